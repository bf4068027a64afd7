"""umrt.enable / session / disable, and the live bridge, over the fake runtime."""
from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCupyRuntime

import umrt.api as api
from umrt import stats
from umrt.allocators.managed import ManagedPool
from umrt.backends.cuda import CudaBackend, CupyApi
from umrt.config import Config
from umrt.errors import ConfigError


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("UMRT")]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(api, "_current", None)
    monkeypatch.setattr(api, "_said_no_gpu", False)
    yield
    stats.attach()


def test_enable_without_gpu_is_inactive_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(api, "gpu_count", lambda: 0)
    s = api.enable(gpu_memory="20%")
    assert not s.active and s.config.enabled and s.config.gpu_memory.fraction == 0.2
    assert api.enable() is s
    api.disable()
    with api.session() as s2:
        assert not s2.active
    assert capsys.readouterr().err.count("no CUDA GPU found") == 1
    assert api.current() is None


def test_enable_rejects_shadow_and_bad_options(monkeypatch):
    monkeypatch.setattr(api, "gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match="umrt run --simulate"):
        api.enable(simulate="a100-pcie4-40g")
    with pytest.raises(ConfigError, match="unknown umrt option"):
        api.enable(budget="1GiB")


def test_enable_inside_a_shadow_run_is_inert(monkeypatch):
    monkeypatch.setenv("UMRT_SIMULATE", "a100-pcie4-40g")
    monkeypatch.setattr(api, "gpu_count", lambda: 1 / 0)  # must not even look for a GPU
    s = api.enable()
    assert not s.active and "shadow" in s.notes[0]


def test_enable_on_a_fake_gpu_builds_backend_pool_and_budget(monkeypatch, fake_gpu):
    import umrt.backends.cuda as cuda_mod

    monkeypatch.setattr(api, "gpu_count", lambda: 1)
    monkeypatch.setattr(cuda_mod, "default_api", lambda: CupyApi(FakeCupyRuntime(fake_gpu)))
    monkeypatch.setattr(api, "_install_torch", lambda session: session.notes.append("torch skipped"))
    monkeypatch.setattr(api, "_attach_runtime", lambda session: None)
    with api.session(gpu_memory="25%") as s:
        assert s.active and s.budget_bytes == fake_gpu.total // 4
        ptr = s.pool.malloc(3 << 20)
        assert stats.memory_stats()["reserved_bytes"] >= 3 << 20
        s.pool.free(ptr)
    assert api.current() is None


def test_live_bridge_feeds_the_runtime(fake_gpu):
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    session = api.Session(Config(enabled=True), active=True, backend=backend,
                          pool=ManagedPool(backend), budget_bytes=1 << 30)
    bridge = api.LiveBridge(session, device="cpu")  # CPU tensors: not managed, so every range is dropped
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bridge.start()
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        bridge.close()
    assert bridge.failed is None and bridge.events > 20
    assert "memPrefetchAsync" not in fake_gpu.names()  # nothing unmanaged reached the driver


def test_managed_only_keeps_managed_ranges(fake_gpu):
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    ptr = backend.malloc(1 << 20)
    view = api.ManagedOnly(backend)
    view.prefetch([(ptr, 4096), (0xDEAD0000, 4096), (ptr + (1 << 20) - 16, 64)], 0)
    calls = [c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]
    assert [(c[1], c[2]) for c in calls] == [(ptr, 4096)]


def test_the_live_runtime_plans_with_the_profile_of_its_gpu(monkeypatch, fake_gpu, caplog):
    """UMRT_PROFILE unset (auto): the shipped profile closest to the GPU; a GPU
    umrt has no profile for says so; UMRT_PROFILE wins; no GPU: no profile."""
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert api._profile_for(Config(enabled=True), backend).name == "h100-pcie5-80g"
    assert api._profile_for(Config(enabled=True, profile="v100-pcie3-16g"), backend).name == "v100-pcie3-16g"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    with caplog.at_level("WARNING"):
        assert api._profile_for(Config(enabled=True), backend) is not None
    assert "no shipped hardware profile for NVIDIA L4" in caplog.text

    def no_gpu(device=None):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_gpu)
    assert api._profile_for(Config(enabled=True), backend) is None
