"""Contract tests of the cuda backend against the fake CUDA 12 and 13 runtimes."""
from __future__ import annotations

import threading
import warnings

import pytest
from fake_cuda import FakeBindingsRuntime, FakeCupyRuntime, FakeGpu, PageStateError

from umrt.backends.base import HOST, Advice
from umrt.backends.cuda import DISCARD_ALIGN, BindingsApi, CudaBackend, CupyApi, counters_delta
from umrt.errors import CudaError

MiB = 2**20


def test_prefetch_to_device_and_host(cuda_backend, fake_gpu):
    ptr = cuda_backend.malloc(4 * MiB)
    cuda_backend.prefetch([(ptr, 4 * MiB)], 0)
    assert fake_gpu.where(ptr) == fake_gpu.where(ptr + 4 * MiB - 1) == "gpu"
    cuda_backend.prefetch([(ptr, MiB)], HOST)
    assert fake_gpu.where(ptr) == "host" and fake_gpu.where(ptr + MiB) == "gpu"
    assert cuda_backend.h2d_bytes == 4 * MiB and cuda_backend.d2h_bytes == MiB


def test_cuda12_uses_device_ids_and_loops(cuda12, fake_gpu):
    a, b = cuda12.malloc(MiB), cuda12.malloc(MiB)
    cuda12.prefetch([(a, MiB), (b, MiB)], HOST)
    calls = [c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]
    assert [(c[1], c[3]) for c in calls] == [(a, -1), (b, -1)]  # dstDevice -1 = cudaCpuDeviceId


def test_cuda13_prefetches_each_coalesced_range_with_one_single_call(cuda13, fake_gpu):
    """Single cudaMemPrefetchAsync calls, not cudaMemPrefetchBatchAsync: on the H100 the
    batch was 7x slower for 1024 resident 2 MiB ranges (56 vs 7.9 ms, h100-measured.md)."""
    a, b = cuda13.malloc(2 * MiB), cuda13.malloc(MiB)
    cuda13.prefetch([(a + MiB, MiB), (b, MiB), (a, MiB)], HOST)
    calls = [c for c in fake_gpu.calls if c[0].startswith("cudaMemPrefetch")]
    assert [(c[0], c[1], c[2]) for c in calls] == [("cudaMemPrefetchAsync", a, 2 * MiB),
                                                   ("cudaMemPrefetchAsync", b, MiB)]
    assert all(c[3].type == FakeBindingsRuntime.cudaMemLocationType.cudaMemLocationTypeHost for c in calls)
    assert fake_gpu.where(a) == fake_gpu.where(b) == "host"
    assert cuda13.calls["cudaMemPrefetchAsync"] == 2 and "cudaMemPrefetchBatchAsync" not in cuda13.calls


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
    """A discard destroys data: it runs in kernel order, between the kernel that last
    used the dead bytes and the one that writes the block's next owner, after copies
    still queued on the range; a later prefetch of it waits for it. Torch's default
    compute stream is the legacy stream 0, which the batch call rejects: the discard
    goes to the backend's blocking stream, which the legacy stream synchronizes with."""
    cuda13.set_compute_stream(0)
    ptr, other = cuda13.malloc(4 * MiB), cuda13.malloc(4 * MiB)
    before = fake_gpu.kernel(0, reads=[(ptr, 4 * MiB)])  # the dead bytes' last reader
    cuda13.prefetch([(ptr, 4 * MiB)], HOST)  # an eviction still queued on the copy stream
    cuda13.discard([(ptr + 100, 2 * MiB)])
    (start, size), = fake_gpu.discarded
    assert start == ptr + DISCARD_ALIGN and start % DISCARD_ALIGN == 0 and (start + size) <= ptr + 100 + 2 * MiB
    (discard,) = fake_gpu.ops_named("cudaMemDiscardBatchAsync")
    (evict,) = fake_gpu.ops_named("cudaMemPrefetchAsync")
    assert discard.stream not in ("legacy", cuda13.copy_stream)
    assert fake_gpu.ordered(before, discard) and fake_gpu.ordered(evict, discard)
    after = fake_gpu.kernel(0, writes=[(ptr + 3 * MiB, MiB)])  # a kernel queued after it
    assert fake_gpu.ordered(discard, after)
    n = len(fake_gpu.calls)
    cuda13.prefetch([(other, MiB)], 0)  # elsewhere: no wait
    assert "cudaStreamWaitEvent" not in [c[0] for c in fake_gpu.calls[n:]]
    cuda13.prefetch([(ptr, 4 * MiB)], 0)  # its discarded part is populated in kernel order, after it
    populate = [op for op in fake_gpu.ops_named("cudaMemPrefetchAsync") if op.stream == "legacy"]
    assert len(populate) == 1 and fake_gpu.ordered(discard, populate[0])
    n = len(fake_gpu.calls)
    cuda13.prefetch([(ptr + DISCARD_ALIGN, DISCARD_ALIGN)], HOST)  # a copy of it waits for both
    names = [c[0] for c in fake_gpu.calls[n:]]
    assert names.index("cudaStreamWaitEvent") < names.index("cudaMemPrefetchAsync")
    evict = fake_gpu.ops_named("cudaMemPrefetchAsync")[-1]
    assert fake_gpu.ordered(discard, evict) and fake_gpu.ordered(populate[0], evict)
    n = len(fake_gpu.calls)
    cuda13.prefetch([(ptr, 4 * MiB)], 0)  # ordered once is enough
    assert "cudaStreamWaitEvent" not in [c[0] for c in fake_gpu.calls[n:]]
    cuda13.discard([(ptr, 1000)])  # smaller than a page: nothing safe to discard
    assert len(fake_gpu.discarded) == 1
    assert not fake_gpu.violations


