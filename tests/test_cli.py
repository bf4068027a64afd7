"""The top-level CLI: every subcommand's --help renders (argparse formats help
strings with %, so a stray % crashes only when a user asks for help)."""
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
