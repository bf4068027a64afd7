"""The runtime over the simulated GPU: learns, acts, survives variation."""
from __future__ import annotations

import random
from dataclasses import FrozenInstanceError, asdict, fields, replace

import pytest

from bench.overhead import NullBackend
from umrt.backends.base import Backend
from umrt.config import Config
from umrt.drive import Driver
from umrt.hardware import load_profile
from umrt.memory.pool import LifetimePool
from umrt.policy import make_policy
from umrt.policy.base import PolicyContext
from umrt.policy.runtime import Runtime, RuntimeOptions
from umrt.policy.runtime import policy as policy_module
from umrt.policy.runtime.planner import PAGE
from umrt.shadow import LiveRun, drive_live
from umrt.sim.backend import SimBackend
from umrt.sim.budget import needs_of_events, resolve_budget
from umrt.sim.replay import parse_budget, peak_live_bytes, simulate
from umrt.testing.synthetic import training_trace
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit, Trace

PROFILE = "v100-pcie3-32g"


def drive(trace: Trace, policy, budget: str = "30%") -> LiveRun:
    """Feed a whole trace, event by event, as shadow mode feeds its live row; the GPU sized from
    the footprint of set-up and the first iteration (a trace whose later steps grow keeps the
    pressure those steps were written to put on the runtime)."""
    first = needs_of_events(trace.events[: trace.iteration_spans()[1][0] + 1])
    d = drive_live(trace.events, policy, load_profile(PROFILE), resolve_budget(budget, first).bytes)
    assert d.error is None, d.error
    return d


def test_registered_as_umrt_and_uses_the_pool():
    rt = make_policy("umrt")
    assert isinstance(rt, Runtime) and rt.name == "umrt"
    assert isinstance(rt.make_layout(SimBackend(PROFILE, 64 << 20)), LifetimePool)
    assert not isinstance(Runtime(use_pool=False).make_layout(SimBackend(PROFILE, 64 << 20)), LifetimePool)


def test_learns_then_acts_and_beats_plain_um():
    tr = training_trace(layers=8, steps=3)
    um = simulate(tr, "um", PROFILE, "30%", iterations=4)
    rt = Runtime()
    res = simulate(tr, rt, PROFILE, "30%", iterations=4)
    rep = rt.report()
    assert rep["learned"] >= 1 and rep["acted"] >= 1 and rep["deviations"] <= 1
    # the simulator has the copy engines: what leaves and comes back is swapped, not migrated
    assert rep["swapped_in_bytes"] > 0 and rep["swapped_out_bytes"] > 0 and rep["discarded_bytes"] > 0
    assert res.iteration_time_s < 0.8 * um.iteration_time_s
    assert res.faults < um.faults / 2


def test_ignores_the_trace_it_is_handed():
    """A policy never reads events it has not been given: same run either way."""
    tr = training_trace(layers=6, steps=3)
    a = simulate(tr, Runtime(trace=tr), PROFILE, "30%")
    b = simulate(tr, Runtime(), PROFILE, "30%")
    assert a.iteration_time_s == b.iteration_time_s


def test_nothing_to_do_with_room_to_spare():
    tr = training_trace(layers=4, steps=3)
    rt = Runtime()
    simulate(tr, rt, PROFILE, "150%")
    assert rt.report()["evicted_bytes"] == 0


@pytest.mark.parametrize(
    "variation",
    [
        {"eval_every": 2, "steps": 8},  # an eval pass inside every other step
        {"accum": 3, "steps": 5},  # gradient accumulation
        {"seqs": [128, 256, 128, 256, 128, 256, 128, 256], "steps": 8},  # sequence-length buckets
    ],
)
def test_survives_variation(variation):
    tr = training_trace(layers=6, **variation)
    rt = Runtime()
    d = drive(tr, rt)
    rep = rt.report()
    assert rep["acted"] >= 2, rep
    assert rep["guard_trips"] == 0
    um = drive(tr, make_policy("um"))
    assert d.steady()["time_s"] < um.steady()["time_s"]


@pytest.mark.parametrize("variation", [{"eval_every": 2, "steps": 16}, {"seqs": [128, 256] * 8, "steps": 16}])
def test_acting_without_launches_follows_alternating_shapes(variation):
    """Two iteration shapes in turn (an eval pass every other step, two
    sequence lengths): each shape's trusted plan runs without launches, the
    right one is predicted each time, and the GPU does what it would with
    every launch seen."""
    tr = training_trace(layers=6, **variation)
    light, full = Runtime(), Runtime(launch_free=False)
    a, b = drive(tr, light, budget="50%"), drive(tr, full, budget="50%")
    rep = light.report()
    assert rep["light_iterations"] >= 6 and rep["guard_trips"] == 0 and rep["late_decisions"] == 0
    assert a.iteration_times()[-4:] == pytest.approx(b.iteration_times()[-4:], rel=2e-3)


def test_a_second_optimizers_step_reads_gradients_the_plan_of_the_step_before_kept():
    """Two optimizers stepped in turn: each training step is two iterations of two shapes, the
    second reading gradients the first one's backward wrote. The first one's plan, made as if
    the next iteration were of its shape, took those gradients for dead and dropped them (their
    bytes were gone when the second optimizer read them). What survives a plan's iteration is
    dropped only where that shape has been followed by itself alone."""
    tr = training_trace(layers=6, steps=10, two_optimizers=True)
    for budget in ("25%", "20%"):
        for name in ("umrt", "oracle"):
            simulate(tr, make_policy(name, tr), load_profile("h100-pcie5-80g"), resolve_budget(budget, tr).bytes,
                     iterations=len(tr.iteration_spans()))  # raises where a launch reads lost bytes


def test_two_optimizers_stepped_in_turn_lose_no_data():
    """The loop of modded-nanogpt-style scripts (SGD with momentum for the blocks' matrices,
    AdamW for the rest, stepped one after the other), recorded. Besides the dropped gradients
    above: where a step was predicted to be the second optimizer's and was the first's, the
    runtime switched plans mid-step; the plan switched to swapped the embedding out, and the
    next step, of the plan first predicted, never brought it back (its AdamW read nothing)."""
    import torch
    import torch.nn.functional as F

    from umrt.capture.recorder import Recorder

    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(512, 256), torch.nn.Linear(256, 512)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 1024),
                                                     torch.nn.GELU(), torch.nn.Linear(1024, 256)) for _ in range(4))
    mats = [p for p in blocks.parameters() if p.dim() == 2]
    rest = [*emb.parameters(), *head.parameters(), *(p for p in blocks.parameters() if p.dim() != 2)]
    opts = torch.optim.SGD(mats, lr=0.02, momentum=0.9), torch.optim.AdamW(rest, lr=1e-3)
    rec = Recorder(steer=False)
    with rec:
        for _ in range(12):
            x = torch.randint(0, 512, (8, 32))
            h = emb(x)
            for b in blocks:
                h = h + b(h)
            F.cross_entropy(head(h).flatten(0, 1), x.flatten()).backward()
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad(set_to_none=True)
    tr = rec.trace()
    assert len(tr.iteration_spans()) == 24
    for budget in ("50%", "33%"):
        for name in ("umrt", "oracle"):
            simulate(tr, make_policy(name, tr), load_profile("h100-pcie5-80g"), resolve_budget(budget, tr).bytes,
                     iterations=24)


