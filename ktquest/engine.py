"""The engine: model + tokenizer + KV cache from one GGUF file; raw completion (``generate``) and the
conversations of ``ktquest.chat``."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ktquest.chat import ChatSession
from ktquest.config import Config, ConfigError, GenerationConfig, find_config, load_config, show, to_dict
from ktquest.context import choose_context, context_warning
from ktquest.engine_choices import pick_activations, pick_device, pick_dtype, pick_weights
from ktquest.engine_lock import EngineLock, exclusive
from ktquest.engine_turn import EngineTurn
from ktquest.formats.bundled import DEFAULT_MODEL
from ktquest.formats.chat_template import ChatTemplateError, read_template_file
from ktquest.generate import prefill
from ktquest.kv import compat as kv_compat
from ktquest.kv import files as kv_files
from ktquest.kv import memory
from ktquest.kv.attention import fused_scratch_bytes, lse_tile_bytes, tiled_attention
from ktquest.kv.dense import DenseKVCache
from ktquest.kv.long_context import LongContextCache
from ktquest.kv.memory import (
    check_cache_fits,
    choose_weights,
    chunk_activation_bytes,
    layer_major_tokens,
    prompt_token_device_bytes,
)
from ktquest.kv.recurrent import RecurrentCache
from ktquest.kv.sliding import HybridCache, global_args
from ktquest.layers.linear import set_x16
from ktquest.models.args import RopeScaling
from ktquest.models.dual_chunk import resolve_dual_chunk
from ktquest.models.loader import build_model, read_gguf, read_tokenizer
from ktquest.native.decode import use_native_decode
from ktquest.sequence import Sequence
from ktquest.structured import ResponseFormat
from ktquest.turn import (
    ProgressCallback,
    PromptTooLongError,
    TextCallback,
    TurnStats,
    check_arg,
    check_callbacks,
)

PLAIN_CHAT_NOTICE = "ktquest: the model has no chat template: chatting as plain text continuation"

__all__ = ["Engine", "PromptTooLongError", "load", "make_cache"]


class Engine:
    """A loaded model ready to generate.  Build with ``ktquest.load``.

    One call at a time (``ktquest.engine_lock``): calls from several threads take turns, each answered as it
    would be alone; a call from inside the engine's own callback (``on_text``, ...) is a RuntimeError."""

    def __init__(self, config: Config, model_path: Path, config_path: Path | None = None):
        """``config_path``: the YAML file ``config`` was read from, if any (never written over by a KV file)."""
        t0 = time.perf_counter()
        self.config = config
        self.model_path = model_path
        self.config_path = config_path
        torch.set_num_threads(config.resolved_threads())
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        contents = read_gguf(model_path)  # the header and the tensors' shapes, checked; nothing dequantized
        self.weights_bytes = model_path.stat().st_size  # (what the weights take of the RAM on the CPU)
        self.tokenizer = read_tokenizer(contents, _chat_template(config))
        self.args = contents.args
        # max_seq_len 0: the trained context, or the most of it that fits; context_note says which and why
        # a hybrid model's DeltaNet states, live and checkpointed (kv/recurrent.py): beside the weights in memory
        states = memory.recurrent_state_bytes(self.args) * (1 + config.state_checkpoints)
        self.max_seq_len, self.context_note = choose_context(config, self.args, self.device, self.dtype,
                                                             self.weights_bytes + states)
        if states:
            memory.check_states_fit(self.args, 1 + config.state_checkpoints, self.device)
        self.state_note = _state_note(config, self.args)
        # refuse before any allocation (the weights included), with the figure
        check_cache_fits(config, global_args(self.args), self.max_seq_len, self.device, self.dtype)
        # fp16 on a GPU where it fits, else int8 rows; weights_note says which and what it takes
        self.weights, self.weights_note = choose_weights(config.weights, pick_weights(config.weights, self.device,
                                                                                      self.dtype),
                                                         self.args, self.device, self.dtype)
        dual_chunk, note = resolve_dual_chunk(config, self.args, self.max_seq_len)
        if note:
            print(note, file=sys.stderr)
        self.model = build_model(contents, self.device, self.dtype, self.max_seq_len, self.weights == "gguf",
                                 _rope_scaling(config), dual_chunk, int8=self.weights == "int8")
        self.args = self.model.args  # the file's, but for the config's RoPE scaling when it sets one
        self.context_warning = context_warning(self.args, self.max_seq_len)  # past the trained context: why
        self.model_name: str = contents.metadata.get("general.name") or model_path.stem
        self.activations = pick_activations(config.activations, self.args)
        set_x16(self.model, self.activations == "int16")
        use_native_decode(self.model, config.resolved_threads())
        self.cache = make_cache(config, self.args, self.max_seq_len, self.device, self.dtype)
        # The tokens the cache holds and whose conversation they are (a ChatSession, the server's worker)
        self.sequence = Sequence(self.cache)
        self.lock = EngineLock()  # held by every call that moves the cache or the sequence
        self._said_plain_chat = False  # PLAIN_CHAT_NOTICE is said once, with the first chat session
        self._model_fingerprint: dict | None = None  # KV files: the model file's (computed at first use)
        self.load_s = time.perf_counter() - t0  # reading, building and caching: what a user waits for

    @exclusive
    def generate(self, prompt: str, *, on_text: TextCallback | None = None,
                 on_progress: ProgressCallback | None = None, should_stop: Callable[[], bool] | None = None,
                 response_format: dict | None = None, **gen_overrides: Any) -> str:
        """Raw completion of ``prompt`` (no chat template) on a fresh cache; returns the generated text.

        ``on_text(piece)`` streams the text as it is generated; ``gen_overrides``: GenerationConfig fields;
        ``response_format``: OpenAI's (``{"type": "json_object"}``, or ``json_schema`` with a schema), the text
        held to it (``ktquest.structured``; a ``FormatError``, a ValueError, for one it cannot hold to).
        Another thread's call waits for this one; a call on this engine from inside a callback is a RuntimeError.
        Refused before any work: a ``TypeError`` for an argument of the wrong type, a ``ValueError`` for a
        value that cannot be used: ``ConfigError`` (a generation option), ``PromptTooLongError``, or a
        prompt that is empty (no tokens to continue from).
        """
        check_arg("prompt", prompt, str)
        check_callbacks(on_text=on_text, on_progress=on_progress, should_stop=should_stop)
        check_arg("response_format", response_format, (dict, type(None)))
        gen = self._gen(gen_overrides)
        fmt = ResponseFormat.parse(response_format)
        tokens = self.tokenizer.encode(prompt)
        if not tokens:
            raise ValueError(f"prompt {show(prompt)} is empty: it encodes to no tokens, and generation continues "
                             f"from at least one")
        self.check_fits(len(tokens))
        self.sequence.claim(None)  # a fresh cache
        text, _ = self.run(self.sequence, tokens, gen, on_text, on_progress, should_stop, response_format=fmt)
        return text

    def chat_session(self, system: str | None = None, document: str | None = None) -> ChatSession:
        """A multi-turn conversation; ``document`` is put before the first user message. ``TypeError``
        unless each is a str or None. A model without a chat template chats as plain text (said once on
        stderr; ``ktquest.formats.chat_template.PlainText``)."""
        check_arg("system", system, (str, type(None)))
        check_arg("document", document, (str, type(None)))
        if self.tokenizer.chat_template is None and not self._said_plain_chat:
            print(PLAIN_CHAT_NOTICE, file=sys.stderr)
            self._said_plain_chat = True
        return ChatSession(self, system=system, document=document)

    @exclusive
    def load_session(self, path: str | os.PathLike) -> ChatSession:
        """The conversation a KV file holds (``ChatSession.save``), its cache loaded: the next message reads
        only itself. ``KVFileError`` as ``load_kv``, or for a file that holds no conversation (the cache then
        unchanged)."""
        contents = self._read_kv(path, self.sequence.cache)
        chat = kv_compat.conversation(path, contents.extra)
        self._fill(self.sequence, contents, path)
        session = self.chat_session(system=chat["system"], document=chat["document"])
        session.messages = chat["messages"]
        self.sequence.adopt(session)  # the tokens loaded are its conversation's
        return session

    # ---- KV files ----

    @exclusive
    def save_kv(self, path: str | os.PathLike, seq: Sequence | None = None, extra: dict | None = None) -> int:
        """Write ``seq`` (the engine's by default: its tokens and its cache) to a KV file (``ktquest.kv.files``)
        with the model's and the config's fingerprints and ``extra`` (JSON-able); returns the file's bytes.
        ``KVFileError`` for a path it may not be written to (``check_kv_path``)."""
        seq = self.sequence if seq is None else seq
        self.check_kv_path(path)
        tokens, cache = seq.ids, seq.cache  # (ValueError where the cache moved outside its sequence)
        meta, arrays = cache.state()
        header = {"model": self._fingerprint(), "config": self.cache_config(), "cache": meta, "extra": extra or {}}
        return kv_files.save(path, header, {**arrays, "tokens": torch.tensor(tokens, dtype=torch.int32)},
                             self._protected())

    def check_kv_path(self, path: str | os.PathLike) -> None:
        """``KVFileError`` unless a KV file may be written at ``path``: a new path, an empty file or a KV file;
        never this engine's model or config file (by name or through a link), nor a directory, a device, a
        FIFO, a socket or a symlink (``kv.files.check_target``)."""
        kv_files.check_target(path, self._protected())

    @exclusive
    def load_kv(self, path: str | os.PathLike, seq: Sequence | None = None) -> tuple[list[int], dict]:
        """Fill ``seq`` (the engine's by default) from a KV file: it becomes nobody's (``Sequence.owner``) and
        holds the file's tokens; returns them and ``extra``. A ``KVFileError`` (a ValueError) names what is
        wrong: unreadable, truncated, corrupted, or written for another model or a config whose cache differs.
        The file is read and checked whole first (the store's bytes too): the sequence is then unchanged."""
        seq = self.sequence if seq is None else seq
        contents = self._read_kv(path, seq.cache)
        self._fill(seq, contents, path)
        return seq.ids, contents.extra

    def cache_config(self) -> dict:
        """The settings that shape the KV cache's contents and layout, as applied (a KV file must agree on
        each): ``kv.compat.cache_fingerprint``."""
        return kv_compat.cache_fingerprint(self)

    def _read_kv(self, path: str | os.PathLike, cache) -> kv_compat.Contents:
        return kv_compat.read(path, cache, self._fingerprint(), self.cache_config(), self.tokenizer.vocab_size)

    def _fill(self, seq: Sequence, contents: kv_compat.Contents, path: str | os.PathLike) -> None:
        seq.claim(None)
        try:
            seq.cache.load_state(contents.meta, contents.arrays)
            seq.restored(contents.tokens)
        except kv_files.KVFileError as e:  # the store refused its bytes
            seq.reset()
            raise kv_files.KVFileError(f"{path}: {e}") from None
        except BaseException:  # (Ctrl-C too): empty, never half-filled
            seq.reset()
            raise

    def _fingerprint(self) -> dict:
        if self._model_fingerprint is None:
            self._model_fingerprint = {"name": self.model_path.name, **kv_files.model_fingerprint(self.model_path)}
        return self._model_fingerprint

    def _protected(self) -> dict:
        return {"the model file": self.model_path, "the config file": self.config_path}

    # ---- internals ----

    def _gen(self, overrides: dict[str, Any]) -> GenerationConfig:
        allowed = {f.name for f in dataclasses.fields(GenerationConfig)}
        for key in overrides:
            if key not in allowed:
                raise ConfigError(f"unknown generation option {show(key)}; allowed: {', '.join(sorted(allowed))}")
        return dataclasses.replace(self.config.generation, **overrides)

    def check_fits(self, n_tokens: int) -> None:
        """PromptTooLongError unless a prompt of ``n_tokens`` leaves room in the cache for a reply."""
        if n_tokens >= self.max_seq_len:
            raise PromptTooLongError(
                f"prompt too long: {n_tokens} tokens, but the context holds {self.max_seq_len} "
                f"(max_seq_len) and the reply needs room too; shorten the prompt or raise max_seq_len")

    @exclusive
    def prefill(self, tokens, cache=None, on_progress: ProgressCallback | None = None,
                then_decode: bool = True) -> torch.Tensor:
        """Read ``tokens`` at ``cache.pos`` as the config says (chunk_size, prefill.order, prefill.slab_tokens);
        returns the last token's logits [V]. ``cache``: one made by ``make_cache`` (the tools' own, decoded
        after: ``then_decode``), or None: the engine's, through its sequence (``read``)."""
        if cache is None:
            return self.read(self.sequence, tokens, on_progress)
        p = self.config.prefill
        return prefill(self.model, cache, tokens, self.config.chunk_size, self.lock.callback(on_progress), p.order,
                       p.slab_tokens, then_decode)

    def prefill_device_bytes(self) -> int:
        """The device memory a layer-major prefill (``prefill.order: layer``) holds beside the weights and the
        cache: one layer's K/V of the longest prompt or slab, one chunk's activations, the attention's score
        tile where no fused kernel takes it (``kv.attention.lse_tile_bytes``) or the fused kernel's scratch
        (``fused_scratch_bytes``), the prompt's last logits, and a few bytes a token of the whole prompt
        (``prompt_token_device_bytes``); 0 in chunk order."""
        n = layer_major_tokens(self.config, self.max_seq_len)
        if n == 0:
            return 0
        a, chunk = self.model.args, min(self.config.chunk_size, n)
        if tiled_attention(self.device, self.dtype, a.head_dim):
            tile = lse_tile_bytes(a.n_heads * chunk)
        else:
            tile = fused_scratch_bytes(self.device, self.dtype, a.n_heads, a.n_kv_heads, a.head_dim, chunk,
                                       self.max_seq_len)
        logits = a.vocab_size * (self.dtype.itemsize + 4)
        return (self.cache.prefill_device_bytes(n) + chunk_activation_bytes(a, chunk, self.dtype.itemsize)
                + tile + logits + self.max_seq_len * prompt_token_device_bytes(a))

    @exclusive
    def read(self, seq: Sequence, tokens: list[int], on_progress: ProgressCallback | None = None) -> torch.Tensor:
        """Read ``tokens`` after what ``seq`` holds, no reply (a document before any message); returns the last
        token's logits [V]. Ctrl-C (or ``on_progress`` raising KeyboardInterrupt) propagates with the chunks
        read whole kept in ``seq``. (No reply follows here: what a first decode step needs, SnapKV's candidates,
        is chosen by the prompt read next, or by a decode step.)"""
        seq.feeding(tokens)
        try:
            return self.prefill(tokens, seq.cache, on_progress, then_decode=False)
        except KeyboardInterrupt:
            seq.rewind(len(seq))  # a cut chunk (or slab) is not kept
            raise
        finally:
            seq.settle()

    @exclusive
    def run(self, seq: Sequence, tokens: list[int], gen: GenerationConfig, on_text: TextCallback | None,
            on_progress: ProgressCallback | None, should_stop: Callable[[], bool] | None,
            on_logits: Callable[[int, torch.Tensor], None] | None = None,
            response_format: ResponseFormat | None = None) -> tuple[str, TurnStats]:
        """Read ``tokens`` after what ``seq`` holds and generate after them; returns the reply text and its
        stats. ``seq``: the engine's own, or another over a cache made by ``make_cache`` (the server's slots).
        ``on_logits``: ``generate``'s (each sampled token and its logits). ``response_format``: the reply held
        to it (``ktquest.structured``). The callbacks run inside this call: one that calls the engine gets a
        RuntimeError (``engine_lock``)."""
        return EngineTurn(self, seq, tokens, gen, on_text, on_progress, should_stop, on_logits, response_format).run()


