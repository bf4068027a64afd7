"""The ``cuda`` backend: real CUDA managed memory.

:class:`CudaBackend` implements :class:`umrt.backends.base.Backend` over one
of two thin adapters that make the actual runtime calls:

* :class:`CupyApi` (CUDA 12): ``cupy.cuda.runtime`` with the CUDA 12 call
  shapes, where a destination is a device id and ``cudaCpuDeviceId`` (-1) is
  the host. CUDA 12 has no batched prefetch (we loop) and no discard.
* :class:`BindingsApi` (CUDA 13): ``cuda.bindings.runtime``. CUDA 13 changed
  ``cudaMemPrefetchAsync``/``cudaMemAdvise`` to take a ``cudaMemLocation``
  ``{type, id}``; host targets need ``type=cudaMemLocationTypeHost``
  (cupy-cuda13x always builds a *device* location, so -1 would not reach the
  host). It also has ``cudaMemDiscardBatchAsync`` and
  ``cudaMemDiscardAndPrefetchBatchAsync``, which umrt uses (prefetches stay
  single calls: ``cudaMemPrefetchBatchAsync`` measured slower).

Why not cuda-core (1.2.2)? Its ``ManagedBuffer.prefetch`` and
``utils.prefetch_batch/discard_batch/discard_prefetch_batch`` act on whole
``Buffer`` objects (the batch forms need two or more), while umrt moves
sub-ranges of pooled slabs; the bindings take raw ranges directly.

Discard on CUDA 12 (documented fallback): :meth:`CudaBackend.discard` is a
no-op, and umrt's pool reuses a dead range *in place* for the next
allocation of that size, so its stale pages are never migrated back and
forth only to be overwritten.

Ordering: every prefetch and eviction runs on a dedicated non-blocking *copy
stream*, one ``cudaMemPrefetchAsync`` per coalesced range (the batched call
is slower for many small ranges: :meth:`CudaBackend.prefetch`). After each
one the backend records an event; :meth:`CudaBackend.launch` makes the
*compute stream* (the framework's stream, see
:meth:`CudaBackend.set_compute_stream`) wait on the latest event that touched
the kernel's ranges. Evictions first make the copy stream wait for the work
already queued on the compute stream, so no page moves while a kernel still
uses it. A discard (``cudaMemDiscardBatchAsync``) or discard-and-prefetch
(``cudaMemDiscardAndPrefetchBatchAsync``; neither has a single-range form)
destroys data, so it is ordered with the kernels: after the last kernel
queued before it, before the first kernel queued after it. On a created (or
per-thread) compute stream it runs on that stream. The batch calls reject the
legacy default stream (``0`` and ``cudaStreamLegacy``: "Must not be legacy
NULL stream", ``cudaErrorInvalidValue`` on the H100), which is torch's
default current stream; then the discard runs on a *blocking* stream of the
backend's own, which the legacy stream synchronizes with implicitly (why not
``cudaStreamPerThread``: :meth:`CudaBackend.discard_stream`). Either way the
discard stream first waits for copies still queued on its ranges, and a later
copy of a discarded range makes the copy stream wait for the discard.
:meth:`CudaBackend.populate` (a newborn's missing pages) and the prefetch of
pages umrt discarded run on the compute stream itself (a single
``cudaMemPrefetchAsync`` accepts the legacy stream), so the next kernel finds
them resident even when no :meth:`CudaBackend.launch` announces it.

Without concurrent managed access (Windows, WSL, pre-Pascal GPUs) the
driver rejects prefetch and advice; they become no-ops with one warning.
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from typing import Any

from umrt.backends.allocations import Allocations
from umrt.backends.base import HOST, PAGE, Advice, Backend, Range
from umrt.backends.cuda_order import (  # noqa: F401 (LEGACY_STREAMS, MAX_PENDING: re-exported)
    LEGACY_STREAMS,
    MAX_PENDING,
    CountedCalls,
    StreamOrder,
    is_legacy_stream,
    same_stream,
)
from umrt.backends.cuda_swap import CudaSwapPath
from umrt.backends.ranges import RangeSet
from umrt.backends.sm_copy import SmCopy, SmCopyKernel
from umrt.config import checked_swap_copy, swap_copy_in_env
from umrt.errors import CudaError

#: Discards are shrunk inward to this alignment: the driver drops whole pages,
#: and a partial page may hold a live neighbour (64 KiB = GPU UVM page size).
DISCARD_ALIGN = PAGE
CONCURRENT_MANAGED_ACCESS_ATTR = 89  # cudaDevAttrConcurrentManagedAccess
CUDA13 = 13000


# ---------------------------------------------------------------------------
# Adapters: one method per runtime call, nothing else.
# ---------------------------------------------------------------------------
class CudaApi(ABC):
    """The runtime calls the backend makes; handles (streams, events) are opaque."""

    #: CUDA runtime version (``12080``, ``13000``, ...).
    version: int
    #: True when the batched and discard entry points exist (CUDA 13+).
    has_batch: bool = False
    #: True when the calls reach this process's CUDA runtime (not a stand-in, as in tests):
    #: a native steady schedule may then call the runtime's library directly.
    process_runtime: bool = False

    @abstractmethod
    def device_count(self) -> int: ...
    @abstractmethod
    def set_device(self, device: int) -> None: ...
    @abstractmethod
    def concurrent_managed_access(self, device: int) -> bool: ...
    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]: ...
    @abstractmethod
    def malloc_managed(self, nbytes: int) -> int: ...
    @abstractmethod
    def free(self, ptr: int) -> None: ...
    @abstractmethod
    def create_stream(self, blocking: bool = False) -> Any:
        """cudaStreamCreateWithFlags: ``cudaStreamNonBlocking``, or ``cudaStreamDefault``
        (``blocking``: implicitly synchronized with the legacy default stream)."""
    @abstractmethod
    def create_event(self) -> Any: ...
    @abstractmethod
    def record_event(self, event: Any, stream: Any) -> None: ...
    @abstractmethod
    def stream_wait_event(self, stream: Any, event: Any) -> None: ...
    @abstractmethod
    def stream_synchronize(self, stream: Any) -> None: ...
    @abstractmethod
    def prefetch(self, ptr: int, nbytes: int, device: int, stream: Any) -> None: ...
    @abstractmethod
    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None: ...

    def discard_batch(self, ranges: Sequence[Range], stream: Any) -> None:
        raise NotImplementedError("cudaMemDiscardBatchAsync needs CUDA 13")

    #: True when the adapter makes the swap path's calls (pinned memory, cudaMemcpyAsync).
    has_copies: bool = False

    def host_alloc(self, nbytes: int) -> int:
        """cudaHostAlloc(nbytes, cudaHostAllocDefault): pinned host memory."""
        raise NotImplementedError("cudaHostAlloc: this adapter has no swap path")

    def free_host(self, ptr: int) -> None:
        """cudaFreeHost."""
        raise NotImplementedError("cudaFreeHost: this adapter has no swap path")

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream)."""
        raise NotImplementedError("cudaMemcpyAsync: this adapter has no swap path")

    def discard_and_prefetch_batch(self, ranges: Sequence[Range], device: int, stream: Any) -> None:
        raise NotImplementedError("cudaMemDiscardAndPrefetchBatchAsync needs CUDA 13")

    #: True when the adapter can launch umrt's SM copy kernel (:mod:`umrt.backends.sm_copy`).
    has_sm_copy: bool = False

    def sm_copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """umrt's SM copy kernel on ``stream``: ``nbytes`` between pinned and managed memory."""
        raise NotImplementedError("umrt_sm_copy: this adapter launches no kernel")

    def build_sm_copy(self) -> None:
        """Make the SM copy kernel ready (compiled) before a step needs it."""
        raise NotImplementedError("umrt_sm_copy: this adapter launches no kernel")

    def create_urgent_stream(self) -> Any:
        """A non-blocking stream whose kernels' blocks the scheduler prefers to those of other streams
        (cudaStreamCreateWithPriority at the device's greatest priority); here, a plain one."""
        return self.create_stream(False)


