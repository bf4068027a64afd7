"""A fake CUDA runtime that enforces the real contract, for tests without a GPU.

One :class:`FakeGpu` holds the state (managed allocations, streams, events,
the order of everything queued, and the state of every 64 KiB page). Two
front ends expose it with the *exact* call shapes of the two real Python
runtimes umrt drives:

* :class:`FakeCupyRuntime` mirrors ``cupy.cuda.runtime`` (CUDA 12):
  ``memPrefetchAsync(devPtr, count, dstDevice, stream)``, errors raised as
  ``CUDARuntimeError``, no batched or discard entry points.
* :class:`FakeBindingsRuntime` mirrors ``cuda.bindings.runtime`` (CUDA 13):
  ``cudaMemPrefetchAsync(devPtr, count, cudaMemLocation, flags, stream)``,
  every call returns ``(cudaError_t, *results)``, plus the batch calls.

**The call contract.** Every "must" / "must not" / invalid-value condition in
the doc comments of the calls umrt makes, as written in the CUDA 13.0 runtime
header (``/usr/local/cuda/include/cuda_runtime_api.h``, ``CUDART_VERSION
13000``), is enforced with the error the header names; each rule has a test
in ``tests/test_cuda_contract.py`` that cites the header line. Measured on a
real H100 (``/work/shared/reference/h100-measured.md`` section 2): the three
batch calls reject the legacy default stream (handle 0 and
``cudaStreamLegacy`` = 1) with ``cudaErrorInvalidValue`` and accept
``cudaStreamPerThread`` (2) and created streams. A few rules are the fake's
own and stricter than the header (a range must lie inside one allocation, a
batch must not be empty): umrt never needs what they refuse.

**Stream order.** Everything queued is an operation on a stream with a vector
clock, so :meth:`FakeGpu.ordered` answers "is A guaranteed to finish before
B starts" exactly: same-stream FIFO; ``cudaEventRecord`` captures the
stream's work so far and ``cudaStreamWaitEvent`` orders all later work of a
stream after it (an event never recorded is empty work); a host wait
(``cudaStreamSynchronize``, :meth:`FakeGpu.device_synchronize`) orders
everything queued afterwards after what it waited for; and the legacy default
stream's implicit synchronization (CUDA driver API docs, "Stream
synchronization behavior"): an action in the legacy stream (a kernel, a
prefetch, a discard, a ``cudaStreamWaitEvent``) first waits for all blocking
streams, then all blocking streams wait for it. Blocking streams are those
created without ``cudaStreamNonBlocking`` and every thread's per-thread
default stream (handle 2, one stream per host thread). Where the docs are
silent the fake assumes *no* ordering: an event recorded on the legacy stream
captures only the legacy stream's own work, ``cudaStreamSynchronize`` on it
waits for that work only, a blocking stream created after a legacy action is
not ordered after it, and ``cudaFree`` does not synchronize.

**Page state.** Per 64 KiB page of each managed allocation: where it is
(``"gpu"``, ``"host"``, or ``None``: not populated), whether its contents
were discarded and not repopulated on the GPU since, the last migration
(prefetch either way, discard, discard-and-prefetch), the discard and the
GPU prefetch after it, and the newest kernel per stream that touched it; and
per byte, whether it was discarded and not written since. Kernels are queued
with :meth:`FakeGpu.kernel` (what torch's launch of a kernel is; umrt's
``backend.launch`` only orders streams). Violations, each a
:class:`PageStateError` raised at the offending call (``strict=True``, the
default) or appended to ``FakeGpu.violations``:

``discarded-read``
    a kernel reads bytes that were discarded and not written since (the data
    is lost; a prefetch does not bring it back).
``refault``
    a kernel touches a discarded page with no prefetch to the GPU (or
    discard-and-prefetch) ordered between the discard and the kernel: the
    fault path measured at 0.8 GB/s on the H100.
``discard-race``
    a kernel or a migration is not ordered after an earlier discard of its
    page ("reads, writes or prefetches ... simultaneously with the discard
    operation result in undefined behavior", header line 7210).
``migrated-in-use``
    a page is evicted (prefetched to the host) or discarded while a kernel
    that touched it is queued and not ordered before it. A prefetch *to* the
    GPU is exempt: it moves the page toward the kernel, and "memory accesses
    to this range are always coherent and are allowed even when the data is
    actively being migrated" (header line 7127).
``migration-race``
    two migrations of a page to different places are not ordered (where the
    page ends up is a race).
``illegal-address``
    a kernel touches memory that is not a live managed allocation.
``stream-race``
    a kernel writes bytes that a kernel on another stream touched and is not ordered
    after it (a block reused on its stream while another stream still reads it: what
    torch's ``record_stream`` is for).
"""
from __future__ import annotations

import bisect
import enum
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

SUCCESS, INVALID_VALUE, MEMORY_ALLOCATION, INVALID_DEVICE, INVALID_HANDLE, NOT_SUPPORTED = 0, 1, 2, 101, 400, 801
INVALID_MEMCPY_DIRECTION = 21  # cudaErrorInvalidMemcpyDirection (driver_types.h)
ILLEGAL_ADDRESS = 700  # cudaErrorIllegalAddress (driver_types.h): a kernel touched memory it may not
ERROR_NAMES = {
    SUCCESS: "cudaSuccess",
    INVALID_VALUE: "cudaErrorInvalidValue",
    INVALID_MEMCPY_DIRECTION: "cudaErrorInvalidMemcpyDirection",
    MEMORY_ALLOCATION: "cudaErrorMemoryAllocation",
    INVALID_DEVICE: "cudaErrorInvalidDevice",
    INVALID_HANDLE: "cudaErrorInvalidResourceHandle",
    NOT_SUPPORTED: "cudaErrorNotSupported",
    ILLEGAL_ADDRESS: "cudaErrorIllegalAddress",
}
HOST = -1  # cudaCpuDeviceId
ALIGN = 2 * 1024 * 1024  # the fake places allocations on 2 MiB boundaries
PAGE = 64 * 1024  # the GPU's big page: unit of residency, migration and discard
CPU_PAGE = 4096  # the driver rounds ranges to CPU pages (header lines 7096, 7282)

# driver_types.h (CUDA 13.0)
STREAM_LEGACY = 1  # cudaStreamLegacy; handle 0 (NULL) means the same stream here
STREAM_PER_THREAD = 2  # cudaStreamPerThread
STREAM_DEFAULT, STREAM_NON_BLOCKING = 0x0, 0x1
STREAM_PRIORITIES = (0, -5)  # cudaDeviceGetStreamPriorityRange: (least, greatest), an H100's
EVENT_DEFAULT, EVENT_BLOCKING_SYNC, EVENT_DISABLE_TIMING, EVENT_INTERPROCESS = 0x0, 0x1, 0x2, 0x4
EVENT_WAIT_DEFAULT, EVENT_WAIT_EXTERNAL = 0x0, 0x1
MEM_ATTACH_GLOBAL, MEM_ATTACH_HOST = 0x1, 0x2
ATTR_MANAGED_MEMORY, ATTR_PAGEABLE_MEMORY_ACCESS, ATTR_CONCURRENT_MANAGED_ACCESS = 83, 88, 89
ADVICE_SET_READ_MOSTLY, ADVICE_UNSET_READ_MOSTLY = 1, 2
ADVICE_SET_PREFERRED, ADVICE_UNSET_PREFERRED = 3, 4
ADVICE_SET_ACCESSED_BY, ADVICE_UNSET_ACCESSED_BY = 5, 6

LEGACY = "legacy"  # the stream key of handles 0 and 1


class FakeCudaError(Exception):
    """A call the real runtime would fail, with the status it would return."""

    def __init__(self, status: int, call: str, why: str) -> None:
        super().__init__(f"{call}: {why}")
        self.status = status


