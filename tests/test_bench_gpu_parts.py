"""bench.gpu's parts that need no GPU: budgets, umrt's counters, NVML's PCIe counters
(a fake NVML), per-step figures, losses, issue 10's targets (fake timings and counters),
the progress lines, and the watchdog (a fake clock, and a real hanging subprocess)."""
from __future__ import annotations

import math
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from bench import gpu_measure as gm
from bench import gpu_watch as gw

# ---------------------------------------------------------------- budgets


@pytest.mark.parametrize("text, kind, value", [
    ("50%", "footprint", 0.5), ("50%footprint", "footprint", 0.5), ("50%peak", "peak", 0.5),
    ("90%device", "device", 0.9), ("7.5GiB", "bytes", 7.5 * 2**30), ("1073741824", "bytes", 2**30),
    ("footprint", "footprint", 1.0), ("footprint/2", "footprint", 0.5), ("Footprint / 4", "footprint", 0.25),
    ("footprint*0.75", "footprint", 0.75),
])
def test_budget_specs(text, kind, value):
    spec = gm.BudgetSpec.parse(text)
    assert (spec.kind, spec.value, spec.text) == (kind, pytest.approx(value), text)


def test_old_budget_spellings_say_what_they_mean_now():
    assert gm.BudgetSpec.parse("footprint/2").note == "--gpu-memory='footprint/2' is 50% of the footprint the run " \
                                                       "needs: write 50%"
    assert "write 50%peak" in gm.BudgetSpec.parse("50%").note  # a bare percentage was of the ideal peak
    assert gm.BudgetSpec.parse("50%peak").note is None and gm.BudgetSpec.parse("8GiB").note is None


