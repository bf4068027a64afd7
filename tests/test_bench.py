"""The bench harness: grid, outputs, failing cells, target check, CLI."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from bench import report
from bench.cli import build_parser, grid_from_args, main
from bench.grid import Grid, parse_budget, preset, run_grid, split_list
from umrt.errors import ConfigError, DataIntegrityError
from umrt.trace.events import IterationBoundary, Trace, TraceHeader

# -- fakes --------------------------------------------------------------------------

# Iteration time per policy as a multiple of ideal, and budget sensitivity.
SLOWDOWN = {"ideal": 1.0, "um": 4.0, "um-advise": 3.6, "oracle": 1.2}


class FakeResult:
    def __init__(self, data):
        self.data = data

    def to_json(self):
        return self.data


def fake_trace(model, batch, seq, dtype="float32"):
    return Trace(TraceHeader(1, "0", model, "-", "meta", 1, meta={"batch": batch or 8, "seq": seq or 64}),
                 [IterationBoundary(0), IterationBoundary(1)])


def fake_simulate(trace, policy, profile, budget, iterations, budget_base="footprint"):
    if policy.name == "um-advise" and budget == "50%":
        raise DataIntegrityError("read of discarded object 7")
    ideal = 0.1
    factor = SLOWDOWN[policy.name] * (1.0 if budget == "20%" else 0.5) if policy.name != "ideal" else 1.0
    t = ideal * max(factor, 1.0)
    return FakeResult({"iteration_time_s": t, "ideal_time_s": ideal, "h2d_bytes": 10, "d2h_bytes": 5,
                       "faults": 3, "fault_batches": 1, "evictions": 0, "peak_resident_bytes": 100,
                       "page_events": 1000, "breakdown": {"compute_s": ideal}})


def fake_profiles(monkeypatch):
    import umrt.hardware as hardware

    monkeypatch.setattr(hardware, "load_profile", lambda name: name, raising=False)


GRID = Grid(models=("m1",), budgets=("20%", "50%"), profiles=("v100-pcie3-32g",),
            policies=("um", "um-advise", "oracle", "ideal"), iterations=2)

# -- tests --------------------------------------------------------------------------


def test_grid_runs_every_cell_ideal_first_and_reports_failures(monkeypatch):
    fake_profiles(monkeypatch)
    rows = run_grid(GRID, progress=False, trace_fn=fake_trace, simulate=fake_simulate)
    assert len(rows) == 8
    assert [r["policy"] for r in rows[:4]] == ["ideal", "um", "um-advise", "oracle"]
    failed = [r for r in rows if r["error"]]
    assert len(failed) == 1 and failed[0]["error"].startswith("DataIntegrityError")
    ok = {(r["budget"], r["policy"]): r for r in rows if not r["error"]}
    assert ok[("20%", "oracle")]["slowdown_vs_ideal"] == pytest.approx(1.2)
    assert ok[("20%", "oracle")]["speedup_vs_um"] == pytest.approx(4.0 / 1.2, rel=1e-3)
    assert ok[("20%", "um")]["batch"] == 8  # from the trace header when not overridden
    assert ok[("20%", "um")]["page_events_per_s"] > 0


def test_unavailable_policy_is_a_failed_cell_not_a_crash(monkeypatch):
    fake_profiles(monkeypatch)
    import umrt.policy as registry

    monkeypatch.setitem(registry.POLICIES, "ghost", "umrt.policy.not_built:Ghost")
    grid = Grid(models=("m1",), budgets=("20%",), profiles=("p",), policies=("ghost",))
    (row,) = run_grid(grid, progress=False, trace_fn=fake_trace, simulate=fake_simulate)
    assert "unavailable" in row["error"]


def test_a_failing_trace_fails_only_its_model(monkeypatch):
    fake_profiles(monkeypatch)

    def trace_fn(model, batch, seq, dtype):
        if model == "bad":
            raise ConfigError("unknown model 'bad'")
        return fake_trace(model, batch, seq)

    grid = Grid(models=("bad", "m1"), budgets=("20%",), profiles=("p",), policies=("ideal", "um"))
    rows = run_grid(grid, progress=False, trace_fn=trace_fn, simulate=fake_simulate)
    assert [bool(r["error"]) for r in rows] == [True, True, False, False]
    assert "unknown model" in rows[0]["error"]


def test_outputs_json_csv_markdown_plots(monkeypatch, tmp_path):
    fake_profiles(monkeypatch)
    rows = run_grid(GRID, progress=False, trace_fn=fake_trace, simulate=fake_simulate)
    report.write_json(rows, tmp_path / "r.json", meta={"grid": {"models": ["m1"]}})
    report.write_csv(rows, tmp_path / "r.csv")
    report.write_markdown(rows, tmp_path / "r.md")
    plots = report.write_plots(rows, tmp_path / "plots")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["simulated"] is True and len(doc["cells"]) == 8
    for key in ("model", "batch", "profile", "budget", "policy", "iteration_time_s", "ideal_time_s",
                "h2d_bytes", "d2h_bytes", "faults"):
        assert key in doc["cells"][1]
    with (tmp_path / "r.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 8 and table[0]["policy"] == "ideal"
    md = (tmp_path / "r.md").read_text()
    assert "| m1 |" in md and "1.20x (3.33x)" in md and "error: DataIntegrityError" in md
    assert "simulat" in md.lower()
    assert len(plots) == 1 and plots[0].stat().st_size > 1000
    assert report.load_rows(tmp_path / "r.json") == json.loads(json.dumps(rows, default=str))


def test_every_row_of_a_cell_gets_the_link_bound_computed_once(monkeypatch):
    import umrt.sim.bound as bound_module
    from umrt.testing.synthetic import training_trace

    calls = []
    real = bound_module.link_bound
    monkeypatch.setattr(bound_module, "link_bound", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    trace = training_trace(layers=3, param_mb=4, act_mb=8, steps=3, flops_per_mb=10**6)
    rows = run_grid(GRID, progress=False, trace_fn=lambda m, b, s, d: trace, simulate=fake_simulate)
    assert sorted(calls) == ["20%", "50%"]  # once per (model, profile, budget), not per policy
    for budget in ("20%", "50%"):
        cell = [r for r in rows if r["budget"] == budget]
        assert len(cell) == 4 and len({r["bound_time_s"] for r in cell}) == 1
        assert len({r["bound_conserving_s"] for r in cell}) == 1
        expected = real(trace, "v100-pcie3-32g", budget, iterations=2)
        assert cell[0]["bound_time_s"] == expected.time_s and cell[0]["bound_conserving_s"] == expected.conserving_s
    md = report.markdown_table(rows)
    assert "| bound | bound + copy-back |" in md and "no policy can beat" in md


def test_a_cell_without_a_bound_keeps_its_result(monkeypatch):
    fake_profiles(monkeypatch)  # the fake trace has no launches and the profile is a name: no bound
    rows = run_grid(GRID, progress=False, trace_fn=fake_trace, simulate=fake_simulate)
    assert all(r["bound_time_s"] is None for r in rows)
    assert all(r.get("bound_error") for r in rows if r["policy"] == "um")
    assert all(r["iteration_time_s"] for r in rows if not r["error"])
    assert "bound" not in report.markdown_table(rows).split("\n")[4]  # no bound columns


def _target_rows(umrt_factor, peer_factor=None):
    rows = []
    for m in ("gpt2-xl", "bert-large", "vit-large", "resnet-152"):
        for p in ("v100-pcie3-32g", "h100-pcie5-80g"):
            times = {"ideal": 1.0, "um": 4.0, "oracle": 1.05, "umrt": umrt_factor}
            if peer_factor:
                times["deepum"] = peer_factor
            for pol, t in times.items():
                rows.append({"model": m, "batch": 8, "seq": 1024, "profile": p, "budget": "20%",
                             "policy": pol, "iteration_time_s": t, "ideal_time_s": 1.0, "error": None})
    return rows


def test_check_targets_pass_and_fail():
    good = {r.name: r.status for r in report.check_targets(_target_rows(1.08, peer_factor=1.3))}
    assert set(good.values()) == {"pass"}
    bad = {r.name: r for r in report.check_targets(_target_rows(1.4, peer_factor=1.3))}
    assert bad["umrt >= 3.06x um (geomean)"].status == "fail"  # 4.0/1.4 = 2.86x
    assert bad["umrt >= 0.95 oracle (every cell)"].status == "fail"
    assert bad["umrt faster than every peer (every cell)"].status == "fail"
    assert "deepum" in bad["umrt faster than every peer (every cell)"].detail
    assert {r.status for r in report.check_targets([])} == {"n/a"}


def test_check_targets_report_what_the_link_bound_allows():
    rows = _target_rows(1.08)
    for r in rows:
        r |= {"bound_time_s": 1.0 if r["model"] != "gpt2-xl" else 2.0, "bound_conserving_s": 2.0}
    by = {r.name: r for r in report.check_targets(rows)}
    speed = by["umrt >= 3.06x um (geomean)"]
    # um 4.0 over bounds 2.0 (2 cells) and 1.0 (6 cells): geomean 4 / 2**(1/4)
    assert f"no policy can exceed {4 / 2 ** 0.25:.2f}x here: link bound" in speed.detail
    assert "(2.00x counting copy-back too, an estimate)" in speed.detail
    assert "link bound 1.00-2.00x ideal (2.00-2.00x counting copy-back, an estimate)" in by[
        "umrt >= 0.92 ideal where oracle reaches it"].detail
    sanity = by["no policy beats the link bound (sanity)"]
    assert sanity.status == "fail"  # oracle (1.05) and umrt (1.08) beat the 2.0 bound of gpt2-xl
    assert "gpt2-xl/v100-pcie3-32g oracle" in sanity.detail and "bert-large" not in sanity.detail
    for r in rows:
        r["bound_time_s"] = 1.0
    assert {r.name: r.status for r in report.check_targets(rows)}["no policy beats the link bound (sanity)"] == "pass"
    assert "no policy beats the link bound (sanity)" not in {r.name for r in report.check_targets(_target_rows(1.08))}


def test_cli_from_json_checks_targets_and_exit_code(tmp_path, capsys):
    path = tmp_path / "r.json"
    report.write_json(_target_rows(1.08, peer_factor=1.3), path)
    assert main(["--from-json", str(path), "--out", str(tmp_path), "--no-plots", "--check-targets"]) == 0
    assert "PASS" in capsys.readouterr().out
    report.write_json(_target_rows(2.0), path)
    assert main(["--from-json", str(path), "--out", str(tmp_path), "--no-plots", "--check-targets"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_cli_rejects_bad_input(capsys, tmp_path):
    assert main(["--budgets", "twenty", "--out", str(tmp_path)]) == 2
    assert "percentage" in capsys.readouterr().err
    assert main(["--policies", "lru", "--out", str(tmp_path)]) == 2
    assert "valid policies" in capsys.readouterr().err
    assert main(["--models", "gtp2", "--out", str(tmp_path)]) == 2
    assert "unknown model 'gtp2'" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
    assert main(["--from-json", str(tmp_path / "missing.json"), "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preset", "nope"])


def test_grid_options_override_the_preset():
    args = build_parser().parse_args(["--models", "gpt2,bert-base", "hf:GPT2Config:n_layer=2,n_embd=64",
                                      "--batch", "gpt2=3", "--iterations", "4", "--policies", "um", "oracle"])
    grid = grid_from_args(args)
    assert grid.models == ("gpt2", "bert-base", "hf:GPT2Config:n_layer=2,n_embd=64")
    assert grid.batch == {"gpt2": 3}  # bert-base keeps the zoo default
    assert grid.policies == ("um", "oracle") and grid.iterations == 4
    with pytest.raises(ConfigError, match="not in the grid"):
        grid_from_args(build_parser().parse_args(["--batch", "vit=3"]))
    assert split_list(["20%,50%", "80%"]) == ("20%", "50%", "80%")
    assert parse_budget("20%") == pytest.approx(0.2)
    with pytest.raises(ConfigError):
        parse_budget("0%")


def test_default_shapes_are_the_zoos_own():
    from bench.grid import resolved_shape

    # an hf: model's sequence is capped by its position embeddings (as `umrt trace` does), not 512
    assert resolved_shape("hf:GPT2Config:n_layer=1,n_embd=32,n_head=2,n_positions=64", None, None) == (8, 64)
    assert resolved_shape("hf:ViTConfig:num_hidden_layers=1,hidden_size=32,num_attention_heads=2",
                          None, None) == (8, 224)
    assert resolved_shape("resnet-152", None, 128) == (64, 128)
    assert resolved_shape("gpt2", 3, None) == (3, 1024)


def test_presets_match_the_issues():
    readme, targets = preset("readme"), preset("targets")
    models = ("gpt2-xl", "bert-large", "vit-large", "resnet-152")
    assert readme.models == models and readme.budgets == ("20%", "50%")
    assert set(readme.policies) == {"ideal", "um", "um-advise", "oracle"}
    assert targets.budgets == ("20%",) and {"umrt", "deepum", "sentinel", "vdnn", "swapadvisor"} <= set(targets.policies)
    assert set(readme.profiles) == set(targets.profiles) == {"v100-pcie3-32g", "h100-pcie5-80g"}
    assert readme.dtypes == ("float32", "bfloat16") and targets.dtypes == ("float32",)  # issue 11: bf16 beside fp32


@pytest.mark.slow
def test_bench_end_to_end_on_a_tiny_model(tmp_path):
    model = "hf:GPT2Config:n_layer=2,n_embd=256,n_head=4,vocab_size=2048,n_positions=128"
    code = main(["--models", model, "--batch", "4", "--seq", "128", "--budgets", "30%", "100%",
                 "--profiles", "v100-pcie3-32g", "--policies", "ideal", "um", "oracle",
                 "--iterations", "2", "--out", str(tmp_path), "--no-progress",
                 "--cache", str(tmp_path / "cache")])
    assert code == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert len(doc["cells"]) == 6
    assert all(c["error"] is None for c in doc["cells"]), [c["error"] for c in doc["cells"]]
    assert (tmp_path / "results.csv").exists() and (tmp_path / "results.md").exists()
    assert list((tmp_path / "plots").glob("*.png"))
    assert list((tmp_path / "cache").glob("*.umrt"))  # the trace was cached


def test_each_policy_is_measured_in_its_steady_state(monkeypatch):
    """A runtime that learns (umrt: 2 learned + 2 probed iterations, and the iterations that
    try swapping against migrating) gets enough iterations that its reported one is steady;
    the others keep the grid's."""
    from umrt.policy.runtime.path_trial import TRIAL_ITERATIONS

    fake_profiles(monkeypatch)
    seen = {}

    def simulate(trace, policy, profile, budget, iterations, budget_base="footprint"):
        seen[policy.name] = iterations
        return fake_simulate(trace, policy, profile, budget, iterations)

    monkeypatch.setitem(SLOWDOWN, "umrt", 1.1)
    grid = Grid(models=("m1",), budgets=("20%",), profiles=("p",), policies=("ideal", "um", "umrt"), iterations=3)
    rows = run_grid(grid, progress=False, trace_fn=fake_trace, simulate=simulate)
    assert seen == {"ideal": 3, "um": 3, "umrt": 5 + TRIAL_ITERATIONS}
    assert {r["policy"]: r["iterations"] for r in rows} == seen


