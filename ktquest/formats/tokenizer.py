"""Tokenizer and chat template, built from a GGUF file's ``tokenizer.*`` metadata alone.

``tokenizer.ggml.model``:
- ``gpt2``: byte-level BPE on HF ``tokenizers``; the pre-tokenizer regexes follow llama.cpp per
  ``tokenizer.ggml.pre`` (applied one after the other, each splitting the pieces of the previous one).
- ``llama``: SentencePiece, from a ModelProto assembled from the GGUF tokens, scores and token types.

Control tokens (GGUF token type 3) are matched in text when ``parse_special`` is on; user-defined tokens
(type 4) always are, as in llama.cpp. Both encode as single tokens.

User text is text: ``encode_messages`` turns the chat template's own markup into control tokens and the
messages' contents into plain text, so ``<|im_end|>`` typed in a message cannot end its turn or fake a role
(unless the caller opts in with ``parse_special``, as llama.cpp's ``--special``).
"""

from __future__ import annotations

import re
import struct
import threading
from collections.abc import Sequence
from typing import Any

import sentencepiece
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ktquest.formats.chat_template import DEFAULT_LIMITS, ChatTemplate, PlainText, TemplateLimits

# GGUF token types (gguf.TokenType); SentencePiece's piece types use the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---- pre-tokenizer regexes (llama.cpp, llama-vocab.cpp) ----

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k (GPT-4o; Phi-4-mini's files): a word's capitals and lower-case letters together, its contraction after it
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION
          + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],  # StarCoder family: single digits, then GPT-2
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "chatglm4": [_LLAMA3],  # llama3's regex, without its whole-piece lookup
    "gpt-4o": [_GPT4O],
}
_PRE_ALIASES = {
    "gpt2": "gpt-2", "mpt": "gpt-2", "olmo": "gpt-2", "jais": "gpt-2", "phi-2": "gpt-2",
    "starcoder": "smollm", "refact": "smollm", "command-r": "smollm", "codeshell": "smollm",
    "exaone": "smollm", "minerva-7b": "smollm",
    "llama-bpe": "llama3", "llama-v3": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "qwen2.5": "qwen2", "qwen-2.5": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2",
    "chatglm-bpe": "chatglm4", "glm4": "chatglm4", "llama4": "gpt-4o",
}
_IGNORE_MERGES = {"llama3"}  # llama.cpp looks whole pieces up in the vocab first for these

# Texts llama.cpp recognises as end-of-turn / end-of-generation when the metadata names none.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
              "<|eom_id|>", "<｜end▁of▁sentence｜>")

