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
    assert len(numeric) >= 13
    for key in numeric:
        assert p.sources[key].strip(), f"{name}.{key} has no source"


def test_transfer_curve_reproduces_uvmsmart_on_a_16_gbps_link():
    # uvm-model.md: (2a/pi)*atan(b*KB), a=12, b=0.07292: 4 KB -> 2.17, 64 KB -> 10.4, 2 MB -> 11.95 GiB/s
    p = load_profile("v100-pcie3-16g")
    assert p.transfer_rate(4 << 10) / GIB == pytest.approx(2.17, abs=0.005)
    assert p.transfer_rate(64 << 10) / GIB == pytest.approx(10.4, abs=0.02)  # 10.39, quoted as 10.4
    assert p.transfer_rate(2 << 20) / GIB == pytest.approx(11.95, abs=0.005)
    assert p.transfer_time(2 << 20) == pytest.approx((2 << 20) / (11.95 * GIB), rel=1e-3)


@pytest.mark.parametrize(
    "name, link, a",
    [
        ("v100-pcie3-16g", 15.75e9, 12.0),
        ("v100-pcie3-32g", 15.75e9, 12.0),
        ("a100-pcie4-40g", 31.5e9, 24.0),
        ("a100-pcie4-80g", 31.5e9, 24.0),
        ("h100-pcie5-80g", 63.0e9, 48.0),
        ("gh200-c2c", 450e9, 337.5),
    ],
)
def test_link_rates_and_curve_scale(name, link, a):
    p = load_profile(name)
    assert p.h2d_bandwidth == link and p.d2h_bandwidth == link
    # the curve's asymptote scales with the link as UVMSmart's 16/32/64 GB/s settings do
    assert p.transfer_curve_a == a
    v100 = load_profile("v100-pcie3-16g")
    assert p.transfer_rate(2 << 20) / v100.transfer_rate(2 << 20) == pytest.approx(a / 12.0, rel=1e-3)
    # a huge copy never beats the link
    assert p.transfer_rate(1 << 40) <= p.h2d_bandwidth
    assert p.transfer_rate(4 << 10) < p.transfer_rate(64 << 10) < p.transfer_rate(2 << 20)


def test_compute_time_is_a_roofline_with_a_floor():
    p = load_profile("a100-pcie4-40g")
    eff = p.compute_efficiency
    flops_bound = p.compute_time(10**13, 10**6)
    assert flops_bound == pytest.approx(10**13 / (p.peak_flops * eff))
    mem_bound = p.compute_time(10**6, 10**11)
    assert mem_bound == pytest.approx(10**11 / (p.hbm_bandwidth * eff))
    assert p.compute_time(0, 0) == p.launch_floor_s > 0


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
