"""umrt's configuration: every knob is a ``UMRT_*`` environment variable.

:func:`from_env` reads and validates them all up front, so a typo fails at
start-up with a message that names the variable and the values it accepts,
never half-way through a training run. ``umrt.enable(**overrides)`` and the
CLI flags override the environment through :meth:`Config.replace`.

==========================  =========================================  ===========
Variable                    Meaning                                    Default
==========================  =========================================  ===========
``UMRT``                    switch umrt on (1/true/yes/on)              off
``UMRT_GPU_MEMORY``         budget: ``80%`` of device memory or bytes  ``90%``
                            (``12GiB``, ``500MB``, ``1073741824``)
``UMRT_PROFILE``            hardware profile name or JSON path          auto
``UMRT_POLICY``             policy name                                 ``umrt``
``UMRT_DEVICE``             CUDA device index                           ``0``
``UMRT_SIMULATE``           profile name: shadow mode (no GPU needed)   unset
``UMRT_GRANULARITY``        ``module`` or ``op``                        ``module``
``UMRT_LEARN_ITERATIONS``   iterations observed before planning         ``2``
``UMRT_TELEMETRY``          NVML sampling during the run (bool)         off
``UMRT_LOG_LEVEL``          debug/info/warning/error                    ``warning``
``UMRT_SHORT_LIVED_ARENA``  arena for short-lived tensors: bytes/``%``  ``0`` (off)
                            or ``off``
``UMRT_STRICT``             raise when umrt stops acting (bool)         off
``UMRT_NATIVE``             serve the steady state natively (bool;      off
                            opt-in until a GPU run has checked it)
``UMRT_SHARE_DIR``          folder of the per-GPU share registry, or    auto
                            ``off`` (:mod:`umrt.share`)
``UMRT_SHARE_MIN``          the least memory a fair share may shrink    ``10%``
                            to: ``%`` of device memory or bytes
``UMRT_SHARE_WAIT``         seconds to wait for a share the device      ``0``
                            cannot give now (``forever``: no limit)
``UMRT_SHADOW_REPORTS``     folder where each torchrun rank of a        unset
                            shadow run leaves its report
==========================  =========================================  ===========

``UMRT_GPU_MEMORY`` set (here or as ``enable(gpu_memory=...)``) is a *fixed*
share of the device; unset, a job takes a *fair* share of what the fixed
shares leave, which moves as umrt jobs on the GPU come and go
(:mod:`umrt.share`). Under ``torchrun`` the device defaults to the rank's
``LOCAL_RANK`` (:mod:`umrt.distributed`).

When umrt stops acting (a CUDA call fails, the event recorder cannot read an
op) it says so in one warning, ``umrt.memory_stats()`` shows it (``acting``,
``stopped_reason``) and the training goes on with its memory managed but no
longer prefetched. With ``UMRT_STRICT=1`` the failure is raised instead, as
:class:`umrt.errors.StoppedActing`, in the training program's thread at the
next safe point: the end of the next ``optimizer.step()``, or
``umrt.disable()`` (see :class:`umrt.drive.live.LiveBridge`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from umrt.errors import ConfigError
from umrt.registry import POLICY_NAMES

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
GRANULARITIES = ("module", "op")
LOG_LEVELS = ("debug", "info", "warning", "error")

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_PCT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")
_FOOTPRINT_RE = re.compile(r"^\s*footprint\s*(?:([/*])\s*(\d+(?:\.\d*)?)\s*)?$", re.IGNORECASE)


@dataclass(frozen=True)
class Amount:
    """A memory amount: either absolute ``bytes`` or a ``fraction`` of a total.

    ``of_footprint``: written as ``footprint``, ``footprint/N`` or ``footprint*x``
    (``python -m bench.gpu``: a fraction of what umrt's pool needs). ``text``:
    the amount as it was given (None for a default), so that a mode in which a
    percentage means something else (shadow mode: of the footprint the run
    needs) can read it again.
    """

    bytes: int | None = None
    fraction: float | None = None
    of_footprint: bool = False
    text: str | None = dataclasses.field(default=None, compare=False)

    def resolve(self, total: int) -> int:
        """Bytes this amount means for a device (or trace) of ``total`` bytes."""
        if self.bytes is not None:
            return self.bytes
        return int(total * (self.fraction or 0.0))

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{(self.fraction or 0.0) * 100:g}%"


def parse_bool(value: str, name: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off/empty`` -> False, else :class:`ConfigError`."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(
        f"{name}={value!r} is not a valid switch; use one of {', '.join(TRUE_WORDS)} to enable "
        f"or {', '.join(w for w in FALSE_WORDS if w)} (or leave it unset) to disable"
    )


def parse_size(text: str) -> int | None:
    """Bytes from a size such as ``"12GiB"``, ``"500MB"``, ``"12G"`` (binary) or ``"4096"``;
    None when ``text`` is not one (:func:`read_amount` reads percentages too)."""
    m = _SIZE_RE.match(text)
    if m and m.group(2).lower() in _UNITS:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return None


def read_amount(text: str) -> Amount | None:
    """The one reader of a memory amount written as text; None when ``text`` is not one.

    ``"20%"`` -> ``Amount(fraction=0.2)``; a size (:func:`parse_size`: ``"12G"``,
    ``"12GiB"``, ``"500MB"``, ``"4096"``) -> ``Amount(bytes=...)``;
    ``"footprint"``, ``"footprint/2"``, ``"footprint*0.75"`` -> a fraction with
    ``of_footprint``. No range is checked: each front end (live budgets
    :func:`parse_amount`, simulated budgets :func:`umrt.sim.budget.parse_budget`,
    the bench) says which forms and values it accepts, and what a fraction is of.
    """
    if not isinstance(text, str):
        return None
    if m := _PCT_RE.match(text):
        return Amount(fraction=float(m.group(1)) / 100.0, text=text)
    if m := _FOOTPRINT_RE.match(text):
        op, num = m.group(1), float(m.group(2)) if m.group(2) else 1.0
        fraction = (1.0 / num if num > 0 else math.inf) if op == "/" else num if op == "*" else 1.0
        return Amount(fraction=fraction, of_footprint=True, text=text)
    nbytes = parse_size(text)
    return None if nbytes is None else Amount(bytes=nbytes, text=text)


def parse_amount(value: str | int | float, name: str, *, allow_percent: bool = True) -> Amount:
    """A live memory amount: ``"80%"`` (of device memory), ``"12GiB"``, ``"500MB"`` or a byte count
    (:func:`read_amount`); a float is a fraction in (0, 1]. :class:`ConfigError` names ``name``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a memory amount")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{name}={value} must be a positive number of bytes")
        return Amount(bytes=value, text=str(value))
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ConfigError(f"{name}={value} as a fraction must be in (0, 1]")
        return Amount(fraction=value, text=f"{value * 100!r}%")
    text = str(value)
    amount = read_amount(text)
    if amount is not None and amount.fraction is not None and not amount.of_footprint:
        if not allow_percent:
            raise ConfigError(f"{name}={text!r}: a percentage is not allowed here; give bytes like 12GiB")
        if not 0 < amount.fraction <= 1:
            raise ConfigError(f"{name}={text!r}: a percentage must be in (0%, 100%]")
        return amount
    if amount is not None and amount.bytes is not None:
        if amount.bytes <= 0:
            raise ConfigError(f"{name}={text!r} must be more than zero bytes")
        return amount
    raise ConfigError(
        f"{name}={text!r} is not a memory amount; use a percentage of device memory like '80%' "
        f"or a size like '12GiB', '500MB' or a plain byte count"
    )


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, as nvidia-smi and torch print them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


