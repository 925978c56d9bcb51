"""How many bytes a KV cache needs (a long_context store, a dense cache), and the checks that refuse a
``max_seq_len`` whose cache would not fit before anything is allocated."""

from __future__ import annotations

import os

import torch

from ktquest.config import Config, ConfigError, LongContextConfig
from ktquest.native import sizes as native_sizes
from ktquest.native.enums import Q8_GROUP


def store_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Bytes the DRAM store needs when full (K, V, scales, anchors, the index's group bounds): the layout the
    C++ store reserves."""
    return native_sizes.store_bytes(n_layers, n_kv_heads, head_dim, max_seq_len, lc.block_size, lc.kv_type,
                                    lc.anchor_type, lc.anchor_num, lc.index_group)


def candidate_copy_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int,
                         max_seq_len: int) -> int:
    """Bytes of the store's copy of the preselected candidates (their K/V tiles and anchor rows, per layer and
    set of KV heads) at the size it starts with after prefill, with a refresh's picks (``preselect_refresh``:
    up to ``second_select_num`` a set, Ada-KV's budgets too on average); it grows by a block each block_size
    tokens once the room it keeps for later blocks is used."""
    if not lc.preselect_block:
        return 0
    picks = lc.second_select_num if lc.preselect_refresh else 0
    need = min(lc.preselect_block_count + picks, -(-max_seq_len // lc.block_size))
    return native_sizes.candidate_copy_bytes(n_layers, n_kv_heads, head_dim, lc.block_size, lc.kv_type,
                                             lc.anchor_type, lc.int8_candidates, need, lc.head_select_mode)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (else physical memory), bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


HUGE_PAGE = 2 << 20  # the store's regions ask for transparent huge pages (cpp/common/mapped_buffer.cpp)


def store_regions(lc: LongContextConfig, n_layers: int) -> int:
    """How many regions the store maps (each rounded up to a huge page when full): K/V tiles, anchors and
    their counts per layer, BLOCK_MEAN's sums, DYNAMIC's importances and positions, the index's bounds."""
    per_layer = 3 + (lc.anchor_type == "BLOCK_MEAN") + 2 * (lc.anchor_type == "DYNAMIC") + (lc.index_group > 0)
    return per_layer * n_layers


def chunk_activation_bytes(args, tokens: int, elem: int = 4) -> int:
    """A chunk's activations at their peak, ``elem`` bytes a value (the compute dtype): the hidden state in, its
    norm and the residual out, beside the larger of the two phases of a layer:

    - attention: q/k/v and RoPE's temporaries (fp32 at worst); the queries folded by KV head; the chunk's K/V
      repeated to the query heads (its causal part); a kernel's output; four outputs in fp32 while parts merge
      (the union so far, a part, the merged union, its copy in the heads' order) and their LSEs; the output
      in the compute dtype and its projection;
    - a sliding-window layer's attention (gemma3): torch's attention with a mask, whose scores, probabilities
      and mask are [H, T, T + window] (4 + 4 + 4 + 1 bytes an entry at most, the math path's);
    - the FFN: gate, up and their product, and its projection; a mixture of experts (models/ffn.py): the
      router's logits, its fp32 softmax and their sort (weights and int64 ids) [T, E], then one expert at a
      time on its group of tokens (the whole chunk at most): the group's x, gate|up, their product, down's
      output and it weighted, beside the sum [T, dim]; the shared expert's like a gated FFN's.
    """
    dim = getattr(args, "dim", args.n_heads * args.head_dim)
    ffn = getattr(args, "ffn_dim", 4 * dim)
    ffn_phase = max((_ffn_token_bytes(b, dim, ffn, elem) for b in getattr(args, "blocks", ())),
                    default=(3 * ffn + dim) * elem)
    hd, kvd = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attn = (6 * hd + 2 * kvd + dim) * elem + (4 * (hd + args.n_heads) + 2 * (hd + kvd)) * 4
    window = max((b.window for b in getattr(args, "blocks", ())), default=0)  # the widest sliding layer's
    if window:
        attn = max(attn, (4 * hd + 2 * kvd + dim) * elem + args.n_heads * (tokens + window) * 13)
    return tokens * (3 * dim * elem + max(attn, ffn_phase))


def _ffn_token_bytes(block, dim: int, ffn: int, elem: int) -> int:
    """A chunk's FFN activations per token at their peak (``chunk_activation_bytes``)."""
    if block.ffn != "moe":
        return (3 * ffn + dim) * elem
    router = block.n_experts * (elem + 4 + 4 + 8)
    expert = (3 * block.expert_ffn + 4 * dim) * elem
    shared = (3 * block.shared_ffn + dim) * elem if block.shared_expert else 0
    return router + expert + shared


def prompt_token_device_bytes(args) -> int:
    """Device bytes a prompt holds per token of the whole prompt (not of a slab) whatever the order: its id
    (int64, generate.prefill), and an allowance of 8 bytes per query head for what else grew with the
    prompt on an H200 in slab order (32 bytes a token on the 4-head test models; its source is not yet
    identified: docs/perf-log.md, 2026-11-26)."""
    return 8 + 8 * args.n_heads