# ---- loading ----


def load(model: str | os.PathLike | None = None, config: Config | str | os.PathLike | None = None,
         **overrides: Any) -> Engine:
    """Load a GGUF model into an ``Engine``: ``model`` is a GGUF path or a bundled model's name
    (``ktquest.formats.bundled.BUNDLED_MODELS``); None = ``config.model``, else ``DEFAULT_MODEL`` (smollm2-135m).

    ``config``: a ``Config``, a YAML path, a packaged preset's name (``"snapkv"``, ``ktquest presets``) or None
    (defaults); ``overrides``: config keys as keyword
    arguments, short names allowed as with ``--set`` (``ktquest.load(threads=2, max_new_tokens=64)``).
    The engine's ``context_note`` and ``context_warning`` (str or None) say what its context is when it is not
    the one asked for or the model's trained one (``ktquest.context``): for the CLI to print, once each.
    Errors: ``TypeError`` for a model or config of the wrong type; ``ConfigError`` (a key or value the
    schema refuses, a cache that would not fit); ``GGUFError`` (``ktquest.GGUFError``) for every model that
    cannot be loaded, its message naming the file: neither a file nor a bundled model's name, a directory or
    a FIFO, unreadable, not GGUF, corrupt, unsupported, a missing or misshapen tensor, a tokenizer or chat
    template its metadata cannot make; ``BundledModelNotFound`` (a GGUFError): a bundled model not installed.
    """
    check_arg("model", model, (str, os.PathLike, type(None)))
    check_arg("config", config, (Config, str, os.PathLike, type(None)))
    sets = list(overrides.items())  # typed (key, value) pairs: no round trip through YAML text
    if isinstance(config, Config):
        if not sets:
            cfg = config
        else:
            cfg = load_config(None, _as_sets(to_dict(config)) + sets)
    else:
        cfg = load_config(config, sets)
    from ktquest.hub import resolve_model  # (and huggingface_hub with it: only when a model is loaded)

    return Engine(cfg, resolve_model(model if model is not None else cfg.model or DEFAULT_MODEL),
                  find_config(config) if isinstance(config, (str, os.PathLike)) else None)