class CupyApi(CudaApi):
    """CUDA 12 through ``cupy.cuda.runtime`` (errors are ``CUDARuntimeError``)."""

    def __init__(self, runtime: Any = None) -> None:
        self.process_runtime = runtime is None
        if runtime is None:
            import cupy.cuda.runtime as runtime  # noqa: PLC0415 (GPU-only import)
        self.rt = runtime
        self.version = self._call("cudaRuntimeGetVersion", runtime.runtimeGetVersion)

    def _call(self, name: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.rt.CUDARuntimeError as exc:
            raise CudaError(f"{name} failed: {exc}") from exc

    def device_count(self) -> int:
        return self._call("cudaGetDeviceCount", self.rt.getDeviceCount)

    def set_device(self, device: int) -> None:
        self._call("cudaSetDevice", self.rt.setDevice, device)

    def concurrent_managed_access(self, device: int) -> bool:
        return bool(self._call("cudaDeviceGetAttribute", self.rt.deviceGetAttribute,
                               CONCURRENT_MANAGED_ACCESS_ATTR, device))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("cudaMemGetInfo", self.rt.memGetInfo)
        return int(free), int(total)

    def malloc_managed(self, nbytes: int) -> int:
        return int(self._call("cudaMallocManaged", self.rt.mallocManaged, nbytes, self.rt.cudaMemAttachGlobal))

    def free(self, ptr: int) -> None:
        self._call("cudaFree", self.rt.free, ptr)

    def create_stream(self, blocking: bool = False) -> int:
        flags = self.rt.streamDefault if blocking else self.rt.streamNonBlocking
        return self._call("cudaStreamCreateWithFlags", self.rt.streamCreateWithFlags, flags)

    def create_event(self) -> int:
        return self._call("cudaEventCreateWithFlags", self.rt.eventCreateWithFlags, self.rt.eventDisableTiming)

    def record_event(self, event: int, stream: int) -> None:
        self._call("cudaEventRecord", self.rt.eventRecord, event, stream)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("cudaStreamWaitEvent", self.rt.streamWaitEvent, stream, event, 0)

    def stream_synchronize(self, stream: int) -> None:
        self._call("cudaStreamSynchronize", self.rt.streamSynchronize, stream)

    def _host_ok(self, call: str, device: int) -> None:
        # cupy-cuda13x builds a *device* cudaMemLocation from the id, so -1 never reaches the host.
        if device == HOST and self.version >= CUDA13:
            raise CudaError(
                f"{call} to the host on CUDA 13 needs cuda-bindings (cupy-cuda13x turns -1 into a "
                "device location): pip install cuda-bindings"
            )

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        # CUDA 12 shape: (devPtr, count, dstDevice, stream); -1 = cudaCpuDeviceId.
        self._host_ok("cudaMemPrefetchAsync", device)
        self._call("cudaMemPrefetchAsync", self.rt.memPrefetchAsync, ptr, nbytes, device, stream)

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        self._host_ok("cudaMemAdvise", device)
        self._call("cudaMemAdvise", self.rt.memAdvise, ptr, nbytes, int(advice), device)


class BindingsApi(CudaApi):
    """CUDA 13 through ``cuda.bindings.runtime`` (every call returns ``(err, *results)``)."""

    has_batch = True
    has_copies = True

    def __init__(self, runtime: Any = None, sm_copy: SmCopy | None = None) -> None:
        """``runtime``: ``cuda.bindings.runtime`` (None: this process's); ``sm_copy``: what
        launches umrt's SM copy kernel (:class:`~umrt.backends.sm_copy.SmCopy`; None: for this
        process's runtime, :class:`~umrt.backends.sm_copy.SmCopyKernel` where CuPy imports;
        for a given runtime, none: its swap path copies on the copy engines)."""
        self.process_runtime = runtime is None
        if runtime is None:
            from cuda.bindings import runtime  # noqa: PLC0415 (GPU-only import)

            if sm_copy is None and SmCopyKernel.available():
                sm_copy = SmCopyKernel()
        self.rt = runtime
        self._sm_copy = sm_copy
        self.has_sm_copy = sm_copy is not None
        (self.version,) = self._call("cudaRuntimeGetVersion")

    def _call(self, name: str, *args: Any) -> tuple:
        out = getattr(self.rt, name)(*args)
        err, rest = out[0], tuple(out[1:])
        if err != self.rt.cudaError_t.cudaSuccess:
            _, label = self.rt.cudaGetErrorName(err)
            label = label.decode() if isinstance(label, bytes) else str(label)
            raise CudaError(f"{name} failed: {label} ({int(err)})")
        return rest

    def _location(self, device: int) -> Any:
        loc = self.rt.cudaMemLocation()
        kinds = self.rt.cudaMemLocationType
        if device == HOST:
            loc.type = kinds.cudaMemLocationTypeHost
            loc.id = 0  # ignored for Host
        else:
            loc.type = kinds.cudaMemLocationTypeDevice
            loc.id = device
        return loc

    def device_count(self) -> int:
        return int(self._call("cudaGetDeviceCount")[0])

    def set_device(self, device: int) -> None:
        self._call("cudaSetDevice", device)

    def concurrent_managed_access(self, device: int) -> bool:
        attr = self.rt.cudaDeviceAttr.cudaDevAttrConcurrentManagedAccess
        return bool(self._call("cudaDeviceGetAttribute", attr, device)[0])

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("cudaMemGetInfo")
        return int(free), int(total)

    def malloc_managed(self, nbytes: int) -> int:
        return int(self._call("cudaMallocManaged", nbytes, self.rt.cudaMemAttachGlobal)[0])

    def free(self, ptr: int) -> None:
        self._call("cudaFree", ptr)

    def create_stream(self, blocking: bool = False) -> Any:
        flags = self.rt.cudaStreamDefault if blocking else self.rt.cudaStreamNonBlocking
        return self._call("cudaStreamCreateWithFlags", flags)[0]

    def create_event(self) -> Any:
        return self._call("cudaEventCreateWithFlags", self.rt.cudaEventDisableTiming)[0]

    def record_event(self, event: Any, stream: Any) -> None:
        self._call("cudaEventRecord", event, stream)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._call("cudaStreamWaitEvent", stream, event, 0)

    def stream_synchronize(self, stream: Any) -> None:
        self._call("cudaStreamSynchronize", stream)

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: Any) -> None:
        # CUDA 13 shape: (devPtr, count, cudaMemLocation, flags, stream).
        self._call("cudaMemPrefetchAsync", ptr, nbytes, self._location(device), 0, stream)

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        self._call("cudaMemAdvise", ptr, nbytes, self.rt.cudaMemoryAdvise(int(advice)), self._location(device))

    def discard_batch(self, ranges: Sequence[Range], stream: Any) -> None:
        ptrs, sizes = [p for p, _ in ranges], [n for _, n in ranges]
        self._call("cudaMemDiscardBatchAsync", ptrs, sizes, len(ranges), 0, stream)

    def discard_and_prefetch_batch(self, ranges: Sequence[Range], device: int, stream: Any) -> None:
        ptrs, sizes = [p for p, _ in ranges], [n for _, n in ranges]
        self._call("cudaMemDiscardAndPrefetchBatchAsync", ptrs, sizes, len(ranges),
                   [self._location(device)], [0], 1, 0, stream)

    def host_alloc(self, nbytes: int) -> int:
        # cudaHostAlloc(size, flags) -> (err, ptr); cudaHostAllocMapped (driver_types.h): mapped into
        # the device's address space (the SM copy kernel reads and writes it; with unified
        # addressing it is mapped at the same address either way).
        return int(self._call("cudaHostAlloc", nbytes, self.rt.cudaHostAllocMapped)[0])

    def free_host(self, ptr: int) -> None:
        self._call("cudaFreeHost", ptr)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        # cudaMemcpyDefault: the direction comes from the pointers (unified virtual addressing).
        self._call("cudaMemcpyAsync", dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDefault, stream)

    def sm_copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if self._sm_copy is None:
            super().sm_copy(dst, src, nbytes, stream)
        self._sm_copy(dst, src, nbytes, stream)

    def build_sm_copy(self) -> None:
        if self._sm_copy is None:
            super().build_sm_copy()
        self._sm_copy.build()

    def create_urgent_stream(self) -> Any:
        # (err, least, greatest): the greatest priority is the lowest number.
        _, greatest = self._call("cudaDeviceGetStreamPriorityRange")
        return self._call("cudaStreamCreateWithPriority", self.rt.cudaStreamNonBlocking, greatest)[0]


