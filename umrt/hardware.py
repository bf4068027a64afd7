"""Hardware profiles: the numbers the simulator runs on, each with its source.

A profile is a JSON data file (``umrt/profiles/NAME.json``) holding one number
per field, each written as ``{"value": ..., "source": "..."}`` so that every
figure the simulator uses names where it comes from (a datasheet, the NVIDIA
UVM driver, a published simulator or paper, or "assumption" where nothing is
published, saying whether ``umrt calibrate`` measures it). ``umrt calibrate``
writes the same format from measurements on a real GPU::

    >>> from umrt.hardware import load_profile
    >>> p = load_profile("v100-pcie3-16g")
    >>> round(p.transfer_rate(2 << 20) / 2**30, 2)  # GiB/s for a 2 MB migration
    11.95
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from umrt.errors import ConfigError

__all__ = ["HardwareProfile", "PROFILES", "load_profile", "save_profile"]

#: Profiles shipped with umrt (``umrt/profiles/NAME.json``).
PROFILES: tuple[str, ...] = (
    "v100-pcie3-16g",
    "v100-pcie3-32g",
    "a100-pcie4-40g",
    "a100-pcie4-80g",
    "h100-pcie5-80g",
    "gh200-c2c",
)

GIB = 1 << 30
KIB = 1 << 10


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU and its host link, as the simulator sees them.

    Bandwidths are bytes/s, times seconds. ``sources`` maps each numeric
    field to the citation it was loaded with.
    """

    name: str
    gpu_memory_bytes: int
    peak_flops: float  # dense tensor-core FLOP/s at training precision
    hbm_bandwidth: float
    h2d_bandwidth: float  # per-direction link rate: caps every host-to-device copy
    d2h_bandwidth: float
    transfer_curve_a: float  # GiB/s: asymptote/(2/pi) of the UVMSmart size-vs-rate curve
    transfer_curve_b: float  # per KB: steepness of that curve
    fault_batch_size: int  # faults serviced per batch (one replay per batch)
    fault_batch_latency_s: float  # fixed cost of servicing one fault batch
    prefetch_threshold: float  # density prefetcher threshold, percent
    prefetch_call_overhead_s: float  # host cost of one prefetch/discard/advise call
    launch_floor_s: float  # shortest kernel: launch + tail
    compute_efficiency: float  # achieved fraction of peak FLOP/s and HBM bandwidth
    # FP32 arithmetic: on CUDA cores (PyTorch's default for matmuls), or TF32 tensor
    # cores (its default for cuDNN convolutions, Ampere and later). 0: as peak_flops.
    peak_flops_fp32: float = 0.0
    peak_flops_tf32: float = 0.0
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def transfer_rate(self, nbytes: int, direction: str = "h2d") -> float:
        """Bytes/s of one migration of ``nbytes`` over the link.

        UVMSmart's curve ``(2a/pi) * atan(b * size_KB)`` GiB/s (gpu-sim.cc):
        small migrations pay a fixed set-up cost and run far below the link
        rate; the result is capped at the profile's per-direction link rate.
        """
        if nbytes <= 0:
            raise ValueError("transfer size must be positive")
        rate = (2.0 * self.transfer_curve_a / math.pi) * math.atan(self.transfer_curve_b * nbytes / KIB) * GIB
        cap = self.d2h_bandwidth if direction == "d2h" else self.h2d_bandwidth
        return min(rate, cap)

    def transfer_time(self, nbytes: int, direction: str = "h2d") -> float:
        """Seconds to migrate ``nbytes`` in one contiguous copy."""
        return 0.0 if nbytes <= 0 else nbytes / self.transfer_rate(nbytes, direction)

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

    def compute_time(self, flops: int, nbytes: int, math_mode: str = "") -> float:
        """Roofline time of one kernel: ``max(flops/(peak*eff), bytes/(hbm*eff), launch floor)``,
        with the peak of its arithmetic (:meth:`peak_for`)."""
        eff = self.compute_efficiency
        peak = self.peak_flops if not math_mode else self.peak_for(math_mode)
        return max(flops / (peak * eff), nbytes / (self.hbm_bandwidth * eff), self.launch_floor_s)

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
    "hbm_bandwidth": (float, 0, math.inf),
    "h2d_bandwidth": (float, 0, math.inf),
    "d2h_bandwidth": (float, 0, math.inf),
    "transfer_curve_a": (float, 0, math.inf),
    "transfer_curve_b": (float, 0, math.inf),
    "fault_batch_size": (int, 0, math.inf),
    "fault_batch_latency_s": (float, -1, 1.0),
    "prefetch_threshold": (float, -1, 100.0),
    "prefetch_call_overhead_s": (float, -1, 1.0),
    "launch_floor_s": (float, -1, 1.0),
    "compute_efficiency": (float, 0, 1.0),
    "peak_flops_fp32": (float, 0, math.inf),
    "peak_flops_tf32": (float, 0, math.inf),
}
# Fields a profile file may leave out (written before they existed): as peak_flops.
_OPTIONAL = frozenset({"peak_flops_fp32", "peak_flops_tf32"})


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
            raise ConfigError(f"{origin}: missing field '{key}'")
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
