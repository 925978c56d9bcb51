"""The long-context KV cache: heterogeneous attention over a DRAM block store and device-side windows.

Every layer's K/V go to a ``KVStore`` (CPU memory, ``kv_type``, block anchors). The initial window
(sink tokens) and the local window (the most recent tokens) are also kept on the device and attended
there densely; the context blocks between them are attended by the store's C++ operator, all of them
during prefill, a selected few per decode step. The two parts are merged exactly by their LSE.

The windows are block aligned, so the partition of the keys is exact (no token in both parts):

    blocks [0, ib)      init window    ib = ceil(init_windows_len / block_size)
    blocks [ib, lb)     context        the store's operator; decode selects among these (minus preselection)
    blocks [lb, ...)    local window   lb = floor((n - local_windows_len) / block_size), n = tokens after the pass

This module composes the parts and keeps the ``KVCache`` protocol: the device windows (``kv/windows.py``), the
store, the decode planner (``kv/plan.py``: which context blocks a decode step attends) and the execution of a
pass (``kv/long_context_pass.py``). A prompt's passes stay exact (a last chunk of one token too:
``begin_prompt`` tells it from a decode step); on the CPU a whole decode token is planned here
(``plan_decode``) and run by ``ktquest.native.decode`` in one native call.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ktquest.config import Config, ConfigError, LongContextConfig
from ktquest.kv import long_context_pass as passes
from ktquest.kv import plan_files
from ktquest.kv.base import DeviceToken
from ktquest.kv.layer_prefill import LongContextPromptLayers, workspace_bytes
from ktquest.kv.memory import check_kv_type, check_store_fits, layer_major_tokens
from ktquest.kv.placement import Placement
from ktquest.kv.plan import DecodePlanner, Selection, SelectionStats
from ktquest.kv.windows import PassGeometry, Windows
from ktquest.models.dual_chunk import DualChunk, long_context_refusal
from ktquest.native.plans import TokenPlan, store_layer
from ktquest.native.store import KVStore


class LongContextCache:
    """A ``KVCache`` (kv/base.py) over a DRAM block store and device windows: see the module docstring."""

    def __init__(self, args, cfg: Config, max_seq_len: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, dual_chunk: DualChunk | None = None):
        lc = cfg.long_context
        self.lc, self.cfg = lc, cfg
        self.n_layers, self.max_seq_len = args.n_layers, max_seq_len
        H, KVH, D = args.n_heads, args.n_kv_heads, args.head_dim
        check_kv_type(lc, D)
        if lc.preselect_block and lc.preselect_window * (H // KVH) > 1 << 14:  # (the store's SnapKV rows)
            raise ConfigError(f"long_context.preselect_window={lc.preselect_window} is not allowed for this model: "
                              f"its {H // KVH} query heads a KV head allow at most {(1 << 14) // (H // KVH)}")
        if lc.init_windows_len + lc.local_windows_len > max_seq_len:
            raise ConfigError(f"long_context.local_windows_len={lc.local_windows_len} is not allowed: "
                              f"init_windows_len + local_windows_len must be <= max_seq_len ({max_seq_len})")
        check_store_fits(lc, args, max_seq_len, cfg.chunk_size, layer_major_tokens(cfg, max_seq_len))
        # dual chunk attention (models/dual_chunk.py): the model sends q as [3, T, H, D]; the store attends each
        # block by its chunk's rotation, so a chunk is whole blocks
        self.dual_chunk = dual_chunk
        why = None if dual_chunk is None else long_context_refusal(dual_chunk, lc)
        if why is not None:
            raise ConfigError(f"dual chunk attention with {why}")
        self.placement = Placement.of(device, dtype)
        bs = lc.block_size
        ib = -(-lc.init_windows_len // bs)  # init window blocks
        self.init_end = ib * bs
        # No pass is longer than the cache: a chunk_size past max_seq_len must not size the window buffer
        self.chunk_size = min(cfg.chunk_size, max_seq_len)
        threads = lc.threads_num or cfg.resolved_threads()
        try:  # the RAM check passed, yet the reservation can still fail (strict overcommit, address space)
            self.store = KVStore(self.n_layers, KVH, D, max_seq_len, bs, lc.kv_type, lc.anchor_type,
                                 lc.anchor_num, threads, lc.int8_candidates, lc.index_group, lc.quest_centre,
                                 lc.sticky_blocks)
        except MemoryError as e:
            raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: {e}; lower max_seq_len") from None
        cap = lc.local_windows_len + bs + self.chunk_size  # the local part's rows
        self.windows = Windows(self.n_layers, KVH, D, self.init_end, lc.local_windows_len, bs, cap, self.placement)
        dynamic = lc.anchor_type == "DYNAMIC"
        all_blocks = torch.arange(-(-max_seq_len // bs), dtype=torch.int32)  # [max_blocks]
        # A CPU fp32 decode step is native (window, store part and LSE merge in one call: cpp/decode/); DYNAMIC
        # anchors need the attention probabilities, which only the explicit torch path returns.
        self.shape = passes.Shape(H, KVH, D, bs, ib, 1.0 / math.sqrt(D), threads, self.placement,
                                  self.placement.native and not dynamic, dynamic, cfg.prefill, all_blocks)
        self.planner = DecodePlanner(lc, self.store, self.n_layers, H, D, ib, all_blocks, self.placement.device,
                                     dtype, max_seq_len, dual_chunk)
        self._planned: tuple = (None, None)  # (the planner's TokenSteps, their layers as a TokenPlan takes them)
        self.reset()

    # ---- bookkeeping ----

    def begin_prompt(self, end: int, then_decode: bool = True) -> None:
        """The prompt read next ends at position ``end``: with sparse prefill its last ``prefill.exact_tail``
        tokens read every block (a pass that was not announced has no exact tail), and a pass
        of one token that ends by ``end`` is the prompt's (exact, its query recorded for SnapKV), not a
        decode step. then_decode: a reply follows, so SnapKV chooses the candidates as each layer finishes the
        prompt (``DecodePlanner.preselect_read``); else (a document read alone) the first decode step does."""
        self.exact_from = end - self.cfg.prefill.exact_tail
        self.prompt_end = end
        self.preselect_end = end if then_decode else -1

    def prompt_layers(self, start: int, n: int) -> LongContextPromptLayers:
        """A prompt of ``n`` tokens at ``start`` read layer by layer (``KVCache.prompt_layers``; kv/layer_prefill.py)."""
        self.write_from(start, n)
        lb = self.first_decode_lb(start + n) if start + n == self.preselect_end else None
        return LongContextPromptLayers(self.shape, self.windows, self.store, self.planner, start, n,
                                       self.prompt_read, lb, self.dual_chunk)

    def prefill_device_bytes(self, n: int) -> int:
        """Device bytes a layer-major prompt of ``n`` tokens adds: its K/V of one layer, each layer's last
        prompt queries kept for the planner, and the past's windows gathered for a chunk (kv/layer_prefill.py)."""
        return workspace_bytes(self.shape, self.windows, self.planner.q_win, n)

    def reset(self) -> None:
        """Forget every token (the memory is kept)."""
        self.store.truncate(-1, 0)
        self.pos = 0
        self.windows.reset()
        self.geo = PassGeometry()
        self.exact_from = self.max_seq_len  # begin_prompt: queries from it on read every block
        self.prompt_end = 0  # begin_prompt: a one-token pass that ends by it is a prompt's, not a decode step
        self.preselect_end = -1  # begin_prompt: the pass that ends there chooses SnapKV's candidates
        self.planner.reset()

    # long_context keys that only the decode steps read: ``retune`` changes them on a filled cache; the SnapKV
    # ones choose the candidates again at the next decode step, from the prompt's recorded queries
    PRESELECT_KEYS = ("preselect_block", "preselect_block_count", "preselect_pool_kernel", "ada_budget",
                      "ada_alpha", "ada_gqa_merge")
    RETUNABLE = ("second_select_num", "sticky_blocks", "rerank", "token_step", "layer_step", "dense_layer_num",
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
        self.preselect_end = self.preselect_end if self.preselect_end <= n else -1
        self.windows.refill(n, self.store)  # (n == pos too: a cut pass may have compacted past n's local window)
        if n == self.pos:
            return
        self.pos = n
        self.planner.truncated(n)

    def nbytes(self) -> int:
        """KV bytes held: the DRAM store's blocks in use, its copy of the candidates, the device windows."""
        return self.store.nbytes() + self.store.cand_nbytes() + self.device_kv_bytes()

    def device_kv_bytes(self) -> int:
        """Bytes of K/V held on the device (the windows; fixed at construction)."""
        return self.windows.nbytes + self.planner.q_win.nbytes

    # ---- the pass ----

    def write_from(self, start: int, T: int) -> None:
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
        self.windows.refill(start, self.store)  # a pass cut after it compacted (even before it stored anything)
        if start + T > self.max_seq_len:
            raise ValueError(f"KV cache overflow: positions {start}..{start + T - 1} do not fit in "
                             f"max_seq_len={self.max_seq_len} (the cache holds {self.pos} tokens)")

    def begin_pass(self, start: int, T: int) -> PassGeometry:
        """Positions [start, start + T) are read next by every layer: their geometry, set up once (at layer
        0); a decode step (one token past the prompt) or a prompt's pass."""
        self.write_from(start, T)
        if T > self.chunk_size:
            raise ValueError(f"long-context cache: {T} tokens in one pass exceed chunk_size={self.chunk_size}")
        decode = T == 1 and start + T > self.prompt_end
        self.geo = self.windows.begin_pass(start, T, decode, self.shape.group, not self.shape.native_decode)
        if decode:
            self.planner.begin_decode()
        else:
            self.planner.begin_prefill()
        return self.geo

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """Store k/v at start_pos.. and return causal attention over everything held.

        q: [T, H, D] (with dual chunk attention [3, T, H, D], its rotations), k/v: [T, KVH, D] (device) -> out
        [T, H, D]. T <= chunk_size. (A CPU decode step runs torch on one thread: ``generate.decode_one_token``
        sets it for the whole step.)
        """
        T = q.shape[-3]
        g = self.begin_pass(start_pos, T) if layer_idx == 0 else self.geo
        dc, rec = self.dual_chunk, q
        if (q.dim() == 4) != (dc is not None):
            raise ValueError(f"long-context cache {'with' if dc else 'without'} dual chunk attention: q of shape "
                             f"{tuple(q.shape)} (make the cache with the model's args.dual_chunk)")
        if dc is not None and dc.active(start_pos + T):
            out = passes.attend_layer_dca(self.shape, self.windows, self.store, self.planner, g, layer_idx, q, k, v,
                                          self.exact_from, dc)
        else:
            q = q if dc is None else q[0]  # (within the first chunk the intra rotation is the plain query)
            if g.decode and self.shape.native_decode:
                out = passes.decode_native(self.shape, self.windows, self.store, self.planner, g, layer_idx, q, k, v)
            else:
                out = passes.attend_layer(self.shape, self.windows, self.store, self.planner, g, layer_idx, q, k, v,
                                          self.exact_from)
        if not g.decode:
            rec = self.planner.rows(rec)  # (dual chunk attention's three rotations side by side)
            if start_pos + T == self.preselect_end:  # the last pass of a prompt a reply follows: SnapKV scores it
                self.planner.preselect_read(layer_idx, rec, start_pos, T, self.first_decode_lb(self.preselect_end))
            self.planner.record_queries(layer_idx, rec, start_pos)
        if layer_idx == self.n_layers - 1:
            self.pos = start_pos + T
            if not g.decode:
                self.planner.queries_recorded(start_pos, T)
        return out

    def first_decode_lb(self, end: int) -> int:
        """The context end (first local-window block) of a decode step at position ``end``."""
        return self.windows.pass_loc0(end, 1) // self.shape.block_size

    def prompt_read(self, end: int) -> None:
        """A layer-major prompt ending at ``end`` is in every layer (``LongContextPromptLayers.done``)."""
        self.pos = end

    # ---- decode: a whole token planned ----

    def plan_decode(self, pos: int) -> TokenPlan | None:
        """The native plan of a decode token at ``pos`` (``KVCache.plan_decode``): every layer's window
        geometry and store part (``DecodePlanner.token_steps``). None where the native path does not apply
        (a GPU, DYNAMIC anchors) or the token is a prompt's (``begin_prompt``: read exactly, through
        ``attend``)."""
        if not self.shape.native_decode or pos < self.prompt_end:
            return None
        if self.dual_chunk is not None and self.dual_chunk.active(pos + 1):
            return None  # (past the first chunk, dual chunk attention's token goes through the model's layers)
        g = self.begin_pass(pos, 1)
        assert g.decode
        steps = self.planner.token_steps(g.loc0 // self.shape.block_size)
        if steps is not self._planned[0]:  # (the planner keeps its steps while the context end stays)
            self._planned = (steps, [store_layer(k, v, step) for (k, v), step in zip(self.windows.views, steps.plans)])
        return TokenPlan(pos, self._planned[1], self.shape.scale, self.store, g.w0, g.width, g.skip, state=steps)

    def commit_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` is in every layer."""
        self.planner.token_done(plan.state)
        self.pos = plan.pos + 1

    def abort_decode(self, plan: TokenPlan) -> None:
        """The token of ``plan`` raised part-way: some layers may hold it (the next pass drops them)."""
        self.planner.token_failed()

    # ---- decode on a device: its layers there, each layer's store part here (models/device_step.py) ----

    def device_token(self, pos: int) -> DeviceToken | None:
        """``KVCache.device_token``: the windows' geometry of a decode token at ``pos``. None for a prompt's
        token (``begin_prompt``), with DYNAMIC anchors (the store takes the window's probabilities) and with
        dual chunk attention past its first chunk."""
        if self.shape.dynamic or pos < self.prompt_end or (self.dual_chunk is not None
                                                           and self.dual_chunk.active(pos + 1)):
            return None
        g = self.begin_pass(pos, 1)
        assert g.decode
        return DeviceToken(pos, g.w0, g.width, g.skip, g.loc0 // self.shape.block_size > self.shape.ib)

    def device_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows.k[layer], self.windows.v[layer]

    def store_part(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The device token's store part in ``layer``: q [H, D], k/v [KVH, D] on the host -> (out [H, D], lse
        [H]) fp32 over the context blocks the planner says, into ``out`` / ``lse`` where given (None where
        there are none); then k/v join the store (after: the store part never sees the token itself)."""
        lb = self.geo.loc0 // self.shape.block_size
        part = None
        if lb > self.shape.ib:
            part = passes.decode_context(self.shape, self.store, self.planner, layer, q[None], lb, out=out, lse=lse)
        self.store.append(layer, k[None], v[None])
        return part

    def commit_device_token(self, token: DeviceToken) -> None:
        self.pos = token.pos + 1

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
        return self.shape.ib, self.geo.loc0 // self.shape.block_size

    # ---- KV files (kv/files.py) ----

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a KV file keeps: each layer's store state as bytes (its blocks in use: K/V tiles, anchors, the
        index), the device windows, and the planner's (the last prefill queries and SnapKV's candidates). A
        cache between passes (``pos`` tokens in every layer)."""
        if self.store.length(0) != self.pos:  # a pass interrupted half-way: dropped, as the next pass would
            self.store.truncate(-1, self.pos)
        meta, arrays = plan_files.state(self.planner)
        arrays |= {"win_k": self.windows.k, "win_v": self.windows.v}
        for i in range(self.n_layers):
            arrays[f"store{i}"] = torch.from_numpy(self.store.export_layer(i))
        return {"pos": self.pos, "buf0": self.windows.buf0, **meta}, arrays

    def state_shapes(self, meta: dict, path: str = "") -> dict[str, tuple]:
        """The arrays ``load_state`` takes for ``meta``: name -> (shape, dtype); KVFileError for a bad ``meta``."""
        from ktquest.kv.files import KVFileError, check_meta

        n = check_meta(path, meta, "pos", 0, self.max_seq_len)
        # row init_end of the windows holds position buf0: block aligned, its rows up to n within the buffers
        buf0 = check_meta(path, meta, "buf0", max(self.init_end, n - self.windows.cap), max(self.init_end, n))
        shapes = plan_files.state_shapes(self.planner, meta, n)
        if shapes is None or buf0 % self.lc.block_size:
            raise KVFileError(f"{path}: the long-context cache's planner state is not allowed here")
        w = self.windows.k
        shapes |= {"win_k": (tuple(w.shape), w.dtype), "win_v": (tuple(w.shape), w.dtype)}
        for i in range(self.n_layers):
            shapes[f"store{i}"] = ((self.store.state_bytes(n),), torch.uint8)
        return shapes

    def check_state(self, meta: dict, arrays: dict[str, torch.Tensor], path: str = "") -> None:
        """KVFileError unless ``load_state`` takes ``meta`` and ``arrays``: their names, shapes and dtypes
        (``state_shapes``), the block ids the planner keeps and the store's bytes (``KVStore.check_import``)."""
        from ktquest.kv.files import KVFileError, expect

        expect(path, arrays, self.state_shapes(meta, path))
        wrong = plan_files.check_ids(self.planner, arrays, meta["pos"])
        if wrong:
            raise KVFileError(f"{path}: {wrong}")
        try:
            for i in range(self.n_layers):
                self.store.check_import(i, meta["pos"], arrays[f"store{i}"].numpy())
        except ValueError as e:
            raise KVFileError(f"{path}: the KV cache's store state is refused: {e}") from None

    def load_state(self, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        """The cache becomes what ``state`` gave (shapes checked by the caller, ``files.expect``). The store's
        bytes are a file's, untrusted: a state no append makes (``KVStore.import_layer``) is a ``KVFileError``
        naming the layer, KV head, block and value, and leaves the cache empty."""
        from ktquest.kv.files import KVFileError

        self.reset()
        n = meta["pos"]
        try:
            for i in range(self.n_layers):
                self.store.import_layer(i, n, arrays[f"store{i}"].numpy())
        except ValueError as e:
            self.reset()  # (the layers before it were imported)
            raise KVFileError(f"the KV cache's store state is refused: {e}") from None
        self.windows.load(arrays["win_k"], arrays["win_v"], meta["buf0"])
        self.planner.load_state(meta, arrays)
        self.pos = n