def default_api() -> CudaApi:
    """Pick the adapter for this machine: cuda-bindings on a CUDA 13 driver, else CuPy.

    Raises :class:`CudaError` when neither can reach a GPU.
    """
    try:
        from cuda.bindings import runtime as brt  # noqa: PLC0415
        err, driver = brt.cudaDriverGetVersion()
        # The driver may be CUDA 13 while cuda-bindings is a 12.x release, built for the CUDA 12
        # runtime, which has no cudaMemDiscardBatchAsync (the batched and discard calls are new in
        # the 13.0 runtime, and in cuda-bindings from 13.0): then CuPy's CUDA 12 shapes are used.
        if err == brt.cudaError_t.cudaSuccess and driver >= CUDA13 and hasattr(brt, "cudaMemDiscardBatchAsync"):
            return BindingsApi(brt)
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - e.g. no libcuda; CuPy gets its chance and reports
        pass
    try:
        return CupyApi()
    except ImportError:
        raise CudaError(
            "no CUDA Python runtime found: install umrt[cuda12] (cupy-cuda12x) or umrt[cuda13] "
            "(cupy-cuda13x, cuda-bindings)"
        ) from None


def gpu_count() -> int:
    """CUDA devices this process can use (0 without a driver, runtime or device)."""
    try:
        return default_api().device_count()
    except (CudaError, ImportError):
        return 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


