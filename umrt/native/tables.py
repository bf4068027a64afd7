"""The CUDA tables a steady schedule's decisions call through.

:class:`CudaTable` is what a table offers: seven calls (prefetch, discard,
discard-and-prefetch, populate, advise, event record, stream wait) and the streams
prefetches and discards go to by default. :class:`ApiTable` fills it from a
:class:`umrt.backends.cuda.CudaApi` (the adapters ``CudaBackend`` uses; tests pass the
fake runtime). :class:`CTable` is the C struct the native schedule holds (``struct
umrt_cuda_table``, declared once, here: :func:`c_table_header` generates the C declaration
``steady_alloc.cpp`` includes): C functions keep Python off the path
(:func:`umrt.native.binding.cudart_table` over the process's libcudart, found by
:func:`loaded_libcudart`; :func:`umrt.native.binding.counting_table`), or
:func:`c_table_of` wraps a Python table in ctypes callbacks. :class:`CFunctionTable`
runs a :class:`CTable` from Python (how the Python twin runs the C tables).
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from umrt.backends.base import Advice, Range
from umrt.errors import CudaError
from umrt.native.constants import CALL_NAMES, DecisionKind


@runtime_checkable
class CudaTable(Protocol):
    """The CUDA calls a schedule's decisions make; each returns 0 or a CUDA error code.

    A decision with its own stream (non-zero) runs there. Otherwise ``copy_stream`` /
    ``discard_stream`` is where prefetches / discards go (``None`` or 0: the stream the
    allocation or free was called with); populates, event records and waits go to that
    stream. :meth:`provides` says which calls exist (a due decision without its call
    disarms the schedule, as a NULL entry of the C table does).
    """

    copy_stream: int | None
    discard_stream: int | None

    def provides(self, kind: DecisionKind) -> bool:
        """Whether the table has the call for decisions of ``kind``."""

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        """cudaMemPrefetchAsync to ``device`` (HOST: -1)."""

    def discard(self, ranges: Sequence[Range], stream: int) -> int:
        """cudaMemDiscardBatchAsync of all ``ranges`` (one call)."""

    def discard_prefetch(self, ranges: Sequence[Range], device: int, stream: int) -> int:
        """cudaMemDiscardAndPrefetchBatchAsync of all ``ranges`` to ``device`` (one call)."""

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        """cudaMemPrefetchAsync to the GPU on the compute stream."""

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        """cudaMemAdvise."""

    def record_event(self, event: int, stream: int) -> int:
        """cudaEventRecord."""

    def wait_event(self, stream: int, event: int) -> int:
        """cudaStreamWaitEvent (flags 0)."""

    def clear_error(self) -> int:
        """Called after a call that failed: reset the runtime's per-thread last error
        (``cudaGetLastError``) so that the framework's next launch check does not see it."""


class ApiTable:
    """A :class:`CudaTable` over a :class:`umrt.backends.cuda.CudaApi` (the adapters
    ``CudaBackend`` calls; tests give it the fake runtime). A failed call returns 1 and
    keeps its message in ``errors``. Without the batch calls (CUDA 12) it provides no
    discards. Stream and event handles reach the api as integers."""

    def __init__(self, api: Any, copy_stream: int | None = None, discard_stream: int | None = None) -> None:
        self.api = api
        self.copy_stream = copy_stream
        self.discard_stream = discard_stream
        self.errors: list[str] = []

    def provides(self, kind: DecisionKind) -> bool:
        return bool(self.api.has_batch) or kind not in (DecisionKind.DISCARD, DecisionKind.DISCARD_PREFETCH)

    def _run(self, fn: Callable[..., Any], *args: Any) -> int:
        try:
            fn(*args)
        except CudaError as exc:
            self.errors.append(str(exc))
            return 1
        return 0

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self._run(self.api.prefetch, ptr, nbytes, device, stream)

    def discard(self, ranges: Sequence[Range], stream: int) -> int:
        return self._run(self.api.discard_batch, list(ranges), stream)

    def discard_prefetch(self, ranges: Sequence[Range], device: int, stream: int) -> int:
        return self._run(self.api.discard_and_prefetch_batch, list(ranges), device, stream)

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self._run(self.api.prefetch, ptr, nbytes, device, stream)

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        return self._run(self.api.advise, ptr, nbytes, Advice(advice), device)

    def record_event(self, event: int, stream: int) -> int:
        return self._run(self.api.record_event, event, stream)

    def wait_event(self, stream: int, event: int) -> int:
        return self._run(self.api.stream_wait_event, stream, event)

    def clear_error(self) -> int:
        """Nothing to reset: a failed call came back as an exception of umrt's adapter, made
        through its own binding of the runtime (cuda-bindings links its own instance), not
        through the libcudart whose last error torch checks."""
        return 0


# ctypes types of the table's functions (CTable: struct umrt_cuda_table).
_u64p = ctypes.POINTER(ctypes.c_uint64)
PREFETCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p)
DISCARD_FN = ctypes.CFUNCTYPE(ctypes.c_int, _u64p, _u64p, ctypes.c_int64, ctypes.c_void_p)
DISCARD_PREFETCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, _u64p, _u64p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p)
ADVISE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int)
RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p)
WAIT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64)
CLEAR_FN = ctypes.CFUNCTYPE(ctypes.c_int)


