"""Contract tests of the cuda backend against the fake CUDA 12 and 13 runtimes."""
from __future__ import annotations

import warnings

import pytest
from fake_cuda import FakeBindingsRuntime, FakeCupyRuntime, FakeGpu

from umrt.backends.base import HOST, Advice
from umrt.backends.cuda import DISCARD_ALIGN, BindingsApi, CudaBackend, CupyApi
from umrt.errors import CudaError

MiB = 2**20


def test_prefetch_to_device_and_host(cuda_backend, fake_gpu):
    ptr = cuda_backend.malloc(4 * MiB)
    cuda_backend.prefetch([(ptr, 4 * MiB)], 0)
    assert fake_gpu.location[ptr] == 0
    cuda_backend.prefetch([(ptr, MiB)], HOST)
    assert fake_gpu.location[ptr] == HOST
    assert cuda_backend.h2d_bytes == 4 * MiB and cuda_backend.d2h_bytes == MiB


def test_cuda12_uses_device_ids_and_loops(cuda12, fake_gpu):
    a, b = cuda12.malloc(MiB), cuda12.malloc(MiB)
    cuda12.prefetch([(a, MiB), (b, MiB)], HOST)
    calls = [c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]
    assert [(c[1], c[3]) for c in calls] == [(a, -1), (b, -1)]  # dstDevice -1 = cudaCpuDeviceId


def test_cuda13_batches_with_host_location(cuda13, fake_gpu):
    a, b = cuda13.malloc(MiB), cuda13.malloc(MiB)
    cuda13.prefetch([(a, MiB), (b, MiB)], HOST)
    (call,) = [c for c in fake_gpu.calls if c[0] == "cudaMemPrefetchBatchAsync"]
    _, ptrs, sizes, count, locs, idxs, nlocs, flags, _stream = call
    assert ptrs == [a, b] and sizes == [MiB, MiB] and count == 2 and idxs == [0] and nlocs == 1
    assert locs[0].type == FakeBindingsRuntime.cudaMemLocationType.cudaMemLocationTypeHost
    assert fake_gpu.location[a] == fake_gpu.location[b] == HOST


def test_cuda13_single_prefetch_takes_a_location(cuda13, fake_gpu):
    a = cuda13.malloc(MiB)
    cuda13.prefetch([(a, MiB)], 0)
    (call,) = [c for c in fake_gpu.calls if c[0] == "cudaMemPrefetchAsync"]
    assert call[3].type == FakeBindingsRuntime.cudaMemLocationType.cudaMemLocationTypeDevice and call[3].id == 0


def test_fake_rejects_cuda12_shape_on_cuda13(fake_gpu):
    # The contract the adapter exists for: CUDA 13 wants a cudaMemLocation, and a
    # device location with id -1 (what cupy-cuda13x builds) does not mean the host.
    rt = FakeBindingsRuntime(fake_gpu)
    (err, ptr) = rt.cudaMallocManaged(MiB, 1)
    with pytest.raises(TypeError):
        rt.cudaMemPrefetchAsync(ptr, MiB, -1, 0, 0)
    loc = rt.cudaMemLocation()
    loc.type, loc.id = rt.cudaMemLocationType.cudaMemLocationTypeDevice, -1
    assert rt.cudaMemPrefetchAsync(ptr, MiB, loc, 0, 0)[0] == rt.cudaError_t.cudaErrorInvalidDevice


@pytest.mark.parametrize("bad", [lambda p: (p + 2 * MiB, 16), lambda p: (p, 2 * MiB), lambda p: (0x1234, 8),
                                 lambda p: (p, 0)])
def test_ranges_outside_an_allocation_are_rejected(cuda_backend, bad):
    ptr = cuda_backend.malloc(MiB)
    with pytest.raises(CudaError, match="cudaMemPrefetchAsync"):
        cuda_backend.prefetch([bad(ptr)], 0)
    with pytest.raises(CudaError, match="cudaMemAdvise"):
        cuda_backend.advise([bad(ptr)], Advice.SET_READ_MOSTLY, 0)


