"""Shared fixtures: the fake CUDA runtime, and clean skipping of ``gpu`` tests.

Tests marked ``@pytest.mark.gpu`` need a real CUDA GPU; without one they are
skipped with a reason, never failed.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import fake_cuda`

from fake_cuda import FakeBindingsRuntime, FakeCupyRuntime, FakeGpu  # noqa: E402


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when a CUDA device answers (checked once, only if a gpu test is collected)."""
    if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/dev/dxg"):
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: all mean "no GPU"
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not gpu_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none found)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def fake_gpu() -> FakeGpu:
    return FakeGpu()


@pytest.fixture
def cuda12(fake_gpu):
    """A CudaBackend over the fake cupy-cuda12x runtime."""
    from umrt.backends.cuda import CudaBackend, CupyApi

    return CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))


@pytest.fixture
def cuda13(fake_gpu):
    """A CudaBackend over the fake cuda-bindings 13 runtime."""
    from umrt.backends.cuda import BindingsApi, CudaBackend

    return CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(fake_gpu)))


@pytest.fixture(params=["cuda12", "cuda13"])
def cuda_backend(request):
    """Both call shapes, for contract tests that must hold on either."""
    return request.getfixturevalue(request.param)
