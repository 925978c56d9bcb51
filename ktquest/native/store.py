"""Checked Python facade of the native KV store and sparse decode attention (``ktquest._C.KVStore``).

One ``KVStore`` holds every layer's keys and values in blocks of ``block_size`` tokens, in C++ memory, with
block anchors kept up to date as tokens arrive. A decode step of one layer is one call::

    out, lse, blocks = store.select_attend(layer, q, k=32, exclude_ranges=[(0, 1), (nb - 16, nb)])

which scores the candidate blocks from their anchors, keeps the top ``k`` (per KV head, or shared), and
attends to them: ``out [H, D]`` and ``lse [H]`` in fp32, to be merged with attention computed elsewhere
(the initial and local windows) by ``ktquest.kv.attention.merge_attention``. A store's bytes: ``sizes.py``;
Ada-KV's split of a budget over KV heads: ``ada.py``; a selection's request: ``select.py``.

Every argument is checked here (torch dtype, shape, contiguity, device) and again in the binding; errors
are ``TypeError`` / ``ValueError`` / ``IndexError`` naming the argument, never a crash.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ktquest import _C
from ktquest.native.ada import alpha_fraction
from ktquest.native.args import as_numpy, check_int, check_name, check_tensor, check_variants, padded_ids
from ktquest.native.enums import ANCHOR_TYPES, HEAD_MODES, KV_TYPES
from ktquest.native.select import Select, check_rerank
from ktquest.native.store_reads import StoreReads

_IN_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_NO_RANGES = np.zeros((0, 2), np.int64)


class KVStore(StoreReads):
    """KV cache of ``n_layers`` layers, ``n_kv_heads`` heads of ``head_dim``, up to ``max_seq_len`` tokens.

    kv_type: FP32, FP16, BF16, Q8_0 or Q4_0 (Q types need head_dim % 32 == 0; rounding in cpp/quant/kv_codec.h).
    anchor_type: QUEST (element-wise min/max keys, scores are upper bounds of q.k), BLOCK_MAX (element-wise
    max key), BLOCK_MEAN (mean key), FIXED (``anchor_num`` tokens at a fixed stride, the first at 0), DYNAMIC
    (the ``anchor_num`` tokens of highest caller-given importance). threads_num: operator threads.
    int8_candidates (linear anchors): selections over a candidate list (``allowed``) score an int8 copy of
    the candidates' anchors, one scale per block and head, QUEST's min rounded down and max up.
    index_group: blocks per group of the hierarchical index (0 = none): selections without a candidate list
    score every group's min/max bound and then only the blocks of groups that may hold a top-k block, with
    the flat scan's picks (cpp/index/group_bounds.h).
    quest_centre (QUEST, in [0, 1]): a block scores (1 - quest_centre) * its bound + quest_centre * q . its
    centre (min + max) / 2 (cpp/kvstore/layout.h).
    sticky_blocks (0..64): after each select_attend, the ``sticky_blocks`` blocks of each set that took the
    largest share of its heads' attention, and the block after each, stay among the layer's k picks at its
    next decode step (the next token; cpp/kvstore/sticky.cpp). 0 = off.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        block_size: int = 64,
        kv_type: str = "FP16",
        anchor_type: str = "QUEST",
        anchor_num: int = 2,
        threads_num: int = 1,
        int8_candidates: bool = False,
        index_group: int = 0,
        quest_centre: float = 0.0,
        sticky_blocks: int = 0,
    ):
        self.n_layers = check_int(n_layers, "n_layers", 1)
        self.n_kv_heads = check_int(n_kv_heads, "n_kv_heads", 1)
        self.head_dim = check_int(head_dim, "head_dim", 1)
        self.max_seq_len = check_int(max_seq_len, "max_seq_len", 1)
        self.block_size = check_int(block_size, "block_size", 1)
        self.kv_type = check_name(kv_type, "kv_type", KV_TYPES)
        self.anchor_type = check_name(anchor_type, "anchor_type", ANCHOR_TYPES)
        self.anchor_num = check_int(anchor_num, "anchor_num", 1)
        self.threads_num = check_int(threads_num, "threads_num", 1)
        if not isinstance(int8_candidates, bool):
            raise TypeError(f"int8_candidates must be a bool, got {type(int8_candidates).__name__}")
        self.int8_candidates = int8_candidates
        self.index_group = check_int(index_group, "index_group", 0)
        if not isinstance(quest_centre, (int, float)) or isinstance(quest_centre, bool):
            raise TypeError(f"quest_centre must be a number, got {type(quest_centre).__name__}")
        self.quest_centre = float(quest_centre)
        self.sticky_blocks = check_int(sticky_blocks, "sticky_blocks", 0)
        self._st = _C.KVStore(
            self.n_layers,
            self.n_kv_heads,
            self.head_dim,
            self.max_seq_len,
            self.block_size,
            self.kv_type,
            self.anchor_type,
            self.anchor_num,
            self.threads_num,
            self.int8_candidates,
            self.index_group,
            self.quest_centre,
            self.sticky_blocks,
        )
        self._k_cache: dict[tuple[str, object], tuple[np.ndarray, int]] = {}

    @property
    def native(self):
        """The ``_C.KVStore`` behind this facade, for the native package alone (``native/plans.py`` hands it to
        the whole-token call)."""
        return self._st

    # ---- a layer's state as bytes (KV files) ----

    def state_bytes(self, n: int) -> int:
        """Bytes of one layer's state (``export_layer``) when it holds ``n`` tokens."""
        return self._st.state_bytes(check_int(n, "n"))

    def state_regions(self, n: int) -> dict[str, list[tuple[int, int]]]:
        """Where a layer's state of ``n`` tokens keeps each region (kv, anchors, n_anchor; sums, imp, pos, bounds
        where the store has them): region -> (offset, bytes) per KV head, in cpp/kvstore/layout.h's order."""
        out: dict[str, list[tuple[int, int]]] = {}
        for name, _head, offset, nbytes in self._st.state_pieces(check_int(n, "n")):
            out.setdefault(name, []).append((offset, nbytes))
        return out

    def export_layer(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s blocks in use as bytes (K/V tiles, anchors, the index): uint8 [state_bytes(n)]."""
        return self._st.export_layer(layer)

    def import_layer(self, layer: int, n: int, data: np.ndarray) -> None:
        """Layer ``layer`` becomes the ``n`` tokens ``export_layer`` gave as ``data`` (uint8). The bytes are
        untrusted (a KV file's): every count, position and value in them is checked by the store before it copies
        any, and ValueError (naming the layer, KV head, block and value) leaves the layer as it was."""
        self._st.import_layer(layer, check_int(n, "n"), data)

    def check_import(self, layer: int, n: int, data: np.ndarray) -> None:  # import_layer's checks alone
        self._st.check_import(layer, check_int(n, "n"), data)

    # ---- contents ----

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, importance: torch.Tensor | None = None
    ) -> None:
        """Append T tokens. k, v: [T, KVH, D] fp32/fp16/bf16 (same dtype); importance: [T, KVH] fp32 or None."""
        k = check_tensor(k, "k", tuple(_IN_DTYPES), 3)
        v = check_tensor(v, "v", (k.dtype,), 3)
        shape = [k.shape[0], self.n_kv_heads, self.head_dim]
        for name, x in (("k", k), ("v", v)):
            if list(x.shape) != shape:
                raise ValueError(
                    f"{name}: expected shape [T, n_kv_heads, head_dim] = {shape}, got {list(x.shape)}"
                )
        imp = None
        if importance is not None:
            imp = check_tensor(importance, "importance", (torch.float32,), 2).numpy()
        dtype = _IN_DTYPES[k.dtype]
        if k.dtype != torch.float32:  # numpy has no bfloat16: hand over the raw 16-bit patterns
            k, v = k.view(torch.int16), v.view(torch.int16)
        self._st.append(layer, k.numpy(), v.numpy(), dtype, imp)

    def length(self, layer: int) -> int:
        return self._st.length(layer)

    def n_blocks(self, layer: int) -> int:
        return self._st.n_blocks(layer)

    def nbytes(self) -> int:
        """Bytes of the blocks in use (K, V, scales, anchors); capacity is reserved lazily."""
        return self._st.nbytes()

    def reserved_bytes(self) -> int:
        """Address space reserved for max_seq_len (committed by the OS only as blocks fill)."""
        return self._st.reserved_bytes()

    def cand_nbytes(self) -> int:
        """Bytes of the candidate caches: each layer's copy of its preselected candidates' anchors and K/V."""
        return self._st.cand_nbytes()

    def cand_copies(self) -> int:
        """Candidates copied into the candidate caches so far (anchor rows and tiles: one each), every layer; a
        selection its cache answered copies none."""
        return self._st.cand_copies()

    def truncate(self, layer: int, n: int) -> None:
        """Keep the first ``n`` tokens of ``layer`` (-1 = every layer; one holding fewer keeps them all).
        The anchors of a now-partial last block are recomputed from its stored keys (DYNAMIC keeps the
        anchors of the surviving tokens: importances are not stored)."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < -1:
            raise ValueError(f"layer={layer!r} is not allowed: a layer index, or -1 for every layer")
        self._st.truncate(int(layer), check_int(n, "n"))

    @property
    def anchor_elem_bytes(self) -> int:
        """Bytes per stored anchor value: 2 where the linear anchors (QUEST, BLOCK_MAX, BLOCK_MEAN) over FP16
        keys are kept as fp16 (min / max exact, the mean rounded to the nearest half), else 4."""
        return self._st.anchor_elem_bytes

    # ---- decode ----

    def _q(self, q, variants=None) -> np.ndarray:  # [H, D] ([3, H, D] with variants): checked by the binding
        return as_numpy(q, "q", (torch.float32,), 2 if variants is None else 3)

    def _k(self, k, mode: str) -> tuple[np.ndarray, int]:
        """k per set as int32 [n_sets] and its maximum (cached: the decode loop passes the same k)."""
        key = (mode, k if isinstance(k, int) else tuple(k) if isinstance(k, Sequence) else None)
        hit = self._k_cache.get(key) if key[1] is not None else None
        if hit is not None:
            return hit
        n_sets = 1 if mode == "SHARED" else self.n_kv_heads
        if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            ks = [check_int(k, "k")] * n_sets
        elif mode == "SEPARATE" and isinstance(k, (Sequence, torch.Tensor)) and len(k) == n_sets:
            ks = [check_int(int(x), f"k[{i}]") for i, x in enumerate(k)]
        else:
            raise ValueError(
                f"k={k!r} is not allowed: an integer >= 0, or (SEPARATE) one per KV head ({self.n_kv_heads})"
            )
        hit = (np.asarray(ks, np.int32), max(ks))
        if key[1] is not None and len(self._k_cache) < 64:
            self._k_cache[key] = hit
        return hit

    @staticmethod
    def _ada(alpha: float | None) -> tuple[int, int] | None:
        """ada_alpha as the binding's (num, den): ``alpha_fraction``, as ``ada_budgets`` reads it."""
        if alpha is None:
            return None
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"ada_alpha={alpha!r} is not allowed: None, or a number in [0, 1]")
        f = alpha_fraction(float(alpha))
        return f.numerator, f.denominator

    def _request(self, layer, k, mode, exclude_ranges, allowed, ada_alpha=None):
        mode = mode if mode in HEAD_MODES else check_name(mode, "mode", HEAD_MODES)
        n_sets = 1 if mode == "SHARED" else self.n_kv_heads
        ks, k_max = self._k(k, mode)
        if ada_alpha is not None:
            k_max = int(ks.sum())  # a set may take up to the whole budget
        if exclude_ranges is None or len(exclude_ranges) == 0:
            excl = _NO_RANGES
        else:
            excl = np.asarray(exclude_ranges, np.int64)
            if excl.ndim != 2 or excl.shape[1] != 2:
                raise ValueError(
                    f"exclude_ranges: expected a list of (b0, b1) block ranges, got {exclude_ranges!r}"
                )
        if allowed is None:
            allow = None
        elif type(allowed) is np.ndarray and allowed.dtype == np.int32 and allowed.ndim == 2:
            allow = allowed  # the decode loop's cached ids: shape and contents are checked by the binding
        else:
            allow = padded_ids(allowed, "allowed", n_sets)
        cols = min(k_max, self._st.n_blocks(layer) if allow is None else allow.shape[1])
        ids = np.empty((n_sets, cols), np.int32)
        return mode, ks, excl, allow, ids, self._ada(ada_alpha)

    def block_scores(self, layer: int, q: torch.Tensor, mode: str = "SEPARATE", variants=None) -> torch.Tensor:
        """Unscaled anchor scores of every block, summed over each KV head's query group (SEPARATE:
        [KVH, n_blocks]) or over all heads (SHARED: [n_blocks]). q: [H, D] fp32, or with dual chunk attention's
        block bounds ``variants`` (``args.check_variants``, as in select, attend and select_attend) [3, H, D]."""
        mode = check_name(mode, "mode", HEAD_MODES)
        var = check_variants(variants)
        s = torch.from_numpy(self._st.block_scores(layer, self._q(q, var), mode, var))
        return s[0] if mode == "SHARED" else s

    def cache_candidates(self, layer: int, allowed: np.ndarray, exclude_ranges: np.ndarray,
                         mode: str = "SEPARATE") -> None:
        """The copies of a candidate list (its anchor rows and K/V tiles, cpp/kvstore/cand_cache.h) made now, so
        that the decode steps passing the same ``allowed`` [n_sets, N] int32 (-1 padded) and ``exclude_ranges``
        [n, 2] int64 find them (SnapKV's candidates are copied as the prompt is read, not by the first step)."""
        mode = check_name(mode, "mode", HEAD_MODES)
        self._st.cache_candidates(layer, mode, exclude_ranges, allowed)

    def snapkv_scores(self, layer: int, q: torch.Tensor, q_pos0: int, n_keys: int, n_blocks: int, pool_kernel: int = 7,
                      gqa_merge: str = "mean", variants=None) -> torch.Tensor:
        """SnapKV's block scores [KVH, n_blocks] fp32 (cpp/select/snapkv.h), read in place from the store: the
        window's queries q [W, H, D] (unscaled, after RoPE; query w at position q_pos0 + w) score keys
        [0, n_keys) by their softmax attention, summed over the window, max-pooled (``pool_kernel``), merged over
        each KV head's query group (``gqa_merge``: mean or max) and summed per block. What
        ``kv.selection.snapkv_token_scores`` and ``block_scores_from_tokens`` compute from an fp32 copy. With dual
        chunk attention's token bounds ``variants``: q [3, W, H, D] (every query in one chunk)."""
        var = check_variants(variants)
        qn = as_numpy(q, "q", (torch.float32,), 3 if var is None else 4)
        if gqa_merge not in ("mean", "max"):
            raise ValueError(f"gqa_merge={gqa_merge!r} is not allowed: 'mean' or 'max'")
        return torch.from_numpy(self._st.snapkv_scores(layer, qn, check_int(q_pos0, "q_pos0"),
                                                       check_int(n_keys, "n_keys"), check_int(n_blocks, "n_blocks"),
                                                       check_int(pool_kernel, "pool_kernel"), gqa_merge, var))

    def group_bounds(self, layer: int, q: torch.Tensor, mode: str = "SEPARATE", variants=None) -> torch.Tensor:
        """The index's bound of every group for q: at least the score block_scores() gives any of its blocks
        (inf: no bound), fp64 [KVH, n_groups] (SEPARATE) or [n_groups] (SHARED). ValueError without an
        index."""
        mode = check_name(mode, "mode", HEAD_MODES)
        var = check_variants(variants)
        b = torch.from_numpy(self._st.group_bounds(layer, self._q(q, var), mode, var))
        return b[0] if mode == "SHARED" else b

    def select(
        self,
        layer: int,
        q: torch.Tensor,
        k: int | Sequence[int],
        mode: str = "SEPARATE",
        exclude_ranges: Sequence[tuple[int, int]] = (),
        allowed=None,
        ada_alpha: float | None = None,
        variants: tuple[int, int] | None = None,
        rerank: int = 1,
    ) -> torch.Tensor:
        """Top-k blocks by anchor score (ties: the lower block id). Candidates: every block, or ``allowed``
        (one id list per KV head, or one list for SHARED), minus the half-open block ``exclude_ranges``.
        k: an int, or one per KV head (SEPARATE). ada_alpha: the sum of k split over the sets by Ada-KV
        (cpp/select/ada.h: ``ada_budgets`` over these scores). variants: dual chunk attention (block_scores).
        rerank (1..MAX_RERANK): a second stage: the anchors pick ``rerank`` times k blocks of each set, and the k
        of those holding the most attention mass for q (QK over their keys) are kept (cpp/kvstore/rerank.h;
        with ada_alpha the budget is split by those masses). 1: the anchors' top k.
        Returns int32 ascending ids, -1 padded: [KVH, cols] (SEPARATE) or [cols] (SHARED)."""
        var = check_variants(variants)
        qn = self._q(q, var)
        mode, ks, excl, allow, ids, ada = self._request(layer, k, mode, exclude_ranges, allowed, ada_alpha)
        self._st.select(layer, qn, mode, ks, excl, allow, ids, ada, var, check_rerank(rerank))
        return self._step_ids(ids, mode)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        blocks,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        with_block_lse: bool = False,
        variants: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """softmax(q K^T / sqrt(D)) V over ``blocks`` (ascending ids: [N] shared by every KV head, or one row
        per KV head, -1 padded). Returns out [H, D] and lse [H] (natural log; -inf for no block), fp32; with
        ``with_block_lse`` also each block's own log-sum-exp per query head, [KVH, N, G] (-inf past a head's
        blocks): exp(block_lse - lse) is the block's share of the head's attention. variants: dual chunk
        attention (block_scores)."""
        var = check_variants(variants)
        qn = self._q(q, var)
        H = qn.shape[-2]
        if isinstance(blocks, torch.Tensor) and blocks.dim() == 1:
            b = padded_ids(blocks, "blocks", 1)
        elif isinstance(blocks, torch.Tensor):
            b = padded_ids(blocks, "blocks", blocks.shape[0] if blocks.dim() == 2 else -1)
        else:
            shared = len(blocks) == 0 or not isinstance(blocks[0], (Sequence, torch.Tensor, np.ndarray))
            b = padded_ids(blocks, "blocks", 1 if shared else self.n_kv_heads)
        out, lse, out_np, lse_np = self._outputs(H, out, lse)
        if not with_block_lse:
            self._st.attend(layer, qn, b, out_np, lse_np, None, var)
            return out, lse
        bl = np.empty((self.n_kv_heads, b.shape[1], H // self.n_kv_heads), np.float32)
        self._st.attend(layer, qn, b, out_np, lse_np, bl, var)
        return out, lse, torch.from_numpy(bl)

    def select_attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: int | Sequence[int],
        mode: str = "SEPARATE",
        exclude_ranges: Sequence[tuple[int, int]] = (),
        allowed=None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        ada_alpha: float | None = None,
        variants: tuple[int, int] | None = None,
        rerank: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """select() then attend() in one native call (the decode hot path): (out [H, D], lse [H], blocks).
        variants: dual chunk attention (block_scores); rerank: the second stage (select)."""
        var = check_variants(variants)
        qn = self._q(q, var)
        mode, ks, excl, allow, ids, ada = self._request(layer, k, mode, exclude_ranges, allowed, ada_alpha)
        out, lse, out_np, lse_np = self._outputs(qn.shape[-2], out, lse)
        self._st.select_attend(layer, qn, mode, ks, excl, allow, ids, out_np, lse_np, ada, var, check_rerank(rerank))
        return out, lse, self._step_ids(ids, mode)

    def decode_step(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, win_k: torch.Tensor,
                    win_v: torch.Tensor, w0: int, width: int, skip: tuple[int, int], scale: float, threads: int,
                    out: torch.Tensor, blocks=None, select: Select | None = None) -> torch.Tensor | None:
        """One long_context decode step of a layer in one native call (cpp/decode/layer_step.h).

        k, v: [KVH, D] the new token, written to row ``w0`` of the window buffers win_k/win_v [KVH, rows, D];
        window rows [0, width) but ``skip`` are attended densely (softmax scale ``scale``); the store part is
        ``blocks`` (as attend()), or a fresh selection ``select``, or nothing when both are None; the parts are merged by LSE into out [H, D]; then k/v are appended to the
        store. All fp32 on the CPU. Returns the selected ids (as select_attend()) or None.
        """
        f32 = (torch.float32,)
        qn = self._q(q)
        plan = self.step_plan(layer, blocks, select)
        self._st.decode_step(layer, qn, as_numpy(k, "k", f32, 2), as_numpy(v, "v", f32, 2), as_numpy(win_k, "win_k", f32, 3),
                             as_numpy(win_v, "win_v", f32, 3), w0, width, skip[0], skip[1], float(scale), threads, plan,
                             as_numpy(out, "out", f32, 2))
        return self._step_ids(plan.out_ids, "SEPARATE" if select is None else select.mode)

    def step_plan(self, layer: int, blocks, select: Select | None) -> _C.StorePlan:
        """A decode step's store part, checked once (``_C.StorePlan``, run by decode_step and the whole-token
        call): a fresh selection ``select``, the picks landing in the plan's ``out_ids``; else ``blocks`` as
        attend() takes them; else nothing (no context block)."""
        if select is not None:
            mode, ks, excl, allow, ids, ada = self._request(layer, select.k, select.mode, select.exclude_ranges,
                                                            select.allowed, select.ada_alpha)
            return _C.StorePlan.select(self._st, mode, ks, excl, allow, ids, ada, check_rerank(select.rerank))
        if blocks is not None:
            n = blocks.shape[0] if isinstance(blocks, torch.Tensor) and blocks.dim() == 2 else 1
            return _C.StorePlan.attend(self._st, padded_ids(blocks, "blocks", n))
        return _C.StorePlan.none()

    @staticmethod
    def _step_ids(ids, mode: str) -> torch.Tensor | None:
        """out_ids (numpy [n_sets, cols] or None) as the returned tensor: [cols] for SHARED."""
        if ids is None:
            return None
        ids = torch.from_numpy(ids)
        return ids[0] if mode == "SHARED" else ids

    def set_walk_index(self, on: bool) -> None:
        """Selections walk the hierarchical index (True, the default) or scan every block as a store without
        ``index_group`` does (False): the same picks, so a benchmark can time one against the other on one
        store (tools/bench_decode.py --selection-views)."""
        self._st.set_walk_index(bool(on))

    def set_sticky_blocks(self, R: int) -> None:
        """``sticky_blocks`` from now on (a decode-time knob: ``LongContextCache.retune``); the blocks kept so
        far are dropped, so the next step selects without any."""
        R = check_int(R, "sticky_blocks", 0)
        self._st.set_sticky_blocks(R)
        self.sticky_blocks = R

    def _outputs(self, H: int, out, lse):
        """(out [H, D], lse [H]) tensors and their numpy views; shapes are checked by the binding."""
        if out is None:
            out_np = np.empty((H, self.head_dim), np.float32)
            out = torch.from_numpy(out_np)
        else:
            out_np = as_numpy(out, "out", (torch.float32,), 2)
        if lse is None:
            lse_np = np.empty(H, np.float32)
            lse = torch.from_numpy(lse_np)
        else:
            lse_np = as_numpy(lse, "lse", (torch.float32,), 1)
        return out, lse, out_np, lse_np