class CTable(ctypes.Structure):
    """``struct umrt_cuda_table``, declared here alone: ``steady_alloc.cpp`` includes the
    declaration :func:`c_table_header` generates from these fields.

    The CUDA calls decisions make, C function pointers, each returning the CUDA error code
    (0: cudaSuccess); a NULL entry with a decision due disarms the schedule. A decision with
    its own stream (non-zero) runs there. Otherwise ``copy_stream`` is where prefetches go
    and ``discard_stream`` where discards and discard-and-prefetches go (NULL: the caller's
    stream); populates, event records and waits run on the caller's stream. Prefetches,
    populates and advice make one call per range; a discard or discard-and-prefetch one
    call with all its ranges (device -1: the host).

    ``clear_error`` is called after any call that failed (NULL: none needed). A failed CUDA
    runtime call also sets the calling thread's last error (``cudaGetLastError``,
    cuda_runtime_api.h: "Returns the last error that has been produced by any of the runtime
    calls in the same instance of the CUDA Runtime library in the host thread ... and resets
    it to cudaSuccess"); torch checks it after every kernel launch
    (``C10_CUDA_KERNEL_LAUNCH_CHECK``), so a failed decision left there would raise in an
    unrelated op before umrt could fall back. The libcudart table points it at
    ``cudaGetLastError``.

    Made by :func:`umrt.native.binding.cudart_table`, :func:`umrt.native.binding.counting_table`,
    or :func:`c_table_of` from a Python table."""

    _fields_ = [("prefetch", PREFETCH_FN), ("discard", DISCARD_FN), ("discard_prefetch", DISCARD_PREFETCH_FN),
                ("populate", PREFETCH_FN), ("advise", ADVISE_FN), ("record_event", RECORD_FN),
                ("wait_event", WAIT_FN), ("copy_stream", ctypes.c_void_p), ("discard_stream", ctypes.c_void_p),
                ("clear_error", CLEAR_FN)]


TABLE_HEADER = "umrt_cuda_table.h"  # what steady_alloc.cpp includes: struct umrt_cuda_table

# The C type of each ctypes type the table's fields use. The arrays a call is given it only
# reads: const (the C++ passes the schedule's own).
_C_TYPES = {ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_uint64: "uint64_t",
            ctypes.c_void_p: "void*", _u64p: "const uint64_t*"}


def _c_type(ctype: Any) -> str:
    if ctype not in _C_TYPES:
        raise ValueError(f"no C type for {ctype!r}: add it to umrt.native.tables._C_TYPES")
    return _C_TYPES[ctype]


def _c_field(name: str, ctype: Any) -> str:
    """One field of the C struct: a function pointer for a ctypes function type, else a value."""
    if issubclass(ctype, ctypes._CFuncPtr):  # a CFUNCTYPE type: its result and argument types
        args = ", ".join(_c_type(a) for a in ctype._argtypes_) or "void"
        return f"{_c_type(ctype._restype_)} (*{name})({args});"
    return f"{_c_type(ctype)} {name};"


def c_table_header() -> str:
    """:class:`CTable`'s fields, in order, as the C declaration of ``struct umrt_cuda_table``
    (:data:`TABLE_HEADER`, written beside the build by :func:`umrt.native.binding.build_library`
    as the constants' header is): the C ABI of the ctypes structure, field for field."""
    return "\n".join([
        "// Generated from umrt/native/tables.py (CTable) when the library is built: do not edit.",
        "// What each field means: CTable's docstring there.",
        "#pragma once",
        "#include <cstdint>",
        "struct umrt_cuda_table {",
        *(f"  {_c_field(name, ctype)}" for name, ctype in CTable._fields_),
        "};",
        "",
    ])


def _c_ranges(ptrs: Any, lens: Any, n: int) -> list[Range]:
    return [(int(ptrs[i]), int(lens[i])) for i in range(n)]


class CFunctionTable:
    """A :class:`CudaTable` that calls a :class:`CTable`'s C functions through ctypes
    (how the Python twin runs the tables the native schedule runs)."""

    def __init__(self, table: CTable) -> None:
        self.c = table
        self.copy_stream = table.copy_stream
        self.discard_stream = table.discard_stream

    def provides(self, kind: DecisionKind) -> bool:
        return bool(getattr(self.c, CALL_NAMES[kind]))

    @staticmethod
    def _arrays(ranges: Sequence[Range]) -> tuple[Any, Any, int]:
        n = len(ranges)
        return ((ctypes.c_uint64 * max(1, n))(*(p for p, _ in ranges)),
                (ctypes.c_uint64 * max(1, n))(*(m for _, m in ranges)), n)

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self.c.prefetch(ptr, nbytes, device, stream or None)

    def discard(self, ranges: Sequence[Range], stream: int) -> int:
        ptrs, lens, n = self._arrays(ranges)
        return self.c.discard(ctypes.cast(ptrs, _u64p), ctypes.cast(lens, _u64p), n, stream or None)

    def discard_prefetch(self, ranges: Sequence[Range], device: int, stream: int) -> int:
        ptrs, lens, n = self._arrays(ranges)
        return self.c.discard_prefetch(ctypes.cast(ptrs, _u64p), ctypes.cast(lens, _u64p), n, device, stream or None)

    def populate(self, ptr: int, nbytes: int, device: int, stream: int) -> int:
        return self.c.populate(ptr, nbytes, device, stream or None)

    def advise(self, ptr: int, nbytes: int, advice: int, device: int) -> int:
        return self.c.advise(ptr, nbytes, advice, device)

    def record_event(self, event: int, stream: int) -> int:
        return self.c.record_event(event, stream or None)

    def wait_event(self, stream: int, event: int) -> int:
        return self.c.wait_event(stream or None, event)

    def clear_error(self) -> int:
        return self.c.clear_error() if self.c.clear_error else 0


