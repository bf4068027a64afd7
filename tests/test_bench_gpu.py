"""bench.gpu: argument checks, the no-GPU exit, the report from fake per-mode timings,
the worker's loop and the parent's progress and watchdog on the CPU (a dry run), and
(with a GPU) a tiny end-to-end run. The measuring parts (budgets, counters, NVML's PCIe
counters, targets) and the watchdog are tested in test_bench_gpu_parts.py."""
from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest

from bench import gpu

TINY = "hf:GPT2Config:n_layer=2,n_embd=256,n_head=4,vocab_size=8192,n_positions=128"
MICRO = "hf:GPT2Config:n_layer=1,n_embd=32,n_head=2,vocab_size=256,n_positions=32"  # CPU-only loop test


@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--batch", "0"], "--batch"),
    (["--gpu-memory", "150%"], "(0, 100]"),
    (["--gpu-memory", "lots"], "--gpu-memory 'lots'"),
    (["--gpu-memory", "1MB"], "2 MB block"),
    (["--model", "gpt9"], "unknown model 'gpt9'"),
    (["--modes", "ideal,fast"], "--modes"),
    (["--modes", "um,umrt", "--gpu-memory", "50%peak"], "keep ideal"),
    (["--modes", "um,umrt"], "keep both"),  # the default, 50% of the footprint
    (["--modes", "ideal,umrt", "--gpu-memory", "footprint/2"], "keep both"),
    (["--gpu-memory", "footprint/0"], "(0, 100]"),
    (["--gpu-memory", "footprint*2"], "(0, 100]"),
    (["--gpu-memory", "20%device", "--gpu-memory", "20%budget"], "of the GPU's memory"),
    (["--gpu-memory", "8GiB", "--gpu-memory", "half"], "--gpu-memory 'half'"),
    (["--stall", "0"], "--stall"),
    (["--profile", "tpu-v9"], "unknown --profile"),
])
def test_bad_arguments_exit_2_with_one_line(argv, words, capsys, monkeypatch):
    monkeypatch.setattr("umrt.api.gpu_count", lambda: 1)  # the argument check comes first either way
    assert gpu.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("bench.gpu: ") and err.count("\n") == 1


def test_argparse_type_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--steps", "many"])
    assert exc.value.code == 2


