"""umrt trace files: versioned, compact, columnar, checksummed.

Layout (little-endian)::

    magic      8 bytes  b"UMRTRACE"
    version    u32      FORMAT_VERSION
    header_len u32      length of the JSON header
    body_len   u64      length of the compressed body
    header     JSON     TraceHeader fields (format_version, umrt_version, model, ...)
    body       zlib     columnar arrays (see below)
    crc32      u32      of header + body

The body is a small JSON index (array names, dtypes, counts; string tables
for op names, module paths and launch precisions) followed by the raw numpy arrays: one event
type code per event, then one column per field of each event type, with the
accesses of all launches flattened into four columns. A GPT-2 XL trace of
three iterations loads in well under a second.

Format 2 added each launch's precision (``Launch.precision``); format 1
files still load, their launches with precision ``""``. Format 3 added each
iteration boundary's phase (``IterationBoundary.phase``); format 1 and 2 files
still load, every iteration a training step.

Every way a file can be bad raises :class:`~umrt.errors.TraceFormatError`
with a message that says what is wrong: missing file, wrong magic, unknown
version, truncated or corrupt data, and a trace without a complete iteration.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from umrt.errors import TraceFormatError
from umrt.trace.events import (
    PHASES,
    Access,
    Alloc,
    Event,
    Free,
    IterationBoundary,
    Kind,
    Launch,
    LayerEnter,
    LayerExit,
    Trace,
    TraceHeader,
)

MAGIC = b"UMRTRACE"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1: launches without a precision (read as ""); 1-2: boundaries without a phase
_PREFIX = struct.Struct("<8sIIQ")
_CRC = struct.Struct("<I")

_LAUNCH, _ALLOC, _FREE, _BOUNDARY, _ENTER, _EXIT = range(6)
_PHASES = ("forward", "backward")

# column name -> dtype
_COLUMNS = {
    "etype": "u1",
    "l_seq": "<i8",
    "l_exec": "<i8",
    "l_op": "<i4",
    "l_mod": "<i4",
    "l_flops": "<i8",
    "l_bytes": "<i8",
    "l_nacc": "<i4",
    "l_prec": "u1",  # index into the body's "precisions" table (format 2)
    "x_obj": "<i8",
    "x_off": "<i8",
    "x_len": "<i8",
    "x_write": "u1",
    "a_obj": "<i8",
    "a_nbytes": "<i8",
    "a_kind": "u1",
    "a_launch": "<i8",
    "f_obj": "<i8",
    "b_index": "<i8",
    "b_phase": "u1",  # index into PHASES (format 3)
    "y_mod": "<i4",
    "y_phase": "u1",
}

PathLike = str | os.PathLike


def save(trace: Trace, path: PathLike) -> None:
    """Write ``trace`` to ``path`` (atomically: a crash leaves no half file)."""
    data = encode(trace)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise TraceFormatError(f"cannot write trace file {str(path)!r}: {exc.strerror or exc}") from exc


def load(path: PathLike) -> Trace:
    """Read a trace file written by :func:`save`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(f"trace file not found: {str(path)!r}") from None
    except IsADirectoryError:
        raise TraceFormatError(f"{str(path)!r} is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace file {str(path)!r}: {exc.strerror or exc}") from None
    return decode(data, source=str(path))


