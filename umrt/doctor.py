"""``umrt doctor``: is this machine ready to run umrt on its GPU?

It reads, in the order a GPU user meets them: umrt's settings (``UMRT_*``),
the CUDA runtime umrt calls (cuda-bindings on a CUDA 13 driver, else CuPy)
and the driver under it, the GPU (name, memory, concurrent managed access),
which batched and discard calls exist, torch (a CUDA build?), the torch
allocator shim (built now when it is not cached, so the first training run
does not pay for it), NVML, the hardware profile umrt will plan with,
whether ``UMRT=1`` is installed, and the versions of umrt's dependencies
against umrt's minimums and the versions it was tested with (:data:`TESTED`).

Each finding is ``ok``, ``note`` (it works, with a caveat worth knowing) or
``missing`` (umrt cannot run on this GPU as installed; the finding names the
command that fixes it). :func:`report` prints them and returns the exit
status: 0 when nothing is missing, 2 otherwise.

Everything it reads comes through a :class:`ThisMachine`, which reads the real
one; tests hand :func:`check` a subclass over the fake CUDA runtimes.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from umrt.activation import INSTALL_COMMAND, HookStatus, hook_status
from umrt.backends.cuda import CUDA13, BindingsApi, CudaApi, default_api
from umrt.config import Config, format_bytes, from_env
from umrt.errors import UmrtError
from umrt.hardware import auto_profile_name, load_profile

OK, NOTE, MISSING = "ok", "note", "missing"

#: The versions umrt is tested with, by where (the README's "Tested versions" table).
#: "CPU CI": `.ci/run` on the development machine (no GPU; the CUDA packages are imported
#: for their call signatures only). "H100": the one real-GPU run (an H100 80GB HBM3 on PCIe Gen5).
#: "CPU suite (lowest)": the CPU suite with that version alone changed (CuPy's tests excepted).
TESTED: dict[str, dict[str, str]] = {
    "python": {"CPU CI": "3.11.7", "H100": "3.12"},
    "torch": {"CPU CI": "2.13.0+cpu", "H100": "2.11.0+cu130"},
    "numpy": {"CPU CI": "2.4.6", "H100": "2.5.2", "CPU suite (lowest)": "1.26.4"},
    "numba": {"CPU CI": "0.68.1", "H100": "0.68"},
    "numba-cuda": {"H100": "0.30.4"},
    "transformers": {"CPU CI": "5.24.0"},
    "cupy-cuda12x": {"CPU CI": "14.2.0"},
    "cupy-cuda13x": {"H100": "14.2.0"},
    "cuda-bindings": {"CPU CI": "13.5.0", "H100": "13.3.1"},
    "cuda-core": {"CPU CI": "1.2.2", "H100": "1.2.0"},
    "nvidia-ml-py": {"CPU CI": "13.615.71"},
}
#: Tested driver and CUDA runtime (the H100 run).
TESTED_DRIVER = "580.159.04"
TESTED_CUDA = (13, 0)
#: umrt's dependencies reported (the optional CUDA ones only when installed).
REQUIRED = ("torch", "numpy", "numba", "transformers", "nvidia-ml-py")
OPTIONAL = ("cupy-cuda12x", "cupy-cuda13x", "cuda-bindings", "cuda-core", "numba-cuda")
#: CUDA 13's batched and discard entry points (cuda.bindings.runtime).
BATCH_CALLS = ("cudaMemPrefetchBatchAsync", "cudaMemDiscardBatchAsync", "cudaMemDiscardAndPrefetchBatchAsync")
#: What a GPU user installs to get torch's CUDA build (pytorch.org's index of each CUDA version).
TORCH_CUDA_INSTALL = ("pip install torch --index-url https://download.pytorch.org/whl/cu130 "
                      "(CUDA 13.0; for CUDA 12.8: .../whl/cu128)")


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``what`` was checked, its ``status`` (ok, note, missing),
    what was found, and the command that fixes it (for missing pieces and some notes)."""

    what: str
    status: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class TorchBuild:
    """The installed torch: its version and the CUDA version it was built for (None: CPU build)."""

    version: str
    cuda: str | None


@dataclass(frozen=True)
class ShimBuild:
    """The torch allocator shim: its library (None: it could not be built, ``error`` says why)
    and how long building it took now (None: loaded from torch's extension cache)."""

    path: str | None
    built_in_s: float | None = None
    error: str = ""


