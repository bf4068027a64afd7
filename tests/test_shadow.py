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


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[int, str, list[str]]:
    """One shadow run of SCRIPT (5 steps, v100-pcie3-32g, 30%), read by several tests: its exit
    status, what the script printed, the report's lines."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("shadow") / "train.py"
    path.write_text(SCRIPT)
    lines: list[str] = []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = run_shadow(str(path), ["5"], profile="v100-pcie3-32g", gpu_memory="30%", out=lines.append)
    return rc, printed.getvalue(), lines


def test_reports_what_the_gpu_would_have_done(report):
    rc, printed, lines = report
    assert rc == 0
    assert "trained 5" in printed  # the script really ran
    text = "\n".join(lines)
    assert "SIMULATED" in text and "v100-pcie3-32g" in text
    for row in ("ideal", "um", "oracle", "umrt"):
        assert f"│ {row} " in text
    assert "faster than plain Unified Memory" in text
    assert "prefetched" in text and "discarded" in text


def test_the_report_explains_every_term(report):
    """A first-time reader understands every line without the source (issue 14): what was
    measured and what simulated, each row and column, where umrt stands in plain words,
    decision points, and that a deviation is not an error."""
    lines = report[2]
    text = " ".join("\n".join(lines).split())  # rich wraps long lines
    assert "Measured on this machine" in text and "they are not GPU times" in text
    assert "nothing ran on a GPU" in text
    for term in ("ideal:", "um:", "oracle:", "replay =", "live =", "H2D / D2H:", "faults:", "evictions:"):
        assert term in text, term
    assert re.search(r"In plain words: umrt is [\d.]+x slower than a GPU with enough memory, and [\d.]+x "
                     r"(faster|slower) than plain Unified Memory", text)
    assert "decision points (the places in an iteration where it acts" in text
    assert re.search(r"Deviations: \d+ — ", text) and ("Not an error" in text or "Deviations: 0" in text)


VARYING = textwrap.dedent(
    """
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                  for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(16):
        x = torch.randn(8, 40 + 8 * step, 64)  # another length every step, none twice
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 8 == 3:
            model.eval()
            with torch.no_grad():
                model(torch.randn(8, 40, 64))
            model.train()
    """
)


def test_a_loop_whose_shapes_never_repeat_is_told_so_and_counts_its_evaluation_batches(tmp_path):
    """A step of another length every time: no plan learned on one fits the next. The report
    says umrt rested those steps (ran them as plain Unified Memory, unrecorded) instead of
    telling the user to run more steps to see it act, and counts training iterations and
    evaluation batches apart."""
    path = tmp_path / "varying.py"
    path.write_text(VARYING)
    lines: list[str] = []
    assert run_shadow(str(path), [], profile="h100-pcie5-80g", gpu_memory="50%", out=lines.append) == 0
    text = " ".join("\n".join(lines).split())
    assert "the script ran 18 iterations (16 training, 2 evaluation batches) on the CPU" in text
    assert "did not act in this run: the shapes of its iterations never repeated" in text, text
    assert re.search(r"ran \d+ as plain Unified Memory, not recorded", text)
    assert re.search(r"\d+ rested \(their shapes never repeated", text) and "run more training steps" not in text


def test_script_exit_status_is_passed_on(script):
    rc = run_shadow(str(script), ["2", "3"], profile="h100-pcie5-80g", out=lambda s: None)
    assert rc == 3


def test_steps_stops_the_script_early(script, capsys):
    lines: list[str] = []
    rc = run_shadow(str(script), ["50"], profile="h100-pcie5-80g", steps=2, out=lines.append)
    assert rc == 0
    assert "trained" not in capsys.readouterr().out
    text = "\n".join(lines)
    assert "the script ran 2 training iterations on the CPU" in text
    assert re.search(r"│ umrt +│ live, learning ", text)  # the steps run were simulated live: umrt still learned
    assert "umrt did not act in this run" in " ".join(text.split()) and "faster than plain" not in text


def test_no_training_step(tmp_path):
    path = tmp_path / "noop.py"
    path.write_text("print('nothing to train')\n")
    lines: list[str] = []
    with pytest.raises(ConfigError, match="the script made no optimizer step: shadow mode simulates a training"):
        run_shadow(str(path), [], profile="h100-pcie5-80g", out=lines.append)
    assert lines == []  # no table, no legend


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"script": "does/not/exist.py"}, "not found"),
        ({"gpu_memory": "lots"}, "not a memory amount"),
        ({"gpu_memory": "90%device"}, "a simulated GPU has no memory but its budget"),
        ({"plot": "/proc/nowhere/p.png"}, "cannot write"),
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
@pytest.mark.parametrize("swap_copy", ["sm", "engines"])
def test_the_embedded_example_runs_end_to_end(capsys, monkeypatch, swap_copy):
    """The README's main job, on a machine that reports a CUDA GPU (as the H100 one did):
    the example trains on the CPU, and that is what is simulated."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("UMRT_SWAP_COPY", swap_copy)
    example = Path(__file__).resolve().parents[1] / "examples" / "train_gpt2.py"
    lines: list[str] = []
    rc = run_shadow(str(example), ["--steps", "6"],
                    profile="h100-pcie5-80g", gpu_memory="20%", out=lines.append)
    assert rc == 0
    assert "step 5: loss" in capsys.readouterr().out
    text = "\n".join(lines)
    assert re.search(r"│ umrt +│ live ", text)
    # 2 learned, then acted on, checked launch by launch while the runtime times its swapping plan
    # against page migration (PathTrial): 6 steps end before it trusts a plan and stops recording
    assert re.search(r"then acted on 4 \(0 of them without recording ops", " ".join(text.split())), text
    assert re.search(r"Iterations: 2 learned \(0, 1\); 0 recovered after leaving a plan", " ".join(text.split()))
    # the swapping plan's trial iterations moved live tensors: the report says with what (SM copies,
    # the default: at rates assumed; the copy engines: as the H200 measured them)
    said = {"sm": r"With its SM copy kernel it copied [\d.]+ MiB of live tensors .* at rates assumed, not yet measured",
            "engines": r"Through the copy engines it copied [\d.]+ MiB of live tensors .* as an H200's timeline showed"}
    assert re.search(said[swap_copy], " ".join(text.split())), text


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


