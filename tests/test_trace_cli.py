"""`umrt trace`: zoo and script recording, `trace info`, and clean errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from umrt.cli import main
from umrt.trace import fileformat

TINY = "hf:GPT2Config:n_layer=1,n_embd=32,n_head=2,vocab_size=128,n_positions=32"

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    assert sys.argv[1:] == ["--lr", "0.1"], sys.argv
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    for i in range(1000):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    raise SystemExit("should have been stopped after the requested steps")
    """
)


def test_trace_zoo_then_info_json(tmp_path, capsys):
    out = tmp_path / "g.umrt"
    assert main(["trace", "--model", TINY, "--batch", "2", "--seq", "8", "--steps", "2", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["trace", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in (
        "ops_per_iteration",
        "iterations",
        "objects",
        "peak_live_bytes",
        "end_live_bytes",
        "flops_per_iteration",
        "bytes_by_kind",
    ):
        assert key in info
    assert info["iterations"] == 2 and info["header"]["meta"]["batch"] == 2
    assert all(isinstance(v, int) for v in info["bytes_by_kind"].values())
    assert info["peak_live_bytes"] >= info["end_live_bytes"] > 0
    assert main(["trace", "info", str(out)]) == 0
    assert "launches / iteration" in capsys.readouterr().out


def test_trace_script(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "s.umrt"
    monkeypatch.chdir(tmp_path)
    rc = main(
        [
            "trace",
            "-o",
            str(out),
            "--steps",
            "2",
            "--device",
            "cpu",
            "--",
            "python",
            str(script),
            "--lr",
            "0.1",
        ]
    )
    assert rc == 0, capsys.readouterr()
    tr = fileformat.load(out)
    assert tr.header.iterations == 2 and tr.header.device == "cpu"
    kinds = {e.kind.name for e in tr.events if type(e).__name__ == "Alloc"}
    assert {"PARAMETER", "GRADIENT", "OPTIMIZER_STATE"} <= kinds


def test_trace_script_that_fails(tmp_path, capsys):
    script = tmp_path / "bad.py"
    script.write_text("raise ValueError('boom')\n")
    assert main(["trace", "-o", str(tmp_path / "x.umrt"), "--", "python", str(script)]) == 1
    assert "boom" in capsys.readouterr().err


def test_trace_script_without_steps(tmp_path, capsys):
    script = tmp_path / "nostep.py"
    script.write_text("import torch\nx = torch.ones(3) * 2\n")
    assert main(["trace", "-o", str(tmp_path / "x.umrt"), "--", str(script)]) == 2
    assert "no complete iteration" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["trace"], "nothing to trace"),
        (["trace", "--model", "nosuch"], "unknown model"),
        (["trace", "--model", TINY, "--steps", "0"], "--steps"),
        (["trace", "-o", "x.umrt", "--", "python", "missing_script.py"], "script not found"),
        (["trace", "--model", TINY, "--", "x.py"], "not both"),
        (["trace", "--batch", "2", "--", "x.py"], "--model only"),
        (["trace", "--model", TINY, "-o", "/no/such/dir/t.umrt"], "does not exist"),
    ],
)
def test_bad_arguments(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "not found"),
        (b"", "not a umrt trace"),
        (b"hello world, definitely not a trace", "magic"),
    ],
)
def test_info_bad_files(tmp_path, capsys, content, match):
    p = tmp_path / "t.umrt"
    if content is not None:
        p.write_bytes(content)
    assert main(["trace", "info", str(p)]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_info_truncated_and_corrupt(tmp_path, capsys):
    from umrt.zoo import trace_model

    data = fileformat.encode(trace_model(TINY, batch=1, seq=4, steps=1))
    cases = {
        "cut.umrt": (data[: len(data) // 2], "truncated"),
        "flip.umrt": (data[:-8] + bytes(b ^ 0x55 for b in data[-8:]), "corrupt"),
    }
    for name, (blob, match) in cases.items():
        (tmp_path / name).write_bytes(blob)
        assert main(["trace", "info", str(tmp_path / name)]) == 2
        assert match in capsys.readouterr().err


def test_small_trace_file_size_is_not_zero_mib(tmp_path, capsys):
    out = tmp_path / "tiny.umrt"
    assert main(["trace", "--model", TINY, "--batch", "1", "--seq", "4", "--steps", "1", "-o", str(out)]) == 0
    line = capsys.readouterr().out
    size = out.stat().st_size
    assert size < 2**20, size  # a KiB-sized file: the point of this test
    assert f"{size / 1024:.1f} KiB file" in line and "0.0 MiB" not in line, line
