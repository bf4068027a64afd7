"""Real training loops, closed loop on the CPU (issue 24, point 4).

Each example loop in ``examples/`` (a GPT script that evaluates every few
iterations and saves a checkpoint; a Hugging Face-style fine-tuning loop with
gradient accumulation, length-bucketed batches, a warm-up schedule, a short
last batch and early stopping; a Lightning-style fit loop with validation
every few steps, checkpoints and early stopping) runs once, small, on the CPU
under umrt's recorder as shadow mode runs it; umrt's runtime then drives the
simulated GPU closed loop (launches only while it wants them), as in shadow
mode. The figures and targets are ``python -m bench.loops``'s; here, what the
runtime does: each phase learned apart and its plans kept apart (the many
shapes of length-bucketed steps never push out the evaluation's), a known
shape not learned again unless it left its plan (after an evaluation,
training resumes its plan), and the report's rows.
"""
from __future__ import annotations

import pytest

from bench import loops
from bench.loops import LOOPS, drive, record, render, resumed_after_evaluation
from umrt.hardware import load_profile
from umrt.memory.caching import CachingAllocatorLayout
from umrt.memory.pool import LifetimePool
from umrt.phase_report import RunFigures
from umrt.shadow import _print, _report
from umrt.sim.budget import resolve_budget


def test_a_step_after_an_evaluation_is_compared_with_the_last_step_of_its_shape():
    """A short last batch before an evaluation (half the compute, and it moves less than its
    share: a fifth of the full step's time) is not held against the full step after it: that
    one is compared with the last full step; a step of a shape not seen before the evaluation,
    each over its compute."""
    phases = ["train", "train", "eval", "train", "train", "eval", "train", "eval", "train"]
    times = [10.0, 2.0, 1.0, 11.0, 10.0, 1.0, 10.0, 1.0, 6.0]
    compute = [4.0, 2.0, 0.5, 4.0, 4.0, 0.5, 4.0, 0.5, 3.0]
    marks = [{"time_s": sum(times[:i]), "compute_s": sum(compute[:i]), "h2d_bytes": 0, "d2h_bytes": 0,
              "faults": 0, "evictions": 0} for i in range(len(times) + 1)]
    run = RunFigures.of("umrt", "live", marks, phases, 0)
    assert [(i, round(r, 3)) for i, r in resumed_after_evaluation(run)] == [(3, 1.1), (6, 1.0), (8, 0.8)]
    shapes, run.compute = compute, [c + 0.01 * i for i, c in enumerate(compute)]  # copies beside the kernels
    assert [(i, round(r, 3)) for i, r in resumed_after_evaluation(run, shapes)] == [(3, 1.1), (6, 1.0), (8, 0.8)]
    run.compute = []  # (no compute known: every step one shape, time for time)
    assert [(i, round(r, 3)) for i, r in resumed_after_evaluation(run)] == [(3, 5.5), (6, 1.0), (8, 0.6)]


def test_the_table_names_the_gpu_and_the_memory_it_was_simulated_at():
    times, phases = [10.0, 1.0], ["train", "eval"]
    marks = [{"time_s": sum(times[:i]), "compute_s": 0.0, "h2d_bytes": 0, "d2h_bytes": 0, "faults": 0,
              "evictions": 0} for i in range(3)]
    results = {"gpt-eval": {"runs": [RunFigures.of(p, "replay", marks, phases, 0) for p in ("um", "umrt")]}}
    title = " ".join(render(results, "bench", "a100-sxm4-80g", "25%").split())
    assert "a100-sxm4-80g, 25% of the footprint" in title
    assert "8 GiB of GPU memory" in " ".join(render(results, "ci", "h100-pcie5-80g", "8 GiB").split())


def test_a_layout_is_one_of_the_two_and_caching_is_umrts_option():
    with pytest.raises(ValueError, match="one of pool, caching"):
        drive(None, layout="buddy")
    with pytest.raises(ValueError, match="umrt's option"):
        drive(None, policy="um", layout="caching")


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

_traces: dict = {}
# Each loop's GPU memory here, in MiB: the tests below were made at 30% of a footprint taken with a
# pool that planned (3.6 / 5.4 / 3.6 MiB at this size); of the footprint a run with that memory
# has (its pool lays out no plan: 6 / 6 / 4 MiB), that memory is 60 / 90 / 90%.
_MEMORY = {"gpt-eval": "60%", "hf-style": "90%", "lightning-style": "90%"}


def _trace(name: str):
    if name not in _traces:
        _traces[name] = record(next(loop for loop in LOOPS if loop.name == name), "ci")
    return _traces[name]


