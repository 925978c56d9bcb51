"""The engine: model + tokenizer + KV cache from one GGUF file; raw completion and multi-turn chat.

A ``ChatSession`` keeps its conversation in the KV cache across turns. Each turn renders the whole
conversation with the model's chat template, tokenizes it, and feeds only what the cache does not
already hold (the longest common token prefix is kept), so the cache always holds exactly the tokens
a fresh engine would prefill for the same conversation, and earlier turns are never prefilled again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ktquest.bundled import bundled_model_path
from ktquest.config import Config, ConfigError, GenerationConfig, load_config, to_dict
from ktquest.generate import generate
from ktquest.gguf_loader import model_weights, read_gguf
from ktquest.kv_cache import DenseKVCache
from ktquest.linear import set_decode_weights
from ktquest.long_context import LongContextCache, check_store_fits
from ktquest.models.llama import Transformer
from ktquest.tokenizer import Tokenizer

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


@dataclass(slots=True)
class Reply:
    text: str
    stats: TurnStats


@dataclass(slots=True)
class SessionStats:
    turns: int
    context_tokens: int
    max_seq_len: int
    kv_cache_bytes: int
    prompt_tokens: int  # prefilled over all turns
    new_tokens: int  # generated over all turns
    prefill_s: float
    decode_s: float
    last: TurnStats | None


class Engine:
    """A loaded model ready to generate.  Build with ``ktquest.load``."""

    def __init__(self, config: Config, model_path: Path):
        self.config = config
        self.model_path = model_path
        torch.set_num_threads(config.resolved_threads())
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, self.device)
        contents = read_gguf(model_path)
        self.args = contents.args
        self.model_name: str = contents.metadata.get("general.name") or model_path.stem
        self.max_seq_len = config.max_seq_len or contents.args.context_length
        if config.mode == "long_context":  # refuse before any allocation, with the figure
            check_store_fits(config.long_context, contents.args, self.max_seq_len)
        self.model = Transformer(contents.args, model_weights(contents, self.dtype, self.device),
                                 max_seq_len=self.max_seq_len).eval()
        decode = config.decode_weights
        if decode == "auto":
            decode = "q8_0" if self.device.type == "cpu" and self.dtype == torch.float32 else "fp32"
        set_decode_weights(self.model, decode, config.resolved_threads())
        if decode == "q8_0":  # each block's decode step in two native calls around attention
            for block in self.model.layers:
                block.enable_fused_decode(config.resolved_threads())
        self.tokenizer = Tokenizer.from_gguf_metadata(contents.metadata)
        a = contents.args
        self.cache = make_cache(config, a, self.max_seq_len, self.device, self.dtype)
        self._cache_owner: ChatSession | None = None  # whose tokens the cache holds

    def generate(self, prompt: str, *, on_text: TextCallback | None = None,
                 on_progress: ProgressCallback | None = None, should_stop: Callable[[], bool] | None = None,
                 **gen_overrides: Any) -> str:
        """Raw completion of ``prompt`` (no chat template) on a fresh cache; returns the generated text.

        ``on_text(piece)`` streams the text as it is generated; ``gen_overrides``: GenerationConfig fields.
        """
        tokens = self.tokenizer.encode(prompt)
        self._check_fits(len(tokens))
        self._cache_owner = None
        self.cache.reset()
        text, _ = self._run(tokens, self._gen(gen_overrides), on_text, on_progress, should_stop)
        return text

    def chat_session(self, system: str | None = None, document: str | None = None) -> ChatSession:
        """A multi-turn conversation; ``document`` is put before the first user message."""
        return ChatSession(self, system=system, document=document)

    # ---- internals ----

    def _gen(self, overrides: dict[str, Any]) -> GenerationConfig:
        allowed = {f.name for f in dataclasses.fields(GenerationConfig)}
        for key in overrides:
            if key not in allowed:
                raise ConfigError(f"unknown generation option {key!r}; allowed: {', '.join(sorted(allowed))}")
        return dataclasses.replace(self.config.generation, **overrides)

    def _check_fits(self, n_tokens: int) -> None:
        if n_tokens >= self.max_seq_len:
            raise PromptTooLongError(
                f"prompt too long: {n_tokens} tokens, but the context holds {self.max_seq_len} "
                f"(max_seq_len) and the reply needs room too; shorten the prompt or raise max_seq_len")

    def _run(self, tokens: list[int], gen: GenerationConfig, on_text: TextCallback | None,
             on_progress: ProgressCallback | None, should_stop: Callable[[], bool] | None,
             on_token: Callable[[int], None] | None = None) -> tuple[str, TurnStats]:
        """Feed ``tokens[cache.pos:]`` and generate after them; returns the reply text and its stats."""
        stop_ids = self.tokenizer.stop_ids
        decoder = self.tokenizer.stream_decoder()
        reply: list[int] = []

        def token_arrived(t: int) -> None:
            if on_token is not None:
                on_token(t)
            if t in stop_ids:
                return
            reply.append(t)
            piece = decoder.push(t)
            if piece and on_text is not None:
                on_text(piece)

        r = generate(self.model, self.cache, tokens[self.cache.pos:], gen, set(stop_ids), self.config.chunk_size,
                     on_token=token_arrived, on_progress=on_progress, should_stop=should_stop)
        rest = decoder.flush()
        if rest and on_text is not None:
            on_text(rest)
        stats = TurnStats(prompt_tokens=r.n_prompt, new_tokens=len(r.tokens), context_tokens=self.cache.pos,
                          max_seq_len=self.max_seq_len, prefill_s=r.prefill_s, decode_s=r.decode_s,
                          prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s, stopped_by=r.stopped_by)
        return self.tokenizer.decode(reply), stats


class ChatSession:
    """A conversation whose tokens stay in the engine's KV cache between turns."""

    def __init__(self, engine: Engine, system: str | None = None, document: str | None = None):
        self.engine = engine
        self.system = system
        self.document = document
        self.messages: list[dict[str, str]] = self._opening()  # as rendered, the system message included
        self._fed: list[int] = []  # token ids at cache positions 0.. (valid up to cache.pos)
        self._turns: list[TurnStats] = []

    def send(self, user_text: str, on_text: TextCallback | None = None,
             on_progress: ProgressCallback | None = None,
             should_stop: Callable[[], bool] | None = None) -> Reply:
        """One turn: the user's message in, the assistant's reply out (streamed to ``on_text``).

        Raises ``PromptTooLongError`` before any work if the conversation no longer fits (nothing changes).
        Ctrl-C or ``should_stop()`` ends the reply early: the partial reply is kept as the assistant's turn
        (stats.stopped_by == "interrupted"); if that happens before the reply starts, the turn is dropped.
        """
        eng, tok = self.engine, self.engine.tokenizer
        first = not any(m["role"] == "user" for m in self.messages)
        content = f"{self.document}\n\n{user_text}" if first and self.document else user_text
        messages = self.messages + [{"role": "user", "content": content}]
        tokens = tok.encode_chat(tok.apply_chat_template(messages, add_generation_prompt=True))
        eng._check_fits(len(tokens))

        cache = eng.cache
        if eng._cache_owner is not self:  # another session or a raw completion used the cache
            cache.reset()
            eng._cache_owner = self
        # Keep the longest prefix the cache already holds; at least one token must be fed for logits.
        keep = min(_common_prefix_len(self._fed[:cache.pos], tokens), len(tokens) - 1)
        cache.truncate(keep)
        self._fed = list(tokens)  # from here on, cache position i holds self._fed[i] for i < cache.pos
        text, stats = eng._run(tokens, eng.config.generation, on_text, on_progress, should_stop,
                               on_token=self._fed.append)
        if stats.prompt_tokens == 0 and stats.stopped_by == "interrupted":
            del self._fed[cache.pos:]
            return Reply(text="", stats=stats)  # interrupted while reading the prompt: turn dropped
        self.messages = messages + [{"role": "assistant", "content": text}]
        self._turns.append(stats)
        return Reply(text=text, stats=stats)

    def reset(self, keep_cache: bool = False) -> None:
        """Forget the conversation (the system prompt and document stay for the next first turn).

        ``keep_cache``: the forgotten tokens stay in the KV cache, so the next turn reads again only what
        differs from them (another question about the same document costs the question alone).
        """
        self.messages = self._opening()
        self._turns = []
        if keep_cache:
            return
        self._fed = []
        if self.engine._cache_owner is self:
            self.engine.cache.reset()

    def stats(self) -> SessionStats:
        eng = self.engine
        held = eng.cache.pos if eng._cache_owner is self else 0
        return SessionStats(turns=len(self._turns), context_tokens=held, max_seq_len=eng.max_seq_len,
                            kv_cache_bytes=eng.cache.nbytes(),
                            prompt_tokens=sum(t.prompt_tokens for t in self._turns),
                            new_tokens=sum(t.new_tokens for t in self._turns),
                            prefill_s=sum(t.prefill_s for t in self._turns),
                            decode_s=sum(t.decode_s for t in self._turns),
                            last=self._turns[-1] if self._turns else None)

    def _opening(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []


# ---- loading ----


def load(model: str | os.PathLike | None = None, config: Config | str | os.PathLike | None = None,
         **overrides: Any) -> Engine:
    """Load a GGUF model (None = ``config.model``, else the bundled SmolLM2) into an ``Engine``.

    ``config``: a ``Config``, a YAML path or None (defaults); ``overrides``: config keys as keyword
    arguments, short names allowed as with ``--set`` (``ktquest.load(threads=2, max_new_tokens=64)``).
    """
    sets = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    if isinstance(config, Config):
        if not sets:
            cfg = config
        else:
            cfg = load_config(None, _as_sets(to_dict(config)) + sets)
    else:
        cfg = load_config(config, sets)
    path = Path(model) if model is not None else Path(cfg.model) if cfg.model else bundled_model_path()
    return Engine(cfg, path)


def _as_sets(d: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += _as_sets(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_cache(config: Config, args, max_seq_len: int, device: torch.device, dtype: torch.dtype):
    """The KV cache of ``config.mode``: dense (every token on the device) or long_context (DRAM store +
    device windows, ``ktquest.long_context``)."""
    if config.mode == "long_context":
        return LongContextCache(args, config, max_seq_len, device, dtype)
    return DenseKVCache(args.n_layers, args.n_kv_heads, args.head_dim, max_seq_len, device, dtype,
                        threads=config.resolved_threads())


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} is not allowed: CUDA is not available to torch "
                          f"{torch.__version__}; use 'cpu' or 'auto'")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
