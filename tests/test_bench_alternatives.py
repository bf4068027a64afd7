"""bench.alternatives: the table of umrt beside activation checkpointing (its labels and notes)."""
import json
from pathlib import Path

import pytest

from bench.alternatives import CHECKPOINTING, TIGHT, Row, main, table

EVIDENCE = Path(__file__).resolve().parents[1] / ".." / "shared" / "gpu-evidence" / "alternatives.jsonl"


def _row(model="gpt2", dtype="float32", budget="45%", umrt=2.0, bound=1.2, ckpt=1.27, engines=3.5):
    return Row(model, 8, 1024, dtype, budget, 1.0, umrt, bound, ckpt, engines_s=engines)


def test_ratios_and_labels():
    r = _row()
    assert r.umrt_ratio == 2.0 and r.bound_ratio == 1.2 and r.to_bound == pytest.approx(2.0 / 1.2)
    assert r.engines_ratio == 3.5 and r.to_json()["engines_over_ideal"] == 3.5
    text = table([r, _row(budget=TIGHT, ckpt=None)])
    assert "SIMULATED" in text and "MEASURED" in text
    assert "| 2.00x | 3.50x | 1.20x | 1.67 | 1.27x |" in text
    assert "copy engines" in text and "assumed, not measured" in text  # the SM copies' column says what it rests on
    assert "below checkpointing's own peak" in text  # the tight budget: checkpointing cannot go there


def test_a_bound_above_checkpointing_is_said():
    r = _row(umrt=3.0, bound=1.5, ckpt=1.27)
    assert r.bound_above_checkpointing
    assert "the bound is above checkpointing" in table([r])
    assert not _row(bound=1.1).bound_above_checkpointing
    assert not _row(bound=9.0, ckpt=None).bound_above_checkpointing  # nothing measured to compare


def test_an_error_is_a_row_not_a_traceback():
    r = Row("bert-large", 32, 512, "bfloat16", TIGHT, 1.0, float("nan"), float("nan"), None, error="too small")
    assert "too small" in table([r])


@pytest.mark.skipif(not EVIDENCE.exists(), reason="the H100 evidence is not beside this checkout")
def test_checkpointing_figures_are_the_measured_ones():
    runs = {(d["model"], d["mode"]): d for d in map(json.loads, EVIDENCE.read_text().splitlines())}
    for model, ck in CHECKPOINTING.items():
        plain, ckpt = runs[(model, "plain")], runs[(model, "checkpoint")]
        assert ck["step_ratio"] == pytest.approx(ckpt["steady_ms"] / plain["steady_ms"])
        assert ck["peak_fraction"] == pytest.approx(ckpt["peak_bytes"] / plain["peak_bytes"])
        # the budget the table gives checkpointing's cell is its measured peak, to the percent
        assert float(ck["budget"].rstrip("%")) / 100 == pytest.approx(ck["peak_fraction"], abs=0.01)


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--models", "resnet"])
    assert "invalid choice" in capsys.readouterr().err


def test_budgets_are_percentages_of_the_peak_and_a_bad_one_is_one_line(capsys, monkeypatch):
    from bench import alternatives

    assert alternatives.budget_percent("45%") == 45.0
    for bad in ("45", "0%", "120%", "x%", ""):
        with pytest.raises(ValueError, match="percentage of the trace's peak"):
            alternatives.budget_percent(bad)
    with pytest.raises(SystemExit):
        main(["--budgets", "45"])
    assert "such as 45%" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(alternatives, "rows", lambda models, dtypes, budgets=None: seen.update(budgets=budgets) or [])
    assert main(["--models", "gpt2", "--budgets", "40%", "50%"]) == 0
    assert seen["budgets"] == ("40%", "50%")


def test_a_budget_under_checkpointings_peak_says_checkpointing_cannot_go_there():
    assert "below checkpointing's own peak" in table([_row(budget="40%", ckpt=None)])  # gpt2's peak: 45%
    assert "below checkpointing's own peak" not in table([_row(budget="50%", ckpt=None)])