@pytest.mark.parametrize("legacy", [0, 1])
def test_legacy_compute_stream_discards_on_a_blocking_stream(fake_gpu, legacy):
    """The H100 returned cudaErrorInvalidValue for the batch calls on streams 0 and 1
    (issue 10): the backend must never queue them there."""
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(fake_gpu)), compute_stream=legacy)
    ptr = backend.malloc(4 * MiB)
    backend.discard([(ptr, 2 * MiB)])
    backend.discard_and_prefetch([(ptr + 2 * MiB, 2 * MiB)], 0)
    streams = {c[-1] for c in fake_gpu.calls if c[0] in ("cudaMemDiscardBatchAsync",
                                                          "cudaMemDiscardAndPrefetchBatchAsync")}
    assert streams == {backend.discard_stream()} and backend.discard_stream() not in (0, 1, 2)
    made = [c for c in fake_gpu.calls if c[0] == "cudaStreamCreateWithFlags"]
    assert [c[1] for c in made] == [FakeBindingsRuntime.cudaStreamNonBlocking,  # the copy stream
                                    FakeBindingsRuntime.cudaStreamDefault]  # blocking: synchronized with 0
    assert backend.calls["cudaStreamCreateWithFlags"] == 2  # made once, then reused
    backend.discard([(ptr, 2 * MiB)])
    assert backend.calls["cudaStreamCreateWithFlags"] == 2


def test_other_compute_streams_keep_their_discards(cuda13, fake_gpu):
    for stream in (cuda13.api.create_stream(), cuda13.api.create_stream(blocking=True), 2):
        cuda13.set_compute_stream(stream)
        ptr = cuda13.malloc(MiB)
        cuda13.discard([(ptr, MiB)])
        assert fake_gpu.calls[-2][0] == "cudaMemDiscardBatchAsync" and fake_gpu.calls[-2][-1] == stream
        assert cuda13.discard_stream() == stream


