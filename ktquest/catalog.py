"""The models this machine has, for ``ktquest list``: the bundled ones that are installed and every GGUF model
in the Hugging Face hub's cache, each described from its GGUF header alone (no tensor is read), with whether
this machine's RAM holds it at its trained context in dense and in long_context (the snapkv preset) mode."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import gguf
import torch
from huggingface_hub import scan_cache_dir
from huggingface_hub.utils import CacheNotFound

from ktquest import hub
from ktquest.config import Config, ConfigError, load_config
from ktquest.config_file import find_config
from ktquest.formats import gguf_split
from ktquest.formats.bundled import BUNDLED_MODELS, BundledModelNotFound
from ktquest.formats.errors import GGUFError
from ktquest.formats.gguf import open_gguf
from ktquest.kv import memory
from ktquest.kv.sliding import global_args
from ktquest.models.args import ModelArgs, model_args
from ktquest.models.loader import FAMILIES

Mode = Literal["dense", "long_context"]
LONG_CONTEXT_PRESET = "snapkv"  # the preset whose long_context settings ``fits`` counts by default


@dataclass(slots=True)
class ModelInfo:
    """What a GGUF file's header says about its model. ``args`` None (and ``error`` the reason) when ktquest
    cannot run it (an architecture it does not know, a corrupt header)."""

    path: Path
    file_size: int  # bytes
    arch: str | None
    file_type: str | None  # the quantization the file says it holds: "Q4_K_M", "F16", ...
    args: ModelArgs | None
    error: str | None = None

    @property
    def n_params(self) -> int | None:
        return None if self.args is None else self.args.n_params

    @property
    def context_length(self) -> int | None:
        """The trained context, tokens."""
        return None if self.args is None else self.args.context_length


@dataclass(slots=True)
class CachedModel:
    """A model of ``ktquest list``; ``name`` is what ``--model`` takes: a bundled name, ``REPO:FILE.gguf``."""

    name: str
    source: Literal["bundled", "hub"]
    info: ModelInfo
    fits_dense: bool | None = None  # None: not known (the model cannot be read, no preset)
    fits_long_context: bool | None = None
    notes: list[str] = field(default_factory=list)


def read_info(path: str | os.PathLike) -> ModelInfo:
    """The model of the GGUF file ``path`` from its header. ``GGUFError`` if it is not a GGUF file."""
    f = open_gguf(path)
    arch = f.metadata.get("general.architecture")
    ftype = f.metadata.get("general.file_type")
    try:
        file_type = gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_") if ftype is not None else None
    except ValueError:
        file_type = f"file_type {ftype}"
    try:
        args, error = model_args(f, FAMILIES), None
    except GGUFError as e:
        args, error = None, str(e)
    return ModelInfo(Path(path), Path(path).stat().st_size, arch, file_type, args, error)


def fits(info: ModelInfo, mode: Mode, config: Config | None = None) -> bool | None:
    """Whether this machine's available RAM holds the model at its trained context on the CPU: the mapped file
    (its weights), a hybrid's DeltaNet states with their checkpoints, and, in ``dense`` mode, the fp32 KV cache
    of every global layer
    (``memory.dense_bytes``); in ``long_context`` mode, ``config``'s (default: the snapkv preset's) KV store
    with its huge-page rounding and the prefill's workspace (``memory.check_store_fits``' sum). None when it
    cannot be told: the model cannot be read, or ``long_context`` without a config and no snapkv preset. A
    store the layout refuses, or a kv_type the model's head_dim does not allow, is False. The same estimates
    the engine checks before it allocates; the OS and other processes may still leave less."""
    if info.args is None:
        return None
    args, ctx = global_args(info.args), info.args.context_length
    if mode == "dense":
        need = memory.dense_bytes(args.n_layers, args.n_kv_heads, args.head_dim, ctx, torch.float32)
    else:
        if config is None:
            try:
                config = load_config(find_config(LONG_CONTEXT_PRESET))
            except ConfigError:  # (no such preset)
                return None
        lc, dims = config.long_context, (args.n_layers, args.n_kv_heads, args.head_dim, ctx)
        try:
            memory.check_kv_type(lc, args.head_dim)
            store = memory.store_bytes(lc, *dims) + memory.candidate_copy_bytes(lc, *dims)
        except (ConfigError, ValueError, OverflowError):
            return False
        need = (store + memory.HUGE_PAGE * memory.store_regions(lc, args.n_layers)
                + memory.prefill_workspace_bytes(lc, args, ctx, config.chunk_size,
                                                 memory.layer_major_tokens(config, ctx)))
    # a hybrid's DeltaNet states, live and checkpointed (kv/recurrent.py), as the engine counts them
    states = memory.recurrent_state_bytes(info.args) * (1 + (config or Config()).state_checkpoints)
    return info.file_size + need + states <= memory.available_ram()


def cached_models(config: Config | None = None) -> list[CachedModel]:
    """The installed bundled models, then every GGUF model in the hub's cache (a split model once: its joined
    file if ``pull`` joined it, else its first part, noted, with every part's size), each with ``fits`` in
    both modes (``config``: the long_context settings, default the snapkv preset). Nothing is downloaded or
    assembled."""
    out = []
    for b in BUNDLED_MODELS.values():
        try:
            there = b.cache_dir is None or (Path.home() / ".cache" / b.cache_dir / b.file).is_file()
            path = b.path() if there else None  # (never assembled here)
        except BundledModelNotFound:
            path = None
        if path is not None:
            out.append(_entry(b.name, "bundled", path, config))
    for name, path, notes, size in _hub_files():
        out.append(_entry(name, "hub", path, config, notes, size))
    return out


def _entry(name: str, source: str, path: Path, config: Config | None, notes: list[str] | None = None,
           size: int | None = None) -> CachedModel:
    """``ktquest list``'s line of the model in ``path``; ``size``: its bytes when not ``path``'s (a split
    model not joined yet: every part's, which is what it maps once joined)."""
    try:
        info = read_info(path)
    except (GGUFError, OSError) as e:
        info = ModelInfo(path, path.stat().st_size if path.is_file() else 0, None, None, None, str(e))
    if size is not None:
        info.file_size = size
    return CachedModel(name, source, info, fits(info, "dense", config), fits(info, "long_context", config),
                       notes or [])


def _hub_files() -> list[tuple[str, Path, list[str], int | None]]:
    """(``REPO:QUANT`` or ``REPO:FILE``, path, notes, size) of every GGUF model in the hub's cache: each repository's models at
    the revision ``main`` is at, then those only older cached revisions hold (``--model`` finds them too),
    newest first. ``size`` is None but for a split model not joined yet: the sum of its parts'."""
    try:
        cache = scan_cache_dir(hub.hub_cache())
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        seen: set[str] = set()
        for rev in sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True):
            files = {f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files}
            models = hub.gguf_models(sorted(files))
            for first, parts in models.items():
                if first not in seen:
                    seen.add(first)
                    model = _hub_model(repo.repo_id, rev.snapshot_path, parts)
                    found.append((f"{repo.repo_id}:{_pick(first, models)}", *model))
    return found


def _pick(first: str, models: dict[str, list[str]]) -> str:
    """What follows ``REPO:`` to name the model ``first`` as ``--model`` takes it: its quantization where no
    other model of the revision has it, else its file."""
    quant = hub.quant_of(first)
    return quant if quant and [hub.quant_of(m) for m in models].count(quant) == 1 else first


def _hub_model(repo: str, snapshot: Path, parts: list[str]) -> tuple[Path, list[str], int | None]:
    """(path, notes, size) of the cached model ``parts`` of ``repo``: its file, a split model's joined file,
    or the first part of one not joined yet (noted, with every part's size)."""
    paths = [snapshot / p for p in parts]
    if len(paths) == 1:
        return paths[0], [], None
    joined = hub.joined_path(repo, paths)
    if gguf_split.is_joined(paths, joined):
        return joined, [], None
    size = sum(p.stat().st_size for p in paths if p.is_file())
    return paths[0], [f"split in {len(parts)} parts, not joined yet: ktquest pull {repo}:{parts[0]} joins "
                      f"them"], size