class PageStateError(AssertionError):
    """Data would be lost, refaulted or raced on a real GPU (see the module docstring)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class Violation:
    kind: str
    message: str


@dataclass(eq=False)
class Op:
    """One queued operation: a kernel, a migration or a discard."""

    name: str
    stream: object  # the stream key (LEGACY, ("ptds", thread id) or a created handle)
    seq: int  # its place in its stream, from 1
    vc: dict  # vector clock: stream key -> newest op of that stream it is ordered after
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.name}#{self.seq} on {_stream_name(self.stream)}{(' ' + self.detail) if self.detail else ''}"


def _stream_name(key: object) -> str:
    if key == LEGACY:
        return "the legacy default stream"
    if isinstance(key, tuple):
        return "the per-thread default stream"
    return f"stream {key:#x}" if isinstance(key, int) else str(key)


def _join(into: dict, other: dict) -> None:
    for k, v in other.items():
        if v > into.get(k, 0):
            into[k] = v


@dataclass
class _Stream:
    key: object
    blocking: bool
    device: int
    frontier: dict = field(default_factory=dict)  # everything later work on it is ordered after
    seq: int = 0


def _page_indices(spans: list[tuple[int, int]]) -> Iterator[int]:
    """Each page index in the union of ``[start, end)`` spans once, in order."""
    start = end = None
    for s, e in sorted(spans):
        if end is not None and s <= end:
            end = max(end, e)
            continue
        if end is not None:
            yield from range(start, end)
        start, end = s, e
    if end is not None:
        yield from range(start, end)


class _Page:
    """The state of one 64 KiB page (see the module docstring)."""

    __slots__ = ("loc", "discarded", "last_move", "discard_op", "revive_op", "uses")

    def __init__(self) -> None:
        self.loc: str | None = None  # "gpu", "host" or None (never populated, or released by a discard)
        self.discarded = False  # discarded and not repopulated on the GPU since
        self.last_move: tuple[Op, str] | None = None  # the newest migration and where it sent the page
        self.discard_op: Op | None = None  # the newest discard
        self.revive_op: Op | None = None  # the prefetch to the GPU that repopulated it after that discard
        self.uses: dict[object, Op] = {}  # stream key -> newest kernel on it that touched the page


class _Intervals:
    """A set of bytes as sorted, disjoint ``[start, end)`` intervals."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.ends, start)  # first interval that ends at or after start
        j = bisect.bisect_right(self.starts, end)  # intervals from i to j touch [start, end)
        if i < j:
            start, end = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [start], [end]

    def remove(self, start: int, end: int) -> None:
        i = bisect.bisect_right(self.ends, start)
        j = bisect.bisect_left(self.starts, end)
        if i >= j:
            return
        keep_s, keep_e = [], []
        if self.starts[i] < start:
            keep_s.append(self.starts[i])
            keep_e.append(start)
        if self.ends[j - 1] > end:
            keep_s.append(end)
            keep_e.append(self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = keep_s, keep_e

    def overlap(self, start: int, end: int) -> list[tuple[int, int]]:
        i = bisect.bisect_right(self.ends, start)
        out = []
        while i < len(self.starts) and self.starts[i] < end:
            out.append((max(start, self.starts[i]), min(end, self.ends[i])))
            i += 1
        return out

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))


# ---------------------------------------------------------------------------
# The swap path: pinned host memory (cudaHostAlloc, cudaFreeHost) and copies between it
# and managed memory (cudaMemcpyAsync), with the state a swap depends on.
# ---------------------------------------------------------------------------
MEMCPY_H2H, MEMCPY_H2D, MEMCPY_D2H, MEMCPY_D2D, MEMCPY_DEFAULT = 0, 1, 2, 3, 4  # cudaMemcpyKind (driver_types.h)
HOST_ALLOC_FLAGS = 0x1 | 0x2 | 0x4  # cudaHostAllocPortable | Mapped | WriteCombined (driver_types.h)
PINNED_BASE = 0x5000_0000_0000  # where the fake places pinned host memory (apart from managed memory)