# -- one footprint, defined; the memory-savings table (issue 22) -----------------------------

SIZE = r"\d+\.\d (?:KiB|MiB|GiB)"


def test_the_report_defines_the_footprint_and_shows_one_peak_live(report):
    from umrt.sim.budget import FOOTPRINT_DEFINITION, PEAK_LIVE_DEFINITION

    lines = report[2]
    text = " ".join("\n".join(lines).split())
    assert " ".join(FOOTPRINT_DEFINITION.split()) in text and " ".join(PEAK_LIVE_DEFINITION.split()) in text
    assert len(set(re.findall(rf"footprint ({SIZE})", text))) == 1  # one footprint
    assert len(set(re.findall(rf"peak live ({SIZE})", text))) == 1  # one peak live figure
    assert re.search(rf"whose memory is {SIZE} = 30% of the footprint {SIZE} \(peak live {SIZE}\)", text)
    # the ideal row: nothing moves, as its legend says (over the whole run: only first touches fault)
    assert re.search(r"│ ideal +│ replay +│ +[\d.,]+ ms │ +1\.00x │ +[\d.]+ ms │ +1\.00x │ +0 B │ +0 B │ +[\d,]+ │ +0 │",
                     "\n".join(lines))


def test_the_memory_savings_table(report):
    """Beside the run's own GPU memory, um's and umrt's step / ideal at 100, 75, 50, 33 and 25% of the
    footprint, from the same recording; the run's own row repeats the main table's figures."""
    lines = report[2]
    text = "\n".join(lines)
    assert "How much GPU memory can this run save, at what cost? (SIMULATED)" in text
    rows = re.findall(rf"│ +({SIZE}) │ +(\d+)%( \(this run\))? │ +([\d.]+)x │ +([\d.]+)x │", text)
    assert [(pct, bool(own)) for _, pct, own, _, _ in rows] == [
        ("100", False), ("75", False), ("50", False), ("33", False), ("30", True), ("25", False)]
    um = {pct: float(x) for _, pct, _, x, _ in rows}
    # Everything fits at 100%: once the first steps have touched every page, plain UM runs as ideal
    # (the steady steps leave out the run's first, where the first touches fault, even in a run
    # shorter than umrt's warm-up: steady_skip).
    assert um["100"] == 1.0 < min(um[p] for p in um if p != "100")
    main_um = re.search(r"│ um +│ replay +│ +[\d.,]+ ms │ +[\d.]+x │ +[\d.]+ ms │ +([\d.]+)x", text).group(1)
    main_umrt = re.search(r"│ umrt +│ live +│ +[\d.,]+ ms │ +[\d.]+x │ +[\d.]+ ms │ +([\d.]+)x", text).group(1)
    own = next(r for r in rows if r[2])
    assert (own[3], own[4]) == (main_um, main_umrt)


