"""umrt's configuration: every knob is a ``UMRT_*`` environment variable.

:func:`from_env` reads and validates them all up front, so a typo fails at
start-up with a message that names the variable and the values it accepts,
never half-way through a training run. ``umrt.enable(**overrides)`` and the
CLI flags override the environment through :meth:`Config.replace`.

==========================  =========================================  =============
Variable                    Meaning                                    Default
==========================  =========================================  =============
``UMRT``                    switch umrt on (1/true/yes/on)              off
``UMRT_GPU_MEMORY``         GPU memory umrt may use: a size            live: a fair
                            (``12GiB``, ``500MB``, ``1073741824``) or  share,
                            a percentage (below)                       ``90%device``
                                                                       alone; ``50%``
                                                                       in shadow mode
``UMRT_PROFILE``            hardware profile name or JSON path          auto
``UMRT_POLICY``             policy name                                 ``umrt``
``UMRT_DEVICE``             CUDA device index                           ``0``
``UMRT_SIMULATE``           profile name: shadow mode (no GPU needed)   unset
``UMRT_GRANULARITY``        ``module`` or ``op``                        ``module``
``UMRT_LEARN_ITERATIONS``   iterations observed before planning         ``2``
``UMRT_TELEMETRY``          NVML sampling during the run (bool)         off
``UMRT_LOG_LEVEL``          debug/info/warning/error                    ``warning``
``UMRT_SHORT_LIVED_ARENA``  arena for short-lived tensors: a size, a    off
                            percentage of the budget (``10%budget``)
                            or ``off``
``UMRT_STRICT``             raise when umrt stops acting (bool)         off
``UMRT_NATIVE``             serve the steady state natively (bool;      off
                            opt-in until a GPU run has checked it)
``UMRT_SHARE_DIR``          folder of the per-GPU share registry, or    auto
                            ``off`` (:mod:`umrt.share`)
``UMRT_SHARE_MIN``          the least memory a fair share may shrink    ``10%device``
                            to: a size or ``%device``
``UMRT_SHARE_WAIT``         seconds to wait for a share the device      ``0``
                            cannot give now (``forever``: no limit)
``UMRT_SHADOW_REPORTS``     folder where each torchrun rank of a        unset
                            shadow run leaves its report
``UMRT_SWAP_COPY``          what copies swapped memory to pinned        ``sm``
                            memory and back: ``sm`` (a kernel of
                            umrt's own) or ``engines``
                            (``cudaMemcpyAsync``)
==========================  =========================================  =============

A percentage is of one named thing, written after it (:data:`PERCENT_BASES`):
``50%`` alone is 50% of **the footprint the run needs** (the GPU memory its
allocations take with nothing evicted: :mod:`umrt.sim.budget`), everywhere a
budget is taken; ``50%peak`` is of the run's peak live bytes; ``90%device`` of
the GPU's memory; ``10%budget`` (the arena only) of the budget. A simulated run
knows its footprint; a live one does not before it runs, so it takes a size or
``%device`` (a bare percentage there is read as ``%device`` for this version,
with a one-line note: :func:`live_amount`).

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

from umrt.backends.base import SWAP_COPIES, SWAP_COPY_DEFAULT
from umrt.errors import ConfigError
from umrt.hardware import load_profile
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
# "20%", "20.5 %", "50%device", "50% of device", "-20%" (a sign, to say it must be above 0%)
_PCT_RE = re.compile(r"^\s*([-+]?\d+(?:\.\d*)?)\s*%\s*(?:of\s+)?([a-zA-Z]*)\s*$")
_FOOTPRINT_RE = re.compile(r"^\s*footprint\s*(?:([/*])\s*(\d+(?:\.\d*)?)\s*)?$", re.IGNORECASE)

#: What a percentage can be of, written right after it: ``50%device``. A bare ``50%`` is of
#: :data:`DEFAULT_BASE`, the footprint the run needs, everywhere a budget is taken.
PERCENT_BASES: dict[str, str] = {
    "footprint": "the footprint the run needs",
    "peak": "the run's peak live bytes",
    "device": "the GPU's memory",
    "budget": "umrt's GPU memory budget",
}
DEFAULT_BASE = "footprint"
#: GPU memory when none is given. Live, a fair share of the GPU (:mod:`umrt.share`): alone on it,
#: umrt leaves a tenth to the CUDA context and to other processes (with ``UMRT_SHARE_DIR=off``, always);
#: simulated (shadow mode, ``umrt simulate``, the benches), the GPU has half of what the run needs.
LIVE_DEFAULT = "90%device"
SIMULATED_DEFAULT = "50%"
#: The least a fair share of the GPU shrinks to (:mod:`umrt.share`), unless ``UMRT_SHARE_MIN`` says.
SHARE_MIN_DEFAULT = "10%device"
#: How a user writes an amount (every error message offers these).
AMOUNT_FORMS = ("a size ('12GiB', '500MB', a byte count) or a percentage: '50%' of the footprint the run "
                "needs, '50%peak' of its peak live bytes, '90%device' of the GPU's memory")
#: What "the footprint" means, printed beside every figure that uses it (one definition for every report).
FOOTPRINT_DEFINITION = ("footprint: the GPU memory the run needs with nothing evicted - the most managed memory "
                        "its allocations take, placed by umrt's pool (as a run with that memory has it: no planned "
                        "layout, nothing having to move) and by PyTorch's caching allocator over the "
                        "whole recorded run, whichever needs more (2 MB blocks, rounding and fragmentation "
                        "included); at 100% everything fits")
#: What "peak live" means.
PEAK_LIVE_DEFINITION = "peak live: the most bytes of tensors alive at once in the recorded run"
#: How a user writes the GPU memory of a simulated run.
SIMULATED_FORMS = ("a size ('8GiB', '512MB', a number of bytes) or a percentage of the footprint the run needs "
                   "('20%') or of its peak live bytes ('20%peak')")


@dataclass(frozen=True)
class Amount:
    """A memory amount: ``bytes``, or a ``fraction`` of ``base`` (a key of :data:`PERCENT_BASES`).

    ``text``: the amount as it was given; ``name``: where (``UMRT_GPU_MEMORY``,
    ``--gpu-memory``), for messages; ``implied``: a bare percentage, whose base the
    value did not write; ``note``: for an old spelling, one line saying what it
    means now (each front end prints it, :meth:`Config.notes`).
    """

    bytes: int | None = None
    fraction: float | None = None
    base: str | None = None
    text: str | None = dataclasses.field(default=None, compare=False)
    name: str | None = dataclasses.field(default=None, compare=False)
    implied: bool = dataclasses.field(default=False, compare=False)
    note: str | None = dataclasses.field(default=None, compare=False)

    def resolve(self, total: int) -> int:
        """Bytes this amount means when its base is ``total`` bytes."""
        if self.bytes is not None:
            return self.bytes
        return int(total * (self.fraction or 0.0))

    def __str__(self) -> str:
        """The canonical spelling: ``12.0 GiB``, ``20%`` (of the footprint), ``90%device``."""
        if self.bytes is not None:
            return format_bytes(self.bytes)
        base = "" if self.base in (None, DEFAULT_BASE) else self.base
        return f"{(self.fraction or 0.0) * 100:g}%{base}"

    def describe(self) -> str:
        """``12.0 GiB``, ``20% of the footprint the run needs``, ``90% of the GPU's memory``."""
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{(self.fraction or 0.0) * 100:g}% of {PERCENT_BASES[self.base or DEFAULT_BASE]}"

    def given(self) -> str:
        """How it was given, for messages: ``--gpu-memory='20%'``."""
        shown = self.text if self.text is not None else str(self)
        return f"{self.name}={shown!r}" if self.name else repr(shown)


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


