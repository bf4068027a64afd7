"""simulate(): the replay driver, budgets, steady state, and the must-show
behaviours of plain Unified Memory on synthetic traces."""
from __future__ import annotations

import pytest

from umrt.backends.base import Backend
from umrt.errors import ConfigError, DataIntegrityError, TraceFormatError
from umrt.memory.base import Layout
from umrt.policy.base import Policy
from umrt.sim.budget import needs
from umrt.sim.replay import parse_budget, simulate
from umrt.trace.events import (
    Access,
    Alloc,
    Free,
    IterationBoundary,
    Kind,
    Launch,
    LayerEnter,
    LayerExit,
    Trace,
    TraceHeader,
)

MB = 1 << 20
PROFILE = "v100-pcie3-16g"
LOSS = 64 << 10  # one 64 KB page: every size here is whole pages, so 100% of live bytes is 100% of pages


class BumpLayout(Layout):
    """Each object gets its own managed allocation: no sharing, no caching."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.ptrs: dict[int, tuple[int, int]] = {}

    def alloc(self, obj, nbytes, kind):
        self.ptrs[obj] = (self.backend.malloc(nbytes), nbytes)
        return self.ptrs[obj][0]

    def free(self, obj):
        self.backend.free(self.ptrs.pop(obj)[0])

    def address(self, obj):
        return self.ptrs[obj][0]

    def footprint(self):
        return sum(-(-n // (2 * MB)) * 2 * MB for _, n in self.ptrs.values())


class Plain(Policy):
    """The driver alone (like `um`), over the bump layout; records what it sees."""

    name = "plain"

    def __init__(self):
        self.seen = []

    def on_event(self, event):
        self.seen.append(event)

    def make_layout(self, backend):
        return BumpLayout(backend)


class Unlimited(Policy):
    """Infinite GPU memory over the default (caching-allocator) layout, like `ideal`."""

    name = "unlimited"
    unlimited_memory = True

    def on_event(self, event):
        pass


class Discarder(Plain):
    """Wrong on purpose: discards every parameter right after it is created."""

    name = "discarder"

    def on_event(self, event):
        if isinstance(event, Alloc) and event.kind == Kind.PARAMETER:
            self.ctx.backend.discard([(self.ctx.layout.address(event.obj), event.nbytes)])


def header(iterations: int) -> TraceHeader:
    return TraceHeader(1, "test", "synthetic", "none", "meta", iterations)


def cyclic_trace(n_objects: int, size: int, iterations: int = 2, flops: int = 10**9) -> Trace:
    """Host-initialised objects read in the same order every iteration."""
    events: list = [Alloc(o, size, Kind.PARAMETER) for o in range(n_objects)]
    seq = 0
    for it in range(iterations):
        events.append(IterationBoundary(it))
        for o in range(n_objects):
            events.append(Launch(seq, o, "aten::sum", (Access(o, 0, size, False),), flops, size))
            seq += 1
    events.append(IterationBoundary(iterations))
    return Trace(header(iterations), events)


def training_trace(layers: int = 4, param: int = 4 * MB, act: int = 6 * MB, iterations: int = 2,
                   grads_in_setup: bool = True) -> Trace:
    """A small training loop: parameters made on the host, inputs by a copy launch; forward
    saves activations, backward frees them and writes gradients (kept across
    iterations); the optimizer updates parameters; the loss lives on until the
    next iteration (an object carried from one iteration into the next)."""
    events: list = []
    seq = 0
    obj = 0

    def new(nbytes, kind, launch=-1):
        nonlocal obj
        events.append(Alloc(obj, nbytes, kind, launch))
        obj += 1
        return obj - 1

    def launch(op, reads, writes, flops=2 * 10**9):
        nonlocal seq
        acc = tuple(Access(o, 0, n, False) for o, n in reads) + tuple(Access(o, 0, n, True) for o, n in writes)
        events.append(Launch(seq, hash(op) & 0xFFFF, op, acc, flops, sum(n for _, n in reads + writes)))
        seq += 1

    params = [new(param, Kind.PARAMETER) for _ in range(layers)]
    grads: dict[int, int] = {}
    if grads_in_setup:  # zero-initialised before training, as optimizers with set_to_none=False have them
        grads = {i: new(param, Kind.GRADIENT) for i in range(layers)}
    loss = None
    for it in range(iterations):
        events.append(IterationBoundary(it))
        if loss is not None:
            events.append(Free(loss))
        x = new(act, Kind.INPUT, seq)
        launch("load_batch", [], [(x, act)])
        acts = [x]
        for i, p in enumerate(params):
            events.append(LayerEnter(f"l{i}"))
            y = new(act, Kind.ACTIVATION, seq)
            launch("fwd", [(acts[-1], act), (p, param)], [(y, act)])
            acts.append(y)
            events.append(LayerExit(f"l{i}"))
        loss = new(LOSS, Kind.OTHER, seq)
        launch("loss", [(acts[-1], act)], [(loss, LOSS)])
        for i in reversed(range(layers)):
            if i not in grads:
                grads[i] = new(param, Kind.GRADIENT, seq)
            launch("bwd", [(acts[i], act), (params[i], param)], [(grads[i], param)])
            events.append(Free(acts[i + 1]))
        events.append(Free(x))
        for i, p in enumerate(params):
            launch("adam", [(p, param), (grads[i], param)], [(p, param)])
    events.append(IterationBoundary(iterations))
    return Trace(header(iterations), events)


# ---------------------------------------------------------------- must show


def test_cyclic_stream_over_capacity_faults_on_every_pass():
    trace = cyclic_trace(12, 8 * MB)  # 96 MB stream
    for iterations in (2, 4):
        r = simulate(trace, Plain(), PROFILE, 64 * MB, iterations=iterations)  # 1.5x capacity
        assert r.faults == 96 * MB // (64 << 10)  # every 64 KB page, every pass
        assert r.h2d_bytes == 96 * MB
        assert r.evictions == 48
        assert r.iteration_time_s > 10 * r.ideal_time_s


def test_cyclic_stream_within_capacity_faults_only_on_the_first_pass():
    trace = cyclic_trace(12, 8 * MB)
    first = simulate(trace, Plain(), PROFILE, 128 * MB, iterations=1)
    assert first.faults == 96 * MB // (64 << 10)
    steady = simulate(trace, Plain(), PROFILE, 128 * MB, iterations=3)
    assert steady.faults == 0 and steady.h2d_bytes == 0 and steady.evictions == 0
    assert steady.iteration_time_s == pytest.approx(steady.ideal_time_s)
    assert steady.iteration_times_s[0] > steady.iteration_times_s[1]


def test_um_at_full_budget_is_within_2_percent_of_ideal():
    trace = training_trace()
    ideal = simulate(trace, Unlimited(), PROFILE, "100%")
    assert ideal.faults == 0 and ideal.iteration_time_s == pytest.approx(ideal.ideal_time_s)
    r = simulate(trace, "um", PROFILE, "100%")
    assert r.ideal_time_s == pytest.approx(ideal.iteration_time_s)
    assert r.iteration_time_s <= 1.02 * ideal.iteration_time_s
    squeezed = simulate(trace, "um", PROFILE, "40%")
    assert squeezed.iteration_time_s > 1.02 * ideal.iteration_time_s  # and it can fail


def test_fresh_managed_allocations_fault_on_first_touch_every_iteration():
    # without a caching layout, new activations are new pages: populating them faults
    r = simulate(training_trace(), Plain(), PROFILE, "100%")
    assert r.faults > 0 and r.iteration_time_s > 1.02 * r.ideal_time_s


def test_objects_created_on_the_host_start_in_host_memory():
    trace = cyclic_trace(2, 8 * MB, iterations=1)
    r = simulate(trace, Plain(), PROFILE, "100%", iterations=1)
    assert r.h2d_bytes == 16 * MB  # Alloc.launch == -1: written on the host, migrated on first touch


# ---------------------------------------------------------------- the driver


def test_events_reach_the_policy_in_program_order_with_addresses():
    trace = training_trace(iterations=1)
    seen_addresses = []

    class Probe(Plain):
        def on_event(self, event):
            super().on_event(event)
            if isinstance(event, Alloc):
                seen_addresses.append(self.ctx.layout.address(event.obj))

    p = Probe()
    simulate(trace, p, PROFILE, "100%", iterations=1)
    assert p.seen == trace.events[: len(trace.events) - 1] + [IterationBoundary(1)]
    assert len(seen_addresses) == sum(isinstance(e, Alloc) for e in trace.events)
    assert p.ctx.budget_bytes == needs(trace).footprint_bytes  # "100%": everything the run needs fits


def test_repeating_the_last_iteration_uses_fresh_objects():
    trace = training_trace(iterations=2)
    p = Plain()
    r = simulate(trace, p, PROFILE, "60%", iterations=5, budget_base="peak")  # 39 MB: a steady um
    original = {e.obj for e in trace.events if isinstance(e, Alloc)}
    allocs = [e.obj for e in p.seen if isinstance(e, Alloc)]
    assert len(allocs) == len(set(allocs))  # never reused
    assert len(set(allocs) - original) > 0
    live: set[int] = set()
    for e in p.seen:  # every Free names a live object; every launch touches live ones
        if isinstance(e, Alloc):
            live.add(e.obj)
        elif isinstance(e, Free):
            live.remove(e.obj)
        elif isinstance(e, Launch):
            assert {a.obj for a in e.accesses} <= live
    seqs = [e.seq for e in p.seen if isinstance(e, Launch)]
    assert seqs == list(range(len(seqs)))
    bounds = [e.index for e in p.seen if isinstance(e, IterationBoundary)]
    assert bounds == list(range(6))
    assert len(r.iteration_times_s) == 5
    assert r.iteration_times_s[3] == pytest.approx(r.iteration_times_s[4], rel=0.05)


def test_unlimited_memory_policy_never_faults_after_warm_up():
    r = simulate(cyclic_trace(12, 8 * MB), Unlimited(), PROFILE, 8 * MB)
    assert r.faults == 0 and r.iteration_time_s == pytest.approx(r.ideal_time_s)
    assert r.budget_bytes == 8 * MB  # the policy still sees the budget it was given


def test_a_policy_that_loses_data_fails_loudly():
    with pytest.raises(DataIntegrityError, match="discarder"):
        simulate(training_trace(), Discarder(), PROFILE, "100%")


def test_policy_by_name_and_result_json():
    r = simulate(training_trace(), "um", "a100-pcie4-40g", "50%", iterations=2)
    out = r.to_json()
    for key in ("iteration_time_s", "ideal_time_s", "h2d_bytes", "d2h_bytes", "faults", "fault_batches",
                "evictions", "peak_resident_bytes", "breakdown"):
        assert key in out
    assert set(out["breakdown"]) >= {"compute_s", "fault_stall_s", "transfer_wait_s", "overhead_s"}
    assert out["policy"] == "um" and out["profile"] == "a100-pcie4-40g"
    assert sum(out["breakdown"].values()) == pytest.approx(out["iteration_time_s"])
    assert 0 < out["peak_resident_bytes"] <= r.budget_bytes


def test_progress_bar_does_not_change_the_result():
    trace = training_trace()
    a = simulate(trace, Plain(), PROFILE, "50%")
    b = simulate(trace, Plain(), PROFILE, "50%", progress=True)
    assert a.iteration_time_s == b.iteration_time_s


# ---------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "budget, expected",
    [("20%", 200 * MB), ("8GiB", 8 << 30), ("512MB", 512 * 10**6), ("3 MiB", 3 * MB), (64 * MB, 64 * MB),
     ("100%", 1000 * MB), ("150 %", 1500 * MB), ("4194304", 4 * MB)],
)
def test_parse_budget(budget, expected):
    assert parse_budget(budget, 1000 * MB) == expected


@pytest.mark.parametrize("budget", ["", "abc", "-5%", "0%", "10 parsecs", "1MB", True, None, 1.5, "nan"])
def test_bad_budgets_are_config_errors(budget):
    with pytest.raises(ConfigError):
        parse_budget(budget, 1000 * MB)


def test_bad_inputs():
    trace = training_trace()
    with pytest.raises(ConfigError, match="iterations"):
        simulate(trace, Plain(), PROFILE, "50%", iterations=0)
    with pytest.raises(ConfigError, match="profile"):
        simulate(trace, Plain(), "no-such-gpu", "50%")
    with pytest.raises(ConfigError, match="policy"):
        simulate(trace, "no-such-policy", PROFILE, "50%")
    empty = Trace(header(0), [Alloc(0, MB, Kind.OTHER)])
    with pytest.raises(TraceFormatError, match="iteration"):
        simulate(empty, Plain(), PROFILE, "50%")


def test_fp32_arithmetic_runs_at_the_fp32_peak():
    """A launch's precision picks its peak: the same trace in FP32 computes
    slower than at the tensor-core peak, by at most the ratio of the peaks."""
    from dataclasses import replace as _replace

    from umrt.hardware import load_profile
    from umrt.testing.synthetic import training_trace
    from umrt.trace.events import Launch as _Launch
    from umrt.trace.events import Trace as _Trace

    tr = training_trace(layers=4, steps=2)
    fp32 = _Trace(tr.header, [_replace(e, precision="fp32") if isinstance(e, _Launch) else e for e in tr.events])
    p = load_profile("v100-pcie3-32g")
    t16 = simulate(tr, "ideal", p, "100%").ideal_time_s
    t32 = simulate(fp32, "ideal", p, "100%").ideal_time_s
    assert t16 < t32 <= t16 * p.peak_flops / p.peak_flops_fp32 * 1.0001
