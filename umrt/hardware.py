"""Hardware profiles: the numbers the simulator runs on, each with its source.

A profile is a JSON data file (``umrt/profiles/NAME.json``) holding one number
per field, each written as ``{"value": ..., "source": "..."}`` so that every
figure the simulator uses names where it comes from (a datasheet, the NVIDIA
UVM driver, a published simulator or paper, or "assumption" where nothing is
published, saying whether ``umrt calibrate`` measures it). ``umrt calibrate``
writes the same format from measurements on a real GPU::

    >>> from umrt.hardware import load_profile
    >>> p = load_profile("h100-sxm5-80g")
    >>> round(p.transfer_rate(1 << 30) / 1e9, 1)  # GB/s of one 1 GiB prefetch to the GPU
    48.1
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from umrt.errors import ConfigError

__all__ = ["Card", "HardwareProfile", "PROFILES", "closest_profile_name", "identify_card", "load_profile",
           "save_profile"]

#: Profiles shipped with umrt (``umrt/profiles/NAME.json``).
PROFILES: tuple[str, ...] = (
    "v100-pcie3-16g",
    "v100-pcie3-32g",
    "a100-pcie4-40g",
    "a100-pcie4-80g",
    "h100-pcie5-80g",
    "h100-sxm5-80g",
    "gh200-c2c",
)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30  # binary units, defined once


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU and its host link, as the simulator sees them.

    Bandwidths and rates are bytes/s, times seconds. ``sources`` maps each
    numeric field to the citation it was loaded with. The Unified Memory
    costs (prefetch, faults, population, discard, calls) are the model of
    ``umrt/sim/MODEL.md``: each is a fixed cost plus size over a rate, fitted
    to measurements (``umrt.calibrate``).
    """

    name: str
    gpu_memory_bytes: int
    peak_flops: float  # dense tensor-core FLOP/s at training precision (datasheet)
    hbm_bandwidth: float  # datasheet
    h2d_bandwidth: float  # the link per direction: remote access (AccessedBy, PreferredLocation=host)
    d2h_bandwidth: float
    fault_batch_size: int  # faults serviced per batch (one replay per batch)
    fault_batch_latency_s: float  # fixed cost of servicing one fault batch
    prefetch_threshold: float  # density prefetcher threshold, percent
    prefetch_call_overhead_s: float  # CPU time of one prefetch/discard call (and of a discard-and-prefetch)
    launch_floor_s: float  # shortest kernel: launch + tail
    compute_efficiency: float  # achieved fraction of the peak FLOP/s
    # Explicit migration (cudaMemPrefetchAsync): per range that moves, a fixed set-up
    # plus bytes over the rate; the two directions share one migration path.
    prefetch_h2d_rate: float = 0.0
    prefetch_h2d_setup_s: float = 0.0
    prefetch_d2h_rate: float = 0.0
    prefetch_d2h_setup_s: float = 0.0
    fault_migration_rate: float = 0.0  # host -> GPU migration on the fault path (after the batch latency)
    first_touch_rate: float = 0.0  # never-populated pages a kernel faults in (zero-fill), bytes/s
    prefetch_populate_rate: float = 0.0  # never-populated pages a prefetch to the GPU populates (no copy)
    host_populate_rate: float = 0.0  # extra cost of the first migration of a page to the host
    discard_rate: float = 0.0  # the discard call's own work, bytes/s of the ranges
    discard_range_s: float = 0.0  # the discard call's work per range
    discard_refault_rate: float = 0.0  # a kernel writing discarded pages (the refault path)
    discard_prefetch_rate: float = 0.0  # a prefetch (or discard-and-prefetch) to the GPU of discarded pages
    advise_call_s: float = 0.0  # one cudaMemAdvise call (one range)
    batch_range_s: float = 0.0  # CPU time per range of a batched prefetch call (cudaMemPrefetchBatchAsync)
    batch_d2h_range_s: float = 0.0  # extra migration time per range of a batched prefetch to the host
    # FP32 arithmetic: on CUDA cores (PyTorch's default for matmuls), or TF32 tensor
    # cores (its default for cuDNN convolutions, Ampere and later). 0: as peak_flops.
    peak_flops_fp32: float = 0.0
    peak_flops_tf32: float = 0.0
    memory_efficiency: float = 0.0  # achieved fraction of hbm_bandwidth; 0: as compute_efficiency
    # Achieved fraction of the TF32 peak for TF32 kernels (cuDNN's convolutions: PyTorch runs
    # FP32 convolutions, not matmuls, in TF32 by default); 0: as compute_efficiency.
    tf32_efficiency: float = 0.0
    # cudaMemcpyAsync between GPU-resident managed memory and pinned host memory, on the
    # copy engines (umrt's swap path). 0: the pinned copy's rate, h2d/d2h_bandwidth.
    copy_h2d_rate: float = 0.0
    copy_d2h_rate: float = 0.0
    # The fraction of such a copy's time the calling CPU thread waits before the call returns
    # (1: until it is done, so nothing issued after it runs beside it, as an H200's timeline
    # showed; whether its thread or its GPU serialized them is not measured; 0: fully
    # asynchronous). A profile that leaves it out takes 1 (umrt/sim/MODEL.md).
    copy_host_wait: float = 1.0
    # The fraction of the GPU's compute a kernel of umrt's own that copies between managed
    # and pinned memory (an *SM copy*: its grid of SM_COPY_BLOCKS blocks drives the link
    # through mapped pinned memory) takes from the kernels beside it while it runs. Assumed,
    # not measured: its blocks over the card's SMs (umrt/sim/MODEL.md, "SM copies"); a profile that
    # leaves it out takes 16 blocks over 128 SMs.
    sm_copy_share: float = 0.125
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def prefetch_time(self, nbytes: int, direction: str = "h2d") -> float:
        """Migration seconds of one prefetch call moving ``nbytes`` of data: set-up + bytes / rate.

        ``direction`` is ``"h2d"`` (to the GPU) or ``"d2h"`` (to the host, its
        host pages already populated). Zero bytes cost nothing.
        """
        if nbytes < 0:
            raise ValueError("transfer size must not be negative")
        if nbytes == 0:
            return 0.0
        if direction == "d2h":
            return self.prefetch_d2h_setup_s + nbytes / self.prefetch_d2h_rate
        return self.prefetch_h2d_setup_s + nbytes / self.prefetch_h2d_rate

    def transfer_rate(self, nbytes: int, direction: str = "h2d") -> float:
        """Effective bytes/s of one prefetch call of ``nbytes`` (its set-up included)."""
        if nbytes <= 0:
            raise ValueError("transfer size must be positive")
        return nbytes / self.prefetch_time(nbytes, direction)

    def transfer_time(self, nbytes: int, direction: str = "h2d") -> float:
        """Seconds to migrate ``nbytes`` in one prefetch call (:meth:`prefetch_time`)."""
        return self.prefetch_time(max(nbytes, 0), direction)

    def migration_rate_limit(self, direction: str = "h2d") -> float:
        """The fastest any migration of data runs in ``direction`` (prefetch or fault path), bytes/s.

        No copy of populated data is faster in the simulator: what
        :mod:`umrt.sim.bound` may assume of every policy.
        """
        if direction == "d2h":
            return self.prefetch_d2h_rate
        return max(self.prefetch_h2d_rate, self.fault_migration_rate)

    def copy_rate(self, direction: str = "h2d") -> float:
        """Bytes/s of a ``cudaMemcpyAsync`` between pinned host memory and GPU-resident managed
        memory in ``direction`` (the copy engines): :attr:`copy_h2d_rate` / :attr:`copy_d2h_rate`
        where the profile measured them, else the pinned copy's own rate (the link,
        :attr:`h2d_bandwidth` / :attr:`d2h_bandwidth`; umrt/sim/MODEL.md says why)."""
        if direction == "d2h":
            return self.copy_d2h_rate or self.d2h_bandwidth
        return self.copy_h2d_rate or self.h2d_bandwidth

    def fastest_rate(self, direction: str = "h2d") -> float:
        """The fastest any path moves data in ``direction``: a migration (prefetch or fault path)
        or a copy-engine copy (:meth:`copy_rate`). What :mod:`umrt.sim.bound` may assume of every policy."""
        return max(self.migration_rate_limit(direction), self.copy_rate(direction))

    def peak_for(self, math_mode: str = "") -> float:
        """Peak FLOP/s for a kernel whose arithmetic runs in ``math_mode``.

        ``"fp32"``/``"fp64"``: CUDA cores (FP64 is rare in training and taken
        at the FP32 rate, an optimistic figure); ``"tf32"``: TF32 tensor cores
        (FP32 on a GPU without them); anything else (``"bf16"``, ``"fp16"``,
        ``""`` for a trace that does not say): :attr:`peak_flops`.
        """
        if math_mode == "fp32" or math_mode == "fp64":
            return self.peak_flops_fp32 or self.peak_flops
        if math_mode == "tf32":
            return self.peak_flops_tf32 or self.peak_flops_fp32 or self.peak_flops
        return self.peak_flops

    @property
    def achieved_hbm_bandwidth(self) -> float:
        """Bytes/s a kernel reaches: ``hbm_bandwidth * memory_efficiency``."""
        return self.hbm_bandwidth * (self.memory_efficiency or self.compute_efficiency)

    def compute_time(self, flops: int, nbytes: int, math_mode: str = "") -> float:
        """Roofline time of one kernel: ``max(flops/(peak*eff), bytes/(hbm*mem_eff), launch floor)``,
        with the peak of its arithmetic (:meth:`peak_for`) and, for TF32 kernels (convolutions),
        :attr:`tf32_efficiency` where the profile has one."""
        peak = self.peak_flops if not math_mode else self.peak_for(math_mode)
        eff = self.tf32_efficiency if math_mode == "tf32" and self.tf32_efficiency else self.compute_efficiency
        return max(flops / (peak * eff), nbytes / self.achieved_hbm_bandwidth, self.launch_floor_s)

    def to_dict(self) -> dict:
        """The JSON form: numbers as ``{"value", "source"}`` pairs."""
        out: dict = {"name": self.name, "description": self.description}
        for f in fields(self):
            if f.name in _NUMERIC and not (f.name in _OPTIONAL and not getattr(self, f.name)):
                out[f.name] = {"value": getattr(self, f.name), "source": self.sources.get(f.name, "")}
        return out