@pytest.mark.parametrize("kind", ["legacy", "legacy1", "nonblocking", "blocking", "per-thread"])
def test_discards_are_ordered_with_the_kernels_on_every_kind_of_stream(cuda13, fake_gpu, kind):
    rt = cuda13.api.rt
    stream = {"legacy": 0, "legacy1": 1, "per-thread": 2,
              "nonblocking": rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)[1],
              "blocking": rt.cudaStreamCreateWithFlags(rt.cudaStreamDefault)[1]}[kind]
    cuda13.set_compute_stream(stream)
    a = cuda13.malloc(4 * MiB)
    cuda13.prefetch([(a, 4 * MiB)], 0)
    cuda13.launch([(a, 4 * MiB)], [])
    k1 = fake_gpu.kernel(stream, reads=[(a, 4 * MiB)])
    cuda13.discard([(a, 2 * MiB)])
    cuda13.discard_and_prefetch([(a + 2 * MiB, 2 * MiB)], 0)
    cuda13.prefetch([(a, 2 * MiB)], 0)  # the discarded half: populated before it is written
    cuda13.launch([], [(a, 4 * MiB)])
    k2 = fake_gpu.kernel(stream, writes=[(a, 4 * MiB)])  # no violation: refault, race or lost data
    for op in fake_gpu.ops_named("cudaMemDiscardBatchAsync") + fake_gpu.ops_named(
            "cudaMemDiscardAndPrefetchBatchAsync"):
        assert fake_gpu.ordered(k1, op) and fake_gpu.ordered(op, k2)
    assert not fake_gpu.violations


def test_discards_from_another_thread_are_covered_by_synchronize(cuda13, fake_gpu):
    """Why not cudaStreamPerThread: torch frees (and umrt discards) from its autograd
    thread, and a synchronize on the main thread must still wait for those discards."""
    cuda13.set_compute_stream(0)
    ptr = cuda13.malloc(4 * MiB)
    worker = threading.Thread(target=cuda13.discard, args=([(ptr, 4 * MiB)],))
    worker.start()
    worker.join()
    (discard,) = fake_gpu.ops_named("cudaMemDiscardBatchAsync")
    cuda13.synchronize()
    assert fake_gpu.completed(discard)


def test_a_new_compute_stream_is_ordered_after_the_old_one(cuda13, fake_gpu):
    rt = cuda13.api.rt
    s1, s2 = (rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)[1] for _ in range(2))
    cuda13.set_compute_stream(s1)
    a = cuda13.malloc(4 * MiB)
    k1 = fake_gpu.kernel(s1, writes=[(a, 4 * MiB)])
    cuda13.set_compute_stream(s2)  # e.g. torch.cuda.stream(s2) around the next allocation
    cuda13.prefetch([(a, 2 * MiB)], HOST)  # an eviction: after k1, although k1 ran on s1
    cuda13.discard([(a + 2 * MiB, 2 * MiB)])
    for op in fake_gpu.ops[-2:]:
        assert op.name != "kernel" and fake_gpu.ordered(k1, op)
    assert not fake_gpu.violations
    n = len(fake_gpu.calls)
    cuda13.set_compute_stream(s2)  # no change: no call
    assert len(fake_gpu.calls) == n


