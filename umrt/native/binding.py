"""The native steady schedule (``steady_alloc.cpp``) through ctypes, and its C tables.

:func:`native_library` builds the library at first use (:mod:`umrt.native.build`) and
declares its functions (:mod:`umrt.native.signatures`); :class:`NativeSteadySchedule` is a schedule in it (the twin of
:class:`umrt.native.twin.PythonSteadySchedule`); :func:`load_steady` picks the native one
when it builds, else warns once and returns the Python one. :func:`cudart_table` (over the
process's libcudart) and :func:`counting_table` (counts only, :func:`counted`) are tables of
C functions the library holds.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from umrt.native.build import build_native, native_source, warn_not_built
from umrt.native.constants import (
    CALL_NAMES,
    CPP_HEADER,
    DEFAULT_CAPACITY,
    DecisionKind,
    Deviation,
    SteadyEvent,
    cpp_header,
)
from umrt.native.schedule import ScheduleArrays, SteadyError
from umrt.native.signatures import declare
from umrt.native.tables import TABLE_HEADER, CTable, CudaTable, c_table_header, c_table_of
from umrt.native.twin import PythonSteadySchedule


def _stream_arg(stream: int | None) -> int:
    return stream or 0


class NativeSteadySchedule:
    """The schedule in ``steady_alloc.cpp``, through ctypes (see :func:`load_steady`)."""

    native = True

    def __init__(self, lib: ctypes.CDLL, arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY) -> None:
        self.handle: int | None = None
        arrays.check(capacity)
        self.lib = lib
        self.a = arrays
        self.capacity = capacity
        u64, i64, i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
        n, nd, nr = len(arrays.sizes), len(arrays.dec_kind), len(arrays.range_ptr)
        self.handle = lib.umrt_steady_create(
            n, (u64 * n)(*arrays.sizes), (u64 * n)(*arrays.addrs), (i64 * (n + 1))(*arrays.alloc_begin),
            (i64 * (n + 1))(*arrays.free_begin), nd, (i32 * max(1, nd))(*arrays.dec_kind),
            (i32 * max(1, nd))(*arrays.dec_device), (i32 * max(1, nd))(*arrays.dec_advice),
            (u64 * max(1, nd))(*arrays.dec_stream), (u64 * max(1, nd))(*arrays.dec_event),
            (i64 * (nd + 1))(*arrays.range_begin), nr, (u64 * max(1, nr))(*arrays.range_ptr),
            (u64 * max(1, nr))(*arrays.range_len), len(arrays.iteration_starts),
            (i64 * len(arrays.iteration_starts))(*arrays.iteration_starts), (i64 * (nd + 1))(*arrays.guard_begin),
            len(arrays.guard_ordinal), (i64 * max(1, len(arrays.guard_ordinal)))(*arrays.guard_ordinal), capacity)
        if not self.handle:
            raise SteadyError("the native schedule rejected the arrays (inconsistent decision, range or iteration offsets)")
        self._table_keep: Any = None
        self._drain_buf: tuple | None = None
        self._malloc = lib.umrt_steady_malloc
        self._free = lib.umrt_steady_free

    def __del__(self) -> None:
        handle, self.handle = self.handle, None
        if handle:
            self.lib.umrt_steady_destroy(handle)

    def set_table(self, table: CudaTable | None) -> None:
        if table is None:
            self.lib.umrt_steady_set_table(self.handle, None)
            self._table_keep = None
            return
        self.set_c_table(c_table_of(table))

    def set_c_table(self, table: CTable) -> None:
        """A table of C functions (no Python on the path: :func:`cudart_table`,
        :func:`counting_table`); copied into the schedule, and kept alive by it."""
        self._table_keep = table
        self.lib.umrt_steady_set_table(self.handle, ctypes.byref(table))

    def adopt(self, blocks: Iterable[tuple[int, int]]) -> None:
        """See :meth:`PythonSteadySchedule.adopt`."""
        blocks = [(int(addr), int(ordinal)) for addr, ordinal in blocks]
        k = len(blocks)
        addrs = (ctypes.c_uint64 * max(1, k))(*(b[0] for b in blocks))
        ordinals = (ctypes.c_int64 * max(1, k))(*(b[1] for b in blocks))
        bad = self.lib.umrt_steady_adopt(self.handle, k, addrs, ordinals)
        if bad:
            raise self.a.adopt_error(bad - 1, *blocks[bad - 1])

    def disown(self) -> list[tuple[int, int, int]]:
        """See :meth:`PythonSteadySchedule.disown`."""
        room = max(16, self.state()[2])
        while True:
            addrs, sizes, ordinals = (ctypes.c_uint64 * room)(), (ctypes.c_uint64 * room)(), (ctypes.c_int64 * room)()
            k = self.lib.umrt_steady_disown(self.handle, room, addrs, sizes, ordinals)
            if k >= 0:
                return list(zip(addrs[:k], sizes[:k], ordinals[:k], strict=True))
            room = -k + 16  # more blocks went live meanwhile: try again with room for them

    def arm(self, device: int = 0, stream: int = 0) -> None:
        self.lib.umrt_steady_arm(self.handle, device, _stream_arg(stream))

    @property
    def armed(self) -> bool:
        return bool(self.lib.umrt_steady_armed(self.handle))

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        return self._malloc(self.handle, size, device, stream or None) or 0

    def free(self, ptr: int, size: int = 0, device: int = 0, stream: int = 0) -> bool:
        return bool(self._free(self.handle, ptr, size, device, stream or None))

    def missing_calls(self) -> list[str]:
        """See :meth:`PythonSteadySchedule.missing_calls`."""
        mask = int(self.lib.umrt_steady_missing(self.handle))
        return [CALL_NAMES[kind] for kind in DecisionKind if mask & (1 << kind)]

    def record_stream(self, ptr: int, stream: int) -> bool:
        """See :meth:`PythonSteadySchedule.record_stream`."""
        return bool(self.lib.umrt_steady_record_stream(self.handle, ptr, stream or None))

    def drain(self, max_events: int | None = None) -> list[SteadyEvent]:
        cap = self.capacity if max_events is None else min(max_events, self.capacity)
        if self._drain_buf is None or len(self._drain_buf[0]) < cap:
            size = max(cap, self.capacity)
            self._drain_buf = ((ctypes.c_int32 * size)(), (ctypes.c_int64 * size)(), (ctypes.c_uint64 * size)(),
                               (ctypes.c_uint64 * size)())
        kinds, ordinals, ptrs, sizes = self._drain_buf
        k = self.lib.umrt_steady_drain(self.handle, kinds, ordinals, ptrs, sizes, cap)
        return list(zip(kinds[:k], ordinals[:k], ptrs[:k], sizes[:k], strict=True))

    def clear_events(self) -> int:
        return int(self.lib.umrt_steady_clear_events(self.handle))

    def deviation(self) -> tuple[Deviation, int, str]:
        buf = ctypes.create_string_buffer(512)
        position = ctypes.c_int64()
        code = self.lib.umrt_steady_deviation(self.handle, buf, len(buf), ctypes.byref(position))
        return Deviation(code), position.value, buf.value.decode("utf-8", "replace")

    def state(self) -> tuple[int, int, int, int]:
        out = (ctypes.c_int64 * 4)()
        self.lib.umrt_steady_state(self.handle, out)
        return tuple(out)


def steady_source() -> Path:
    """``umrt/native/steady_alloc.cpp``."""
    return native_source("steady_alloc.cpp")


def build_library() -> str:
    """Compile the native schedule, with its constants generated from
    :mod:`umrt.native.constants` (:func:`~umrt.native.constants.cpp_header`) and its CUDA
    table's struct from :class:`~umrt.native.tables.CTable`
    (:func:`~umrt.native.tables.c_table_header`), and return the library's path. Raises on
    any build failure."""
    return build_native(steady_source(), "umrt_steady_alloc", "the native steady schedule", ["-ldl"],
                        headers={CPP_HEADER: cpp_header(), TABLE_HEADER: c_table_header()})


@functools.lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The built native schedule library, or ``None`` after one warning saying why."""
    try:
        return declare(ctypes.CDLL(build_library()), "steady_alloc.cpp")
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the Python schedule"
        warn_not_built("the native steady schedule", exc,
                       "the steady state is served by the pure-Python schedule instead (same behaviour, slower)")
        return None


