"""The context an engine reserves, and what it says about it: ``max_seq_len: 0`` is the model's trained context
when the config's KV cache holds it in memory beside the weights, else the longest context that fits, to
``CONTEXT_STEP`` tokens (a one-line note says why, and names a preset that would hold more); a context past the
trained one gets a one-line warning."""

from __future__ import annotations

import torch

from ktquest.config import Config, ConfigError, load_config
from ktquest.config_file import PRESETS
from ktquest.kv import memory
from ktquest.kv.sliding import global_args
from ktquest.models.args import ModelArgs

MIN_DEFAULT_CONTEXT = 256  # the search stops here; the engine's fit check then refuses it with the figure
CONTEXT_STEP = 1024  # a default context below the trained one is a multiple of this
# The presets a note names first when several hold as much (the README's order: the common choice first)
PRESET_ORDER = ("snapkv", "quest", "million")


def choose_context(config: Config, args: ModelArgs, device: torch.device, dtype: torch.dtype,
                   weights_bytes: int = 0) -> tuple[int, str | None]:
    """``(max_seq_len, note)``: ``config.max_seq_len`` when set (note None; the engine's fit check decides);
    for 0 the trained context when ``config.mode``'s cache of it fits beside the weights (``weights_bytes``, the
    model file's size: on the CPU they share the RAM), note None; else the largest multiple of CONTEXT_STEP that
    fits and a note saying so, e.g. "context 131,072 tokens (the model's trained 1,048,576 would need 41.20 GiB
    of RAM in dense mode and 30.00 GiB is available; --config million holds it)". ``ConfigError`` for a kv_type
    the model cannot use (``kv.memory.check_kv_type``)."""
    if config.max_seq_len:
        return config.max_seq_len, None
    trained = args.context_length
    g = global_args(args)
    if config.mode == "long_context":
        memory.check_kv_type(config.long_context, g.head_dim)  # (the store's bytes need it)
    have = _have(config, device, weights_bytes)
    n = _largest_fit(config, g, trained, dtype, have)
    if n == trained:
        return n, None
    need = _need(config, g, trained, dtype)
    needs = f"would need {_gib(need)} {_where(config, device)}" if need is not None else "is past the store's layout"
    beside = " beside the weights" if weights_bytes and torch.device(device).type == "cpu" else ""
    note = (f"context {n:,} tokens (the model's trained {trained:,} {needs} in {config.mode} mode and "
            f"{_gib(have)} is available{beside}")
    better = _preset_holding_more(g, n, trained, device, dtype, weights_bytes)
    return n, note + (f"; {better})" if better else ")")


def preset_context(config: Config, args: ModelArgs, device: torch.device, dtype: torch.dtype,
                   weights_bytes: int = 0) -> int | None:
    """The context ``config`` (a preset) gives this model on this machine: its own max_seq_len where that fits,
    else (for 0) the one ``choose_context`` picks; None where it holds none (its max_seq_len does not fit, or a
    kv_type the model cannot take)."""
    try:
        n = choose_context(config, args, device, dtype, weights_bytes)[0]
        if config.mode == "long_context":
            memory.check_kv_type(config.long_context, args.head_dim)
    except ConfigError:
        return None
    need = _need(config, global_args(args), n, dtype)
    return n if need is not None and need <= _have(config, device, weights_bytes) else None


def presets_by_preference() -> list:
    """The packaged presets' paths, ``PRESET_ORDER``'s first, ``default.yaml`` (every key at its default) left
    out."""
    paths = [p for p in sorted(PRESETS.glob("*.yaml")) if p.name != "default.yaml"]
    rank = {name: i for i, name in enumerate(PRESET_ORDER)}
    return sorted(paths, key=lambda p: rank.get(p.stem, len(rank)))


def context_warning(args: ModelArgs, max_seq_len: int) -> str | None:
    """One line when ``max_seq_len`` is past the model's trained context (``args.context_length``), naming it
    and the RoPE scaling ``args`` carries (the GGUF's, or the config's dynamic NTK); None within it."""
    trained, s = args.context_length, args.rope_scaling
    if max_seq_len <= trained:
        return None
    head = f"context {max_seq_len:,} tokens is past the {trained:,} the model was trained on"
    if s is None:
        return f"{head}: text past {trained:,} tokens may be meaningless"
    if s.type == "dynamic":
        return (f"{head}; the config's dynamic NTK RoPE scaling (factor {s.factor:g}) stretches positions past "
                f"it, and text there may still degrade")
    original = s.original_context_length or trained
    scaling = f"{s.type} RoPE scaling" + (f", factor {s.factor:g}" if s.factor != 1 else "")
    scaling += f", original context {original:,}"
    reach = int(original * s.factor) if s.type in ("linear", "yarn") and s.factor > 1 else 0
    if reach >= max_seq_len:
        return f"{head}; its GGUF's {scaling} is meant to reach {reach:,} tokens"
    if reach:
        return f"{head}; its GGUF's {scaling} is meant to reach {reach:,}: text past it may be meaningless"
    return f"{head} (its GGUF's {scaling}): text past {trained:,} tokens may be meaningless"


