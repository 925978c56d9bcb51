"""A decode token planned by its cache and run in one native call (flashinfer's plan/run): the cache makes the
plan (``KVCache.plan_decode``, kv/base.py) and keeps it while it stays valid; ``run`` hands every block of the
model to C++ (cpp/decode/token_step.h), which checks each layer's arguments and runs them all without coming
back to Python."""

from __future__ import annotations

from dataclasses import dataclass

from ktquest import _C
from ktquest.native.store import KVStore


@dataclass(slots=True)
class DenseTokenPlan:
    """One decode token through a dense cache (``DenseKVCache.plan_decode``): every layer writes its k/v at row
    ``pos`` of ``caches[i]`` = (k, v) [KVH, capacity, D] and attends rows [0, pos] (softmax scale ``scale``)."""

    pos: int
    caches: list  # [n_layers] (k, v) numpy views
    scale: float

    def run(self, blocks: list, x, cos, sin, threads: int) -> None:
        """Every block of the token in one native call (blocks: the model's _C.DecodeLayer; x [dim] in place)."""
        _C.decode_token_dense(blocks, x, cos, sin, self.caches, self.pos, self.scale, threads)


@dataclass(slots=True)
class TokenPlan:
    """One decode token's attention in every layer, planned by the cache (``KVCache.plan_decode``), run in
    one native call (``ktquest.native.decode``), then handed back to ``cache.commit_decode`` (or
    ``cache.abort_decode`` when it raised).

    Every layer writes its new k/v at row ``w0`` of its window buffers ``windows[i]`` = (win_k, win_v)
    [KVH, rows, D], attends rows [0, width) but ``skip`` densely (softmax scale ``scale``), attends the
    store's context blocks as ``steps[i]`` says (a ``_C.StorePlan``: none, a fixed list, or a fresh selection
    into its ids buffer), merges the two parts by their LSE and appends k/v to ``store``."""

    pos: int
    store: KVStore
    windows: list  # [n_layers] (win_k, win_v) numpy views
    w0: int
    width: int
    skip: tuple[int, int]
    scale: float
    steps: list  # [n_layers] _C.StorePlan
    state: object = None  # the cache's own bookkeeping for commit_decode

    def run(self, blocks: list, x, cos, sin, threads: int) -> None:
        """Every block of the token in one native call (blocks: the model's _C.DecodeLayer; x [dim] in place)."""
        _C.decode_token_long_context(blocks, x, cos, sin, self.store.native, self.windows, self.w0, self.width,
                                     self.skip[0], self.skip[1], self.scale, threads, self.steps)
