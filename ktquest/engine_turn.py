"""A reply of an engine in progress (``Engine.run``'s body, and each running request of the server's parallel
slots): a ``Generation`` whose tokens become text as they come (the stream decoder; stop ids are not text), held
to a response format where asked, with the engine's callbacks marked as its own (``engine_lock``).

    turn = EngineTurn(engine, seq, tokens, gen, on_text, on_progress, should_stop)
    text, stats = turn.run()                                   # alone: a decode step a token
    # or, side by side with others (server/worker.py's parallel slots):
    turn.generation.read_prompt(); t = turn.generation.next_token(); ...; turn.generation.took(logits)
    text, stats = turn.finish()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ktquest.config import GenerationConfig
from ktquest.generate import Generation, GenerationResult
from ktquest.sequence import Sequence
from ktquest.turn import ProgressCallback, TextCallback, TurnStats

if TYPE_CHECKING:
    from ktquest.engine import Engine
    from ktquest.structured import ResponseFormat


class EngineTurn:
    def __init__(self, engine: Engine, seq: Sequence, tokens: list[int], gen: GenerationConfig,
                 on_text: TextCallback | None, on_progress: ProgressCallback | None,
                 should_stop: Callable[[], bool] | None,
                 on_logits: Callable[[int, torch.Tensor], None] | None = None,
                 response_format: ResponseFormat | None = None):
        self.engine, self.seq = engine, seq
        on_text, on_progress, should_stop, on_logits = map(engine.lock.callback,
                                                           (on_text, on_progress, should_stop, on_logits))
        self.on_text = on_text
        self.stop_ids = engine.tokenizer.stop_ids
        self.decoder = engine.tokenizer.stream_decoder()
        self.reply: list[int] = []
        self.constraint = None if response_format is None else \
            response_format.constraint(engine.tokenizer, engine.args.vocab_size)
        try:
            self.generation = Generation(engine.model, seq, tokens, gen, set(self.stop_ids), engine.config.chunk_size,
                                         on_token=self._token, on_progress=on_progress, should_stop=should_stop,
                                         order=engine.config.prefill.order,
                                         slab_tokens=engine.config.prefill.slab_tokens, on_logits=on_logits,
                                         constraint=self.constraint)
        except BaseException:
            self.close()
            raise

    def _token(self, t: int) -> None:
        if t in self.stop_ids:
            return
        self.reply.append(t)
        piece = self.decoder.push(t)
        if piece and self.on_text is not None:
            self.on_text(piece)

    def run(self) -> tuple[str, TurnStats]:
        """The whole reply, alone."""
        try:
            r = self.generation.run()
        finally:
            self.close()
        return self._done(r)

    def finish(self) -> tuple[str, TurnStats]:
        """The reply stepped from outside ended (or was abandoned part-way: its sequence settles)."""
        try:
            r = self.generation.finish()
        finally:
            self.close()
        return self._done(r)

    def close(self) -> None:
        if self.constraint is not None:
            self.constraint.close()

    def _done(self, r: GenerationResult) -> tuple[str, TurnStats]:
        rest = self.decoder.flush()
        if rest and self.on_text is not None:
            self.on_text(rest)
        stats = TurnStats(prompt_tokens=r.n_prompt, new_tokens=len(r.tokens), context_tokens=len(self.seq),
                          max_seq_len=self.engine.max_seq_len, prefill_s=r.prefill_s, decode_s=r.decode_s,
                          prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s, stopped_by=r.stopped_by,
                          first_token_s=r.first_token_s)
        return self.engine.tokenizer.decode(self.reply), stats
