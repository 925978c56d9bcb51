"""The device's stream as the device decode step uses it (models/device_step.py): captured work replayed, async
copies between device buffers and page-locked host buffers, and marks the host waits on.

    CudaLane   a CUDA stream: work captured once in a CUDA graph (one memory pool a context bucket) and
               replayed; copies with cudaMemcpyAsync from and to pinned memory; marks are CUDA events.
    FakeLane   the same contract on the CPU, for the tests: nothing runs when it is issued. Work, copies and
               marks queue in order and run when the host waits on a mark (or ``finish``), so a host that
               reads a buffer before it waited for the copy into it reads stale data, and a host that writes
               a buffer before the copy out of it ran sends the new data: the ordering bugs of a real stream
               show up as wrong logits on the CPU. It logs what ran, for the tests to read.

A lane's ``capture(fn, key)`` returns the replay of ``fn``: ``fn`` must touch only tensors that outlive it
(the step's static buffers, the cache's), with no host sync inside (no ``.item()``, no data-dependent shape).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

import torch


class Lane(Protocol):
    def host_buffer(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor: ...

    def capture(self, fn: Callable[[], None], key: object) -> Callable[[], None]: ...

    def release(self, key: object) -> None: ...

    def run(self, fn: Callable[[], None]) -> None: ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def mark(self) -> object: ...

    def wait(self, mark: object) -> None: ...

    def finish(self) -> None: ...


class CudaLane:
    """The current CUDA stream of ``device``. ``graphs=False`` runs the work eagerly (the fallback where a
    capture fails, and the A/B of a benchmark). ``timing``: marks carry a CUDA timing event too
    (``elapsed_ms``)."""

    def __init__(self, device: torch.device, graphs: bool = True, timing: bool = False):
        self.device, self.graphs, self.timing = device, graphs, timing
        self.pools: dict[object, object] = {}  # a context bucket's graphs share one memory pool
        self.failed: str | None = None  # why a capture failed (then every replay runs eagerly)

    def host_buffer(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)

    def capture(self, fn: Callable[[], None], key: object) -> Callable[[], None]:
        """The replay of ``fn`` as a CUDA graph in ``key``'s pool (graphs of one key replay in the order they
        were captured, never side by side, so they share it); ``fn`` itself where graphs are off or the capture
        failed (said once on stderr)."""
        if not self.graphs or self.failed:
            return fn
        pool = self.pools.setdefault(key, torch.cuda.graph_pool_handle())
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=pool):
                fn()
        except Exception as e:  # noqa: BLE001 -- a capture the build refuses: run eagerly, correct but slower
            self.failed = f"{type(e).__name__}: {e}"
            print(f"ktquest: the device decode step runs without CUDA graphs ({self.failed})", file=sys.stderr)
            torch.cuda.synchronize(self.device)
            return fn
        return g.replay

    def release(self, key: object) -> None:
        """``key``'s graphs are gone: its pool goes with them (a new key of the same id takes a new one)."""
        self.pools.pop(key, None)

    def run(self, fn: Callable[[], None]) -> None:
        fn()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record()
        return ev

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    @staticmethod
    def elapsed_ms(a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        return a.elapsed_time(b)


class FakeLane:
    """A stream simulated on the CPU (see the module docstring). ``log`` holds what ran, in order: ("run", name),
    ("graph", key, name), ("to_host", n), ("to_device", n), ("mark", i)."""

    def __init__(self):
        self.queue: list[tuple] = []
        self.log: list[tuple] = []
        self.marks = 0  # marks issued
        self.reached = 0  # marks the queue ran up to
        self.captured: dict[object, int] = {}  # key -> graphs captured under it

    def host_buffer(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Filled with NaN (or -1): a read before any copy into it shows."""
        t = torch.empty(shape, dtype=dtype)
        return t.fill_(float("nan") if dtype.is_floating_point else -1)

    def capture(self, fn: Callable[[], None], key: object) -> Callable[[], None]:
        self.captured[key] = self.captured.get(key, 0) + 1
        name = getattr(fn, "__name__", "fn")
        return lambda: self.queue.append(("graph", fn, (key, name)))

    def release(self, key: object) -> None:
        self.log.append(("release", key))

    def run(self, fn: Callable[[], None]) -> None:
        self.queue.append(("run", fn, getattr(fn, "__name__", "fn")))

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append(("to_host", lambda: dst.copy_(src), src.numel()))

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.queue.append(("to_device", lambda: dst.copy_(src), src.numel()))

    def mark(self) -> int:
        self.marks += 1
        self.queue.append(("mark", None, self.marks))
        return self.marks

    def wait(self, mark: int) -> None:
        """Run the queue up to ``mark``."""
        while self.reached < mark:
            self._step()

    def finish(self) -> None:
        while self.queue:
            self._step()

    def _step(self) -> None:
        kind, fn, what = self.queue.pop(0)
        if kind == "mark":
            self.reached = what
        else:
            fn()
        self.log.append((kind, what))