def test_overhead_bench_holds_back_launches_the_runtime_does_not_want():
    """bench.overhead delivers events as the live bridge does: in the trusted
    steady state launches are held back, and the runtime still acts."""
    from bench.overhead import measure
    from umrt.testing.synthetic import training_trace

    tr = training_trace(layers=6, steps=3)
    light = measure(tr, "h100-pcie5-80g", "30%", iterations=6, op_level=False, repeats=2)
    assert light["runtime_report"]["light_iterations"] >= 2 and light["runtime_report"]["deviations"] == 0
    assert light["launches_delivered_per_iteration"] < light["launches_per_iteration"]
    assert light["backend_calls_per_iteration"] > 0
    full = measure(tr, "h100-pcie5-80g", "30%", iterations=6, op_level=False, repeats=2, all_launches=True)
    assert full["launches_delivered_per_iteration"] == full["launches_per_iteration"] > 0
    assert full["runtime_report"]["light_iterations"] == 0


def test_dtypes_run_side_by_side(monkeypatch):
    fake_profiles(monkeypatch)
    asked = []

    def trace_fn(model, batch, seq, dtype):
        asked.append(dtype)
        return fake_trace(model, batch, seq)

    grid = Grid(models=("m1",), budgets=("20%",), profiles=("p",), policies=("ideal", "um", "oracle"),
                dtypes=("float32", "bfloat16"))
    rows = run_grid(grid, progress=False, trace_fn=trace_fn, simulate=fake_simulate)
    assert asked == ["float32", "bfloat16"]  # one trace per precision
    assert [r["dtype"] for r in rows] == ["float32"] * 3 + ["bfloat16"] * 3
    assert all(r["speedup_vs_um"] == pytest.approx(4.0 / 1.2, rel=1e-3) for r in rows if r["policy"] == "oracle")
    md = report.markdown_table(rows)
    assert "| model | batch | seq | dtype | GPU profile |" in md
    assert "| m1 | 8 | 64 | bfloat16 | p | 20% |" in md and "| m1 | 8 | 64 | float32 | p | 20% |" in md
    assert "dtype" not in report.markdown_table([r for r in rows if r["dtype"] == "float32"])
    with pytest.raises(ConfigError, match="unknown dtype 'fp8'"):
        run_grid(Grid(models=("m1",), budgets=("20%",), profiles=("p",), policies=("um",), dtypes=("fp8",)),
                 progress=False, trace_fn=trace_fn, simulate=fake_simulate)


