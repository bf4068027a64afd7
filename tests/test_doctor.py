"""`umrt doctor` against the fake CUDA runtimes (CUDA 12 through CuPy's shape, CUDA 13 through
cuda-bindings'), with and without a GPU and NVML: exit 0 when everything a GPU run needs is
there, 2 with the missing piece named when not."""
from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_cuda import FakeBindingsRuntime, FakeCupyRuntime, FakeGpu, cudaError_t

from umrt.activation import INSTALL_COMMAND, HookStatus
from umrt.backends.cuda import BindingsApi, CupyApi
from umrt.doctor import TESTED, ShimBuild, ThisMachine, TorchBuild, check, minimums, report, version_tuple
from umrt.errors import CudaError
from umrt.hardware import auto_profile_name

H100 = b"NVIDIA H100 80GB HBM3"


class CupyRuntime(FakeCupyRuntime):
    """cupy.cuda.runtime (CUDA 12) with getDeviceProperties, as CuPy returns it (a dict, name in bytes)."""

    def __init__(self, gpu: FakeGpu, version: int = 12080, driver: int | None = None, name: bytes = H100) -> None:
        super().__init__(gpu, version)
        self._driver, self._name = driver if driver is not None else version, name

    def driverGetVersion(self) -> int:
        return self._driver

    def getDeviceProperties(self, device: int) -> dict:
        self.gpu.check_device("getDeviceProperties", device, host_ok=False)
        return {"name": self._name, "totalGlobalMem": self.gpu.total, "concurrentManagedAccess": int(self.gpu.concurrent)}


class BindingsRuntime(FakeBindingsRuntime):
    """cuda.bindings.runtime (CUDA 13) with cudaGetDeviceProperties -> (cudaError_t, cudaDeviceProp)."""

    def __init__(self, gpu: FakeGpu, version: int = 13000, name: bytes = H100) -> None:
        super().__init__(gpu, version)
        self._name = name

    def cudaGetDeviceProperties(self, device: int):
        if not 0 <= device < self.gpu.devices:
            return (cudaError_t.cudaErrorInvalidDevice, None)
        return (cudaError_t.cudaSuccess, SimpleNamespace(name=self._name, totalGlobalMem=self.gpu.total))


class NVMLError(Exception):
    pass


def fake_nvml(fail_init: bool = False) -> SimpleNamespace:
    def init() -> None:
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    return SimpleNamespace(NVMLError=NVMLError, nvmlInit=init, nvmlShutdown=lambda: None,
                           nvmlSystemGetDriverVersion=lambda: "580.159.04", nvmlDeviceGetCount=lambda: 1)


#: The versions of the H100 run (the one real-GPU run umrt has had).
H100_VERSIONS = {dist: where["H100"] for dist, where in TESTED.items() if "H100" in where}
H100_VERSIONS["transformers"] = TESTED["transformers"]["CPU CI"]
H100_VERSIONS["nvidia-ml-py"] = TESTED["nvidia-ml-py"]["CPU CI"]


CUDA_TORCH = TorchBuild("2.11.0+cu130", "13.0")
HOOK = HookStatus(Path("/venv/site-packages/umrt-activate.pth"), True)
CACHED_SHIM = ShimBuild("/cache/umrt_torch_alloc_shim.so")
CACHED_NATIVE = ShimBuild("/cache/umrt_steady_front.so")


class FakeMachine(ThisMachine):
    """This machine's checks (device name, driver version, minimums) over a fake CUDA runtime."""

    def __init__(self, api=None, *, nvml=None, torch=CUDA_TORCH, hook=HOOK, shim=CACHED_SHIM,
                 native=CACHED_NATIVE, versions=None) -> None:
        self._api, self._nvml, self._torch, self._hook, self._shim = api, nvml, torch, hook, shim
        self._native = native
        self._versions = dict(H100_VERSIONS if versions is None else versions)

    def cuda_api(self):
        if isinstance(self._api, Exception):
            raise self._api
        return self._api

    def nvml(self):
        if self._nvml is None:
            raise ImportError("No module named 'pynvml'")
        return self._nvml

    def torch_build(self):
        return self._torch

    def build_shim(self):
        return self._shim

    def build_native(self):
        return self._native

    def activation(self):
        return self._hook

    def version_of(self, distribution):
        return self._versions.get(distribution)


def cuda13(**gpu) -> BindingsApi:
    return BindingsApi(BindingsRuntime(FakeGpu(total=80 * 2**30, **gpu)))


def cuda12(**gpu) -> CupyApi:
    return CupyApi(CupyRuntime(FakeGpu(total=80 * 2**30, **gpu)))


