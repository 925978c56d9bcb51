"""GGUF models from the Hugging Face Hub: ``ktquest pull REPO[:QUANT]`` downloads one into the hub's cache,
``--model REPO[:QUANT]`` finds it there without the network, ``ktquest list`` shows what is there
(``ktquest.catalog``).

A reference names a repository and, after a colon, a quantization (``Q4_K_M``, any case, matched against the
repository's GGUF file names) or a file (``model-Q8_0.gguf``); with neither, the repository holds one model.
Files go to huggingface_hub's cache (``HF_HOME`` / ``HF_HUB_CACHE``), which resumes a download cut off during
the call and checks each file's size; ``pull`` checks a new file's sha256 against the hub's (an LFS file's
ETag) too. A split model (``name-00001-of-00003.gguf``) is downloaded part by part and joined into one file
(``formats/gguf_split.py``) under ``<HF_HUB_CACHE>/../ktquest-joined``: ktquest maps one file per model, so
the parts and the joined file take the model's size twice on disk.

``HF_ENDPOINT`` is read at each call (huggingface_hub reads its other settings, ``HF_HUB_OFFLINE`` and the
cache's folder, once when it is imported: ``huggingface_hub.constants``). Offline, ``pull`` makes no request.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import tqdm as hf_tqdm

from ktquest.formats import bundled
from ktquest.formats.bundled import BUNDLED_MODELS
from ktquest.formats.errors import GGUFError
from ktquest.formats.gguf_split import join_split, split_part

REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<pick>.*))?$")
QUANT = re.compile(r"^[A-Za-z0-9_]+$")
# A quantization's name among a file name's "-"/"." separated words: Q4_K_M, IQ2_XXS, Q8_0, BF16, MXFP4, ...
QUANT_WORD = re.compile(r"^(?:U?I?Q\d\w*|TQ\d_\d|MXFP4\w*|B?F16|F32)$", re.IGNORECASE)
SHA256 = re.compile(r"^[0-9a-f]{64}$")
REVISION = "main"


class HubError(GGUFError):
    """A model that cannot be had from the hub: no such repository, no GGUF file matching the reference (the
    message lists the quantizations there), a download that failed or whose checksum is wrong. A ``GGUFError``
    as every model that cannot be loaded."""


class ModelNotCached(HubError, FileNotFoundError):
    """A hub model that is not in the local cache; the message has the ``ktquest pull`` command."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    """``REPO``, ``REPO:QUANT`` or ``REPO:FILE.gguf``: a GGUF model of a hub repository."""

    repo: str  # owner/name
    quant: str | None = None  # upper-case, e.g. "Q4_K_M"
    file: str | None = None  # a GGUF file's path in the repository

    def __str__(self) -> str:
        pick = self.file or self.quant
        return f"{self.repo}:{pick}" if pick else self.repo


def parse_ref(text: str | os.PathLike) -> ModelRef | None:
    """The hub model ``text`` names, or None for a local path (one that exists, or any name ending in .gguf
    without a colon) or a bundled model's name. ``ValueError`` for ``REPO:`` with nothing or a bad
    quantization after the colon."""
    text = os.fspath(text)
    if text in BUNDLED_MODELS or (text.lower().endswith(".gguf") and ":" not in text):
        return None
    try:
        if Path(text).exists():
            return None
    except OSError:
        return None
    m = REPO.match(text)
    if m is None:
        return None
    pick = m["pick"]
    if pick is None:
        return ModelRef(m["repo"])
    if pick.lower().endswith(".gguf"):
        return ModelRef(m["repo"], file=pick)
    if not QUANT.match(pick):
        raise ValueError(f"model {text!r}: expected REPO, REPO:QUANT (e.g. {m['repo']}:Q4_K_M) or "
                         f"REPO:FILE.gguf after the colon, got {pick!r}")
    return ModelRef(m["repo"], quant=pick.upper())


def pull_hint(ref: ModelRef) -> str:
    """The message of a hub model that is not cached: what to run to download it."""
    return f"the model {ref} is not downloaded; download it with: ktquest pull {ref}"


# ---- choosing a file ----


def quant_of(name: str) -> str | None:
    """The quantization a GGUF file's name carries (its last word that looks like one), upper-case."""
    base = name.rsplit("/", 1)[-1]
    split = split_part(base)
    stem = split[0] if split else base.removesuffix(".gguf").removesuffix(".GGUF")
    words = [w for w in re.split(r"[-.]", stem) if QUANT_WORD.match(w)]
    return words[-1].upper() if words else None


