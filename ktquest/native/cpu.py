"""The native code's process-wide settings: which kernels run (AVX2/FMA/F16C, with AVX-VNNI variants where the
CPU has it, picked from the CPU's features at run time, or the scalar twins when forced), the C heap's
settings while a prompt is read, and how long the worker pool's idle threads spin."""

from __future__ import annotations

import contextlib
import gc

from ktquest import _C


def cpu_features() -> dict[str, bool]:
    """The CPU's features as the kernels see them: {'avx2', 'fma', 'f16c', 'avx_vnni'} -> bool."""
    return _C.cpu_features()


def use_avx2() -> bool:
    """True when the AVX2/FMA/F16C kernels run (the CPU has them and the scalar twins are not forced)."""
    return _C.use_avx2()


def use_avx_vnni() -> bool:
    """True when the kernels with an AVX-VNNI variant use it (on the AVX2 path; KTQUEST_NO_VNNI=1 says no)."""
    return _C.use_avx_vnni()


def set_force_scalar(force: bool) -> None:
    """Force the scalar kernels process-wide (KTQUEST_FORCE_SCALAR=1 at start does the same)."""
    _C.set_force_scalar(bool(force))


@contextlib.contextmanager
def prefill_heap():
    """The C heap's prefill settings while the block runs (its temporaries reused, not mapped afresh each
    chunk), the decode settings after it and the heap trimmed (cpp/common/heap.h); and Python's cycle collector
    paused: a prompt allocates tensors by the thousand, and each few hundred started a collection that walked
    the model's objects (3% of a 35B-A3B's prefill in ``gc_collect_main``). Cycles made meanwhile are collected
    after it."""
    _C.prefill_heap(True)
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        _C.prefill_heap(False)


def pool_spin_us() -> int:
    """How long the worker pool's idle threads spin before they sleep (microseconds)."""
    return _C.pool_spin_us()


@contextlib.contextmanager
def hot_pool(spin_us: int):
    """The worker pool's idle threads spin ``spin_us`` microseconds before they sleep while the block runs (a
    GPU decode step: the store parts of consecutive layers come a layer's device work apart), then as before."""
    before = _C.pool_spin_us()
    _C.set_pool_spin_us(int(spin_us))
    try:
        yield
    finally:
        _C.set_pool_spin_us(before)
