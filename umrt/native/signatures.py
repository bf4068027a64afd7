"""Every C function umrt calls through ctypes, declared once: by source file, each
function's ``(restype, argtypes)``. :func:`declare` sets them on a loaded library.

The C side of each row is the ``UMRT_EXPORT`` definition in that source (``steady_alloc.cpp``,
``steady_front.cpp``, ``torch_alloc_shim.cpp``). ``void*`` handles, arrays and streams are
``c_void_p``; a NULL stream is passed as ``None``.
"""
from __future__ import annotations

import ctypes
from typing import Any

_vp, _u64, _i64, _i32, _int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int
_ssize, _str = ctypes.c_ssize_t, ctypes.c_char_p

Signature = tuple[Any, list[Any]]  # (restype, argtypes)

SIGNATURES: dict[str, dict[str, Signature]] = {
    "steady_alloc.cpp": {
        "umrt_steady_create": (_vp, [_i64, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp, _vp,
                                     _i64, _vp, _vp, _i64, _vp, _i64]),
        "umrt_steady_adopt": (_i64, [_vp, _i64, _vp, _vp]),
        "umrt_steady_disown": (_i64, [_vp, _i64, _vp, _vp, _vp]),
        "umrt_steady_cudart_table": (_int, [_str, _vp, _str, _i64]),
        "umrt_steady_counting_table": (None, [_vp]),
        "umrt_steady_counted": (None, [_vp]),
        "umrt_steady_counted_reset": (None, []),
        "umrt_steady_destroy": (None, [_vp]),
        "umrt_steady_set_table": (None, [_vp, _vp]),
        "umrt_steady_arm": (None, [_vp, _int, _vp]),
        "umrt_steady_armed": (_int, [_vp]),
        "umrt_steady_missing": (_i32, [_vp]),
        "umrt_steady_malloc": (_vp, [_vp, _u64, _int, _vp]),
        "umrt_steady_free": (_int, [_vp, _u64, _u64, _int, _vp]),
        "umrt_steady_record_stream": (_int, [_vp, _u64, _vp]),
        "umrt_steady_drain": (_i64, [_vp, _vp, _vp, _vp, _vp, _i64]),
        "umrt_steady_clear_events": (_i64, [_vp]),
        "umrt_steady_deviation": (_i32, [_vp, _str, _i64, _vp]),
        "umrt_steady_state": (None, [_vp, _vp]),
        "umrt_steady_noop_malloc": (_vp, [_vp, _u64, _int, _vp]),
        "umrt_steady_noop_free": (_int, [_vp, _u64, _u64, _int, _vp]),
        "umrt_steady_run": (_i64, [_vp, _i64, _vp, _vp, _vp, _i64, _int, _vp]),
        "umrt_steady_plant_bugs": (None, [_int]),
    },
    "steady_front.cpp": {
        "umrt_front_set_fallback": (None, [_vp, _vp, _vp]),
        "umrt_front_install": (None, [_vp, _vp, _vp, _vp, _vp]),
        "umrt_front_record_stream": (None, [_vp, _vp]),
        "umrt_front_slot_size": (_i64, []),
        "umrt_front_malloc": (_vp, [_ssize, _int, _vp]),
        "umrt_front_free": (None, [_vp, _ssize, _int, _vp]),
        "umrt_front_counters": (None, [_vp]),
        "umrt_front_run": (_i64, [_i64, _vp, _vp, _vp, _i64, _int, _vp]),
    },
    "torch_alloc_shim.cpp": {
        "umrt_set_callbacks": (None, [_vp, _vp]),
        "umrt_set_error": (None, [_str]),
        "umrt_set_record_stream": (None, [_vp]),
    },
}


def declare(lib: ctypes.CDLL, source: str) -> ctypes.CDLL:
    """``lib`` (built from ``source``, a key of :data:`SIGNATURES`) with every function of
    that source given its ``restype`` and ``argtypes``; raises AttributeError if one is missing."""
    for name, (restype, argtypes) in SIGNATURES[source].items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