def test_memory_too_small_to_simulate_is_named_not_a_traceback(monkeypatch, capsys):
    """At 34% of its small footprint (6 MiB: 2 MiB) lightning-style's ci size cannot hold one fault batch."""
    monkeypatch.setattr(loops, "record", lambda loop, size: _trace(loop.name))
    assert loops.main(["--loops", "lightning-style", "--size", "ci", "--gpu-memory", "34%"]) == 2
    err = capsys.readouterr().err
    assert "lightning-style: not simulated at 34%: GPU memory budget" in err and "one fault batch" in err


@pytest.mark.parametrize("name", [loop.name for loop in LOOPS])
def test_each_loop_is_learned_phase_by_phase_and_no_shape_twice(name):
    recording = _trace(name)
    phases = recording.trace.iteration_phases()
    assert "train" in phases and "eval" in phases
    rt = drive(recording, gpu_memory=_MEMORY[name]).driver.policy
    log = rt.log
    assert [e["phase"] for e in log] == phases  # the runtime saw the recorder's phases
    rep = rt.report()
    assert set(rep["phases"]) == {"train", "eval"} and all(p["plans"] >= 1 for p in rep["phases"].values())
    # Training after an evaluation resumes a plan at once: it is learned only where its shape
    # is new or it left the plan it was given (a first step of an epoch, in shadow mode a
    # shape of its own: the CPU-side ops a GPU run would not record, a sampler's randperm).
    seen: set[int] = set()
    for prev, e in zip(log, log[1:], strict=False):
        if "signature" in prev:
            seen.add(prev["signature"])
        if prev["phase"] == "eval" and e["phase"] == "train" and e["mode"] == "learn":
            assert e.get("deviated") or e["signature"] not in seen, [(x["iteration"], x["phase"], x["mode"]) for x in log]
    # Learning and deviating stay bounded by the shapes the loop has: a known shape learned
    # again only where it deviated first.
    learned = [e["signature"] for e in log if e["mode"] == "learn" and not e.get("deviated")]
    assert len(learned) == len(set(learned)), [(e["iteration"], e["phase"], e["mode"]) for e in log]


def test_the_report_compares_every_policy_over_the_same_iterations_by_phase():
    recording = _trace("gpt-eval")
    trace = recording.trace
    budget = resolve_budget(_MEMORY["gpt-eval"], trace)
    rep = _report(trace, recording.events, budget, load_profile("h100-pcie5-80g"), "umrt", 8, None)
    n = len(trace.iteration_spans())
    assert [r["policy"] for r in rep["rows"]] == ["ideal", "um", "oracle", "umrt"]
    assert all(r["iterations"] == n for r in rep["rows"])
    for run in rep["runs"]:
        assert run["phases"] == trace.iteration_phases()
        assert set(run["by_phase"]) == {"train", "eval"}
        assert run["time_s"] == pytest.approx(sum(run["iteration_times_s"]))
    named = rep["named_iterations"]
    assert named["learned"] and all(phase in ("train", "eval") for _, phase in named["learned"])
    lines: list[str] = []
    _print(rep, lines.append)
    text = " ".join("\n".join(lines).split())
    assert "training step (steady)" in text and "evaluation batch (steady)" in text
    assert "whole run (total)" in text and "over the whole run" in text
    assert "Training steps (steady): umrt" in text and "Evaluation batches (steady): umrt" in text
    assert f"Iterations: {len(named['learned'])} learned" in text


def test_umrt_runs_a_loop_over_either_layout():
    """``--layout caching``: the same closed loop with PyTorch's caching allocator placing the
    tensors, so the pool's layout can be weighed loop for loop."""
    recording = _trace("gpt-eval")
    pooled, cached = (drive(recording, gpu_memory=_MEMORY["gpt-eval"], layout=lay).driver.policy for lay in ("pool", "caching"))
    assert isinstance(pooled.layout, LifetimePool) and pooled.options.use_pool
    assert isinstance(cached.layout, CachingAllocatorLayout) and not cached.options.use_pool
    assert [e["phase"] for e in cached.log] == recording.trace.iteration_phases()


def test_recording_a_loop_leaves_no_checkpoints_behind(tmp_path, monkeypatch):
    """The example loops save checkpoints to folders they make in the temporary directory;
    recording one removes them (each bench or test run left some behind: 3 MB each)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    recording = record(next(loop for loop in LOOPS if loop.name == "gpt-eval"), "ci")
    assert recording.trace.iteration_phases().count("eval") >= 1  # it ran, evaluation and checkpoint
    assert list(tmp_path.iterdir()) == []
