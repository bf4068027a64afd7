"""Shadow mode: a real PyTorch script, the runtime driving a simulated GPU."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from umrt.errors import ConfigError
from umrt.shadow import run_shadow

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU())
                                  for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for step in range(steps):
        x = torch.randn(128, 512)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print("trained", steps)
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    """
)


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_reports_what_the_gpu_would_have_done(script, capsys):
    lines: list[str] = []
    rc = run_shadow(str(script), ["5"], profile="v100-pcie3-32g", gpu_memory="30%", out=lines.append)
    assert rc == 0
    assert "trained 5" in capsys.readouterr().out  # the script really ran
    text = "\n".join(lines)
    assert "SIMULATED" in text and "v100-pcie3-32g" in text
    for row in ("ideal", "um", "oracle", "umrt"):
        assert f"│ {row} " in text
    assert "faster than plain Unified Memory" in text
    assert "prefetched" in text and "discarded" in text


def test_the_report_explains_every_term(script):
    """A first-time reader understands every line without the source (issue 14): what was
    measured and what simulated, each row and column, where umrt stands in plain words,
    decision points, and that a deviation is not an error."""
    lines: list[str] = []
    run_shadow(str(script), ["5"], profile="v100-pcie3-32g", gpu_memory="30%", out=lines.append)
    text = " ".join("\n".join(lines).split())  # rich wraps long lines
    assert "Measured on this machine" in text and "they are not GPU times" in text
    assert "nothing ran on a GPU" in text
    for term in ("ideal:", "um:", "oracle:", "replay =", "live =", "H2D / D2H:", "faults:", "evictions:"):
        assert term in text, term
    assert re.search(r"In plain words: umrt is [\d.]+x slower than a GPU with enough memory, and [\d.]+x "
                     r"(faster|slower) than plain Unified Memory", text)
    assert "decision points (the places in an iteration where it acts" in text
    assert re.search(r"Deviations: \d+ — ", text) and ("Not an error" in text or "Deviations: 0" in text)


def test_script_exit_status_is_passed_on(script):
    rc = run_shadow(str(script), ["2", "3"], profile="h100-pcie5-80g", out=lambda s: None)
    assert rc == 3


def test_steps_stops_the_script_early(script, capsys):
    lines: list[str] = []
    rc = run_shadow(str(script), ["50"], profile="h100-pcie5-80g", steps=2, out=lines.append)
    assert rc == 0
    assert "trained" not in capsys.readouterr().out
    assert re.search(r"│ umrt +│ live ", "\n".join(lines))  # the steps run were simulated live


def test_no_training_step(tmp_path):
    path = tmp_path / "noop.py"
    path.write_text("print('nothing to train')\n")
    lines: list[str] = []
    assert run_shadow(str(path), [], profile="h100-pcie5-80g", out=lines.append) == 0
    assert "no training iteration" in "\n".join(lines)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"script": "does/not/exist.py"}, "not found"),
        ({"gpu_memory": "lots"}, "invalid budget"),
        ({"profile": "no-such-gpu"}, "profile"),
        ({"policy": "oracle"}, "whole future"),
        ({"policy": "nope"}, "unknown policy"),
        ({"steps": 0}, "positive"),
    ],
)
def test_bad_input_is_a_clear_error(script, kwargs, match):
    args = {"script": str(script), "profile": "h100-pcie5-80g"}
    args.update(kwargs)
    script_path = args.pop("script")
    with pytest.raises(ConfigError, match=match):
        run_shadow(script_path, [], **args)