def test_counters_count_calls_by_runtime_name_and_bytes(cuda_backend):
    ptr = cuda_backend.malloc(4 * MiB)
    before = cuda_backend.counters()
    cuda_backend.prefetch([(ptr, MiB), (ptr + 2 * MiB, MiB)], 0)
    cuda_backend.prefetch([(ptr, MiB)], HOST)
    cuda_backend.discard([(ptr + 2 * MiB, MiB)])
    cuda_backend.advise([(ptr, MiB)], Advice.SET_ACCESSED_BY, 0)
    delta = counters_delta(before, cuda_backend.counters())
    calls = delta.pop("calls")
    cuda13 = cuda_backend.api.has_batch
    assert delta == {"h2d_bytes": 2 * MiB, "d2h_bytes": MiB, "populated_bytes": 0,
                     "discarded_bytes": MiB if cuda13 else 0, "swapped_out_bytes": 0, "swapped_in_bytes": 0,
                     "staging_bytes": 0, "late_swap_ins": 0,
                     # the fixture's adapters launch no SM copy kernel: the copy engines (CUDA 13), or migration
                     "swap_copy": "engines" if cuda13 else ""}
    assert calls["cudaMemPrefetchAsync"] == 3 and calls["cudaMemAdvise"] == 1
    assert calls.get("cudaMemDiscardBatchAsync", 0) == int(cuda13)
    assert calls["cudaEventRecord"] >= 3 and "cudaMallocManaged" not in calls  # before the snapshot
    assert cuda_backend.calls["cudaMallocManaged"] == 1
    # Every call the adapter made is counted once, under its CUDA runtime name (the
    # fake does not log the two queries).
    made = [c[0] for c in cuda_backend.api.rt.gpu.calls]
    queries = cuda_backend.calls["cudaGetDeviceCount"] + cuda_backend.calls["cudaMemGetInfo"]
    assert sum(cuda_backend.calls.values()) - queries == len(made)


def test_discard_cuda12_is_a_documented_noop(cuda12, fake_gpu):
    ptr = cuda12.malloc(4 * MiB)
    before = list(fake_gpu.calls)
    cuda12.discard([(ptr, 4 * MiB)])
    assert fake_gpu.calls == before


def test_discard_and_prefetch(cuda_backend, fake_gpu):
    ptr = cuda_backend.malloc(4 * MiB)
    cuda_backend.discard_and_prefetch([(ptr, 4 * MiB)], 0)
    assert fake_gpu.where(ptr) == "gpu"
    expect = "cudaMemDiscardAndPrefetchBatchAsync" if cuda_backend.api.has_batch else "memPrefetchAsync"
    assert expect in fake_gpu.names()
    if cuda_backend.api.has_batch:  # it destroys data: in order with the kernels, as discard
        (call,) = [c for c in fake_gpu.calls if c[0] == expect]
        assert call[-1] == cuda_backend.discard_stream()


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


@pytest.mark.parametrize("merge", [False, True])
def test_touching_allocations_merge_only_when_asked(fake_gpu, merge):
    """Two allocations that touch in the address space: one call only with
    merge_across_allocations (unverified on a GPU, so off by default)."""
    fake_gpu.span_allocations = merge
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(fake_gpu)), merge_across_allocations=merge)
    a, b = backend.malloc(2 * MiB), backend.malloc(2 * MiB)
    assert b == a + 2 * MiB  # the fake places them back to back
    backend.prefetch([(b, MiB), (a + MiB, MiB)], 0)
    calls = [(c[1], c[2]) for c in fake_gpu.calls if c[0] == "cudaMemPrefetchAsync"]
    assert calls == ([(a + MiB, 2 * MiB)] if merge else [(a + MiB, MiB), (b, MiB)])


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
    order = {cuda_backend.discard_stream()} if cuda_backend.api.has_batch else set()  # legacy: its own
    assert synced == {cuda_backend.copy_stream, 0} | order
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
    assert len(cuda12.order.pending) <= MAX_PENDING


