"""SimBackend as a Backend: policy actions, time on three engines, advice,
data integrity."""
from __future__ import annotations

import math

import pytest

from umrt.backends.base import HOST, Advice, Backend
from umrt.errors import ConfigError, DataIntegrityError
from umrt.hardware import load_profile
from umrt.sim.backend import SimBackend

MB = 1 << 20
PAGE = 64 << 10
BLOCK = 2 * MB
PROFILE = load_profile("v100-pcie3-16g")
OVERHEAD = PROFILE.prefetch_call_overhead_s


def gpu(blocks: int = 64) -> SimBackend:
    return SimBackend(PROFILE, blocks * BLOCK)


def host_data(b: SimBackend, nbytes: int) -> int:
    ptr = b.malloc(nbytes)
    b.mark_host_written([(ptr, nbytes)])
    return ptr


def test_is_a_backend_with_a_budget():
    b = gpu(4)
    assert isinstance(b, Backend) and b.name == "sim"
    assert b.mem_info() == (4 * BLOCK, 4 * BLOCK)
    with pytest.raises(ConfigError, match="2 MB"):
        SimBackend(PROFILE, MB)
    assert SimBackend(PROFILE, math.inf).mem_info()[1] > 1 << 50


def test_with_unlimited_memory_allocations_are_device_memory_never_faulted_in():
    """ideal: a GPU with enough memory backs an allocation when it is made (cudaMalloc), so
    its first kernel runs at compute speed; managed memory of a budgeted GPU is faulted in."""
    long_kernel = int(PROFILE.peak_flops * PROFILE.compute_efficiency * 0.001)  # 1 ms
    times = {}
    for name, b in (("ideal", SimBackend(PROFILE, math.inf)), ("managed", gpu())):
        ptr = b.malloc(8 * BLOCK)
        b.launch([], [(ptr, 8 * BLOCK)], long_kernel, 0)
        times[name] = (b.now(), b.faults, b.calls, b.resident_bytes, b.breakdown["compute_s"])
    assert times["ideal"][1:4] == (0, 0, 8 * BLOCK)
    assert times["ideal"][0] == pytest.approx(times["ideal"][4])
    assert times["managed"][1] == 8 * BLOCK // PAGE and times["managed"][0] > times["ideal"][0]


def test_prefetch_then_launch_waits_for_the_copy_instead_of_faulting():
    b = gpu()
    ptr = host_data(b, 8 * BLOCK)
    b.prefetch([(ptr, 8 * BLOCK)], 0)
    b.launch([(ptr, 8 * BLOCK)], [], 0, 0)
    assert b.faults == 0
    copy = PROFILE.prefetch_time(8 * BLOCK)  # one set-up, then pipelined per 2 MB VA block
    assert b.breakdown["transfer_wait_s"] == pytest.approx(copy, rel=1e-6)
    assert b.breakdown["overhead_s"] == pytest.approx(OVERHEAD)
    assert b.now() == pytest.approx(OVERHEAD + copy + PROFILE.launch_floor_s, rel=1e-6)


def test_prefetch_overlaps_compute():
    b = gpu()
    ptr = host_data(b, 4 * BLOCK)
    work = b.malloc(BLOCK)
    b.prefetch([(ptr, 4 * BLOCK)], 0)
    long_kernel = int(PROFILE.peak_flops * PROFILE.compute_efficiency * 0.01)  # 10 ms
    b.launch([], [(work, BLOCK)], long_kernel, 0)
    b.launch([(ptr, 4 * BLOCK)], [], 0, 0)
    assert b.faults == 32  # only the first touch of `work`
    assert b.breakdown["transfer_wait_s"] == 0.0


def test_prefetches_in_both_directions_share_one_migration_path():
    # h100-measured.md: 2 GiB each way at once on two streams took as long as both one after the other
    b = gpu()
    out = host_data(b, 8 * BLOCK)
    inn = host_data(b, 8 * BLOCK)
    b.prefetch([(out, 8 * BLOCK)], 0)
    b.synchronize()
    t0 = b.now()
    b.prefetch([(out, 8 * BLOCK)], HOST)
    b.prefetch([(inn, 8 * BLOCK)], 0)
    b.synchronize()
    both = PROFILE.prefetch_time(8 * BLOCK, "d2h") + PROFILE.prefetch_time(8 * BLOCK)
    assert b.now() - t0 == pytest.approx(OVERHEAD + both, rel=1e-6)  # the second call is issued during the first
    assert b.d2h_bytes == 8 * BLOCK and b.h2d_bytes == 16 * BLOCK


