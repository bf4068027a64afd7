"""Shadow mode: run a real training script, show what the GPU would have done.

:func:`run_shadow` runs the user's PyTorch script unchanged under the recorder
that ``umrt trace -- python script.py`` uses (:func:`umrt.capture.recorder.script_recorder`):
on the device the script picks (the CPU, normally), with no steering, so every
op, kernel and random number is the script's own and its losses are bit for
bit those of a plain run. When the script ends:

* **the footprint** of the recorded run is measured (:func:`umrt.sim.budget.needs`,
  the same function ``umrt simulate`` uses on a trace file of the same
  recording, so both give the same footprint) and the GPU memory
  (``gpu_memory``: ``"20%"`` of the footprint, ``"20%peak"`` of peak live, or
  a size) is sized from it;
* the policy (the umrt runtime, by default) drives a simulated GPU
  (:class:`~umrt.sim.backend.SimBackend`) through the ordinary
  :class:`~umrt.backends.base.Backend` interface, fed every event as the script
  emitted it (object kinds as they were known then, not as the finished trace
  refines them: what the runtime sees on a real GPU), exactly as it would drive
  the ``cuda`` backend: the ``live`` row;
* the recorded trace is replayed, first iteration to last, under ``ideal``
  (unlimited memory), ``um`` (plain Unified Memory) and ``oracle`` (handed the
  whole recorded run: the reference for how close the runtime gets) at the
  same GPU memory, so that every policy is measured over the same iterations
  (:mod:`umrt.phase_report`): the first table gives each one's whole-run time,
  traffic and faults (and its steady training step), the second the steady
  time per phase of the loop (training steps, evaluation batches), and plain
  sentences name the iterations the runtime learned, recovered in or deviated
  in;
* the memory-savings table (:func:`memory_savings`): step time over ideal of
  ``um`` and the policy at 100, 75, 50, 33 and 25% of the footprint, from the
  same recording, beside the run's own budget (and a plot with ``plot=``).

Every number in the report but the script's own output is simulated. The
simulator is compiled (:func:`umrt.sim.warmup.warm_up`) before the script
starts, so that a cold numba cache is paid for, and announced, before the
script's first step.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from umrt.capture import StopRecording
from umrt.capture.recorder import not_recorded, script_recorder
from umrt.config import SIMULATED_DEFAULT, Amount, format_bytes, parse_amount, simulated_amount
from umrt.console import text_console
from umrt.drive.driver import Driver
from umrt.errors import ConfigError, UmrtError
from umrt.hardware import HardwareProfile, load_profile
from umrt.memory.pool import LifetimePool
from umrt.paths import check_writable
from umrt.phase_report import (
    PHASE_PLURALS,
    RunFigures,
    describe_iterations,
    live_run,
    named_iterations,
    phase_table,
    replay_run,
    steady_skip,
)
from umrt.policy import make_policy
from umrt.policy.base import Policy, PolicyContext
from umrt.policy.runtime import Runtime
from umrt.scripts import run_script
from umrt.sim.backend import SimBackend
from umrt.sim.budget import FOOTPRINT_DEFINITION, PEAK_LIVE_DEFINITION, Budget, resolve_budget
from umrt.sim.warmup import warm_up
from umrt.trace.events import Alloc, Event, Free, IterationBoundary, Kind, Launch, Trace

__all__ = ["run_shadow", "drive_live", "LiveRun", "memory_savings", "SAVINGS_FRACTIONS", "plot_savings"]

#: The GPU memory, as shares of the footprint, of the memory-savings table.
SAVINGS_FRACTIONS = (1.0, 0.75, 0.5, 1 / 3, 0.25)
#: Training steps a report needs: the first builds the model and the optimizer's state, the second is steady.
MIN_STEPS = 2


@dataclass
class LiveRun:
    """The policy driven over a run's events as they were emitted (what it sees on a GPU)."""

    driver: Driver
    budget_bytes: int
    error: UmrtError | None = None

    def iteration_times(self) -> list[float]:
        """Simulated time of each completed iteration."""
        return self.driver.iteration_times()

    def steady(self) -> dict:
        """Counters of the last complete iteration."""
        return self.driver.steady()

    def report(self) -> dict:
        """The policy's own counters (umrt's runtime: learned, acted, moves, deviations)."""
        return dict(self.driver.policy.report() or {})