# Put between the characters of special-token text inside message contents (before it, for a one-character
# token), so that the text no longer matches a control token when the rendered chat is split; taken out
# before the text is encoded. A Unicode noncharacter ("for internal use"): one a message brings is dropped.
_TEXT_MARK = "\ufdd0"
# a message's text: the special-token strings in it are characters
_TEXT_FIELDS = ("content", "reasoning_content", "name", "tool_call_id")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing a key or names an unsupported tokenizer."""


class Tokenizer:
    """Text <-> token ids plus the model's chat template.  Build with ``from_gguf_metadata``."""

    def __init__(self, metadata: dict[str, Any], chat_template: str | None = None):
        """``chat_template``: Jinja text used over the file's own template (which is then not compiled)."""
        md = metadata
        try:
            self.kind: str = md["tokenizer.ggml.model"]
            self.tokens: list[str] = list(md["tokenizer.ggml.tokens"])
        except KeyError as e:
            raise TokenizerError(f"GGUF metadata has no {e.args[0]!r}: cannot build the tokenizer") from None
        n = len(self.tokens)
        self.token_types: list[int] = list(md.get("tokenizer.ggml.token_type", [NORMAL] * n))
        spm = self.kind == "llama"
        self.bos_id: int | None = md.get("tokenizer.ggml.bos_token_id", 1 if spm else None)
        self.eos_id: int | None = md.get("tokenizer.ggml.eos_token_id", 2 if spm else None)
        self.add_bos: bool = bool(md.get("tokenizer.ggml.add_bos_token", spm)) and self.bos_id is not None
        # None: a base model
        self.chat_template: str | None = chat_template or md.get("tokenizer.chat_template") or None
        self.eot_ids: frozenset[int] = _find_eot_ids(md, self.tokens)
        self.stop_ids: frozenset[int] = self.eot_ids | ({self.eos_id} if self.eos_id is not None else set())
        if self.kind == "gpt2":
            self._backend: _Backend = _ByteLevelBPE(md, self.tokens, self.token_types)
        elif spm:
            self._backend = _SentencePiece(md, self.tokens, self.token_types)
        else:
            raise TokenizerError(f"tokenizer.ggml.model={self.kind!r} is not supported: expected 'gpt2' or 'llama'")
        self._template: ChatTemplate | PlainText = PlainText()
        self.set_chat_template(self.chat_template)  # a ChatTemplateError here if it does not compile
        specials = sorted(self._backend.special_ids, key=len, reverse=True)  # longest first: it wins
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        # special-token text that is whole (one character: no _TEXT_MARK before it) is the template's own
        markup = [re.escape(t) if len(t) > 1 else f"(?<!{_TEXT_MARK}){re.escape(t)}" for t in specials]
        self._markup_re = re.compile(f"({'|'.join(markup)})") if specials else None

    def set_chat_template(self, source: str | None) -> None:
        """Chat with the Jinja template ``source`` (e.g. ``--chat-template FILE``'s, over the file's own); None or
        empty: none, a base model's plain text. A ``ChatTemplateError`` if it does not compile (then unchanged)."""
        self._template = ChatTemplate(source) if source else PlainText()
        self.chat_template = source or None
        self._takes_tools = None  # (ktquest.tool_calls.takes_tools: found again for this template)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], chat_template: str | None = None) -> Tokenizer:
        """``metadata``: the GGUF ``tokenizer.*`` keys as plain Python values; ``chat_template``: Jinja text used
        over the file's own."""
        return cls(metadata, chat_template)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer splits ``text`` into before BPE (byte-level: bytes shown as GPT-2's
        characters, e.g. "Ġ" for a space); SentencePiece has no pre-tokenizer: [text]."""
        return self._backend.pre_tokenize(text)

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """text -> ids.  ``add_bos`` None = the GGUF default; ``parse_special`` matches control tokens."""
        ids = self._backend.encode(valid_text(text), parse_special)
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """ids -> text; control tokens are written out unless ``skip_special``."""
        return self._backend.decode(list(ids), skip_special)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    # ---- chat ----

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            limits: TemplateLimits = DEFAULT_LIMITS, tools: list[dict] | None = None) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the model's template; without one (a base
        model) the plain text of ``PlainText``: each message's content followed by a newline. ``tools``: the
        functions the model may call (OpenAI's and Hugging Face's ``{"type": "function", "function": ...}``),
        given to the template only when there are some.

        Bounded by ``limits``; any failure of the template is a ``ChatTemplateError`` (one line)."""
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        extra = {"tools": list(tools)} if tools else {}
        return self._template.render(limits, messages=list(messages), bos_token=bos, eos_token=eos,
                                     add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat, every special-token text in it a control token (``encode_messages`` keeps
        the messages' text apart); BOS per the GGUF default unless the template already wrote it."""
        bos = self.tokens[self.bos_id] if self.bos_id is not None else None
        add_bos = self.add_bos and not (bos and text.startswith(bos))
        return self.encode(text, add_bos=add_bos, parse_special=True)

    def encode_messages(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                        parse_special: bool = False, limits: TemplateLimits = DEFAULT_LIMITS,
                        tools: list[dict] | None = None) -> list[int]:
        """Render ``messages`` (and ``tools``) with the chat template and tokenize it: the template's markup
        (role markers, BOS/EOS) becomes control tokens, the messages' contents, tool calls and tools are text,
        special-token strings in them included (``<|im_end|>`` typed by a user is characters), unless
        ``parse_special``."""
        if parse_special or self._markup_re is None:
            return self.encode_chat(self.apply_chat_template(messages, add_generation_prompt, limits, tools))
        # Each text's special-token strings are broken up by _TEXT_MARKs; the template then renders them
        # wherever it puts the text (transformed too: trimmed, split, written as JSON, ...), and only the whole
        # special-token texts of the result, the template's own, are control tokens.
        marked = [{**m, **{k: self._mark(m[k]) for k in _TEXT_FIELDS if isinstance(m.get(k), str)},
                   **({"tool_calls": self._mark_all(m["tool_calls"])} if m.get("tool_calls") else {})}
                  for m in messages]
        marked_tools = self._mark_all(tools) if tools else None
        rendered = self.apply_chat_template(marked, add_generation_prompt, limits, marked_tools)
        parts = self._markup_re.split(rendered)
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:  # odd parts are the separators: the template's special tokens
                ids.append(self._backend.special_ids[part])
            elif part:
                ids += self.encode(part.replace(_TEXT_MARK, ""), add_bos=False, parse_special=False)
        if self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def _mark_all(self, value: Any) -> Any:
        """``value`` (JSON: tools, tool calls) with every string in it, keys too, marked as ``_mark`` does."""
        if isinstance(value, str):
            return self._mark(value)
        if isinstance(value, dict):
            return {self._mark(k) if isinstance(k, str) else k: self._mark_all(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark_all(v) for v in value]
        return value

    def _mark(self, content: str) -> str:
        content = content.replace(_TEXT_MARK, "")
        return self._special_re.sub(lambda m: _TEXT_MARK.join(m.group()) if len(m.group()) > 1
                                    else _TEXT_MARK + m.group(), content)


class StreamDecoder:
    """Turns ids arriving one at a time into text, holding back bytes of an unfinished UTF-8 character.

    Decodes a short window of recent ids and emits what it adds to the window's already-emitted text,
    so SentencePiece's leading-space rules and multi-token characters come out exactly as ``decode``.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._start = 0  # window start
        self._done = 0  # ids[start:done] are already emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is still incomplete)."""
        self._ids.append(token_id)
        prev = self._tok.decode(self._ids[self._start:self._done])
        text = self._tok.decode(self._ids[self._start:])
        if text.endswith("\ufffd"):
            return ""
        self._start, self._done = self._done, len(self._ids)
        return text[len(prev):]

    def flush(self) -> str:
        """The held-back rest (replacement characters for bytes that never completed)."""
        prev = self._tok.decode(self._ids[self._start:self._done])
        text = self._tok.decode(self._ids[self._start:])
        self._start = self._done = len(self._ids)
        return text[len(prev):]


# ---- backends ----


class _Backend:
    special_ids: dict[str, int]  # text -> id of the tokens that are matched in text only with parse_special

    def encode(self, text: str, parse_special: bool) -> list[int]:
        raise NotImplementedError

    def pre_tokenize(self, text: str) -> list[str]:
        return [text]

    def decode(self, ids: list[int], skip_special: bool) -> str:
        raise NotImplementedError


class _ByteLevelBPE(_Backend):
    def __init__(self, md: dict[str, Any], tokens: list[str], types: list[int]):
        pre = md.get("tokenizer.ggml.pre", "default")
        pre = _PRE_ALIASES.get(pre, pre)
        regexes = _PRE_REGEXES.get(pre, _PRE_REGEXES["gpt-2"])  # unknown names: plain GPT-2
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        self.tk = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
        self.tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self.tk.decoder = decoders.ByteLevel()
        self.tk.add_tokens([AddedToken(t, special=(ty == CONTROL), normalized=False)
                            for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)])
        self.special_ids = {t: self.tk.token_to_id(t) for t, ty in zip(tokens, types) if ty == CONTROL and t}
        self._lock = threading.Lock()

    def pre_tokenize(self, text: str) -> list[str]:
        return [p for p, _ in self.tk.pre_tokenizer.pre_tokenize_str(text)]

    def encode(self, text: str, parse_special: bool) -> list[int]:
        with self._lock:  # (the setting is the shared tokenizer's: structured output's mask thread encodes too)
            self.tk.encode_special_tokens = not parse_special
            return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special)


class _SentencePiece(_Backend):
    def __init__(self, md: dict[str, Any], tokens: list[str], types: list[int]):
        scores = list(md.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
        types = list(types)
        unk = md.get("tokenizer.ggml.unknown_token_id", 0)
        if UNKNOWN not in types:  # SentencePiece requires exactly one unknown piece
            types[unk] = UNKNOWN
        proto = _model_proto(tokens, scores, types,
                             add_dummy_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", True)),
                             remove_extra_whitespaces=bool(md.get("tokenizer.ggml.remove_extra_whitespaces", False)))
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        except RuntimeError as e:  # its check of the vocabulary (a piece twice, an empty piece, ...)
            raise TokenizerError(f"SentencePiece refused the vocabulary: {' '.join(str(e).split())}") from None
        self.tokens = tokens
        self.special = {i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)}
        # Control and user-defined tokens never come out of SentencePiece's own encoder (it escapes spaces
        # before it matches, so a user-defined run of spaces or newlines, as gemma's, would never match):
        # the text is split on them first, control tokens with parse_special only. Longest first, so that
        # a token containing another one wins.
        user = {i for i, t in enumerate(types) if t == USER_DEFINED}
        self.split_re = {parse: _split_re(tokens, user | (self.special if parse else set())) for parse in (False, True)}
        self.special_ids = {tokens[i]: i for i in self.special if tokens[i]}
        self._split_ids = {tokens[i]: i for i in self.special | user if tokens[i]}

    def encode(self, text: str, parse_special: bool) -> list[int]:
        split = self.split_re[parse_special]
        parts = split.split(text) if split else [text]
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:  # odd parts are the separators, i.e. control or user-defined tokens
                ids.append(self._split_ids[part])
            elif part:
                # Each text run follows the start or a special token: SentencePiece's dummy-prefix
                # space goes in front of each, as llama.cpp does.
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        out, run = [], []
        for i in ids:
            if i in self.special:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special:
                    out.append(self.tokens[i])
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)


