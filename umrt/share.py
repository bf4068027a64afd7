"""Several umrt jobs on one GPU: each holds a share of its memory, in a registry the OS keeps honest.

Every umrt process that drives a GPU (a live run; a shadow run with a budget in
bytes, on its simulated GPU) joins that GPU's registry: a folder
(``UMRT_SHARE_DIR``, default ``/dev/shm/umrt-shares``; one sub-folder per GPU,
named by its PCI bus id so that processes with different
``CUDA_VISIBLE_DEVICES`` agree) holding one small JSON file per job. A job holds
an exclusive ``flock`` on its own file for as long as it lives. The kernel drops
that lock when the process ends, however it ends (``kill -9`` included: "locks
are released on close, and a process's files are closed when it terminates",
flock(2)), so a file whose lock anyone can take belongs to a dead job: the next
job that reads the registry deletes it and the dead job's share is free again.
A second lock, on the folder's ``.lock``, makes each read-decide-write one step.

Two kinds of share:

* **fixed** (``UMRT_GPU_MEMORY`` given, e.g. ``12GiB`` or ``40%`` of the device):
  the job plans with exactly that for its life. A job whose fixed share does not
  fit beside the others' (the fixed shares, and each fair job at its minimum)
  is refused with one clear error (exit status 2), or waits for jobs to leave
  (``UMRT_SHARE_WAIT`` seconds, ``forever`` for no limit).
* **fair** (``UMRT_GPU_MEMORY`` unset): the fair jobs split 90% of what the fixed
  shares leave equally (alone on the GPU a job gets 90% of it, umrt's default
  budget), but never less than their minimum (``UMRT_SHARE_MIN``, default 10% of
  the device); a fair job that would get less is refused or waits.

Each job records the share it *holds* (the budget it plans with now), and the
held shares never add up to more than the device: a newcomer starts with what
is free and grows to its share as the others shrink to theirs. A running job
moves to its new share at its next optimizer step (between steps, never inside
one: :meth:`Share.step`); a thread re-reads the registry once a second and flags
the move (:meth:`Share.watch`), so a step reads one flag.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from umrt.config import format_bytes
from umrt.errors import UmrtError

__all__ = ["FAIR", "FIXED", "FAIR_FRACTION", "Member", "Registry", "Share", "ShareError", "default_folder",
           "job_label", "targets", "refusal", "join"]

log = logging.getLogger("umrt")

FIXED, FAIR = "fixed", "fair"
#: The fraction of what the fixed shares leave that the fair jobs split (umrt's default budget alone).
FAIR_FRACTION = 0.9
#: How long a newcomer waits for running jobs to give back memory they were asked to (one step each).
SETTLE_S = 120.0
POLL_S = 1.0  # how often a job re-reads its GPU's registry


class ShareError(UmrtError):
    """This job cannot get its share of the GPU (exit status 2)."""


@dataclass
class Member:
    """One job in a GPU's registry: its file's contents."""

    id: str  # the file's stem
    pid: int
    mode: str  # FIXED or FAIR
    want: int  # a fixed share's bytes (0 for a fair one)
    minimum: int  # the least it plans with
    held: int  # the budget it plans with now
    label: str = ""  # what the job is, for messages (its command)

    def describe(self) -> str:
        what = f"{format_bytes(self.held)} {self.mode}" if self.held else f"waiting for {self.mode} share"
        return f"pid {self.pid}{f' ({self.label})' if self.label else ''}: {what}"


def targets(members: list[Member], total: int) -> dict[str, int]:
    """The share each member is due on a GPU of ``total`` bytes: a fixed member its
    ``want``; the fair members an equal split of :data:`FAIR_FRACTION` of what the
    fixed shares leave, each at least its ``minimum``."""
    fixed = sum(m.want for m in members if m.mode == FIXED)
    fair = [m for m in members if m.mode == FAIR]
    out = {m.id: m.want for m in members if m.mode == FIXED}
    if fair:
        each = int(FAIR_FRACTION * max(0, total - fixed) / len(fair))
        out.update({m.id: max(m.minimum, each) for m in fair})
    return out


def refusal(members: list[Member], newcomer: Member, total: int) -> str | None:
    """Why ``newcomer`` cannot have a share beside ``members`` (None: it can).

    The test is on what each job is due at the least, not what it holds now:
    fair jobs shrink to their minimum if they must, fixed jobs never shrink.
    """
    everyone = [*members, newcomer]
    least = sum(m.want if m.mode == FIXED else m.minimum for m in everyone)
    if least > total:
        return (f"{format_bytes(least)} would be promised on a GPU of {format_bytes(total)} "
                f"(fixed shares, and each fair job at its minimum)")
    return None


def job_label(argv: list[str] | None = None) -> str:
    """What this job is, for the other jobs' messages: its script's name (or ``python -c``)."""
    argv = sys.argv if argv is None else argv
    first = argv[0] if argv else ""
    return (f"python {first}" if first.startswith("-") else os.path.basename(first))[:60]


def default_folder() -> Path:
    """``/dev/shm/umrt-shares`` (memory-backed, emptied at boot), else the temp folder's."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "umrt-shares"


