"""GGUF models from the Hugging Face Hub: ``ktquest pull REPO[:QUANT]`` downloads one into the hub's cache,
``--model REPO[:QUANT]`` finds it there without the network, ``ktquest list`` shows what is there
(``ktquest.catalog``).

A reference names a repository and, after a colon, a quantization (``Q4_K_M``, any case, matched against the
repository's GGUF file names) or a file (``model-Q8_0.gguf``); with neither, the repository holds one model.
Files go to huggingface_hub's cache (``HF_HOME`` / ``HF_HUB_CACHE``), which resumes a download cut off during
the call and checks each file's size; every file of one pull is of the commit the hub's file list was of. A
file's sha256 is checked against the hub's (an LFS file's ETag, its blob's name) before it is first used, and
the check is recorded, so one stopped while hashing is checked again. A split model
(``name-00001-of-00003.gguf``) is downloaded part by part and joined into one file (``formats/gguf_split.py``)
under ``ktquest_cache()/joined`` (``$XDG_CACHE_HOME/ktquest``, default ``~/.cache/ktquest``), in a folder
named by its parts' hashes: ktquest maps one file per model, so the parts and the joined file take the model's
size twice on disk. ``--model`` searches every cached snapshot of the repository, ``main``'s first.

``HF_ENDPOINT`` is read at each call (huggingface_hub reads its other settings, ``HF_HUB_OFFLINE`` and the
cache's folder, once when it is imported: ``huggingface_hub.constants``). Offline, ``pull`` makes no request.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download
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


def ktquest_cache() -> Path:
    """ktquest's own cache folder, ``$XDG_CACHE_HOME/ktquest`` (default ``~/.cache/ktquest``): the split
    models it joined (``joined/``) and a record of each downloaded file whose sha256 it checked
    (``verified/``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ktquest"


def joined_path(repo: str, parts: list[Path]) -> Path:
    """Where the split model ``parts`` (its cached files, in order) of ``repo`` is joined: named after the
    model, in a folder named by its parts' blobs (their hashes), so an upstream commit that leaves the parts
    as they were does not join them twice."""
    first = Path(parts[0]).name
    stem = split_part(first)
    name = f"{stem[0]}.gguf" if stem else first
    blobs = "\n".join(Path(os.path.realpath(p)).name for p in parts)
    key = hashlib.sha256(blobs.encode()).hexdigest()[:32]
    return ktquest_cache() / "joined" / repo_folder_name(repo_id=repo, repo_type="model") / key / name


def _snapshots(repo: str) -> list[Path]:
    """The folders of ``repo``'s cached snapshots: the one ``main`` pointed at when it was last downloaded
    first, then the others, newest first."""
    folder = hub_cache() / repo_folder_name(repo_id=repo, repo_type="model")
    try:
        main = (folder / "refs" / REVISION).read_text().strip()
    except OSError:
        main = None
    try:
        found = [p for p in (folder / "snapshots").iterdir() if p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: (p.name != main, -_mtime(p)))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def resolve_cached(ref: ModelRef) -> Path | None:
    """The GGUF file of ``ref`` from the local cache only (no network): the file, or a split model's joined
    file (joined now if every part is cached); None when it is not cached. Every cached snapshot of the
    repository is searched, ``main``'s first, so a file pulled before an upstream commit is still found. A
    file whose sha256 was never checked (a pull stopped while hashing) is checked now, once (``HubError``
    when it is wrong: the file is deleted and the message says to pull it again). ``HubError`` when the
    cached files of a snapshot hold several models that match (the message lists them)."""
    for snapshot in _snapshots(ref.repo):
        files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
        if not _match(ref, gguf_models(files)):
            continue  # not downloaded at this commit (other files of the repository may be)
        names = choose(ref, files)  # (HubError when several match)
        for name in names:
            verify(ref, name, snapshot / name)
        return _joined(ref.repo, [snapshot / name for name in names])
    return None


def _joined(repo: str, paths: list[Path]) -> Path:
    """A model's one file: ``paths[0]``, or a split model's parts joined (``gguf_split.join_split``, which
    keeps a whole join done before)."""
    return paths[0] if len(paths) == 1 else join_split(paths, joined_path(repo, paths))


def require_cached(ref: ModelRef) -> Path:
    """``resolve_cached``'s file, else ``ModelNotCached`` whose message says to run ``ktquest pull``."""
    path = resolve_cached(ref)
    if path is None:
        raise ModelNotCached(pull_hint(ref))
    return path


# ---- checksums ----


def verify(ref: ModelRef, name: str, path: Path) -> None:
    """Check the cached file ``path`` (``name`` in ``ref``'s repository) against the sha256 the hub gave it
    (its blob's name), unless that was done: a record ``verified/<sha256>`` in ``ktquest_cache()``, written
    once the hash matched, holding the blob's size and mtime (a blob downloaded again is checked again). A
    git (not LFS) file, whose blob is named by a git hash, had only its size checked. ``HubError`` when the
    hash is wrong: the blob and its link are deleted."""
    blob = path.resolve()
    if not SHA256.match(blob.name) or _is_verified(blob):
        return
    digest = hashlib.sha256()
    try:
        with open(blob, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    except OSError as e:
        raise HubError(f"{ref.repo}: {name} ({blob}) cannot be read: {e.strerror or e}") from None
    if digest.hexdigest() != blob.name:
        blob.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise HubError(f"{ref.repo}: {name} was downloaded with sha256 {digest.hexdigest()}, and the hub "
                       f"says {blob.name}; the file was deleted, run ktquest pull {ref} again")
    try:
        marker = _marker(blob)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(_stamp(blob))
    except OSError:
        pass  # (checked now; without the record it is checked again next time)


def _marker(blob: Path) -> Path:
    return ktquest_cache() / "verified" / blob.name


def _stamp(blob: Path) -> str:
    """What a verified blob's record holds: its size and mtime (a torn record matches nothing)."""
    st = blob.stat()
    return f"{st.st_size} {st.st_mtime_ns}\n"


def _is_verified(blob: Path) -> bool:
    try:
        return _marker(blob).read_text() == _stamp(blob)
    except OSError:
        return False


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
    commit = info.sha or REVISION  # every file at the commit the list is of
    names = choose(ref, [s.rfilename for s in info.siblings or []])
    paths = [_download(ref, name, commit, progress) for name in names]
    if info.sha:
        _record_main(ref.repo, info.sha)
    return _joined(ref.repo, paths)


def _download(ref: ModelRef, name: str, commit: str, progress: bool) -> Path:
    """One file at ``commit`` into the cache (none if it is there), its sha256 checked (``verify``)."""
    try:
        path = Path(hf_hub_download(ref.repo, name, revision=commit, cache_dir=hub_cache(),
                                    endpoint=endpoint(), tqdm_class=None if progress else _Silent))
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{ref.repo}: downloading {name} failed: {_line(e)}") from None
    verify(ref, name, path)
    return path


def _record_main(repo: str, commit: str) -> None:
    """Note in the hub's cache that ``main`` is at ``commit`` (as a download of ``main`` does; a download at a
    commit does not)."""
    ref = hub_cache() / repo_folder_name(repo_id=repo, repo_type="model") / "refs" / REVISION
    try:
        if ref.is_file() and ref.read_text().strip() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{REVISION}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError:
        pass  # (only the order snapshots are searched in)


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def resolve_model(model: str | os.PathLike) -> Path:
    """The GGUF file ``model`` names: a path or a bundled model's name (``formats.bundled.resolve_model``), or
    a repository's ``OWNER/NAME[:QUANT|:FILE]`` from the local hub cache, never the network
    (``ModelNotCached`` names the ``ktquest pull`` to run; for a bare ``A/B``, maybe a mistyped path, it says
    there is no such file too)."""
    text = os.fspath(model)
    ref = parse_ref(text)
    if ref is None:
        return bundled.resolve_model(model)
    path = resolve_cached(ref)
    if path is None:
        if ref.quant is None and ref.file is None:
            raise ModelNotCached(f"no such file {text}, and OWNER/NAME {ref} is not downloaded; "
                                 f"download it with: ktquest pull {ref}")
        raise ModelNotCached(pull_hint(ref))
    return path
