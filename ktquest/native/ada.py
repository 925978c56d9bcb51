"""Ada-KV's split of a layer's selection budget over its KV heads, the store's own rule (cpp/select/ada.h): what
SnapKV's preselection splits by (``kv/selection.py``) and what a decode step's selection splits inside the store
(``KVStore.select_attend(ada_alpha=...)``)."""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import torch

from ktquest import _C
from ktquest.native.args import check_int

# Ada-KV's alpha is read as the nearest fraction with a denominator up to this (cpp/select/ada.h's kAdaMaxDen),
# so 0.2 means exactly 1/5 and every budget split rounds the same way.
ADA_MAX_DENOMINATOR = 10**6


@lru_cache(maxsize=16)
def alpha_fraction(alpha: float) -> Fraction:
    """Ada-KV's alpha as the exact fraction every budget split uses (cpp/select/ada.h)."""
    return Fraction(alpha).limit_denominator(ADA_MAX_DENOMINATOR)


def ada_budgets(block_scores: torch.Tensor, total: int, alpha: float) -> torch.Tensor:
    """Ada-KV blocks per set (cpp/select/ada.h, the rule the store's selection splits its budget by).

    block_scores: [n_sets, NB] fp32 (-inf = not a candidate) -> int64 [n_sets]: ``min(total, candidates)``
    blocks split by each set's share of the best scores, a uniform share ``alpha`` of them spread evenly but
    never past a set's candidates; exact integer arithmetic (alpha read as ``alpha_fraction``)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ada_budgets: alpha={alpha!r} is not allowed: a number in [0, 1]")
    total = check_int(total, "total")
    s = block_scores.detach().float().cpu()
    if s.dim() != 2:
        raise ValueError(f"ada_budgets: block_scores must be [n_sets, n_blocks], got shape {list(s.shape)}")
    if torch.isnan(s).any():
        raise ValueError("ada_budgets: block_scores contain NaN")
    # The native rule takes each set's candidates in order, first: -inf (not a candidate) sorts last, stably.
    cand = s != float("-inf")  # [n_sets, NB]
    order = torch.sort(cand.to(torch.uint8), dim=1, descending=True, stable=True).indices
    packed = torch.gather(s, 1, order).contiguous()
    counts = cand.sum(1).to(torch.int64)
    f = alpha_fraction(float(alpha))
    return torch.from_numpy(_C.ada_budgets(packed.numpy(), counts.numpy(), total, f.numerator,
                                           f.denominator)).long()