def read_amount(text: str, name: str | None = None) -> Amount | None:
    """The one reader of a memory amount written as text; None when ``text`` is not one.

    ``"20%"`` -> 20% of the footprint the run needs (``implied``); ``"20%peak"``,
    ``"90%device"``, ``"10%budget"``, ``"20%footprint"`` (also ``"90% of device"``)
    -> 20% of that base; a size (:func:`parse_size`) -> bytes. The old spellings
    ``footprint``, ``footprint/2``, ``footprint*0.75`` read as 100%, 50%, 75% (with
    a :attr:`~Amount.note`). No range is checked: each front end says which bases
    and values it accepts (:func:`parse_amount`, :meth:`Config.budget`,
    :func:`umrt.sim.budget.resolve_budget`, the benches).
    """
    if not isinstance(text, str):
        return None
    if m := _PCT_RE.match(text):
        word = m.group(2).lower()
        if word and word not in PERCENT_BASES:
            return None
        return Amount(fraction=float(m.group(1)) / 100.0, base=word or DEFAULT_BASE, text=text, name=name,
                      implied=not word)
    if m := _FOOTPRINT_RE.match(text):
        op, num = m.group(1), float(m.group(2)) if m.group(2) else 1.0
        fraction = (1.0 / num if num > 0 else math.inf) if op == "/" else num if op == "*" else 1.0
        note = (f"{name + '=' if name else ''}{text.strip()!r} is {fraction * 100:g}% of the footprint the run "
                f"needs: write {fraction * 100:g}%")
        return Amount(fraction=fraction, base="footprint", text=text, name=name, note=note)
    nbytes = parse_size(text)
    return None if nbytes is None else Amount(bytes=nbytes, text=text, name=name)