def test_a_savings_cell_that_failed_says_why(tmp_path):
    """A run too small for the simulator's shares: its cells say "failed" and a line says why."""
    path = tmp_path / "tiny.py"
    path.write_text(textwrap.dedent("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        opt = torch.optim.Adam(model.parameters())
        for _ in range(4):
            torch.nn.functional.cross_entropy(model(torch.randn(64, 64)), torch.randint(0, 10, (64,))).backward()
            opt.step()
            opt.zero_grad()
        """))
    lines: list[str] = []
    assert run_shadow(str(path), [], profile="h100-pcie5-80g", gpu_memory="50%", out=lines.append) == 0
    text = "\n".join(lines)
    failed = re.findall(rf"│ +({SIZE}) │ +(\d+)% │ +failed │ +failed │", text)
    assert failed and all(int(pct) < 50 for _, pct in failed)
    for size, _ in failed:
        assert re.search(rf"At {re.escape(size)}, um and umrt failed: GPU memory budget \d+ bytes is below one 2 MB block",
                         text)


@pytest.mark.slow
def test_on_a_small_model_the_guard_stops_acting_where_acting_loses(capsys):
    """README, "Small models lose to plain Unified Memory while umrt finds out": on
    examples/train_small_checkpointed.py umrt's acting steps are slower than doing nothing, and
    the report says the guard stopped acting for training steps."""
    script = Path(__file__).resolve().parents[1] / "examples" / "train_small_checkpointed.py"
    lines: list[str] = []
    assert run_shadow(str(script), [], profile="h100-pcie5-80g", gpu_memory="50%", out=lines.append) == 0
    text = " ".join(" ".join(lines).split())
    stopped = re.search(r"umrt stopped acting in training steps: its last \d+ train iterations acting took "
                        r"([\d.]+)x the time of an iteration held back doing nothing", text)
    assert stopped and float(stopped.group(1)) > 1.05, text[-2000:]
    assert "step 7: loss" in capsys.readouterr().out  # the script ran its 8 steps


@pytest.mark.slow
def test_a_gan_whose_steps_take_turns_runs_faster_than_plain_unified_memory():
    """examples/train_gan.py: a discriminator step and a generator step in strict turns. The
    pool's plan of one of the two shapes missed every other step, and took the other's places
    too: umrt's whole run was 1.17x slower than plain UM's (169.47 against 144.46 ms,
    SIMULATED) and its guard stopped acting. Served as a caching allocator serves them, its
    steps keep their addresses two by two and acting pays (118.36 ms)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "train_gan.py"
    lines: list[str] = []
    assert run_shadow(str(script), [], profile="h100-pcie5-80g", gpu_memory="50%", out=lines.append) == 0
    text = " ".join(" ".join(lines).split())
    said = re.search(r"and ([\d.]+)x (faster|slower) than plain Unified Memory over the whole run \(24 iterations", text)
    assert said and said.group(2) == "faster", text[-2000:]
    assert "umrt stopped acting" not in text


@pytest.mark.slow
def test_k_fold_training_where_all_fits_runs_no_slower_than_plain_unified_memory():
    """examples/train_kfold.py (a new model and optimizer per fold) with all of its footprint:
    the pool placed each fold's model beside the memory the last one emptied, planned for
    twice what fits, and umrt's whole run took 74.92 ms against plain UM's 24.90; the oracle's
    replay lost data (SIMULATED)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "train_kfold.py"
    lines: list[str] = []
    assert run_shadow(str(script), ["--folds", "2"], profile="h100-pcie5-80g", gpu_memory="100%",
                      out=lines.append) == 0
    text = " ".join(" ".join(lines).split())
    said = re.search(r"and ([\d.]+)x (faster|slower) than plain Unified Memory over the whole run", text)
    assert said and said.group(2) == "faster", text[-2000:]
    assert "replay failed" not in text


def test_after_the_optimizer_is_swapped_for_a_smaller_one_steps_that_fit_move_nothing(tmp_path):
    """Adam for a warm-up, then SGD with momentum: the optimizer state halves and the steps fit
    the GPU. The runtime judged whether a learned step fits by the most its layout had ever
    held (Adam's), so the SGD steps' plan moved data that had room: a steady step of 0.83 ms
    against plain UM's 0.21 (SIMULATED, 50%). It judges by what the learned step held."""
    path = tmp_path / "switch.py"
    path.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
        "for step in range(16):\n"
        "    if step == 6:\n"
        "        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)\n"
        "    loss = F.cross_entropy(model(torch.randn(128, 256)), torch.randint(0, 10, (128,)))\n"
        "    opt.zero_grad(set_to_none=True)\n"
        "    loss.backward()\n"
        "    opt.step()\n")
    lines: list[str] = []
    assert run_shadow(str(path), [], profile="h100-pcie5-80g", gpu_memory="50%", out=lines.append) == 0
    text = " ".join(" ".join(lines).split())
    said = re.search(r"Training steps \(steady\): umrt ([\d.]+) ms against um's ([\d.]+) ms", text)
    assert said and float(said.group(1)) <= 1.15 * float(said.group(2)), text[-1500:]


def test_a_run_shorter_than_the_warm_up_is_steady_after_the_learning():
    """The steady figures leave out the live policy's warm-up; a run no longer than that leaves
    out the iterations it learned in (and always the run's first), and the report says so."""
    from umrt.phase_report import steady_skip

    assert steady_skip(20, 9, [0, 1]) == (9, "")
    skip, note = steady_skip(6, 9, [0, 1])
    assert skip == 2 and "not longer than the live policy's warm-up of 9 iterations" in note
    assert steady_skip(6, 9, [0, 1, 2, 5])[0] == 3  # its first learning only: 5 came later
    assert steady_skip(6, 0, [])[0] == 1  # the run's first is set-up's: every first touch
    skip, note = steady_skip(2, 9, [0, 1])
    assert skip == 2 and "No iteration came after" in note


def test_a_short_run_reports_the_iterations_after_its_learning(report):
    """The 5-step script: umrt learns from 2 iterations, so the steady figures are those of
    the 3 after them, not of every iteration (the learning ones included)."""
    text = " ".join("\n".join(report[2]).split())
    assert re.search(r"training step \(steady\) │ 3 of 5 │", text), text
    assert "after the run's first 2 iterations" in text
    assert "not longer than the live policy's warm-up" in text


def test_a_plot_when_asked(script, tmp_path):
    plot = tmp_path / "savings.png"
    run_shadow(str(script), ["5"], profile="v100-pcie3-32g", gpu_memory="30%", out=lambda s: None, plot=str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000


def test_one_training_step_is_a_clear_error(script):
    with pytest.raises(ConfigError, match="the script made 1 training step: .* needs at least 2"):
        run_shadow(str(script), ["1"], profile="h100-pcie5-80g", out=lambda s: None)


def test_a_loop_that_updates_its_weights_by_hand_is_told_what_a_step_is(tmp_path, capsys):
    """A tutorial-style loop with no torch.optim (``p -= lr * p.grad``) trains, and umrt sees no
    step: the one line says where umrt finds one and what to change."""
    from umrt.cli import main

    path = tmp_path / "by_hand.py"
    path.write_text("import torch\n"
                    "w = torch.randn(64, 64, requires_grad=True)\n"
                    "for _ in range(3):\n"
                    "    (torch.randn(8, 64) @ w).square().mean().backward()\n"
                    "    with torch.no_grad():\n"
                    "        w -= 0.1 * w.grad\n"
                    "        w.grad = None\n")
    assert main(["run", "--simulate", "h100-pcie5-80g", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("umrt: error: the script made no optimizer step") and err.count("\n") == 1
    assert "by hand (p -= lr * p.grad) makes none; step a torch.optim optimizer" in err


def test_a_script_umrt_cannot_record_runs_to_its_end_and_is_told_so(tmp_path, capsys, monkeypatch):
    """A failure of the recorder's own (planted: the 40th op it records) ends the recording,
    never the script: the script prints every step, and umrt says in one line what stopped it
    and that it is umrt's limit (it raised into the script before)."""
    from umrt.capture.recorder import Recorder
    from umrt.cli import main

    record, calls = Recorder._record, []

    def planted(self, *args):
        calls.append(1)
        if len(calls) == 40:
            raise NotImplementedError("Cannot access storage of PlantedTensorImpl")
        return record(self, *args)

    monkeypatch.setattr(Recorder, "_record", planted)
    path = tmp_path / "train.py"
    path.write_text("import torch\n"
                    "m = torch.nn.Linear(32, 32)\n"
                    "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                    "for i in range(4):\n"
                    "    m(torch.randn(8, 32)).square().mean().backward()\n"
                    "    opt.step()\n"
                    "    opt.zero_grad()\n"
                    "    print('step', i)\n")
    assert main(["run", "--simulate", "h100-pcie5-80g", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out.splitlines()[:4] == ["step 0", "step 1", "step 2", "step 3"]
    assert out.err.startswith("umrt: error: umrt could not record the script (NotImplementedError: Cannot access "
                              "storage of PlantedTensorImpl (recording aten::")
    assert "ran on to its end unrecorded, and nothing was simulated" in out.err and out.err.count("\n") == 1


def test_a_script_with_no_training_loop_exits_2_with_one_line(tmp_path, capsys):
    from umrt.cli import main

    path = tmp_path / "noop.py"
    path.write_text("print('nothing to train')\n")
    assert main(["run", "--simulate", "h100-pcie5-80g", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "nothing to train\n"  # the script's own output, and no table
    assert out.err.startswith("umrt: error: the script made no optimizer step") and out.err.count("\n") == 1


def test_the_two_paths_give_one_footprint(script, tmp_path, capsys, monkeypatch):
    """`umrt trace` then `umrt simulate`, and `umrt run --simulate`, on the same script and GPU memory:
    one recording, one footprint, one budget in bytes (and the same peak live)."""
    from umrt.cli import main

    monkeypatch.delenv("UMRT_GPU_MEMORY", raising=False)
    monkeypatch.delenv("UMRT_SIMULATE", raising=False)
    trace = tmp_path / "t.umrt"
    assert main(["trace", "-q", "--steps", "5", "-o", str(trace), "--", "python", str(script), "5"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(trace), "--profile", "h100-pcie5-80g", "--gpu-memory", "20%"]) == 0
    simulated = capsys.readouterr().out
    assert main(["run", "--simulate", "h100-pcie5-80g", "--gpu-memory", "20%", str(script), "5"]) == 0
    shadow = " ".join(capsys.readouterr().out.split())
    memory, share = re.search(rf"│ GPU memory +│ +({SIZE}) = (20% of the footprint) │", simulated).groups()
    footprint = re.search(rf"│ footprint +│ +({SIZE}) │", simulated).group(1)
    peak = re.search(rf"│ peak live +│ +({SIZE}) │", simulated).group(1)
    assert f"whose memory is {memory} = {share} {footprint} (peak live {peak})" in shadow
    assert set(re.findall(rf"footprint ({SIZE})", shadow)) == {footprint}


def test_the_live_feed_is_told_what_the_optimizer_step_says(monkeypatch):
    """As the live bridge hints parameters, gradients and optimizer state at each optimizer step,
    drive_live hints the objects the finished trace knows better, before the next boundary, once."""
    import umrt.shadow as shadow
    from umrt.hardware import load_profile
    from umrt.policy.baselines import UMPolicy
    from umrt.trace.events import Alloc, Free, IterationBoundary, Kind

    told = []

    class Listening(UMPolicy):
        def hint_kind(self, obj, kind):
            told.append((obj, kind, len(seen)))

        def on_event(self, ev):
            seen.append(ev)
            super().on_event(ev)

    seen: list = []
    monkeypatch.setattr(shadow, "make_policy", lambda name: Listening())
    mib = 1 << 20
    events = [IterationBoundary(0), Alloc(1, 4 * mib, Kind.ACTIVATION), Alloc(2, 4 * mib, Kind.TEMPORARY),
              Alloc(3, 4 * mib, Kind.TEMPORARY), Free(3), IterationBoundary(1), IterationBoundary(2)]
    kinds = {1: Kind.PARAMETER, 2: Kind.OPTIMIZER_STATE, 3: Kind.GRADIENT}
    run = shadow.drive_live(events, "um", load_profile("h100-pcie5-80g"), 64 * mib, kinds)
    assert run.error is None
    # objects 1 and 2, before the boundary that ends the step (5 events seen); 3 died before it
    assert told == [(1, Kind.PARAMETER, 5), (2, Kind.OPTIMIZER_STATE, 5)]
