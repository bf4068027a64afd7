"""Recording a steady window: the pool's allocations and frees and the CUDA calls between them.

:class:`SteadyRecorder` collects, in order, what :func:`umrt.native.schedule.compile_schedule`
compiles: :class:`AllocAt` / :class:`FreeAt` (a ``ManagedPool`` listener), :class:`CallAt`
(Backend calls, :class:`RecordingBackend`, merged and coalesced when compiled; CUDA API calls
with their exact arguments, :class:`RecordingApi` around ``CudaBackend``'s adapter:
prefetches, advice, batch discards, event records and stream waits, with the stream and event
handles, replayed verbatim), :class:`Unschedulable` (a call a schedule cannot repeat) and
:class:`Mark` (a module boundary: the program's kernels may have run).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from umrt.backends.base import Advice, Backend, ForwardingBackend, Range, SwapPath
from umrt.backends.cuda import CudaApi
from umrt.native.constants import DecisionKind


@dataclass(frozen=True)
class AllocAt:
    """The pool placed an allocation of ``size`` bytes at ``ptr``."""

    size: int
    ptr: int


@dataclass(frozen=True)
class FreeAt:
    """The block at ``ptr`` was freed."""

    ptr: int


@dataclass(frozen=True)
class CallAt:
    """One call: a Backend call (:class:`RecordingBackend`; ``exact`` False, stream 0,
    compiled merged and coalesced) or a CUDA API call with its exact arguments
    (:class:`RecordingApi`; ``exact`` True, replayed verbatim on ``stream``, with ``event``
    for RECORD_EVENT / WAIT_EVENT). Stream 0 means the table's copy / discard stream, else
    the caller's stream (see :class:`CudaTable`)."""

    kind: DecisionKind
    ranges: tuple[Range, ...]
    device: int = 0
    advice: int = 0
    stream: int = 0
    event: int = 0
    exact: bool = False


@dataclass(frozen=True)
class Unschedulable:
    """A CUDA API call a schedule cannot repeat (``name``: the :class:`CudaApi` method):
    :func:`compile_schedule` refuses an iteration that made one."""

    name: str


@dataclass(frozen=True)
class Mark:
    """A point of the recorded window where the program's kernels may have run since the
    last allocation or free: a module boundary (the live bridge's hooks) where the policy
    acts. A schedule cannot see it, so calls made after it replay at the *next* allocation
    or free (after those kernels, never before them: an eviction before the kernels that
    write the data would make them refault)."""

    what: str = "module"


Recorded = AllocAt | FreeAt | CallAt | Unschedulable | Mark


class RecordingBackend(ForwardingBackend):
    """A backend that also appends each decision call to ``log`` (a :class:`CallAt`)."""

    def __init__(self, backend: Backend, log: list) -> None:
        super().__init__(backend)
        self.log = log

    def prefetch(self, ranges: Sequence[Range], device: int) -> None:
        self.log.append(CallAt(DecisionKind.PREFETCH, tuple(ranges), device))
        self._b.prefetch(ranges, device)

    def populate(self, ranges: Sequence[Range]) -> None:
        self.log.append(CallAt(DecisionKind.POPULATE, tuple(ranges), self._b.device))
        self._b.populate(ranges)

    def discard(self, ranges: Sequence[Range]) -> None:
        self.log.append(CallAt(DecisionKind.DISCARD, tuple(ranges)))
        self._b.discard(ranges)

    def discard_and_prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """``CudaBackend.discard_and_prefetch`` (recorded, then forwarded)."""
        self.log.append(CallAt(DecisionKind.DISCARD_PREFETCH, tuple(ranges), device))
        self._b.discard_and_prefetch(ranges, device)

    def advise(self, ranges: Sequence[Range], advice: Advice, device: int) -> None:
        self.log.append(CallAt(DecisionKind.ADVISE, tuple(ranges), device, int(advice)))
        self._b.advise(ranges, advice, device)

    def drop(self, ranges: Sequence[Range]) -> None:
        """Dead ranges discarded beside the kernels: a schedule replays them as a discard."""
        self.log.append(CallAt(DecisionKind.DISCARD, tuple(ranges)))
        self._b.drop(ranges)

    @property
    def swap(self) -> SwapPath:
        """The backend's swap path, its copies out and back logged as :class:`Unschedulable`."""
        return _UnschedulableSwap(self._b.swap, self.log)


class _UnschedulableSwap(SwapPath):
    """A swap path whose copies a schedule cannot repeat: each is logged, then forwarded."""

    def __init__(self, swap: SwapPath, log: list) -> None:
        super().__init__(swap.backend)
        self._swap = swap
        self._log = log
        self.pinned_copies = swap.pinned_copies

    def out(self, ranges: Sequence[Range]) -> None:
        self._log.append(Unschedulable("swap.out"))
        self._swap.out(ranges)

    def back(self, ranges: Sequence[Range]) -> None:
        self._log.append(Unschedulable("swap.back"))
        self._swap.back(ranges)

    def wait(self, ranges: Sequence[Range]) -> None:
        self._swap.wait(ranges)

    def release(self, ranges: Sequence[Range]) -> None:
        self._swap.release(ranges)

    def reserve(self, nbytes: int) -> None:
        self._swap.reserve(nbytes)


def _handle(handle: Any) -> int:
    """A stream or event handle as an integer (``None``: 0; cuda-bindings handles convert with ``int``)."""
    return 0 if handle is None else int(handle)


