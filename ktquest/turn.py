"""What a turn of generation reports and how the Python API checks its arguments: the stats of one turn, the
callbacks it reports through, the error of a prompt that does not fit. The engine, the chat and the server
share them (none of them imports another for these)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TextCallback = Callable[[str], None]
ProgressCallback = Callable[[int, int], None]


class PromptTooLongError(ValueError):
    """The prompt does not fit in the KV cache (``max_seq_len``); nothing was computed or changed."""


@dataclass(slots=True)
class TurnStats:
    prompt_tokens: int  # tokens prefilled this turn (new to the cache)
    new_tokens: int  # tokens generated, the stop token included
    context_tokens: int  # tokens in the KV cache after the turn
    max_seq_len: int
    prefill_s: float
    decode_s: float
    prefill_tok_s: float
    decode_tok_s: float
    stopped_by: str  # "eos", "max_new_tokens", "max_seq_len" or "interrupted"


def check_arg(name: str, value: object, types: type | tuple[type, ...]) -> None:
    """TypeError unless ``value`` is an instance of ``types``: the Python API's check of its arguments."""
    if not isinstance(value, types):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in
                            (types if isinstance(types, tuple) else (types,)))
        raise TypeError(f"{name} must be {names}, not {type(value).__name__}")


def check_callbacks(**callbacks: object) -> None:
    """TypeError unless each callback is None or callable."""
    for name, f in callbacks.items():
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be callable or None, not {type(f).__name__}")