def test_prefetch_to_host_frees_capacity_once_the_copy_is_done():
    b = gpu(4)
    a = host_data(b, 4 * BLOCK)
    c = host_data(b, 4 * BLOCK)
    b.prefetch([(a, 4 * BLOCK)], 0)
    b.prefetch([(a, 4 * BLOCK)], HOST)
    b.prefetch([(c, 4 * BLOCK)], 0)  # waits for the D2H copies, evicts nothing
    assert b.evictions == 0
    b.launch([(c, 4 * BLOCK)], [], 0, 0)
    assert b.faults == 0
    assert b.resident_fraction([(a, 4 * BLOCK)]) == 0.0


def test_prefetch_to_gpu_evicts_on_demand_when_full():
    b = gpu(2)
    a, c = host_data(b, 2 * BLOCK), host_data(b, 2 * BLOCK)
    b.prefetch([(a, 2 * BLOCK)], 0)
    b.prefetch([(c, 2 * BLOCK)], 0)
    assert b.evictions == 2 and b.resident_bytes == 2 * BLOCK
    assert b.resident_fraction([(c, 2 * BLOCK)]) == 1.0


def test_reading_never_written_data_is_an_integrity_error():
    b = gpu()
    ptr = b.malloc(BLOCK)
    with pytest.raises(DataIntegrityError, match="never written"):
        b.launch([(ptr, 16)], [], 0, 0)
    b.launch([], [(ptr, 1024)], 0, 0)
    b.launch([(ptr, 1024)], [], 0, 0)  # written: fine
    with pytest.raises(DataIntegrityError):
        b.launch([(ptr + 1000, 100)], [], 0, 0)  # straddles the written end


def test_discard_of_live_data_is_caught_and_writing_undoes_it():
    b = gpu()
    ptr = host_data(b, BLOCK)
    b.launch([(ptr, BLOCK)], [], 0, 0)
    b.discard([(ptr + PAGE, PAGE)])
    b.launch([(ptr, PAGE)], [], 0, 0)  # the neighbour is intact
    with pytest.raises(DataIntegrityError, match="discarded"):
        b.launch([(ptr, BLOCK)], [], 0, 0)
    b.launch([], [(ptr + PAGE, PAGE)], 0, 0)
    b.launch([(ptr, BLOCK)], [], 0, 0)


def test_mark_dead_is_bookkeeping_only():
    b = gpu(1)
    ptr, other = host_data(b, BLOCK), host_data(b, BLOCK)
    b.launch([(ptr, BLOCK)], [], 0, 0)
    b.mark_dead([(ptr, BLOCK)])
    with pytest.raises(DataIntegrityError):
        b.launch([(ptr, 8)], [], 0, 0)
    b.launch([(other, BLOCK)], [], 0, 0)  # the driver does not know: dead pages are copied back
    assert b.d2h_bytes == BLOCK
    assert b.calls == 0


