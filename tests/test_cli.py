"""The top-level CLI: every subcommand's --help renders (argparse formats help
strings with %, so a stray % crashes only when a user asks for help)."""
import pytest

from umrt.cli import SUBCOMMANDS, build_parser, main


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
