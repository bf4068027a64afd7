"""The simulator's page-level mechanics: faults, batching, the density
prefetcher, eviction order and copy-back (umrt.sim.engine via SimBackend)."""
from __future__ import annotations

import pytest

from umrt.backends.base import HOST, Advice
from umrt.hardware import load_profile
from umrt.sim import engine as E
from umrt.sim.backend import SimBackend

MB = 1 << 20
PAGE = 64 << 10
BLOCK = 2 * MB
PROFILE = load_profile("v100-pcie3-16g")
OVERHEAD = PROFILE.prefetch_call_overhead_s
FAULT_COPY = BLOCK / PROFILE.fault_migration_rate  # one 2 MB block on the fault path
BACK = BLOCK / PROFILE.prefetch_d2h_rate  # one block copied back (an eviction: no set-up)


def gpu(blocks: int) -> SimBackend:
    return SimBackend(PROFILE, blocks * BLOCK)


def host_block(b: SimBackend, nbytes: int = BLOCK) -> int:
    """A managed allocation whose content was written on the host."""
    ptr = b.malloc(nbytes)
    b.mark_host_written([(ptr, nbytes)])
    return ptr


def read(b: SimBackend, ptr: int, nbytes: int) -> None:
    b.launch([(ptr, nbytes)], [], 0, 0)


@pytest.mark.parametrize("pages, migrated", [(16, 16), (17, 32), (1, 1), (32, 32)])
def test_density_prefetcher_takes_the_whole_block_above_51_percent(pages, migrated):
    b = gpu(8)
    ptr = host_block(b)
    read(b, ptr, pages * PAGE)
    assert b.faults == pages  # one entry per faulted 64 KB page
    assert b.h2d_bytes == migrated * PAGE
    assert b.resident_bytes == migrated * PAGE


def test_prefetcher_counts_resident_pages_and_never_crosses_the_block():
    b = gpu(8)
    ptr = host_block(b, 2 * BLOCK)
    read(b, ptr, 16 * PAGE)  # half of block 0: exactly 16 pages come
    assert b.resident_bytes == 16 * PAGE
    read(b, ptr + 16 * PAGE, PAGE)  # one more fault: 17/32 resident-or-faulted > 51%
    assert b.resident_bytes == BLOCK  # the whole first block, nothing of the second
    assert b.resident_fraction([(ptr + BLOCK, BLOCK)]) == 0.0


def test_scattered_pages_above_threshold_also_fill_the_block():
    b = gpu(8)
    ptr = host_block(b)
    # pages 0, 2, 4, ... 30 (16) and 1: 17 of 32 -> the root subtree exceeds 51%
    touched = [(ptr + i * PAGE, PAGE) for i in [*range(0, 32, 2), 1]]
    b.launch(touched, [], 0, 0)
    assert b.resident_bytes == BLOCK


def test_faults_are_serviced_in_batches_of_256():
    b = gpu(64)
    ptr = host_block(b, 10 * BLOCK)
    read(b, ptr, 10 * BLOCK)  # 320 faulted pages
    assert b.faults == 320
    assert b.fault_batches == 2
    stall = b.breakdown["fault_stall_s"]
    assert stall == pytest.approx(2 * PROFILE.fault_batch_latency_s + 10 * FAULT_COPY, rel=1e-6)


def test_resident_pages_do_not_fault_again():
    b = gpu(8)
    ptr = host_block(b)
    read(b, ptr, BLOCK)
    read(b, ptr, BLOCK)
    assert b.faults == 32 and b.fault_batches == 1


def test_eviction_is_lru_by_migration_time_not_by_access():
    b = gpu(2)
    first, second, third = (host_block(b) for _ in range(3))
    read(b, first, BLOCK)
    read(b, second, BLOCK)
    read(b, first, BLOCK)  # a hit: first is accessed last but migrated first
    read(b, third, BLOCK)
    assert b.evictions == 1
    assert b.resident_fraction([(first, BLOCK)]) == 0.0
    assert b.resident_fraction([(second, BLOCK)]) == 1.0
    assert b.d2h_bytes == BLOCK  # the victim's pages are copied back


def test_discarded_blocks_are_evicted_first_without_copy_back():
    b = gpu(2)
    first, second, third = (host_block(b) for _ in range(3))
    read(b, first, BLOCK)
    read(b, second, BLOCK)
    b.discard([(second, BLOCK)])
    read(b, third, BLOCK)
    assert b.resident_fraction([(second, BLOCK)]) == 0.0  # not the older first block
    assert b.resident_fraction([(first, BLOCK)]) == 1.0
    assert b.d2h_bytes == 0