def doctor(machine, environ=None, **kw):
    out = io.StringIO()
    rc = report(check(machine, environ or {}, **kw), out)
    return rc, out.getvalue()


def status_of(text: str, what: str) -> str:
    return next(line.split()[0] for line in text.splitlines() if line[9:].startswith(what + " "))


def test_cuda13_with_everything_is_ready():
    rc, text = doctor(FakeMachine(cuda13(), nvml=fake_nvml()))
    assert rc == 0, text
    assert "CUDA 13.0 through cuda-bindings" in text
    assert "driver 580.159.04, supports CUDA 13.0" in text
    assert "cuda:0 NVIDIA H100 80GB HBM3, 80.0 GiB" in text
    assert "cudaMemPrefetchBatchAsync, cudaMemDiscardBatchAsync, cudaMemDiscardAndPrefetchBatchAsync" in text
    picked, _ = auto_profile_name("NVIDIA H100 80GB HBM3", 80 * 2**30)  # what the runtime plans with
    assert f"profile            {picked} (the shipped profile for a NVIDIA H100 80GB HBM3)" in text
    assert "cached: /cache/umrt_torch_alloc_shim.so" in text
    assert status_of(text, "managed memory") == "ok" and status_of(text, "NVML") == "ok"
    assert status_of(text, "torch build") == "ok" and "torch 2.11.0+cu130, built for CUDA 13.0" in text
    assert status_of(text, "torch") == "ok" and "2.11.0+cu130 (needs >=" in text
    # numba-cuda 0.30.4 with numpy 2.5.2: what broke `umrt calibrate` on the H100 run
    assert "could not compile any kernel with numpy 2.5" in text
    assert text.rstrip().endswith("note(s) above).") and "umrt doctor: ready" in text


def test_cuda12_with_everything_is_ready():
    versions = {**H100_VERSIONS, "cupy-cuda12x": "14.2.0", "numpy": "2.4.6"}
    del versions["cupy-cuda13x"], versions["cuda-bindings"], versions["numba-cuda"]
    rc, text = doctor(FakeMachine(cuda12(), nvml=fake_nvml(), torch=TorchBuild("2.11.0+cu128", "12.8"),
                                  versions=versions))
    assert rc == 0, text
    assert "CUDA 12.8 through CuPy" in text
    assert "none on CUDA 12.8: one cudaMemPrefetchAsync per range, and no discard" in text
    assert status_of(text, "batched calls") == "note" and "numba-cuda" not in text


@pytest.mark.parametrize("api", [cuda12, cuda13])
def test_no_gpu_and_no_nvml_exits_2_naming_the_gpu(api):
    rc, text = doctor(FakeMachine(api(devices=0), nvml=None))
    assert rc == 2, text
    assert status_of(text, "GPU") == "missing" and "device 0 asked for (UMRT_DEVICE), 0 visible" in text
    assert status_of(text, "NVML") == "note" and "fix: pip install nvidia-ml-py" in text
    assert status_of(text, "profile") == "note" and "not chosen: no usable GPU" in text
    assert "missing GPU (fixes above)" in text


@pytest.mark.parametrize("api", [cuda12, cuda13])
def test_nvml_is_optional(api):
    rc, text = doctor(FakeMachine(api(), nvml=fake_nvml(fail_init=True),
                                  torch=TorchBuild("2.11.0+cu130", "13.0" if api is cuda13 else "12.8")))
    assert rc == 0, text
    assert "NVML unavailable (NVML Shared Library Not Found)" in text and "supports CUDA" in text


def test_no_cuda_runtime_exits_2():
    rc, text = doctor(FakeMachine(CudaError("no CUDA Python runtime found: install umrt[cuda12]")))
    assert rc == 2 and status_of(text, "CUDA runtime") == "missing"
    assert "fix: pip install 'umrt[cuda13]'" in text and "missing CUDA runtime" in text