#: What a live run learns of an object after its allocation, at the optimizer step (the live
#: bridge, :class:`umrt.drive.live.LiveBridge`, hints parameters, gradients and optimizer state).
OPTIMIZER_KINDS = (Kind.PARAMETER, Kind.GRADIENT, Kind.OPTIMIZER_STATE)


def drive_live(events: Iterable[Event], policy: str | Policy, profile: HardwareProfile, budget_bytes: int,
               kinds: dict[int, Kind] | None = None) -> LiveRun:
    """Feed ``events`` (a run's, as emitted) one by one to ``policy`` (a name, or a policy not yet
    attached) driving a simulated GPU of ``budget_bytes``; a failure of the simulated run is kept in
    :attr:`LiveRun.error`, not raised.

    ``kinds`` (object -> kind, as the finished trace knows them) stands in for what a live run
    learns at each optimizer step: before each iteration boundary, every live object that
    ``kinds`` says is a parameter, a gradient or optimizer state, and that was announced as
    something else, is hinted to the layout and the policy, as the live bridge does. The
    policy's layout is made as a live allocator feeds it (``live_feed``: kinds guessed, no
    launches in its keys), as umrt's pool runs behind torch.
    """
    pol = make_policy(policy) if isinstance(policy, str) else policy
    backend = SimBackend(profile, math.inf if pol.unlimited_memory else budget_bytes)
    layout = pol.make_layout(backend, live_feed=True)  # as a live run's allocator places them
    pol.attach(PolicyContext(backend, layout, budget_bytes, profile))
    # Closed loop, as a live run: a launch reaches the policy only while it wants launches.
    driver = Driver(pol, layout, backend, profile=profile, launches_on_demand=True)
    run = LiveRun(driver, budget_bytes)
    hints = layout if isinstance(layout, LifetimePool) else None
    pending: dict[int, Kind] = {}  # live objects the optimizer step will name
    try:
        for ev in events:
            t = type(ev)
            if t is Alloc and kinds is not None:
                kind = kinds.get(ev.obj, ev.kind)
                if kind in OPTIMIZER_KINDS and kind != ev.kind:
                    pending[ev.obj] = kind
            elif t is Free:
                pending.pop(ev.obj, None)
            elif t is IterationBoundary and pending:
                for obj, kind in pending.items():
                    if hints is not None:
                        hints.hint_kind(obj, kind)
                    pol.hint_kind(obj, kind)
                pending.clear()
            driver.feed(ev)
    except UmrtError as exc:
        run.error = exc
    return run


def refined_kinds(trace: Trace) -> dict[int, Kind]:
    """Each object's kind as the finished trace knows it."""
    return {e.obj: e.kind for e in trace.events if type(e) is Alloc}