@pytest.mark.parametrize("text, words", [
    ("0%", "(0, 100]"), ("footprint/0", "(0, 100]"), ("footprint*1.5", "(0, 100]"), ("footprint/0.5", "(0, 100]"),
    ("footprints", "'footprints'"), ("1MB", "2 MB block"), ("-3GB", "give a percentage"),
    ("10%budget", "of the GPU's memory"),
])
def test_bad_budget_specs(text, words):
    with pytest.raises(gm.BenchError, match=words.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        gm.BudgetSpec.parse(text)


def test_budgets_resolve_against_what_they_refer_to():
    assert gm.BudgetSpec.parse("footprint/2").resolve(None, 15_000_000_000) == 7_500_000_000
    assert gm.BudgetSpec.parse("50%").resolve(None, 15_000_000_000) == 7_500_000_000
    assert gm.BudgetSpec.parse("25%peak").resolve(8 << 30, None) == 2 << 30
    assert gm.BudgetSpec.parse("50%device").resolve(None, None, 80 << 30) == 40 << 30
    assert gm.BudgetSpec.parse("footprint/1000000").resolve(None, 1 << 30) == 2 << 20  # at least one block
    with pytest.raises(gm.BenchError, match="ideal and um runs"):
        gm.BudgetSpec.parse("footprint").resolve(8 << 30, None)
    with pytest.raises(gm.BenchError, match="ideal run's peak"):
        gm.BudgetSpec.parse("25%peak").resolve(None, 8 << 30)


def test_the_simulated_column_reads_the_budget_the_same_way():
    """The simulator's footprint is a model of what bench.gpu measures: 50% is of it in both columns."""
    assert gm.BudgetSpec.parse("50%").simulated == "50%" and gm.BudgetSpec.parse("footprint/4").simulated == "25%"
    assert gm.BudgetSpec.parse("50%peak").simulated == "50%peak"
    assert gm.BudgetSpec.parse("8GiB").simulated is None and gm.BudgetSpec.parse("50%device").simulated is None


# ---------------------------------------------------------------- umrt's counters


class SnapshotBackend:
    """A backend with the ``counters()`` snapshot (calls by CUDA call name)."""

    def __init__(self):
        self.snap = {"calls": {"cudaMemPrefetchAsync": 10, "cudaMemAdvise": 2}, "h2d_bytes": 100,
                     "d2h_bytes": 50, "discarded_bytes": 7}

    def counters(self):
        return dict(self.snap, calls=dict(self.snap["calls"]))


def test_counters_from_a_snapshot_and_their_difference():
    b = SnapshotBackend()
    before = gm.read_counters(b)
    b.snap["calls"] = {"cudaMemPrefetchAsync": 13, "cudaMemAdvise": 2, "cudaMemDiscardBatchAsync": 1}
    b.snap.update(h2d_bytes=400, discarded_bytes=9)
    step = gm.read_counters(b).minus(before)
    assert step == gm.Counters(300, 0, 2, {"cudaMemPrefetchAsync": 3, "cudaMemDiscardBatchAsync": 1})


def test_counters_from_the_cuda_backends_byte_attributes(cuda13, fake_gpu):
    """Until the backend has counters(): its bytes, and calls not counted (None)."""
    if isinstance(cuda13, gm.CountingBackend):
        pytest.skip("the backend has counters(): the snapshot path is used")
    ptr = cuda13.malloc(4 << 20)
    before = gm.read_counters(cuda13)
    cuda13.prefetch([(ptr, 4 << 20)], 0)
    step = gm.read_counters(cuda13).minus(before)
    assert step == gm.Counters(4 << 20, 0, 0, None)


def test_a_backend_that_counts_nothing_has_no_counters():
    assert gm.read_counters(object()) is None and gm.read_counters(None) is None


# ---------------------------------------------------------------- NVML's PCIe counters


class FakeNvml:
    """pynvml's field-value and throughput calls over scripted values."""

    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    def __init__(self, counters=None, value_type=1, ret=0, throughput=None):
        self.counters = list(counters or [])  # (rx, tx) raw values, one pair per read
        self.value_type, self.ret, self.throughput = value_type, ret, throughput
        self.reads = 0

    def nvmlDeviceGetFieldValues(self, handle, ids):
        assert ids == [gm.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, gm.NVML_FI_DEV_PCIE_COUNT_TX_BYTES]
        rx, tx = self.counters[min(self.reads, len(self.counters) - 1)] if self.counters else (0, 0)
        self.reads += 1
        member = gm._VALUE_TYPES.get(self.value_type, ("uiVal", 32))[0]
        return [SimpleNamespace(nvmlReturn=self.ret, valueType=self.value_type,
                                value=SimpleNamespace(**{member: v})) for v in (rx, tx)]

    def nvmlDeviceGetPcieThroughput(self, handle, which):
        if self.throughput is None:
            raise RuntimeError("Not Supported")
        return self.throughput[which]


def test_pcie_byte_counters_add_up_across_a_32_bit_wrap():
    top = 1 << 32
    nvml = FakeNvml([(top - 100, 5), (top - 100, 5), (50, 1005), (450, 2005)])
    pcie = gm.PcieCounters(nvml, "h", interval=3600)  # the background thread reads once, then waits
    pcie.start()
    try:
        time.sleep(0.05)
        assert pcie.source == "counter"
        nvml.reads = 2  # the next read sees the wrapped RX counter
        assert pcie.read() == (150, 1000)
        assert pcie.read() == (550, 2000)
    finally:
        pcie.stop()


def test_pcie_counters_fall_back_to_integrating_the_throughput_rate():
    nvml = FakeNvml(ret=3, throughput={0: 1000, 1: 2000})  # 3 = NVML_ERROR_NOT_SUPPORTED; KB/s
    pcie = gm.PcieCounters(nvml, "h", interval=0.01).start()
    try:
        time.sleep(0.2)
        h2d, d2h = pcie.read()
    finally:
        pcie.stop()
    assert pcie.source == "throughput" and any("not supported" in n for n in pcie.notes)
    assert h2d == pytest.approx(2 * d2h) and 0 < h2d <= 2000 * 1024 * 0.5  # RX is host -> GPU


def test_pcie_counters_without_any_nvml_figure_say_so():
    pcie = gm.PcieCounters(FakeNvml(ret=3), "h").start()
    assert pcie.source is None and pcie.read() is None and "no NVML PCIe figures" in pcie.notes[-1]
    pcie.stop()


# ---------------------------------------------------------------- per-step figures, losses, targets


def _step(i, timed, **kw):
    return {"step": i, "time_s": 0.1, "timed": timed, **kw}


def test_steady_per_step_means_over_the_timed_steps_only():
    steps = [_step(0, False, h2d_bytes=10**9, d2h_bytes=0, calls={"cudaMemAdvise": 500}),
             _step(1, True, h2d_bytes=100, d2h_bytes=10, discarded_bytes=0, calls={"cudaMemPrefetchAsync": 2},
                   pcie_h2d_bytes=120.0, pcie_d2h_bytes=None),
             _step(2, True, h2d_bytes=300, d2h_bytes=30, discarded_bytes=0,
                   calls={"cudaMemPrefetchAsync": 4, "cudaMemDiscardBatchAsync": 2}, pcie_h2d_bytes=80.0)]
    per = gm.steady_per_step(steps)
    assert per == {"steps": 2, "h2d_bytes": 200, "d2h_bytes": 20, "discarded_bytes": 0, "pcie_h2d_bytes": 100.0,
                   "pcie_d2h_bytes": None, "calls": 4.0,
                   "calls_by_name": {"cudaMemDiscardBatchAsync": 1.0, "cudaMemPrefetchAsync": 3.0}}
    assert gm.steady_per_step([_step(0, True)])["calls"] is None  # not counted: None, not 0


def test_losses_step_by_step():
    ref = [9.0820, 8.5, 8.1]
    assert gm.compare_losses(ref, list(ref)) == {"steps": 3, "equal": True, "exact_steps": 3, "max_abs_diff": 0.0,
                                                 "first_unequal_step": None}
    close = gm.compare_losses(ref, [9.0820 + 1e-6, 8.5, 8.1])
    assert close["equal"] and close["exact_steps"] == 2
    off = gm.compare_losses(ref, [9.0820, 8.5, 8.2])
    assert not off["equal"] and off["first_unequal_step"] == 2 and off["max_abs_diff"] == pytest.approx(0.1)
    assert gm.compare_losses(ref, [9.0820, math.nan, 8.1])["first_unequal_step"] == 1
    assert not gm.compare_losses(ref, ref[:2])["equal"]  # a mode that stopped early
    assert not gm.compare_losses([], [])["equal"]


def test_the_bound_uses_the_measured_h100_rates():
    assert gm.H2D_BYTES_PER_S == 48e9 and gm.D2H_BYTES_PER_S == 12e9
    assert gm.bound_time(0.185, 0, 0) == 0.185
    assert gm.bound_time(0.185, 24e9, 0) == pytest.approx(0.5)
    assert gm.bound_time(0.185, 24e9, 12e9) == pytest.approx(1.0)


def _row(t, h2d=0, d2h=0, pcie=None):
    return {"iteration_time_s": t, "per_step": {"h2d_bytes": h2d, "d2h_bytes": d2h,
                                                "pcie_h2d_bytes": pcie, "pcie_d2h_bytes": 0 if pcie is not None else None}}


IDEAL = _row(0.2, h2d=None, d2h=None, pcie=1 << 20)


@pytest.mark.parametrize("row, frac, want", [
    (_row(0.21, pcie=2 << 20), 1.0, [True, True]),  # nothing moved, NVML as plain, 1.05x
    (_row(0.23, pcie=2 << 20), 1.2, [True, False]),  # 1.15x
    (_row(0.21, h2d=4096, pcie=2 << 20), 1.0, [False, True]),  # umrt moved a page
    (_row(0.21, pcie=200 << 20), 1.0, [False, True]),  # faults umrt did not see: NVML counts them
    (_row(0.21), 1.0, [True, True]),  # no NVML: umrt's own bytes only
    (_row(0.25, h2d=4.8e9), 0.5, [True]),  # bound 0.2 s: 1.25x
    (_row(0.27, h2d=4.8e9), 0.5, [False]),  # 1.35x
    (_row(0.64, d2h=6e9), 0.75, [True]),  # bound 0.5 s (6 GB D2H at 12 GB/s): 1.28x
    (_row(0.70, d2h=6e9), 0.75, [False]),  # 1.4x
    (_row(0.60, h2d=24e9), 0.25, [None]),  # no target below half
])
def test_targets(row, frac, want):
    checks = gm.check_targets("umrt@x", row, IDEAL, frac)
    assert [c.passed for c in checks] == want


def test_targets_that_cannot_be_checked():
    assert gm.check_targets("umrt@8GiB", _row(0.2), IDEAL, None)[0].passed is None  # footprint unknown
    failed = gm.check_targets("umrt@x", {"error": "timed out after step 3: ..."}, IDEAL, 1.0)
    assert [(c.name, c.passed, c.value) for c in failed] == [("ran", False, "timed out after step 3: ...")]
    no_ideal = gm.check_targets("umrt@x", _row(0.2), {"error": "x"}, 1.0)
    assert no_ideal[1].passed is None


def test_loss_checks():
    row = {"loss_check": gm.compare_losses([1.0, 2.0], [1.0, 2.5])}
    c = gm.check_losses("umrt@x", row)
    assert c.passed is False and "first unequal step 1" in c.value
    assert gm.check_losses("um", {"error": "x"}).passed is None


# ---------------------------------------------------------------- progress lines


def test_progress_lines_round_trip_and_other_lines_are_not_progress():
    rec = gw.StepRecord(4, 0.4123, True, 9.082031, 1 << 30, 0, 0, {"cudaMemPrefetchAsync": 231},
                        1.3 * 2**30, 12 * 2**20, 15 << 30, True, None)
    assert gw.StepRecord.from_line(rec.to_line()) == rec
    assert gw.StepRecord.from_line("umrt: no CUDA GPU found") is None
    assert gw.StepRecord.from_line(gw.PROGRESS_PREFIX + "{not json") is None
    line = gw.format_step("umrt@footprint/2", rec, 25)
    assert line == ("umrt@footprint/2  step  4/25 timed       412.3 ms  loss 9.082031  "
                    "umrt H2D 1.0 GiB D2H 0 B calls 231  PCIe H2D 1.3 GiB D2H 12.0 MiB  pool 15.0 GiB")
    stopped = gw.StepRecord(7, 0.2, True, 1.0, 0, 0, 0, None, acting=False, stopped_reason="CudaError: x")
    assert "calls -" in gw.format_step("umrt", stopped, 9) and gw.format_step("umrt", stopped, 9).endswith("NOT ACTING")
    assert gw.format_step("ideal", gw.StepRecord(0, 1.5, False, 9.0), 9) == "ideal  step 0/9 warmup     1500.0 ms  loss 9.000000"


# ---------------------------------------------------------------- the watchdog


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_watchdog_time_limit_and_stall():
    clock = Clock()
    dog = gw.Watchdog(limit_s=60, stall_s=10, clock=clock)
    clock.t += 9
    assert dog.expired() is None
    clock.t += 2
    assert dog.expired() == "made no progress for 10 s since it started"
    dog.progress()
    clock.t += 9.5
    assert dog.expired() is None
    dog.progress()
    dog.progress()
    clock.t += 10.5
    assert dog.expired() == "made no progress for 10 s after 3 step(s)"
    for _ in range(5):
        clock.t += 7
        dog.progress()
    assert dog.expired() == "exceeded its time limit of 60 s"
    with pytest.raises(ValueError, match="positive"):
        gw.Watchdog(0, 1)


def test_extract_stacks_keeps_only_the_dump():
    text = textwrap.dedent("""\
        umrt: something else
        Thread 0x00007f0000000001 (most recent call first):
          File "/x/threading.py", line 331 in wait
          File "/x/pcie.py", line 12 in _run

        Current thread 0x00007f0000000002 (most recent call first):
          Garbage-collecting
          File "/x/cuda.py", line 99 in prefetch
          File "/x/train.py", line 5 in <module>
        later line
        """)
    got = gw.extract_stacks(text)
    assert got.startswith("Thread 0x00007f0000000001") and got.endswith('line 5 in <module>')
    assert "something else" not in got and "later line" not in got and "in prefetch" in got
    assert gw.extract_stacks("no dump here") == ""


CHILD = textwrap.dedent("""\
    import sys, threading, time
    sys.path.insert(0, {root!r})
    from bench.gpu_watch import StepRecord, install_stack_dump
    assert install_stack_dump()
    def copy_thread_waits():
        time.sleep(600)
    threading.Thread(target=copy_thread_waits, daemon=True).start()
    print("hello from the worker", flush=True)
    for step in range({steps}):
        print(StepRecord(step, 0.01, step > 0, 1.0).to_line(), flush=True)
    def stuck_in_a_cuda_call():
        time.sleep({hang})
    stuck_in_a_cuda_call()
    print("done", file=sys.stderr)
    """)


def _child(tmp_path, steps, hang):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=root, steps=steps, hang=hang))
    return [sys.executable, str(script)]


