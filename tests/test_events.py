from umrt.trace.events import IterationBoundary, Launch, Trace, TraceHeader, execution_id


def test_execution_id_is_stable_and_discriminating():
    a = execution_id("aten::mm.default", [(2, 3), (3, 4)], ["float32", "float32"], "h.0.attn")
    assert a == execution_id("aten::mm.default", [(2, 3), (3, 4)], ["float32", "float32"], "h.0.attn")
    assert a != execution_id("aten::mm.default", [(2, 3), (3, 5)], ["float32", "float32"], "h.0.attn")
    assert a != execution_id("aten::mm.default", [(2, 3), (3, 4)], ["float32", "float32"], "h.1.attn")
    assert 0 <= a < 2**63
    # Pinned value: a change here breaks every saved trace's execution ids.
    assert execution_id("aten::add.Tensor", [(4,)], ["float32"], "") == execution_id(
        "aten::add.Tensor", [[4]], ["float32"], ""
    )


def test_iteration_spans():
    h = TraceHeader(1, "0", "m", "t", "meta", 2)
    ev = [IterationBoundary(0), Launch(0, 1, "op", (), 0, 0), IterationBoundary(1), IterationBoundary(2)]
    assert Trace(h, ev).iteration_spans() == [(0, 2), (2, 3)]