def run_shadow(
    script: str,
    argv: list[str],
    *,
    profile: str,
    gpu_memory: str | Amount = SIMULATED_DEFAULT,
    policy: str = "umrt",
    steps: int | None = None,
    out: Callable[[str], None] | None = None,
    plot: str | None = None,
    on_report: Callable[[dict, int], None] | None = None,
) -> int:
    """Run ``script`` with ``argv`` in shadow mode and print the report.

    ``profile`` names a hardware profile (or a profile file); ``gpu_memory`` is
    the simulated GPU's memory: a percentage of the footprint the run needs
    (``"20%"``), of its peak live bytes (``"20%peak"``), or a size (``"8GiB"``);
    default :data:`umrt.config.SIMULATED_DEFAULT`. ``policy`` drives it (default
    the umrt runtime); ``steps`` stops the script after that many training steps;
    ``out`` takes the report as text instead of stdout; ``plot`` is a PNG file for
    the memory-savings curve; ``on_report`` is handed the report (a dict) and the
    script's exit status once it is printed (a ``torchrun`` rank leaves it for the
    launcher: :mod:`umrt.shadow_ranks`). Returns the script's exit status; a script
    that made too few training steps to simulate one is a :class:`ConfigError`
    (exit status 2) unless it failed itself.
    """
    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"script {script!r} not found")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be a positive number of iterations, got {steps}")
    prof = load_profile(profile)
    amount = simulated_amount(parse_amount(gpu_memory, "gpu_memory"))  # the form, now, not after the job ran
    if policy == "oracle":
        raise ConfigError("the oracle needs the whole future; shadow mode runs live (use `umrt simulate` on a trace)")
    make_policy(policy)  # an unknown name fails before the script runs
    if plot is not None:
        check_writable(plot)
    warm_up()  # compile the simulator now, not after the script, and say so first

    rec = script_recorder([str(path), *argv], steps=steps)
    with rec:
        try:
            status = run_script(str(path), list(argv), passthrough=(StopRecording,))
        except StopRecording:
            status = 0  # the steps asked for are recorded
    if rec.failure is not None:
        message = not_recorded(rec.failure, "nothing was simulated")
        if on_report is not None:
            on_report({"profile": prof.name, "policy": policy, "iterations": 0, "rows": [], "notes": [message]},
                      int(status))
        if status:
            print(f"umrt: {message}", file=sys.stderr)
            return status
        raise UmrtError(message)
    live_events = list(rec.events)  # kinds as announced while the script ran
    trace = rec.trace()  # kinds refined: what a trace file of this run holds
    made = sum(type(e) is IterationBoundary for e in live_events) - 1  # boundary 0 opens the first step
    if made < MIN_STEPS:
        what = "no optimizer step" if made <= 0 else f"{made} training step"
        message = (f"the script made {what}: shadow mode simulates a training loop's steps (one optimizer.step() "
                   f"to the next) and needs at least {MIN_STEPS} (the first builds the model and the optimizer's "
                   "state); nothing to simulate")
        if made <= 0 and any(type(e) is Launch for e in live_events):  # it computed: a loop without torch.optim?
            message += (". A step is a torch.optim optimizer's step(): a loop that updates its weights by hand "
                        "(p -= lr * p.grad) makes none; step a torch.optim optimizer (torch.optim.SGD does the same)")
        if on_report is not None:
            on_report({"profile": prof.name, "policy": policy, "iterations": max(made, 0), "rows": [],
                       "notes": [message]}, int(status))
        if status:
            print(f"umrt: {message}", file=sys.stderr)
            return status
        raise ConfigError(message)
    budget = resolve_budget(amount.text or str(amount), trace)
    rep = _report(trace, live_events, budget, prof, policy, made, plot)
    _print(rep, out)
    rep.pop("_runs", None)  # the printed tables' figures; the report's "runs" hold them as JSON
    if on_report is not None:
        on_report(rep, int(status))
    if rep.get("error") is not None:
        raise UmrtError(rep["error"])
    return int(status)


# ---------------------------------------------------------------- the report


