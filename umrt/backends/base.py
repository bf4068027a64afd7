"""The act layer's interface: what a policy or the runtime may ask of a GPU.

Two backends implement it: ``cuda`` (real managed memory through the CUDA
runtime) and ``sim`` (the Unified Memory simulator). Callers never know
which one they drive. Addresses and sizes are plain integers; a *range* is a
``(ptr, nbytes)`` pair inside one managed allocation.

Device ids follow the CUDA runtime: ``0..n-1`` are GPUs, :data:`HOST` (-1,
``cudaCpuDeviceId``) is host memory.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

HOST = -1  # cudaCpuDeviceId

# The UVM driver's units (uvm_va_block_types.h; umrt/sim/MODEL.md): a 2 MB VA
# block is the unit of eviction, a 64 KB big page that of residency, migration
# and discard.
BLOCK = 2 << 20
PAGE = 64 << 10

Range = tuple[int, int]  # (ptr, nbytes)


class Advice(enum.IntEnum):
    """cudaMemoryAdvise values (CUDA runtime API, identical in CUDA 12 and 13)."""

    SET_READ_MOSTLY = 1
    UNSET_READ_MOSTLY = 2
    SET_PREFERRED_LOCATION = 3
    UNSET_PREFERRED_LOCATION = 4
    SET_ACCESSED_BY = 5
    UNSET_ACCESSED_BY = 6


class Backend(ABC):
    """A GPU with managed memory, real or simulated.

    All calls are asynchronous in the CUDA sense: prefetches are ordered on the
    backend's copy stream, and :meth:`launch` orders a kernel after every
    prefetch issued before it that touches its ranges; a discard is ordered
    with the kernels (after those queued before it, before those queued after).
    """

    name: str = "backend"
    device: int = 0

    @abstractmethod
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of managed memory; return its address."""

    @abstractmethod
    def free(self, ptr: int) -> None:
        """Free an allocation made by :meth:`malloc`."""

    @abstractmethod
    def prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """Migrate ranges to ``device`` (a GPU id or :data:`HOST`) on the copy stream."""

    def populate(self, ranges: Sequence[Range]) -> None:
        """Make ranges resident on this backend's GPU before the kernels queued after
        this call run (a newborn's pages that are not there: never populated,
        discarded or evicted), keeping their contents. A kernel that reaches such
        pages first faults them in, a discarded range at 0.8 GB/s on the H100.
        Default: a prefetch to the GPU (a backend with streams orders it with the
        kernels)."""
        self.prefetch(ranges, self.device)

    @property
    def swap(self) -> SwapPath:
        """How this backend takes live ranges off the GPU and brings them back
        (:class:`SwapPath`): through the copy engines where it has them, else by page
        migration (this default)."""
        path = self.__dict__.get("_migration_swap")
        if path is None:
            path = self.__dict__["_migration_swap"] = SwapPath(self)
        return path

    @abstractmethod
    def discard(self, ranges: Sequence[Range]) -> None:
        """Declare the ranges' contents dead: a later migration copies nothing.

        In kernel order: the kernels queued before it may still read the dead
        bytes, those queued after it may write a new owner's."""

    def discard_and_prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """Make dead ranges resident on ``device`` without copying their contents, in
        kernel order as :meth:`discard`. Default: a plain prefetch (correct: it only
        copies bytes nobody reads)."""
        self.prefetch(ranges, device)

    def drop(self, ranges: Sequence[Range]) -> None:
        """Discard dead ranges *beside* the kernels: after those queued so far (which may
        still read them), on a stream of the backend's own, so that no kernel waits for
        the discard's work. Unlike :meth:`discard`, a kernel queued afterwards that touches
        the ranges must come after a :meth:`populate` of them (which waits for the
        discard). Default: :meth:`discard` (in kernel order)."""
        self.discard(ranges)

    @abstractmethod
    def advise(self, ranges: Sequence[Range], advice: Advice, device: int) -> None:
        """cudaMemAdvise on each range."""

    @abstractmethod
    def launch(self, reads: Sequence[Range], writes: Sequence[Range], flops: int, nbytes: int,
               precision: str = "") -> None:
        """A kernel is about to run on these ranges (its arithmetic in ``precision``,
        see :attr:`umrt.trace.events.Launch.precision`).

        The ``sim`` backend executes it (faults, migrations, compute time);
        the ``cuda`` backend only orders the compute stream after pending
        prefetches (the real kernel is launched by the framework).
        """

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all outstanding copies and kernels."""

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory as the backend sees them."""
        raise NotImplementedError


@runtime_checkable
class SimulatedContents(Protocol):
    """A backend that models what memory holds (the simulator): the driver tells it
    which ranges the host wrote before the run and which died, and reads its
    counters and resident peak at each iteration boundary."""

    peak_resident_bytes: int

    def mark_host_written(self, ranges: Sequence[Range]) -> None:
        """``ranges`` hold data written on the host (parameters, inputs made there)."""

    def mark_dead(self, ranges: Sequence[Range]) -> None:
        """``ranges`` were freed: their contents need not be kept."""

    def check_defined(self, ranges: Sequence[Range]) -> None:
        """A kernel is about to read ``ranges`` (an in-place update, which the ranges a launch
        reads do not name): raise :class:`~umrt.errors.DataIntegrityError` where one holds no data."""

    def counters(self) -> dict:
        """Cumulative counters (simulated time, bytes moved, faults ...)."""

    def reset_peak(self) -> None:
        """Start a new resident-bytes peak."""


