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

Exact prefill only: sparse prefill's selection and DYNAMIC anchors (which need each chunk's attention
probabilities) read the prompt chunk by chunk (``prefill.order: chunk``; the config refuses the mix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ktquest.kv.attention import attention_lse, merge_attention

if TYPE_CHECKING:
    from ktquest.kv.long_context import LongContextCache

SLAB_TO_STORE = 4096  # tokens a layer's K/V cross to the store at a time (bounds the host copy)


class LongContextPromptLayers:
    """A prompt of ``n`` tokens at ``start`` read layer by layer into a ``LongContextCache`` (the protocol:
    ``KVCache.prompt_layers``). Where the past's keys lie and how a layer's windows move are the cache's
    (``_past``, ``_window_to``); this reads the prompt and keeps what undoes it."""

    def __init__(self, cache: LongContextCache, start: int, n: int):
        c = cache
        if c.cfg.prefill.mode != "exact" or c.lc.anchor_type == "DYNAMIC":
            raise ValueError("layer-major prefill reads a prompt exactly with linear anchors (prefill.mode: exact, "
                             "anchor_type not DYNAMIC)")
        end = start + n
        if n < 1:
            raise ValueError(f"layer-major prompt: {n} tokens")
        c._write_from(start, n)
        if c.buf0 > max(c.init_end, c._local_start(start)):  # _write_from puts buf0 back to <= it
            raise ValueError(f"long-context cache: its window buffer starts at {c.buf0}, past the local window "
                             f"of position {start}")
        self.cache, self.start, self.end, self.n = c, start, end, n
        self.init_rows, self.local_rows, self.lb = c._past(start)
        # The workspace: this layer's prompt K/V, [KVH, n, D] each, on the device
        self.k = torch.empty(c.KVH, n, c.D, device=c.device, dtype=c.dtype)
        self.v = torch.empty_like(self.k)
        self.device_bytes = c.prefill_device_bytes(n)  # the workspace and the queries in q_tail
        self._W = c.planner.q_win.shape[1]  # each layer's last W prompt queries, for SnapKV (recorded in done())
        self.q_tail: list[torch.Tensor | None] = [None] * c.n_layers
        self._saved: list[tuple] = []  # per layer moved: the window rows it overwrote (abort puts them back)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        """``KVCache.attend`` for the layer being read: q [T, H, D], k/v [T, KVH, D] at start_pos.. -> [T, H, D]."""
        c, T = self.cache, q.shape[0]
        j = start_pos - self.start  # the chunk's first workspace row
        if layer != len(self._saved) or not 0 <= j <= self.n - T:
            raise ValueError(f"layer-major prompt: layer {layer} at positions {start_pos}..{start_pos + T - 1}, "
                             f"but layer {len(self._saved)} reads positions {self.start}..{self.end - 1}")
        KVH, G, D = c.KVH, c.G, c.D
        self.k[:, j: j + T] = k.transpose(0, 1)
        self.v[:, j: j + T] = v.transpose(0, 1)
        qh = q.reshape(T, KVH, G, D).transpose(0, 1).reshape(KVH, T * G, D)  # [KVH, T*G, D]: rows (t, g)
        # ---- the chunk itself, causal: K/V repeated to the H query heads ([H, T, D], one chunk's worth) ----
        kc = self.k[:, j: j + T].repeat_interleave(G, 0)
        vc = self.v[:, j: j + T].repeat_interleave(G, 0)
        out, lse = attention_lse(q.transpose(0, 1), kc, vc, c.scale, causal=True)  # [H, T, D], [H, T] fp32
        out = out.view(KVH, G, T, D).transpose(1, 2).reshape(KVH, T * G, D)
        lse = lse.view(KVH, G, T).transpose(1, 2).reshape(KVH, T * G)
        # (each part merged as soon as it is made: device memory holds one part beside the union)
        if j > 0:  # ---- the prompt before the chunk ----
            out, lse = merge_attention(out, lse, *attention_lse(qh, self.k[:, :j], self.v[:, :j], c.scale))
        a, b = self.local_rows  # ---- the past's windows ----
        if self.init_rows or b > a:
            wk, wv = c.win_k[layer], c.win_v[layer]  # [KVH, rows, D]
            keys = torch.cat([wk[:, : self.init_rows], wk[:, a:b]], 1)  # [KVH, <= init + local, D]
            vals = torch.cat([wv[:, : self.init_rows], wv[:, a:b]], 1)
            out, lse = merge_attention(out, lse, *attention_lse(qh, keys, vals, c.scale))
            del keys, vals
        if self.lb > c.ib:  # ---- the past's context blocks, read in place from DRAM ----
            qs = qh.float().reshape(KVH * T * G, D).cpu().contiguous()
            o, s = c.store.attend(layer, qs, c._all_blocks[c.ib: self.lb])
            o, s = o.view(KVH, T * G, D).to(c.device), s.view(KVH, T * G).to(c.device)
            out, lse = merge_attention(out, lse, o, s)
        tail = q if self.q_tail[layer] is None else torch.cat([self.q_tail[layer], q])
        self.q_tail[layer] = tail[-self._W:].clone()
        return out.view(KVH, T, G, D).transpose(0, 1).reshape(T, c.H, D).to(q.dtype)

    def layer_done(self, layer: int) -> None:
        """The layer read the whole prompt: its K/V to the store (in slabs), its windows to the prompt's end."""
        c = self.cache
        for a in range(0, self.n, SLAB_TO_STORE):
            b = min(self.n, a + SLAB_TO_STORE)
            c.store.append(layer, self.k[:, a:b].transpose(0, 1).contiguous().cpu(),
                           self.v[:, a:b].transpose(0, 1).contiguous().cpu())
        self._saved.append(c._window_rows(layer, self.start))  # (before they move: abort puts them back)
        c._window_to(layer, self.start, self.k, self.v)

    def done(self) -> None:
        """Every layer read the prompt: the cache holds it; the workspace is freed."""
        c = self.cache
        if len(self._saved) != c.n_layers:
            raise ValueError(f"layer-major prompt: {len(self._saved)} of {c.n_layers} layers read it")
        c.planner.begin_prefill()  # (as a chunk-order pass: selections are stale, SnapKV preselects again)
        for layer, q in enumerate(self.q_tail):
            c.planner.record_queries(layer, q, self.end - q.shape[0])
        c.planner.queries_recorded(self.start, self.n)
        c.buf0 = max(c.init_end, c._local_start(self.end))
        c.pos = self.end
        self.k = self.v = self._saved = None

    def abort(self) -> None:
        """The read stopped part-way: the cache holds exactly what it held before the prompt."""
        c = self.cache
        c.store.truncate(-1, self.start)
        for layer, saved in enumerate(self._saved):
            c._window_back(layer, saved)
        self.k = self.v = self._saved = None