def _report(trace: Trace, live_events: list[Event], budget: Budget, prof: HardwareProfile, policy: str,
            steps: int, plot: str | None) -> dict:
    rep: dict = {"profile": prof.name, "policy": policy, "steps": steps, "iterations": len(trace.iteration_spans()),
                 "budget_bytes": budget.bytes,
                 "budget_description": budget.describe(), "budget_share": budget.share(),
                 "footprint_bytes": budget.needs.footprint_bytes,
                 "peak_live_bytes": budget.needs.peak_live_bytes, "rows": [], "runs": [], "runtime": {}, "notes": []}
    kinds = refined_kinds(trace)
    live = drive_live(live_events, policy, prof, budget.bytes, kinds)
    # Every policy over the same iterations: the recorded run, first to last; the steady
    # figures of each phase leave out the live policy's warm-up (and the run's first), or
    # its learning where the run is no longer than that (steady_skip).
    named = named_iterations(live.driver.policy.log) if isinstance(live.driver.policy, Runtime) else None
    learned = [i for i, _ in named["learned"]] if named is not None else []
    skip, steady_note = steady_skip(len(trace.iteration_spans()), live.driver.policy.warmup_iterations, learned)
    runs: list[RunFigures] = []
    for name in ("ideal", "um", "oracle"):
        try:
            runs.append(replay_run(trace, name, prof, budget.bytes, skip))
        except UmrtError as exc:
            rep["notes"].append(f"{name} replay failed: {exc}")
    mine = live_run(policy, live.driver, skip)
    if mine.times:
        runs.append(mine)
    rep["runs"] = [r.to_json() for r in runs]
    rep["skip"] = skip
    rep["steady_note"] = steady_note
    ideal = next((r for r in runs if r.policy == "ideal"), None)
    ideal_t = _step_s(ideal) if ideal is not None else 0.0
    ideal_total = ideal.totals["time_s"] if ideal is not None else 0.0
    rep["ideal_time_s"] = ideal_t
    rt = live.report()
    acted = int(rt.get("acted", 0)) if "acted" in rt else None
    for r in runs:
        step = _step_s(r)
        rep["rows"].append({"policy": r.policy, "how": r.how, "learning": r.how == "live" and acted == 0,
                            "iterations": len(r.times), **r.totals, "iteration_time_s": step,
                            "vs_ideal": step / ideal_t if ideal_t > 0 else float("nan"),
                            "run_vs_ideal": r.totals["time_s"] / ideal_total if ideal_total > 0 else float("nan")})
    um = next((r for r in rep["rows"] if r["policy"] == "um"), None)
    row = next((r for r in rep["rows"] if r["how"] == "live"), None)
    if um and row and row["time_s"] > 0 and acted != 0:
        rep["speedup_vs_um"] = um["time_s"] / row["time_s"]  # the whole run's: like with like
    if mine.times and len(mine.times) != rep["iterations"]:
        rep["notes"].append(f"the live run simulated {len(mine.times)} of the {rep['iterations']} recorded "
                            "iterations; the replays ran all of them")
    rep["acted"] = acted
    rep["iteration_times_s"] = mine.times
    rep["iteration_phases"] = mine.phases
    rep["runtime"] = rt
    rep["swap_copy"] = live.driver.backend.swap.swap_copy  # what the simulated swap path copied with
    if named is not None:
        rep["named_iterations"] = named
    if live.error is not None:
        rep["notes"].append(f"the simulated run stopped: {live.error}")
        rep["error"] = str(live.error)
    rep["savings"] = memory_savings(trace, live_events, prof, policy, budget, ideal_t, skip,
                                    own={"um": um, policy: row}, kinds=kinds)
    if plot is not None:
        plot_savings(rep["savings"], plot, title=f"{prof.name}, {policy} vs um (SIMULATED)")
        rep["notes"].append(f"memory-savings plot written to {plot}")
    rep["_runs"] = runs  # for the printed tables (not part of the JSON-able report)
    return rep


def _step_s(run: RunFigures) -> float:
    """A run's steady training step (its first phase's where it has no training step)."""
    figs = run.by_phase.get("train") or next(iter(run.by_phase.values()), None)
    return figs.steady_s if figs is not None else 0.0


def memory_savings(trace: Trace, live_events: list[Event], prof: HardwareProfile, policy: str, budget: Budget,
                   ideal_s: float, skip: int, own: dict[str, dict | None] | None = None,
                   fractions: tuple[float, ...] = SAVINGS_FRACTIONS,
                   kinds: dict[int, Kind] | None = None) -> list[dict]:
    """How much memory a run can save, at what cost: for each share of the footprint in
    ``fractions`` (and the run's own budget), the steady training step time over ideal of
    plain Unified Memory (``um``, the trace replayed) and of ``policy`` (fed the run's events
    as emitted, as the report's live row), all simulated from the same recording: the mean
    of the run's training steps after its first ``skip`` iterations (:mod:`umrt.phase_report`).

    ``own`` holds the report's rows at the run's own budget (``{"um": row, policy: row}``),
    reused rather than simulated again. Rows are ordered from the most memory to the least;
    each has ``fraction`` (of the footprint), ``budget_bytes``, ``own`` and, per policy,
    ``{name}_s`` and ``{name}_x`` (over ideal), None where a run failed, and then
    ``{name}_failed``, why (but on the run's own row: the report's notes say it).
    """
    fp = budget.needs.footprint_bytes
    policies = list(dict.fromkeys(("um", policy)))
    rows = [{"fraction": budget.bytes / fp if fp else math.nan, "budget_bytes": budget.bytes, "own": True}]
    for row in rows:
        for name in policies:
            got = (own or {}).get(name)
            row[f"{name}_s"] = got["iteration_time_s"] if got else None
    for f in fractions:
        nbytes = int(fp * f)
        if nbytes == budget.bytes:
            continue  # the run's own budget is that row already
        row = {"fraction": f, "budget_bytes": nbytes, "own": False}
        for name in policies:
            row[f"{name}_s"], why = _step_time(trace, live_events, prof, name, nbytes, skip, kinds)
            if why is not None:
                row[f"{name}_failed"] = why
        rows.append(row)
    for row in rows:
        for name in policies:
            t = row[f"{name}_s"]
            row[f"{name}_x"] = t / ideal_s if t is not None and ideal_s > 0 else None
    return sorted(rows, key=lambda r: -r["budget_bytes"])