def test_a_backbone_unfrozen_mid_run_is_not_taken_for_the_frozen_step():
    """fastai's fine_tune order: the head trained alone for a few steps, then the backbone
    unfrozen (``add_param_group``), every step from then on adding its backward. The frozen
    step's plan has no decision to tell the two apart (this model is too small for any), so
    it "held" on the unfrozen steps it was predicted for, and the variant table learned the
    two shapes took turns: every other step ran the frozen step's plan. umrt's whole run was
    1.05x plain UM's (128.29 against 122.68 ms at 50%, SIMULATED); an iteration that ran more
    launches than its plan is not of its shape, and the steps after the first after the
    unfreeze act on the unfrozen step's plan."""
    import torch
    import torch.nn.functional as F

    from tests.recorded_loops import drive
    from umrt.capture.recorder import Recorder
    from umrt.phase_report import live_run, replay_run

    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                   torch.nn.GELU(), torch.nn.Linear(1024, 512))
    head = torch.nn.Linear(512, 10)
    model = torch.nn.Sequential(backbone, head)
    backbone.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    rec = Recorder(steer=False)
    with rec:
        for step in range(14):
            if step == 6:
                backbone.requires_grad_(True)
                opt.add_param_group({"params": backbone.parameters(), "lr": 1e-4})
            F.cross_entropy(model(torch.randn(64, 256)), torch.randint(0, 10, (64,))).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    run, budget = drive(rec)
    log = run.driver.policy.log
    unfrozen = next(e["signature"] for e in log if e["iteration"] >= 7 and e["mode"] == "learn")
    acted = [e["signature"] for e in log if e["iteration"] >= 9 and e["mode"] == "act"]
    assert len(acted) >= 3 and set(acted) == {unfrozen}, log
    umrt, um = live_run("umrt", run.driver, 0), replay_run(rec.trace(), "um", load_profile("h100-pcie5-80g"), budget, 0)
    assert umrt.totals["time_s"] < um.totals["time_s"]


def test_a_new_folds_model_and_optimizer_are_learned_not_left_to_the_last_folds_plan():
    """K-fold training: a new model and optimizer per fold, in one process. The steps of a
    fold launch as the last fold's did, so its plan "held", moving the last fold's weights
    and optimizer state, which no longer exist, and none of the new ones: the folds after
    the first ran their steps at 16 ms against the first's 4 (SIMULATED, 50%). A plan whose
    long-lived objects are gone is learned again."""
    from tests.recorded_loops import drive, kfold
    from umrt.phase_report import live_run

    rec = kfold(folds=3, steps=8, width=1024)
    assert len(rec.trace().iteration_spans()) == 26  # (the last validation ends no iteration)
    run, _ = drive(rec)
    times = live_run("umrt", run.driver, 0).times
    first, last = sum(times[5:8]) / 3, sum(times[23:26]) / 3  # each fold's last three steps
    assert last < 2 * first, (first, last)


