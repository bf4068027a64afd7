"""Replay a recorded live run in closed loop: ``python -m bench.live_replay``.

A live run's iterations come in two variants: while the runtime wants launches
the recorder's dispatch mode is on, and the program runs differently (on the
H100 GPT-2 made 1,101 allocations per iteration with it, 1,053 without: see
``tests/data/gpu-evidence/README.md``). The recorded live logs are open loop:
the runtime that made them chose which variant came next. :class:`ClosedLoop`
rebuilds a source that answers the runtime being replayed: each event of an
iteration comes from the recorded variant while ``wants_launches`` is true
and from the allocation-only variant otherwise, switching mid-iteration where
the runtime does (the two variants are aligned on their allocations, frees and
module boundaries). Objects get fresh ids every iteration, by role: an
object's allocation ordinal in the recorded variant.

The replay drives the runtime on the simulator (:class:`~umrt.sim.backend.SimBackend`,
the runtime's own pool as its layout) and reports, per iteration: the runtime's
mode, whether it ran without launches, its deviations, the simulated time,
bytes moved and calls made. Simulated figures, on the profile given.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import functools
import gzip
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from umrt.backends.base import Backend, ForwardingBackend
from umrt.cli import Renamed
from umrt.config import parse_amount
from umrt.drive.driver import Driver
from umrt.errors import ConfigError
from umrt.hardware import load_profile
from umrt.policy.base import PolicyContext
from umrt.policy.runtime import Runtime
from umrt.sim.backend import SimBackend
from umrt.trace.events import (
    Access,
    Alloc,
    Event,
    Free,
    IterationBoundary,
    Kind,
    Launch,
    LayerEnter,
    LayerExit,
)

LOGS = Path(__file__).resolve().parent.parent / "tests" / "data" / "gpu-evidence"
RUNS = {"40GiB": "live-gpt2-b8s1024-budget40GiB.log.gz", "50pct": "live-gpt2-b8s1024-budget50pct.log.gz"}

_TYPES = {"Alloc": Alloc, "Free": Free, "Launch": Launch, "IterationBoundary": IterationBoundary,
          "LayerEnter": LayerEnter, "LayerExit": LayerExit}
_ACCESS = re.compile(r"Access\(obj=(\d+), offset=(\d+), length=(\d+), write=(True|False)\)")
_KIND = re.compile(r"<Kind\.\w+: (\d+)>")
_FIELD = re.compile(r"(?<![\w'\"])(\w+)=")


def parse_event(text: str) -> Event:
    """One event from its ``repr`` (no ``eval``: fields are read as literals)."""
    m = re.fullmatch(r"(\w+)\((.*)\)", text.strip())
    if m is None or m.group(1) not in _TYPES:
        raise ValueError(f"not an umrt event: {text[:80]!r}")
    body = _ACCESS.sub(r"(\1, \2, \3, \4)", m.group(2))
    body = _KIND.sub(r"\1", body)
    fields = ast.literal_eval("{" + _FIELD.sub(r"'\1': ", body) + "}")
    cls = _TYPES[m.group(1)]
    if cls is Alloc:
        fields["kind"] = Kind(fields["kind"])
    elif cls is Launch:
        fields["accesses"] = tuple(Access(*a) for a in fields["accesses"])
    return cls(**fields)


def read_live_log(path: str | Path) -> list[Event]:
    """The events of a live log (``perf_counter<TAB>repr`` per line, gzip or plain)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [parse_event(line.split("\t", 1)[1]) for line in f if line.strip()]


def _iterations(events: Sequence[Event]) -> list[list[Event]]:
    """The events of each iteration (after its boundary, up to the next), in order."""
    out: list[list[Event]] = []
    for ev in events:
        if type(ev) is IterationBoundary:
            out.append([])
        elif out:
            out[-1].append(ev)
    return out


def _token(ev: Event, size: dict[int, int]) -> tuple | None:
    t = type(ev)
    if t is Alloc:
        return ("A", ev.nbytes)
    if t is Free:
        return ("F", size.get(ev.obj, -1))
    if t is LayerEnter or t is LayerExit:
        return (t.__name__, ev.module, ev.phase)
    return None


@dataclass(frozen=True)
class _Slot:
    """One place in the merged iteration: ``which`` is "both", "rec", "light" or "launch"."""

    which: str
    rec: Event | None
    light: Event | None


