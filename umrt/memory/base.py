"""The interface of an address layout: where each traced object lives.

A layout sub-allocates objects inside managed segments it obtains from a
backend (``backend.malloc``), the way PyTorch's caching allocator or umrt's
lifetime-aware pool would. The simulator needs one to turn a trace's object
ranges into addresses, and 2 MB blocks shared between objects are exactly
what makes placement matter.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from umrt.trace.events import Event, Kind


class Layout(ABC):
    """Maps live objects to addresses."""

    @abstractmethod
    def alloc(self, obj: int, nbytes: int, kind: Kind) -> int:
        """Place ``obj``; return its address. Never fails for lack of a plan."""

    @abstractmethod
    def free(self, obj: int) -> None:
        """``obj`` is dead; its bytes may be reused."""

    @abstractmethod
    def address(self, obj: int) -> int:
        """Address of a live object."""

    @abstractmethod
    def footprint(self) -> int:
        """Bytes of managed memory currently obtained from the backend."""

    def peak_footprint_bytes(self) -> int | None:
        """The most managed memory obtained at once so far, where the layout knows it
        (``None``: it does not; a layout the runtime made is counted by the runtime)."""
        return None


# What a layout may offer beyond :class:`Layout`. A caller checks these with
# ``isinstance`` once, when it is handed the layout, never per event.


@runtime_checkable
class LearningLayout(Protocol):
    """A layout that learns from the program's stream (umrt's lifetime-aware pool).

    The driver (:class:`umrt.drive.Driver`) alone feeds it: every event but
    allocations and frees, before the policy sees the event.
    """

    def observe(self, event: Event) -> None:
        """One event of the stream: an iteration boundary, a launch, a layer event."""

    def observe_launch(self, exec_id: int) -> None:
        """``observe`` of a launch, its type already known (the hot path)."""


class LiveRecord(Protocol):
    """Where a live object sits."""

    ptr: int
    nbytes: int


@runtime_checkable
class IndexedLayout(Protocol):
    """A layout whose live objects can be read without a call each (the runtime's hot path)."""

    @property
    def live_index(self) -> Mapping[int, LiveRecord]:
        """``obj -> record`` of every live object; read-only."""


@runtime_checkable
class PlanningLayout(Protocol):
    """A layout that plans where recurring objects go (umrt's pool), and can stop, or serve
    one step unplanned."""

    def stop_planning(self, why: str, budget_bytes: int | None = None) -> None:
        """Serve every allocation best-fit from now on, as a caching allocator does;
        live objects stay where they are (``budget_bytes``: the GPU memory the run has,
        where known: see :meth:`umrt.memory.pool.LifetimePool.stop_planning`)."""

    def resume_planning(self) -> None:
        """Plan again after :meth:`stop_planning`, from the next training step's objects."""

    def serve_unplanned(self, unplanned: bool) -> None:
        """Whether the iteration starting now is served best-fit, its plan kept for the next."""