# ---- internals ----


def _need(config: Config, g: ModelArgs, n: int, dtype: torch.dtype) -> int | None:
    """The bytes ``config.mode``'s fit check counts for ``n`` tokens; None where the store's layout refuses n."""
    if config.mode != "long_context":
        return memory.dense_bytes(g.n_layers, g.n_kv_heads, g.head_dim, n, dtype)
    try:
        store, more = memory.store_need_bytes(config.long_context, g, n, config.chunk_size,
                                              memory.layer_major_tokens(config, n))
    except (ValueError, OverflowError):
        return None
    return store + more


def _have(config: Config, device: torch.device, weights_bytes: int = 0) -> int:
    """The bytes the fit check compares with: RAM for the store, the device's memory for a dense cache; on the
    CPU the weights (``weights_bytes``) take their share of the RAM first."""
    device = torch.device(device)
    have = memory.available_ram() if config.mode == "long_context" else memory.available_memory(device)[0]
    return max(0, have - weights_bytes) if device.type == "cpu" else have


def _largest_fit(config: Config, g: ModelArgs, trained: int, dtype: torch.dtype, have: int) -> int:
    """``trained`` when its cache fits in ``have`` bytes, else the largest multiple of ``CONTEXT_STEP`` below it
    that does (halvings first, then a binary search between the last two), not below ``MIN_DEFAULT_CONTEXT``."""
    def fits(n: int) -> bool:
        need = _need(config, g, n, dtype)
        return need is not None and need <= have

    hi, n = trained, trained
    while n > MIN_DEFAULT_CONTEXT and not fits(n):
        hi, n = n, max(n // 2, MIN_DEFAULT_CONTEXT)
    if n == trained or not fits(n):
        return n
    lo, hi = n // CONTEXT_STEP, (hi - 1) // CONTEXT_STEP  # in steps: lo fits (or is 0), hi * STEP < the failure
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * CONTEXT_STEP) else (lo, mid - 1)
    return max(n, lo * CONTEXT_STEP)


def _where(config: Config, device: torch.device) -> str:
    device = torch.device(device)
    return "of RAM" if config.mode == "long_context" or device.type != "cuda" else f"on {device}"


def _preset_holding_more(g: ModelArgs, n: int, trained: int, device: torch.device, dtype: torch.dtype,
                         weights_bytes: int) -> str | None:
    """"--config NAME holds it" for the long_context preset that holds the most of the trained context here
    (all of it: "it"; ``PRESET_ORDER`` first on a tie), when that is more than ``n``; with "-c N" where the
    preset's own max_seq_len is not what holds it. None when no preset would hold more."""
    best: tuple[int, str, int] | None = None
    for path in presets_by_preference():
        try:
            cfg = load_config(path)
            if cfg.mode != "long_context":
                continue
            memory.check_kv_type(cfg.long_context, g.head_dim)
        except ConfigError:
            continue
        have = _have(cfg, device, weights_bytes)
        m = _largest_fit(cfg, g, trained, dtype, have)
        need = _need(cfg, g, m, dtype)
        if need is not None and need <= have and (best is None or m > best[0]):
            best = (m, path.stem, cfg.max_seq_len)
    if best is None or best[0] <= n:
        return None
    m, name, own = best
    flag = f"--config {name}" + (f" -c {m}" if own and own != m else "")
    return f"{flag} holds it" if m == trained else f"{flag} holds {m:,} tokens"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_parallel_fits(config: Config, args: ModelArgs, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                        n: int, weights_bytes: int = 0) -> None:
    """ConfigError (with the figures) unless ``n`` KV caches of ``max_seq_len`` tokens fit where they live beside
    the weights (``weights_bytes``, on the CPU): the server's parallel slots, each running reply with a cache of
    its own, filled as far as its context."""
    g = global_args(args)
    one = _need(config, g, max_seq_len, dtype)
    have = _have(config, device, weights_bytes)
    if one is not None and n * one > have:
        raise ConfigError(f"--parallel {n}: {n} KV caches of {max_seq_len:,} tokens need {_gib(n * one)} "
                          f"{_where(config, device)}, {_gib(have)} is available: lower --parallel or the context "
                          f"(-c), or use a long_context preset (--config snapkv)")
