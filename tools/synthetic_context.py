"""A context of N tokens whose K/V are made up, written into a KV cache without a prefill (``bench_decode.py
--synthetic``): decode speed and memory at 128K-1M tokens on a real model's shapes, where a real prefill of a
4B model at 128K takes an hour on a small machine.

``fill(cache, args, n)`` writes positions [0, n) of every layer through the cache's own layer-major prompt
protocol (``KVCache.prompt_layers``: a long-context cache's store computes its block anchors and index from
the keys as a prompt's append does, its device windows and SnapKV's recorded queries move as after a prompt),
in slabs of ``slab`` tokens; the cache then holds n tokens and the next decode step is at position n. The
made-up K/V, per layer and KV head, imitate what SmolLM2-135M's keys and values look like after a 2K-token
prefill of natural text (measured: median over its 30 layers x 3 KV heads, p10-p90 in brackets):

    key norm |k|              17   (median 17.4, p10-p90 15.5-20.5)                      ``key_norm``
    mean key, before RoPE     0.9 of |k| (0.90, 0.82-0.93); after RoPE 0.75 (0.66-0.81)   ``mean_share``
    outlier channels          4 rotary pairs among the slowest-rotating half carry most of the mean: the
                              largest mean |channel| is ~10x the median (10.8, 5.8-15.3)  ``outliers``
    locality (keys minus their mean, cosine of tokens ``lag`` apart)
                              lag 1: 0.70 (0.52-0.79), lag 8: ~0.45, lag 64: ~0.2, lag 512: ~0; made as
                              a sum of two AR(1) processes per channel: a fast one (rho 0.5, 65% of the
                              variance) and a slow one (rho exp(-1/100), 35%)            ``key_slow``
    value norm |v|            6    (5.8, 3.6-11.6); lag-1 cosine 0.25 (0.24, 0.05-0.43)   ``value_norm``
    query norm |q|            14   (14.2, 10.6-18.6)                                        ``query_norm``

On SmolLM2's shape (4K tokens, layers 0/15/29; ``key_stats``) the made-up keys come out at |k| 17.0-17.2,
mean after RoPE 0.80-0.85 of |k|, lag-1/8/64 cosines 0.76-0.81 / 0.44-0.58 / 0.27-0.40: a little more
local than the real ones, whose mean also turns further under RoPE.

Keys are rotated by the model's own RoPE frequencies (``models.rope.rope_frequencies``, rotate-half) at their
positions. ``needles`` blocks per layer and KV head (at random places between the init window and the last
``local_windows_len`` tokens) add ``needle_gain * key_norm`` along that head's query direction, so a selection
has real winners: the recorded prompt queries (the last ``preselect_window`` positions, SnapKV's), which
point that way, score the needles among their best blocks (a gain of 0.5 puts a needle's q.k/sqrt(D) some
10-15 above a plain key's at head_dim 128-64, as SmolLM2's best key stands 11-15 above the median one; where
RoPE turns the mean key into a query's way, a plain block can outbid a needle). Everything is seeded.

What it cannot show: accuracy. The decode's own queries come from the real weights reading real tokens at
position n, not from this context; the text is meaningless and the logits mean nothing. Selection and
memory traffic are real: block anchors, the hierarchical index, SnapKV's candidates, the KV bytes read per
step and the store's and process's memory. The init (sink) tokens are not special here (a real model's
first key has its own norm), and no head is 'retrieval-like' beyond its needles.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ktquest.kv.dense import DenseKVCache
from ktquest.kv.long_context import LongContextCache
from ktquest.kv.recurrent import RecurrentCache
from ktquest.kv.sliding import global_args
from ktquest.models.rope import rope_frequencies


@dataclasses.dataclass(frozen=True, slots=True)
class SyntheticKV:
    """The statistics of the made-up K/V (see the module docstring for the measured figures)."""

    key_norm: float = 17.0
    mean_share: float = 0.9  # |mean key before RoPE| / |k|
    outliers: int = 4  # rotary pairs that carry the mean (x outlier_gain)
    outlier_gain: float = 10.0
    key_fast_rho: float = 0.5  # lag-1 correlation of the fast part of a key's variation
    key_slow_len: float = 100.0  # correlation length (tokens) of the slow part
    key_slow: float = 0.35  # share of the variance in the slow part
    value_norm: float = 6.0
    value_rho: float = 0.25
    query_norm: float = 14.0
    needles: int = 8  # blocks per layer and KV head aligned with the head's query direction
    needle_gain: float = 0.5
    seed: int = 0

    def __post_init__(self):
        for name in ("key_norm", "value_norm", "query_norm", "outlier_gain", "key_slow_len"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SyntheticKV.{name}={getattr(self, name)} must be > 0")
        for name in ("mean_share", "key_fast_rho", "key_slow", "value_rho"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"SyntheticKV.{name}={getattr(self, name)} must be in [0, 1)")


@dataclasses.dataclass(slots=True)
class Filled:
    """What ``fill`` wrote: n tokens; per layer the needle blocks [KVH, needles] (block ids of ``block_size``)
    and the unit query direction of each KV head [KVH, D] (as rotated at position n - 1)."""

    n: int
    block_size: int
    needle_blocks: list[torch.Tensor]
    query_dirs: list[torch.Tensor]


def ar1(e: torch.Tensor, rho: float, x0: torch.Tensor) -> torch.Tensor:
    """x_t = rho x_{t-1} + e_t with x_{-1} = x0, without a Python loop over t: chunks of B tokens solved in
    closed form (x_i = rho^i sum_j<=i rho^-j e_j, B small enough that rho^-B <= 1e3 keeps float32's rounding
    far below the noise), the chunks' carries by the same recursion at rho^B. e: [T, C], x0: [C] -> [T, C]."""
    T = e.shape[0]
    if rho < 1e-3 or T == 0:  # (rho^2 below float32's resolution of a unit step: one term is exact enough)
        x = e.clone()
        if T:
            x[0] += rho * x0
            x[1:] += rho * e[:-1]
        return x
    B = max(2, min(512, int(6.9 / -math.log(rho))))
    M = -(-T // B)
    ep = (e if M * B == T else torch.cat([e, e.new_zeros(M * B - T, e.shape[1])])).view(M, B, -1)
    i = torch.arange(B, dtype=torch.float64)
    up, down = (rho ** -i).to(e.dtype)[:, None], (rho ** i).to(e.dtype)[:, None]
    local = torch.cumsum(ep * up, 1).mul_(down)  # [M, B, C]: each chunk from zero
    carry = x0[None] if M == 1 else torch.cat([x0[None], ar1(local[:, -1], rho ** B, x0)[:-1]])  # [M, C]
    local.add_(carry[:, None] * (down * rho))
    return local.view(M * B, -1)[:T]


class _Layer:
    """One layer's generator: per KV head a mean key, outlier pairs, a query direction, needle blocks, and the
    AR(1) states carried from one slab to the next."""

    def __init__(self, spec: SyntheticKV, layer: int, kvh: int, d: int, block_size: int, lo: int, hi: int,
                 slow_pairs: torch.Tensor, end_rope: tuple[torch.Tensor, torch.Tensor]):
        g = torch.Generator().manual_seed(spec.seed * 1_000_003 + layer)
        self.g, self.spec, self.kvh, self.d = g, spec, kvh, d
        half = d // 2
        gain = torch.ones(kvh, d, dtype=torch.float64)
        for h in range(kvh):  # outlier rotary pairs (i, i + D/2) among the slowest-rotating ones
            pairs = slow_pairs[torch.randperm(len(slow_pairs), generator=g)[: spec.outliers]]
            gain[h, pairs] = gain[h, pairs + half] = spec.outlier_gain
        mu = torch.randn(kvh, d, generator=g, dtype=torch.float64) * gain
        mu = mu / mu.norm(dim=-1, keepdim=True) * spec.mean_share * spec.key_norm  # [KVH, D] before RoPE
        self.k_sd = spec.key_norm * math.sqrt(1 - spec.mean_share ** 2) / math.sqrt(d)  # per channel
        u = torch.randn(kvh, d, generator=g, dtype=torch.float64)
        u -= (u * mu).sum(-1, keepdim=True) * mu / mu.norm(dim=-1, keepdim=True) ** 2
        self.mu = mu.float()
        u = u / u.norm(dim=-1, keepdim=True)  # [KVH, D], orthogonal to the mean key
        # as a query at the context's last position sees it (RoPE'd there): what the needles add, what the
        # recorded queries point along
        self.query_dir = _rotate(u, *end_rope).float()
        nb = max(0, (hi - lo) // block_size)  # needle blocks: between the init window and the local window
        k = min(spec.needles, nb)
        self.needles = torch.stack([lo // block_size + torch.randperm(nb, generator=g)[:k] for _ in range(kvh)]) \
            if k else torch.zeros(kvh, 0, dtype=torch.long)
        self.block_size = block_size
        c = kvh * d
        self.state = [torch.zeros(c) for _ in range(3)]  # fast key, slow key, value

    def _process(self, i: int, T: int, rho: float) -> torch.Tensor:
        """T steps of unit-variance AR(1) state ``i``: [T, KVH * D]."""
        e = torch.randn(T, self.kvh * self.d, generator=self.g, dtype=torch.float32) * math.sqrt(1 - rho * rho)
        x = ar1(e, rho, self.state[i])
        self.state[i] = x[-1].clone()
        return x

    def kv(self, a: int, b: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [a, b): keys (RoPE'd, needles added) and values, [T, KVH, D] float32 each."""
        s, T = self.spec, b - a
        slow_rho = math.exp(-1 / s.key_slow_len)
        x = (math.sqrt(1 - s.key_slow) * self._process(0, T, s.key_fast_rho)
             + math.sqrt(s.key_slow) * self._process(1, T, slow_rho)).view(T, self.kvh, self.d)
        k = self.mu + self.k_sd * x  # [T, KVH, D] before RoPE
        k = _rotate(k, cos[:, None], sin[:, None])
        pos = torch.arange(a, b)
        for h in range(self.kvh):
            hit = torch.isin(pos // self.block_size, self.needles[h])
            k[hit, h] += s.needle_gain * s.key_norm * self.query_dir[h]
        v = self._process(2, T, s.value_rho).view(T, self.kvh, self.d) * (s.value_norm / math.sqrt(self.d))
        return k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half (``models.rope.apply_rope``): x [..., D] by cos/sin broadcasting to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _rope(inv_freq: torch.Tensor, mscale: float, a: int, b: int,
          period: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] of positions [a, b) (with dual chunk attention's chunks of ``period``: their place in
    their chunk, where a key turns)."""
    pos = torch.arange(a, b, dtype=torch.float64)
    ang = (pos if period is None else pos % period)[:, None] * inv_freq[None]  # [T, D/2]
    return (torch.cat([ang.cos()] * 2, -1) * mscale).float(), (torch.cat([ang.sin()] * 2, -1) * mscale).float()


def fill(cache, args, n: int, spec: SyntheticKV = SyntheticKV(), slab: int = 8192) -> Filled:
    """Make ``cache`` (empty or not: it is reset) hold ``n`` tokens of made-up K/V, as after a prompt of n tokens
    (module docstring). cache: a ``DenseKVCache`` or a ``LongContextCache`` (exact prefill, linear anchors: its
    layer-major protocol); args: the model's ``ModelArgs`` (shapes, RoPE)."""
    if isinstance(cache, RecurrentCache):  # a hybrid: its attention layers' cache, and DeltaNet states at n
        filled = fill(cache.main, global_args(args), n, spec, slab)
        made_up_states(cache, n, spec.seed)
        return filled
    if not isinstance(cache, (DenseKVCache, LongContextCache)):
        raise ValueError(f"synthetic context: a dense or long_context cache, not {type(cache).__name__}")
    if not 1 <= n <= cache.max_seq_len:
        raise ValueError(f"synthetic context: n={n} must be in 1..max_seq_len={cache.max_seq_len}")
    kvh, d, H = args.n_kv_heads, args.head_dim, args.n_heads
    n_layers = len(args.blocks)
    if any(b.attention != "global" for b in args.blocks):
        raise ValueError("synthetic context: models with sliding-window layers are not supported")
    long = isinstance(cache, LongContextCache)
    bs = cache.lc.block_size if long else 64
    lo = cache.init_end if long else 0
    hi = n - (cache.lc.local_windows_len if long else 0)
    inv_freq, mscale = rope_frequencies(args, cache.max_seq_len)
    inv_freq = F.pad(inv_freq, (0, d // 2 - inv_freq.shape[0]))  # partial rotary: the other pairs do not turn
    slow_pairs = torch.arange(d // 4, d // 2)  # the slowest-rotating half of the pairs
    # dual chunk attention: keys turn at their place in their chunk, and the recorded queries come in its three
    # rotations (here all along the one direction: the selection's cost is what the context can show)
    dc = cache.dual_chunk
    period = None if dc is None else dc.length
    end_rope = _rope(inv_freq, 1.0, n - 1, n, period)
    layers = [_Layer(spec, i, kvh, d, bs, lo, hi, slow_pairs, end_rope) for i in range(n_layers)]
    W = cache.planner.q_win.shape[1] if long else 0
    qg = torch.Generator().manual_seed(spec.seed * 7 + 1)
    cache.reset()
    cache.begin_prompt(n)
    for a in range(0, n, slab):
        b = min(n, a + slab)
        try:
            pl = cache.prompt_layers(a, b - a)
        except ValueError as e:
            raise ValueError(f"synthetic context: the cache cannot take a layer-major prompt ({e}); "
                             f"use prefill.mode=exact and linear anchors") from None
        cos, sin = _rope(inv_freq, mscale, a, b, period)
        for i, lay in enumerate(layers):
            k, v = lay.kv(a, b, cos, sin)
            if long:  # the prompt's workspace the store and windows take the layer from (k, v [KVH, T, D]);
                # SnapKV's recorded queries (q_tail [<= W, H, D]): LongContextPromptLayers' attributes, which
                # its attend() fills
                pl.k.copy_(k.transpose(0, 1))
                pl.v.copy_(v.transpose(0, 1))
                w = min(W, b - a)
                q = lay.query_dir.repeat_interleave(H // kvh, 0)[None].expand(w, H, d)  # [w, H, D]
                q = q + 0.5 / math.sqrt(d) * torch.randn(w, H, d, generator=qg)
                q = q / q.norm(dim=-1, keepdim=True) * spec.query_norm
                pl.q_tail[i] = (q if dc is None else torch.cat([q] * 3, 1)).to(pl.k)  # [w, (3) H, D]
            else:
                kc, vc = cache.layer_kv(i)  # [KVH, capacity, D]
                kc[:, a:b], vc[:, a:b] = k.transpose(0, 1), v.transpose(0, 1)
            pl.layer_done(i)
        pl.done()
    assert cache.pos == n
    return Filled(n, bs, [lay.needles for lay in layers], [lay.query_dir.float() for lay in layers])


def made_up_states(cache, n: int, seed: int) -> None:
    """A hybrid model's DeltaNet states as after n tokens (a decode step reads the whole state whatever its
    values: small random ones, like a trained state's scale), no checkpoints."""
    g = torch.Generator().manual_seed(seed * 13 + 5)
    s = cache.states
    s.ssm.copy_(0.02 * torch.randn(s.ssm.shape, generator=g))
    s.conv.copy_(0.1 * torch.randn(s.conv.shape, generator=g))
    s.hi = [n] * len(s.hi)
    cache.checkpoints.clear()
    cache.pos = n


def key_stats(k: torch.Tensor) -> dict[str, float]:
    """The documented statistics of keys k [T, KVH, D] (medians over the KV heads): norm, the mean key's share
    of it, and the cosine of neighbouring tokens' keys minus their mean at lags 1, 8 and 64."""
    k = k.double()
    norm = k.norm(dim=-1).mean(0)  # [KVH]
    mu = k.mean(0)  # [KVH, D]
    out = {"key_norm": norm.median().item(), "mean_share": (mu.norm(dim=-1) / norm).median().item()}
    kc = k - mu
    for lag in (1, 8, 64):
        if k.shape[0] > lag:
            cos = torch.nn.functional.cosine_similarity(kc[lag:], kc[:-lag], dim=-1).mean(0)
            out[f"lag{lag}_cos"] = cos.median().item()
    return out


def touch_experts(model) -> int:
    """Make every expert's weights resident, as a real prompt of thousands of tokens leaves them (each of its
    tokens routed to ``expert_used_count`` experts a layer: all of them, soon), where a made-up context leaves
    them as loading did: unread pages of the mapped file, which the first decode steps would fault in at some
    60 ms a token on a shaped Qwen3-30B-A3B. Reads one byte of every 4 KiB page of each expert's encoded
    matrices; returns the bytes they span (0 for a model without experts)."""
    from ktquest.models.ffn import MoEFeedForward

    total = 0
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            for expert in m.experts:
                for lin in (expert.w_gate_up, expert.w_down):
                    for _, part in getattr(lin.quant, "parts", ()):
                        flat = part.reshape(-1)
                        int(flat[::4096].max())
                        total += flat.nbytes
    return total

