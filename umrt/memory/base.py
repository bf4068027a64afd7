"""The interface of an address layout: where each traced object lives.

A layout sub-allocates objects inside managed segments it obtains from a
backend (``backend.malloc``), the way PyTorch's caching allocator or umrt's
lifetime-aware pool would. The simulator needs one to turn a trace's object
ranges into addresses, and 2 MB blocks shared between objects are exactly
what makes placement matter.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from umrt.trace.events import Kind


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