def parse_amount(value: str | int | float | Amount, name: str, *, allow_percent: bool = True) -> Amount:
    """A memory amount (:func:`read_amount`), checked: a size above zero, or a percentage above 0%
    (at most 100% of the GPU's memory or of the budget). An int is bytes; a float in (0, 1]
    a fraction of the GPU's memory. :class:`ConfigError` names ``name``. Which bases a
    run takes is :meth:`Config.budget`'s to say."""
    if isinstance(value, Amount):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not a memory amount")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{name}={value} must be a positive number of bytes")
        return Amount(bytes=value, text=str(value), name=name)
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ConfigError(f"{name}={value} as a fraction of the GPU's memory must be in (0, 1]")
        return Amount(fraction=value, base="device", text=f"{value * 100:g}%device", name=name)
    text = str(value)
    amount = read_amount(text, name)
    if amount is not None and amount.fraction is not None:
        if not allow_percent:
            raise ConfigError(f"{name}={text!r}: a percentage is not allowed here; give a size like 12GiB")
        if not 0 < amount.fraction < math.inf:
            raise ConfigError(f"{name}={text!r}: a percentage must be above 0%")
        if amount.base in ("device", "budget") and amount.fraction > 1:
            raise ConfigError(f"{name}={text!r}: a percentage of {PERCENT_BASES[amount.base]} must be at most 100%")
        return amount
    if amount is not None and amount.bytes is not None:
        if amount.bytes <= 0:
            raise ConfigError(f"{name}={text!r} must be more than zero bytes")
        return amount
    forms = AMOUNT_FORMS if allow_percent else "a size ('12GiB', '500MB', a byte count)"
    raise ConfigError(f"{name}={text!r} is not a memory amount; give {forms}")


def live_amount(amount: Amount) -> Amount:
    """``amount`` as a live run (a real GPU) reads it: a size, or a percentage of the GPU's memory.

    A bare ``"50%"`` (the spelling of the footprint the run needs, which a live run
    does not know before it runs) is read, for this version, as ``50%device``, with a
    note; ``%footprint`` and ``%peak`` are a :class:`ConfigError`.
    """
    if amount.fraction is None or amount.base == "device":
        return amount
    pct = f"{amount.fraction * 100:g}"
    if amount.implied:
        if amount.fraction > 1:
            raise ConfigError(f"{amount.given()}: a live run reads a bare percentage as one of the GPU's memory "
                              "(write it '...%device'), and that must be at most 100%")
        note = (f"{amount.given()} in a live run is {pct}% of the GPU's memory: write {pct}%device (a bare "
                "percentage is of the footprint the run needs, which a live run does not know in advance)")
        return dataclasses.replace(amount, base="device", implied=False, note=note)
    raise ConfigError(f"{amount.given()}: a live run does not know {PERCENT_BASES[amount.base or DEFAULT_BASE]} "
                      f"before it runs; give a size ('12GiB') or a percentage of the GPU's memory ('{pct}%device')")