def encode(trace: Trace, *, check: bool = True) -> bytes:
    """The bytes of a trace file. ``check=False`` allows a trace without a complete iteration."""
    if check and not trace.iteration_spans():
        raise TraceFormatError(
            "trace has no complete iteration (it needs two IterationBoundary events); record at least one step"
        )
    cols: dict[str, list] = {name: [] for name in _COLUMNS}
    ops: dict[str, int] = {}
    mods: dict[str, int] = {}
    precs: dict[str, int] = {"": 0}
    etype = cols["etype"]
    for e in trace.events:
        if isinstance(e, Launch):
            etype.append(_LAUNCH)
            cols["l_seq"].append(e.seq)
            cols["l_exec"].append(e.exec_id)
            cols["l_op"].append(ops.setdefault(e.op, len(ops)))
            cols["l_mod"].append(mods.setdefault(e.module, len(mods)))
            cols["l_flops"].append(e.flops)
            cols["l_bytes"].append(e.bytes)
            cols["l_nacc"].append(len(e.accesses))
            cols["l_prec"].append(precs.setdefault(e.precision, len(precs)))
            for a in e.accesses:
                cols["x_obj"].append(a.obj)
                cols["x_off"].append(a.offset)
                cols["x_len"].append(a.length)
                cols["x_write"].append(1 if a.write else 0)
        elif isinstance(e, Alloc):
            etype.append(_ALLOC)
            cols["a_obj"].append(e.obj)
            cols["a_nbytes"].append(e.nbytes)
            cols["a_kind"].append(int(e.kind))
            cols["a_launch"].append(e.launch)
        elif isinstance(e, Free):
            etype.append(_FREE)
            cols["f_obj"].append(e.obj)
        elif isinstance(e, IterationBoundary):
            etype.append(_BOUNDARY)
            cols["b_index"].append(e.index)
            cols["b_phase"].append(PHASES.index(e.phase))
        elif isinstance(e, (LayerEnter, LayerExit)):
            etype.append(_ENTER if isinstance(e, LayerEnter) else _EXIT)
            cols["y_mod"].append(mods.setdefault(e.module, len(mods)))
            cols["y_phase"].append(_PHASES.index(e.phase) if e.phase in _PHASES else 0)
        else:
            raise TypeError(f"not a trace event: {e!r}")
    arrays = []
    index = []
    for name, dtype in _COLUMNS.items():
        arr = np.asarray(cols[name], dtype=dtype)
        index.append([name, len(arr)])
        arrays.append(arr.tobytes())
    body_index = json.dumps({"columns": index, "ops": list(ops), "modules": list(mods),
                             "precisions": list(precs)}).encode()
    body = zlib.compress(struct.pack("<I", len(body_index)) + body_index + b"".join(arrays), 6)
    h = trace.header
    header = json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "umrt_version": h.umrt_version,
            "model": h.model,
            "torch_version": h.torch_version,
            "device": h.device,
            "iterations": len(trace.iteration_spans()),
            "notes": list(h.notes),
            "meta": h.meta,
        },
        default=str,
    ).encode()
    crc = zlib.crc32(header + body)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), len(body)) + header + body + _CRC.pack(crc)


