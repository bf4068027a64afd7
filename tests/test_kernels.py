"""The calibration kernels, checked for correctness in numba's CUDA simulator.

NUMBA_ENABLE_CUDASIM is read when numba.cuda is first imported, so the check
runs in a fresh interpreter. mapped_array works in the simulator (managed_array
does not), and on a GPU it is host memory the kernels reach over the bus too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent("""
    import numpy as np
    from numba import cuda
    assert cuda.simulator_enabled if hasattr(cuda, "simulator_enabled") else True
    import kernels

    n = 3000
    a = cuda.mapped_array(n, dtype=np.float32)
    b = cuda.mapped_array(n, dtype=np.float32)
    c = cuda.mapped_array(n, dtype=np.float32)
    b[:] = np.arange(n, dtype=np.float32)
    c[:] = 2.0
    a[:] = 0
    kernels.triad(a, b, c, 3.0)
    cuda.synchronize()
    np.testing.assert_allclose(np.asarray(a), np.arange(n) + 6.0)

    kernels.copy(c, b)
    cuda.synchronize()
    np.testing.assert_array_equal(np.asarray(c), np.asarray(b))

    d = cuda.mapped_array(2500, dtype=np.float64)
    d[:] = 0
    pages = kernels.touch_pages(d, page_bytes=4096)  # 512 float64 per page
    cuda.synchronize()
    touched = np.flatnonzero(np.asarray(d))
    assert pages == 5 and list(touched) == [0, 512, 1024, 1536, 2048], touched
    e = cuda.mapped_array(600 * 16, dtype=np.float32)  # 600 pages of 64 bytes
    e[:] = 0
    kernels.MAX_BLOCKS = 1  # one block of 256 threads: each thread takes several pages
    assert kernels.touch_pages(e, page_bytes=64) == 600
    cuda.synchronize()
    assert list(np.flatnonzero(np.asarray(e))) == list(range(0, 600 * 16, 16))
    try:
        kernels.touch_pages(d, page_bytes=1004)
    except ValueError:
        pass
    else:
        raise AssertionError("page size not a multiple of the item size was accepted")
    print("KERNELS OK")
""")


@pytest.mark.slow
def test_kernels_in_cudasim():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KERNELS OK" in out.stdout


def test_import_is_cheap_and_validates():
    import kernels

    class Arr:
        shape = (10,)

        class dtype:  # noqa: N801
            itemsize = 8

    with pytest.raises(ValueError, match="multiple of the item size"):
        kernels.touch_pages(Arr(), page_bytes=12)
    with pytest.raises(ValueError, match="equal shapes"):
        kernels.triad(Arr(), Arr(), type("B", (), {"shape": (3,)})(), 1.0)


def test_numpy_without_row_stack_is_patched_before_numba_cuda_loads(monkeypatch):
    """numpy 2.5 removed ``np.row_stack``, which numba-cuda 0.30 registers on its first
    compilation: kernels restore it (as ``np.vstack``) before the module that imports
    numba.cuda is loaded. A meta-path finder stands in for that module and notes what
    numpy looked like when it was imported."""
    import importlib.abc
    import importlib.machinery
    import types

    import numpy

    import kernels

    seen = {}

    class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self) if name == "kernels._jit" else None

        def create_module(self, spec):
            seen["row_stack"] = getattr(numpy, "row_stack", None)
            mod = types.ModuleType(spec.name)
            mod.touch_kernel = mod.triad_kernel = mod.copy_kernel = object()
            return mod

        def exec_module(self, module):
            pass

    monkeypatch.delattr(numpy, "row_stack", raising=False)  # numpy >= 2.5
    monkeypatch.delitem(sys.modules, "kernels._jit", raising=False)
    monkeypatch.delattr(kernels, "_jit", raising=False)
    monkeypatch.setattr(sys, "meta_path", [StandIn(), *sys.meta_path])
    kernels._compiled.cache_clear()
    try:
        kernels._compiled()
    finally:
        kernels._compiled.cache_clear()
        sys.modules.pop("kernels._jit", None)
    assert seen["row_stack"] is numpy.vstack
    assert kernels.numpy_compat() is False  # present now: nothing more to do


def test_numpy_compat_leaves_a_numpy_with_row_stack_alone(monkeypatch):
    import numpy

    import kernels

    marker = object()
    monkeypatch.setattr(numpy, "row_stack", marker, raising=False)
    assert kernels.numpy_compat() is False and numpy.row_stack is marker
