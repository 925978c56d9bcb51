"""Which context blocks each layer of a long_context decode step attends to: the per-step policy.

A layer attends every context block (the first ``dense_layer_num`` layers), reuses a selection (its
``layer_step`` leader's of this token, or its own until ``token_step`` tokens have passed, extended by the
blocks that left the local window since), or selects afresh: the store scores the candidates' anchors
against the query and keeps the top ``second_select_num`` (per KV head in SEPARATE mode; Ada-KV budgets
split a layer's total over its heads by the step's own scores, in the store). The candidates are every
context block, or after a prefill with ``preselect_block`` the blocks SnapKV kept (``kv/selection.py``),
scored by the last prompt queries; with ``preselect_refresh`` R, every R decode steps a layer selects from
every context block instead, and its picks join its candidates in place of the last refresh's (what a long
reply goes on to need is not all in what the prompt's end asked for).

The planner holds this state (selections, candidates, the SnapKV observation window) and the call
statistics; the cache (``kv/long_context.py``) owns the windows and the store and asks it for plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ktquest.config import LongContextConfig
from ktquest.kv.selection import snapkv_preselect
from ktquest.models.dual_chunk import DualChunk
from ktquest.native.args import padded_ids
from ktquest.native.store import KVStore, Select


@dataclass(slots=True)
class SelectionStats:
    """What each layer did on its decode steps (documented statistics: the tests and tools read them)."""

    select_calls: list[int]  # anchor scoring + top-k (select_attend) per layer
    reuse_calls: list[int]  # decode steps that reused a cached selection per layer
    full_calls: list[int]  # decode steps that attended every context block per layer
    preselect_calls: int = 0
    refresh_calls: int = 0  # selections from every context block that refreshed a layer's candidates


@dataclass(slots=True)
class Selection:
    """A layer's last block selection: ids [n_sets, k] (-1 padded, ascending), taken when the context
    blocks were [ib, lb), at decode step ``step``."""

    ids: torch.Tensor
    lb: int
    step: int


@dataclass(slots=True)
class TokenSteps:
    """Every layer's store part for decode tokens whose context ends at block ``lb`` (``_C.StorePlan``s from
    KVStore.step_plan; their out_ids buffers are reused from token to token), with the layers that select
    (``fresh``: layer -> its plan) and those that attend every block or reuse a selection (the statistics to
    count)."""

    lb: int
    plans: list  # [n_layers] _C.StorePlan
    fresh: dict  # layer -> its plan, for the layers that select
    full: list  # the layers that attend every context block
    reuse: list  # the layers that reuse a selection
    refresh_at: int = 1 << 62  # the decode step from which one of its selecting layers refreshes its candidates


class DecodePlanner:
    """The selection policy of a ``LongContextCache``: ``plan`` (one layer), ``token_steps`` (a whole token).

    ib: the init window's blocks (never selected); all_blocks: int32 [max_blocks] = arange, shared."""

    def __init__(self, lc: LongContextConfig, store: KVStore, n_layers: int, n_heads: int, head_dim: int,
                 ib: int, all_blocks: torch.Tensor, device: torch.device, dtype: torch.dtype, max_seq_len: int,
                 dual_chunk: DualChunk | None = None):
        self.lc, self.store, self.n_layers, self.ib = lc, store, n_layers, ib
        self._all_blocks, self._all_blocks_np = all_blocks, all_blocks.numpy()
        W = min(lc.preselect_window, max_seq_len)
        # the last prompt queries, [L, W, H, D]; with dual chunk attention their three rotations side by side,
        # [L, W, 3 H, D] (``rows``), and SnapKV scores each key by the one its chunk calls for
        self.dual_chunk = dual_chunk
        heads = n_heads * (1 if dual_chunk is None else 3)
        self.q_win = torch.zeros(n_layers, W, heads, head_dim, device=device, dtype=dtype)
        self._excl: tuple[int, np.ndarray | None] = (-1, None)  # (lb, exclude ranges) of the last selection
        self._sel: list[Selection | None] = []
        self._sel_live: tuple | None = None  # (steps, lb, step): selections still in token_steps' buffers
        self.reset()

    def reset(self) -> None:
        """Forget every selection, candidate list and recorded query; zero the statistics."""
        self.q_win_span = (0, 0)  # positions [a, b) whose queries q_win holds (last b - a slots)
        self._q_recording = False  # record_queries ran for a pass that queries_recorded has not closed
        self._staged: dict[int, tuple[torch.Tensor, int]] = {}  # layer -> candidates of the pass being read
        self.forget()
        self.stats = SelectionStats([0] * self.n_layers, [0] * self.n_layers, [0] * self.n_layers)

    def forget(self) -> None:
        """Forget the selections and candidates (the cache was truncated: they may name dropped blocks)."""
        self.sel = [None] * self.n_layers
        self._token_steps: TokenSteps | None = None  # valid while nothing changes
        # per layer: [n_sets, N] int32 preselected blocks (-1 padded), and the context end it covers
        self.allowed: list[torch.Tensor | None] = [None] * self.n_layers
        self.allowed_np: list[np.ndarray | None] = [None] * self.n_layers  # numpy views (decode calls)
        self.allowed_lb = [0] * self.n_layers
        self.presel_pending = [False] * self.n_layers
        self.decode_step = 0
        self.refreshed = [0] * self.n_layers  # decode step of each layer's last candidate refresh (or preselection)
        self._staged = {}
        # per layer SnapKV's own pick [n_sets, N] and the context end it covers (what refreshes join)
        self.presel_base: list[tuple[np.ndarray, int] | None] = [None] * self.n_layers
        self._refreshing: dict[int, tuple[int, int]] = {}  # layer -> (lb, refreshed before): this token's

    def forget_selections(self) -> None:
        """Drop the selections (not the candidates): the next decode step of each layer selects anew."""
        self.sel = [None] * self.n_layers
        self._token_steps = None

    def preselect_again(self) -> None:
        """Drop the candidates: the next decode step preselects (``lc.preselect_block``) from the recorded
        queries."""
        self.allowed, self.allowed_np = [None] * self.n_layers, [None] * self.n_layers
        self.allowed_lb = [0] * self.n_layers
        self.presel_base = [None] * self.n_layers
        self.presel_pending = [self.lc.preselect_block] * self.n_layers
        self._token_steps = None

    def pass_abandoned(self) -> None:
        """A pass stopped between its layers is written again: the queries some layers recorded for it
        moved their slots, so the recorded window is dropped."""
        if self._q_recording:
            self.q_win_span = (0, 0)
            self._q_recording = False
        self._staged = {}

    def truncated(self, n: int) -> None:
        """The cache keeps its first ``n`` tokens: every selection may name dropped blocks; the recorded
        queries of positions below ``n`` stay (a query depends on its prefix only), so a prompt rewound to
        a prefix and read on preselects as it did when read whole."""
        a, b = self.q_win_span
        if self._q_recording or n <= a:  # (a pass stopped between its layers' records: slots disagree)
            self.q_win_span = (0, 0)
        elif n < b:  # positions [a, n) move to the last slots
            W = self.q_win.shape[1]
            self.q_win[:, W - (n - a):] = self.q_win[:, W - (b - a): W - (b - n)].clone()
            self.q_win_span = (a, n)
        self._q_recording = False
        self.forget()

    def begin_prefill(self) -> None:
        """A prefill pass starts: selections are stale, and SnapKV preselects again at the next decode step."""
        self.presel_pending = [self.lc.preselect_block] * self.n_layers
        self.sel = [None] * self.n_layers
        self._token_steps = None

    def begin_decode(self) -> None:
        """A decode step starts (token_step and preselect_refresh count these). A refresh planned for the last
        token whose picks never joined (the token raised) is due again."""
        for layer, (_, before) in self._refreshing.items():
            self.refreshed[layer] = before
        self._refreshing.clear()
        self.decode_step += 1

    # ---- selections ----

    def selection(self, layer: int) -> Selection | None:
        """``layer``'s last selection (None: none yet)."""
        return self.sel[layer]

    def candidates(self, layer: int) -> torch.Tensor | None:
        """``layer``'s candidate blocks after SnapKV preselection, [n_sets, N] int32 -1 padded (None: every
        context block), extended by the blocks that entered the context since."""
        return self.allowed[layer]

    @property
    def sel(self) -> list[Selection | None]:
        if self._sel_live is not None:
            self._flush_sel()
        return self._sel

    @sel.setter
    def sel(self, value: list[Selection | None]) -> None:
        self._sel_live = None
        self._sel = value

    def _flush_sel(self) -> None:
        """Copy token_steps' picks of its last token out of its buffers into ``sel``."""
        live, self._sel_live = self._sel_live, None
        if live is not None:
            steps, lb, step = live
            for layer, plan in steps.fresh.items():  # out_ids [n_sets, cols]: a fresh tensor per selection
                self._sel[layer] = Selection(torch.from_numpy(plan.out_ids.copy()), lb, step)

    def record(self, layer: int, ids: torch.Tensor, lb: int) -> None:
        """A selection ``layer`` just made (ids: a fresh tensor per call)."""
        mode = self.lc.head_select_mode
        if ids.dim() != 2 or mode != "SEPARATE":
            ids = ids.reshape(-1 if mode == "SEPARATE" else 1, ids.shape[-1])
        self.sel[layer] = Selection(ids, lb, self.decode_step)
        if layer in self._refreshing:
            self._join_candidates(layer, ids.numpy(), self._refreshing.pop(layer)[0])

    # ---- plans ----

    def token_steps(self, lb: int) -> TokenSteps:
        """Every layer's store part of a decode token whose context blocks are [ib, lb) (``StorePlan``s), the
        statistics counted. Kept for the next tokens when they would plan the same: every
        selection due at every token (token_step 1), nothing pending, the same context end."""
        plan = self._token_steps
        # the same plan as the last token (no refresh due yet): only the counters move
        if plan is not None and plan.lb == lb and self.decode_step < plan.refresh_at:
            st = self.stats
            for layer in plan.full:
                st.full_calls[layer] += 1
            for layer in plan.reuse:
                st.reuse_calls[layer] += 1
            for layer in plan.fresh:
                st.select_calls[layer] += 1
        else:  # (the same plan's next token replaces all of its picks: only a new plan needs the old ones)
            self._flush_sel()
            plan = self._make_token_steps(lb)
        return plan

    def token_done(self, plan: TokenSteps) -> None:
        """The token of ``plan`` ran: its selections are in the plan's buffers (copied out when read: a copy
        per layer per token would cost ~6 us a layer on the decode path, and the next token replaces them);
        a refreshing layer's picks join its candidates now."""
        self._sel_live = (plan, plan.lb, self.decode_step)
        for layer, (lb, _) in self._refreshing.items():
            self._join_candidates(layer, plan.fresh[layer].out_ids, lb)
        self._refreshing.clear()

    def token_failed(self) -> None:
        """The token of the last plan raised: its ids buffers may hold part of its picks."""
        self.sel = [None] * self.n_layers

    def _make_token_steps(self, lb: int) -> TokenSteps:
        plans, fresh = [], {}  # fresh: layer -> its store plan, for the layers that select in this token
        full, reuse = [], []  # the layers plan() counted as attending every block / reusing a selection
        for layer in range(self.n_layers):
            blocks, select = self.plan(layer, lb, fresh) if lb > self.ib else (None, None)
            store_plan = self.store.step_plan(layer, blocks, select)
            if select is not None:
                fresh[layer] = store_plan
            elif blocks is not None:
                (full if layer < self.lc.dense_layer_num else reuse).append(layer)
            plans.append(store_plan)
        steps = TokenSteps(lb, plans, fresh, full, reuse)
        r = self.lc.preselect_refresh
        if r:
            steps.refresh_at = min((self.refreshed[i] + r for i in fresh if self.allowed[i] is not None),
                                   default=steps.refresh_at)
        self._token_steps = steps if self.lc.token_step == 1 and lb > self.ib and not self._refreshing else None
        return steps

    def plan(self, layer: int, lb: int, fresh: dict | None = None) -> tuple[torch.Tensor | None, Select | None]:
        """Which context blocks a decode step of ``layer`` attends to: (blocks, None) for a fixed list (dense
        layers, a reused selection), or (None, a ``Select``) for a fresh selection (Ada-KV budgets: split by
        the store from the step's own scores). Keeps the call statistics and runs a pending preselection.
        fresh (token_steps): the store plans of the layers that select in this token but have not run yet; a
        follower of one of them reuses its out_ids."""
        lc, st = self.lc, self.stats
        if layer < lc.dense_layer_num:
            st.full_calls[layer] += 1
            return self._all_blocks[self.ib: lb], None
        if self.presel_pending[layer]:
            self._preselect(layer, lb)
        leader = layer - (layer - lc.dense_layer_num) % lc.layer_step  # layer_step groups reuse its selection
        if fresh is not None and leader != layer and leader in fresh:
            st.reuse_calls[layer] += 1
            return torch.from_numpy(fresh[leader].out_ids), None  # [n_sets, cols], filled by the leader's step
        sel = self.sel[leader]
        due = sel is None or (layer == leader and self.decode_step - sel.step >= lc.token_step)
        if not due:
            st.reuse_calls[layer] += 1
            return self._extend(sel, lb), None
        st.select_calls[layer] += 1
        mode, allowed = lc.head_select_mode, self._allowed(layer, lb)
        r = lc.preselect_refresh
        if allowed is not None and r and self.decode_step - self.refreshed[layer] >= r:
            self._refreshing[layer] = (lb, self.refreshed[layer])
            self.refreshed[layer] = self.decode_step
            st.refresh_calls += 1
            allowed = None  # this step selects from every context block; its picks join the candidates
        # Ada-KV (SEPARATE): the store splits the layer's total over its heads by this query's scores
        ada = lc.ada_alpha if lc.ada_budget and mode == "SEPARATE" else None
        return None, Select(lc.second_select_num, mode, self._exclusions(lb),
                            None if allowed is None else self.allowed_np[layer], ada, lc.rerank)

    def _exclusions(self, lb: int) -> np.ndarray:
        """A selection's excluded blocks at context end lb: [2, 2] int64 ranges, the init window and the local
        window onwards (one array per lb: the store's candidate copies are keyed by its contents)."""
        if self._excl[0] != lb:
            self._excl = (lb, np.array([[0, self.ib], [lb, self._all_blocks.shape[0]]], np.int64))
        return self._excl[1]

    def _extend(self, sel: Selection, lb: int) -> torch.Tensor:
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

    def _join_candidates(self, layer: int, picks: np.ndarray, lb: int) -> None:
        """A refresh's picks [n_sets, k] (-1 padded) join ``layer``'s candidates in place of the last refresh's:
        each set becomes SnapKV's own pick, the blocks that entered the context since it, and these picks
        (ascending). So the candidates stay within ``preselect_block_count + second_select_num`` (+ the sticky
        blocks a step keeps) besides the blocks that entered, as without refreshes."""
        base, base_lb = self.presel_base[layer]
        lb = max(lb, self.allowed_lb[layer])
        entered = self._all_blocks_np[base_lb: lb]
        rows = [np.union1d(np.concatenate([base[i][base[i] >= 0], entered]), picks[i][picks[i] >= 0])
                for i in range(base.shape[0])]  # (never empty: SnapKV's own pick is not)
        self._set_allowed(layer, torch.from_numpy(padded_ids(rows, "candidates", len(rows))), lb)
        self._token_steps = None  # a kept plan names the candidates as they were

    # ---- what a KV file keeps (kv/files.py) ----

    def load_state(self, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        """The planner becomes what ``plan_files.state`` gave (checked by its ``state_shapes`` and ``check_ids``)."""
        self.reset()
        self.q_win.copy_(arrays["q_win"])
        self.q_win_span = tuple(meta["q_win_span"])
        for i in range(self.n_layers):
            if meta["allowed"][i] is not None:
                self._set_allowed(i, arrays[f"allowed{i}"].clone(), meta["allowed_lb"][i])
        self.presel_pending = list(meta["presel_pending"])
        self.decode_step = meta["decode_step"]
        self.refreshed = list(meta["refreshed"])
        self.presel_base = [None if b is None else (arrays[f"presel{i}"].numpy().copy(), b[2])
                            for i, b in enumerate(meta["presel"])]

    # ---- SnapKV preselection (once after each prompt, as each layer finishes it; else at the first decode step) ----

    @staticmethod
    def rows(q: torch.Tensor) -> torch.Tensor:  # queries as recorded: [T, H, D], rotations [3, T, H, D] as [T, 3H, D]
        return q if q.dim() == 3 else q.transpose(0, 1).reshape(q.shape[1], -1, q.shape[3])

    def record_queries(self, layer: int, q: torch.Tensor, start: int) -> None:
        """Keep the last W prefill queries of the layer (q_win_span, updated by ``queries_recorded`` after
        the last layer, says which positions they are). q: [T, H, D]."""
        self._q_recording = True
        W = self.q_win.shape[1]
        keep = q[-W:]
        n = keep.shape[0]
        if self.q_win_span[1] == start and n < W:  # continues the window: shift the older queries left
            self.q_win[layer, : W - n] = self.q_win[layer, n:].clone()
        self.q_win[layer, W - n:] = keep

    def queries_recorded(self, start: int, T: int) -> None:
        """Every layer recorded the queries of positions [start, start + T); the candidates that
        ``preselect_read`` chose while the pass was read take effect."""
        self._q_recording = False
        self.q_win_span = self._span_after(start, T)
        for layer, (allowed, nb) in self._staged.items():  # (made for the next decode step, as if at it)
            self._install(layer, allowed, nb, self.decode_step + 1)
        self._staged = {}

    def _span_after(self, start: int, T: int) -> tuple[int, int]:
        """The positions [a, b) whose queries q_win holds once every layer recorded [start, start + T)."""
        a, b = self.q_win_span
        end = start + T
        return max(a if b == start else start, end - self.q_win.shape[1]), end

    def preselect_read(self, layer: int, q: torch.Tensor, start: int, T: int, lb: int) -> None:
        """``layer`` read the prompt's last positions [start, start + T) (q [n, H, D]: the queries of the last n
        of them, not recorded yet): SnapKV scores its context now, from the store's keys, between this layer
        and the next (the first decode step only finds the candidates, and the store's copies of them); they
        take effect when every layer has recorded the pass (``queries_recorded``), and a pass abandoned before
        that leaves the planner as it was. lb: the first decode step's context end (its local window's first
        block)."""
        if not self.lc.preselect_block or layer < self.lc.dense_layer_num:  # (a dense layer attends every block)
            return
        a, b = self._span_after(start, T)
        n = min(b - a, q.shape[0])
        rows = q[q.shape[0] - n:]
        if n < b - a:  # the window begins in the queries recorded before this pass (the last slots of q_win)
            rows = torch.cat([self.q_win[layer, self.q_win.shape[1] - (b - a - n):].to(rows.dtype), rows])
        picked = self._snapkv(layer, rows, a, b, lb)
        if picked is not None:
            self._staged[layer] = picked
            # (their copies too, keyed as the first decode step will ask: plan()'s exclusions at lb)
            self.store.cache_candidates(layer, picked[0].numpy(), self._exclusions(lb), self.lc.head_select_mode)

    def _preselect(self, layer: int, lb: int) -> None:
        """SnapKV at a decode step (a prompt read without ``preselect_read``: a document read without a reply,
        a KV file's, a retune's): the candidates of ``_snapkv`` by the recorded queries."""
        self.presel_pending[layer] = False
        a, b = self.q_win_span
        picked = self._snapkv(layer, self.q_win[layer, self.q_win.shape[1] - (b - a):], a, b, lb)
        if picked is not None:
            self._install(layer, *picked, self.decode_step)

    def _snapkv(self, layer: int, q: torch.Tensor, a: int, b: int, lb: int) -> tuple[torch.Tensor, int] | None:
        """SnapKV: the top ``preselect_block_count`` context blocks per KV head (SHARED: one set) of this
        layer, scored by the queries q [b - a, H, D] of positions [a, b) over the store's keys [0, b), in place
        (Ada-SnapKV budgets with ``ada_budget``): (candidates [n_sets, N] int32 -1 padded, the context end nb
        they cover), or None where there is no context to choose from."""
        nb = min(lb, b // self.store.block_size)  # (after a retune mid-reply: later blocks join as new ones)
        if b <= a or nb <= self.ib:
            return None
        var = None
        if self.dual_chunk is not None:  # the window's queries of the last one's chunk, by their rotations
            var = self.dual_chunk.bounds((b - 1) // self.dual_chunk.length)
            q, a = q[max(0, var[1] - a):], max(a, var[1])
            q = q.reshape(q.shape[0], 3, -1, q.shape[2]).transpose(0, 1)  # [3, W, H, D]
        qw = q.float().cpu().contiguous()  # [W, H, D] ([3, W, H, D])
        scores = self.store.snapkv_scores(layer, qw, a, b, nb, self.lc.preselect_pool_kernel, self.lc.ada_gqa_merge,
                                          var)
        sets = snapkv_preselect(scores, self.lc, exclude=[(0, self.ib)])
        allowed = torch.full((len(sets), max(1, max(len(s) for s in sets))), -1, dtype=torch.int32)
        for i, s in enumerate(sets):  # a few KV heads, once per prefill
            allowed[i, : len(s)] = s.to(torch.int32)
        return allowed, nb

    def _install(self, layer: int, allowed: torch.Tensor, nb: int, step: int) -> None:
        """SnapKV's candidates of ``layer`` (covering the context blocks up to nb) replace its last ones, as made at
        decode step ``step`` (``preselect_refresh`` counts from it)."""
        self.stats.preselect_calls += 1
        self._set_allowed(layer, allowed, nb)
        self.presel_pending[layer] = False
        self.presel_base[layer], self.refreshed[layer] = (allowed.numpy(), nb), step
