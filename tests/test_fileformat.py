"""Trace files: round trip and every kind of bad input."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from umrt.errors import TraceFormatError
from umrt.trace import fileformat as ff
from umrt.trace.events import (
    Access,
    Alloc,
    Free,
    IterationBoundary,
    Kind,
    Launch,
    LayerEnter,
    LayerExit,
    Trace,
    TraceHeader,
    execution_id,
)


def _header(**kw):
    base = dict(
        format_version=1,
        umrt_version="0.1.0",
        model="toy",
        torch_version="x",
        device="meta",
        iterations=0,
        notes=["a note"],
        meta={"batch": 2},
    )
    base.update(kw)
    return TraceHeader(**base)


def _trace(iterations: int = 2) -> Trace:
    ev = [Alloc(0, 4096, Kind.PARAMETER, -1)]
    seq = 0
    for i in range(iterations):
        ev.append(IterationBoundary(i))
        ev.append(LayerEnter("layer.0"))
        ev.append(Alloc(1, 1 << 40, Kind.ACTIVATION, seq))  # sizes beyond 32 bits survive
        ev.append(
            Launch(
                seq,
                execution_id("aten::mm.default", [(2, 2)], ["float32"], "layer.0"),
                "aten::mm.default",
                (Access(0, 0, 4096, False), Access(1, 8, 1 << 40, True)),
                10**15,
                4096 + (1 << 40),
                "layer.0",
                "bf16" if i % 2 else "fp32",
            )
        )
        seq += 1
        ev.append(LayerExit("layer.0"))
        ev.append(LayerEnter("layer.0", "backward"))
        ev.append(Launch(seq, 7, "aten::relu.default", (), 0, 0, ""))
        seq += 1
        ev.append(LayerExit("layer.0", "backward"))
        ev.append(Free(1))
    ev.append(IterationBoundary(iterations))
    return Trace(_header(), ev)


def test_round_trip(tmp_path):
    tr = _trace(3)
    path = tmp_path / "t.umrt"
    ff.save(tr, path)
    back = ff.load(path)
    assert back.events == tr.events
    assert back.header.iterations == 3
    assert back.header.format_version == ff.FORMAT_VERSION
    assert back.header.model == "toy" and back.header.meta == {"batch": 2} and back.header.notes == ["a note"]
    assert ff.read_header(path).model == "toy"
    assert not (tmp_path / "t.umrt.tmp").exists()


def test_missing_file(tmp_path):
    with pytest.raises(TraceFormatError, match="not found"):
        ff.load(tmp_path / "nope.umrt")


def test_directory(tmp_path):
    with pytest.raises(TraceFormatError, match="directory"):
        ff.load(tmp_path)


def test_wrong_magic(tmp_path):
    p = tmp_path / "bad.umrt"
    p.write_bytes(b"PK\x03\x04 this is a zip file, not a trace" * 3)
    with pytest.raises(TraceFormatError, match="magic"):
        ff.load(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.umrt"
    p.write_bytes(b"")
    with pytest.raises(TraceFormatError, match="not a umrt trace"):
        ff.load(p)


def _as_format_1(data: bytes, version: int = 1) -> bytes:
    """The same trace as format 1 wrote it: no precision column, no precision table,
    no boundary phases (``version=2``: only the boundary phases missing)."""
    drop = {"b_phase"} | ({"l_prec"} if version == 1 else set())
    magic, _, hlen, blen = ff._PREFIX.unpack_from(data)
    header = json.loads(data[ff._PREFIX.size : ff._PREFIX.size + hlen])
    header["format_version"] = version
    raw = zlib.decompress(data[ff._PREFIX.size + hlen : ff._PREFIX.size + hlen + blen])
    (ilen,) = struct.unpack_from("<I", raw, 0)
    index = json.loads(raw[4 : 4 + ilen])
    pos, arrays, columns = 4 + ilen, [], []
    for name, count in index["columns"]:
        size = count * np.dtype(ff._COLUMNS[name]).itemsize
        if name not in drop:
            arrays.append(raw[pos : pos + size])
            columns.append([name, count])
        pos += size
    index = {"columns": columns, "ops": index["ops"], "modules": index["modules"],
             **({"precisions": index["precisions"]} if version > 1 else {})}
    ib = json.dumps(index).encode()
    body = zlib.compress(struct.pack("<I", len(ib)) + ib + b"".join(arrays))
    hb = json.dumps(header).encode()
    return ff._PREFIX.pack(magic, version, len(hb), len(body)) + hb + body + ff._CRC.pack(zlib.crc32(hb + body))


def test_precisions_round_trip_and_format_1_still_loads():
    tr = _trace(2)
    assert {e.precision for e in tr.launches()} == {"fp32", "bf16", ""}
    assert ff.decode(ff.encode(tr)).events == tr.events
    # A format 1 file (written before launches carried a precision): same events, precision "".
    old = _as_format_1(ff.encode(tr))
    back = ff.decode(old)
    assert back.header.format_version == 1
    assert [e.precision for e in back.launches()] == [""] * len(tr.launches())
    assert [(e.op, e.flops, e.accesses) for e in back.launches()] == [(e.op, e.flops, e.accesses) for e in tr.launches()]


def test_phases_round_trip_and_older_formats_load_as_training_steps():
    tr = _trace(3)
    events = [IterationBoundary(e.index, "eval") if isinstance(e, IterationBoundary) and e.index == 1 else e
              for e in tr.events]
    tr = Trace(tr.header, events)
    assert tr.iteration_phases() == ["train", "eval", "train"]
    assert ff.decode(ff.encode(tr)).iteration_phases() == ["train", "eval", "train"]
    for version in (1, 2):  # written before boundaries carried a phase: every iteration a step
        back = ff.decode(_as_format_1(ff.encode(tr), version))
        assert back.header.format_version == version
        assert back.iteration_phases() == ["train"] * 3
    with pytest.raises(ValueError, match="phase is one of train, eval"):
        IterationBoundary(0, "test")


def test_unknown_version(tmp_path):
    data = bytearray(ff.encode(_trace()))
    struct.pack_into("<I", data, 8, ff.FORMAT_VERSION + 1)
    p = tmp_path / "new.umrt"
    p.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="unknown trace format version"):
        ff.load(p)


@pytest.mark.parametrize("keep", [4, 12, 30, 60, -1])
def test_truncated(tmp_path, keep):
    data = ff.encode(_trace())
    p = tmp_path / "cut.umrt"
    p.write_bytes(data[:keep])
    with pytest.raises(TraceFormatError, match="truncated"):
        ff.load(p)


def test_corrupt_body(tmp_path):
    data = bytearray(ff.encode(_trace()))
    data[-10] ^= 0xFF
    p = tmp_path / "flip.umrt"
    p.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match="corrupt"):
        ff.load(p)


def test_trailing_garbage(tmp_path):
    p = tmp_path / "tail.umrt"
    p.write_bytes(ff.encode(_trace()) + b"xx")
    with pytest.raises(TraceFormatError, match="corrupt"):
        ff.load(p)


def test_no_complete_iteration(tmp_path):
    tr = _trace(1)
    tr.events = [e for e in tr.events if not (isinstance(e, IterationBoundary) and e.index == 1)]
    with pytest.raises(TraceFormatError, match="no complete iteration"):
        ff.save(tr, tmp_path / "x.umrt")
    p = tmp_path / "noiter.umrt"
    p.write_bytes(ff.encode(tr, check=False))
    with pytest.raises(TraceFormatError, match="no complete iteration"):
        ff.load(p)


def test_unwritable_path(tmp_path):
    with pytest.raises(TraceFormatError, match="cannot write"):
        ff.save(_trace(), tmp_path / "no" / "such" / "dir" / "t.umrt")


def test_recorded_trace_round_trip(tmp_path):
    from umrt.zoo import trace_model

    tr = trace_model(
        "hf:GPT2Config:n_layer=1,n_embd=32,n_head=2,vocab_size=128,n_positions=32", batch=1, seq=8, steps=2
    )
    ff.save(tr, tmp_path / "g.umrt")
    back = ff.load(tmp_path / "g.umrt")
    assert back.events == tr.events and back.header.iterations == 2
