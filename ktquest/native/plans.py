"""A decode token planned by its cache and run in one native call (flashinfer's plan/run): the cache makes the
plan (``KVCache.plan_decode``, kv/base.py) and keeps what it can while it stays valid; ``run`` hands every block
of the model to C++ (cpp/decode/token_step.h), which checks each layer's arguments and runs them all without
coming back to Python."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ktquest import _C
from ktquest.native.store import KVStore


def dense_layer(k: np.ndarray, v: np.ndarray, row: int, skip: tuple[int, int] = (0, 0)) -> tuple:
    """A layer that attends a dense K/V buffer k/v [KVH, rows, D] (fp32 numpy views): the token's k/v at ``row``,
    rows [0, row] attended but [skip)."""
    return ("dense", k, v, row, skip[0], skip[1])


def store_layer(win_k: np.ndarray, win_v: np.ndarray, step) -> tuple:
    """The next layer of the plan's store: its window buffers [KVH, rows, D] and its store part (a
    ``_C.StorePlan`` from ``KVStore.step_plan``: none, a fixed block list, or a fresh selection)."""
    return ("store", win_k, win_v, step)


@dataclass(slots=True)
class TokenPlan:
    """One decode token through every layer of the model, planned by its cache (``KVCache.plan_decode``), run in
    one native call, then handed back to ``cache.commit_decode`` (or ``cache.abort_decode`` when it raised).

    ``layers[i]`` says what layer i attends (``dense_layer`` or ``store_layer``). The store layers write the
    token at row ``w0`` of their window buffers, attend rows [0, width) but ``skip`` densely and their store
    part, merge the two by their LSE and append the token to ``store``. Softmax scale ``scale`` everywhere."""

    pos: int
    layers: list  # [n_layers] dense_layer / store_layer tuples
    scale: float
    store: KVStore | None = None
    w0: int = 0
    width: int = 0
    skip: tuple[int, int] = (0, 0)
    state: object = None  # the cache's own bookkeeping for commit_decode

    def run(self, blocks: list, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope: np.ndarray,
            threads: int) -> None:
        """Every block of the token in one native call: blocks, the model's _C.DecodeLayer; x [dim] in place;
        cos/sin [n_tables, D] the token's RoPE rows; rope int32 [n_layers] each layer's table."""
        _C.decode_token(blocks, x, cos, sin, rope, self.layers, self.scale, threads,
                        None if self.store is None else self.store.native, self.w0, self.width, *self.skip)