class ThisMachine:
    """The real machine."""

    def cuda_api(self) -> CudaApi:
        """The CUDA runtime adapter umrt would use; raises when there is none."""
        return default_api()

    def device_name(self, api: CudaApi, device: int) -> str:
        """The GPU's name (``cudaGetDeviceProperties``)."""
        if isinstance(api, BindingsApi):
            err, prop = api.rt.cudaGetDeviceProperties(device)
            if err != api.rt.cudaError_t.cudaSuccess:
                raise UmrtError(f"cudaGetDeviceProperties({device}) failed: {err}")
            raw = prop.name
        else:
            raw = api.rt.getDeviceProperties(device)["name"]
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).strip("\x00 ")

    def driver_version(self, api: CudaApi) -> int:
        """The CUDA version the driver supports (``cudaDriverGetVersion``; 0: no driver)."""
        if isinstance(api, BindingsApi):
            return int(api.rt.cudaDriverGetVersion()[1])
        return int(api.rt.driverGetVersion())

    def nvml(self) -> Any:
        """The ``pynvml`` module; raises ImportError without it."""
        import pynvml

        return pynvml

    def torch_build(self) -> TorchBuild | None:
        """The installed torch, None when there is none."""
        try:
            import torch
        except ImportError:
            return None
        return TorchBuild(torch.__version__, torch.version.cuda)

    def build_shim(self) -> ShimBuild:
        """Load the allocator shim, building it first when it is not cached."""
        # optional: torch: the shim is checked only when torch is installed
        from umrt.allocators.torch import load_shim

        started = time.time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shim = load_shim()
        if shim is None:
            return ShimBuild(None, error=str(caught[-1].message) if caught else "load_shim() returned None")
        built_now = os.path.getmtime(shim.path) >= started - 1
        return ShimBuild(shim.path, time.time() - started if built_now else None)

    def build_native(self) -> ShimBuild:
        """Load the native steady state's libraries (the allocation front and the schedule),
        building them first when they are not cached; ``path``: the front's."""
        # optional: torch: the native libraries are built with torch's cpp_extension
        from umrt.native.binding import native_library

        # optional: same
        from umrt.native.front import load_front

        started = time.time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            front, schedule = load_front(), native_library()
        if front is None or schedule is None:
            return ShimBuild(None, error=str(caught[-1].message) if caught else "the native libraries did not load")
        built_now = os.path.getmtime(front.path) >= started - 1
        return ShimBuild(front.path, time.time() - started if built_now else None)

    def activation(self) -> HookStatus:
        """Whether ``UMRT=1`` works (:func:`umrt.activation.hook_status`)."""
        return hook_status()

    def version_of(self, distribution: str) -> str | None:
        """An installed distribution's version, None when it is not installed."""
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def minimum_versions(self) -> dict[str, str]:
        """umrt's declared lower bounds, ``{distribution: version}``."""
        try:
            return minimums(importlib.metadata.requires("umrt") or [])
        except importlib.metadata.PackageNotFoundError:
            return _source_tree_minimums()


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)")


def minimums(requirements: list[str]) -> dict[str, str]:
    """``{"torch": "2.4", ...}`` from requirement strings such as ``torch>=2.4`` or
    ``cupy-cuda12x>=13; extra == "cuda12"`` (the first ``>=`` bound of each)."""
    out: dict[str, str] = {}
    for line in requirements:
        m = _REQUIREMENT.match(line)
        if m:
            out.setdefault(_normal(m.group(1)), m.group(2))
    return out


