"""What the model and the decode step ask of a KV cache: the protocol both caches implement.

The model computes q, k, v and RoPE; the cache stores k/v and returns causal attention over everything it
holds (``attend``). The CPU decode step (``ktquest.native.decode``) asks the cache instead for a plan of
one token (``plan_decode``): where each layer's new k/v go and what each layer attends, which one native
call then runs for every block of the model.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    pos: int  # positions 0..pos-1 hold valid k/v in every layer
    max_seq_len: int  # capacity, tokens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (views, maybe non-contiguous) for positions start_pos..+T-1.

        Stores k/v and returns causal attention over positions 0..start_pos+T-1: out [T, H, D].
        """
        ...

    def plan_decode(self, pos: int):
        """The native plan of one decode token at ``pos`` (a ``ktquest.native.decode.TokenPlan``), or None
        when this cache cannot plan it ahead (its attention needs the token's query first: the decode step
        then goes block by block through ``attend``)."""
        ...

    def commit_decode(self, plan) -> None:
        """The planned token ran in every layer (only called for a plan this cache made)."""
        ...

    def abort_decode(self, plan) -> None:
        """The planned token raised part-way (only called for a plan this cache made)."""
        ...

    def reset(self) -> None: ...

    def truncate(self, n: int) -> None: ...

    def nbytes(self) -> int: ...
