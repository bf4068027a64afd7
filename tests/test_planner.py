"""The planner: a learned iteration in, a schedule that fits the budget out."""
from __future__ import annotations

import pytest

from umrt.hardware import load_profile
from umrt.policy.runtime.planner import PAGE, IterationRecord, Planner
from umrt.trace.events import Access, Alloc, Kind

MB = 1 << 20


def record(layers: int = 8, param: int = 8 * MB, act: int = 4 * MB, t: float = 1e-3,
           optimizer_state: bool = False) -> IterationRecord:
    """Forward over ``layers`` (each reads its parameter, writes an activation),
    backward in reverse (reads both, frees the activation), then a step."""
    rec = IterationRecord()
    params = [-(i + 1) for i in range(layers)]
    for k in params:
        rec.sizes[k], rec.kinds[k] = param, Kind.PARAMETER
        rec.start_live.add(k)
    states = []
    if optimizer_state:
        states = [-(100 + i) for i in range(layers)]
        for k in states:
            rec.sizes[k], rec.kinds[k] = 2 * param, Kind.OPTIMIZER_STATE
            rec.start_live.add(k)
    acts = []

    def launch(keys, boundary=True):
        if boundary:
            rec.boundaries.append(len(rec.exec_ids))
        rec.exec_ids.append(len(rec.exec_ids) + 1000)
        rec.uses.append(tuple(keys))
        rec.times.append(t)
        rec.alloc_counts.append(len(rec.allocs))
        rec.free_counts.append(len(rec.frees))

    for i in range(layers):
        a = len(acts)
        rec.allocs.append((len(rec.exec_ids), a))
        rec.sizes[a], rec.kinds[a] = act, Kind.ACTIVATION
        acts.append(a)
        launch([params[i]] + ([acts[i - 1]] if i else []) + [a])
    for i in reversed(range(layers)):
        launch([params[i], acts[i]] + ([acts[i - 1]] if i else []))
        rec.frees.append((len(rec.exec_ids), acts[i]))
    for i in range(layers):
        launch([params[i]] + ([states[i]] if states else []), boundary=False)
    rec.signature = 1
    return rec


