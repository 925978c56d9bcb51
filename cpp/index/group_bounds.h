// The hierarchical index's bounds: per layer, KV head and group of index_group consecutive blocks, the
// element-wise min and max over every anchor row of the group's blocks (QUEST: the min of the min rows and
// the max of the max rows), as fp16 rounded outward (min down, max up: still bounds, half of fp32's bytes to
// stream; exact for fp16 anchors; past fp16's range a row holds -inf / +inf and its group has no bound). The
// store keeps them exact as its anchors change (append, truncate); a
// selection scores them first (index/bound_kernels.h) and scores the blocks of a group only when its bound
// says it may hold a top-k block (select/pruned_select.cpp).
//
// Why a group's [min | max] bounds every member block's score, for each anchor type, with q_g the query
// heads of the KV head and every member anchor row a (or a QUEST block's min / max rows) inside [gmin, gmax]:
//   QUEST        sum_d (Q-_d mn_d + Q+_d mx_d), Q- <= 0 <= Q+ (selector.cpp): each term grows as mn_d falls
//                to gmin_d and mx_d rises to gmax_d, so the group's QUEST score bounds its blocks'.
//   BLOCK_MAX /  e . a, e = sum_g q_g: e_d a_d <= max(e_d gmin_d, e_d gmax_d) = min(e_d, 0) gmin_d +
//   BLOCK_MEAN   max(e_d, 0) gmax_d.
//   FIXED /      sum_g max_j q_g . a_j <= sum_g sum_d max(q_gd gmin_d, q_gd gmax_d) = sum_d (Q-_d gmin_d +
//   DYNAMIC      Q+_d gmax_d), Q-_d = sum_g min(q_gd, 0), Q+_d = sum_g max(q_gd, 0).
// So every type's bound is one dot product of [gmin | gmax] with a per-head [Q- | Q+] (BlockSelector builds
// them, bound_kernels.h computes it); fp32 rounding is covered by a margin (pruned_select.cpp). Rounding
// outward commutes with min / max (monotone), so merging into rounded rows gives the rows a recomputation
// gives.
#pragma once

#include <cstdint>

#include "kvstore/layout.h"

namespace ktq {

// Whether appending to a block only widens the hull of its anchor rows (QUEST's [min, max] box grows, FIXED's
// anchors are only added): then an append merges the block into its group's bounds instead of recomputing
// them. BLOCK_MAX's one row rises (the group's min row may rise with it), BLOCK_MEAN's moves and DYNAMIC's
// anchors are replaced: their groups are recomputed.
inline bool anchors_only_widen(AnchorType t) { return t == AnchorType::QUEST || t == AnchorType::FIXED; }

// Bring head h's group bounds of layer L up to date for nb blocks, after blocks [b_lo, nb) changed or were
// added (blocks below b_lo unchanged; old_nb: the blocks the layer had before). widened: each block in
// [b_lo, old_nb) only widened its hull (an append with anchors_only_widen), so a group that existed merges
// the changed blocks into its bounds; otherwise each touched group is recomputed from all its blocks.
// A group with no valid anchor (DYNAMIC blocks emptied by a truncate) keeps min = +inf, max = -inf.
void update_group_bounds(const StoreLayout& lay, const StoreLayer& L, int h, int64_t b_lo, int64_t old_nb,
                         int64_t nb, bool widened);

}  // namespace ktq
