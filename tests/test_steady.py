"""The steady schedule: native (umrt/native/steady_alloc.cpp) and Python twins behave identically."""
from __future__ import annotations

import queue
import threading
import warnings
from pathlib import Path

import pytest

from bench.live_replay import LOGS, RUNS, read_live_log
from bench.steady import gpt2_steady, log_iterations, run_plan, schedule_plan
from tests.fake_cuda import STREAM_NON_BLOCKING, FakeBindingsRuntime, FakeCupyRuntime, FakeGpu, plain
from umrt.backends.base import HOST, Advice
from umrt.backends.cuda import BindingsApi, CudaBackend, CupyApi
from umrt.native import binding
from umrt.native.binding import (
    NativeSteadySchedule,
    counted,
    counting_table,
    cudart_table,
    load_steady,
    native_library,
    reset_counted,
)
from umrt.native.constants import (
    CALL_NAMES,
    DEFAULT_CAPACITY,
    EV_ALLOC,
    EV_BOUNDARY,
    EV_FREE,
    DecisionKind,
    Deviation,
)
from umrt.native.recorder import AllocAt, CallAt, FreeAt, Mark, RecordingApi, SteadyRecorder, Unschedulable
from umrt.native.schedule import (
    ScheduleArrays,
    SteadyError,
    coalesce,
    compile_cycle,
    compile_schedule,
    compile_steady,
    repeat_period,
)
from umrt.native.tables import ApiTable, loaded_libcudart
from umrt.native.twin import PythonSteadySchedule

MiB = 1 << 20
P, D, DP, POP, ADV = (DecisionKind.PREFETCH, DecisionKind.DISCARD, DecisionKind.DISCARD_PREFETCH,
                      DecisionKind.POPULATE, DecisionKind.ADVISE)


@pytest.fixture(scope="module")
def lib():
    library = native_library()
    if library is None:
        pytest.skip("the native schedule did not build here (no C++ compiler or ninja)")
    return library


def both(lib, arrays, capacity=DEFAULT_CAPACITY):
    return PythonSteadySchedule(arrays, capacity), NativeSteadySchedule(lib, arrays, capacity)


class LogTable:
    """A CudaTable that logs its calls (fails the ones listed in ``fail``, lacks those in ``lacks``)."""

    copy_stream = None
    discard_stream = None

    def __init__(self, fail=(), lacks=()):
        self.calls = []
        self.fail = set(fail)
        self.lacks = set(lacks)

    def provides(self, kind):
        return CALL_NAMES[kind] not in self.lacks

    def _log(self, *call):
        self.calls.append(call)
        return 7 if call[0] in self.fail else 0

    def prefetch(self, p, n, device, stream):
        return self._log("prefetch", p, n, device, stream)

    def discard(self, ranges, stream):
        return self._log("discard", tuple(ranges), stream)

    def discard_prefetch(self, ranges, device, stream):
        return self._log("discard_prefetch", tuple(ranges), device, stream)

    def populate(self, p, n, device, stream):
        return self._log("populate", p, n, device, stream)

    def advise(self, p, n, advice, device):
        return self._log("advise", p, n, advice, device)

    def record_event(self, event, stream):
        return self._log("record_event", event, stream)

    def wait_event(self, stream, event):
        return self._log("wait_event", stream, event)

    def clear_error(self):
        self.cleared = getattr(self, "cleared", 0) + 1
        return 0


