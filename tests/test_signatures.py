"""The backend's calls checked against the real, installed CUDA Python packages.

No GPU is needed: cupy-cuda12x and cuda-bindings import without one, and
their functions convert (and type-check) every argument before the driver
answers ``cudaErrorInsufficientDriver``. A proxy forwards each call the
backend makes to the real function, so a wrong argument count or type fails
here, and returns plausible results so the backend can keep going.

The pointers and stream handles those results hold are made up, so the two
tests that drive the backend run only where no CUDA driver is loaded (the
``no_cuda_driver`` fixture skips them elsewhere, with the reason): a real
driver would take them at their word and crash the process. On a GPU
machine the ``gpu``-marked tests make these calls with real pointers.
"""
from __future__ import annotations

import inspect
import itertools

import pytest

from umrt.backends.base import HOST, Advice
from umrt.backends.cuda import BindingsApi, CudaBackend, CupyApi

MiB = 2**20


class RealCallProxy:
    """Calls the real module function; replaces its no-driver failure by a canned result."""

    def __init__(self, module, results, is_failure):
        self._m, self._results, self._is_failure = module, results, is_failure
        self.called: list[str] = []
        self.args: list[tuple] = []  # (name, *args) of every call

    def __getattr__(self, name):
        real = getattr(self._m, name)
        if not callable(real) or isinstance(real, type) or name in ("CUDARuntimeError",):
            return real

        def call(*args):
            self.called.append(name)
            self.args.append((name, *args))
            try:
                out = real(*args)  # TypeError/ValueError here = wrong call shape
            except Exception as exc:  # noqa: BLE001
                if not self._is_failure(exc):
                    raise
                out = None
            if name in self._results:
                return self._results[name]()
            return out

        return call


def _drive(backend):
    a, b = backend.malloc(4 * MiB), backend.malloc(4 * MiB)
    backend.prefetch([(a, 4 * MiB)], 0)
    backend.prefetch([(a, MiB), (b, MiB)], HOST)
    backend.advise([(a, MiB)], Advice.SET_PREFERRED_LOCATION, HOST)
    backend.advise([(b, MiB)], Advice.SET_ACCESSED_BY, 0)
    backend.discard([(a, 2 * MiB)])
    backend.discard_and_prefetch([(b, 2 * MiB)], 0)
    backend.populate([(a, 4 * MiB)])  # on the compute stream (0): the discarded part without a copy
    backend.launch([(a, 16)], [(b, 16)], 0, 0)
    backend.synchronize()
    backend.mem_info()
    backend.free(a)


def test_cupy_cuda12x_runtime_calls(no_cuda_driver):
    cupy_runtime = pytest.importorskip("cupy.cuda.runtime")
    ptrs = itertools.count(0x7F00_0000_0000, 16 * MiB)
    handles = itertools.count(0x100)
    results = {
        "runtimeGetVersion": lambda: 12080, "getDeviceCount": lambda: 1, "deviceGetAttribute": lambda: 1,
        "mallocManaged": lambda: next(ptrs), "memGetInfo": lambda: (1 << 30, 2 << 30),
        "streamCreateWithFlags": lambda: next(handles), "eventCreateWithFlags": lambda: next(handles),
    }
    proxy = RealCallProxy(cupy_runtime, results, lambda e: isinstance(e, cupy_runtime.CUDARuntimeError))
    _drive(CudaBackend(0, api=CupyApi(proxy)))
    for name in ("mallocManaged", "memPrefetchAsync", "memAdvise", "eventRecord", "streamWaitEvent",
                 "streamSynchronize", "free", "setDevice"):
        assert name in proxy.called
    assert cupy_runtime.cudaDevAttrConcurrentManagedAccess == 89
    assert cupy_runtime.cudaCpuDeviceId == HOST
    assert (cupy_runtime.cudaMemAdviseSetReadMostly, cupy_runtime.cudaMemAdviseSetPreferredLocation,
            cupy_runtime.cudaMemAdviseSetAccessedBy) == (Advice.SET_READ_MOSTLY, Advice.SET_PREFERRED_LOCATION,
                                                          Advice.SET_ACCESSED_BY)
    assert not hasattr(cupy_runtime, "memDiscardBatchAsync")  # why CUDA 12 has the no-op fallback