def _folder_name(device_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", device_id) or "gpu"


class Registry:
    """One GPU's registry folder (see the module docstring)."""

    def __init__(self, folder: str | Path, device_id: str) -> None:
        self.folder = Path(folder) / _folder_name(device_id)
        self.device_id = device_id
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # shared by every user's jobs on the machine
                self.folder.parent.chmod(0o1777)
                self.folder.chmod(0o1777)
        except OSError as exc:
            raise ShareError(f"cannot use the GPU share registry {self.folder}: {exc.strerror or exc}; "
                             "set UMRT_SHARE_DIR to a writable folder, or UMRT_SHARE_DIR=off") from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The registry to oneself, for one read-decide-write."""
        fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def members(self, *, mine: str | None = None) -> list[Member]:
        """The live members (call under :meth:`locked`); a dead job's file is deleted
        on the way (``mine``: this process's own file, held by it, read as it is)."""
        out = []
        for path in sorted(self.folder.glob("*.json")):
            if path.stem != mine and not _held_by_someone(path):
                with contextlib.suppress(OSError):  # another user's dead job under the sticky bit: skip it
                    path.unlink()
                continue
            member = _read(path)
            if member is not None:
                out.append(member)
        return out

    def path(self, member_id: str) -> Path:
        return self.folder / f"{member_id}.json"


def _held_by_someone(path: Path) -> bool:
    """True when a live process holds ``path``'s lock (taking it shows the holder is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def _read(path: Path) -> Member | None:
    try:
        data = json.loads(path.read_text() or "{}")
        return Member(**data)
    except (OSError, ValueError, TypeError):
        return None  # being written: it is read again at the next poll


class Share:
    """This process's share of one GPU: its locked file in the registry.

    ``held`` is the budget it plans with. :meth:`poll` notices when that should
    move (:meth:`watch`: every second, in a thread); :meth:`step` moves it (at a
    safe point) and returns the new budget. :meth:`close` leaves the registry (process exit does too).
    """

    def __init__(self, registry: Registry, member: Member, total: int, fd: int) -> None:
        self.registry, self.member, self.total = registry, member, total
        self._fd = fd
        self._due = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.others = 0  # other jobs on the GPU at the last look

    @property
    def held(self) -> int:
        return self.member.held

    @property
    def mode(self) -> str:
        return self.member.mode

    def _write(self) -> None:
        data = json.dumps(asdict(self.member)).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def _next(self, members: list[Member]) -> int:
        """What this job may hold now: its due share, within what the others leave free."""
        others = [m for m in members if m.id != self.member.id]
        due = targets([*others, self.member], self.total)[self.member.id]
        free = self.total - sum(m.held for m in others)
        return max(0, min(due, free))

    def poll(self) -> bool:
        """Read the registry once and flag a move if the share should move (the watch
        thread calls this every second); returns whether one is due."""
        with self.registry.locked():
            members = self.registry.members(mine=self.member.id)
        self.others = len(members) - 1
        if self._next(members) != self.member.held:
            self._due.set()
        return self._due.is_set()

    def step(self) -> int | None:
        """At a safe point (between optimizer steps): move to the share now due, if
        :meth:`poll` flagged a move. Returns the new budget, or None when it stays."""
        if not self._due.is_set():
            return None
        self._due.clear()
        with self.registry.locked():
            members = self.registry.members(mine=self.member.id)
            new = self._next(members)
            if new == self.member.held:
                return None
            self.member.held = new
            self._write()
        self.others = len(members) - 1
        return new

    def watch(self, poll_s: float = POLL_S) -> None:
        """Re-read the registry every ``poll_s`` seconds in a daemon thread and flag a due move."""
        if self._thread is not None:
            return

        def run() -> None:
            while not self._stop.wait(poll_s):
                try:
                    self.poll()
                except OSError as exc:  # the registry went away: keep the share held
                    log.debug("umrt: share registry unreadable: %s", exc)

        self._thread = threading.Thread(target=run, name="umrt-share", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Leave the registry: the share is free for the others at once."""
        self._stop.set()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self.registry.path(self.member.id).unlink()
            os.close(self._fd)
            self._fd = -1


def join(registry: Registry, total: int, *, fixed: int | None, minimum: int, wait: float = 0.0,
         label: str = "", describe: str = "the GPU", clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep) -> Share:
    """Join ``registry`` for a share of a GPU of ``total`` bytes and return it.

    Args:
        fixed: the fixed share's bytes; None for a fair share.
        minimum: the least a fair share plans with (a fixed share's is the share).
        wait: seconds to wait for a share that does not fit now (``math.inf``: no limit).
        label: what this job is, for the others' messages.
        describe: what the GPU is, for this job's messages.

    Raises:
        ShareError: the share does not fit (after ``wait``), or running jobs did not
            give back what they were asked to within :data:`SETTLE_S`.
    """
    if fixed is not None and fixed > total:
        raise ShareError(f"{describe} has {format_bytes(total)}: it cannot give this job the "
                         f"{format_bytes(fixed)} asked for (UMRT_GPU_MEMORY)")
    member_id = f"{os.getpid()}-{time.time_ns():x}"
    me = Member(member_id, os.getpid(), FAIR if fixed is None else FIXED, fixed or 0,
                fixed if fixed is not None else min(minimum, total), 0, label)
    fd = os.open(registry.path(member_id), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    share = Share(registry, me, total, fd)
    try:
        _admit(share, wait=wait, describe=describe, clock=clock, sleep=sleep)
        _settle(share, describe=describe, clock=clock, sleep=sleep)
    except BaseException:
        share.close()
        raise
    return share


def _admit(share: Share, *, wait: float, describe: str, clock: Callable[[], float],
           sleep: Callable[[float], None]) -> None:
    """Enter the registry once the share fits beside the others (waiting up to ``wait``)."""
    registry, me = share.registry, share.member
    deadline = clock() + wait
    said = False
    while True:
        with registry.locked():
            others = registry.members(mine=me.id)
            others = [m for m in others if m.id != me.id]
            why = refusal(others, me, share.total)
            if why is None:
                share._write()  # in the registry from here on (holding nothing yet)
                return
        if clock() >= deadline:
            held = sum(m.held for m in others)
            who = "; ".join(m.describe() for m in others) or "none"
            asked = f"its fixed {format_bytes(me.want)} (UMRT_GPU_MEMORY)" if me.mode == FIXED else \
                f"a fair share of at least {format_bytes(me.minimum)} (UMRT_SHARE_MIN)"
            raise ShareError(
                f"{describe} ({format_bytes(share.total)}) cannot give this job {asked}: {why}. "
                f"umrt jobs on it hold {format_bytes(held)} ({who}). Lower UMRT_GPU_MEMORY or "
                "UMRT_SHARE_MIN, or set UMRT_SHARE_WAIT=SECONDS to wait for a share")
        if not said:
            print(f"umrt: waiting for a share of {describe}: {why}", file=sys.stderr, flush=True)
            said = True
        sleep(min(POLL_S, max(0.0, deadline - clock())) if math.isfinite(deadline) else POLL_S)


def _settle(share: Share, *, describe: str, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
    """Take what is free, up to the share due; wait (up to :data:`SETTLE_S`) while
    running jobs shrink, if less than this job's minimum is free."""
    registry, me = share.registry, share.member
    deadline = clock() + SETTLE_S
    while True:
        with registry.locked():
            members = registry.members(mine=me.id)
            new = share._next(members)
            if new >= me.minimum:
                me.held = new
                share._write()
                share.others = len(members) - 1
                return
        if clock() >= deadline:
            raise ShareError(f"the umrt jobs on {describe} did not give back memory for this job's share "
                             f"within {SETTLE_S:.0f} s (they move at their next optimizer step)")
        sleep(POLL_S)