def load_steady(arrays: ScheduleArrays, capacity: int = DEFAULT_CAPACITY, *,
                native: bool = True) -> NativeSteadySchedule | PythonSteadySchedule:
    """The schedule for ``arrays``: native when the library builds (first use), else
    the Python one (after one warning); ``native=False`` asks for the Python one."""
    lib = native_library() if native else None
    if lib is None:
        return PythonSteadySchedule(arrays, capacity)
    return NativeSteadySchedule(lib, arrays, capacity)


def _library() -> ctypes.CDLL:
    lib = native_library()
    if lib is None:
        raise SteadyError("the native steady schedule did not build (see the warning): no C tables without it")
    return lib


def cudart_table(path: str, copy_stream: int | None = None, discard_stream: int | None = None) -> CTable:
    """A :class:`CTable` over the libcudart at ``path`` (``umrt_steady_cudart_table``:
    dlopen, CUDA 13 shapes, or CUDA 12's without discards), for
    :meth:`NativeSteadySchedule.set_c_table`. ``table.version`` is the runtime version.

    Raises:
        SteadyError: the native library did not build, or the runtime cannot be used.
    """
    lib = _library()
    table = CTable()
    err = ctypes.create_string_buffer(512)
    version = lib.umrt_steady_cudart_table(str(path).encode(), ctypes.byref(table), err, len(err))
    if version <= 0:
        raise SteadyError(f"no CUDA table over {path}: {err.value.decode('utf-8', 'replace')}")
    table.copy_stream, table.discard_stream = copy_stream or None, discard_stream or None
    table.version = version
    return table


COUNTED_KINDS = tuple(DecisionKind)  # the order of umrt_steady_counted's counts


def counting_table() -> CTable:
    """A :class:`CTable` whose calls only count themselves (per kind, atomically) and succeed."""
    table = CTable()
    _library().umrt_steady_counting_table(ctypes.byref(table))
    return table


def counted() -> dict[str, int]:
    """Calls the counting tables made since :func:`reset_counted`, by call name."""
    out = (ctypes.c_int64 * len(COUNTED_KINDS))()
    _library().umrt_steady_counted(out)
    return {CALL_NAMES[kind]: int(out[kind]) for kind in COUNTED_KINDS}


def reset_counted() -> None:
    """Zero the counting tables' counts."""
    _library().umrt_steady_counted_reset()
