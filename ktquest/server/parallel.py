"""Parallel slots (``ktquest serve --parallel N``): up to N replies run at once, each in a slot of its own, and each
decode step batches their tokens through the weights once (``NativeDecoder.decode_batch``: every matrix read once
for the N tokens, each token attending its own slot's cache). A token's logits are what it gets decoded alone, so
a greedy reply is the same whatever runs beside it.

One scheduler thread runs the model; ``complete`` (called from the HTTP side's threads, one per request) hands it
a request and waits for the result. Each round of the scheduler:

    1. admit waiting requests, first come first served, while fewer than N run: each takes a slot (the worker's
       pick: prefix reuse as with one slot; a slot whose reply runs is never taken) and has its prompt read whole;
    2. one decode step for every running reply together, their tokens sampled first (a reply that ended, was
       cancelled or hit a stop string leaves here, and its result goes back).

Fairness: every running reply gets one token a round; a new prompt is read between two rounds, so the running
replies pause while it is read (a long prompt pauses them longer), and a request waits for a free place only
behind those before it. A reply that ends with its token leaves in that round. The engine's lock is held while any
reply runs (a chat session of the engine waits until the server is idle). A failed decode step ends only the
replies whose tokens failed (the batch is all or nothing; its tokens are then decoded alone); a request whose
client left while it waited is answered "cancelled" without touching a slot.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from ktquest.generate import decode_one_token


@dataclass(eq=False)
class _Request:
    args: tuple  # Worker.complete's
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None  # the worker's Result
    error: BaseException | None = None
    run: object = None  # the worker's Running, once begun


class Parallel:
    """The scheduler of ``worker`` (a ``server.worker.Worker``, which makes it: it is the worker's ``parallel``)."""

    def __init__(self, worker, n: int):
        self.worker, self.n = worker, n
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []
        self.cv = threading.Condition()
        self.closed = False
        self.steps = 0  # decode rounds run, and the tokens they batched (``/health``: the mean batch)
        self.batched = 0
        self.widest = 0  # the most tokens one step batched
        self.thread = threading.Thread(target=self._loop, name="ktquest-parallel", daemon=True)
        self.thread.start()

    def complete(self, *args):
        """``Worker.complete``'s arguments; its result once the reply ends (its exception if it failed)."""
        req = _Request(args)
        with self.cv:
            if self.closed:
                raise RuntimeError("the server's parallel slots are closed")
            self.waiting.append(req)
            self.cv.notify()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.waiting and not self.running and not self.closed:
                    self.cv.wait()
                if self.closed and not self.running:
                    for req in self.waiting:
                        self._fail(req, RuntimeError("the server's parallel slots are closed"))
                    self.waiting.clear()
                    return
            # The engine's lock is held while any reply runs (slot 0 is the engine's own sequence: a chat session
            # of the engine must not take it from under a reply); it waits until the server is idle.
            with self.worker.engine.lock.hold("Worker.parallel"):
                while True:
                    with self.cv:
                        new = []
                        while self.waiting and not self.closed and len(self.running) + len(new) < self.n:
                            new.append(self.waiting.popleft())
                    if not new and not self.running:
                        break
                    try:
                        for req in new:
                            self._admit(req)
                        self._step()
                    except BaseException as e:  # noqa: BLE001 - a bug: every reply ends with it, the loop lives on
                        for req in list(self.running) + [r for r in new if not r.done.is_set()]:
                            self._end(req, e)

    def _admit(self, req: _Request) -> None:
        """A request's slot taken and its prompt read; it runs from the next step (or ends here)."""
        tokens, cancelled = req.args[0], req.args[4]
        if cancelled is not None and cancelled():  # its client left while it waited: no slot is touched
            req.result = self.worker.skipped(len(tokens))
            req.done.set()
            return
        try:
            req.run = self.worker.begin(*req.args)
        except BaseException as e:  # noqa: BLE001 - its caller raises it
            self._fail(req, e)
            return
        self.running.append(req)
        g = req.run.turn.generation
        try:
            g.read_prompt()
        except KeyboardInterrupt:  # cancelled while its prompt was read (``Worker.begin``'s progress)
            g.interrupted()
            self._end(req)
        except BaseException as e:  # noqa: BLE001
            self._end(req, e)

    def _step(self) -> None:
        """Every running reply's next token sampled, then one batched decode step for those that go on; a reply
        that ends with its token leaves at once (its result does not wait for the next round)."""
        going, tokens = [], []
        for req in list(self.running):
            try:
                token = req.run.turn.generation.next_token()
            except BaseException as e:  # noqa: BLE001 - a sampler or format error ends that reply alone
                self._end(req, e)
                continue
            if token is None:
                self._end(req)
            else:
                going.append(req)
                tokens.append(token)
        if not going:
            return
        caches = [r.run.slot.seq.cache for r in going]
        model = self.worker.engine.model
        if len(going) > 1 and hasattr(model.decoder, "decode_batch"):
            logits = model.decoder.decode_batch(tokens, caches)  # (a failed token: its exception)
        else:  # (one reply, or a decoder that runs one token at a time: each alone)
            logits = []
            for c, t in zip(caches, tokens):
                try:
                    logits.append(decode_one_token(model, c, t))
                except Exception as e:  # noqa: BLE001 - that reply's alone
                    logits.append(e)
        self.steps += 1
        self.batched += len(going)
        self.widest = max(self.widest, len(going))
        for req, x in zip(going, logits):
            if isinstance(x, BaseException):
                self._end(req, x)
                continue
            g = req.run.turn.generation
            try:
                g.took(x)
                if g.ended():
                    self._end(req)
            except BaseException as e:  # noqa: BLE001 - its callbacks' error ends that reply alone
                self._end(req, e)

    def _end(self, req: _Request, error: BaseException | None = None) -> None:
        """The reply is over: its sequence settles, its result (or ``error``) goes back, its slot is free."""
        if req in self.running:
            self.running.remove(req)
        run = req.run
        if run is None:  # (never began)
            self._fail(req, error or RuntimeError("the request never ran"))
            return
        try:
            _, stats = run.turn.finish()
            if error is None:
                req.result = self.worker.end(run, stats)
        except BaseException as e:  # noqa: BLE001
            error = error or e
        finally:
            run.slot.busy = False
        if error is not None:
            self._fail(req, error)
        else:
            req.done.set()

    @staticmethod
    def _fail(req: _Request, error: BaseException) -> None:
        req.error = error
        req.done.set()