# -- compiling -------------------------------------------------------------------------
def test_coalesce_merges_touching_and_overlapping_ranges_within_an_allocation():
    assert coalesce([(10, 5), (0, 10), (12, 10), (40, 1), (30, 0)]) == [(0, 22), (40, 1)]
    bounds = {0: (0, 16), 16: (16, 16)}
    assert coalesce([(0, 16), (16, 16)], lambda p: bounds[p // 16 * 16]) == [(0, 16), (16, 16)]


def test_compile_keys_decisions_by_position_and_coalesces_same_kind():
    a, b = 1 << 30, (1 << 30) + 4 * MiB
    rec = [
        CallAt(P, ((a, MiB),), 0),  # before any allocation: allocation 0's
        AllocAt(MiB, a),
        CallAt(P, ((a + MiB, MiB),), 0), CallAt(P, ((a, MiB),), 0), CallAt(P, ((b, MiB),), HOST),
        CallAt(ADV, ((a, MiB),), 0, int(Advice.SET_READ_MOSTLY)),
        AllocAt(2 * MiB, b),
        FreeAt(a), CallAt(D, ((a + 1000, 3 * MiB),)),  # shrunk inward to whole 64 KiB pages
        FreeAt(b),
    ]
    arrays = compile_schedule(rec)
    assert arrays.sizes == [MiB, 2 * MiB] and arrays.addrs == [a, b]
    at0 = arrays.decisions(arrays.alloc_begin[0], arrays.alloc_begin[1])
    assert at0 == [(P, 0, 0, [(a, 2 * MiB)], 0, 0), (P, HOST, 0, [(b, MiB)], 0, 0), (ADV, 0, 1, [(a, MiB)], 0, 0)]
    assert arrays.alloc_begin[1] == arrays.alloc_begin[2]
    free0 = arrays.decisions(arrays.free_begin[0], arrays.free_begin[1])
    assert free0 == [(D, 0, 0, [(a + 64 * 1024, 3 * MiB - 64 * 1024)], 0, 0)]
    assert arrays.free_begin[1] == arrays.free_begin[2] == len(arrays.dec_kind)


def test_compile_never_reorders_a_call_past_another_kind_on_its_ranges():
    a = 1 << 30
    rec = [AllocAt(MiB, a), CallAt(P, ((a, MiB),), HOST), CallAt(P, ((a, MiB),), 0),
           CallAt(P, ((a, MiB),), HOST)]
    arrays = compile_schedule(rec)
    assert [d[1] for d in arrays.decisions(0, arrays.alloc_begin[1])] == [HOST, 0, HOST]


def test_compile_rejects_what_it_cannot_compile():
    with pytest.raises(SteadyError, match="no allocation"):
        compile_schedule([FreeAt(1)])
    with pytest.raises(SteadyError, match="not a recorded"):
        compile_schedule([AllocAt(1, 1), ("alloc", 1)])
    with pytest.raises(SteadyError, match="inconsistent"):
        PythonSteadySchedule(ScheduleArrays([1], [1], [0], [0]))


def test_recorder_records_pool_events_and_backend_calls_in_order(cuda13):
    rec = SteadyRecorder()
    backend = rec.wrap(cuda13)
    ptr = cuda13.malloc(4 * MiB)
    rec.on_pool_event("alloc", ptr, MiB)
    backend.prefetch([(ptr, MiB)], 0)
    backend.populate([(ptr, MiB)])
    backend.advise([(ptr, MiB)], Advice.SET_ACCESSED_BY, 0)
    rec.on_pool_event("free", ptr, MiB)
    backend.discard([(ptr, MiB)])
    backend.discard_and_prefetch([(ptr, MiB)], 0)
    assert rec.take() == [AllocAt(MiB, ptr), CallAt(P, ((ptr, MiB),), 0), CallAt(POP, ((ptr, MiB),), 0),
                          CallAt(ADV, ((ptr, MiB),), 0, 5), FreeAt(ptr), CallAt(D, ((ptr, MiB),)),
                          CallAt(DP, ((ptr, MiB),), 0)]
    assert rec.take() == [] and cuda13.calls["cudaMemDiscardBatchAsync"] == 1


# -- the twins -------------------------------------------------------------------------
def small_schedule():
    a, b, c = 1 << 30, (1 << 30) + 4096, (1 << 30) + 8192
    rec = [AllocAt(100, a), CallAt(P, ((a, 100),), 0), AllocAt(200, b), FreeAt(a), CallAt(D, ((a, 1 << 20),)),
           AllocAt(300, c), FreeAt(b), FreeAt(c), CallAt(ADV, ((c, 300),), 0, 3)]
    return compile_schedule(rec), (a, b, c)


def drive(s, table, iterations=3, stream=0):
    s.set_table(table)
    s.arm(0, stream)
    got = []
    for _ in range(iterations):
        p = [s.malloc(100, 0, stream), s.malloc(200, 0, stream)]
        s.free(p[0], 100, 0, stream)
        p.append(s.malloc(300, 0, stream))
        s.free(p[1], 200, 0, stream)
        s.free(p[2], 300, 0, stream)
        got.append(p)
    return got, s.drain(), s.deviation(), s.state()


def test_twins_serve_the_same_addresses_events_and_calls(lib):
    arrays, (a, b, c) = small_schedule()
    results = []
    for s in both(lib, arrays):
        table = LogTable()
        results.append((drive(s, table), table.calls))
    assert results[0] == results[1]
    (got, events, dev, state), calls = results[0]
    assert got == [[a, b, c]] * 3 and dev == (Deviation.NONE, -1, "") and state == (3, 2, 0, 0)
    first = [(EV_ALLOC, 0, a, 100), (EV_ALLOC, 1, b, 200), (EV_FREE, 0, a, 100), (EV_ALLOC, 2, c, 300),
             (EV_FREE, 1, b, 200), (EV_FREE, 2, c, 300)]
    assert events == first + [(EV_BOUNDARY, 1, 0, 0)] + first + [(EV_BOUNDARY, 2, 0, 0)] + first
    assert calls == [("prefetch", a, 100, 0, 0), ("discard", ((a, 1 << 20),), 0), ("advise", c, 300, 3, 0)] * 3


def test_twins_drop_their_events_counted_alike(lib):
    arrays, _ = small_schedule()
    for s in both(lib, arrays):
        drive(s, LogTable(), iterations=2)  # drains what it served
        s.malloc(100, 0, 0)
        s.malloc(200, 0, 0)
        assert s.clear_events() == 3  # a boundary and two allocations
        assert s.clear_events() == 0 and s.drain() == [] and s.state()[3] == 0


@pytest.mark.parametrize("size, code, message", [
    (201, Deviation.SIZE, "allocation 1: 201 bytes, the schedule expects 200"),
])
def test_a_deviation_disarms_both_identically_and_hands_back(lib, size, code, message):
    arrays, (a, b, c) = small_schedule()
    out = []
    for s in both(lib, arrays):
        s.set_table(LogTable())
        s.arm()
        p0 = s.malloc(100)
        r = [p0, s.malloc(size), s.armed, s.deviation(), s.malloc(200),
             s.free(p0), s.free(12345), s.drain(), s.state()]
        s.arm()  # re-armed: the stream starts again at allocation 0
        r += [s.malloc(100), s.deviation()]
        out.append(r)
    assert out[0] == out[1]
    assert out[0][:5] == [a, 0, False, (code, 1, message), 0]
    assert out[0][5:7] == [True, False]  # its block is still the schedule's; a stranger's is not
    assert out[0][7] == [(EV_ALLOC, 0, a, 100), (EV_FREE, 0, a, 100)]  # no decision ran at the free
    assert out[0][9:] == [a, (Deviation.NONE, -1, "")]


def test_other_deviations_match(lib):
    arrays, (a, b, c) = small_schedule()
    out = []
    for s in both(lib, arrays):
        s.set_table(None)  # a decision is due at allocation 0: no table -> disarmed (still served)
        s.arm(0, 0)
        r = [s.malloc(100), s.deviation()]
        s.set_table(LogTable(fail={"prefetch"}))
        s.arm()
        r += [s.malloc(100), s.deviation()]  # its block is still live: the schedule's own overlap
        s.free(a)
        s.arm(0, 0x5000)
        r += [s.malloc(100, 0, 0x6000), s.deviation()]
        s.arm(0, 0x5000)
        r += [s.malloc(100, 1, 0x5000), s.deviation()]
        s.arm(0, 0x5000)
        r += [s.malloc(100, 0, 0x5000), s.deviation()]
        out.append(r)
    assert out[0] == out[1]
    r = out[0]
    assert r[0] == a and r[1] == (Deviation.NO_TABLE, 0, "allocation of allocation 0: the CUDA table has no prefetch")
    assert r[2] == 0 and r[3][:2] == (Deviation.LIVE, 0) and "overlaps live block" in r[3][2]
    assert r[5] == (Deviation.STREAM, 0, "allocation 0: stream 0x6000, the schedule serves stream 0x5000")
    assert r[7] == (Deviation.DEVICE, 0, "allocation 0: device 1, the schedule serves device 0")
    assert r[8] == a and r[9] == (Deviation.CALL, 0, f"allocation of allocation 0: prefetch({a:#x}, 100) "
                                  "failed with CUDA error 7")


def test_a_full_event_buffer_disarms_with_a_reason_and_loses_nothing(lib):
    arrays, _ = small_schedule()
    out = []
    for s in both(lib, arrays, capacity=8):
        got, events, dev, state = drive(s, LogTable(), iterations=2)
        out.append((got, events, dev, state))
    assert out[0] == out[1]
    got, events, dev, _ = out[0]
    assert dev == (Deviation.BUFFER, 0, "allocation 0: the event buffer is full (6 events not drained, capacity 8)")
    assert got[1] == [0, 0, 0] and len(events) == 6  # the second iteration fell back, whole


def test_twins_on_the_fake_runtime_make_the_same_cuda_calls_and_obey_its_rules(lib):
    """Decisions through ApiTable over the fake CUDA 13 runtime: the calls are checked by
    its contract (the batch calls reject the legacy stream) and are the same for both."""
    calls, results = [], []
    for make in (PythonSteadySchedule, lambda arr: NativeSteadySchedule(lib, arr)):
        gpu = FakeGpu()
        backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(gpu)))
        seg = backend.malloc(16 * MiB)
        x, y = seg, seg + 4 * MiB
        rec = [AllocAt(4 * MiB, x), CallAt(POP, ((x, 4 * MiB),), 0), AllocAt(4 * MiB, y),
               CallAt(P, ((y, 2 * MiB),), 0), CallAt(P, ((y + 2 * MiB, 2 * MiB),), 0),
               FreeAt(x), CallAt(DP, ((x, 4 * MiB),), 0), FreeAt(y), CallAt(D, ((y, 4 * MiB),)),
               CallAt(ADV, ((y, 4 * MiB),), 0, int(Advice.SET_PREFERRED_LOCATION))]
        arrays = compile_schedule(rec, backend.allocation_of)
        start = len(gpu.calls)
        stream = backend.api.create_stream(False)
        s = make(arrays)
        s.set_table(ApiTable(backend.api))
        s.arm(0, stream)
        for _ in range(2):
            p, q = s.malloc(4 * MiB, 0, stream), s.malloc(4 * MiB, 0, stream)
            s.free(p, 0, 0, stream)
            s.free(q, 0, 0, stream)
        ok = s.deviation()
        backend.api.stream_synchronize(stream)  # switching streams: the old one's work first
        s.arm(0, 0)  # the legacy stream: the fake rejects the discard-and-prefetch batch
        p, q = s.malloc(4 * MiB), s.malloc(4 * MiB)
        s.free(p)
        results.append((ok, s.deviation(), s.drain()))
        calls.append([tuple(plain(x) for x in c) for c in gpu.calls[start + 1:]])
    assert calls[0] == calls[1] and results[0] == results[1]
    assert results[0][0] == (Deviation.NONE, -1, "")
    assert results[0][1][0] == Deviation.CALL and "discard_prefetch" in results[0][1][2]
    names = [c[0] for c in calls[0]]
    assert names.count("cudaMemPrefetchAsync") == 2 * 2 + 2  # populate + one coalesced prefetch, per iteration
    assert names.count("cudaMemDiscardAndPrefetchBatchAsync") == 3 and names.count("cudaMemAdvise") == 2


def test_twins_on_the_cuda12_fake(lib):
    calls = []
    for make in (PythonSteadySchedule, lambda arr: NativeSteadySchedule(lib, arr)):
        gpu = FakeGpu()
        api = CupyApi(FakeCupyRuntime(gpu))
        seg = api.malloc_managed(8 * MiB)
        copy = api.create_stream(False)
        rec = [AllocAt(MiB, seg), CallAt(P, ((seg, MiB),), 0), FreeAt(seg), CallAt(P, ((seg, MiB),), HOST)]
        s = make(compile_schedule(rec))
        s.set_table(ApiTable(api, copy_stream=copy))
        s.arm()
        for _ in range(3):
            s.free(s.malloc(MiB))
        calls.append((gpu.calls[-6:], s.deviation()))
    assert calls[0] == calls[1] and calls[0][1][0] == Deviation.NONE
    assert [c[0] for c in calls[0][0]] == ["memPrefetchAsync"] * 6


# -- the live logs ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2():
    return gpt2_steady(repeats=5)


def test_live_log_steady_iterations_through_both_twins(lib, gpt2):
    """gpt2's live allocation stream, placed by umrt's pool: compiled from one steady
    iteration, the next ones served by both twins at the pool's own addresses, with the
    same events and decisions (a prefetch of every 50th block, a discard at every 7th free)."""
    stream, placed, steady_at = gpt2
    rec = []
    for k, entry in enumerate(placed[steady_at]):
        rec.append(entry)
        if isinstance(entry, AllocAt) and k % 50 == 0:
            rec.append(CallAt(P, ((entry.ptr, entry.size),), 0))
        if isinstance(entry, FreeAt) and k % 7 == 0:
            rec.append(CallAt(D, ((entry.ptr, 1 << 20),)))
    arrays = compile_schedule(rec)
    pool_addrs = [[e.ptr for e in placed[i] if isinstance(e, AllocAt)] for i in (steady_at + 1, steady_at + 2)]
    out = []
    for s in both(lib, arrays):
        table = LogTable()
        s.set_table(table)
        s.arm()
        last, got = [0] * len(arrays.sizes), []
        for i in (steady_at + 1, steady_at + 2):
            plan = schedule_plan(stream[i])
            prev = {}
            for op in stream[i - 1]:
                if op[0] == "A":
                    prev[op[1]] = len(prev)
            plan = [(2, prev[op[1]]) if st == (2, -1) else st for st, op in zip(plan, stream[i], strict=True)]
            last = run_plan(s.malloc, s.free, plan, len(arrays.sizes), last)
            got.append(list(last))
        out.append((got, s.drain(), table.calls, s.deviation()))
    assert out[0] == out[1]
    got, events, calls, dev = out[0]
    assert got == pool_addrs and dev[0] == Deviation.NONE
    assert sum(e[0] == EV_BOUNDARY for e in events) == 1 and len(calls) > 40
    # The first armed iteration frees three blocks the pool placed before: not the schedule's.
    assert sum(e[0] == EV_FREE for e in events) == 2 * len(arrays.sizes) - 3


