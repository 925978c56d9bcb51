"""The server's engine side: one model, one sequence at a time, the KV of recent conversations kept in slots.

No HTTP here (``ktquest.server.app`` is the HTTP side). A request is a list of prompt token ids; the
worker picks the slot whose cached tokens share the longest prefix with it, rewinds that slot's cache to the
common prefix and prefills only the rest, exactly as ``ChatSession`` does across turns. So a follow-up in a
conversation, or another question about the same long document, costs its new tokens alone; in
``long_context`` mode too (its caches rewind exactly, ``KVCache.rewind_point``).

Slots: ``slots`` caches at most, made on demand (a dense cache grows with its tokens; a long-context store
reserves lazily). A request reuses the slot with the longest common prefix when that prefix holds at least
half of the slot's tokens (the same document or conversation), else takes an empty slot, else the least
recently used one.

Whose slots: each slot remembers the key of the request that filled it (the client's credential, hashed by the
HTTP side; None: the anonymous group). With ``reuse="per-key"`` (the default) a request reuses only a slot of
its own key; another key's slot it takes starts from zero. So neither ``cached_tokens`` nor the time to answer
tells a client anything about another key's prompts (the cached count of guesses at another's secret would
grow as they come closer). ``"shared"``: any slot is reused (one user, or clients that trust each other);
``"off"``: never (every prompt read whole). A KV file's tokens (``load_kv``) are the operator's: any key
reuses them, until a request fills that slot.

Timing (``Result``, ``/health``): ``ttft_s``, the time to first token, runs from the request taken up (its
turn come, the engine's lock held: the time it waited in the queue is not in it) to its first token known: the
slot's pick and rewind, the prefill of what was not cached, and the first decode step (which may run SnapKV's
preselection). ``decode_tok_s`` is the steady speed after that first token (``steady_tok_s``).

Everything runs on the thread that calls ``complete``: the HTTP side runs requests one by one on a single
worker thread.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ktquest.config import GenerationConfig
from ktquest.engine import Engine, make_cache
from ktquest.engine_turn import EngineTurn
from ktquest.sequence import Sequence
from ktquest.turn import steady_tok_s

SIMILAR = 0.5  # a slot is this conversation's when the common prefix holds at least this share of its tokens
REUSE = ("per-key", "shared", "off")  # whose slots a request may reuse (the module docstring)
ANY_KEY = "*"  # the key of a slot any request may reuse (a KV file's; a hashed credential is hex)


@dataclass(slots=True)
class Slot:
    seq: Sequence  # the conversation it keeps: its tokens and its KV cache
    used: float = 0.0  # time.monotonic() of its last request
    key: str | None = None  # the key of the request that filled it (None: the anonymous group)
    busy: bool = False  # a reply runs in it (parallel slots)


@dataclass(slots=True)
class Running:
    """A request whose reply is under way in a slot (``Worker.begin``)."""
    slot: Slot
    turn: EngineTurn
    stop: StopText
    on_text: Callable[[str], None] | None
    cancelled: Callable[[], bool]
    n_tokens: int  # the whole prompt
    cached: int  # of it, found in the slot's cache
    setup_s: float  # the slot's pick and rewind


@dataclass(slots=True)
class Result:
    text: str
    finish_reason: str  # "stop" (end of turn or a stop string), "length" or "cancelled" (the client left)
    prompt_tokens: int  # the whole prompt
    cached_tokens: int  # of them, already in the slot's cache: not prefilled again
    completion_tokens: int  # generated, the end-of-turn token included
    prefill_s: float
    decode_s: float  # from the end of the prefill to the last token (first_token_s included)
    first_token_s: float = 0.0  # from the end of the prefill to the first token, its decode step included
    ttft_s: float = 0.0  # time to first token: from the request taken up (``complete``) to its first token

    @property
    def decode_tok_s(self) -> float:
        """Steady decode speed, the first token's time left out (``steady_tok_s``)."""
        return steady_tok_s(self.completion_tokens, self.decode_s, self.first_token_s)

    def timing(self) -> dict:
        """What ``/health`` shows of the last request."""
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "finish_reason": self.finish_reason,
                "ttft_s": self.ttft_s if self.completion_tokens else None, "prefill_s": self.prefill_s,
                "first_token_s": self.first_token_s if self.completion_tokens else None,
                "decode_tok_s": self.decode_tok_s if self.completion_tokens > 1 else None}


@dataclass(slots=True)
class Counters:
    """What the server did since it started (``/health``)."""

    requests: int = 0  # run to their end or cancelled
    cancelled: int = 0  # ended early: the client disconnected
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in a slot's cache
    prefilled_tokens: int = 0  # prompt tokens computed
    completion_tokens: int = 0
    answered: int = 0  # requests that produced a token
    ttft_s_total: float = 0.0  # their times to first token, summed (``Result.ttft_s``)