@pytest.mark.parametrize("compute", [0, "created"])
def test_a_discarded_range_is_repopulated_in_kernel_order(cuda13, fake_gpu, compute):
    """A newborn placed on discarded pages is prefetched to the GPU before its first
    kernel even when no launch() announces that kernel (a live run that stopped
    capturing ops): the discarded parts go on the compute stream, the rest on the
    copy stream."""
    stream = cuda13.api.create_stream() if compute == "created" else 0
    cuda13.set_compute_stream(stream)
    a = cuda13.malloc(4 * MiB)
    fake_gpu.kernel(stream, writes=[(a, 4 * MiB)])
    cuda13.discard([(a, 2 * MiB)])
    before = cuda13.h2d_bytes
    cuda13.prefetch([(a + MiB, 2 * MiB)], 0)  # half discarded, half not
    calls = [(c[1], c[2], c[-1]) for c in fake_gpu.calls if c[0] == "cudaMemPrefetchAsync"]
    assert calls == [(a + MiB, MiB, stream), (a + 2 * MiB, MiB, cuda13.copy_stream)]
    assert cuda13.populated_bytes == MiB and cuda13.h2d_bytes - before == MiB
    fake_gpu.kernel(stream, writes=[(a + MiB, MiB)])  # no launch(): still no refault
    with pytest.raises(PageStateError, match="refault"):
        fake_gpu.kernel(stream, writes=[(a, MiB)])  # the part nobody prefetched
    cuda13.prefetch([(a + MiB, MiB)], 0)  # repopulated already: an ordinary prefetch now
    assert fake_gpu.calls[-2][0] == "cudaMemPrefetchAsync" and fake_gpu.calls[-2][-1] == cuda13.copy_stream


@pytest.mark.parametrize("compute", [0, 1, "created"])
def test_populate_is_in_kernel_order(cuda_backend, fake_gpu, compute):
    """Backend.populate: a newborn's pages that are not on the GPU (discarded, evicted,
    never touched) are there before the next kernel, with no launch() announcing it."""
    stream = cuda_backend.api.create_stream() if compute == "created" else compute
    cuda_backend.set_compute_stream(stream)
    a = cuda_backend.malloc(6 * MiB)
    fake_gpu.kernel(stream, writes=[(a, 4 * MiB)])
    cuda_backend.prefetch([(a, 2 * MiB)], HOST)  # evicted, still queued on the copy stream
    cuda_backend.discard([(a + 2 * MiB, 2 * MiB)])  # discarded (CUDA 13)
    h2d = cuda_backend.h2d_bytes
    cuda_backend.populate([(a, 6 * MiB)])  # the last 2 MiB: never touched
    (call,) = [c for c in fake_gpu.calls if c[0] in ("cudaMemPrefetchAsync", "memPrefetchAsync")][1:]
    assert call[1:3] == (a, 6 * MiB) and call[-1] == stream
    cuda13 = cuda_backend.api.has_batch
    assert cuda_backend.populated_bytes == (2 * MiB if cuda13 else 0)
    assert cuda_backend.h2d_bytes - h2d == (4 if cuda13 else 6) * MiB
    populate = fake_gpu.ops_named(call[0])[-1]
    assert fake_gpu.ordered(fake_gpu.ops_named(call[0])[0], populate)  # after the eviction
    fake_gpu.kernel(stream, writes=[(a, 6 * MiB)])  # no launch(): no refault, no race
    assert not fake_gpu.violations and fake_gpu.faults["host"] == 0


def test_the_allocations_check_merge_and_keep_residency():
    from umrt.backends.allocations import Allocations

    allocs = Allocations()
    allocs.add(0x1000_0000, 4 * MiB)
    allocs.add(0x1000_0000 + 4 * MiB, MiB)  # touching the first
    a = 0x1000_0000
    assert allocs.allocation_of(a + MiB) == (a, 4 * MiB) and allocs.allocation_of(a + 5 * MiB) is None
    assert allocs.checked("call", [(a + MiB, MiB), (a, MiB), (a + 4 * MiB, 4096)]) == [(a, 2 * MiB), (a + 4 * MiB, 4096)]
    with pytest.raises(CudaError, match="call: range .* not inside one managed allocation"):
        allocs.checked("call", [(a + 3 * MiB, 2 * MiB)])
    allocs.place([(a, 2 * MiB), (a + 4 * MiB, MiB)], on_device=True)
    allocs.place([(a + MiB, 4096)], on_device=False)
    assert allocs.resident_bytes() == 3 * MiB - 4096
    assert allocs.remove(a + 4 * MiB) == MiB and allocs.resident_bytes() == 2 * MiB - 4096
    assert list(allocs) == [a] and a in allocs and a + 4 * MiB not in allocs


