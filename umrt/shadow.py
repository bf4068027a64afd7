"""Shadow mode: run a real training script, show what the GPU would have done.

:func:`run_shadow` runs the user's PyTorch script unchanged under
:class:`umrt.capture.Recorder`: on the device the script picks (the CPU,
normally; the recorder follows the script onto a GPU if it moves there), with
no steering, so every op, kernel and random number is the script's own and its
losses are bit for bit those of a plain run. Every event the recorder emits goes,
live, to a driver that does what the GPU would: the runtime (or another
policy) sees the event and drives a simulated GPU
(:class:`~umrt.sim.backend.SimBackend`) through the ordinary
:class:`~umrt.backends.base.Backend` interface, exactly as it would drive
the ``cuda`` backend. When the script ends, the recorded trace is replayed,
first iteration to last, under ``ideal`` (unlimited memory) and ``um`` (plain
Unified Memory) for comparison (and under ``oracle``, which is handed the
whole recorded trace: the reference for how close the live runtime gets), so
that every policy is measured over the same iterations
(:mod:`umrt.phase_report`): a table reports each one's whole-run time,
traffic and faults, a second one the steady time per phase of the loop
(training steps, evaluation batches), and plain sentences what the runtime
prefetched, pre-evicted and discarded and which iterations it learned,
recovered in or deviated in. Every number is simulated.

Sizing the budget live. ``gpu_memory="20%"`` means 20% of the footprint the
job needs (:mod:`umrt.sim.budget`: the managed memory its allocations obtain
with nothing evicted, so "100%" fits), which is only known once the job has
run. The driver therefore holds the events of set-up and the first iteration
(the runtime learns from that iteration anyway and would not act in it),
replays their allocations through the layouts to measure that footprint,
sizes the simulated GPU from it, and then feeds the held events and
everything after them live, in order. The comparison replays use the same
byte budget, so the three rows are like for like; the whole trace's peak is
reported too (it is usually the first iteration's).

The simulator is compiled (:func:`umrt.sim.warmup.warm_up`) before the
script starts: never inside its first iteration, where a cold numba cache
would pause the program for up to a minute and leave reference cycles that
delay its frees (a cold and a warm cache would report different figures).
"""
from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

from umrt.capture import Recorder, StopRecording
from umrt.config import format_bytes
from umrt.drive.driver import Driver
from umrt.errors import ConfigError, UmrtError
from umrt.hardware import HardwareProfile, load_profile
from umrt.phase_report import (
    PHASE_PLURALS,
    RunFigures,
    describe_iterations,
    live_run,
    named_iterations,
    phase_table,
    replay_run,
)
from umrt.policy import make_policy
from umrt.policy.base import Policy, PolicyContext
from umrt.policy.runtime import Runtime
from umrt.scripts import run_script
from umrt.sim.backend import SimBackend
from umrt.sim.budget import Budget, needs_of_events, parse_budget, resolve_budget
from umrt.sim.replay import peak_live_bytes
from umrt.sim.warmup import warm_up
from umrt.trace.events import Event, IterationBoundary, Trace

__all__ = ["run_shadow", "ShadowSource"]


