"""The long-context KV cache: heterogeneous attention over a DRAM block store and device-side windows.

Every layer's K/V go to a ``KVStore`` (CPU memory, ``kv_type``, block anchors). The initial window
(sink tokens) and the local window (the most recent tokens) are also kept on the device and attended
there densely; the context blocks between them are attended by the store's C++ operator, all of them
during prefill, a selected few per decode step. The two parts are merged exactly by their LSE.

The windows are block aligned, so the partition of the keys is exact (no token in both parts):

    blocks [0, ib)      init window    ib = ceil(init_windows_len / block_size)
    blocks [ib, lb)     context        the store's operator; decode selects among these (minus preselection)
    blocks [lb, ...)    local window   lb = floor((n - local_windows_len) / block_size), n = tokens after the pass

Device window buffer, per layer: ``win_k/win_v [L, KVH, init_end + cap, D]``: index p < init_end holds
position p; index init_end + j holds position buf0 + j (buf0 block aligned, <= the local start). It is
compacted (the local window moved to the front) only when a pass would not fit, so decode appends in
place; capacity = local_windows_len + block_size + chunk_size, independent of the prompt length.

Prefill (T > 1) stays exact: the chunk's queries attend to the context blocks through ``store.attend``
with the queries regrouped as [KVH, T * G] "heads" (every query of a KV head's group, every context
block), so past K/V are read in place from DRAM in their stored type: nothing is copied back to the
device and nothing is dequantised into a buffer. It reads each past token once per chunk, i.e.
O(N^2 / chunk_size) token reads for an N-token prompt, the same O(N^2) work as dense attention.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ktquest.config import LINEAR_ANCHORS, Config, ConfigError, LongContextConfig
from ktquest.ops import KVStore, dense_decode_attention
from ktquest.selection_policy import (
    ada_budgets_fast,
    block_scores_from_tokens,
    preselect_blocks,
    snapkv_token_scores,
)

# torch's CPU flash attention with the log-sum-exp output (a private op: the explicit path is the fallback)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


# ---- memory estimate ----

_ROW_BYTES = {"FP32": 4.0, "FP16": 2.0, "BF16": 2.0, "Q8_0": 1.0, "Q4_0": 0.5}  # bytes per element


def _tile_bytes(lc: LongContextConfig, head_dim: int) -> int:
    """One (KV head, block) tile of K or V: block_size rows and their Q8_0/Q4_0 scales, padded to 64 bytes."""
    scales = head_dim // 32 * 4 if lc.kv_type in ("Q8_0", "Q4_0") else 0
    return int(lc.block_size * (head_dim * _ROW_BYTES[lc.kv_type] + scales) + 63) // 64 * 64


def store_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Bytes the DRAM store needs when full (K, V, scales, anchors): the layout of cpp/kv_store.h."""
    bs, D = lc.block_size, head_dim
    tile = _tile_bytes(lc, D)
    linear = lc.anchor_type in LINEAR_ANCHORS
    A = 2 if lc.anchor_type == "QUEST" else 1 if linear else lc.anchor_num
    anchor_bytes = 2 if linear and lc.kv_type == "FP16" else 4  # linear anchors over FP16 keys are fp16
    per_block = 2 * tile + A * D * anchor_bytes + 4 + (D * 8 if lc.anchor_type == "BLOCK_MEAN" else 0) \
        + (A * 8 if lc.anchor_type == "DYNAMIC" else 0)
    return n_layers * n_kv_heads * -(-max_seq_len // bs) * per_block


def candidate_copy_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int,
                         max_seq_len: int) -> int:
    """Bytes of the store's copy of the preselected candidates (their K/V tiles and anchor rows, per layer and
    KV head), at the size it starts with after prefill: room for preselect_block_count blocks and a quarter
    more (at least 64) that join as decoding goes on; it grows by a block each block_size tokens past that."""
    if not lc.preselect_block or lc.anchor_type not in LINEAR_ANCHORS:  # only linear anchors' candidates are cached
        return 0
    D = head_dim
    A = 2 if lc.anchor_type == "QUEST" else 1
    row = A * D * (1 if lc.int8_candidates else 2 if lc.kv_type == "FP16" else 4) + (4 if lc.int8_candidates else 0)
    need = min(lc.preselect_block_count, -(-max_seq_len // lc.block_size))
    return n_layers * n_kv_heads * (need + max(64, need // 4)) * (2 * _tile_bytes(lc, D) + row + 4)


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


def check_store_fits(lc: LongContextConfig, args, max_seq_len: int) -> None:
    """ConfigError (with the figure) when a full store for ``max_seq_len`` would not fit in available RAM."""
    dims = (args.n_layers, args.n_kv_heads, args.head_dim, max_seq_len)
    need, have = store_bytes(lc, *dims) + candidate_copy_bytes(lc, *dims), available_ram()
    if need > have:
        raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: the {lc.kv_type} KV store would need "
                          f"{need / 2**30:.2f} GiB and {have / 2**30:.2f} GiB of RAM is available; lower "
                          f"max_seq_len or pick a smaller kv_type (Q8_0, Q4_0)")


# ---- per-step state ----


@dataclass(slots=True)
class SelectionStats:
    """Counters the tests read: what each layer did on its decode steps."""

    select_calls: list[int]  # anchor scoring + top-k (select_attend) per layer
    reuse_calls: list[int]  # decode steps that reused a cached selection per layer
    full_calls: list[int]  # decode steps that attended every context block per layer
    preselect_calls: int = 0


@dataclass(slots=True)
class _Selection:
    """A layer's last block selection: ids [n_sets, k] (-1 padded), taken when the context was [ib, lb)."""

    ids: torch.Tensor
    lb: int
    step: int


@dataclass(slots=True)
class _TokenPlan:
    """decode_token's per-layer step args (ops.KVStore.step_args) for context end ``lb``; the layers that
    select (with their args: the out_ids buffers are reused from token to token), and those that attend
    every block or reuse a selection (the statistics to count)."""

    lb: int
    steps: list
    fresh: dict
    full: list
    reuse: list


@dataclass(slots=True)
class _Geometry:
    """Where the windows stand for the current pass (the same for every layer)."""

    start: int = 0  # first position of the pass
    T: int = 0
    loc0: int = 0  # local window start (block aligned): context blocks are [ib, loc0 // bs)
    mask: torch.Tensor | None = None  # [T, W] additive, device: 0 = attend, -inf = not this part
    mask_rows: torch.Tensor | None = None  # [T*G, W]: the mask per query row (t, g)
    width: int = 0  # W: window buffer indexes 0..W-1 in use
    skip: tuple[int, int] = (0, 0)  # decode: window indexes [a, b) that left the window (the mask's -inf)


class LongContextCache:
    """The cache interface of ``DenseKVCache`` (attend, pos, max_seq_len, reset, truncate, nbytes)."""

    def __init__(self, args, cfg: Config, max_seq_len: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        lc = cfg.long_context
        self.lc, self.cfg = lc, cfg
        self.n_layers, self.max_seq_len = args.n_layers, max_seq_len
        self.H, self.KVH, self.D = args.n_heads, args.n_kv_heads, args.head_dim
        self.G = self.H // self.KVH
        if lc.kv_type in ("Q8_0", "Q4_0") and self.D % 32:
            raise ConfigError(f"long_context.kv_type={lc.kv_type!r} is not allowed for this model: it quantises "
                              f"groups of 32 along head_dim, and head_dim is {self.D}; use FP16, BF16 or FP32")
        if lc.init_windows_len + lc.local_windows_len > max_seq_len:
            raise ConfigError(f"long_context.local_windows_len={lc.local_windows_len} is not allowed: "
                              f"init_windows_len + local_windows_len must be <= max_seq_len ({max_seq_len})")
        check_store_fits(lc, args, max_seq_len)
        self.device, self.dtype = torch.device(device), dtype
        self.bs = lc.block_size
        self.ib = -(-lc.init_windows_len // self.bs)  # init window blocks
        self.init_end = self.ib * self.bs
        self.chunk_size = cfg.chunk_size
        self.cap = lc.local_windows_len + self.bs + cfg.chunk_size  # local buffer capacity, tokens
        threads = lc.threads_num or cfg.resolved_threads()
        self.store = KVStore(self.n_layers, self.KVH, self.D, max_seq_len, self.bs, lc.kv_type, lc.anchor_type,
                             lc.anchor_num, threads, lc.int8_candidates)
        shape = (self.n_layers, self.KVH, self.init_end + self.cap, self.D)
        self.win_k = torch.zeros(shape, device=self.device, dtype=dtype)  # [L, KVH, init_end + cap, D]
        self.win_v = torch.zeros(shape, device=self.device, dtype=dtype)
        W = min(lc.preselect_window, max_seq_len)
        self.q_win = torch.zeros(self.n_layers, W, self.H, self.D, device=self.device, dtype=dtype)  # [L, W, H, D]
        self.scale = 1.0 / math.sqrt(self.D)
        self.k_sel = lc.second_select_num
        self.threads = threads
        # Decode's window attention in C++ (ops.dense_decode_attention) on CPU fp32; DYNAMIC anchors need
        # the attention probabilities, which only the explicit torch path returns.
        self._native_decode = self.device.type == "cpu" and dtype == torch.float32 and lc.anchor_type != "DYNAMIC"
        # numpy views of each layer's window buffers for the native decode calls (the buffers are never replaced)
        self._win_np = [(self.win_k[i].numpy(), self.win_v[i].numpy()) for i in range(self.n_layers)] \
            if self._native_decode else None
        self._all_blocks = torch.arange(-(-max_seq_len // self.bs), dtype=torch.int32)  # [max_blocks]
        self._all_blocks_np = self._all_blocks.numpy()
        self._out = torch.empty(self.H, self.D)  # decode: the store part, fp32 [H, D]
        self._lse = torch.empty(self.H)  # [H]
        self._excl: tuple[int, np.ndarray | None] = (-1, None)  # (lb, exclude ranges) of the last selection
        self._sel: list[_Selection | None] = []
        self._sel_live: tuple | None = None  # (plan, lb, step): sel's entries still in decode_token's buffers
        self.reset()

    # ---- bookkeeping ----

    def reset(self) -> None:
        """Forget every token (the memory is kept)."""
        self.store.truncate(-1, 0)
        self.pos = 0
        self.buf0 = self.init_end  # position of window index init_end
        self.geo = _Geometry()
        self.q_win_span = (0, 0)  # positions [a, b) whose queries q_win holds (last b - a slots)
        self._forget_selection()
        self.stats = SelectionStats([0] * self.n_layers, [0] * self.n_layers, [0] * self.n_layers)

    def _forget_selection(self) -> None:
        self.sel = [None] * self.n_layers
        self._token_plan: _TokenPlan | None = None  # decode_token's plan, valid while nothing changes
        # per layer: [n_sets, N] int32 preselected blocks (-1 padded), and the context end it covers
        self.allowed: list[torch.Tensor | None] = [None] * self.n_layers
        self.allowed_np: list[np.ndarray | None] = [None] * self.n_layers  # numpy views of allowed (decode calls)
        self.allowed_lb = [0] * self.n_layers
        self.presel_pending = [False] * self.n_layers
        self.decode_step = 0

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (0 <= n <= pos); the device windows are refilled from the store."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"truncate({n}): must be between 0 and the {self.pos} tokens held")
        self.store.truncate(-1, n)  # also drops what an interrupted pass appended to the first layers
        if n == self.pos:
            return
        self.pos = n
        if n < self.buf0:  # the local window now starts before the buffer: reload it from the store
            loc0 = self._local_start(n)  # >= init_end: with n <= init_end the init window holds them all
            for layer in range(self.n_layers if loc0 < n else 0):
                k, v = self.store.read_range(layer, loc0, n)  # [n - loc0, KVH, D] fp32
                self.win_k[layer, :, self.init_end: self.init_end + n - loc0] = k.transpose(0, 1).to(self.win_k)
                self.win_v[layer, :, self.init_end: self.init_end + n - loc0] = v.transpose(0, 1).to(self.win_v)
            self.buf0 = max(loc0, self.init_end)
        self.q_win_span = (0, 0)
        self._forget_selection()

    def nbytes(self) -> int:
        """KV bytes held: the DRAM store's blocks in use, its copy of the candidates, the device windows."""
        return self.store.nbytes() + self.store.cand_nbytes() + self.device_kv_bytes()

    def device_kv_bytes(self) -> int:
        """Bytes of K/V held on the device (the windows; fixed at construction)."""
        return self.win_k.nbytes + self.win_v.nbytes + self.q_win.nbytes

    def _local_start(self, n: int) -> int:
        """First position of the local window when n tokens are held (block aligned, >= init_end)."""
        return max(self.init_end, (n - self.lc.local_windows_len) // self.bs * self.bs)

    # ---- the pass ----

    def _begin_pass(self, start: int, T: int) -> None:
        """Geometry for positions [start, start + T), set up once (at layer 0) for every layer."""
        if start != self.pos:
            if start > self.pos or start < 0:
                raise ValueError(f"KV cache: cannot write positions {start}..{start + T - 1}: the cache holds "
                                 f"{self.pos} tokens, so a chunk must start at {self.pos}")
            self.truncate(start)  # rewrite from an earlier position: forget the rest
        elif self.store.length(0) != start:  # a pass interrupted half-way: drop its first layers' tokens
            self.store.truncate(-1, start)
        if start + T > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {start}..{start + T - 1} do not fit in "
                             f"max_seq_len={self.max_seq_len} (the cache holds {self.pos} tokens)")
        if T > self.chunk_size:
            raise ValueError(f"long-context cache: {T} tokens in one pass exceed chunk_size={self.chunk_size}")
        # The local window of this pass: strictly the last local_windows_len tokens of start + T, but never
        # past the store's full blocks (a context block must be in the store before the chunk).
        loc0 = max(self.init_end, min(self._local_start(start + T), start // self.bs * self.bs))
        # Compact (move [loc0, start) to the front of the local part) when the pass would not fit, or in
        # decode once a quarter of the window is dead weight that every step would read and mask.
        if start + T - self.buf0 > self.cap or (T == 1 and loc0 - self.buf0 > max(self.bs, self.cap // 4)):
            m, off = start - loc0, self.init_end + loc0 - self.buf0
            for buf in (self.win_k, self.win_v):
                buf[:, :, self.init_end: self.init_end + m] = buf[:, :, off: off + m].clone()
            self.buf0 = loc0
        width = self.init_end + start + T - self.buf0 if start + T > self.init_end else start + T
        # Additive mask [T, W]: query start+i sees window index j iff its position p(j) <= start+i and
        # p(j) is in the init window or in [loc0, ...). Decode sees every index but the dropped ones.
        drop = loc0 - self.buf0 if start >= self.init_end else 0  # positions [buf0, loc0) left the window
        skip = (0, 0)
        if T == 1:
            mask = None
            if drop > 0:
                skip = (self.init_end, self.init_end + drop)
            if drop > 0 and not self._native_decode:  # the native kernel skips the stretch itself
                mask = torch.zeros(1, width, device=self.device)
                mask[:, skip[0]: skip[1]] = float("-inf")
        else:
            j = torch.arange(width, device=self.device)
            p = torch.where(j < self.init_end, j, self.buf0 + j - self.init_end)  # [W] positions
            qpos = torch.arange(start, start + T, device=self.device)[:, None]  # [T, 1]
            ok = (p[None, :] <= qpos) & ((p < self.init_end) | (p >= loc0))[None, :]
            mask = torch.zeros(T, width, device=self.device).masked_fill_(~ok, float("-inf"))
        rows = None if mask is None else mask.repeat_interleave(self.G, 0)  # [T*G, W]
        self.geo = _Geometry(start, T, loc0, mask, rows, width, skip)
        if T > 1:
            self.presel_pending = [self.lc.preselect_block] * self.n_layers
            self.sel = [None] * self.n_layers
            self._token_plan = None
        else:
            self.decode_step += 1

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """Store k/v at start_pos.. and return causal attention over everything held.

        q: [T, H, D], k/v: [T, KVH, D] (device) -> out [T, H, D]. T <= chunk_size. (A CPU decode step runs
        torch on one thread: ``generate.decode_one_token`` sets it for the whole step.)
        """
        T = q.shape[0]
        if layer_idx == 0:
            self._begin_pass(start_pos, T)
        g = self.geo
        if T == 1 and self._native_decode:
            return self._decode_native(layer_idx, q, k, v, start_pos)
        # ---- device part: init + local windows + this chunk, dense ----
        w0 = self._window_row(start_pos)
        self.win_k[layer_idx, :, w0: w0 + T] = k.transpose(0, 1)
        self.win_v[layer_idx, :, w0: w0 + T] = v.transpose(0, 1)
        out_w, lse_w, probs = self._window_attention(layer_idx, q, g)  # [T, H, D], [T, H] fp32
        imp = None
        if self.lc.anchor_type == "DYNAMIC":  # a token's importance: the attention the chunk's queries give it
            imp = probs.view(self.KVH, T, self.G, -1)[..., w0: w0 + T].sum((1, 2)).t().float().cpu().contiguous()
        # ---- store part: the context blocks [ib, lb) ----
        lb = g.loc0 // self.bs
        if lb > self.ib:
            if T == 1:
                out_s, lse_s = self._decode_context(layer_idx, q, lb)
                out_s, lse_s = out_s.to(self.device)[None], lse_s.to(self.device)[None]
            else:
                out_s, lse_s = self._prefill_context(layer_idx, q, lb)
            # LSE merge (ops.merge_attention) in 3 ops: every query sees itself, so lse_w is finite and the
            # store part's weight is sigmoid(lse_s - lse_w) (0 when it has no block: lse_s = -inf).
            out_w = torch.lerp(out_w, out_s, torch.sigmoid(lse_s - lse_w)[..., None])
        # ---- the chunk goes to the store (after attention: the store part never sees it) ----
        kc, vc = k.contiguous(), v.contiguous()
        if kc.device.type != "cpu":
            kc, vc = kc.cpu(), vc.cpu()
        self.store.append(layer_idx, kc, vc, imp)
        if T > 1:
            self._record_queries(layer_idx, q, start_pos)
        if layer_idx == self.n_layers - 1:
            self.pos = start_pos + T
            if T > 1:
                self.q_win_span = self._q_span(start_pos, T)
        return out_w.to(q.dtype)

    def _window_attention(self, layer: int, q: torch.Tensor, g: _Geometry):
        """Dense attention over the device windows: (out [T, H, D], lse [T, H], probs [KVH, T*G, W]).

        Rows are ordered (t, g) per KV head, so the [T, W] mask broadcasts over G without a copy, and for
        T = 1 every reshape is a view: a decode step is one baddbmm, a softmax, a logsumexp and one bmm.
        """
        T, KVH, G, D = q.shape[0], self.KVH, self.G, self.D
        if T == 1 and self._native_decode:  # the C++ split-K kernel, the dropped stretch skipped
            out, lse = dense_decode_attention(q[0], self.win_k[layer], self.win_v[layer], g.width, self.scale,
                                              self.threads, skip=g.skip)
            return out[None], lse[None], None
        keys = self.win_k[layer, :, : g.width]  # [KVH, W, D]
        vals = self.win_v[layer, :, : g.width]
        qh = q.reshape(T, KVH, G, D).transpose(0, 1).reshape(KVH, T * G, D)  # [KVH, T*G, D]
        if _FLASH_CPU is not None and self.device.type == "cpu" and self.lc.anchor_type != "DYNAMIC" \
                and keys.dtype == torch.float32:
            # torch's fused CPU flash attention returns the LSE too: 2-3x faster than the explicit ops below.
            mask = None if g.mask is None else g.mask_rows  # [T*G, W]
            out, lse = _FLASH_CPU(qh[None], keys[None], vals[None], 0.0, False, attn_mask=mask, scale=self.scale)
            out = out.view(KVH, T, G, D).transpose(0, 1).reshape(T, self.H, D)
            return out, lse.view(KVH, T, G).transpose(0, 1).reshape(T, self.H), None
        if keys.dtype != torch.float32:
            qh, keys, vals = qh.float(), keys.float(), vals.float()
        if g.mask is None:  # decode, nothing to hide
            s = torch.bmm(qh, keys.transpose(1, 2)).mul_(self.scale)  # [KVH, G, W]
        elif T == 1:
            s = torch.baddbmm(g.mask, qh, keys.transpose(1, 2), alpha=self.scale)  # mask [1, W] broadcasts
        else:
            s = torch.bmm(qh, keys.transpose(1, 2)).mul_(self.scale)  # [KVH, T*G, W]
            s.view(KVH, T, G, g.width).add_(g.mask[:, None, :])
        # softmax and its log-sum-exp in one exp pass, in place (torch.logsumexp would run its own exp over a
        # temporary of the scores' size): [KVH, T*G, W]
        m = s.amax(-1, keepdim=True).clamp_min_(torch.finfo(s.dtype).min)  # a row of -inf keeps m finite
        probs = s.sub_(m).exp_()
        total = probs.sum(-1, keepdim=True)  # >= 1 in every row that has an unmasked key
        probs.div_(total)
        lse = (m + total.log()).squeeze(-1)  # [KVH, T*G]
        out = torch.bmm(probs, vals)  # [KVH, T*G, D]
        out = out.view(KVH, T, G, D).transpose(0, 1).reshape(T, self.H, D)
        return out, lse.view(KVH, T, G).transpose(0, 1).reshape(T, self.H), probs

    def _prefill_context(self, layer: int, q: torch.Tensor, lb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact attention of every chunk query to the context blocks [ib, lb), read in place from DRAM."""
        T, KVH, G, D = q.shape[0], self.KVH, self.G, self.D
        # Query "head" (kvh, t, g) reads KV head kvh: the store's grouping h // (H' / KVH) with H' = KVH*T*G.
        qs = q.float().reshape(T, KVH, G, D).permute(1, 0, 2, 3).reshape(KVH * T * G, D).cpu().contiguous()
        out, lse = self.store.attend(layer, qs, self._all_blocks[self.ib: lb])
        out = out.view(KVH, T, G, D).permute(1, 0, 2, 3).reshape(T, self.H, D)
        lse = lse.view(KVH, T, G).permute(1, 0, 2).reshape(T, self.H)
        return out.to(self.device), lse.to(self.device)

    # ---- decode: which context blocks ----

    def _window_row(self, pos: int) -> int:
        """Row of position ``pos`` in the window buffers: positions below init_end map to themselves, later
        ones to init_end + pos - buf0 (buf0 = init_end then)."""
        return self.init_end + pos - self.buf0 if pos >= self.init_end else pos

    def decode_block(self, layer: int, fused, x, cos, sin, start_pos: int, threads: int) -> bool:
        """A block's whole CPU decode step in one native call (models/llama.py; ops.KVStore.decode_block):
        x [dim] (an fp32 tensor or numpy view, as are cos/sin [D]) is replaced by the block's output. False
        (nothing done) where the selection needs the query first (Ada-KV budgets at decode time) or the native
        path does not apply."""
        lc = self.lc
        if not self._native_decode or (lc.ada_budget and lc.head_select_mode == "SEPARATE"):
            return False
        if layer == 0:
            self._begin_pass(start_pos, 1)
        w0, lb, blocks, select = self._native_plan(layer, None, start_pos)
        g = self.geo
        wk, wv = self._win_np[layer]
        ids = self.store.decode_block(fused, layer, x, cos, sin, wk, wv, w0, g.width, g.skip, self.scale, threads,
                                      blocks, select)
        self._native_done(layer, ids, lb, start_pos)
        return True

    def decode_token(self, layers: list, x, cos, sin, start_pos: int, threads: int) -> bool:
        """Every block's CPU decode step of one token in one native call (ops.KVStore.decode_token): the
        blocks' ``fused`` stages ``layers`` [n_layers], x [dim] numpy (replaced by the last block's output),
        the token's RoPE rows cos/sin [D] numpy. Each layer's plan (_plan: fixed blocks or a fresh selection,
        with the same statistics) is made before the call; a layer that reuses a selection its layer_step
        leader makes in this token reads the leader's ids as the native call wrote them. False (nothing done)
        where decode_block() would decline, so the caller goes layer by layer."""
        lc = self.lc
        if not self._native_decode or (lc.ada_budget and lc.head_select_mode == "SEPARATE") \
                or len(layers) != self.n_layers:
            return False
        self._begin_pass(start_pos, 1)
        lb = self.geo.loc0 // self.bs
        plan = self._token_plan
        if plan is not None and plan.lb == lb:  # the same plan as the last token: only the counters move
            st = self.stats
            for layer in plan.full:
                st.full_calls[layer] += 1
            for layer in plan.reuse:
                st.reuse_calls[layer] += 1
            for layer in plan.fresh:
                st.select_calls[layer] += 1
        else:  # (the same plan's next token replaces all of its picks: only a new plan needs the old ones)
            self._flush_sel()
            plan = self._make_token_plan(lb)
        g = self.geo
        try:
            self.store.decode_token(layers, x, cos, sin, self._win_np, self._window_row(start_pos), g.width,
                                    g.skip, self.scale, threads, plan.steps)
        except BaseException:
            self.sel = [None] * self.n_layers  # the ids buffers may hold part of this token's picks
            raise
        # The selections stay in the plan's buffers; ``sel`` copies them out when it is read (one copy per
        # layer per token would cost ~6 us a layer on the decode path, and the next token replaces them).
        self._sel_live = (plan, lb, self.decode_step)
        self.pos = start_pos + 1
        return True

    @property
    def sel(self) -> list[_Selection | None]:
        """Each layer's last selection (None: none yet)."""
        if self._sel_live is not None:
            self._flush_sel()
        return self._sel

    @sel.setter
    def sel(self, value: list[_Selection | None]) -> None:
        self._sel_live = None
        self._sel = value

    def _flush_sel(self) -> None:
        """Copy decode_token's picks of its last token out of its plan's buffers into ``sel``."""
        live, self._sel_live = self._sel_live, None
        if live is not None:
            plan, lb, step = live
            for layer, args in plan.fresh.items():  # [n_sets, cols], a fresh tensor per selection
                self._sel[layer] = _Selection(torch.from_numpy(args[6].copy()), lb, step)

    def _make_token_plan(self, lb: int) -> _TokenPlan:
        """Every layer's step args for a decode token (_plan, with its statistics), kept for the next tokens
        when they would plan the same: every selection due at every token (token_step 1), nothing pending,
        the same context end."""
        steps, fresh = [], {}  # fresh: layer -> its step args, for the layers that select in this token
        full, reuse = [], []  # the layers _plan counted as attending every block / reusing a selection
        for layer in range(self.n_layers):
            blocks, select = self._plan(layer, None, lb, fresh) if lb > self.ib else (None, None)
            args = self.store.step_args(layer, blocks, select)
            if select is not None:
                fresh[layer] = args
            elif blocks is not None:
                (full if layer < self.lc.dense_layer_num else reuse).append(layer)
            steps.append(args)
        plan = _TokenPlan(lb, steps, fresh, full, reuse)
        self._token_plan = plan if self.lc.token_step == 1 and lb > self.ib else None
        return plan

    def _decode_native(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       start_pos: int) -> torch.Tensor:
        """attend() for one token on the CPU in one native call (cpp/lc_decode.h): window write, dense window
        attention, the store part as _plan() says, LSE merge and the store append. q [1, H, D] -> [1, H, D]."""
        qc = q[0].contiguous()  # [H, D]
        w0, lb, blocks, select = self._native_plan(layer, qc, start_pos)
        g = self.geo
        out = torch.empty(1, self.H, self.D)
        ids = self.store.decode_step(layer, qc, k[0].contiguous(), v[0].contiguous(), self.win_k[layer],
                                     self.win_v[layer], w0, g.width, g.skip, self.scale, self.threads, out[0],
                                     blocks, select)
        self._native_done(layer, ids, lb, start_pos)
        return out

    def _native_plan(self, layer: int, qc: torch.Tensor | None, start_pos: int):
        """(window row of the new token, first local block, blocks, select) of a native decode step."""
        lb = self.geo.loc0 // self.bs
        blocks, select = self._plan(layer, qc, lb) if lb > self.ib else (None, None)
        return self._window_row(start_pos), lb, blocks, select

    def _native_done(self, layer: int, ids: torch.Tensor | None, lb: int, start_pos: int) -> None:
        if ids is not None:
            self._record_selection(layer, ids, lb)
        if layer == self.n_layers - 1:
            self.pos = start_pos + 1

    def _decode_context(self, layer: int, q: torch.Tensor, lb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [1, H, D] -> (out [H, D], lse [H]) fp32 on the CPU over the selected context blocks."""
        qc = q[0].float()
        qc = (qc.cpu() if qc.device.type != "cpu" else qc).contiguous()  # [H, D]
        blocks, select = self._plan(layer, qc, lb)
        if select is None:
            return self.store.attend(layer, qc, blocks, self._out, self._lse)
        out, lse, ids = self.store.select_attend(layer, qc, *select, self._out, self._lse)
        self._record_selection(layer, ids, lb)
        return out, lse

    def _record_selection(self, layer: int, ids: torch.Tensor, lb: int) -> None:
        mode = self.lc.head_select_mode
        if ids.dim() != 2 or mode != "SEPARATE":
            ids = ids.reshape(-1 if mode == "SEPARATE" else 1, ids.shape[-1])
        self.sel[layer] = _Selection(ids, lb, self.decode_step)  # ids: a fresh tensor per call

    def _plan(self, layer: int, qc: torch.Tensor, lb: int,
              fresh: dict | None = None) -> tuple[torch.Tensor | None, tuple | None]:
        """Which context blocks a decode step of ``layer`` attends to: (blocks, None) for a fixed list (dense
        layers, a reused selection), or (None, (k, mode, exclude_ranges, allowed)) for a fresh selection.
        qc: [H, D] fp32 CPU (only read for Ada-KV budgets in SEPARATE mode; may be None otherwise). Keeps the
        call statistics and runs a pending preselection. fresh (decode_token): the step args of the layers
        that select in this token but have not run yet; a follower of one of them reuses its out_ids."""
        lc, st = self.lc, self.stats
        if layer < lc.dense_layer_num:
            st.full_calls[layer] += 1
            return self._all_blocks[self.ib: lb], None
        if self.presel_pending[layer]:
            self._preselect(layer, lb)
        leader = layer - (layer - lc.dense_layer_num) % lc.layer_step  # layer_step groups reuse its selection
        if fresh is not None and leader != layer and leader in fresh:
            st.reuse_calls[layer] += 1
            return torch.from_numpy(fresh[leader][6]), None  # [n_sets, cols], filled by the leader's step
        sel = self.sel[leader]
        due = sel is None or (layer == leader and self.decode_step - sel.step >= lc.token_step)
        if not due:
            st.reuse_calls[layer] += 1
            return self._extend(sel, lb), None
        st.select_calls[layer] += 1
        mode, allowed = lc.head_select_mode, self._allowed(layer, lb)
        if self._excl[0] != lb:  # [2, 2] int64 block ranges: the init window, and the local window onwards
            self._excl = (lb, np.array([[0, self.ib], [lb, self._all_blocks.shape[0]]], np.int64))
        excl = self._excl[1]
        ks = self.k_sel
        if lc.ada_budget and mode == "SEPARATE":
            scores = self.store.block_scores(layer, qc, "SEPARATE")  # [KVH, nb]
            scores[:, : self.ib] = float("-inf")
            scores[:, lb:] = float("-inf")
            if allowed is not None:
                nb = scores.shape[1]
                idx = allowed.long().masked_fill(allowed < 0, nb)  # padding -> a spare last column
                keep = torch.zeros(scores.shape[0], nb + 1, dtype=torch.bool).scatter_(1, idx, True)
                scores.masked_fill_(~keep[:, :nb], float("-inf"))
            ks = ada_budgets_fast(scores, lc.second_select_num * self.KVH, lc.ada_alpha).tolist()
        return None, (ks, mode, excl, None if allowed is None else self.allowed_np[layer])

    def _extend(self, sel: _Selection, lb: int) -> torch.Tensor:
        """A cached selection plus the context blocks that left the local window since it was taken."""
        if lb == sel.lb:
            return sel.ids
        new = self._all_blocks[sel.lb: lb].expand(sel.ids.shape[0], lb - sel.lb)
        ids = torch.cat([sel.ids, new], 1)
        big = torch.iinfo(torch.int32).max  # -1 padding sorts last, then turns back into -1
        ids = torch.sort(ids.masked_fill(ids < 0, big), 1).values
        sel.ids, sel.lb = ids.masked_fill_(ids == big, -1), lb
        return sel.ids

    def _allowed(self, layer: int, lb: int) -> torch.Tensor | None:
        """Preselected candidates plus the blocks that entered the context after preselection."""
        allowed, a_lb = self.allowed[layer], self.allowed_lb[layer]
        if allowed is None or lb <= a_lb:
            return allowed
        a = self.allowed_np[layer]  # numpy: torch.cat and friends cost several times more on the decode path
        ext = np.empty((a.shape[0], a.shape[1] + lb - a_lb), np.int32)
        ext[:, : a.shape[1]] = a
        ext[:, a.shape[1]:] = self._all_blocks_np[a_lb: lb]
        self._set_allowed(layer, torch.from_numpy(ext), lb)
        return self.allowed[layer]

    def _set_allowed(self, layer: int, allowed: torch.Tensor, lb: int) -> None:
        """allowed: [n_sets, N] int32 contiguous, covering the context blocks [ib, lb)."""
        self.allowed[layer], self.allowed_np[layer], self.allowed_lb[layer] = allowed, allowed.numpy(), lb

    # ---- SnapKV preselection (once after each prefill, lazily at the first decode step) ----

    def _record_queries(self, layer: int, q: torch.Tensor, start: int) -> None:
        """Keep the last W prefill queries of the layer (q_win_span, updated after the last layer, says
        which positions they are)."""
        W = self.q_win.shape[1]
        keep = q[-W:]
        n = keep.shape[0]
        if self.q_win_span[1] == start and n < W:  # continues the window: shift the older queries left
            self.q_win[layer, : W - n] = self.q_win[layer, n:].clone()
        self.q_win[layer, W - n:] = keep

    def _q_span(self, start: int, T: int) -> tuple[int, int]:
        a, b = self.q_win_span
        end = start + T
        return max(a if b == start else start, end - self.q_win.shape[1]), end

    def _preselect(self, layer: int, lb: int) -> None:
        """SnapKV: the top ``preselect_block_count`` context blocks per KV head (SHARED: one set) of this
        layer, scored by the last prefill queries (Ada-SnapKV budgets with ``ada_budget``)."""
        self.presel_pending[layer] = False
        a, b = self.q_win_span
        if b <= a or lb <= self.ib:
            return
        self.stats.preselect_calls += 1
        lc = self.lc
        k, _ = self.store.read_range(layer, 0, b)  # [b, KVH, D] fp32: one layer's keys, once per prefill
        qw = self.q_win[layer, self.q_win.shape[1] - (b - a):].float().cpu()  # [W, H, D]
        tok = snapkv_token_scores(qw, k, a, lc.preselect_pool_kernel, lc.ada_gqa_merge)  # [KVH, b]
        scores = block_scores_from_tokens(tok, self.bs, lb)  # [KVH, lb]
        if lc.head_select_mode == "SHARED":
            scores = scores.sum(0, keepdim=True)
        sets = preselect_blocks(scores, lc.preselect_block_count, lc.ada_budget, lc.ada_alpha,
                                exclude=[(0, self.ib)])
        allowed = torch.full((len(sets), max(1, max(len(s) for s in sets))), -1, dtype=torch.int32)
        for i, s in enumerate(sets):  # a few KV heads, once per prefill
            allowed[i, : len(s)] = s.to(torch.int32)
        self._set_allowed(layer, allowed, lb)
