"""What Python and the C++ schedule share, defined once: the decision kinds and their call
names, the deviation codes, the event kinds, the running hash's step (and, Python's alone, the
event buffer's default size: the C++ is given its capacity).

Python is the source: ``steady_alloc.cpp`` includes a header generated from this module
when it is built (:mod:`umrt.native.build`), so the two cannot drift apart.
"""
from __future__ import annotations

import enum

EV_ALLOC, EV_FREE, EV_BOUNDARY = 0, 1, 2
SteadyEvent = tuple[int, int, int, int]  # (EV_*, ordinal (EV_BOUNDARY: the iteration), ptr, size)
HASH_MUL = 1000003
HASH_MASK = (1 << 63) - 1  # the width of the runtime's running hash (umrt.policy.runtime.learning.SIGNATURE_MASK)
DEFAULT_CAPACITY = 1 << 16  # events (24 bytes each natively): ~20 gpt2 iterations undrained


class DecisionKind(enum.IntEnum):
    """What a decision asks of CUDA (C++: enum Kind)."""

    PREFETCH = 0  # to ``device`` (HOST: an eviction), on the table's copy stream
    DISCARD = 1  # on the table's discard stream
    DISCARD_PREFETCH = 2  # discard and prefetch to ``device``, on the discard stream
    POPULATE = 3  # prefetch to ``device`` on the caller's (compute) stream
    ADVISE = 4  # cudaMemAdvise(advice, device)
    RECORD_EVENT = 5  # cudaEventRecord(event, stream)
    WAIT_EVENT = 6  # cudaStreamWaitEvent(stream, event, 0)


class Deviation(enum.IntEnum):
    """Why a schedule disarmed (C++: enum Dev, ``DEV_`` + the name)."""

    NONE = 0
    SIZE = 1
    HASH = 2
    LIVE = 3
    BUFFER = 4
    CALL = 5
    DEVICE = 6
    STREAM = 7
    NO_TABLE = 8
    STOPPED = 9  # disown() while armed: "stopped by Python"
    TOUCH = 10  # a decision would touch a block live now that was dead there in the recorded window
    REENTERED = 11  # an allocation from inside a decision's CUDA call (a Python table's callback)


# Each kind's call: its CudaTable method and its field of the C table (CTable).
CALL_NAMES = {DecisionKind.PREFETCH: "prefetch", DecisionKind.DISCARD: "discard",
               DecisionKind.DISCARD_PREFETCH: "discard_prefetch", DecisionKind.POPULATE: "populate",
               DecisionKind.ADVISE: "advise", DecisionKind.RECORD_EVENT: "record_event",
               DecisionKind.WAIT_EVENT: "wait_event"}


def mix(h: int, size: int) -> int:
    """One allocation's step of the runtime's running hash (restarts at 0 each iteration)."""
    return ((h * HASH_MUL) ^ (size << 1)) & HASH_MASK


CPP_HEADER = "umrt_steady_constants.h"  # what steady_alloc.cpp includes


def cpp_header() -> str:
    """This module's constants as C++ (:data:`CPP_HEADER`, written beside the build by
    :func:`umrt.native.binding.build_library`): ``kHashMul``, ``kHashMask``, ``enum Kind``
    (:class:`DecisionKind`) and ``kKinds``, ``kCallNames`` (:data:`CALL_NAMES`), ``enum Ev``
    and ``enum Dev`` (:class:`Deviation`, ``DEV_`` + the name)."""
    kinds = list(DecisionKind)
    if [int(k) for k in kinds] != list(range(len(kinds))) or set(CALL_NAMES) != set(kinds):
        raise ValueError("DecisionKind must number 0..n-1, each with its call name: the C++ indexes by it")
    events = {"EV_ALLOC": EV_ALLOC, "EV_FREE": EV_FREE, "EV_BOUNDARY": EV_BOUNDARY}

    def enum_of(name: str, members: dict[str, int]) -> str:
        return f"enum {name} : int32_t {{ " + ", ".join(f"{k} = {v}" for k, v in members.items()) + " };"

    return "\n".join([
        "// Generated from umrt/native/constants.py when the library is built: do not edit.",
        "#pragma once",
        "#include <cstdint>",
        "namespace {",
        f"constexpr uint64_t kHashMul = {HASH_MUL}ULL;",
        f"constexpr uint64_t kHashMask = {HASH_MASK}ULL;",
        enum_of("Kind", {k.name: int(k) for k in kinds}),
        f"constexpr int kKinds = {len(kinds)};",
        "constexpr const char* kCallNames[kKinds] = {" + ", ".join(f'"{CALL_NAMES[k]}"' for k in kinds) + "};",
        enum_of("Ev", events),
        enum_of("Dev", {f"DEV_{d.name}": int(d) for d in Deviation}),
        "}  // namespace",
        "",
    ])
