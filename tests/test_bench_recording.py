"""bench.recording: the four ways per model, in the JSON and the printed line."""
from __future__ import annotations

import json

from bench import recording

TINY = "hf:GPT2Config:n_layer=1"  # --models splits on commas: one key only


def test_rows_carry_the_hooks_only_way(tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert recording.main(["--models", TINY, "--seq", "16", "--steps", "1", "--repeat", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["launches_per_step"] > 0 and row["trace_events"] > row["launches_per_step"]
    for way in ("plain", "mode", "recorder", "hooks"):
        assert row[f"{way}_s_per_step"] > 0
    for way in ("mode", "recorder", "hooks"):  # one normalisation for all three
        per_launch = (row[f"{way}_s_per_step"] - row["plain_s_per_step"]) / row["launches_per_step"] * 1e6
        assert abs(row[f"{way}_us_per_launch"] - per_launch) < 1e-6
    assert "hooks only (ops suspended)" in capsys.readouterr().out


def test_an_unknown_model_is_a_clean_error(tmp_path, capsys):
    assert recording.main(["--models", "no-such-model", "--out", str(tmp_path / "x.json")]) == 2
    assert "bench.recording: error:" in capsys.readouterr().err