def gguf_models(files: list[str]) -> dict[str, list[str]]:
    """A repository's GGUF models (``files``: its paths): the first file's name -> its files (one, or every
    part of a split model in order). Projectors (``mmproj*``) are not models; a split model missing a part
    is left out."""
    groups: dict[tuple[str, str, int], dict[int, str]] = {}
    for f in files:
        base = f.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        split = split_part(base)
        stem, no, count = split if split else (base, 1, 1)
        groups.setdefault((f[: len(f) - len(base)] + stem, base if not split else "", count), {})[no] = f
    return {parts[1]: [parts[i] for i in range(1, count + 1)]
            for (_, _, count), parts in sorted(groups.items()) if len(parts) == count}


def choose(ref: ModelRef, files: list[str]) -> list[str]:
    """The files of the model ``ref`` names among a repository's ``files``: one, or a split model's parts in
    order. ``HubError`` listing the quantizations (and files) there when none or several match."""
    models = gguf_models(files)
    hit = _match(ref, models)
    if len(hit) == 1:
        return hit[0]
    listing = ", ".join(f"{quant_of(first) or '?'} ({first}{f' in {len(p)} parts' if len(p) > 1 else ''})"
                        for first, p in models.items()) or "none"
    if not hit:
        what = f"no GGUF file {ref.file!r}" if ref.file else f"no {ref.quant} GGUF file" if ref.quant \
            else "no GGUF file"
        raise HubError(f"{ref.repo}: {what}; the GGUF models there: {listing}")
    quants = sorted({q for q in map(quant_of, models) if q})
    raise HubError(f"{ref}: {len(hit)} GGUF models match; name one with REPO:QUANT "
                   f"({', '.join(f'{ref.repo}:{q}' for q in quants) or 'REPO:FILE.gguf'}) or REPO:FILE.gguf; "
                   f"the GGUF models there: {listing}")


def _match(ref: ModelRef, models: dict[str, list[str]]) -> list[list[str]]:
    if ref.file is not None:
        return [parts for first, parts in models.items() if ref.file in (first, first.rsplit("/", 1)[-1])]
    if ref.quant is not None:
        return [parts for first, parts in models.items() if quant_of(first) == ref.quant]
    return list(models.values())


# ---- the cache ----


def endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT`` as it is now, else huggingface_hub's."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache() -> Path:
    """huggingface_hub's cache folder (``HF_HUB_CACHE``)."""
    return Path(constants.HF_HUB_CACHE)


def joined_path(repo: str, commit: str, first: str) -> Path:
    """Where a split model (whose first part is ``first``) of ``repo`` at ``commit`` is joined."""
    stem = split_part(first.rsplit("/", 1)[-1])
    name = f"{stem[0]}.gguf" if stem else first.rsplit("/", 1)[-1]
    folder = repo_folder_name(repo_id=repo, repo_type="model")
    return hub_cache().parent / "ktquest-joined" / folder / commit / name


def _cached_snapshot(repo: str) -> tuple[str, Path] | None:
    """The commit ``main`` pointed at when ``repo`` was last downloaded, and its snapshot's folder."""
    folder = hub_cache() / repo_folder_name(repo_id=repo, repo_type="model")
    try:
        commit = (folder / "refs" / REVISION).read_text().strip()
    except OSError:
        return None
    snapshot = folder / "snapshots" / commit
    return (commit, snapshot) if snapshot.is_dir() else None


