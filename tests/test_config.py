"""UMRT_* variables: parsing, defaults, and clear errors."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from umrt.config import Amount, Config, enabled_in_env, from_env, parse_amount, read_amount
from umrt.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value,expected", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                            ("0", False), ("false", False), ("No", False), ("off", False),
                                            ("", False)])
def test_switch_words(value, expected):
    assert from_env({"UMRT": value}).enabled is expected
    assert enabled_in_env({"UMRT": value}) is expected


def test_unset_is_off_and_defaults():
    cfg = from_env({})
    assert cfg == Config() and not cfg.enabled and cfg.policy == "umrt" and cfg.device == 0
    assert not cfg.shadow and cfg.granularity == "module"


@pytest.mark.parametrize("value", ["2", "enable", "y", "ture"])
def test_bad_switch_names_variable_and_values(value):
    with pytest.raises(ConfigError, match=r"UMRT=.*1, true, yes, on.*0, false, no, off"):
        from_env({"UMRT": value})


@pytest.mark.parametrize("text,total,expected", [("80%", 1000, 800), ("12GiB", 1, 12 * 2**30),
                                                 ("500MB", 1, 500 * 10**6), ("4096", 1, 4096),
                                                 ("1.5 GiB", 1, 3 * 2**29), ("100%", 7, 7)])
def test_amounts(text, total, expected):
    assert parse_amount(text, "X").resolve(total) == expected


@pytest.mark.parametrize("text", ["0%", "-20%", "150%device", "-3GB", "12 parsecs", "GiB", "0", "20%gpus"])
def test_bad_amounts(text):
    with pytest.raises(ConfigError, match="UMRT_GPU_MEMORY"):
        from_env({"UMRT_GPU_MEMORY": text})


def test_a_percentage_is_of_one_named_thing():
    """'50%' is of the footprint the run needs everywhere; another base is written in the value."""
    assert read_amount("50%") == Amount(fraction=0.5, base="footprint") == read_amount("50%footprint")
    assert read_amount("50%").implied and not read_amount("50%footprint").implied
    assert read_amount("50%peak") == Amount(fraction=0.5, base="peak") == read_amount("50 % of peak")
    assert read_amount("90%device") == Amount(fraction=0.9, base="device") == read_amount("90% device")
    assert read_amount("20%gpus") is None and read_amount("12GiB") == Amount(bytes=12 << 30)
    assert [str(read_amount(t)) for t in ("50%", "50%footprint", "50%peak", "90%device")] == \
        ["50%", "50%", "50%peak", "90%device"]
    assert read_amount("90%device").describe() == "90% of the GPU's memory"
    assert read_amount("20%").describe() == "20% of the footprint the run needs"


def test_a_live_run_reads_a_bare_percentage_as_the_gpus_memory_with_a_note():
    """Old spelling, one version: UMRT_GPU_MEMORY=50% keeps meaning half the GPU, and says so."""
    cfg = from_env({"UMRT_GPU_MEMORY": "50%"})
    assert cfg.budget() == Amount(fraction=0.5, base="device") and cfg.budget().resolve(1000) == 500
    assert cfg.notes() == ["UMRT_GPU_MEMORY='50%' in a live run is 50% of the GPU's memory: write 50%device (a bare "
                           "percentage is of the footprint the run needs, which a live run does not know in advance)"]
    assert from_env({"UMRT_GPU_MEMORY": "50%device"}).notes() == []
    with pytest.raises(ConfigError, match="at most 100%"):
        from_env({"UMRT_GPU_MEMORY": "150%"}).budget()


@pytest.mark.parametrize("text", ["20%footprint", "20%peak"])
def test_a_live_run_refuses_a_base_it_cannot_know(text):
    with pytest.raises(ConfigError, match=rf"UMRT_GPU_MEMORY='{text}': a live run does not know .* \('20%device'\)"):
        from_env({"UMRT_GPU_MEMORY": text}).budget()
    assert from_env({"UMRT_GPU_MEMORY": text, "UMRT_SIMULATE": "h100-pcie5-80g"}).budget().fraction == 0.2


def test_a_simulated_run_refuses_the_gpus_memory():
    with pytest.raises(ConfigError, match="a simulated GPU has no memory but its budget"):
        from_env({"UMRT_GPU_MEMORY": "90%device", "UMRT_SIMULATE": "h100-pcie5-80g"}).budget()
    assert from_env({"UMRT_GPU_MEMORY": "150%", "UMRT_SIMULATE": "h100-pcie5-80g"}).budget().fraction == 1.5


def test_one_default_per_kind_of_run():
    """The defaults are constants read by the code, the help, the README and doctor."""
    from umrt.config import LIVE_DEFAULT, SIMULATED_DEFAULT

    assert Config().budget() == read_amount(LIVE_DEFAULT) == Amount(fraction=0.9, base="device")
    assert Config(simulate="h100-pcie5-80g").budget() == read_amount(SIMULATED_DEFAULT) == \
        Amount(fraction=0.5, base="footprint")
    assert Config().notes() == []  # a default is no old spelling


def test_the_arena_is_a_size_or_a_share_of_the_budget():
    assert from_env({"UMRT_SHORT_LIVED_ARENA": "10%budget"}).arena(1000) == 100
    cfg = from_env({"UMRT_SHORT_LIVED_ARENA": "10%"})
    assert cfg.arena(1000) == 100 and cfg.notes() == [
        "UMRT_SHORT_LIVED_ARENA='10%' is 10% of umrt's GPU memory budget: write 10%budget"]
    assert from_env({"UMRT_SHORT_LIVED_ARENA": "off"}).arena(1000) is None
    with pytest.raises(ConfigError, match="the arena is a size or a percentage of umrt's GPU memory budget"):
        from_env({"UMRT_SHORT_LIVED_ARENA": "10%device"})


@pytest.mark.parametrize("var", ["UMRT_PROFILE", "UMRT_SIMULATE"])
def test_a_profile_is_checked_up_front(var, tmp_path):
    with pytest.raises(ConfigError, match=rf"{var}='nope': unknown hardware profile 'nope'"):
        from_env({var: "nope"})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match=rf"{var}=.*not valid JSON"):
        from_env({var: str(bad)})
    assert getattr(from_env({var: "h100-pcie5-80g"}), var.removeprefix("UMRT_").lower()) == "h100-pcie5-80g"


@pytest.mark.parametrize("var,value,match", [
    ("UMRT_DEVICE", "gpu0", "whole number"), ("UMRT_DEVICE", "-1", ">= 0"),
    ("UMRT_GRANULARITY", "layer", "module, op"), ("UMRT_LEARN_ITERATIONS", "0", ">= 1"),
    ("UMRT_LOG_LEVEL", "loud", "debug, info"), ("UMRT_TELEMETRY", "maybe", "UMRT_TELEMETRY"),
    ("UMRT_POLICY", "  ", "empty"), ("UMRT_STRICT", "always", "UMRT_STRICT"),
])
def test_each_knob_is_validated(var, value, match):
    with pytest.raises(ConfigError, match=match) as info:
        from_env({var: value})
    assert var in str(info.value)


def test_all_knobs_parse():
    cfg = from_env({"UMRT": "1", "UMRT_GPU_MEMORY": "20%", "UMRT_PROFILE": "a100-pcie4-40g",
                    "UMRT_DEVICE": "1", "UMRT_SIMULATE": "h100-pcie5-80g", "UMRT_GRANULARITY": "op",
                    "UMRT_LEARN_ITERATIONS": "3", "UMRT_TELEMETRY": "on", "UMRT_LOG_LEVEL": "DEBUG",
                    "UMRT_SHORT_LIVED_ARENA": "256MiB", "UMRT_STRICT": "1"})
    assert cfg.gpu_memory == Amount(fraction=0.2, base="footprint") and cfg.device == 1 and cfg.shadow
    assert cfg.simulate == "h100-pcie5-80g" and cfg.granularity == "op" and cfg.learn_iterations == 3
    assert cfg.telemetry and cfg.log_level == "debug" and cfg.short_lived_arena == Amount(bytes=256 * 2**20)
    assert from_env({"UMRT_SHORT_LIVED_ARENA": "off"}).short_lived_arena is None
    assert cfg.strict and not from_env({}).strict and not from_env({"UMRT_STRICT": "off"}).strict


def test_strict_is_documented_and_overridable():
    import umrt.config

    assert "UMRT_STRICT" in umrt.config.__doc__ and "UMRT_STRICT" in umrt.config.ENV_VARS
    assert Config().replace(strict="yes").strict is True
    with pytest.raises(ConfigError, match="strict"):
        Config().replace(strict="sometimes")


def test_native_steady_state_is_opt_in():
    """UMRT_NATIVE=1 turns the native steady state on; unset (or 0) leaves it off: it has not
    met a GPU yet (README.md, "The native steady state")."""
    import umrt.config

    assert not Config().native and not from_env({}).native and not from_env({"UMRT_NATIVE": "0"}).native
    assert from_env({"UMRT_NATIVE": "1"}).native and Config().replace(native="on").native
    assert "UMRT_NATIVE" in umrt.config.__doc__
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `UMRT_NATIVE`"))
    assert row.rstrip(" |").endswith("off"), row


def test_every_variable_umrt_reads_is_in_the_config_table():
    """The module's variable table names every ``UMRT_*`` variable umrt reads, and only those."""
    import ast

    import umrt.config

    table = {line.split("``")[1] for line in umrt.config.__doc__.splitlines() if line.startswith("``UMRT")}
    assert table == set(umrt.config.ENV_VARS)
    named = {node.value for path in (ROOT / "umrt").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"UMRT(_[A-Z0-9]+)*", node.value)}
    assert named <= table, named - table