# ---- helpers ----


def _split_re(tokens: Sequence[str], ids: set[int]) -> re.Pattern | None:
    """A regex whose split keeps the texts of tokens ``ids`` as separators (longest first), or None."""
    texts = sorted({tokens[i] for i in ids if tokens[i]}, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None


def _find_eot_ids(md: dict[str, Any], tokens: list[str]) -> frozenset[int]:
    ids = {md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md}
    index = {t: i for i, t in enumerate(tokens) if t in _EOT_TEXTS}
    ids.update(index.values())
    return frozenset(i for i in ids if 0 <= i < len(tokens))


def valid_text(text: str) -> str:
    """``text`` with its lone surrogates as U+FFFD: bytes that are not UTF-8, as Python's stdin and argv hand
    them over (surrogateescape), become replacement characters instead of failing to encode."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def _model_proto(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                 add_dummy_prefix: bool, remove_extra_whitespaces: bool) -> bytes:
    """Serialize a sentencepiece ModelProto (field numbers from sentencepiece_model.proto).

    Written by hand so that the ``protobuf`` package is not needed just to assemble one message.
    """
    def key(field: int, wire: int) -> bytes:
        return _varint(field << 3 | wire)

    def string(field: int, s: str | bytes) -> bytes:
        b = s.encode() if isinstance(s, str) else s
        return key(field, 2) + _varint(len(b)) + b

    def uint(field: int, v: int) -> bytes:
        return key(field, 0) + _varint(v)

    pieces = b"".join(
        string(1, string(1, t) + key(2, 5) + struct.pack("<f", s) + uint(3, ty))
        for t, s, ty in zip(tokens, scores, types))
    # llama.cpp tokenizes "llama" vocabularies as BPE whose merge priority is the piece score.
    trainer = (uint(3, 2)  # model_type BPE
               + uint(4, len(tokens))  # vocab_size
               + uint(35, int(BYTE in types)))  # byte_fallback when <0xXX> pieces exist
    normalizer = (string(1, "identity") + uint(3, int(add_dummy_prefix))
                  + uint(4, int(remove_extra_whitespaces)) + uint(5, 1))  # escape_whitespaces
    return pieces + string(2, trainer) + string(3, normalizer)


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)