class StopText:
    """Holds back streamed text that may be the start of a stop string; ``push`` returns what can be sent,
    ``hit`` is set once a stop string is complete (the text before it is the whole reply; of several, the one
    that begins first).

    One automaton per stop string (Knuth-Morris-Pratt) reads each character once: its state is the longest end
    of the text that begins that stop string, which is also what must be held back. So a reply costs time
    linear in its length whatever the stop strings (``scanned`` counts the automata's steps)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # per stop: how many of its first characters the text ends with
        self.sent: list[str] = []
        self.held = ""  # pushed, not sent: the longest end of the text that begins a stop string
        self.hit = False
        self.scanned = 0

    @property
    def text(self) -> str:
        return "".join(self.sent) + self.held

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        buf = self.held + piece
        cut = len(buf)  # where the first stop string found begins
        for j, (stop, fail) in enumerate(zip(self.stops, self.fail)):
            q, steps = self.state[j], 0
            for i, ch in enumerate(piece):
                while q and stop[q] != ch:
                    q, steps = fail[q - 1], steps + 1
                q += stop[q] == ch
                steps += 1
                if q == len(stop):
                    cut = min(cut, len(self.held) + i + 1 - q)
                    break
            self.state[j] = q
            self.scanned += steps
        if cut < len(buf):
            self.hit = True
            self.held = ""
            return self._send(buf[:cut])
        keep = max(self.state, default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return self._send(buf[: len(buf) - keep])

    def flush(self) -> str:
        out, self.held = self.held, ""
        self.state = [0] * len(self.stops)
        return self._send(out)

    def _send(self, out: str) -> str:
        if out:
            self.sent.append(out)
        return out


def _failure(s: str) -> list[int]:
    """KMP's table: fail[k] is the length of the longest proper prefix of ``s[:k + 1]`` that also ends it."""
    fail, q = [0] * len(s), 0
    for k in range(1, len(s)):
        while q and s[q] != s[k]:
            q = fail[q - 1]
        q += s[q] == s[k]
        fail[k] = q
    return fail