def test_unknown_variable_warns():
    with pytest.warns(UserWarning, match="UMRT_GPU_MEMROY"):
        from_env({"UMRT_GPU_MEMROY": "20%"})


def test_replace_validates_overrides():
    cfg = Config().replace(gpu_memory="2GiB", device="0", telemetry=True)
    assert cfg.gpu_memory.bytes == 2 * 2**30 and cfg.telemetry
    with pytest.raises(ConfigError, match="unknown umrt option"):
        Config().replace(gpu_mem="2GiB")
    with pytest.raises(ConfigError, match="gpu_memory"):
        Config().replace(gpu_memory="lots")


def test_policy_names_are_checked_without_importing_the_policies():
    """config validates UMRT_POLICY against umrt.registry, a leaf module: the plan layer stays unloaded."""
    code = ("import sys; from umrt.config import from_env; "
            "assert from_env({'UMRT_POLICY': 'um'}).policy == 'um'; "
            "assert 'umrt.policy' not in sys.modules, 'config imported umrt.policy'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    with pytest.raises(ConfigError, match="not a known policy"):
        from_env({"UMRT_POLICY": "nope"})


UNITS = ("", "b", "kb", "MB", "gb", "tb", "k", "M", "G", "t", "KiB", "mib", "GiB", "TiB")


@pytest.mark.parametrize("unit", UNITS)
def test_every_unit_means_the_same_bytes_to_every_front_end(unit):
    """One reader of memory amounts (read_amount): a live budget, a simulated budget and bench.gpu's
    --budget take every unit UMRT_GPU_MEMORY takes, as the same bytes."""
    from bench.gpu_measure import BudgetSpec
    from umrt.sim.budget import parse_budget

    text = f"3{unit}"
    live = parse_amount(text, "UMRT_GPU_MEMORY").bytes
    assert live == from_env({"UMRT_GPU_MEMORY": text}).gpu_memory.bytes
    if live >= 2 << 20:  # simulated and bench budgets start at one 2 MB block
        assert parse_budget(text, 1) == live == int(BudgetSpec.parse(text).value)


def test_one_percent_syntax_everywhere():
    """'20.%' was a simulated budget but not a live one; every front end now reads the same forms."""
    from bench.gpu_measure import BudgetSpec
    from bench.grid import parse_budget as bench_budget
    from umrt.sim.budget import parse_budget

    for text in ("20%", " 20.5 % ", "20.%"):
        fraction = float(text.strip().rstrip("%").strip()) / 100.0
        assert parse_amount(text, "X").fraction == fraction == bench_budget(text) == BudgetSpec.parse(text).value
        assert parse_budget(text, 1 << 30) == int((1 << 30) * fraction)
    assert read_amount("footprint/2") == Amount(fraction=0.5, base="footprint")  # bench.gpu's old spelling
    assert read_amount("footprint/2", "X").note == "X='footprint/2' is 50% of the footprint the run needs: write 50%"


def test_the_budget_keeps_the_text_it_was_given():
    """A message quotes the amount as the user wrote it, and where; unset is None (the default of the run's kind)."""
    assert from_env({"UMRT_GPU_MEMORY": "12G"}).gpu_memory.text == "12G"
    assert from_env({"UMRT_GPU_MEMORY": "12G"}).gpu_memory.given() == "UMRT_GPU_MEMORY='12G'"
    assert Config().replace(gpu_memory="30%").gpu_memory.text == "30%"
    assert from_env({}).gpu_memory is None
    assert from_env({"UMRT_GPU_MEMORY": "12G"}).gpu_memory == Amount(bytes=12 << 30)
