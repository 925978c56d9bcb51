"""Generation: chunked prefill, one-token decode, sampling, and the loop that ties them together.

A ``Sequence`` (ktquest/sequence.py) holds the conversation so far; ``generate`` appends one turn: it prefills
the new prompt tokens after what the sequence holds and decodes after them. Invariant on return (also after
Ctrl-C or an error):

    seq.ids == ids_before + prompt_tokens[:result.n_prompt] + result.tokens

i.e. every token in the cache was either given as a prompt or generated *and returned*. Ctrl-C while the
prompt is read keeps the chunks read whole (``n_prompt`` of them: a turn sent again goes on from there; a
cache that cannot rewind exactly to their end holds fewer: ``KVCache.rewind_point``). A generated
token is fed to the model (so it is in the cache) before it is handed to ``on_token``; this includes the
stop token, so the next turn can continue right after it. The extra forward pass this costs at the end of
a reply (the logits of the last token are not used) keeps the cache a faithful transcript.
"""

from __future__ import annotations

import time
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ktquest.config import GenerationConfig
from ktquest.native.cpu import prefill_heap
from ktquest.native.sample import Sampler
from ktquest.sequence import Sequence
from ktquest.turn import steady_tok_s

if TYPE_CHECKING:  # (llguidance loads only where a reply is held to a format)
    from ktquest.structured import Constraint

StopReason = Literal["eos", "max_new_tokens", "max_seq_len", "interrupted"]


@dataclass(slots=True)
class GenerationResult:
    tokens: list[int]  # generated, including the stop token when stopped_by == "eos"
    n_prompt: int  # prompt tokens added to the cache (interrupted while reading it: the whole chunks or slabs read)
    prefill_s: float
    decode_s: float  # from the end of the prefill to the last token: first_token_s included
    stopped_by: StopReason
    first_token_s: float = 0.0  # from the end of the prefill to the first token known (0.0: none generated)

    @property
    def prefill_tok_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Steady decode speed, the first token's time left out (``ktquest.turn.steady_tok_s``)."""
        return steady_tok_s(len(self.tokens), self.decode_s, self.first_token_s)


