"""bench.gpu: argument checks, the no-GPU exit, the report from fake per-mode timings,
and (with a GPU) a tiny end-to-end run."""
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
    (["--budget", "150%"], "(0, 100]"),
    (["--budget", "lots"], "--budget 'lots'"),
    (["--budget", "1MB"], "2 MB block"),
    (["--model", "gpt9"], "unknown model 'gpt9'"),
    (["--modes", "ideal,fast"], "--modes"),
    (["--modes", "um,umrt"], "keep ideal"),
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
    assert missing == {"um/ideal": None, "umrt/ideal": None, "um/umrt": None}


def test_steady_time_is_the_median_of_the_timed_steps():
    assert gpu.steady_time([0.3, 0.1, 0.2, 5.0]) == pytest.approx(0.25)
    assert math.isnan(gpu.steady_time([]))


def test_budget_is_a_fraction_of_the_ideal_peak_or_a_size():
    assert gpu.resolve_budget("50%", 1000 << 20) == 500 << 20
    assert gpu.resolve_budget("1GiB", None) == 1 << 30
    with pytest.raises(gpu.BenchError, match="ideal run"):
        gpu.resolve_budget("50%", None)


def _fake(mode, times, **extra):
    base = {"mode": mode, "batch": 2, "seq": 64, "step_times_s": times, "notes": [],
            "gpu": {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 80 << 30, "free_bytes_at_start": 79 << 30}}
    return {**base, **extra}


def _results():
    stats = {"allocated_bytes": 0, "peak_allocated_bytes": 7 << 20, "migrated_bytes": 3 << 20}
    return {
        "ideal": _fake("ideal", [0.010, 0.011, 0.012], peak_allocated_bytes=200 << 20,
                       peak_reserved_bytes=220 << 20),
        "um": _fake("um", [0.050, 0.040, 0.060], memory_stats=stats),
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
    rep["measured"]["um"]["odd"] = math.nan
    assert json.loads(json.dumps(gpu._strict(rep), allow_nan=False))["measured"]["um"]["odd"] is None
    from rich.console import Console

    buf = io.StringIO()
    gpu.render(rep, Console(file=buf, width=250))
    text = buf.getvalue()
    assert "measured on NVIDIA H100" in text and "umrt failed: out of memory" in text
    assert f"um/ideal {0.050 / 0.011:.2f}x | 5.00x" in text
    assert "migrated_bytes=3.0 MiB" in text


def test_run_passes_the_budget_from_the_ideal_peak(monkeypatch):
    seen = {}

    def fake_run_mode(mode, args, budget_bytes, workdir):
        seen[mode] = budget_bytes
        return _results()[mode] if mode != "umrt" else _fake("umrt", [0.02], memory_stats={})

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    args = gpu.build_parser().parse_args(["--model", "gpt2", "--budget", "25%", "--no-sim"])
    rep = gpu.run(args)
    assert seen == {"ideal": 0, "um": 50 << 20, "umrt": 50 << 20}
    assert rep["ratios"]["um/umrt"] == pytest.approx(2.5) and rep["simulated"] is None


def test_a_model_that_does_not_fit_the_free_memory_is_refused(monkeypatch):
    def fake_run_mode(mode, args, budget_bytes, workdir):
        return _fake("ideal", [0.01], peak_allocated_bytes=70 << 30, peak_reserved_bytes=72 << 30)

    monkeypatch.setattr(gpu, "require_gpu", lambda: None)
    monkeypatch.setattr(gpu, "run_mode", fake_run_mode)
    args = gpu.build_parser().parse_args(["--model", "gpt2", "--no-sim"])
    with pytest.raises(gpu.BenchError, match="does not fit"):
        gpu.run(args)


def test_the_ideal_worker_trains_and_times_each_step(monkeypatch, tmp_path):
    """The worker's loop, on the CPU with torch.cuda's queries faked (no GPU here)."""
    import torch

    class Props:
        name, major, minor = "Fake GPU", 9, 0

    monkeypatch.setattr(gpu, "_TORCH_DEVICE", "cpu")
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
         "--warmup", "3", "--budget", "50%", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert set(rep["measured"]) == {"ideal", "um", "umrt"}
    assert all("error" not in m and len(m["step_times_s"]) == 3 for m in rep["measured"].values())
    assert all(v is not None and v > 0 for v in rep["ratios"].values())
    assert rep["measured"]["umrt"]["budget_bytes"] == rep["budget"]["bytes"]
    assert rep["simulated"]["profile"]


def test_the_simulated_prediction_is_each_modes_steady_state(monkeypatch):
    """The timed GPU steps come after --warmup; the simulated column must be the
    same steady state: umrt after its learned and probed iterations."""
    import bench.grid
    import umrt.sim.replay as replay

    seen = {}

    class Result:
        iteration_time_s, h2d_bytes, d2h_bytes, faults, budget_bytes, peak_live_bytes = 1.0, 0, 0, 0, 1, 1

    def fake_simulate(trace, policy, profile, budget, iterations):
        seen[policy.name] = iterations
        return Result()

    monkeypatch.setattr(bench.grid, "trace_for", lambda model, batch, seq: None)
    monkeypatch.setattr(replay, "simulate", fake_simulate)
    gpu.simulate_modes("gpt2", 1, 32, "50%", "h100-pcie5-80g", ["ideal", "um", "umrt"])
    assert seen == {"ideal": 3, "um": 3, "umrt": 5}
