"""Attention pieces shared by the caches, in torch: attention that returns its log-sum-exp (``attention_lse``) and
the exact merge of two attentions over disjoint key sets by their log-sum-exp. (The CPU's dense decode
attention is native: ``ktquest.native.attention``.)"""

from __future__ import annotations

import functools

import numpy as np
import torch

# torch's fused attentions that return the log-sum-exp (private ops: the tiled torch path is the fallback):
# the CPU's flash kernel (fp32 here), and on CUDA the flash kernel (fp16/bf16) and the memory-efficient one (fp32)
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_CUDA = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
EFFICIENT_CUDA = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
LSE_TILE = 4096  # keys a tile of the portable path scores at once: its scores are [B, M, LSE_TILE] fp32


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v with its log-sum-exp, on q's device.

    q: [B, M, D], k/v: [B, S, D] (B = KV heads; a KV head's query rows share its keys) -> out [B, M, D], lse
    [B, M], both fp32 (the caller merges parts in fp32; CUDA's fused kernels round a part's output to q's
    dtype first). ``causal``: M == S and row i sees keys 0..i. No keys: out 0, lse -inf (an empty part).
    Memory stays O(M x LSE_TILE): the CPU in fp32 runs torch's flash kernel, CUDA its flash or memory-efficient
    kernel (``_cuda_kernel``); elsewhere the keys are taken LSE_TILE at a time (``lse_tile_bytes``) and the
    tiles' partial results merged by their LSE, so no [M, S] matrix is ever made.
    """
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"attention_lse: causal needs as many queries as keys, got {q.shape[1]} and {k.shape[1]}")
    if FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32:
        out, lse = FLASH_CPU(q[None], k[None], v[None], 0.0, causal, scale=scale)[:2]
        return out[0], lse[0]
    kind = _cuda_kernel(q.device, q.dtype, q.shape[-1]) if q.dtype == k.dtype == v.dtype else None
    if kind is not None:
        return _fused_cuda(kind, q, k, v, scale, causal)
    B, M, S = q.shape[0], q.shape[1], k.shape[1]
    out = torch.zeros(B, M, v.shape[2], device=q.device, dtype=torch.float32)
    lse = torch.full((B, M), float("-inf"), device=q.device)
    qf = q.float()
    for a in range(0, S, LSE_TILE):
        b = min(S, a + LSE_TILE)
        s = torch.bmm(qf, k[:, a:b].float().transpose(1, 2)).mul_(scale)  # [B, M, b - a]
        if causal and a < M:  # row i sees key j <= i
            rows = torch.arange(M, device=q.device)[:, None]
            s.masked_fill_(torch.arange(a, b, device=q.device)[None, :] > rows, float("-inf"))
        t_lse = torch.logsumexp(s, -1)  # [B, M]; -inf where a row sees no key of the tile
        p = s.sub_(t_lse.nan_to_num(0.0, neginf=0.0)[..., None]).exp_()  # in place: the tile's probabilities
        t_out = torch.bmm(p, v[:, a:b].float())  # [B, M, D]
        out, lse = merge_attention(out, lse, t_out, t_lse)
    return out, lse


def tiled_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``attention_lse`` on ``device`` in ``dtype`` runs the tiled torch path (no fused kernel)."""
    if device.type == "cpu":
        return not (FLASH_CPU is not None and dtype == torch.float32)
    return _cuda_kernel(device, dtype, head_dim) is None


@functools.lru_cache(maxsize=32)  # asked once a chunk and layer: the device's capability is asked once
def _cuda_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The fused CUDA attention for these inputs ("flash" or "efficient"), or None (the tiled path runs).

    Flash takes fp16/bf16 on NVIDIA GPUs from Ampere (sm80) on, in builds that have it; the memory-efficient
    kernel takes fp32, and fp16 on older GPUs. Both take a head size that is a multiple of 8, at most 256.
    """
    if device.type != "cuda" or torch.version.hip is not None or head_dim % 8 or head_dim > 256:
        return None
    flash = (FLASH_CUDA is not None and torch.backends.cuda.is_flash_attention_available()
             and torch.cuda.get_device_capability(device) >= (8, 0))
    if dtype in (torch.float16, torch.bfloat16) and flash:
        return "flash"
    if dtype in (torch.float32, torch.float16) and EFFICIENT_CUDA is not None:
        return "efficient"
    return None


def _fused_cuda(kind: str, q, k, v, scale, causal):
    """[B, M, D] x [B, S, D] as one batch of B heads -> out [B, M, D] fp32 (rounded to q's dtype by the
    kernel first), lse [B, M] fp32 (the memory-efficient kernel pads its LSE rows: the first M are the
    queries'). An empty key set is answered here: flash would give an LSE of +inf, not -inf."""
    B, M, S = q.shape[0], q.shape[1], k.shape[1]
    if M == 0 or S == 0:
        return (torch.zeros(B, M, v.shape[2], device=q.device),
                torch.full((B, M), float("-inf"), device=q.device))
    if kind == "flash":
        out, lse = FLASH_CUDA(q[None], k[None], v[None], 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = EFFICIENT_CUDA(q[None], k[None], v[None], None, True, 0.0, causal, scale=scale)[:2]
    return out[0].float(), lse[0, :, :M]


def fused_scratch_bytes(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int,
                        chunk: int, keys: int) -> int:
    """Device bytes ``attention_lse``'s fused CUDA kernel may allocate beside its inputs and outputs, at most,
    for the calls a layer-major prefill makes (kv/layer_prefill.py): a chunk of T <= ``chunk`` queries
    causally over itself (n_heads heads, T rows) and over up to ``keys`` keys (n_kv_heads heads, T x G rows).

    - flash: when a call's 64-row query blocks fill under 80% of twice the multiprocessors, it splits the keys
      and keeps every split's fp32 output and LSE, [splits, heads, M, D rounded + 1] (``flash_splits``,
      PyTorch's heuristic); the maximum over the calls' shapes;
    - memory-efficient: in fp32 it writes in place; in fp16 it accumulates the output in fp32, [M, heads, D].
    """
    kind = _cuda_kernel(device, dtype, head_dim)
    G = n_heads // n_kv_heads
    if kind == "efficient":
        return 0 if dtype == torch.float32 else n_heads * chunk * head_dim * 4
    if kind != "flash":
        return 0
    sms2 = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    d_round = -(-head_dim // 32) * 32 if head_dim <= 128 else -(-head_dim // 64) * 64
    block_n = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    worst = 0
    for heads, rows, n_keys in ((n_heads, chunk, chunk), (n_kv_heads, chunk * G, keys)):
        splits = flash_splits(heads, -(-rows // 64), -(-n_keys // block_n), sms2)
        worst = max(worst, max(s * heads * min(64 * m, rows) for m, s in enumerate(splits, 1)))
    return worst * (d_round + 1) * 4


@functools.lru_cache(maxsize=64)
def flash_splits(heads: int, m_blocks: int, n_blocks: int, sms2: int, max_splits: int = 128) -> tuple[int, ...]:
    """For m = 1..m_blocks query blocks of 64 rows a head: the most splits flash's heuristic
    (``num_splits_heuristic`` in PyTorch's flash_api.cpp) chooses for any key length of 1..n_blocks blocks.

    It keeps one split when heads x m fills 80% of ``sms2`` (twice the multiprocessors); else among the
    eligible split counts s <= min(max_splits, sms2, blocks) (those that change the blocks a split reads)
    the fewest whose wave efficiency (w / ceil(w), w = heads x m x s / sms2) reaches 85% of the best.
    Past 128 x 127 blocks every count is eligible: the longer key lengths choose as that one does.
    """
    nb = np.arange(1, min(n_blocks, max_splits * (max_splits - 1) + 1) + 1)[:, None]  # [NB, 1]
    s = np.arange(1, max_splits + 1)[None, :]  # [1, S]
    cdiv = -(-nb // s)
    eligible = (s == 1) | np.concatenate([np.ones_like(cdiv[:, :1], bool), cdiv[:, 1:] != cdiv[:, :-1]], 1)
    eligible &= s <= np.minimum(min(max_splits, sms2), nb)
    out = []
    for m in range(1, m_blocks + 1):
        bnm = heads * m
        if bnm >= 0.8 * sms2:
            out.append(1)
            continue
        waves = bnm * s / sms2
        eff = np.where(eligible, waves / np.ceil(waves), -1.0)  # [NB, S]
        ok = eff >= 0.85 * eff.max(1, keepdims=True)
        out.append(int((ok.argmax(1) + 1).max()))
    return tuple(out)


def lse_tile_bytes(rows: int) -> int:
    """Device bytes ``attention_lse``'s tiled path holds beside its inputs for ``rows`` query rows (B x M): a
    tile's scores and logsumexp's temporary of their size."""
    return 2 * rows * LSE_TILE * 4


def merge_attention(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of attention over two disjoint key sets. out*: [..., H, D], lse*: [..., H]
    (natural log; -inf = empty part, whose out rows are zeros). Returns (out, lse) of the union.

    Part 2's weight in the union is exp(lse2 - lse) = sigmoid(lse2 - lse1): 1 when part 1 is empty, 0 when
    part 2 is (and 0 when both are: their sigmoid is NaN).
    """
    w2 = torch.sigmoid(lse2 - lse1).nan_to_num_(0.0)
    return torch.lerp(out1, out2, w2.unsqueeze(-1)), torch.logaddexp(lse1, lse2)