def test_the_stream_order_waits_once_for_the_newest_overlapping_copy(fake_gpu):
    from umrt.backends.cuda_order import CountedCalls, StreamOrder

    api = BindingsApi(FakeBindingsRuntime(fake_gpu))
    calls = CountedCalls()
    copy, compute = api.create_stream(), api.create_stream()
    order = StreamOrder(api, calls, copy)
    order.copied([(0x1000, 10)], compute)
    order.copied([(0x2000, 10)], compute)
    order.copied([(0x3000, 10)], compute)
    assert calls.counts == {"cudaEventCreateWithFlags": 3, "cudaEventRecord": 3}
    order.wait_copies(compute, [(0x2005, 1)])  # the second copy: covers the first too
    assert calls.counts["cudaStreamWaitEvent"] == 1 and len(order.pending) == 1
    order.wait_copies(compute, [(0x1000, 10)])  # already waited for
    assert calls.counts["cudaStreamWaitEvent"] == 1
    order.copied([(0x4000, 10)], compute)  # reuses a spare event
    assert calls.counts["cudaEventCreateWithFlags"] == 3
    assert not order.discard_running([(0x4000, 10)])
    order.discarded(compute, [(0x4000, 10)])
    assert order.discard_running([(0x4005, 1)]) and not order.discard_running([(0x5000, 1)])
    order.copy_after_discards()
    assert not order.discard_running([(0x4005, 1)])
    order.synchronized()
    assert not order.pending


def test_no_backend_class_is_over_25_methods():
    """Issue 12: the backends are split into collaborators a newcomer can read one at a time."""
    from bench.architecture import measure

    shapes = {c.name: c.methods for c in measure().classes
              if c.name.startswith(("umrt.backends.", "umrt.sim.backend", "umrt.sim.engine_state",
                                    "umrt.sim.address_space"))}
    assert shapes["umrt.backends.cuda.CudaBackend"] <= 25 and shapes["umrt.sim.backend.SimBackend"] <= 25
    assert max(shapes.values()) <= 25, shapes


def test_neighbours_swapped_out_together_come_back_and_die_one_at_a_time(cuda13, fake_gpu):
    """Two touching ranges swapped out in one call leave as two entries: the runtime brings back
    (or releases) one without the other, and a kernel then reads each with its data there.
    Merged into one entry, the first back found no entry starting in its range and prefetched
    discarded pages (the data still in pinned memory), and a release of one dropped both."""
    base = cuda13.malloc(4 * MiB)
    a, b, c = (base, MiB), (base + MiB, MiB), (base + 2 * MiB, MiB)
    fake_gpu.kernel(cuda13.compute_stream, writes=(a, b, c), name="writer")
    swap = cuda13.swap
    swap.reserve(3 * MiB)
    swap.out([a, b, c])
    assert sorted(swap.streams.away) == [a[0], b[0], c[0]]
    swap.back([b])
    swap.wait([b])
    fake_gpu.kernel(cuda13.compute_stream, reads=(b,), name="reads b")
    swap.release([a])  # a died: c stays away, its copy kept
    assert sorted(swap.streams.away) == [c[0]]
    swap.back([c])
    swap.wait([c])
    fake_gpu.kernel(cuda13.compute_stream, reads=(c,), name="reads c")
    assert not swap.away and not fake_gpu.violations


