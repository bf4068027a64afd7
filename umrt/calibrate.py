"""Measure a GPU's Unified Memory behaviour and write a hardware profile.

``umrt calibrate`` runs the micro-benchmarks of ``h100-measured.md`` on the
user's GPU (through a :class:`Probe`), fits the simulator's parameters to
them (:func:`fit_parameters`) and writes a profile file in the schema of
``umrt/profiles/*.json`` (:func:`build_profile`), starting from the shipped
profile of the card it identified (:func:`identify_card`) for what it does
not measure (datasheet peaks, the driver's constants).

What is measured, and the parameter each measurement fits (``umrt/sim/MODEL.md``):

============================================  ===================================================
measurement                                   parameter(s)
============================================  ===================================================
single prefetch calls to the GPU, by size     ``prefetch_h2d_setup_s`` + size / ``prefetch_h2d_rate``
the same to the host (host pages populated)   ``prefetch_d2h_setup_s``, ``prefetch_d2h_rate``
first prefetch to the host of a GPU-born range ``host_populate_rate``
no-op prefetch calls (2 MiB, resident)        ``prefetch_call_overhead_s``
``cudaMemAdvise`` calls                       ``advise_call_s``
batched prefetch of resident ranges (no-op)   ``batch_range_s``
batched prefetch to the host                  ``batch_d2h_range_s``
a kernel faulting one host-resident page      ``fault_batch_latency_s`` (with the next row)
a kernel writing a host-resident range        ``fault_migration_rate``
a kernel writing a fresh range                ``first_touch_rate``
a prefetch to the GPU of a fresh range        ``prefetch_populate_rate``
discard calls (one range, many ranges)        ``discard_rate``, ``discard_range_s``
a kernel writing a discarded range            ``discard_refault_rate``
a prefetch to the GPU of a discarded range    ``discard_prefetch_rate``
pinned ``cudaMemcpyAsync`` each way           ``h2d_bandwidth``, ``d2h_bandwidth`` (the link)
an fp32 matmul; a device-to-device copy       ``compute_efficiency``, ``memory_efficiency``
``cudaMemGetInfo``                            ``gpu_memory_bytes``
============================================  ===================================================

Each kernel timing has the same kernel's time on resident memory subtracted
(what is left is the Unified Memory cost). No buffer set exceeds a quarter
of the device's *free* memory: oversubscription is emulated by umrt's
budget, never by asking the driver for more than it has.

The measuring is behind :class:`Probe` so that orchestration and fitting are
tested without a GPU: :class:`SimProbe` runs the same operations on the
simulator (``tests/test_calibrate.py`` recovers a profile's parameters from
it, and ``bench/fidelity.py`` uses it for the simulated side of its table).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from umrt.backends.base import (
    HOST,
    PAGE,  # the driver's big page: one fault entry migrates one
    Advice,
)
from umrt.backends.cuda import default_api, gpu_count
from umrt.errors import UmrtError
from umrt.hardware import (
    GIB,
    KIB,
    MIB,
    identify_card,
    load_profile,
)

SMALL_PAGE = 4 * KIB  # what the one-page fault kernel writes into
SWEEP = (2 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, GIB)  # prefetch call sizes (h100-measured.md)
BATCH_RANGE = 2 * MIB
DEFAULT_FAULT_BATCH = 256  # uvm_gpu_replayable_faults.c


class NoGpuError(UmrtError):
    """Calibration needs a CUDA GPU."""


class CalibrationError(UmrtError):
    """Measurements that no positive parameter explains (say which)."""


# ---------------------------------------------------------------------------
# What a probe measures
# ---------------------------------------------------------------------------
class Probe:
    """The operations calibration times, each synchronised, in seconds.

    :class:`CudaProbe` runs them on a GPU, :class:`SimProbe` on the simulator.
    A probe never holds more managed memory than the sizes it is asked for.
    ``kernel writes`` are one kernel that writes every byte of a range (a fill).
    """

    device_name: str = "unknown"
    total_bytes: int = 0
    free_bytes: int = 0
    sm_count: int = 0
    host_page_tables: bool = False  # coherent access through the host's page tables (NVLink-C2C, ATS)
    has_batch: bool = True  # CUDA 13's batched prefetch and discard calls exist

    def prefetch(self, size: int, count: int, to_device: bool) -> float:
        """``count`` back-to-back single prefetch calls of ``size`` bytes (consecutive ranges),
        their data on the other side with its host pages populated."""
        raise NotImplementedError

    def prefetch_first_to_host(self, nbytes: int) -> float:
        """One prefetch to the host of a range a kernel just wrote on the GPU (no host pages yet)."""
        raise NotImplementedError

    def prefetch_both(self, nbytes: int) -> float:
        """``nbytes`` to the host and another ``nbytes`` to the GPU, issued together on two streams."""
        raise NotImplementedError

    def prefetch_noop(self, count: int) -> float:
        """``count`` prefetch calls of 2 MiB ranges already on the GPU."""
        raise NotImplementedError

    def advise(self, count: int) -> float:
        """``count`` ``cudaMemAdvise(SetAccessedBy, GPU)`` calls on 2 MiB ranges."""
        raise NotImplementedError

    def batch_prefetch(self, ranges: int, size: int, target: str) -> float:
        """One ``cudaMemPrefetchBatchAsync`` of ``ranges`` ranges of ``size``: ``target`` is
        ``"resident"`` (to the GPU, already there), ``"gpu"`` (from the host) or ``"host"``."""
        raise NotImplementedError

    def write_one_page(self, resident: bool) -> float:
        """A kernel writing 4 bytes of a 4 KiB page, host-resident (``False``) or on the GPU."""
        raise NotImplementedError

    def write(self, nbytes: int, state: str) -> float:
        """A kernel writing ``nbytes`` whose pages are ``state``: ``"resident"`` (on the GPU),
        ``"host"`` (written on the host), ``"fresh"`` (never touched), ``"discarded"`` (on the
        GPU, then discarded), ``"discarded-preferred"`` (the same with PreferredLocation=GPU),
        ``"host-discarded"`` (moved to the host, then discarded), ``"prefetched"`` (fresh, then
        prefetched to the GPU), ``"discard-prefetched"`` (discarded, then prefetched to the GPU),
        ``"discard-and-prefetched"`` (one discard-and-prefetch call to the GPU)."""
        raise NotImplementedError

    def populate_prefetch(self, nbytes: int) -> float:
        """One prefetch to the GPU of a fresh (never touched) range."""
        raise NotImplementedError

    def discard(self, nbytes: int, ranges: int, calls: int = 1) -> float:
        """Discard a GPU-resident range of ``nbytes`` in ``calls`` calls of ``ranges`` equal ranges each."""
        raise NotImplementedError

    def discard_then_prefetch(self, nbytes: int) -> float:
        """A GPU-resident range is discarded (not timed), then one prefetch to the GPU (timed)."""
        raise NotImplementedError

    def discard_and_prefetch(self, nbytes: int) -> float:
        """One discard-and-prefetch call to the GPU of a GPU-resident range."""
        raise NotImplementedError

    def pinned_copy(self, nbytes: int, to_device: bool) -> float:
        """One ``cudaMemcpyAsync`` of pinned host memory and device memory."""
        raise NotImplementedError

    def matmul(self, n: int) -> float:
        """One ``n x n x n`` fp32 matrix multiply on device memory."""
        raise NotImplementedError

    def device_copy(self, nbytes: int) -> float:
        """A device-to-device copy of ``nbytes`` (it reads and writes ``nbytes`` each)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass
