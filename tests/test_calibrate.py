"""Calibration: orchestration and fitting with a synthetic probe; no-GPU exit status."""
from __future__ import annotations

import math

import pytest

from umrt import calibrate
from umrt.calibrate import GIB, KIB, MIB, Probe, build_profile, fit_transfer_curve, measure
from umrt.hardware import PROFILES, load_profile, save_profile


class CurveProbe(Probe):
    """A GPU whose migrations follow a known UVMSmart curve, capped by a link rate."""

    device_name = "NVIDIA A100-PCIE-40GB"
    total_bytes = 40 * GIB

    def __init__(self, a=12.0, b=0.004, free=8 * GIB):
        self.a, self.b, self.free_bytes = a, b, free
        self.sizes_seen: list[int] = []

    def rate(self, n):
        return (2 * self.a / math.pi) * math.atan(self.b * n / KIB) * GIB

    def prefetch_seconds(self, nbytes, to_device):
        self.sizes_seen.append(nbytes)
        return nbytes / (self.rate(nbytes) * (1.0 if to_device else 0.9))

    def fault_seconds(self, nbytes):
        return 30e-6 + nbytes / (self.rate(nbytes) * 0.5)

    def resident_touch_seconds(self, nbytes):
        return 5e-6

    def triad_seconds(self, nbytes):
        return 3 * nbytes / (1.5e12)


def test_fit_recovers_the_curve():
    probe = CurveProbe()
    rates = {s: probe.rate(s) for s in calibrate.SIZES}
    a, b = fit_transfer_curve(rates)
    assert a == pytest.approx(12.0, rel=0.03) and b == pytest.approx(0.004, rel=0.05)


def test_measure_and_build_profile():
    probe = CurveProbe()
    steps = []
    m = measure(probe, repeats=3, progress=steps.append)
    assert m.fault_latency_s == pytest.approx(30e-6 + PAGE_TIME(probe) - 5e-6, rel=1e-6)
    assert m.hbm_bandwidth == pytest.approx(1.5e12)
    assert m.d2h_rate[max(m.d2h_rate)] == pytest.approx(0.9 * m.h2d_rate[max(m.h2d_rate)])
    assert len(steps) == 2 * len(calibrate.SIZES) + 2
    profile = build_profile(m)
    base = load_profile("a100-pcie4-40g")
    assert profile.h2d_bandwidth == pytest.approx(probe.rate(256 * MIB))
    assert profile.gpu_memory_bytes == 40 * GIB and profile.peak_flops == base.peak_flops  # kept from base
    assert "measured by umrt calibrate" in profile.sources["fault_batch_latency_s"]
    assert profile.transfer_curve_a == pytest.approx(12.0, rel=0.03)


def PAGE_TIME(probe):  # noqa: N802
    return calibrate.PAGE / (probe.rate(calibrate.PAGE) * 0.5)


def test_profile_file_round_trips(tmp_path):
    profile = build_profile(measure(CurveProbe(), repeats=1))
    path = tmp_path / "p.json"
    save_profile(profile, path)
    again = load_profile(str(path))
    assert again.h2d_bandwidth == pytest.approx(profile.h2d_bandwidth)
    assert again.fault_batch_latency_s == pytest.approx(profile.fault_batch_latency_s)


def test_never_asks_for_more_than_half_the_free_memory():
    probe = CurveProbe(free=20 * MIB)
    measure(probe, repeats=1)
    assert max(probe.sizes_seen) <= 10 * MIB
    with pytest.raises(calibrate.UmrtError, match="too little"):
        measure(CurveProbe(free=64 * KIB), repeats=1)


@pytest.mark.parametrize("name,total,expected", [("NVIDIA H100 PCIe", 80 * GIB, "h100-pcie5-80g"),
                                                 ("Tesla V100-PCIE-16GB", 16 * GIB, "v100-pcie3-16g"),
                                                 ("NVIDIA GH200 480GB", 96 * GIB, "gh200-c2c"),
                                                 ("NVIDIA A100 80GB PCIe", 80 * GIB, "a100-pcie4-80g")])
def test_base_profile_choice(name, total, expected):
    assert calibrate.closest_profile_name(name, total) == expected


def test_cli_without_gpu_exits_2(monkeypatch, capsys, tmp_path):
    import umrt.api
    from umrt.cli import main

    monkeypatch.setattr(umrt.api, "gpu_count", lambda: 0)
    assert main(["calibrate", "-o", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_sources_claim_calibration_only_for_what_calibrate_measures(name):
    calibrated = build_profile(measure(CurveProbe(), repeats=1))
    measured = {k for k, s in calibrated.sources.items() if "measured by umrt calibrate" in s}
    shipped = load_profile(name)
    claims = {k for k, s in shipped.sources.items() if "calibrate measures" in s}
    assert claims and claims <= measured, claims - measured
