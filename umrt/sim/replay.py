"""Replay a trace under a policy on the simulated GPU: :func:`simulate`.

The replay is a source of events for the :class:`~umrt.drive.Driver`, which
feeds them to the policy, its layout and a :class:`~umrt.sim.backend.SimBackend`
in program order, exactly as the live runtime would see them. It replays the set-up and the recorded iterations, then repeats the last
recorded iteration (with fresh object ids, so each repetition allocates new
objects) until ``iterations`` iterations were simulated, and reports the last
one: the steady state. Objects created with no launch (``Alloc.launch == -1``:
parameters and inputs made on the host) start out written in host memory.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import replace

from umrt.drive.driver import Driver
from umrt.errors import ConfigError, TraceFormatError
from umrt.hardware import HardwareProfile, load_profile
from umrt.policy import make_policy
from umrt.policy.base import Policy, PolicyContext
from umrt.sim.backend import SimBackend
from umrt.sim.budget import parse_budget, peak_live_bytes, resolve_budget
from umrt.sim.result import BREAKDOWN_KEYS, SimResult
from umrt.trace.events import Access, Alloc, Event, Free, IterationBoundary, Launch, Trace

__all__ = ["simulate", "iteration_stream", "parse_budget", "peak_live_bytes", "resolve_budget"]


def simulate(
    trace: Trace,
    policy: Policy | str,
    profile: HardwareProfile | str,
    budget: int | str,
    iterations: int = 3,
    progress: bool = False,
    budget_base: str = "footprint",
    swap_copy: str | None = None,
) -> SimResult:
    """Simulate ``iterations`` training iterations of ``trace`` under ``policy``.

    ``profile`` is a :class:`~umrt.hardware.HardwareProfile`, a shipped
    profile name or a profile file; ``budget`` is the GPU memory the run may
    use: a size, or a percentage of the footprint the run needs
    (``budget_base="footprint"``, see :mod:`umrt.sim.budget`) or of the
    trace's peak live bytes (``"peak"``); a policy with
    ``unlimited_memory = True`` runs with unbounded GPU memory. A policy
    given by name is built with ``umrt.policy.make_policy(name, trace)``.
    ``swap_copy``: what copies swapped ranges (None: as ``UMRT_SWAP_COPY`` says).
    """
    t_wall = time.perf_counter()
    if not isinstance(profile, HardwareProfile):
        profile = load_profile(profile)
    if isinstance(policy, str):
        policy = make_policy(policy, trace)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigError(f"iterations must be a positive integer, got {iterations!r}")
    spans = trace.iteration_spans()
    if not spans:
        raise TraceFormatError("the trace holds no complete iteration (it needs two IterationBoundary events)")
    resolved = resolve_budget(budget, trace, budget_base)
    budget_bytes = resolved.bytes
    backend = SimBackend(profile, math.inf if policy.unlimited_memory else budget_bytes, swap_copy)
    layout = policy.make_layout(backend)
    policy.attach(PolicyContext(backend=backend, layout=layout, budget_bytes=budget_bytes, profile=profile,
                                simulate=simulate))

    total_events = spans[0][0] + sum(
        (spans[min(i, len(spans) - 1)][1] - spans[min(i, len(spans) - 1)][0]) for i in range(iterations))
    bar = _Progress(progress, total_events, f"simulate {policy.name}")
    driver = Driver(policy, layout, backend, profile=profile, strict=True)
    with bar:
        driver.feed_all(bar.counting(iteration_stream(trace, spans, iterations)))
    marks, peaks, compute = driver.marks, driver.peaks, driver.ideal_s
    first, last = marks[-2], marks[-1]
    delta = {k: last[k] - first[k] for k in last}
    return SimResult(
        model=str(trace.header.model),
        policy=policy.name,
        profile=profile.name,
        budget_bytes=budget_bytes,
        iterations=iterations,
        iteration_time_s=delta["time_s"],
        ideal_time_s=compute[-2],
        h2d_bytes=delta["h2d_bytes"],
        d2h_bytes=delta["d2h_bytes"],
        faults=delta["faults"],
        fault_batches=delta["fault_batches"],
        evictions=delta["evictions"],
        peak_resident_bytes=peaks[-1],
        page_events=backend.page_events,
        launches=delta["launches"],
        breakdown={k: float(delta[k]) for k in BREAKDOWN_KEYS},
        iteration_times_s=[b["time_s"] - a["time_s"] for a, b in zip(marks, marks[1:], strict=False)],
        peak_live_bytes=resolved.needs.peak_live_bytes,
        footprint_bytes=int(layout.footprint()),
        wall_s=time.perf_counter() - t_wall,
        policy_report=dict(policy.report() or {}),
        budget=resolved,
    )


# ---------------------------------------------------------------- event stream


def iteration_stream(trace: Trace, spans: list[tuple[int, int]], iterations: int) -> Iterator[Event]:
    """The events a simulation of ``iterations`` iterations replays: the set-up, the
    recorded iterations (``spans``, from ``trace.iteration_spans()``), then repetitions
    of the last one with fresh object ids, then a closing boundary."""
    events = trace.events
    yield from events[: spans[0][0]]
    recorded = spans[:iterations]
    for a, b in recorded:
        yield from events[a:b]
    repeats = iterations - len(recorded)
    if repeats:
        yield from _repeat(trace, spans[-1], len(recorded), repeats)
    yield IterationBoundary(iterations)


def replayable_iterations(trace: Trace, wanted: int) -> int:
    """``wanted``, or the recorded iterations where the last one cannot be repeated (it
    frees objects from before the loop that nothing it allocates stands in for: a
    script's teardown, say)."""
    spans = trace.iteration_spans()
    if not spans or wanted <= len(spans):
        return wanted
    events, born_ids, _, pairs = _carried(trace, spans[-1])
    freed = {e.obj for e in events if isinstance(e, Free)}
    return wanted if not (freed - born_ids - set(pairs)) else len(spans)


def _carried(trace: Trace, span: tuple[int, int]) -> tuple[list[Event], set[int], list[Alloc], dict[int, int]]:
    """Iteration ``span``'s events, the objects it allocates, its carried-out allocations (not
    freed in it), and its carried-in objects (freed, not allocated, in it) paired with them."""
    events = trace.events[span[0] : span[1]]
    born = [e for e in events if isinstance(e, Alloc)]
    born_ids = {e.obj for e in born}
    freed = {e.obj for e in events if isinstance(e, Free)}
    carried_out = [e for e in born if e.obj not in freed]
    alloc_of = {e.obj: (i, e) for i, e in enumerate(trace.events[: span[0]]) if isinstance(e, Alloc)}
    carried_in = [alloc_of[o][1] for o in sorted(freed - born_ids, key=lambda o: alloc_of.get(o, (-1,))[0])
                  if o in alloc_of]
    return events, born_ids, carried_out, _match(carried_in, carried_out)


def _repeat(trace: Trace, span: tuple[int, int], first_index: int, repeats: int) -> Iterator[Event]:
    """The iteration ``span`` again, ``repeats`` times, with fresh object ids.

    Objects the iteration frees but did not allocate (carried in from the
    previous iteration, e.g. the last step's loss) are matched, in order, to
    the objects it allocates and does not free (carried out to the next).
    """
    events, born_ids, carried_out, pairs = _carried(trace, span)
    launches = [e.seq for e in events if isinstance(e, Launch)]
    seq0 = launches[0] if launches else 0
    next_seq = max((e.seq for e in trace.events if isinstance(e, Launch)), default=-1) + 1
    next_obj = max((e.obj for e in trace.events if isinstance(e, Alloc)), default=-1) + 1
    prev_out = {e.obj: e.obj for e in carried_out}  # carried-out object -> its id in the last repetition
    for r in range(repeats):
        ids: dict[int, int] = {}
        for o in born_ids:
            ids[o] = next_obj
            next_obj += 1
        for inn, out in pairs.items():
            ids[inn] = prev_out[out]
        shift = next_seq - seq0
        for e in events:
            if isinstance(e, Launch):
                accesses = tuple(
                    a if a.obj not in ids else Access(ids[a.obj], a.offset, a.length, a.write) for a in e.accesses
                )
                yield replace(e, seq=e.seq + shift, accesses=accesses)
            elif isinstance(e, Alloc):
                yield replace(e, obj=ids[e.obj], launch=e.launch + shift if e.launch >= 0 else -1)
            elif isinstance(e, Free):
                if e.obj in born_ids or e.obj in pairs:
                    yield Free(ids[e.obj])
                # else: an object from before the loop already freed by the recorded iteration
            elif isinstance(e, IterationBoundary):
                yield IterationBoundary(first_index + r)
            else:
                yield e
        next_seq += len(launches)
        prev_out = {e.obj: ids[e.obj] for e in carried_out}


def _match(carried_in: list[Alloc], carried_out: list[Alloc]) -> dict[int, int]:
    """Pair carried-in objects with carried-out ones of the same size and kind, in order."""
    pending: dict[tuple[int, int], list[int]] = {}
    for e in carried_out:
        pending.setdefault((e.nbytes, int(e.kind)), []).append(e.obj)
    pairs: dict[int, int] = {}
    for e in carried_in:
        queue = pending.get((e.nbytes, int(e.kind)))
        if queue:
            pairs[e.obj] = queue.pop(0)
    return pairs


# ---------------------------------------------------------------- helpers


class _Progress:
    """A rich progress bar over events, or nothing."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("events"), TimeElapsedColumn(), transient=True)
            self._task = self._bar.add_task(label, total=total)

    def __enter__(self) -> _Progress:
        if self._bar:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar:
            self._bar.__exit__(*exc)

    def counting(self, events: Iterator[Event]) -> Iterator[Event]:
        """``events``, moving the bar every 2,048 of them and to the end when they end."""
        if not self._bar:
            yield from events
            return
        n = 0
        for n, ev in enumerate(events):  # noqa: B007 - n is read after the loop
            if n % 2048 == 0:
                self._bar.update(self._task, completed=n)
            yield ev
        self._bar.update(self._task, completed=self._bar.tasks[0].total)