def _source_tree_minimums() -> dict[str, str]:
    """Running from a source tree that is not installed: read pyproject.toml beside the package."""
    path = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return {}
    if not path.is_file():
        return {}
    project = tomllib.loads(path.read_text()).get("project", {})
    lines = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        lines.extend(extra)
    return minimums(lines)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading release numbers: ``"2.13.0+cpu" -> (2, 13, 0)``, ``"0.30.4" -> (0, 30, 4)``."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def _cuda(version: int) -> str:
    """``13000 -> "13.0"``, ``12090 -> "12.9"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


# ---------------------------------------------------------------------------
# The checks.
# ---------------------------------------------------------------------------
def check(machine: ThisMachine, environ: dict[str, str] | None = None, *, build_shim: bool = True) -> list[Finding]:
    """Every finding about ``machine``, in the order a GPU user meets them.

    Args:
        machine: what to read (:class:`ThisMachine` for the real one).
        environ: the ``UMRT_*`` settings to validate (default ``os.environ``).
        build_shim: build the torch allocator shim when it is not cached (10-60 s once).
    """
    found: list[Finding] = []
    settings = _settings(environ, found)
    cfg = settings or Config()
    nvml_found: list[Finding] = []
    nvml_driver = _nvml(machine, nvml_found)  # read first: the driver line shows NVML's driver version
    gpu = _gpu(machine, cfg, nvml_driver, found)
    torch = _torch(machine, gpu, found, build_shim, native=cfg.native)
    found.extend(nvml_found)
    if settings is None and "UMRT_PROFILE" in (os.environ if environ is None else environ):
        found.append(Finding("profile", NOTE, "not chosen: the UMRT_* settings above are invalid"))
    else:
        _profile(cfg, gpu, found)
    hook = machine.activation()
    found.append(Finding("UMRT=1 activation", OK if hook.works else MISSING, hook.describe(),
                         "" if hook.works else INSTALL_COMMAND))
    _versions(machine, torch, found)
    return found


def _settings(environ: dict[str, str] | None, found: list[Finding]) -> Config | None:
    """The ``UMRT_*`` settings' finding (and notes); None when one is invalid."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = from_env(environ)
        budget = cfg.budget()
        notes = cfg.notes()
    except UmrtError as exc:
        found.append(Finding("settings", MISSING, str(exc), "fix or unset that variable"))
        return None
    profile = cfg.profile or "auto"
    if cfg.gpu_memory is None and not cfg.shadow and not cfg.shares_off:
        memory = f"unset: a fair share of the GPU ({budget} when alone, at least {cfg.share_minimum()})"
    else:
        default = "" if cfg.gpu_memory is not None else "the default, "
        mode = f"; shadow mode on {cfg.simulate}" if cfg.shadow else ""
        memory = f"{budget} ({default}{budget.describe()}{mode})"
    found.append(Finding("settings", OK, f"UMRT_* valid: GPU memory {memory}, "
                                         f"policy {cfg.policy}, device {cfg.device}, profile {profile}"))
    for note in notes:
        found.append(Finding("settings", NOTE, note))
    for w in caught:
        found.append(Finding("settings", NOTE, str(w.message)))
    return cfg


@dataclass
class _Gpu:
    api: CudaApi
    device: int
    name: str
    total: int


