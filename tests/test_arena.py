"""The pool's best-fit sub-allocator (:class:`umrt.memory.arena.Arena`): a planned
region's space, as the pool uses it."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from umrt.backends.ranges import RangeSet
from umrt.memory.arena import GPU_FIT_SCAN, Arena
from umrt.memory.pool import ALIGN, BLOCK

MiB = 1 << 20


def _space() -> Arena:
    """A region's space: it serves one adopted segment and never obtains another."""
    def no_malloc(nbytes: int) -> int:
        raise AssertionError(f"a region's space obtained {nbytes} bytes")

    return Arena(no_malloc, lambda ptr: None, "region", alignment=ALIGN, block=BLOCK)


def test_a_regions_space_hands_out_planned_places_and_best_fits():
    """The region's free list: a planned place is taken only where all of it is free, a miss
    gets the smallest free block that holds it, and freed blocks coalesce."""
    space = _space()
    space.adopt(0, 6 * MiB, [])
    assert space.take(MiB, MiB) and not space.take(MiB + 512, 512)  # taken: in use
    assert space.take(4 * MiB, 2 * MiB) and not space.take(3 * MiB, 2 * MiB)  # partly in use
    assert space.fit(3 * MiB) is None  # the largest free block is 2 MiB: nothing is obtained
    assert space.fit(MiB) == 0  # the smallest block that holds it (not [2, 4) MiB)
    space.free(MiB)
    space.free(0)
    assert space.fit(2 * MiB) == 0  # the freed neighbours coalesced, and 0 comes first
    assert sorted(space.free_blocks()) == [(2 * MiB, 2 * MiB)]


def test_a_fit_on_the_gpu_takes_the_smallest_free_block_with_room_on_the_gpu():
    """Free memory the caller took off the GPU would be populated again before its first
    kernel: a fit on the GPU skips it while another free block has room on the GPU, and
    takes what best fit takes where none has."""
    space = _space()
    space.adopt(0, 8 * MiB, [(MiB, MiB), (3 * MiB + MiB // 2, MiB // 2)])  # free: [0,1) [2,3.5) [4,8)
    off = RangeSet()
    off.add(0, MiB)  # the smallest block that holds 1 MiB, discarded
    off.add(2 * MiB, MiB // 2)
    assert space.fit_on_gpu(MiB, off.gaps) == 2 * MiB + MiB // 2  # the room on the GPU in [2, 3.5)
    assert space.fit_on_gpu(2 * MiB, off.gaps) == 4 * MiB
    off.add(0, 8 * MiB)
    assert space.fit_on_gpu(MiB, off.gaps) is None
    assert space.fit(MiB) == 0  # best fit, the caller's fallback


def test_a_fit_on_the_gpu_takes_the_smallest_part_on_the_gpu_not_the_first():
    """A small object (an evaluation's next batch) goes into a fragment on the GPU, not at the start
    of a large part a later large object needs whole: the smallest part that holds it."""
    space = _space()
    space.adopt(0, 8 * MiB, [(6 * MiB, MiB)])  # free: [0,6) [7,8)
    off = RangeSet()
    off.add(3 * MiB, 3 * MiB // 2)  # on the GPU: [0,3) [4.5,6) [7,8)
    off.add(7 * MiB, MiB)
    assert space.fit_on_gpu(MiB, off.gaps) == 4 * MiB + MiB // 2  # [4.5,6), not [0,3)
    assert space.fit_on_gpu(3 * MiB, off.gaps) == 0  # what [0,3) was kept whole for
    assert space.fit_on_gpu(MiB // 2, off.gaps) == 5 * MiB + MiB // 2  # the half MiB left of [4.5,6)


_KiB64 = 64 << 10
_pieces = st.lists(st.tuples(st.integers(1, 24), st.booleans()), min_size=1, max_size=12)  # (64 KiB units, used)


@settings(max_examples=150, deadline=None)
@given(_pieces, st.lists(st.tuples(st.integers(0, 200), st.integers(1, 24)), max_size=6), st.integers(1, 40))
def test_a_fit_on_the_gpu_is_the_smallest_free_block_with_room_there_and_its_smallest_part(pieces, off, units):
    """Against a model of the rule over random free lists and random memory off the GPU: the
    place is aligned, free, all on the GPU, in the smallest free block (of those that hold it)
    with such room, and in the smallest part on the GPU there that holds it; None where none has."""
    space, cursor, used = _space(), 0, []
    for n, in_use in pieces:
        if in_use:
            used.append((cursor, n * _KiB64))
        cursor += n * _KiB64
    space.adopt(0, cursor, used)
    gone = RangeSet()
    for start, n in off:
        gone.add(start * _KiB64 // 2, n * _KiB64)
    size = units * _KiB64 // 3 // ALIGN * ALIGN or ALIGN
    fitting = []  # (block bytes, block start, [(part bytes, where size goes in it)])
    for ptr, n in sorted(space.free_blocks(), key=lambda b: (b[1], b[0])):
        if n < size:
            continue
        parts = [(m, -(-p // ALIGN) * ALIGN) for p, m in gone.gaps(ptr, n) if -(-p // ALIGN) * ALIGN + size <= p + m]
        fitting.append((n, ptr, parts))
    scanned = [f for f in fitting[:GPU_FIT_SCAN] if f[2]]
    got = space.fit_on_gpu(size, gone.gaps)
    if not scanned:
        assert got is None
        return
    assert got == min(scanned[0][2])[1]
    assert got % ALIGN == 0 and not gone.overlaps(got, size)
    assert got in space.used and space.used[got] == size


def test_a_first_fit_takes_the_lowest_free_range_never_across_an_edge():
    space = _space()
    space.adopt(0, 8 * MiB, [(MiB, MiB), (3 * MiB + MiB // 2, MiB // 2)])  # free: [0,1) [2,3.5) [4,8)
    assert space.first_fit(MiB) == 0
    assert space.first_fit(MiB, edges=(2 * MiB + MiB // 2,)) == 2 * MiB + MiB // 2  # [2,3) would cross it
    assert space.first_fit(2 * MiB) == 4 * MiB  # (best fit: the same; [2,2.5) is too small)
    assert space.first_fit(4 * MiB) is None
