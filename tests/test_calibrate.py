"""Calibration without a GPU: the fits, the card's name, the sizes, and a whole calibration of the
simulator (``SimProbe``) that recovers the parameters of the profile it ran on."""
from __future__ import annotations

import dataclasses

import pytest

from umrt import calibrate
from umrt.calibrate import (
    GIB,
    MIB,
    CalibrationError,
    Measurements,
    Plan,
    SimProbe,
    build_profile,
    fit_fixed_plus_rate,
    fit_parameters,
    measure,
    plan_sizes,
)
from umrt.hardware import PROFILES, closest_profile_name, identify_card, load_profile, save_profile

# A GPU unlike any shipped profile: every Unified Memory parameter moved, so a calibration that
# merely copied the base profile could not pass.
TRUE = dataclasses.replace(
    load_profile("h100-sxm5-80g"), name="made-up",
    prefetch_h2d_rate=30e9, prefetch_h2d_setup_s=50e-6, prefetch_d2h_rate=9e9, prefetch_d2h_setup_s=70e-6,
    fault_migration_rate=4e9, fault_batch_latency_s=90e-6, first_touch_rate=3e9, prefetch_populate_rate=150e9,
    host_populate_rate=6e9, discard_rate=200e9, discard_range_s=3e-6, discard_refault_rate=1.2e9,
    discard_prefetch_rate=300e9, prefetch_call_overhead_s=9e-6, advise_call_s=80e-6, batch_range_s=40e-6,
    batch_d2h_range_s=150e-6, h2d_bandwidth=40e9, d2h_bandwidth=41e9, compute_efficiency=0.6,
    memory_efficiency=0.8)
SMALL = Plan(big=256 * MIB, sweep=(2 * MIB, 16 * MIB, 64 * MIB), sweep_total=64 * MIB, batch_ranges=64,
             discard_ranges=128, matmul_n=4096, copy_bytes=256 * MIB)


class LinkSimProbe(SimProbe):
    """The simulator, with pinned copies at the profile's link rate (the simulator has no cudaMemcpy)."""

    device_name = "NVIDIA H100 80GB HBM3"

    def __init__(self, profile):
        super().__init__(profile)
        self.device_name = LinkSimProbe.device_name
        self.asked: list[int] = []

    def pinned_copy(self, nbytes, to_device):
        return nbytes / (self.profile.h2d_bandwidth if to_device else self.profile.d2h_bandwidth)

    def write(self, nbytes, state):
        self.asked.append(nbytes)
        return super().write(nbytes, state)


@pytest.fixture(scope="module")
def calibrated():
    probe = LinkSimProbe(TRUE)
    steps: list[str] = []
    m = measure(probe, repeats=1, progress=steps.append, plan=SMALL)
    return m, build_profile(m, base=TRUE), steps, probe


def test_fixed_plus_rate_fit_recovers_both():
    points = [(s, 80e-6 + s / 48e9) for s in (2 * MIB, 16 * MIB, 256 * MIB, 4 * GIB)]
    fixed, rate = fit_fixed_plus_rate(points)
    assert fixed == pytest.approx(80e-6, rel=1e-6) and rate == pytest.approx(48e9, rel=1e-6)
    # a set-up the data cannot support is clamped to zero, not negative
    fixed, rate = fit_fixed_plus_rate([(MIB, 1e-4), (2 * MIB, 2.2e-4)])
    assert fixed == 0.0 and rate > 0
    with pytest.raises(CalibrationError, match="do not grow"):
        fit_fixed_plus_rate([(MIB, 1e-3), (2 * MIB, 1e-4)])
    with pytest.raises(CalibrationError):
        fit_fixed_plus_rate([])


@pytest.mark.parametrize("key", [
    "prefetch_h2d_rate", "prefetch_d2h_rate", "fault_migration_rate", "fault_batch_latency_s", "first_touch_rate",
    "prefetch_populate_rate", "host_populate_rate", "discard_rate", "discard_range_s", "discard_refault_rate",
    "discard_prefetch_rate", "prefetch_call_overhead_s", "advise_call_s", "batch_range_s", "batch_d2h_range_s",
    "h2d_bandwidth", "d2h_bandwidth", "compute_efficiency", "memory_efficiency"])