class ShadowSource:
    """A live event stream handed to a :class:`~umrt.drive.Driver` whose policy
    drives a simulated GPU (the recorder's listener).

    The set-up and the first iteration are held until the boundary that opens
    iteration 1: then the footprint is known, the simulated GPU is sized from it
    (:attr:`budget`) and the held events go to the driver, and every later event
    as it arrives. Events are handled one at a time, in the order they arrive:
    one that arrives while another is being handled (a storage freed by Python's
    garbage collector in the middle of the simulator's work) waits until that
    one is done, and none overtakes the held set-up events.
    """

    def __init__(self, policy: Policy, profile: HardwareProfile | str, gpu_memory: str | int = "20%") -> None:
        self.profile = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
        self.policy = policy
        self.gpu_memory = gpu_memory
        self.budget_bytes: int | None = None
        self.budget: Budget | None = None  # what budget_bytes is a share of
        self.peak_bytes = 0  # peak live bytes of the held events the GPU was sized from
        self.driver: Driver | None = None
        self.error: UmrtError | None = None
        self._held: list[Event] = []
        self._queue: deque[Event] = deque()
        self._handling = False

    # -- the listener ----------------------------------------------------------

    def __call__(self, event: Event) -> None:
        if self.error is not None:
            return
        self._queue.append(event)
        if self._handling:  # re-entered from our own handling: after the current event
            return
        self._handling = True
        try:
            while self._queue and self.error is None:
                ev = self._queue.popleft()
                try:
                    if self.driver is None:
                        self._hold(ev)
                    else:
                        self.driver.feed(ev)
                except UmrtError as exc:  # never break the user's script; report at the end
                    self.error = exc
        finally:
            self._handling = False
        if self.error is not None:
            self._queue.clear()

    def finish(self) -> None:
        """The script ended. A job that never completed an iteration never
        started the GPU: there is nothing to simulate, and the report says so."""
        self._held = []

    def _hold(self, event: Event) -> None:
        self._held.append(event)
        # Set-up and iteration 0 are held; the boundary that opens iteration 1 starts the GPU.
        if type(event) is IterationBoundary and event.index >= 1:
            self._start()

    def _start(self) -> None:
        needs = needs_of_events(self._held)
        self.peak_bytes = needs.peak_live_bytes
        self.budget = resolve_budget(self.gpu_memory, needs)
        self.budget_bytes = self.budget.bytes
        backend = SimBackend(self.profile, math.inf if self.policy.unlimited_memory else self.budget_bytes)
        layout = self.policy.make_layout(backend)
        self.policy.attach(PolicyContext(backend, layout, self.budget_bytes, self.profile))
        # Closed loop, as a live run: a launch reaches the policy only while it wants launches.
        self.driver = Driver(self.policy, layout, backend, profile=self.profile, launches_on_demand=True)
        held, self._held = self._held, []
        self.driver.feed_all(held)

    def iteration_times(self) -> list[float]:
        """Simulated time of each completed iteration."""
        return self.driver.iteration_times() if self.driver is not None else []

    def steady(self) -> dict:
        """Counters of the last complete iteration."""
        return self.driver.steady() if self.driver is not None else {}


def run_shadow(
    script: str,
    argv: list[str],
    *,
    profile: str,
    gpu_memory: str = "20%",
    policy: str = "umrt",
    steps: int | None = None,
    out: Callable[[str], None] | None = None,
) -> int:
    """Run ``script`` with ``argv`` in shadow mode and print the report.

    ``profile`` names a hardware profile (or a profile file); ``gpu_memory``
    is the simulated GPU memory ("20%" of the job's peak live bytes, or a
    size such as "8GiB"); ``policy`` the policy that drives it (default the
    umrt runtime); ``steps`` stops the script after that many iterations.
    Returns the script's exit status (2 if shadow mode itself failed).
    """
    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"script {script!r} not found")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be a positive number of iterations, got {steps}")
    prof = load_profile(profile)
    parse_budget(gpu_memory, 1 << 40)  # validate the form now, not after the job ran
    if policy == "oracle":
        raise ConfigError("the oracle needs the whole future; shadow mode runs live (use `umrt simulate` on a trace)")
    pol = make_policy(policy)
    driver = ShadowSource(pol, prof, gpu_memory)
    warm_up()  # compile the simulator now, not inside the script's first iteration

    status = 0
    # Unsteered: the script computes exactly what it computes without umrt (see umrt.capture.steer).
    rec = Recorder(listeners=[driver], stop_after=steps, model_name=path.stem, meta={"argv": list(argv)},
                   steer=False)
    with rec:
        try:
            status = run_script(str(path), list(argv))
        except StopRecording:
            pass
    driver.finish()
    trace = rec.trace()
    report = _report(trace, driver, prof, policy)
    _print(report, out)
    if driver.error is not None:
        raise driver.error
    return int(status)