def test_discard_skips_copy_back_only_for_whole_pages():
    b = gpu(1)
    ptr, other = host_data(b, BLOCK), host_data(b, BLOCK)
    b.launch([(ptr, BLOCK)], [], 0, 0)
    b.discard([(ptr, BLOCK - PAGE // 2)])  # the last page is only half covered
    b.launch([(other, BLOCK)], [], 0, 0)
    assert b.d2h_bytes == PAGE


def test_accessed_by_reads_host_data_over_the_link():
    b = gpu()
    ptr = host_data(b, 8 * BLOCK)
    b.advise([(ptr, 8 * BLOCK)], Advice.SET_ACCESSED_BY, 0)
    b.launch([(ptr, 8 * BLOCK)], [], 0, 0)
    assert b.faults == 0 and b.resident_bytes == 0
    assert b.h2d_bytes == 8 * BLOCK
    assert b.breakdown["remote_access_s"] == pytest.approx(8 * BLOCK / PROFILE.h2d_bandwidth - PROFILE.launch_floor_s)


def test_preferred_location_host_maps_instead_of_migrating():
    b = gpu()
    ptr = host_data(b, BLOCK)
    b.advise([(ptr, BLOCK)], Advice.SET_PREFERRED_LOCATION, HOST)
    b.launch([(ptr, BLOCK)], [], 0, 0)
    b.launch([(ptr, BLOCK)], [], 0, 0)
    assert b.faults == 32  # the first access faults to map, the second does not
    assert b.resident_bytes == 0 and b.h2d_bytes == 2 * BLOCK
    b.prefetch([(ptr, BLOCK)], 0)  # an explicit prefetch still migrates
    assert b.resident_bytes == BLOCK


def test_policy_calls_cost_overhead_before_the_next_launch():
    b = gpu()
    ptr = host_data(b, BLOCK)
    for _ in range(3):
        b.advise([(ptr, BLOCK)], Advice.SET_PREFERRED_LOCATION, 0)
    b.prefetch([], 0)  # nothing to do: no call is made
    b.discard([])
    b.launch([], [], 0, 0)
    assert b.calls == 3
    assert b.breakdown["overhead_s"] == pytest.approx(3 * PROFILE.advise_call_s)


def test_a_batched_prefetch_costs_cpu_per_range_beside_its_migrations():
    # h100-measured.md: cudaMemPrefetchBatchAsync costs 55 us per range even when nothing moves;
    # the migrations of the ranges issued so far run meanwhile
    b = gpu()
    ptr = host_data(b, 4 * BLOCK)
    ranges = [(ptr + i * BLOCK, BLOCK) for i in range(4)]
    b.prefetch_batch(ranges, 0)
    b.synchronize()
    per_range = PROFILE.prefetch_time(BLOCK)
    assert per_range > PROFILE.batch_range_s  # the migrations are the bottleneck
    assert b.now() == pytest.approx(OVERHEAD + PROFILE.batch_range_s + 4 * per_range, rel=1e-9)
    before = b.breakdown["overhead_s"]
    b.prefetch_batch(ranges, 0)  # all resident: only the CPU cost
    b.launch([], [], 0, 0)
    assert b.breakdown["overhead_s"] - before == pytest.approx(OVERHEAD + 4 * PROFILE.batch_range_s, rel=1e-9)


def test_a_prefetch_is_single_calls_of_merged_ranges_as_the_cuda_backend_issues_it():
    """Touching ranges are one call; separate ones a call each, with no per-range batch cost."""
    b = gpu()
    ptr = host_data(b, 8 * BLOCK)
    b.prefetch([(ptr + i * BLOCK, BLOCK) for i in range(4)], 0)  # touching: one call
    b.synchronize()
    assert b.calls == 1
    assert b.now() == pytest.approx(OVERHEAD + PROFILE.prefetch_time(4 * BLOCK), rel=1e-9)
    before, calls = b.breakdown["overhead_s"], b.calls
    b.prefetch([(ptr + 4 * BLOCK, BLOCK), (ptr + 6 * BLOCK, BLOCK)], 0)  # apart: two calls
    b.launch([], [], 0, 0)
    assert b.calls - calls == 2  # two prefetch calls
    assert b.breakdown["overhead_s"] - before == pytest.approx(2 * OVERHEAD, rel=1e-9)


def test_a_batched_prefetch_to_the_host_pays_more_per_range():
    b = gpu()
    ptr = host_data(b, 4 * BLOCK)
    b.prefetch([(ptr, 4 * BLOCK)], 0)
    b.synchronize()
    t = b.now()
    b.prefetch_batch([(ptr + i * BLOCK, BLOCK) for i in range(4)], HOST)
    b.synchronize()
    per_range = PROFILE.prefetch_time(BLOCK, "d2h") + PROFILE.batch_d2h_range_s
    assert b.now() - t == pytest.approx(OVERHEAD + PROFILE.batch_range_s + 4 * per_range, rel=1e-9)


def test_a_discard_costs_its_call_its_ranges_and_its_bytes():
    b = gpu()
    ptr = host_data(b, 4 * BLOCK)
    b.launch([(ptr, 4 * BLOCK)], [], 0, 0)
    before = b.breakdown["overhead_s"]
    b.discard([(ptr, BLOCK), (ptr + 2 * BLOCK, 2 * BLOCK)])
    b.launch([], [], 0, 0)
    cost = OVERHEAD + 2 * PROFILE.discard_range_s + 3 * BLOCK / PROFILE.discard_rate
    assert b.breakdown["overhead_s"] - before == pytest.approx(cost, rel=1e-9)


def test_advice_costs_one_call_per_range():
    b = gpu()
    ptr = host_data(b, 4 * BLOCK)
    b.advise([(ptr + i * BLOCK, BLOCK) for i in range(3)], Advice.SET_ACCESSED_BY, 0)
    b.launch([], [], 0, 0)
    assert b.breakdown["overhead_s"] == pytest.approx(3 * PROFILE.advise_call_s, rel=1e-9)


def test_discard_and_prefetch_to_the_host_copies_nothing():
    b = gpu()
    ptr = host_data(b, BLOCK)
    b.launch([(ptr, BLOCK)], [], 0, 0)
    b.discard_and_prefetch([(ptr, BLOCK)], HOST)
    assert b.resident_bytes == 0 and b.d2h_bytes == 0
    with pytest.raises(DataIntegrityError):
        b.launch([(ptr, 8)], [], 0, 0)
    with pytest.raises(ValueError, match="device 2"):
        b.discard_and_prefetch([(ptr, BLOCK)], 2)


def test_a_profile_without_the_um_rates_is_refused():
    import dataclasses

    with pytest.raises(ConfigError, match="Unified Memory rate"):
        SimBackend(dataclasses.replace(PROFILE, first_touch_rate=0.0))


def test_actions_start_no_earlier_than_the_next_launch_would():
    b = gpu()
    ptr = host_data(b, BLOCK)
    work = b.malloc(BLOCK)
    ten_ms = int(PROFILE.peak_flops * PROFILE.compute_efficiency * 0.01)
    b.launch([], [(work, BLOCK)], ten_ms, 0)
    t = b.now()
    b.prefetch([(ptr, BLOCK)], 0)
    b.synchronize()
    assert b.now() == pytest.approx(t + OVERHEAD + PROFILE.prefetch_time(BLOCK), rel=1e-6)


def test_free_drops_pages_and_content_and_reuses_the_address_space():
    b = gpu(2)
    ptr = host_data(b, BLOCK)
    b.launch([(ptr, BLOCK)], [], 0, 0)
    b.free(ptr)
    assert b.resident_bytes == 0 and b.d2h_bytes == 0
    again = b.malloc(BLOCK)
    assert again == ptr
    with pytest.raises(DataIntegrityError):
        b.launch([(again, 8)], [], 0, 0)
    with pytest.raises(ValueError, match="not a live allocation"):
        b.free(ptr + 4096)


def test_ranges_outside_allocations_are_rejected():
    b = gpu()
    ptr = host_data(b, BLOCK)
    with pytest.raises(ValueError, match="managed allocation"):
        b.prefetch([(ptr, 2 * BLOCK)], 0)
    with pytest.raises(ValueError, match="device 3"):
        b.prefetch([(ptr, BLOCK)], 3)
    with pytest.raises(ValueError, match="outside"):
        b.launch([], [(ptr + 10 * BLOCK, 8)], 0, 0)


def test_counters_snapshot():
    b = gpu()
    ptr = host_data(b, BLOCK)
    b.launch([(ptr, BLOCK)], [], 10**9, 10**6)
    c = b.counters()
    for key in ("time_s", "faults", "fault_batches", "evictions", "h2d_bytes", "d2h_bytes", "page_events",
                "compute_s", "fault_stall_s", "transfer_wait_s", "overhead_s"):
        assert key in c
    assert c["faults"] == 32 and c["page_events"] >= 64
    assert c["time_s"] == pytest.approx(sum(b.breakdown.values()))


def test_a_budget_below_one_fault_batch_says_so():
    b = gpu(4)  # 8 MiB: a batch of 256 faults over 8 blocks (16 MiB) cannot be serviced
    ptr = host_data(b, 8 * BLOCK)
    with pytest.raises(ConfigError, match=r"one fault batch.*256 faults.*spans at least 5 blocks"):
        b.launch([(ptr, 8 * BLOCK)], [], 0, 0)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_remote_access_shares_the_link_with_copies_in_its_direction(direction):
    b = gpu()
    remote, other = host_data(b, 8 * BLOCK), host_data(b, 8 * BLOCK)
    b.advise([(remote, 8 * BLOCK)], Advice.SET_ACCESSED_BY, 0)
    if direction == "d2h":
        b.prefetch([(other, 8 * BLOCK)], 0)
        b.synchronize()
    t = b.now()
    b.prefetch([(other, 8 * BLOCK)], 0 if direction == "h2d" else HOST)  # copies queued on the link ...
    access = [(remote, 8 * BLOCK)]
    b.launch(access if direction == "h2d" else [], access if direction == "d2h" else [], 0, 0)  # ... and remote
    b.synchronize()
    copies = PROFILE.prefetch_time(8 * BLOCK, direction)
    link = PROFILE.h2d_bandwidth if direction == "h2d" else PROFILE.d2h_bandwidth
    assert b.faults == 0
    assert b.now() - t == pytest.approx(OVERHEAD + copies + 8 * BLOCK / link, rel=1e-6)  # one after the other
    assert b.breakdown["remote_access_s"] > 8 * BLOCK / link  # the kernel's share of the link was halved


def test_memory_a_prefetch_waited_for_is_not_free_earlier_for_others():
    b = gpu(3)
    a, c, d = host_data(b, 2 * BLOCK), host_data(b, BLOCK), host_data(b, BLOCK)
    b.prefetch([(a, 2 * BLOCK), (c, BLOCK)], 0)
    b.synchronize()
    b.prefetch([(a, 2 * BLOCK)], HOST)  # 2 blocks leave, free once their copy is done
    b.prefetch([(d, BLOCK // 2)], 0)  # waits for the first of them and takes half of it ...
    w = b.malloc(BLOCK)
    b.launch([], [(w, BLOCK // 2)], 0, 0)  # ... but the launch runs now: the other half is not free yet
    assert b.evictions == 1 and b.resident_fraction([(c, BLOCK)]) == 0.0


def test_the_address_space_reuses_the_first_hole_that_fits_and_grows_the_page_state():
    b = gpu()
    big, small, last = b.malloc(3 * BLOCK), b.malloc(BLOCK), b.malloc(BLOCK)
    b.free(big)
    assert b.malloc(BLOCK + 1) == big  # two blocks of the three-block hole ...
    assert b.malloc(BLOCK) == big + 2 * BLOCK  # ... then its last one
    assert b.malloc(BLOCK) == last + BLOCK  # no hole left: past the top
    assert small < last
    blocks = b.engine.nblocks
    far = b.malloc((blocks + 1) * BLOCK)  # past the page state's end: it grows, the new pages mapped
    assert b.engine.nblocks >= b.space.top > blocks
    b.mark_host_written([(far, (blocks + 1) * BLOCK)])
    b.launch([(far + blocks * BLOCK, BLOCK)], [], 0, 0)
    assert b.faults == 32


def test_the_space_merges_a_prefetch_s_touching_ranges_within_an_allocation_only():
    b = gpu()
    a, c = b.malloc(BLOCK), b.malloc(BLOCK)  # adjacent allocations
    assert c == a + BLOCK
    merged = b.space.coalesce([(a + MB, MB), (a, MB), (c, PAGE), (c + PAGE, PAGE), (c + 4 * PAGE, PAGE)])
    assert merged == [(a, BLOCK), (c, 2 * PAGE), (c + 4 * PAGE, PAGE)]


def test_counters_read_as_attributes_are_the_engine_s():
    b = gpu()
    ptr = host_data(b, 2 * BLOCK)
    b.launch([(ptr, 2 * BLOCK)], [], 0, 0)
    assert (b.faults, b.resident_bytes, b.peak_resident_bytes, b.h2d_bytes) == (64, 2 * BLOCK, 2 * BLOCK, 2 * BLOCK)
    b.prefetch([(ptr, BLOCK)], HOST)
    b.synchronize()
    assert b.resident_bytes == BLOCK and b.d2h_bytes == BLOCK
    b.reset_peak()
    assert b.peak_resident_bytes == BLOCK
    assert "64 KB pages" in SimBackend.faults.__doc__


def _written_on_the_gpu(prof, swap_copy):
    """A simulated GPU with 512 MB a kernel wrote on it (to swap) and one more block (for a kernel
    beside the copies): ``(backend, bytes, data, other)``."""
    b = SimBackend(prof, swap_copy=swap_copy)
    n = 512 * MB
    data, other = b.malloc(n), b.malloc(BLOCK)
    b.prefetch([(data, n), (other, BLOCK)], 0)
    b.launch([], [(data, n), (other, BLOCK)], 0, n)
    b.synchronize()
    return b, n, data, other


@pytest.mark.parametrize("wait", [0.0, 1.0])
def test_the_thread_waits_for_a_swap_copy_as_the_profile_says(wait):
    """``copy_host_wait``: 1 (measured on an H200), a kernel issued after a copy out starts once the
    copy is done; 0, it runs beside it."""
    import dataclasses

    prof = dataclasses.replace(load_profile("h100-sxm5-80g"), copy_host_wait=wait)
    b, n, data, other = _written_on_the_gpu(prof, "engines")
    t0 = b.now()
    b.swap.out([(data, n)])
    b.launch([(other, BLOCK)], [(other, BLOCK)], 10**12, 0, "fp32")  # ~20 ms of compute, not on the range
    b.synchronize()
    copy, compute = n / prof.copy_rate("d2h"), prof.compute_time(10**12, 0, "fp32")
    serial = b.now() - t0 >= copy + compute
    assert serial is (wait == 1.0), (b.now() - t0, copy, compute)


@pytest.mark.parametrize("share", [0.1, 0.5])
def test_an_sm_copy_holds_nothing_back_and_slows_the_kernels_beside_it_by_its_share(share):
    """``swap_copy="sm"``: the copy is a kernel of umrt's own, so a kernel issued after it starts at
    once (the thread waits for nothing), and computes at ``1 - sm_copy_share`` of the GPU for as
    long as the copy runs beside it; a kernel after the copy is done runs at full speed."""
    import dataclasses

    prof = dataclasses.replace(load_profile("h100-sxm5-80g"), copy_host_wait=1.0, sm_copy_share=share)
    b, n, data, other = _written_on_the_gpu(prof, "sm")
    t0 = b.now()
    b.swap.out([(data, n)])
    flops = 10**12  # ~20 ms of fp32 compute, longer than the copy (~10 ms)
    b.launch([(other, BLOCK)], [(other, BLOCK)], flops, 0, "fp32")
    t1 = b.now()
    copy, compute = n / prof.copy_rate("d2h"), prof.compute_time(flops, 0, "fp32")
    assert copy < compute
    beside = t1 - t0 - 2 * prof.prefetch_call_overhead_s  # the copy's and the discard's calls
    assert beside == pytest.approx(compute + copy * share / (1 - share), rel=1e-3)
    b.synchronize()
    t2 = b.now()
    b.launch([(other, BLOCK)], [(other, BLOCK)], flops, 0, "fp32")
    assert b.now() - t2 == pytest.approx(compute)


def test_the_swap_copy_follows_umrt_swap_copy_and_refuses_a_word_it_does_not_know(monkeypatch):
    from umrt.errors import ConfigError

    monkeypatch.setenv("UMRT_SWAP_COPY", "engines")
    assert SimBackend("h100-sxm5-80g").swap.swap_copy == "engines"
    monkeypatch.delenv("UMRT_SWAP_COPY")
    assert SimBackend("h100-sxm5-80g").swap.swap_copy == "sm"
    monkeypatch.setenv("UMRT_SWAP_COPY", "dma")
    with pytest.raises(ConfigError, match="UMRT_SWAP_COPY='dma'.*sm, engines"):
        SimBackend("h100-sxm5-80g")


def test_sm_copies_both_ways_each_take_their_share_of_the_kernels_beside_them():
    """A copy out and a copy back running at once beside one long kernel: each direction's copy
    kernel holds its own SMs, so the kernel loses ``sm_copy_share`` for each one's overlap."""
    import dataclasses

    share = 0.2
    prof = dataclasses.replace(load_profile("h100-sxm5-80g"), sm_copy_share=share)
    b = SimBackend(prof, swap_copy="sm")
    n = 256 * MB
    out, back, other = b.malloc(n), b.malloc(n), b.malloc(BLOCK)
    b.prefetch([(out, n), (back, n), (other, BLOCK)], 0)
    b.launch([], [(out, n), (back, n), (other, BLOCK)], 0, 2 * n)
    b.synchronize()
    b.swap.out([(back, n)])  # away first, so that it can come back below
    b.synchronize()
    t0 = b.now()
    b.swap.out([(out, n)])
    b.swap.back([(back, n)])
    t1 = b.now()
    flops = 10**12  # ~20 ms of fp32 compute: longer than either copy
    b.launch([(other, BLOCK)], [(other, BLOCK)], flops, 0, "fp32")
    compute = prof.compute_time(flops, 0, "fp32")
    took = b.now() - t1
    one = n / prof.copy_rate("d2h") * share / (1 - share)
    assert compute + 1.8 * one < took <= compute + 2.2 * one, (took, compute, one)  # both, not one
    assert t1 - t0 < 1e-3  # the thread held nothing back: the calls' own cost only
