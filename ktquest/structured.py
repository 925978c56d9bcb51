"""Structured output: a reply held to JSON, or to a JSON schema, by a mask over the vocabulary at every step
(llguidance: an Earley parser over the grammar and a token trie of the vocabulary; ~50-500 us a mask).

    fmt = ResponseFormat.parse({"type": "json_schema", "json_schema": {"schema": {...}}})   # FormatError: a 400
    c = fmt.constraint(tokenizer, vocab_size)   # one reply's matcher, its first mask being computed
    logits = c.apply(logits)                    # disallowed tokens at -inf (before the sampler)
    c.advance(token)                            # the sampled token; the next mask starts on a worker thread

The next mask is computed while the model's decode step for the sampled token runs (both release the GIL), so a
step waits for it only when the mask takes longer than the step. Once the grammar is complete only the model's
end-of-turn tokens are allowed, so a reply ends where its JSON does. The vocabulary as llguidance needs it (each
token's bytes; control tokens as 0xFF + their text, which no grammar matches) is built once per tokenizer.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from ktquest.formats.tokenizer import CONTROL, UNKNOWN, UNUSED, USER_DEFINED, Tokenizer
from ktquest.turn import THINK_CLOSE

JSON_OBJECT = {"type": "object"}  # JSON mode: any object


class FormatError(ValueError):
    """A response format this runtime cannot hold a reply to (the server answers 400 with its text)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {b: b for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


def token_bytes(tok: Tokenizer) -> list[bytes]:
    """Every token's bytes as it writes into a reply: byte-level BPE letters mapped back to bytes, SentencePiece's
    "▁" as a space and its <0xAB> byte pieces as that byte; control tokens as 0xFF + their text."""
    out: list[bytes] = []
    dec = _byte_decoder() if tok.kind == "gpt2" else None
    for text, ty in zip(tok.tokens, tok.token_types):
        if ty in (CONTROL, UNKNOWN, UNUSED):  # (never part of a reply's text)
            out.append(b"\xff" + text.encode())
        elif dec is not None and ty == USER_DEFINED:  # added tokens are their literal text
            out.append(text.encode())
        elif dec is not None:
            out.append(bytes(dec[c] for c in text) if all(c in dec for c in text) else text.encode())
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out.append(bytes([int(text[3:5], 16)]))
        else:
            out.append(text.replace("▁", " ").encode())
    return out


class _Vocab:
    """What llguidance's TokenizerWrapper reads of a tokenizer (its tokens' bytes, ids, and an encoder)."""

    def __init__(self, tok: Tokenizer, vocab_size: int):
        self.tokens = token_bytes(tok) + [b""] * max(0, vocab_size - len(tok.tokens))  # (rows past the vocabulary)
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.stop_ids, default=0)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i, ty in enumerate(tok.token_types) if ty == CONTROL]
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_bos=False, parse_special=False)


def ll_tokenizer(tok: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance takes it (built once per tokenizer and vocabulary size, ~1 s), its end
    tokens the model's stop ids."""
    key = ("_llguidance", vocab_size)
    cached = getattr(tok, "_llguidance", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    wrapped = llguidance.TokenizerWrapper(_Vocab(tok, vocab_size))
    ll = llguidance.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=sorted(tok.stop_ids) or None)
    if ll.vocab_size != vocab_size:
        raise FormatError(f"response_format: the tokenizer's {ll.vocab_size} tokens are not the model's {vocab_size}")
    tok._llguidance = (key, ll)
    return ll


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A reply's format: a JSON schema (JSON mode: any object), compiled to llguidance's grammar; ``lark``: the
    same grammar in llguidance's Lark syntax, its ``start`` rule first (``after_thinking`` wraps it)."""

    grammar: str
    name: str
    lark: str = ""

    def after_thinking(self) -> ResponseFormat:
        """The format after a think block the prompt opened (``turn.opens_thinking``): any text up to
        ``</think>``, blanks, then the value. A thinking model's held reply thinks first, as it was trained to;
        the server's reasoning_content and the chat's thinking take that part. A format without Lark text (made
        by hand) is held from the first token as before. (The close tag is matched as text: a tokenizer whose
        ``</think>`` is a control token would have to spell it.) FormatError where the wrapped grammar fails."""
        if not self.lark:
            return self
        body = re.sub(r"^start:", "answer:", self.lark, count=1, flags=re.M)
        lark = "\n".join(["start: thought /\\s*/ answer", f'thought[suffix="{THINK_CLOSE}"]: /(?s:.*)/', body])
        grammar = llguidance.grammar_from("lark", lark)
        failed, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise FormatError(f"response_format after a think block: {msgs[0].strip()}")
        return ResponseFormat(grammar, self.name, lark)

    @classmethod
    def parse(cls, fmt: dict | None) -> ResponseFormat | None:
        """OpenAI's ``response_format``: None or ``{"type": "text"}`` -> None; ``json_object``; ``json_schema``
        with ``{"json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. FormatError naming what is
        wrong or what the schema uses that cannot be held to."""
        kind = (fmt or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(llguidance.grammar_from("json_schema", json.dumps(JSON_OBJECT)), "json_object",
                       f"start: %json {json.dumps(JSON_OBJECT)}")
        if kind != "json_schema":
            raise FormatError(f"response_format type {kind!r} is not supported: text, json_object or json_schema")
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise FormatError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
        failed, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:  # (warnings, a keyword it ignores, pass: the output still follows what it holds)
            raise FormatError(f"response_format json_schema: {msgs[0].strip()}")
        return cls(grammar, str(spec.get("name", "json_schema")), f"start: %json {json.dumps(schema)}")

    def constraint(self, tok: Tokenizer, vocab_size: int) -> Constraint:
        return Constraint(ll_tokenizer(tok, vocab_size), self.grammar, vocab_size)


class Constraint:
    """One reply held to a grammar (module docstring): ``apply`` before each sample, ``advance`` after it."""

    def __init__(self, lltok: llguidance.LLTokenizer, grammar: str, vocab_size: int):
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=1)
        if self.matcher.is_error():
            raise FormatError(f"response_format: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, np.int32)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ktquest-mask")
        self._next: Future = self._pool.submit(self._compute)
        self.mask_s = 0.0  # time apply() waited for masks (what the overlap did not hide)

    def _compute(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (CPU) with the tokens the grammar does not allow next at -inf (a new tensor)."""
        t0 = time.perf_counter()
        self._next.result()
        self.mask_s += time.perf_counter() - t0
        if self.matcher.is_error():  # (the parser's limits, say: its mask would only allow the end)
            raise FormatError(f"response_format: {self.matcher.get_error()}")
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        return logits.masked_fill(torch.from_numpy(allowed == 0).to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        """The reply took ``token``; the next mask starts now."""
        if not self.matcher.consume_token(token):
            raise FormatError(f"response_format: token {token} does not follow the grammar "
                              f"({self.matcher.get_error()})")
        self._next = self._pool.submit(self._compute)

    @property
    def complete(self) -> bool:
        """The reply so far is a whole value of the format."""
        return self.matcher.is_accepting()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
