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
