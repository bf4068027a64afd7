"""bench.served on its default CUDA runtime (NullCuda, the native schedule's calls going
to the C table that only counts them): the H100 live run served on both paths gives
every allocation the same address, and the native path arms and serves steps."""
from __future__ import annotations

import pytest

from bench.served import serve
from umrt.native.front import load_front


@pytest.mark.slow
def test_both_paths_serve_the_h100_run_at_the_same_addresses():
    python = serve("40GiB", 40 << 30, 12, native=False)
    native = serve("40GiB", 40 << 30, 12, native=True, front=load_front())
    assert python.failed is None and native.failed is None
    assert native.addresses == python.addresses
    assert python.report["phase"] == "off" and python.report["arms"] == 0
    assert native.report["arms"] == 1 and native.report["steps_native"] >= 2, native.report
    assert "native" in native.phases and "native" not in python.phases