def _as_sets(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += _as_sets(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def make_cache(config: Config, args, max_seq_len: int, device: torch.device, dtype: torch.dtype):
    """The KV cache of ``config.mode``: dense (every token on the device) or long_context (DRAM store +
    device windows, ``ktquest.kv.long_context``); for a model with sliding-window layers (gemma3), that cache
    holds its global layers and a ``HybridCache`` the sliding layers' windows (``ktquest.kv.sliding``); for a
    hybrid model (qwen35) a ``RecurrentCache`` its DeltaNet layers' states (``ktquest.kv.recurrent``)."""
    threads = config.resolved_threads()
    g = global_args(args)
    if config.mode == "long_context":
        cache = LongContextCache(g, config, max_seq_len, device, dtype, args.dual_chunk)
    else:
        cache = DenseKVCache(g.n_layers, g.n_kv_heads, g.head_dim, max_seq_len, device, dtype, threads=threads,
                             dual_chunk=args.dual_chunk)
    if g.n_layers == args.n_layers:
        return cache
    if args.dual_chunk is not None:  # (build_model leaves it off for these models)
        raise ConfigError("dual chunk attention on a model with sliding-window or recurrent layers")
    if args.delta_layers:  # a hybrid model's DeltaNet layers keep a state (qwen35)
        return RecurrentCache(args, cache, device, config.state_checkpoint_tokens, config.state_checkpoints)
    keep = max(config.sliding_window_keep, config.chunk_size)  # an interrupted chunk must not lose the window
    return HybridCache(args, cache, device, dtype, keep, threads)


def _state_note(config: Config, args) -> str | None:
    """What a hybrid model's DeltaNet states take (the CLI prints it once), or None for another model."""
    one = memory.recurrent_state_bytes(args)
    if not one:
        return None
    mib = one / 2**20
    every = (f" and every {config.state_checkpoint_tokens:,} prompt tokens" if config.state_checkpoint_tokens
             else "")
    return (f"recurrent state {mib:.1f} MiB ({len(args.delta_layers)} DeltaNet layers), and {mib:.1f} MiB a "
            f"checkpoint at each turn boundary{every}, the last {config.state_checkpoints} kept: up to "
            f"{mib * (1 + config.state_checkpoints):.1f} MiB")


def _chat_template(config: Config) -> str | None:
    """The Jinja text of ``config.chat_template``'s file, or None (the GGUF's own); ConfigError naming it."""
    if not config.chat_template:
        return None
    try:
        return read_template_file(config.chat_template)
    except ChatTemplateError as e:
        raise ConfigError(f"chat_template: {e}") from None


def _rope_scaling(config: Config) -> RopeScaling | None:
    """The config's RoPE scaling in place of the file's, or None (``rope_scaling: gguf``)."""
    if config.rope_scaling == "dynamic":
        return RopeScaling(type="dynamic", factor=config.rope_scaling_factor)
    return None
