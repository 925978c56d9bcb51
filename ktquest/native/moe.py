"""A mixture-of-experts FFN on GGUF-encoded experts (cpp/moe/): ``MoeFfn`` holds a block's router and experts'
``QuantMatrix`` objects (each expert a view of its rows of the stacked tensor) and runs one decode token through
the experts it routes the token to; ``route`` is its routing alone. The binding checks every argument."""

from __future__ import annotations

import numpy as np

from ktquest import _C

# (router, experts_gate_up [E], experts_down [E], n_used, norm_topk, *, shared_gate_up, shared_down, shared_gate)
# .run(xn [dim], y [dim], threads) -> (ids int32 [k], weights fp32 [k])
MoeFfn = _C.MoeFfn


def route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits fp32 [E] -> (ids int32 [k], weights fp32 [k]): softmax, the k best (ties to the lower id),
    renormalized over the k where ``norm`` (``models.ffn.route``'s native twin)."""
    return _C.moe_route(logits, k, norm)
