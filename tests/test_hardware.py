"""Hardware profiles: sourced figures, the transfer-rate curve, validation."""
from __future__ import annotations

import json

import pytest

from umrt.errors import ConfigError
from umrt.hardware import PROFILES, HardwareProfile, load_profile, save_profile

GIB = 1 << 30


@pytest.mark.parametrize("name", PROFILES)
def test_every_shipped_profile_loads_with_a_source_per_number(name):
    p = load_profile(name)
    assert p.name == name
    numeric = [k for k, v in p.to_dict().items() if isinstance(v, dict)]
    assert len(numeric) >= 29
    for key in numeric:
        assert p.sources[key].strip(), f"{name}.{key} has no source"


def test_a_prefetch_costs_its_set_up_plus_bytes_over_the_rate():
    p = load_profile("h100-sxm5-80g")
    # h100-measured.md: 89 ms for one 4 GiB call host -> GPU, 17.1 GB/s in 2 MiB calls
    assert p.prefetch_time(4 * GIB) == pytest.approx(0.0893, rel=0.01)
    assert p.transfer_rate(2 << 20) / 1e9 == pytest.approx(17.1, rel=0.02)
    assert p.prefetch_time(2 << 20, "d2h") == pytest.approx(p.prefetch_d2h_setup_s + (2 << 20) / p.prefetch_d2h_rate)
    assert p.prefetch_time(0) == 0.0 and p.transfer_time(0) == 0.0
    assert p.transfer_rate(4 << 10) < p.transfer_rate(64 << 10) < p.transfer_rate(2 << 20) < p.prefetch_h2d_rate
    with pytest.raises(ValueError):
        p.transfer_rate(0)


def test_the_fastest_migration_bounds_every_path():
    p = load_profile("h100-sxm5-80g")
    assert p.migration_rate_limit("h2d") == max(p.prefetch_h2d_rate, p.fault_migration_rate)
    assert p.migration_rate_limit("d2h") == p.prefetch_d2h_rate


@pytest.mark.parametrize(
    "name, link",
    [
        ("v100-pcie3-16g", 12e9),  # uvm-model.md: PCIe Gen3 x16 ~12 GB/s measured
        ("v100-pcie3-32g", 12e9),
        ("a100-pcie4-40g", 25e9),  # PCIe Gen4 x16 ~25 GB/s measured (A100)
        ("a100-pcie4-80g", 25e9),
        ("h100-pcie5-80g", 54.57e9),  # the pinned copy measured on the H100 over PCIe Gen5 x16
        ("h100-sxm5-80g", 54.57e9),
        ("gh200-c2c", 346e9),  # NVLink-C2C ~346 GB/s measured host -> device
    ],
)
def test_links_and_migration_rates(name, link):
    p = load_profile(name)
    assert p.h2d_bandwidth == pytest.approx(link, rel=1e-3)
    sxm = load_profile("h100-sxm5-80g")
    # prefetch to the GPU reaches the fraction of the link it reached on the measured card
    assert p.prefetch_h2d_rate / p.h2d_bandwidth == pytest.approx(sxm.prefetch_h2d_rate / sxm.h2d_bandwidth, rel=1e-6)
    # no migration outruns the link; GPU -> host never outruns host -> GPU
    assert p.migration_rate_limit("h2d") <= p.h2d_bandwidth and p.prefetch_d2h_rate <= p.prefetch_h2d_rate
    # a huge copy never beats the rate, a small one pays its set-up
    assert p.transfer_rate(1 << 40) <= p.prefetch_h2d_rate
    assert p.transfer_rate(4 << 10) < p.transfer_rate(64 << 10) < p.transfer_rate(2 << 20)


@pytest.mark.parametrize("name", PROFILES)
def test_architecture_wide_costs_are_those_measured_on_the_h100(name):
    """Call costs, discard, first touch and the fault batch: measured on the H100 SXM5, carried over
    to every profile, each source saying so."""
    p, sxm = load_profile(name), load_profile("h100-sxm5-80g")
    for key in ("prefetch_call_overhead_s", "advise_call_s", "batch_range_s", "batch_d2h_range_s", "discard_rate",
                "discard_range_s", "discard_refault_rate", "discard_prefetch_rate", "first_touch_rate",
                "prefetch_populate_rate", "host_populate_rate", "fault_batch_latency_s",
                "prefetch_h2d_setup_s", "prefetch_d2h_setup_s"):
        assert getattr(p, key) == getattr(sxm, key), key
        assert "H100" in p.sources[key] and ("carried over" in p.sources[key] or name == "h100-sxm5-80g"), key