@dataclass(frozen=True)
class Config:
    """Validated umrt settings; build with :func:`from_env` and adjust with :meth:`replace`."""

    enabled: bool = False
    gpu_memory: Amount = Amount(fraction=0.9)
    profile: str | None = None
    policy: str = "umrt"
    device: int = 0
    simulate: str | None = None
    granularity: str = "module"
    learn_iterations: int = 2  # a first training step is special (lazy optimizer state): plan from the second
    telemetry: bool = False
    log_level: str = "warning"
    short_lived_arena: Amount | None = None
    strict: bool = False
    # Serve the steady state natively once the plan repeats (UMRT_NATIVE=1). Off by default
    # until a GPU run has shown it safe (README.md, "The native steady state").
    native: bool = False
    share_dir: str | None = None  # the per-GPU share registry's folder (None: auto; "off": no registry)
    share_min: Amount | None = None  # the least a fair share shrinks to (None: 10% of the device)
    share_wait: float = 0.0  # seconds to wait for a share the device cannot give now (inf: no limit)
    shadow_reports: str | None = None  # torchrun shadow runs: where each rank leaves its report

    @property
    def shares_off(self) -> bool:
        """True when ``UMRT_SHARE_DIR=off``: no registry, the budget is of the whole device."""
        return self.share_dir == "off"

    @property
    def shadow(self) -> bool:
        """True when umrt should run in shadow mode (simulate instead of managing a GPU)."""
        return self.simulate is not None

    def replace(self, **overrides: object) -> Config:
        """A copy with ``overrides`` applied and validated like the env vars.

        Keys are field names (``gpu_memory="20%"``, ``policy="um"``); values may
        be strings as in the environment or already-typed values.
        """
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ConfigError(f"unknown umrt option(s): {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
        values = {k: _coerce(k, v) for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **values)


_ENV = {  # field -> environment variable
    "enabled": "UMRT",
    "gpu_memory": "UMRT_GPU_MEMORY",
    "profile": "UMRT_PROFILE",
    "policy": "UMRT_POLICY",
    "device": "UMRT_DEVICE",
    "simulate": "UMRT_SIMULATE",
    "granularity": "UMRT_GRANULARITY",
    "learn_iterations": "UMRT_LEARN_ITERATIONS",
    "telemetry": "UMRT_TELEMETRY",
    "log_level": "UMRT_LOG_LEVEL",
    "short_lived_arena": "UMRT_SHORT_LIVED_ARENA",
    "strict": "UMRT_STRICT",
    "native": "UMRT_NATIVE",
    "share_dir": "UMRT_SHARE_DIR",
    "share_min": "UMRT_SHARE_MIN",
    "share_wait": "UMRT_SHARE_WAIT",
    "shadow_reports": "UMRT_SHADOW_REPORTS",
}
ENV_VARS: tuple[str, ...] = tuple(_ENV.values())


def env_var(field: str) -> str:
    """The ``UMRT_*`` variable that sets a :class:`Config` field."""
    return _ENV[field]


def _coerce(field: str, value: object, name: str | None = None) -> object:
    """Validate one setting; ``name`` is what error messages call it."""
    name = name or field
    if field in ("enabled", "telemetry", "strict", "native"):
        return value if isinstance(value, bool) else parse_bool(str(value), name)
    if field == "gpu_memory":
        return value if isinstance(value, Amount) else parse_amount(value, name)  # type: ignore[arg-type]
    if field == "short_lived_arena":
        if value is None or isinstance(value, Amount):
            return value
        if str(value).strip().lower() in FALSE_WORDS:
            return None
        return parse_amount(value, name)  # type: ignore[arg-type]
    if field in ("device", "learn_iterations"):
        try:
            number = int(str(value).strip())
        except ValueError:
            raise ConfigError(f"{name}={value!r} must be a whole number") from None
        low = 0 if field == "device" else 1
        if number < low:
            raise ConfigError(f"{name}={value!r} must be >= {low}")
        return number
    if field == "granularity":
        word = str(value).strip().lower()
        if word not in GRANULARITIES:
            raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(GRANULARITIES)}")
        return word
    if field == "log_level":
        word = str(value).strip().lower()
        if word not in LOG_LEVELS:
            raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(LOG_LEVELS)}")
        return word
    if field in ("profile", "simulate", "shadow_reports"):
        text = str(value).strip()
        return text or None
    if field == "share_dir":
        text = str(value).strip()
        return "off" if text.lower() in FALSE_WORDS and text else (text or None)
    if field == "share_min":
        if value is None or isinstance(value, Amount):
            return value
        return parse_amount(value, name)  # type: ignore[arg-type]
    if field == "share_wait":
        return _seconds(value, name)
    if field == "policy":
        text = str(value).strip()
        if not text:
            raise ConfigError(f"{name} is empty; give a policy name such as 'umrt'")
        _check_policy(text, name)
        return text
    raise AssertionError(field)