@pytest.mark.parametrize("case, what, shown", [
    ("cpu torch", "torch build", "is a CPU build"),
    ("no hook", "UMRT=1 activation", f"fix: {INSTALL_COMMAND}"),
    ("no concurrent access", "managed memory", "no concurrent managed access"),
    ("bad setting", "settings", "UMRT_GPU_MEMORY='banana'"),
    ("old numpy", "numpy", "1.20.0, older than umrt's minimum"),
    ("cuda 13 through cupy", "CUDA runtime", "fix: pip install 'cuda-bindings>=13'"),
    ("old driver", "driver", "supports CUDA 12.2, older than the CUDA 12.8 runtime"),
    ("no driver", "driver", "no NVIDIA driver found (cudaDriverGetVersion: 0)"),
    ("bad profile", "settings", "UMRT_PROFILE='no-such-gpu': unknown hardware profile"),
    ("live peak budget", "settings", "UMRT_GPU_MEMORY='20%peak': a live run does not know"),
])
def test_each_missing_piece_is_named_with_exit_2(case, what, shown):
    machine = FakeMachine(cuda13(), nvml=fake_nvml())
    environ = {}
    if case == "cpu torch":
        machine._torch = TorchBuild("2.13.0+cpu", None)
    elif case == "no hook":
        machine._hook = HookStatus(None)
    elif case == "no concurrent access":
        machine._api = cuda13(concurrent=False)
    elif case == "bad setting":
        environ = {"UMRT_GPU_MEMORY": "banana"}
    elif case == "old numpy":
        machine._versions["numpy"] = "1.20.0"
    elif case == "cuda 13 through cupy":
        machine._api = CupyApi(CupyRuntime(FakeGpu(), version=13000))
    elif case == "old driver":
        machine._api = CupyApi(CupyRuntime(FakeGpu(), version=12080, driver=12020))
    elif case == "no driver":
        machine._api = CupyApi(CupyRuntime(FakeGpu(), version=12080, driver=0))
    elif case == "bad profile":
        environ = {"UMRT_PROFILE": "no-such-gpu"}
    elif case == "live peak budget":
        environ = {"UMRT_GPU_MEMORY": "20%peak"}
    rc, text = doctor(machine, environ)
    assert rc == 2, text
    assert status_of(text, what) == "missing", text
    assert shown in text
    assert f"missing {what}" in text.splitlines()[-1]


def test_an_unknown_gpu_gets_the_closest_profile_and_a_calibrate_hint():
    rc, text = doctor(FakeMachine(BindingsApi(BindingsRuntime(FakeGpu(total=48 * 2**30), name=b"NVIDIA L40S")),
                                  nvml=fake_nvml()))
    assert rc == 0, text
    assert "no shipped profile for a NVIDIA L40S: umrt plans with a100-pcie4-40g" in text
    assert "fix: umrt calibrate -o mygpu.json, then UMRT_PROFILE=mygpu.json" in text


def test_shim_that_cannot_be_built_is_a_note():
    rc, text = doctor(FakeMachine(cuda13(), nvml=fake_nvml(), shim=ShimBuild(None, error="ninja is not installed")))
    assert rc == 0 and status_of(text, "allocator shim") == "note"
    assert "could not be built (ninja is not installed)" in text
    rc, text = doctor(FakeMachine(cuda13(), nvml=fake_nvml()), build_shim=False)
    assert "not checked (--no-build)" in text


def test_untested_versions_are_notes():
    machine = FakeMachine(cuda13(), nvml=fake_nvml(), versions={**H100_VERSIONS, "transformers": "4.50.0"})
    rc, text = doctor(machine)
    assert rc == 0 and status_of(text, "transformers") == "note"
    assert "4.50.0 (needs >=4.45; tested: CPU CI 5.24.0); this version is untested" in text


def test_json_report():
    out = io.StringIO()
    rc = report(check(FakeMachine(cuda13(devices=0)), {}), out, as_json=True)
    data = json.loads(out.getvalue())
    assert rc == 2 and data["ready"] is False
    assert {"what": "GPU", "status": "missing"}.items() <= next(f for f in data["findings"] if f["what"] == "GPU").items()


def test_minimums_and_versions():
    assert minimums(["torch>=2.4", 'cupy-cuda12x>=13; extra == "cuda12"', "rich", "Cuda_Core >=0.3"]) == {
        "torch": "2.4", "cupy-cuda12x": "13", "cuda-core": "0.3"}
    assert version_tuple("2.13.0+cpu") == (2, 13, 0) and version_tuple("13.615.71") == (13, 615, 71)
    assert ThisMachine().minimum_versions()["torch"]  # umrt's own declared bounds are readable


def test_umrt_doctor_on_this_machine(capsys):
    """The CLI on the real machine: every section prints; without a GPU it exits 2 naming what is missing."""
    from umrt.cli import main

    rc = main(["doctor", "--no-build"])
    text = capsys.readouterr().out
    for what in ("settings", "CUDA runtime", "NVML", "profile", "UMRT=1 activation", "python", "numpy"):
        assert f" {what} " in text, text
    assert rc in (0, 2) and ("umrt doctor: ready" in text) == (rc == 0)


def test_torch_built_for_another_cuda_than_umrts_calls_is_a_note():
    rc, text = doctor(FakeMachine(cuda12(), nvml=fake_nvml(), torch=TorchBuild("2.11.0+cu130", "13.0")))
    assert rc == 0 and status_of(text, "torch build") == "note"
    assert "umrt's own CUDA calls go through CUDA 12.8: install umrt[cuda13] to match" in text