def test_the_allocation_only_variant_disarms_both_at_the_same_allocation(lib, gpt2):
    """The live run's other variant (1,053 allocations: no out-of-place gradient
    accumulation) against the recorded variant's schedule: both hand back at its first
    different size."""
    stream, placed, steady_at = gpt2
    arrays = compile_schedule(placed[steady_at])
    light = next(it for it in log_iterations(read_live_log(LOGS / RUNS["40GiB"]))
                 if 0 < sum(op[0] == "A" for op in it) < len(arrays.sizes))
    out = []
    for s in both(lib, arrays):
        s.arm()
        served, ptr_of = 0, {}
        for op in light:
            if op[0] == "F":
                s.free(ptr_of.pop(op[1], 0))
                continue
            ptr_of[op[1]] = s.malloc(op[2])
            if not ptr_of[op[1]]:
                break
            served += 1
        out.append((served, s.deviation(), s.armed))
    assert out[0] == out[1] and out[0][1][0] == Deviation.SIZE and not out[0][2]
    assert 0 < out[0][0] < len(arrays.sizes) and out[0][1][1] == out[0][0]


# -- threads and the build -------------------------------------------------------------
def test_two_threads_allocating_and_freeing(lib):
    """Like torch's forward and autograd threads: both allocate, and one frees blocks the
    other allocated (handed over through a bounded queue, so few are live at once)."""
    n, pairs = 512, 3000
    arrays = compile_schedule([AllocAt(4096, (1 << 30) + i * 8192) for i in range(n)])
    for s in both(lib, arrays, capacity=1 << 20):
        s.set_table(LogTable())
        s.arm()
        handed: queue.Queue = queue.Queue(maxsize=8)
        failures = []

        def producer(s=s, handed=handed, failures=failures):
            for _ in range(pairs):
                p = s.malloc(4096)
                if not p:
                    failures.append(s.deviation())
                handed.put(p)
            handed.put(None)

        def consumer(s=s, handed=handed, failures=failures):
            while (p := handed.get()) is not None:
                if not s.free(p):
                    failures.append(("free", p))
                own = s.malloc(4096)
                if not own or not s.free(own):
                    failures.append(("own", own, s.deviation()))

        threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events = s.drain()
        assert not failures and s.deviation()[0] == Deviation.NONE, (failures[:3], s.deviation())
        allocs = [e for e in events if e[0] == EV_ALLOC]
        assert len(allocs) == 2 * pairs and sum(e[0] == EV_FREE for e in events) == 2 * pairs
        assert [e[1] for e in allocs] == [k % n for k in range(2 * pairs)]  # one stream, in order
        assert sum(e[0] == EV_BOUNDARY for e in events) == (2 * pairs - 1) // n
        assert s.state()[2] == 0


def test_every_exported_c_function_is_declared_once_in_the_signature_table():
    """umrt.native.signatures is the one declaration of the C functions ctypes calls: each row
    names a function its source exports, and every export is there (but the shim's entry
    points, which torch calls through the addresses it is given, never ctypes)."""
    import re

    from umrt.native.build import native_source
    from umrt.native.signatures import SIGNATURES

    called_by_torch = {"umrt_alloc", "umrt_free", "umrt_record_stream"}
    for source, rows in SIGNATURES.items():
        text = native_source(source).read_text()
        exported = set(re.findall(r"^UMRT_EXPORT [^(]*?\b(umrt_\w+)\(", text, re.MULTILINE))
        assert set(rows) <= exported, (source, set(rows) - exported)
        assert exported - set(rows) == (called_by_torch if source == "torch_alloc_shim.cpp" else set()), source


def test_the_constants_python_shares_with_the_cpp_are_defined_once_in_python(lib):
    """steady_alloc.cpp includes the header generated from umrt.native.constants and defines
    none of them itself; the library built here holds Python's values (``lib``: the hash of
    the sizes, the counted kinds' order and the deviation codes, through the twin tests)."""
    from umrt.native.build import native_source
    from umrt.native.constants import CPP_HEADER, HASH_MASK, HASH_MUL, cpp_header

    source = native_source("steady_alloc.cpp").read_text()
    assert f'#include "{CPP_HEADER}"' in source
    for defined_in_python in (str(HASH_MUL), "enum Kind :", "enum Dev :", "enum Ev :", "kKinds =", '"prefetch"',
                              "kHashMul =", "kHashMask ="):
        assert defined_in_python not in source, defined_in_python
    header = cpp_header()
    assert f"kHashMul = {HASH_MUL}ULL" in header and f"kHashMask = {HASH_MASK}ULL" in header
    assert all(f"{k.name} = {int(k)}" in header for k in DecisionKind)
    assert all(f"DEV_{d.name} = {int(d)}" in header for d in Deviation)
    # The twins agree on the running hash: a size the schedule does not expect at the
    # same position but with the same running hash cannot exist, so HASH deviations
    # never happen there; the native one recomputes the hashes from the sizes itself.
    arrays = compile_schedule([AllocAt(MiB, 1 << 30), FreeAt(1 << 30), AllocAt(2 * MiB, 1 << 30)])
    for s in both(lib, arrays):
        s.set_table(LogTable())
        s.arm()
        assert s.malloc(MiB) == 1 << 30 and s.free(1 << 30) and s.malloc(2 * MiB) == 1 << 30
        assert s.deviation()[0] == Deviation.NONE


def test_the_cuda_table_struct_is_declared_once_in_python(lib):
    """struct umrt_cuda_table is CTable's ctypes fields, in order, as the header generated for
    the build declares them; steady_alloc.cpp includes it and declares no struct of its own
    (``lib``: the library built with it fills and runs the tables, through the twin tests)."""
    import ctypes
    import re

    from umrt.native.build import native_source
    from umrt.native.tables import TABLE_HEADER, CTable, c_table_header

    source = native_source("steady_alloc.cpp").read_text()
    assert f'#include "{TABLE_HEADER}"' in source
    assert not re.search(r"struct\s+umrt_cuda_table\s*\{", source)
    header = c_table_header()
    fields = header[header.index("struct umrt_cuda_table {\n"):header.index("\n};")].splitlines()[1:]
    assert len(fields) == len(CTable._fields_)
    for line, (name, ctype) in zip(fields, CTable._fields_, strict=True):  # each field, in order
        if issubclass(ctype, ctypes._CFuncPtr):  # a function pointer: int and as many arguments
            match = re.fullmatch(rf"  int \(\*{name}\)\((.*)\);", line)
            assert match and len(match[1].split(", ")) == max(1, len(ctype._argtypes_)), line
        else:
            assert line == f"  void* {name};", line
    assert "  int (*discard)(const uint64_t*, const uint64_t*, int64_t, void*);" in fields
    assert "  int (*clear_error)(void);" in fields


def test_the_steady_build_includes_both_generated_headers(monkeypatch):
    """The schedule's build writes the constants' header and the table's, so both texts are in
    its cache key (the build's name)."""
    from umrt.native.constants import CPP_HEADER, cpp_header
    from umrt.native.tables import TABLE_HEADER, c_table_header

    seen = {}
    monkeypatch.setattr(binding, "build_native", lambda *args, headers: seen.update(headers) or "built.so")
    assert binding.build_library() == "built.so"
    assert seen == {CPP_HEADER: cpp_header(), TABLE_HEADER: c_table_header()}


