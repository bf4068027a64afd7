"""NVML telemetry: GPU memory used and PCIe traffic, sampled in the background.

    sampler = Sampler(device=0).start()
    ...
    sampler.stop_and_report()   # prints a one-paragraph summary

Without NVML (no driver, no GPU, no ``nvidia-ml-py``) :meth:`Sampler.start`
prints a one-line note and the sampler stays idle. PCIe counters come from
``nvmlDeviceGetPcieThroughput`` (KB/s over a 20 ms window), so traffic totals
are estimates: rate x sampling interval.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from umrt.config import format_bytes


@dataclass
class Summary:
    """What a sampler saw."""

    samples: int = 0
    seconds: float = 0.0
    peak_used_bytes: int = 0
    total_bytes: int = 0
    tx_bytes: float = 0.0  # GPU -> host over PCIe (estimate)
    rx_bytes: float = 0.0  # host -> GPU over PCIe (estimate)
    peak_tx_rate: float = 0.0  # bytes/s
    peak_rx_rate: float = 0.0
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        if not self.samples:
            return "umrt telemetry: no samples" + (f" ({'; '.join(self.notes)})" if self.notes else "")
        return (
            f"umrt telemetry: {self.samples} samples over {self.seconds:.1f} s; "
            f"peak GPU memory used {format_bytes(self.peak_used_bytes)} of {format_bytes(self.total_bytes)}; "
            f"PCIe host->GPU ~{format_bytes(self.rx_bytes)} (peak {format_bytes(self.peak_rx_rate)}/s), "
            f"GPU->host ~{format_bytes(self.tx_bytes)} (peak {format_bytes(self.peak_tx_rate)}/s)"
        )


class Sampler:
    """Samples one device with NVML every ``interval`` seconds in a daemon thread.

    Args:
        device: NVML device index (used when ``pci_bus_id`` is not given).
        pci_bus_id: the CUDA device's PCI bus id (``cudaDeviceGetPCIBusId``): NVML
            numbers devices differently from CUDA under ``CUDA_VISIBLE_DEVICES``.
        interval: seconds between samples.
        nvml: the ``pynvml`` module (tests pass a fake); default imports it.
        out: where :meth:`stop_and_report` and notes print (default stderr).
    """

    def __init__(self, device: int = 0, interval: float = 0.1, nvml: Any = None, out: TextIO | None = None,
                 pci_bus_id: str | None = None) -> None:
        self.device, self.interval, self.out, self.pci_bus_id = device, interval, out, pci_bus_id
        self._nvml = nvml
        self._handle = None
        self._initialized = False  # nvmlShutdown only after a good nvmlInit
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._reported = False
        self._last_sample: float | None = None
        self.summary = Summary()

    def _print(self, text: str) -> None:
        print(text, file=self.out or sys.stderr)

    def start(self) -> Sampler:
        """Initialise NVML and start sampling; without NVML print one note and do nothing."""
        try:
            nvml = self._nvml
            if nvml is None:
                import pynvml as nvml
            self._nvml = nvml
        except ImportError:
            self._note("NVML unavailable (pip install nvidia-ml-py); no telemetry")
            return self
        try:
            nvml.nvmlInit()
            self._initialized = True
            if self.pci_bus_id:
                self._handle = nvml.nvmlDeviceGetHandleByPciBusId(self.pci_bus_id)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device)
            self.summary.total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(self._handle).total)
        except nvml.NVMLError as exc:
            self._note(f"NVML unavailable ({exc}); no telemetry")
            self._shutdown()
            return self
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="umrt-telemetry", daemon=True)
        self._thread.start()
        return self

    def _note(self, text: str) -> None:
        self.summary.notes.append(text)
        self._print(f"umrt: {text}")

    def sample(self) -> None:
        """Take one sample (the thread calls this; tests may too)."""
        nvml, h, s = self._nvml, self._handle, self.summary
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        s.peak_used_bytes = max(s.peak_used_bytes, int(mem.used))
        try:
            tx = nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
            rx = nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
        except nvml.NVMLError:  # not supported on some boards (e.g. C2C-attached)
            tx = rx = 0.0
        # Each rate holds until the next sample: the interval plus the time sampling takes
        # (NVML measures each PCIe counter over 20 ms, so two reads add about 40 ms).
        now = time.perf_counter()
        dt = self.interval if self._last_sample is None else max(self.interval, now - self._last_sample)
        self._last_sample = now
        s.tx_bytes += tx * dt
        s.rx_bytes += rx * dt
        s.peak_tx_rate, s.peak_rx_rate = max(s.peak_tx_rate, tx), max(s.peak_rx_rate, rx)
        s.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except self._nvml.NVMLError as exc:
                self.summary.notes.append(f"sampling stopped: {exc}")
                return
            self._stop.wait(self.interval)

    def stop(self) -> Summary:
        """Stop sampling, shut NVML down (only if it was initialised), return the summary."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self.summary.seconds = time.perf_counter() - self._t0
            self._thread = None
        self._shutdown()
        return self.summary

    def _shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    def stop_and_report(self) -> Summary:
        """:meth:`stop` and print the summary once (safe to call again, e.g. from atexit)."""
        summary = self.stop()
        if not self._reported and (summary.samples or self._handle is not None):
            self._print(summary.format())
        self._reported = True
        return summary