def test_a_context_that_grows_in_stages_acts_on_each_stages_plan():
    """Sequence-length warm-up (32, 64, then 128 tokens): each stage's step launches as the
    last stage's did, at other sizes. A plan with no decision (a small model) "held" on the
    next stage's steps, and the variant table learned that the stages took turns; the first
    step of a stage, learned, freed the last stage's tensors, so its plan deviated on every
    step of the stage after it and was learned again each time without being replaced. umrt's
    whole run over 15 steps was 493.10 ms against plain UM's 473.98 at 50% (SIMULATED)."""
    import torch
    import torch.nn.functional as F

    from tests.recorded_loops import drive
    from umrt.capture.recorder import Recorder
    from umrt.phase_report import live_run, replay_run

    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(512, 256), torch.nn.Linear(256, 512)
    blocks = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
                                 for _ in range(3))
    opt = torch.optim.AdamW([*emb.parameters(), *blocks.parameters(), *head.parameters()], lr=1e-3)
    rec = Recorder(steer=False)
    with rec:
        for step in range(18):
            x = torch.randint(0, 512, (16, 32 if step < 5 else 64 if step < 10 else 128))
            h = emb(x)
            for b in blocks:
                h = b(h)
            F.cross_entropy(head(h).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    run, budget = drive(rec)
    log = run.driver.policy.log
    last = next(e["signature"] for e in log if e["iteration"] >= 10 and e["mode"] == "learn")
    assert [(e["mode"], e["signature"]) for e in log[-2:]] == [("act", last)] * 2, log
    umrt, um = live_run("umrt", run.driver, 0), replay_run(rec.trace(), "um", load_profile("h100-pcie5-80g"), budget, 0)
    assert umrt.totals["time_s"] < um.totals["time_s"]


def test_a_short_step_does_not_rebase_the_clock_of_the_steps_after_it():
    """A loop that holds each step's batch until the next one arrives frees it first thing
    in the next step, at the last step's length. First tried on the step after a short one,
    the launch-free clock re-based on it, then again on the step after (both acting on
    nothing); once confirmed, that step deviated. The clock is followed only after a step of
    its plan's shape or of one as usual; after a short step the plan follows launches,
    checked without freed sizes, and every step after learning acts."""
    tr = training_trace(layers=8, steps=24, seqs=[128] * 4 + [64], hold_batch=True)
    rt = Runtime()
    drive(tr, rt, budget="30%")
    modes = [entry["mode"] for entry in rt.log]
    rep = rt.report()
    assert rep["light_rebases"] == 0 and set(modes[5:]) == {"act"}, modes
    assert rep["light_iterations"] >= 8 and rep["deviations"] <= 1


def test_the_step_after_a_short_one_keeps_what_it_swapped_out_away():
    """The step after a short one frees that one's batch first, at the short length: what it
    swaps out is checked against its plan without freed sizes, as its decisions are. With
    freed sizes, every check of that step failed and brought back all it had swapped out
    (16 restores in this run, 758.0 ms; now 671.8 ms, SIMULATED)."""
    tr = training_trace(layers=8, steps=16, seqs=[128] * 4 + [64], hold_batch=True)
    rt = Runtime()
    drive(tr, rt, budget="30%")
    rep = rt.report()
    assert rep["swapped_out_bytes"] > 0 and rep["swap_restores"] == 0


def test_free_blocks_are_whole_blocks_no_live_object_touches_inside_one_segment():
    from umrt.backends.ranges import RangeSet
    from umrt.policy.runtime.ranges import Where, free_blocks

    mib = 1 << 20
    segments = {0: 8 * mib, 8 * mib: 4 * mib}  # two segments, side by side
    live = [Where(100, 10), Where(4 * mib - 1, 2)]  # in block 0, and in blocks 1 and 2 (across their edge)
    off_gpu = RangeSet()
    off_gpu.add(10 * mib, mib)  # half of the second segment's last block is off the GPU already
    assert free_blocks(segments, live, off_gpu, 2 * mib) == [(6 * mib, 2 * mib), (8 * mib, 2 * mib), (11 * mib, mib)]


def test_relearns_after_a_changed_batch_size():
    first = training_trace(layers=6, steps=4, seqs=[128])
    second = training_trace(layers=6, steps=4, seqs=[192])
    # the second job continues the first: same objects, new shapes after step 4
    events = list(first.events[:-1])
    offset = max(e.obj for e in first.events if hasattr(e, "obj")) + 1
    shift = {}
    for e in second.events:
        if hasattr(e, "obj"):
            e = replace(e, obj=e.obj + offset)
        elif isinstance(e, Launch):
            e = replace(e, accesses=tuple(replace(a, obj=a.obj + offset) for a in e.accesses))
        elif hasattr(e, "index"):
            e = replace(e, index=e.index + 4)
        events.append(e)
    del shift
    rt = Runtime()
    drive(Trace(first.header, events), rt, budget="40%")
    modes = [entry["mode"] for entry in rt.log]
    assert modes.count("act") >= 3
    assert rt.report()["plans_compiled"] >= 2
    assert modes[-1] == "act"


def test_a_short_batch_of_the_same_kernels_is_not_taken_for_a_full_step():
    """A short last batch runs the very kernels of a full step, at other sizes. A runtime
    following a full step's plan with launches in view tells them apart by the sizes allocated
    so far (the running hash of its non-launch events), at its first decision: it acts on none
    of the full step's decisions there and learns the short one."""
    full = training_trace(layers=6, steps=7, seqs=[128] * 7)
    short = training_trace(layers=6, steps=7, seqs=[128] * 6 + [64])
    exec_ids = iter(e.exec_id for e in full.events if isinstance(e, Launch))
    events = [replace(e, exec_id=next(exec_ids)) if isinstance(e, Launch) else e for e in short.events]
    assert any(a.nbytes != b.nbytes for a, b in zip(
        (e for e in full.events if isinstance(e, Alloc)), (e for e in events if isinstance(e, Alloc)), strict=True))
    rt = Runtime(launch_free=False)
    drive(Trace(short.header, events), rt, budget="20%")
    last = rt.log[-1]
    assert last["iteration"] == 6 and last["mode"] == "learn" and last.get("deviated")
    ref = Runtime(launch_free=False)  # the same run without its short step
    drive(training_trace(layers=6, steps=6, seqs=[128] * 6), ref, budget="20%")
    assert rt.report()["deviations"] == 1 and rt.report()["decisions"] == ref.report()["decisions"] > 0


def test_a_free_made_late_by_another_thread_costs_only_the_iterations_it_changed():
    """A collective's worker thread drops the last gradient it reduced after the step's
    boundary: one iteration ends a free short, the next starts with it. The runtime
    learns those two and acts from the next one on (it used to predict the stray shape
    after every step, learning again each time)."""
    events = list(training_trace(layers=6, steps=12).events)
    at = next(i for i, e in enumerate(events) if isinstance(e, IterationBoundary) and e.index == 4)
    late = events.pop(max(i for i in range(at) if isinstance(events[i], Free)))
    first_launch = next(i for i in range(at, len(events)) if isinstance(events[i], Launch))
    events.insert(first_launch + 1, late)
    rt = Runtime()
    drive(Trace(training_trace(layers=6, steps=12).header, events), rt, budget="40%")
    modes = [entry["mode"] for entry in rt.log]
    assert modes[2] == "act" and modes[3:5] == ["learn", "learn"], modes
    assert set(modes[5:]) == {"act"}, modes


@pytest.mark.parametrize("launch_free", [True, False])
def test_misprediction_guard_falls_back_and_relearns(launch_free):
    """After a few regular steps (the plan is trusted), every step ends
    differently (its optimizer launches are new each time, with a scratch
    buffer of a new size): the trusted plan keeps failing mid-iteration, so
    the runtime stops acting for a while (plain UM) instead of fighting the
    driver, then re-learns. Acting without launches, the sizes give it away. (The odd steps
    start after the path trial: PathTrial.)"""
    from umrt.policy.runtime.path_trial import TRIAL_ITERATIONS

    base = training_trace(layers=6, steps=14 + TRIAL_ITERATIONS)
    rng = random.Random(0)
    events, step, scratch = [], -1, 10**9
    for e in base.events:
        if isinstance(e, IterationBoundary):
            step = e.index
        if step >= 6 + TRIAL_ITERATIONS and isinstance(e, Launch) and "adamw" in e.op:
            scratch += 1
            events.append(Alloc(scratch, rng.randrange(1, 1 << 20) * PAGE, Kind.TEMPORARY, e.seq))
            events.append(replace(e, exec_id=rng.getrandbits(62)))
            events.append(Free(scratch))
            continue
        events.append(e)
    rt = Runtime(launch_free=launch_free)
    drive(Trace(base.header, events), rt)
    rep = rt.report()
    assert rep["deviations"] >= 2
    assert rep["guard_trips"] >= 1
    modes = [entry["mode"] for entry in rt.log]
    assert "learn" in modes[modes.index("off") + 1:]  # after failing, it learns again


def test_bad_options():
    """A bad option is refused at construction, naming itself (not later, mid-run)."""
    with pytest.raises(ValueError, match="learn_iterations"):
        Runtime(learn_iterations=0)
    with pytest.raises(ValueError, match="learn_iterations"):
        RuntimeOptions(learn_iterations=0)


def test_an_unknown_option_is_refused_naming_it_and_the_options():
    """Runtime's defaults live in RuntimeOptions alone: a misspelt keyword is refused by name."""
    with pytest.raises(TypeError, match=r"unknown runtime option\(s\) learn_iteration; the options are op_level"):
        Runtime(learn_iteration=3)


def test_options_are_the_constructor_keywords_frozen(monkeypatch):
    """Runtime's keyword arguments land, unchanged, in one frozen RuntimeOptions;
    make_policy passes them through. What no user sets is a module constant, read
    when a runtime is made."""
    kwargs = {"op_level": False, "learn_iterations": 3, "use_pool": False, "launch_free": False,
              "discard_on_free": True}
    assert {f.name for f in fields(RuntimeOptions)} == set(kwargs)
    monkeypatch.setattr(policy_module, "PROBE_ITERATIONS", 1)
    monkeypatch.setattr(policy_module, "SWAP", False)
    rt = Runtime(**kwargs)
    assert rt.options == RuntimeOptions(**kwargs)
    assert asdict(rt.options) == kwargs
    assert rt.warmup_iterations == 4
    assert Runtime().options == RuntimeOptions()
    assert RuntimeOptions().learn_iterations == Config.learn_iterations  # UMRT_LEARN_ITERATIONS's default
    assert make_policy("umrt", learn_iterations=3, use_pool=False).options == RuntimeOptions(
        learn_iterations=3, use_pool=False)
    with pytest.raises(FrozenInstanceError):
        rt.options.launch_free = True  # type: ignore[misc]



class _Recording(NullBackend):
    """Records every discard call (addresses from a bump allocator; moves are no-ops)."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.discards: list[list[tuple[int, int]]] = []

    def discard(self, ranges) -> None:
        self.discards.append(list(ranges))


def test_discard_counters_match_the_calls_made():
    """The runtime's discard counters must agree with what the backend was
    asked to drop, across learned, probed and trusted iterations and the
    pool's releases."""
    backend = _Recording()
    rep = _drive(backend).report()
    assert rep["acted"] >= 3 and rep["discard_calls"] > 0
    assert rep["discard_calls"] == len(backend.discards)
    assert rep["discarded_bytes"] == sum(n for call in backend.discards for _, n in call)


class _AllCalls(_Recording):
    """Records prefetches and advice too."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def prefetch(self, ranges, device) -> None:
        self.calls.append(("prefetch", tuple(ranges), device))

    def discard(self, ranges) -> None:
        super().discard(ranges)
        self.calls.append(("discard", tuple(ranges)))

    def advise(self, ranges, advice, device) -> None:
        self.calls.append(("advise", tuple(ranges), advice, device))

    def launch(self, reads, writes, flops, nbytes, precision="") -> None:
        self.calls.append(("launch",))


class _NoIndexPool(LifetimePool):
    @property
    def live_index(self):  # hides the pool's index: the runtime resolves through address()
        raise AttributeError("live_index")


def _drive(backend: Backend, *, steps: int = 6, hide_index: bool = False, tamper=None, honour: bool = False,
           lag: bool = False, **options) -> Runtime:
    """Feed a synthetic training trace to a Runtime(**options) over ``backend``,
    event by event as the replay does; ``tamper(rt)`` runs at each boundary
    reached while the runtime is frozen. ``honour``: hold back launches while
    the runtime does not want them, as the live bridge does (it stops
    capturing them); counted in ``rt.held_back``. ``lag``: as a live capture
    that resumes only at the next module hook (layer event)."""
    tr = training_trace(layers=6, steps=steps)
    budget = parse_budget("30%", peak_live_bytes(tr))
    rt = Runtime(**options)
    layout = rt.make_layout(backend)
    if hide_index:
        layout.__class__ = _NoIndexPool
    rt.attach(PolicyContext(backend, layout, budget, load_profile(PROFILE)))
    driver = Driver(rt, layout, backend)
    capturing = True
    for ev in tr.events:
        if not rt.wants_launches:
            capturing = False
        elif not lag or isinstance(ev, (LayerEnter, LayerExit)):
            capturing = True
        if isinstance(ev, IterationBoundary) and tamper is not None and rt._frozen:
            tamper(rt)
        driver.feed(ev, shown=capturing or not honour)  # a launch not shown still runs
    rt.held_back = driver.launches_held_back
    assert rt.report()["acted"] >= 3
    return rt


def _calls(**kw) -> tuple[list[tuple], Runtime]:
    backend = _AllCalls()
    rt = _drive(backend, **kw)
    return backend.calls, rt


def test_pool_index_and_address_lookups_resolve_the_same_ranges():
    """The hot path reads addresses from the pool's live index; a layout
    without one is resolved through Layout.address: the same moves either way."""
    fast = _calls()[0]
    assert any(c[0] == "prefetch" for c in fast)
    assert fast == _calls(hide_index=True)[0]


def test_decision_ranges_are_memoized_only_while_objects_stay_put():
    """DecisionRanges.resolve memoizes a decision's ranges per key tuple; an object
    that moved, changed size or died must be resolved afresh."""
    from umrt.policy.runtime.ranges import DecisionRanges, Where

    rt = Runtime()
    page = 64 << 10
    lives = {10: Where(4 * page, 3 * page), 11: Where(8 * page + 5, 2 * page)}
    ranges = DecisionRanges(rt.keys)
    ranges.connect(lives, lambda obj: 0)
    rt.keys.obj_of.update({1: 10, 2: 11})
    keys = (1, 2)
    assert ranges.resolve(keys, False, False) == (((4 * page, 3 * page), (8 * page + 5, 2 * page)), 5 * page, 0)
    # evictions move whole pages only
    assert ranges.resolve(keys, True, False) == (((4 * page, 3 * page), (9 * page, page)), 4 * page, 0)
    lives[10] = Where(20 * page, page)  # the role got another address this iteration
    assert ranges.resolve(keys, False, False) == (((20 * page, page), (8 * page + 5, 2 * page)), 3 * page, 0)
    del rt.keys.obj_of[2]  # not alive: counted, not moved
    assert ranges.resolve(keys, False, False) == (((20 * page, page),), page, 1)
    # the memoized ranges are shared with the caller: immutable
    assert isinstance(ranges.resolve(keys, False, False)[0], tuple)


def test_a_frozen_plan_makes_the_same_moves(monkeypatch):
    """Freezing skips resolving keys, never changes a move."""
    frozen, rt = _calls(steps=8)
    rep = rt.report()
    assert rep["frozen_iterations"] >= 2 and rep["unfreezes"] == 0
    monkeypatch.setattr(policy_module, "FREEZE", False)
    plain, rt2 = _calls(steps=8)
    assert rt2.report()["frozen_iterations"] == 0
    assert any(c[0] == "prefetch" for c in frozen)
    assert frozen == plain


def _moves(calls: list[tuple]) -> tuple[list, list]:
    """Prefetches and advice in order between the launches, and every
    discarded range in order (how frees are batched into discard calls may differ)."""
    return ([c for c in calls if c[0] != "discard"],
            [r for c in calls if c[0] == "discard" for r in c[1]])


def test_acting_without_launches_makes_the_same_moves():
    """A trusted plan runs on the clock of allocations, frees and module
    boundaries: a driver that stops delivering launches while the runtime
    does not want them gets the same moves as one that delivers them all.
    (The caching-allocator layout: like a live allocator it never sees
    launches, so both runs place every object alike.)"""
    light, rt = _calls(steps=8, honour=True, use_pool=False)
    rep = rt.report()
    assert rep["light_iterations"] >= 3 and rep["deviations"] == 0 and rep["late_decisions"] == 0
    assert rt.held_back > 0
    full, rt2 = _calls(steps=8, launch_free=False, use_pool=False)
    assert rt2.report()["light_iterations"] == 0
    assert any(c[0] == "prefetch" for c in full)
    assert _moves(light) == _moves(full)


def test_launches_delivered_late_make_late_decisions_not_deviations():
    """A live capture resumes only at the next module hook: the decisions
    among launches it missed are taken at the next event, late, and the plan
    still holds (the same moves, no deviation)."""
    late, rt = _calls(steps=8, honour=True, lag=True, use_pool=False)
    rep = rt.report()
    assert rep["deviations"] == 0 and rep["late_decisions"] > 0 and rep["light_iterations"] >= 3
    full, rt2 = _calls(steps=8, launch_free=False, use_pool=False)
    assert rep["decisions"] == rt2.report()["decisions"]
    assert rep["prefetched_bytes"] == rt2.report()["prefetched_bytes"]
    assert rep["evicted_bytes"] == rt2.report()["evicted_bytes"]


def test_an_object_at_another_address_unfreezes(monkeypatch):
    """An allocation that lands anywhere but where the reference iteration had
    it ends freezing for the iteration: decisions resolve every key again."""
    from umrt.policy.runtime.planner import Plan

    def tamper(rt):
        ptrs = rt._reference[1]
        ptrs[len(ptrs) // 2] = ptrs[len(ptrs) // 2] + 4096  # "the pool moved it"
    # (newborns are populated ahead only after an iteration whose addresses all repeated, which
    # the tampered one is not: the decisions' own moves are what must not change)
    monkeypatch.setattr(Plan, "newborns", lambda self, keys: [])
    calls, rt = _calls(steps=8, tamper=tamper)
    rep = rt.report()
    assert rep["unfreezes"] >= 1
    monkeypatch.setattr(policy_module, "FREEZE", False)
    assert calls == _calls(steps=8)[0]  # nothing moved really: same moves


def test_an_object_the_layout_never_allocated_is_a_layout_error():
    """A driver that skips layout.alloc gets the layout's clear error, not a KeyError."""
    from umrt.memory.caching import LayoutError

    rt = Runtime()
    backend = _Recording()
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, 1 << 30, load_profile(PROFILE)))
    rt._off_gpu.add(0, 1 << 40)  # the runtime needs the newborn's address: pages to populate
    with pytest.raises(LayoutError):
        rt.on_event(Alloc(7, 32 << 20, Kind.ACTIVATION))
    rt.keys.obj_of[5] = 7
    with pytest.raises(LayoutError):
        rt._ranges.resolve((5,), False, False)