def layer_major_tokens(config: Config, max_seq_len: int) -> int:
    """Tokens whose hidden states a layer-major prefill holds at once (``prefill.order: layer``): a slab, or
    the longest prompt; 0 in chunk order."""
    p = config.prefill
    return min(p.slab_tokens or max_seq_len, max_seq_len) if p.order == "layer" else 0


# A prompt's text, its token ids (Python ints) and what the tokenizer's work leaves resident, per token: a
# process that tokenized 1,048,576 tokens of stdlib text (tools/common.context_tokens, 6M characters) held
# 0.45 GiB more than before, ~460 bytes a token (2026-11-28; the check counted 64 before).
PROMPT_BYTES_PER_TOKEN = 512


def prefill_workspace_bytes(lc: LongContextConfig, args, max_seq_len: int, chunk_size: int,
                            layer_tokens: int = 0) -> int:
    """RAM a prompt of ``max_seq_len`` tokens needs beside the store: its text and token ids with what the
    tokenizer leaves resident (``PROMPT_BYTES_PER_TOKEN``), one chunk's activations in fp32
    (``chunk_activation_bytes``), SnapKV's scores of one layer (the store's pass over its keys in place: per
    KV head and task, at most 64 a head, each window query row's running max and sum, cpp/select/snapkv.h; its
    tasks' scratch, a few MiB a thread at most, is left out), and in layer-major order (``layer_major_tokens``) the hidden states of ``layer_tokens`` tokens
    and, on the CPU, one layer's K/V of them (kv/layer_prefill.py)."""
    dim = getattr(args, "dim", args.n_heads * args.head_dim)
    chunk = chunk_activation_bytes(args, min(chunk_size, max_seq_len))
    rows = args.n_heads * min(lc.preselect_window, max_seq_len)  # the window's query rows, all KV heads
    preselect = -(-max_seq_len // 256) * 2 * rows * 4 if lc.preselect_block else 0
    layer = layer_tokens * 4 * (dim + 2 * args.n_kv_heads * args.head_dim)
    return PROMPT_BYTES_PER_TOKEN * max_seq_len + chunk + preselect + layer


def store_need_bytes(lc: LongContextConfig, args, max_seq_len: int, chunk_size: int = 512,
                     layer_tokens: int = 0) -> tuple[int, int]:
    """RAM a full store for ``max_seq_len`` tokens needs: (the store with its candidate copy, its huge-page
    rounding and the prefill's workspace). ValueError or OverflowError for sizes past the store's layout."""
    dims = (args.n_layers, args.n_kv_heads, args.head_dim, max_seq_len)
    store = store_bytes(lc, *dims) + candidate_copy_bytes(lc, *dims)
    rounding = HUGE_PAGE * store_regions(lc, args.n_layers)
    return store, rounding + prefill_workspace_bytes(lc, args, max_seq_len, chunk_size, layer_tokens)


def check_store_fits(lc: LongContextConfig, args, max_seq_len: int, chunk_size: int = 512,
                     layer_tokens: int = 0) -> None:
    """ConfigError (with the figure) when a full store for ``max_seq_len`` would not fit in available RAM,
    with its huge-page rounding and the prefill's workspace (``prefill_workspace_bytes``)."""
    try:  # the store's layout refuses sizes past its limits (int32 block ids) or that overflow
        store, more = store_need_bytes(lc, args, max_seq_len, chunk_size, layer_tokens)
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: {e}") from None
    need, have = store + more, available_ram()
    if need > have:
        raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: the {lc.kv_type} KV store would need "
                          f"{store / 2**30:.2f} GiB (and {more / 2**30:.2f} GiB more for huge-page "
                          f"rounding and the prefill's workspace) and {have / 2**30:.2f} GiB of RAM is available; "
                          f"lower max_seq_len or pick a smaller kv_type (Q8_0, Q4_0)")


def dense_bytes(n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """Bytes of a dense KV cache: K and V of every position of every layer in ``dtype``."""
    return 2 * n_layers * n_kv_heads * max_seq_len * head_dim * dtype.itemsize


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes a new tensor on ``device`` can take, and how to name them in a message."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"is free on {device}"
    return available_ram(), "of RAM is available"


def check_dense_fits(n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int, device: torch.device,
                     dtype: torch.dtype) -> None:
    """ConfigError (with the figure) when a dense KV cache for ``max_seq_len`` would not fit on ``device``."""
    need = dense_bytes(n_layers, n_kv_heads, head_dim, max_seq_len, dtype)
    have, where = available_memory(torch.device(device))
    if need > have:
        raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: the dense KV cache would need "
                          f"{_size(need)} (K and V, {n_layers} layers x {n_kv_heads} KV heads x {head_dim} x "
                          f"{max_seq_len} tokens in {str(dtype).removeprefix('torch.')}) and {_size(have)} "
                          f"{where}; lower max_seq_len or use mode long_context")


