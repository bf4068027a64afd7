"""Prediction tables: correlation, data, variants, stable object keys."""
from __future__ import annotations

import pytest

from umrt.predict import CorrelationTable, DataTable, ObjectKeys, VariantTable, carried_key


def feed(table: CorrelationTable, ids):
    for i in ids:
        table.observe(i)


def test_correlation_keeps_every_successor_with_counts():
    t = CorrelationTable(order=3)
    for _ in range(3):
        t.reset_context()
        feed(t, [7, 9, 92, 75])
    t.reset_context()
    feed(t, [7, 9, 92, 11])
    succ = dict(t.successors((7, 9, 92)))
    assert set(succ) == {75, 11}
    assert succ[75] == pytest.approx(0.75) and succ[11] == pytest.approx(0.25)
    assert t.predict((7, 9, 92))[0] == 75


def test_correlation_uses_three_ids_of_context():
    t = CorrelationTable(order=3)
    t.reset_context()
    feed(t, [1, 2, 3, 4, 9, 2, 3, 5])
    assert t.predict((1, 2, 3))[0] == 4
    assert t.predict((9, 2, 3))[0] == 5  # same last two ids, different third: different row
    assert t.predict((8, 8, 8)) is None


def test_walk_predicts_a_sequence_and_stops_where_blind():
    t = CorrelationTable()
    seq = [10, 11, 12, 13, 14, 15]
    for _ in range(2):
        t.reset_context()
        feed(t, seq)
    t.reset_context()
    walked = [eid for eid, _ in t.walk(20)]
    assert walked == seq  # nothing was ever seen after 15 in that context
    assert all(conf == pytest.approx(1.0) for _, conf in t.walk(6))


def test_accuracy_counts_top_predictions():
    t = CorrelationTable()
    for _ in range(4):
        t.reset_context()
        feed(t, [1, 2, 3, 4])
    assert 0.7 < t.accuracy <= 1.0


def test_correlation_is_bounded():
    t = CorrelationTable(max_rows=64)
    t.reset_context()
    feed(t, range(10_000))
    assert len(t) <= 64
    # recent rows survive eviction
    assert t.predict((9996, 9997, 9998))[0] == 9999


def test_data_table_confidence_first_last_and_caps():
    d = DataTable(max_rows=8, max_objects=3)
    d.observe(5, [1, 2, 3])
    d.observe(5, [1, 2, 4])
    row = d.row(5)
    assert row.runs == 2 and row.first == 1 and row.last == 4
    assert row.confidence(1) == 1.0 and row.confidence(3) == 0.5
    assert sorted(d.predict(5, 0.9)) == [1, 2]
    assert len(row.objects) <= 3
    for eid in range(100):
        d.observe(eid + 10, [eid])
    assert len(d) <= 8
    assert d.predict(12345) == []


def test_object_keys_are_stable_across_iterations():
    keys = ObjectKeys()
    # set-up: two parameters
    keys.alloc(100)
    keys.alloc(101)
    keys.boundary(signature=0)
    seen = []
    next_obj = 200
    for _ in range(3):
        # an iteration: two activations (fresh ids each time), one survives (the loss)
        a = keys.alloc(next_obj)
        b = keys.alloc(next_obj + 1)
        keys.free(next_obj)
        seen.append((a, b, keys.key(100), keys.key(101)))
        keys.boundary(signature=42)
        seen[-1] += (keys.key(next_obj + 1),)
        keys.free(next_obj + 1)  # freed during the next iteration in real loops
        next_obj += 2
    assert len(set(seen)) == 1  # same roles, same keys, every iteration
    a, b, k100, k101, carried = seen[0]
    assert (a, b) == (0, 1) and carried == carried_key(42, 1)
    assert keys.obj_of[k100] == 100 and k100 < 0


def test_carried_key_clash_falls_back_to_object_identity():
    keys = ObjectKeys()
    keys.alloc(1)
    keys.boundary(7)
    keys.alloc(2)  # same ordinal, same signature, previous one still alive
    keys.boundary(7)
    assert keys.key(1) != keys.key(2)
    assert {keys.obj_of[keys.key(1)], keys.obj_of[keys.key(2)]} == {1, 2}


def test_variant_table_predicts_the_following_shape():
    v = VariantTable()
    assert v.predict() == []
    v.observe(1)
    assert v.predict() == [1]  # no history: training loops repeat
    for s in [1, 1, 2, 1, 1, 2, 1]:
        v.observe(s)
    # after a 1 came 1 (x3) and 2 (x2): most likely first
    assert v.predict() == [1, 2]
    v.observe(2)
    assert v.predict()[0] == 1


def test_a_stray_shape_does_not_outweigh_the_shape_that_repeats():
    """A shape seen once (a free another thread made late shifts one iteration's
    signature; one odd batch) is expected back only after the shapes that recur."""
    v = VariantTable()
    for s in [1, 2, 1, 1]:  # 2: a stray between steps of shape 1
        v.observe(s)
    assert v.predict() == [1, 2]  # after a 1 came a 1 and the stray, once each: loops repeat
    v.observe(3)  # another stray, with no successors yet: what recurs after 1, then the stray itself
    assert v.predict() == [1, 3, 2]
    w = VariantTable()
    for s in [9, 1, 2, 1]:  # two shapes in turn: the only successor seen is predicted
        w.observe(s)
    assert w.predict()[0] == 2


def test_the_last_two_shapes_tell_apart_the_places_of_a_shape_in_a_cycle():
    """An evaluation's batches: shape 2 is followed by 3 in one place of the cycle, by 2
    in another; the pass after the first is predicted batch by batch."""
    v = VariantTable()
    for s in [0, 0, 1, 2, 3, 2, 2, 4, 0, 0, 1, 2]:
        v.observe(s)
    assert v.predict()[0] == 3  # after (1, 2)
    for s in (3, 2):
        v.observe(s)
    assert v.predict()[0] == 2  # after (3, 2)