class _SwapState:
    """What the swap path's checks remember (see :class:`SwapPath`)."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}  # cudaHostAlloc'd: ptr -> bytes
        self.pinned_starts: list[int] = []
        self.next_pinned = PINNED_BASE
        self.written = _Intervals()  # managed bytes a kernel or a copy back wrote (and not freed)
        self.writers: dict[int, dict] = {}  # page -> stream -> newest kernel that wrote it
        self.copied_out: dict[int, Op] = {}  # page -> newest copy that read it out to pinned memory
        self.copied_in: dict[int, Op] = {}  # page -> newest copy that wrote it back from pinned memory
        self.slot_fills: list[tuple[int, int, Op]] = []  # pinned bytes [s, e) and the copy out that filled them
        self.slot_reads: list[tuple[int, int, Op]] = []  # pinned bytes [s, e) and a copy back that read them
        self.copies: list[Op] = []  # every copy, in issue order


class SwapPath:
    """The swap path of :class:`FakeGpu`: ``cudaHostAlloc`` / ``cudaFreeHost`` and
    ``cudaMemcpyAsync`` checked against the CUDA 13 header (cuda_runtime_api.h:
    cudaHostAlloc "flags ... cudaHostAllocDefault, Portable, Mapped, WriteCombined",
    memory "must be freed with cudaFreeHost"; cudaFreeHost: the pointer "must have been
    returned by a previous call to cudaMallocHost() or cudaHostAlloc()"; cudaMemcpyAsync:
    ``kind`` "must be one of" the five cudaMemcpyKind values, "the memory areas may not
    overlap", pointers that do not match the direction are undefined behaviour, which the
    fake refuses with cudaErrorInvalidMemcpyDirection). The fake's own, stricter rules: a copy
    is between memory the fake knows (pinned or managed, each range inside one allocation),
    of more than 0 bytes; a pinned allocation is more than 0 bytes.

    The page and slot state it keeps, and the violations (:class:`PageStateError`) it raises:

    ``copy-out-unwritten``
        a copy to pinned memory reads managed bytes no kernel (or copy back) wrote, or that
        were discarded and not written since: it would save nothing.
    ``copy-out-race``
        a copy out reads a page that a queued kernel writes, not ordered before the copy.
    ``discard-before-copy-out``
        a discard of a page whose copy out is not ordered before it: the copy would read
        nothing (the data is lost).
    ``copy-into-discarded``
        a copy back into a page that was discarded and not repopulated on the GPU (a
        prefetch or discard-and-prefetch) ordered before the copy.
    ``read-before-copy-back``
        a kernel touches a page whose copy back from pinned memory is not ordered before it.
    ``slot-read-early``
        a copy back reads pinned bytes no copy out filled, or whose copy out is not ordered
        before it.
    ``slot-reused``
        a copy out into pinned bytes that a copy back still reads (not ordered before it):
        the bytes waiting to go back would be overwritten.
    ``slot-freed-in-use``
        ``cudaFreeHost`` of pinned memory a copy uses that the host has not waited for.
    """

    @property
    def swap(self) -> _SwapState:
        state = self.__dict__.get("_swap_state")
        if state is None:
            state = self.__dict__["_swap_state"] = _SwapState()
        return state

    host_limit: int = 64 * 2**30  # pinned host memory the fake hands out

    # -- pinned memory -----------------------------------------------------------
    def host_alloc(self, call: str, size: int, flags: int) -> int:
        if not isinstance(size, int) or size < 0:
            raise OverflowError(f"{call}: size {size!r} is not a size_t")
        if not isinstance(flags, int) or flags & ~HOST_ALLOC_FLAGS:
            raise FakeCudaError(INVALID_VALUE, call, f"flags {flags!r} (cudaHostAllocDefault, Portable, Mapped, "
                                                     "WriteCombined)")
        if size == 0:
            raise FakeCudaError(INVALID_VALUE, call, "size 0")
        st = self.swap
        if sum(st.pinned.values()) + size > self.host_limit:
            raise FakeCudaError(MEMORY_ALLOCATION, call, "out of pinned host memory")
        ptr = st.next_pinned
        st.next_pinned += -(-size // ALIGN) * ALIGN
        st.pinned[ptr] = size
        bisect.insort(st.pinned_starts, ptr)
        return ptr

    def free_host(self, call: str, ptr: int) -> None:
        st = self.swap
        if ptr not in st.pinned:
            raise FakeCudaError(INVALID_VALUE, call, f"{ptr:#x} was not returned by cudaHostAlloc (or was freed)")
        end = ptr + st.pinned[ptr]
        for s_, e_, op in st.slot_fills + st.slot_reads:
            if s_ < end and ptr < e_ and not self.completed(op):
                self._violate("slot-freed-in-use", f"cudaFreeHost({ptr:#x}) while {op}, which uses it, may still run")
        del st.pinned[ptr]
        st.pinned_starts.remove(ptr)
        st.slot_fills = [x for x in st.slot_fills if not ptr <= x[0] < end]
        st.slot_reads = [x for x in st.slot_reads if not ptr <= x[0] < end]

    def pinned_of(self, ptr: int) -> tuple[int, int] | None:
        st = self.swap
        i = bisect.bisect_right(st.pinned_starts, ptr) - 1
        if i < 0:
            return None
        base = st.pinned_starts[i]
        return (base, st.pinned[base]) if ptr < base + st.pinned[base] else None

    def pinned_bytes(self) -> int:
        return sum(self.swap.pinned.values())

    # -- copies --------------------------------------------------------------------
    def memcpy(self, call: str, dst: int, src: int, count: int, kind: int, stream: object) -> Op:
        """``cudaMemcpyAsync``, checked, queued on ``stream`` and applied to the page and slot state."""
        if not all(isinstance(x, int) for x in (dst, src, count)):
            raise TypeError(f"{call}: dst, src and count must be int")
        if count < 0:
            raise OverflowError(f"{call}: count {count!r} is not a size_t")
        if kind not in (MEMCPY_H2H, MEMCPY_H2D, MEMCPY_D2H, MEMCPY_D2D, MEMCPY_DEFAULT):
            raise FakeCudaError(INVALID_MEMCPY_DIRECTION, call, f"kind {kind!r} is not a cudaMemcpyKind")
        if count == 0:
            raise FakeCudaError(INVALID_VALUE, call, "count 0")
        return self._copy(call, dst, src, count, kind, stream)

    def sm_copy(self, dst: int, src: int, count: int, stream: object) -> Op:
        """umrt's SM copy kernel (``umrt_sm_copy``) on ``stream``: ``count`` bytes between pinned
        and managed memory, one side each, checked and applied as a copy is. A kernel reading or
        writing pinned memory needs it mapped into the device's address space: every
        ``cudaHostAlloc`` allocation is, with unified addressing (CUDA Runtime API, "Unified
        Addressing"), which the fake has. Its pointers must be 16-byte aligned and ``count`` a
        multiple of 16 (the kernel moves 16-byte words): anything else is an illegal address."""
        call = "umrt_sm_copy"
        if not all(isinstance(x, int) for x in (dst, src, count)) or count <= 0:
            raise TypeError(f"{call}: dst, src and count must be int, count > 0")
        if (dst | src | count) % 16:
            raise FakeCudaError(ILLEGAL_ADDRESS, call, f"({src:#x} -> {dst:#x}, {count}) is not in 16-byte words")
        if (self.pinned_of(dst) is None) == (self.pinned_of(src) is None):
            raise FakeCudaError(ILLEGAL_ADDRESS, call, "copies between pinned and managed memory, one side each")
        return self._copy(call, dst, src, count, None, stream)

    def _copy(self, call: str, dst: int, src: int, count: int, kind: int | None, stream: object) -> Op:
        where = {}
        for name, ptr in (("dst", dst), ("src", src)):
            managed, pinned = self.allocation_of(ptr), self.pinned_of(ptr)
            alloc = managed or pinned
            if alloc is None or ptr + count > alloc[0] + alloc[1]:
                raise FakeCudaError(INVALID_VALUE, call, f"{name} ({ptr:#x}, {count}) is not inside one pinned or "
                                                         "managed allocation")
            where[name] = "device" if managed else "host"
        if dst < src + count and src < dst + count:
            raise FakeCudaError(INVALID_VALUE, call, "the memory areas overlap")
        expected = {MEMCPY_H2H: ("host", "host"), MEMCPY_H2D: ("host", "device"), MEMCPY_D2H: ("device", "host"),
                    MEMCPY_D2D: ("device", "device")}.get(kind)  # type: ignore[arg-type]
        if expected is not None and expected != (where["src"], where["dst"]):
            raise FakeCudaError(INVALID_MEMCPY_DIRECTION, call, f"kind {kind} does not match a copy from "
                                                                f"{where['src']} to {where['dst']} memory")
        self.stream_key(call, stream)
        op = self.issue(call, stream, f"({src:#x} -> {dst:#x}, {count})")
        st = self.swap
        st.copies.append(op)
        if where["src"] == "device":
            self._copy_out(op, src, count)
        if where["dst"] == "host":
            self._fill_slot(op, dst, count)
        if where["src"] == "host":
            self._read_slot(op, src, count)
        if where["dst"] == "device":
            self._copy_in(op, dst, count)
        return op

    def _copy_out(self, op: Op, src: int, count: int) -> None:
        st = self.swap
        unwritten = [(s_, e_) for s_, e_ in _gaps(st.written.overlap(src, src + count), src, src + count)]
        lost = self._dead.overlap(src, src + count)
        if unwritten or lost:
            s_, e_ = (unwritten or lost)[0]
            self._violate("copy-out-unwritten", f"{op} copies out ({s_:#x}, {e_ - s_}) bytes that hold nothing: "
                                                "never written, or discarded and not written since")
        for i in range(src // PAGE, -(-(src + count) // PAGE)):
            for k in st.writers.get(i, {}).values():
                if not self.ordered(k, op):
                    self._violate("copy-out-race", f"{op} copies out page {i * PAGE:#x} while {k}, which writes it, "
                                                   "is queued and not ordered before it")
            page = self._pages.get(i)
            if page is not None and page.discard_op is not None and not self.ordered(page.discard_op, op):
                self._violate("discard-race", f"{op} copies page {i * PAGE:#x} while {page.discard_op} may still run")
            st.copied_out[i] = op

    def _copy_in(self, op: Op, dst: int, count: int) -> None:
        st = self.swap
        for i in range(dst // PAGE, -(-(dst + count) // PAGE)):
            page = self._pages.get(i)
            if page is not None:
                if page.discard_op is not None and not self.ordered(page.discard_op, op):
                    self._violate("discard-race", f"{op} copies into page {i * PAGE:#x} while {page.discard_op} "
                                                  "may still run")
                if page.discarded or (page.revive_op is not None and not self.ordered(page.revive_op, op)):
                    self._violate("copy-into-discarded", f"{op} copies into page {i * PAGE:#x}, discarded by "
                                                         f"{page.discard_op}, with no population of it ordered before")
                for k in page.uses.values():
                    if not self.ordered(k, op):
                        self._violate("copy-race", f"{op} copies into page {i * PAGE:#x} while {k}, which touches it, "
                                                   "is queued and not ordered before it")
                page.loc = "gpu"
            st.copied_in[i] = op
        st.written.add(dst, dst + count)
        self._dead.remove(dst, dst + count)

    def _fill_slot(self, op: Op, dst: int, count: int) -> None:
        st = self.swap
        for s_, e_, reader in st.slot_reads:
            if s_ < dst + count and dst < e_ and not self.ordered(reader, op):
                self._violate("slot-reused", f"{op} writes pinned ({max(s_, dst):#x}, ...) while {reader}, which "
                                             "copies those bytes back, is not ordered before it")
        st.slot_reads = [x for x in st.slot_reads if not (x[0] < dst + count and dst < x[1])]
        st.slot_fills = [x for x in st.slot_fills if not (x[0] < dst + count and dst < x[1])]
        st.slot_fills.append((dst, dst + count, op))

    def _read_slot(self, op: Op, src: int, count: int) -> None:
        st = self.swap
        covered = _Intervals()
        for s_, e_, filler in st.slot_fills:
            if s_ < src + count and src < e_:
                covered.add(max(s_, src), min(e_, src + count))
                if not self.ordered(filler, op):
                    self._violate("slot-read-early", f"{op} copies back pinned bytes that {filler}, which fills "
                                                     "them, is not ordered before")
        if len(covered) < count:
            self._violate("slot-read-early", f"{op} copies back pinned bytes ({src:#x}, {count}) no copy out filled")
        st.slot_reads.append((src, src + count, op))

    # -- hooks into the rest of the fake -----------------------------------------------
    def swap_check_discard(self, op: Op, index: int) -> None:
        """A discard of page ``index`` must come after the page's copy out."""
        out = self.swap.copied_out.get(index)
        if out is not None and op.vc.get(out.stream, 0) < out.seq:
            self._violate("discard-before-copy-out", f"{op} discards page {index * PAGE:#x} while {out}, which "
                                                     "copies it out, is not ordered before it")

    def swap_check_kernel(self, op: Op, touched: list) -> None:
        """A kernel: it must come after the copies back of its pages; its writes hold data."""
        st = self.swap
        for p, n, write in touched:
            if self.allocation_of(p) is None:
                continue
            copied_in, vc = st.copied_in, op.vc
            for i in range(p // PAGE, -(-(p + n) // PAGE)):
                back = copied_in.get(i)
                if back is not None and vc.get(back.stream, 0) < back.seq:
                    self._violate("read-before-copy-back", f"{op} touches page {i * PAGE:#x} before {back}, which "
                                                           "copies it back, is ordered before it")
                if write:
                    st.writers.setdefault(i, {})[op.stream] = op
            if write:
                st.written.add(p, p + n)

    def swap_forget(self, ptr: int, n: int) -> None:
        """``cudaFree`` of managed memory: what the swap path remembers of it goes."""
        st = self.__dict__.get("_swap_state")
        if st is None:
            return
        st.written.remove(ptr, ptr + n)
        for i in range(ptr // PAGE, -(-(ptr + n) // PAGE)):
            st.writers.pop(i, None)
            st.copied_out.pop(i, None)
            st.copied_in.pop(i, None)


def _gaps(covered: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` outside the sorted, disjoint ``covered`` intervals."""
    out, at = [], start
    for s_, e_ in covered:
        if s_ > at:
            out.append((at, s_))
        at = max(at, e_)
    if at < end:
        out.append((at, end))
    return out


class _LastUse:
    """For one stream: the newest kernel that touched each byte, as sorted, disjoint
    ``[start, end)`` intervals with their op."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.ops: list[Op] = []

    def set(self, start: int, end: int, op: Op) -> None:
        i = bisect.bisect_right(self.ends, start)
        j = bisect.bisect_left(self.starts, end)
        keep = []
        if i < j and self.starts[i] < start:
            keep.append((self.starts[i], start, self.ops[i]))
        keep.append((start, end, op))
        if i < j and self.ends[j - 1] > end:
            keep.append((end, self.ends[j - 1], self.ops[j - 1]))
        self.starts[i:j] = [k[0] for k in keep]
        self.ends[i:j] = [k[1] for k in keep]
        self.ops[i:j] = [k[2] for k in keep]

    def overlap(self, start: int, end: int) -> list[Op]:
        i = bisect.bisect_right(self.ends, start)
        out = []
        while i < len(self.starts) and self.starts[i] < end:
            out.append(self.ops[i])
            i += 1
        return out

    def drop(self, start: int, end: int) -> None:
        i = bisect.bisect_right(self.ends, start)
        j = bisect.bisect_left(self.starts, end)
        keep = []
        if i < j and self.starts[i] < start:
            keep.append((self.starts[i], start, self.ops[i]))
        if i < j and self.ends[j - 1] > end:
            keep.append((end, self.ends[j - 1], self.ops[j - 1]))
        self.starts[i:j] = [k[0] for k in keep]
        self.ends[i:j] = [k[1] for k in keep]
        self.ops[i:j] = [k[2] for k in keep]


@dataclass
class FakeGpu(SwapPath):
    """State of a fake machine. ``calls`` logs (name, args) of every runtime call."""

    devices: int = 1
    concurrent: bool = True
    total: int = 16 * 2**30
    managed_limit: int = 64 * 2**30  # host + device: managed memory may oversubscribe
    numa_nodes: int = 1
    strict: bool = True  # raise PageStateError at the offending call (else only record it)
    # Accept a range that runs on into the next allocation when the two touch (what the
    # UVM kernel driver does, uvm_migrate.c; not shown for the CUDA runtime on a GPU).
    span_allocations: bool = False
    allocs: dict[int, int] = field(default_factory=dict)
    discarded: list[tuple[int, int]] = field(default_factory=list)  # every range a discard was asked for
    advice: list[tuple[int, int, int, int]] = field(default_factory=list)
    events: dict[int, dict | None] = field(default_factory=dict)  # event -> captured work (None: never recorded)
    recorded: dict[int, object] = field(default_factory=dict)  # event -> stream it was last recorded on
    calls: list[tuple] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)  # GPU faults by cause: first-touch, host, discarded
    priorities: dict = field(default_factory=dict)  # stream handle -> priority (created with one)
    ops: list[Op] = field(default_factory=list)  # everything queued, in the order it was issued
    current: int = 0
    _next: int = 0x7F00_0000_0000
    _handles: int = 0x1000

    def __post_init__(self) -> None:
        self._streams: dict[object, _Stream] = {LEGACY: _Stream(LEGACY, True, 0)}
        self._created: dict[int, object] = {}  # created handle -> stream key (the handle itself)
        self._event_device: dict[int, int] = {}
        self._host: dict = {}  # what the host has waited for
        self._pages: dict[int, _Page] = {}  # page index (address // PAGE) -> state
        self._dead = _Intervals()  # bytes discarded and not written since
        self._last_use: dict[object, _LastUse] = {}  # stream key -> the newest kernel per byte
        self._starts: list[int] = []  # sorted allocation bases

    # -- checks --------------------------------------------------------------
    def allocation_of(self, ptr: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        base = self._starts[i]
        return (base, self.allocs[base]) if ptr < base + self.allocs[base] else None

    def check_range(self, call: str, ptr: object, n: object) -> None:
        if not isinstance(ptr, int) or not isinstance(n, int):
            raise TypeError(f"{call}: pointer and count must be int, got {type(ptr).__name__}, {type(n).__name__}")
        alloc = self.allocation_of(ptr)
        if alloc is None:
            raise FakeCudaError(INVALID_VALUE, call, f"{ptr:#x} is not managed memory")
        end = alloc[0] + alloc[1]
        while self.span_allocations and ptr + n > end and end in self.allocs:
            end += self.allocs[end]  # the next allocation starts right where this one ends
        if n <= 0 or ptr + n > end:
            raise FakeCudaError(INVALID_VALUE, call, f"range ({ptr:#x}, {n}) leaves its allocation")

    def check_device(self, call: str, device: int, host_ok: bool = True) -> None:
        if device == HOST and host_ok:
            return
        if not isinstance(device, int) or not 0 <= device < self.devices:
            raise FakeCudaError(INVALID_DEVICE, call, f"invalid device {device}")

    def check_concurrent(self, call: str) -> None:
        if not self.concurrent:
            raise FakeCudaError(INVALID_DEVICE, call, "device lacks concurrent managed access")

    def check_not_legacy(self, call: str, stream: object) -> None:
        if _handle(stream) in (0, STREAM_LEGACY):
            raise FakeCudaError(INVALID_VALUE, call, "the stream must not be the legacy NULL stream (0 or 1)")

    def handle(self) -> int:
        self._handles += 1
        return self._handles

    # -- streams and events --------------------------------------------------
    def stream_key(self, call: str, stream: object) -> object:
        """The stream a handle names (raises cudaErrorInvalidResourceHandle for an unknown one)."""
        h = _handle(stream)
        if h in (0, STREAM_LEGACY):
            return LEGACY
        if h == STREAM_PER_THREAD:
            key = ("ptds", threading.get_ident())
            if key not in self._streams:
                # It exists as long as its thread and, being blocking, has waited for every
                # legacy action so far.
                self._streams[key] = _Stream(key, True, self.current, dict(self._streams[LEGACY].frontier))
            return key
        if h in self._created:
            return self._created[h]
        raise FakeCudaError(INVALID_HANDLE, call, f"unknown stream {stream!r}")

    def create_stream(self, call: str, flags: int) -> int:
        if flags not in (STREAM_DEFAULT, STREAM_NON_BLOCKING):
            raise FakeCudaError(INVALID_VALUE, call, f"stream flags {flags!r} (cudaStreamDefault or NonBlocking)")
        h = self.handle()
        self._created[h] = h
        self._streams[h] = _Stream(h, flags == STREAM_DEFAULT, self.current)
        return h

    @property
    def streams(self) -> set:
        """The stream handles the fake accepts: the three built-in ones and every created one."""
        return {0, STREAM_LEGACY, STREAM_PER_THREAD, *self._created}

    def create_event(self, call: str, flags: int) -> int:
        if not isinstance(flags, int) or flags & ~(EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING | EVENT_INTERPROCESS):
            raise FakeCudaError(INVALID_VALUE, call, f"event flags {flags!r}")
        if flags & EVENT_INTERPROCESS and not flags & EVENT_DISABLE_TIMING:
            raise FakeCudaError(INVALID_VALUE, call, "cudaEventInterprocess needs cudaEventDisableTiming")
        h = self.handle()
        self.events[h] = None
        self._event_device[h] = self.current
        return h

    def record(self, call: str, event: int, stream: object) -> None:
        if event not in self.events:
            raise FakeCudaError(INVALID_HANDLE, call, f"unknown event {event!r}")
        st = self._streams[self.stream_key(call, stream)]
        device = self.current if st.key in (LEGACY,) or isinstance(st.key, tuple) else st.device
        if self._event_device[event] != device:
            raise FakeCudaError(INVALID_HANDLE, call, "event and stream are on different devices (contexts)")
        work = dict(st.frontier)
        _join(work, self._host)
        self.events[event] = work
        self.recorded[event] = st.key

    def wait(self, call: str, stream: object, event: int, flags: int) -> None:
        if flags not in (EVENT_WAIT_DEFAULT, EVENT_WAIT_EXTERNAL):
            raise FakeCudaError(INVALID_VALUE, call, f"wait flags {flags!r}")
        key = self.stream_key(call, stream)
        if event not in self.events:
            raise FakeCudaError(INVALID_HANDLE, call, f"unknown event {event!r}")
        work = self.events[event] or {}  # an event never recorded is an empty set of work
        if key == LEGACY:
            self._legacy_action(lambda st: _join(st.frontier, work))
        else:
            _join(self._streams[key].frontier, work)

    def synchronize(self, call: str, stream: object) -> None:
        """The host waits for a stream's work (and whatever that work waited for)."""
        _join(self._host, self._streams[self.stream_key(call, stream)].frontier)

    def device_synchronize(self) -> None:
        """The host waits for every stream (cudaDeviceSynchronize)."""
        for st in self._streams.values():
            _join(self._host, st.frontier)

    def _legacy_action(self, act) -> None:
        """The legacy stream waits for every blocking stream, acts, then they all wait for it."""
        legacy = self._streams[LEGACY]
        blocking = [st for st in self._streams.values() if st.blocking and st.key != LEGACY]
        for st in blocking:
            _join(legacy.frontier, st.frontier)
        act(legacy)
        for st in blocking:
            _join(st.frontier, legacy.frontier)

    def issue(self, call: str, stream: object, detail: str = "") -> Op:
        """Queue one operation on ``stream``; return it (with its place in the order)."""
        key = self.stream_key(call, stream)
        made: list[Op] = []

        def act(st: _Stream) -> None:
            _join(st.frontier, self._host)
            st.seq += 1
            st.frontier[st.key] = st.seq
            made.append(Op(call, st.key, st.seq, dict(st.frontier), detail))

        if key == LEGACY:
            self._legacy_action(act)
        else:
            act(self._streams[key])
        self.ops.append(made[0])
        return made[0]

    def completed(self, op: Op) -> bool:
        """Whether the host has waited for ``op`` (a stream or device synchronize after it)."""
        return self._host.get(op.stream, 0) >= op.seq

    def ops_named(self, name: str) -> list[Op]:
        return [op for op in self.ops if op.name == name]

    @staticmethod
    def ordered(before: Op, after: Op) -> bool:
        """Whether ``before`` is guaranteed to finish before ``after`` starts."""
        return after.vc.get(before.stream, 0) >= before.seq

    # -- allocation ------------------------------------------------------------
    def malloc(self, call: str, n: int, flags: int) -> int:
        if not isinstance(n, int) or n < 0:
            raise OverflowError(f"{call}: size {n!r} is not a size_t")
        if n == 0:
            raise FakeCudaError(INVALID_VALUE, call, "size 0")
        if flags not in (MEM_ATTACH_GLOBAL, MEM_ATTACH_HOST):
            raise FakeCudaError(INVALID_VALUE, call, f"flags {flags!r} (cudaMemAttachGlobal or cudaMemAttachHost)")
        if sum(self.allocs.values()) + n > self.managed_limit:
            raise FakeCudaError(MEMORY_ALLOCATION, call, "out of memory")
        ptr = self._next
        self._next += -(-n // ALIGN) * ALIGN
        self.allocs[ptr] = n
        bisect.insort(self._starts, ptr)
        return ptr

    def free(self, call: str, ptr: int) -> None:
        if ptr == 0:
            return  # "If devPtr is 0, no operation is performed"
        if ptr not in self.allocs:
            raise FakeCudaError(INVALID_VALUE, call, f"{ptr:#x} was not allocated (or was freed already)")
        n = self.allocs.pop(ptr)
        self._starts.remove(ptr)
        for i in range(ptr // PAGE, -(-(ptr + n) // PAGE)):
            self._pages.pop(i, None)
        self._dead.remove(ptr, ptr + n)
        self.swap_forget(ptr, n)
        for uses in self._last_use.values():
            uses.drop(ptr, ptr + n)

    def base_of(self, ptr: int) -> int:
        alloc = self.allocation_of(ptr)
        if alloc is None:
            raise KeyError(f"{ptr:#x} is not managed memory")
        return alloc[0]

    # -- migrations ------------------------------------------------------------
    def prefetch(self, call: str, ptr: int, n: int, device: int, stream: object) -> None:
        """``cudaMemPrefetchAsync`` (either front end), checked and applied."""
        self.check_range(call, ptr, n)
        self.check_device(call, device)
        self.stream_key(call, stream)
        self.check_concurrent(call)
        op = self.issue(call, stream, f"({ptr:#x}, {n}) -> {_where(device)}")
        self._move(op, [(ptr, n)], "gpu" if device != HOST else "host", discard=False)

    def migrate_batch(self, call: str, ranges: list[tuple[int, int]], targets: list[int], stream: object,
                      discard: bool) -> None:
        """A checked batch of prefetches, discards or discard-and-prefetches (one stream-ordered op)."""
        detail = f"{len(ranges)} range(s)"
        op = self.issue(call, stream, detail)
        if discard:
            self.discarded.extend(ranges)
        for (p, n), target in zip(ranges, targets, strict=True):
            self._move(op, [(p, n)], None if target is None else ("gpu" if target != HOST else "host"),
                       discard=discard)

    def _move(self, op: Op, ranges: list[tuple[int, int]], dest: str | None, discard: bool) -> None:
        """Check, then apply, one migration or discard of every 64 KiB page of ``ranges``
        (``ordered`` inlined: this loop runs per page)."""
        vc, pages = op.vc, self._pages
        mine = "discarded" if dest is None else dest
        # A prefetch *to* the GPU cannot take a page from a GPU kernel (accesses stay coherent
        # during a migration, header line 7127), so only evictions and discards must wait.
        evicts = discard or dest == "host"
        for ptr, n in ranges:
            if discard:
                # The driver may drop whole CPU pages around the range's ends.
                start, end = ptr // CPU_PAGE * CPU_PAGE, -(-(ptr + n) // CPU_PAGE) * CPU_PAGE
                self._dead.add(start, end)
            for i in range(ptr // PAGE, -(-(ptr + n) // PAGE)):
                page = pages.get(i)
                if page is None:
                    page = pages[i] = _Page()
                if discard:
                    self.swap_check_discard(op, i)
                if evicts:
                    for k in page.uses.values():
                        if vc.get(k.stream, 0) < k.seq:
                            self._violate("migrated-in-use", f"{op} moves page {i * PAGE:#x} while {k}, which "
                                                             "touches it, is queued and not ordered before it")
                done = page.discard_op
                if done is not None and vc.get(done.stream, 0) < done.seq:
                    self._violate("discard-race", f"{op} touches page {i * PAGE:#x} while {done} may still run")
                last = page.last_move
                if last is not None and last[0] is not done:  # (checked just above)
                    prev = last[0]
                    if (discard or last[1] != mine) and vc.get(prev.stream, 0) < prev.seq:
                        self._violate("migration-race" if not discard else "discard-race",
                                      f"{op} and {prev} both move page {i * PAGE:#x} and are not ordered")
                if discard:
                    page.discard_op, page.revive_op = op, None
                    page.discarded, page.loc = True, None
                if dest == "gpu":
                    if page.discarded:
                        page.discarded, page.revive_op = False, op
                    page.loc = "gpu"
                elif dest == "host":
                    page.loc = "host"
                page.last_move = (op, mine)

    # -- kernels -----------------------------------------------------------------
    def kernel(self, stream: object, reads=(), writes=(), name: str = "kernel") -> Op:
        """Queue a kernel that reads and writes these ``(ptr, nbytes)`` ranges on ``stream``,
        as the framework would launch it. Checks the page-state rules (module docstring)."""
        op = self.issue(name, stream)
        touched = [(int(p), int(n), False) for p, n in reads] + [(int(p), int(n), True) for p, n in writes]
        spans = []
        for p, n, _ in touched:
            alloc = self.allocation_of(p)
            if n <= 0 or alloc is None or p + n > alloc[0] + alloc[1]:
                self._violate("illegal-address", f"{op} touches ({p:#x}, {n}), not inside a live managed allocation")
                continue
            spans.append((p // PAGE, -(-(p + n) // PAGE)))
        # Each page once, in address order; ``ordered`` inlined (this loop runs per 64 KiB page).
        vc, key, pages, faults = op.vc, op.stream, self._pages, self.faults
        for i in _page_indices(spans):
            page = pages.get(i)
            if page is None:
                page = pages[i] = _Page()
            done = page.discard_op
            if done is not None and vc.get(done.stream, 0) < done.seq:
                self._violate("discard-race", f"{op} touches page {i * PAGE:#x} while {done} may still run")
            if page.discarded:
                faults["discarded"] += 1
                self._violate("refault", f"{op} touches page {i * PAGE:#x}, discarded by {page.discard_op}, with no "
                                         "prefetch to the GPU ordered in between")
                page.discarded = False
            elif (revive := page.revive_op) is not None and vc.get(revive.stream, 0) < revive.seq:
                self._violate("refault", f"{op} touches page {i * PAGE:#x}, discarded by {page.discard_op}; the "
                                         f"prefetch that repopulates it, {revive}, is not ordered before the kernel")
            elif page.loc != "gpu":
                faults["first-touch" if page.loc is None else "host"] += 1
            page.loc = "gpu"
            page.uses[key] = op
        for p, n, write in touched:
            if not write:
                lost = self._dead.overlap(p, p + n)
                if lost:
                    s, e = lost[0]
                    self._violate("discarded-read", f"{op} reads ({s:#x}, {e - s}) bytes that were discarded and "
                                                    "not written since")
        for p, n, write in touched:
            if write:
                self._dead.remove(p, p + n)
                for key, uses in self._last_use.items():
                    if key == op.stream:
                        continue
                    for other in uses.overlap(p, p + n):
                        if not self.ordered(other, op):
                            self._violate("stream-race", f"{op} writes ({p:#x}, {n}) bytes {other} touched on "
                                                         "another stream, and is not ordered after it")
                            break
        mine = self._last_use.setdefault(op.stream, _LastUse())
        for p, n, _ in touched:
            if self.allocation_of(p) is not None:
                mine.set(p, p + n, op)
        self.swap_check_kernel(op, touched)
        return op

    # -- advice and queries --------------------------------------------------------
    def advise(self, call: str, ptr: int, n: int, advice: int, device: int | None) -> None:
        """``cudaMemAdvise``; ``device`` None: a location the advice ignores."""
        self.check_range(call, ptr, n)
        if advice not in range(1, 7):
            raise FakeCudaError(INVALID_VALUE, call, f"invalid advice {advice!r}")
        if device is not None:
            self.check_device(call, device)
            if device != HOST:
                self.check_concurrent(call)
        self.advice.append((ptr, n, advice, HOST if device is None else device))

    def where(self, ptr: int) -> str | None:
        """Where the page holding ``ptr`` is: "gpu", "host" or None (not populated)."""
        page = self._pages.get(ptr // PAGE)
        return None if page is None else page.loc

    def resident_bytes(self) -> int:
        return PAGE * sum(1 for p in self._pages.values() if p.loc == "gpu")

    def dead_bytes(self) -> int:
        """Bytes discarded and not written since (reading them is a ``discarded-read``)."""
        return len(self._dead)

    def mem_info(self) -> tuple[int, int]:
        return max(0, self.total - self.resident_bytes()), self.total

    def _violate(self, kind: str, message: str) -> None:
        self.violations.append(Violation(kind, message))
        if self.strict:
            raise PageStateError(kind, message)

    def log(self, *entry: object) -> None:
        self.calls.append(entry)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def _handle(stream: object) -> int | None:
    try:
        return int(stream)
    except (TypeError, ValueError):
        return None


def _where(device: int) -> str:
    return "host" if device == HOST else f"GPU {device}"


# ---------------------------------------------------------------------------
# CUDA 12: cupy.cuda.runtime
# ---------------------------------------------------------------------------
class CUDARuntimeError(RuntimeError):
    """Like cupy_backends.cuda.api.runtime.CUDARuntimeError."""

    def __init__(self, status: int, why: str = "") -> None:
        self.status = status
        super().__init__(f"{ERROR_NAMES.get(status, status)}: {why}")


class FakeCupyRuntime:
    """The subset of ``cupy.cuda.runtime`` (cupy-cuda12x 14.x) umrt calls, same signatures."""

    cudaCpuDeviceId = HOST
    cudaMemAttachGlobal = MEM_ATTACH_GLOBAL
    cudaMemAttachHost = MEM_ATTACH_HOST
    streamDefault = STREAM_DEFAULT
    streamNonBlocking = STREAM_NON_BLOCKING
    streamLegacy = STREAM_LEGACY
    streamPerThread = STREAM_PER_THREAD
    eventDefault = EVENT_DEFAULT
    eventBlockingSync = EVENT_BLOCKING_SYNC
    eventDisableTiming = EVENT_DISABLE_TIMING
    eventInterprocess = EVENT_INTERPROCESS
    cudaDevAttrConcurrentManagedAccess = ATTR_CONCURRENT_MANAGED_ACCESS
    CUDARuntimeError = CUDARuntimeError

    def __init__(self, gpu: FakeGpu, version: int = 12080) -> None:
        self.gpu = gpu
        self._version = version

    def _run(self, call: str, fn, *args):
        self.gpu.log(call, *args)
        try:
            return fn(*args)
        except FakeCudaError as exc:
            raise CUDARuntimeError(exc.status, str(exc)) from None

    @staticmethod
    def _ints(call: str, *args: object) -> None:
        for a in args:
            if not isinstance(a, int):  # cupy's Cython signatures take C integers only
                raise TypeError(f"{call}: an integer is required, got {type(a).__name__}")

    def runtimeGetVersion(self) -> int:
        return self._version

    def driverGetVersion(self) -> int:
        return self._version

    def getDeviceCount(self) -> int:
        return self.gpu.devices

    def setDevice(self, device: int) -> None:
        def op(d):
            self.gpu.check_device("setDevice", d, host_ok=False)
            self.gpu.current = d
        self._run("setDevice", op, device)

    def getDevice(self) -> int:
        return self.gpu.current

    def deviceGetAttribute(self, attrib: int, device: int) -> int:
        self._ints("deviceGetAttribute", attrib, device)
        return self._run("deviceGetAttribute", lambda a, d: _attribute(self.gpu, "deviceGetAttribute", a, d),
                         attrib, device)

    def memGetInfo(self) -> tuple[int, int]:
        return self.gpu.mem_info()

    def mallocManaged(self, size: int, flags: int = MEM_ATTACH_GLOBAL) -> int:
        self._ints("mallocManaged", size, flags)
        return self._run("mallocManaged", lambda s, f: self.gpu.malloc("mallocManaged", s, f), size, flags)

    def free(self, ptr: int) -> None:
        self._ints("free", ptr)
        self._run("free", lambda p: self.gpu.free("free", p), ptr)

    def streamCreateWithFlags(self, flags: int) -> int:
        self._ints("streamCreateWithFlags", flags)
        return self._run("streamCreateWithFlags", lambda f: self.gpu.create_stream("streamCreateWithFlags", f), flags)

    def eventCreateWithFlags(self, flags: int) -> int:
        self._ints("eventCreateWithFlags", flags)
        return self._run("eventCreateWithFlags", lambda f: self.gpu.create_event("eventCreateWithFlags", f), flags)

    def eventRecord(self, event: int, stream: int) -> None:
        self._ints("eventRecord", event, stream)
        self._run("eventRecord", lambda e, s: self.gpu.record("eventRecord", e, s), event, stream)

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self._ints("streamWaitEvent", stream, event, flags)
        self._run("streamWaitEvent", lambda s, e, f: self.gpu.wait("streamWaitEvent", s, e, f), stream, event, flags)

    def streamSynchronize(self, stream: int) -> None:
        self._ints("streamSynchronize", stream)
        self._run("streamSynchronize", lambda s: self.gpu.synchronize("streamSynchronize", s), stream)

    def deviceSynchronize(self) -> None:
        self._run("deviceSynchronize", self.gpu.device_synchronize)

    def memPrefetchAsync(self, devPtr: int, count: int, dstDevice: int, stream: int) -> None:
        self._ints("memPrefetchAsync", devPtr, count, dstDevice, stream)
        self._run("memPrefetchAsync", lambda *a: self.gpu.prefetch("memPrefetchAsync", *a),
                  devPtr, count, dstDevice, stream)

    def memAdvise(self, devPtr: int, count: int, advice: int, device: int) -> None:
        self._ints("memAdvise", devPtr, count, advice, device)

        def op(p, n, a, d):
            # CUDA 12: the device matters for PreferredLocation and AccessedBy only.
            self.gpu.advise("memAdvise", p, n, a, d if a in (ADVICE_SET_PREFERRED, ADVICE_SET_ACCESSED_BY,
                                                              ADVICE_UNSET_ACCESSED_BY) else None)
        self._run("memAdvise", op, devPtr, count, advice, device)


def _attribute(gpu: FakeGpu, call: str, attr: int, device: int) -> int:
    gpu.check_device(call, device, host_ok=False)
    values = {ATTR_MANAGED_MEMORY: 1, ATTR_PAGEABLE_MEMORY_ACCESS: 0,
              ATTR_CONCURRENT_MANAGED_ACCESS: int(gpu.concurrent)}
    if int(attr) not in values:
        raise FakeCudaError(INVALID_VALUE, call, f"attribute {attr!r} (the fake knows {sorted(values)})")
    return values[int(attr)]


# ---------------------------------------------------------------------------
# CUDA 13: cuda.bindings.runtime
# ---------------------------------------------------------------------------
class cudaError_t(enum.IntEnum):
    cudaSuccess = SUCCESS
    cudaErrorInvalidValue = INVALID_VALUE
    cudaErrorInvalidMemcpyDirection = INVALID_MEMCPY_DIRECTION
    cudaErrorMemoryAllocation = MEMORY_ALLOCATION
    cudaErrorInvalidDevice = INVALID_DEVICE
    cudaErrorInvalidResourceHandle = INVALID_HANDLE
    cudaErrorNotSupported = NOT_SUPPORTED


class cudaMemLocationType(enum.IntEnum):
    cudaMemLocationTypeInvalid = 0
    cudaMemLocationTypeDevice = 1
    cudaMemLocationTypeHost = 2
    cudaMemLocationTypeHostNuma = 3
    cudaMemLocationTypeHostNumaCurrent = 4


class cudaMemoryAdvise(enum.IntEnum):
    cudaMemAdviseSetReadMostly = 1
    cudaMemAdviseUnsetReadMostly = 2
    cudaMemAdviseSetPreferredLocation = 3
    cudaMemAdviseUnsetPreferredLocation = 4
    cudaMemAdviseSetAccessedBy = 5
    cudaMemAdviseUnsetAccessedBy = 6


class cudaDeviceAttr(enum.IntEnum):
    cudaDevAttrManagedMemory = ATTR_MANAGED_MEMORY
    cudaDevAttrPageableMemoryAccess = ATTR_PAGEABLE_MEMORY_ACCESS
    cudaDevAttrConcurrentManagedAccess = ATTR_CONCURRENT_MANAGED_ACCESS


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = MEMCPY_H2H
    cudaMemcpyHostToDevice = MEMCPY_H2D
    cudaMemcpyDeviceToHost = MEMCPY_D2H
    cudaMemcpyDeviceToDevice = MEMCPY_D2D
    cudaMemcpyDefault = MEMCPY_DEFAULT


class cudaMemLocation:
    def __init__(self) -> None:
        self.type = cudaMemLocationType.cudaMemLocationTypeInvalid
        self.id = 0


class FakeBindingsRuntime:
    """The subset of ``cuda.bindings.runtime`` (13.x) umrt calls, same signatures and returns."""

    cudaError_t = cudaError_t
    cudaMemLocationType = cudaMemLocationType
    cudaMemoryAdvise = cudaMemoryAdvise
    cudaDeviceAttr = cudaDeviceAttr
    cudaMemLocation = cudaMemLocation
    cudaMemcpyKind = cudaMemcpyKind
    cudaHostAllocDefault, cudaHostAllocPortable, cudaHostAllocMapped, cudaHostAllocWriteCombined = 0x0, 0x1, 0x2, 0x4
    cudaMemAttachGlobal = MEM_ATTACH_GLOBAL
    cudaMemAttachHost = MEM_ATTACH_HOST
    cudaStreamDefault = STREAM_DEFAULT
    cudaStreamNonBlocking = STREAM_NON_BLOCKING
    cudaStreamLegacy = STREAM_LEGACY
    cudaStreamPerThread = STREAM_PER_THREAD
    cudaEventDefault = EVENT_DEFAULT
    cudaEventBlockingSync = EVENT_BLOCKING_SYNC
    cudaEventDisableTiming = EVENT_DISABLE_TIMING
    cudaEventInterprocess = EVENT_INTERPROCESS
    cudaEventWaitDefault = EVENT_WAIT_DEFAULT
    cudaEventWaitExternal = EVENT_WAIT_EXTERNAL

    def __init__(self, gpu: FakeGpu, version: int = 13000) -> None:
        self.gpu = gpu
        self._version = version
        # umrt's SM copy kernel on this GPU (not a runtime call: the adapter takes it as its
        # launcher, umrt.backends.sm_copy.SmCopy)
        self.sm_copy_kernel = FakeSmCopy(gpu)

    def _run(self, call: str, fn, *args) -> tuple:
        self.gpu.log(call, *args)
        try:
            out = fn(*args)
        except FakeCudaError as exc:
            return (cudaError_t(exc.status),)
        return (cudaError_t.cudaSuccess,) + (out if isinstance(out, tuple) else (() if out is None else (out,)))

    def _target(self, call: str, loc: object, *, numa: bool = True) -> int:
        """A location as a device id or HOST (-1); ``numa``: host NUMA types are valid here."""
        if not isinstance(loc, cudaMemLocation):
            raise TypeError(f"{call}: location must be a cudaMemLocation, got {type(loc).__name__}")
        kind = loc.type
        if kind == cudaMemLocationType.cudaMemLocationTypeHost:
            return HOST  # id ignored
        if kind == cudaMemLocationType.cudaMemLocationTypeDevice:
            self.gpu.check_device(call, loc.id, host_ok=False)  # id -1 is NOT the host here
            return loc.id
        if numa and kind == cudaMemLocationType.cudaMemLocationTypeHostNumaCurrent:
            return HOST  # id ignored
        if numa and kind == cudaMemLocationType.cudaMemLocationTypeHostNuma:
            if not 0 <= loc.id < self.gpu.numa_nodes:
                raise FakeCudaError(INVALID_VALUE, call, f"host NUMA node {loc.id}")
            return HOST
        raise FakeCudaError(INVALID_VALUE, call, f"location type {kind!r}")

    def _batch(self, call: str, dptrs, sizes, count, flags, stream) -> list[tuple[int, int]]:
        """Checks common to the three batch calls (header lines 7159-7271)."""
        if not isinstance(dptrs, (list, tuple)) or not isinstance(sizes, (list, tuple)):
            raise TypeError(f"{call}: dptrs and sizes must be lists")
        if count != len(dptrs) or count != len(sizes) or count == 0:
            raise FakeCudaError(INVALID_VALUE, call, f"count {count} vs {len(dptrs)}/{len(sizes)}")
        if flags != 0:
            raise FakeCudaError(INVALID_VALUE, call, "flags must be 0")
        self.gpu.check_not_legacy(call, stream)
        self.gpu.stream_key(call, stream)
        self.gpu.check_concurrent(call)
        for p, n in zip(dptrs, sizes, strict=True):
            self.gpu.check_range(call, p, n)
        return list(zip(dptrs, sizes, strict=True))

    def _locs(self, call: str, count, locs, idxs, num) -> list[int]:
        """The destination of each operation (prefetchLocs / prefetchLocIdxs rules)."""
        if not isinstance(locs, (list, tuple)) or not isinstance(idxs, (list, tuple)):
            raise TypeError(f"{call}: prefetchLocs and prefetchLocIdxs must be lists")
        if num != len(locs) or num != len(idxs) or num == 0 or num > count:
            raise FakeCudaError(INVALID_VALUE, call, f"numPrefetchLocs {num} vs {len(locs)}/{len(idxs)}, count {count}")
        if idxs[0] != 0:
            raise FakeCudaError(INVALID_VALUE, call, f"the first prefetchLocIdxs entry must be 0, got {idxs[0]}")
        if any(b <= a for a, b in zip(idxs, idxs[1:], strict=False)) or idxs[-1] >= count:
            raise FakeCudaError(INVALID_VALUE, call, f"prefetchLocIdxs {list(idxs)} must increase and stay < count")
        targets = [self._target(call, loc) for loc in locs]
        out = []
        for k, target in enumerate(targets):
            end = idxs[k + 1] if k + 1 < num else count
            out.extend([target] * (end - idxs[k]))
        return out

    def cudaRuntimeGetVersion(self):
        return (cudaError_t.cudaSuccess, self._version)

    def cudaDriverGetVersion(self):
        return (cudaError_t.cudaSuccess, self._version)

    def cudaGetErrorName(self, err):
        return (cudaError_t.cudaSuccess, cudaError_t(err).name.encode())

    def cudaGetDeviceCount(self):
        return (cudaError_t.cudaSuccess, self.gpu.devices)

    def cudaSetDevice(self, device):
        def op(d):
            self.gpu.check_device("cudaSetDevice", d, host_ok=False)
            self.gpu.current = d
        return self._run("cudaSetDevice", op, device)

    def cudaDeviceGetAttribute(self, attr, device):
        def op(a, d):
            if not isinstance(a, cudaDeviceAttr):
                raise TypeError("attr must be a cudaDeviceAttr")
            return _attribute(self.gpu, "cudaDeviceGetAttribute", a, d)
        return self._run("cudaDeviceGetAttribute", op, attr, device)

    def cudaMemGetInfo(self):
        return (cudaError_t.cudaSuccess, *self.gpu.mem_info())

    def cudaMallocManaged(self, size, flags):
        return self._run("cudaMallocManaged", lambda s, f: self.gpu.malloc("cudaMallocManaged", s, f), size, flags)

    def cudaFree(self, ptr):
        return self._run("cudaFree", lambda p: self.gpu.free("cudaFree", p), ptr)

    def cudaStreamCreateWithFlags(self, flags):
        return self._run("cudaStreamCreateWithFlags",
                         lambda f: self.gpu.create_stream("cudaStreamCreateWithFlags", f), flags)

    def cudaDeviceGetStreamPriorityRange(self):
        return self._run("cudaDeviceGetStreamPriorityRange", lambda: STREAM_PRIORITIES)

    def cudaStreamCreateWithPriority(self, flags, priority):
        def op(f, p):
            if not isinstance(p, int):
                raise TypeError("priority must be int")
            # outside the range: "clamped to the lowest or the highest number in the range" (header)
            stream = self.gpu.create_stream("cudaStreamCreateWithPriority", f)
            self.gpu.priorities[stream] = min(max(p, STREAM_PRIORITIES[1]), STREAM_PRIORITIES[0])
            return stream
        return self._run("cudaStreamCreateWithPriority", op, flags, priority)

    def cudaEventCreateWithFlags(self, flags):
        return self._run("cudaEventCreateWithFlags",
                         lambda f: self.gpu.create_event("cudaEventCreateWithFlags", f), flags)

    def cudaEventRecord(self, event, stream):
        return self._run("cudaEventRecord", lambda e, s: self.gpu.record("cudaEventRecord", e, s), event, stream)

    def cudaStreamWaitEvent(self, stream, event, flags):
        return self._run("cudaStreamWaitEvent", lambda s, e, f: self.gpu.wait("cudaStreamWaitEvent", s, e, f),
                         stream, event, flags)

    def cudaStreamSynchronize(self, stream):
        return self._run("cudaStreamSynchronize", lambda s: self.gpu.synchronize("cudaStreamSynchronize", s), stream)

    def cudaDeviceSynchronize(self):
        return self._run("cudaDeviceSynchronize", self.gpu.device_synchronize)

    def cudaMemPrefetchAsync(self, devPtr, count, location, flags, stream):
        def op(p, n, loc, f, s):
            target = self._target("cudaMemPrefetchAsync", loc)
            if f != 0:
                raise FakeCudaError(INVALID_VALUE, "cudaMemPrefetchAsync", "flags must be 0")
            self.gpu.prefetch("cudaMemPrefetchAsync", p, n, target, s)
        return self._run("cudaMemPrefetchAsync", op, devPtr, count, location, flags, stream)

    def cudaMemAdvise(self, devPtr, count, advice, location):
        def op(p, n, a, loc):
            if not isinstance(a, cudaMemoryAdvise):
                raise TypeError("advice must be a cudaMemoryAdvise")
            call = "cudaMemAdvise"
            if a in (cudaMemoryAdvise.cudaMemAdviseSetReadMostly, cudaMemoryAdvise.cudaMemAdviseUnsetReadMostly,
                     cudaMemoryAdvise.cudaMemAdviseUnsetPreferredLocation):
                if not isinstance(loc, cudaMemLocation):
                    raise TypeError(f"{call}: location must be a cudaMemLocation")
                device = None  # "The location argument is ignored for this advice"
            else:
                # AccessedBy: Device or Host only ("All other location types are invalid").
                device = self._target(call, loc, numa=a == cudaMemoryAdvise.cudaMemAdviseSetPreferredLocation)
            self.gpu.advise(call, p, n, int(a), device)
        return self._run("cudaMemAdvise", op, devPtr, count, advice, location)

    # -- the swap path (SwapPath) ----------------------------------------------------------
    def cudaHostAlloc(self, size, flags):
        return self._run("cudaHostAlloc", lambda n, f: self.gpu.host_alloc("cudaHostAlloc", n, f), size, flags)

    def cudaFreeHost(self, ptr):
        return self._run("cudaFreeHost", lambda p: self.gpu.free_host("cudaFreeHost", p), ptr)

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        def op(d, s_, n, k, st):
            if not isinstance(k, cudaMemcpyKind):
                raise TypeError("kind must be a cudaMemcpyKind")
            self.gpu.memcpy("cudaMemcpyAsync", d, s_, n, int(k), st)
        return self._run("cudaMemcpyAsync", op, dst, src, count, kind, stream)

    def cudaMemPrefetchBatchAsync(self, dptrs, sizes, count, prefetchLocs, prefetchLocIdxs,
                                  numPrefetchLocs, flags, stream):
        call = "cudaMemPrefetchBatchAsync"

        def op(*_):
            ranges = self._batch(call, dptrs, sizes, count, flags, stream)
            targets = self._locs(call, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs)
            self.gpu.migrate_batch(call, ranges, targets, stream, discard=False)
        return self._run(call, op, dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags,
                         stream)

    def cudaMemDiscardBatchAsync(self, dptrs, sizes, count, flags, stream):
        call = "cudaMemDiscardBatchAsync"

        def op(*_):
            ranges = self._batch(call, dptrs, sizes, count, flags, stream)
            self.gpu.migrate_batch(call, ranges, [None] * len(ranges), stream, discard=True)
        return self._run(call, op, dptrs, sizes, count, flags, stream)

    def cudaMemDiscardAndPrefetchBatchAsync(self, dptrs, sizes, count, prefetchLocs, prefetchLocIdxs,
                                            numPrefetchLocs, flags, stream):
        call = "cudaMemDiscardAndPrefetchBatchAsync"

        def op(*_):
            ranges = self._batch(call, dptrs, sizes, count, flags, stream)
            targets = self._locs(call, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs)
            self.gpu.migrate_batch(call, ranges, targets, stream, discard=True)
        return self._run(call, op, dptrs, sizes, count, prefetchLocs, prefetchLocIdxs, numPrefetchLocs, flags,
                         stream)


def plain(x):
    """A logged call argument (or a whole call) as plain values: a cudaMemLocation as its
    type and fields, so two runs' logs compare with ``==``."""
    if isinstance(x, (int, str, float, type(None))):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(plain(y) for y in x)
    return (type(x).__name__, *(plain(v) for v in vars(x).values()))


class FakeSmCopy:
    """umrt's SM copy kernel, as :class:`umrt.backends.sm_copy.SmCopyKernel` launches it, on a
    :class:`FakeGpu`: ``build`` counts its builds, a launch is :meth:`FakeGpu.sm_copy`; a failed
    one raises CudaError."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.builds = 0

    def build(self) -> None:
        self.builds += 1

    def __call__(self, dst: int, src: int, count: int, stream) -> None:
        from umrt.errors import CudaError

        self.gpu.log("umrt_sm_copy", dst, src, count, stream)
        try:
            self.gpu.sm_copy(dst, src, count, stream)
        except FakeCudaError as exc:
            raise CudaError(f"umrt_sm_copy failed: {exc}") from None