class Measurements:
    """Everything :func:`fit_parameters` needs: (bytes, seconds) pairs, ``None`` where not measured.

    ``origin`` says where and when (it goes into every fitted field's source);
    ``keys`` may name, per field, the raw measurement it came from.
    """

    device_name: str
    total_bytes: int
    origin: str = ""
    sm_count: int = 0
    host_page_tables: bool = False
    prefetch_h2d: list[tuple[int, float]] = field(default_factory=list)  # (bytes per call, s per call)
    prefetch_d2h: list[tuple[int, float]] = field(default_factory=list)  # host pages populated
    prefetch_d2h_first: tuple[int, float] | None = None
    prefetch_noop_call_s: list[float] = field(default_factory=list)  # per call
    advise_call_s: float | None = None
    batch_noop: tuple[int, float] | None = None  # (ranges, s)
    batch_d2h: tuple[int, int, float] | None = None  # (ranges, bytes each, s)
    one_page_fault_s: float | None = None  # the fault kernel minus the resident one
    kernel_write: tuple[int, float] | None = None  # the write kernel on resident memory
    fault_write: tuple[int, float] | None = None  # ... on host-resident memory
    first_touch: tuple[int, float] | None = None
    populate_prefetch: tuple[int, float] | None = None
    discard: tuple[int, float] | None = None  # one range
    discard_ranges: tuple[int, int, float] | None = None  # (bytes, ranges, s): one call
    discard_write: tuple[int, float] | None = None
    discard_prefetch: tuple[int, float] | None = None
    pinned_h2d_rate: float | None = None
    pinned_d2h_rate: float | None = None
    matmul: tuple[int, float] | None = None  # (n, s), fp32
    device_copy: tuple[int, float] | None = None  # (bytes copied, s)
    keys: dict[str, str] = field(default_factory=dict)

    def kernel_seconds(self, nbytes: int) -> float:
        """The write kernel's own time for ``nbytes`` (scaled from :attr:`kernel_write`; 0 if unmeasured)."""
        if not self.kernel_write:
            return 0.0
        size, secs = self.kernel_write
        return secs * nbytes / size


