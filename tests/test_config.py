"""UMRT_* variables: parsing, defaults, and clear errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from umrt.config import Amount, Config, enabled_in_env, from_env, parse_amount
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


@pytest.mark.parametrize("text", ["0%", "150%", "-3GB", "12 parsecs", "GiB", "0"])
def test_bad_amounts(text):
    with pytest.raises(ConfigError, match="UMRT_GPU_MEMORY"):
        from_env({"UMRT_GPU_MEMORY": text})


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
    assert cfg.gpu_memory == Amount(fraction=0.2) and cfg.device == 1 and cfg.shadow
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