def test_calibrating_the_simulator_recovers_its_parameters(calibrated, key):
    _, profile, _, _ = calibrated
    assert getattr(profile, key) == pytest.approx(getattr(TRUE, key), rel=0.02), key
    assert "measured by umrt calibrate on NVIDIA H100 80GB HBM3" in profile.sources[key]


def test_prefetch_set_ups_are_recovered_up_to_the_call_cost(calibrated):
    _, profile, _, _ = calibrated  # a timed single call includes its CPU cost once: a few us
    assert profile.prefetch_h2d_setup_s == pytest.approx(TRUE.prefetch_h2d_setup_s, abs=2 * TRUE.prefetch_call_overhead_s)
    assert profile.prefetch_d2h_setup_s == pytest.approx(TRUE.prefetch_d2h_setup_s, abs=2 * TRUE.prefetch_call_overhead_s)


def test_calibration_reports_progress_and_stays_within_its_plan(calibrated):
    m, _, steps, probe = calibrated
    assert len(steps) == calibrate.MEASURE_STEPS
    assert max(probe.asked) == SMALL.big
    assert m.kernel_write[0] == m.fault_write[0] == SMALL.big


def test_the_written_profile_round_trips_and_the_simulator_reads_it(calibrated, tmp_path):
    from umrt.sim.backend import SimBackend

    _, profile, _, _ = calibrated
    path = tmp_path / "gpu.json"
    save_profile(profile, path)
    again = load_profile(str(path))
    assert again.prefetch_d2h_rate == pytest.approx(profile.prefetch_d2h_rate)
    assert again.description == profile.description
    SimBackend(str(path)).malloc(1 << 20)


def test_the_profile_names_the_card_it_measured(calibrated):
    _, profile, _, _ = calibrated
    # the calibrate at a7fa758 described this SXM card as "H100 PCIe" (h100-sxm-calibrate-output.json)
    assert profile.name == "calibrated-nvidia-h100-80gb-hbm3"
    assert "SXM" in profile.description and "PCIe" not in profile.description


@pytest.mark.parametrize("name, sms, total, c2c, form, base", [
    ("NVIDIA H100 80GB HBM3", 132, 80 * GIB, False, "sxm", "h100-sxm5-80g"),
    ("NVIDIA H100 PCIe", 114, 80 * GIB, False, "pcie", "h100-pcie5-80g"),
    ("NVIDIA H100 NVL", 132, 94 * GIB, False, "pcie", "h100-pcie5-80g"),
    ("NVIDIA H100", 132, 80 * GIB, False, "sxm", "h100-sxm5-80g"),  # told apart by its SM count
    ("NVIDIA H100", 114, 80 * GIB, False, "pcie", "h100-pcie5-80g"),
    ("NVIDIA H100", 0, 80 * GIB, False, "unknown", "h100-sxm5-80g"),  # never assumed
    ("NVIDIA GH200 480GB", 132, 96 * GIB, False, "c2c", "gh200-c2c"),
    ("NVIDIA H100 80GB HBM3", 132, 80 * GIB, True, "c2c", "gh200-c2c"),  # coherent through host page tables
    ("NVIDIA A100-SXM4-80GB", 108, 80 * GIB, False, "sxm", "a100-pcie4-80g"),
    ("NVIDIA A100 80GB PCIe", 108, 80 * GIB, False, "pcie", "a100-pcie4-80g"),
    ("NVIDIA A100-PCIE-40GB", 108, 40 * GIB, False, "pcie", "a100-pcie4-40g"),
    ("Tesla V100-PCIE-16GB", 80, 16 * GIB, False, "pcie", "v100-pcie3-16g"),
    ("Tesla V100-SXM2-32GB", 80, 32 * GIB, False, "sxm", "v100-pcie3-32g"),
    ("NVIDIA RTX 6000 Ada Generation", 142, 48 * GIB, False, "unknown", "a100-pcie4-40g"),
])
def test_the_card_is_identified_from_its_name_and_attributes(name, sms, total, c2c, form, base):
    card = identify_card(name, sms, total, c2c)
    assert (card.form_factor, card.base_profile) == (form, base), card.evidence
    assert card.evidence
    assert closest_profile_name(name, total, sms, c2c) == base