def test_invalid_device_and_advice(cuda_backend):
    ptr = cuda_backend.malloc(MiB)
    with pytest.raises(CudaError, match="device 3"):
        cuda_backend.prefetch([(ptr, MiB)], 3)
    with pytest.raises(CudaError, match="cudaMemoryAdvise"):
        cuda_backend.advise([(ptr, MiB)], 9, 0)
    with pytest.raises(CudaError, match="does not exist"):
        CudaBackend(5, api=cuda_backend.api)


def test_advice_reaches_runtime(cuda_backend, fake_gpu):
    ptr = cuda_backend.malloc(MiB)
    cuda_backend.advise([(ptr, MiB)], Advice.SET_PREFERRED_LOCATION, HOST)
    assert fake_gpu.advice == [(ptr, MiB, 3, HOST)]


def test_runtime_errors_name_the_call(fake_gpu):
    fake_gpu.managed_limit = MiB
    for api in (CupyApi(FakeCupyRuntime(fake_gpu)), BindingsApi(FakeBindingsRuntime(fake_gpu))):
        backend = CudaBackend(0, api=api)
        with pytest.raises(CudaError, match="cudaMallocManaged.*(MemoryAllocation|out of memory)"):
            backend.malloc(2 * MiB)
    with pytest.raises(CudaError, match="cudaFree"):
        backend.free(0xDEAD)


def test_discard_cuda13_is_page_aligned_and_in_kernel_order(cuda13, fake_gpu):
    """A discard destroys data: it runs on the compute stream, between the kernel
    that last used the dead bytes and the one that writes the block's next owner,
    after copies still queued on the range; a later prefetch of it waits for it."""
    cuda13.set_compute_stream(0)
    ptr, other = cuda13.malloc(4 * MiB), cuda13.malloc(4 * MiB)
    cuda13.prefetch([(ptr, 4 * MiB)], HOST)  # an eviction still queued on the copy stream
    n = len(fake_gpu.calls)
    cuda13.discard([(ptr + 100, 2 * MiB)])
    (start, size), = fake_gpu.discarded
    assert start == ptr + DISCARD_ALIGN and start % DISCARD_ALIGN == 0 and (start + size) <= ptr + 100 + 2 * MiB
    calls = fake_gpu.calls[n:]
    names = [c[0] for c in calls]
    i = names.index("cudaMemDiscardBatchAsync")
    assert calls[i][-1] == 0  # on the compute stream
    waits = [c for c in calls[:i] if c[0] == "cudaStreamWaitEvent"]
    assert waits and waits[0][1] == 0  # the compute stream waited for the queued eviction first
    n = len(fake_gpu.calls)
    cuda13.prefetch([(other, MiB)], 0)  # elsewhere: no wait
    assert "cudaStreamWaitEvent" not in [c[0] for c in fake_gpu.calls[n:]]
    n = len(fake_gpu.calls)
    cuda13.prefetch([(ptr, 4 * MiB)], 0)  # the discarded range: the copy stream waits for the discard
    calls = fake_gpu.calls[n:]
    names = [c[0] for c in calls]
    w = names.index("cudaStreamWaitEvent")
    assert calls[w][1] == cuda13.copy_stream and w < names.index("cudaMemPrefetchAsync")
    n = len(fake_gpu.calls)
    cuda13.prefetch([(ptr, 4 * MiB)], 0)  # ordered once is enough
    assert "cudaStreamWaitEvent" not in [c[0] for c in fake_gpu.calls[n:]]
    cuda13.discard([(ptr, 1000)])  # smaller than a page: nothing safe to discard
    assert len(fake_gpu.discarded) == 1


def test_discard_cuda12_is_a_documented_noop(cuda12, fake_gpu):
    ptr = cuda12.malloc(4 * MiB)
    before = list(fake_gpu.calls)
    cuda12.discard([(ptr, 4 * MiB)])
    assert fake_gpu.calls == before


def test_discard_and_prefetch(cuda_backend, fake_gpu):
    ptr = cuda_backend.malloc(4 * MiB)
    cuda_backend.discard_and_prefetch([(ptr, 4 * MiB)], 0)
    assert fake_gpu.location[ptr] == 0
    expect = "cudaMemDiscardAndPrefetchBatchAsync" if cuda_backend.api.has_batch else "memPrefetchAsync"
    assert expect in fake_gpu.names()
    if cuda_backend.api.has_batch:  # it destroys data: in order with the kernels, as discard
        (call,) = [c for c in fake_gpu.calls if c[0] == expect]
        assert call[-1] == cuda_backend.compute_stream


