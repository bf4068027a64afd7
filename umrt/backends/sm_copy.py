"""umrt's SM copy: a kernel that copies a swapped range to pinned memory and back.

A ``cudaMemcpyAsync`` between GPU-resident managed memory and pinned memory ran at the
link's rate on an H200, but nothing issued after it ran beside it: the other direction's
copy and the kernels waited (``bench/data/h200-um-micro-4.json``). A kernel is asynchronous
by definition: this one moves the bytes with the SMs, reading or writing the pinned slot
through its device mapping (with unified addressing every ``cudaHostAlloc`` allocation is
mapped at the same address: CUDA Runtime API, "Unified Addressing"), as NCCL's kernels move
data over a link and as cuDF proposes for copies stuck behind a busy copy engine
(rapidsai/cudf#15620). Its grid is small (:data:`SM_COPY_BLOCKS` blocks), so it takes a few
SMs from the kernels beside it (the simulator's ``sm_copy_share``); it runs on a stream of
the device's greatest priority, so the scheduler prefers its blocks as SMs free up (a hint: the
CUDA 13 header says priorities never preempt running work; not measured).

Whether it reaches the link's rate, both directions at once, and what the kernels beside it
lose, are not measured: ``python -m bench.copy_wait`` measures them on a GPU (its
``sm_copy_*`` rows run this kernel).
"""
from __future__ import annotations

from typing import Any, Protocol

from umrt.errors import CudaError

__all__ = ["SM_COPY_BLOCKS", "SM_COPY_THREADS", "WORD", "SmCopy", "SmCopyKernel"]

SM_COPY_BLOCKS = 16  # the grid: 16 blocks (the simulator's sm_copy_share is this over the card's SMs)
SM_COPY_THREADS = 1024
WORD = 16  # bytes per load and store (uint4): pointers and sizes must be multiples

_SOURCE = r"""
extern "C" __global__ void umrt_sm_copy(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                        unsigned long long words) {
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < words; i += 4 * step) {  // four loads in flight per thread: the link is far
        uint4 a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
        dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = c; dst[i + 3 * step] = d;
    }
    for (; i < words; i += step) dst[i] = src[i];
}
"""


class SmCopy(Protocol):
    """What launches the SM copy (:class:`SmCopyKernel`; the tests' fake runtime has its own)."""

    def build(self) -> None:
        """Make the kernel ready before the first step that copies (compiling takes a while)."""

    def __call__(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """``nbytes`` from ``src`` to ``dst`` after the work queued on ``stream``."""


class SmCopyKernel:
    """Launches ``umrt_sm_copy`` (compiled with CuPy's NVRTC on first use) on a given stream.

    ``kernel(dst, src, nbytes, stream)``: ``nbytes`` from ``src`` to ``dst`` after the work
    queued on ``stream``; both 16-byte aligned, ``nbytes`` a multiple of 16. A failure raises
    :class:`~umrt.errors.CudaError` naming ``UMRT_SWAP_COPY=engines`` as the way around it."""

    def __init__(self, blocks: int = SM_COPY_BLOCKS) -> None:
        self.blocks = blocks  # the grid (bench.copy_wait times others: what the link needs is not measured)
        self._kernel: Any = None
        self._streams: dict[int, Any] = {}

    @staticmethod
    def available() -> bool:
        """Whether CuPy 14 or later (``Stream.from_external``), which builds and launches the
        kernel, imports."""
        try:
            import cupy  # noqa: PLC0415 (GPU-only import)
        except Exception:  # noqa: BLE001 - any failure to import means no SM copy
            return False
        return int(cupy.__version__.split(".")[0]) >= 14

    def build(self) -> None:
        """Compile the kernel now (NVRTC; CuPy caches it on disk for later runs), so that no
        step waits for it; a failure raises CudaError."""
        try:
            self._compiled()
        except Exception as exc:  # noqa: BLE001 - NVRTC, the driver or CuPy: one clear error
            raise _failed(exc) from exc

    def _compiled(self) -> Any:
        if self._kernel is None:
            import cupy  # noqa: PLC0415 (GPU-only import)

            kernel = cupy.RawKernel(_SOURCE, "umrt_sm_copy")
            kernel.compile()
            self._kernel = kernel
        return self._kernel

    def __call__(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if (dst | src | nbytes) % WORD:
            raise CudaError(f"umrt_sm_copy: ({src:#x} -> {dst:#x}, {nbytes}) is not in {WORD}-byte words")
        try:
            import cupy  # noqa: PLC0415 (GPU-only import)
            import numpy  # noqa: PLC0415

            kernel = self._compiled()
            handle = int(stream)
            side = self._streams.get(handle)
            if side is None:
                side = self._streams[handle] = _cupy_stream(cupy, handle)
            kernel((self.blocks,), (SM_COPY_THREADS,),
                   (numpy.uint64(src), numpy.uint64(dst), numpy.uint64(nbytes // WORD)), stream=side)
        except Exception as exc:  # noqa: BLE001 - NVRTC, the driver or CuPy: one clear error
            raise _failed(exc) from exc


def _failed(exc: Exception) -> CudaError:
    return CudaError(f"umrt_sm_copy failed: {type(exc).__name__}: {exc} (UMRT_SWAP_COPY=engines copies with "
                     "cudaMemcpyAsync instead)")


class _StreamHandle:
    """A raw ``cudaStream_t`` through the CUDA stream protocol (cuda-python's interoperability)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_stream(cupy: Any, handle: int) -> Any:
    """CuPy's view of the stream ``handle`` (``Stream.from_external``, CuPy 14)."""
    return cupy.cuda.Stream.from_external(_StreamHandle(handle))