def simulated_amount(amount: Amount) -> Amount:
    """``amount`` as a simulated run reads it: a size, or a percentage of the footprint the run
    needs (bare or ``%footprint``) or of its peak live bytes (``%peak``)."""
    if amount.fraction is not None and amount.base not in ("footprint", "peak"):
        pct = f"{amount.fraction * 100:g}"
        raise ConfigError(f"{amount.given()}: a simulated GPU has no memory but its budget; give a size ('8GiB') "
                          f"or a percentage of the footprint the run needs ('{pct}%') or of its peak live bytes "
                          f"('{pct}%peak')")
    return amount


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
    gpu_memory: Amount | None = None  # None: the default of the run's kind (budget())
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
    share_min: Amount | None = None  # the least a fair share shrinks to (None: SHARE_MIN_DEFAULT)
    share_wait: float = 0.0  # seconds to wait for a share the device cannot give now (inf: no limit)
    shadow_reports: str | None = None  # torchrun shadow runs: where each rank leaves its report
    swap_copy: str = SWAP_COPY_DEFAULT  # what copies swapped ranges: "sm" (a kernel) or "engines"

    @property
    def shares_off(self) -> bool:
        """True when ``UMRT_SHARE_DIR=off``: no registry, the budget is of the whole device."""
        return self.share_dir == "off"

    @property
    def shadow(self) -> bool:
        """True when umrt should run in shadow mode (simulate instead of managing a GPU)."""
        return self.simulate is not None

    def budget(self) -> Amount:
        """The GPU memory this run may use, as the run reads it: in shadow mode a size or a
        percentage of the footprint (default :data:`SIMULATED_DEFAULT`), live a size or a
        percentage of the GPU's memory (default :data:`LIVE_DEFAULT`). :class:`ConfigError`
        for a base the run cannot know (:func:`live_amount`, :func:`simulated_amount`)."""
        if self.shadow:
            return simulated_amount(self.gpu_memory or read_amount(SIMULATED_DEFAULT))  # type: ignore[arg-type]
        return live_amount(self.gpu_memory or read_amount(LIVE_DEFAULT))  # type: ignore[arg-type]

    def share_minimum(self) -> Amount:
        """The least a fair share of the GPU shrinks to (``UMRT_SHARE_MIN``, default
        :data:`SHARE_MIN_DEFAULT`): a size or a percentage of the GPU's memory."""
        return self.share_min or live_amount(read_amount(SHARE_MIN_DEFAULT))  # type: ignore[arg-type]

    def arena(self, budget_bytes: int) -> int | None:
        """Bytes of the short-lived arena for a budget of ``budget_bytes`` (None: off)."""
        return None if self.short_lived_arena is None else self.short_lived_arena.resolve(budget_bytes)

    def notes(self) -> list[str]:
        """One line per old spelling among the settings, saying what it means now (a front end
        prints them as ``umrt: note: ...``); raises like :meth:`budget`."""
        amounts = (self.budget(), self.short_lived_arena, self.share_min)
        return [a.note for a in amounts if a is not None and a.note]

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
    "swap_copy": "UMRT_SWAP_COPY",
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
        return parse_amount(value, name)  # type: ignore[arg-type]
    if field == "short_lived_arena":
        if value is None or isinstance(value, Amount):
            return value
        if str(value).strip().lower() in FALSE_WORDS:
            return None
        return _arena(parse_amount(value, name))  # type: ignore[arg-type]
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
    if field == "swap_copy":
        return checked_swap_copy(value, name or "swap_copy")
    if field == "log_level":
        word = str(value).strip().lower()
        if word not in LOG_LEVELS:
            raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(LOG_LEVELS)}")
        return word
    if field in ("profile", "simulate"):
        text = str(value).strip()
        if text:
            _check_profile(text, name)
        return text or None
    if field == "shadow_reports":
        return str(value).strip() or None
    if field == "share_dir":
        text = str(value).strip()
        return "off" if text.lower() in FALSE_WORDS and text else (text or None)
    if field == "share_min":
        if value is None:
            return value
        return live_amount(parse_amount(value, name))  # type: ignore[arg-type]
    if field == "share_wait":
        return _seconds(value, name)
    if field == "policy":
        text = str(value).strip()
        if not text:
            raise ConfigError(f"{name} is empty; give a policy name such as 'umrt'")
        _check_policy(text, name)
        return text
    raise AssertionError(field)


def _arena(amount: Amount) -> Amount:
    """The short-lived arena: a size or a percentage of the budget (a bare one: with a note)."""
    if amount.fraction is None or amount.base == "budget":
        return amount
    if amount.implied:
        pct = f"{amount.fraction * 100:g}"
        return dataclasses.replace(amount, base="budget", implied=False,
                                   note=f"{amount.given()} is {pct}% of umrt's GPU memory budget: write {pct}%budget")
    raise ConfigError(f"{amount.given()}: the arena is a size or a percentage of umrt's GPU memory budget "
                      "('10%budget')")


def _check_profile(text: str, name: str) -> None:
    """A hardware profile that loads: a shipped name or a valid profile file, checked up front."""
    try:
        load_profile(text)
    except ConfigError as exc:
        raise ConfigError(f"{name}={text!r}: {exc}") from None


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


def checked_swap_copy(value: object, name: str = "swap_copy") -> str:
    """``value`` as one of :data:`~umrt.backends.base.SWAP_COPIES`, or a ConfigError naming ``name``."""
    word = str(value).strip().lower()
    if word not in SWAP_COPIES:
        raise ConfigError(f"{name}={value!r} is not valid; use one of {', '.join(SWAP_COPIES)}")
    return word


def swap_copy_in_env(environ: Mapping[str, str] | None = None) -> str:
    """``UMRT_SWAP_COPY`` alone, checked (a backend made outside :func:`from_env`'s config, such
    as the simulator a bench builds, still follows it)."""
    env = os.environ if environ is None else environ
    var = _ENV["swap_copy"]
    return checked_swap_copy(env[var], var) if var in env else SWAP_COPY_DEFAULT


def enabled_in_env(environ: Mapping[str, str] | None = None) -> bool:
    """Cheap check of ``UMRT`` alone (the site hook calls this in every Python start)."""
    env = os.environ if environ is None else environ
    return parse_bool(env.get("UMRT", ""), "UMRT")