def test_sizes_never_exceed_a_quarter_of_the_free_memory():
    plan = plan_sizes(70 * GIB)
    assert plan.big == 2 * GIB and plan.sweep[-1] == GIB and plan.batch_ranges == 1024
    small = plan_sizes(300 * MIB)
    assert small.big <= 300 * MIB // 4 and all(s <= small.big for s in small.sweep)
    assert 3 * small.matmul_n**2 * 4 <= 300 * MIB // 4 or small.matmul_n == 4096
    with pytest.raises(calibrate.UmrtError, match="too little"):
        plan_sizes(100 * MIB)


def test_without_batched_calls_discard_and_batch_fields_keep_the_base():
    probe = LinkSimProbe(TRUE)
    probe.has_batch = False
    steps: list[str] = []
    m = measure(probe, repeats=1, progress=steps.append, plan=SMALL)
    assert m.discard is None and m.batch_noop is None and len(steps) == calibrate.MEASURE_STEPS - 2
    base = load_profile("h100-sxm5-80g")
    profile = build_profile(m, base=base)
    assert profile.discard_refault_rate == base.discard_refault_rate
    assert profile.sources["discard_refault_rate"] == base.sources["discard_refault_rate"]
    assert profile.first_touch_rate == pytest.approx(TRUE.first_touch_rate, rel=0.02)


def test_inconsistent_measurements_are_named():
    m = Measurements("x", GIB, kernel_write=(GIB, 0.01), first_touch=(GIB, 0.005), one_page_fault_s=1e-4)
    with pytest.raises(CalibrationError, match="first_touch_rate"):
        fit_parameters(m)
    with pytest.raises(calibrate.UmrtError, match="repeats"):
        measure(LinkSimProbe(TRUE), repeats=0, plan=SMALL)


def test_cli_without_gpu_exits_2(monkeypatch, capsys, tmp_path):
    from umrt.cli import main

    monkeypatch.setattr(calibrate, "gpu_count", lambda: 0)
    assert main(["calibrate", "-o", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_sources_claim_calibration_only_for_what_calibrate_measures(calibrated, name):
    _, profile, _, _ = calibrated
    measured = {k for k, s in profile.sources.items() if "measured by umrt calibrate" in s}
    shipped = load_profile(name)
    claims = {k for k, s in shipped.sources.items() if "calibrate measures" in s}
    assert claims <= measured, claims - measured


def test_the_summary_states_the_measured_figures():
    from umrt.cli.calibrate import summary

    text = summary(load_profile("h100-sxm5-80g"))
    for figure in ("48.2 GB/s", "12.8 GB/s", "6.61 GB/s", "0.82 GB/s", "112 us", "51.4 TFLOP/s", "3.02 TB/s"):
        assert figure in text, figure


@pytest.mark.gpu
def test_calibrating_a_real_gpu(tmp_path):
    from umrt.sim.backend import SimBackend

    probe = calibrate.CudaProbe(0)
    try:
        m = measure(probe, repeats=1, plan=plan_sizes(min(probe.free_bytes, 2 * GIB)))
    finally:
        probe.close()
    profile = build_profile(m)
    assert profile.h2d_bandwidth > 1e9 and 1e9 < profile.prefetch_h2d_rate < 2 * profile.h2d_bandwidth
    assert 0 < profile.fault_batch_latency_s < 1e-2 and profile.discard_refault_rate > 0
    assert profile.memory_efficiency > 0.3  # a device copy, not a numba triad (0.21 of the H100's datasheet)
    card = identify_card(m.device_name, m.sm_count, m.total_bytes, m.host_page_tables)
    assert profile.description.startswith(m.device_name) and card.evidence in profile.description
    save_profile(profile, tmp_path / "gpu.json")
    SimBackend(str(tmp_path / "gpu.json")).malloc(1 << 20)


def test_calibrate_imports_no_front_end():
    """calibrate counts devices through umrt.backends.cuda and identifies cards through umrt.hardware:
    no import of umrt.api, so no cycle api <-> calibrate."""
    from bench.architecture import measure

    assert not [c for c in measure().cycles if "umrt.calibrate" in c]