def test_supervise_stops_a_stalled_worker_with_the_stacks_of_all_its_threads(tmp_path):
    seen, other = [], []
    t0 = time.monotonic()
    out = gw.supervise(_child(tmp_path, 2, 600), env=None, watchdog=gw.Watchdog(60, 1.0),
                       stderr_path=tmp_path / "err", on_step=seen.append, on_line=other.append)
    assert time.monotonic() - t0 < 15
    assert out.timed_out == "made no progress for 1 s after 2 step(s)"
    assert [r.step for r in seen] == [0, 1] == [r.step for r in out.steps] and other == ["hello from the worker"]
    assert "in stuck_in_a_cuda_call" in out.stacks and "in copy_thread_waits" in out.stacks
    assert out.stacks.count("(most recent call first)") == 2 and out.returncode != 0


def test_supervise_lets_a_worker_that_progresses_finish(tmp_path):
    out = gw.supervise(_child(tmp_path, 3, 0.1), env=None, watchdog=gw.Watchdog(60, 30),
                       stderr_path=tmp_path / "err")
    assert out.returncode == 0 and out.timed_out is None and out.stacks == ""
    assert len(out.steps) == 3 and out.last_error_line() == "done"


def test_supervise_enforces_the_time_limit_even_with_progress(tmp_path):
    out = gw.supervise(_child(tmp_path, 1, 600), env=None, watchdog=gw.Watchdog(1.0, 30),
                       stderr_path=tmp_path / "err")
    assert out.timed_out == "exceeded its time limit of 1 s" and "stuck_in_a_cuda_call" in out.stacks
