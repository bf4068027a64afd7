from umrt.trace.events import IterationBoundary, Launch, Trace, TraceHeader, execution_id, updates_in_place


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


UPDATES = ["aten::mul_.Tensor", "aten::add_.Scalar", "aten::lerp_.Scalar", "aten::addcdiv_.default", "aten::relu_.default",
           "aten::_foreach_mul_.Scalar", "aten::_foreach_lerp_.Scalar", "aten::_foreach_addcmul_.Scalar",
           "aten::_foreach_sqrt_.default", "aten::_foreach_maximum_.List", "aten::_fused_adamw_.default",
           "aten::_amp_foreach_non_finite_check_and_unscale_.default"]
OVERWRITES = ["aten::copy_.default", "aten::fill_.Scalar", "aten::zero_.default", "aten::_foreach_zero_.default",
              "aten::_foreach_copy_.default", "aten::index_put_.default", "aten::addmm_.default",
              "aten::uniform_.default", "aten::mul.Tensor", "aten::mm.default"]


def test_an_in_place_update_reads_what_it_writes_and_an_overwrite_does_not():
    import torch

    for name in UPDATES + OVERWRITES:
        base, _, overload = name.removeprefix("aten::").partition(".")
        schema = getattr(getattr(torch.ops.aten, base), overload)._schema  # a real op, as recorded
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if name in UPDATES:
            assert updates_in_place(name), name
            assert written and written[0] == schema.arguments[0].name, name  # it updates its first operand
        else:
            assert not updates_in_place(name), name
    assert Launch(0, 1, "aten::mul_.Tensor", (), 0, 0).updates_in_place