# name -> (type, lower bound exclusive?, bound): the validation table
_NUMERIC: dict[str, tuple[type, float, float]] = {
    "gpu_memory_bytes": (int, 0, math.inf),
    "peak_flops": (float, 0, math.inf),
    "peak_flops_fp32": (float, 0, math.inf),
    "peak_flops_tf32": (float, 0, math.inf),
    "hbm_bandwidth": (float, 0, math.inf),
    "compute_efficiency": (float, 0, 1.0),
    "memory_efficiency": (float, 0, 1.0),
    "tf32_efficiency": (float, 0, 1.0),
    "launch_floor_s": (float, -1, 1.0),
    "h2d_bandwidth": (float, 0, math.inf),
    "d2h_bandwidth": (float, 0, math.inf),
    "prefetch_h2d_rate": (float, 0, math.inf),
    "prefetch_h2d_setup_s": (float, -1, 1.0),
    "prefetch_d2h_rate": (float, 0, math.inf),
    "prefetch_d2h_setup_s": (float, -1, 1.0),
    "fault_batch_size": (int, 0, math.inf),
    "fault_batch_latency_s": (float, -1, 1.0),
    "fault_migration_rate": (float, 0, math.inf),
    "prefetch_threshold": (float, -1, 100.0),
    "first_touch_rate": (float, 0, math.inf),
    "prefetch_populate_rate": (float, 0, math.inf),
    "host_populate_rate": (float, 0, math.inf),
    "discard_rate": (float, 0, math.inf),
    "discard_range_s": (float, -1, 1.0),
    "discard_refault_rate": (float, 0, math.inf),
    "discard_prefetch_rate": (float, 0, math.inf),
    "prefetch_call_overhead_s": (float, -1, 1.0),
    "advise_call_s": (float, -1, 1.0),
    "batch_range_s": (float, -1, 1.0),
    "batch_d2h_range_s": (float, -1, 1.0),
    "copy_h2d_rate": (float, 0, math.inf),
    "copy_d2h_rate": (float, 0, math.inf),
    "copy_host_wait": (float, -1, 1.0),
    "sm_copy_share": (float, -1, 0.99),
}
# Fields a profile file may leave out (written before they existed): the FP32/TF32
# peaks as peak_flops, memory_efficiency as compute_efficiency.
_OPTIONAL = frozenset({"peak_flops_fp32", "peak_flops_tf32", "memory_efficiency", "copy_h2d_rate",
                       "copy_d2h_rate", "copy_host_wait", "tf32_efficiency", "sm_copy_share"})
