"""Sampling: logits -> the next token. One sampler for chat, the Python API and the tools.

The chain follows llama.cpp's default order, so its knobs mean what users of llama.cpp and Ollama expect:

    penalties (repeat, frequency, presence over the last repeat_last_n tokens)
    -> top-k -> top-p -> min-p -> temperature -> a draw from the rest

temperature 0 is greedy: the argmax after the penalties. Everything is numpy over the logits (one vector of
V floats a token, no torch dispatch on the decode path), seeded by ``GenerationConfig.seed`` and independent
of thread counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ktquest.config import GenerationConfig


def apply_penalties(logits: np.ndarray, recent: Sequence[int], repeat: float, frequency: float,
                    presence: float) -> np.ndarray:
    """logits [V] (float32, modified in place) after the penalties of the tokens in ``recent``.

    repeat (llama.cpp's repeat_penalty): a seen token's positive logit is divided by it, a negative one
    multiplied, so it always loses ground; frequency and presence (OpenAI's): subtract ``count * frequency
    + presence`` from a seen token's logit. Ids outside [0, V) are ignored."""
    if len(recent) == 0 or (repeat == 1.0 and frequency == 0.0 and presence == 0.0):
        return logits
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[keep], counts[keep]
    x = logits[ids]
    if repeat != 1.0:
        x = np.where(x > 0, x / repeat, x * repeat)
    logits[ids] = x - counts * frequency - presence
    return logits


def truncate(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The candidates left by top-k, top-p and min-p, most likely first: (ids, their logits).

    top_k 0 / top_p 1 / min_p 0 = off. top-p keeps the smallest prefix whose probability reaches top_p;
    min-p keeps the tokens whose probability is at least min_p times the most likely one's. The most likely
    token always stays; ties keep the lower id first."""
    V = logits.shape[0]
    if 0 < top_k < V:
        ids = _top_k(logits, top_k)
    else:
        ids = np.arange(V)
    ids = ids[np.lexsort((ids, -logits[ids]))]  # descending logit, then ascending id
    x = logits[ids]
    p = np.exp(x - x[0])
    p /= p.sum()
    n = len(ids)
    if top_p < 1.0:
        before = np.cumsum(p) - p  # the mass of the candidates ranked above each one
        n = min(n, max(1, int(np.count_nonzero(before < top_p))))
    if min_p > 0.0:
        n = min(n, max(1, int(np.count_nonzero(p >= min_p * p[0]))))
    return ids[:n], x[:n]


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest logits (any order; ties at the k-th value: any of them). A partial sort of
    the whole vocabulary costs ~0.4 ms at 49K: the top k are first narrowed to the logits within ``delta`` of
    the maximum (a compare; every logit left out is below every one kept), widened until k are in."""
    m, delta = float(logits.max()), 8.0
    while True:
        cand = np.flatnonzero(logits >= m - delta)
        if len(cand) >= k or delta > 1e4:
            break
        delta *= 4
    if len(cand) < k:  # (non-finite or extreme logits: the whole vocabulary)
        cand = np.arange(logits.shape[0])
    x = logits[cand]
    return cand[np.lexsort((cand, -x))[:k]] if len(cand) <= 4 * k else cand[np.argpartition(-x, k - 1)[:k]]


class Sampler:
    """The sampling state of one generation: its knobs and its random stream (seeded by ``gen.seed``)."""

    def __init__(self, gen: GenerationConfig):
        self.gen = gen
        self.rng = np.random.default_rng(gen.seed)
        self.penalized = gen.repeat_penalty != 1.0 or gen.frequency_penalty != 0.0 or gen.presence_penalty != 0.0

    def __call__(self, logits: torch.Tensor, recent: Sequence[int] = ()) -> int:
        """logits [V] -> a token id; ``recent``: the tokens so far (the last ``repeat_last_n`` are penalized)."""
        g = self.gen
        cpu32 = logits.device.type == "cpu" and logits.dtype == torch.float32
        x = logits.numpy() if cpu32 else logits.float().cpu().numpy()
        if g.temperature == 0 and not self.penalized:  # greedy: numpy's argmax, no copy
            return int(x.argmax())
        if self.penalized:
            x = apply_penalties(x.copy(), recent[-g.repeat_last_n:] if g.repeat_last_n > 0 else (),
                                g.repeat_penalty, g.frequency_penalty, g.presence_penalty)
        if g.temperature == 0:
            return int(x.argmax())
        ids, kept = truncate(x, g.top_k, g.top_p, g.min_p)
        p = np.exp((kept - kept[0]) / g.temperature)
        cdf = np.cumsum(p)
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(ids[min(i, len(ids) - 1)])
