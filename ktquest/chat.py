"""Multi-turn chat: a ``ChatSession`` keeps its conversation in the engine's KV cache across turns.

Each turn renders the whole conversation with the model's chat template (a model without one, a base
model, gets the plain text: each message followed by a newline, its replies as generated; ``PlainText``),
tokenizes it, and feeds only what the cache does not already hold (the longest common token prefix is
kept), so the cache always holds exactly the tokens a fresh engine would prefill for the same conversation,
and earlier turns are never prefilled again.

The messages' text (the user's, the system prompt, the document) is text: special-token strings in it are
characters, not control tokens, unless the config's ``parse_special`` is on.

A thinking model's reply (Qwen3, QwQ, DeepSeek-R1: ``<think>...</think>`` before the answer) is kept as the
answer, its thinking beside it as ``reasoning_content``: the chat template decides whether to render it
(Qwen3's does only after the last user message, so never in a later turn's history; a template that does not
know the key never shows it). The cache, which holds the reply as generated, then differs from the next
rendering from that reply's first token on: the next turn reads again from there (the common prefix kept).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ktquest.engine_lock import EngineLock, exclusive
from ktquest.formats.chat_template import TemplateLimits
from ktquest.kv.recurrent import RecurrentCache
from ktquest.sequence import common_prefix_len
from ktquest.turn import (
    ProgressCallback,
    PromptTooLongError,
    TextCallback,
    ThinkSplit,
    TurnStats,
    check_arg,
    check_callbacks,
    opens_thinking,
    split_thinking,
)

if TYPE_CHECKING:  # the engine builds sessions; a session only calls back into the engine it was given
    from ktquest.engine import Engine
    from ktquest.structured import ResponseFormat


@dataclass(slots=True)
class Reply:
    text: str  # the answer (a thinking model's think block apart)
    stats: TurnStats
    thinking: str | None = None  # the think block's text; None: the reply had none


@dataclass(slots=True)
class SessionStats:
    turns: int
    context_tokens: int
    max_seq_len: int
    kv_cache_bytes: int
    load_s: float  # the engine's load: reading the file, building the model and its cache
    prompt_tokens: int  # prefilled over all turns
    new_tokens: int  # generated over all turns
    prefill_s: float
    decode_s: float  # the first tokens' times included
    first_token_s: float  # over all turns: each from the end of its prefill to its first token
    decode_tok_s: float  # steady, over all turns: their tokens after the first over their time after it
    last: TurnStats | None
    state_bytes: int = 0  # a hybrid model's DeltaNet states and their checkpoints (kv/recurrent.py); not in kv_cache


class ChatSession:
    """A conversation whose tokens stay in the engine's KV cache between turns. Its calls take turns with every
    other call on the engine (another session's, another thread's); a call on the engine from inside one of
    its callbacks is a RuntimeError (``ktquest.engine_lock``)."""

    def __init__(self, engine: Engine, system: str | None = None, document: str | None = None):
        self.engine = engine
        self.system = system
        self.document = document
        self.messages: list[dict[str, str]] = self._opening()  # as rendered, the system message included
        self._turns: list[TurnStats] = []
        # every reply held to JSON / a JSON schema (``ktquest.structured``; ``ktquest chat --json``), or free
        self.response_format: ResponseFormat | None = None

    @exclusive
    def send(self, user_text: str, on_text: TextCallback | None = None,
             on_progress: ProgressCallback | None = None,
             should_stop: Callable[[], bool] | None = None,
             on_thinking: TextCallback | None = None) -> Reply:
        """One turn: the user's message in, the assistant's reply out (streamed to ``on_text``). A thinking
        model's think block streams to ``on_thinking`` instead (``ThinkSplit``) and is kept apart from the
        answer (``Reply.thinking``; the message's ``reasoning_content``).

        A failed turn changes nothing: the conversation stays as it was, without this message. Before any
        work: ``ChatTemplateError`` (the template failed on this conversation) or ``PromptTooLongError`` (it
        no longer fits: in tokens, or in characters past what the template may render). An error while the
        reply is generated leaves the cache consistent (the next turn reads again what differs). Ctrl-C or
        ``should_stop()`` ends the reply early: the partial reply is kept as the assistant's turn
        (stats.stopped_by == "interrupted"); if that happens before the reply starts, the turn is dropped,
        and the whole chunks of it already read (stats.prompt_tokens) stay in the cache: sent again, the
        message is read on from there.
        """
        eng = self.engine
        check_arg("user_text", user_text, str)  # TypeError, as for the callbacks
        check_callbacks(on_text=on_text, on_progress=on_progress, should_stop=should_stop,
                        on_thinking=on_thinking)
        messages = self._with_message(user_text)
        tokens = encode_chat(eng, messages)
        held = self.response_format
        open_block = opens_prompt_thinking(eng, tokens)
        if held is not None and open_block:  # the think block the prompt opened first, then the format
            held = held.after_thinking()
        thinks = held is None or open_block  # (else a held reply is its format throughout)
        split = ThinkSplit(open_block) if thinks else _AllAnswer()

        def pieces(out: list) -> None:
            for kind, text in out:
                f = on_thinking if kind == "thinking" else on_text
                if f is not None:
                    f(text)

        seq = eng.sequence
        seq.claim(self)  # another session, the server or a raw completion used the cache: it starts afresh
        cached = seq.rewind_for(tokens)
        text, stats = eng.run(seq, tokens[cached:], eng.config.generation, lambda p: pieces(split.push(p)),
                              on_progress, should_stop, response_format=held)
        eng.lock.callback(pieces)(split.flush())
        if stats.new_tokens == 0 and stats.stopped_by == "interrupted":
            # interrupted before the reply began: the turn is dropped; what was read of it stays in the cache,
            # so the same message sent again reads only the rest
            return Reply(text="", stats=stats)
        thinking, answer = split_thinking(text, open_block) if thinks else (None, text)
        reply = {"role": "assistant", "content": answer}
        if thinking is not None:
            reply["reasoning_content"] = thinking
        self.messages = messages + [reply]
        self._turns.append(stats)
        return Reply(text=answer, stats=stats, thinking=thinking)

    @exclusive
    def read_document(self, on_progress: ProgressCallback | None = None) -> TurnStats:
        """Read the system prompt and the document (the tokens every first message begins with) into the cache
        before any message, e.g. to save them (``save``); the first message then reads only itself. Nothing to
        read (no document, or a conversation under way): stats of an empty read. Ctrl-C (or ``on_progress``
        raising KeyboardInterrupt) stops it, the chunks read kept (stats.stopped_by == "interrupted")."""
        eng = self.engine
        if self.document is None or any(m["role"] == "user" for m in self.messages):
            return TurnStats(0, 0, len(eng.sequence), eng.max_seq_len, 0.0, 0.0, 0.0, 0.0, "max_new_tokens")
        # the first message's tokens that do not depend on the message: the common prefix of two renderings
        a, b = (encode_chat(eng, self.messages + [{"role": "user", "content": f"{self.document}\n\n{x}"}])
                for x in ("A", "B"))
        tokens = a[: common_prefix_len(a, b)]
        if not tokens:
            return TurnStats(0, 0, len(eng.sequence), eng.max_seq_len, 0.0, 0.0, 0.0, 0.0, "max_new_tokens")
        seq = eng.sequence
        seq.claim(self)
        n0, stopped_by = seq.rewind_for(tokens), "max_new_tokens"
        t0 = time.perf_counter()
        try:
            eng.read(seq, tokens[n0:], on_progress)
        except KeyboardInterrupt:  # (raised by on_progress too) the chunks (slabs) read whole stay, as in generate
            stopped_by = "interrupted"
        dt = time.perf_counter() - t0
        n = len(seq) - n0
        return TurnStats(n, 0, len(seq), eng.max_seq_len, dt, 0.0, n / dt if dt > 0 else 0.0, 0.0, stopped_by)

    @exclusive
    def save(self, path: str | os.PathLike) -> int:
        """Write the conversation and its KV cache to a KV file (``Engine.load_session`` reads it back);
        returns the file's bytes. ValueError when the cache holds another conversation; ``KVFileError`` (a
        ValueError) for a path a KV file may not be written to (``Engine.check_kv_path``: the model or config
        file, anything but a new path, an empty file or a KV file)."""
        eng = self.engine
        if eng.sequence.owner is not self:
            raise ValueError("nothing to save: the KV cache holds no turn of this conversation")
        chat = {"system": self.system, "document": self.document, "messages": self.messages}
        return eng.save_kv(path, eng.sequence, {"chat": chat})

    @exclusive
    def reset(self, keep_cache: bool = False) -> None:
        """Forget the conversation (the system prompt and document stay for the next first turn).

        ``keep_cache``: the forgotten tokens stay in the KV cache, so the next turn reads again only what
        differs from them (another question about the same document costs the question alone).
        """
        self.messages = self._opening()
        self._turns = []
        if not keep_cache and self.engine.sequence.owner is self:
            self.engine.sequence.reset()

    def next_prompt_tokens(self, user_text: str = "") -> int:
        """How many tokens the prompt of ``send(user_text)`` would be, counted at any length (no
        PromptTooLongError): the conversation so far and the message as the chat template wraps them, the
        document with the first message. For "" before the first message: what the system prompt and the
        document take of the context (``ktquest chat`` refuses a --prompt-file that leaves no room)."""
        eng = self.engine
        messages = self._with_message(user_text)
        chars = text_chars(messages)  # the template's bounds sized for the text, not the context
        limits = TemplateLimits.for_context(max(eng.max_seq_len, chars))
        return len(eng.tokenizer.encode_messages(messages, add_generation_prompt=True,
                                                 parse_special=eng.config.parse_special, limits=limits))

    def _with_message(self, user_text: str) -> list[dict[str, str]]:
        """The conversation with the user's next message (after the document, if it is the first)."""
        first = not any(m["role"] == "user" for m in self.messages)
        content = f"{self.document}\n\n{user_text}" if first and self.document else user_text
        return self.messages + [{"role": "user", "content": content}]

    @property
    def lock(self) -> EngineLock:
        """The engine's lock, which the session's calls hold."""
        return self.engine.lock

    def stats(self) -> SessionStats:
        eng = self.engine
        held = len(eng.sequence) if eng.sequence.owner is self else 0
        steady = [t for t in self._turns if t.new_tokens > 1]  # (as ``steady_tok_s``, turn by turn, summed)
        steady_s = sum(t.decode_s - t.first_token_s for t in steady)
        steady_tok_s = sum(t.new_tokens - 1 for t in steady) / steady_s if steady_s > 0 else 0.0
        state = eng.cache.state_bytes() if isinstance(eng.cache, RecurrentCache) else 0
        return SessionStats(turns=len(self._turns), context_tokens=held, max_seq_len=eng.max_seq_len,
                            kv_cache_bytes=eng.cache.nbytes() - state, state_bytes=state, load_s=eng.load_s,
                            prompt_tokens=sum(t.prompt_tokens for t in self._turns),
                            new_tokens=sum(t.new_tokens for t in self._turns),
                            prefill_s=sum(t.prefill_s for t in self._turns),
                            decode_s=sum(t.decode_s for t in self._turns),
                            first_token_s=sum(t.first_token_s for t in self._turns),
                            decode_tok_s=steady_tok_s,
                            last=self._turns[-1] if self._turns else None)

    def _opening(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []


class _AllAnswer:
    """ThinkSplit's part for a reply held to a format: all of it is the answer."""

    def push(self, piece: str) -> list[tuple[str, str]]:
        return [("answer", piece)]

    def flush(self) -> list[tuple[str, str]]:
        return []


def encode_chat(eng: Engine, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The token ids of ``messages`` (and the ``tools`` the model may call) rendered for a reply (the
    generation prompt added); before any work on the model: ``ChatTemplateError`` (the template failed) or
    ``PromptTooLongError`` (past the context in tokens, or in characters past what the template may render)."""
    limits = TemplateLimits.for_context(eng.max_seq_len)
    chars = text_chars(messages) + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)
    if chars > limits.max_chars:  # past what the template may render: said as what it is
        raise PromptTooLongError(f"prompt too long: {chars:,} characters, more than the context of "
                                 f"{eng.max_seq_len} tokens (max_seq_len) can hold; shorten the prompt "
                                 "or raise max_seq_len")
    tokens = eng.tokenizer.encode_messages(messages, add_generation_prompt=True,
                                           parse_special=eng.config.parse_special, limits=limits, tools=tools)
    eng.check_fits(len(tokens))
    return tokens


def text_chars(messages: list[dict]) -> int:
    """The characters of the messages' text: their contents, any thinking kept with a reply, the calls it made."""
    return sum(len(m["content"]) + len(m.get("reasoning_content") or "") +
               (len(json.dumps(m["tool_calls"], ensure_ascii=False)) if m.get("tool_calls") else 0)
               for m in messages)


def opens_prompt_thinking(eng: Engine, tokens: list[int]) -> bool:
    """Whether the chat prompt ``tokens`` ends by opening a think block (``opens_thinking``): its reply begins
    inside it. (A model without a chat template has no generation prompt: its text is the user's.)"""
    return eng.tokenizer.chat_template is not None and opens_thinking(eng.tokenizer.decode(tokens[-16:]))
