"""umrt.enable / session / disable, and the live bridge, over the fake runtime."""
from __future__ import annotations

import logging
import weakref

import pytest
import torch
from fake_cuda import FakeCupyRuntime
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

import umrt.api as api
from umrt import stats
from umrt.allocators.managed import ManagedPool
from umrt.backends.cuda import CudaBackend, CupyApi
from umrt.config import Config
from umrt.drive.live import LiveBridge, ManagedOnly, profile_for
from umrt.errors import ConfigError
from umrt.policy.base import Policy
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit


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
    bridge = LiveBridge(session, device="cpu")  # CPU tensors: not managed, so every range is dropped
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
    view = ManagedOnly(backend)
    view.prefetch([(ptr, 4096), (0xDEAD0000, 4096), (ptr + (1 << 20) - 16, 64)], 0)
    calls = [c for c in fake_gpu.calls if c[0] == "memPrefetchAsync"]
    assert [(c[1], c[2]) for c in calls] == [(ptr, 4096)]


def test_managed_only_passes_on_every_call_of_the_backend_interface(fake_gpu):
    """The live runtime calls its backend through ManagedOnly: a call the interface has and
    the view does not pass on falls to the interface's default, or, where there is none,
    fails live (a GPU run stopped acting on ``discard_and_prefetch`` this way)."""
    from umrt.backends.base import Backend

    calls = {name for name, f in vars(Backend).items()
             if (callable(f) or isinstance(f, property)) and not name.startswith("_")}
    assert {"discard_and_prefetch", "swap"} <= calls
    assert calls <= set(vars(ManagedOnly)), sorted(calls - set(vars(ManagedOnly)))
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    ptr = backend.malloc(4 << 20)
    before = len(fake_gpu.calls)
    ManagedOnly(backend).discard_and_prefetch([(ptr, 2 << 20), (0xDEAD0000, 4096)], 0)
    moves = [c for c in fake_gpu.calls[before:] if c[0].startswith("mem")]  # (a prefetch on CUDA 12's cupy)
    assert moves and all(ptr <= c[1] < ptr + (4 << 20) for c in moves), moves  # the unmanaged range dropped


def _swapping_backend():
    """A CudaBackend with the copy-engine swap path (CUDA 13 over the fake runtime) and a
    managed range a kernel wrote."""
    from fake_cuda import FakeBindingsRuntime, FakeGpu

    from umrt.backends.cuda import BindingsApi

    gpu = FakeGpu()
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(gpu)))
    size = 1 << 20
    ptr = backend.malloc(size)
    gpu.kernel(backend.compute_stream, reads=(), writes=((ptr, size),), name="writer")
    return gpu, backend, ptr, size


def test_managed_only_swaps_through_the_copy_engines_of_its_backend(fake_gpu):
    """The live runtime plans copies through the copy engines where the backend has them: the
    view's swap path is the backend's, ranges outside managed allocations skipped."""
    gpu, backend, ptr, size = _swapping_backend()
    view = ManagedOnly(backend)
    assert backend.swap.pinned_copies and view.swap.pinned_copies
    assert view.swap is view.swap
    assert not ManagedOnly(CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))).swap.pinned_copies  # CUDA 12
    unmanaged = (0xDEAD0000, 1 << 20)
    view.swap.reserve(size)
    view.swap.out([(ptr, size), unmanaged])
    assert backend.swap.away and gpu.names().count("cudaMemcpyAsync") == 1
    view.swap.back([(ptr, size), unmanaged])
    view.swap.wait([(ptr, size), unmanaged])
    view.swap.release([unmanaged])
    gpu.kernel(backend.compute_stream, reads=((ptr, size),), writes=(), name="reader")
    assert not backend.swap.away and gpu.names().count("cudaMemcpyAsync") == 2
    assert backend.counters()["swapped_out_bytes"] == backend.counters()["swapped_in_bytes"] == size
    assert not gpu.violations