def test_cli_takes_dtypes_and_the_budget_base(capsys, tmp_path):
    grid = grid_from_args(build_parser().parse_args(["--dtype", "float32", "bfloat16", "--gpu-memory", "20%peak",
                                                     "8GiB"]))
    assert grid.dtypes == ("float32", "bfloat16") and grid.budgets == ("20%peak", "8GiB")
    grid = grid_from_args(build_parser().parse_args([]))
    assert grid.dtypes == ("float32",) and grid.budgets == ("20%", "50%")
    # the old spellings, for one version, each with a note
    grid = grid_from_args(build_parser().parse_args(["--budgets", "20%", "8GiB", "--budget-base", "peak"]))
    assert grid.budgets == ("20%peak", "8GiB")
    err = capsys.readouterr().err
    assert "bench: note: --budgets is now --gpu-memory (the same meaning)" in err
    assert "bench: note: --budget-base is gone: a percentage names its base" in err
    assert main(["--dtype", "fp8", "--out", str(tmp_path)]) == 2
    assert "unknown dtype 'fp8'" in capsys.readouterr().err


def test_rows_say_what_their_budget_is():
    from umrt.sim.budget import needs
    from umrt.testing.synthetic import training_trace

    trace = training_trace(layers=3, param_mb=4, act_mb=8, steps=3, flops_per_mb=10**6)
    grid = Grid(models=("m1",), budgets=("50%",), profiles=("v100-pcie3-32g",), policies=("um",), iterations=2)
    (row,) = run_grid(grid, progress=False, trace_fn=lambda m, b, s, d: trace)
    n = needs(trace)
    assert row["budget_base"] == "footprint" and row["needed_footprint_bytes"] == n.footprint_bytes
    assert row["budget_bytes"] == n.footprint_bytes // 2 and row["budget_of_footprint"] == pytest.approx(0.5, abs=1e-6)
    assert row["budget_description"].startswith("budget ") and "of the footprint" in row["budget_description"]
    (old,) = run_grid(Grid(**{**grid.__dict__, "budget_base": "peak"}), progress=False,
                      trace_fn=lambda m, b, s, d: trace)
    assert old["budget_bytes"] == n.peak_live_bytes // 2 and old["budget_of_peak"] == pytest.approx(0.5, abs=1e-6)
    md = report.markdown_table([row])
    assert "Budget = % of the footprint the run needs." in md
    gib = 1 << 30
    assert f"| {row['budget_bytes'] / gib:.2f} / {n.footprint_bytes / gib:.2f} / {n.peak_live_bytes / gib:.2f} |" in md