def test_op_level_follows_every_launch():
    """Acting before every launch needs them all: op level never asks a driver to stop capturing."""
    assert not Runtime(op_level=True).options.launch_free
    assert not RuntimeOptions(op_level=True, launch_free=True).launch_free
    rt = _drive(_AllCalls(), steps=8, honour=True, op_level=True, use_pool=False)
    assert rt.held_back == 0 and rt.report()["light_iterations"] == 0


@pytest.mark.parametrize("on_free", [False, True])
def test_a_dead_range_a_newborn_reuses_at_once_is_discarded_only_where_events_come_late(on_free):
    """A live allocator announces an op's outputs before its kernel is queued,
    and may hand a newborn the range that just died with no launch between.
    Dead ranges wait for the next allocation to be discarded; a newborn that
    takes one then takes it as it is, resident: discarding it would cost the
    call and then a population of the same pages before its kernel writes them.
    A driver whose events come after the op's kernel (``discard_on_free``) has
    the range discarded at the Free itself, before the allocator can hand it out
    again: the newborn's range is then prefetched to the GPU before its kernel
    (a kernel writing discarded memory refaults, 0.8 GB/s on the H100). The
    first newborn, on a segment nobody populated yet (one larger than the
    budget: not populated whole), is populated likewise."""
    backend = _AllCalls()
    rt = Runtime(discard_on_free=on_free, use_pool=False)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, 8 << 20, load_profile(PROFILE)))
    size = 4 << 20
    rt.on_event(IterationBoundary(0))
    rt.discard_keys = frozenset({0})  # as an acting plan under pressure says
    layout.alloc(1, size, Kind.ACTIVATION)
    rt.on_event(Alloc(1, size, Kind.ACTIVATION, 0))
    dead = (layout.address(1), size)
    populate = ("prefetch", (dead,), backend.device)
    assert backend.calls == [populate]
    rt.on_event(Free(1))
    layout.free(1)
    at_free = list(backend.calls)
    layout.alloc(2, size, Kind.ACTIVATION)
    assert layout.address(2) == dead[0]  # the caching allocator reuses the block at once
    rt.on_event(Alloc(2, size, Kind.ACTIVATION, 0))
    assert backend.calls == ([populate, ("discard", (dead,)), populate] if on_free else [populate])
    assert at_free == ([populate, ("discard", (dead,))] if on_free else [populate])


