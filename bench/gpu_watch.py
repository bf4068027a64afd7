"""Per-step progress and a per-mode watchdog for ``python -m bench.gpu``.

Each mode runs in a worker subprocess that prints one progress line per
training step (:class:`StepRecord`, a prefix and JSON) on its stdout. The
parent (:func:`supervise`) shows each step as it arrives and runs a
:class:`Watchdog`: when the mode exceeds its time limit, or makes no progress
(no step) for ``stall_s`` seconds, the parent asks the worker for the Python
stacks of all its threads (``SIGUSR1``, which the worker hands to
:mod:`faulthandler`: it dumps from a C signal handler, so it answers even
while a thread holds the GIL inside a CUDA call), kills it, and returns an
:class:`Outcome` that says where it hung. The benchmark then moves on to the
next mode.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from umrt.config import format_bytes

#: What starts a progress line on a worker's stdout.
PROGRESS_PREFIX = "@bench.gpu step "
#: The signal a worker dumps its threads' stacks on.
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
_STACK_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*\(most recent call first\):\s*$")
# a frame, "  Garbage-collecting", "  <no Python frame>", "  ...", or the blank line between threads
_STACK_LINE = re.compile(r"^(  \S.*|\s*)$")


@dataclass
class StepRecord:
    """One training step of one mode, as the worker saw it.

    Byte and call counts are what umrt issued during this step (None where
    the mode has no umrt, or the backend does not count it); ``pcie_*`` are
    NVML's PCIe byte counters over the step (None without NVML).
    """

    step: int
    time_s: float
    timed: bool  # a timed (steady-state) step, after the warm-up
    loss: float | None = None
    h2d_bytes: int | None = None
    d2h_bytes: int | None = None
    discarded_bytes: int | None = None
    calls: dict[str, int] | None = None  # CUDA calls umrt issued, by call name
    pcie_h2d_bytes: float | None = None
    pcie_d2h_bytes: float | None = None
    reserved_bytes: int | None = None  # umrt's pool after the step
    acting: bool | None = None  # umrt's runtime still acting after the step
    stopped_reason: str | None = None

    @property
    def total_calls(self) -> int | None:
        """All CUDA calls umrt issued in the step, or None where they are not counted."""
        return None if self.calls is None else sum(self.calls.values())

    def to_line(self) -> str:
        """The progress line a worker prints."""
        return PROGRESS_PREFIX + json.dumps(dataclasses.asdict(self), allow_nan=False)

    @classmethod
    def from_line(cls, line: str) -> StepRecord | None:
        """The record in a progress line, or None for any other line."""
        if not line.startswith(PROGRESS_PREFIX):
            return None
        try:
            data = json.loads(line[len(PROGRESS_PREFIX):])
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (ValueError, TypeError):
            return None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        """A record from its JSON form (a worker's result file)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def format_step(label: str, rec: StepRecord, total: int) -> str:
    """One progress line for the console, e.g.
    ``umrt@7.5 GiB  step  6/25 timed   412.3 ms  loss 9.082031  umrt H2D 1.2 GiB D2H 0 B calls 231  PCIe H2D 1.3 GiB D2H 12.0 MiB``."""
    parts = [f"{label}  step {rec.step:>{len(str(total))}}/{total} {'timed ' if rec.timed else 'warmup'}",
             f"{rec.time_s * 1e3:9.1f} ms"]
    if rec.loss is not None:
        parts.append(f"loss {rec.loss:.6f}")
    if rec.h2d_bytes is not None:
        calls = "-" if rec.total_calls is None else str(rec.total_calls)
        parts.append(f"umrt H2D {format_bytes(rec.h2d_bytes)} D2H {format_bytes(rec.d2h_bytes or 0)} "
                     f"calls {calls}")
    if rec.pcie_h2d_bytes is not None:
        parts.append(f"PCIe H2D {format_bytes(rec.pcie_h2d_bytes)} D2H {format_bytes(rec.pcie_d2h_bytes or 0)}")
    if rec.reserved_bytes is not None:
        parts.append(f"pool {format_bytes(rec.reserved_bytes)}")
    if rec.acting is False:
        parts.append("NOT ACTING")
    return "  ".join(parts)


class Watchdog:
    """A mode's time limit and its no-progress limit.

    Args:
        limit_s: the most seconds the whole mode may take.
        stall_s: the most seconds between two progress marks (the start counts as one).
        clock: a monotonic clock (tests pass a fake one).
    """

    def __init__(self, limit_s: float, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if limit_s <= 0 or stall_s <= 0:
            raise ValueError(f"watchdog limits must be positive, got {limit_s} s and {stall_s} s")
        self.limit_s, self.stall_s, self.clock = limit_s, stall_s, clock
        self.started = self.last = clock()
        self.marks = 0

    def progress(self) -> None:
        """The mode made progress (a step finished)."""
        self.last = self.clock()
        self.marks += 1

    def expired(self) -> str | None:
        """Why the mode should be stopped now, or None."""
        now = self.clock()
        if now - self.started > self.limit_s:
            return f"exceeded its time limit of {self.limit_s:g} s"
        if now - self.last > self.stall_s:
            since = "since it started" if self.marks == 0 else f"after {self.marks} step(s)"
            return f"made no progress for {self.stall_s:g} s {since}"
        return None


@dataclass
class Outcome:
    """How a supervised worker ended."""

    returncode: int | None
    stderr: str
    steps: list[StepRecord] = field(default_factory=list)
    timed_out: str | None = None  # the watchdog's reason, when it stopped the worker
    stacks: str = ""  # the worker's threads' Python stacks, when the watchdog stopped it

    def last_error_line(self) -> str:
        """The worker's last non-empty stderr line that is not part of a stack dump."""
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        dump = set(self.stacks.splitlines())
        lines = [ln for ln in lines if ln not in dump]
        return lines[-1] if lines else f"exit status {self.returncode}"


def install_stack_dump(out: TextIO | None = None) -> bool:
    """In a worker: dump all threads' Python stacks to ``out`` (the process's stderr)
    on :data:`STACK_SIGNAL`. False where the platform has no such signal or ``out``
    is not a file with a descriptor."""
    import faulthandler

    if STACK_SIGNAL is None:
        return False
    try:
        faulthandler.register(STACK_SIGNAL, file=out or sys.__stderr__, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is an OSError
        return False
    return True


def extract_stacks(text: str) -> str:
    """The faulthandler stack dumps in a worker's stderr (empty if none)."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if _STACK_HEADER.match(line):
            inside = True
            out.append(line)
        elif inside and _STACK_LINE.match(line):
            out.append(line)
        else:
            inside = False
    return "\n".join(out).strip()


def supervise(cmd: Sequence[str], *, env: Mapping[str, str] | None, watchdog: Watchdog,
              stderr_path: Path, on_step: Callable[[StepRecord], None] | None = None,
              on_line: Callable[[str], None] | None = None, grace_s: float = 3.0,
              poll_s: float = 0.2) -> Outcome:
    """Run a worker; hand each progress line to ``on_step`` (other stdout lines to
    ``on_line``) as they come; stop it when ``watchdog`` expires.

    On expiry the worker is sent :data:`STACK_SIGNAL`, given ``grace_s`` seconds
    to write its stacks, then killed; :attr:`Outcome.timed_out` says why and
    :attr:`Outcome.stacks` holds the stacks.
    """
    lines: queue.Queue[str | None] = queue.Queue()
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None, stdout=subprocess.PIPE,
                                stderr=err, text=True, bufsize=1)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        reader = threading.Thread(target=pump, name="bench-gpu-worker-stdout", daemon=True)
        reader.start()
        steps: list[StepRecord] = []
        timed_out: str | None = None
        eof = False
        while not eof:
            try:
                line = lines.get(timeout=poll_s)
            except queue.Empty:
                line = ""
                if proc.poll() is not None and not reader.is_alive():
                    break
            else:
                if line is None:
                    eof = True
                    continue
                rec = StepRecord.from_line(line)
                if rec is not None:
                    steps.append(rec)
                    watchdog.progress()
                    if on_step is not None:
                        on_step(rec)
                elif line and on_line is not None:
                    on_line(line)
            if proc.poll() is None:
                timed_out = watchdog.expired()
                if timed_out:
                    _dump_and_kill(proc, grace_s, stderr_path)
                    break
        proc.wait()
        reader.join(timeout=2.0)
    stderr = Path(stderr_path).read_text(errors="replace")
    return Outcome(proc.returncode, stderr, steps, timed_out, extract_stacks(stderr) if timed_out else "")


def _dump_and_kill(proc: subprocess.Popen, grace_s: float, stderr_path: Path) -> None:
    """Ask for the worker's stacks, wait until its stderr stops growing (or
    ``grace_s``), kill it."""
    if STACK_SIGNAL is not None:
        before = _size(stderr_path)
        try:
            os.kill(proc.pid, STACK_SIGNAL)
        except OSError:
            pass
        deadline, last, still = time.monotonic() + grace_s, before, 0
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            size = _size(stderr_path)
            still = still + 1 if size == last and size > before else 0
            last = size
            if still >= 4:  # written, and quiet for 0.2 s
                break
    proc.kill()


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
