"""RangeSet against a model: the set of bytes it holds."""
from hypothesis import given, settings
from hypothesis import strategies as st

from umrt.backends.ranges import RangeSet

ops = st.lists(st.tuples(st.sampled_from(["add", "take"]), st.integers(0, 60), st.integers(0, 20)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_rangeset_holds_exactly_the_bytes_added_and_not_taken(seq):
    rs = RangeSet()
    model: set[int] = set()
    for op, ptr, n in seq:
        if op == "add":
            rs.add(ptr, n)
            model |= set(range(ptr, ptr + n))
        else:
            taken = rs.take(ptr, n)
            want = model & set(range(ptr, ptr + n))
            got = {b for p, k in taken for b in range(p, p + k)}
            assert got == want
            assert sum(k for _, k in taken) == len(want)  # taken pieces are disjoint
            model -= want
        held = _held(rs)
        assert held == model
        pieces = list(rs)
        # sorted, disjoint and merged (no two intervals touch)
        assert all(p1 + n1 < p2 for (p1, n1), (p2, _) in zip(pieces, pieces[1:], strict=False))
        assert rs.nbytes() == len(model)
        assert bool(rs) == bool(model)


def _built(seq) -> RangeSet:
    rs = RangeSet()
    for op, p, k in seq:
        (rs.add if op == "add" else rs.take)(p, k)
    return rs


def _held(rs: RangeSet) -> set[int]:
    return {b for p, k in rs for b in range(p, p + k)}


def test_take_clips_to_the_asked_range():
    rs = RangeSet()
    rs.add(100, 100)
    assert rs.take(150, 100) == [(150, 50)]
    assert list(rs) == [(100, 50)]
    assert rs.take(0, 10) == []


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 80), st.integers(1, 20))
def test_overlaps_agrees_with_take(seq, ptr, n):
    rs = _built(seq)
    assert rs.overlaps(ptr, n) == bool(rs.take(ptr, n))
    assert rs.ends == [p + k for p, k in rs]


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 80), st.integers(1, 20))
def test_covers_and_first_gap_agree_with_the_bytes_held(seq, ptr, n):
    rs = _built(seq)
    held = _held(rs)
    assert rs.covers(ptr, n) == all(b in held for b in range(ptr, ptr + n))
    assert rs.first_gap(ptr, n) == next((b for b in range(ptr, ptr + n) if b not in held), ptr + n)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 80), st.integers(0, 20))
def test_gaps_are_exactly_the_bytes_not_held(seq, ptr, n):
    rs = _built(seq)
    held = _held(rs)
    gaps = rs.gaps(ptr, n)
    assert {b for p, k in gaps for b in range(p, p + k)} == {b for b in range(ptr, ptr + n) if b not in held}
    assert all(k > 0 for _, k in gaps)
    assert all(p1 + n1 < p2 for (p1, n1), (p2, _) in zip(gaps, gaps[1:], strict=False))  # sorted, merged