def _as_tokens(tokens: abc.Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(-1)


def _device(model: torch.nn.Module) -> torch.device:
    return model.device


PrefillOrder = Literal["chunk", "layer"]


@torch.inference_mode()
def prefill(model, cache, tokens: abc.Sequence[int] | torch.Tensor, chunk_size: int,
            on_progress: Callable[[int, int], None] | None = None, order: PrefillOrder = "chunk",
            slab_tokens: int = 0, then_decode: bool = True) -> torch.Tensor:
    """Feed ``tokens`` [N] at cache.pos in chunks of ``chunk_size``; returns the last token's logits [V].

    order "chunk": each chunk through every layer, then the next chunk. "layer": each slab of ``slab_tokens``
    tokens (0 = the whole prompt) read layer by layer (``Transformer.prefill_layers``: one layer over all the
    slab's chunks, its K/V on the device, then the next layer). Only the last position's logits are computed.
    on_progress(done, total) after each chunk (of each layer: done counts a share of the work in tokens).
    then_decode: a reply follows (``KVCache.begin_prompt``: the work a first decode step needs is done as the
    prompt is read); False for a document read alone.
    """
    tokens = _as_tokens(tokens, _device(model))
    n = tokens.shape[0]
    if n == 0:
        raise ValueError("prefill: no tokens")
    if chunk_size < 1:
        raise ValueError(f"prefill: chunk_size={chunk_size} must be >= 1")
    if cache.pos + n > cache.max_seq_len:
        raise ValueError(f"KV cache overflow: {n} prompt tokens after the {cache.pos} held do not fit in "
                         f"max_seq_len={cache.max_seq_len}")
    logits = None
    cache.begin_prompt(cache.pos + n, then_decode)
    if order == "layer" and n > 1:
        # A last chunk of one token goes through the chunk path (the cache reads it as a prompt's pass,
        # every block: begin_prompt), as chunk order reads it.
        body, slab = n - (n % chunk_size == 1), slab_tokens or n
        with prefill_heap():
            for a in range(0, body, slab):
                def progress(done: int, total: int, a: int = a) -> None:  # slab a's share of the prompt
                    on_progress(a + done, n)

                logits = model.prefill_layers(tokens[a: min(body, a + slab)], cache.pos, cache, chunk_size,
                                              None if on_progress is None else progress)
        if body < n:
            logits = prefill_chunk(model, cache, tokens[body:])
            if on_progress is not None:
                on_progress(n, n)
        return logits
    with prefill_heap():
        for done in range(0, n, chunk_size):
            logits = prefill_chunk(model, cache, tokens[done: done + chunk_size])
            if on_progress is not None:
                on_progress(min(done + chunk_size, n), n)
    return logits


def prefill_chunk(model, cache, chunk: torch.Tensor) -> torch.Tensor:
    """Feed one chunk [C] at cache.pos; returns its last token's logits [V]. A chunk of one token goes
    through ``decode_one_token`` (on the CPU with GGUF weights, the native path); the cache still reads a
    prompt's token as the prompt's, exactly (``begin_prompt``)."""
    if chunk.shape[0] == 1:
        return decode_one_token(model, cache, int(chunk[0]))
    return model(chunk, cache.pos, cache, last_only=True)[0]  # [V]


@torch.inference_mode()
def decode_one_token(model, cache, token: int) -> torch.Tensor:
    """Feed one token at cache.pos; returns its logits [V] (the model's decode step: ``models.llama.DecodeStep``,
    native on the CPU with GGUF-encoded weights, the forward pass elsewhere)."""
    return model.decoder.decode(token, cache)


class Generation:
    """One reply in progress, a step at a time: the prompt read (``read_prompt``), then per token its sampling
    (``next_token``, None once the reply is over) and, after the model's decode step for it, its logits
    (``took``). ``generate`` runs one to its end; the server's parallel slots run several side by side, their
    decode steps batched (``NativeDecoder.decode_batch``). The arguments are ``generate``'s; the invariant of the
    module docstring holds after ``finish`` (``interrupted`` first, where a KeyboardInterrupt ended it)."""

    def __init__(self, model, seq: Sequence, prompt_tokens: abc.Sequence[int], gen: GenerationConfig,
                 stop_ids: set[int], chunk_size: int, on_token: Callable[[int], None] | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, order: PrefillOrder = "chunk",
                 slab_tokens: int = 0, on_logits: Callable[[int, torch.Tensor], None] | None = None,
                 constraint: Constraint | None = None):
        self.model, self.seq, self.prompt, self.gen, self.stop_ids = model, seq, prompt_tokens, gen, stop_ids
        self.chunk_size, self.order, self.slab_tokens = chunk_size, order, slab_tokens
        self.on_token, self.on_progress, self.should_stop = on_token, on_progress, should_stop
        self.on_logits, self.constraint = on_logits, constraint
        self.sampler = Sampler(gen)
        self.pos0 = len(seq)
        self.n_prompt = len(prompt_tokens)
        self.tokens: list[int] = []
        # What the penalties look back on: the reply's own tokens. (Penalizing the prompt's too, as llama.cpp
        # does, steers the bundled model away from the words of the question: "What is the capital of France?"
        # got an answer in French.)
        self.history: list[int] = []
        self.prefill_s = self.decode_s = self.first_token_s = 0.0
        self.stopped_by: StopReason | None = None  # None: going on
        self.logits: torch.Tensor | None = None  # the next token's, once the prompt is read
        self.pending = -1  # the token sampled last, fed to the model next
        self.t0 = 0.0

    @property
    def cache(self):
        return self.seq.cache

    def read_prompt(self) -> None:
        """Prefill the prompt after what the sequence holds (ValueError, nothing changed, if it does not fit)."""
        self.t0 = time.perf_counter()
        self.seq.feeding(self.prompt)
        self.logits = prefill(self.model, self.cache, self.prompt, self.chunk_size, self.on_progress, self.order,
                              self.slab_tokens)
        self.prefill_s = time.perf_counter() - self.t0
        self.t0 = time.perf_counter()

    def ended(self) -> bool:
        """Whether the reply is over, without sampling: a stop token, max_new_tokens, ``should_stop()`` or a
        full cache (``stopped_by`` set)."""
        if self.stopped_by is None:
            if len(self.tokens) >= self.gen.max_new_tokens:
                self._stop("max_new_tokens")
            elif self.should_stop is not None and self.should_stop():
                self._stop("interrupted")
            elif self.cache.pos >= self.cache.max_seq_len:
                self._stop("max_seq_len")
        return self.stopped_by is not None

    def next_token(self) -> int | None:
        """The next token sampled from the last logits, declared fed to the sequence; None when the reply is
        over (``stopped_by`` says why)."""
        if self.ended():
            return None
        raw = logits = self.logits
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        token = self.sampler(logits, self.history)
        if self.on_logits is not None:
            self.on_logits(token, raw)
        if self.constraint is not None and token not in self.stop_ids:
            self.constraint.advance(token)  # (its next mask is computed while the decode step runs)
        self.seq.feeding([token])
        self.pending = token
        return token

    def took(self, logits: torch.Tensor) -> None:
        """The decode step of the token ``next_token`` gave ran: it is in the cache, ``logits`` are the next."""
        token = self.pending
        self.logits = logits
        self.tokens.append(token)
        self.history.append(token)
        if len(self.tokens) == 1:  # known and in the cache: its decode step counts, on_token's work does not
            self.first_token_s = time.perf_counter() - self.t0
        if self.on_token is not None:
            self.on_token(token)
        if token in self.stop_ids:
            self._stop("eos")

    def _stop(self, why: StopReason) -> None:
        self.stopped_by = why
        self.decode_s = time.perf_counter() - self.t0

    def interrupted(self) -> None:
        """A KeyboardInterrupt ended it: while the prompt was read, the chunks read whole stay (the one cut
        short goes); after, the reply so far."""
        self.stopped_by = "interrupted"
        if self.logits is None:
            self.prefill_s = time.perf_counter() - self.t0
            self.n_prompt = max(0, self.seq.rewind(len(self.seq)) - self.pos0)
        else:
            self.decode_s = time.perf_counter() - self.t0
            self.seq.rewind(self.pos0 + self.n_prompt + len(self.tokens))

    def run(self) -> GenerationResult:
        """The whole reply, one decode step a token (``generate``)."""
        try:
            self.read_prompt()
            while (token := self.next_token()) is not None:
                self.took(decode_one_token(self.model, self.cache, token))  # token is now in the cache
        except KeyboardInterrupt:
            self.interrupted()
        finally:
            result = self.finish()
        return result

    def finish(self) -> GenerationResult:
        """The sequence settled on what the cache holds, and the reply's result."""
        self.seq.settle()
        if self.stopped_by is None:  # (an error part-way)
            self.decode_s = time.perf_counter() - self.t0
        return GenerationResult(tokens=self.tokens, n_prompt=self.n_prompt, prefill_s=self.prefill_s,
                                decode_s=self.decode_s, stopped_by=self.stopped_by or "interrupted",
                                first_token_s=self.first_token_s)


def generate(model, seq: Sequence, prompt_tokens: abc.Sequence[int], gen: GenerationConfig,
             stop_ids: set[int], chunk_size: int,
             on_token: Callable[[int], None] | None = None,
             on_progress: Callable[[int, int], None] | None = None,
             should_stop: Callable[[], bool] | None = None, order: PrefillOrder = "chunk",
             slab_tokens: int = 0,
             on_logits: Callable[[int, torch.Tensor], None] | None = None,
             constraint: Constraint | None = None) -> GenerationResult:
    """Prefill ``prompt_tokens`` after what ``seq`` holds, then sample until a stop id, max_new_tokens or a
    full cache.

    ``order`` and ``slab_tokens``: how the prompt is read (``prefill``). Sampling is seeded from
    ``gen.seed``. ``should_stop()`` is polled between tokens; it and Ctrl-C
    (KeyboardInterrupt) end generation with stopped_by="interrupted" and the invariant of the module
    docstring intact. The prompt must fit in the cache (ValueError otherwise, nothing changed).
    ``on_logits(token, logits)``: each sampled token with the logits [V] it was drawn from (before the sampler's
    temperature and penalties), before its decode step (the server's logprobs). ``constraint``: structured
    output (``ktquest.structured``): each step's logits masked to the tokens its grammar allows before sampling
    (on_logits sees the model's own, unmasked), and the sampled token fed to it.
    """
    return Generation(model, seq, prompt_tokens, gen, stop_ids, chunk_size, on_token, on_progress, should_stop,
                      order, slab_tokens, on_logits, constraint).run()