def _nvml(machine: ThisMachine, found: list[Finding]) -> str | None:
    """NVML's finding (appended to ``found``) and the driver version it reports."""
    try:
        nvml = machine.nvml()
    except ImportError:
        found.append(Finding("NVML", NOTE, "pynvml is not installed: `umrt run` prints no telemetry",
                             "pip install nvidia-ml-py"))
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        found.append(Finding("NVML", NOTE, f"NVML unavailable ({exc}): `umrt run` prints no telemetry"))
        return None
    try:
        raw = nvml.nvmlSystemGetDriverVersion()
        driver = raw.decode() if isinstance(raw, bytes) else str(raw)
        count = int(nvml.nvmlDeviceGetCount())
        found.append(Finding("NVML", OK, f"works (driver {driver}, {count} device(s)): "
                                         "`umrt run` samples GPU memory and PCIe traffic"))
        return driver
    except nvml.NVMLError as exc:
        found.append(Finding("NVML", NOTE, f"NVML initialised but failed ({exc}): no telemetry"))
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _gpu(machine: ThisMachine, cfg: Config, nvml_driver: str | None, found: list[Finding]) -> _Gpu | None:
    """CUDA runtime, driver, GPU, concurrent managed access, batched calls; the GPU if usable."""
    try:
        api = machine.cuda_api()
    except Exception as exc:  # noqa: BLE001 - CudaError, or a broken CUDA install
        found.append(Finding("CUDA runtime", MISSING, f"none usable: {exc}",
                             "pip install 'umrt[cuda13]' (CUDA 13 driver) or 'umrt[cuda12]' (CUDA 12)"))
        return None
    via = "cuda-bindings (cuda.bindings.runtime)" if isinstance(api, BindingsApi) else "CuPy (cupy.cuda.runtime)"
    runtime_ok = not (api.version >= CUDA13 and not isinstance(api, BindingsApi))
    found.append(Finding(
        "CUDA runtime", OK if runtime_ok else MISSING,
        f"CUDA {_cuda(api.version)} through {via}" + ("" if runtime_ok else
            ": on CUDA 13 umrt needs cuda-bindings 13 (CuPy cannot prefetch to the host there)"),
        "" if runtime_ok else "pip install 'cuda-bindings>=13'"))
    try:
        driver = machine.driver_version(api)
        why = "cudaDriverGetVersion: 0"
    except Exception as exc:  # noqa: BLE001 - a broken driver install
        driver, why = 0, f"cudaDriverGetVersion failed: {exc}"
    shown = f"driver {nvml_driver}, " if nvml_driver else ""
    if driver == 0:
        found.append(Finding("driver", MISSING, f"no NVIDIA driver found ({why})", "install the NVIDIA driver"))
        return None
    if driver < api.version:
        found.append(Finding("driver", MISSING,
                             f"{shown}supports CUDA {_cuda(driver)}, older than the CUDA {_cuda(api.version)} "
                             "runtime umrt calls", "update the NVIDIA driver, or install umrt[cuda12]"))
        return None
    tested = "" if nvml_driver in (None, TESTED_DRIVER) else f" (tested: {TESTED_DRIVER})"
    found.append(Finding("driver", OK, f"{shown}supports CUDA {_cuda(driver)}{tested}"))
    try:
        count = api.device_count()
    except Exception as exc:  # noqa: BLE001
        found.append(Finding("GPU", MISSING, f"no CUDA device: {exc}", "check `nvidia-smi` and CUDA_VISIBLE_DEVICES"))
        return None
    if count == 0 or cfg.device >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        found.append(Finding("GPU", MISSING,
                             f"device {cfg.device} asked for (UMRT_DEVICE), {count} visible"
                             + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""),
                             "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and UMRT_DEVICE"))
        return None
    try:
        api.set_device(cfg.device)
        name = machine.device_name(api, cfg.device)
        free, total = api.mem_get_info()
        concurrent = api.concurrent_managed_access(cfg.device)
    except Exception as exc:  # noqa: BLE001
        found.append(Finding("GPU", MISSING, f"device {cfg.device} cannot be read: {exc}"))
        return None
    found.append(Finding("GPU", OK, f"cuda:{cfg.device} {name}, {format_bytes(total)} "
                                    f"({format_bytes(free)} free), {count} visible"))
    if concurrent:
        found.append(Finding("managed memory", OK, "concurrent managed access: umrt can prefetch, evict, "
                                                   "advise and discard while kernels run"))
    else:
        found.append(Finding("managed memory", MISSING,
                             "no concurrent managed access (Windows, WSL or a pre-Pascal GPU): pages "
                             "migrate on demand only, umrt cannot prefetch or evict",
                             "run on Linux with a Pascal or newer GPU"))
    calls: list[str] = []
    if isinstance(api, BindingsApi):
        calls = [c for c in BATCH_CALLS if hasattr(api.rt, c)]
        found.append(Finding("batched calls", OK if calls else NOTE,
                             ", ".join(calls) if calls else "none of " + ", ".join(BATCH_CALLS)))
    else:
        found.append(Finding("batched calls", NOTE,
                             f"none on CUDA {_cuda(api.version)}: one cudaMemPrefetchAsync per range, and no "
                             "discard (umrt's pool reuses dead ranges in place instead)",
                             "with a CUDA 13 driver: pip install 'umrt[cuda13]'"))
    built = ""  # why umrt's SM copy kernel cannot be used here, if it cannot
    if cfg.swap_copy == "sm" and api.has_sm_copy:
        try:
            api.build_sm_copy()  # compiled now, as umrt does before its first swap (cached by CuPy)
        except Exception as exc:  # noqa: BLE001 - NVRTC, the driver or CuPy: said, not raised
            built = f"umrt's SM copy kernel does not build: {exc}"
    if "cudaMemDiscardBatchAsync" in calls and cfg.swap_copy == "sm" and api.has_sm_copy and not built:
        found.append(Finding("swap path", OK, "live data umrt takes off the GPU is copied to pinned host memory "
                                              "by umrt's SM copy kernel (on a stream of the greatest priority, meant to "
                                              "run beside the kernels: not measured yet) and discarded, then copied "
                                              "back before use"))
    elif "cudaMemDiscardBatchAsync" in calls:
        why = ("UMRT_SWAP_COPY=engines" if cfg.swap_copy == "engines"
               else built or "CuPy, which builds umrt's SM copy kernel, does not import")
        found.append(Finding("swap path", OK if cfg.swap_copy == "engines" else NOTE,
                             "live data umrt takes off the GPU is copied to pinned host memory by the copy engines "
                             f"({why}) and discarded, then copied back before use; on an H200 nothing issued after "
                             "such a copy ran beside it",
                             "" if cfg.swap_copy == "engines" else
                             "pip install 'umrt[cuda13]' (CuPy and its NVRTC), or UMRT_SWAP_COPY=engines to choose "
                             "the copy engines"))
    else:
        found.append(Finding("swap path", NOTE,
                             f"CUDA {_cuda(api.version)} has no discard: umrt moves live data off the GPU by page "
                             "migration (a prefetch to the host: 10-15 GB/s on an H100, against 55 GB/s for the "
                             "copy engines), so a tight GPU budget runs slower than on CUDA 13",
                             "with a CUDA 13 driver: pip install 'umrt[cuda13]'"))
    return _Gpu(api, cfg.device, name, total)


