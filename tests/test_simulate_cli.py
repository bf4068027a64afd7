"""`umrt simulate`: flags, JSON output, the table, clear errors."""
from __future__ import annotations

import json

import pytest

from umrt.cli import main
from umrt.trace.events import Access, Alloc, IterationBoundary, Kind, Launch, Trace, TraceHeader

fileformat = pytest.importorskip("umrt.trace.fileformat")

MB = 1 << 20


@pytest.fixture
def trace_file(tmp_path):
    events: list = [Alloc(o, 8 * MB, Kind.PARAMETER) for o in range(6)]
    seq = 0
    for it in range(2):
        events.append(IterationBoundary(it))
        for o in range(6):
            events.append(Launch(seq, o, "aten::sum.default", (Access(o, 0, 8 * MB, False),), 10**9, 8 * MB))
            seq += 1
    events.append(IterationBoundary(2))
    path = tmp_path / "cyclic.umrt"
    fileformat.save(Trace(TraceHeader(1, "test", "cyclic", "none", "meta", 2), events), path)
    return path


def run_json(capsys, *argv):
    code = main(["simulate", *map(str, argv), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


def test_json_has_the_documented_fields(capsys, trace_file):
    data = run_json(capsys, trace_file, "--gpu", "v100-pcie3-16g", "--budget", "50%", "--policy", "um")
    for key in ("iteration_time_s", "ideal_time_s", "h2d_bytes", "d2h_bytes", "faults", "fault_batches",
                "evictions", "peak_resident_bytes", "breakdown"):
        assert key in data
    assert {"compute_s", "fault_stall_s", "transfer_wait_s", "overhead_s"} <= set(data["breakdown"])
    # 50% of the footprint the run needs: six 8 MB parameters in PyTorch's 20 MB segments (two per segment)
    assert data["faults"] > 0 and data["needed_footprint_bytes"] == 60 * MB and data["budget_bytes"] == 30 * MB
    assert data["budget_description"] == "budget 30.0 MiB = 50% of the footprint 60.0 MiB (peak live 48.0 MiB)"
    assert data["profile"] == "v100-pcie3-16g" and data["iterations"] == 3


def test_the_link_bound_comes_with_the_result(capsys, trace_file):
    data = run_json(capsys, trace_file, "--budget", "50%", "--policy", "oracle")
    bound = data["link_bound"]
    assert bound["ideal_s"] == pytest.approx(data["ideal_time_s"])
    assert data["ideal_time_s"] <= bound["time_s"] <= data["iteration_time_s"]
    assert bound["time_s"] <= bound["steady_s"] <= data["iteration_time_s"]
    assert bound["budget_bytes"] == data["budget_bytes"] and bound["launches"] == 6
    assert main(["simulate", str(trace_file), "--budget", "50%"]) == 0
    out = capsys.readouterr().out
    assert "link bound" in out and "in a steady state" in out


def test_budget_and_iterations_change_the_result(capsys, trace_file):
    tight = run_json(capsys, trace_file, "--budget", "50%", "--iterations", "2")
    roomy = run_json(capsys, trace_file, "--budget", "64MiB", "--iterations", "2")
    assert len(tight["iteration_times_s"]) == 2
    assert roomy["faults"] == 0 < tight["faults"]


def test_human_output_is_a_table(capsys, trace_file):
    assert main(["simulate", str(trace_file), "--budget", "50%"]) == 0
    out = capsys.readouterr().out
    for word in ("iteration time", "slowdown", "fault stall", "evictions", "simulated"):
        assert word in out


def test_profile_file_is_accepted(capsys, tmp_path, trace_file):
    from umrt.hardware import load_profile, save_profile

    path = tmp_path / "mine.json"
    save_profile(load_profile("h100-pcie5-80g"), path)
    assert run_json(capsys, trace_file, "--gpu", path)["profile"] == "h100-pcie5-80g"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "lots"], "invalid budget"),
        (["--gpu", "tpu-v5"], "unknown hardware profile"),
        (["--policy", "magic"], "unknown policy"),
        (["--iterations", "0"], "iterations"),
    ],
)
def test_bad_flags_exit_2_with_a_message(capsys, trace_file, argv, message):
    assert main(["simulate", str(trace_file), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_trace_file(capsys, tmp_path):
    assert main(["simulate", str(tmp_path / "nope.umrt")]) == 2
    assert "nope.umrt" in capsys.readouterr().err


def test_table_sizes_use_the_one_byte_formatter(capsys, trace_file):
    assert main(["simulate", str(trace_file), "--budget", "50%"]) == 0
    table = capsys.readouterr().out
    assert "30.0 MiB = 50% of the footprint" in table and "48.0 MiB" in table  # of the 60 MiB footprint; 48 live
    assert "0.02 GiB" not in table and "0.05 GiB" not in table


def test_budget_base_peak_keeps_the_older_meaning(capsys, trace_file, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal (or xdist's console): the report's width is fixed
    data = run_json(capsys, trace_file, "--budget", "50%", "--budget-base", "peak", "--policy", "um")
    assert data["budget_bytes"] == 24 * MB and data["budget_base"] == "peak"  # half of the 48 MB live
    assert data["budget_of_footprint"] == pytest.approx(0.4)  # of the 60 MB the layouts need
    assert main(["simulate", str(trace_file), "--budget", "100%", "--policy", "um"]) == 0
    out = capsys.readouterr().out
    assert "60.0 MiB = 100% of the footprint" in out and "│ peak live " in out and "48.0 MiB │" in out


@pytest.mark.parametrize("budget", ["32M", "32MiB", "33554432", "0.03125G"])
def test_budget_takes_every_unit_a_live_budget_takes(capsys, trace_file, budget):
    """`umrt simulate --budget 32M` is the same 32 MiB as UMRT_GPU_MEMORY=32M (umrt.config.read_amount)."""
    assert run_json(capsys, trace_file, "--budget", budget, "--iterations", "2")["budget_bytes"] == 32 * MB
