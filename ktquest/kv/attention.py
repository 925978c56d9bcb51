"""Attention pieces shared by the caches: the native dense decode attention, attention that returns its
log-sum-exp (``attention_lse``), and the exact merge of two attentions over disjoint key sets by their
log-sum-exp."""

from __future__ import annotations

import torch

from ktquest import _C
from ktquest.native.args import as_numpy, check_int


def dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float,
                           threads: int = 1, out: torch.Tensor | None = None,
                           skip: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token's attention over the first ``n`` rows of a dense fp32 cache but rows [skip), in C++.

    q: [H, D], k/v: [KVH, S, D] (S >= n) -> out [H, D], lse [H] (fp32; GQA: head i reads KV head i // (H/KVH)).
    """
    qn = as_numpy(q, "q", (torch.float32,), 2)
    kn, vn = as_numpy(k, "k", (torch.float32,), 3), as_numpy(v, "v", (torch.float32,), 3)
    if out is None:
        out = torch.empty(qn.shape[0], qn.shape[1])
    lse = torch.empty(qn.shape[0])
    _C.dense_decode_attention(qn, kn, vn, check_int(n, "n", 1), float(scale), as_numpy(out, "out", (torch.float32,), 2),
                              lse.numpy(), check_int(threads, "threads", 1), skip[0], skip[1])
    return out, lse


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
    [B, M], both fp32 (the caller merges parts before rounding). ``causal``: M == S and row i sees keys 0..i.
    Memory stays O(M x LSE_TILE): the CPU in fp32 runs torch's flash kernel, CUDA its flash kernel (fp16/bf16)
    or memory-efficient kernel (fp32); elsewhere the keys are taken LSE_TILE at a time (``lse_tile_bytes``)
    and the tiles' partial results merged by their LSE, so no [M, S] matrix is ever made.
    """
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"attention_lse: causal needs as many queries as keys, got {q.shape[1]} and {k.shape[1]}")
    if FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32:
        out, lse = FLASH_CPU(q[None], k[None], v[None], 0.0, causal, scale=scale)[:2]
        return out[0], lse[0]
    fused = _cuda_kernel(q.device, q.dtype, q.shape[-1]) if q.dtype == k.dtype == v.dtype else None
    if fused is not None:
        return fused(q, k, v, scale, causal)
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


def _cuda_kernel(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The fused CUDA attention for these inputs, or None (the tiled path then runs): flash for fp16/bf16,
    memory-efficient for fp32; both take a head size that is a multiple of 8, at most 256."""
    if device.type != "cuda" or head_dim % 8 or head_dim > 256:
        return None
    if dtype in (torch.float16, torch.bfloat16) and FLASH_CUDA is not None:
        return _flash_cuda
    if dtype == torch.float32 and EFFICIENT_CUDA is not None:
        return _efficient_cuda
    return None


def _flash_cuda(q, k, v, scale, causal):
    """[B, M, D] x [B, S, D] as one batch of B heads -> out [B, M, D] fp32, lse [B, M] fp32."""
    out, lse = FLASH_CUDA(q[None], k[None], v[None], 0.0, causal, False, scale=scale)[:2]
    return out[0].float(), lse[0, :, : q.shape[1]]


def _efficient_cuda(q, k, v, scale, causal):
    """As ``_flash_cuda``, in fp32 (its LSE rows may be padded: the first M are the queries')."""
    out, lse = EFFICIENT_CUDA(q[None], k[None], v[None], None, True, 0.0, causal, scale=scale)[:2]
    return out[0], lse[0, :, : q.shape[1]]


def fused_scratch_bytes(device: torch.device, dtype: torch.dtype, head_dim: int) -> int:
    """Device bytes ``attention_lse``'s fused CUDA kernel may allocate beside its inputs and outputs: the flash
    kernel splits the keys when a call has too few query blocks to fill the GPU and keeps each split's fp32
    output and LSE (its heuristic takes the fewest splits that fill about one wave of the multiprocessors:
    splits x heads x 64-row blocks ~ SMs; allowed twice that, with the rows rounded to 128 and the head size to
    32). The memory-efficient kernel (fp32) writes its output in place: none."""
    if _cuda_kernel(device, dtype, head_dim) is not _flash_cuda:
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return 2 * sms * 128 * (-(-head_dim // 32) * 32 + 1) * 4


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