def replay_plan(rec: IterationRecord, plan, cap: int, start: set[int] | None = None) -> dict:
    """Follow a plan over its record the way the driver would, counting
    what is resident; returns the peak and the keys that faulted."""
    size = {k: max(PAGE, -(-b // PAGE) * PAGE) for k, b in rec.sizes.items()}
    acts = plan.action_at()
    resident = set(start or ())
    peak, faults = 0, []
    frees = sorted(rec.frees)
    fi = 0
    for i, keys in enumerate(rec.uses):
        while fi < len(frees) and frees[fi][0] <= i:
            resident.discard(frees[fi][1])
            fi += 1
        a = acts.get(i)
        if a is not None:
            resident -= set(a.evict)
            resident |= set(a.prefetch)
        for k in keys:
            if k in plan.remote:
                continue
            if k not in resident:
                faults.append((i, k))
                resident.add(k)
        peak = max(peak, sum(size[k] for k in resident))
    return {"peak": peak, "faults": faults}


def test_plan_fits_the_budget_and_prefetches_before_use():
    rec = record()
    budget = 40 * MB  # parameters alone are 64 MB
    planner = Planner(budget, load_profile("v100-pcie3-32g"), headroom=1.0)
    plan = planner.plan(rec)
    assert plan.stats["planned_peak_bytes"] <= budget
    assert plan.actions, "an oversubscribed iteration needs moves"
    first = plan.actions[0]
    # every action names the launch it is tied to and the state it expects there
    for a in plan.actions:
        assert rec.exec_ids[a.at] == a.exec_id
        assert a.n_alloc == rec.alloc_counts[a.at] and a.n_free == rec.free_counts[a.at]
    assert first.prefetch
    # following the plan from its own steady state, nothing faults after warm-up
    out = replay_plan(rec, plan, budget, start=set())
    out2 = replay_plan(rec, plan, budget, start={k for k in rec.start_live})
    assert out2["peak"] <= budget + max(rec.sizes.values())
    assert len(out2["faults"]) < len(rec.exec_ids) / 2
    assert out["peak"] <= budget + max(rec.sizes.values())


def test_evictions_never_take_what_the_window_needs():
    rec = record(layers=12)
    planner = Planner(48 * MB, load_profile("v100-pcie3-32g"), headroom=1.0)
    plan = planner.plan(rec)
    for a in plan.actions:
        nxt = next((b.at for b in plan.actions if b.at > a.at), len(rec))
        needed_now = {k for i in range(a.at, nxt) for k in rec.uses[i]}
        assert not set(a.evict) & needed_now
        assert not set(a.evict) & set(a.prefetch)


def test_nothing_moves_when_everything_fits():
    rec = record()
    plan = Planner(1 << 40, load_profile("h100-pcie5-80g")).plan(rec)
    assert all(not a.evict for a in plan.actions)
    assert plan.stats["planned_d2h_bytes"] == 0
    # nothing is discarded either: a dead range is reused in place, resident
    assert plan.discard == frozenset()
    assert Planner(40 * MB, load_profile("v100-pcie3-32g")).plan(rec).discard  # under pressure it is


def test_unborn_objects_take_room_but_are_not_copied():
    rec = record()
    plan = Planner(40 * MB, load_profile("v100-pcie3-32g")).plan(rec)
    born_at = {k: p for p, k in rec.allocs}
    for a in plan.actions:
        for k in a.prefetch:
            assert born_at.get(k, -1) < a.at or k in rec.start_live


def mean_lead(rec: IterationRecord, budget: int, profile: str) -> float:
    """Mean number of launches between a prefetch and the use it serves."""
    plan = Planner(budget, load_profile(profile), headroom=1.0, min_segment_s=0).plan(rec)
    leads = []
    for a in plan.actions:
        for k in a.prefetch:
            uses = [i for i, keys in enumerate(rec.uses) if k in keys and i >= a.at]
            if uses:
                leads.append(uses[0] - a.at)
    return sum(leads) / len(leads)


def test_window_is_sized_in_time_by_the_link():
    """Same iteration, same budget: where the link is the bottleneck (slow
    PCIe 3, short kernels) the window is a segment or so — queuing more only
    hoards memory; where the link keeps up (NVLink-C2C) it runs ahead."""
    rec = record(layers=16, t=1e-4)
    slow = mean_lead(rec, 150 * MB, "v100-pcie3-32g")
    fast = mean_lead(rec, 150 * MB, "gh200-c2c")
    assert slow <= 2.0 < fast
    # and with kernels long enough to hide any copy, the link no longer matters
    rec = record(layers=16, t=1e-2)
    assert mean_lead(rec, 150 * MB, "v100-pcie3-32g") == pytest.approx(mean_lead(rec, 150 * MB, "gh200-c2c"))


def test_optimizer_state_is_host_mapped_not_planned():
    rec = record(optimizer_state=True)
    plan = Planner(40 * MB, load_profile("v100-pcie3-32g")).plan(rec)
    states = {k for k, kind in rec.kinds.items() if kind == Kind.OPTIMIZER_STATE}
    assert plan.remote == frozenset(states)
    moved = {k for a in plan.actions for k in a.evict + a.prefetch}
    assert not moved & states
    off = Planner(40 * MB, load_profile("v100-pcie3-32g"), remote_access=False).plan(rec)
    assert off.remote == frozenset()


def test_optimizer_state_read_in_several_passes_is_migrated_not_host_mapped():
    """Foreach AdamW reads its moments in two or three launches: over the link
    each pass would cross again, so they are planned (migrated) instead."""
    rec = record(optimizer_state=True)
    states = sorted(k for k, kind in rec.kinds.items() if kind == Kind.OPTIMIZER_STATE)
    for k in states:  # a second pass over every state (e.g. the update reads exp_avg again)
        rec.exec_ids.append(len(rec.exec_ids) + 1000)
        rec.uses.append((k,))
        rec.times.append(rec.times[-1])
        rec.alloc_counts.append(len(rec.allocs))
        rec.free_counts.append(len(rec.frees))
    plan = Planner(40 * MB, load_profile("v100-pcie3-32g")).plan(rec)
    assert not plan.remote & set(states)
    assert {k for a in plan.actions for k in a.prefetch} & set(states)


def test_long_lived_objects_are_discarded_when_they_die():
    rec = record()
    plan = Planner(40 * MB, None).plan(rec)
    born = dict((k, p) for p, k in rec.allocs)
    died = dict((k, p) for p, k in rec.frees)
    first, last = 0, len(rec.allocs) - 1  # layer 0's activation lives all iteration, the last one 2 launches
    assert died[first] - born[first] > 8 and died[last] - born[last] <= 2
    assert first in plan.discard and last not in plan.discard
    assert plan.discard <= set(died)


def test_op_level_decides_before_every_launch():
    rec = record()
    assert Planner(40 * MB, None, op_level=True).decision_points(rec) == list(range(len(rec)))
    coarse = Planner(40 * MB, None).decision_points(rec)
    assert coarse[0] == 0 and len(coarse) <= len(rec)


@pytest.mark.parametrize("bad", [{"budget_bytes": 0}, {"budget_bytes": 10, "headroom": 0}])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        Planner(**bad)


def test_a_launch_larger_than_the_budget_reaches_data_over_the_link():
    rec = record()
    # one fused step over every parameter: 64 MB in a 40 MB budget
    rec.exec_ids.append(99)
    rec.uses.append(tuple(k for k in rec.start_live))
    rec.times.append(1e-3)
    rec.alloc_counts.append(len(rec.allocs))
    rec.free_counts.append(len(rec.frees))
    planner = Planner(40 * MB, load_profile("v100-pcie3-32g"))
    plan = planner.plan(rec)
    last = len(rec) - 1
    assert planner.oversize(rec) == {last}
    assert plan.remote_at and set(plan.remote_at) == {last}
    assert set(plan.remote_at[last]) <= set(rec.start_live)
    off = Planner(40 * MB, load_profile("v100-pcie3-32g"), remote_access=False).plan(rec)
    assert not off.remote_at


def _dying(t: float) -> IterationRecord:
    """A parameter P used throughout; A used once at launch 0 and freed before
    launch 6 (long enough not to count as short-lived); B born at 1 and used
    until launch 5: P + A + B do not fit, P + B do."""
    rec = IterationRecord(signature=7)
    rec.sizes = {0: 64 * MB, 1: 64 * MB, 2: 64 * MB}
    rec.kinds = {0: Kind.PARAMETER, 1: Kind.ACTIVATION, 2: Kind.ACTIVATION}
    rec.start_live = {0}
    rec.allocs = [(0, 1), (1, 2)]
    rec.frees = [(6, 1), (7, 2)]
    for i, keys in enumerate([(0, 1), (0, 2), (0, 2), (0, 2), (0, 2), (0, 2), (0,), (0,)]):
        rec.exec_ids.append(100 + i)
        rec.uses.append(keys)
        rec.times.append(t)
        rec.boundaries.append(i)
        rec.alloc_counts.append(sum(1 for p, _ in rec.allocs if p <= i))
        rec.free_counts.append(sum(1 for p, _ in rec.frees if p <= i))
    return rec


def test_a_dead_object_is_not_copied_out_just_before_it_is_freed():
    """Used for the last time and freed before its copy to the host could
    finish: evicting it would only move dead bytes. Freed long after, it goes."""
    planner = Planner(160 * MB, load_profile("v100-pcie3-32g"), headroom=1.0, min_segment_s=0)
    soon = planner.plan(_dying(1e-6))
    assert not any(1 in a.evict for a in soon.actions)
    late = planner.plan(_dying(1.0))
    assert any(1 in a.evict for a in late.actions)


def test_launch_free_points_place_actions_on_the_events_before_their_launch():
    """Acting without launches: an action goes to the last non-launch event
    right before its launch; where none is (launch after launch), the runtime
    counts launches from the last event before it, as around an oversized launch."""
    from umrt.policy.runtime.planner import Action, launch_free_points

    light = [(0, 11), (0, 12), (2, 13), (5, 14)]  # (position: launches before it, running hash)
    acts = [Action(at, 0, 0, 0, (), ()) for at in (0, 2, 4, 5, 7)]
    placed, resume = launch_free_points(light, acts, oversized=[3])
    assert [(a.launch_free_at, a.launch_free_hash) for a in placed] == [(1, 12), (2, 13), (-1, 0), (3, 14), (-1, 0)]
    # launch 4 and the oversized launch 3: counted from event 2 (2 launches before it);
    # launch 7: from event 3 (5 before it)
    assert resume == {2: (2, 13), 3: (5, 14)}
    early = launch_free_points([(1, 5)], [Action(0, 0, 0, 0, (), ())], oversized=[])
    assert early[1] == {-1: (0, 0)}  # before the iteration's first event: count from its start


def test_a_plan_with_the_copy_engines_decides_at_finer_module_boundaries():
    """Module boundaries 2 ms of compute apart: a plan by page migration decides at every
    third (5 ms apart at least: finer decisions gained nothing there), one with the copy
    engines at each (1 ms), so that each copy out starts right after its object's last use
    and the GPU -> host engine does not idle while the compute waits for the room it frees."""
    from umrt.policy.runtime.planner import MIN_SEGMENT_S, SWAP_MIN_SEGMENT_S

    assert SWAP_MIN_SEGMENT_S < 2e-3 < MIN_SEGMENT_S
    rec = record(layers=12, t=2e-3)
    profile = load_profile("h100-sxm5-80g")
    budget = 40 << 30  # (a large budget: no segment is split for its length or bytes)
    migrate = Planner(budget, profile).decision_points(rec)
    swap = Planner(budget, profile, swap=True).decision_points(rec)
    forward = [p for p in swap if p < 12]
    assert forward == list(range(12))
    assert [p for p in migrate if p < 12] == [0, 3, 6, 9]
    assert Planner(budget, profile, swap=True, min_segment_s=MIN_SEGMENT_S).decision_points(rec) == migrate


def test_a_key_holds_data_from_its_birth_where_a_launch_reads_it_first():
    """A key made outside every launch (the host wrote it), or first touched by a launch that
    reads it (a kernel umrt does not see wrote it), holds data from its birth: no plan may
    treat it as born but unwritten."""
    rec = IterationRecord(start_live={1})
    for key, launch in ((2, 0), (3, 0), (4, 0), (5, -1)):
        rec.add_alloc(0, key, Alloc(key, 100, Kind.ACTIVATION, launch))

    def uses(**reads):  # obj name -> whether the launch reads it
        return rec.add_uses([Access(int(o[1:]), 0, 100, not r) for o, r in reads.items()], {1: 1, 2: 2, 3: 3, 4: 4}.get)

    assert uses(k1=True, k2=False) == (1, 2)  # 1 alive at the start; 2 written first
    uses(k2=True, k3=True, k4=False, k9=True)  # 9: not in the record
    uses(k4=True)
    assert rec.born_written == {3, 5} and rec.touched == {1, 2, 3, 4}
    assert rec.uses == [(1, 2), (2, 3, 4), (4,)] and rec.sizes[5] == 100


def _with_small_keys(rec: IterationRecord) -> set[int]:
    """Give each launch that reads a parameter a small persistent key beside it (a bias, a
    norm's weight): read where the parameter is, from the iteration's start; 1 KiB for the
    first parameter's, 2 KiB for the second's, and so on."""
    small: dict[int, int] = {}
    for i, keys in enumerate(rec.uses):
        params = [k for k in keys if rec.kinds.get(k) == Kind.PARAMETER]
        for p in params:
            if p not in small:
                small[p] = k = -(1000 - p)
                rec.sizes[k], rec.kinds[k] = len(small) << 10, Kind.PARAMETER
                rec.start_live.add(k)
        rec.uses[i] = keys + tuple(small[p] for p in params)
    return set(small.values())


def _moved(plan) -> set[int]:
    return {k for a in plan.actions for k in (*a.evict, *a.prefetch, *a.swap_out, *a.swap_in)}


def test_a_plan_that_swaps_keeps_objects_too_small_to_swap_resident(monkeypatch):
    """An object under two pages cannot be swapped (its discard frees whole 64 KB pages): it
    would move by page migration, a prefetch's set-up each, queued on the link behind the
    swap path's copies. A plan that swaps leaves them resident, the smallest first, within a
    sliver of its capacity; a plan by migration alone moves them as it moves the rest."""
    from umrt.policy.runtime import planner as planner_module

    rec = record(layers=8)
    small = _with_small_keys(rec)
    profile = load_profile("h100-sxm5-80g")
    budget = 64 * MB  # parameters 64 MiB, activations 32 MiB: the plan must move both
    swapping = Planner(budget, profile, swap=True)
    assert sum(max(PAGE, rec.sizes[k]) for k in small) <= swapping.cap * planner_module.SMALL_SHARE
    plan = swapping.plan(rec)
    assert plan.stats["planned_swap_out_bytes"] > 0
    assert not _moved(plan) & small
    assert _moved(Planner(budget, profile).plan(rec)) & small  # by migration: they move
    monkeypatch.setattr(planner_module, "SMALL_SHARE", 4 * PAGE / swapping.cap)  # room for four of eight
    moved = _moved(Planner(budget, profile, swap=True).plan(rec)) & small
    assert moved and not moved & set(sorted(small, key=rec.sizes.get)[:4])


def test_newborns_the_plan_holds_room_for_are_populated_before_their_birth():
    """A decision names the keys born before the decision after next, holding nothing yet, whose
    room the plan holds from there: the runtime populates their memory then, so that their
    first kernel does not wait for it. Counted resident from that decision, the plan still fits."""
    rec = record(layers=8)
    budget = 40 * MB
    planner = Planner(budget, load_profile("v100-pcie3-32g"))
    plan = planner.plan(rec)
    born_at = {k: p for p, k in rec.allocs}
    points = [a.at for a in plan.actions]
    populated = [(a, k) for a in plan.actions for k in a.populate]
    assert populated
    for a, k in populated:
        assert a.at < born_at[k] and k not in rec.born_written
        later = [p for p in points if p > a.at]
        assert len(later) < 2 or born_at[k] < later[1]  # before the decision after next
    size = {k: max(PAGE, -(-b // PAGE) * PAGE) for k, b in rec.sizes.items()}
    resident, peak = set(), 0
    frees = sorted(rec.frees)
    acts = plan.action_at()
    for i, keys in enumerate(rec.uses):
        resident -= {k for p, k in frees if p <= i}
        a = acts.get(i)
        if a is not None:
            resident = (resident - set(a.evict)) | set(a.prefetch) | set(a.populate)
        resident |= set(keys)
        peak = max(peak, sum(size[k] for k in resident))
    assert peak <= budget


def test_a_key_the_host_writes_later_is_moved_once_born():
    """A key born with data from the host (an input batch) after the decision whose window reaches
    its first reader is brought to the GPU at the first decision after its birth: before it,
    there is nothing to move (the runtime would find no object and the reader would fault)."""
    rec = record(layers=8)
    reader = 12  # a backward launch
    host = 99
    rec.allocs.append((reader - 1, host))
    rec.allocs.sort()
    rec.sizes[host], rec.kinds[host] = 4 * MB, Kind.INPUT
    rec.born_written.add(host)
    rec.uses[reader] = rec.uses[reader] + (host,)
    plan = Planner(48 * MB, load_profile("v100-pcie3-32g")).plan(rec)  # a window reaches the reader early
    moved_at = [a.at for a in plan.actions if host in (*a.prefetch, *a.swap_in)]
    assert moved_at and all(reader - 1 <= at <= reader for at in moved_at), moved_at


def _loss_record(read_over_link: bool = False, read_by_an_oversized_launch: bool = False,
                 two_newborns: bool = False) -> IterationRecord:
    """A (48 MB), B (48 MB), then a launch reading both that writes a newborn C (48 MB): more
    than a 128 MB budget's plan holds (115.2 MB). Then a launch reading C. Options: the launch
    also reads a 40 MB parameter that is off the GPU (read over the link); C's reader writes
    another newborn of 48 MB besides reading B and C (a second oversized launch); the launch
    writes a second newborn of 48 MB besides C (as a foreach over many tensors writes many)."""
    rec = IterationRecord()

    def launch(keys):
        rec.boundaries.append(len(rec.exec_ids))
        rec.exec_ids.append(len(rec.exec_ids) + 1000)
        rec.uses.append(tuple(keys))
        rec.times.append(1e-3)
        rec.alloc_counts.append(len(rec.allocs))
        rec.free_counts.append(len(rec.frees))

    if read_over_link:
        rec.sizes[-1], rec.kinds[-1] = 40 * MB, Kind.PARAMETER
        rec.start_live.add(-1)
    for k in (1, 2, 3, 4, 5):
        rec.sizes[k], rec.kinds[k] = 48 * MB, Kind.ACTIVATION
    rec.allocs.append((0, 1))
    launch([1])
    rec.allocs.append((1, 2))
    launch([1, 2])
    rec.allocs.extend([(2, 3)] + ([(2, 5)] if two_newborns else []))
    launch([1, 2, 3] + ([-1] if read_over_link else []) + ([5] if two_newborns else []))
    rec.frees.append((3, 1))
    if read_by_an_oversized_launch:
        rec.allocs.append((3, 4))
        launch([2, 3, 4])
        rec.frees.append((4, 4))
    else:
        launch([3])
    rec.frees.extend([(len(rec.exec_ids), 2), (len(rec.exec_ids), 3)] + ([(len(rec.exec_ids), 5)] if two_newborns else []))
    if read_over_link:
        launch([-1])
    rec.signature = 1
    return rec


def test_an_oversized_launch_writes_the_blocks_of_its_newborn_that_fit_on_the_gpu():
    """Only what the room lacks goes over the link: C's first whole 2 MB blocks that fit beside
    A and B (115.2 - 96 MB: 18 MB) are written on the GPU (``remote_head``). Not where C is not
    all the launch reaches over the link (it reads a parameter there too, or writes a second
    newborn there: its pages come and go on the GPU as it runs; heads on the main job's optimizer
    step, whose foreach writes many, took its steady step at 25% from 26.99x ideal to 29.93x,
    SIMULATED, ``umrt run``'s memory-savings table), nor
    where C's next reader is itself larger than the budget (it reads C over the link, where it lies)."""
    profile = load_profile("h100-sxm5-80g")
    planner = Planner(128 * MB, profile, swap=True)
    plan = planner.plan(_loss_record())
    assert planner.oversize(_loss_record()) == {2}
    assert plan.remote_fresh == {2: frozenset({3})} and plan.remote_head == {2: {3: 18 * MB}}
    for kw in ({"read_over_link": True}, {"two_newborns": True}, {"read_by_an_oversized_launch": True}):
        plan = planner.plan(_loss_record(**kw))
        assert 3 in plan.remote_fresh[2] and not plan.remote_head, kw
