"""Layer-major prefill into the long-context cache: one layer reads the whole prompt, then the next.

``generate.prefill`` with ``prefill.order: layer`` runs the model one layer at a time over every chunk of the
prompt (``Transformer.prefill_layers``; the hidden states wait in host memory). While layer l reads the
prompt, the prompt's K/V of that layer stay on the device in one workspace, and a chunk of queries at
positions [s, s + T) attends four disjoint key sets, merged exactly by their LSE:

    the chunk itself          workspace rows [s - P, s - P + T), causal       device
    the prompt before it      workspace rows [0, s - P)                        device
    the past's windows        window rows: positions < init_end, [loc0, P)     device
    the past's context        store blocks [ib, loc0 / block_size)              the store's operator (CPU)

where P is the prompt's first position and loc0 the past's local-window start. A first prompt (P = 0) has no
past: every attention of the prompt then runs on the device. When the layer is done, its K/V cross to the
DRAM store once, in bulk, and its window buffers take the prompt's last tokens. Device memory: the workspace
(2 x KVH x n x D values of the compute dtype), each layer's last prompt queries for the planner and the past
windows gathered for a chunk (``prefill_device_bytes``) beside one chunk's activations;
``prefill.slab_tokens`` bounds n by reading a longer prompt as several layer-major slabs.

With dual chunk attention (models/dual_chunk.py) the model sends each chunk's queries in three rotations: past
the first chunk each part is read by the rotation its keys' chunk calls for (``dca_range``; the store's blocks by
their bounds), within it by the intra one, the plain query.

Exact prefill only: sparse prefill's selection and DYNAMIC anchors (which need each chunk's attention
probabilities) read the prompt chunk by chunk (``prefill.order: chunk``; the config refuses the mix).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ktquest.kv.attention import attention_lse, merge_attention
from ktquest.kv.dual_chunk_attention import dca_range, merge_parts
from ktquest.kv.long_context_pass import Shape, read_context
from ktquest.kv.plan import DecodePlanner
from ktquest.kv.windows import Windows
from ktquest.models.dual_chunk import DualChunk
from ktquest.native.store import KVStore

SLAB_TO_STORE = 4096  # tokens a layer's K/V cross to the store at a time (bounds the host copy)


def workspace_bytes(shape: Shape, windows: Windows, q_win: torch.Tensor, n: int) -> int:
    """Device bytes a layer-major prompt of ``n`` tokens holds beside the cache: its K/V of one layer, each
    layer's last prompt queries kept for the planner (as its ``q_win`` [L, W, heads, D] holds them), and the
    past's windows gathered for a chunk."""
    rows = 2 * shape.n_kv_heads * (n + windows.k.shape[2]) + len(windows.k) * min(q_win.shape[1], n) * q_win.shape[2]
    return rows * shape.head_dim * windows.k.element_size()