class Worker:
    """The engine and its slots; ``complete`` runs one request, holding the engine's lock (calls from several
    threads take turns)."""

    def __init__(self, engine: Engine, slots: int = 2, reuse: str = "per-key", parallel: int = 1):
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1")
        if parallel < 1:
            raise ValueError(f"parallel={parallel} must be >= 1")
        if reuse not in REUSE:
            raise ValueError(f"reuse={reuse!r} is not one of {', '.join(REUSE)}")
        self.engine = engine
        self.n_slots = slots
        self.reuse = reuse
        with engine.lock.hold("Worker"):  # the engine's cache is the first slot's (a chat session claims it back)
            engine.sequence.claim(self)
        self.slots = [Slot(engine.sequence)]
        self.counters = Counters()
        self.last: Result | None = None  # the last request run (``/health``)
        self.lock = threading.Lock()  # guards counters read from the HTTP side
        self.n_slots = max(slots, parallel)  # (each running reply has a slot of its own)
        self.parallel = None
        if parallel > 1:
            from ktquest.server.parallel import Parallel

            self.parallel = Parallel(self, parallel)

    def load_kv(self, path) -> int:
        """The first slot starts from a KV file's tokens (``Engine.load_kv``: a document read once, by any
        ktquest); returns how many."""
        slot = self.slots[0]
        with self.engine.lock.hold("Worker.load_kv"):
            self.engine.load_kv(path, slot.seq)
            slot.seq.adopt(self)
            slot.used = time.monotonic()
            slot.key = ANY_KEY
            return len(slot.seq)

    def pick(self, tokens: list[int], key: str | None = None) -> tuple[Slot, int]:
        """The slot for ``tokens`` from a client of ``key`` and the common prefix it may reuse there (see the
        module docstring)."""
        def shared(s: Slot) -> int:  # (a slot a chat session of this engine took holds nothing of the server's)
            return s.seq.shared(tokens) if s.seq.owner is self and self._may_reuse(s, key) else 0

        free = [s for s in self.slots if not s.busy]  # (a slot whose reply is running is not taken)
        best = max(free, key=lambda s: (shared(s), s.used), default=None)
        n = 0 if best is None else shared(best)
        if n and n >= SIMILAR * len(best.seq):
            return best, n
        empty = [s for s in free if len(s.seq) == 0 or s.seq.owner is not self]
        if empty:
            return empty[0], 0
        if len(self.slots) < self.n_slots:
            eng = self.engine
            seq = Sequence(make_cache(eng.config, eng.args, eng.max_seq_len, eng.device, eng.dtype))
            seq.adopt(self)
            self.slots.append(Slot(seq))
            return self.slots[-1], 0
        lru = min(free, key=lambda s: s.used)
        return lru, shared(lru)

    def _may_reuse(self, slot: Slot, key: str | None) -> bool:
        return self.reuse == "shared" or (self.reuse == "per-key" and slot.key in (key, ANY_KEY))

    def complete(self, tokens: list[int], gen: GenerationConfig, stops: list[str] = (),
                 on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None, key: str | None = None,
                 on_logits: Callable | None = None, response_format=None) -> Result:
        """Generate after ``tokens`` (which must fit: ``Engine.check_fits``); ``on_text`` gets the reply as it
        comes, stop strings held back; ``cancelled()`` is polled between prompt chunks and tokens. ``key``: the
        client's (whose slots it may reuse; the module docstring). ``on_logits``, ``response_format``:
        ``Engine.run``'s (the reply's log probabilities: server/logprobs.py; structured output). Holds the
        engine's lock (``ktquest.engine_lock``): a chat session of the same engine waits its turn. With parallel
        slots the request joins the running ones (``server/parallel.py``) and this waits for its result."""
        if self.parallel is not None:
            return self.parallel.complete(tokens, gen, stops, on_text, cancelled, key, on_logits, response_format)
        with self.engine.lock.hold("Worker.complete"):  # from the slot's pick to the reply: one call
            run = self.begin(tokens, gen, stops, on_text, cancelled, key, on_logits, response_format)
            try:
                _, stats = run.turn.run()
            finally:
                run.slot.busy = False
            return self.end(run, stats)

    def begin(self, tokens: list[int], gen: GenerationConfig, stops: list[str], on_text, cancelled, key,
              on_logits, response_format) -> Running:
        """A request taken up (the caller holds the engine's lock): its slot picked and rewound, its turn made."""
        taken = time.perf_counter()  # the request is taken up: its time to first token counts from here
        eng = self.engine
        eng.check_fits(len(tokens))
        slot, reusable = self.pick(tokens, key)
        slot.used = time.monotonic()
        seq = slot.seq
        if seq.owner is not self:  # a chat session of this engine took the first slot's cache: afresh
            seq.claim(self)
        cached = seq.rewind_for(tokens) if reusable else seq.rewind(0)  # another's: nothing of it kept
        slot.key = key
        stop = StopText(list(stops))
        is_cancelled = cancelled or (lambda: False)

        def text_arrived(piece: str) -> None:
            out = stop.push(piece)
            if out and on_text is not None:
                on_text(out)

        def progress(done: int, total: int) -> None:
            if is_cancelled():
                raise KeyboardInterrupt  # between chunks: the chunks read stay (generate's invariant)

        turn = EngineTurn(eng, seq, tokens[cached:], gen, text_arrived, progress,
                          lambda: stop.hit or is_cancelled(), on_logits, response_format)
        slot.busy = True
        return Running(slot, turn, stop, on_text, is_cancelled, len(tokens), cached,
                       setup_s=time.perf_counter() - taken)

    def skipped(self, n_tokens: int) -> Result:
        """The result of a request whose client left before it was taken up (nothing ran, nothing counted)."""
        return Result(text="", finish_reason="cancelled", prompt_tokens=n_tokens, cached_tokens=0,
                      completion_tokens=0, prefill_s=0.0, decode_s=0.0)

    def end(self, run: Running, stats) -> Result:
        """A request's reply over: the held-back text out, its result counted."""
        stop = run.stop
        rest = "" if stop.hit else stop.flush()
        if rest and run.on_text is not None:
            run.on_text(rest)
        if run.cancelled():
            reason = "cancelled"
        elif stop.hit or stats.stopped_by == "eos":
            reason = "stop"
        else:
            reason = "length"
        result = Result(text=stop.text, finish_reason=reason, prompt_tokens=run.n_tokens, cached_tokens=run.cached,
                        completion_tokens=stats.new_tokens, prefill_s=stats.prefill_s,
                        decode_s=stats.decode_s, first_token_s=stats.first_token_s,
                        ttft_s=run.setup_s + stats.prefill_s + stats.first_token_s if stats.new_tokens else 0.0)
        with self.lock:
            self.last = result
            c = self.counters
            c.requests += 1
            c.cancelled += reason == "cancelled"
            c.prompt_tokens += run.n_tokens
            c.cached_tokens += run.cached
            c.prefilled_tokens += stats.prompt_tokens
            c.completion_tokens += stats.new_tokens
            c.answered += stats.new_tokens > 0
            c.ttft_s_total += result.ttft_s
        return result

    def snapshot(self) -> dict:
        """The counters, the mean time to first token over the requests that produced one (None before any)
        and the last request's timing (``Result.timing``; None before any)."""
        with self.lock:
            c = self.counters
            mean = c.ttft_s_total / c.answered if c.answered else None
            return {**dataclasses.asdict(c), "ttft_s_mean": mean,
                    "last": None if self.last is None else self.last.timing()}