def test_a_muted_view_sends_nothing_out_but_brings_back_what_it_sent_out():
    """A muted replay of a native window: an ``out`` is dropped (nothing was copied out natively),
    but a range the view really swapped out before it was muted is still brought back (a kernel
    then reads it: with the copy back dropped, the fake GPU would see discarded data read)."""
    gpu, backend, ptr, size = _swapping_backend()
    other = backend.malloc(size)
    gpu.kernel(backend.compute_stream, reads=(), writes=((other, size),), name="writer")
    view = ManagedOnly(backend)
    view.swap.reserve(2 * size)
    view.swap.out([(ptr, size)])
    view.muted = True
    before = len(gpu.calls)
    view.swap.out([(other, size)])  # dropped
    view.swap.back([(other, size)])  # never sent out: dropped, no prefetch either
    view.swap.wait([(other, size)])
    assert gpu.calls[before:] == [] and backend.swap.streams.away.keys() == {ptr}
    view.swap.back([(ptr, size)])  # sent out for real: brought back
    view.swap.wait([(ptr, size)])
    view.muted = False
    gpu.kernel(backend.compute_stream, reads=((ptr, size), (other, size)), writes=(), name="reader")
    assert not backend.swap.away and backend.counters()["swapped_in_bytes"] == size
    assert not gpu.violations


def test_a_muted_view_releases_what_it_sent_out_when_it_dies():
    """A range swapped out for real that dies in a muted replay: its slot goes back."""
    _, backend, ptr, size = _swapping_backend()
    view = ManagedOnly(backend)
    view.swap.reserve(size)
    view.swap.out([(ptr, size)])
    view.muted = True
    view.swap.release([(ptr, size)])
    assert not backend.swap.away and not backend.swap.pool.in_use


def test_the_live_runtime_plans_with_the_profile_of_its_gpu(monkeypatch, fake_gpu, caplog):
    """UMRT_PROFILE unset (auto): the shipped profile closest to the GPU; a GPU
    umrt has no profile for says so; UMRT_PROFILE wins; no GPU: no profile."""
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert profile_for(Config(enabled=True), backend).name == "h100-pcie5-80g"
    assert profile_for(Config(enabled=True, profile="v100-pcie3-16g"), backend).name == "v100-pcie3-16g"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    with caplog.at_level("WARNING"):
        assert profile_for(Config(enabled=True), backend) is not None
    assert "no shipped hardware profile for NVIDIA L4" in caplog.text

    def no_gpu(device=None):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(torch.cuda, "get_device_name", no_gpu)
    assert profile_for(Config(enabled=True), backend) is None


# -- the live bridge with objects from the allocator ------------------------------------


class StubPolicy(Policy):
    """Records what it is given; ``wants`` maps an iteration to the ``wants_launches``
    it sets at that iteration's boundary; raises at its ``fail_at``-th event."""

    def __init__(self, wants=None, fail_at=None):
        self.got, self.wants_launches = [], True
        self.wants, self.fail_at, self.n = dict(wants or {}), fail_at, 0

    def attach(self, ctx):
        self.ctx = ctx

    def on_event(self, ev):
        self.got.append(ev)
        self.n += 1
        if self.n == self.fail_at:
            raise RuntimeError("stub policy broke")
        if isinstance(ev, IterationBoundary):
            self.wants_launches = self.wants.get(ev.index, self.wants_launches)


class FakeAllocator(TorchDispatchMode):
    """Plays umrt's pool for CPU tensors: tells the pool's listeners about each
    new storage from inside the op that made it (before the recorder's Launch,
    as ManagedPool.malloc runs inside the op) and about its end."""

    def __init__(self, pool):
        super().__init__()
        self.pool, self.live = pool, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
                if ptr and n and ptr not in self.live:
                    self.live[ptr] = weakref.finalize(st, self._tell, "free", ptr, n)
                    self._tell("alloc", ptr, n)
        return out

    def _tell(self, what, ptr, n):
        if what == "free":
            self.live.pop(ptr, None)
        for listener in list(self.pool.listeners):
            listener(what, ptr, n)


def _session(fake_gpu):
    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    return api.Session(Config(enabled=True), active=True, backend=backend,
                       pool=ManagedPool(backend), budget_bytes=1 << 30)


