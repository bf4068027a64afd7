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


def cuda_driver_present() -> bool:
    """True when an NVIDIA kernel driver is loaded (its control device exists): real CUDA
    entry points then act on what they are given, so fake pointers must never reach them."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


@pytest.fixture
def no_cuda_driver() -> None:
    """Skip, with the reason, a test that calls real CUDA entry points with fake pointers
    and handles (safe only where no driver answers: they fail on their argument checks or
    with cudaErrorInsufficientDriver; with a driver they would dereference them)."""
    if cuda_driver_present():
        pytest.skip("calls real CUDA functions with fake pointers: only without a CUDA driver "
                    "(the gpu-marked tests make these calls with real ones)")


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when a CUDA device answers (checked once, only if a gpu test is collected)."""
    if not cuda_driver_present():
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


@pytest.fixture(autouse=True)
def private_share_registry(monkeypatch, tmp_path_factory):
    """A test that enables umrt joins a registry of its own, never the machine's GPU share
    registry (``/dev/shm/umrt-shares``) that other processes, and other test runs, share."""
    import umrt.share

    folder = tmp_path_factory.mktemp("shares")
    monkeypatch.setattr(umrt.share, "default_folder", lambda: folder)
    return folder


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


@pytest.fixture
def one_torch_thread():
    """Tiny ops run ~10x faster on one intra-op thread on a shared, loaded CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
