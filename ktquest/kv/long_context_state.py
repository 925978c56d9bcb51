"""What a KV file (``ktquest.kv.files``) keeps of a ``LongContextCache``: each layer's store state as bytes,
the device windows, and the planner's state. A mixin of the cache: it reads the cache's ``store``,
``planner``, ``win_k``/``win_v``, ``pos``, ``buf0``, ``init_end``, ``n_layers``, ``max_seq_len`` and
``reset``."""

from __future__ import annotations

import torch


class LongContextFileState:
    """``KVCache.state`` / ``state_shapes`` / ``load_state`` for the long-context cache."""

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a KV file keeps: each layer's store state as bytes (its blocks in use: K/V tiles, anchors, the
        index), the device windows, and the planner's: the last prefill queries and SnapKV's candidates. A
        cache between passes (``pos`` tokens in every layer); the selections of the last decode step are not
        kept (the next pass prefills, which drops them)."""
        if self.store.length(0) != self.pos:  # a pass interrupted half-way: dropped, as the next pass would
            self.store.truncate(-1, self.pos)
        p = self.planner
        arrays = {"win_k": self.win_k, "win_v": self.win_v, "q_win": p.q_win}
        for i in range(self.n_layers):
            arrays[f"store{i}"] = torch.from_numpy(self.store.export_layer(i))
            if p.allowed[i] is not None:
                arrays[f"allowed{i}"] = p.allowed[i]
            if p.presel_base[i] is not None:
                arrays[f"presel{i}"] = torch.from_numpy(p.presel_base[i][0])
        meta = {"pos": self.pos, "buf0": self.buf0, "q_win_span": list(p.q_win_span),
                "allowed": [None if a is None else list(a.shape) for a in p.allowed], "allowed_lb": list(p.allowed_lb),
                "presel_pending": list(p.presel_pending), "decode_step": p.decode_step,
                "refreshed": list(p.refreshed),
                "presel": [None if b is None else [*b[0].shape, b[1]] for b in p.presel_base]}
        return meta, arrays

    def state_shapes(self, meta: dict, path: str = "") -> dict[str, tuple]:
        from ktquest.kv.files import KVFileError, check_meta

        n = check_meta(path, meta, "pos", 0, self.max_seq_len)
        check_meta(path, meta, "buf0", self.init_end, max(self.init_end, n))
        span, allowed = meta.get("q_win_span"), meta.get("allowed")
        lists = [meta.get(k) for k in ("allowed", "allowed_lb", "presel_pending")]
        if not (all(isinstance(x, list) and len(x) == self.n_layers for x in lists) and isinstance(span, list)
                and len(span) == 2 and all(type(x) is int and 0 <= x <= n for x in span) and
                all(a is None or (isinstance(a, list) and len(a) == 2 and all(type(x) is int and x >= 0 for x in a))
                    for a in allowed) and type(meta.get("decode_step")) is int
                and _refresh_state_ok(meta, self.n_layers, n)):
            raise KVFileError(f"{path}: the long-context cache's planner state is not allowed here")
        shapes = {"win_k": (tuple(self.win_k.shape), self.win_k.dtype), "win_v": (tuple(self.win_v.shape), self.dtype),
                  "q_win": (tuple(self.planner.q_win.shape), self.planner.q_win.dtype)}
        for i in range(self.n_layers):
            shapes[f"store{i}"] = ((self.store.state_bytes(n),), torch.uint8)
            if allowed[i] is not None:
                shapes[f"allowed{i}"] = (tuple(allowed[i]), torch.int32)
            if meta["presel"][i] is not None:
                shapes[f"presel{i}"] = (tuple(meta["presel"][i][:2]), torch.int32)
        return shapes

    def load_state(self, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        self.reset()
        n = meta["pos"]
        for i in range(self.n_layers):
            self.store.import_layer(i, n, arrays[f"store{i}"].numpy())
        self.win_k.copy_(arrays["win_k"])
        self.win_v.copy_(arrays["win_v"])
        self.pos, self.buf0 = n, meta["buf0"]
        p = self.planner
        p.q_win.copy_(arrays["q_win"])
        p.q_win_span = tuple(meta["q_win_span"])
        for i in range(self.n_layers):
            if meta["allowed"][i] is not None:
                p._set_allowed(i, arrays[f"allowed{i}"].clone(), meta["allowed_lb"][i])
        p.presel_pending = list(meta["presel_pending"])
        p.decode_step = meta["decode_step"]
        p.refreshed = list(meta["refreshed"])
        p.presel_base = [None if b is None else (arrays[f"presel{i}"].numpy().copy(), b[2])
                         for i, b in enumerate(meta["presel"])]


def _refresh_state_ok(meta: dict, n_layers: int, n: int) -> bool:
    """The planner's refresh state in a KV file: per layer the decode step of its last refresh (<= the file's),
    and SnapKV's own pick ([n_sets, N, lb] of the ``presel<i>`` array, or None)."""
    refreshed, presel = meta.get("refreshed"), meta.get("presel")
    return (isinstance(refreshed, list) and len(refreshed) == n_layers
            and all(type(x) is int and 0 <= x <= meta["decode_step"] for x in refreshed)
            and isinstance(presel, list) and len(presel) == n_layers
            and all(b is None or (isinstance(b, list) and len(b) == 3 and all(type(x) is int for x in b)
                                  and b[0] >= 1 and b[1] >= 1 and 0 <= b[2] <= n) for b in presel))