# ---------------------------------------------------------------------------
# The backend.
# ---------------------------------------------------------------------------
class CudaBackend(Backend):
    """Managed memory on one CUDA device.

    Args:
        device: CUDA device index.
        api: the runtime adapter; default :func:`default_api` (tests pass a fake).
        compute_stream: the stream kernels run on (``0`` = legacy default
            stream); the torch allocator sets torch's current stream.
        merge_across_allocations: let one call cover ranges of two managed
            allocations that touch in the address space (see :meth:`prefetch`).
            Off by default: the UVM kernel driver migrates across contiguous
            managed ranges (``uvm_migrate_ranges`` fails only on a gap), but
            no GPU run has shown that the CUDA runtime accepts such a range.
        swap_copy: what copies swapped ranges (:data:`~umrt.backends.base.SWAP_COPIES`;
            None: as ``UMRT_SWAP_COPY`` says, SM copies by default). SM copies need an
            adapter that launches the kernel (``has_sm_copy``); without one, the copy engines.

    Counters, for ``umrt.memory_stats()`` and ``bench.gpu`` (take a
    :meth:`counters` snapshot per training step and diff two with
    :func:`counters_delta`):

    * ``h2d_bytes`` / ``d2h_bytes``: bytes umrt prefetched to the GPU /
      evicted to the host (faults are invisible to it);
    * ``populated_bytes``: bytes prefetched to the GPU that umrt had
      discarded (populated on the GPU, nothing copied; not in ``h2d_bytes``);
    * ``discarded_bytes``: bytes discarded (alone or with a prefetch after);
    * ``calls``: a :class:`collections.Counter` of the CUDA runtime calls the
      backend issued, keyed by the runtime's name (``"cudaMemPrefetchAsync"``,
      ``"cudaMemDiscardBatchAsync"``, ``"cudaStreamWaitEvent"``, ...) whichever
      adapter makes them.

    Its collaborators: :class:`~umrt.backends.cuda_order.CountedCalls` (every
    runtime call, counted), :class:`~umrt.backends.cuda_order.StreamOrder` (the
    events between the copy, compute and discard streams) and
    :class:`~umrt.backends.allocations.Allocations` (allocations, range
    checks, residency).
    """

    name = "cuda"

    def __init__(self, device: int = 0, *, api: CudaApi | None = None, compute_stream: Any = 0,
                 merge_across_allocations: bool = False, swap_copy: str | None = None) -> None:
        self.api = api or default_api()
        self.swap_copy = swap_copy_in_env() if swap_copy is None else checked_swap_copy(swap_copy)
        self._call = CountedCalls()
        self.calls: Counter[str] = self._call.counts
        count = self._call("cudaGetDeviceCount", self.api.device_count)
        if not 0 <= device < count:
            raise CudaError(f"CUDA device {device} does not exist; this machine has {count} device(s)")
        self.device = device
        self._call("cudaSetDevice", self.api.set_device, device)
        self.concurrent = self._call("cudaDeviceGetAttribute", self.api.concurrent_managed_access, device)
        self._warned = False
        self.copy_stream = self._call("cudaStreamCreateWithFlags", self.api.create_stream, False)
        self.compute_stream = compute_stream
        # Where discards go while the compute stream is the legacy default stream (discard_stream);
        # made now, before any kernel that uses umrt's memory, so it follows all of them.
        self._order_stream: Any = None
        if self.api.has_batch:
            self._order_stream = self._call("cudaStreamCreateWithFlags", self.api.create_stream, True)
        self.allocations = Allocations(merge_across_allocations)
        self.order = StreamOrder(self.api, self._call, self.copy_stream)
        # Discarded and not prefetched to the GPU since: prefetches of these go in kernel order.
        self._dropped = RangeSet()
        # Counters for umrt.stats: what umrt itself moved (faults are invisible to the runtime).
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.populated_bytes = 0
        self.discarded_bytes = 0
        # The swap path: pinned staging (allocated once: swap.reserve), its streams and copies.
        self._swap = CudaSwapPath(self, self._call, self._dropped)

    # -- allocation ----------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"malloc of {nbytes} bytes")
        ptr = self._call("cudaMallocManaged", self.api.malloc_managed, nbytes)
        self.allocations.add(ptr, nbytes)
        return ptr

    def free(self, ptr: int) -> None:
        if ptr not in self.allocations:
            raise CudaError(f"cudaFree: {ptr:#x} is not an allocation of this backend")
        # A prefetch (copy stream), a kernel (compute stream) or a discard may still use
        # it, and cudaFree only "may" synchronize for managed memory: wait for all of them
        # (the pool gives a segment back rarely; PyTorch's empty_cache synchronizes too).
        self.synchronize()
        self._call("cudaFree", self.api.free, ptr)
        nbytes = self.allocations.remove(ptr)
        self._dropped.remove(ptr, nbytes)
        if self._swap.away:
            self._swap.release([(ptr, nbytes)])

    def allocation_of(self, ptr: int) -> tuple[int, int] | None:
        """``(base, nbytes)`` of the managed allocation holding ``ptr``, or None."""
        return self.allocations.allocation_of(ptr)

    def mem_info(self) -> tuple[int, int]:
        return self._call("cudaMemGetInfo", self.api.mem_get_info)

    def resident_bytes(self) -> int:
        """Bytes umrt placed on the GPU and has not evicted (demand faults are not seen)."""
        return self.allocations.resident_bytes()

    def counters(self) -> dict:
        """A snapshot of the counters (see the class docstring): bytes per direction,
        bytes discarded, and ``calls``, a dict of runtime call name -> calls issued."""
        return {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "populated_bytes": self.populated_bytes,
                "discarded_bytes": self.discarded_bytes, "swapped_out_bytes": self._swap.out_bytes,
                "swapped_in_bytes": self._swap.in_bytes, "staging_bytes": self._swap.pool.nbytes,
                "late_swap_ins": self._swap.late, "swap_copy": self._swap.copies_with,
                "calls": dict(self.calls)}

    # -- migration -------------------------------------------------------------
    def prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """Migrate ranges on the copy stream: one ``cudaMemPrefetchAsync`` per
        coalesced range (touching and overlapping ranges are merged first).

        Single calls, not ``cudaMemPrefetchBatchAsync``: on the H100 1024
        already-resident 2 MiB ranges took 7.9 ms as single calls and 56 ms as
        one batch, and the batch moved host -> GPU at 19 GB/s against 17 GB/s
        for single 2 MiB calls (h100-measured.md, section 1): coalescing into
        few large calls is what pays (48-50 GB/s from 256 MiB up).

        The parts umrt discarded and has not repopulated are populated in
        kernel order instead (as :meth:`populate` does): they reach the GPU
        before any kernel queued afterwards, whether or not that kernel is
        announced with :meth:`launch` (a kernel touching a discarded page
        first refaults at 0.8 GB/s on the H100)."""
        ranges = self.allocations.checked("cudaMemPrefetchAsync", ranges)
        self._check_device(device)
        if not ranges or not self._can_migrate():
            return
        if self._swap.away:  # swapped out: to the GPU by its copy back; to the host it already is
            ranges = self._swap.take_back(ranges) if device != HOST else self._swap.not_away(ranges)
            if not ranges:
                return
        if device != HOST and self._dropped:
            taken, ranges = _take_parts(self._dropped, ranges)
            if taken:
                self._in_kernel_order(taken, taken)
            if not ranges:
                return
        if self.order.discard_running(ranges):
            self.order.copy_after_discards()  # touching a range while its discard runs is undefined
        if device == HOST:
            # An eviction: wait for kernels already queued that may use these pages.
            self.order.stream_after(self.copy_stream, self.compute_stream)
        for ptr, n in ranges:
            self._call("cudaMemPrefetchAsync", self.api.prefetch, ptr, n, device, self.copy_stream)
        moved = sum(n for _, n in ranges)
        if device == HOST:
            self.d2h_bytes += moved
        else:
            self.h2d_bytes += moved
        self.allocations.place(ranges, on_device=device != HOST)
        self.order.copied(ranges, self.compute_stream)

    def populate(self, ranges: Sequence[Range]) -> None:
        """Make ranges resident on the GPU before the kernels queued after this call:
        ``cudaMemPrefetchAsync`` on the compute stream itself (the single call takes
        any stream, the legacy one included), after the copies still queued on
        the ranges; the legacy stream's implicit synchronization or the compute
        stream's own order puts it after discards of them too. No :meth:`launch`
        is needed for the kernel to find the pages there (a live run stops
        announcing kernels once the runtime trusts its plan). Pages umrt
        discarded are populated without a copy (``populated_bytes``); the rest is
        copied (``h2d_bytes``)."""
        ranges = self.allocations.checked("cudaMemPrefetchAsync", ranges)
        if ranges and self._can_migrate():
            if self._swap.away:
                ranges = self._swap.take_back(ranges)
            if ranges:
                self._in_kernel_order(ranges, [r for p, n in ranges for r in self._dropped.take(p, n)])

    def discard(self, ranges: Sequence[Range]) -> None:
        """Drop dead ranges' pages, in order with the kernels (see :meth:`discard_stream`).

        A discard destroys data, so its place in the kernel order is what makes it
        correct: after the last kernel that used the dead bytes (queued before the
        free) and before the first kernel that writes the block's next owner (queued
        after its allocation). The compute stream's order gives both; on the copy
        stream it would race with that kernel. Copies still queued on these ranges
        finish first, and a later prefetch of them waits for it (touching a range
        while its discard runs is undefined)."""
        checked = self.allocations.checked("cudaMemDiscardBatchAsync", ranges)
        ranges = [r for r in (_shrink(p, n) for p, n in checked) if r]
        if self._swap.away:
            self._swap.release(ranges)  # dead: a copy of it in pinned memory is of no use
        if not ranges or not self.api.has_batch or not self._can_migrate():
            return  # CUDA 12: documented no-op; the pool reuses dead ranges in place
        stream = self.discard_stream()
        self.order.wait_copies(stream, ranges)
        self._swap.wait_over(stream, ranges)  # a swap's copy out and discard of them, still running
        self._call("cudaMemDiscardBatchAsync", self.api.discard_batch, ranges, stream)
        self.discarded_bytes += sum(n for _, n in ranges)
        self.allocations.place(ranges, on_device=False)  # discarded pages are released
        for p, n in ranges:
            self._dropped.add(p, n)
        self.order.discarded(stream, ranges)

    def discard_and_prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """Make ranges resident on ``device`` without copying their dead contents.

        CUDA 13: ``cudaMemDiscardAndPrefetchBatchAsync``, in kernel order like
        :meth:`discard` (it destroys data: it must come before the kernel that
        writes the ranges' new owner, whenever the caller learns of it); CUDA
        12, or ranges not made of whole 64 KiB pages: a plain prefetch
        (correct, it just copies bytes nobody reads).
        """
        checked = self.allocations.checked("cudaMemDiscardAndPrefetchBatchAsync", ranges)
        self._check_device(device)
        aligned = [r for r in (_shrink(p, n) for p, n in checked) if r]
        if not self.api.has_batch or not aligned or aligned != checked:
            self.prefetch(checked, device)
            return
        if not self._can_migrate():
            return
        if self._swap.away:
            self._swap.release(aligned)  # dead contents: a copy of them in pinned memory is of no use
        stream = self.discard_stream()
        self.order.wait_copies(stream, aligned)
        self._swap.wait_over(stream, aligned)
        self._call("cudaMemDiscardAndPrefetchBatchAsync", self.api.discard_and_prefetch_batch, aligned, device,
                   stream)
        self.discarded_bytes += sum(n for _, n in aligned)
        self.allocations.place(aligned, on_device=device != HOST)
        for p, n in aligned:  # populated on the GPU, or dead bytes on the host
            (self._dropped.add if device == HOST else self._dropped.remove)(p, n)
        self.order.discarded(stream, aligned)

    def advise(self, ranges: Sequence[Range], advice: Advice, device: int) -> None:
        ranges = self.allocations.checked("cudaMemAdvise", ranges)
        advice = _advice(advice)
        self._check_device(device)
        if not self._can_migrate():
            return
        for ptr, n in ranges:
            self._call("cudaMemAdvise", self.api.advise, ptr, n, advice, device)

    # -- the swap path (copy engines: umrt.backends.cuda_swap) ----------------------
    @property
    def swap(self) -> CudaSwapPath:
        """The swap path: through the copy engines on CUDA 13 (discard), else page migration."""
        return self._swap

    def drop(self, ranges: Sequence[Range]) -> None:
        """Discard dead ranges beside the kernels (:meth:`CudaSwapPath.drop`)."""
        self._swap.drop(self.allocations.checked("cudaMemDiscardBatchAsync", ranges))

    # -- ordering --------------------------------------------------------------
    def set_compute_stream(self, stream: Any) -> None:
        """The stream the framework launches kernels on (torch: ``current_stream().cuda_stream``).

        A change makes the new stream wait for the work queued so far on the old
        one (and on the discard stream): the backend's ordering (evictions after
        the kernels, kernels after the prefetches and discards they need) is kept
        on one stream at a time, so nothing queued before the change is left
        unordered. It costs two calls per change and orders the new stream's
        later work after the old stream's earlier work."""
        if same_stream(stream, self.compute_stream):
            return
        old, old_discards = self.compute_stream, self.discard_stream()
        self.compute_stream = stream
        self.order.stream_after(stream, old)
        if old_discards is not None and not same_stream(old_discards, old):
            self.order.stream_after(stream, old_discards)

    def order_after(self, waiter: Any, source: Any) -> None:
        """Order ``waiter``'s later work after ``source``'s work so far (one event record and
        one ``cudaStreamWaitEvent``; nothing when they are one stream). What a block used on
        another stream (torch's ``record_stream``) needs before its next use or discard."""
        if not same_stream(waiter, source):
            self.order.stream_after(waiter, source)

    def discard_stream(self) -> Any:
        """The stream discards and discard-and-prefetches are queued on.

        The compute stream itself, unless it is the legacy default stream (``0``
        or ``cudaStreamLegacy``), which the batch calls reject (header: "Must not
        be legacy NULL stream"; ``cudaErrorInvalidValue`` on the H100) and which
        is torch's default. Then a stream of the backend's own, created
        *blocking* (``cudaStreamDefault``): the legacy stream synchronizes
        implicitly with every blocking stream ("an action in the legacy stream
        first waits on all blocking streams ... then all blocking streams wait
        on the legacy stream", CUDA docs, Stream synchronization behavior), so
        a discard queued there runs after the kernels queued before it and
        before those queued after it, with no event. Not the per-thread default
        stream (``cudaStreamPerThread``, blocking too and accepted): it is a
        different stream in each host thread (torch runs backward on its own
        autograd thread), so a :meth:`synchronize` or an event on one thread
        would not cover discards queued from another; the backend's stream is
        one handle for every thread. It is created with the backend (CUDA 13),
        before any kernel touches umrt's memory. None on CUDA 12 (no discards)."""
        return self._order_stream if is_legacy_stream(self.compute_stream) else self.compute_stream

    def launch(self, reads: Sequence[Range], writes: Sequence[Range], flops: int = 0, nbytes: int = 0,
               precision: str = "") -> None:
        if self.order.pending and (reads or writes):
            self.order.wait_copies(self.compute_stream, [*reads, *writes])
        if self._swap.away and (reads or writes):  # swapped out and not brought back: now, before it
            touched = self.allocations.checked("cudaMemcpyAsync", [*reads, *writes])
            if self._swap.not_away(touched) != touched:
                self._swap.late += 1
                self._swap.take_back(touched)
        if self._swap.streams.coming and (reads or writes):
            self._swap.wait([*reads, *writes])

    def synchronize(self) -> None:
        self._call("cudaStreamSynchronize", self.api.stream_synchronize, self.copy_stream)
        self._call("cudaStreamSynchronize", self.api.stream_synchronize, self.compute_stream)
        if self._order_stream is not None:
            self._call("cudaStreamSynchronize", self.api.stream_synchronize, self._order_stream)
        self._swap.synchronized()
        self.order.synchronized()

    def close(self) -> None:
        """Free every allocation still held (at process exit or session end; :meth:`free` waits for both streams)."""
        for ptr in self.allocations:
            self.free(ptr)
        self._swap.pool.release()

    # -- helpers ----------------------------------------------------------------
    def _in_kernel_order(self, ranges: list[Range], dropped: list[Range]) -> None:
        """Prefetch ``ranges`` to the GPU on the compute stream (``dropped``: the parts
        of them umrt had discarded, now taken out of ``_dropped``)."""
        stream = self.compute_stream
        self.order.wait_copies(stream, ranges)
        self._swap.wait_drops(stream, ranges)  # dead ranges discarded beside the kernels: populated after
        for ptr, n in ranges:
            self._call("cudaMemPrefetchAsync", self.api.prefetch, ptr, n, self.device, stream)
        populated = sum(n for _, n in dropped)
        self.populated_bytes += populated
        self.h2d_bytes += sum(n for _, n in ranges) - populated
        self.allocations.place(ranges, on_device=True)

    def _can_migrate(self) -> bool:
        if self.concurrent:
            return True
        if not self._warned:
            warnings.warn(
                f"umrt: CUDA device {self.device} lacks concurrent managed access "
                "(Windows, WSL or a pre-Pascal GPU); prefetch, advice and discard are disabled "
                "and pages migrate on demand only",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned = True
        return False

    def _check_device(self, device: int) -> None:
        if device != HOST and device != self.device:
            raise CudaError(f"device {device} is not valid here; use {self.device} (this backend's GPU) or -1 (host)")


def _take_parts(taken_from: RangeSet, ranges: list[Range]) -> tuple[list[Range], list[Range]]:
    """Take ``ranges`` out of ``taken_from``: the parts that were in it, and the other parts."""
    taken: list[Range] = []
    rest: list[Range] = []
    for ptr, n in ranges:
        pieces = taken_from.take(ptr, n)
        at = ptr
        for q, m in pieces:
            if q > at:
                rest.append((at, q - at))
            at = q + m
        if at < ptr + n:
            rest.append((at, ptr + n - at))
        taken.extend(pieces)
    return taken, rest


def counters_delta(before: dict, after: dict) -> dict:
    """``after - before`` for two :meth:`CudaBackend.counters` snapshots (what one step issued)."""
    out = {k: v - before.get(k, 0) if isinstance(v, int) else v for k, v in after.items() if k != "calls"}
    was = before.get("calls", {})
    out["calls"] = {name: n - was.get(name, 0) for name, n in after.get("calls", {}).items() if n != was.get(name, 0)}
    return out


def _advice(advice: Advice | int) -> Advice:
    try:
        return Advice(int(advice))
    except ValueError:
        raise CudaError(f"cudaMemAdvise: {advice!r} is not a cudaMemoryAdvise value (1..6)") from None


def _shrink(ptr: int, nbytes: int) -> Range | None:
    start = -(-ptr // DISCARD_ALIGN) * DISCARD_ALIGN
    end = (ptr + nbytes) // DISCARD_ALIGN * DISCARD_ALIGN
    return (start, end - start) if end > start else None