class LongContextPromptLayers:
    """A prompt of ``n`` tokens at ``start`` read layer by layer into a long-context cache's parts (the protocol:
    ``KVCache.prompt_layers``; the cache has dropped what it held from ``start`` on). Where the past's keys lie
    and how a layer's windows move are the windows' (``Windows.past``, ``move_to``); this reads the prompt and
    keeps what undoes it. ``on_done(end)``: every layer holds the prompt. preselect_lb: where this prompt ends the
    one announced (``begin_prompt``), the first decode step's context end: SnapKV scores each layer's context as
    the layer finishes (``DecodePlanner.preselect_read``)."""

    def __init__(self, shape: Shape, windows: Windows, store: KVStore, planner: DecodePlanner, start: int, n: int,
                 on_done: Callable[[int], None], preselect_lb: int | None = None, dual_chunk: DualChunk | None = None):
        if shape.prefill.mode != "exact" or shape.dynamic:
            raise ValueError("layer-major prefill reads a prompt exactly with linear anchors (prefill.mode: exact, "
                             "anchor_type not DYNAMIC)")
        if n < 1:
            raise ValueError(f"layer-major prompt: {n} tokens")
        if windows.buf0 > windows.local_start(start):  # the cache's write_from puts buf0 back to <= it
            raise ValueError(f"long-context cache: its window buffer starts at {windows.buf0}, past the local "
                             f"window of position {start}")
        self.shape, self.windows, self.store, self.planner = shape, windows, store, planner
        self.start, self.end, self.n, self._on_done, self._lb = start, start + n, n, on_done, preselect_lb
        self.dual_chunk = dual_chunk
        self.init_rows, self.local_rows, self.lb = windows.past(start, shape.ib)
        p = shape.placement
        # The workspace: this layer's prompt K/V, [KVH, n, D] each, on the device
        self.k = torch.empty(shape.n_kv_heads, n, shape.head_dim, device=p.device, dtype=p.dtype)
        self.v = torch.empty_like(self.k)
        self._W = planner.q_win.shape[1]  # each layer's last W prompt queries, for SnapKV (recorded in done())
        self.device_bytes = workspace_bytes(shape, windows, planner.q_win, n)
        self.q_tail: list[torch.Tensor | None] = [None] * len(windows.k)
        self._saved: list[tuple] = []  # per layer moved: the window rows it overwrote (abort puts them back)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        """``KVCache.attend`` for the layer being read: q [T, H, D] (with dual chunk attention [3, T, H, D]), k/v
        [T, KVH, D] at start_pos.. -> [T, H, D]."""
        s, T = self.shape, q.shape[-3]
        if (q.dim() == 4) != (self.dual_chunk is not None):
            raise ValueError(f"layer-major prompt {'with' if self.dual_chunk else 'without'} dual chunk attention: "
                             f"q of shape {tuple(q.shape)} (make the cache with the model's args.dual_chunk)")
        j = start_pos - self.start  # the chunk's first workspace row
        if layer != len(self._saved) or not 0 <= j <= self.n - T:
            raise ValueError(f"layer-major prompt: layer {layer} at positions {start_pos}..{start_pos + T - 1}, "
                             f"but layer {len(self._saved)} reads positions {self.start}..{self.end - 1}")
        KVH, G, D = s.n_kv_heads, s.group, s.head_dim
        self.k[:, j: j + T] = k.transpose(0, 1)
        self.v[:, j: j + T] = v.transpose(0, 1)
        self._record(layer, self.planner.rows(q))
        if q.dim() == 4 and self.dual_chunk.active(start_pos + T):
            return self._attend_dca(layer, q, j, start_pos)
        q = q if q.dim() == 3 else q[0]  # (within the first chunk the intra rotation is the plain query)
        qh = q.reshape(T, KVH, G, D).transpose(0, 1).reshape(KVH, T * G, D)  # [KVH, T*G, D]: rows (t, g)
        # ---- the chunk itself, causal: K/V repeated to the H query heads ([H, T, D], one chunk's worth) ----
        kc = self.k[:, j: j + T].repeat_interleave(G, 0)
        vc = self.v[:, j: j + T].repeat_interleave(G, 0)
        out, lse = attention_lse(q.transpose(0, 1), kc, vc, s.scale, causal=True)  # [H, T, D], [H, T] fp32
        out = out.view(KVH, G, T, D).transpose(1, 2).reshape(KVH, T * G, D)
        lse = lse.view(KVH, G, T).transpose(1, 2).reshape(KVH, T * G)
        # (each part merged as soon as it is made: device memory holds one part beside the union)
        if j > 0:  # ---- the prompt before the chunk ----
            out, lse = merge_attention(out, lse, *attention_lse(qh, self.k[:, :j], self.v[:, :j], s.scale))
        a, b = self.local_rows  # ---- the past's windows ----
        if self.init_rows or b > a:
            keys, vals = self.windows.gather(layer, self.init_rows, self.local_rows)  # [KVH, <= init + local, D]
            out, lse = merge_attention(out, lse, *attention_lse(qh, keys, vals, s.scale))
            del keys, vals
        if self.lb > s.ib:  # ---- the past's context blocks, read in place from DRAM ----
            qs = s.placement.to_host(qh.float().reshape(KVH * T * G, D))
            o, sc = self.store.attend(layer, qs, s.all_blocks[s.ib: self.lb])
            o, sc = s.placement.to_device(o.view(KVH, T * G, D)), s.placement.to_device(sc.view(KVH, T * G))
            out, lse = merge_attention(out, lse, o, sc)
        return out.view(KVH, T, G, D).transpose(0, 1).reshape(T, s.n_heads, D).to(q.dtype)

    def _record(self, layer: int, q: torch.Tensor) -> None:
        tail = q if self.q_tail[layer] is None else torch.cat([self.q_tail[layer], q])
        self.q_tail[layer] = tail[-self._W:].clone()

    def _attend_dca(self, layer: int, qv: torch.Tensor, j: int, start_pos: int) -> torch.Tensor:
        """``attend`` past dual chunk attention's first chunk: the chunk's queries by chunk, each over the prompt
        up to itself, the past's windows and the past's context blocks, every key by its chunk's rotation."""
        s, T, dc, bs = self.shape, qv.shape[1], self.dual_chunk, self.shape.block_size
        out = torch.empty(T, s.n_heads, s.head_dim, dtype=torch.float32, device=qv.device)
        (a, b), kw, vw = self.local_rows, self.windows.k[layer], self.windows.v[layer]
        for qa, qb, ci in dc.groups(start_pos, T):
            rows = slice(qa - start_pos, qb - start_pos)
            qg = qv[:, rows]
            parts = [dca_range(qg, qa, self.k[:, : qb - self.start], self.v[:, : qb - self.start], self.start,
                               s.scale, dc),
                     dca_range(qg, qa, kw[:, : self.init_rows], vw[:, : self.init_rows], 0, s.scale, dc),
                     dca_range(qg, qa, kw[:, a:b], vw[:, a:b], self.lb * bs, s.scale, dc)]
            if self.lb > s.ib:  # the past's context blocks, the rotations' bounds in blocks
                parts.append(read_context(s, self.store, layer, qg, s.all_blocks[s.ib: self.lb],
                                          dc.block_bounds(ci, bs)))
            out[rows] = merge_parts(parts)[0]
        return out.to(qv.dtype)

    def layer_done(self, layer: int) -> None:
        """The layer read the whole prompt: its K/V to the store (in slabs), its windows to the prompt's end."""
        if layer != len(self._saved):
            raise ValueError(f"layer-major prompt: layer {layer} is done, but layer {len(self._saved)} is read next")
        if self.q_tail[layer] is None:
            raise ValueError(f"layer-major prompt: layer {layer} is done before it read any chunk")
        p = self.shape.placement
        for a in range(0, self.n, SLAB_TO_STORE):
            b = min(self.n, a + SLAB_TO_STORE)
            self.store.append(layer, p.to_host(self.k[:, a:b].transpose(0, 1)), p.to_host(self.v[:, a:b].transpose(0, 1)))
        self._saved.append(self.windows.saved_rows(layer, self.start))  # (before they move: abort puts them back)
        self.windows.move_to(layer, self.start, self.k, self.v)
        if self._lb is not None:  # the end of a prompt a reply follows: SnapKV scores the layer's context now
            self.planner.preselect_read(layer, self.q_tail[layer], self.start, self.n, self._lb)

    def done(self) -> None:
        """Every layer read the prompt: the cache holds it; the workspace is freed."""
        n_layers = len(self.windows.k)
        if len(self._saved) != n_layers:
            raise ValueError(f"layer-major prompt: {len(self._saved)} of {n_layers} layers read it")
        self.planner.begin_prefill()  # (as a chunk-order pass: selections are stale, SnapKV preselects again)
        for layer, q in enumerate(self.q_tail):
            self.planner.record_queries(layer, q, self.end - q.shape[0])
        self.planner.queries_recorded(self.start, self.n)  # (and SnapKV's candidates chosen in layer_done)
        self.windows.moved(self.end)
        self._on_done(self.end)
        self.k = self.v = self._saved = None

    def abort(self) -> None:
        """The read stopped part-way: the cache holds exactly what it held before the prompt."""
        self.store.truncate(-1, self.start)
        self.planner.pass_abandoned()  # (drops the candidates that layer_done chose)
        for layer, saved in enumerate(self._saved):
            self.windows.put_back(layer, saved)
        self.k = self.v = self._saved = None
