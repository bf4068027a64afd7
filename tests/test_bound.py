"""The link bound (umrt.sim.bound): no policy beats it, and it is exact where it can be checked by hand."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umrt.errors import ConfigError, TraceFormatError
from umrt.hardware import GIB, load_profile
from umrt.policy import POLICY_NAMES, make_policy
from umrt.sim.bound import LinkBound, link_bound
from umrt.sim.replay import peak_live_bytes, simulate
from umrt.testing.synthetic import training_trace
from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch, Trace, TraceHeader

MB = 1 << 20
# Round numbers: migrations at most 8 GiB/s (prefetch and fault path), remote access at 10 GB/s,
# sharing one link: the cheapest way in is a remote read by the launch that needs the bytes.
PROFILE = dataclasses.replace(load_profile("v100-pcie3-32g"), h2d_bandwidth=10e9, d2h_bandwidth=10e9,
                              prefetch_h2d_rate=8.0 * GIB, prefetch_d2h_rate=8.0 * GIB,
                              fault_migration_rate=8.0 * GIB, peak_flops=1e12, compute_efficiency=1.0,
                              memory_efficiency=1.0, hbm_bandwidth=1e15, launch_floor_s=1e-6)
RATE, LINK = 8 * GIB, 10e9


def _header(iterations: int) -> TraceHeader:
    return TraceHeader(1, "test", "tiny", "none", "meta", iterations)


def _one_read_trace(size: int, flops: int, iterations: int = 3) -> Trace:
    """One object made on the host, read once per iteration by one launch."""
    events: list = [Alloc(0, size, Kind.PARAMETER)]
    for it in range(iterations):
        events.append(IterationBoundary(it))
        events.append(Launch(it, 1, "aten::sum", (Access(0, 0, size, False),), flops, 0))
    events.append(IterationBoundary(iterations))
    return Trace(_header(iterations), events)


def _assert_no_policy_beats(trace: Trace, profile, budget: str) -> LinkBound:
    bound = link_bound(trace, profile, budget)
    unlimited = link_bound(trace, profile, 10 * peak_live_bytes(trace))
    for name in POLICY_NAMES:
        policy = make_policy(name, trace)
        result = simulate(trace, policy, profile, budget)
        ref = unlimited if getattr(policy, "unlimited_memory", False) else bound
        assert ref.time_s <= result.iteration_time_s * (1 + 1e-9), (name, budget, ref, result.iteration_time_s)
        before, last = result.iteration_times_s[-2:]
        if before <= last * (1 + 1e-9):  # an iteration no shorter than the one before it
            assert ref.steady_s <= last * (1 + 1e-9), (name, budget, ref, result.iteration_times_s)
        assert ref.ideal_s == pytest.approx(result.ideal_time_s, rel=1e-9)
    return bound


# ---------------------------------------------------------------- exact cases


def test_one_read_over_the_link_is_hand_computable():
    # 64 MiB on the host, 24 MiB budget: 40 MiB must come in while the launch runs 1 ms.
    # Prefetches and remote reads share the link, so at best 40 MiB / 10 GB/s.
    trace = _one_read_trace(64 * MB, flops=10**9)  # 1 ms at 1 TFLOP/s
    bound = link_bound(trace, PROFILE, 24 * MB)
    assert bound.ideal_s == pytest.approx(1e-3)
    assert bound.time_s == pytest.approx(40 * MB / LINK)
    assert bound.at_launch == 0 and bound.h2d_min_bytes == 40 * MB
    assert bound.conserving_s == pytest.approx(40 * MB / LINK)  # nothing is written
    for name in ("um", "oracle", "umrt"):  # the oracle reaches the bound: equal up to rounding
        assert simulate(trace, name, PROFILE, 24 * MB).iteration_time_s >= bound.time_s * (1 - 1e-12)


def test_remote_reads_hidden_under_compute_cost_nothing():
    # 10 ms of compute can read 100 MB over the link: the 60 MiB that do not fit cost no time
    trace = _one_read_trace(64 * MB, flops=10**10)
    bound = link_bound(trace, PROFILE, 4 * MB)
    assert bound.time_s == pytest.approx(bound.ideal_s) == pytest.approx(1e-2)


def test_input_made_on_the_host_every_iteration_crosses_even_with_memory_to_spare():
    # a fresh 64 MiB host batch per iteration, read by a 1 ms launch; the budget holds everything
    events: list = []
    for it in range(3):
        events += [IterationBoundary(it), Alloc(it, 64 * MB, Kind.INPUT),
                   Launch(it, 1, "aten::sum", (Access(it, 0, 64 * MB, False),), 10**9, 0)]
    events.append(IterationBoundary(3))
    trace = Trace(_header(3), events)
    bound = link_bound(trace, PROFILE, "100%")
    assert bound.time_s == pytest.approx(64 * MB / LINK)
    assert bound.h2d_min_bytes == 64 * MB


def test_overwritten_bytes_are_not_needed_and_written_ones_are():
    # launch 0 (1 ms) overwrites [0, 48) MiB of a 64 MiB host object; launch 1 (1 ms) reads [32, 64).
    # Before launch 0 only [48, 64) is needed (16 MiB, hidden under 2 ms of compute); while it
    # runs, 12 MiB of the [32, 48) it writes do not fit and leave (written over the link or
    # evicted), 1.26 ms at the fastest rate out; before launch 1, [32, 64) is needed (32 MiB, 28
    # MiB over the budget): the bound is 12 MiB / 10 GB/s + 28 MiB / 10 GB/s.
    events: list = [Alloc(0, 64 * MB, Kind.ACTIVATION)]
    for it in range(3):
        events += [IterationBoundary(it),
                   Launch(2 * it, 1, "fill", (Access(0, 0, 48 * MB, True),), 10**9, 0),
                   Launch(2 * it + 1, 2, "sum", (Access(0, 32 * MB, 32 * MB, False),), 10**9, 0)]
    events.append(IterationBoundary(3))
    bound = link_bound(Trace(_header(3), events), PROFILE, 4 * MB)
    assert bound.at_launch == 1 and bound.h2d_min_bytes == 28 * MB
    assert bound.d2h_min_bytes == 16 * MB - 4 * MB  # written and still needed: [32, 48) MiB
    assert bound.time_s == pytest.approx(12 * MB / PROFILE.fastest_rate("d2h") + 28 * MB / LINK)
    assert PROFILE.fastest_rate("d2h") == LINK and 12 * MB / LINK > 1e-3  # the leaving, not launch 0, ends it
    assert bound.cuts == (0, 1, 2) and bound.window_end == 2
    # with the copy-back term: 12 MiB must leave in the first window, 28 MiB come in during the second
    assert bound.conserving_s == pytest.approx(12 * MB / LINK + 28 * MB / LINK)


def test_data_read_again_after_other_data_pays_again():
    # P, then Q, then P again (64 MiB each, 1 ms launches), 24 MiB budget: 40 MiB of P come in for
    # launch 0; after it at most 24 MiB of P and Q are resident, so 104 MiB come in for launches 1-2.
    # No single cut sees more than 104 MiB.
    events: list = [Alloc(0, 64 * MB, Kind.PARAMETER), Alloc(1, 64 * MB, Kind.PARAMETER)]
    for it in range(3):
        events.append(IterationBoundary(it))
        events += [Launch(3 * it + j, j, "sum", (Access(o, 0, 64 * MB, False),), 10**9, 0)
                   for j, o in enumerate((0, 1, 0))]
    events.append(IterationBoundary(3))
    bound = link_bound(Trace(_header(3), events), PROFILE, 24 * MB)
    assert bound.cuts == (0, 1, 3) and bound.h2d_min_bytes == 144 * MB
    assert bound.time_s == pytest.approx(144 * MB / LINK)
    assert bound.time_s > 104 * MB / LINK


def _one_object(kind: Kind, op: str, access: Access) -> Trace:
    """Three iterations of one launch touching one 64 MiB object."""
    events: list = [Alloc(0, 64 * MB, kind)]
    for it in range(3):
        events += [IterationBoundary(it), Launch(it, 1, op, (access,), 10**6, 0)]
    events.append(IterationBoundary(3))
    return Trace(_header(3), events)


def test_a_value_nobody_reads_costs_nothing():
    bound = link_bound(_one_object(Kind.ACTIVATION, "fill", Access(0, 0, 64 * MB, True)), PROFILE, 4 * MB)
    assert bound.time_s == bound.ideal_s and bound.h2d_min_bytes == 0


def test_an_in_place_update_reads_what_it_writes():
    # x.mul_(2) on 64 MiB with a 4 MiB budget: the old value is read, 60 MiB come in as for a read
    update = link_bound(_one_object(Kind.OPTIMIZER_STATE, "aten::mul_.Scalar", Access(0, 0, 64 * MB, True)),
                        PROFILE, 4 * MB)
    assert update.h2d_min_bytes == 60 * MB
    assert update.time_s == pytest.approx(60 * MB / LINK)
    overwrite = link_bound(_one_object(Kind.OPTIMIZER_STATE, "aten::fill_.Scalar", Access(0, 0, 64 * MB, True)),
                           PROFILE, 4 * MB)
    assert overwrite.time_s == overwrite.ideal_s and overwrite.h2d_min_bytes == 0


def test_what_the_iteration_before_wrote_must_leave_before_the_room_is_needed():
    # 32 MiB of state updated in place by an iteration's last launch (3); its first launch writes a
    # 32 MiB activation that launch 1 reads; launch 2 computes long enough to bring the state back
    # under it. Budget 40 MiB: 24 MiB of the state have left before launch 1 starts, from the start
    # of the update in the iteration before at the earliest. That one lasted T' <= T and reached its
    # update no earlier than c0 + c1 + c2 after it began, so T >= T' - c3 + X + c1 + c2 + c3, with
    # X the 24 MiB at the fastest rate out: T >= ideal + (X - c0 - c3) / 2. One iteration alone
    # could start with the state gone: its own bound is the ideal time.
    events: list = [Alloc(0, 32 * MB, Kind.OPTIMIZER_STATE)]
    flops = (10**8, 10**8, 10**10, 10**8)
    for it in range(3):
        s0 = 4 * it
        events += [IterationBoundary(it), Alloc(1 + it, 32 * MB, Kind.ACTIVATION, launch=s0),
                   Launch(s0, 1, "aten::gelu.default", (Access(1 + it, 0, 32 * MB, True),), flops[0], 0),
                   Launch(s0 + 1, 2, "aten::sum.default", (Access(1 + it, 0, 32 * MB, False),), flops[1], 0),
                   Free(1 + it),
                   Launch(s0 + 2, 3, "aten::mm.default", (), flops[2], 0),
                   Launch(s0 + 3, 4, "aten::mul_.Scalar", (Access(0, 0, 32 * MB, True),), flops[3], 0)]
    events.append(IterationBoundary(3))
    trace = Trace(_header(3), events)
    c = [PROFILE.compute_time(f, 0, "") for f in flops]
    bound = _assert_no_policy_beats(trace, PROFILE, 40 * MB)
    assert bound.ideal_s == pytest.approx(sum(c)) and bound.time_s == pytest.approx(bound.ideal_s)
    assert bound.carried_bytes == 32 * MB
    x = 24 * MB / PROFILE.fastest_rate("d2h")
    assert bound.steady_s == pytest.approx(bound.ideal_s + (x - c[0] - c[3]) / 2)
    assert bound.steady_s > bound.ideal_s + x / 3


def test_partial_reads_count_only_the_bytes_read():
    # only the first 16 MiB of a 64 MiB object are read: 12 MiB cannot stay
    bound = link_bound(_one_object(Kind.PARAMETER, "sum", Access(0, 0, 16 * MB, False)), PROFILE, 4 * MB)
    assert bound.h2d_min_bytes == 12 * MB
    assert bound.time_s == pytest.approx(12 * MB / LINK)


def test_budget_at_peak_live_gives_the_ideal_time():
    trace = training_trace(layers=4, param_mb=4, act_mb=6, steps=3, flops_per_mb=10**6)
    for budget in ("100%", "150%"):
        bound = link_bound(trace, "v100-pcie3-32g", budget)
        assert bound.time_s == bound.ideal_s
        assert bound.h2d_min_bytes == 0


def test_a_smaller_budget_never_lowers_the_bound():
    trace = training_trace(layers=4, param_mb=4, act_mb=6, steps=3, flops_per_mb=10**6)
    times = [link_bound(trace, "h100-pcie5-80g", f"{p}%").time_s for p in (100, 50, 20, 5)]
    assert times == sorted(times)
    assert times[-1] > times[0]


# ---------------------------------------------------------------- no policy beats it


# Budgets stay above ~20 MiB: the simulator pins every 2 MB block of a fault batch (up to
# 256 x 64 KB pages), so a smaller GPU cannot service one batch.
@pytest.mark.parametrize("budget", ["30%", "60%"])
def test_no_registered_policy_beats_the_bound(budget):
    trace = training_trace(layers=4, param_mb=4, act_mb=6, steps=3, flops_per_mb=10**7)
    bound = _assert_no_policy_beats(trace, "v100-pcie3-32g", budget)
    if budget == "30%":
        assert bound.time_s > bound.ideal_s  # the case is link-bound: the check is not vacuous
        assert bound.steady_s > bound.time_s  # and the optimizer's state must leave each step


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(2, 5), param_mb=st.integers(2, 8), act_mb=st.integers(2, 12),
       flops_per_mb=st.sampled_from([10**6, 10**8, 10**9]), pct=st.integers(10, 90),
       profile=st.sampled_from(["v100-pcie3-32g", "h100-pcie5-80g"]))
def test_no_policy_beats_the_bound_on_random_loops(layers, param_mb, act_mb, flops_per_mb, pct, profile):
    trace = training_trace(layers=layers, param_mb=param_mb, act_mb=act_mb, steps=3, flops_per_mb=flops_per_mb)
    _assert_no_policy_beats(trace, profile, max(peak_live_bytes(trace) * pct // 100, 24 * MB))


# ---------------------------------------------------------------- interface


def test_result_json_and_errors():
    trace = _one_read_trace(64 * MB, flops=10**9)
    bound = link_bound(trace, PROFILE, "50%")
    doc = json.loads(json.dumps(bound.to_json()))
    assert doc["time_s"] == bound.time_s and doc["slowdown"] == pytest.approx(bound.time_s / bound.ideal_s)
    assert {"ideal_s", "at_launch", "h2d_min_bytes", "d2h_min_bytes", "conserving_s"} <= set(doc)
    with pytest.raises(AttributeError):
        bound.time_s = 0.0  # frozen
    with pytest.raises(ConfigError):
        link_bound(trace, PROFILE, "lots")
    with pytest.raises(ConfigError):
        link_bound(trace, PROFILE, "20%", iterations=0)
    with pytest.raises(ConfigError):
        link_bound(trace, "no-such-gpu", "20%")
    with pytest.raises(TraceFormatError):
        link_bound(Trace(_header(0), [Alloc(0, MB, Kind.PARAMETER)]), PROFILE, "20%")