def _train(bridge, steps, before=None, width=16, layers=1):
    """Train an MLP under the bridge, every storage made through FakeAllocator;
    a "STEP" marker goes into a stub policy's events after each optimizer step."""
    got = getattr(bridge.policy, "got", [])
    with FakeAllocator(bridge.pool):
        bridge.start()
        hook = register_optimizer_step_post_hook(lambda *a: got.append("STEP"))
        try:
            torch.manual_seed(0)
            hidden = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
            model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), *hidden, torch.nn.Linear(width, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for _ in range(steps):
                x = torch.randn(4, 8)
                y = model(x) if before is None else model(x) * before
                y.sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del x, y
        finally:
            hook.remove()
            bridge.close()


def test_allocator_objects_reach_the_policy_before_the_launches_that_use_them(fake_gpu):
    policy = StubPolicy()
    session = _session(fake_gpu)
    bridge = LiveBridge(session, device="cpu", policy=policy, from_allocator=True)
    outside = torch.ones(1)  # made before umrt: not the allocator's
    seen = []  # what the recorder emitted (the bridge's keeps no events)
    bridge.recorder.listeners.append(seen.append)
    _train(bridge, 3, before=outside)
    assert bridge.failed is None and session.pool.listeners == []
    got = [e for e in policy.got if e != "STEP"]
    alive, launches = set(), 0
    for e in got:
        if isinstance(e, Alloc):
            assert e.kind == Kind.OTHER and e.launch == 0 and e.obj not in alive
            alive.add(e.obj)
        elif isinstance(e, Free):
            alive.remove(e.obj)
        elif isinstance(e, Launch):
            launches += 1
            assert {a.obj for a in e.accesses} <= alive, e.op  # allocator ids, born before
    assert launches > 30
    recorded = [e for e in seen if isinstance(e, Launch)]
    fed = [e for e in got if isinstance(e, Launch)]
    assert [e.seq for e in fed] == [e.seq for e in recorded]
    # the multiply by `outside` (forward and backward, 3 steps) lost the access to it, and only that one
    lost = [(r, len(r.accesses) - len(f.accesses)) for r, f in zip(recorded, fed, strict=True)
            if len(r.accesses) != len(f.accesses)]
    assert len(lost) == 6 and all(n == 1 and r.op == "aten::mul.Tensor" for r, n in lost)
    outside_obj = {r.accesses[1].obj for r, _ in lost}  # mul(y, outside), mul(grad, outside)
    (alloc,) = [e for e in seen if isinstance(e, Alloc) and e.obj in outside_obj]
    assert alloc.nbytes == 4 and alloc.launch == -1  # first seen as an input: made before umrt


def test_bridge_boundaries_fall_before_the_first_alloc_layer_or_launch_after_a_step(fake_gpu):
    policy = StubPolicy()
    bridge = LiveBridge(_session(fake_gpu), device="cpu", policy=policy, from_allocator=True)
    _train(bridge, 3)
    got = policy.got
    boundaries = [e.index for e in got if isinstance(e, IterationBoundary)]
    assert boundaries == [0, 1, 2, 3]  # the last one at close
    assert isinstance(got[0], IterationBoundary)
    steps = [i for i, e in enumerate(got) if e == "STEP"]
    assert len(steps) == 3
    for i in steps:
        j = next(k for k in range(i + 1, len(got)) if isinstance(got[k], IterationBoundary))
        assert all(isinstance(e, Free) for e in got[i + 1:j])  # zero_grad's frees close the old one
        assert any(isinstance(e, Free) for e in got[i + 1:j])
        assert j == len(got) - 1 or isinstance(got[j + 1], (Alloc, LayerEnter, Launch))


class _Event:
    """A CUDA event as torch's: recorded on a fake clock that advances a millisecond
    per event; ``query()`` True once ``done`` says the GPU has passed it."""

    clock = 0.0
    done = True

    def record(self):
        _Event.clock += 1.0
        self.at = _Event.clock

    def query(self):
        return _Event.done

    def elapsed_time(self, end):
        return end.at - self.at


class _TimedStub(StubPolicy):
    def __init__(self):
        super().__init__()
        self.times = []

    def iteration_time(self, index, seconds):
        self.times.append((index, seconds))


def test_bridge_boundaries_carry_the_loop_phase_and_the_gpu_clock_times_them(fake_gpu):
    """Two steps, an evaluation of three batches (model.eval(), no_grad), two steps: the
    bridge opens an eval iteration per batch and a training one after it, before the
    first allocation of each; the iteration clock's times reach the policy, and
    memory_stats() shows what the policy says of each phase."""
    from umrt.drive.live import IterationClock

    policy = _TimedStub()
    bridge = LiveBridge(_session(fake_gpu), device="cpu", policy=policy, from_allocator=True)
    bridge.clock = IterationClock(_Event)
    policy.report = lambda: {"phases": {"eval": {"acting": False, "stopped_because": "slower"}}}
    with FakeAllocator(bridge.pool):
        bridge.start()
        try:
            assert stats.memory_stats()["phases"] == {"eval": {"acting": False, "stopped_because": "slower"}}
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def step():
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()
            step()
            model.eval()
            with torch.no_grad():
                for _ in range(3):
                    model(torch.randn(4, 8)).sum().item()
            model.train()
            step()
            step()
        finally:
            bridge.close()
    stats.attach()
    bounds = [e for e in policy.got if isinstance(e, IterationBoundary)]
    assert [b.index for b in bounds] == list(range(8))
    assert [b.phase for b in bounds[:-1]] == ["train", "train", "eval", "eval", "eval", "train", "train"]
    for i, e in enumerate(policy.got):  # each opens before anything of its iteration
        if isinstance(e, IterationBoundary) and e.phase == "eval":
            assert isinstance(policy.got[i + 1], (LayerEnter, Alloc)), policy.got[i + 1]
    # training resumes at the next batch's allocation (its randn), before the model's forward
    resumed = policy.got.index(bounds[5])
    assert isinstance(policy.got[resumed + 1], Alloc) and isinstance(policy.got[resumed + 2], Launch)
    assert policy.got[resumed + 2].op == "aten::randn.default"
    assert [i for i, _ in policy.times] == list(range(7))  # each iteration timed, in order
    assert all(t == pytest.approx(1e-3) for _, t in policy.times)


def test_the_iteration_clock_never_waits_for_the_gpu():
    from umrt.drive.live import IterationClock

    _Event.done = False
    try:
        clock = IterationClock(_Event)
        got = []
        clock.boundary(0, lambda i, t: got.append(i))
        clock.boundary(1, lambda i, t: got.append(i))
        assert got == []  # the GPU has not passed them yet
        _Event.done = True
        clock.boundary(2, lambda i, t: got.append(i))
        assert got == [0, 1]  # late, but every one
    finally:
        _Event.done = True


def test_ops_are_suspended_while_the_policy_wants_no_launches(fake_gpu):
    """The stub stops wanting launches at iteration 1's boundary and wants them
    again at 2's; a probe that always wants them shows what the run looks like."""

    def run(wants=None):
        policy = StubPolicy(wants)
        bridge = LiveBridge(_session(fake_gpu), device="cpu", policy=policy, from_allocator=True)
        _train(bridge, 3)
        got = [e for e in policy.got if e != "STEP"]
        at = [got.index(IterationBoundary(i)) for i in range(4)]
        return bridge, [got[at[i]:at[i + 1]] for i in range(3)]

    def of(span, *types):
        return [e for e in span if isinstance(e, types)]

    _, probe = run()
    bridge, spans = run({1: False, 2: True})
    assert len(of(probe[1], Launch)) > 10 and of(spans[1], Launch) == []
    # launches again from the first layer on (the op whose allocation opened
    # iteration 2 was running when the bridge resumed), as if never suspended
    assert isinstance(spans[2][1], Alloc) and of(probe[2], Launch)[0].op == "aten::randn.default"

    def ops(span):
        return [(e.op, e.module, e.accesses) for e in of(span, Launch)]

    assert ops(spans[2]) == ops(probe[2])[1:]
    assert of(spans[1], LayerEnter, LayerExit) == of(probe[1], LayerEnter, LayerExit)
    assert len(of(spans[1], Alloc)) == len(of(probe[1], Alloc)) > 0  # the allocator keeps announcing
    assert not bridge.recorder.ops_suspended


def test_a_failing_policy_stops_the_bridge_with_one_warning(fake_gpu, caplog):
    policy = StubPolicy(fail_at=40)
    bridge = LiveBridge(_session(fake_gpu), device="cpu", policy=policy, from_allocator=True)
    seen = []
    bridge.recorder.listeners.append(seen.append)
    with caplog.at_level(logging.WARNING, logger="umrt"):
        _train(bridge, 3)  # the training runs to its end
    assert isinstance(bridge.failed, RuntimeError)
    assert len([e for e in policy.got if e != "STEP"]) == 40
    # the recorder's ops were suspended at the failure: no launch recorded after it
    assert sum(isinstance(e, Launch) for e in seen) == sum(isinstance(e, Launch) for e in policy.got) > 0
    assert sum(isinstance(e, LayerEnter) for e in seen) > sum(isinstance(e, LayerEnter) for e in policy.got)
    assert caplog.text.count("runtime stopped acting") == 1


def test_the_pool_listener_never_raises_into_the_allocator(fake_gpu, caplog):
    session = _session(fake_gpu)
    policy = StubPolicy(fail_at=3)
    bridge = LiveBridge(session, device="cpu", policy=policy, from_allocator=True)
    bridge.start()
    try:
        ptr = session.pool.malloc(1 << 20)
        assert bridge.layout.address(policy.got[-1].obj) == ptr  # the layout answers from the allocator
        with caplog.at_level(logging.WARNING, logger="umrt"):
            session.pool.free(ptr)  # the policy raises here
            session.pool.free(session.pool.malloc(4096))
    finally:
        bridge.close()
    assert [type(e) for e in policy.got] == [IterationBoundary, Alloc, Free]
    assert isinstance(bridge.failed, RuntimeError) and caplog.text.count("runtime stopped acting") == 1


def test_a_policy_that_wants_no_launches_from_the_start_has_none_recorded(fake_gpu):
    """The recorder emits its first boundary before it records (suspend_ops is
    refused there): the bridge asks again once it records."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    policy = StubPolicy()
    policy.wants_launches = False
    bridge = LiveBridge(_session(fake_gpu), device="cpu", policy=policy, from_allocator=True)
    _train(bridge, 2)
    assert bridge.failed is None and isinstance(policy.got[0], IterationBoundary)
    assert not any(isinstance(e, Launch) for e in policy.got)
    assert any(isinstance(e, LayerEnter) for e in policy.got) and any(isinstance(e, Alloc) for e in policy.got)
    assert _get_current_dispatch_mode_stack() == []


def test_plain_um_and_the_baselines_never_have_ops_recorded(fake_gpu):
    """``um`` acts on nothing: the bridge must not pay for (nor perturb the program
    with) the dispatch-mode capture. It used to default wants_launches to True."""
    from umrt.policy import make_policy

    for name in ("um", "um-advise", "ideal"):
        policy = make_policy(name)
        seen = []
        on_event = policy.on_event
        policy.on_event = lambda ev, f=on_event, seen=seen: (seen.append(ev), f(ev))
        bridge = LiveBridge(_session(fake_gpu), device="cpu", policy=policy, from_allocator=True)
        _train(bridge, 2)
        assert bridge.failed is None
        assert any(isinstance(e, Alloc) for e in seen) and not any(isinstance(e, Launch) for e in seen), name


def test_a_resume_from_the_allocator_waits_for_the_recorders_next_hook(fake_gpu):
    """A pool event comes from inside the op that asked for memory: a policy that
    wants launches again there has the recorder's mode re-entered at its next
    hook, not pushed in the middle of that op."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    class WantsAfterAnAlloc(StubPolicy):
        def on_event(self, ev):
            super().on_event(ev)
            if isinstance(ev, Alloc):
                self.wants_launches = True

    policy = WantsAfterAnAlloc()
    policy.wants_launches = False
    session = _session(fake_gpu)
    bridge = LiveBridge(session, device="cpu", policy=policy, from_allocator=True)
    bridge.start()
    try:
        assert bridge.recorder.ops_suspended and _get_current_dispatch_mode_stack() == []
        ptr = session.pool.malloc(4096)  # as torch's allocator calls it, from inside an op
        assert not bridge.recorder.ops_suspended and _get_current_dispatch_mode_stack() == []
        torch.nn.Linear(4, 4)(torch.ones(2, 4))  # its module hook re-enters the mode
        assert len(_get_current_dispatch_mode_stack()) == 1
        assert any(isinstance(e, Launch) for e in policy.got)
        session.pool.free(ptr)
    finally:
        bridge.close()
    assert bridge.failed is None and _get_current_dispatch_mode_stack() == []


def test_the_source_of_objects(fake_gpu):
    session = _session(fake_gpu)
    assert LiveBridge(session, device="cuda", policy=StubPolicy()).from_allocator
    assert not LiveBridge(session, device="cpu", policy=StubPolicy()).from_allocator
    session.pool = object()
    assert not LiveBridge(session, device="cuda", policy=StubPolicy()).from_allocator
    with pytest.raises(ConfigError, match="pool with listeners"):
        LiveBridge(session, device="cuda", policy=StubPolicy(), from_allocator=True)


def test_the_runtime_over_the_bridge_acts_without_launches(fake_gpu):
    """umrt's runtime, live: it learns, then follows its trusted plan from
    allocations, frees and layers; while it wants no launches the recorder's
    ops are suspended, so it is given fewer than the program runs."""
    session = _session(fake_gpu)
    session.config = Config(enabled=True, policy="umrt", learn_iterations=2)
    session.budget_bytes = 1 << 20  # a quarter of the MLP's 3.8 MiB of parameters, gradients and momentum
    bridge = LiveBridge(session, device="cpu", from_allocator=True)
    per_iteration = []
    deliver = bridge.policy.on_event

    def count(ev):
        if isinstance(ev, IterationBoundary):
            per_iteration.append(0)
        elif isinstance(ev, Launch):
            per_iteration[-1] += 1
        deliver(ev)

    bridge.policy.on_event = count
    _train(bridge, 10, width=256, layers=5)
    rep = bridge.policy.report()
    assert bridge.failed is None and rep["learned"] == 2 and rep["acted"] == 8
    assert rep["light_iterations"] >= 3
    full = per_iteration[1]  # a learned iteration: every launch
    assert full > 0 and sum(n < full for n in per_iteration[2:-1]) >= 3


class SpyPool(ManagedPool):
    """umrt's pool, noting what the bridge feeds it."""

    def __init__(self, backend, layout_factory=None):
        super().__init__(backend, layout_factory)
        self.fed = []

    def observe(self, event):
        self.fed.append(event)
        super().observe(event)

    def hint_kind(self, ptr, kind):
        self.fed.append(("hint", ptr, Kind(kind)))
        return super().hint_kind(ptr, kind)


def test_the_bridge_feeds_the_pool_boundaries_layers_and_kind_hints(fake_gpu):
    session = _session(fake_gpu)
    session.pool = pool = SpyPool(session.backend)
    policy = StubPolicy()
    bridge = LiveBridge(session, device="cpu", policy=policy, from_allocator=True)
    facts = []  # per step: (parameter blocks, optimizer state blocks)

    def read(opt, args, kwargs):
        params = {p.untyped_storage().data_ptr() for g in opt.param_groups for p in g["params"]}
        state = {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)}
        facts.append((params, state))

    hook = register_optimizer_step_post_hook(read)
    try:
        _train(bridge, 3)
    finally:
        hook.remove()
    assert bridge.failed is None and pool.before_malloc == []
    events = [e for e in pool.fed if not isinstance(e, tuple)]
    assert events == [e for e in policy.got if isinstance(e, (IterationBoundary, LayerEnter, LayerExit))]
    assert any(isinstance(e, LayerEnter) for e in events)
    hints = [e for e in pool.fed if isinstance(e, tuple)]
    assert {k for _, _, k in hints} >= {Kind.ACTIVATION, Kind.PARAMETER, Kind.OPTIMIZER_STATE}  # recorder's, facts
    # The first two steps' facts (momentum buffers are made in the first), each before the
    # boundary that ends the step's iteration (the pool plans there); none from the third.
    assert len(facts) == 3
    ends = [pool.fed.index(IterationBoundary(i)) for i in range(4)]
    for step, (params, state) in enumerate(facts[:2]):
        told = {(e[1], e[2]) for e in pool.fed[ends[step]:ends[step + 1]] if isinstance(e, tuple)}
        assert state and params
        assert {(p, Kind.PARAMETER) for p in params} | {(p, Kind.OPTIMIZER_STATE) for p in state} <= told
    third = pool.fed[ends[2]:]
    assert not any(isinstance(e, tuple) and e[2] == Kind.PARAMETER for e in third)