def read_header(path: PathLike) -> TraceHeader:
    """Only the header of a trace file (checks magic and version, not the body)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            magic, version, hlen, _ = _check_prefix(prefix, str(path))
            raw = f.read(hlen)
    except FileNotFoundError:
        raise TraceFormatError(f"trace file not found: {str(path)!r}") from None
    except IsADirectoryError:
        raise TraceFormatError(f"{str(path)!r} is a directory, not a trace file") from None
    if len(raw) < hlen:
        raise TraceFormatError(f"{str(path)!r} is truncated (header cut short)")
    return _parse_header(raw, str(path))


def _check_prefix(prefix: bytes, source: str) -> tuple:
    if len(prefix) < len(MAGIC) or prefix[: len(MAGIC)] != MAGIC:
        if len(prefix) < len(MAGIC) and MAGIC.startswith(prefix) and prefix:
            raise TraceFormatError(f"{source!r} is truncated (file ends inside the magic number)")
        raise TraceFormatError(f"{source!r} is not a umrt trace file (wrong magic number)")
    if len(prefix) < _PREFIX.size:
        raise TraceFormatError(f"{source!r} is truncated (file ends inside the fixed header)")
    magic, version, hlen, blen = _PREFIX.unpack(prefix)
    if version not in READABLE_VERSIONS:
        raise TraceFormatError(
            f"{source!r} has unknown trace format version {version}; this umrt reads versions "
            + ", ".join(map(str, READABLE_VERSIONS))
            + (" (written by a newer umrt?)" if version > FORMAT_VERSION else "")
        )
    return magic, version, hlen, blen


def _parse_header(raw: bytes, source: str) -> TraceHeader:
    try:
        h = json.loads(raw.decode())
        return TraceHeader(
            format_version=int(h["format_version"]),
            umrt_version=str(h["umrt_version"]),
            model=str(h["model"]),
            torch_version=str(h["torch_version"]),
            device=str(h["device"]),
            iterations=int(h["iterations"]),
            notes=[str(n) for n in h.get("notes", [])],
            meta=dict(h.get("meta", {})),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{source!r} is corrupt (unreadable header: {exc})") from None


def decode(data: bytes, *, source: str = "<bytes>") -> Trace:
    """Parse the bytes of a trace file."""
    _, _, hlen, blen = _check_prefix(data[: _PREFIX.size], source)
    need = _PREFIX.size + hlen + blen + _CRC.size
    if len(data) < need:
        raise TraceFormatError(f"{source!r} is truncated ({len(data)} of {need} bytes)")
    if len(data) > need:
        raise TraceFormatError(f"{source!r} is corrupt ({len(data) - need} unexpected bytes after the end)")
    raw_header = data[_PREFIX.size : _PREFIX.size + hlen]
    body = data[_PREFIX.size + hlen : _PREFIX.size + hlen + blen]
    (crc,) = _CRC.unpack(data[need - _CRC.size : need])
    if zlib.crc32(raw_header + body) != crc:
        raise TraceFormatError(f"{source!r} is corrupt (checksum mismatch)")
    header = _parse_header(raw_header, source)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # building ~10^5 small objects: the cyclic GC would only slow it down
    try:
        events = _decode_body(zlib.decompress(body))
    except (zlib.error, ValueError, KeyError, IndexError, TypeError, struct.error) as exc:
        raise TraceFormatError(f"{source!r} is corrupt (bad body: {exc})") from None
    finally:
        if gc_was_enabled:
            gc.enable()
    trace = Trace(header, events)
    n = len(trace.iteration_spans())
    if n == 0:
        raise TraceFormatError(f"{source!r} holds no complete iteration; record at least one full step")
    header.iterations = n
    return trace


def _decode_body(raw: bytes) -> list[Event]:
    (ilen,) = struct.unpack_from("<I", raw, 0)
    index = json.loads(raw[4 : 4 + ilen].decode())
    ops: list[str] = index["ops"]
    mods: list[str] = index["modules"]
    precs: list[str] = index.get("precisions", [""])
    pos = 4 + ilen
    c: dict[str, list] = {}
    for name, count in index["columns"]:
        dtype = np.dtype(_COLUMNS[name])
        size = int(count) * dtype.itemsize
        if pos + size > len(raw):
            raise ValueError(f"column {name} runs past the end")
        c[name] = np.frombuffer(raw, dtype=dtype, count=int(count), offset=pos).tolist()
        pos += size
    if pos != len(raw) or set(c) - set(_COLUMNS) or set(_COLUMNS) - set(c) - {"l_prec", "b_phase"}:
        raise ValueError("column table does not match the data")
    if "l_prec" not in c:  # format 1: no precision recorded
        c["l_prec"] = [0] * len(c["l_seq"])
    if "b_phase" not in c:  # formats 1 and 2: every iteration a training step
        c["b_phase"] = [0] * len(c["b_index"])
    if len(c["b_phase"]) != len(c["b_index"]) or any(p >= len(PHASES) for p in c["b_phase"]):
        raise ValueError("boundary phases do not match the boundaries")
    if sum(c["l_nacc"]) != len(c["x_obj"]):
        raise ValueError("access counts do not match the access columns")
    kinds = list(Kind)
    li = ai = fi = bi = yi = xi = 0
    events: list[Event] = []
    append = events.append
    x_obj, x_off, x_len, x_write = c["x_obj"], c["x_off"], c["x_len"], c["x_write"]
    for t in c["etype"]:
        if t == _LAUNCH:
            n = c["l_nacc"][li]
            acc = tuple(Access(x_obj[k], x_off[k], x_len[k], bool(x_write[k])) for k in range(xi, xi + n))
            xi += n
            append(
                Launch(
                    c["l_seq"][li],
                    c["l_exec"][li],
                    ops[c["l_op"][li]],
                    acc,
                    c["l_flops"][li],
                    c["l_bytes"][li],
                    mods[c["l_mod"][li]],
                    precs[c["l_prec"][li]],
                )
            )
            li += 1
        elif t == _ALLOC:
            append(Alloc(c["a_obj"][ai], c["a_nbytes"][ai], kinds[c["a_kind"][ai]], c["a_launch"][ai]))
            ai += 1
        elif t == _FREE:
            append(Free(c["f_obj"][fi]))
            fi += 1
        elif t == _BOUNDARY:
            append(IterationBoundary(c["b_index"][bi], PHASES[c["b_phase"][bi]]))
            bi += 1
        elif t in (_ENTER, _EXIT):
            cls = LayerEnter if t == _ENTER else LayerExit
            append(cls(mods[c["y_mod"][yi]], _PHASES[c["y_phase"][yi]]))
            yi += 1
        else:
            raise ValueError(f"unknown event type code {t}")
    if (li, ai, fi, bi, yi) != (
        len(c["l_seq"]),
        len(c["a_obj"]),
        len(c["f_obj"]),
        len(c["b_index"]),
        len(c["y_mod"]),
    ):
        raise ValueError("event counts do not match the columns")
    return events
