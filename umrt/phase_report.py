"""A run's figures by loop phase, for every policy over the same iterations.

A real training loop has iterations of different shapes: training steps, and
the batches of an evaluation every few steps (``IterationBoundary.phase``). A
report that compares policies must compare the same iterations: this module
replays a recorded run under each policy from its first iteration to its last
(:func:`replay_run`), takes the live run's own iterations (:func:`live_run`),
and reduces each to :class:`RunFigures`: the whole run's time and traffic,
and per phase its *steady* time, the mean over the phase's iterations after
the first ``skip`` of the run (the runtime's learning and probing, or its learning
alone in a run no longer than that: :func:`steady_skip`; the same iterations for
every policy). :func:`phase_table` renders them, one row per
phase and the whole run, one column per policy; :func:`named_iterations`
names the iterations umrt's runtime learned, recovered in, deviated in or
held back in (from its log).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from umrt.drive.driver import Driver
from umrt.policy import make_policy
from umrt.policy.base import PolicyContext
from umrt.sim.backend import SimBackend
from umrt.sim.replay import iteration_stream, simulate
from umrt.trace.events import PHASES

if TYPE_CHECKING:  # pragma: no cover
    from rich.table import Table

    from umrt.hardware import HardwareProfile
    from umrt.trace.events import Trace

__all__ = ["RunFigures", "PhaseFigures", "replay_run", "live_run", "phase_table", "named_iterations",
           "describe_iterations", "steady_skip", "PHASE_LABELS", "PHASE_PLURALS", "TOTALS"]

#: How a phase is named in reports: one iteration of it, and several.
PHASE_LABELS = {"train": "training step", "eval": "evaluation batch"}
PHASE_PLURALS = {"train": "training steps", "eval": "evaluation batches"}
#: The whole-run counters a run's figures add up (the simulator's names).
TOTALS = ("time_s", "h2d_bytes", "d2h_bytes", "faults", "evictions")


@dataclass
class PhaseFigures:
    """One phase of one run: how many of its iterations there were, how many are
    steady (after the run's first ``skip``), and their mean time."""

    iterations: int
    steady_iterations: int
    steady_s: float
    total_s: float


@dataclass
class RunFigures:
    """One policy over a whole run: its iterations' times and phases, the run's
    totals (:data:`TOTALS`), and per phase :class:`PhaseFigures`."""

    policy: str
    how: str  # "replay" (simulated afterwards from the trace) or "live" (driven as the script ran)
    times: list[float]
    phases: list[str]
    totals: dict[str, float]
    by_phase: dict[str, PhaseFigures] = field(default_factory=dict)
    compute: list[float] = field(default_factory=list)  # each iteration's GPU compute alone (its shape's work)

    @classmethod
    def of(cls, policy: str, how: str, marks: Sequence[dict], phases: Sequence[str], skip: int) -> RunFigures:
        """Figures from a simulated backend's counters at each iteration boundary
        (``Driver.marks``) and each iteration's phase."""
        times = [b["time_s"] - a["time_s"] for a, b in zip(marks, marks[1:], strict=False)]
        phases = list(phases[: len(times)])
        totals = {k: (marks[-1][k] - marks[0][k]) if len(marks) > 1 else 0 for k in TOTALS}
        compute = [b.get("compute_s", 0.0) - a.get("compute_s", 0.0) for a, b in zip(marks, marks[1:], strict=False)]
        run = cls(policy, how, times, phases, totals, compute=compute)
        run.by_phase = phase_figures(times, phases, skip)
        return run

    def to_json(self) -> dict:
        return {"policy": self.policy, "how": self.how, "iterations": len(self.times), **self.totals,
                "iteration_times_s": self.times, "phases": self.phases,
                "by_phase": {p: vars(f) for p, f in self.by_phase.items()}}


def steady_skip(iterations: int, warmup: int, learned: Sequence[int] = ()) -> tuple[int, str]:
    """How many of a run's first iterations its steady figures leave out, and a note for
    the report where that is not the live policy's whole warm-up ("" where it is).

    ``iterations``: the run's; ``warmup``: the live policy's warm-up (learning, then probing
    its plan: ``Policy.warmup_iterations``); ``learned``: the iterations it learned in. The
    run's first iteration (set-up: every first touch) is always left out. A run no longer
    than the warm-up leaves out the learning iterations the policy started with instead,
    so its steady figures are those of iterations that acted, not its learning's."""
    skip = max(1, warmup)
    if iterations > skip:
        return skip, ""
    done = set(learned)
    first = 1
    while first in done:
        first += 1
    if iterations > first:
        return first, (f"The run is not longer than the live policy's warm-up of {skip} iterations: its steady figures "
                       f"are those after its learning (the first {first}), some of them still probing its plan; a run "
                       f"of more than {skip} iterations gives steady-state figures.")
    return first, ("No iteration came after the live policy's learning: the steady figures are every iteration's, "
                   "learning included.")


def phase_figures(times: Sequence[float], phases: Sequence[str], skip: int) -> dict[str, PhaseFigures]:
    """Per phase: its iterations, and the mean time of those after the run's first
    ``skip`` (all of them where none comes after)."""
    out: dict[str, PhaseFigures] = {}
    for phase in sorted(set(phases), key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES)):
        every = [t for t, p in zip(times, phases, strict=True) if p == phase]
        steady = [t for i, (t, p) in enumerate(zip(times, phases, strict=True)) if p == phase and i >= skip] or every
        out[phase] = PhaseFigures(len(every), len(steady), statistics.fmean(steady), math.fsum(every))
    return out