def _seconds(value: object, name: str) -> float:
    """A wait in seconds: a number >= 0, or ``forever`` (no limit)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        text = str(value).strip().lower()
        if text in ("forever", "inf", "infinite"):
            return math.inf
        try:
            number = float(text.removesuffix("s"))
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a wait; give seconds like '600' or 'forever'") from None
    if not number >= 0:
        raise ConfigError(f"{name}={value!r} must be 0 or more seconds (or 'forever')")
    return number


def _check_policy(name_value: str, name: str) -> None:
    """Reject unknown policy names early (:data:`umrt.registry.POLICY_NAMES`: no policy is imported)."""
    if name_value not in POLICY_NAMES:
        raise ConfigError(f"{name}={name_value!r} is not a known policy; use one of {', '.join(POLICY_NAMES)}")


def from_env(environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate every ``UMRT_*`` variable; raise :class:`ConfigError` on the first bad one.

    Unknown ``UMRT_*`` variables draw a warning: a misspelt knob should not
    be silently ignored, but other tools may share the prefix.
    """
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith("UMRT_") and k not in ENV_VARS)
    if unknown:
        warnings.warn(
            f"umrt: ignoring unknown variable(s) {', '.join(unknown)}; known: {', '.join(ENV_VARS)}",
            stacklevel=2,
        )
    values: dict[str, object] = {}
    for field, var in _ENV.items():
        if var in env:
            coerced = _coerce(field, env[var], var)
            if coerced is not None or field in ("short_lived_arena", "profile", "simulate", "share_dir",
                                                "shadow_reports"):
                values[field] = coerced
    return dataclasses.replace(Config(), **values)


def enabled_in_env(environ: Mapping[str, str] | None = None) -> bool:
    """Cheap check of ``UMRT`` alone (the site hook calls this in every Python start)."""
    env = os.environ if environ is None else environ
    return parse_bool(env.get("UMRT", ""), "UMRT")