class RecordingApi(CudaApi):
    """A :class:`umrt.backends.cuda.CudaApi` that forwards every call to ``api`` and appends
    the ones a schedule replays to ``log`` as exact :class:`CallAt` (prefetch, advise, the
    batch discards, event records and waits, with their stream and event handles as
    integers); calls that would make an iteration non-repeatable (``malloc_managed``,
    ``free``, ``stream_synchronize``, ``create_event``, ``create_stream``) as
    :class:`Unschedulable`. A call is logged before it is forwarded (a failed call too)."""

    def __init__(self, api: CudaApi, log: list) -> None:
        self.api = api
        self.log = log
        self.version = api.version
        self.has_batch = api.has_batch
        self.has_copies = api.has_copies
        self.has_sm_copy = api.has_sm_copy
        self.process_runtime = api.process_runtime

    def device_count(self) -> int:
        return self.api.device_count()

    def set_device(self, device: int) -> None:
        self.api.set_device(device)

    def concurrent_managed_access(self, device: int) -> bool:
        return self.api.concurrent_managed_access(device)

    def mem_get_info(self) -> tuple[int, int]:
        return self.api.mem_get_info()

    def malloc_managed(self, nbytes: int) -> int:
        self.log.append(Unschedulable("malloc_managed"))
        return self.api.malloc_managed(nbytes)

    def free(self, ptr: int) -> None:
        self.log.append(Unschedulable("free"))
        self.api.free(ptr)

    def create_stream(self, blocking: bool = False) -> Any:
        self.log.append(Unschedulable("create_stream"))
        return self.api.create_stream(blocking)

    def create_urgent_stream(self) -> Any:
        self.log.append(Unschedulable("create_stream"))
        return self.api.create_urgent_stream()

    def create_event(self) -> Any:
        self.log.append(Unschedulable("create_event"))
        return self.api.create_event()

    def stream_synchronize(self, stream: Any) -> None:
        self.log.append(Unschedulable("stream_synchronize"))
        self.api.stream_synchronize(stream)

    # The swap path: a schedule has no copy calls (nor pinned memory), so a window that
    # swapped is not repeated natively.
    def host_alloc(self, nbytes: int) -> int:
        self.log.append(Unschedulable("host_alloc"))
        return self.api.host_alloc(nbytes)

    def free_host(self, ptr: int) -> None:
        self.log.append(Unschedulable("free_host"))
        self.api.free_host(ptr)

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.log.append(Unschedulable("memcpy"))
        self.api.memcpy(dst, src, nbytes, stream)

    def sm_copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.log.append(Unschedulable("sm_copy"))
        self.api.sm_copy(dst, src, nbytes, stream)

    def build_sm_copy(self) -> None:
        self.api.build_sm_copy()

    def record_event(self, event: Any, stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.RECORD_EVENT, (), stream=_handle(stream), event=_handle(event),
                               exact=True))
        self.api.record_event(event, stream)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(CallAt(DecisionKind.WAIT_EVENT, (), stream=_handle(stream), event=_handle(event),
                               exact=True))
        self.api.stream_wait_event(stream, event)

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.PREFETCH, ((int(ptr), int(nbytes)),), device, stream=_handle(stream),
                               exact=True))
        self.api.prefetch(ptr, nbytes, device, stream)

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        self.log.append(CallAt(DecisionKind.ADVISE, ((int(ptr), int(nbytes)),), device, int(advice), exact=True))
        self.api.advise(ptr, nbytes, advice, device)

    def discard_batch(self, ranges: Sequence[Range], stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.DISCARD, tuple((int(p), int(n)) for p, n in ranges),
                               stream=_handle(stream), exact=True))
        self.api.discard_batch(ranges, stream)

    def discard_and_prefetch_batch(self, ranges: Sequence[Range], device: int, stream: Any) -> None:
        self.log.append(CallAt(DecisionKind.DISCARD_PREFETCH, tuple((int(p), int(n)) for p, n in ranges), device,
                               stream=_handle(stream), exact=True))
        self.api.discard_and_prefetch_batch(ranges, device, stream)


class SteadyRecorder:
    """Records one iteration: the pool's allocations and frees and the backend calls
    between them, in order. Wrap the runtime's backend with :meth:`wrap` and add
    :meth:`on_pool_event` to ``ManagedPool.listeners`` *first* (before the live bridge,
    so an allocation is recorded before the decisions it triggers)."""

    def __init__(self) -> None:
        self.log: list[Recorded] = []

    def wrap(self, backend: Backend) -> RecordingBackend:
        """``backend``, recording its decision calls into this recorder."""
        return RecordingBackend(backend, self.log)

    def wrap_api(self, api: CudaApi) -> RecordingApi:
        """``api`` (a ``CudaBackend``'s adapter), recording its CUDA calls exactly into this recorder."""
        return RecordingApi(api, self.log)

    def on_pool_event(self, what: str, ptr: int, nbytes: int) -> None:
        """A ``ManagedPool`` listener: ``("alloc" | "free", ptr, nbytes)``."""
        self.log.append(AllocAt(nbytes, ptr) if what == "alloc" else FreeAt(ptr))

    def mark(self, what: str = "module") -> None:
        """Kernels may have run since the last pool event (a module boundary): see :class:`Mark`."""
        self.log.append(Mark(what))

    def take(self) -> list[Recorded]:
        """What was recorded since the last call (one iteration, if called at its boundaries)."""
        out, self.log[:] = list(self.log), []
        return out