# ---------------------------------------------------------------- the report


def _report(trace: Trace, driver: ShadowSource, prof, policy: str) -> dict:
    rep: dict = {"profile": prof.name, "policy": policy, "budget_bytes": driver.budget_bytes,
                 "budget_description": driver.budget.describe() if driver.budget is not None else None,
                 "gpu_memory": str(driver.gpu_memory), "sized_from_bytes": driver.peak_bytes,
                 "peak_live_bytes": peak_live_bytes(trace), "iterations": len(trace.iteration_spans()),
                 "rows": [], "runs": [], "runtime": {}, "notes": []}
    if driver.budget_bytes is None or not trace.iteration_spans() or driver.driver is None:
        rep["notes"].append("the script completed no training iteration: nothing to simulate")
        return rep
    # Every policy over the same iterations: the recorded run, first to last; the steady
    # figures of each phase leave out the live policy's warm-up (and the run's first).
    skip = max(1, driver.policy.warmup_iterations)
    runs: list[RunFigures] = []
    for name in ("ideal", "um", "oracle"):
        try:
            runs.append(replay_run(trace, name, prof, driver.budget_bytes, skip))
        except UmrtError as exc:
            rep["notes"].append(f"{name} replay failed: {exc}")
    live = live_run(policy, driver.driver, skip)
    if live.times:
        runs.append(live)
    rep["runs"] = [r.to_json() for r in runs]
    rep["skip"] = skip
    ideal_total = next((r.totals["time_s"] for r in runs if r.policy == "ideal"), 0.0)
    for r in runs:
        rep["rows"].append({"policy": r.policy, "how": r.how, "iterations": len(r.times), **r.totals,
                            "vs_ideal": r.totals["time_s"] / ideal_total if ideal_total > 0 else float("nan")})
    um = next((r for r in rep["rows"] if r["policy"] == "um"), None)
    row = next((r for r in rep["rows"] if r["how"] == "live"), None)
    if um and row and row["time_s"] > 0:
        rep["speedup_vs_um"] = um["time_s"] / row["time_s"]
    if live.times and len(live.times) != rep["iterations"]:
        rep["notes"].append(f"the live run simulated {len(live.times)} of the {rep['iterations']} recorded "
                            "iterations; the replays ran all of them")
    rep["iteration_times_s"] = live.times
    rep["iteration_phases"] = live.phases
    rep["runtime"] = dict(driver.policy.report() or {})
    if isinstance(driver.policy, Runtime):
        rep["named_iterations"] = named_iterations(driver.policy.log)
    if driver.error is not None:
        rep["notes"].append(f"the simulated run stopped: {driver.error}")
    rep["_runs"] = runs  # for the printed tables (not part of the JSON-able report)
    return rep


#: What each row and column of the report means, printed under the tables.
LEGEND = (
    "Each row of the first table: the whole run, simulated, under one policy; every policy runs the same "
    "recorded iterations, first to last.",
    "  ideal: a GPU with unlimited memory (nothing moves: the floor).",
    "  um: plain Unified Memory (the driver migrates pages when a kernel faults on them).",
    "  oracle: the fastest of several plans made knowing the whole recorded run in advance "
    "(the reference: nothing live can beat it).",
    "  run: replay = simulated afterwards from the recorded trace; live = driven event by event "
    "while the script ran, as on a GPU.",
    "  H2D / D2H: bytes moved host to GPU / GPU to host over the run; faults: GPU page faults "
    "(64 KiB pages) over the run; evictions: 2 MiB blocks the driver pushed out to make room, over the run.",
    "The second table: per phase of the loop (a training step; one batch of an evaluation), its steady time "
    "per iteration under each policy: the mean over that phase's iterations after the first {skip} of the "
    "run (umrt's learning; the same iterations for every policy); and the whole run's total.",
)


