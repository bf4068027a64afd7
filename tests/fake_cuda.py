"""A fake CUDA runtime that enforces the real contract, for tests without a GPU.

One :class:`FakeGpu` holds the state (managed allocations, streams, events,
residency). Two front ends expose it with the *exact* call shapes of the two
real Python runtimes umrt drives:

* :class:`FakeCupyRuntime` mirrors ``cupy.cuda.runtime`` (CUDA 12):
  ``memPrefetchAsync(devPtr, count, dstDevice, stream)``, errors raised as
  ``CUDARuntimeError``, no batched or discard entry points.
* :class:`FakeBindingsRuntime` mirrors ``cuda.bindings.runtime`` (CUDA 13):
  ``cudaMemPrefetchAsync(devPtr, count, cudaMemLocation, flags, stream)``,
  every call returns ``(cudaError_t, *results)``, plus the batch calls.

Contract enforced (cudaErrorInvalidValue / InvalidDevice as the runtime
would return): every range lies inside one live managed allocation; devices
exist; host is -1 on CUDA 12 and a Host-typed location on CUDA 13 (a Device
location with id -1 is rejected, the cupy-cuda13x pitfall); advice values are
1..6; streams and events were created; batch flags are 0, counts match the
lists, location indices start at 0; without concurrent managed access,
prefetch/advice/discard fail like the driver does.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

SUCCESS, INVALID_VALUE, MEMORY_ALLOCATION, INVALID_DEVICE, INVALID_HANDLE, NOT_SUPPORTED = 0, 1, 2, 101, 400, 801
ERROR_NAMES = {
    SUCCESS: "cudaSuccess",
    INVALID_VALUE: "cudaErrorInvalidValue",
    MEMORY_ALLOCATION: "cudaErrorMemoryAllocation",
    INVALID_DEVICE: "cudaErrorInvalidDevice",
    INVALID_HANDLE: "cudaErrorInvalidResourceHandle",
    NOT_SUPPORTED: "cudaErrorNotSupported",
}
HOST = -1
ALIGN = 2 * 1024 * 1024


class FakeCudaError(Exception):
    def __init__(self, status: int, call: str, why: str) -> None:
        super().__init__(f"{call}: {why}")
        self.status = status


@dataclass
class FakeGpu:
    """State of a fake machine. ``calls`` logs (name, args) of every runtime call."""

    devices: int = 1
    concurrent: bool = True
    total: int = 16 * 2**30
    managed_limit: int = 64 * 2**30  # host + device: managed memory may oversubscribe
    allocs: dict[int, int] = field(default_factory=dict)
    location: dict[int, int] = field(default_factory=dict)  # alloc base -> last prefetch target
    discarded: list[tuple[int, int]] = field(default_factory=list)
    advice: list[tuple[int, int, int, int]] = field(default_factory=list)
    streams: set = field(default_factory=lambda: {0})
    events: set = field(default_factory=set)
    recorded: dict[int, int] = field(default_factory=dict)  # event -> stream it was recorded on
    calls: list[tuple] = field(default_factory=list)
    current: int = 0
    _next: int = 0x7F00_0000_0000
    _handles: int = 0x1000

    # -- checks --------------------------------------------------------------
    def check_range(self, call: str, ptr: object, n: object) -> None:
        if not isinstance(ptr, int) or not isinstance(n, int):
            raise TypeError(f"{call}: pointer and count must be int, got {type(ptr).__name__}, {type(n).__name__}")
        for base, size in self.allocs.items():
            if base <= ptr < base + size:
                if n <= 0 or ptr + n > base + size:
                    raise FakeCudaError(INVALID_VALUE, call, f"range ({ptr:#x}, {n}) leaves its allocation")
                return
        raise FakeCudaError(INVALID_VALUE, call, f"{ptr:#x} is not managed memory")

    def check_device(self, call: str, device: int, host_ok: bool = True) -> None:
        if device == HOST and host_ok:
            return
        if not 0 <= device < self.devices:
            raise FakeCudaError(INVALID_DEVICE, call, f"invalid device {device}")

    def check_stream(self, call: str, stream: int) -> None:
        if stream not in self.streams:
            raise FakeCudaError(INVALID_HANDLE, call, f"unknown stream {stream!r}")

    def check_concurrent(self, call: str) -> None:
        if not self.concurrent:
            raise FakeCudaError(INVALID_DEVICE, call, "device lacks concurrent managed access")

    def handle(self) -> int:
        self._handles += 1
        return self._handles

    # -- operations ----------------------------------------------------------
    def malloc(self, call: str, n: int, flags: int) -> int:
        if n <= 0 or flags not in (1, 2):
            raise FakeCudaError(INVALID_VALUE, call, f"size {n}, flags {flags}")
        if sum(self.allocs.values()) + n > self.managed_limit:
            raise FakeCudaError(MEMORY_ALLOCATION, call, "out of memory")
        ptr = self._next
        self._next += -(-n // ALIGN) * ALIGN
        self.allocs[ptr] = n
        self.location[ptr] = HOST
        return ptr

    def free(self, call: str, ptr: int) -> None:
        if ptr not in self.allocs:
            raise FakeCudaError(INVALID_VALUE, call, f"{ptr:#x} was not allocated")
        del self.allocs[ptr]
        self.location.pop(ptr, None)

    def base_of(self, ptr: int) -> int:
        return next(b for b, s in self.allocs.items() if b <= ptr < b + s)

    def prefetch(self, call: str, ptr: int, n: int, device: int, stream: int) -> None:
        self.check_range(call, ptr, n)
        self.check_device(call, device)
        self.check_stream(call, stream)
        self.check_concurrent(call)
        self.location[self.base_of(ptr)] = device

    def advise(self, call: str, ptr: int, n: int, advice: int, device: int) -> None:
        self.check_range(call, ptr, n)
        if advice not in range(1, 7):
            raise FakeCudaError(INVALID_VALUE, call, f"invalid advice {advice}")
        self.check_device(call, device)
        self.check_concurrent(call)
        self.advice.append((ptr, n, advice, device))

    def mem_info(self) -> tuple[int, int]:
        resident = sum(self.allocs[b] for b, loc in self.location.items() if loc != HOST)
        return max(0, self.total - resident), self.total

    def log(self, *entry: object) -> None:
        self.calls.append(entry)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


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

    cudaCpuDeviceId = -1
    cudaMemAttachGlobal = 1
    streamNonBlocking = 1
    eventDisableTiming = 2
    cudaDevAttrConcurrentManagedAccess = 89
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
        def op(a, d):
            self.gpu.check_device("deviceGetAttribute", d, host_ok=False)
            if a != 89:
                raise FakeCudaError(INVALID_VALUE, "deviceGetAttribute", f"fake knows only attribute 89, not {a}")
            return int(self.gpu.concurrent)
        return self._run("deviceGetAttribute", op, attrib, device)

    def memGetInfo(self) -> tuple[int, int]:
        return self.gpu.mem_info()

    def mallocManaged(self, size: int, flags: int = 1) -> int:
        self._ints("mallocManaged", size, flags)
        return self._run("mallocManaged", lambda s, f: self.gpu.malloc("mallocManaged", s, f), size, flags)

    def free(self, ptr: int) -> None:
        self._ints("free", ptr)
        self._run("free", lambda p: self.gpu.free("free", p), ptr)

    def streamCreateWithFlags(self, flags: int) -> int:
        h = self.gpu.handle()
        self.gpu.streams.add(h)
        self.gpu.log("streamCreateWithFlags", flags)
        return h

    def eventCreateWithFlags(self, flags: int) -> int:
        h = self.gpu.handle()
        self.gpu.events.add(h)
        self.gpu.log("eventCreateWithFlags", flags)
        return h

    def eventRecord(self, event: int, stream: int) -> None:
        self._ints("eventRecord", event, stream)
        def op(e, s):
            if e not in self.gpu.events:
                raise FakeCudaError(INVALID_HANDLE, "eventRecord", f"unknown event {e}")
            self.gpu.check_stream("eventRecord", s)
            self.gpu.recorded[e] = s
        self._run("eventRecord", op, event, stream)

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self._ints("streamWaitEvent", stream, event, flags)
        def op(s, e, f):
            self.gpu.check_stream("streamWaitEvent", s)
            if e not in self.gpu.recorded:
                raise FakeCudaError(INVALID_HANDLE, "streamWaitEvent", f"event {e} never recorded")
        self._run("streamWaitEvent", op, stream, event, flags)

    def streamSynchronize(self, stream: int) -> None:
        self._ints("streamSynchronize", stream)
        self._run("streamSynchronize", lambda s: self.gpu.check_stream("streamSynchronize", s), stream)

    def memPrefetchAsync(self, devPtr: int, count: int, dstDevice: int, stream: int) -> None:
        self._ints("memPrefetchAsync", devPtr, count, dstDevice, stream)
        self._run("memPrefetchAsync", lambda *a: self.gpu.prefetch("memPrefetchAsync", *a),
                  devPtr, count, dstDevice, stream)

    def memAdvise(self, devPtr: int, count: int, advice: int, device: int) -> None:
        self._ints("memAdvise", devPtr, count, advice, device)
        self._run("memAdvise", lambda *a: self.gpu.advise("memAdvise", *a), devPtr, count, advice, device)


# ---------------------------------------------------------------------------
# CUDA 13: cuda.bindings.runtime
# ---------------------------------------------------------------------------
class cudaError_t(enum.IntEnum):
    cudaSuccess = SUCCESS
    cudaErrorInvalidValue = INVALID_VALUE
    cudaErrorMemoryAllocation = MEMORY_ALLOCATION
    cudaErrorInvalidDevice = INVALID_DEVICE
    cudaErrorInvalidResourceHandle = INVALID_HANDLE
    cudaErrorNotSupported = NOT_SUPPORTED


class cudaMemLocationType(enum.IntEnum):
    cudaMemLocationTypeInvalid = 0
    cudaMemLocationTypeDevice = 1
    cudaMemLocationTypeHost = 2


class cudaMemoryAdvise(enum.IntEnum):
    cudaMemAdviseSetReadMostly = 1
    cudaMemAdviseUnsetReadMostly = 2
    cudaMemAdviseSetPreferredLocation = 3
    cudaMemAdviseUnsetPreferredLocation = 4
    cudaMemAdviseSetAccessedBy = 5
    cudaMemAdviseUnsetAccessedBy = 6


class cudaDeviceAttr(enum.IntEnum):
    cudaDevAttrConcurrentManagedAccess = 89


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
    cudaMemAttachGlobal = 1
    cudaStreamNonBlocking = 1
    cudaEventDisableTiming = 2

    def __init__(self, gpu: FakeGpu, version: int = 13000) -> None:
        self.gpu = gpu
        self._version = version

    def _run(self, call: str, fn, *args) -> tuple:
        self.gpu.log(call, *args)
        try:
            out = fn(*args)
        except FakeCudaError as exc:
            return (cudaError_t(exc.status),)
        return (cudaError_t.cudaSuccess,) + (out if isinstance(out, tuple) else (() if out is None else (out,)))

    def _target(self, call: str, loc: object) -> int:
        if not isinstance(loc, cudaMemLocation):
            raise TypeError(f"{call}: location must be a cudaMemLocation, got {type(loc).__name__}")
        if loc.type == cudaMemLocationType.cudaMemLocationTypeHost:
            return HOST
        if loc.type == cudaMemLocationType.cudaMemLocationTypeDevice:
            self.gpu.check_device(call, loc.id, host_ok=False)  # id -1 is NOT the host here
            return loc.id
        raise FakeCudaError(INVALID_VALUE, call, f"location type {loc.type}")

    def _batch(self, call: str, dptrs, sizes, count, flags, stream) -> None:
        if not isinstance(dptrs, (list, tuple)) or not isinstance(sizes, (list, tuple)):
            raise TypeError(f"{call}: dptrs and sizes must be lists")
        if count != len(dptrs) or count != len(sizes) or count == 0:
            raise FakeCudaError(INVALID_VALUE, call, f"count {count} vs {len(dptrs)}/{len(sizes)}")
        if flags != 0:
            raise FakeCudaError(INVALID_VALUE, call, "flags must be 0")
        self.gpu.check_stream(call, stream)
        self.gpu.check_concurrent(call)
        for p, n in zip(dptrs, sizes, strict=False):
            self.gpu.check_range(call, p, n)

    def _locs(self, call: str, locs, idxs, num) -> int:
        if num != len(locs) or num != len(idxs) or num == 0 or idxs[0] != 0:
            raise FakeCudaError(INVALID_VALUE, call, f"locations {num} / indices {idxs}")
        return self._target(call, locs[0])

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
            self.gpu.check_device("cudaDeviceGetAttribute", d, host_ok=False)
            return int(self.gpu.concurrent)
        return self._run("cudaDeviceGetAttribute", op, attr, device)

    def cudaMemGetInfo(self):
        return (cudaError_t.cudaSuccess, *self.gpu.mem_info())

    def cudaMallocManaged(self, size, flags):
        return self._run("cudaMallocManaged", lambda s, f: self.gpu.malloc("cudaMallocManaged", s, f), size, flags)

    def cudaFree(self, ptr):
        return self._run("cudaFree", lambda p: self.gpu.free("cudaFree", p), ptr)

    def cudaStreamCreateWithFlags(self, flags):
        h = self.gpu.handle()
        self.gpu.streams.add(h)
        return self._run("cudaStreamCreateWithFlags", lambda f: h, flags)

    def cudaEventCreateWithFlags(self, flags):
        h = self.gpu.handle()
        self.gpu.events.add(h)
        return self._run("cudaEventCreateWithFlags", lambda f: h, flags)

    def cudaEventRecord(self, event, stream):
        def op(e, s):
            if e not in self.gpu.events:
                raise FakeCudaError(INVALID_HANDLE, "cudaEventRecord", f"unknown event {e}")
            self.gpu.check_stream("cudaEventRecord", s)
            self.gpu.recorded[e] = s
        return self._run("cudaEventRecord", op, event, stream)

    def cudaStreamWaitEvent(self, stream, event, flags):
        def op(s, e, f):
            self.gpu.check_stream("cudaStreamWaitEvent", s)
            if e not in self.gpu.recorded:
                raise FakeCudaError(INVALID_HANDLE, "cudaStreamWaitEvent", f"event {e} never recorded")
        return self._run("cudaStreamWaitEvent", op, stream, event, flags)

    def cudaStreamSynchronize(self, stream):
        return self._run("cudaStreamSynchronize", lambda s: self.gpu.check_stream("cudaStreamSynchronize", s), stream)

    def cudaMemPrefetchAsync(self, devPtr, count, location, flags, stream):
        def op(p, n, loc, f, s):
            if f != 0:
                raise FakeCudaError(INVALID_VALUE, "cudaMemPrefetchAsync", "flags must be 0")
            self.gpu.prefetch("cudaMemPrefetchAsync", p, n, self._target("cudaMemPrefetchAsync", loc), s)
        return self._run("cudaMemPrefetchAsync", op, devPtr, count, location, flags, stream)

    def cudaMemAdvise(self, devPtr, count, advice, location):
        def op(p, n, a, loc):
            if not isinstance(a, cudaMemoryAdvise):
                raise TypeError("advice must be a cudaMemoryAdvise")
            self.gpu.advise("cudaMemAdvise", p, n, int(a), self._target("cudaMemAdvise", loc))
        return self._run("cudaMemAdvise", op, devPtr, count, advice, location)

    def cudaMemPrefetchBatchAsync(self, dptrs, sizes, count, prefetchLocs, prefetchLocIdxs,
                                  numPrefetchLocs, flags, stream):
        def op(*a):
            self._batch("cudaMemPrefetchBatchAsync", dptrs, sizes, count, flags, stream)
            target = self._locs("cudaMemPrefetchBatchAsync", prefetchLocs, prefetchLocIdxs, numPrefetchLocs)
            for p in dptrs:
                self.gpu.location[self.gpu.base_of(p)] = target
        return self._run("cudaMemPrefetchBatchAsync", op, dptrs, sizes, count, prefetchLocs,
                         prefetchLocIdxs, numPrefetchLocs, flags, stream)

    def cudaMemDiscardBatchAsync(self, dptrs, sizes, count, flags, stream):
        def op(*a):
            self._batch("cudaMemDiscardBatchAsync", dptrs, sizes, count, flags, stream)
            self.gpu.discarded.extend(zip(dptrs, sizes, strict=False))
        return self._run("cudaMemDiscardBatchAsync", op, dptrs, sizes, count, flags, stream)

    def cudaMemDiscardAndPrefetchBatchAsync(self, dptrs, sizes, count, prefetchLocs, prefetchLocIdxs,
                                            numPrefetchLocs, flags, stream):
        def op(*a):
            self._batch("cudaMemDiscardAndPrefetchBatchAsync", dptrs, sizes, count, flags, stream)
            target = self._locs("cudaMemDiscardAndPrefetchBatchAsync", prefetchLocs, prefetchLocIdxs,
                                numPrefetchLocs)
            self.gpu.discarded.extend(zip(dptrs, sizes, strict=False))
            for p in dptrs:
                self.gpu.location[self.gpu.base_of(p)] = target
        return self._run("cudaMemDiscardAndPrefetchBatchAsync", op, dptrs, sizes, count, prefetchLocs,
                         prefetchLocIdxs, numPrefetchLocs, flags, stream)