def int8_weight_bytes(args, dtype: torch.dtype) -> int:
    """Bytes of the model's weights as int8 rows (``weights: int8``): a byte a parameter, a scale a row in
    ``dtype`` (rows of about ``dim`` values; the norms and biases are a rounding error beside them)."""
    return args.n_params + args.n_params // args.dim * dtype.itemsize


def choose_weights(asked: str, picked: str, args, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """How the weights are held, and a line that says it with the memory it takes; before any weight is read.

    ``picked``: ``engine_choices.pick_weights``'s choice for the ``weights`` knob (``asked``). On the CPU it
    stands (gguf maps the file). On CUDA the weights go in ``dtype`` where they fit the free device memory;
    where they do not and ``asked`` is auto, as int8 rows (half the memory; a model with experts' stacks
    excepted), and int8 where that was asked. ConfigError with the figures where the form asked, or neither
    form, fits."""
    full, int8 = args.n_params * dtype.itemsize, int8_weight_bytes(args, dtype)
    name = str(dtype).removeprefix("torch.")
    moe = any(b.ffn == "moe" for b in args.blocks)
    if picked == "int8" and moe:
        raise ConfigError("weights: int8 is for a model without experts (their stacks stay whole); use weights: "
                          "auto or dequantize")
    if device.type != "cuda":
        size = {"gguf": "the file mapped in place", "int8": _size(int8), "dequantize": _size(full)}[picked]
        return picked, f"weights: {'int8 rows' if picked == 'int8' else picked} on {device.type}, {size}"
    have, where = available_memory(device)
    if picked == "dequantize" and full <= have:
        return picked, f"weights: {name} on {device}, {_size(full)} ({_size(have)} {where})"
    fallback = asked == "auto" and not moe
    if (picked == "int8" or fallback) and int8 <= have:
        why = "asked" if picked == "int8" else f"in {name} they would need {_size(full)}"
        return "int8", f"weights: int8 rows on {device}, {_size(int8)} ({why}; {_size(have)} {where})"
    if picked == "int8":
        what = f"as int8 rows would need {_size(int8)}"
    elif fallback:
        what = f"in {name} would need {_size(full)}, as int8 rows {_size(int8)},"
    else:
        what = f"in {name} would need {_size(full)}"
    hint = ("; weights: int8 would need " + _size(int8)) if asked == "dequantize" and not moe else ""
    raise ConfigError(f"the model's weights {what} ({args.n_params / 1e9:.2f}B parameters) and {_size(have)} "
                      f"{where}{hint}; run it on the CPU (device: cpu), where the weights stay in the file's "
                      f"encoding")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_kv_type(lc: LongContextConfig, head_dim: int) -> None:
    """ConfigError unless the store's ``kv_type`` holds rows of ``head_dim`` (Q8_0/Q4_0: whole groups)."""
    if lc.kv_type in ("Q8_0", "Q4_0") and head_dim % Q8_GROUP:
        raise ConfigError(f"long_context.kv_type={lc.kv_type!r} is not allowed for this model: it quantises "
                          f"groups of {Q8_GROUP} along head_dim, and head_dim is {head_dim}; use FP16, BF16 "
                          f"or FP32")


def check_cache_fits(config: Config, args, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
    """The fit check of ``config.mode``'s KV cache for ``max_seq_len`` tokens, before anything is allocated."""
    if config.mode == "long_context":
        check_kv_type(config.long_context, args.head_dim)  # (the store's layout needs it to count its bytes)
        check_store_fits(config.long_context, args, max_seq_len, config.chunk_size,
                         layer_major_tokens(config, max_seq_len))
    else:
        check_dense_fits(args.n_layers, args.n_kv_heads, args.head_dim, max_seq_len, device, dtype)


def recurrent_state_bytes(args) -> int:
    """One copy of a hybrid model's DeltaNet states (kv/recurrent.py, fp32: each DeltaNet layer's conv inputs
    [K-1, conv_dim] and S [Hv, Dk, Dv]); 0 for a model without DeltaNet layers."""
    total = 0
    for i in args.delta_layers:
        d = args.blocks[i].delta
        total += 4 * ((d.conv_kernel - 1) * d.conv_dim + d.n_v_heads * d.k_head_dim * d.v_head_dim)
    return total


def check_states_fit(args, copies: int, device: torch.device) -> None:
    """ConfigError (with the figure) when ``copies`` of the DeltaNet states (the live one and the checkpoints)
    would not fit on ``device``."""
    one = recurrent_state_bytes(args)
    need = one * copies
    have, where = available_memory(torch.device(device))
    if need > have:
        raise ConfigError(f"state_checkpoints={copies - 1} is not allowed: the recurrent states would need "
                          f"{_size(need)} ({copies} copies of {_size(one)}) and {_size(have)} {where}; lower "
                          f"state_checkpoints")