# ---------------------------------------------------------------------------
# Fitting: pure arithmetic
# ---------------------------------------------------------------------------
def fit_fixed_plus_rate(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Fit ``seconds = fixed + bytes / rate`` to ``(bytes, seconds)`` points; return ``(fixed, rate)``.

    Least squares on the relative error (every size counts alike); a negative
    fixed cost is clamped to 0 (then the rate is refitted alone). One point
    gives ``fixed = 0``.
    """
    pts = [(float(s), float(t)) for s, t in points if s > 0 and t > 0]
    if not pts:
        raise CalibrationError("no (size, time) points to fit")
    # minimise sum(((c + s*k) / t - 1)^2) over (c, k): two linear normal equations
    a11 = sum(1 / t**2 for _, t in pts)
    a12 = sum(s / t**2 for s, t in pts)
    a22 = sum(s * s / t**2 for s, t in pts)
    b1 = sum(1 / t for _, t in pts)
    b2 = sum(s / t for s, t in pts)
    det = a11 * a22 - a12 * a12
    c = (b1 * a22 - b2 * a12) / det if len(pts) > 1 and det > 0 else -1.0
    k = (a11 * b2 - a12 * b1) / det if c >= 0 else 0.0
    if c < 0:
        c, k = 0.0, b2 / a22
    if k <= 0:
        raise CalibrationError(f"the times {[t for _, t in pts]} do not grow with size: no transfer rate fits them")
    return c, 1.0 / k


def fault_batches(nbytes: int, batch_size: int = DEFAULT_FAULT_BATCH) -> int:
    """Fault batches the simulator services for a kernel touching every page of ``nbytes``."""
    pages = -(-nbytes // PAGE)
    return -(-pages // batch_size)


def _positive(name: str, what: str, num: float, den: float) -> float:
    if den <= 0 or num <= 0:
        raise CalibrationError(f"{what}: the measurement leaves no positive time for {name} ({den:.3g} s)")
    return num / den


def fit_parameters(m: Measurements, batch_size: int = DEFAULT_FAULT_BATCH) -> dict[str, tuple[float, str]]:
    """The simulator's parameters from ``m``: ``{field: (value, how it was fitted)}``.

    Only what ``m`` holds is fitted; each formula inverts what the simulator
    computes for the same operation (``umrt/sim/MODEL.md``), so a fitted
    measurement is reproduced by ``SimProbe`` on the resulting profile.
    Raises :class:`CalibrationError` for measurements no positive value explains.
    """
    out: dict[str, tuple[float, str]] = {}
    call = statistics.fmean(m.prefetch_noop_call_s) if m.prefetch_noop_call_s else 0.0
    if m.prefetch_noop_call_s:
        out["prefetch_call_overhead_s"] = (call, "mean CPU time of a prefetch call that moves nothing "
                                                 f"({len(m.prefetch_noop_call_s)} measurement(s))")
    for d, pts in (("h2d", m.prefetch_h2d), ("d2h", m.prefetch_d2h)):
        if pts:
            setup, rate = fit_fixed_plus_rate(pts)
            how = (f"fit of set-up + size/rate to {len(pts)} single prefetch calls "
                   f"{'to the GPU' if d == 'h2d' else 'to the host (host pages populated)'}, "
                   f"{min(s for s, _ in pts) / MIB:g} MiB - {max(s for s, _ in pts) / MIB:g} MiB")
            out[f"prefetch_{d}_setup_s"] = (setup, how)
            out[f"prefetch_{d}_rate"] = (rate, how)
    setup_h = out.get("prefetch_h2d_setup_s", (0.0, ""))[0]
    if m.prefetch_d2h_first and "prefetch_d2h_rate" in out:
        size, secs = m.prefetch_d2h_first
        later = out["prefetch_d2h_setup_s"][0] + size / out["prefetch_d2h_rate"][0]
        out["host_populate_rate"] = (
            _positive("host population", "first prefetch to the host", size, secs - call - later),
            f"first prefetch to the host of {size / MIB:g} MiB minus a later one (fitted rate)")
    if m.batch_noop:
        n, secs = m.batch_noop
        out["batch_range_s"] = (max(secs - call, 0.0) / n, f"one batched prefetch of {n} resident ranges, per range")
    if m.advise_call_s is not None:
        out["advise_call_s"] = (m.advise_call_s, "cudaMemAdvise(SetAccessedBy) on 2 MiB ranges, per call")
    if m.batch_d2h and "prefetch_d2h_rate" in out:
        n, size, secs = m.batch_d2h
        per_range = (secs - call - out.get("batch_range_s", (0.0, ""))[0]) / n
        single = out["prefetch_d2h_setup_s"][0] + size / out["prefetch_d2h_rate"][0]
        out["batch_d2h_range_s"] = (max(per_range - single, 0.0),
                                    f"one batched prefetch of {n} x {size / MIB:g} MiB to the host, per range, "
                                    "minus a single call's migration")
    latency = None
    if m.one_page_fault_s is not None and m.fault_write:
        size, secs = m.fault_write
        nb = fault_batches(size, batch_size)
        um = secs - m.kernel_seconds(size)
        # L + PAGE/R = one page; nb*L + size/R = um  =>  R = (size - nb*PAGE) / (um - nb*one)
        rate = _positive("fault-driven migration", "kernel writing a host-resident range", size - nb * PAGE,
                         um - nb * m.one_page_fault_s)
        latency = m.one_page_fault_s - PAGE / rate
        if latency < 0:
            raise CalibrationError(f"one-page fault {m.one_page_fault_s * 1e6:.1f} us is shorter than migrating "
                                   f"one 64 KiB page at the fault-driven rate {rate / 1e9:.2f} GB/s")
        how = (f"solved from a kernel faulting one host-resident page ({m.one_page_fault_s * 1e6:.1f} us) and one "
               f"writing {size / MIB:g} MiB of host-resident data ({nb} batches of {batch_size} 64 KiB pages)")
        out["fault_batch_latency_s"] = (latency, how)
        out["fault_migration_rate"] = (rate, how)
    elif m.one_page_fault_s is not None:
        latency = m.one_page_fault_s
        out["fault_batch_latency_s"] = (latency, "a kernel faulting one host-resident page, minus the resident kernel")
    lat = latency or 0.0
    for key, meas, what in (("first_touch_rate", m.first_touch, "a kernel writing a fresh range (zero-fill faults)"),
                            ("discard_refault_rate", m.discard_write, "a kernel writing a discarded GPU-resident range")):
        if meas:
            size, secs = meas
            um = secs - m.kernel_seconds(size) - fault_batches(size, batch_size) * lat
            out[key] = (_positive(key, what, size, um), f"{what}, {size / MIB:g} MiB, minus the kernel and the batch latency")
    for key, meas, what in (("prefetch_populate_rate", m.populate_prefetch, "a prefetch to the GPU of a fresh range"),
                            ("discard_prefetch_rate", m.discard_prefetch,
                             "a prefetch to the GPU of a discarded GPU-resident range")):
        if meas:
            size, secs = meas
            out[key] = (_positive(key, what, size, secs - call - setup_h),
                        f"{what}, {size / MIB:g} MiB, minus the call and the prefetch set-up")
    if m.discard and m.discard_ranges:
        s1, t1 = m.discard
        s2, n, t2 = m.discard_ranges
        # t1 = call + r + s1/R ; t2 = call + n*r + s2/R  (two linear equations in r and 1/R)
        a, b = t1 - call, t2 - call
        det = s2 - n * s1
        inv_rate = (b - n * a) / det if det else 0.0
        per_range = a - s1 * inv_rate if det else (b - a) / (n - 1)
        if det == 0:
            inv_rate = (a - per_range) / s1
        if inv_rate <= 0:
            raise CalibrationError("discard calls: the time does not grow with the bytes discarded")
        how = f"discard calls of {s1 / MIB:g} MiB in one range and {s2 / MIB:g} MiB in {n} ranges"
        out["discard_rate"] = (1.0 / inv_rate, how)
        out["discard_range_s"] = (max(per_range, 0.0), how)
    if m.pinned_h2d_rate:
        out["h2d_bandwidth"] = (m.pinned_h2d_rate, "pinned cudaMemcpyAsync host -> device (the link)")
    if m.pinned_d2h_rate:
        out["d2h_bandwidth"] = (m.pinned_d2h_rate, "pinned cudaMemcpyAsync device -> host (the link)")
    if m.total_bytes:
        out["gpu_memory_bytes"] = (int(m.total_bytes), "cudaMemGetInfo total")
    return out


def measured_rates(m: Measurements) -> dict[str, tuple[float, str]]:
    """Achieved compute and HBM rates: ``{"fp32_flops": ...,"hbm": ...}`` (FLOP/s, bytes/s)."""
    out: dict[str, tuple[float, str]] = {}
    if m.matmul:
        n, secs = m.matmul
        out["fp32_flops"] = (2.0 * n**3 / secs, f"{n}^3 fp32 matmul in {secs * 1e3:.2f} ms")
    if m.device_copy:
        size, secs = m.device_copy
        out["hbm"] = (2.0 * size / secs, f"device-to-device copy of {size / MIB:g} MiB (read + written bytes)")
    return out


# ---------------------------------------------------------------------------
# Which card: umrt.hardware.identify_card (the shipped profiles live there)
# ---------------------------------------------------------------------------
def profile_slug(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"


# ---------------------------------------------------------------------------
# Profile
# ---------------------------------------------------------------------------
def build_profile(m: Measurements, base: Any = None, name: str | None = None,
                  batch_size: int | None = None, description: str | None = None) -> Any:
    """A :class:`umrt.hardware.HardwareProfile`: ``base`` with every fitted field replaced.

    ``base`` (a shipped profile name or a profile; default: the card
    :func:`identify_card` names) supplies the datasheet peaks, which the
    matmul and copy turn into ``compute_efficiency`` and ``memory_efficiency``,
    and every field not measured (its source kept, saying so).
    """
    card = identify_card(m.device_name, m.sm_count, m.total_bytes, m.host_page_tables)
    base = load_profile(base or card.base_profile)
    fitted = fit_parameters(m, batch_size or base.fault_batch_size)
    origin = m.origin or (
        f"measured by umrt calibrate on {m.device_name}, "
        f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d')}")
    values: dict[str, Any] = {}
    sources = dict(base.sources)

    def put(key: str, value: float, how: str) -> None:
        values[key] = value
        raw = f"; {m.keys[key]}" if key in m.keys else ""
        sources[key] = f"{origin}: {how}{raw}"

    for key, (value, how) in fitted.items():
        put(key, value, how)
    rates = measured_rates(m)
    if "fp32_flops" in rates:
        rate, how = rates["fp32_flops"]
        peak = base.peak_flops_fp32 or base.peak_flops
        if rate > peak:  # faster than the base's datasheet: not that card; the measured rate is the peak
            put("peak_flops_fp32", rate, how + " (above the base profile's datasheet peak)")
            peak = rate
        put("compute_efficiency", rate / peak,
            f"{how} = {rate / 1e12:.1f} TFLOP/s, over the datasheet FP32 peak {peak / 1e12:.1f} "
            "(taken for every precision)")
    if "hbm" in rates:
        rate, how = rates["hbm"]
        peak = base.hbm_bandwidth
        if rate > peak:
            put("hbm_bandwidth", rate, how + " (above the base profile's datasheet bandwidth)")
            peak = rate
        put("memory_efficiency", rate / peak, f"{how} = {rate / 1e12:.2f} TB/s, over the datasheet {peak / 1e12:.2f}")
    form = {"sxm": "SXM", "pcie": "PCIe", "c2c": "NVLink-C2C", "unknown": "form factor unknown"}[card.form_factor]
    description = description or (f"{m.device_name} ({form}: {card.evidence}); calibrated: {origin}; "
                                  f"not measured: as {base.name}")
    return dataclasses.replace(base, name=name or f"calibrated-{profile_slug(m.device_name)}", sources=sources,
                               description=description, **values)


# ---------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The sizes one calibration uses, all within a quarter of the free memory."""

    big: int  # the range of the population, fault and discard measurements
    sweep: tuple[int, ...]  # prefetch call sizes
    sweep_total: int  # bytes each size's calls move
    batch_ranges: int  # ranges of 2 MiB in the batched calls
    discard_ranges: int
    matmul_n: int
    copy_bytes: int


def plan_sizes(free_bytes: int) -> Plan:
    """Sizes for a device with ``free_bytes`` free: never more than a quarter of it at once.

    Raises :class:`UmrtError` when less than 256 MiB are free.
    """
    budget = free_bytes // 4
    if budget < 64 * MIB:
        raise UmrtError(f"only {free_bytes} bytes free on the GPU: too little to calibrate (256 MiB needed)")
    big = 1 << int(math.log2(min(2 * GIB, budget)))
    sweep = tuple(s for s in SWEEP if s <= big)
    ranges = big // BATCH_RANGE
    n = 8192 if budget >= 3 * 8192 * 8192 * 4 else 4096
    return Plan(big=big, sweep=sweep, sweep_total=min(GIB, big), batch_ranges=min(1024, ranges),
                discard_ranges=min(2048, ranges), matmul_n=n, copy_bytes=min(2 * GIB, budget // 2))


def _median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def measure(probe: Probe, repeats: int = 5, progress: Callable[[str], None] | None = None,
            plan: Plan | None = None) -> Measurements:
    """Run every measurement on ``probe`` (medians of ``repeats``) and return them.

    Without CUDA 13's batched calls (``probe.has_batch`` false) the discard and
    batch measurements are skipped; their fields keep the base profile's values.
    """
    if repeats < 1:
        raise UmrtError(f"repeats={repeats} must be >= 1")
    plan = plan or plan_sizes(probe.free_bytes)
    step = progress or (lambda _label: None)
    big = plan.big
    m = Measurements(probe.device_name, probe.total_bytes, sm_count=probe.sm_count,
                     host_page_tables=probe.host_page_tables)
    step("prefetch calls by size")
    for size in plan.sweep:
        count = max(1, plan.sweep_total // size)
        m.prefetch_h2d.append((size, _median(lambda s=size, c=count: probe.prefetch(s, c, True), repeats) / count))
        m.prefetch_d2h.append((size, _median(lambda s=size, c=count: probe.prefetch(s, c, False), repeats) / count))
    for label in ("h2d", "d2h"):  # one call of the whole range
        pts = m.prefetch_h2d if label == "h2d" else m.prefetch_d2h
        if big not in {s for s, _ in pts}:
            pts.append((big, _median(lambda d=label: probe.prefetch(big, 1, d == "h2d"), repeats)))
    step("first prefetch to the host")
    m.prefetch_d2h_first = (big, _median(lambda: probe.prefetch_first_to_host(big), repeats))
    step("call costs")
    m.prefetch_noop_call_s = [_median(lambda: probe.prefetch_noop(1000), repeats) / 1000]
    m.advise_call_s = _median(lambda: probe.advise(1000), repeats) / 1000
    step("faults")
    m.one_page_fault_s = max(_median(lambda: probe.write_one_page(False), 4 * repeats)
                             - _median(lambda: probe.write_one_page(True), 4 * repeats), 1e-7)
    m.kernel_write = (big, _median(lambda: probe.write(big, "resident"), repeats))
    m.fault_write = (big, _median(lambda: probe.write(big, "host"), repeats))
    step("first touch")
    m.first_touch = (big, _median(lambda: probe.write(big, "fresh"), repeats))
    m.populate_prefetch = (big, _median(lambda: probe.populate_prefetch(big), repeats))
    if probe.has_batch:
        step("batched calls")
        n = plan.batch_ranges
        m.batch_noop = (n, _median(lambda: probe.batch_prefetch(n, BATCH_RANGE, "resident"), repeats))
        m.batch_d2h = (n, BATCH_RANGE, _median(lambda: probe.batch_prefetch(n, BATCH_RANGE, "host"), repeats))
        step("discard")
        m.discard = (big, _median(lambda: probe.discard(big, 1), repeats))
        m.discard_ranges = (big, plan.discard_ranges, _median(lambda: probe.discard(big, plan.discard_ranges), repeats))
        m.discard_write = (big, _median(lambda: probe.write(big, "discarded"), max(1, repeats // 2)))
        m.discard_prefetch = (big, _median(lambda: probe.discard_then_prefetch(big), repeats))
    step("link, compute, HBM")
    m.pinned_h2d_rate = big / _median(lambda: probe.pinned_copy(big, True), repeats)
    m.pinned_d2h_rate = big / _median(lambda: probe.pinned_copy(big, False), repeats)
    m.matmul = (plan.matmul_n, _median(lambda: probe.matmul(plan.matmul_n), repeats))
    m.device_copy = (plan.copy_bytes, _median(lambda: probe.device_copy(plan.copy_bytes), repeats))
    return m


MEASURE_STEPS = 8  # progress steps :func:`measure` reports with batched calls (6 without)


# ---------------------------------------------------------------------------
# The simulator as a probe
# ---------------------------------------------------------------------------
class SimProbe(Probe):
    """The same operations on the simulator (:class:`umrt.sim.backend.SimBackend`), each on a fresh GPU.

    ``kernel_rate``: bytes/s the write kernel reaches on resident memory (the
    micro-benchmarks' kernel is CuPy's fill, slower than a copy); ``None``:
    the roofline's own figure for a kernel writing the range.
    """

    def __init__(self, profile: Any, kernel_rate: float | None = None) -> None:
        self.profile = load_profile(profile)
        self.kernel_rate = kernel_rate
        self.device_name = f"simulated {self.profile.name}"
        self.total_bytes = self.free_bytes = self.profile.gpu_memory_bytes

    # -- helpers
    def _gpu(self) -> Any:
        # optional: SimProbe alone runs the simulator (numba); measuring a real GPU must not compile it
        from umrt.sim.backend import SimBackend

        return SimBackend(self.profile)

    def _kernel_bytes(self, nbytes: int) -> int:
        if self.kernel_rate is None:
            return nbytes
        return int(nbytes * self.profile.achieved_hbm_bandwidth / self.kernel_rate)

    def _fill(self, b: Any, ptr: int, nbytes: int) -> None:
        b.launch([], [(ptr, nbytes)], 0, self._kernel_bytes(nbytes))

    @staticmethod
    def _timed(b: Any, fn: Callable[[], None]) -> float:
        b.synchronize()
        t0 = b.now()
        fn()
        b.synchronize()
        return b.now() - t0

    def _on_gpu(self, b: Any, nbytes: int, host_pages: bool = True) -> int:
        """A range written on the host (its host pages populated), then moved to the GPU."""
        ptr = b.malloc(nbytes)
        if host_pages:
            b.mark_host_written([(ptr, nbytes)])
            b.prefetch([(ptr, nbytes)], 0)
        else:
            self._fill(b, ptr, nbytes)
        b.synchronize()
        return ptr

    # -- operations
    def prefetch(self, size: int, count: int, to_device: bool) -> float:
        b = self._gpu()
        ptr = b.malloc(size * count)
        b.mark_host_written([(ptr, size * count)])
        if not to_device:
            b.prefetch([(ptr, size * count)], 0)
        target = 0 if to_device else HOST
        return self._timed(b, lambda: [b.prefetch([(ptr + i * size, size)], target) for i in range(count)])

    def prefetch_first_to_host(self, nbytes: int) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, nbytes, host_pages=False)
        return self._timed(b, lambda: b.prefetch([(ptr, nbytes)], HOST))

    def prefetch_both(self, nbytes: int) -> float:
        b = self._gpu()
        out = self._on_gpu(b, nbytes)
        inn = b.malloc(nbytes)
        b.mark_host_written([(inn, nbytes)])
        return self._timed(b, lambda: (b.prefetch([(out, nbytes)], HOST), b.prefetch([(inn, nbytes)], 0)))

    def prefetch_noop(self, count: int) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, BATCH_RANGE)
        return self._timed(b, lambda: [b.prefetch([(ptr, BATCH_RANGE)], 0) for _ in range(count)])

    def advise(self, count: int) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, BATCH_RANGE)
        return self._timed(b, lambda: [b.advise([(ptr, BATCH_RANGE)], Advice.SET_ACCESSED_BY, 0)
                                       for _ in range(count)])

    def batch_prefetch(self, ranges: int, size: int, target: str) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, ranges * size) if target != "gpu" else b.malloc(ranges * size)
        if target == "gpu":
            b.mark_host_written([(ptr, ranges * size)])
        rs = [(ptr + i * size, size) for i in range(ranges)]
        return self._timed(b, lambda: b.prefetch_batch(rs, HOST if target == "host" else 0))

    def write_one_page(self, resident: bool) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, BATCH_RANGE) if resident else b.malloc(BATCH_RANGE)
        if not resident:
            b.mark_host_written([(ptr, BATCH_RANGE)])
        return self._timed(b, lambda: b.launch([], [(ptr, 4)], 0, 0))

    def write(self, nbytes: int, state: str) -> float:
        b = self._gpu()
        r = [(0, nbytes)]
        if state == "fresh":
            ptr = b.malloc(nbytes)
        elif state == "host":
            ptr = b.malloc(nbytes)
            b.mark_host_written([(ptr, nbytes)])
        elif state == "prefetched":
            ptr = b.malloc(nbytes)
            b.prefetch([(ptr, nbytes)], 0)
        else:
            ptr = self._on_gpu(b, nbytes, host_pages=state == "host-discarded")
            r = [(ptr, nbytes)]
            if state == "discarded-preferred":
                b.advise(r, Advice.SET_PREFERRED_LOCATION, 0)
            if state == "host-discarded":
                b.prefetch(r, HOST)
            if state == "discard-and-prefetched":
                b.discard_and_prefetch(r, 0)
            elif state != "resident":
                if state not in ("discarded", "discarded-preferred", "host-discarded", "discard-prefetched"):
                    raise ValueError(f"unknown state {state!r}")
                b.discard(r)
            if state == "discard-prefetched":
                b.prefetch(r, 0)
        b.synchronize()
        return self._timed(b, lambda: self._fill(b, ptr, nbytes))

    def populate_prefetch(self, nbytes: int) -> float:
        b = self._gpu()
        ptr = b.malloc(nbytes)
        return self._timed(b, lambda: b.prefetch([(ptr, nbytes)], 0))

    def discard(self, nbytes: int, ranges: int, calls: int = 1) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, nbytes)
        size = nbytes // (ranges * calls)
        rs = [(ptr + i * size, size) for i in range(ranges * calls)]
        return self._timed(b, lambda: [b.discard(rs[c * ranges:(c + 1) * ranges]) for c in range(calls)])

    def discard_then_prefetch(self, nbytes: int) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, nbytes)
        b.discard([(ptr, nbytes)])
        b.synchronize()
        return self._timed(b, lambda: b.prefetch([(ptr, nbytes)], 0))

    def discard_and_prefetch(self, nbytes: int) -> float:
        b = self._gpu()
        ptr = self._on_gpu(b, nbytes)
        return self._timed(b, lambda: b.discard_and_prefetch([(ptr, nbytes)], 0))

    def pinned_copy(self, nbytes: int, to_device: bool) -> float:
        raise NotImplementedError("the simulator has no cudaMemcpy: the link rate is a parameter "
                                  "(remote access uses it)")

    def matmul(self, n: int) -> float:
        b = self._gpu()
        ptr = b.malloc(3 * n * n * 4)
        b.mark_host_written([(ptr, 2 * n * n * 4)])
        b.prefetch([(ptr, 3 * n * n * 4)], 0)
        b.launch([], [(ptr + 2 * n * n * 4, n * n * 4)], 0, 0)  # the output is resident
        b.synchronize()
        return self._timed(b, lambda: b.launch([(ptr, 2 * n * n * 4)], [(ptr + 2 * n * n * 4, n * n * 4)],
                                               2 * n**3, 3 * n * n * 4, "fp32"))

    def device_copy(self, nbytes: int) -> float:
        b = self._gpu()
        src = self._on_gpu(b, nbytes)
        dst = self._on_gpu(b, nbytes)
        return self._timed(b, lambda: b.launch([(src, nbytes)], [(dst, nbytes)], 0, 2 * nbytes))