def test_cuda_bindings_13_runtime_calls(no_cuda_driver):
    rt = pytest.importorskip("cuda.bindings.runtime")
    ok = rt.cudaError_t.cudaSuccess
    ptrs = itertools.count(0x7F00_0000_0000, 16 * MiB)
    streams = itertools.count(0x10)
    results = {
        "cudaRuntimeGetVersion": lambda: (ok, 13000), "cudaGetDeviceCount": lambda: (ok, 1),
        "cudaDeviceGetAttribute": lambda: (ok, 1), "cudaMallocManaged": lambda: (ok, next(ptrs)),
        "cudaMemGetInfo": lambda: (ok, 1 << 30, 2 << 30),
        "cudaStreamCreateWithFlags": lambda: (ok, rt.cudaStream_t(next(streams))),
        "cudaEventCreateWithFlags": lambda: (ok, rt.cudaEvent_t(0x20)),
    }
    proxy = RealCallProxy(rt, results, lambda e: False)
    # Unlisted calls return the real (err,) tuple; no driver here, so make errors pass as success.
    for name in ("cudaSetDevice", "cudaMemPrefetchAsync", "cudaMemAdvise", "cudaMemDiscardBatchAsync", "cudaMemDiscardAndPrefetchBatchAsync", "cudaEventRecord",
                 "cudaStreamWaitEvent", "cudaStreamSynchronize", "cudaFree"):
        real = getattr(rt, name)
        results[name] = (lambda real=real: (ok,))
        assert real.__name__ == name
    api = BindingsApi(proxy)
    assert api.has_batch
    _drive(CudaBackend(0, api=api))
    for name in ("cudaMemPrefetchAsync", "cudaMemAdvise", "cudaMemDiscardBatchAsync",
                 "cudaMemDiscardAndPrefetchBatchAsync", "cudaStreamWaitEvent", "cudaEventRecord", "cudaFree"):
        assert name in proxy.called, name
    assert "cudaMemPrefetchBatchAsync" not in proxy.called  # single calls are faster (h100-measured.md)
    # The batch calls never get the legacy default stream (the H100 rejects 0 and 1); the
    # backend's compute stream is 0 here, so they go to its own blocking stream.
    made = [c[1] for c in proxy.args if c[0] == "cudaStreamCreateWithFlags"]
    assert made == [rt.cudaStreamNonBlocking, rt.cudaStreamDefault]
    for call in proxy.args:
        if call[0] in ("cudaMemDiscardBatchAsync", "cudaMemDiscardAndPrefetchBatchAsync"):
            assert int(call[-1]) not in (0, int(rt.cudaStreamLegacy)), call
    params = list(inspect.signature(rt.cudaMemDiscardAndPrefetchBatchAsync).parameters)
    assert params == ["dptrs", "sizes", "count", "prefetchLocs", "prefetchLocIdxs", "numPrefetchLocs", "flags",
                      "stream"]
    assert list(inspect.signature(rt.cudaMemDiscardBatchAsync).parameters) == ["dptrs", "sizes", "count",
                                                                                "flags", "stream"]
    assert list(inspect.signature(rt.cudaMemAdvise).parameters) == ["devPtr", "count", "advice", "location"]
    assert [int(rt.cudaMemoryAdvise(a)) for a in Advice] == [int(a) for a in Advice]
    assert int(rt.cudaDeviceAttr.cudaDevAttrConcurrentManagedAccess) == 89


def test_bindings_reject_a_cuda12_style_host_target():
    rt = pytest.importorskip("cuda.bindings.runtime")
    with pytest.raises(TypeError):
        rt.cudaMemPrefetchAsync(0x1000, 4096, -1, 0, 0)  # CUDA 13 needs a cudaMemLocation


def test_cuda_core_batch_helpers_work_on_whole_buffers():
    # Documented reason umrt drives cuda.bindings directly: cuda-core's batch
    # helpers take Buffer objects (whole allocations), not (ptr, nbytes) sub-ranges.
    utils = pytest.importorskip("cuda.core.utils")
    for name in ("prefetch_batch", "discard_batch", "discard_prefetch_batch"):
        params = list(inspect.signature(getattr(utils, name)).parameters)
        assert params[:2] == ["stream", "buffers"], (name, params)


def test_torch_pluggable_allocator_api():
    import torch

    assert hasattr(torch.cuda.memory, "CUDAPluggableAllocator")
    assert hasattr(torch.cuda.memory, "change_current_allocator")
    src = inspect.getsource(torch.cuda.memory.change_current_allocator)
    assert "_cuda_changeCurrentAllocator" in src  # what umrt.allocators.torch calls directly