def _discarding_key_0() -> tuple[_AllCalls, Runtime, object]:
    """A runtime on a 64 MiB GPU in iteration 0, told (as an acting plan under pressure
    says) to discard key 0's range when it dies; its backend and layout."""
    backend = _AllCalls()
    rt = Runtime(use_pool=False)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, 64 << 20, load_profile(PROFILE)))
    rt.on_event(IterationBoundary(0))
    rt.discard_keys = frozenset({0})
    return backend, rt, layout


@pytest.mark.parametrize("phase", ["train", "eval"])
def test_dead_ranges_held_for_a_steps_newborns_stay_resident_into_an_evaluation(phase):
    """A dead range held for a newborn that never came is discarded as the step ends, unless
    an evaluation comes next: its newborns take the range as it is, resident (as plain
    Unified Memory reuses resident pages), where a discarded one is populated again first."""
    backend, rt, layout = _discarding_key_0()
    rt._reuse.keys.add(0)  # learned: a newborn took this key's discarded range at once
    size = 4 << 20
    layout.alloc(1, size, Kind.ACTIVATION)
    rt.on_event(Alloc(1, size, Kind.ACTIVATION, 0))
    ptr = layout.address(1)
    rt.on_event(Free(1))
    layout.free(1)
    before = len(backend.calls)
    rt.on_event(IterationBoundary(1, phase))
    discards = [c for c in backend.calls[before:] if c[0] == "discard"]
    assert discards == ([("discard", ((ptr, size),))] if phase == "train" else [])