@pytest.mark.slow
def test_the_embedded_example_runs_end_to_end(capsys, monkeypatch):
    """The README's main job, on a machine that reports a CUDA GPU (as the H100 one did):
    the example trains on the CPU, and that is what is simulated."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    example = Path(__file__).resolve().parents[1] / "examples" / "train_gpt2.py"
    lines: list[str] = []
    rc = run_shadow(str(example), ["--steps", "6"],
                    profile="h100-pcie5-80g", gpu_memory="20%", out=lines.append)
    assert rc == 0
    assert "step 5: loss" in capsys.readouterr().out
    text = "\n".join(lines)
    assert re.search(r"│ umrt +│ live ", text)
    # 2 learned, 2 checked launch by launch, then the trusted plan runs as a live run would; the
    # last iteration holds the script's teardown (its frees after the last step): it leaves the plan
    assert re.search(r"then acted on 3 \(1 of them without recording ops", " ".join(text.split())), text
    assert re.search(r"Iterations: 2 learned \(0, 1\); 1 recovered after leaving a plan \(5\)", " ".join(text.split()))


# A tiny GPT-2 with attention and residual dropout on (transformers' defaults, p=0.1):
# every loss printed exactly, as hex.
LOSSES = textwrap.dedent(
    """
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=256, use_cache=False)
    model = GPT2LMHeadModel(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    for step in range(3):
        tokens = torch.randint(0, config.vocab_size, (2, 32))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print("loss", loss.item().hex())
    """
)


def test_shadow_mode_leaves_the_losses_exactly_as_a_plain_run(tmp_path, capsys):
    """Recording changes nothing the script computes: not its kernels, not its random stream."""
    from umrt.scripts import run_script

    path = tmp_path / "gpt2.py"
    path.write_text(LOSSES)
    assert run_script(str(path), []) == 0
    plain = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loss")]
    lines: list[str] = []
    assert run_shadow(str(path), [], profile="h100-pcie5-80g", gpu_memory="8MiB", out=lines.append) == 0
    shadow = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loss")]
    assert len(plain) == 3 and shadow == plain
    assert re.search(r"│ umrt +│ live ", "\n".join(lines))  # and it was simulated


def test_the_job_is_simulated_where_cuda_is_available(script, capsys, monkeypatch):
    """On a GPU machine a CPU script is still recorded on the CPU: the recorder follows
    the device the script uses, not the one the machine has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    lines: list[str] = []
    assert run_shadow(str(script), ["4"], profile="h100-pcie5-80g", gpu_memory="50%", out=lines.append) == 0
    text = "\n".join(lines)
    assert "nothing to simulate" not in text
    assert re.search(r"│ umrt +│ live ", text) and re.search(r"│ oracle +│ replay ", text)


def test_an_event_that_arrives_during_the_drivers_own_work_waits_its_turn():
    """A storage freed by Python's garbage collector while the driver is busy (here: while
    it replays the held first iteration) is handled after the event in hand, never before
    the held Alloc it frees."""
    from umrt.hardware import load_profile
    from umrt.policy import make_policy
    from umrt.shadow import ShadowSource
    from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch

    mib = 1 << 20
    policy = make_policy("um")
    driver = ShadowSource(policy, load_profile("h100-pcie5-80g"), "100%")
    on_event = policy.on_event
    fired = []

    def busy(ev):  # the policy's first event: a finalizer runs in the middle of it
        if not fired:
            fired.append(ev)
            driver(Free(1))
        on_event(ev)

    policy.on_event = busy
    w = Launch(0, 7, "aten::fill_.Scalar", (Access(0, 0, 4 * mib, True),), 0, 4 * mib)
    for ev in (IterationBoundary(0), Alloc(0, 4 * mib, Kind.ACTIVATION, 0), Alloc(1, 4 * mib, Kind.OTHER, -1), w,
               IterationBoundary(1), w, IterationBoundary(2)):
        driver(ev)
    assert fired and driver.error is None
    assert set(driver.driver.addresses) == {0}  # object 1 was freed, after its Alloc


# A shadow run in a fresh interpreter whose numba cache is NUMBA_CACHE_DIR, with Python's
# cyclic garbage collector off: whatever a reference cycle holds stays held (the worst
# case of when the collector runs). It prints the report, and how many numba compilations
# started while the script ran.
COLD_OR_WARM = textwrap.dedent(
    """
    import gc
    import sys

    gc.disable()
    from numba.core import event

    import umrt.scripts
    from umrt.shadow import run_shadow

    class Count(event.Listener):
        n = 0

        def on_start(self, ev):
            Count.n += 1

        def on_end(self, ev):
            pass

    run_script = umrt.scripts.run_script

    def counted(script, argv):
        with event.install_listener("numba:compile", Count()):
            return run_script(script, argv)

    umrt.scripts.run_script = counted
    run_shadow(sys.argv[1], ["5"], profile="h100-pcie5-80g", gpu_memory="30%", out=print)
    print("compilations while the script ran:", Count.n)
    """
)


@pytest.mark.slow
def test_a_cold_and_a_warm_compile_cache_give_the_same_report(script, tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cache = tmp_path / "numba-cache"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(root))

    def run() -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-c", COLD_OR_WARM, str(script)], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    cold, warm = run(), run()
    assert "compilations while the script ran: 0" in cold.stdout
    assert cold.stdout == warm.stdout
    assert "│ umrt " in cold.stdout
    # the compilation was announced, before the script, and only when there was one
    assert "umrt: compiling the simulator" in cold.stderr and "compiling" not in warm.stderr
    assert cold.stderr.index("compiling the simulator") < cold.stderr.index("simulator compiled in")