def test_the_build_is_keyed_by_its_generated_headers(monkeypatch, tmp_path):
    """Other constants, another library: the generated header's text is in the build's name,
    and the header is written where the build's include path points."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    from umrt.native import build

    if not cpp_extension.is_ninja_available():
        pytest.skip("no ninja")
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(kw) or "built.so")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for text in ("one", "one", "two"):
        assert build.build_native(build.native_source("steady_alloc.cpp"), "stem", "it",
                                  headers={"generated.h": text}) == "built.so"
    names = [kw["name"] for kw in seen]
    assert names[0] == names[1] != names[2]
    include = tmp_path / (names[2] + "_include")
    assert seen[2]["extra_include_paths"] == [str(include)] and (include / "generated.h").read_text() == "two"


def test_a_failed_build_falls_back_to_python_with_one_warning(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr(binding, "build_library", no_compiler)
    native_library.cache_clear()
    try:
        arrays, _ = small_schedule()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = load_steady(arrays), load_steady(arrays)
        assert isinstance(first, PythonSteadySchedule) and isinstance(second, PythonSteadySchedule)
        assert len(caught) == 1
        assert "could not build the native steady schedule" in str(caught[0].message)
        assert "g++: command not found" in str(caught[0].message)
        got, *_ = drive(first, LogTable())
        assert got[0] == list(small_schedule()[1])
        with pytest.raises(SteadyError, match="did not build"):
            counting_table()
    finally:
        native_library.cache_clear()


def test_native_rejects_inconsistent_arrays(lib):
    arrays, _ = small_schedule()
    arrays.alloc_begin[1] = 99
    with pytest.raises(SteadyError, match="rejected"):
        NativeSteadySchedule(lib, arrays)


def test_stream_handles_of_created_streams_reach_the_table(lib):
    arrays, (a, b, c) = small_schedule()
    gpu = FakeGpu()
    rt = FakeCupyRuntime(gpu)
    stream = rt.streamCreateWithFlags(STREAM_NON_BLOCKING)
    out = []
    for s in both(lib, arrays):
        table = LogTable()
        drive(s, table, iterations=1, stream=stream)
        out.append(table.calls)
    assert out[0] == out[1] and out[0][0] == ("prefetch", a, 100, 0, stream)


# -- CUDA-API-level decisions: exact streams and events --------------------------------
RE, WE = DecisionKind.RECORD_EVENT, DecisionKind.WAIT_EVENT


def test_exact_calls_compile_verbatim_in_order_with_their_streams_and_events():
    a = 1 << 30
    copy, side, ev = 0x7000, 0x7100, 0x9000
    rec = [AllocAt(MiB, a),
           CallAt(P, ((a, MiB),), 0, stream=copy, exact=True),
           CallAt(RE, (), stream=copy, event=ev, exact=True),
           CallAt(P, ((a + MiB, MiB),), 0, stream=copy, exact=True),  # touching: still not coalesced
           CallAt(P, ((a, 4096),), 0, stream=0, exact=True),  # the NULL stream: the caller's (a populate)
           CallAt(ADV, ((a, MiB),), 0, int(Advice.SET_ACCESSED_BY), exact=True),
           CallAt(P, ((a, MiB),), 0), CallAt(P, ((a + MiB, MiB),), 0),  # Backend level: merged as before
           CallAt(WE, (), stream=0, event=ev, exact=True),
           FreeAt(a),
           CallAt(D, ((a + 1000, MiB),), stream=side, exact=True),  # verbatim: not shrunk to pages
           CallAt(DP, ((a, 4096), (a + 8192, 4096)), 0, stream=side, exact=True)]
    arrays = compile_schedule(rec)
    assert arrays.decisions(0, arrays.alloc_begin[1]) == [
        (P, 0, 0, [(a, MiB)], copy, 0), (RE, 0, 0, [], copy, ev), (P, 0, 0, [(a + MiB, MiB)], copy, 0),
        (POP, 0, 0, [(a, 4096)], 0, 0), (ADV, 0, 5, [(a, MiB)], 0, 0), (P, 0, 0, [(a, 2 * MiB)], 0, 0),
        (WE, 0, 0, [], 0, ev)]
    assert arrays.decisions(arrays.free_begin[0], arrays.free_begin[1]) == [
        (D, 0, 0, [(a + 1000, MiB)], side, 0), (DP, 0, 0, [(a, 4096), (a + 8192, 4096)], side, 0)]


@pytest.mark.parametrize("name", ["malloc_managed", "free", "stream_synchronize", "create_event", "create_stream"])
def test_compile_refuses_an_iteration_that_made_an_unschedulable_call(name):
    with pytest.raises(SteadyError, match=f"called {name} \\(after allocation 0\\)"):
        compile_schedule([AllocAt(1, 1 << 30), Unschedulable(name), FreeAt(1 << 30)])


def test_twins_replay_exact_streams_and_events(lib):
    a, b = 1 << 30, (1 << 30) + MiB
    copy, side, ev1, ev2 = 0x7000, 0x7100, 0x9000, 0x9100
    rec = [AllocAt(MiB, a), CallAt(P, ((a, MiB),), 0, stream=copy, exact=True),
           CallAt(RE, (), stream=copy, event=ev1, exact=True), CallAt(WE, (), stream=0, event=ev1, exact=True),
           AllocAt(MiB, b), CallAt(P, ((b, MiB),), HOST, stream=0, exact=True),  # NULL stream: caller's
           FreeAt(a), CallAt(D, ((a, MiB),), stream=side, exact=True),
           CallAt(RE, (), stream=side, event=ev2, exact=True), CallAt(WE, (), stream=copy, event=ev2, exact=True),
           FreeAt(b), CallAt(DP, ((b, 4096), (b + 8192, 4096)), 0, exact=True)]  # stream 0: the table's
    arrays = compile_schedule(rec)
    out = []
    for s in both(lib, arrays):
        table = LogTable()
        table.copy_stream, table.discard_stream = 0x5500, 0x5600  # used only by stream-0 decisions
        s.set_table(table)
        s.arm(0, 0x4000)
        for _ in range(2):
            p, q = s.malloc(MiB, 0, 0x4000), s.malloc(MiB, 0, 0x4000)
            s.free(p, 0, 0, 0x4000)
            s.free(q, 0, 0, 0x4000)
        out.append((table.calls, s.deviation()))
    assert out[0] == out[1] and out[0][1][0] == Deviation.NONE
    assert out[0][0] == [
        ("prefetch", a, MiB, 0, copy), ("record_event", ev1, copy), ("wait_event", 0x4000, ev1),
        ("populate", b, MiB, HOST, 0x4000),
        ("discard", ((a, MiB),), side), ("record_event", ev2, side), ("wait_event", copy, ev2),
        ("discard_prefetch", ((b, 4096), (b + 8192, 4096)), 0, 0x5600)] * 2


def test_a_failed_or_missing_event_call_disarms_both_alike(lib):
    a = 1 << 30
    rec = [AllocAt(MiB, a), CallAt(RE, (), stream=0x7000, event=0x9000, exact=True), FreeAt(a),
           CallAt(D, ((a, MiB), (a + 2 * MiB, MiB)), stream=0x7100, exact=True)]
    arrays = compile_schedule(rec)
    out = []
    for s in both(lib, arrays):
        s.set_table(LogTable(fail={"record_event"}))
        s.arm()
        r = [s.malloc(MiB), s.deviation()]
        s.free(a)
        s.set_table(LogTable(lacks={"discard"}))
        s.arm()
        r += [s.free(s.malloc(MiB)), s.deviation()]
        s.set_table(LogTable(fail={"discard"}))
        s.arm()
        r += [s.free(s.malloc(MiB)), s.deviation()]
        out.append(r)
    assert out[0] == out[1]
    r = out[0]
    assert r[0] == a and r[1] == (Deviation.CALL, 0, "allocation of allocation 0: record_event(event 0x9000, "
                                  "stream 0x7000) failed with CUDA error 7")
    assert r[2] is True and r[3] == (Deviation.NO_TABLE, 0, "free of allocation 0: the CUDA table has no discard")
    assert r[5] == (Deviation.CALL, 0, f"free of allocation 0: discard(2 ranges from {a:#x}) failed with CUDA error 7")


def test_recording_api_logs_exact_calls_and_forwards_them(fake_gpu):
    log = []
    inner = BindingsApi(FakeBindingsRuntime(fake_gpu))
    api = RecordingApi(inner, log)
    assert api.version == inner.version and api.has_batch
    ptr = api.malloc_managed(4 * MiB)
    stream, event = api.create_stream(False), api.create_event()
    api.prefetch(ptr, MiB, 0, stream)
    api.advise(ptr, MiB, Advice.SET_READ_MOSTLY, HOST)
    api.record_event(event, stream)
    api.stream_wait_event(0, event)
    api.discard_batch([(ptr, MiB)], stream)
    api.discard_and_prefetch_batch([(ptr, MiB), (ptr + 2 * MiB, MiB)], 0, stream)
    api.stream_synchronize(stream)
    api.free(ptr)
    U = Unschedulable
    assert log == [U("malloc_managed"), U("create_stream"), U("create_event"),
                   CallAt(P, ((ptr, MiB),), 0, stream=stream, exact=True),
                   CallAt(ADV, ((ptr, MiB),), HOST, int(Advice.SET_READ_MOSTLY), exact=True),
                   CallAt(RE, (), stream=stream, event=event, exact=True),
                   CallAt(WE, (), stream=0, event=event, exact=True),
                   CallAt(D, ((ptr, MiB),), stream=stream, exact=True),
                   CallAt(DP, ((ptr, MiB), (ptr + 2 * MiB, MiB)), 0, stream=stream, exact=True),
                   U("stream_synchronize"), U("free")]
    names = fake_gpu.names()
    for call in ("cudaMallocManaged", "cudaMemPrefetchAsync", "cudaMemAdvise", "cudaEventRecord",
                 "cudaStreamWaitEvent", "cudaMemDiscardBatchAsync", "cudaMemDiscardAndPrefetchBatchAsync",
                 "cudaStreamSynchronize", "cudaFree"):
        assert call in names


def _alternate_discard_events(monkeypatch):
    """CudaBackend as it was before its event handles were made to repeat: spare events
    handed out last-in first-out and a spare event per discard (the old one back to the
    spares), so handles alternate between two iterations (a backend whose calls repeat
    only every second iteration)."""
    from umrt.backends import cuda_order

    def event(self):
        lifo = self.__dict__.setdefault("lifo", [])
        return lifo.pop() if lifo else self._call("cudaEventCreateWithFlags", self.api.create_event)

    def spare(self, *events):
        self.__dict__.setdefault("lifo", []).extend(events)

    def discarded(self, stream, ranges):
        event = self.event()
        self.record(event, stream)
        old = self._discard_events.pop(cuda_order.stream_key(stream), None)
        if old is not None:
            self._spare(old)
        self._discard_events[cuda_order.stream_key(stream)] = event
        self._discarded.extend(ranges)

    monkeypatch.setattr(cuda_order.StreamOrder, "event", event)
    monkeypatch.setattr(cuda_order.StreamOrder, "_spare", spare)
    monkeypatch.setattr(cuda_order.StreamOrder, "discarded", discarded)


def _serve_rounds(s, gpu, expected) -> None:
    """Arm ``s`` and serve the recorded loop (two 4 MiB blocks, freed) once per entry of
    ``expected``: the runtime calls each round makes must be that entry."""
    s.arm(0, 0)
    for want in expected:
        start = len(gpu.calls)
        p, q = s.malloc(4 * MiB), s.malloc(4 * MiB)
        s.free(p)
        s.free(q)
        assert [tuple(plain(x) for x in c) for c in gpu.calls[start:]] == want


def test_a_discarding_cuda_backend_repeats_its_calls_every_iteration(lib, fake_gpu):
    """CudaBackend re-records its discard stream's event in place, so an iteration with a
    discard makes the same calls with the same handles every time (period 1), and one
    recorded iteration replays race-free."""
    backend, iterations = _record_backend_iterations(fake_gpu, discard_and_prefetch=False)
    logs = [log for log, _ in iterations]
    assert repeat_period(logs) == 1
    (previous, _), (log, recorded) = iterations[-2:]
    arrays = compile_schedule(log, previous=previous)
    expected = [tuple(plain(x) for x in c) for c in recorded]
    for s in both(lib, arrays):
        s.set_table(ApiTable(backend.api.api))
        _serve_rounds(s, fake_gpu, [expected, expected])
    assert not fake_gpu.violations


def _record_backend_iterations(gpu, discard_and_prefetch, iterations=5):
    """CudaBackend over the fake CUDA 13 runtime, its api wrapped in RecordingApi, runs a
    small training-like loop: a prefetch to the GPU on the copy stream and a kernel that
    waits for it, a populate, at the first block's free a discard (or discard-and-
    prefetch) on the legacy compute stream's blocking discard stream, an eviction.
    Returns the backend and, per iteration, its log and the runtime calls it made."""
    rec = SteadyRecorder()
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(gpu)))
    backend.api = rec.wrap_api(backend.api)
    backend.order.api = backend.api
    seg = backend.malloc(16 * MiB)
    x, y = seg, seg + 4 * MiB
    rec.take()
    out = []
    for _ in range(iterations):
        start = len(gpu.calls)
        rec.on_pool_event("alloc", x, 4 * MiB)
        backend.prefetch([(x, 4 * MiB)], 0)
        backend.launch([(x, 4 * MiB)], [])
        rec.on_pool_event("alloc", y, 4 * MiB)
        backend.populate([(y, 4 * MiB)])
        backend.launch([(y, MiB)], [(y, MiB)])
        rec.on_pool_event("free", x, 0)
        if discard_and_prefetch:
            backend.discard_and_prefetch([(x, 4 * MiB)], 0)
        else:
            backend.discard([(x, 4 * MiB)])
        backend.prefetch([(y, 4 * MiB)], HOST)
        rec.on_pool_event("free", y, 0)
        out.append((rec.take(), gpu.calls[start:]))
    return backend, out


def test_a_recorded_cuda_backend_iteration_replays_the_same_runtime_calls(lib, fake_gpu):
    """The issue's point: the schedule replays CudaBackend's own calls (copy-stream
    prefetches, the events ordering them with the kernels and the discard stream, the
    discard-and-prefetch) with the same handles, so the fake runtime sees the same calls
    again, from both twins, and its stream-ordering rules hold."""
    backend, iterations = _record_backend_iterations(fake_gpu, discard_and_prefetch=True)
    (previous, _), (log, recorded) = iterations[-2:]
    assert {"cudaEventRecord", "cudaStreamWaitEvent", "cudaMemDiscardAndPrefetchBatchAsync"} <= {
        c[0] for c in recorded}
    arrays = compile_schedule(log, previous=previous)
    expected = [tuple(plain(x) for x in c) for c in recorded]
    for s in both(lib, arrays):
        s.set_table(ApiTable(backend.api.api))
        _serve_rounds(s, fake_gpu, [expected, expected])
        assert s.deviation() == (Deviation.NONE, -1, "")
    assert not fake_gpu.violations


def test_compile_refuses_an_iteration_whose_event_handles_do_not_repeat(lib, fake_gpu, monkeypatch):
    """Where a backend's events alternate between two handles from one iteration to the
    next, one iteration's calls replayed again would make the compute stream wait on the
    discard's event, not the eviction's. ``previous`` catches it; the fake runtime shows
    the race a replay would cause."""
    _alternate_discard_events(monkeypatch)
    backend, iterations = _record_backend_iterations(fake_gpu, discard_and_prefetch=False)
    (previous, _), (log, _) = iterations[-2:]
    with pytest.raises(SteadyError, match="differ from the previous iteration's at call 1 .*do not repeat"):
        compile_schedule(log, previous=previous)
    s = PythonSteadySchedule(compile_schedule(log))
    s.set_table(ApiTable(backend.api.api))
    s.arm(0, 0)
    with pytest.raises(Exception, match="migration-race"):
        for _ in range(2):
            p, q = s.malloc(4 * MiB), s.malloc(4 * MiB)
            s.free(p)
            s.free(q)


def test_calls_after_the_last_event_open_the_next_iteration():
    a = 1 << 30
    rec = [CallAt(RE, (), stream=1, event=5, exact=True), AllocAt(MiB, a), CallAt(WE, (), event=5, exact=True),
           FreeAt(a + 1), CallAt(P, ((a, MiB),), 0, stream=7, exact=True)]  # a free of a block from before
    arrays = compile_schedule(rec)
    assert [d[0] for d in arrays.decisions(0, arrays.alloc_begin[1])] == [P, RE, WE]


# -- ownership hand-over ---------------------------------------------------------------
def test_adopt_hands_survivors_to_the_schedule_and_disown_hands_everything_back(lib):
    arrays, (a, b, _) = small_schedule()
    c = a + (4 << 20)  # allocation 2's block from an earlier iteration, outside a's discard (1 MiB from a)
    out = []
    for s in both(lib, arrays):
        table = LogTable()
        s.set_table(table)
        s.adopt([(a, 0), (c, 2)])  # live from the recorded iteration: a (+100) and c (+300)
        s.arm()
        r = [s.free(a), s.drain(), list(table.calls), s.state()]
        r.append(s.malloc(100))  # a is free again: served
        p1 = s.malloc(200)
        r += [p1, s.disown(), s.armed, s.deviation(), s.free(p1), s.free(c), s.drain(), s.state()]
        r.append(s.disown())  # disarmed already: nothing live, the deviation kept
        r.append(s.deviation())
        out.append(r)
    assert out[0] == out[1]
    r = out[0]
    assert r[0] is True and r[1] == [(EV_FREE, 0, a, 100)]
    assert r[2] == [("discard", ((a, 1 << 20),), 0)]  # allocation 0's free decision ran
    assert r[3] == (0, 0, 1, 0)
    assert r[4] == a and r[5] == b
    assert r[6] == [(a, 100, 0), (b, 200, 1), (c, 300, 2)]  # ascending, sizes from the schedule
    assert r[7] is False and r[8] == (Deviation.STOPPED, 2, "stopped by Python")
    assert r[9] is False and r[10] is False  # the caller frees them now
    assert r[11] == [(EV_ALLOC, 0, a, 100), (EV_ALLOC, 1, b, 200)]  # buffered events stay drainable
    assert r[12] == (2, 0, 0, 0) and r[13] == [] and r[14] == r[8]


def test_adopt_rejects_a_bad_ordinal_or_an_overlap_identically_and_adopts_nothing(lib):
    arrays, (a, b, c) = small_schedule()
    out = []
    for s in both(lib, arrays):
        s.arm()
        s.malloc(100)  # a is live
        r = []
        for blocks in ([(c, 2), (b, 3)], [(c, 2), (b, -1)], [(c, 2), (a + 50, 1)], [(b, 1), (b + 100, 2)]):
            with pytest.raises(SteadyError) as caught:
                s.adopt(blocks)
            r.append(str(caught.value))
        r.append(s.state())
        out.append(r)
    assert out[0] == out[1]
    assert out[0][0] == f"adopt: block 1 at {b:#x}: allocation 3 is not in the schedule (0..2)"
    assert out[0][1] == f"adopt: block 1 at {b:#x}: allocation -1 is not in the schedule (0..2)"
    assert out[0][2] == f"adopt: block 1 at {a + 50:#x} (+200, allocation 1) overlaps a live block"
    assert out[0][3] == f"adopt: block 1 at {b + 100:#x} (+300, allocation 2) overlaps a live block"
    assert out[0][4][2] == 1  # only a: nothing was adopted


def test_native_disown_of_more_blocks_than_its_first_buffer(lib):
    n = 40
    arrays = compile_schedule([AllocAt(4096, (1 << 30) + i * 8192) for i in range(n)])
    s = NativeSteadySchedule(lib, arrays)
    s.adopt([((1 << 30) + i * 8192, i) for i in range(n)])
    assert s.disown() == [((1 << 30) + i * 8192, 4096, i) for i in range(n)]
    assert s.deviation()[0] == Deviation.NONE  # never armed: nothing to stop


# -- C tables --------------------------------------------------------------------------
def test_the_counting_table_counts_each_kind_from_both_twins(lib):
    a, b = 1 << 30, (1 << 30) + MiB
    rec = [AllocAt(MiB, a), CallAt(P, ((a, MiB), (b, 4096)), 0, stream=0x7000, exact=True),
           CallAt(RE, (), stream=0x7000, event=0x9000, exact=True), CallAt(WE, (), event=0x9000, exact=True),
           CallAt(ADV, ((a, MiB),), 0, 3, exact=True), AllocAt(MiB, b), CallAt(POP, ((b, MiB),), 0),
           FreeAt(a), CallAt(D, ((a, MiB), (b, MiB)), stream=0x7100, exact=True),
           FreeAt(b), CallAt(DP, ((b, MiB),), 0, stream=0x7100, exact=True)]
    arrays = compile_schedule(rec)
    for s in both(lib, arrays):
        reset_counted()
        s.set_c_table(counting_table())
        s.arm()
        for _ in range(3):
            p, q = s.malloc(MiB), s.malloc(MiB)
            s.free(p)
            s.free(q)
        assert s.deviation()[0] == Deviation.NONE
        assert counted() == {"prefetch": 6, "discard": 3, "discard_prefetch": 3, "populate": 3,
                                    "advise": 3, "record_event": 3, "wait_event": 3}


def _build_fake_cudart(tmp_path, variant, *defines):
    import shutil
    import subprocess
    from pathlib import Path

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcudart")
    out = tmp_path / f"libfake_cudart_{variant}.so"
    source = Path(__file__).with_name("fake_cudart.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", *defines, str(source), "-o", str(out)], check=True,
                   capture_output=True)
    return out


class FakeCudart:
    """The fake libcudart, opened by path (the table's dlopen finds the same library)."""

    def __init__(self, path):
        import ctypes

        self.path = str(path)
        self.lib = ctypes.CDLL(self.path)
        self.lib.fake_cudart_take.restype = ctypes.c_size_t
        self.lib.fake_cudart_take.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.lib.fake_cudart_fail.argtypes = [ctypes.c_int]
        self._buf = ctypes.create_string_buffer(1 << 16)

    def take(self):
        self.lib.fake_cudart_take(self._buf, len(self._buf))
        return self._buf.value.decode().splitlines()


@pytest.fixture(scope="module")
def fake_cudarts(lib, tmp_path_factory):
    d = tmp_path_factory.mktemp("cudart")
    return {"13": FakeCudart(_build_fake_cudart(d, "13", "-DFAKE_VERSION=13000")),
            "12v2": FakeCudart(_build_fake_cudart(d, "12v2", "-DFAKE_VERSION=12080", "-DFAKE_V2")),
            "12": FakeCudart(_build_fake_cudart(d, "12", "-DFAKE_VERSION=12010"))}


def _every_kind_schedule():
    a = 1 << 30
    rec = [AllocAt(MiB, a), CallAt(P, ((a, MiB),), HOST, stream=0x7000, exact=True),
           CallAt(POP, ((a, 4096),), 1), CallAt(ADV, ((a, MiB),), HOST, 3, exact=True),
           CallAt(ADV, ((a, MiB),), 2, 5, exact=True),
           CallAt(RE, (), stream=0x7000, event=0x9000, exact=True), CallAt(WE, (), stream=0, event=0x9000, exact=True),
           FreeAt(a), CallAt(D, ((a, 65536), (a + 131072, 65536)), stream=0x7100, exact=True),
           CallAt(DP, ((a, 65536),), HOST, stream=0x7100, exact=True), CallAt(DP, ((a, 65536),), 3, exact=True)]
    return compile_schedule(rec), a


def test_the_cudart_table_passes_cuda13_arguments_exactly(lib, fake_cudarts):
    """Both twins, through the C adapters over a fake CUDA 13 libcudart: the location
    (type 1 = device with its id, type 2 = host with id 0), flags 0, counts, one location
    at index 0 for discard-and-prefetch, the streams and events as passed."""
    fake = fake_cudarts["13"]
    arrays, a = _every_kind_schedule()
    logs = []
    for s in both(lib, arrays):
        table = cudart_table(fake.path, discard_stream=0x5600)
        assert table.version == 13000
        s.set_c_table(table)
        fake.take()
        s.arm(0, 0x4000)
        s.free(s.malloc(MiB, 0, 0x4000), 0, 0, 0x4000)
        assert s.deviation()[0] == Deviation.NONE
        logs.append(fake.take())
    assert logs[0] == logs[1]
    assert logs[0] == [
        f"cudaMemPrefetchAsync {a:#x} {MiB} loc=2:0 flags=0 stream=0x7000",
        f"cudaMemPrefetchAsync {a:#x} 4096 loc=1:1 flags=0 stream=0x4000",
        f"cudaMemAdvise {a:#x} {MiB} advice=3 loc=2:0",
        f"cudaMemAdvise {a:#x} {MiB} advice=5 loc=1:2",
        "cudaEventRecord event=0x9000 stream=0x7000",
        "cudaStreamWaitEvent stream=0x4000 event=0x9000 flags=0",
        f"cudaMemDiscardBatchAsync count=2 flags=0 stream=0x7100 ranges= {a:#x}+65536 {a + 131072:#x}+65536",
        f"cudaMemDiscardAndPrefetchBatchAsync count=1 locs=1 loc=2:0@0 flags=0 stream=0x7100 ranges= {a:#x}+65536",
        f"cudaMemDiscardAndPrefetchBatchAsync count=1 locs=1 loc=1:3@0 flags=0 stream=0x5600 ranges= {a:#x}+65536",
    ]


@pytest.mark.parametrize("variant, prefetch, advise", [
    ("12v2", "cudaMemPrefetchAsync_v2 {a:#x} 1048576 loc=2:0 flags=0 stream=0x7000",
     "cudaMemAdvise_v2 {a:#x} 1048576 advice=3 loc=2:0"),
    ("12", "cudaMemPrefetchAsync(device) {a:#x} 1048576 device=-1 stream=0x7000",
     "cudaMemAdvise(device) {a:#x} 1048576 advice=3 device=-1"),
])
def test_the_cudart_table_on_cuda12_has_no_discards(lib, fake_cudarts, variant, prefetch, advise):
    """CUDA 12: the _v2 location shapes where the runtime has them (12.2+), else the
    device-id shapes with -1 for the host (as CupyApi); the batch discards are left out,
    so a due discard disarms both twins alike, after the calls before it."""
    fake = fake_cudarts[variant]
    arrays, a = _every_kind_schedule()
    out = []
    for s in both(lib, arrays):
        table = cudart_table(fake.path)
        assert table.version < 13000 and not table.discard and not table.discard_prefetch
        s.set_c_table(table)
        fake.take()
        s.arm(0, 0x4000)
        s.free(s.malloc(MiB, 0, 0x4000), 0, 0, 0x4000)
        out.append((fake.take(), s.deviation()))
    assert out[0] == out[1]
    log, dev = out[0]
    assert log[0] == prefetch.format(a=a) and log[2] == advise.format(a=a) and len(log) == 6
    assert dev == (Deviation.NO_TABLE, 0, "free of allocation 0: the CUDA table has no discard")


def test_a_cudart_error_code_reaches_the_deviation(lib, fake_cudarts):
    fake = fake_cudarts["13"]
    arrays, a = _every_kind_schedule()
    out = []
    for s in both(lib, arrays):
        s.set_c_table(cudart_table(fake.path))
        s.arm(0, 0x4000)
        fake.lib.fake_cudart_fail(2)
        try:
            out.append((s.malloc(MiB, 0, 0x4000), s.deviation()))
        finally:
            fake.lib.fake_cudart_fail(0)
    assert out[0] == out[1] == (a, (Deviation.CALL, 0, f"allocation of allocation 0: prefetch({a:#x}, {MiB}) "
                                                       "failed with CUDA error 2"))


def test_a_failed_native_call_leaves_no_last_error_for_torch(lib, fake_cudarts):
    """Finding 3: a decision that fails through the libcudart table sets that runtime's
    per-thread last error (the fake keeps it as CUDA does); torch checks it after its next
    kernel launch (cudaGetLastError) and would raise "CUDA error" in an unrelated op. Both
    twins clear it (cudaGetLastError) before falling back, on the thread that failed."""
    fake = fake_cudarts["13"]
    arrays, a = _every_kind_schedule()
    for s in both(lib, arrays):
        s.set_c_table(cudart_table(fake.path))
        s.arm(0, 0x4000)
        fake.lib.fake_cudart_fail(2)
        try:
            assert s.malloc(MiB, 0, 0x4000) == a and s.deviation()[0] == Deviation.CALL
        finally:
            fake.lib.fake_cudart_fail(0)
        assert fake.lib.cudaPeekAtLastError() == 0, type(s).__name__  # torch's next launch check: no error
        assert s.malloc(MiB, 0, 0x4000) == 0  # disarmed: the next allocation goes to Python


def test_cudart_table_errors_are_clear(lib, tmp_path):
    with pytest.raises(SteadyError, match="dlopen.*nowhere.so"):
        cudart_table(str(tmp_path / "nowhere.so"))
    not_cudart = _build_fake_cudart(tmp_path, "none", "-DFAKE_VERSION=13000", "-DcudaRuntimeGetVersion=other_name")
    with pytest.raises(SteadyError, match="cudaRuntimeGetVersion is missing"):
        cudart_table(str(not_cudart))


def test_loaded_libcudart_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    line = "7f00-7f10 r-xp 00000000 08:01 123 {}\n"
    maps.write_text(line.format("/usr/lib/libc.so.6") + line.format("/opt/torch/lib/libcudart.so.13")
                    + line.format("/opt/torch/lib/libcudart.so.13"))
    assert loaded_libcudart(str(maps)) == ("/opt/torch/lib/libcudart.so.13", f"loaded by this process ({maps})")
    maps.write_text(line.format("/usr/lib/libc.so.6") + line.format("/usr/lib/libcudart_static_fake.a"))
    path, why = loaded_libcudart(str(maps))
    assert path is None and "no libcudart.so" in why
    path, why = loaded_libcudart(str(tmp_path / "missing"))
    assert path is None and "cannot read" in why


def test_loaded_libcudart_takes_the_copy_torch_uses_not_the_first_by_name(tmp_path):
    """Finding 6: with several libcudart copies loaded (CuPy's, another CUDA version's:
    separate runtime instances), the one torch's libc10_cuda.so resolves cudaGetLastError
    to, whatever the names sort as. A copy nobody vouches for is not guessed."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libraries")
    source = Path(__file__).with_name("fake_cudart.c")
    other, torchs = tmp_path / "a", tmp_path / "b"  # "a/..." sorts first: not torch's
    for d, version in ((other, "12"), (torchs, "13")):
        d.mkdir()
        subprocess.run([cc, "-shared", "-fPIC", f"-DFAKE_VERSION={version}000", str(source), "-o",
                        str(d / f"libcudart.so.{version}")], check=True, capture_output=True)
    user = tmp_path / "c" / "libc10_cuda.so"
    user.parent.mkdir()
    (tmp_path / "c10.c").write_text("int cudaGetLastError(void);\nint c10_check(void) { return cudaGetLastError(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", str(tmp_path / "c10.c"), "-o", str(user), "-Wl,--no-as-needed",
                    f"-L{torchs}", "-l:libcudart.so.13", f"-Wl,-rpath,{torchs}"], check=True, capture_output=True)
    keep = [ctypes.CDLL(str(other / "libcudart.so.12")), ctypes.CDLL(str(user))]  # both loaded now
    path, why = loaded_libcudart()
    assert path == str(torchs / "libcudart.so.13") and "libc10_cuda.so" in why, (path, why)
    maps = tmp_path / "maps"
    line = "7f00-7f10 r-xp 00000000 08:01 123 {}\n"
    maps.write_text(line.format(other / "libcudart.so.12") + line.format(tmp_path / "x" / "libcudart.so.13"))
    path, why = loaded_libcudart(str(maps))
    assert path is None and "none is known to be torch's" in why
    del keep


def test_the_real_libcudart_has_every_entry_point_the_table_names(lib):
    """The CUDA 13 runtime installed here (no GPU needed: only cudaRuntimeGetVersion is
    called): every symbol the adapters look up exists under that name."""
    import glob

    found = sorted(glob.glob("/usr/local/cuda/lib64/libcudart.so.1[3-9]*"))
    if not found:
        pytest.skip("no CUDA 13 libcudart in /usr/local/cuda/lib64")
    table = cudart_table(found[0])
    assert table.version >= 13000
    assert all(bool(getattr(table, name)) for name in (*CALL_NAMES.values(), "clear_error"))
    assert not table.copy_stream and not table.discard_stream


# -- cycles: CUDA handles that repeat every few iterations -----------------------------
def test_a_cycle_of_iterations_replays_handles_that_repeat_every_second_iteration(lib, fake_gpu, monkeypatch):
    """Events alternating between two handles: the period is two iterations, compiled as
    one cycle; both twins replay both iterations' calls in turn (the fake runtime sees
    them again, race-free), with a boundary per iteration."""
    _alternate_discard_events(monkeypatch)
    backend, iterations = _record_backend_iterations(fake_gpu, discard_and_prefetch=False, iterations=6)
    logs = [log for log, _ in iterations]
    assert repeat_period(logs[:3]) is None and repeat_period(logs) == 2
    arrays = compile_steady(logs)
    assert arrays.iteration_starts == [0, 2] and len(arrays.sizes) == 4
    expected = [[tuple(plain(x) for x in c) for c in calls] for _, calls in iterations[-2:]]
    out = []
    for s in both(lib, arrays):
        s.set_table(ApiTable(backend.api.api))
        _serve_rounds(s, fake_gpu, [expected[k % 2] for k in range(4)])
        out.append((s.drain(), s.deviation(), s.state()))
    assert out[0] == out[1] and out[0][1][0] == Deviation.NONE and out[0][2] == (4, 3, 0, 0)
    assert [e[1] for e in out[0][0] if e[0] == EV_BOUNDARY] == [1, 2, 3]
    assert not fake_gpu.violations


def test_compile_steady_and_cycle_refuse_what_does_not_repeat():
    a = 1 << 30
    one = [AllocAt(MiB, a), CallAt(RE, (), stream=1, event=5, exact=True), FreeAt(a)]
    other = [AllocAt(MiB, a), CallAt(RE, (), stream=1, event=6, exact=True), FreeAt(a)]
    with pytest.raises(SteadyError, match="do not repeat with a period of at most 2"):
        compile_steady([one, other, one, one, other], max_period=2)
    assert compile_steady([one, other, one, other]).iteration_starts == [0, 1]
    assert compile_steady([other, one, one]).iteration_starts == [0]
    with pytest.raises(SteadyError, match="iteration 1 of the cycle has no allocation"):
        compile_cycle([one, [CallAt(RE, (), stream=1, event=5, exact=True)]])
    with pytest.raises(SteadyError, match="iteration starts"):
        PythonSteadySchedule(ScheduleArrays([1, 1], [0, 8], [0, 0, 0], [0, 0, 0], iteration_starts=[0, 2]))


def test_twins_restart_the_hash_at_each_iteration_of_a_cycle(lib):
    a, b = 1 << 30, (1 << 30) + MiB
    arrays = compile_cycle([[AllocAt(MiB, a), FreeAt(a)], [AllocAt(2 * MiB, b), FreeAt(b)]])
    out = []
    for s in both(lib, arrays):
        s.arm()
        got = []
        for _ in range(2):
            got += [s.malloc(MiB), s.free(a), s.malloc(2 * MiB), s.free(b)]
        got.append(s.malloc(2 * MiB))  # the cycle expects its first iteration again
        out.append((got, s.drain(), s.deviation()))
    assert out[0] == out[1]
    got, events, dev = out[0]
    assert got == [a, True, b, True] * 2 + [0]
    assert [e for e in events if e[0] == EV_BOUNDARY] == [(EV_BOUNDARY, k, 0, 0) for k in (1, 2, 3)]
    assert dev == (Deviation.SIZE, 0, f"allocation 0: {2 * MiB} bytes, the schedule expects {MiB}")


def test_native_create_rejects_bad_iteration_starts_itself(lib, monkeypatch):
    import dataclasses

    arrays = compile_cycle([[AllocAt(MiB, 1 << 30)], [AllocAt(MiB, 1 << 31)]])
    monkeypatch.setattr(ScheduleArrays, "check", lambda arrays, capacity: None)  # reach the C validation
    for starts in ([0, 5], [1], [0, 1, 1]):
        with pytest.raises(SteadyError, match="rejected"):
            NativeSteadySchedule(lib, dataclasses.replace(arrays, iteration_starts=starts))
    assert NativeSteadySchedule(lib, arrays).a.iteration_starts == [0, 1]


def test_a_decision_touching_a_block_live_now_but_dead_when_recorded_deviates_before_any_call(lib):
    """Finding 1, both twins: the recorded window discards a and b at b's free, evicts a
    while it is live (allowed: live there too) and populates c at its allocation. A step
    that frees b before a must deviate (TOUCH) at b's free, with no call made there; one
    whose discard would land on a block at an allocation declines that allocation."""
    a, b, c = 1 << 30, (1 << 30) + 2 * MiB, (1 << 30) + 4 * MiB
    rec = [AllocAt(MiB, a), AllocAt(MiB, b), CallAt(P, ((a, MiB),), HOST), FreeAt(a), FreeAt(b),
           CallAt(D, ((a, 3 * MiB),)), AllocAt(MiB, c), CallAt(POP, ((c, MiB),), 0), FreeAt(c)]
    arrays = compile_schedule(rec)
    out = []
    for s in both(lib, arrays):
        table = LogTable()
        s.set_table(table)
        s.arm()
        r = [s.malloc(MiB), s.malloc(MiB), s.free(a), s.free(b), s.malloc(MiB), s.free(c), list(table.calls)]
        table.calls.clear()
        s.arm()
        r += [s.malloc(MiB), s.malloc(MiB), s.free(b), s.armed, s.deviation(), list(table.calls), s.free(a),
              s.malloc(MiB)]
        out.append(r)
    assert out[0] == out[1]
    r = out[0]
    assert r[:6] == [a, b, True, True, c, True]
    assert r[6] == [("prefetch", a, MiB, HOST, 0), ("discard", ((a, 3 * MiB),), 0), ("populate", c, MiB, 0, 0)]
    assert r[7:10] == [a, b, True] and r[10] is False
    assert r[11] == (Deviation.TOUCH, 1, f"free of allocation 1: its discard of ({a:#x}, {3 * MiB}) would touch live "
                     f"block {a:#x} of allocation 0, dead at that point of the recorded window")
    assert r[12] == [("prefetch", a, MiB, HOST, 0)] and r[13] is True and r[14] == 0  # no discard; then Python

    # At an allocation: the discard is keyed to c's allocation; a still live there declines c.
    rec = [AllocAt(MiB, a), FreeAt(a), AllocAt(MiB, c), CallAt(D, ((a, MiB),)), FreeAt(c)]
    out = []
    for s in both(lib, compile_schedule(rec)):
        table = LogTable()
        s.set_table(table)
        s.arm()
        out.append([s.malloc(MiB), s.malloc(MiB), s.deviation()[:2], s.state()[:3], table.calls])
    assert out[0] == out[1] == [a, 0, (Deviation.TOUCH, 1), (1, 0, 1), []]


def test_calls_after_a_module_boundary_replay_at_the_next_pool_event_never_before_it():
    """Finding 5: a Mark (a module boundary: kernels may have run since the last pool
    event) sends the calls after it to the next allocation or free, before that one's own
    calls; calls at the window's end after a Mark would replay after the optimizer step's
    kernels: the compiler refuses; a block living across the step is freed at its ordinal."""
    a, b, c = 1 << 30, (1 << 30) + 2 * MiB, (1 << 30) + 4 * MiB
    evict = CallAt(P, ((a, MiB),), HOST, stream=7, exact=True)
    advise = CallAt(ADV, ((a, MiB),), HOST, 3, exact=True)
    own = CallAt(POP, ((b, MiB),), 0, exact=True)
    rec = [FreeAt(c), CallAt(D, ((c, MiB),), stream=9, exact=True),  # c: allocated in the previous step
           AllocAt(MiB, a), Mark(), evict, advise, AllocAt(MiB, b), own, FreeAt(b), Mark(),
           CallAt(P, ((a, MiB),), 0, stream=7, exact=True), FreeAt(a), AllocAt(MiB, c)]
    arrays = compile_schedule(rec)
    at = {name: [d[0] for d in arrays.decisions(begins[i], begins[i + 1])]
          for name, begins, i in (("alloc a", arrays.alloc_begin, 0), ("alloc b", arrays.alloc_begin, 1),
                                  ("free a", arrays.free_begin, 0), ("free c", arrays.free_begin, 2))}
    assert at == {"alloc a": [], "alloc b": [P, ADV, POP], "free a": [P], "free c": [D]}
    with pytest.raises(SteadyError, match="after the optimizer step's kernels"):
        compile_schedule([AllocAt(MiB, a), FreeAt(a), Mark(), CallAt(P, ((b, MiB),), HOST, stream=7,
                                                                             exact=True)])


def test_a_free_from_inside_a_decisions_call_is_deferred_not_deadlocked(lib):
    """Finding 6: a table call that frees a block of the same schedule (Python's garbage
    collector releasing a tensor inside a callback of a Python table) re-entered the
    schedule on the thread that holds its lock: a non-recursive lock, a deadlock. Both
    twins serve such a free once the decisions ran; an allocation from there is declined."""
    a, b = 1 << 30, (1 << 30) + 2 * MiB
    arrays = compile_schedule([AllocAt(MiB, a), AllocAt(MiB, b), CallAt(P, ((b, MiB),), 0), FreeAt(a), FreeAt(b)])
    for s in both(lib, arrays):
        inner = []

        class GcTable(LogTable):
            def prefetch(self, p, n, device, stream, s=s, inner=inner):
                inner.append(s.free(a))  # the collector frees a's tensor here
                inner.append(s.malloc(64))  # and something allocates
                return super().prefetch(p, n, device, stream)

        s.set_table(GcTable())
        s.arm()
        out = []
        worker = threading.Thread(target=lambda s=s, out=out: out.append((s.malloc(MiB), s.malloc(MiB))),
                                  daemon=True)
        worker.start()
        worker.join(20)
        assert not worker.is_alive(), f"{type(s).__name__} deadlocked"
        assert out == [(a, b)] and inner == [True, 0]
        assert s.drain() == [(EV_ALLOC, 0, a, MiB), (EV_ALLOC, 1, b, MiB), (EV_FREE, 0, a, MiB)]
        assert s.deviation()[0] == Deviation.REENTERED and not s.free(a) and s.free(b)


def test_a_schedule_whose_table_lacks_a_call_says_so_before_arming(lib, fake_cudarts):
    """Finding 6: over torch's CUDA 12 libcudart the table has no batched discard; a
    schedule recorded with discards (umrt's own calls on CUDA 13) would disarm at its
    first discard every time it is armed. Both twins name what is missing."""
    a = 1 << 30
    arrays = compile_schedule([AllocAt(MiB, a), FreeAt(a), CallAt(D, ((a, MiB),), stream=7, exact=True)])
    for s in both(lib, arrays):
        s.set_c_table(cudart_table(fake_cudarts["12"].path))
        assert s.missing_calls() == ["discard"]
        s.set_c_table(cudart_table(fake_cudarts["13"].path))
        assert s.missing_calls() == []


def test_a_server_never_arms_a_schedule_its_runtime_cannot_replay(lib, fake_cudarts, fake_gpu):
    """Finding 6: torch built for CUDA 12 (its libcudart has no batched discard) while
    umrt's own calls go through cuda-bindings 13, which discards: the recorded schedule
    would be armed and disarmed at its first discard, step after step. The server does
    not arm it; it says why and Python serves on."""
    from umrt.allocators.managed import ManagedPool
    from umrt.native.front import load_front
    from umrt.native.server import BackendCalls, Phase, SteadyServer

    front = load_front()
    if front is None:
        pytest.skip("no compiler: the native front cannot be built")
    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(fake_gpu)))
    pool = ManagedPool(backend)
    calls = BackendCalls(backend, c_table=lambda: cudart_table(fake_cudarts["12"].path))
    server = SteadyServer(pool, front=front, calls=calls, enabled=True)

    class Bridge:
        native = False

        def can_go_native(self):
            return True

        def go_native(self):
            self.native = True

        def leave_native(self):
            self.native = False

        def muted(self, on):
            pass

        def replayed_step(self):
            pass

        def stop(self, exc):
            raise AssertionError(exc)

    server.attach(Bridge())
    pool.listeners.append(lambda what, ptr, n: what == "free" and backend.discard([(ptr, n)]))
    keep = None
    for _ in range(12):
        if keep:
            server.free(keep)
        blocks = [server.malloc(n, 0) for n in (1 << 20, 2 << 20, 1 << 20)]
        for ptr in blocks[:-1]:
            server.free(ptr)
        keep = blocks[-1]
        server.on_step()
    assert server.report.arms == 0 and server.phase is Phase.OFF, server.report
    assert "discard" in server.report.last_deviation and "lacks" in server.report.last_deviation