def replay_run(trace: Trace, policy: str, profile: HardwareProfile, budget_bytes: int, skip: int) -> RunFigures:
    """``trace``'s recorded iterations, first to last, replayed under ``policy`` on
    the simulated GPU (as :func:`umrt.sim.replay.simulate` does, without repeating
    any): the run's figures."""
    pol = make_policy(policy, trace)
    backend = SimBackend(profile, math.inf if pol.unlimited_memory else budget_bytes)
    layout = pol.make_layout(backend)
    pol.attach(PolicyContext(backend, layout, budget_bytes, profile, simulate=simulate))
    driver = Driver(pol, layout, backend, profile=profile, strict=True)
    spans = trace.iteration_spans()
    driver.feed_all(iteration_stream(trace, spans, len(spans)))
    return RunFigures.of(policy, "replay", driver.marks, driver.phases, skip)


def live_run(policy: str, driver: Driver, skip: int) -> RunFigures:
    """The figures of a run driven live (shadow mode's driver)."""
    return RunFigures.of(policy, "live", driver.marks, driver.phases, skip)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def phase_table(runs: Sequence[RunFigures], title: str) -> Table:
    """One row per phase (its steady time per iteration, under each policy) and one
    for the whole run (its total time), one column per policy."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("phase")
    table.add_column("iterations", justify="right")
    for run in runs:
        table.add_column(run.policy, justify="right")
    phases = list(runs[0].by_phase) if runs else []
    for phase in phases:
        figs = [run.by_phase.get(phase) for run in runs]
        first = next(f for f in figs if f is not None)
        table.add_row(f"{PHASE_LABELS.get(phase, phase)} (steady)", f"{first.steady_iterations} of {first.iterations}",
                      *(_ms(f.steady_s) if f is not None else "-" for f in figs))
    if runs:
        table.add_row("whole run (total)", str(len(runs[0].times)), *(_ms(r.totals["time_s"]) for r in runs))
    return table


#: What each kind of iteration in the runtime's log is called, in the order reports list them.
_NAMED = (("learned", "learned"), ("recovered", "recovered after leaving a plan"),
          ("deviated", "deviated from their plan"), ("held", "held back (acting loses there)"),
          ("unsure", "learned with their predicted plan only checked (predictions kept failing there)"),
          ("rested", "rested (their shapes never repeated: run as plain Unified Memory, not recorded, "
                     "until one came back)"))


def named_iterations(log: Sequence[dict]) -> dict[str, list[tuple[int, str]]]:
    """The iterations umrt's runtime learned, recovered in (ran on after leaving a
    plan, or re-based its launch-free clock on), deviated in, held back in, learned
    acting on no prediction (:meth:`~umrt.policy.runtime.guard.Guard.unsure`), or rested
    in (:mod:`umrt.policy.runtime.rest`), each as ``(index, phase)``, from its log (``Runtime.log``)."""
    out: dict[str, list[tuple[int, str]]] = {name: [] for name, _ in _NAMED}
    for e in log:
        where = (e["iteration"], e.get("phase", "train"))
        if e.get("deviated"):
            out["deviated"].append(where)
        mode = e["mode"]
        if mode == "learn":
            out["learned"].append(where)
        elif mode in ("off", "rebase"):
            out["recovered"].append(where)
        elif mode == "none":
            out["rested" if e.get("rested") else "held"].append(where)
        if e.get("unsure"):
            out["unsure"].append(where)
    return out


def describe_iterations(named: dict[str, list[tuple[int, str]]], limit: int = 12) -> str:
    """``named_iterations`` in one sentence: how many of each, and which."""
    parts = []
    for name, label in _NAMED:
        items = named.get(name, [])
        shown = ", ".join(f"{i}{'' if p == 'train' else f' ({p})'}" for i, p in items[:limit])
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        parts.append(f"{len(items)} {label}" + (f" ({shown}{more})" if items else ""))
    return "Iterations: " + "; ".join(parts) + "."