def test_launch_waits_on_overlapping_prefetch_only(cuda_backend, fake_gpu):
    cuda_backend.set_compute_stream(0)
    a, b = cuda_backend.malloc(MiB), cuda_backend.malloc(MiB)
    cuda_backend.prefetch([(a, MiB)], 0)
    n = len(fake_gpu.calls)
    cuda_backend.launch([(b, 16)], [], 0, 0)  # unrelated kernel: no wait
    assert not any("WaitEvent" in c[0] for c in fake_gpu.calls[n:])
    cuda_backend.launch([(a + 64, 16)], [], 0, 0)
    waits = [c for c in fake_gpu.calls[n:] if "WaitEvent" in c[0]]
    assert len(waits) == 1 and waits[0][1] == 0  # the compute stream waits ...
    assert fake_gpu.recorded[waits[0][2]] == cuda_backend.copy_stream  # ... on a copy-stream event
    n = len(fake_gpu.calls)
    cuda_backend.launch([(a, 16)], [], 0, 0)  # already ordered
    assert not any("WaitEvent" in c[0] for c in fake_gpu.calls[n:])


def test_adjacent_ranges_are_merged(cuda12, fake_gpu):
    ptr = cuda12.malloc(MiB)
    cuda12.prefetch([(ptr + 4096, 4096), (ptr, 4096), (ptr + 8192, 100)], 0)
    calls = [c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]
    assert [(c[1], c[2]) for c in calls] == [(ptr, 8192 + 100)]


def test_no_concurrent_managed_access_warns_once():
    gpu = FakeGpu(concurrent=False)
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(gpu)))
    ptr = backend.malloc(MiB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.prefetch([(ptr, MiB)], 0)
        backend.advise([(ptr, MiB)], Advice.SET_ACCESSED_BY, 0)
    assert len(caught) == 1 and "concurrent managed access" in str(caught[0].message)
    assert "memPrefetchAsync" not in gpu.names()


def test_free_and_mem_info(cuda_backend, fake_gpu):
    ptr = cuda_backend.malloc(MiB)
    free, total = cuda_backend.mem_info()
    assert total == fake_gpu.total and free <= total
    cuda_backend.set_compute_stream(0)
    n = len(fake_gpu.calls)
    cuda_backend.free(ptr)
    assert ptr not in fake_gpu.allocs
    # a prefetch (copy stream) or a kernel or discard (compute stream) may still use it
    calls = fake_gpu.calls[n:]
    freed = next(i for i, c in enumerate(calls) if c[0] in ("free", "cudaFree"))
    synced = {c[1] for c in calls[:freed] if c[0] in ("streamSynchronize", "cudaStreamSynchronize")}
    assert synced == {cuda_backend.copy_stream, 0}
    with pytest.raises(CudaError):
        cuda_backend.prefetch([(ptr, 16)], 0)


def test_resident_bytes_tracks_what_umrt_placed(cuda_backend):
    a = cuda_backend.malloc(8 * MiB)
    cuda_backend.prefetch([(a, 4 * MiB)], 0)
    cuda_backend.prefetch([(a + 2 * MiB, 4 * MiB)], 0)  # overlaps: 6 MiB in all
    assert cuda_backend.resident_bytes() == 6 * MiB
    cuda_backend.prefetch([(a + MiB, MiB)], HOST)  # a hole in the middle
    assert cuda_backend.resident_bytes() == 5 * MiB
    cuda_backend.free(a)
    assert cuda_backend.resident_bytes() == 0


def test_cupy_cuda13_cannot_reach_the_host(fake_gpu):
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu, version=13000)))
    ptr = backend.malloc(MiB)
    backend.prefetch([(ptr, MiB)], 0)  # device targets are fine
    with pytest.raises(CudaError, match="cuda-bindings"):
        backend.prefetch([(ptr, MiB)], HOST)


def test_pending_events_stay_bounded(cuda12, fake_gpu):
    from umrt.backends.cuda import MAX_PENDING

    ptr = cuda12.malloc(MiB)
    for _ in range(MAX_PENDING + 5):
        cuda12.prefetch([(ptr, 4096)], 0)
    assert len(cuda12._pending) <= MAX_PENDING
