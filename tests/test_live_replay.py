"""The H100's live event streams, replayed in closed loop (bench.live_replay).

On the GPU the runtime never completed an iteration without launches: the plan
was learned with the capture's dispatch mode on (1,101 allocations per GPT-2
step) and acted on with it off (1,053), so every launch-free iteration deviated
and the run alternated. The replay answers the runtime as the GPU run would.
"""
import pytest

from bench.live_replay import LOGS, RUNS, ClosedLoop, parse_event, read_live_log, replay
from umrt.policy.runtime.launch_free import rebase
from umrt.policy.runtime.planner import Action, Plan, launch_free_token
from umrt.trace.events import Access, Alloc, IterationBoundary, Kind, Launch, LayerEnter


@pytest.fixture(scope="module")
def logs():
    return {name: read_live_log(LOGS / f) for name, f in RUNS.items()}


def test_events_are_read_from_their_repr_without_eval():
    ev = parse_event("Launch(seq=3, exec_id=12, op='aten::add_.Tensor', accesses=(Access(obj=1, offset=0, "
                     "length=8, write=True),), flops=0, bytes=8, module='h.0.mlp', precision='fp32')")
    assert ev == Launch(3, 12, "aten::add_.Tensor", (Access(1, 0, 8, True),), 0, 8, "h.0.mlp", "fp32")
    assert parse_event("Alloc(obj=2, nbytes=64, kind=<Kind.OTHER: 6>, launch=0)") == Alloc(2, 64, Kind.OTHER, 0)
    assert parse_event("LayerEnter(module='h.0', phase='backward')") == LayerEnter("h.0", "backward")
    with pytest.raises(ValueError):
        parse_event("__import__('os').system('true')")


def test_the_source_answers_the_runtime(logs):
    """Recorded variant while launches are wanted, the allocation-only one otherwise."""
    source = ClosedLoop(logs["40GiB"])
    assert source.matched > 0.95

    def allocs(want):
        per = {}
        it = None
        for ev, _ in source.stream(source.first_index + 2, lambda: want):
            if type(ev) is IterationBoundary:
                it = ev.index
            elif type(ev) is Alloc and it is not None and it >= source.first_index:
                per[it] = per.get(it, 0) + 1
        return sorted(per.values())

    assert allocs(True) == [1101, 1101]
    assert allocs(False) == [1053, 1053]


def _converges(rows):
    assert len(rows) >= 20  # 20 iterations or more (issue 10)
    first = next(i for i, r in enumerate(rows) if r["light"])
    after = rows[first:]
    assert all(r["light"] for r in after), [r["mode"] for r in rows]
    assert len({r["deviations"] for r in after}) == 1  # never deviates once launch-free
    assert all(r["launches"] <= 1 for r in after[1:])  # the capture stays off
    return first


@pytest.mark.parametrize("lag", [False, True])
def test_a_plan_that_fits_converges_and_then_moves_nothing(logs, lag):
    """40 GiB for a 15 GiB peak: after learning, launch-free and not a byte moved.
    (The live pool lays its blocks out anew once it knows their lifetimes: the new
    segments are populated, without a copy, and from then on no call at all.)"""
    rows = replay("40GiB", 40 << 30, 20, lag=lag)
    first = _converges(rows)
    assert first <= 8
    for r in rows[2:]:
        assert set(r["calls"]) <= {"populate"} and r["h2d_bytes"] == 0 and r["d2h_bytes"] == 0, r
    assert all(r["calls"] == {} for r in rows[first:]), rows


def test_a_plan_under_pressure_converges(logs):
    """7.5 GiB, about half the footprint: the plan evicts and discards, and still
    runs launch-free from its first re-based iteration on, the same moves each step."""
    rows = replay("50pct", int(7.5 * 2**30), 20, lag=True)
    first = _converges(rows)
    assert first <= 8
    steady = rows[first + 2:]
    assert all(r["calls"] == steady[0]["calls"] and r["calls"].get("discard") for r in steady)
    assert rows[-1]["rebases"] <= 2