@runtime_checkable
class ReportsFaults(Protocol):
    """A backend that tells which pages faulted (the simulator; DeepUM learns from them)."""

    def drain_faults(self) -> list[int]:
        """Pages that faulted since the last call."""


#: What copies a swapped range to pinned memory and back (``UMRT_SWAP_COPY``): ``"sm"``, a kernel
#: of umrt's own on a stream of its own (the SMs drive the link through mapped pinned memory;
#: meant to run beside the kernels, not measured yet), or ``"engines"``, ``cudaMemcpyAsync`` on the copy engines (an H200
#: ran nothing issued after such a copy of managed memory beside it).
SWAP_COPIES = ("sm", "engines")
SWAP_COPY_DEFAULT = "sm"


class SwapPath:
    """Taking live ranges off a backend's GPU and back, keeping their contents (``backend.swap``).

    This default is page migration: :meth:`out` prefetches to the host, :meth:`back` to the
    GPU. A backend with pinned copies (``pinned_copies``) copies each range out to pinned host
    memory after the kernels queued so far and discards its pages once the copy is done;
    :meth:`back` populates the pages and copies the range back, and the kernels that read it
    must come after :meth:`wait`. Addresses never change, and every byte swapped out must come
    back (or be :meth:`release`'d when its object dies) before a kernel uses it.
    """

    #: Whether ranges are copied to pinned staging and back (by SM copies or the copy engines;
    #: a discard after the copy out).
    pinned_copies: bool = False

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def reserve(self, nbytes: int) -> None:
        """Make room in host memory for ``nbytes`` away at once (before the first step that swaps)."""

    def out(self, ranges: Sequence[Range]) -> None:
        """Take ``ranges`` off the GPU after the kernels queued so far, keeping their contents."""
        self.backend.prefetch(ranges, HOST)

    def back(self, ranges: Sequence[Range]) -> None:
        """Bring ``ranges`` back to the GPU (what was never taken off is prefetched)."""
        self.backend.prefetch(ranges, self.backend.device)

    def wait(self, ranges: Sequence[Range]) -> None:
        """Kernels queued from now on wait until ``ranges`` are back (a prefetch keeps memory
        coherent: nothing to wait for here)."""

    def release(self, ranges: Sequence[Range]) -> None:
        """``ranges`` were taken off and died: their copies are dropped (nothing to drop here)."""


class ForwardingBackend(Backend):
    """A backend that passes every call to ``backend``: subclass it to watch some
    calls (a pool's segments, a count of calls); anything else a caller asks of
    the backend (counters, ``allocation_of``) is read from ``backend``."""

    def __init__(self, backend: Backend) -> None:
        self._b = backend
        self.name = backend.name
        self.device = backend.device

    def malloc(self, nbytes: int) -> int:
        return self._b.malloc(nbytes)

    def free(self, ptr: int) -> None:
        self._b.free(ptr)

    def prefetch(self, ranges: Sequence[Range], device: int) -> None:
        self._b.prefetch(ranges, device)

    def populate(self, ranges: Sequence[Range]) -> None:
        self._b.populate(ranges)

    def discard(self, ranges: Sequence[Range]) -> None:
        self._b.discard(ranges)

    def discard_and_prefetch(self, ranges: Sequence[Range], device: int) -> None:
        self._b.discard_and_prefetch(ranges, device)

    @property
    def swap(self) -> SwapPath:
        return self._b.swap

    def drop(self, ranges: Sequence[Range]) -> None:
        self._b.drop(ranges)

    def advise(self, ranges: Sequence[Range], advice: Advice, device: int) -> None:
        self._b.advise(ranges, advice, device)

    def launch(self, reads: Sequence[Range], writes: Sequence[Range], flops: int, nbytes: int,
               precision: str = "") -> None:
        self._b.launch(reads, writes, flops, nbytes, precision)

    def synchronize(self) -> None:
        self._b.synchronize()

    def mem_info(self) -> tuple[int, int]:
        return self._b.mem_info()

    def __getattr__(self, name: str):
        return getattr(self._b, name)


class SegmentWatch(ForwardingBackend):
    """The backend as a pool sees it: ``on_made(ptr, nbytes)`` after each segment
    the pool makes, ``on_free(ptr, nbytes)`` before each it gives back."""

    def __init__(self, backend: Backend, on_made, on_free) -> None:
        super().__init__(backend)
        self._on_made = on_made
        self._on_free = on_free
        self._sizes: dict[int, int] = {}

    def malloc(self, nbytes: int) -> int:
        ptr = self._b.malloc(nbytes)
        self._sizes[ptr] = nbytes
        self._on_made(ptr, nbytes)
        return ptr

    def free(self, ptr: int) -> None:
        self._on_free(ptr, self._sizes.pop(ptr, 0))
        self._b.free(ptr)