# ---------------------------------------------------------------------------
# The real probe (CUDA GPU): CuPy arrays and kernels, umrt's runtime adapter for UM calls
# ---------------------------------------------------------------------------
class CudaProbe(Probe):
    """Measures on CUDA device ``device``: the operations of ``../shared/gpu-probes`` (um_micro_1-3).

    Kernels are CuPy's (``fill``, ``copyto``, ``matmul``), as in the probes that
    measured ``h100-measured.md``; Unified Memory calls go through umrt's own
    runtime adapter (:func:`umrt.backends.cuda.default_api`), on created
    non-blocking streams (CUDA 13's batched calls refuse the legacy stream).
    """

    def __init__(self, device: int = 0) -> None:
        if gpu_count() == 0:
            raise NoGpuError("umrt calibrate needs a CUDA GPU and none was found "
                             "(use the shipped profiles, e.g. --simulate h100-sxm5-80g, without one)")
        import cupy

        self.cp = cupy
        self.api = default_api()
        self.api.set_device(device)
        cupy.cuda.Device(device).use()
        self.device = device
        self.has_batch = bool(self.api.has_batch)
        self.stream = self.api.create_stream()
        self.stream2 = self.api.create_stream()
        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(device)
        raw = props["name"]
        self.device_name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.sm_count = int(props.get("multiProcessorCount", 0))
        try:
            self.host_page_tables = bool(rt.deviceGetAttribute(100, device))  # PageableMemoryAccessUsesHostPageTables
        except Exception:  # noqa: BLE001 - an old runtime without the attribute: not coherent
            self.host_page_tables = False
        self.free_bytes, self.total_bytes = self.api.mem_get_info()
        self._live: list[int] = []

    # -- helpers
    def _sync(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()

    def _timed(self, fn: Callable[[], Any]) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - t0

    def _alloc(self, nbytes: int) -> int:
        ptr = self.api.malloc_managed(nbytes)
        self._live.append(ptr)
        return ptr

    def _free_all(self) -> None:
        self._sync()
        for ptr in self._live:
            self.api.free(ptr)
        self._live.clear()
        self.cp.get_default_memory_pool().free_all_blocks()

    def _array(self, ptr: int, nbytes: int) -> Any:
        cp = self.cp
        mem = cp.cuda.UnownedMemory(ptr, nbytes, self, self.device)
        return cp.ndarray((nbytes // 4,), cp.float32, cp.cuda.MemoryPointer(mem, 0))

    def _to(self, ptr: int, nbytes: int, device: int, stream: Any = None) -> None:
        self.api.prefetch(ptr, nbytes, device, self.stream if stream is None else stream)

    def _fill(self, ptr: int, nbytes: int) -> None:
        self._array(ptr, nbytes).fill(1.0)

    def _on_gpu(self, nbytes: int) -> int:
        """A range written on the GPU and moved to the host and back (its host pages populated)."""
        ptr = self._alloc(nbytes)
        self._fill(ptr, nbytes)
        self._sync()  # the fill runs on CuPy's stream, the prefetches on ours
        self._to(ptr, nbytes, -1)
        self._to(ptr, nbytes, self.device)
        self._sync()
        return ptr

    def _op(self, fn: Callable[[], float]) -> float:
        try:
            return fn()
        finally:
            self._free_all()

    # -- operations
    def prefetch(self, size: int, count: int, to_device: bool) -> float:
        def run() -> float:
            ptr = self._on_gpu(size * count)
            if to_device:
                self._to(ptr, size * count, -1)
            target = self.device if to_device else -1
            return self._timed(lambda: [self._to(ptr + i * size, size, target) for i in range(count)])
        return self._op(run)

    def prefetch_first_to_host(self, nbytes: int) -> float:
        def run() -> float:
            ptr = self._alloc(nbytes)
            self._fill(ptr, nbytes)
            return self._timed(lambda: self._to(ptr, nbytes, -1))
        return self._op(run)

    def prefetch_both(self, nbytes: int) -> float:
        def run() -> float:
            out = self._on_gpu(nbytes)
            inn = self._on_gpu(nbytes)
            self._to(inn, nbytes, -1)
            return self._timed(lambda: (self._to(out, nbytes, -1), self._to(inn, nbytes, self.device, self.stream2)))
        return self._op(run)

    def prefetch_noop(self, count: int) -> float:
        def run() -> float:
            ptr = self._on_gpu(BATCH_RANGE)
            return self._timed(lambda: [self._to(ptr, BATCH_RANGE, self.device) for _ in range(count)])
        return self._op(run)

    def advise(self, count: int) -> float:
        def run() -> float:
            ptr = self._on_gpu(BATCH_RANGE)
            return self._timed(lambda: [self.api.advise(ptr, BATCH_RANGE, Advice.SET_ACCESSED_BY, self.device)
                                        for _ in range(count)])
        return self._op(run)

    def batch_prefetch(self, ranges: int, size: int, target: str) -> float:
        def run() -> float:
            ptr = self._on_gpu(ranges * size)
            if target == "gpu":
                self._to(ptr, ranges * size, -1)
            rs = [(ptr + i * size, size) for i in range(ranges)]
            dest = -1 if target == "host" else self.device
            return self._timed(lambda: self.api.prefetch_batch(rs, dest, self.stream))
        return self._op(run)

    def write_one_page(self, resident: bool) -> float:
        def run() -> float:
            ptr = self._on_gpu(BATCH_RANGE)
            if not resident:
                self._to(ptr, BATCH_RANGE, -1)
            view = self._array(ptr, SMALL_PAGE)[:1]
            return self._timed(lambda: view.fill(2.0))
        return self._op(run)

    def write(self, nbytes: int, state: str) -> float:
        def run() -> float:
            if state in ("fresh", "prefetched"):
                ptr = self._alloc(nbytes)
                if state == "prefetched":
                    self._to(ptr, nbytes, self.device)
            else:
                ptr = self._on_gpu(nbytes)
                r = [(ptr, nbytes)]
                if state == "host":
                    self._to(ptr, nbytes, -1)
                elif state == "discarded-preferred":
                    self.api.advise(ptr, nbytes, Advice.SET_PREFERRED_LOCATION, self.device)
                if state == "host-discarded":
                    self._to(ptr, nbytes, -1)
                if state == "discard-and-prefetched":
                    self.api.discard_and_prefetch_batch(r, self.device, self.stream)
                elif state in ("discarded", "discarded-preferred", "host-discarded", "discard-prefetched"):
                    self.api.discard_batch(r, self.stream)
                elif state not in ("resident", "host"):
                    raise ValueError(f"unknown state {state!r}")
                if state == "discard-prefetched":
                    self._to(ptr, nbytes, self.device)
            self._sync()
            return self._timed(lambda: self._fill(ptr, nbytes))
        return self._op(run)

    def populate_prefetch(self, nbytes: int) -> float:
        def run() -> float:
            ptr = self._alloc(nbytes)
            return self._timed(lambda: self._to(ptr, nbytes, self.device))
        return self._op(run)

    def discard(self, nbytes: int, ranges: int, calls: int = 1) -> float:
        def run() -> float:
            ptr = self._on_gpu(nbytes)
            size = nbytes // (ranges * calls)
            rs = [(ptr + i * size, size) for i in range(ranges * calls)]
            return self._timed(lambda: [self.api.discard_batch(rs[c * ranges:(c + 1) * ranges], self.stream)
                                        for c in range(calls)])
        return self._op(run)

    def discard_then_prefetch(self, nbytes: int) -> float:
        def run() -> float:
            ptr = self._on_gpu(nbytes)
            self.api.discard_batch([(ptr, nbytes)], self.stream)
            self._sync()
            return self._timed(lambda: self._to(ptr, nbytes, self.device))
        return self._op(run)

    def discard_and_prefetch(self, nbytes: int) -> float:
        def run() -> float:
            ptr = self._on_gpu(nbytes)
            return self._timed(lambda: self.api.discard_and_prefetch_batch([(ptr, nbytes)], self.device, self.stream))
        return self._op(run)

    def pinned_copy(self, nbytes: int, to_device: bool) -> float:
        def run() -> float:
            cp = self.cp
            rt = cp.cuda.runtime
            host, dev = cp.cuda.alloc_pinned_memory(nbytes), cp.cuda.alloc(nbytes)
            if to_device:
                return self._timed(lambda: rt.memcpy(dev.ptr, host.ptr, nbytes, rt.memcpyHostToDevice))
            return self._timed(lambda: rt.memcpy(host.ptr, dev.ptr, nbytes, rt.memcpyDeviceToHost))
        return self._op(run)

    def matmul(self, n: int) -> float:
        def run() -> float:
            cp = self.cp
            a, b = cp.random.rand(n, n, dtype=cp.float32), cp.random.rand(n, n, dtype=cp.float32)
            c = cp.empty_like(a)
            cp.matmul(a, b, out=c)  # warm-up (cuBLAS handle, kernel selection)
            return self._timed(lambda: cp.matmul(a, b, out=c))
        return self._op(run)

    def device_copy(self, nbytes: int) -> float:
        def run() -> float:
            cp = self.cp
            src = cp.ones(nbytes // 4, cp.float32)
            dst = cp.empty_like(src)
            cp.copyto(dst, src)  # warm-up
            return self._timed(lambda: cp.copyto(dst, src))
        return self._op(run)

    def close(self) -> None:
        self._free_all()