def test_rebase_moves_decisions_onto_the_iteration_that_ran_without_launches():
    """Recorded: ... A(10) A(20) F(20) A(30) enter; without launches A(20) F(20) are gone
    (a temporary the capture caused): decisions move to the last event both have."""
    def a(n):
        return launch_free_token(n << 1, 0)

    def f(n):
        return launch_free_token((n << 1) | 1, 1)

    common = tuple(launch_free_token(1000 + i, 2) for i in range(12))  # module boundaries
    recorded = common + (a(10), a(20), f(20), a(30), launch_free_token(77, 2))
    plain = common + (a(10), a(30), launch_free_token(77, 2))
    acts = [Action(1, 5, 1, 0, (), (0,), launch_free_at=12), Action(2, 6, 2, 1, (), (5,), launch_free_at=14),
            Action(3, 7, 3, 1, (4,), (2,), launch_free_at=15)]
    plan = Plan(9, 5, acts, frozenset({2}), launch_free_end=(len(recorded), 0), tokens=recorded)
    v = rebase(plan, plain)
    assert v is not None
    assert [x.launch_free_at for x in v.actions] == [12, 13]  # two decisions on one event are one
    assert v.actions[0].prefetch == (0, 5) and v.actions[1].evict == (4,)
    assert v.keymap == (0, 2)  # the plain run's 2nd allocation is the recorded 3rd
    hashes, h = [], 0
    for tok in plain:  # the runtime's running hash, as Runtime.on_event mixes the events
        h = ((h * 1000003) ^ (tok >> 2)) & ((1 << 63) - 1)
        hashes.append(h)
    assert [x.launch_free_hash for x in v.actions] == [hashes[12], hashes[13]]
    assert v.launch_free_end == (len(plain), hashes[-1])
    assert rebase(plan, tuple(a(n) for n in range(1, 18))) is None  # another shape


def test_a_launch_free_clock_is_re_based_a_bounded_number_of_times():
    """A mismatch while the launch-free clock is unconfirmed lets the iteration run on
    launch-free and re-bases the plan; once a plan has been re-based twice, or once
    its clock held a whole iteration, a mismatch is a deviation (learned again)."""
    from umrt.policy.runtime import Runtime

    rt = Runtime()
    rows = replay("40GiB", 40 << 30, 9, runtime=rt)
    assert rows[-1]["light"] and rows[-1]["deviations"] == 0 and rows[-1]["rebases"] >= 1
    sig = rt.plan.signature
    assert sig in rt._clock.confirmed and rt.event_tokens is None  # confirmed: no more recording
    rt._clock.mismatch()
    assert rt.report()["deviations"] == 1 and rt.wants_launches  # the next iteration is learned

    rt = Runtime()
    replay("40GiB", 40 << 30, 5, runtime=rt)  # the first launch-free iteration just started
    assert rt.acting_launch_free and rt.event_tokens is not None
    sig = rt.plan.signature
    rt._clock.mismatch()
    assert rt._mode == "rebase" and not rt.wants_launches and rt.report()["deviations"] == 0
    rt._mode, rt.acting_launch_free = "act", True
    rt._clock.rebases[sig] = 2
    rt._clock.mismatch()
    assert rt.report()["deviations"] == 1


def test_without_probing_a_plan_runs_launch_free_right_after_learning(logs, monkeypatch):
    """PROBE_ITERATIONS = 0 (a capture that hands over an iteration's launches at its
    end): trusted at once, launch-free from the third iteration, and still converged."""
    from umrt.policy.runtime import Runtime
    from umrt.policy.runtime import policy as policy_module
    from umrt.policy.runtime.path_trial import TRIAL_ITERATIONS

    monkeypatch.setattr(policy_module, "PROBE_ITERATIONS", 0)
    rt = Runtime()
    assert rt.warmup_iterations == rt.options.learn_iterations + TRIAL_ITERATIONS  # (the trial: only where it swaps)
    rows = replay("40GiB", 40 << 30, 20, runtime=rt)
    assert _converges(rows) <= 4 and rows[-1]["deviations"] == 0