def test_a_range_inside_one_swapped_out_comes_back_with_it(cuda13, fake_gpu):
    """A range that starts inside a range away (a kernel on part of it, a prefetch of part of
    it) brings the whole of it back, never a prefetch of its discarded pages."""
    ptr = cuda13.malloc(4 * MiB)
    fake_gpu.kernel(cuda13.compute_stream, writes=((ptr, 2 * MiB),), name="writer")
    cuda13.swap.reserve(2 * MiB)
    cuda13.swap.out([(ptr, 2 * MiB)])
    cuda13.prefetch([(ptr + MiB, MiB)], 0)
    cuda13.swap.wait([(ptr, 2 * MiB)])
    fake_gpu.kernel(cuda13.compute_stream, reads=((ptr, 2 * MiB),), name="reader")
    assert not cuda13.swap.away and not fake_gpu.violations


def _sm_backend(fake_gpu, swap_copy="sm", launcher=True):
    from umrt.backends.cuda import BindingsApi, CudaBackend

    rt = FakeBindingsRuntime(fake_gpu)
    return CudaBackend(0, api=BindingsApi(rt, sm_copy=rt.sm_copy_kernel if launcher else None), swap_copy=swap_copy)


@pytest.mark.parametrize(("swap_copy", "launcher", "copy"), [("sm", True, "umrt_sm_copy"),
                                                             ("engines", True, "cudaMemcpyAsync"),
                                                             ("sm", False, "cudaMemcpyAsync")])
def test_a_swap_copies_with_the_sm_kernel_where_it_can_and_the_copy_engines_otherwise(fake_gpu, swap_copy, launcher,
                                                                                      copy):
    """``UMRT_SWAP_COPY=sm`` (the default): the copies out and back are umrt's SM copy kernel, on
    streams of the device's greatest priority (a scheduling hint: that its blocks start early is
    not measured); ``engines``, or an adapter that launches no kernel: ``cudaMemcpyAsync``. Either
    way the round trip is ordered as the fake runtime requires, and a reader after it is clean."""
    b = _sm_backend(fake_gpu, swap_copy, launcher)
    ptr = b.malloc(4 * MiB)
    fake_gpu.kernel(b.compute_stream, writes=((ptr, 4 * MiB),), name="writer")
    b.swap.reserve(4 * MiB)
    b.swap.reserve(2 * MiB)  # reserved again (a later plan): built once all the same
    b.swap.out([(ptr, 4 * MiB)])
    b.swap.back([(ptr, 4 * MiB)])
    b.swap.wait([(ptr, 4 * MiB)])
    fake_gpu.kernel(b.compute_stream, reads=((ptr, 4 * MiB),), name="reader")
    names = fake_gpu.names()
    other = ({"umrt_sm_copy", "cudaMemcpyAsync"} - {copy}).pop()
    assert names.count(copy) == 2 and other not in names
    urgent = [int(b.swap.streams.streams[k]) for k in ("out", "in")]
    assert [fake_gpu.priorities.get(s, 0) for s in urgent] == ([-5, -5] if copy == "umrt_sm_copy" else [0, 0])
    assert b.calls[copy] == 2 and b.swap.out_bytes == b.swap.in_bytes == 4 * MiB
    if launcher:  # built once, when the staging was reserved (before any step copies), only for SM copies
        assert b.api.rt.sm_copy_kernel.builds == (copy == "umrt_sm_copy")
    assert b.counters()["swap_copy"] == {"umrt_sm_copy": "sm", "cudaMemcpyAsync": "engines"}[copy]
    assert not fake_gpu.violations