def _guarded(fn: Callable[..., int]) -> Callable[..., int]:
    """A table function for a ctypes callback: an exception becomes error 999 (a callback cannot raise)."""
    def call(*args: Any) -> int:
        try:
            return int(fn(*(0 if a is None else a for a in args)))  # a NULL stream arrives as None
        except Exception as exc:  # noqa: BLE001 - nothing may escape a C callback
            print(f"umrt: steady schedule CUDA table call failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 999
    return call


def c_table_of(table: CudaTable) -> CTable:
    """A :class:`CTable` of ctypes callbacks into a Python table (its missing calls: NULL)."""
    fns = {
        "prefetch": PREFETCH_FN(_guarded(table.prefetch)),
        "discard": DISCARD_FN(_guarded(lambda ptrs, lens, n, stream: table.discard(_c_ranges(ptrs, lens, n), stream))),
        "discard_prefetch": DISCARD_PREFETCH_FN(_guarded(
            lambda ptrs, lens, n, device, stream: table.discard_prefetch(_c_ranges(ptrs, lens, n), device, stream))),
        "populate": PREFETCH_FN(_guarded(table.populate)),
        "advise": ADVISE_FN(_guarded(table.advise)),
        "record_event": RECORD_FN(_guarded(table.record_event)),
        "wait_event": WAIT_FN(_guarded(table.wait_event)),
    }
    c = CTable(copy_stream=table.copy_stream or None, discard_stream=table.discard_stream or None)
    for kind, name in CALL_NAMES.items():
        if table.provides(kind):
            setattr(c, name, fns[name])
    fns["clear_error"] = CLEAR_FN(_guarded(table.clear_error))
    c.clear_error = fns["clear_error"]
    c.keep = fns  # the callbacks must outlive every call the schedule makes
    return c


# The libraries of torch's (and CuPy's) that call the CUDA runtime: the libcudart they
# resolve is the runtime instance whose per-thread state (the last error, the current
# device) torch reads.
CUDART_USERS = ("libc10_cuda.so", "libtorch_cuda.so", "libcupy")


def loaded_libcudart(maps: str = "/proc/self/maps") -> tuple[str | None, str]:
    """``(path, reason)``: the libcudart shared library torch uses in this process (found in
    ``/proc/self/maps``), else ``(None, why not)``. With one loaded, that one; with several
    (torch's, CuPy's, another CUDA version's: separate runtime instances), the one torch's
    own CUDA library (``libc10_cuda.so``) resolves ``cudaGetLastError`` to, never a guess.
    cuda-bindings links the runtime statically: importing it alone loads no libcudart."""
    try:
        text = Path(maps).read_text()
    except OSError as exc:
        return None, f"cannot read {maps}: {exc}"
    paths = {line.split(None, 5)[5] for line in text.splitlines() if len(line.split(None, 5)) == 6}
    found = sorted(p for p in paths if re.search(r"/libcudart\.so[.\d]*$", p))
    if not found:
        return None, f"no libcudart.so in {maps} (load torch.cuda or CuPy's runtime first)"
    if len(found) == 1:
        return found[0], f"loaded by this process ({maps})"
    real = {os.path.realpath(p): p for p in found}
    for user in CUDART_USERS:
        for path in sorted(p for p in paths if Path(p).name.startswith(user)):
            resolved = _resolves_to(path, "cudaGetLastError")
            if resolved is not None and os.path.realpath(resolved) in real:
                return real[os.path.realpath(resolved)], f"the copy {Path(path).name} uses, of {len(found)} loaded"
    return None, (f"{len(found)} libcudart libraries loaded ({', '.join(found)}) and none is known to be torch's: "
                  "the schedule's calls go through umrt's Python adapter")


class _DlInfo(ctypes.Structure):
    """``Dl_info`` (glibc ``dlfcn.h``)."""

    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def _resolves_to(library: str, symbol: str) -> str | None:
    """The file of the library that defines ``symbol`` as ``library`` (already loaded) sees it:
    ``dlsym`` on its handle searches it and its dependencies, ``dladdr`` names the file."""
    try:
        handle = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
        libc = ctypes.CDLL(None)
        info = _DlInfo()
        if not address or not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
            return None
        return info.dli_fname.decode()
    except (OSError, AttributeError):
        return None
