"""Measure a GPU's Unified Memory behaviour and write a hardware profile.

``umrt calibrate`` runs these measurements on a real GPU and writes a profile
file in the schema of ``umrt/profiles/*.json`` (:func:`umrt.hardware.save_profile`),
starting from the closest shipped profile and replacing what it measured:

``h2d_bandwidth`` / ``d2h_bandwidth``
    largest-size rate of explicit ``cudaMemPrefetchAsync`` migrations (the link rate).
``transfer_curve_a`` / ``transfer_curve_b``
    least-squares fit of UVMSmart's ``(2a/pi) atan(b * KB)`` GiB/s curve to the
    prefetch rates measured at each transfer size.
``fault_batch_latency_s``
    median time of a kernel that faults one page in, minus the same kernel on
    a resident page (launch cost removed).
``hbm_bandwidth``
    STREAM triad on device-resident arrays.
``gpu_memory_bytes``
    ``cudaMemGetInfo`` total.

Fault-driven bandwidth is measured and reported (not a profile field: the
simulator derives it from faults and the curve). Buffers never exceed half of
the device's *free* memory: oversubscription is emulated by umrt's budget,
never by asking the driver for more than it has.

The measuring is behind :class:`Probe` so that the orchestration and fitting
are tested without a GPU.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from umrt.errors import UmrtError

KIB, MIB, GIB = 2**10, 2**20, 2**30
SIZES = (64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
PAGE = 4096


class NoGpuError(UmrtError):
    """Calibration needs a CUDA GPU."""


class Probe:
    """What calibration measures; :class:`CudaProbe` is the real one."""

    device_name: str = "unknown"
    total_bytes: int = 0
    free_bytes: int = 0

    def prefetch_seconds(self, nbytes: int, to_device: bool) -> float:
        """Time of one prefetch of ``nbytes`` (host->device if ``to_device``), synchronised."""
        raise NotImplementedError

    def fault_seconds(self, nbytes: int) -> float:
        """Time for a kernel touching every page of a host-resident ``nbytes`` buffer."""
        raise NotImplementedError

    def resident_touch_seconds(self, nbytes: int) -> float:
        """The same kernel on device-resident memory (launch + touch, no faults)."""
        raise NotImplementedError

    def triad_seconds(self, nbytes: int) -> float:
        """STREAM triad over three device-resident arrays of ``nbytes`` each."""
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass
class Measurements:
    device_name: str
    total_bytes: int
    h2d_rate: dict[int, float] = field(default_factory=dict)  # size -> bytes/s
    d2h_rate: dict[int, float] = field(default_factory=dict)
    fault_rate: dict[int, float] = field(default_factory=dict)
    fault_latency_s: float = 0.0
    hbm_bandwidth: float = 0.0


def _median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def measure(probe: Probe, sizes: Sequence[int] = SIZES, repeats: int = 5,
            progress: Callable[[str], None] | None = None) -> Measurements:
    """Run every measurement, skipping sizes above half the free device memory."""
    cap = probe.free_bytes // 2
    usable = [s for s in sizes if s <= cap]
    if not usable:
        raise UmrtError(f"only {probe.free_bytes} bytes free on the GPU: too little to calibrate")
    m = Measurements(probe.device_name, probe.total_bytes)
    step = progress or (lambda _label: None)
    for size in usable:
        step(f"prefetch {size // KIB} KiB")
        m.h2d_rate[size] = size / _median(lambda s=size: probe.prefetch_seconds(s, True), repeats)
        m.d2h_rate[size] = size / _median(lambda s=size: probe.prefetch_seconds(s, False), repeats)
        step(f"faults {size // KIB} KiB")
        m.fault_rate[size] = size / _median(lambda s=size: probe.fault_seconds(s), repeats)
    step("fault latency")
    one_fault = _median(lambda: probe.fault_seconds(PAGE), repeats * 4)
    no_fault = _median(lambda: probe.resident_touch_seconds(PAGE), repeats * 4)
    m.fault_latency_s = max(one_fault - no_fault, 1e-7)
    step("triad")
    triad_bytes = min(64 * MIB, cap // 3) // 16 * 16  # three arrays of this size
    m.hbm_bandwidth = 3 * triad_bytes / _median(lambda: probe.triad_seconds(triad_bytes), repeats)
    return m


def fit_transfer_curve(rates: dict[int, float]) -> tuple[float, float]:
    """Fit ``rate_GiB = (2a/pi) atan(b * KB)`` to ``{bytes: bytes/s}``; return ``(a, b)``.

    Grid search on ``b`` (log-spaced) with the closed-form least-squares ``a``
    for each: robust, dependency-free, and exact enough for a 2-parameter curve.
    """
    points = [(size / KIB, rate / GIB) for size, rate in sorted(rates.items()) if rate > 0]
    if not points:
        raise ValueError("no transfer rates to fit")
    best = (math.inf, 0.0, 0.0)
    for i in range(-600, 201):
        b = 10 ** (i / 100)
        g = [(2 / math.pi) * math.atan(b * kb) for kb, _ in points]
        denom = sum(x * x for x in g)
        a = sum(x * y for x, (_, y) in zip(g, points, strict=False)) / denom
        err = sum((a * x - y) ** 2 for x, (_, y) in zip(g, points, strict=False))
        if err < best[0]:
            best = (err, a, b)
    return best[1], best[2]


def closest_profile_name(device_name: str, total_bytes: int) -> str:
    """The shipped profile to start from, chosen from the device name and memory size."""
    name = device_name.upper()
    if "GH200" in name:
        return "gh200-c2c"
    if "H100" in name or "H200" in name:
        return "h100-pcie5-80g"
    if "V100" in name:
        return "v100-pcie3-32g" if total_bytes > 20 * GIB else "v100-pcie3-16g"
    return "a100-pcie4-80g" if total_bytes > 48 * GIB else "a100-pcie4-40g"


def build_profile(m: Measurements, base: Any = None) -> Any:
    """A :class:`umrt.hardware.HardwareProfile`: ``base`` with the measured fields replaced."""
    from umrt.hardware import load_profile

    base = load_profile(base or closest_profile_name(m.device_name, m.total_bytes))
    a, b = fit_transfer_curve(m.h2d_rate)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    src = f"measured by umrt calibrate on {m.device_name}, {when}"
    largest = max(m.h2d_rate)
    measured = {
        "gpu_memory_bytes": int(m.total_bytes),
        "h2d_bandwidth": float(m.h2d_rate[largest]),
        "d2h_bandwidth": float(m.d2h_rate[largest]),
        "transfer_curve_a": float(a),
        "transfer_curve_b": float(b),
        "fault_batch_latency_s": float(m.fault_latency_s),
        "hbm_bandwidth": float(m.hbm_bandwidth),
    }
    sources = dict(base.sources)
    for key in measured:
        sources[key] = src + {
            "h2d_bandwidth": f" (cudaMemPrefetchAsync of {largest // MIB} MiB)",
            "d2h_bandwidth": f" (cudaMemPrefetchAsync to host of {largest // MIB} MiB)",
            "transfer_curve_a": " (fit of prefetch rates by size)",
            "transfer_curve_b": " (fit of prefetch rates by size)",
            "fault_batch_latency_s": " (one-page fault kernel minus resident kernel, median)",
            "hbm_bandwidth": " (STREAM triad)",
        }.get(key, "")
    name = f"calibrated-{m.device_name.lower().replace(' ', '-')}"
    return dataclasses.replace(base, name=name, sources=sources,
                               description=f"{base.description} Calibrated: {src}.".strip(), **measured)


# ---------------------------------------------------------------------------
# The real probe (CUDA GPU, CuPy for arrays and timing, numba kernels).
# ---------------------------------------------------------------------------
class CudaProbe(Probe):
    """Measures on CUDA device ``device`` through umrt's :class:`CudaBackend`."""

    def __init__(self, device: int = 0) -> None:
        from umrt.api import gpu_count

        if gpu_count() == 0:
            raise NoGpuError("umrt calibrate needs a CUDA GPU and none was found "
                             "(use the shipped profiles, e.g. --simulate a100-pcie4-40g, without one)")
        import cupy

        from umrt.backends.cuda import CudaBackend

        self.cupy = cupy
        self.backend = CudaBackend(device)
        self.backend.set_compute_stream(0)
        self.device = device
        props = cupy.cuda.runtime.getDeviceProperties(device)
        raw = props["name"]
        self.device_name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.free_bytes, self.total_bytes = self.backend.mem_info()
        self._buffers: dict[int, int] = {}

    def _buffer(self, nbytes: int) -> int:
        if nbytes not in self._buffers:
            self._buffers[nbytes] = self.backend.malloc(nbytes)
        return self._buffers[nbytes]

    def _array(self, ptr: int, nbytes: int, dtype: str = "float32") -> Any:
        cp = self.cupy
        mem = cp.cuda.UnownedMemory(ptr, nbytes, self, self.device)
        return cp.ndarray((nbytes // cp.dtype(dtype).itemsize,), dtype, cp.cuda.MemoryPointer(mem, 0))

    def _time(self, fn: Callable[[], None]) -> float:
        self.cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        fn()
        self.cupy.cuda.runtime.deviceSynchronize()
        return time.perf_counter() - t0

    def _to(self, ptr: int, nbytes: int, device: int) -> None:
        self.backend.prefetch([(ptr, nbytes)], device)
        self.backend.synchronize()

    def prefetch_seconds(self, nbytes: int, to_device: bool) -> float:
        ptr = self._buffer(nbytes)
        self._to(ptr, nbytes, -1 if to_device else self.device)
        target = self.device if to_device else -1
        return self._time(lambda: self._to(ptr, nbytes, target))

    def fault_seconds(self, nbytes: int) -> float:
        import kernels

        ptr = self._buffer(nbytes)
        self._to(ptr, nbytes, -1)
        arr = self._array(ptr, nbytes)
        return self._time(lambda: kernels.touch_pages(arr, PAGE))

    def resident_touch_seconds(self, nbytes: int) -> float:
        import kernels

        ptr = self._buffer(nbytes)
        self._to(ptr, nbytes, self.device)
        arr = self._array(ptr, nbytes)
        return self._time(lambda: kernels.touch_pages(arr, PAGE))

    def triad_seconds(self, nbytes: int) -> float:
        import kernels

        arrays = []
        for i in range(3):
            ptr = self._buffers.get(-(i + 1)) or self.backend.malloc(nbytes)
            self._buffers[-(i + 1)] = ptr
            self._to(ptr, nbytes, self.device)
            arrays.append(self._array(ptr, nbytes))
        a, b, c = arrays
        kernels.triad(a, b, c, 2.0)  # warm-up: JIT compile
        return self._time(lambda: kernels.triad(a, b, c, 2.0))

    def close(self) -> None:
        self.backend.close()
        self._buffers.clear()
