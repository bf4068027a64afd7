"""bench.overhead: the Python path and the native path side by side (issue 13, item 5).

Figures are not timed here: only that they exist, are positive, and that the native
schedule served the addresses the Python path gave."""
from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from bench import overhead
from bench.overhead import record_steady, schedule_ops, targets
from umrt.hardware import load_profile
from umrt.native.binding import native_library
from umrt.native.constants import DecisionKind
from umrt.native.recorder import AllocAt, CallAt, FreeAt
from umrt.sim.budget import resolve_budget
from umrt.testing.synthetic import training_trace

PROFILE = "h100-pcie5-80g"


@pytest.fixture(scope="module")
def trace():
    return training_trace(layers=6, steps=3)


@pytest.fixture(scope="module")
def report(trace):
    return overhead.run(["tiny"], budget="30%", iterations=6, repeats=2, native_iterations=2,
                        trace_fn=lambda model, batch, seq, dtype: trace, pairs=False)


def test_schedule_ops_index_frees_by_the_operation_that_allocated_them():
    rec = [AllocAt(64, 0x1000), CallAt(DecisionKind.PREFETCH, ((0x1000, 64),)), AllocAt(32, 0x2000),
           FreeAt(0x1000), FreeAt(0x3000),  # 0x3000: allocated last iteration (op 5 below)
           FreeAt(0x9000),  # never allocated by the iteration: left to Python
           AllocAt(16, 0x3000)]
    op, arg, outside = schedule_ops(rec)
    assert op == [0, 0, 1, 1, 0]
    assert arg == [64, 32, 0, 4, 16]
    assert outside == 1


def test_the_recorded_steady_iteration_repeats_and_counts_its_events(trace):
    budget = resolve_budget("30%", trace).bytes
    rec = record_steady(trace, load_profile(PROFILE), budget, 6, op_level=False)
    assert rec.repeats
    c = rec.counts
    assert c["allocations"] == len(rec.arrays.sizes) > 0 and c["frees"] > 0
    assert c["boundaries"] == 1 and c["layer_events"] > 0 and c["launches"] >= c["launches_fed"] >= 0
    assert c["backend_calls"] == sum(isinstance(e, CallAt) for e in rec.recorded) > 0


def test_side_by_side_figures_exist_and_the_addresses_match(report):
    (m,) = report["models"].values()
    py = m["python"]
    assert py["cpu_s"] > 0 and py["driver_cpu_s"] > 0 and py["share"] > 0
    c = m["counts"]
    assert py["python_callbacks"] == (c["allocations"] + c["frees"] + c["layer_events"] + c["launches_fed"]
                                      + c["boundaries"])
    assert m["reference_step"] == "simulated ideal" and m["reference_step_s"] > 0
    nat = m["native"]
    assert nat["schedule_repeats"]
    if native_library() is None:
        pytest.skip("the native schedule did not build here (the Python path's figures are checked above)")
    assert nat["built"] and nat["addresses_match"]
    assert nat["cpu_s"] > 0 and nat["c_loop_s"] > 0 and nat["step_hook_s"] > 0 and nat["share"] > 0
    assert nat["events_drained"] == c["allocations"] + c["frees"] + 1  # one iteration and its boundary
    assert nat["decision_calls"] >= m["decisions"] > 0
    assert nat["optimizer_hook_callbacks"] == 3 and nat["optimizer_hooks_s"] >= 0
    assert nat["python_callbacks"] == 3 + (nat["decision_calls"] if nat["decisions_cross_python"] else 0)


def test_json_report_and_printed_tables(report):
    json.dumps(report)  # JSON-ready as --json writes it
    assert set(report) >= {"profile", "budget", "real_gpt2_step_s", "pair", "models", "targets"}
    buf = io.StringIO()
    overhead.print_report(report, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "python path" in out and "native path" in out and "Python callbacks per step" in out


def test_targets_say_pass_or_miss_and_never_invent_a_figure():
    gpt2 = {"native": {"cpu_s": 0.002}}
    (pair, step) = targets({"native_built": True, "native_c_loop_pair_ns": (80.0, 70.0)}, {"gpt2": gpt2})
    assert pair["pass"] is True and pair["value"] == 80.0 and pair["unit"] == "ns"
    assert step["pass"] is False and step["target"] == pytest.approx(0.00185) and step["unit"] == "s"
    (pair, step) = targets({"native_built": False}, {"gpt2": {"native": {"built": False}}})
    assert pair["pass"] is None and step["pass"] is None


def test_an_unknown_model_is_a_clean_error(capsys):
    assert overhead.main(["--models", "no-such-model", "--no-pairs"]) == 2
    assert "bench.overhead: error:" in capsys.readouterr().err


def test_the_counting_table_says_whether_its_calls_cross_into_python(trace):
    if native_library() is None:
        pytest.skip("the native schedule did not build here")
    from umrt.native.binding import load_steady

    budget = resolve_budget("30%", trace).bytes
    rec = record_steady(trace, load_profile(PROFILE), budget, 6, op_level=False)
    for native in (True, False):
        sched = load_steady(rec.arrays)
        calls, crosses = overhead.use_counting_table(sched, native=native)
        assert crosses is not native
        before = calls()
        sched.arm()
        op, arg, _ = schedule_ops(rec.recorded)
        blocks = [0] * len(op)
        for k, o in enumerate(op):
            if o == 0:
                blocks[k] = sched.malloc(arg[k])
            else:
                sched.free(blocks[arg[k]])
        assert sched.armed and calls() - before >= len(rec.arrays.dec_kind) > 0
