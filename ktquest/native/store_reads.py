"""The ``KVStore``'s read-backs (ktquest/native/store.py): what a layer holds, dequantised to fp32 tensors (its K/V,
its keys slab by slab, its anchors and index rows), for tests, tools and the torch twins of the native operators;
and what the last selection did (its stages' times, what it scored). The store's native object is ``self._st``."""

from __future__ import annotations

import torch

from ktquest.native.args import check_int


class StoreReads:
    """A mixin of ``KVStore``: the methods that copy a layer's contents or the last call's statistics out (none runs
    on the decode path)."""

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What is stored, dequantised: (k, v), each [length, KVH, D] fp32."""
        k, v = self._st.read(layer)
        return torch.from_numpy(k), torch.from_numpy(v)

    def read_range(self, layer: int, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [t0, t1) dequantised: (k, v), each [t1 - t0, KVH, D] fp32."""
        k, v = self._st.read_range(layer, check_int(t0, "t0"), check_int(t1, "t1"))
        return torch.from_numpy(k), torch.from_numpy(v)

    def read_keys(self, layer: int, t0: int, t1: int, step: int = 16384) -> torch.Tensor:
        """The keys of tokens [t0, t1) dequantised, [t1 - t0, KVH, D] fp32, read ``step`` tokens at a time, so
        that no fp32 copy of their values exists beside them (the torch twin of SnapKV's scores reads a
        layer's keys; the store's ``snapkv_scores`` reads them in place).
        Unlike ``read_range`` not one read under the store's lock: a truncate from another thread between two
        slabs would show (the cache's own thread appends and truncates, and reads this between)."""
        t0, t1, step = check_int(t0, "t0"), check_int(t1, "t1"), check_int(step, "step", 1)
        n = self._st.length(layer)  # (checks the layer)
        if t0 > t1 or t1 > n:
            raise IndexError(f"read_keys: [{t0}, {t1}) is not inside the {n} tokens of layer {layer}")
        k = torch.empty(t1 - t0, self.n_kv_heads, self.head_dim, dtype=torch.float32)
        for a in range(t0, t1, step):
            b = min(t1, a + step)
            k[a - t0: b - t0] = torch.from_numpy(self._st.read_range(layer, a, b)[0])
        return k

    def anchors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [KVH, n_blocks, A, D] as fp32, counts [KVH, n_blocks] int32): QUEST A=2 (min, max)."""
        a, c = self._st.read_anchors(layer)
        return torch.from_numpy(a), torch.from_numpy(c)

    def n_groups(self, layer: int) -> int:
        """Index groups of the layer's blocks: ceil(n_blocks / index_group) (0 without an index)."""
        return self._st.n_groups(layer)

    def bounds(self, layer: int) -> torch.Tensor:
        """The index's group rows [KVH, n_groups, 2, D] as fp32: the element-wise min, then max, over the anchor
        rows of each group's blocks (QUEST: of their min rows, then of their max rows), kept as fp16 rounded
        outward (min down, max up). ValueError without an index."""
        return torch.from_numpy(self._st.read_bounds(layer))

    def last_timing(self) -> dict[str, float]:
        """Milliseconds of the stages of the last select/attend call: score, topk, attend, and the second stage
        (rerank; 0 without one)."""
        s, t, a, r = self._st.last_timing()
        return {"score_ms": s * 1e3, "topk_ms": t * 1e3, "attend_ms": a * 1e3, "rerank_ms": r * 1e3}

    def last_index_stats(self) -> dict[str, int]:
        """What the last selection without a candidate list scored, summed over its sets: ``groups`` (group
        bounds, 0 without the index), ``blocks_scored`` (blocks whose anchors were scored) and ``candidates``
        (candidate blocks)."""
        g, b, c = self._st.last_index_stats()
        return {"groups": g, "blocks_scored": b, "candidates": c}
