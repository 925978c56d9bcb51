"""One engine, one call at a time: the lock that every entry point moving an engine's cache or sequence holds
(``Engine.generate``, ``run``, ``read``, ``prefill``, the KV files, ``ChatSession``'s turns, the server's
``Worker``).

A call from another thread waits its turn, so two threads sharing an engine each get the answer they would get
alone. A call from inside one of the engine's own callbacks (``on_text``, ``on_progress``, ``should_stop``) runs
on the thread that holds the lock, in the middle of the call it reports on: it would move the cache under that
call (or wait for itself forever), so it is a RuntimeError. Calls that an entry point makes itself (``generate``
-> ``run``, ``ChatSession.save`` -> ``Engine.save_kv``) pass through.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class EngineLock:
    """The lock of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread in a call (only it sets or clears this to its own id)
        self._in_callback = 0  # the holder's callbacks running now

    @contextmanager
    def hold(self, entry: str) -> Iterator[None]:
        """The block runs as ``entry`` (e.g. "Engine.generate"): after the other threads' calls, and inside the
        holder's own call (its nested calls), but never from inside one of its callbacks (RuntimeError)."""
        if self._holder == threading.get_ident():
            if self._in_callback:
                raise RuntimeError(
                    f"ktquest: {entry} called from inside its own callback; the engine is busy with the call "
                    f"that callback reports on (on_text, on_progress and should_stop run inside it): make the "
                    f"call after that one returns, or on another engine (ktquest.load)")
            yield  # a call the entry point in progress makes itself
            return
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def callback(self, f: F | None) -> F | None:
        """``f`` (None stays None), marked as the engine's callback while it runs: a call it makes on the engine
        is refused instead of moving the cache under the call in progress."""
        if f is None:
            return None

        @functools.wraps(f)
        def called(*args: Any) -> Any:
            self._in_callback += 1
            try:
                return f(*args)
            finally:
                self._in_callback -= 1

        return called  # type: ignore[return-value]


def exclusive(method: F) -> F:
    """A method run holding ``self.lock`` (an ``EngineLock``) as its qualified name ("Engine.generate")."""
    entry = method.__qualname__

    @functools.wraps(method)
    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock.hold(entry):
            return method(self, *args, **kwargs)

    return held  # type: ignore[return-value]
