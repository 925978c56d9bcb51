"""The extension is built, importable, and picks its kernels from the CPU's features at run time."""

import os
import subprocess
import sys

from ktquest import _C


def test_extension_reports_cpu_features():
    f = _C.cpu_features()
    assert set(f) == {"avx2", "fma", "f16c"}
    assert all(isinstance(v, bool) for v in f.values())


def test_force_scalar_switches_kernels():
    has_avx2 = all(_C.cpu_features().values())
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
