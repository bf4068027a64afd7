"""CachingAllocatorLayout: PyTorch's caching-allocator rules over a fake backend."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umrt.errors import UmrtError
from umrt.memory.caching import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    CachingAllocatorLayout,
    LayoutError,
    allocation_size,
    round_size,
)
from umrt.testing.fake_backend import BumpBackend
from umrt.trace.events import Kind

MiB = 1 << 20
A = Kind.ACTIVATION


def spaced_segments() -> BumpBackend:
    """Just enough of a Backend: 2 MiB-aligned segments with a gap between them, and a free
    fails the test (the caching allocator never returns memory)."""
    return BumpBackend(gap=2 * MiB, frees=False)


@pytest.fixture
def layout():
    return CachingAllocatorLayout(spaced_segments())


def test_constants_match_pytorch():
    assert (K_MIN_BLOCK_SIZE, K_SMALL_SIZE, K_SMALL_BUFFER) == (512, 1048576, 2097152)
    assert (K_LARGE_BUFFER, K_ROUND_LARGE) == (20971520, 2097152)


@pytest.mark.parametrize(
    "nbytes,rounded", [(0, 512), (1, 512), (512, 512), (513, 1024), (1000000, 1000448)]
)
def test_round_size(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize(
    "size,segment",
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
     (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB), (33 * MiB, 34 * MiB)],
)
def test_allocation_size(size, segment):
    assert allocation_size(size) == segment


def test_small_requests_share_a_2mib_segment(layout):
    a = layout.alloc(0, 100, A)
    b = layout.alloc(1, 1000, A)
    assert layout.footprint() == 2 * MiB
    assert b == a + 512  # split, 512-B rounded
    assert layout.block_size(1) == 1024


def test_small_and_large_pools_are_separate(layout):
    layout.alloc(0, 100, A)
    layout.alloc(1, 2 * MiB, A)  # large: 20 MiB segment, not the small one's remainder
    assert layout.backend.mallocs == [(layout.backend.mallocs[0][0], 2 * MiB),
                                      (layout.backend.mallocs[1][0], 20 * MiB)]
    assert layout.footprint() == 22 * MiB


def test_large_block_split_only_above_1mib_remainder(layout):
    layout.alloc(0, 10 * MiB + 512, A)  # segment rounded to 12 MiB, remainder < 2 MiB but > 1 MiB
    assert layout.footprint() == 12 * MiB
    assert layout.block_size(0) == 10 * MiB + 512
    layout.free(0)
    layout.alloc(1, 11 * MiB + 512, A)  # reuses the 12 MiB block; remainder < 1 MiB: not split
    assert layout.block_size(1) == 12 * MiB
    assert layout.footprint() == 12 * MiB


def test_best_fit_picks_smallest_adequate_block(layout):
    ptrs = [layout.alloc(i, 3 * MiB, A) for i in range(6)]  # six 3 MiB blocks in one 20 MiB segment
    assert layout.footprint() == 20 * MiB
    layout.free(1)  # a 3 MiB hole
    layout.free(3)
    layout.free(4)  # a 6 MiB hole
    # 2.5 MiB fits the 3 MiB hole best (the tail holds 2 MiB, too small).
    assert layout.alloc(10, 5 * MiB // 2, A) == ptrs[1]
    assert layout.alloc(11, 6 * MiB, A) == ptrs[3]


def test_free_coalesces_neighbours(layout):
    for i in range(3):
        layout.alloc(i, 4 * MiB, A)
    layout.free(0)
    layout.free(2)
    layout.free(1)  # merges with both sides and the tail: one 20 MiB free block
    assert layout.alloc(9, 19 * MiB, A) == layout.backend.mallocs[0][0]
    assert layout.footprint() == 20 * MiB


def test_freed_blocks_are_cached_not_returned(layout):
    p = layout.alloc(0, 50 * MiB, A)
    layout.free(0)
    assert layout.footprint() == 50 * MiB
    assert layout.alloc(1, 50 * MiB, A) == p
    assert len(layout.backend.mallocs) == 1


def test_bad_calls_raise_clear_errors(layout):
    layout.alloc(0, 10, A)
    with pytest.raises(LayoutError, match="already live"):
        layout.alloc(0, 10, A)
    with pytest.raises(UmrtError, match="not live"):
        layout.free(5)
    with pytest.raises(LayoutError):
        layout.address(5)


ops = st.lists(
    st.tuples(st.booleans(), st.integers(0, 3 * K_LARGE_BUFFER), st.integers(0, 10**6)),
    min_size=1, max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_live_objects_never_overlap_and_stay_in_segments(script):
    layout = CachingAllocatorLayout(spaced_segments())
    live: dict[int, int] = {}
    next_obj = 0
    for is_alloc, nbytes, pick in script:
        if is_alloc or not live:
            layout.alloc(next_obj, nbytes, A)
            live[next_obj] = nbytes
            next_obj += 1
        else:
            victim = sorted(live)[pick % len(live)]
            layout.free(victim)
            del live[victim]
        spans = sorted((layout.address(o), layout.address(o) + round_size(n)) for o, n in live.items())
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start
        segs = layout.segments()
        for lo, hi in spans:
            assert any(p <= lo and hi <= p + n for p, n in segs)
        assert layout.footprint() == sum(n for _, n in segs)
        assert layout.live_bytes == sum(live.values())


@pytest.mark.gpu
def test_matches_pytorch_caching_allocator_on_a_gpu():
    """Same requests through the real CUDACachingAllocator: same reserved bytes, same offsets."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    import os

    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        pytest.skip("expandable segments are not modelled")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    model = CachingAllocatorLayout(spaced_segments())
    sizes = [100, 3000, 700_000, 2 * MiB + 5, 5 * MiB, 12 * MiB + 1, 512, 1 * MiB, 9 * MiB]
    live = {}
    script = [("a", i, n) for i, n in enumerate(sizes)] + [("f", 1, 0), ("f", 3, 0), ("a", 20, 2000),
                                                           ("a", 21, 2 * MiB), ("f", 4, 0), ("a", 22, 4 * MiB)]
    for op, obj, n in script:
        if op == "a":
            live[obj] = torch.empty(n, dtype=torch.uint8, device="cuda")
            model.alloc(obj, n, A)
        else:
            del live[obj]
            model.free(obj)
    assert torch.cuda.memory_reserved() - base == model.footprint()
    segments = {s["address"]: s["total_size"] for s in torch.cuda.memory_snapshot()}
    my_segments = model.segments()
    for obj, t in live.items():
        ptr = t.data_ptr()
        real_base = max(a for a in segments if a <= ptr)
        my_ptr = model.address(obj)
        my_base = max(p for p, _ in my_segments if p <= my_ptr)
        assert ptr - real_base == my_ptr - my_base, obj
        assert segments[real_base] == dict(my_segments)[my_base]
