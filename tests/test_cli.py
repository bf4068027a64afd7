"""The top-level CLI: every subcommand's --help renders (argparse formats help
strings with %, so a stray % crashes only when a user asks for help)."""
import os
import re
import sys

import pytest

from umrt.cli import SUBCOMMANDS, build_parser, main, plain_text


def test_every_subcommand_is_registered():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(SUBCOMMANDS)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: umrt " + command in capsys.readouterr().out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: umrt" in capsys.readouterr().out


#: reST inline markup that must not reach a terminal: ``literal``, :role:`target`, "Example::".
REST_MARKUP = r"``|:[a-z]+(:[a-z]+)?:`|\S::$"


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_help_has_no_rest_markup(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"] if command else ["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: umrt")
    assert not re.search(REST_MARKUP, text, re.MULTILINE), text


def test_plain_text_keeps_the_words():
    assert plain_text("* ``--simulate PROFILE`` (:func:`umrt.shadow.run_shadow`, :class:`~a.B`)") == \
        "* --simulate PROFILE (umrt.shadow.run_shadow, B)"
    assert plain_text("For example::\n\n    umrt run x.py\nuse `umrt trace`") == \
        "For example:\n\n    umrt run x.py\nuse `umrt trace`"


def test_gpu_memory_errors_name_the_flag_and_every_base(tmp_path, capsys, monkeypatch):
    """One vocabulary (issue 22): the error names the flag as the user wrote it and what each
    percentage is of, in shadow mode and live alike."""
    monkeypatch.delenv("UMRT_SIMULATE", raising=False)
    monkeypatch.delenv("UMRT_GPU_MEMORY", raising=False)
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    for argv in (["--simulate", "h100-pcie5-80g"], []):
        assert main(["run", *argv, "--gpu-memory", "banana", str(script)]) == 2
        err = capsys.readouterr().err
        assert err == ("umrt: error: --gpu-memory='banana' is not a memory amount; give a size ('12GiB', '500MB', "
                       "a byte count) or a percentage: '50%' of the footprint the run needs, '50%peak' of its peak "
                       "live bytes, '90%device' of the GPU's memory\n")


def test_one_size_parser_for_live_and_simulated_budgets():
    """UMRT_GPU_MEMORY=12G passed start-up validation and then failed in shadow mode."""
    from umrt.config import parse_amount, parse_size
    from umrt.sim.budget import parse_budget

    for text in ("12G", "12GiB", "500MB", "4194304"):
        assert parse_budget(text, 1) == parse_amount(text, "x").bytes == parse_size(text)
    assert parse_size("banana") is None


def test_shadow_mode_takes_its_budget_from_the_config(tmp_path, monkeypatch):
    """umrt.cli.run.shadow reads cfg.budget() (--gpu-memory, else UMRT_GPU_MEMORY, else the simulated
    default), not the environment."""
    import types

    from umrt.cli.run import shadow
    from umrt.config import SIMULATED_DEFAULT, Config

    seen = {}
    fake = types.ModuleType("umrt.shadow")
    fake.run_shadow = lambda script, argv, **kw: seen.update(kw) or 0
    monkeypatch.setitem(sys.modules, "umrt.shadow", fake)
    monkeypatch.delenv("UMRT_GPU_MEMORY", raising=False)
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert shadow(Config().replace(simulate="h100-pcie5-80g", gpu_memory="12G"), str(script), []) == 0
    assert seen["gpu_memory"].bytes == 12 << 30
    seen.clear()
    monkeypatch.setenv("UMRT_GPU_MEMORY", "30%")  # the Config given wins over a stray variable
    assert shadow(Config().replace(simulate="h100-pcie5-80g"), str(script), []) == 0
    assert str(seen["gpu_memory"]) == SIMULATED_DEFAULT == "50%"  # unset: the simulated default


# -- what a user sees (issue 22) -----------------------------------------------------------

RAISES = "def f():\n    raise ValueError('boom')\n\n\nf()\n"
SYNTAX = "x = (\n"
WAYS = {
    "run": lambda script, tmp: ["run", str(script)],
    "run --simulate": lambda script, tmp: ["run", "--simulate", "h100-pcie5-80g", str(script)],
    "trace": lambda script, tmp: ["trace", "-o", str(tmp / "t.umrt"), "--", "python", str(script)],
}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("body", [RAISES, SYNTAX], ids=["raises", "syntax-error"])
def test_a_failing_script_shows_what_python_shows(way, body, tmp_path, capsys, monkeypatch):
    """Under `umrt run`, `umrt run --simulate` and `umrt trace`, a script that raises (or does not
    parse) shows python's own traceback of it, without a frame of umrt's or runpy's, and exits 1."""
    import subprocess

    import umrt.api

    monkeypatch.setattr(umrt.api, "gpu_count", lambda: 0)
    for k in [k for k in os.environ if k.startswith("UMRT")]:
        monkeypatch.delenv(k)
    script = tmp_path / "s.py"
    script.write_text(body)
    python = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert python.returncode == 1 and python.stderr.endswith("Error: boom\n" if body == RAISES else "closed\n")
    assert main(WAYS[way](script, tmp_path)) == 1
    err = capsys.readouterr().err
    assert python.stderr in err, err
    assert "umrt/" not in err.replace("umrt: ", "") and "runpy" not in err
    others = [line for line in err.replace(python.stderr, "").splitlines() if line]
    assert all(line.startswith("umrt: ") for line in others), others  # at most umrt's own one-liners
    assert not (tmp_path / "t.umrt").exists()


def test_a_negative_amount_gets_umrts_message_not_argparses(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("UMRT_GPU_MEMORY", raising=False)
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    for sim in ([], ["--simulate", "h100-pcie5-80g"]):
        assert main(["run", *sim, "--gpu-memory", "-20%", str(script)]) == 2
        assert capsys.readouterr().err == "umrt: error: --gpu-memory='-20%': a percentage must be above 0%\n"


def test_a_gpu_memory_error_in_shadow_mode_names_the_flag(tmp_path, capsys, monkeypatch):
    """It said `gpu_memory='200%'`, the Config field's name; 200% of the footprint is a roomy GPU now."""
    monkeypatch.delenv("UMRT_GPU_MEMORY", raising=False)
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert main(["run", "--simulate", "h100-pcie5-80g", "--gpu-memory", "90%device", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("umrt: error: --gpu-memory='90%device': a simulated GPU has no memory but its budget")
    assert "gpu_memory=" not in err and err.count("\n") == 1


#: Words of the code's history, not of what a user does.
HISTORY = (r"umrt\.shadow", r"run_shadow", r"before 0\.2", r"issue \d", r"gpu_memory=", r"\brest\b")


def _helps():
    from bench.cli import build_parser as bench_parser
    from bench.gpu import build_parser as gpu_parser

    yield "python -m bench", bench_parser().format_help()
    yield "python -m bench.gpu", gpu_parser().format_help()
    parser = build_parser()
    yield "umrt", parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        yield f"umrt {name}", p.format_help()


def test_help_speaks_of_what_a_user_does_not_of_the_codes_history():
    for where, text in _helps():
        for word in HISTORY:
            assert not re.search(word, text), f"{where} --help: {word}"


def test_the_defaults_in_help_are_the_codes():
    from umrt.config import LIVE_DEFAULT, SIMULATED_DEFAULT

    helps = dict(_helps())
    assert f"default: live, a fair share, {LIVE_DEFAULT} alone; {SIMULATED_DEFAULT} in shadow mode" in \
        " ".join(helps["umrt run"].split())
    assert f"(default {SIMULATED_DEFAULT})" in " ".join(helps["umrt simulate"].split())
    assert "(default umrt)" in " ".join(helps["umrt simulate"].split())  # the same default policy as `umrt run`


def test_trace_output_under_a_file_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hello.py").write_text("pass\n")
    assert main(["trace", "-o", "hello.py/x.umrt", "--", "python", "hello.py"]) == 2
    assert capsys.readouterr().err == (f"umrt: error: cannot write 'hello.py/x.umrt': '{tmp_path / 'hello.py'}' "
                                       "is a file, not a directory\n")


def test_one_default_in_code_help_readme_and_doctor():
    """GPU memory defaults to a fair share live (90%device alone) and 50% (of the footprint) simulated:
    the same constants in every front end, the README's configuration table and (tests/test_doctor.py)
    doctor."""
    import inspect
    from pathlib import Path

    from bench.gpu import DEFAULT_BUDGET
    from umrt.config import LIVE_DEFAULT, SIMULATED_DEFAULT
    from umrt.shadow import run_shadow

    assert inspect.signature(run_shadow).parameters["gpu_memory"].default == SIMULATED_DEFAULT == DEFAULT_BUDGET
    assert build_parser().parse_args(["simulate", "t.umrt"]).gpu_memory == SIMULATED_DEFAULT
    assert build_parser().parse_args(["simulate", "t.umrt"]).policy == "umrt"  # as UMRT_POLICY's default
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `UMRT_GPU_MEMORY` |"))
    assert row.endswith(f"| live: unset, a fair share (`{LIVE_DEFAULT}` when alone); `{SIMULATED_DEFAULT}` in "
                        "shadow mode |")


BENCH_MODULES = ["bench", "bench.alternatives", "bench.architecture", "bench.copy_wait", "bench.fidelity",
                 "bench.gpu", "bench.live_replay", "bench.loops", "bench.overhead", "bench.remote_write",
                 "bench.steady"]


@pytest.mark.parametrize("module", BENCH_MODULES)
def test_every_bench_commands_help_renders(module, capsys):
    """``python -m bench.X --help`` (a budget's % in a help string once crashed it)."""
    import importlib
    mod = importlib.import_module(module if module != "bench" else "bench.cli")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m " + module)
