"""Resting a loop phase whose shapes never repeat.

Learning an iteration records every op it runs (the recorder's dispatch mode runs Python for each:
166-215 us of CPU per launch on the development machine, README "CPU cost"; not measured on a GPU
host) and compiles a plan at its end. Where a phase's steps take a new
shape each time (lengths that never repeat, not bucketed), no plan is ever used again, and that
cost is paid on every step for nothing. After :data:`REST_AFTER` iterations of a phase in a row
each learned a shape never seen before, the phase *rests*: its iterations run as plain Unified
Memory, not recorded and not planned (what torch allocates and frees is still seen, at no cost).
A rested iteration whose allocation sizes repeat those of an iteration seen before (its sizes
hash, which needs no recorded op) wakes the phase: its shapes repeat, and it learns again.
"""
from __future__ import annotations

from collections import OrderedDict, deque

__all__ = ["REST_AFTER", "Rest"]

#: Iterations of a phase in a row, each learning a new shape, after which the phase rests.
REST_AFTER = 8
#: Allocation-size hashes remembered per phase (a shape comes back after at most this many others).
SEEN = 4096


class Rest:
    """Which loop phases rest (:meth:`resting`), from the allocation sizes each of
    their iterations ran and whether it learned or acted (:meth:`ran`)."""

    def __init__(self, after: int | None = None) -> None:
        self.after = REST_AFTER if after is None else after  # (0: never rest)
        self._new: dict[str, deque[bool]] = {}  # phase -> its last iterations: learned a new shape or not
        self._seen: dict[str, OrderedDict[int, None]] = {}  # phase -> sizes hashes of its iterations, oldest first
        self._resting: set[str] = set()
        self.wakes = 0  # phases woken by a shape that came back

    def resting(self, phase: str) -> bool:
        """Whether the next iteration of ``phase`` rests (see the module's docstring)."""
        return phase in self._resting

    def ran(self, phase: str, sizes_hash: int, learned: bool | None) -> None:
        """An iteration of ``phase`` ended, having allocated sizes hashing to ``sizes_hash``;
        ``learned``: it was recorded to learn its shape (True), acted on a plan (False), or
        neither (None). The phase rests once :attr:`after` learned iterations in a row, no
        acting one between, allocated as no iteration of it had before; a resting phase wakes
        when one allocates as one did before."""
        seen = self._seen.get(phase)
        if seen is None:
            seen = self._seen[phase] = OrderedDict()
        known = sizes_hash in seen
        if known:
            seen.move_to_end(sizes_hash)
        else:
            seen[sizes_hash] = None
            if len(seen) > SEEN:
                seen.popitem(last=False)
        if phase in self._resting:
            if known:
                self._resting.discard(phase)
                self._new.pop(phase, None)
                self.wakes += 1
            return
        if learned is None or self.after <= 0:
            return
        recent = self._new.get(phase)
        if recent is None:
            recent = self._new[phase] = deque(maxlen=self.after)
        recent.append(learned and not known)
        if len(recent) == self.after and all(recent):
            self._resting.add(phase)
