"""What ``python -m bench.gpu`` measures and checks, apart from the GPU itself.

* :class:`BudgetSpec` - a ``--gpu-memory``: a percentage of the footprint the
  run needs, of plain PyTorch's peak (``%peak``) or of the GPU's memory
  (``%device``), or a size.
* :class:`Counters` / :func:`read_counters` - the bytes and CUDA calls umrt's
  backend issued (its ``counters()`` snapshot where it has one).
* :class:`PcieCounters` - NVML's PCIe byte counters of the GPU, read in a
  background thread.
* :func:`steady_per_step`, :func:`compare_losses`, :func:`check_targets` -
  the per-step figures of the timed steps, the losses against plain
  PyTorch's step by step, and issue 10's targets (reported, not asserted).
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from umrt.backends.base import BLOCK as _MIN_BUDGET  # one 2 MB block
from umrt.config import format_bytes, read_amount

#: Host -> GPU and GPU -> host rates of the issue-10 bound, as measured on an H100
#: (PCIe Gen5 x16): ``/work/shared/reference/h100-measured.md`` section 1, "prefetch
#: host -> GPU, 4 GiB, one call: 48 GB/s" and "prefetch GPU -> host, later times: 9-14 GB/s"
#: (issue 10 takes 12 GB/s). Decimal GB, as measured there.
H2D_BYTES_PER_S = 48e9
D2H_BYTES_PER_S = 12e9
#: Issue 10's targets: at a budget >= the footprint umrt within this much of plain PyTorch;
FIT_RATIO = 1.10
#: at half the footprint within this much of max(compute, H2D / 48 GB/s, D2H / 12 GB/s).
BOUND_RATIO = 1.3
#: Losses count as equal to plain PyTorch's within this relative difference (a few fp32
#: ulps; h100-measured.md section 3 found them identical to 1e-7).
LOSS_RTOL = 1e-6
#: "No PCIe traffic": NVML may count this much more per steady step than in the plain
#: PyTorch run (kernel launches, the loss read back). An allowance, not a measured figure:
#: the plain run's own NVML bytes are shown beside it.
PCIE_QUIET_BYTES = 64 << 20



class BenchError(Exception):
    """A bad argument or a machine that cannot run the benchmark (exit 2, one line)."""


# ---------------------------------------------------------------- budgets


@dataclass(frozen=True)
class BudgetSpec:
    """One ``--gpu-memory``: ``kind`` is ``footprint`` (a share of the footprint the run needs:
    the larger of plain PyTorch's peak reserved bytes and umrt's pool's, as measured),
    ``peak`` (of plain PyTorch's peak allocated bytes: the run's peak live bytes), ``device``
    (of the GPU's memory), ``checkpoint`` (the peak of plain PyTorch with the model's own
    activation checkpointing) or ``bytes``; ``note``: what an old spelling means now."""

    text: str
    kind: str
    value: float  # the fraction (footprint, peak, device) or the byte count
    note: str | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, text: str) -> BudgetSpec:
        """``"50%"`` (of the footprint), ``"50%peak"``, ``"90%device"``, ``"7.5GiB"`` / ``"1073741824"``,
        ``"checkpoint"`` (the checkpoint run's peak: umrt at checkpointing's memory); the old ``footprint``,
        ``footprint/2``, ``footprint*0.75`` with a note (read by :func:`umrt.config.read_amount`, as every
        memory amount umrt takes)."""
        if text.strip().lower() == "checkpoint":
            return cls(text, "checkpoint", 1.0)
        amount = read_amount(text, "--gpu-memory")
        if amount is not None and amount.fraction is not None:
            base = amount.base or "footprint"
            if not 0 < amount.fraction <= 1:
                raise BenchError(f"--gpu-memory {text!r}: a percentage must be in (0, 100]")
            if base not in ("footprint", "peak", "device"):
                raise BenchError(f"--gpu-memory {text!r}: give a percentage of the footprint ('50%'), of the "
                                 "ideal run's peak ('50%peak') or of the GPU's memory ('50%device')")
            note = amount.note
            if amount.implied:
                pct = f"{amount.fraction * 100:g}"
                note = (f"--gpu-memory {text.strip()} is {pct}% of the footprint the run needs (for {pct}% of the "
                        f"ideal run's peak allocated bytes, write {pct}%peak)")
            return cls(text, base, amount.fraction, note)
        if amount is None or not amount.bytes:
            raise BenchError(f"--gpu-memory {text!r}: give a percentage of the footprint the run needs ('50%'), "
                             "of the ideal run's peak ('50%peak') or of the GPU's memory ('90%device'), or a size "
                             "('7.5GiB', '512MB', a byte count)")
        nbytes = amount.bytes
        if nbytes < _MIN_BUDGET:
            raise BenchError(f"--gpu-memory {text!r} is below one 2 MB block")
        return cls(text, "bytes", float(nbytes))

    @property
    def simulated(self) -> str | None:
        """The same GPU memory for the simulator (``50%``, ``50%peak``), None when only bytes say it."""
        if self.kind in ("footprint", "peak"):
            return f"{self.value * 100:g}%" + ("peak" if self.kind == "peak" else "")
        return None

    def resolve(self, ideal_peak: int | None, footprint: int | None, device_total: int | None = None,
                checkpoint_peak: int | None = None) -> int:
        """Budget bytes; :class:`BenchError` when the figure it refers to is missing."""
        if self.kind == "bytes":
            return int(self.value)
        base, what = {"peak": (ideal_peak, "the ideal run's peak, and there is none"),
                      "footprint": (footprint, "the footprint, which the ideal and um runs measure, and there is "
                                               "none"),
                      "device": (device_total, "the GPU's memory, and no run read it"),
                      "checkpoint": (checkpoint_peak, "the checkpoint run's peak, which was not measured")}[self.kind]
        if not base:
            raise BenchError(f"--gpu-memory {self.text}: a percentage of {what}")
        return max(_MIN_BUDGET, int(base * self.value))


# ---------------------------------------------------------------- umrt's own counters


@runtime_checkable
class CountingBackend(Protocol):
    """A backend with a snapshot of what it issued: ``{"calls": {CUDA call name: count},
    "h2d_bytes": int, "d2h_bytes": int, "discarded_bytes": int}``."""

    def counters(self) -> Mapping[str, Any]: ...


@runtime_checkable
class ByteCountingBackend(Protocol):
    """A backend that counts the bytes it moved and discarded (no calls)."""

    h2d_bytes: int
    d2h_bytes: int
    discarded_bytes: int


@dataclass(frozen=True)
class Counters:
    """Bytes umrt moved and discarded, and CUDA calls it issued by name (None: not counted)."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    discarded_bytes: int = 0
    calls: Mapping[str, int] | None = None

    def minus(self, earlier: Counters) -> Counters:
        """What happened since ``earlier``."""
        calls = None
        if self.calls is not None and earlier.calls is not None:
            calls = {k: n - earlier.calls.get(k, 0) for k, n in self.calls.items()
                     if n - earlier.calls.get(k, 0)}
        return Counters(self.h2d_bytes - earlier.h2d_bytes, self.d2h_bytes - earlier.d2h_bytes,
                        self.discarded_bytes - earlier.discarded_bytes, calls)


def read_counters(backend: object) -> Counters | None:
    """A snapshot of ``backend``'s counters: its ``counters()`` where it has one, else its
    byte attributes (calls not counted); None for a backend that counts nothing."""
    if isinstance(backend, CountingBackend):
        snap = backend.counters()
        calls = snap.get("calls")
        return Counters(int(snap.get("h2d_bytes", 0)), int(snap.get("d2h_bytes", 0)),
                        int(snap.get("discarded_bytes", 0)),
                        {str(k): int(v) for k, v in calls.items()} if isinstance(calls, Mapping) else None)
    if isinstance(backend, ByteCountingBackend):
        return Counters(int(backend.h2d_bytes), int(backend.d2h_bytes), int(backend.discarded_bytes))
    return None


# ---------------------------------------------------------------- NVML's PCIe counters

NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197  # nvml.h: "PCIe transmit bytes. Value can be wrapped."
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198  # nvml.h: "PCIe receive bytes. Value can be wrapped."
_NVML_SUCCESS = 0
# nvmlValueType_t -> (union member, counter width in bits)
_VALUE_TYPES = {1: ("uiVal", 32), 2: ("ulVal", 64), 3: ("ullVal", 64), 4: ("sllVal", 64), 5: ("siVal", 32),
                6: ("usVal", 16)}


class PcieCounters:
    """PCIe bytes to (H2D, NVML's RX) and from (D2H, TX) one GPU since :meth:`start`.

    NVML's byte counters (``nvmlDeviceGetFieldValues`` with
    ``NVML_FI_DEV_PCIE_COUNT_RX_BYTES`` / ``TX_BYTES``, driver R545+) are read
    every ``interval`` seconds in a background thread, so that a counter that
    wraps (it may be 32 bits wide: 4 GiB, 90 ms at 48 GB/s) is never missed
    between two reads, and once more at each :meth:`read`. Where the driver does
    not have them, ``nvmlDeviceGetPcieThroughput`` (a rate over a 20 ms window)
    is sampled back to back and integrated over time: an estimate.
    :attr:`source` says which (``"counter"``, ``"throughput"``, or None: no NVML).

    Args:
        nvml: the ``pynvml`` module (tests pass a fake), already initialised.
        handle: the device's NVML handle.
        interval: seconds between background reads of the counters.
    """

    def __init__(self, nvml: Any, handle: Any, interval: float = 0.01) -> None:
        self.nvml, self.handle, self.interval = nvml, handle, interval
        self.source: str | None = None
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[int, int] | None = None
        self._widths = (64, 64)
        self._rx = self._tx = 0.0
        self._t_last = 0.0

    def start(self) -> PcieCounters:
        """Find the best source and start reading in the background."""
        try:
            first = self._fields()
        except Exception as exc:  # noqa: BLE001 - an old driver or binding: the rate estimate
            first = None
            self.notes.append(f"no NVML PCIe byte counters ({exc})")
        if first is None and not self.notes:
            self.notes.append("NVML PCIe byte counters not supported by this driver")
        if first is not None:
            self.source, self._last = "counter", first
        else:
            try:
                self.nvml.nvmlDeviceGetPcieThroughput(self.handle, self.nvml.NVML_PCIE_UTIL_RX_BYTES)
            except Exception as exc:  # noqa: BLE001 - e.g. a C2C-attached board
                self.notes.append(f"no NVML PCIe figures ({exc})")
                return self
            self.source = "throughput"
            self.notes.append("PCIe bytes estimated from NVML's 20 ms throughput rate")
            self._t_last = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="bench-gpu-pcie", daemon=True)
        self._thread.start()
        return self

    def read(self) -> tuple[float, float] | None:
        """``(h2d_bytes, d2h_bytes)`` since :meth:`start`, or None without a source."""
        if self.source is None:
            return None
        with self._lock:
            if self.source == "counter":
                self._sample_counters()
            return self._rx, self._tx

    def stop(self) -> None:
        """Stop the background reads."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None

    # -- sources ---------------------------------------------------------------

    def _fields(self) -> tuple[int, int] | None:
        """The raw (RX, TX) counter values; None where the driver lacks them."""
        values = self.nvml.nvmlDeviceGetFieldValues(
            self.handle, [NVML_FI_DEV_PCIE_COUNT_RX_BYTES, NVML_FI_DEV_PCIE_COUNT_TX_BYTES])
        out, widths = [], []
        for v in values:
            if int(v.nvmlReturn) != _NVML_SUCCESS or int(v.valueType) not in _VALUE_TYPES:
                return None
            member, width = _VALUE_TYPES[int(v.valueType)]
            out.append(int(getattr(v.value, member)))
            widths.append(width)
        self._widths = (widths[0], widths[1])
        return out[0], out[1]

    def _sample_counters(self) -> None:
        now = self._fields()
        if now is None or self._last is None:
            return
        self._rx += (now[0] - self._last[0]) % (1 << self._widths[0])  # a wrapped counter
        self._tx += (now[1] - self._last[1]) % (1 << self._widths[1])
        self._last = now

    def _sample_throughput(self) -> None:
        rx = self.nvml.nvmlDeviceGetPcieThroughput(self.handle, self.nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
        tx = self.nvml.nvmlDeviceGetPcieThroughput(self.handle, self.nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
        with self._lock:
            now = time.perf_counter()
            dt, self._t_last = now - self._t_last, now
            self._rx += rx * dt  # KB/s over the last 20 ms, held for the whole gap
            self._tx += tx * dt

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.source == "counter":
                    with self._lock:
                        self._sample_counters()
                else:
                    self._sample_throughput()
            except Exception as exc:  # noqa: BLE001 - NVML went away: keep what was counted
                self.notes.append(f"PCIe sampling stopped: {exc}")
                return
            self._stop.wait(self.interval)


# ---------------------------------------------------------------- per-step figures


def steady_time(times: Sequence[float]) -> float:
    """The steady-state iteration time: the median of the timed steps."""
    return float(statistics.median(times)) if times else math.nan


def steady_per_step(steps: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Means over the timed steps of what moved per step: umrt's own bytes and calls
    (by call name too) and NVML's PCIe bytes; None for a figure no step has."""
    timed = [s for s in steps if s.get("timed")]
    out: dict[str, Any] = {"steps": len(timed)}
    for key in ("h2d_bytes", "d2h_bytes", "discarded_bytes", "pcie_h2d_bytes", "pcie_d2h_bytes"):
        vals = [s[key] for s in timed if s.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals and len(vals) == len(timed) else None
    calls = [s["calls"] for s in timed if s.get("calls") is not None]
    if calls and len(calls) == len(timed):
        names = sorted({k for c in calls for k in c})
        out["calls_by_name"] = {k: sum(c.get(k, 0) for c in calls) / len(calls) for k in names}
        out["calls"] = sum(out["calls_by_name"].values())
    else:
        out["calls_by_name"] = out["calls"] = None
    return out


def compare_losses(reference: Sequence[float], losses: Sequence[float], rtol: float = LOSS_RTOL) -> dict[str, Any]:
    """Step by step against plain PyTorch's losses: ``equal`` when every step
    matches within ``rtol`` and both ran the same steps."""
    n = min(len(reference), len(losses))
    diffs = [abs(a - b) for a, b in zip(reference[:n], losses[:n], strict=True)]
    bad = [i for i, (a, d) in enumerate(zip(reference[:n], diffs, strict=True))
           if not (d <= rtol * max(1.0, abs(a)))]  # NaN fails too
    return {"steps": n, "equal": n > 0 and not bad and len(reference) == len(losses),
            "exact_steps": sum(d == 0 for d in diffs), "max_abs_diff": max(diffs) if diffs else None,
            "first_unequal_step": bad[0] if bad else None}


def bound_time(compute_s: float, h2d_bytes: float, d2h_bytes: float) -> float:
    """Issue 10's bound: max(compute time, H2D bytes / 48 GB/s, D2H bytes / 12 GB/s)."""
    return max(compute_s, h2d_bytes / H2D_BYTES_PER_S, d2h_bytes / D2H_BYTES_PER_S)


@dataclass
class TargetCheck:
    """One target, checked: ``passed`` None means it could not be checked (or has no target)."""

    budget: str
    name: str
    value: str
    target: str
    passed: bool | None
    notes: list[str] = field(default_factory=list)


def check_targets(label: str, umrt: Mapping[str, Any], ideal: Mapping[str, Any],
                  fraction_of_footprint: float | None) -> list[TargetCheck]:
    """Issue 10's targets for one umrt row (a worker's result) against the plain PyTorch row.

    At a budget >= the footprint: no PCIe traffic in the timed steps (umrt moved
    nothing, and NVML counts at most :data:`PCIE_QUIET_BYTES` per step more than
    plain PyTorch) and a steady step within :data:`FIT_RATIO` of plain PyTorch's.
    From half the footprint up: within :data:`BOUND_RATIO` of :func:`bound_time`
    with plain PyTorch's step as the compute time and umrt's own bytes per step.
    Below half the ratio is reported without a target.
    """
    if "error" in umrt:
        return [TargetCheck(label, "ran", umrt["error"], "completes", False)]
    checks: list[TargetCheck] = []
    t_umrt = umrt.get("iteration_time_s", math.nan)
    t_ideal = ideal.get("iteration_time_s", math.nan) if "error" not in ideal else math.nan
    per, per_ideal = umrt.get("per_step") or {}, ideal.get("per_step") or {}
    moved_h2d, moved_d2h = per.get("h2d_bytes"), per.get("d2h_bytes")
    if fraction_of_footprint is None:
        return [TargetCheck(label, "targets", "footprint unknown", "a budget relative to the footprint", None)]
    if fraction_of_footprint >= 1:
        moved = None if moved_h2d is None else moved_h2d + (moved_d2h or 0)
        pcie = _sum_or_none(per.get("pcie_h2d_bytes"), per.get("pcie_d2h_bytes"))
        pcie_ideal = _sum_or_none(per_ideal.get("pcie_h2d_bytes"), per_ideal.get("pcie_d2h_bytes"))
        quiet: bool | None = None if moved is None else moved == 0
        value = f"umrt moved {_b(moved)}/step"
        notes = []
        if pcie is not None:
            value += f"; NVML {_b(pcie)}/step (plain PyTorch {_b(pcie_ideal)})"
            if pcie_ideal is not None and quiet is not None:
                quiet = quiet and pcie - pcie_ideal <= PCIE_QUIET_BYTES
        else:
            notes.append("no NVML PCIe figures: umrt's own bytes only")
        checks.append(TargetCheck(label, "no PCIe traffic after learning", value,
                                  f"0 B by umrt, NVML <= plain + {_b(PCIE_QUIET_BYTES)}", quiet, notes))
        ratio = t_umrt / t_ideal if _finite(t_umrt, t_ideal) else None
        checks.append(TargetCheck(label, "step vs plain PyTorch", _x(ratio), f"<= {FIT_RATIO:.2f}x",
                                  None if ratio is None else ratio <= FIT_RATIO))
        return checks
    if moved_h2d is None or not _finite(t_umrt, t_ideal):
        return [TargetCheck(label, "step vs bound", "-", f"<= {BOUND_RATIO}x", None,
                            ["needs umrt's bytes per step and both step times"])]
    bound = bound_time(t_ideal, moved_h2d, moved_d2h or 0)
    ratio = t_umrt / bound
    value = (f"{_x(ratio)} of {bound * 1e3:.1f} ms = max(compute {t_ideal * 1e3:.1f} ms, "
             f"H2D {_b(moved_h2d)} / 48 GB/s, D2H {_b(moved_d2h or 0)} / 12 GB/s)")
    if fraction_of_footprint >= 0.5:
        return [TargetCheck(label, "step vs bound", value, f"<= {BOUND_RATIO}x", ratio <= BOUND_RATIO)]
    return [TargetCheck(label, "step vs bound", value, "none below half the footprint", None)]


def check_losses(label: str, row: Mapping[str, Any]) -> TargetCheck:
    """The loss comparison a row carries (:func:`compare_losses`) as a check."""
    lc = row.get("loss_check")
    if "error" in row or not lc:
        return TargetCheck(label, "losses equal plain PyTorch", "-", f"rtol {LOSS_RTOL:g}", None)
    value = (f"{lc['exact_steps']}/{lc['steps']} exact, max diff {lc['max_abs_diff']:.3g}"
             if lc["max_abs_diff"] is not None else "no steps")
    if lc["first_unequal_step"] is not None:
        value += f", first unequal step {lc['first_unequal_step']}"
    return TargetCheck(label, "losses equal plain PyTorch", value, f"every step, rtol {LOSS_RTOL:g}", lc["equal"])


def _finite(*xs: Any) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


def _sum_or_none(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _b(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"