def resolve_cached(ref: ModelRef) -> Path | None:
    """The GGUF file of ``ref`` from the local cache only (no network): the file, or a split model's joined
    file (joined now if every part is cached); None when it is not cached. ``HubError`` when the cached files
    hold several models that match (the message lists them)."""
    found = _cached_snapshot(ref.repo)
    if found is None:
        return None
    commit, snapshot = found
    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    if not _match(ref, gguf_models(files)):
        return None  # not downloaded (other files of the repository may be)
    parts = choose(ref, files)  # (HubError when several match)
    if len(parts) == 1:
        return snapshot / parts[0]
    joined = joined_path(ref.repo, commit, parts[0])
    return joined if joined.is_file() else join_split([snapshot / p for p in parts], joined)


def require_cached(ref: ModelRef) -> Path:
    """``resolve_cached``'s file, else ``ModelNotCached`` whose message says to run ``ktquest pull``."""
    path = resolve_cached(ref)
    if path is None:
        raise ModelNotCached(pull_hint(ref))
    return path


# ---- downloading ----


class _Silent(hf_tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def pull(ref: ModelRef, progress: bool = True) -> Path:
    """Download the GGUF model ``ref`` names into the hub's cache (the parts it already holds are kept) and
    return its file (a split model's joined file). Offline (``HF_HUB_OFFLINE``): the cached file with no
    request, else ``ModelNotCached``. ``HubError`` for no such repository, no matching file (the message lists
    the quantizations there), a failed download, or a file whose sha256 is not the hub's (it is deleted)."""
    if constants.is_offline_mode():
        path = resolve_cached(ref)
        if path is None:
            raise ModelNotCached(f"{pull_hint(ref)} (HF_HUB_OFFLINE is set: nothing is downloaded offline)")
        return path
    api = HfApi(endpoint=endpoint())
    try:
        info = api.model_info(ref.repo, revision=REVISION)
    except RepositoryNotFoundError:
        raise HubError(f"{ref.repo}: no such model repository on {endpoint()} (or it is private or gated: "
                       f"log in with `hf auth login`)") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{ref.repo}: the file list could not be read from {endpoint()}: {_line(e)}") from None
    parts = choose(ref, [s.rfilename for s in info.siblings or []])
    paths = [_download(ref, name, progress) for name in parts]
    if len(paths) == 1:
        return paths[0]
    commit = paths[0].relative_to(hub_cache()).parts[2]  # models--owner--name/snapshots/<commit>/...
    joined = joined_path(ref.repo, commit, parts[0])
    return joined if joined.is_file() else join_split(paths, joined)


def _download(ref: ModelRef, name: str, progress: bool) -> Path:
    """One file into the cache; a file downloaded now has its sha256 checked against the hub's."""
    cached = try_to_load_from_cache(ref.repo, name, cache_dir=hub_cache(), revision=REVISION)
    try:
        path = Path(hf_hub_download(ref.repo, name, revision=REVISION, cache_dir=hub_cache(),
                                    endpoint=endpoint(), tqdm_class=None if progress else _Silent))
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{ref.repo}: downloading {name} failed: {_line(e)}") from None
    if not isinstance(cached, str) or Path(cached) != path:
        _check_sha256(ref, name, path)
    return path


def _check_sha256(ref: ModelRef, name: str, path: Path) -> None:
    blob = path.resolve()
    if not SHA256.match(blob.name):  # a git (not LFS) file: its ETag is a git hash, its size was checked
        return
    digest = hashlib.sha256()
    with open(blob, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != blob.name:
        blob.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise HubError(f"{ref.repo}: {name} was downloaded with sha256 {digest.hexdigest()}, and the hub "
                       f"says {blob.name}; the file was deleted, run ktquest pull {ref} again")


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def resolve_model(model: str | os.PathLike) -> Path:
    """The GGUF file ``model`` names: a path or a bundled model's name (``formats.bundled.resolve_model``), or a
    repository's ``OWNER/NAME[:QUANT|:FILE]`` from the local hub cache, never the network (``ModelNotCached``
    names the ``ktquest pull`` to run)."""
    ref = parse_ref(os.fspath(model))
    return bundled.resolve_model(model) if ref is None else require_cached(ref)