@pytest.mark.parametrize("skip", ["writer", "population"])
def test_the_fake_runtime_catches_an_sm_copy_out_of_order(fake_gpu, skip):
    """The SM copy kernel is checked as a copy is: one out before the range's last writer is a
    race; one back into discarded pages with no population before it takes the refault path."""
    from fake_cuda import PageStateError

    rt = FakeBindingsRuntime(fake_gpu)
    _, ptr = rt.cudaMallocManaged(MiB, 1)
    _, slot = rt.cudaHostAlloc(MiB, rt.cudaHostAllocMapped)
    compute, copy = (rt.cudaStreamCreateWithFlags(1)[1] for _ in range(2))
    fake_gpu.strict = True
    fake_gpu.kernel(compute, writes=((ptr, MiB),), name="writer")
    with pytest.raises(PageStateError, match="copy-out-race" if skip == "writer" else "copy-into-discarded"):
        if skip == "population":
            _, ev = rt.cudaEventCreateWithFlags(2)
            rt.cudaEventRecord(ev, compute)
            rt.cudaStreamWaitEvent(copy, ev, 0)
            rt.sm_copy_kernel(slot, ptr, MiB, copy)
            _, ev = rt.cudaEventCreateWithFlags(2)
            rt.cudaEventRecord(ev, copy)
            rt.cudaStreamWaitEvent(compute, ev, 0)
            rt.cudaMemDiscardBatchAsync([ptr], [MiB], 1, 0, compute)
        rt.sm_copy_kernel(ptr if skip == "population" else slot, slot if skip == "population" else ptr, MiB,
                          compute if skip == "population" else copy)


def test_the_sm_copy_kernel_refuses_what_it_cannot_copy_with_a_way_around():
    """Pointers and sizes not in 16-byte words, and any failure to build or launch the kernel,
    are a CudaError naming ``UMRT_SWAP_COPY=engines``."""
    from umrt.backends.sm_copy import SmCopyKernel

    with pytest.raises(CudaError, match="16-byte words"):
        SmCopyKernel()(0x1000, 0x2008, 64, 0)
    if SmCopyKernel.available():  # CuPy imports; with no GPU here, building or launching fails
        with pytest.raises(CudaError, match="UMRT_SWAP_COPY=engines"):
            SmCopyKernel()(0x1000, 0x2000, 64, 0)
        with pytest.raises(CudaError, match="umrt_sm_copy failed: .*UMRT_SWAP_COPY=engines"):
            SmCopyKernel().build()


class _Broken:
    """An SM copy kernel that cannot be built (``at="build"``) or launched (``at="launch"``)."""

    def __init__(self, at):
        self.at = at

    def build(self):
        if self.at == "build":
            raise CudaError("umrt_sm_copy failed: CompileException: nvrtc not found")

    def __call__(self, dst, src, nbytes, stream):
        raise CudaError("umrt_sm_copy failed: CompileException: nvrtc not found")


@pytest.mark.parametrize("at", ["build", "launch"])
def test_an_sm_copy_kernel_that_cannot_run_is_said_once_and_the_copy_engines_take_over(fake_gpu, at):
    """A kernel CuPy cannot build (no NVRTC, say) fails when the staging is reserved, before any
    step, or, failing later, at the first copy: umrt warns once, naming why, and copies with
    cudaMemcpyAsync from then on, losing nothing."""
    from umrt.backends.cuda import BindingsApi, CudaBackend

    b = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(fake_gpu), sm_copy=_Broken(at)), swap_copy="sm")
    ptr = b.malloc(4 * MiB)
    fake_gpu.kernel(b.compute_stream, writes=((ptr, 4 * MiB),), name="writer")
    with pytest.warns(RuntimeWarning, match="nvrtc not found; copying with cudaMemcpyAsync"):
        b.swap.reserve(4 * MiB)
        b.swap.out([(ptr, 2 * MiB), (ptr + 2 * MiB, 2 * MiB)])
    assert b.swap.copies_with == "engines"
    b.swap.back([(ptr, 4 * MiB)])
    b.swap.wait([(ptr, 4 * MiB)])
    fake_gpu.kernel(b.compute_stream, reads=((ptr, 4 * MiB),), name="reader")
    assert fake_gpu.names().count("cudaMemcpyAsync") == 4 and not b.swap.sm and "nvrtc" in b.swap.sm_failed
    assert b.counters()["swap_copy"] == "engines"  # memory_stats()["swap_copy"] says it
    assert not fake_gpu.violations
