"""What the model and the decode step ask of a KV cache: the protocol both caches implement.

The model computes q, k, v and RoPE; the cache stores k/v and returns causal attention over everything it
holds (``attend``). The CPU decode step (``ktquest.native.decode``) asks the cache instead for a plan of
one token (``plan_decode``): where each layer's new k/v go and what each layer attends, which one native
call then runs for every block of the model (``ktquest.native.plans``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ktquest.native.plans import TokenPlan


def check_write(start: int, n: int, held: int, capacity: int) -> None:
    """ValueError unless ``n`` >= 1 positions from ``start`` can be written to a cache that holds ``held``
    tokens of at most ``capacity`` (the caches that wrap others: kv/sliding.py, kv/recurrent.py)."""
    if n < 1 or not 0 <= start <= held or start + n > capacity:
        raise ValueError(f"KV cache: cannot write positions {start}..{start + n - 1}: the cache holds {held} "
                         f"tokens of at most {capacity} (max_seq_len)")


@dataclass(frozen=True, slots=True)
class DeviceToken:
    """One decode token as a device decode step runs it (``KVCache.device_token``; models/device_step.py): the
    token's k/v go to row ``w0`` of every layer's device buffers (``device_buffers``), and its query attends
    their rows [0, width) but [skip) densely there; with ``store`` each layer's store part runs on the host
    (``store_part``) and merges by its LSE."""

    pos: int
    w0: int
    width: int
    skip: tuple[int, int] = (0, 0)
    store: bool = False
    generation: int = 0  # changes when the device buffers are replaced (a captured step must be made again)


class PromptLayers(Protocol):
    """A prompt read layer by layer (``prefill.order: layer``; ``Transformer.prefill_layers``): layer 0 over
    every chunk of the prompt in order, then layer 1, ...; made by ``KVCache.prompt_layers``."""

    device_bytes: int  # device memory the read holds beside the cache (``KVCache.prefill_device_bytes``)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """``KVCache.attend`` for the layer being read: its chunk at start_pos attends every position before
        it (the cache's and the prompt's) and itself causally."""
        ...

    def layer_done(self, layer_idx: int) -> None:
        """The layer read the whole prompt."""
        ...

    def done(self) -> None:
        """Every layer read the prompt: the cache holds it (``pos`` = its end)."""
        ...

    def abort(self) -> None:
        """The read stopped part-way: the cache holds exactly what it held before the prompt."""
        ...


class KVCache(Protocol):
    pos: int  # positions 0..pos-1 hold valid k/v in every layer
    max_seq_len: int  # capacity, tokens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for positions start_pos..+T-1: views, maybe non-contiguous, valid
        only during the call (the caller reuses their memory: copy what is kept).

        Stores k/v and returns causal attention over positions 0..start_pos+T-1: out [T, H, D], read by the
        caller before its next call.
        """
        ...

    def begin_prompt(self, end: int, then_decode: bool = True) -> None:
        """A prompt ending at position ``end`` is read next (chunk by chunk through ``attend``); then_decode: a
        reply follows it (not a document read alone)."""
        ...

    def prompt_layers(self, start: int, n: int) -> PromptLayers:
        """A prompt of ``n`` tokens at ``start`` (<= pos; later tokens are dropped) to be read layer by layer."""
        ...

    def prefill_device_bytes(self, n: int) -> int:
        """Device bytes that ``prompt_layers`` for ``n`` tokens holds beside the cache."""
        ...

    def plan_decode(self, pos: int) -> TokenPlan | None:
        """The native plan of one decode token at ``pos``, or None when this cache cannot plan it ahead (its
        attention needs the token's query first: the decode step then goes block by block through
        ``attend``). A plan begins the token's pass in the cache (window geometry, the planner's counters),
        so each plan is followed by exactly one ``commit_decode`` or ``abort_decode``."""
        ...

    def commit_decode(self, plan: TokenPlan) -> None:
        """The planned token ran in every layer."""
        ...

    def abort_decode(self, plan: TokenPlan) -> None:
        """The planned token raised part-way (some layers may hold it)."""
        ...

    def device_token(self, pos: int) -> DeviceToken | None:
        """Begin a decode token at ``pos`` for the device step (then ``commit_device_token``, or nothing: a
        token that raised is dropped by the next pass), or None where this cache cannot run it so (the step
        then goes through ``attend``)."""
        ...

    def device_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's device K and V [KVH, rows, D] a ``DeviceToken`` writes and attends."""
        ...

    def commit_device_token(self, token: DeviceToken) -> None:
        """The token ran in every layer."""
        ...

    def reset(self) -> None: ...

    def rewind_point(self, n: int) -> int:
        """The longest prefix of at most ``n`` held tokens that ``truncate`` can keep exactly (n, unless the
        cache dropped what a query at position n needs: ``kv/sliding.py``)."""
        ...

    def truncate(self, n: int) -> None: ...

    def nbytes(self) -> int: ...
