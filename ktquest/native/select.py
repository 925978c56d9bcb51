"""A fresh selection's request to the store (``KVStore.select``, ``select_attend``, ``step_plan``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ktquest.native.enums import MAX_RERANK


def check_rerank(r) -> int:
    """A selection's second-stage width (``Select.rerank``), checked: an integer in [1, MAX_RERANK]."""
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 1 <= r <= MAX_RERANK:
        raise ValueError(f"rerank={r!r} is not allowed: an integer in [1, {MAX_RERANK}] (1 = off)")
    return int(r)


@dataclass(slots=True, frozen=True)
class Select:
    """A fresh selection's request, as select() and select_attend() take it: the top ``k`` blocks (an int, or
    one per KV head in SEPARATE mode) per set of ``mode``, never in the half-open block ``exclude_ranges``,
    among ``allowed`` (one id list per set; None: every block); with ``ada_alpha`` the sum of k split over the
    sets by Ada-KV from this query's scores (uniform floor share ``ada_alpha``); with ``rerank`` > 1 the anchors pick
    ``rerank`` times k and a second stage keeps the k holding the most attention mass (cpp/kvstore/rerank.h)."""

    k: int | Sequence[int]
    mode: str = "SEPARATE"
    exclude_ranges: Sequence[tuple[int, int]] | np.ndarray = ()
    allowed: object = None
    ada_alpha: float | None = None
    rerank: int = 1