def test_a_newborn_keeps_its_own_pages_out_of_a_pending_discard_and_no_more():
    """Only the whole pages a newborn touches leave the pending discards: the rest of a
    larger dead range it lands in is still discarded at that allocation."""
    from umrt.policy.runtime.reuse import without

    page = PAGE
    assert without([(0, 10 * page)], 3 * page + 5, 5 * page) == [(0, 3 * page), (5 * page, 5 * page)]
    assert without([(0, 2 * page), (8 * page, page)], 2 * page, 8 * page) == [(0, 2 * page), (8 * page, page)]
    assert without([(page, page)], 0, 3 * page) == []
    backend, rt, layout = _discarding_key_0()
    big, small = 8 << 20, 2 << 20
    layout.alloc(1, big, Kind.ACTIVATION)
    rt.on_event(Alloc(1, big, Kind.ACTIVATION, 0))
    ptr = layout.address(1)
    rt.on_event(Free(1))
    layout.free(1)
    layout.alloc(2, small, Kind.ACTIVATION)
    before = len(backend.calls)
    rt.on_event(Alloc(2, small, Kind.ACTIVATION, 0))
    new = layout.address(2)
    assert ptr <= new < ptr + big
    discards = [c for c in backend.calls[before:] if c[0] == "discard"]
    assert discards == [("discard", tuple((p, n) for p, n in without([(ptr, big)], new, new + small)))]


def test_a_large_segment_is_populated_whole_while_it_fits_the_budget():
    """A segment of a plan's size is populated on the GPU when the pool makes it, in one
    call (as the live allocator does), while the segments populated so fit the budget: the
    objects placed there later need no call of their own. One that would not fit is left to
    its newborns, each populated before its kernel."""
    from umrt.policy.runtime.policy import WHOLE_SEGMENT

    backend = _AllCalls()
    rt = Runtime(use_pool=False)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, 3 * WHOLE_SEGMENT, load_profile(PROFILE)))
    rt.on_event(IterationBoundary(0))
    layout.alloc(1, WHOLE_SEGMENT, Kind.ACTIVATION)
    (call,) = backend.calls
    assert call[0] == "prefetch" and len(call[1]) == 1
    seg_ptr, seg_n = call[1][0]
    assert seg_n >= WHOLE_SEGMENT and seg_ptr <= layout.address(1) < seg_ptr + seg_n
    rt.on_event(Alloc(1, WHOLE_SEGMENT, Kind.ACTIVATION, 0))
    assert backend.calls == [call]  # populated already: nothing more for the newborn
    assert rt.report()["populated_bytes"] == seg_n
    layout.alloc(2, 2 * WHOLE_SEGMENT, Kind.ACTIVATION)  # with the first, more than the budget
    rt.on_event(Alloc(2, 2 * WHOLE_SEGMENT, Kind.ACTIVATION, 0))
    assert backend.calls[1:] == [("prefetch", ((layout.address(2), 2 * WHOLE_SEGMENT),), backend.device)]


def test_a_switch_adopts_everything_keyed_by_the_other_plan():
    """Keys and launch ordinals mean something only within their plan: after a
    switch, the keys to discard and the oversized launches are the new plan's,
    on either clock."""
    from umrt.policy.runtime.planner import Action, Plan

    a = Action(0, 1, 0, 0, (), ())
    first = Plan(1, 4, [a], frozenset({1}), remote_at={3: (4,)}, launch_free_resume={0: (0, 0)})
    second = Plan(2, 4, [a], frozenset({5}), remote_at={7: (8,)}, launch_free_resume={1: (1, 1)})
    for light in (False, True):
        rt = Runtime()
        rt.plan, rt.acting_launch_free = first, light
        rt.discard_keys, rt.oversized, rt._clock.resume = first.discard, first.remote_at, first.launch_free_resume
        (rt._clock if light else rt._guard).adopt(second, 0)  # on the launch-free clock, the clock switches
        assert (rt.plan, rt.discard_keys, rt.oversized) == (second, second.discard, second.remote_at)
        assert rt._clock.resume == (second.launch_free_resume if light else first.launch_free_resume)
        assert rt.counters["switches"] == 1


def test_a_segment_given_back_takes_its_launch_advice_with_it():
    """Advice held for the launch that just ran is undone at the next launch; a
    segment the pool gave back meanwhile is freed memory, never advised again."""
    rt = Runtime()
    rt._launch_mapped[:] = [(1 << 30, 4096), (2 << 30, 4096)]
    rt._released(1 << 30, 1 << 21)
    assert rt._launch_mapped == [(2 << 30, 4096)]


def test_the_guard_trips_after_enough_failures_then_cools_down():
    """Guard: ``failures`` deviations among the last ``window`` acted iterations
    trip it (its history starts afresh); then ``cooldown`` iterations do nothing."""
    from umrt.policy.runtime.guard import Guard

    rt = Runtime()
    guard = Guard(rt, rt.plans, rt.phases)
    assert (guard.window, guard.failures, guard.cooldown) == (4, 3, 2)
    for ok in (False, True, False, True, True):
        guard.outcomes().append(ok)
    assert not guard.tripped()  # the first failure left the window
    guard.outcomes().extend([False, False, False])
    guard.outcomes("eval").extend([False, False])
    assert guard.tripped() and not guard.outcomes()
    assert not guard.tripped("eval")  # phase by phase: an evaluation's failures are its own
    assert [guard.cooling() for _ in range(3)] == [True, True, False]
    assert not guard.cooling("eval")