def _step_time(trace: Trace, live_events: list[Event], prof: HardwareProfile, policy: str, nbytes: int,
               skip: int, kinds: dict[int, Kind] | None) -> tuple[float | None, str | None]:
    """The steady training step time of ``policy`` at ``nbytes`` (as the report's rows): ``um``
    replayed from the trace, any other policy fed the live events (as the report's live row);
    where the run fails, None and why."""
    try:
        if policy == "um":
            return _step_s(replay_run(trace, "um", prof, nbytes, skip)), None
        run = drive_live(live_events, policy, prof, nbytes, kinds)
        if run.error is not None:
            return None, str(run.error)
        if len(run.driver.marks) < 2:
            return None, "the run completed no iteration"
        return _step_s(live_run(policy, run.driver, skip)), None
    except UmrtError as exc:
        return None, str(exc)


def plot_savings(rows: list[dict], path: str, title: str) -> None:
    """The memory-savings curve: step time over ideal against GPU memory (% of the footprint)."""
    # optional: matplotlib only when a plot is asked for
    import matplotlib

    matplotlib.use("Agg")
    # optional: as above
    import matplotlib.pyplot as plt

    names = [k[:-2] for k in rows[0] if k.endswith("_x")] if rows else []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        pts = [(r["fraction"] * 100, r[f"{name}_x"]) for r in rows if r[f"{name}_x"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for r in rows:
        if r["own"]:
            ax.axvline(r["fraction"] * 100, color="grey", linestyle=":", label="this run's GPU memory")
    ax.set_xlabel("GPU memory, % of the footprint the run needs")
    ax.set_ylabel("step time / ideal (SIMULATED)")
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: What each row and column of the report means, printed under the tables.
LEGEND = (
    "Each row of the first table: the whole run, simulated, under one policy; every policy runs the same "
    "recorded iterations, first to last. step: its steady training step (the mean of its training steps "
    "after the run's first {skip} iterations), and over ideal's.",
    "  ideal: a GPU with unlimited memory, its allocations device memory (backed when made: nothing is "
    "faulted in or evicted; the floor).",
    "  um: plain Unified Memory (the driver migrates pages when a kernel faults on them).",
    "  oracle: the fastest of several plans made knowing the whole recorded run in advance, plain "
    "Unified Memory among them (the reference; its plans follow the last training step, so a live "
    "run can beat it in a loop whose iterations differ).",
    "  run: replay = simulated from the recorded run; live = fed each event as the script emitted it, "
    "as the runtime sees a program on a GPU.",
    "  H2D / D2H: bytes moved host to GPU / GPU to host over the run; faults: GPU page faults "
    "(64 KiB pages) over the run; evictions: 2 MiB blocks the driver pushed out to make room, over the run.",
    "The second table: per phase of the loop (a training step; one batch of an evaluation), its steady time "
    "per iteration under each policy: the mean over that phase's iterations after the run's first {skip} "
    "(the same iterations for every policy); and the whole run's total.",
)


def _print(rep: dict, out: Callable[[str], None] | None) -> None:
    """Render the report: what was measured and simulated (with the footprint's definition),
    the table, its legend, in plain words where the policy stands and what it did, and the
    memory-savings table."""
    from rich.table import Table

    title = f"umrt shadow run — what a {rep['profile']} GPU would have done (SIMULATED)"
    table = Table(title=title)
    for col in ("policy", "run", "whole run", "vs ideal", "step", "step / ideal", "H2D", "D2H", "faults",
                "evictions"):
        table.add_column(col, justify="left" if col in ("policy", "run") else "right")
    for r in rep["rows"]:
        how = r["how"] + (", learning" if r.get("learning") else "")
        table.add_row(r["policy"], how, f"{r['time_s'] * 1e3:,.2f} ms", f"{r['run_vs_ideal']:.2f}x",
                      f"{r['iteration_time_s'] * 1e3:.2f} ms", f"{r['vs_ideal']:.2f}x", format_bytes(r["h2d_bytes"]),
                      format_bytes(r["d2h_bytes"]), f"{r['faults']:,}", f"{r['evictions']:,}")
    runs = rep.get("_runs") or []
    phases = phase_table(runs, "Steady time per iteration, by phase of the loop (SIMULATED)") if runs else None
    n, evals = (len(runs[0].phases), runs[0].phases.count("eval")) if runs else (rep["steps"], 0)
    ran = (f"{n} iterations ({n - evals} training, {evals} evaluation batch{'es' if evals > 1 else ''})" if evals
           else f"{n} training iterations")
    head = [
        f"Measured on this machine: the script ran {ran} on the CPU, unchanged (its "
        "losses are a plain run's). The step times it printed include umrt recording every op: they are not "
        "GPU times.",
        f"Simulated: a {rep['profile']} GPU whose memory is {format_bytes(rep['budget_bytes'])} = "
        f"{rep['budget_share']} {format_bytes(rep['footprint_bytes'])} (peak live "
        f"{format_bytes(rep['peak_live_bytes'])}); nothing ran on a GPU.",
        f"  {FOOTPRINT_DEFINITION}.",
        f"  {PEAK_LIVE_DEFINITION}.",
    ]
    lines = [line.format(skip=rep.get("skip", 1)) for line in LEGEND]
    if rep.get("steady_note"):
        lines.append(rep["steady_note"])
    live = next((r for r in rep["rows"] if r["how"] == "live"), None)
    rt = rep.get("runtime") or {}
    if "speedup_vs_um" in rep and live is not None:
        x = rep["speedup_vs_um"]
        than = f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"
        lines.append(f"In plain words: {rep['policy']} is {live['run_vs_ideal']:.1f}x slower than a GPU with enough "
                     f"memory, and {than} than plain Unified Memory over the whole run ({live['iterations']} "
                     "iterations, simulated).")
    elif rep.get("acted") == 0 and rt.get("rested_iterations"):
        lines.append(f"In plain words: {rep['policy']} did not act in this run: the shapes of its iterations never "
                     f"repeated (a plan learned on one fits no other), so after learning {rt.get('learned', 0)} it "
                     f"ran {rt['rested_iterations']} as plain Unified Memory, not recorded (recording costs the CPU "
                     "on every op), ready to learn again once a shape comes back.")
    elif rep.get("acted") == 0:
        lines.append(f"In plain words: {rep['policy']} did not act in this run: it learns from the first "
                     f"{rt.get('learned', 2)} step(s) and acts from the next; run more training steps to see it "
                     "act (its row is a learning step, no comparison is drawn).")
    lines.extend(_phase_sentences(runs, rep["policy"]))
    if "prefetched_bytes" in rt:
        lines.append(
            f"What umrt did: it learned the iteration from {rt.get('learned', 0)} iteration(s), then acted on "
            f"{rt.get('acted', 0)} ({rt.get('light_iterations', 0)} of them without recording ops, as a live run "
            f"does once it trusts its plan); over the run it prefetched {format_bytes(rt['prefetched_bytes'])} to the "
            f"GPU and pre-evicted {format_bytes(rt['evicted_bytes'])} to the host in {rt.get('prefetch_calls', 0)} calls, "
            f"at {rt.get('decisions', 0)} decision points (the places in an iteration where it acts: module "
            f"boundaries, at least a few ms of compute apart), and discarded {format_bytes(rt['discarded_bytes'])} "
            f"of dead tensors' memory in {rt.get('discard_calls', 0)} calls (dead bytes are then never copied back).")
        if rt.get("swapped_out_bytes"):
            how = ("With its SM copy kernel it copied", "simulated beside the kernels, at rates assumed, not yet "
                   "measured; UMRT_SWAP_COPY=engines copies on the copy engines") if rep.get("swap_copy") == "sm" else \
                ("Through the copy engines it copied", "simulated with nothing issued after a copy running beside it, "
                 "as an H200's timeline showed")
            lines.append(
                f"{how[0]} {format_bytes(rt['swapped_out_bytes'])} of live tensors to pinned "
                f"host memory and {format_bytes(rt.get('swapped_in_bytes', 0))} back, in {rt.get('swap_calls', 0)} "
                f"calls (the swap path; {how[1]}).")
        for phase, info in (rt.get("phases") or {}).items():
            if not info.get("acting", True):
                lines.append(f"umrt stopped acting in {PHASE_PLURALS.get(phase, phase)}: {info['stopped_because']}; "
                             "they run as plain Unified Memory (do no harm).")
        dev = rt.get("deviations", 0)
        lines.append(
            f"Deviations: {dev} — iterations that left their learned plan (the script's last, partial one, its "
            "teardown, usually does); umrt stops acting for the rest of such an iteration and learns again. "
            "Not an error." if dev else "Deviations: 0 — every acted iteration matched its learned plan.")
    if rep.get("named_iterations"):
        lines.append(describe_iterations(rep["named_iterations"]))
    if rep.get("iteration_times_s"):
        marks = {"train": "", "eval": " (eval)"}
        lines.append("Simulated iteration times, first to last (learning first, then acting): "
                     + ", ".join(f"{t * 1e3:.1f} ms{marks.get(p, f' ({p})')}"
                                 for t, p in zip(rep["iteration_times_s"], rep["iteration_phases"], strict=True)))
    lines.extend(rep["notes"])
    savings, savings_lines = _savings_table(rep)
    console = text_console(out)
    for line in head:
        console.print(line)
    console.print(table)
    if phases is not None:
        console.print(phases)
    for line in lines:
        console.print(line)
    if savings is not None:
        console.print(savings)
        for line in savings_lines:
            console.print(line)
    console.flush_to(out)


def _savings_table(rep: dict):
    """The memory-savings table and the lines under it (None when there are no rows)."""
    from rich.table import Table

    rows = rep.get("savings") or []
    if not rows:
        return None, []
    names = [k[:-2] for k in rows[0] if k.endswith("_x")]
    table = Table(title="How much GPU memory can this run save, at what cost? (SIMULATED)")
    table.add_column("GPU memory", justify="right")
    table.add_column("of the footprint", justify="right")
    for name in names:
        table.add_column(f"{name}: step / ideal", justify="right")
    for r in rows:
        pct = f"{r['fraction'] * 100:.0f}%" + (" (this run)" if r["own"] else "")
        table.add_row(format_bytes(r["budget_bytes"]), pct,
                      *[f"{r[f'{n}_x']:.2f}x" if r[f"{n}_x"] is not None else "failed" for n in names])
    lines = [f"Each cell: the steady training step time at that GPU memory over ideal ({rep['ideal_time_s'] * 1e3:.2f} ms, "
             "unlimited memory), simulated from this run's recording: um replayed, "
             f"{rep['policy']} fed the run's events as the live row."]
    for r in rows:  # a failed cell: why
        failed: dict[str, list[str]] = {}  # why -> the policies
        for n in names:
            if f"{n}_failed" in r:
                failed.setdefault(r[f"{n}_failed"], []).append(n)
        lines += [f"At {format_bytes(r['budget_bytes'])}, {' and '.join(ns)} failed: {why}" for why, ns in failed.items()]
    return table, lines


def _phase_sentences(runs: list[RunFigures], policy: str) -> list[str]:
    """Per phase, in plain words: the live policy's steady time against plain UM's and the oracle's."""
    by = {r.policy: r for r in runs}
    live = next((r for r in runs if r.how == "live"), None)
    if live is None:
        return []
    out = []
    for phase, figs in live.by_phase.items():
        others = [f"{name}'s {by[name].by_phase[phase].steady_s * 1e3:,.2f} ms" for name in ("um", "oracle")
                  if name in by and phase in by[name].by_phase]
        out.append(f"{PHASE_PLURALS.get(phase, phase).capitalize()} (steady): {policy} {figs.steady_s * 1e3:,.2f} ms"
                   + (f" against {' and '.join(others)}" if others else "") + ".")
    return out