def test_an_allocation_after_a_step_opens_the_pools_iteration_before_it_is_placed(fake_gpu):
    from umrt.memory.pool import LifetimePool

    log = []

    class Logged(LifetimePool):
        def alloc(self, obj, nbytes, kind):
            log.append(("alloc", nbytes))
            return super().alloc(obj, nbytes, kind)

        def observe(self, event):
            log.append(event)
            super().observe(event)

    session = _session(fake_gpu)
    session.pool = ManagedPool(session.backend, lambda b: Logged(b, live_feed=True))
    policy = StubPolicy()
    bridge = LiveBridge(session, device="cpu", policy=policy, from_allocator=True)
    bridge.start()
    try:
        session.pool.free(session.pool.malloc(4096))
        w = torch.nn.Parameter(torch.ones(2))
        w.grad = torch.ones(2)
        torch.optim.SGD([w], lr=0.1).step()
        session.pool.malloc(1 << 20)
    finally:
        bridge.close()
    assert log == [IterationBoundary(0), ("alloc", 4096), IterationBoundary(1), ("alloc", 1 << 20)]
    got = [e for e in policy.got if e != "STEP"]
    assert got[-2] == IterationBoundary(1) and isinstance(got[-1], Alloc)  # the policy's order as before


class MirrorPool:
    """umrt's pool over CPU storages: what torch allocates (as FakeAllocator sees it) is placed
    by a live-feed LifetimePool as ManagedPool does (hooks, then the layout, then listeners),
    and the bridge feeds it through the same calls."""

    def __init__(self, hints: bool = True) -> None:
        from umrt.memory.pool import LifetimePool

        class Bump:  # 2 MB-aligned segments, as cudaMallocManaged's
            next = 1 << 40

            def malloc(self, n):
                ptr, self.next = self.next, self.next + -(-n // (2 << 20)) * (2 << 20)
                return ptr

            def free(self, ptr):
                pass

        self.listeners, self.before_malloc = [], []
        self.layout = LifetimePool(Bump(), live_feed=True)
        self.hints = hints
        self._obj, self._ids = {}, iter(range(1, 1 << 62))
        self.iteration, self.addresses = -1, {}  # (iteration, ordinal) -> address
        self.live, self.peaks = 0, {}  # iteration -> (peak live bytes, peak footprint)

    def observe(self, event):
        self.layout.observe(event)
        if isinstance(event, IterationBoundary):
            self.iteration = event.index
            self.peaks[event.index] = (self.live, self.layout.footprint())

    def hint_kind(self, ptr, kind):
        obj = self._obj.get(ptr)
        if obj is not None and self.hints:
            self.layout.hint_kind(obj, kind)
        return obj is not None

    def reserved_bytes(self):
        return self.layout.footprint()

    def peak_reserved_bytes(self):
        return self.layout.peak_footprint

    def stop_planning(self, why, budget_bytes=None):
        self.layout.stop_planning(why, budget_bytes)

    def resume_planning(self):
        self.layout.resume_planning()

    def serve_unplanned(self, unplanned):
        self.layout.serve_unplanned(unplanned)

    def tell(self, what, ptr, n):
        if what == "alloc":
            for hook in self.before_malloc:
                hook(n)
            obj = self._obj[ptr] = next(self._ids)
            ordinal = sum(1 for k in self.addresses if k[0] == self.iteration)
            self.addresses[(self.iteration, ordinal)] = self.layout.alloc(obj, n, Kind.OTHER)
            self.live += n
            live, footprint = self.peaks.get(self.iteration, (0, 0))
            self.peaks[self.iteration] = (max(live, self.live), max(footprint, self.layout.footprint()))
        else:
            self.layout.free(self._obj.pop(ptr))
            self.live -= n


class MirrorAllocator(FakeAllocator):
    def _tell(self, what, ptr, n):
        self.pool.tell(what, ptr, n)
        super()._tell(what, ptr, n)


@pytest.mark.parametrize("hints", [True, False])
def test_the_pool_fed_by_the_bridge_plans_a_real_training_loop(fake_gpu, hints):
    """An Adam training loop (state made lazily in the first step) through the bridge: the
    pool plans once, when a step repeats the shape of the one before, and from then on gives
    every allocation the same address: from the third step with the bridge's kind hints (the
    state left out, the first two steps have one shape), from the fourth without them; in
    little more than live memory."""
    session = _session(fake_gpu)
    session.pool = pool = MirrorPool(hints)
    bridge = LiveBridge(session, device="cpu", policy=StubPolicy(), from_allocator=True)
    with MirrorAllocator(pool):
        bridge.start()
        try:
            torch.manual_seed(0)
            layers = [m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.GELU())]
            model = torch.nn.Sequential(torch.nn.Linear(64, 1024), *layers, torch.nn.Linear(1024, 1))
            opt = torch.optim.Adam(model.parameters())
            for _ in range(5):
                model(torch.randn(256, 64)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            bridge.close()
    assert bridge.failed is None
    addrs = pool.addresses
    steady = 2 if hints else 3  # unhinted, the first step's optimizer state makes it a shape of its own
    n = sum(1 for k in addrs if k[0] == steady)
    assert n > 20
    for it in range(steady, 5):
        assert [addrs.get((it, i)) for i in range(n + 1)] == [addrs[(steady, i)] for i in range(n)] + [None]
    assert [addrs.get((steady - 1, i)) for i in range(n)] != [addrs[(steady, i)] for i in range(n)]
    assert pool.layout.plans_made == 1
    assert pool.layout.report()["last_iteration"]["plan_misses"] == 0
    live, footprint = pool.peaks[4]  # the last step
    assert footprint <= 1.15 * live  # 2 MB rounding of a few arenas


def test_the_policy_is_told_what_allocator_objects_hold(fake_gpu):
    """The allocator announces every block as Kind.OTHER; the bridge passes the
    recorder's kinds and the optimizer's facts on to a policy that takes hints
    (umrt's runtime plans with them), by the policy's own object ids."""
    class Hinted(StubPolicy):
        def __init__(self):
            super().__init__()
            self.hints = []

        def hint_kind(self, obj, kind):
            self.hints.append((obj, Kind(kind)))

    session = _session(fake_gpu)
    policy = Hinted()
    bridge = LiveBridge(session, device="cpu", policy=policy, from_allocator=True)
    _train(bridge, 3)
    assert bridge.failed is None
    announced = {ev.obj for ev in policy.got if isinstance(ev, Alloc)}
    kinds = {k for _, k in policy.hints}
    assert policy.hints and {o for o, _ in policy.hints} <= announced
    assert {Kind.PARAMETER, Kind.OPTIMIZER_STATE} <= kinds


def test_the_runtime_plans_with_hinted_kinds():
    """Runtime.hint_kind: the kind an object was announced with is replaced, in
    what the runtime knows of it and in the iteration it is recording."""
    from umrt.policy.runtime import Runtime

    rt = Runtime()
    rt.record = rt._learner.new_record(rt._alloc_of)
    rt.on_event(Alloc(7, 1 << 20, Kind.OTHER, 0))
    rt.hint_kind(7, Kind.OPTIMIZER_STATE)
    rt.hint_kind(8, Kind.PARAMETER)  # never announced: ignored
    key = rt.keys.key_of[7]
    assert rt.record.kinds[key] == Kind.OPTIMIZER_STATE
    assert rt._learner.new_record(rt._alloc_of).kinds[key] == Kind.OPTIMIZER_STATE


def test_a_failure_of_the_recorder_itself_stops_umrt_not_the_training(fake_gpu, caplog, monkeypatch):
    """The recorder's own bookkeeping can fail on an op it cannot read: in a live
    run that stops umrt's actions with one warning, and the training goes on."""
    from umrt.capture.recorder import Recorder

    def broken(self, *args):
        raise RuntimeError("an op the recorder cannot read")

    monkeypatch.setattr(Recorder, "_record", broken)
    session = _session(fake_gpu)
    bridge = LiveBridge(session, device="cpu", policy=StubPolicy(), from_allocator=True)
    with caplog.at_level("WARNING", logger="umrt"):
        _train(bridge, 3)
    assert isinstance(bridge.failed, RuntimeError)
    assert caplog.text.count("runtime stopped acting") == 1