def _torch(machine: ThisMachine, gpu: _Gpu | None, found: list[Finding], build_shim: bool, *,
           native: bool) -> TorchBuild | None:
    torch = machine.torch_build()
    if torch is None:
        found.append(Finding("torch build", MISSING, "torch is not installed", TORCH_CUDA_INSTALL))
        return None
    if torch.cuda is None:
        found.append(Finding("torch build", MISSING, f"torch {torch.version} is a CPU build: umrt's allocator "
                                               "needs torch's CUDA build", TORCH_CUDA_INSTALL))
        found.append(Finding("allocator shim", NOTE, "not built: torch is a CPU build"))
        return torch
    note = ""
    if gpu is not None and version_tuple(torch.cuda)[:1] != (gpu.api.version // 1000,):
        note = (f"; umrt's own CUDA calls go through CUDA {_cuda(gpu.api.version)}: install umrt[cuda"
                f"{version_tuple(torch.cuda)[0]}] to match")
    found.append(Finding("torch build", NOTE if note else OK,
                         f"torch {torch.version}, built for CUDA {torch.cuda}{note}"))
    if not build_shim:
        found.append(Finding("allocator shim", NOTE, "not checked (--no-build)"))
        return torch
    found.append(_built("allocator shim", machine.build_shim(), "{path}",
                        "without it running out of managed memory stops the process instead of raising "
                        "torch.cuda.OutOfMemoryError"))
    if not native:
        found.append(Finding("native steady", OK, "off: every allocation goes through Python (UMRT_NATIVE=1 "
                                                  "serves a repeating step natively; opt-in until a GPU run "
                                                  "has checked it, see the README)"))
        return torch
    found.append(_built("native steady", machine.build_native(),
                        "allocations of a repeating step are served without Python ({path}; UMRT_NATIVE=1)",
                        "the steady state is served from Python (same behaviour, ~70x the CPU per allocation)"))
    return torch


def _built(name: str, build: ShimBuild, ok: str, without: str) -> Finding:
    """The finding for a library umrt compiles: ``ok`` (with ``{path}``) when it loaded,
    ``without`` (what that costs) when it could not be built."""
    if build.path is None:
        return Finding(name, NOTE, f"could not be built ({build.error}); {without}",
                       "install a C++ compiler and ninja (pip install ninja)")
    how = "cached" if build.built_in_s is None else f"built now in {build.built_in_s:.0f} s, cached for later runs"
    return Finding(name, OK, f"{how}: {ok.format(path=build.path)}")


def _profile(cfg: Config, gpu: _Gpu | None, found: list[Finding]) -> None:
    if cfg.profile:
        try:
            load_profile(cfg.profile)
        except UmrtError as exc:
            found.append(Finding("profile", MISSING, f"UMRT_PROFILE={cfg.profile}: {exc}",
                                 "set UMRT_PROFILE to a shipped profile name or a `umrt calibrate` file"))
            return
        found.append(Finding("profile", OK, f"{cfg.profile} (UMRT_PROFILE)"))
        return
    if gpu is None:
        found.append(Finding("profile", NOTE, "not chosen: no usable GPU"))
        return
    name, made_for_it = auto_profile_name(gpu.name, gpu.total)
    if made_for_it:
        found.append(Finding("profile", OK, f"{name} (the shipped profile for a {gpu.name})"))
    else:
        found.append(Finding("profile", NOTE, f"no shipped profile for a {gpu.name}: umrt plans with {name}",
                             "umrt calibrate -o mygpu.json, then UMRT_PROFILE=mygpu.json"))


def _versions(machine: ThisMachine, torch: TorchBuild | None, found: list[Finding]) -> None:
    mins = machine.minimum_versions()
    python = ".".join(str(v) for v in sys.version_info[:3])
    found.append(_version_finding("python", python, None))
    for dist in REQUIRED + OPTIONAL:
        if dist == "torch" and torch is None:
            continue  # said above
        version = torch.version if dist == "torch" and torch is not None else machine.version_of(dist)
        if version is None:
            if dist in REQUIRED:
                found.append(Finding(dist, MISSING, "not installed", f"pip install '{dist}>={mins.get(dist, '0')}'"))
            continue
        found.append(_version_finding(dist, version, mins.get(dist)))
    numpy, numba_cuda = machine.version_of("numpy"), machine.version_of("numba-cuda")
    if numpy and numba_cuda and version_tuple(numpy) >= (2, 5) and version_tuple(numba_cuda)[:2] <= (0, 30):
        found.append(Finding("numba-cuda", NOTE,
                             f"numba-cuda {numba_cuda} with numpy {numpy}: on the H100 run numba-cuda 0.30.4 "
                             "could not compile any kernel with numpy 2.5 (numpy.row_stack was removed), so "
                             "`umrt calibrate` failed", "pip install 'numpy<2.5'"))


def _version_finding(dist: str, version: str, minimum: str | None) -> Finding:
    tested = TESTED.get(dist, {})
    where = ", ".join(f"{k} {v}" for k, v in tested.items()) or "none recorded"
    if minimum is not None and version_tuple(version) < version_tuple(minimum):
        return Finding(dist, MISSING, f"{version}, older than umrt's minimum {minimum}",
                       f"pip install '{dist}>={minimum}'")
    bound = f"needs >={minimum}; " if minimum else ""
    same = any(version_tuple(version)[:2] == version_tuple(v)[:2] for v in tested.values())
    return Finding(dist, OK if same else NOTE, f"{version} ({bound}tested: {where})"
                                               + ("" if same else "; this version is untested"))


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------
def report(findings: list[Finding], out: TextIO | None = None, *, as_json: bool = False) -> int:
    """Print ``findings``; return the exit status (0: nothing missing, 2: something is)."""
    out = out or sys.stdout
    missing = [f for f in findings if f.status == MISSING]
    if as_json:
        json.dump({"ready": not missing, "findings": [asdict(f) for f in findings]}, out, indent=2)
        out.write("\n")
        return 2 if missing else 0
    width = max(len(f.what) for f in findings)
    for f in findings:
        out.write(f"{f.status:<8} {f.what:<{width}}  {f.detail}\n")
        if f.fix:
            out.write(f"{'':<8} {'':<{width}}  fix: {f.fix}\n")
    notes = sum(f.status == NOTE for f in findings)
    if missing:
        names = ", ".join(dict.fromkeys(f.what for f in missing))
        out.write(f"umrt doctor: not ready for a GPU run: missing {names} (fixes above). Shadow mode "
                  "(`umrt run --simulate PROFILE script.py`) needs none of it.\n")
        return 2
    out.write(f"umrt doctor: ready: `UMRT=1 python train.py` runs under umrt ({notes} note(s) above).\n")
    return 0


def run(machine: ThisMachine | None = None, *, build_shim: bool = True, as_json: bool = False,
        out: TextIO | None = None) -> int:
    """Check ``machine`` (default :class:`ThisMachine`), print the report, return the exit status."""
    return report(check(machine or ThisMachine(), build_shim=build_shim), out, as_json=as_json)
