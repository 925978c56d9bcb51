"""What a turn of generation reports and how the Python API checks its arguments: the stats of one turn, the
callbacks it reports through, the error of a prompt that does not fit, and a reply's text split into its
thinking and its answer (``ThinkSplit``). The engine, the chat and the server share them (none of them
imports another for these)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

TextCallback = Callable[[str], None]
ProgressCallback = Callable[[int, int], None]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
Piece = tuple[Literal["thinking", "answer"], str]


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
    decode_tok_s: float  # steady: after the first token (``steady_tok_s``)
    stopped_by: str  # "eos", "max_new_tokens", "max_seq_len" or "interrupted"
    first_token_s: float = 0.0  # from the end of the prefill to the first token, its decode step included


def steady_tok_s(new_tokens: int, decode_s: float, first_token_s: float) -> float:
    """Decode speed once the first token is out: ``(new_tokens - 1) / (decode_s - first_token_s)``. The first
    token's time (from the end of the prefill to the token, its decode step included: that step may run
    SnapKV's preselection) is reported apart as ``first_token_s``; below two tokens there is no steady rate:
    0.0."""
    steady = decode_s - first_token_s
    return (new_tokens - 1) / steady if new_tokens > 1 and steady > 0 else 0.0


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


# ---- thinking ----


def opens_thinking(prompt_end: str) -> bool:
    """Whether a rendered generation prompt ending in ``prompt_end`` opens a think block itself (the templates
    of Qwen3-2507 Thinking write ``<think>\n``): the reply then begins inside it, and writes only its end."""
    return prompt_end.rstrip().endswith(THINK_OPEN)


class ThinkSplit:
    """A reply's text, as it streams, split into its thinking and its answer (as llama.cpp's server and vLLM's
    reasoning parsers split Qwen3's, QwQ's and DeepSeek-R1's replies).

    A reply that begins with ``<think>`` (after blanks), or any reply when the prompt opened the block
    (``open_block``: ``opens_thinking``), thinks until ``</think>``; the rest is the answer. Without the end
    tag (the reply cut short) it is all thinking; a reply that does not begin so is all answer, as it came.
    The thinking and the answer are trimmed of the blanks around them (``<think>\n...\n</think>\n\n``), as
    Qwen3's template trims them. ``push`` returns the pieces that can go out now: text that may be the start
    of a tag, or blanks that may end the thinking, wait for the next piece (or ``flush``, at the reply's end).
    """

    def __init__(self, open_block: bool = False):
        self.state = "think_start" if open_block else "start"  # -> think_start -> think -> after -> answer
        self.held = ""
        self.found = open_block  # a think block was seen
        self.thinking: list[str] = []
        self.answer: list[str] = []

    @property
    def reasoning(self) -> str | None:
        """The thinking so far; None for a reply without a think block."""
        return "".join(self.thinking) if self.found else None

    @property
    def content(self) -> str:
        return "".join(self.answer)

    def push(self, piece: str) -> list[Piece]:
        out: list[Piece] = []
        buf, self.held = self.held + piece, ""
        while buf:
            if self.state == "start":
                head = buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.state, self.found, buf = "think_start", True, head[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(head):  # blanks, or the start of the tag: wait for more
                    self.held, buf = buf, ""
                else:
                    self.state = "answer"
            elif self.state in ("think_start", "after"):  # the blanks after a tag are dropped
                buf = buf.lstrip()
                if buf:
                    self.state = "think" if self.state == "think_start" else "answer"
            elif self.state == "think":
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    self._emit(out, "thinking", buf[:end].rstrip())
                    self.state, buf = "after", buf[end + len(THINK_CLOSE):]
                    continue
                # held: the end of buf that may begin the tag, and the blanks before it
                keep = next((k for k in range(min(len(buf), len(THINK_CLOSE) - 1), 0, -1)
                             if buf.endswith(THINK_CLOSE[:k])), 0)
                text = buf[: len(buf) - keep]
                sent = text.rstrip()
                self.held = buf[len(sent):]
                self._emit(out, "thinking", sent)
                buf = ""
            else:
                self._emit(out, "answer", buf)
                buf = ""
        return out

    def flush(self) -> list[Piece]:
        """The reply ended: what was held goes out (a think block never closed is all thinking)."""
        out: list[Piece] = []
        held, self.held = self.held, ""
        if self.state == "start":
            self._emit(out, "answer", held)
        elif self.state == "think":
            self._emit(out, "thinking", held.rstrip())
        return out

    def _emit(self, out: list[Piece], kind: Literal["thinking", "answer"], text: str) -> None:
        if text:
            (self.thinking if kind == "thinking" else self.answer).append(text)
            out.append((kind, text))


def split_thinking(text: str, open_block: bool = False) -> tuple[str | None, str]:
    """A whole reply's (thinking, answer), as ``ThinkSplit`` streams them; thinking None: no think block."""
    split = ThinkSplit(open_block)
    split.push(text)
    split.flush()
    return split.reasoning, split.content
