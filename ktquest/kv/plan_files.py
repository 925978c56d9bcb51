"""What a KV file holds of a ``DecodePlanner`` (kv/plan.py): its state (``state``), whose shapes and values are
checked before ``DecodePlanner.load_state`` takes them (``LongContextCache.check_state``, kv/long_context.py). A file is
untrusted: every scalar typed and in range, every block id one the cache holds."""

from __future__ import annotations

import torch

from ktquest.kv.plan import DecodePlanner


def state(planner: DecodePlanner) -> tuple[dict, dict[str, torch.Tensor]]:
    """The last prefill queries and SnapKV's candidates (the selections of the last decode step are not
    kept: the next pass prefills, which drops them): (scalars, arrays)."""
    arrays = {"q_win": planner.q_win}
    for i in range(planner.n_layers):
        if planner.allowed[i] is not None:
            arrays[f"allowed{i}"] = planner.allowed[i]
        if planner.presel_base[i] is not None:
            arrays[f"presel{i}"] = torch.from_numpy(planner.presel_base[i][0])
    meta = {"q_win_span": list(planner.q_win_span),
            "allowed": [None if a is None else list(a.shape) for a in planner.allowed],
            "allowed_lb": list(planner.allowed_lb), "presel_pending": list(planner.presel_pending),
            "decode_step": planner.decode_step, "refreshed": list(planner.refreshed),
            "presel": [None if b is None else [*b[0].shape, b[1]] for b in planner.presel_base]}
    return meta, arrays


def state_shapes(planner: DecodePlanner, meta: dict, n: int) -> dict[str, tuple] | None:
    """The arrays ``DecodePlanner.load_state`` takes for ``meta`` of a cache of ``n`` tokens (name -> (shape,
    dtype)), or None where ``meta`` is not a planner's state of this cache: every scalar of it typed and in range (a
    candidate list [n_sets, N] of this head_select_mode's sets, a context end within the cache)."""
    span, allowed, lbs, pending = (meta.get(k) for k in ("q_win_span", "allowed", "allowed_lb", "presel_pending"))
    n_sets = 1 if planner.lc.head_select_mode == "SHARED" else planner.store.n_kv_heads
    if not (all(isinstance(x, list) and len(x) == planner.n_layers for x in (allowed, lbs, pending))
            and isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)
            and 0 <= span[0] <= span[1] <= min(n, span[0] + planner.q_win.shape[1])  # [a, b) in the W slots
            and all(a is None or (isinstance(a, list) and len(a) == 2 and type(a[0]) is int and a[0] == n_sets
                                  and type(a[1]) is int and 0 <= a[1] <= n) for a in allowed)
            and all(type(x) is int and 0 <= x <= n for x in lbs) and all(type(x) is bool for x in pending)
            and type(meta.get("decode_step")) is int and 0 <= meta["decode_step"] < 1 << 62
            and _refresh_state_ok(meta, planner.n_layers, n, n_sets)):
        return None
    shapes = {"q_win": (tuple(planner.q_win.shape), planner.q_win.dtype)}
    for i in range(planner.n_layers):
        if allowed[i] is not None:
            shapes[f"allowed{i}"] = (tuple(allowed[i]), torch.int32)
        if meta["presel"][i] is not None:
            shapes[f"presel{i}"] = (tuple(meta["presel"][i][:2]), torch.int32)
    return shapes

def check_ids(planner: DecodePlanner, arrays: dict[str, torch.Tensor], n: int) -> str | None:
    """What is wrong with the block ids in ``arrays`` (the candidates, SnapKV's picks) for a cache of ``n``
    tokens, or None: each is a block the cache holds, or -1 (padding)."""
    nb = -(-n // planner.lc.block_size)
    for name, t in arrays.items():
        if name.startswith(("allowed", "presel")) and t.numel() and not -1 <= int(t.min()) <= int(t.max()) < nb:
            return f"array {name} names blocks outside the {nb} the cache holds"
    return None


def _refresh_state_ok(meta: dict, n_layers: int, n: int, n_sets: int) -> bool:
    """The planner's refresh state in a KV file: per layer the decode step of its last refresh (at most the file's
    next: candidates chosen as a prompt was read count from the step after it),
    and SnapKV's own pick ([n_sets, N, lb] of the ``presel<i>`` array, or None)."""
    refreshed, presel = meta.get("refreshed"), meta.get("presel")
    return (isinstance(refreshed, list) and len(refreshed) == n_layers
            and all(type(x) is int and 0 <= x <= meta["decode_step"] + 1 for x in refreshed)
            and isinstance(presel, list) and len(presel) == n_layers
            and all(b is None or (isinstance(b, list) and len(b) == 3 and all(type(x) is int for x in b)
                                  and b[0] == n_sets and 1 <= b[1] <= n and 0 <= b[2] <= n) for b in presel))