def test_the_runtime_feeds_no_layout_the_driver_does():
    """A learning layout learns from the driver alone (umrt.drive.Driver): the runtime on
    its own passes nothing on, so the pool is never fed twice."""
    from umrt.memory.caching import CachingAllocatorLayout

    class Learning(CachingAllocatorLayout):
        def __init__(self, backend) -> None:
            super().__init__(backend)
            self.fed: list = []

        def observe(self, event) -> None:
            self.fed.append(event)

        def observe_launch(self, exec_id: int) -> None:
            self.fed.append(("launch", exec_id))

    events = [IterationBoundary(0), LayerEnter("m"), Launch(0, 42, "aten::mm.default", (), 1, 1, "m"),
              LayerExit("m"), IterationBoundary(1)]
    for through_driver, fed in ((False, []), (True, [IterationBoundary(0), LayerEnter("m"), ("launch", 42),
                                                     LayerExit("m"), IterationBoundary(1)])):
        backend = _Recording()
        rt = Runtime(use_pool=False)
        layout = Learning(backend)
        rt.attach(PolicyContext(backend, layout, 1 << 30, load_profile(PROFILE)))
        if through_driver:
            Driver(rt, layout, backend).feed_all(events)
        else:
            for ev in events:
                rt.on_event(ev)
        assert layout.fed == fed
        assert rt.report()["iterations"] == 1


def test_each_shape_keeps_the_path_its_own_iterations_measured_faster():
    """A plan that swaps runs beside its migration-only twin: one warm (second in a row)
    iteration of each is timed, and the faster is kept from then on."""
    from types import SimpleNamespace

    from umrt.policy.runtime.path_trial import MIGRATE, SWAP, PathTrial

    for swap_s, migrate_s, kept in ((1.0, 2.0, SWAP), (2.0, 1.0, MIGRATE)):
        twin = SimpleNamespace(signature=7, swap=frozenset(), migration_only=None)
        plan = SimpleNamespace(signature=7, swap=frozenset({1}), migration_only=twin)
        trial, ran, decided = PathTrial(), [], None
        for index in range(8):
            chosen = trial.pick(plan)
            ran.append(SWAP if chosen is plan else MIGRATE)
            trial.ran(index, chosen)
            decided = trial.timed(index, swap_s if chosen is plan else migrate_s) or decided
        # swap, swap (timed), migrate (changing over), migrate (timed), then the faster
        assert ran[:4] == [SWAP, SWAP, MIGRATE, MIGRATE] and decided == (7, kept)
        assert set(ran[4:]) == {kept} and trial.report()[kept] == 1


def test_a_shape_whose_times_never_come_keeps_the_planners_choice():
    """Live without CUDA events (no iteration times): the trial does not go on for ever."""
    from types import SimpleNamespace

    from umrt.policy.runtime.path_trial import SWAP, PathTrial

    twin = SimpleNamespace(signature=7, swap=frozenset(), migration_only=None)
    plan = SimpleNamespace(signature=7, swap=frozenset({1}), migration_only=twin)
    trial = PathTrial()
    for index in range(20):
        trial.ran(index, trial.pick(plan))
    assert trial.kept == {7: SWAP} and trial.pick(plan) is plan and not trial.trying(plan)


def test_a_newborns_population_takes_in_the_free_pages_of_its_blocks_and_no_live_ones():
    """A newborn on pages umrt took off the GPU is populated before its kernel, and the same
    call takes in what of its 2 MB blocks lies off the GPU with nothing live there (a fresh
    segment, dead ranges discarded): the next newborns there need no call of their own (each
    a prefetch the next kernel waits for). A live object's pages off the GPU (evicted: its
    data is on the host) are left for the plan to bring back."""
    from umrt.backends.base import BLOCK

    backend = _AllCalls()
    rt = Runtime(use_pool=False, discard_on_free=True)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, 64 << 20, load_profile(PROFILE)))
    rt.on_event(IterationBoundary(0))
    rt.discard_keys = frozenset(range(16))  # as an acting plan under pressure says
    size = 256 << 10

    def born(obj):
        layout.alloc(obj, size, Kind.ACTIVATION)
        rt.on_event(Alloc(obj, size, Kind.ACTIVATION, 0))
        return layout.address(obj)

    a = born(1)
    (call,) = backend.calls  # the fresh segment's block, in one call
    assert call[0] == "prefetch" and sum(n for _, n in call[1]) == BLOCK
    lo = a // BLOCK * BLOCK
    assert all(lo <= p and p + n <= lo + BLOCK for p, n in call[1])
    b, c, d = born(2), born(3), born(4)
    assert backend.calls == [call]  # their pages came with the first call
    rt._off_gpu.add(b, size)  # B evicted, as a plan's pre-eviction leaves it: live, on the host
    for obj in (1, 3):  # A and C die: discarded (whole pages), dead
        rt.on_event(Free(obj))
        layout.free(obj)
    e = born(5)  # lands on A's or C's dead range
    populate = [x for x in backend.calls[1:] if x[0] == "prefetch"]
    assert len(populate) == 1
    got = sorted(populate[0][1])
    assert got == sorted([(a, size), (c, size)]) and e in (a, c)  # the newborn's and the other dead range
    assert all(not (p < b + size and b < p + n) for p, n in got)  # never the live, evicted B
    assert rt._off_gpu.overlaps(b, size)
    assert d not in {p for p, _ in got}


def test_a_dead_range_a_newborn_took_at_once_is_kept_for_it_from_then_on():
    """A dead range discarded, then taken by a newborn a few events later, was discarded for
    nothing: its pages were populated again before the newborn's kernel. From then on that
    key's range is kept as it is when it dies, for ``REUSE_EVENTS`` events: a newborn that
    takes it needs neither call. What no newborn takes by then is discarded after all."""
    from umrt.policy.runtime.reuse import REUSE_EVENTS

    backend = _AllCalls()
    rt = Runtime(use_pool=False)
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, 64 << 20, load_profile(PROFILE)))
    size, small = 4 << 20, 256 << 10
    objs = iter(range(1, 1000))

    def alloc(nbytes):
        obj = next(objs)
        layout.alloc(obj, nbytes, Kind.ACTIVATION)
        rt.on_event(Alloc(obj, nbytes, Kind.ACTIVATION, 0))
        return obj

    def free(obj):
        rt.on_event(Free(obj))
        layout.free(obj)

    def step(index, others):
        """An object dies; ``others`` small allocations elsewhere; then a newborn of its size."""
        rt.on_event(IterationBoundary(index))
        rt.discard_keys = frozenset({0})  # the first object of each step, as a plan under pressure says
        dead = alloc(size)
        span = (layout.address(dead), size)
        free(dead)
        start = len(backend.calls)
        for _ in range(others):
            free(alloc(small))
        newborn = alloc(size)
        assert layout.address(newborn) == span[0]  # the caching allocator hands the range out again
        free(newborn)
        touched = [c for c in backend.calls[start:] if c[0] in ("discard", "prefetch")
                   and any(p < span[0] + span[1] and span[0] < p + n for p, n in c[1])]
        return [c[0] for c in touched]

    assert step(0, 2) == ["discard", "prefetch"]  # discarded at the next allocation, populated again
    assert step(1, 2) == []  # kept: the newborn takes it as it is
    assert step(2, REUSE_EVENTS) == ["discard", "prefetch"]  # no newborn in time: discarded after all


