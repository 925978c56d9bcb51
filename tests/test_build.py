"""The extension is built, importable, and picks its kernels from the CPU's features at run time."""

import os
import subprocess
import sys

from ktquest import _C


def test_extension_reports_cpu_features():
    f = _C.cpu_features()
    assert set(f) == {"avx2", "fma", "f16c", "avx_vnni"}
    assert all(isinstance(v, bool) for v in f.values())


def test_force_scalar_switches_kernels():
    f = _C.cpu_features()
    has_avx2 = f["avx2"] and f["fma"] and f["f16c"]
    try:
        _C.set_force_scalar(True)
        assert _C.use_avx2() is False
        _C.set_force_scalar(False)
        assert _C.use_avx2() is has_avx2
    finally:
        _C.set_force_scalar(False)


def test_env_var_forces_scalar_at_import():
    env = dict(os.environ, KTQUEST_FORCE_SCALAR="1")
    out = subprocess.run([sys.executable, "-c", "from ktquest import _C; print(_C.use_avx2())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_vnni_kernels_follow_the_cpu_and_the_switches():
    """The AVX-VNNI variants run only on the AVX2 path of a CPU that has AVX-VNNI; set_allow_vnni(False) and
    KTQUEST_NO_VNNI=1 keep the AVX2 kernels, forcing scalar turns both off."""
    f = _C.cpu_features()
    has = f["avx2"] and f["fma"] and f["f16c"] and f["avx_vnni"]
    try:
        assert _C.use_avx_vnni() is has
        _C.set_allow_vnni(False)
        assert _C.use_avx_vnni() is False
        _C.set_allow_vnni(True)
        _C.set_force_scalar(True)
        assert _C.use_avx_vnni() is False
    finally:
        _C.set_force_scalar(False)
        _C.set_allow_vnni(True)
    env = dict(os.environ, KTQUEST_NO_VNNI="1")
    out = subprocess.run([sys.executable, "-c", "from ktquest import _C; print(_C.use_avx_vnni(), _C.use_avx2())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", str(f["avx2"] and f["fma"] and f["f16c"])]


MALLINFO = """
import ctypes, numpy as np
from ktquest import _C
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
"""

HEAP_PROBE = MALLINFO + """
big = np.ones(8 << 20, np.uint8)  # mmapped; freeing it would raise glibc's dynamic threshold to 8 MiB
del big
before = libc.mallinfo2().hblkhd
buf = np.ones(2 << 20, np.uint8)
print(_C.MMAP_THRESHOLD, libc.mallinfo2().hblkhd - before)
"""


def test_heap_threshold_fixed_at_import():
    """A 2 MiB buffer is still mmapped after an 8 MiB one was freed (glibc's default would serve it from the
    heap, which then grows in a long decode loop: common/heap.h); a user's MALLOC_MMAP_THRESHOLD_ stands."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], env=env, capture_output=True, text=True, check=True)
    threshold, mmapped = map(int, out.stdout.split())
    assert threshold == 1 << 20
    assert mmapped >= 2 << 20
    env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 20)
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], env=env, capture_output=True, text=True, check=True)
    threshold, mmapped = map(int, out.stdout.split())
    assert threshold == 0 and mmapped == 0


PREFILL_HEAP_PROBE = MALLINFO + """
from ktquest.native.cpu import prefill_heap
def mapped(n):  # bytes of an n-byte buffer that came by mmap (mallinfo2.hblkhd grows by them)
    before = libc.mallinfo2().hblkhd
    buf = np.ones(n, np.uint8)
    return libc.mallinfo2().hblkhd - before
with prefill_heap():
    inside = mapped(4 << 20)
    arena = libc.mallinfo2().arena
after = mapped(4 << 20)
print(inside, after, arena - libc.mallinfo2().arena)
"""


def test_prefill_heap_serves_temporaries_from_the_heap_then_trims():
    """Inside a prefill a 4 MiB temporary comes from the heap (no fresh mapping to fault in every chunk);
    after it, the decode threshold is back (a 4 MiB buffer is mapped) and the heap was trimmed."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", PREFILL_HEAP_PROBE], env=env, capture_output=True, text=True,
                         check=True)
    inside, after, trimmed = map(int, out.stdout.split())
    assert inside == 0
    assert after >= 4 << 20
    assert trimmed >= 4 << 20


def test_prefill_pauses_the_cycle_collector_and_restores_it():
    """``prefill_heap`` pauses Python's cycle collector while a prompt is read and leaves it as it found it
    (on, or off where the caller had turned it off), an exception included."""
    import gc

    from ktquest.native.cpu import prefill_heap

    assert gc.isenabled()
    with prefill_heap():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with prefill_heap():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with prefill_heap():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
