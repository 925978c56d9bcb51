#!/usr/bin/env python3
"""The sampler with top-k off against the same draw ranking the whole vocabulary (top_k = V - 1, the path
top-k off took before), A B A B in one run, on 151,936 normal logits (std 3), temperature 0.8: ms a token."""

import time

import numpy as np
import torch

from ktquest.config import GenerationConfig
from ktquest.native.sample import Sampler

V = 151936
x = torch.from_numpy((np.random.default_rng(0).standard_normal(V) * 3).astype(np.float32))
def t(**kw):
    s = Sampler(GenerationConfig(temperature=0.8, seed=1, **kw)); s(x)
    t0 = time.perf_counter()
    for _ in range(30): s(x)
    return (time.perf_counter() - t0) / 30 * 1e3
for cut in (dict(top_p=1.0, min_p=0.0), dict(top_p=0.95, min_p=0.0), dict(top_p=1.0, min_p=0.05)):
    for rep in range(2):  # A B A B
        print(cut, f"ranked whole (top_k=V-1) {t(top_k=V - 1, **cut):.2f} ms   top_k=0 {t(top_k=0, **cut):.2f} ms")