def test_compute_time_is_a_roofline_with_a_floor():
    p = load_profile("a100-pcie4-40g")
    eff = p.compute_efficiency
    flops_bound = p.compute_time(10**13, 10**6)
    assert flops_bound == pytest.approx(10**13 / (p.peak_flops * eff))
    mem_bound = p.compute_time(10**6, 10**11)
    assert mem_bound == pytest.approx(10**11 / (p.hbm_bandwidth * p.memory_efficiency))
    assert p.compute_time(0, 0) == p.launch_floor_s > 0


def test_the_h100_computes_at_its_measured_matmul_and_copy_rates():
    p = load_profile("h100-sxm5-80g")  # um-micro-3.json: 8192^3 fp32 matmul 21.37 ms, device copy 3.02 TB/s
    assert p.compute_time(2 * 8192**3, 0, "fp32") == pytest.approx(21.37e-3, rel=1e-3)
    assert p.achieved_hbm_bandwidth == pytest.approx(3.022e12, rel=1e-3)
    assert p.memory_efficiency != p.compute_efficiency


def test_a_profile_file_without_memory_efficiency_uses_the_compute_efficiency(tmp_path):
    data = load_profile("h100-sxm5-80g").to_dict()
    del data["memory_efficiency"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    p = load_profile(path)
    assert p.achieved_hbm_bandwidth == p.hbm_bandwidth * p.compute_efficiency


def test_a_profile_file_from_before_the_measured_model_says_what_to_do(tmp_path):
    data = load_profile("h100-sxm5-80g").to_dict()
    del data["prefetch_h2d_rate"]
    data["transfer_curve_a"] = {"value": 48.0, "source": "UVMSmart"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="prefetch_h2d_rate.*umrt calibrate"):
        load_profile(path)


@pytest.mark.parametrize("name", PROFILES)
def test_precision_picks_the_peak(name):
    """bf16/fp16 (and a trace that does not say) at the tensor peak; FP32 on CUDA
    cores; TF32 on tensor cores where the GPU has them (Volta: the FP32 rate)."""
    p = load_profile(name)
    assert p.sources["peak_flops_fp32"] and p.sources["peak_flops_tf32"]
    assert p.peak_for("") == p.peak_for("bf16") == p.peak_for("fp16") == p.peak_flops
    assert p.peak_for("fp32") == p.peak_flops_fp32 < p.peak_flops
    assert p.peak_flops_fp32 <= p.peak_for("tf32") == p.peak_flops_tf32 < p.peak_flops
    flops = 10**14  # compute-bound on every profile
    assert p.compute_time(flops, 0, "fp32") / p.compute_time(flops, 0, "bf16") == pytest.approx(
        p.peak_flops / p.peak_flops_fp32)
    if name.startswith("v100"):
        assert p.peak_for("tf32") == p.peak_for("fp32")


def test_a_profile_file_without_the_fp32_peaks_uses_the_tensor_peak(tmp_path):
    """Files written before the FP32/TF32 fields existed still load, as before."""
    data = load_profile("h100-pcie5-80g").to_dict()
    del data["peak_flops_fp32"], data["peak_flops_tf32"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    p = load_profile(path)
    assert p.peak_for("fp32") == p.peak_for("tf32") == p.peak_flops
    save_profile(p, tmp_path / "again.json")  # and they round-trip without the fields
    assert load_profile(tmp_path / "again.json") == p


def test_save_then_load_round_trips(tmp_path):
    p = load_profile("h100-pcie5-80g")
    path = tmp_path / "mine.json"
    save_profile(p, path)
    q = load_profile(path)
    assert q == p and q.sources == p.sources
    assert isinstance(q, HardwareProfile)


def _write(tmp_path, mutate):
    data = load_profile("v100-pcie3-16g").to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.pop("hbm_bandwidth"), "hbm_bandwidth"),
        (lambda d: d.__setitem__("peak_flops", {"value": -1, "source": "x"}), "peak_flops"),
        (lambda d: d.__setitem__("h2d_bandwidth", 15e9), "h2d_bandwidth"),
        (lambda d: d.__setitem__("fault_batch_size", {"value": 2.5, "source": "x"}), "fault_batch_size"),
        (lambda d: d.__setitem__("compute_efficiency", {"value": 1.5, "source": "x"}), "compute_efficiency"),
        (lambda d: d.__setitem__("launch_floor_s", {"value": "5us", "source": "x"}), "launch_floor_s"),
        (lambda d: d.__setitem__("launch_floor_s", {"value": 5e-6, "source": " "}), "launch_floor_s"),
        (lambda d: d.pop("name"), "name"),
    ],
)
def test_invalid_profile_names_the_field(tmp_path, mutate, field):
    with pytest.raises(ConfigError, match=field):
        load_profile(_write(tmp_path, mutate))


def test_unknown_name_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="v100-pcie3-16g"):  # lists the valid names
        load_profile("a100-sxm")
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        load_profile(bad)