def _print(rep: dict, out: Callable[[str], None] | None) -> None:
    """Render the report: a title, what was measured, the tables, their legend, and
    in plain words where the policy stands and what it did."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, highlight=False, width=max(110, Console().width)) if out is None else None
    budget = rep.get("budget_bytes")
    sized = rep.get("sized_from_bytes") or 0
    memory = (f"{rep['budget_description']}, sized from set-up and the first iteration"
              if rep.get("budget_description") and sized else f"GPU memory {format_bytes(budget or 0)}")
    title = f"umrt shadow run — what a {rep['profile']} GPU would have done (SIMULATED)"
    table = Table(title=title)
    for col in ("policy", "run", "whole run", "vs ideal", "H2D", "D2H", "faults", "evictions"):
        table.add_column(col, justify="left" if col in ("policy", "run") else "right")
    for r in rep["rows"]:
        table.add_row(r["policy"], r["how"], f"{r['time_s'] * 1e3:,.2f} ms", f"{r['vs_ideal']:.2f}x",
                      format_bytes(r["h2d_bytes"]), format_bytes(r["d2h_bytes"]), f"{r['faults']:,}",
                      f"{r['evictions']:,}")
    runs = rep.get("_runs") or []
    phases = phase_table(runs, "Steady time per iteration, by phase of the loop (SIMULATED)") if runs else None
    head = [
        f"Measured on this machine: the script ran {rep.get('iterations', 0)} complete iteration(s) "
        f"on the CPU, unchanged (its losses are a plain run's); their peak live memory was "
        f"{format_bytes(rep['peak_live_bytes'])}. The step times it printed include umrt recording every op, "
        "and the first run on a machine a one-off compile of the simulator: they are not GPU times.",
        f"Simulated: a GPU with {memory}; nothing ran on a GPU.",
    ]
    lines = [line.format(skip=rep.get("skip", 1)) for line in LEGEND]
    live = next((r for r in rep["rows"] if r["how"] == "live"), None)
    if "speedup_vs_um" in rep and live is not None:
        x = rep["speedup_vs_um"]
        than = f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"
        lines.append(f"In plain words: {rep['policy']} is {live['vs_ideal']:.1f}x slower than a GPU with enough "
                     f"memory, and {than} than plain Unified Memory over the whole run ({live['iterations']} "
                     "iterations, simulated).")
    lines.extend(_phase_sentences(runs, rep["policy"]))
    rt = rep.get("runtime") or {}
    if "prefetched_bytes" in rt:
        lines.append(
            f"What umrt did: it learned the iteration from {rt.get('learned', 0)} iteration(s), then acted on "
            f"{rt.get('acted', 0)} ({rt.get('light_iterations', 0)} of them without recording ops, as a live run "
            f"does once it trusts its plan); over the run it prefetched {format_bytes(rt['prefetched_bytes'])} to the "
            f"GPU and pre-evicted {format_bytes(rt['evicted_bytes'])} to the host in {rt.get('prefetch_calls', 0)} calls, "
            f"at {rt.get('decisions', 0)} decision points (the places in an iteration where it acts: module "
            f"boundaries, at least a few ms of compute apart), and discarded {format_bytes(rt['discarded_bytes'])} "
            f"of dead tensors' memory in {rt.get('discard_calls', 0)} calls (dead bytes are then never copied back).")
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
    if console is not None:
        for line in head:
            console.print(line)
        console.print(table)
        if phases is not None:
            console.print(phases)
        for line in lines:
            console.print(line)
    else:
        from io import StringIO

        buf = StringIO()
        printer = Console(file=buf, width=110, highlight=False)
        printer.print(table)
        if phases is not None:
            printer.print(phases)
        out("\n".join(head) + "\n" + buf.getvalue() + "\n".join(lines))


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