class ClosedLoop:
    """Iterations of a live log, replayed in closed loop (see the module docstring).

    Args:
        events: the log's events, from its first boundary.
        recorded: index of a complete recorded iteration to use as that
            variant (default: the last one before the first iteration that ran
            without launches); the iteration before it must be recorded too.
        light: index of an allocation-only iteration (default: the first).
        start: the first iteration made in closed loop (default 2: the runtime
            learns the first two whatever it does); the log's iterations before
            it are replayed as they are, and the one just before it must be a
            recorded iteration of the same shape.
    """

    def __init__(self, events: Sequence[Event], recorded: int | None = None, light: int | None = None,
                 start: int = 2) -> None:
        its = _iterations(events)
        launches = [sum(type(e) is Launch for e in it) for it in its]
        if light is None:
            light = next((i for i, n in enumerate(launches) if i > 0 and n < launches[1] // 4), None)
            if light is None:
                raise ValueError("the log holds no iteration that ran without launches")
        if recorded is None:
            recorded = light - 1
        if not 1 <= recorded < len(its) or not 1 <= light < len(its) or not 1 <= start <= recorded:
            raise ValueError(f"iterations {recorded} / {light} / {start} do not fit the log ({len(its)} iterations)")
        self.prefix = list(events[: sum(len(it) + 1 for it in its[:start])])
        self.first_index = start
        born: dict[int, tuple[int, int]] = {}  # obj -> (iteration, allocation ordinal)
        size: dict[int, int] = {}
        for i, it in enumerate(its):
            n = 0
            for ev in it:
                if type(ev) is Alloc:
                    born[ev.obj], size[ev.obj] = (i, n), ev.nbytes
                    n += 1
        rec_it, light_it = its[recorded], its[light]
        rec_ne = [ev for ev in rec_it if type(ev) is not Launch]
        light_ne = [ev for ev in light_it if type(ev) is not Launch]
        sm = difflib.SequenceMatcher(None, [_token(e, size) for e in rec_ne], [_token(e, size) for e in light_ne],
                                     autojunk=False)
        match = {}
        for a, b, n in sm.get_matching_blocks():
            for k in range(n):
                match[a + k] = b + k
        self.matched = len(match) / max(1, max(len(rec_ne), len(light_ne)))
        # Roles: an object's allocation ordinal in the recorded variant; the
        # allocation-only variant's own newborns map through the alignment.
        light_role: dict[int, object] = {}
        for i, j in match.items():
            if type(rec_ne[i]) is Alloc:
                light_role[born[light_ne[j].obj][1]] = born[rec_ne[i].obj][1]
        self._role: dict[tuple[int, int], object] = {}

        def role(obj: int, template: int) -> tuple:
            it_born, ordinal = born.get(obj, (-1, -1))
            if it_born == template:
                r = ordinal if template == recorded else light_role.get(ordinal, ("light", ordinal))
                return ("cur", r)
            if it_born == template - 1:
                return ("prev", ordinal)  # the iteration before either variant was recorded
            return ("old", obj)

        self._roles = {id(ev): role(ev.obj, recorded) for ev in rec_it if type(ev) in (Alloc, Free)}
        self._roles.update({id(ev): role(ev.obj, light) for ev in light_it if type(ev) in (Alloc, Free)})
        self._access_roles = {
            id(ev): tuple(role(a.obj, recorded) for a in ev.accesses) for ev in rec_it if type(ev) is Launch}
        # The merged iteration, in the recorded variant's order.
        slots: list[_Slot] = []
        j_next = 0
        i = 0
        for ev in rec_it:
            if type(ev) is Launch:
                slots.append(_Slot("launch", ev, None))
                continue
            j = match.get(i)
            if j is not None:
                slots.extend(_Slot("light", None, light_ne[k]) for k in range(j_next, j))
                j_next = j + 1
                slots.append(_Slot("both", ev, light_ne[j]))
            else:
                slots.append(_Slot("rec", ev, None))
            i += 1
        slots.extend(_Slot("light", None, light_ne[k]) for k in range(j_next, len(light_ne)))
        self.slots = slots
        before = [ev for ev in its[start - 1] if type(ev) is Alloc]
        if [e.nbytes for e in before] != [e.nbytes for e in rec_it if type(e) is Alloc]:
            raise ValueError(f"iteration {start - 1} is not a recorded iteration of the shape of {recorded}")
        self._prev0 = {("prev", born[ev.obj][1]): ev.obj for ev in before}

    def stream(self, iterations: int, wants_launches: Callable[[], bool], *, lag: bool = False
               ) -> Iterator[tuple[Event, bool]]:
        """``(event, seen)``: the log up to the recorded variant, then iterations
        until ``iterations`` in all, each event chosen by ``wants_launches()`` as it
        comes. ``seen`` is False for a launch the capture does not record (it still
        runs on the GPU).

        ``lag``: a capture that resumes (launches wanted again) only at its next
        module hook, as the live recorder does from inside the allocator.
        """
        for ev in self.prefix:
            yield ev, True
        next_id = 1 + max((e.obj for e in self.prefix if type(e) is Alloc), default=0)
        prev = dict(self._prev0)  # ("prev", role) -> object of the previous iteration
        recording = True
        for index in range(self.first_index, iterations):
            yield IterationBoundary(index), True
            cur: dict[tuple, int] = {}
            for slot in self.slots:
                want = wants_launches()
                if not want:
                    recording = False
                elif not recording and (not lag or type(slot.rec or slot.light) in (LayerEnter, LayerExit)):
                    recording = True
                if slot.which == "launch":
                    yield self._launch(slot.rec, cur, prev), recording
                    continue
                if slot.which == "both":
                    src = slot.rec if recording else slot.light
                elif slot.which == "rec":
                    src = slot.rec if recording else None
                else:
                    src = slot.light if not recording else None
                if src is None:
                    continue
                t = type(src)
                if t is Alloc:
                    kind, r = self._roles[id(src)]
                    cur[(kind, r)] = next_id
                    yield Alloc(next_id, src.nbytes, src.kind, src.launch), True
                    next_id += 1
                elif t is Free:
                    obj = self._object(self._roles[id(src)], cur, prev)
                    if obj is not None:
                        yield Free(obj), True
                else:
                    yield src, True
            # Objects born this iteration and still alive are the next one's "prev".
            prev = {("prev", r): obj for (kind, r), obj in cur.items() if kind == "cur"}

    @staticmethod
    def _object(role: tuple, cur: dict, prev: dict) -> int | None:
        kind, r = role
        if kind == "cur":
            return cur.pop(("cur", r), None)
        if kind == "prev":
            return prev.pop(("prev", r), None)
        return r

    def _launch(self, ev: Launch, cur: dict, prev: dict) -> Launch:
        accesses = []
        for a, (kind, r) in zip(ev.accesses, self._access_roles[id(ev)], strict=True):
            obj = cur.get(("cur", r)) if kind == "cur" else prev.get(("prev", r)) if kind == "prev" else r
            if obj is not None:
                accesses.append(Access(obj, a.offset, a.length, a.write))
        return Launch(ev.seq, ev.exec_id, ev.op, tuple(accesses), ev.flops, ev.bytes, ev.module, ev.precision)


class CountingBackend(ForwardingBackend):
    """Passes every call to ``backend`` and counts the moves and advice by kind, with their bytes."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def _count(self, kind: str, ranges) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += sum(n for _, n in ranges)

    def prefetch(self, ranges, device) -> None:
        self._count("prefetch_h2d" if device >= 0 else "prefetch_d2h", ranges)
        self._b.prefetch(ranges, device)

    def populate(self, ranges) -> None:
        self._count("populate", ranges)
        self._b.populate(ranges)

    def discard(self, ranges) -> None:
        self._count("discard", ranges)
        self._b.discard(ranges)

    def drop(self, ranges) -> None:
        self._count("discard", ranges)  # dead ranges discarded beside the kernels: a discard
        self._b.drop(ranges)

    @property
    def swap(self):
        return _CountingSwap(self._b.swap, self._count)

    def advise(self, ranges, advice, device) -> None:
        self._count("advise", ranges)
        self._b.advise(ranges, advice, device)


class _CountingSwap:
    """The wrapped backend's swap path, its copies out and back counted."""

    def __init__(self, swap, count) -> None:
        self._s = swap
        self._count = count

    def __getattr__(self, name):
        return getattr(self._s, name)

    def out(self, ranges) -> None:
        self._count("swap_out", ranges)
        self._s.out(ranges)

    def back(self, ranges) -> None:
        self._count("swap_in", ranges)
        self._s.back(ranges)


@functools.lru_cache(maxsize=4)
def _source(path: str) -> ClosedLoop:
    return ClosedLoop(read_live_log(path))


def replay(run: str | Path, budget_bytes: int, iterations: int = 24, *, profile: str = "h100-pcie5-80g",
           lag: bool = False, runtime=None) -> list[dict]:
    """Replay a live log (a name of :data:`RUNS` or a path) in closed loop under
    umrt's runtime on the simulator; one row per iteration from the first."""
    path = LOGS / RUNS[run] if run in RUNS else Path(run)
    source = _source(str(path))
    prof = load_profile(profile)
    rt = runtime if runtime is not None else Runtime()
    sim = SimBackend(prof, budget_bytes)
    backend = CountingBackend(sim)
    layout = rt.make_layout(backend, live_feed=True)  # as in the live run: every block announced as OTHER
    rt.attach(PolicyContext(backend, layout, budget_bytes, prof))
    driver = Driver(rt, layout, backend)
    rows: list[dict] = []
    mark = None

    def close_row(index: int) -> None:
        nonlocal mark
        now = (sim.counters(), Counter(backend.calls), Counter(backend.bytes), dict(rt.report()), launches[0])
        if mark is not None:
            (c0, k0, b0, r0, l0), (c1, k1, b1, r1, l1) = mark, now
            rows.append({
                "iteration": index - 1, "mode": rt.log[-1]["mode"] if rt.log else "",
                "light": r1["light_iterations"] > r0["light_iterations"],
                "deviations": r1["deviations"], "rebases": r1.get("light_rebases", 0),
                "time_s": c1["time_s"] - c0["time_s"], "h2d_bytes": c1["h2d_bytes"] - c0["h2d_bytes"],
                "d2h_bytes": c1["d2h_bytes"] - c0["d2h_bytes"], "faults": c1["faults"] - c0["faults"],
                "calls": dict(k1 - k0), "call_bytes": dict(b1 - b0), "launches": l1 - l0,
            })
        mark = now

    launches = [0]  # launches the runtime was shown
    for ev, seen in source.stream(iterations, lambda: rt.wants_launches, lag=lag):
        t = type(ev)
        if t is Launch:
            launches[0] += seen
            driver.feed(ev, shown=seen)
        else:
            driver.feed(ev)
            if t is IterationBoundary:
                close_row(ev.index)
    driver.feed(IterationBoundary(iterations))
    close_row(iterations)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.live_replay", description=__doc__.splitlines()[0])
    p.add_argument("--run", default="40GiB", help=f"a live log: {', '.join(RUNS)} or a path (default 40GiB)")
    p.add_argument("--gpu-memory", dest="budget", default="40GiB", metavar="SIZE",
                   help="GPU memory the runtime plans for, a size (default 40GiB)")
    p.add_argument("--budget", dest="budget", action=Renamed, new="--gpu-memory", prefix="bench.live_replay")
    p.add_argument("--iterations", type=int, default=24)
    p.add_argument("--profile", default="h100-pcie5-80g")
    p.add_argument("--lag", action="store_true", help="launches resume only at the next module hook")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)

    try:
        budget = parse_amount(args.budget, "--gpu-memory", allow_percent=False).bytes
    except ConfigError as exc:
        p.error(str(exc))
    rows = replay(args.run, budget, args.iterations, profile=args.profile, lag=args.lag)
    print(f"closed-loop replay of {args.run} at {budget / 2**30:.1f} GiB on {args.profile} (SIMULATED)")
    print(f"{'it':>3} {'mode':>6} {'light':>5} {'dev':>3} {'launches':>8} {'time ms':>9} {'H2D MB':>8} "
          f"{'D2H MB':>8} {'faults':>7}  calls")
    for r in rows:
        print(f"{r['iteration']:>3} {r['mode']:>6} {'yes' if r['light'] else '':>5} {r['deviations']:>3} "
              f"{r['launches']:>8} {r['time_s'] * 1e3:>9.1f} {r['h2d_bytes'] / 1e6:>8.1f} "
              f"{r['d2h_bytes'] / 1e6:>8.1f} {r['faults']:>7}  {r['calls']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
