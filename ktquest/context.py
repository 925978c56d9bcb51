"""The context an engine reserves, and what it says about it: ``max_seq_len: 0`` is the model's trained context
when the config's KV cache holds it in memory, else the longest halving of it that fits (a one-line note says
why, and names a preset that would hold more); a context past the trained one gets a one-line warning."""

from __future__ import annotations

import torch

from ktquest.config import Config, ConfigError, load_config
from ktquest.config_file import PRESETS
from ktquest.kv import memory
from ktquest.kv.sliding import global_args
from ktquest.models.args import ModelArgs

MIN_DEFAULT_CONTEXT = 256  # halving stops here; the engine's fit check then refuses it with the figure


def choose_context(config: Config, args: ModelArgs, device: torch.device,
                   dtype: torch.dtype) -> tuple[int, str | None]:
    """``(max_seq_len, note)``: ``config.max_seq_len`` when set (note None; the engine's fit check decides);
    for 0 the trained context when ``config.mode``'s cache of it fits (note None), else the largest
    ``trained / 2**k`` that fits and a note saying so, e.g. "context 131,072 tokens (the model's trained
    1,048,576 would need 41.20 GiB of RAM in dense mode and 30.00 GiB is available; --config million
    holds it)". ``ConfigError`` for a kv_type the model cannot use (``kv.memory.check_kv_type``)."""
    if config.max_seq_len:
        return config.max_seq_len, None
    trained = args.context_length
    g = global_args(args)
    if config.mode == "long_context":
        memory.check_kv_type(config.long_context, g.head_dim)  # (the store's bytes need it)
    have = _have(config, device)
    n = _largest_fit(config, g, trained, dtype, have)
    if n == trained:
        return n, None
    need = _need(config, g, trained, dtype)
    needs = f"would need {_gib(need)} {_where(config, device)}" if need is not None else "is past the store's layout"
    note = (f"context {n:,} tokens (the model's trained {trained:,} {needs} in {config.mode} mode and "
            f"{_gib(have)} is available")
    better = _preset_holding_more(config, g, n, trained, device, dtype)
    return n, note + (f"; {better})" if better else ")")


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


def _have(config: Config, device: torch.device) -> int:
    """The bytes the fit check compares with: RAM for the store, the device's memory for a dense cache."""
    if config.mode == "long_context":
        return memory.available_ram()
    return memory.available_memory(torch.device(device))[0]


def _largest_fit(config: Config, g: ModelArgs, trained: int, dtype: torch.dtype, have: int) -> int:
    """``trained``, halved until its cache fits in ``have`` bytes (not below ``MIN_DEFAULT_CONTEXT``)."""
    n = trained
    while n > MIN_DEFAULT_CONTEXT:
        need = _need(config, g, n, dtype)
        if need is not None and need <= have:
            return n
        n = max(n // 2, MIN_DEFAULT_CONTEXT)
    return n


def _where(config: Config, device: torch.device) -> str:
    device = torch.device(device)
    return "of RAM" if config.mode == "long_context" or device.type != "cuda" else f"on {device}"


def _preset_holding_more(config: Config, g: ModelArgs, n: int, trained: int, device: torch.device,
                         dtype: torch.dtype) -> str | None:
    """"--config NAME holds it" for the long_context preset whose store holds the most of the trained context
    (all of it: "it"), when that is more than ``n``; None when no preset would."""
    best: tuple[int, str] | None = None
    for path in sorted(PRESETS.glob("*.yaml")):
        try:
            cfg = load_config(path)
        except ConfigError:
            continue
        if cfg.mode != "long_context" or path.name == "default.yaml":
            continue
        try:
            memory.check_kv_type(cfg.long_context, g.head_dim)
        except ConfigError:
            continue
        m = _largest_fit(cfg, g, trained, dtype, _have(cfg, device))
        need = _need(cfg, g, m, dtype)
        if need is not None and need <= _have(cfg, device) and (best is None or m > best[0]):
            best = (m, path.stem)
    if best is None or best[0] <= n:
        return None
    m, name = best
    return f"--config {name} holds it" if m == trained else f"--config {name} holds {m:,} tokens"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