def test_no_gpu_exits_2_with_a_message(capsys, monkeypatch):
    monkeypatch.setattr("umrt.api.gpu_count", lambda: 0)
    assert gpu.main(["--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err == ("bench.gpu: no CUDA GPU found: bench.gpu measures on a real GPU "
                   "(use `python -m bench` for the simulated grid)\n")


def test_no_gpu_from_the_command_line():
    from tests.conftest import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "no CUDA GPU found" in proc.stderr


def test_a_failed_worker_is_recorded_with_its_last_line(tmp_path):
    from tests.conftest import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: umrt would start")
    args = gpu.build_parser().parse_args(["--model", TINY, "--steps", "1", "--warmup", "0"])
    r = gpu.run_mode("umrt", args, 64 << 20, tmp_path)
    assert r == {"mode": "umrt", "error": "bench.gpu: umrt did not start (no CUDA GPU)"}


def test_ratios_from_fake_timings():
    r = gpu.compute_ratios({"ideal": 0.1, "um": 0.5, "umrt": 0.2})
    assert r["um/ideal"] == pytest.approx(5.0)
    assert r["umrt/ideal"] == pytest.approx(2.0)
    assert r["um/umrt"] == pytest.approx(2.5)
    missing = gpu.compute_ratios({"ideal": 0.1, "umrt": math.nan})
    assert missing == {"um/ideal": None, "umrt/ideal": None, "um/umrt": None, "checkpoint/ideal": None,
                       "umrt/checkpoint": None}
    beside = gpu.compute_ratios({"ideal": 0.1, "checkpoint": 0.127, "umrt": 0.2})
    assert beside["checkpoint/ideal"] == pytest.approx(1.27) and beside["umrt/checkpoint"] == pytest.approx(0.2 / 0.127)


def test_steady_time_is_the_median_of_the_timed_steps():
    assert gpu.steady_time([0.3, 0.1, 0.2, 5.0]) == pytest.approx(0.25)
    assert math.isnan(gpu.steady_time([]))


def test_budget_is_a_share_of_the_footprint_or_of_the_ideal_peak_or_a_size():
    assert gpu.resolve_budget("50%", None, 1000 << 20) == 500 << 20  # a bare percentage: of the footprint
    assert gpu.resolve_budget("50%peak", 1000 << 20) == 500 << 20
    assert gpu.resolve_budget("1GiB", None) == 1 << 30
    assert gpu.resolve_budget("7.5GiB", None) == 15 << 29
    assert gpu.resolve_budget("footprint/4", None, 1000 << 20) == 250 << 20  # the old spelling of 25%
    with pytest.raises(gpu.BenchError, match="ideal run"):
        gpu.resolve_budget("50%peak", None)
    with pytest.raises(gpu.BenchError, match="the footprint, which the ideal and um runs measure"):
        gpu.resolve_budget("50%", 1000 << 20, None)


def test_repeated_budgets_are_kept_in_order_once():
    args = gpu.build_parser().parse_args(["--gpu-memory", "footprint", "--gpu-memory", "footprint/2", "--gpu-memory",
                                          "footprint", "--gpu-memory", "7.5GiB"])
    assert [b.text for b in gpu.budget_specs(args)] == ["footprint", "footprint/2", "7.5GiB"]
    assert [b.text for b in gpu.budget_specs(gpu.build_parser().parse_args([]))] == ["50%"]


LOSSES = [9.1, 8.7, 8.2]


def _steps(times, **per_step):
    """Worker step records: the last len(times) are timed."""
    return [{"step": i, "time_s": t, "timed": True, "loss": LOSSES[i % 3], **per_step}
            for i, t in enumerate(times)]


def _fake(mode, times, **extra):
    base = {"mode": mode, "batch": 2, "seq": 64, "step_times_s": times, "notes": [], "losses": LOSSES[:len(times)],
            "steps": _steps(times),
            "gpu": {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 << 30, "free_bytes_at_start": 79 << 30}}
    return {**base, **extra}


def _results():
    stats = {"allocated_bytes": 0, "peak_allocated_bytes": 7 << 20, "migrated_bytes": 3 << 20,
             "acting": True, "stopped_reason": None}
    return {
        "ideal": _fake("ideal", [0.010, 0.011, 0.012], peak_allocated_bytes=200 << 20,
                       peak_reserved_bytes=220 << 20),
        "um": _fake("um", [0.050, 0.040, 0.060], memory_stats=stats, pool_peak_reserved_bytes=240 << 20),
        "umrt": {"mode": "umrt", "error": "out of memory: OutOfMemoryError: CUDA out of memory"},
    }


def test_report_from_fake_per_mode_results():
    sim = {"profile": "h100-pcie5-80g", "modes": {"ideal": {"iteration_time_s": 0.01},
                                                  "um": {"iteration_time_s": 0.05}},
           "ratios": {"um/ideal": 5.0, "umrt/ideal": None, "um/umrt": None}}
    rep = gpu.build_report(_results(), model=TINY, budget_spec="50%", budget_bytes=100 << 20, simulated=sim)
    assert rep["label"] == "measured on NVIDIA H100 80GB HBM3"
    assert rep["measured"]["ideal"]["iteration_time_s"] == pytest.approx(0.011)
    assert rep["measured"]["um"]["min_time_s"] == pytest.approx(0.040)
    assert rep["ratios"]["um/ideal"] == pytest.approx(0.050 / 0.011)
    assert rep["ratios"]["umrt/ideal"] is None and "error" in rep["measured"]["umrt"]
    assert rep["budget"]["fraction_of_ideal_peak"] == pytest.approx(0.5)
    assert rep["measured"]["um"]["loss_check"]["equal"] and rep["losses_equal"] is None  # umrt: no losses
    assert [(t["budget"], t["name"], t["passed"]) for t in rep["targets"]] == [
        ("um", "losses equal plain PyTorch", True), ("umrt@50%", "ran", False)]
    rep["measured"]["um"]["odd"] = math.nan
    assert json.loads(json.dumps(gpu._strict(rep), allow_nan=False))["measured"]["um"]["odd"] is None
    from rich.console import Console

    buf = io.StringIO()
    gpu.render(rep, Console(file=buf, width=250))
    text = buf.getvalue()
    assert "measured on NVIDIA H100" in text and "umrt failed: out of memory" in text
    assert f"um/ideal {0.050 / 0.011:.2f}x | 5.00x" in text
    assert "migrated_bytes=3.0 MiB" in text and "acting=True" in text


def _fit_run(pool_peak=1000 << 20):
    """Fake results of ideal, um and umrt at footprint, footprint/2 and footprint/4."""
    ideal = _fake("ideal", [0.20, 0.20, 0.20], peak_allocated_bytes=900 << 20, peak_reserved_bytes=950 << 20)
    for s in ideal["steps"]:
        s.update(pcie_h2d_bytes=1 << 20, pcie_d2h_bytes=1 << 20)
    um = _fake("um", [0.3, 0.3, 0.3], pool_peak_reserved_bytes=pool_peak)

    def umrt(t, h2d, d2h, losses=LOSSES):
        r = _fake("umrt", [t] * 3, pool_peak_reserved_bytes=pool_peak, losses=losses)
        r["steps"] = [{**s, "h2d_bytes": h2d, "d2h_bytes": d2h, "discarded_bytes": 0,
                       "calls": {"cudaMemPrefetchAsync": 4}, "pcie_h2d_bytes": h2d + (1 << 20),
                       "pcie_d2h_bytes": d2h + (1 << 20)} for s in r["steps"]]
        return r

    return {"ideal": ideal, "um": um,
            "umrt": umrt(0.21, 0, 0),  # at the footprint: nothing moves, 1.05x
            "umrt@footprint/2": umrt(0.30, 9_600_000_000, 1_200_000_000),  # bound 0.2 s: 1.5x, missed
            "umrt@footprint/4": umrt(0.90, 24e9, 6e9, losses=[9.1, 8.7, 8.3])}  # bound 0.5 s; a loss differs


def test_targets_of_the_issue_in_the_report():
    fp = 1000 << 20
    budgets = [{"spec": "footprint", "bytes": fp, "label": "umrt"},
               {"spec": "footprint/2", "bytes": fp // 2, "label": "umrt@footprint/2"},
               {"spec": "footprint/4", "bytes": fp // 4, "label": "umrt@footprint/4"}]
    rep = gpu.build_report(_fit_run(), model="gpt2", budget_spec="footprint", budget_bytes=fp,
                           budgets=budgets, footprint_bytes=fp)
    assert [b["fraction_of_footprint"] for b in rep["budgets"]] == [1.0, 0.5, 0.25]
    assert rep["budget"]["fraction_of_footprint"] == 1.0 and rep["footprint_bytes"] == fp
    got = {(t["budget"], t["name"]): t["passed"] for t in rep["targets"]}
    assert got == {
        ("um", "losses equal plain PyTorch"): True,
        ("umrt@footprint", "losses equal plain PyTorch"): True,
        ("umrt@footprint", "no PCIe traffic after learning"): True,
        ("umrt@footprint", "step vs plain PyTorch"): True,
        ("umrt@footprint/2", "losses equal plain PyTorch"): True,
        ("umrt@footprint/2", "step vs bound"): False,
        ("umrt@footprint/4", "losses equal plain PyTorch"): False,
        ("umrt@footprint/4", "step vs bound"): None,  # no target below half
    }
    assert rep["losses_equal"] is False
    half = rep["budgets"][1]
    assert half["measured"]["per_step"]["calls"] == 4 and half["ratios"]["umrt/ideal"] == pytest.approx(1.5)
    assert rep["measured"]["umrt"]["iteration_time_s"] == pytest.approx(0.21)  # measured: the first budget
    from rich.console import Console

    buf = io.StringIO()
    gpu.render(rep, Console(file=buf, width=250))
    text = buf.getvalue()
    for words in ("umrt@footprint/2", "targets umrt is held to on a GPU", "missed", "met", "8.9 GiB",  # 9.6e9 B
                  "CUDA calls per timed step: cudaMemPrefetchAsync 4.0", "first unequal step 2",
                  "footprint 1000.0 MiB"):
        assert words in text, words


def test_run_passes_the_budget_from_the_ideal_peak(monkeypatch):
    seen = {}

    def fake_run_mode(mode, args, budget_bytes, workdir, **kw):
        seen[kw.get("label", mode)] = budget_bytes
        return _results()[mode] if mode != "umrt" else _fake("umrt", [0.02], memory_stats={})

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    args = gpu.build_parser().parse_args(["--model", "gpt2", "--gpu-memory", "25%peak", "--no-sim"])
    rep = gpu.run(args)
    assert seen == {"ideal": 0, "um": 50 << 20, "umrt": 50 << 20}
    assert rep["ratios"]["um/umrt"] == pytest.approx(2.5) and rep["simulated"] is None


def test_a_bare_percentage_is_of_the_measured_footprint(monkeypatch, capsys):
    """--gpu-memory 25% is a quarter of the footprint (the larger of the ideal run's peak reserved, 220 MiB,
    and umrt's pool's in the um run, 240 MiB), as in the simulator; it was of the ideal peak, and says so."""
    seen = {}

    def fake_run_mode(mode, args, budget_bytes, workdir, **kw):
        seen[kw.get("label", mode)] = budget_bytes
        return _results()[mode] if mode != "umrt" else _fake("umrt", [0.02], memory_stats={})

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    rep = gpu.run(gpu.build_parser().parse_args(["--model", "gpt2", "--gpu-memory", "25%", "--no-sim"]))
    assert seen == {"ideal": 0, "um": 79 << 30, "umrt": 60 << 20}  # um: the free memory (no pressure on it)
    assert rep["footprint_bytes"] == 240 << 20 and rep["budget"]["fraction_of_footprint"] == 0.25
    assert "note: --gpu-memory 25% is 25% of the footprint the run needs (for 25% of the ideal run's peak " \
           "allocated bytes, write 25%peak)" in capsys.readouterr().err


def test_run_measures_umrt_at_fractions_of_the_um_runs_pool_footprint(monkeypatch):
    seen = {}
    fake = _fit_run(pool_peak=3000 << 20)

    def fake_run_mode(mode, args, budget_bytes, workdir, **kw):
        seen[kw.get("label", mode)] = budget_bytes
        return fake["ideal" if mode == "ideal" else "um" if mode == "um" else "umrt"]

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    args = gpu.build_parser().parse_args(["--model", "gpt2", "--gpu-memory", "footprint", "--gpu-memory",
                                          "footprint/2", "--budget", "footprint/4", "--budget", "1GiB", "--no-sim"])
    rep = gpu.run(args)
    # um first (its budget: the first size given; it puts no pressure on um), then umrt at each
    assert seen == {"ideal": 0, "um": 1 << 30, "umrt@footprint": 3000 << 20, "umrt@footprint/2": 1500 << 20,
                    "umrt@footprint/4": 750 << 20, "umrt@1GiB": 1 << 30}
    assert [b["label"] for b in rep["budgets"]] == ["umrt", "umrt@footprint/2", "umrt@footprint/4", "umrt@1GiB"]
    assert rep["budget"] == {"spec": "footprint", "bytes": 3000 << 20, "fraction_of_ideal_peak": 3000 / 900,
                             "fraction_of_footprint": 1.0}


def test_a_footprint_budget_without_a_footprint_is_a_failed_row_not_an_abort(monkeypatch):
    def fake_run_mode(mode, args, budget_bytes, workdir, **kw):
        return _fake("ideal", [0.01], peak_allocated_bytes=1 << 30) if mode == "ideal" else \
            {"mode": mode, "error": "timed out after step 3: it made no progress for 60 s", "timed_out": True}

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    args = gpu.build_parser().parse_args(["--model", "gpt2", "--gpu-memory", "footprint/2", "--no-sim"])
    rep = gpu.run(args)
    assert rep["measured"]["um"]["timed_out"]
    assert "the footprint, which the ideal and um runs measure" in rep["measured"]["umrt"]["error"]
    from rich.console import Console

    buf = io.StringIO()
    gpu.render(rep, Console(file=buf, width=250))
    assert "um timed out: timed out after step 3" in buf.getvalue()


def test_a_model_that_does_not_fit_the_free_memory_is_refused(monkeypatch):
    def fake_run_mode(mode, args, budget_bytes, workdir, **kw):
        return _fake("ideal", [0.01], peak_allocated_bytes=70 << 30, peak_reserved_bytes=72 << 30)

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    args = gpu.build_parser().parse_args(["--model", "gpt2", "--no-sim"])
    with pytest.raises(gpu.BenchError, match="does not fit"):
        gpu.run(args)


def test_a_budget_beyond_the_free_memory_is_a_failed_row(monkeypatch):
    def fake_run_mode(mode, args, budget_bytes, workdir, **kw):
        return _fake(mode, [0.01], peak_allocated_bytes=1 << 30, peak_reserved_bytes=1 << 30)

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    args = gpu.build_parser().parse_args(["--model", "gpt2", "--no-sim", "--gpu-memory", "1GiB", "--gpu-memory", "90GiB"])
    rep = gpu.run(args)
    assert "exceeds the device's free memory" in rep["budgets"][1]["measured"]["error"]
    assert "error" not in rep["budgets"][0]["measured"]


def test_the_ideal_worker_trains_and_times_each_step(monkeypatch, tmp_path, capsys):
    """The worker's loop, on the CPU with torch.cuda's queries faked (no GPU here): every
    step is printed as a progress line as it completes, and seeded so that every mode
    trains on the same batches (the same losses)."""
    import torch

    from bench.gpu_watch import StepRecord

    class Props:
        name, major, minor = "Fake GPU", 9, 0

    monkeypatch.setattr(gpu, "_TORCH_DEVICE", "cpu")
    monkeypatch.setattr(gpu, "_start_pcie", lambda device: (None, None, "no NVML here"))
    for fn in ("set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, fn, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (7 << 30, 8 << 30))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 123)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 456)
    out = tmp_path / "ideal.json"
    args = gpu.build_parser().parse_args(["--worker", "ideal", "--model", MICRO, "--batch", "2", "--seq", "32",
                                          "--steps", "2", "--warmup", "1", "--out", str(out)])
    assert gpu._worker_main(args) == 0
    r = json.loads(out.read_text())
    assert len(r["step_times_s"]) == 2 and all(t > 0 for t in r["step_times_s"])
    assert (r["batch"], r["seq"], r["peak_allocated_bytes"]) == (2, 32, 123)
    assert r["gpu"]["name"] == "Fake GPU" and r["gpu"]["free_bytes_at_start"] == 7 << 30
    printed = [StepRecord.from_line(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(p.step, p.timed) for p in printed] == [(0, False), (1, True), (2, True)]
    assert [p.loss for p in printed] == r["losses"] and len(set(r["losses"])) == 3
    assert [s["time_s"] for s in r["steps"] if s["timed"]] == r["step_times_s"]
    assert printed[0].h2d_bytes is None and r["per_step"]["steps"] == 2 and "no NVML here" in r["notes"]
    assert gpu._worker_main(args) == 0
    assert json.loads(out.read_text())["losses"] == r["losses"]  # seeded: the same steps again


def test_step_records_carry_umrts_counters_and_status():
    from bench.gpu_measure import Counters

    rec = gpu.step_record(3, 0.25, True, 9.5, Counters(1 << 20, 0, 4096, {"cudaMemPrefetchAsync": 2}), (5.0, 6.0),
                          {"reserved_bytes": 7 << 20, "acting": False, "stopped_reason": "CudaError: x"})
    assert (rec.h2d_bytes, rec.d2h_bytes, rec.discarded_bytes, rec.total_calls) == (1 << 20, 0, 4096, 2)
    assert (rec.pcie_h2d_bytes, rec.pcie_d2h_bytes, rec.reserved_bytes) == (5.0, 6.0, 7 << 20)
    assert rec.acting is False and rec.stopped_reason == "CudaError: x"
    plain = gpu.step_record(0, 0.1, False, None, None, None, None)
    assert plain.h2d_bytes is None and plain.acting is None and plain.calls is None


def test_run_mode_passes_strict_and_reports_a_time_out_with_the_stacks(monkeypatch, tmp_path):
    from bench.gpu_watch import Outcome, StepRecord

    seen = {}

    def fake_supervise(cmd, **kw):
        seen["cmd"] = cmd
        return Outcome(None, "", [StepRecord(0, 1.0, False)], "made no progress for 60 s after 1 step(s)",
                       'Current thread 0x1 (most recent call first):\n  File "x.py", line 3 in stuck')

    monkeypatch.setattr(gpu, "supervise", fake_supervise)
    args = gpu.build_parser().parse_args(["--model", TINY, "--strict", "--stall", "60"])
    from rich.console import Console

    buf = io.StringIO()
    r = gpu.run_mode("umrt", args, 64 << 20, tmp_path, label="umrt@footprint/2", console=Console(file=buf))
    assert "--strict" in seen["cmd"] and seen["cmd"][seen["cmd"].index("--budget-bytes") + 1] == str(64 << 20)
    assert r["timed_out"] and r["error"] == "timed out after step 0: it made no progress for 60 s after 1 step(s)"
    assert "line 3 in stuck" in r["stacks"] and len(r["steps"]) == 1
    assert "umrt@footprint/2 timed out after step 0" in buf.getvalue() and "in stuck" in buf.getvalue()


def test_a_mode_that_makes_no_progress_is_stopped_with_its_stacks_and_the_run_goes_on(tmp_path):
    """A real worker on the CPU, stopped by the watchdog before its first step
    (it is still starting up after 1.5 s): its row says so and carries its stacks."""
    from tests.conftest import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present")
    args = gpu.build_parser().parse_args(["--model", MICRO, "--batch", "2", "--seq", "16", "--steps", "1",
                                          "--warmup", "0", "--stall", "1.5", "--dry-run-cpu"])
    from rich.console import Console

    buf = io.StringIO()
    r = gpu.run_mode("ideal", args, 0, tmp_path, console=Console(file=buf, width=200))
    assert r["timed_out"] and "before its first step: it made no progress for 1.5 s since it started" in r["error"]
    assert "(most recent call first)" in r["stacks"] and 'File "' in r["stacks"]
    assert "ideal timed out before its first step" in buf.getvalue()


def test_a_cpu_dry_run_end_to_end(tmp_path, capsys):
    """The parent and its workers on the CPU: ideal trains and shows each step; umrt
    cannot start without a GPU, which its row says; the JSON keeps its keys."""
    from tests.conftest import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: umrt would start")
    out = tmp_path / "r.json"
    code = gpu.main(["--dry-run-cpu", "--model", MICRO, "--batch", "2", "--seq", "16", "--steps", "2",
                     "--warmup", "1", "--modes", "ideal,umrt", "--gpu-memory", "64MiB", "--json", str(out)])
    assert code == 1  # umrt failed
    err = capsys.readouterr().err
    assert "ideal  step 0/3 warmup" in err and "ideal  step 2/3 timed" in err and "loss " in err
    assert "umrt failed: bench.gpu: umrt did not start (no CUDA GPU)" in err
    rep = json.loads(out.read_text())
    assert rep["label"] == "CPU dry run (not a GPU measurement)"
    assert set(rep) >= {"label", "gpu", "model", "batch", "seq", "budget", "measured", "ratios", "simulated",
                        "notes", "budgets", "targets", "footprint_bytes"}
    assert len(rep["measured"]["ideal"]["losses"]) == 3 and rep["measured"]["ideal"]["per_step"]["steps"] == 2
    assert rep["budgets"][0]["bytes"] == 64 << 20 and "error" in rep["budgets"][0]["measured"]


@pytest.mark.parametrize("name, total, want", [
    ("NVIDIA H100 80GB HBM3", 80 << 30, "h100-pcie5-80g"),
    ("NVIDIA A100-SXM4-40GB", 40 << 30, "a100-pcie4-40g"),
    ("NVIDIA A100 80GB PCIe", 80 << 30, "a100-pcie4-80g"),
    ("Tesla V100-PCIE-32GB", 32 << 30, "v100-pcie3-32g"),
    ("NVIDIA GH200 480GB", 96 << 30, "gh200-c2c"),
])
def test_closest_profile(name, total, want):
    assert gpu.closest_profile(name, total) == want


@pytest.mark.gpu
def test_tiny_end_to_end_on_a_gpu(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--model", TINY, "--batch", "4", "--seq", "128", "--steps", "3",
         "--warmup", "3", "--gpu-memory", "footprint", "--gpu-memory", "footprint/2", "--timeout", "300",
         "--stall", "120", "--json", str(out)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "umrt@footprint/2  step 5/6 timed" in proc.stderr  # per-step progress as it went
    rep = json.loads(out.read_text())
    assert set(rep["measured"]) == {"ideal", "um", "umrt"}
    assert all("error" not in m and len(m["step_times_s"]) == 3 for m in rep["measured"].values())
    assert all(v is not None and v > 0 for v in rep["ratios"].values())
    assert rep["measured"]["umrt"]["budget_bytes"] == rep["budget"]["bytes"] == rep["footprint_bytes"]
    assert [b["fraction_of_footprint"] for b in rep["budgets"]] == [1.0, 0.5]
    assert rep["losses_equal"] is True
    assert rep["measured"]["umrt"]["memory_stats"]["acting"] is True
    assert rep["simulated"]["profile"]


def test_the_simulated_prediction_is_each_modes_steady_state(monkeypatch):
    """The timed GPU steps come after --warmup; the simulated column must be the
    same steady state: umrt after its learned and probed iterations."""
    import bench.grid
    import umrt.sim.replay as replay
    from umrt.policy.runtime.path_trial import TRIAL_ITERATIONS

    seen = {}

    class Result:
        iteration_time_s, h2d_bytes, d2h_bytes, faults, budget_bytes, peak_live_bytes = 1.0, 0, 0, 0, 1, 1

    def fake_simulate(trace, policy, profile, budget, iterations):
        seen[policy.name] = iterations
        return Result()

    monkeypatch.setattr(bench.grid, "trace_for", lambda model, batch, seq: None)
    monkeypatch.setattr(replay, "simulate", fake_simulate)
    monkeypatch.setattr(replay, "replayable_iterations", lambda trace, wanted: wanted)  # (no trace here)
    gpu.simulate_modes("gpt2", 1, 32, "50%", "h100-pcie5-80g", ["ideal", "um", "umrt"])
    assert seen == {"ideal": 3, "um": 3, "umrt": 5 + TRIAL_ITERATIONS}  # (learned, probed, the path trial)


def test_the_checkpoint_mode_trains_with_the_models_own_checkpointing_and_sets_the_budget(tmp_path, capsys):
    """What a user picks instead, in the same run: plain torch with activation checkpointing;
    its losses are plain PyTorch's, and ``--budget checkpoint`` is its peak (on the CPU there
    is no peak to read: the umrt row says the budget could not be resolved)."""
    from tests.conftest import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: this is the CPU dry run")
    out = tmp_path / "r.json"
    code = gpu.main(["--dry-run-cpu", "--model", MICRO, "--batch", "2", "--seq", "16", "--steps", "2",
                     "--warmup", "1", "--modes", "ideal,checkpoint,um,umrt", "--budget", "checkpoint",
                     "--json", str(out)])
    assert code == 1  # um and umrt cannot start without a GPU
    err = capsys.readouterr().err
    assert "checkpoint  step 2/3 timed" in err
    rep = json.loads(out.read_text())
    ideal, ckpt = rep["measured"]["ideal"], rep["measured"]["checkpoint"]
    assert ckpt["losses"] == ideal["losses"]  # recomputation changes no result
    assert any(t["budget"] == "checkpoint" and t["name"].startswith("losses") and t["passed"] for t in rep["targets"])
    assert "checkpoint run's peak" in rep["budgets"][0]["measured"]["error"]


def test_a_checkpoint_budget_needs_the_checkpoint_mode():
    args = gpu.build_parser().parse_args(["--modes", "ideal,um,umrt", "--budget", "checkpoint"])
    with pytest.raises(gpu.BenchError, match="keep checkpoint in --modes"):
        gpu.validate(args)