# The Unified Memory cost model of umrt/sim/MODEL.md (umrt 0.2): a file written before it
# (with the UVMSmart transfer curve) lacks these and is refused with a hint.
_UM_MODEL = frozenset({
    "prefetch_h2d_rate", "prefetch_h2d_setup_s", "prefetch_d2h_rate", "prefetch_d2h_setup_s",
    "fault_migration_rate", "first_touch_rate", "prefetch_populate_rate", "host_populate_rate",
    "discard_rate", "discard_range_s", "discard_refault_rate", "discard_prefetch_rate", "advise_call_s",
    "batch_range_s", "batch_d2h_range_s",
})


def _parse(data: object, origin: str) -> HardwareProfile:
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: a hardware profile must be a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{origin}: field 'name' must be a non-empty string")
    values: dict = {}
    sources: dict[str, str] = {}
    for key, (typ, low, high) in _NUMERIC.items():
        if key not in data:
            if key in _OPTIONAL:
                continue
            hint = ""
            if key in _UM_MODEL and "transfer_curve_a" in data:
                hint = (" (this file predates the measured Unified Memory model: run `umrt calibrate` again, "
                        "or copy the field from a shipped profile such as h100-sxm5-80g)")
            raise ConfigError(f"{origin}: missing field '{key}'{hint}")
        entry = data[key]
        if not isinstance(entry, dict) or "value" not in entry or not isinstance(entry.get("source"), str):
            raise ConfigError(f"{origin}: field '{key}' must be {{\"value\": number, \"source\": \"...\"}}")
        value = entry["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{origin}: field '{key}' must be a finite number, got {value!r}")
        if typ is int and value != int(value):
            raise ConfigError(f"{origin}: field '{key}' must be an integer, got {value!r}")
        # low == 0: strictly positive; low == -1: zero allowed
        if (low == 0 and value <= 0) or (low == -1 and value < 0) or value > high:
            bound = "> 0" if low == 0 else ">= 0"
            if math.isfinite(high):
                bound += f" and <= {high:g}"
            raise ConfigError(f"{origin}: field '{key}' must be {bound}, got {value!r}")
        if not entry["source"].strip():
            raise ConfigError(f"{origin}: field '{key}' needs a non-empty source")
        values[key] = typ(value)
        sources[key] = entry["source"]
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{origin}: field 'description' must be a string")
    return HardwareProfile(name=name, description=description, sources=sources, **values)


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a shipped profile by name (see :data:`PROFILES`) or a profile file by path.

    Raises :class:`~umrt.errors.ConfigError` naming the field for an invalid file.
    """
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    text_name = str(name_or_path)
    if text_name in PROFILES:
        text = resources.files("umrt").joinpath("profiles", f"{text_name}.json").read_text()
        origin = f"profile {text_name}"
    else:
        path = Path(text_name)
        if not path.is_file():
            raise ConfigError(
                f"unknown hardware profile {text_name!r}: not a file, and not one of {', '.join(PROFILES)}"
            )
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read hardware profile {path}: {exc}") from exc
        origin = str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{origin}: not valid JSON ({exc})") from exc
    return _parse(data, origin)


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    """Write ``profile`` in the file format :func:`load_profile` reads."""
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


# ---------------------------------------------------------------- which card


@dataclass(frozen=True)
class Card:
    """A CUDA device identified: its form factor and the shipped profile to start from."""

    form_factor: str  # "sxm", "pcie", "c2c" or "unknown"
    base_profile: str
    evidence: str  # how the form factor was derived


# (name pattern, SXM SM count, PCIe SM count, SXM profile, PCIe profile)
_FAMILIES = (
    ("H100", 132, 114, "h100-sxm5-80g", "h100-pcie5-80g"),
    ("H200", 132, 132, "h100-sxm5-80g", "h100-pcie5-80g"),
    ("A100", 108, 108, "a100-pcie4-80g", "a100-pcie4-80g"),
    ("V100", 80, 80, "v100-pcie3-32g", "v100-pcie3-32g"),
)


def identify_card(device_name: str, sm_count: int = 0, total_bytes: int = 0,
                  host_page_tables: bool = False) -> Card:
    """The form factor and base profile of a CUDA device, from its name and attributes.

    Never assumed: ``"sxm"``/``"pcie"`` come from the name (``SXM``, ``PCIe``,
    ``NVL``: the NVL card is a PCIe card), an NVLink-C2C part (GH200/GB200)
    from its name or from coherent access through the host's page tables;
    an H100 whose name says neither is told apart by its SM count (132 on
    SXM5, 114 on PCIe), and the H100 80GB HBM3 name is the SXM5 part (the
    PCIe card has HBM2e). Anything else is ``"unknown"`` and the evidence says so.
    """
    name = device_name.upper().replace("-", " ")
    big = total_bytes > 48 * GIB
    if "GH200" in name or "GB200" in name or host_page_tables:
        why = "the name" if ("GH200" in name or "GB200" in name) else "coherent access through host page tables"
        return Card("c2c", "gh200-c2c", f"NVLink-C2C from {why}")
    form, why = "unknown", f"neither SXM nor PCIe in the name {device_name!r}"
    if "SXM" in name:
        form, why = "sxm", "'SXM' in the device name"
    elif "PCIE" in name or " NVL" in name or name.endswith("NVL"):
        form, why = "pcie", "'PCIe' or 'NVL' in the device name"
    for family, sxm_sms, pcie_sms, sxm_prof, pcie_prof in _FAMILIES:
        if family not in name:
            continue
        if form == "unknown" and family == "H100" and "HBM3" in name:
            form, why = "sxm", "an 'H100 ... HBM3' is the SXM5 part (HBM3; the 80 GB add-in card has HBM2e)"
        if form == "unknown" and sm_count and sxm_sms != pcie_sms:
            if sm_count == sxm_sms:
                form, why = "sxm", f"{sm_count} SMs (the {family} SXM part; the PCIe card has {pcie_sms})"
            elif sm_count == pcie_sms:
                form, why = "pcie", f"{sm_count} SMs (the {family} PCIe card; the SXM part has {sxm_sms})"
        if family == "A100":
            base = "a100-pcie4-80g" if big else "a100-pcie4-40g"
        elif family == "V100":
            base = "v100-pcie3-32g" if total_bytes > 20 * GIB else "v100-pcie3-16g"
        else:
            base = pcie_prof if form == "pcie" else sxm_prof
        return Card(form, base, why)
    return Card(form, "a100-pcie4-80g" if big else "a100-pcie4-40g", why + "; unknown family")


def closest_profile_name(device_name: str, total_bytes: int, sm_count: int = 0,
                         host_page_tables: bool = False) -> str:
    """The shipped profile to start from (:func:`identify_card`)."""
    return identify_card(device_name, sm_count, total_bytes, host_page_tables).base_profile


#: GPU families a shipped profile was measured or modelled on.
KNOWN_GPUS = ("V100", "A100", "H100", "H200", "GH200")


def auto_profile_name(device_name: str, total_bytes: int) -> tuple[str, bool]:
    """The shipped profile umrt plans with on this GPU when ``UMRT_PROFILE`` is unset
    (the closest one, as ``umrt calibrate`` starts from), and whether a shipped
    profile was made for this kind of GPU (False: only the closest guess)."""
    return closest_profile_name(device_name, total_bytes), any(k in device_name.upper() for k in KNOWN_GPUS)