def test_native_steady_is_off_unless_asked_for_and_its_libraries_are_reported():
    """Opt-in (UMRT_NATIVE=1) until a GPU run has checked it: off, doctor says so and builds
    nothing; on, it reports the two libraries."""
    rc, text = doctor(FakeMachine(cuda13(), nvml=fake_nvml(), native=ShimBuild(None, error="never built")))
    assert rc == 0 and status_of(text, "native steady") == "ok" and "off: every allocation goes through Python" in text
    assert "UMRT_NATIVE=1" in text and "never built" not in text
    on = {"UMRT_NATIVE": "1"}
    rc, text = doctor(FakeMachine(cuda13(), nvml=fake_nvml()), on)
    assert rc == 0 and status_of(text, "native steady") == "ok" and "served without Python" in text
    rc, text = doctor(FakeMachine(cuda13(), nvml=fake_nvml(), native=ShimBuild(None, error="no c++")), on)
    assert rc == 0 and status_of(text, "native steady") == "note"
    assert "could not be built (no c++); the steady state is served from Python" in text


def test_settings_say_what_the_gpu_memory_is_of_and_every_check_agrees():
    """One line per finding, consistent (issue 22): the GPU memory as the run reads it, with its default
    and its base; a bad UMRT_PROFILE is one missing setting, not an ok setting and a missing profile."""
    from umrt.config import LIVE_DEFAULT, SIMULATED_DEFAULT

    machine = FakeMachine(cuda13(), nvml=fake_nvml())
    _, text = doctor(machine)
    assert (f"UMRT_* valid: GPU memory unset: a fair share of the GPU ({LIVE_DEFAULT} when alone, at least "
            "10%device), policy umrt") in text
    _, text = doctor(machine, {"UMRT_SHARE_DIR": "off"})
    assert f"UMRT_* valid: GPU memory {LIVE_DEFAULT} (the default, 90% of the GPU's memory), policy umrt" in text
    _, text = doctor(machine, {"UMRT_SIMULATE": "h100-pcie5-80g"})
    assert (f"GPU memory {SIMULATED_DEFAULT} (the default, 50% of the footprint the run needs; shadow mode on "
            "h100-pcie5-80g)") in text
    _, text = doctor(machine, {"UMRT_GPU_MEMORY": "50%"})
    assert "GPU memory 50%device (50% of the GPU's memory)" in text
    assert status_of(text, "settings") == "ok" and "note     settings           UMRT_GPU_MEMORY='50%' in a live " \
        "run is 50% of the GPU's memory: write 50%device" in text
    rc, text = doctor(machine, {"UMRT_PROFILE": "nope"})
    assert rc == 2 and status_of(text, "settings") == "missing" and status_of(text, "profile") == "note"
    assert "nope" not in next(line for line in text.splitlines() if line[9:].startswith("profile "))
    assert "ok       settings" not in text


class _Unbuildable:
    def build(self):
        from umrt.errors import CudaError

        raise CudaError("umrt_sm_copy failed: CompileException: nvrtc64 not found")

    def __call__(self, dst, src, nbytes, stream):
        raise AssertionError("never launched")


@pytest.mark.parametrize(("launcher", "environ", "status", "says"), [
    ("fake", {}, "ok", "by umrt's SM copy kernel"),
    (None, {}, "note", "by the copy engines (CuPy, which builds umrt's SM copy kernel, does not import)"),
    ("fake", {"UMRT_SWAP_COPY": "engines"}, "ok", "by the copy engines (UMRT_SWAP_COPY=engines)"),
    ("unbuildable", {}, "note", "by the copy engines (umrt's SM copy kernel does not build: umrt_sm_copy failed: "
                                "CompileException: nvrtc64 not found)"),
])
def test_the_swap_path_line_says_what_copies_live_data(launcher, environ, status, says):
    rt = BindingsRuntime(FakeGpu(total=80 * 2**30))
    api = BindingsApi(rt, sm_copy={"fake": rt.sm_copy_kernel, "unbuildable": _Unbuildable(), None: None}[launcher])
    rc, text = doctor(FakeMachine(api, nvml=fake_nvml()), environ)
    assert rc == 0, text
    assert status_of(text, "swap path") == status and says in text, text
    if launcher == "fake":  # built now, as umrt builds it before its first swap, where it copies with it
        assert rt.sm_copy_kernel.builds == (0 if environ else 1)
    if status == "note":
        assert "UMRT_SWAP_COPY=engines to choose the copy engines" in text