def _held_while_learning(trace: Trace) -> int:
    """The most managed memory the runtime's pool holds over ``trace`` with room to spare."""
    rt = Runtime()
    drive_live(trace.events, rt, load_profile(PROFILE), 1 << 40)
    return rt._peak_held


def test_a_step_all_of_whose_memory_fits_the_gpu_moves_nothing_and_the_pool_does_not_plan():
    """The live objects' peak is above what a plan may hold (the budget less its headroom),
    but all the memory the pool holds fits the budget: plain Unified Memory never evicts there,
    so the runtime moves nothing, and the pool does not lay out a plan's region beside it. A
    block less, and the runtime plans moves (and the pool its layout) as before."""
    tr = training_trace(layers=8, steps=6, act_mb=16)
    held = _held_while_learning(tr)
    assert peak_live_bytes(tr) > 0.9 * held  # the plan's own test alone would have it move

    rt = Runtime()
    run = drive_live(tr.events, rt, load_profile(PROFILE), held)
    rep = rt.report()
    assert run.error is None and rep["acted"] >= 3
    train = [p for p in rt.plans.values() if p.stats.get("planned_peak_bytes", 0) > 0.9 * held]
    assert train and all(p.stats.get("fits_as_held") and not p.actions for p in train)
    assert rep["evicted_bytes"] == rep["prefetched_bytes"] == rep["discarded_bytes"] == rep["swapped_out_bytes"] == 0
    assert not run.driver.layout.planned and rt._peak_held == held
    assert run.driver.backend.counters()["evictions"] == 0

    tight = Runtime()
    run = drive_live(tr.events, tight, load_profile(PROFILE), held - (2 << 20))
    assert run.error is None and run.driver.layout.planned
    assert tight.report()["discarded_bytes"] > 0 and not any(p.stats.get("fits") for p in tight.plans.values())


def test_plans_that_moved_nothing_because_the_memory_fitted_are_relearned_once_it_does_not():
    """Longer sequences later in the run make the pool hold more than the GPU has: the
    training plans learned at the short ones (nothing to move) are dropped, the longer
    steps learned, and the runtime moves memory for them."""
    short = training_trace(layers=8, steps=4, act_mb=16, seqs=[128] * 4)
    held = _held_while_learning(short)
    tr = training_trace(layers=8, steps=10, act_mb=16, seqs=[128] * 4 + [256] * 6)
    assert _held_while_learning(tr) > held
    rt = Runtime()
    run = drive_live(tr.events, rt, load_profile(PROFILE), held)
    assert run.error is None
    assert not any(p.stats.get("fits_as_held") for p in rt.plans.values())
    rep = rt.report()
    assert rep["discarded_bytes"] + rep["evicted_bytes"] + rep["swapped_out_bytes"] > 0 and run.driver.layout.planned
    modes = [e["mode"] for e in rt.log]
    assert modes[:4].count("act") >= 1 and "learn" in modes[4:]  # acted on the short steps' plan, then learned


def test_newborns_are_populated_at_a_decision_before_their_birth(monkeypatch):
    """The newborns a decision names (``Action.populate``) have their memory populated then, at
    the addresses the last iteration of the shape gave them, where it lies off the GPU with
    nothing live in it: their kernels find it there, where a population at birth would make
    the kernel wait. Without the names, every such newborn is populated at birth."""
    from umrt.policy.runtime.planner import Plan

    def run() -> tuple[int, int, float, float]:
        at_birth, ahead = [], []
        populate, free_pieces = Runtime._populate, policy_module._free_pieces

        def counted_populate(self, ptr, nbytes):
            if self._mode == "act":
                at_birth.append(nbytes)
            return populate(self, ptr, nbytes)

        def counted_pieces(*args):
            pieces = free_pieces(*args)
            ahead.extend(n for _, n in pieces)
            return pieces

        with monkeypatch.context() as m:
            m.setattr(Runtime, "_populate", counted_populate)
            m.setattr(policy_module, "_free_pieces", counted_pieces)
            res = simulate(training_trace(layers=8, steps=3), Runtime(), PROFILE, "37%", iterations=10)
        return sum(at_birth), sum(ahead), res.breakdown["transfer_wait_s"], res.iteration_time_s

    born, ahead, wait, took = run()
    monkeypatch.setattr(Plan, "newborns", lambda self, keys: [])
    born_without, ahead_without, wait_without, took_without = run()
    assert ahead > 0 and ahead_without == 0
    assert born < born_without
    assert wait < wait_without and took < took_without


@pytest.mark.parametrize("rest_mib", [16, 2])
def test_an_oversized_launch_populates_a_newborns_head_and_maps_only_a_rest_worth_its_advice(rest_mib):
    """``HostMapper.map_for_launch`` with a head (``Plan.remote_head``): the head is populated on the
    GPU and only the rest is discarded to the host and host-mapped. A rest under what its advice
    calls cost (3.2 MiB on the H100) is not mapped, but the head is populated all the same, as the
    oracle places it."""
    from umrt.backends.base import HOST, Advice
    from umrt.backends.ranges import RangeSet
    from umrt.policy.runtime.host_map import HostMapper
    from umrt.predict.tables import ObjectKeys
    from umrt.trace.events import Alloc as AllocEvent

    mib, base = 1 << 20, 1 << 30
    keys = ObjectKeys()
    keys.obj_of[5] = 7
    size = (12 + rest_mib) * mib
    mapper = HostMapper(keys, {7: AllocEvent(7, size, Kind.ACTIVATION)}, RangeSet(), {"launch_host_mapped_bytes": 0})
    class Calls(_AllCalls):
        def discard_and_prefetch(self, ranges, device) -> None:
            self.calls.append(("discard_and_prefetch", tuple(ranges), device))

    backend = Calls()
    mapper.connect(backend, lambda obj: base, load_profile("h100-sxm5-80g"))
    mapper.map_for_launch([5], frozenset({5}), {5: 12 * mib})
    rest = (base + 12 * mib, rest_mib * mib)
    expected = [("prefetch", ((base, 12 * mib),), backend.device)]
    if rest_mib == 16:
        expected = [("discard_and_prefetch", (rest,), HOST), *expected,
                    ("advise", (rest,), Advice.SET_PREFERRED_LOCATION, HOST),
                    ("advise", (rest,), Advice.SET_ACCESSED_BY, backend.device)]
    assert backend.calls == expected
    assert mapper.launch_mapped == ([rest] if rest_mib == 16 else [])
