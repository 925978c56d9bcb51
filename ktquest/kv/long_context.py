"""The long-context KV cache: heterogeneous attention over a DRAM block store and device-side windows.

Every layer's K/V go to a ``KVStore`` (CPU memory, ``kv_type``, block anchors). The initial window
(sink tokens) and the local window (the most recent tokens) are also kept on the device and attended
there densely; the context blocks between them are attended by the store's C++ operator, all of them
during prefill, a selected few per decode step. The two parts are merged exactly by their LSE.

The windows are block aligned, so the partition of the keys is exact (no token in both parts):

    blocks [0, ib)      init window    ib = ceil(init_windows_len / block_size)
    blocks [ib, lb)     context        the store's operator; decode selects among these (minus preselection)
    blocks [lb, ...)    local window   lb = floor((n - local_windows_len) / block_size), n = tokens after the pass

The device window buffers and their attention are ``kv/windows.py``'s.

A prompt's passes stay exact (a last chunk of one token too: ``begin_prompt`` tells it from a decode
step): the chunk's queries attend to the context blocks through ``store.attend``
with the queries regrouped as [KVH, T * G] "heads" (every query of a KV head's group, every context
block), so past K/V are read in place from DRAM in their stored type: nothing is copied back to the
device and nothing is dequantised into a buffer. It reads each past token once per chunk, i.e.
O(N^2 / chunk_size) token reads for an N-token prompt, the same O(N^2) work as dense attention.

Which context blocks a decode step attends to is the planner's (``kv/plan.py``); on the CPU a whole decode
token is planned here (``plan_decode``) and run by ``ktquest.native.decode`` in one native call.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ktquest.config import Config, ConfigError, LongContextConfig
from ktquest.kv.attention import merge_attention
from ktquest.kv.layer_prefill import LongContextPromptLayers
from ktquest.kv.long_context_state import LongContextFileState
from ktquest.kv.memory import check_kv_type, check_store_fits, layer_major_tokens
from ktquest.kv.plan import DecodePlanner, Selection, SelectionStats
from ktquest.kv.windows import DeviceWindows, PassGeometry
from ktquest.native.plans import TokenPlan
from ktquest.native.store import KVStore


class LongContextCache(DeviceWindows, LongContextFileState):
    """A ``KVCache`` (kv/base.py) over a DRAM block store and device windows: see the module docstring."""

    def __init__(self, args, cfg: Config, max_seq_len: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        lc = cfg.long_context
        self.lc, self.cfg = lc, cfg
        self.n_layers, self.max_seq_len = args.n_layers, max_seq_len
        self.H, self.KVH, self.D = args.n_heads, args.n_kv_heads, args.head_dim
        self.G = self.H // self.KVH
        check_kv_type(lc, self.D)
        if lc.init_windows_len + lc.local_windows_len > max_seq_len:
            raise ConfigError(f"long_context.local_windows_len={lc.local_windows_len} is not allowed: "
                              f"init_windows_len + local_windows_len must be <= max_seq_len ({max_seq_len})")
        check_store_fits(lc, args, max_seq_len, cfg.chunk_size, layer_major_tokens(cfg, max_seq_len))
        self.device, self.dtype = torch.device(device), dtype
        self.bs = lc.block_size
        self.ib = -(-lc.init_windows_len // self.bs)  # init window blocks
        self.init_end = self.ib * self.bs
        # No pass is longer than the cache: a chunk_size past max_seq_len must not size the window buffer
        self.chunk_size = min(cfg.chunk_size, max_seq_len)
        self.cap = lc.local_windows_len + self.bs + self.chunk_size  # local buffer capacity, tokens
        threads = lc.threads_num or cfg.resolved_threads()
        try:  # the RAM check passed, yet the reservation can still fail (strict overcommit, address space)
            self.store = KVStore(self.n_layers, self.KVH, self.D, max_seq_len, self.bs, lc.kv_type, lc.anchor_type,
                                 lc.anchor_num, threads, lc.int8_candidates, lc.index_group, lc.quest_centre,
                                 lc.sticky_blocks)
        except MemoryError as e:
            raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: {e}; lower max_seq_len") from None
        shape = (self.n_layers, self.KVH, self.init_end + self.cap, self.D)
        self.win_k = torch.zeros(shape, device=self.device, dtype=dtype)  # [L, KVH, init_end + cap, D]
        self.win_v = torch.zeros(shape, device=self.device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(self.D)
        self.threads = threads
        # A CPU fp32 decode step is native (cpp/decode/layer_step: window, store part and LSE merge in one call);
        # DYNAMIC anchors need the attention probabilities, which only the explicit torch path returns.
        self._native_decode = self.device.type == "cpu" and dtype == torch.float32 and lc.anchor_type != "DYNAMIC"
        # numpy views of each layer's window buffers for the native decode calls (the buffers are never replaced)
        self._win_np = [(self.win_k[i].numpy(), self.win_v[i].numpy()) for i in range(self.n_layers)] \
            if self._native_decode else None
        self._all_blocks = torch.arange(-(-max_seq_len // self.bs), dtype=torch.int32)  # [max_blocks]
        self._out = torch.empty(self.H, self.D)  # decode: the store part, fp32 [H, D]
        self._lse = torch.empty(self.H)  # [H]
        self.planner = DecodePlanner(lc, self.store, self.n_layers, self.H, self.D, self.ib, self._all_blocks,
                                     self.device, dtype, max_seq_len)
        self.reset()

    # ---- bookkeeping ----

    def begin_prompt(self, end: int) -> None:
        """The prompt read next ends at position ``end``: with sparse prefill its last ``prefill.exact_tail``
        tokens read every block (a pass that was not announced has no exact tail), and a pass
        of one token that ends by ``end`` is the prompt's (exact, its query recorded for SnapKV), not a
        decode step."""
        self.exact_from = end - self.cfg.prefill.exact_tail
        self.prompt_end = end

    def prompt_layers(self, start: int, n: int) -> LongContextPromptLayers:
        """A prompt of ``n`` tokens at ``start`` read layer by layer (``KVCache.prompt_layers``; kv/layer_prefill.py)."""
        return LongContextPromptLayers(self, start, n)

    def prefill_device_bytes(self, n: int) -> int:
        """Device bytes a layer-major prompt of ``n`` tokens adds: its K/V of one layer, each layer's last
        prompt queries kept for the planner, and the past's windows gathered for a chunk (kv/layer_prefill.py)."""
        W = min(self.planner.q_win.shape[1], n)
        rows = 2 * self.KVH * (n + self.win_k.shape[2]) + self.n_layers * W * self.H
        return rows * self.D * self.win_k.element_size()

    def reset(self) -> None:
        """Forget every token (the memory is kept)."""
        self.store.truncate(-1, 0)
        self.pos = 0
        self.buf0 = self.init_end  # position of window index init_end
        self.geo = PassGeometry()
        self.exact_from = self.max_seq_len  # begin_prompt: queries from it on read every block
        self.prompt_end = 0  # begin_prompt: a one-token pass that ends by it is a prompt's, not a decode step
        self.planner.reset()

    # long_context keys that only the decode steps read: ``retune`` changes them on a filled cache; the SnapKV
    # ones choose the candidates again at the next decode step, from the prompt's recorded queries
    PRESELECT_KEYS = ("preselect_block", "preselect_block_count", "preselect_pool_kernel", "ada_budget",
                      "ada_alpha", "ada_gqa_merge")
    RETUNABLE = ("second_select_num", "sticky_blocks", "token_step", "layer_step", "dense_layer_num",
                 "preselect_refresh", *PRESELECT_KEYS)

    def retune(self, lc: LongContextConfig) -> LongContextConfig:
        """Select by ``lc`` from the next decode step on; it differs from this cache's knobs in ``RETUNABLE``
        keys only. The tokens and the store stay, the selections kept so far are dropped; SnapKV's candidates
        stay unless a ``PRESELECT_KEYS`` knob changed, and are then chosen again at the next decode step by
        the last prompt's recorded queries, over the context as it stands (a prompt read again: as when it
        was first read). So one prompt read once is answered under several selections (tools/eval_longctx.py
        --variant). Returns the knobs before. The engine's config, and a KV file saved from the cache, still
        show the ones it was loaded with."""
        changed = [f.name for f in dataclasses.fields(lc) if getattr(lc, f.name) != getattr(self.lc, f.name)]
        fixed = [k for k in changed if k not in self.RETUNABLE]
        if fixed:
            raise ConfigError(f"long_context.{fixed[0]} is not a decode-time knob: it cannot change once the cache "
                              f"is made (only {', '.join(self.RETUNABLE)} can); load the engine with it instead")
        old = self.lc
        self.store.set_sticky_blocks(lc.sticky_blocks)
        self.lc = self.planner.lc = lc
        self.planner.forget_selections()
        if any(k in self.PRESELECT_KEYS for k in changed):
            self.planner.preselect_again()
        return old

    def rewind_point(self, n: int) -> int:
        """``KVCache.rewind_point``: every prefix is kept exactly."""
        return n

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (0 <= n <= pos); the device windows are refilled from the store."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"truncate({n}): must be between 0 and the {self.pos} tokens held")
        self.store.truncate(-1, n)  # also drops what an interrupted pass appended to the first layers
        self.prompt_end = min(self.prompt_end, n)
        self._window_back_to(n)  # (n == pos too: a cut pass may have compacted past n's local window)
        if n == self.pos:
            return
        self.pos = n
        self.planner.truncated(n)

    def _window_back_to(self, n: int) -> None:
        """With ``n`` tokens held, the buffer holds the local window of n again (``buf0`` <= its start):
        where it starts past it (after a truncate, or after a prompt's pass that compacted up to its own
        local window and was cut), the rows it still holds move right and the positions [loc0, buf0) come
        from the store."""
        loc0 = self._local_start(n)  # >= init_end: with n <= init_end the init window holds them all
        if loc0 >= self.buf0:
            return
        ie, kept = self.init_end, max(0, n - self.buf0)
        shift, m = self.buf0 - loc0, min(n, self.buf0) - loc0
        for layer in range(self.n_layers if loc0 < n else 0):
            for buf in (self.win_k, self.win_v):
                buf[layer, :, ie + shift: ie + shift + kept] = buf[layer, :, ie: ie + kept].clone()
            k, v = self.store.read_range(layer, loc0, loc0 + m)  # [m, KVH, D] fp32
            self.win_k[layer, :, ie: ie + m] = k.transpose(0, 1).to(self.win_k)
            self.win_v[layer, :, ie: ie + m] = v.transpose(0, 1).to(self.win_v)
        self.buf0 = loc0

    def nbytes(self) -> int:
        """KV bytes held: the DRAM store's blocks in use, its copy of the candidates, the device windows."""
        return self.store.nbytes() + self.store.cand_nbytes() + self.device_kv_bytes()

    def device_kv_bytes(self) -> int:
        """Bytes of K/V held on the device (the windows; fixed at construction)."""
        return self.win_k.nbytes + self.win_v.nbytes + self.planner.q_win.nbytes

    # ---- the pass ----

    def _write_from(self, start: int, T: int) -> None:
        """Positions [start, start + T) are written next (by a pass or a layer-major prompt): the cache drops
        what it holds from ``start`` on, and what an interrupted pass left; ValueError where they cannot go."""
        if start != self.pos:
            if start > self.pos or start < 0:
                raise ValueError(f"KV cache: cannot write positions {start}..{start + T - 1}: the cache holds "
                                 f"{self.pos} tokens, so a chunk must start at {self.pos}")
            self.truncate(start)  # rewrite from an earlier position: forget the rest
        elif self.store.length(0) != start:  # a pass interrupted half-way: drop its first layers' tokens
            self.store.truncate(-1, start)
            self.planner.pass_abandoned()
        self._window_back_to(start)  # a pass cut after it compacted (even before it stored anything)
        if start + T > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {start}..{start + T - 1} do not fit in "
                             f"max_seq_len={self.max_seq_len} (the cache holds {self.pos} tokens)")

    def _begin_pass(self, start: int, T: int) -> None:
        """Geometry for positions [start, start + T), set up once (at layer 0) for every layer."""
        self._write_from(start, T)
        if T > self.chunk_size:
            raise ValueError(f"long-context cache: {T} tokens in one pass exceed chunk_size={self.chunk_size}")
        # The local window of this pass: strictly the last local_windows_len tokens of start + T, but never
        # past the store's full blocks (a context block must be in the store before the chunk).
        loc0 = max(self.init_end, min(self._local_start(start + T), start // self.bs * self.bs))
        # Compact (move [loc0, start) to the front of the local part) when the pass would not fit, in a
        # prompt's pass of several tokens whenever rows left the window (then the window attention scores
        # no dead rows; at most local_windows_len rows move, none in million.yaml's full prefill chunks),
        # or in decode once a quarter of the window is dead weight that every step would read and mask.
        # (A cut pass leaves buf0 at its loc0, past the local window of the positions held: _window_back_to.)
        if (start + T - self.buf0 > self.cap or (T > 1 and loc0 > self.buf0)
                or (T == 1 and loc0 - self.buf0 > max(self.bs, self.cap // 4))):
            m, off = start - loc0, self.init_end + loc0 - self.buf0
            for buf in (self.win_k, self.win_v):
                buf[:, :, self.init_end: self.init_end + m] = buf[:, :, off: off + m].clone()
            self.buf0 = loc0
        width = self.init_end + start + T - self.buf0 if start + T > self.init_end else start + T
        # Additive mask [T, W]: query start+i sees window index j iff its position p(j) <= start+i and
        # p(j) is in the init window or in [loc0, ...). Decode sees every index but the dropped ones.
        drop = loc0 - self.buf0 if start >= self.init_end else 0  # positions [buf0, loc0) left the window
        skip = (0, 0)
        decode = T == 1 and start + T > self.prompt_end
        if decode:
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
        self.geo = PassGeometry(start, T, loc0, mask, rows, width, skip, decode)
        if not decode:
            self.planner.begin_prefill()
        else:
            self.planner.begin_decode()

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
        if g.decode and self._native_decode:
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
            if g.decode:
                out_s, lse_s = self._decode_context(layer_idx, q, lb)
                out_s, lse_s = out_s.to(self.device)[None], lse_s.to(self.device)[None]
            else:
                out_s, lse_s = self._prefill_context(layer_idx, q, lb)
            out_w, _ = merge_attention(out_w, lse_w, out_s, lse_s)
        # ---- the chunk goes to the store (after attention: the store part never sees it) ----
        kc, vc = k.contiguous(), v.contiguous()
        if kc.device.type != "cpu":
            kc, vc = kc.cpu(), vc.cpu()
        self.store.append(layer_idx, kc, vc, imp)
        if not g.decode:
            self.planner.record_queries(layer_idx, q, start_pos)
        if layer_idx == self.n_layers - 1:
            self.pos = start_pos + T
            if not g.decode:
                self.planner.queries_recorded(start_pos, T)
        return out_w.to(q.dtype)

    def _prefill_context(self, layer: int, q: torch.Tensor, lb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of every chunk query to the context blocks [ib, lb) (all of them, or with sparse prefill
        those ``_prefill_blocks`` picks), read in place from DRAM."""
        T = q.shape[0]
        blocks = self._prefill_blocks(layer, q, lb)  # [n]: every block; [KVH, n]: sparse picks
        cut = min(max(self.exact_from - self.geo.start, 0), T)  # queries [cut, T): the prompt's exact tail
        if blocks.dim() == 1 or cut == T:
            return self._read_context(layer, q, blocks)
        every = self._all_blocks[self.ib: lb]
        (o1, s1), (o2, s2) = self._read_context(layer, q[:cut], blocks), self._read_context(layer, q[cut:], every)
        return torch.cat([o1, o2]), torch.cat([s1, s2])

    def _read_context(self, layer: int, q: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] attends the store's ``blocks`` of ``layer`` ([KVH, n] per KV head, or [n] for every
        head): (out [T, H, D], lse [T, H]) fp32 on the device."""
        T, KVH, G, D = q.shape[0], self.KVH, self.G, self.D
        # Query "head" (kvh, t, g) reads KV head kvh: the store's grouping h // (H' / KVH) with H' = KVH*T*G.
        qs = q.float().reshape(T, KVH, G, D).permute(1, 0, 2, 3).reshape(KVH * T * G, D).cpu().contiguous()
        out, lse = self.store.attend(layer, qs, blocks)
        out = out.view(KVH, T, G, D).permute(1, 0, 2, 3).reshape(T, self.H, D)
        lse = lse.view(KVH, T, G).permute(1, 0, 2).reshape(T, self.H)
        return out.to(self.device), lse.to(self.device)

    def _prefill_blocks(self, layer: int, q: torch.Tensor, lb: int) -> torch.Tensor:
        """The context blocks a prefill chunk attends. Exact prefill (and sparse before ``prefill.exact_tokens``,
        while the context holds at most ``prefill.blocks`` blocks, or in a chunk within the prompt's last
        ``prefill.exact_tail`` tokens: ``begin_prompt``): every block of [ib, lb), [n]. (A chunk that
        reaches into that tail takes the sparse picks; ``_prefill_context`` gives its tail queries every
        block.) Sparse: per KV
        head the ``prefill.blocks`` blocks whose anchor scores, summed over ``select_queries`` of the chunk's
        queries (spread over it, its last included) and their query heads, are highest, plus the chunk's length
        of blocks just before the local window (the local window ends with the chunk, so its first queries
        would otherwise see no recent token before themselves): [KVH, n] int32, ascending, -1 padded. The
        choice is the store's selection, pruned by the hierarchical index when ``index_group`` > 0 (a chunk
        then scores the N / (block_size * index_group) group bounds and the blocks of the groups that may hold
        a pick, not all N / block_size blocks)."""
        pf = self.cfg.prefill
        if (pf.mode != "sparse" or self.geo.start < pf.exact_tokens or lb - self.ib <= pf.blocks
                or self.geo.start >= self.exact_from):
            return self._all_blocks[self.ib: lb]
        T, KVH, G, D = q.shape[0], self.KVH, self.G, self.D
        R = min(pf.select_queries, T)
        pick = torch.linspace(0, T - 1, R).round().long()  # [R]
        qs = q[pick].float().reshape(R, KVH, G, D).permute(1, 0, 2, 3).reshape(KVH * R * G, D).cpu().contiguous()
        picked = self.store.select(layer, qs, pf.blocks, "SEPARATE", [(0, self.ib), (lb, self.store.n_blocks(layer))])
        recent = torch.arange(max(self.ib, lb - -(-T // self.bs)), lb).expand(KVH, -1)  # [KVH, <= T / bs]
        blocks = torch.cat([picked.long(), recent], 1)
        big = torch.iinfo(torch.int64).max  # the -1 padding and the repeats sort last, then become -1
        blocks = blocks.masked_fill(blocks < 0, big).sort(dim=1).values
        blocks[:, 1:].masked_fill_(blocks[:, 1:] == blocks[:, :-1], big)
        blocks = blocks.sort(dim=1).values
        return blocks.masked_fill_(blocks == big, -1).to(torch.int32).contiguous()

    # ---- decode: which context blocks ----

    def plan_decode(self, pos: int) -> TokenPlan | None:
        """The native plan of a decode token at ``pos`` (``KVCache.plan_decode``): every layer's window
        geometry and store part (``DecodePlanner.token_steps``). None where the native path does not apply
        (a GPU, DYNAMIC anchors) or the token is a prompt's (``begin_prompt``: read exactly, through
        ``attend``)."""
        if not self._native_decode or pos < self.prompt_end:
            return None
        self._begin_pass(pos, 1)
        g = self.geo
        assert g.decode
        steps = self.planner.token_steps(g.loc0 // self.bs)
        return TokenPlan(pos, self.store, self._win_np, self._window_row(pos), g.width, g.skip, self.scale,
                         steps.plans, state=steps)

    def commit_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` is in every layer."""
        self.planner.token_done(plan.state)
        self.pos = plan.pos + 1

    def abort_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` raised part-way: some layers may hold it (the next pass drops them)."""
        self.planner.token_failed()

    # ---- what the planner did (documented for tests and tools) ----

    @property
    def stats(self) -> SelectionStats:
        return self.planner.stats

    def selection(self, layer: int) -> Selection | None:
        """``layer``'s last block selection (ids [n_sets, k] -1 padded, the context end ``lb`` it covers)."""
        return self.planner.selection(layer)

    def candidates(self, layer: int) -> torch.Tensor | None:
        """``layer``'s SnapKV candidates [n_sets, N] (-1 padded), or None: every context block."""
        return self.planner.candidates(layer)

    def context_blocks(self) -> tuple[int, int]:
        """The context blocks [ib, lb) of the last pass: between the init window and the local window."""
        return self.ib, self.geo.loc0 // self.bs

    def _decode_native(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       start_pos: int) -> torch.Tensor:
        """attend() for one token on the CPU in one native call (cpp/decode/layer_step.h): window write, dense window
        attention, the store part as the planner says, LSE merge and the store append. q [1, H, D] -> [1, H, D]."""
        qc = q[0].contiguous()  # [H, D]
        lb = self.geo.loc0 // self.bs
        blocks, select = self.planner.plan(layer, lb) if lb > self.ib else (None, None)
        g = self.geo
        out = torch.empty(1, self.H, self.D)
        ids = self.store.decode_step(layer, qc, k[0].contiguous(), v[0].contiguous(), self.win_k[layer],
                                     self.win_v[layer], self._window_row(start_pos), g.width, g.skip, self.scale, self.threads, out[0],
                                     blocks, select)
        if ids is not None:
            self.planner.record(layer, ids, lb)
        if layer == self.n_layers - 1:
            self.pos = start_pos + 1
        return out

    def _decode_context(self, layer: int, q: torch.Tensor, lb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [1, H, D] -> (out [H, D], lse [H]) fp32 on the CPU over the selected context blocks."""
        qc = q[0].float()
        qc = (qc.cpu() if qc.device.type != "cpu" else qc).contiguous()  # [H, D]
        blocks, select = self.planner.plan(layer, lb)
        if select is None:
            return self.store.attend(layer, qc, blocks, self._out, self._lse)
        out, lse, ids = self.store.select_attend(layer, qc, select.k, select.mode, select.exclude_ranges,
                                                 select.allowed, self._out, self._lse, select.ada_alpha)
        self.planner.record(layer, ids, lb)
        return out, lse