def test_check_targets_say_what_20_percent_is_and_catch_a_beaten_oracle():
    rows = _target_rows(1.08)
    for r in rows:
        r |= {"budget_base": "footprint", "budget_bytes": 19 << 30, "budget_of_footprint": 0.2,
              "budget_of_peak": 0.21 if r["model"] == "gpt2-xl" else 0.23}
    by = {r.name: r for r in report.check_targets(rows)}
    assert by["budget"].status == "info"
    assert by["budget"].detail == "20% of the footprint the run needs = 21-23% of peak live bytes = 19.00 GiB"
    assert by["no policy beats the oracle (sanity)"].status == "pass"
    for r in rows:
        if r["policy"] == "umrt" and r["model"] == "vit-large":
            r["iteration_time_s"] = 1.0  # faster than the oracle's 1.05
    sanity = {r.name: r for r in report.check_targets(rows)}["no policy beats the oracle (sanity)"]
    assert sanity.status == "fail" and "vit-large/v100-pcie3-32g umrt 1.050x" in sanity.detail
    # precisions (and bases) are judged apart, each result named with its set
    bf16 = [dict(r, dtype="bfloat16") for r in _target_rows(1.08)]
    names = [r.name for r in report.check_targets(_target_rows(1.08) + bf16)]
    assert "[float32, 20% of peak live] umrt >= 3.06x um (geomean)" in names
    assert "[bfloat16, 20% of peak live] umrt >= 3.06x um (geomean)" in names


