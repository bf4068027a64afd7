"""NVML sampler against a fake pynvml."""
from __future__ import annotations

import io
from types import SimpleNamespace

from umrt.telemetry import Sampler


class NVMLError(Exception):
    pass


def fake_nvml(fail_init=False):
    calls = []

    def init():
        calls.append("init")
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    return SimpleNamespace(
        NVMLError=NVMLError, NVML_PCIE_UTIL_TX_BYTES=0, NVML_PCIE_UTIL_RX_BYTES=1, calls=calls,
        nvmlInit=init, nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: ("h", i),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 2**30, used=3 * 2**30, free=77 * 2**30),
        nvmlDeviceGetPcieThroughput=lambda h, counter: 2048 if counter == 1 else 1024,  # KB/s
    )


def test_samples_and_summarises():
    nvml, out = fake_nvml(), io.StringIO()
    s = Sampler(0, interval=0.5, nvml=nvml, out=out)
    s._nvml = nvml
    s.start()
    s.stop()  # stop the thread; take deterministic samples by hand
    s._handle, before = ("h", 0), s.summary.samples
    s.sample()
    s.sample()
    summary = s.summary
    assert summary.samples == before + 2 and summary.peak_used_bytes == 3 * 2**30
    assert summary.peak_rx_rate == 2048 * 1024 and summary.peak_tx_rate == 1024 * 1024
    assert summary.rx_bytes >= 2 * 2048 * 1024 * 0.5
    s.stop_and_report()
    s.stop_and_report()
    assert out.getvalue().count("umrt telemetry:") == 1 and "peak GPU memory used 3.0 GiB" in out.getvalue()
    assert nvml.calls.count("shutdown") == 1


def test_without_nvml_one_note_and_no_shutdown():
    nvml, out = fake_nvml(fail_init=True), io.StringIO()
    s = Sampler(0, nvml=nvml, out=out).start()
    s.stop_and_report()
    assert out.getvalue().strip().count("\n") == 0 and "NVML unavailable" in out.getvalue()
    assert "shutdown" not in nvml.calls


def test_pci_bus_id_picks_the_cuda_device():
    nvml, out = fake_nvml(), io.StringIO()
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: ("bus", bus)
    s = Sampler(0, nvml=nvml, out=out, pci_bus_id="0000:41:00.0").start()
    s.stop()
    assert s._handle == ("bus", "0000:41:00.0")


def test_rates_count_for_the_time_between_samples(monkeypatch):
    """NVML reads each PCIe counter over 20 ms, so samples lie further apart than the interval."""
    import umrt.telemetry as telemetry

    clock = iter([10.0, 10.3, 10.35])
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    s = Sampler(0, interval=0.1, nvml=fake_nvml(), out=io.StringIO())
    s._handle = ("h", 0)
    s.sample()  # the first sample counts one interval
    s.sample()  # 0.3 s after the first
    s.sample()  # 0.05 s after: never less than the interval
    assert abs(s.summary.rx_bytes - 2048 * 1024 * (0.1 + 0.3 + 0.1)) < 1e-6