def test_clean_read_mostly_copies_are_dropped_without_copy_back():
    b = gpu(1)
    rm, other = host_block(b), host_block(b)
    b.advise([(rm, BLOCK)], Advice.SET_READ_MOSTLY, 0)
    read(b, rm, BLOCK)
    read(b, other, BLOCK)  # evicts the read-mostly copy
    assert b.evictions == 1 and b.d2h_bytes == 0


def test_a_write_collapses_read_mostly_copies_so_eviction_copies_back():
    b = gpu(1)
    rm, other = host_block(b), host_block(b)
    b.advise([(rm, BLOCK)], Advice.SET_READ_MOSTLY, 0)
    read(b, rm, BLOCK)
    faults = b.faults
    b.launch([], [(rm, PAGE)], 0, 0)
    assert b.faults == faults + 1  # revoking the host copy is a fault, with no transfer
    read(b, other, BLOCK)
    assert b.d2h_bytes == PAGE  # only the written page was dirty


def test_prefetch_to_host_copies_back_by_the_eviction_rule():
    b = gpu(8)
    rm, data = host_block(b), host_block(b)
    b.advise([(rm, BLOCK)], Advice.SET_READ_MOSTLY, 0)
    read(b, rm, BLOCK)
    read(b, data, BLOCK)
    b.discard([(data + BLOCK // 2, BLOCK // 2)])
    b.prefetch([(rm, BLOCK), (data, BLOCK)], HOST)
    assert b.d2h_bytes == BLOCK // 2  # clean read-mostly copies and discarded pages copy nothing
    assert b.resident_bytes == 0


def test_a_block_whose_valid_pages_left_for_the_host_is_evicted_first():
    b = gpu(2)
    first, second, third = (host_block(b) for _ in range(3))
    read(b, first, BLOCK)
    read(b, second, BLOCK)
    b.discard([(second, BLOCK // 2)])
    b.prefetch([(second + BLOCK // 2, BLOCK // 2)], HOST)  # only discarded pages stay resident
    b.synchronize()
    read(b, third, BLOCK)
    assert b.resident_fraction([(second, BLOCK)]) == 0.0  # not the older first block
    assert b.resident_fraction([(first, BLOCK)]) == 1.0
    assert b.d2h_bytes == BLOCK // 2  # the prefetched half; the eviction copied nothing


def test_never_written_pages_populate_without_a_copy_at_the_first_touch_rate():
    b = gpu(8)
    ptr = b.malloc(BLOCK)
    b.launch([], [(ptr, BLOCK)], 0, 0)  # first touch is a write
    assert b.faults == 32 and b.h2d_bytes == 0
    assert b.resident_bytes == BLOCK
    # h100-measured.md: zero-fill faults populate at ~4.6 GB/s, not for free
    stall = PROFILE.fault_batch_latency_s + BLOCK / PROFILE.first_touch_rate
    assert b.breakdown["fault_stall_s"] == pytest.approx(stall, rel=1e-9)


def test_a_prefetch_populates_fresh_pages_without_a_copy_or_a_fault():
    b = gpu(16)
    ptr = b.malloc(8 * BLOCK)
    b.prefetch([(ptr, 8 * BLOCK)], 0)
    b.synchronize()
    populate = PROFILE.prefetch_h2d_setup_s + 8 * BLOCK / PROFILE.prefetch_populate_rate
    assert b.now() == pytest.approx(OVERHEAD + populate, rel=1e-9) and b.h2d_bytes == 0
    b.launch([], [(ptr, 8 * BLOCK)], 0, 0)
    assert b.faults == 0


def discarded_block(b: SimBackend) -> int:
    ptr = host_block(b)
    read(b, ptr, BLOCK)
    b.discard([(ptr, BLOCK)])
    b.synchronize()
    return ptr


def test_a_kernel_writing_discarded_pages_takes_the_refault_path():
    b = gpu(8)
    ptr = discarded_block(b)
    stall = b.breakdown["fault_stall_s"]
    b.launch([], [(ptr, BLOCK)], 0, 0)  # still resident, but discarded: every page faults
    assert b.faults == 64 and b.resident_bytes == BLOCK and b.h2d_bytes == BLOCK
    refault = PROFILE.fault_batch_latency_s + BLOCK / PROFILE.discard_refault_rate
    assert b.breakdown["fault_stall_s"] - stall == pytest.approx(refault, rel=1e-9)
    b.launch([], [(ptr, BLOCK)], 0, 0)  # written again: mapped, no more faults
    assert b.faults == 64


@pytest.mark.parametrize("how", ["prefetch", "discard_and_prefetch"])
def test_a_prefetch_to_the_gpu_after_a_discard_avoids_the_refault(how):
    b = gpu(8)
    ptr = discarded_block(b) if how == "prefetch" else host_block(b)
    if how == "discard_and_prefetch":
        read(b, ptr, BLOCK)
        b.synchronize()
    t = b.now()
    getattr(b, how)([(ptr, BLOCK)], 0)
    b.synchronize()
    call = OVERHEAD + (PROFILE.discard_range_s if how == "discard_and_prefetch" else 0.0)
    revalidate = PROFILE.prefetch_h2d_setup_s + BLOCK / PROFILE.discard_prefetch_rate
    assert b.now() - t == pytest.approx(call + revalidate, rel=1e-9)
    faults = b.faults
    b.launch([], [(ptr, BLOCK)], 0, 0)
    assert b.faults == faults and b.h2d_bytes == BLOCK  # no refault, nothing copied


def test_discarded_pages_evicted_and_then_written_still_take_the_refault_path():
    b = gpu(1)
    ptr = discarded_block(b)
    other = host_block(b)
    read(b, other, BLOCK)  # evicts the discarded block first, copying nothing
    assert b.resident_fraction([(ptr, BLOCK)]) == 0.0 and b.d2h_bytes == 0
    stall = b.breakdown["fault_stall_s"]
    b.launch([], [(ptr, BLOCK)], 0, 0)  # evicts `other` (a copy back), then populates at the refault rate
    expected = (PROFILE.fault_batch_latency_s + BLOCK / PROFILE.prefetch_d2h_rate
                + BLOCK / PROFILE.discard_refault_rate)
    assert b.breakdown["fault_stall_s"] - stall == pytest.approx(expected, rel=1e-9)


def test_the_first_copy_of_a_page_to_the_host_populates_host_memory():
    b = gpu(8)
    born = b.malloc(BLOCK)
    b.launch([], [(born, BLOCK)], 0, 0)  # born on the GPU: no host memory behind it yet
    b.synchronize()
    first = PROFILE.prefetch_time(BLOCK, "d2h") + BLOCK / PROFILE.host_populate_rate
    for expected in (first, PROFILE.prefetch_time(BLOCK, "d2h")):  # the second time the host pages exist
        t = b.now()
        b.prefetch([(born, BLOCK)], HOST)
        b.synchronize()
        assert b.now() - t == pytest.approx(OVERHEAD + expected, rel=1e-9)
        b.prefetch([(born, BLOCK)], 0)
        b.synchronize()
    written = host_block(b)  # written on the host: its host pages exist
    read(b, written, BLOCK)
    b.synchronize()
    t = b.now()
    b.prefetch([(written, BLOCK)], HOST)
    b.synchronize()
    assert b.now() - t == pytest.approx(OVERHEAD + PROFILE.prefetch_time(BLOCK, "d2h"), rel=1e-9)


def test_capacity_is_never_exceeded_and_peak_is_tracked():
    b = gpu(3)
    ptrs = [host_block(b) for _ in range(6)]
    for _ in range(2):
        for p in ptrs:
            read(b, p, BLOCK)
            assert b.resident_bytes <= 3 * BLOCK
    assert b.peak_resident_bytes == 3 * BLOCK
    assert b.evictions == 9


def test_fault_log_reports_block_addresses_in_order():
    b = gpu(8)
    a, c = host_block(b, 2 * BLOCK), host_block(b)
    read(b, c, PAGE)
    read(b, a + BLOCK, PAGE)
    read(b, a, PAGE)
    assert b.drain_faults() == [c, a + BLOCK, a]
    assert b.drain_faults() == []


def test_engine_constants_follow_the_driver():
    assert E.PAGE == 64 << 10 and E.BLOCK == 2 << 20 and E.PAGES_PER_BLOCK == 32
    assert PROFILE.fault_batch_size == 256 and PROFILE.prefetch_threshold == 51


def test_faults_share_the_link_with_pending_prefetches_instead_of_queueing():
    b = gpu(64)
    big, small = host_block(b, 32 * BLOCK), host_block(b)
    b.prefetch([(big, 32 * BLOCK)], 0)
    read(b, small, BLOCK)  # faults while 64 MB of prefetch is still on the link
    assert b.breakdown["fault_stall_s"] == pytest.approx(PROFILE.fault_batch_latency_s + 2 * FAULT_COPY, rel=1e-6)
    b.synchronize()  # the link did the prefetch's work and the fault copy's, in all
    assert b.now() == pytest.approx(OVERHEAD + PROFILE.prefetch_time(32 * BLOCK) + FAULT_COPY, rel=1e-6)


def test_pages_queued_behind_a_fault_copy_arrive_later_by_its_share():
    b = gpu(64)
    big, small = host_block(b, 32 * BLOCK), host_block(b)
    b.prefetch([(big, 32 * BLOCK)], 0)
    read(b, small, BLOCK)  # a fault copy takes its share of the link while the prefetch runs ...
    read(b, big, 32 * BLOCK)  # ... so the last prefetched block lands one fault copy later
    assert b.faults == 32
    assert b.now() == pytest.approx(OVERHEAD + PROFILE.prefetch_time(32 * BLOCK) + FAULT_COPY + PROFILE.launch_floor_s,
                                    rel=1e-6)


def test_a_page_comes_back_only_after_its_copy_to_the_host_is_done():
    b = gpu(8)
    ptr = host_block(b)
    b.prefetch([(ptr, BLOCK)], 0)
    b.synchronize()
    b.prefetch([(ptr, BLOCK)], HOST)
    read(b, ptr, BLOCK)  # faults at once: its data is still on its way to the host
    assert b.faults == 32
    assert b.breakdown["fault_stall_s"] == pytest.approx(PROFILE.prefetch_time(BLOCK, "d2h") + FAULT_COPY, rel=1e-6)


def test_a_launch_waits_for_the_eviction_a_prefetch_started():
    b = gpu(1)
    old, new = host_block(b), host_block(b)
    read(b, old, BLOCK)
    t = b.now()
    b.prefetch([(new, BLOCK)], 0)  # evicts `old` on the D2H engine, then copies `new` in
    read(b, old, BLOCK)  # `old` comes back only once its copy-back is done, after `new` is evicted in turn
    assert b.h2d_bytes == 3 * BLOCK and b.d2h_bytes == 2 * BLOCK
    # old out, new in (waits for the room), new out (waits for its arrival), old in (a fault)
    assert b.now() >= t + OVERHEAD + 2 * BACK + PROFILE.prefetch_time(BLOCK) + FAULT_COPY - 1e-9


def test_pages_a_launch_loses_to_its_own_faults_fault_again():
    b = gpu(2)
    out = b.malloc(BLOCK)
    b.launch([], [(out, BLOCK)], 0, 0)  # `out` is the least recently migrated block ...
    other, inp = host_block(b), host_block(b)
    read(b, other, BLOCK)
    b.launch([(inp, BLOCK)], [(out, BLOCK)], 0, 0)  # ... so servicing `inp` evicts it, though this launch writes it
    assert b.resident_fraction([(out, BLOCK)]) == 1.0 and b.resident_fraction([(inp, BLOCK)]) == 1.0
    assert b.faults == 4 * 32 and b.refaults == 32  # `out` faults again: thrashing, at its price
    assert b.d2h_bytes == 2 * BLOCK  # `out` copied back, then `other`
    assert b.h2d_bytes == 3 * BLOCK  # `other`, `inp`, and `out` once more


def test_work_on_the_gpu_alone_is_not_slowed_by_copies_sharing_the_link():
    """A discard after a copy out runs on the GPU, not over the link: a second copy out that
    starts while it runs shares the link with migrations, not with the discard, so the first
    range's pages are free when its discard is done, as the discard's rate says."""
    prof = load_profile("h100-sxm5-80g")
    b = SimBackend(prof, swap_copy="engines")
    n = 256 * MB
    first, second = b.malloc(n), b.malloc(n)
    b.prefetch([(first, n), (second, n)], 0)
    b.launch([], [(first, n), (second, n)], 0, 2 * n)
    b.synchronize()
    b.swap.out([(first, n)])
    copied = float(b.engine.tf[E.T_CE_D2H])  # the first copy's end: its discard starts here
    b.swap.out([(second, n)])  # its copy starts there too, while the first discard runs
    assert float(b.engine.tf[E.T_CE_D2H]) > copied + n / prof.copy_rate("d2h") * 0.99
    lo, hi = b.space.page_spans([(first, n)], inward=False)
    assert b.engine.ready_time(lo, hi) == pytest.approx(copied + n / prof.discard_rate, rel=1e-9)
