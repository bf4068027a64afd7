"""SmartPool planner: a valid, deterministic, compact placement."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umrt.memory.smartpool import Lifetime, max_live_bytes, plan, quietest_point

item = st.builds(
    lambda s, d, z: Lifetime(s, s + d, z),
    st.integers(0, 200), st.integers(1, 60), st.integers(0, 5000),
)
items = st.lists(item, max_size=60)


def _check_valid(its, placement, alignment=1):
    for i, a in enumerate(its):
        oa = placement.offsets[i]
        if oa is None:
            continue
        assert oa % alignment == 0
        assert oa + a.nbytes <= placement.footprint
        for j in range(i + 1, len(its)):
            b, ob = its[j], placement.offsets[j]
            if ob is None or a.nbytes == 0 or b.nbytes == 0:
                continue
            if a.start < b.end and b.start < a.end:  # lifetimes overlap
                assert oa + a.nbytes <= ob or ob + b.nbytes <= oa, (a, b, oa, ob)


@settings(max_examples=150, deadline=None)
@given(items, st.sampled_from([1, 256, 512]))
def test_no_address_overlap_among_lifetime_overlapping_objects(its, alignment):
    p = plan(its, alignment=alignment)
    assert all(o is not None for o in p.offsets)
    _check_valid(its, p, alignment)


@settings(max_examples=100, deadline=None)
@given(items)
def test_footprint_at_least_max_live_bytes(its):
    assert plan(its).footprint >= max_live_bytes(its)


@settings(max_examples=60, deadline=None)
@given(items)
def test_deterministic(its):
    assert plan(its) == plan(list(its)) == plan([(i.start, i.end, i.nbytes) for i in its])


@settings(max_examples=60, deadline=None)
@given(items, st.integers(0, 20000))
def test_limit_leaves_out_what_does_not_fit(its, limit):
    p = plan(its, limit=limit)
    _check_valid(its, p)
    assert p.footprint <= limit


def test_disjoint_lifetimes_share_offset_zero():
    p = plan([Lifetime(0, 5, 100), Lifetime(5, 9, 300), Lifetime(9, 12, 50)])
    assert p.offsets == (0, 0, 0)
    assert p.footprint == 300


def test_largest_first_lowest_gap():
    # 100 B lives all along; 50 B and 60 B overlap it but not each other: both go above it at 100.
    its = [Lifetime(0, 10, 100), Lifetime(0, 4, 50), Lifetime(5, 10, 60), Lifetime(3, 6, 30)]
    p = plan(its)
    assert p.offsets[:3] == (0, 100, 100)
    assert p.offsets[3] == 160  # overlaps all three
    assert p.footprint == 190 == max_live_bytes(its)


def test_fills_a_hole_between_neighbours():
    its = [Lifetime(0, 4, 200), Lifetime(5, 10, 150), Lifetime(0, 10, 60), Lifetime(6, 10, 40),
           Lifetime(4, 5, 50)]
    p = plan(its)
    # 60 B overlaps both big ones -> above them at 200; 40 B fits the [150, 200) hole;
    # 50 B lives when neither big one does -> offset 0.
    assert p.offsets == (0, 0, 200, 150, 0)
    assert p.footprint == 260


def test_per_item_alignment():
    its = [Lifetime(0, 10, 1000), Lifetime(0, 10, 10), Lifetime(0, 10, 300)]
    p = plan(its, alignments=[1, 1, 1024])
    assert p.offsets == (0, 1000, 1024)  # the 10 B one fills the alignment gap
    _check_valid(its, p)


def test_bad_alignment_raises():
    with pytest.raises(ValueError):
        plan([Lifetime(0, 1, 1)], alignment=0)
    with pytest.raises(ValueError):
        plan([Lifetime(0, 1, 1)], alignments=[1, 2])


def test_the_quietest_point_counts_objects_that_die_in_the_next_iteration():
    # A lives [1, 4); B from 6 to 2 of the next iteration (12 on a 10-long clock), so it is
    # alive at 0 and 1 too; C is alive all along and counts nowhere. Bytes alive:
    # 0 -> 100, 1 -> 110, 2 -> 10, 4 -> 0, 6 -> 100: the quietest point is 4, not 0.
    spans = [(1, 4, 10), (6, 12, 100), (3, None, 1000)]
    assert quietest_point(spans, 10) == 4
    assert quietest_point([(6, 10, 100)], 10) == 0  # (a tie goes to the earliest point)
