"""When umrt stops acting: one warning, ``umrt.memory_stats()`` shows it, and
``UMRT_STRICT`` raises it in the training thread at a safe point (never from
inside the allocator). Over the fake CUDA runtime, CPU tensors."""
from __future__ import annotations

import logging

import pytest
import torch
from fake_cuda import FakeCupyRuntime

import umrt.api as api
from umrt import stats
from umrt.allocators.managed import ManagedPool
from umrt.backends.cuda import CudaBackend, CupyApi
from umrt.config import Config
from umrt.drive.live import LiveBridge
from umrt.errors import CudaError, StoppedActing
from umrt.trace.events import Alloc

REASON = "CudaError: cudaMemDiscardBatchAsync failed: cudaErrorInvalidValue (1)"


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.setattr(api, "_current", None)
    stats.attach()
    yield
    stats.attach()


class FailOnAlloc:
    """A policy that raises a CUDA error at every allocation once ``armed`` (and reports nothing)."""

    wants_launches = True

    def __init__(self):
        self.armed, self.calls = False, 0

    def attach(self, ctx):
        pass

    def report(self):
        return {}

    def on_event(self, ev):
        if self.armed and isinstance(ev, Alloc):
            self.calls += 1
            raise CudaError("cudaMemDiscardBatchAsync failed: cudaErrorInvalidValue (1)")


def _bridge(fake_gpu, *, strict=False):
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    session = api.Session(Config(enabled=True, strict=strict), active=True, backend=backend,
                          pool=ManagedPool(backend), budget_bytes=1 << 30)
    policy = FailOnAlloc()
    bridge = LiveBridge(session, device="cpu", policy=policy, from_allocator=True)
    session.runtime = bridge
    return session, bridge, policy


def test_a_failure_is_said_once_and_shown_by_memory_stats(fake_gpu, caplog):
    session, bridge, policy = _bridge(fake_gpu)
    assert stats.memory_stats()["acting"] is False  # nothing started yet
    live = stats.memory_stats()["allocated_bytes"]  # other tests' blocks may still be live
    bridge.start()
    try:
        assert stats.memory_stats()["acting"] is True and stats.memory_stats()["stopped_reason"] is None
        policy.armed = True
        with caplog.at_level(logging.WARNING, logger="umrt"):
            ptrs = [session.pool.malloc(1 << 20) for _ in range(3)]  # fails inside the allocator
            bridge._fail(RuntimeError("a second failure"))  # e.g. another thread's: dropped
            bridge._recorder_failed(RuntimeError("a third"))
    finally:
        bridge.close()
    assert policy.calls == 1  # nothing reaches the policy after the failure
    assert all(ptrs) and stats.memory_stats()["allocated_bytes"] == live + (3 << 20)  # the allocator went on
    assert caplog.text.count("runtime stopped acting") == 1 and REASON in caplog.text
    got = stats.memory_stats()
    assert got["acting"] is False and got["stopped_reason"] == REASON  # still readable after close
    assert isinstance(bridge.failed, CudaError)
    for ptr in ptrs:
        session.pool.free(ptr)


def test_a_closed_runtime_that_never_failed_is_not_acting_and_has_no_reason(fake_gpu):
    _, bridge, _ = _bridge(fake_gpu)
    bridge.start()
    bridge.close()
    assert (stats.memory_stats()["acting"], stats.memory_stats()["stopped_reason"]) == (False, None)


def _train(session, bridge, policy, steps=3, fail_in=1):
    """A CPU training loop; in step ``fail_in`` an allocation through umrt's pool
    fails inside the allocator callback. Returns (step, exception) for each step
    whose ``opt.step()`` raised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raised, ptrs = [], []
    for step in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        if step == fail_in:
            policy.armed = True
            ptrs.append(session.pool.malloc(1 << 20))  # the failure: no exception here
        try:
            opt.step()
        except StoppedActing as exc:
            raised.append((step, exc))
        opt.zero_grad(set_to_none=True)
    for ptr in ptrs:
        session.pool.free(ptr)
    return raised


def test_strict_raises_at_the_next_optimizer_step_once(fake_gpu, caplog):
    session, bridge, policy = _bridge(fake_gpu, strict=True)
    live = stats.memory_stats()["allocated_bytes"]
    bridge.start()
    try:
        with caplog.at_level(logging.WARNING, logger="umrt"):
            raised = _train(session, bridge, policy, steps=4, fail_in=1)
        assert bridge.recorder._phases.in_step == 0  # the recorder's own step hook ran before the raise
    finally:
        bridge.close()
    assert [step for step, _ in raised] == [1]  # at the end of the failing step, and only once
    exc = raised[0][1]
    assert isinstance(exc.__cause__, CudaError) and REASON in str(exc) and "UMRT_STRICT" in str(exc)
    assert caplog.text.count("runtime stopped acting") == 1 and "raising it" in caplog.text
    assert stats.memory_stats()["allocated_bytes"] == live  # the pool's books balance


def test_without_strict_the_training_never_sees_the_failure(fake_gpu):
    session, bridge, policy = _bridge(fake_gpu)
    bridge.start()
    try:
        assert _train(session, bridge, policy) == []
    finally:
        bridge.close()
    assert isinstance(bridge.failed, CudaError)
    bridge.raise_if_failed()  # not strict: a no-op


def test_strict_raises_from_disable_when_no_step_came(fake_gpu, monkeypatch):
    session, bridge, policy = _bridge(fake_gpu, strict=True)
    bridge.start()
    policy.armed = True
    session.pool.free(session.pool.malloc(1 << 20))
    monkeypatch.setattr(api, "_current", session)
    with pytest.raises(StoppedActing, match="cudaErrorInvalidValue") as info:
        api.disable()
    assert isinstance(info.value.__cause__, CudaError)
    assert api.current() is None and bridge._strict_hook is None  # closed before raising
    bridge.raise_if_failed()  # raised once already


def test_strict_does_not_replace_an_error_leaving_a_with_block(fake_gpu, monkeypatch):
    session, bridge, policy = _bridge(fake_gpu, strict=True)
    bridge.start()
    policy.armed = True
    session.pool.free(session.pool.malloc(1 << 20))
    monkeypatch.setattr(api, "_current", session)
    with pytest.raises(KeyError, match="the program's own"), session:
        raise KeyError("the program's own")
    assert api.current() is None