def test_results_from_before_the_footprint_base_read_as_peak(tmp_path):
    path = tmp_path / "old.json"
    report.write_json(_target_rows(1.08), path)  # rows without budget_base, as older runs wrote them
    rows = report.load_rows(path)
    assert "Budget = % of the trace's peak live bytes." in report.markdown_table(rows)


# -- what a user meets (issue 22) --------------------------------------------------------------


@pytest.mark.parametrize("flag, under", [("--out", "out"), ("--json", "r.json"), ("--csv", "r.csv"),
                                          ("--md", "r.md"), ("--plots", "plots")])
def test_output_paths_are_checked_before_the_grid_runs(flag, under, tmp_path, capsys, monkeypatch):
    """An output that cannot be written fails in one line at once, not after the grid (minutes)."""
    import bench.cli

    monkeypatch.setattr(bench.cli, "run_grid", lambda *a, **k: pytest.fail("the grid ran"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["--models", "gpt2", "--out", str(tmp_path / "ok")]
    assert main([*argv, flag, str(blocker / under)]) == 2
    err = capsys.readouterr().err
    assert err == f"bench: error: cannot write '{blocker / under}': '{blocker}' is a file, not a directory\n"


def test_an_unwritable_system_path_is_refused_before_the_grid(capsys, monkeypatch):
    import bench.cli

    monkeypatch.setattr(bench.cli, "run_grid", lambda *a, **k: pytest.fail("the grid ran"))
    assert main(["--out", "/proc/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench: error: cannot write '/proc/x") and err.count("\n") == 1


def test_progress_when_piped(monkeypatch, capsys):
    """Not a terminal (a log, `| tee`): one line per finished cell on stderr, as it finishes."""
    fake_profiles(monkeypatch)
    run_grid(GRID, progress=True, trace_fn=fake_trace, simulate=fake_simulate)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 8 and lines[0].startswith("bench: [1/8] m1 v100-pcie3-32g 20% ideal (")
    assert lines[-1].startswith("bench: [8/8] m1 v100-pcie3-32g 50% oracle (")


def test_the_default_grid_has_a_umrt_column():
    assert "umrt" in preset("default").policies
    assert "umrt" in build_parser().format_help().split("default  ")[1].split("readme")[0]


def test_the_ideal_column_is_the_same_whatever_policies_run(monkeypatch):
    """The same cell's ideal (ms) is the figure every slowdown is divided by, with or without the
    ideal policy in the grid (it was the ideal policy's own time when it ran: 233.1 vs 232.7 ms)."""
    fake_profiles(monkeypatch)

    def simulate(trace, policy, profile, budget, iterations, budget_base="footprint"):
        result = fake_simulate(trace, policy, profile, budget, iterations)
        if policy.name == "ideal":  # the ideal policy pays a little more than the compute-only floor
            result.data["iteration_time_s"] = 0.1002
        return result

    def ideal_ms(policies):
        grid = Grid(models=("m1",), budgets=("20%",), profiles=("p",), policies=policies)
        md = report.markdown_table(run_grid(grid, progress=False, trace_fn=fake_trace, simulate=simulate))
        row = next(line for line in md.splitlines() if line.startswith("| m1 |"))
        return row.split("|")[6].strip()

    assert ideal_ms(("um",)) == ideal_ms(("ideal", "um")) == "100.0"


def test_the_gpu_checks_keep_to_their_deadline_and_name_what_they_skipped(tmp_path):
    """``bench/gpu_checks.sh`` must fit a lent GPU's command limit: with no time left it runs
    nothing and says, per check in its order, that it skipped it; a wrong stage is refused."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECKS_SECONDS": "0", "PYTHON": "false"}
    done = subprocess.run(["bash", "bench/gpu_checks.sh", "all"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    names = [line.split(":")[0] for line in lines]
    assert names == ["doctor", "um_micro_4", "loop_plain", "loop_umrt", "bench_gpu", "pytest_gpu", "copy_wait",
                     "remote_write", "bench_gpu_engines"]
    assert all("skipped" in line for line in lines), lines
    failing = subprocess.run(["bash", "bench/gpu_checks.sh"], cwd=root, env={**env, "GPU_CHECKS_SECONDS": "120"},
                             capture_output=True, text=True, timeout=60)  # (every command fails at once)
    summary = (tmp_path / "summary.txt").read_text()
    assert failing.returncode == 0 and "loop_plain: rc=1" in summary, summary
    assert "loop losses: none from the plain run" in summary  # never "equal" with no losses to compare
    bad = subprocess.run(["bash", "bench/gpu_checks.sh", "everything"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_the_gpu_probes_say_in_one_line_that_they_need_a_gpu(capsys):
    """Without a GPU (CI), each probe ``bench/gpu_checks.sh`` runs exits 2 with one line, never a traceback."""
    from conftest import gpu_available

    from bench import copy_wait, remote_write

    if gpu_available():
        pytest.skip("a GPU is here: the probes would run")
    for probe in (copy_wait, remote_write):
        assert probe.main([]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"bench.{probe.__name__.split('.')[-1]} needs ") and err.count("\n") == 1, err
