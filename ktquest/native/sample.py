"""Sampling: logits -> the next token. One sampler for chat, the Python API and the tools.

The chain follows llama.cpp's default order, so its knobs mean what users of llama.cpp and Ollama expect:

    penalties (repeat, frequency, presence over the last repeat_last_n tokens)
    -> top-k -> top-p -> min-p -> temperature -> a draw from the rest

temperature 0 is greedy: the argmax after the penalties. The chain is one native call a token
(``cpp/sample/sampler.h``: a single AVX2 pass over the vocabulary for the top k, then the rest on the k
candidates; with top-k off, only the ids a top-p or min-p cut can keep are ranked, and with no cut at all the
tempered softmax is walked in id order; no torch dispatch on the decode path), drawn at a uniform number from
a numpy stream seeded by ``GenerationConfig.seed``, so the tokens do not depend on thread counts. Its numpy
reference is in tests/test_sampling.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ktquest import _C
from ktquest.config import GenerationConfig

_NO_IDS = np.zeros(0, np.int32)


class Sampler:
    """The sampling state of one generation: its knobs and its random stream (seeded by ``gen.seed``)."""

    def __init__(self, gen: GenerationConfig):
        self.gen = gen
        self.rng = np.random.default_rng(gen.seed)
        self.params = _C.SampleParams(gen.top_k, gen.top_p, gen.min_p, gen.temperature, gen.repeat_penalty,
                                      gen.frequency_penalty, gen.presence_penalty)
        penalized = gen.repeat_penalty != 1.0 or gen.frequency_penalty != 0.0 or gen.presence_penalty != 0.0
        self.last_n = gen.repeat_last_n if penalized else 0

    def __call__(self, logits: torch.Tensor, recent: Sequence[int] = ()) -> int:
        """logits [V] -> a token id; ``recent``: the tokens so far (the last ``repeat_last_n`` are penalized)."""
        u = self.rng.random() if self.gen.temperature > 0 else 0.0
        return _C.sample(_as_numpy(logits), self._recent(recent), self.params, u)

    def distribution(self, logits: torch.Tensor, recent: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """What ``__call__`` draws from: (ids int32 [n], probabilities float64 [n]), the most likely first."""
        return _C.sample_distribution(_as_numpy(logits), self._recent(recent), self.params)

    def _recent(self, recent: Sequence[int]) -> np.ndarray:
        if self.last_n == 0 or len(recent) == 0:
            return _NO_IDS
        return np.asarray(recent[-self.last_n:], dtype=np.int32)


def _as_numpy(logits: torch.Tensor) -> np.ndarray:
    """logits [V] as a float32 numpy view (the kernel penalizes in place and restores): no copy on the CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return logits.numpy()
    return logits.detach().float().cpu().contiguous().numpy()
