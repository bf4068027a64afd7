"""ProfiledCapture: observes a training step without changing what it allocates."""

from __future__ import annotations

import copy
import functools
import threading

import pytest
import torch

from umrt.capture import Recorder
from umrt.capture.profiled import (
    AlignmentError,
    ProfiledCapture,
    ProfiledWindow,
    align_allocations,
    caching_block_fits,
    translate,
)
from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.lru_cache(maxsize=1)
def _template():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False)
    return GPT2LMHeadModel(config), torch.randint(0, 512, (2, 32))


def _gpt2():
    """A small GPT-2 (dropout on), AdamW foreach, one batch, always the same;
    warmed up by one step (so the optimizer state exists), and the RNG reset
    for the dropout masks of what follows."""
    template, tokens = _template()
    model = copy.deepcopy(template)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step() -> torch.Tensor:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    torch.manual_seed(1)
    step()
    torch.manual_seed(2)
    return model, opt, step


def _allocation_sizes(roots) -> list[int]:
    """Sizes of the allocations in a profile's event tree, in program order."""
    from torch._C._profiler import _EventType

    found = []

    def walk(ev):
        if ev.tag == _EventType.Allocation and ev.extra_fields.alloc_size > 0:
            found.append((ev.start_time_ns, ev.extra_fields.alloc_size))
        for c in ev.children:
            walk(c)

    for r in roots:
        walk(r)
    return [size for _, size in sorted(found, key=lambda x: x[0])]


def _observed(step, wrap=None) -> tuple[list[int], torch.Tensor]:
    """The allocation sizes of one step seen by the profiler alone (``wrap``: a
    context around the step, e.g. a Recorder)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if wrap is None:
            loss = step()
        else:
            with wrap:
                loss = step()
    return _allocation_sizes(prof.profiler.kineto_results.experimental_event_tree()), loss


# ---------------------------------------------------------------------------- (1) no perturbation


def test_a_gpt2_step_allocates_the_same_with_the_capture_on_and_off():
    _, _, step = _gpt2()
    plain_sizes, plain_loss = _observed(step)

    model, opt, step = _gpt2()
    cap = ProfiledCapture(model, opt)
    with cap:
        loss = step()
    sizes = [n for w in cap.windows for _, _, n in w.allocations]

    assert len(plain_sizes) > 400
    assert sizes == plain_sizes  # same sizes, same order, none more, none less
    assert loss.item() == plain_loss.item()  # bit for bit
    assert sum(isinstance(e, Launch) for e in cap.events) > 150


def test_the_dispatch_mode_recorder_changes_what_a_step_allocates():
    """Why the profiled capture exists: with any TorchDispatchMode active, ATen
    treats every tensor as a subclass, so autograd accumulates gradients out of
    place and composite ops take out-of-place paths: more allocations."""
    _, _, step = _gpt2()
    plain_sizes, _ = _observed(step)
    model, opt, step = _gpt2()
    recorded_sizes, _ = _observed(step, Recorder(model, opt, steer=False))
    assert len(recorded_sizes) > len(plain_sizes)
    assert recorded_sizes != plain_sizes


# ---------------------------------------------------------------------------- (2) agreement with the Recorder


def _second_iteration(trace):
    start, stop = trace.iteration_spans()[1]
    return trace.events[start:stop]


def test_events_agree_with_the_recorders_where_both_see_the_same_kernels():
    model, opt, step = _gpt2()
    cap = ProfiledCapture(model, opt)
    with cap:
        step()
        step()
    ours = _second_iteration(cap.trace())
    model, opt, step = _gpt2()
    rec = Recorder(model, opt, steer=False)
    with rec:
        step()
        step()
    theirs = _second_iteration(rec.trace())

    la = [e for e in ours if isinstance(e, Launch)]
    lb = [e for e in theirs if isinstance(e, Launch)]
    assert len(la) == len(lb)
    differ = 0
    for a, b in zip(la, lb, strict=True):
        assert a.module == b.module and a.flops == b.flops and a.precision == b.precision
        if a.op == b.op:
            assert a.exec_id == b.exec_id, a.op
            # Same bytes read and written; the profiler has no storage offsets, so two
            # views of one object at different offsets count once (aten::sub in the
            # packed-sequence check is the only such launch here).
            mine = {(x.length, x.write) for x in a.accesses}
            assert mine == {(x.length, x.write) for x in b.accesses}
        else:
            # The Recorder's dispatch mode turns in-place adds out of place (gradient
            # accumulation, the attention mask add, GELU's adds): the perturbation
            # the profiled capture avoids.
            assert (a.op, b.op) == ("aten::add_.Tensor", "aten::add.Tensor")
            differ += 1
    assert 0 < differ < len(la) // 10

    def layers(events):
        return [(type(e).__name__, e.module, e.phase) for e in events if isinstance(e, (LayerEnter, LayerExit))]

    assert layers(ours) == layers(theirs)
    assert len(layers(ours)) > 50

    def persistent(events):
        return sorted(
            (e.kind, e.nbytes) for e in events if isinstance(e, Alloc) and e.kind in (Kind.GRADIENT, Kind.OPTIMIZER_STATE)
        )

    # Objects: the same gradients are born in the iteration (the Recorder announces
    # storages; the capture announces every allocation, so temporaries differ).
    assert persistent(ours) == persistent(theirs)
    assert sum(isinstance(e, Alloc) for e in ours) > sum(isinstance(e, Alloc) for e in theirs)


# ---------------------------------------------------------------------------- (3) boundaries and kinds


def test_iteration_boundaries_and_kinds():
    model, opt, step = _gpt2()
    n_params = len(list(model.parameters()))
    cap = ProfiledCapture(model, opt)
    with cap:
        for _ in range(3):
            step()
    trace = cap.trace()
    assert trace.header.iterations == 3
    assert [e.index for e in trace.events if isinstance(e, IterationBoundary)] == [0, 1, 2, 3]
    assert len(cap.windows) == 3  # one profile per iteration
    setup = trace.events[: trace.iteration_spans()[0][0]]
    assert sum(isinstance(e, Alloc) and e.kind is Kind.PARAMETER for e in setup) == n_params
    assert sum(isinstance(e, Alloc) and e.kind is Kind.OPTIMIZER_STATE for e in setup) == 2 * n_params
    for start, stop in trace.iteration_spans():
        events = trace.events[start:stop]
        first = events[1]
        assert isinstance(first, (Alloc, Launch, LayerEnter)), first  # a boundary opens before work
        kinds = [e.kind for e in events if isinstance(e, Alloc)]
        assert kinds.count(Kind.GRADIENT) == n_params
        assert kinds.count(Kind.ACTIVATION) > 20  # made in forward, freed in backward
        assert Kind.TEMPORARY in kinds
        # The step's frees (zero_grad(set_to_none=True)) close the iteration before the boundary.
        assert isinstance(events[-1], Free)
        launches = [e for e in events if isinstance(e, Launch)]
        assert launches[-1].module == "" and launches[-1].op.startswith("aten::_foreach_")
    # The same launches, with the same exec ids, every iteration.
    ids = [[e.exec_id for e in trace.events[a:b] if isinstance(e, Launch)] for a, b in trace.iteration_spans()]
    assert ids[1] == ids[2]


def test_an_iteration_limit_stops_profiling_and_closes_the_last_iteration():
    model, opt, step = _gpt2()
    cap = ProfiledCapture(model, opt, iterations=2)
    with cap:
        for _ in range(4):
            step()
        assert not cap.profiling
    trace = cap.trace()
    assert trace.header.iterations == 2
    assert isinstance(trace.events[-1], IterationBoundary)


def test_bad_arguments_and_a_busy_profiler_are_clear_errors():
    with pytest.raises(ValueError, match="iterations"):
        ProfiledCapture(iterations=0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]), pytest.raises(RuntimeError, match="another torch profiler"):
        ProfiledCapture(device="cpu").start()
    with ProfiledCapture(device="cpu"), pytest.raises(RuntimeError, match="another torch profiler"):
        ProfiledCapture(device="cpu").start()
    cap = ProfiledCapture(device="cpu", keep_events=False)
    with cap:
        pass
    with pytest.raises(RuntimeError, match="keeps no events"):
        cap.trace()
    with pytest.raises(RuntimeError, match="only once"):
        cap.start()


# ---------------------------------------------------------------------------- (4) a valid order


def _assert_valid_order(events):
    """Each object allocated once, before any launch touches it, freed once after
    its last use; a launch writes what it allocated and outlives it (its outputs)."""
    alive: dict[int, int] = {}  # object -> the launch that made it
    seen: set[int] = set()
    outputs: set[int] = set()  # made by the last launch, to be written by it unless freed right after
    written: set[int] = set()
    for ev in events:
        if isinstance(ev, Free):
            assert ev.obj in alive, f"object {ev.obj} freed while not alive"
            del alive[ev.obj]
            outputs.discard(ev.obj)
            continue
        assert outputs <= written, f"a launch does not write the objects {outputs - written} it made"
        outputs = set()
        if isinstance(ev, Alloc):
            assert ev.obj not in seen, f"object {ev.obj} allocated twice"
            seen.add(ev.obj)
            alive[ev.obj] = ev.launch
        elif isinstance(ev, Launch):
            for a in ev.accesses:
                assert a.obj in alive, f"launch {ev.seq} ({ev.op}) touches object {a.obj}, not alive"
            outputs = {o for o, seq in alive.items() if seq == ev.seq}
            written = {a.obj for a in ev.accesses if a.write}
    assert outputs <= written, f"a launch does not write the objects {outputs - written} it made"


def test_events_are_in_a_valid_order():
    model, opt, step = _gpt2()
    cap = ProfiledCapture(model, opt)
    with cap:
        step()
        step()
    events = cap.trace().events
    _assert_valid_order(events)
    launches = [e for e in events if isinstance(e, Launch)]
    assert [e.seq for e in launches] == list(range(len(launches)))
    assert sum(isinstance(e, Alloc) and e.launch >= 0 for e in events) > 300


def test_the_validity_check_catches_a_use_after_free_and_an_unwritten_output():
    bad = [Alloc(0, 8, Kind.TEMPORARY), Free(0), Launch(0, 1, "aten::x", (Access(0, 0, 8, False),), 0, 8)]
    with pytest.raises(AssertionError, match="not alive"):
        _assert_valid_order(bad)
    bad = [Alloc(0, 8, Kind.TEMPORARY, launch=0), Launch(0, 1, "aten::x", (), 0, 0)]
    with pytest.raises(AssertionError, match="does not write the objects"):
        _assert_valid_order(bad)


# ---------------------------------------------------------------------------- allocator markers and alignment


def _pool_op(cap: ProfiledCapture, noted: list):
    """A custom op whose allocation a (simulated) pool listener reports, as umrt's
    pool does through note_alloc from inside torch's allocator."""
    lib = torch.library.Library("umrt_profiled_test", "FRAGMENT")  # noqa: TOR901
    lib.define("grow(Tensor x) -> Tensor")

    def grow(x):
        out = torch.empty(x.numel() * 2, dtype=x.dtype)
        st = out.untyped_storage()
        if cap.note_alloc(st.data_ptr(), st.nbytes()):
            noted.append((st.data_ptr(), st.nbytes()))
        out.copy_(torch.cat([x, x]))
        return out

    lib.impl("grow", grow, "CPU")
    return lib, torch.ops.umrt_profiled_test.grow


def test_allocator_markers_land_inside_the_op_and_align_with_the_allocator():
    noted: list[tuple[int, int]] = []
    cap = ProfiledCapture(device="cpu", allocator_events=True)
    lib, grow = _pool_op(cap, noted)
    x = torch.ones(16)
    with cap:
        y = grow(x)
        ptr = y.untyped_storage().data_ptr()
        assert cap.note_free(ptr, y.untyped_storage().nbytes())
        del y
        elsewhere = threading.Thread(target=lambda: grow(x))  # a thread the profiler does not follow
        elsewhere.start()
        elsewhere.join()
    assert not cap.note_alloc(1, 1)  # not profiling
    (window,) = cap.windows
    # Only the pool's blocks are objects: the profiler's own memory events are ignored.
    assert [(p, n) for _, p, n in window.allocations] == noted
    launch = next(e for e in window.events if isinstance(e, Launch) and e.op == "umrt_profiled_test::grow.default")
    (obj,) = [o for o, _, _ in window.allocations]
    alloc = next(e for e in window.events if isinstance(e, Alloc) and e.obj == obj)
    assert alloc.launch == launch.seq and alloc.nbytes == 128
    assert Access(obj, 0, 128, True) in launch.accesses
    assert window.events.index(alloc) < window.events.index(launch) < window.events.index(Free(obj))

    mapping = align_allocations(noted, window)
    assert mapping == {obj: 0}
    live_ids = {o: 1000 + i for o, i in mapping.items()}
    (moved,) = [e for e in translate(window.events, live_ids) if isinstance(e, Launch) and e.op == launch.op]
    assert [a.obj for a in moved.accesses] == [1000]  # x was made before the capture: not the pool's
    del lib


def test_alignment_names_the_first_difference():
    window = ProfiledWindow(0, [], [(5, 0x1000, 512), (6, 0x2000, 1024)])
    assert align_allocations([(0x1000, 512), (0x2000, 1024)], window) == {5: 0, 6: 1}
    with pytest.raises(AlignmentError, match="allocation 1: the allocator gave 1000 bytes"):
        align_allocations([(0x1000, 512), (0x2000, 1000)], window)
    assert align_allocations([(0, 500), (0, 1000)], window, fits=caching_block_fits, check_addresses=False) == {
        5: 0,
        6: 1,
    }
    with pytest.raises(AlignmentError, match="at 0x3000"):
        align_allocations([(0x1000, 512), (0x3000, 1024)], window)
    with pytest.raises(AlignmentError, match="made 1 allocations, the profile shows 2"):
        align_allocations([(0x1000, 512)], window)


def test_caching_block_sizes():
    assert caching_block_fits(1, 512) and caching_block_fits(512, 512)
    assert not caching_block_fits(513, 512) and caching_block_fits(513, 1024)
    assert caching_block_fits(3 << 20, (3 << 20) + (512 << 10))  # an unsplit large block
    assert not caching_block_fits(3 << 20, 5 << 20)


# ---------------------------------------------------------------------------- the conversion, on a synthetic profile


class _Dev:
    def __init__(self, type_: str) -> None:
        self.type = type_


class _TM:
    """Stands in for torch's _TensorMetadata (a float32 tensor on the CPU)."""

    def __init__(self, ptr: int, sizes: list[int], device: str = "cpu") -> None:
        self.storage_data_ptr = ptr
        self.sizes = sizes
        self.strides = [sizes[1], 1] if len(sizes) == 2 else [1]
        self.dtype = torch.float32
        self.device = _Dev(device)


class _Fields:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class _Ev:
    def __init__(self, tag, name, t, end=None, tid=1, children=(), **fields) -> None:
        self.tag, self.name, self.overload_name = tag, name, ""
        self.start_time_ns, self.end_time_ns, self.start_tid = t, end if end is not None else t, tid
        self.children = list(children)
        self.extra_fields = _Fields(**fields)


def _op(name, t, end, inputs, children=(), tid=1):
    from torch._C._profiler import _EventType

    return _Ev(_EventType.TorchOp, name, t, end, tid, children, inputs=inputs)


def _mem(ptr, size, t, tid=1, device="cpu"):
    from torch._C._profiler import _EventType

    return _Ev(_EventType.Allocation, "[memory]", t, t, tid, (), ptr=ptr, alloc_size=size, device=_Dev(device))


def test_conversion_orders_two_threads_and_places_frees_after_their_launch(monkeypatch):
    """A forward on the main thread, its backward on autograd's thread (as on
    CUDA), a step, then an op that frees its input inside itself."""
    import umrt.capture.profiled as profiled

    monkeypatch.setattr(profiled, "_TENSOR_METADATA", _TM)
    a, w, c, d, e, f = 0x100, 0x200, 0x300, 0x400, 0x500, 0x600
    roots = [
        _op("umrt::fwd::lin", 10, 40, [], [_op("aten::mm", 20, 30, [_TM(a, [4, 4]), _TM(w, [4, 4])], [_mem(c, 64, 21)])]),
        _op("autograd::engine::evaluate_function: MmBackward0", 50, 80, [], [
            _op("umrt::bwd::lin", 51, 51, [], tid=2),
            _op("aten::mm", 60, 65, [_TM(c, [4, 4]), _TM(w, [4, 4])], [_mem(d, 64, 61, tid=2)], tid=2),
            _mem(c, -64, 70, tid=2),
        ], tid=2),
        _op("umrt::step_post::1", 90, 90, []),
        _mem(e, 16, 100),
        _op("aten::relu", 110, 120, [_TM(d, [4, 4])], [_mem(d, -64, 111), _mem(f, 64, 112)]),
    ]
    conv = profiled.ProfileConverter("cpu", (False, True), allocator_events=False)
    conv.open_window()
    conv.boundary()
    events = conv.convert(roots).events

    def show(ev):
        if isinstance(ev, Launch):
            return ("Launch", ev.seq, ev.module, tuple((x.obj, x.write) for x in ev.accesses))
        if isinstance(ev, Alloc):
            return ("Alloc", ev.obj, ev.nbytes, ev.launch)
        if isinstance(ev, Free):
            return ("Free", ev.obj)
        if isinstance(ev, IterationBoundary):
            return ("Boundary", ev.index)
        return (type(ev).__name__, ev.module, ev.phase)

    assert [show(ev) for ev in events] == [
        ("Boundary", 0),
        ("LayerEnter", "lin", "forward"),
        ("Alloc", 0, 64, -1),  # a, first seen (made before the capture)
        ("Alloc", 1, 64, -1),  # w
        ("Alloc", 2, 64, 0),  # c, made by the launch that follows
        ("Launch", 0, "lin", ((0, False), (1, False), (2, True))),
        ("LayerExit", "lin", "forward"),
        ("LayerEnter", "lin", "backward"),
        ("Alloc", 3, 64, 1),
        ("Launch", 1, "lin", ((2, False), (1, False), (3, True))),
        ("Free", 2),
        ("LayerExit", "lin", "backward"),
        ("Boundary", 1),
        ("Alloc", 4, 16, -1),
        ("Alloc", 5, 64, 2),
        ("Launch", 2, "", ((3, False), (5, True))),
        ("Free", 3),  # freed inside relu, after reading it: the free follows the launch
    ]
    _assert_valid_order(events)
    kinds = {ev.obj: ev.kind for ev in events if isinstance(ev, Alloc)}
    assert kinds[2] is Kind.ACTIVATION  # made in forward, freed in backward
    assert kinds[0] is Kind.INPUT


def test_conversion_on_cuda_keeps_host_memory_out_and_marks_copied_batches_as_inputs(monkeypatch):
    import umrt.capture.profiled as profiled

    monkeypatch.setattr(profiled, "_TENSOR_METADATA", _TM)
    host, dev_w, dev_x, dev_y = 0x10, 0x100, 0x200, 0x300
    roots = [
        _mem(host, 24, 5),  # the batch, made on the host: not the traced device's memory
        _op("aten::_to_copy", 10, 20, [_TM(host, [2, 3])], [_mem(dev_x, 512, 11, device="cuda")]),
        _op("aten::mm", 30, 40, [_TM(dev_x, [2, 3], "cuda"), _TM(dev_w, [3, 3], "cuda")],
            [_mem(dev_y, 512, 31, device="cuda")]),
        _op("aten::add", 50, 60, [_TM(host, [2, 3]), _TM(host, [2, 3])], [_mem(0x20, 24, 51)]),  # a host op
    ]
    conv = profiled.ProfileConverter("cuda", (False, True), allocator_events=False)
    conv.open_window()
    conv.boundary()
    events = conv.convert(roots).events
    launches = [e for e in events if isinstance(e, Launch)]
    assert [e.op for e in launches] == ["aten::_to_copy.default", "aten::mm.default"]
    assert launches[1].flops == 2 * 2 * 3 * 3
    allocs = {e.obj: e for e in events if isinstance(e, Alloc)}
    assert [a.nbytes for a in allocs.values()] == [512, 36, 512]  # x, w (first seen), y: no host block
    assert allocs[0].kind is Kind.INPUT and allocs[0].launch == 0  # batch data arriving


def test_without_overload_names_schemas_are_matched_from_the_inputs(monkeypatch):
    """A torch without ``capture_overload_names`` (or with it off): the same
    launches, found by torch's SchemaMatcher from the recorded arguments."""
    import umrt.capture.profiled as profiled

    def run() -> list[tuple[str, int]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        cap = ProfiledCapture(model, opt)
        with cap:
            for _ in range(2):
                (model(torch.randn(4, 8)) * 2.0).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return [(e.op, e.exec_id) for e in cap.events if isinstance(e, Launch)]

    with_names = run()
    monkeypatch.setattr(profiled, "_experimental_config", lambda: (profiled._ExperimentalConfig(), False))
    without = run()
    assert len(with_names) > 20
    assert without == with_names
    assert ("aten::mul.Tensor" in {op for op, _ in without}) and ("aten::addmm.default" in {op for op, _ in without})


def test_its_own_failures_propagate_unless_on_error_takes_them(monkeypatch):
    import umrt.capture.profiled as profiled

    def broken(self, *args):
        raise KeyError("bookkeeping")

    monkeypatch.setattr(profiled.ProfileConverter, "_op", broken)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(cap, steps):
        with cap:
            for _ in range(steps):
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

    errors: list[BaseException] = []
    cap = ProfiledCapture(model, opt, on_error=errors.append)
    train(cap, 3)  # the training goes on
    assert len(errors) == 1 and isinstance(errors[0], KeyError)
    assert not cap.profiling and cap.failed is errors[0]
    assert not torch._C._autograd._profiler_enabled()
    with pytest.raises(RuntimeError, match="partial"):
        cap.trace()
    with pytest.raises(KeyError, match="bookkeeping"):
        train(ProfiledCapture(model, opt), 2)
    assert not torch._C._autograd._profiler_enabled()


def test_the_cost_bench_measures_each_observer():
    from bench.profiled_cost import measure_tiny_ops

    out = measure_tiny_ops(300)
    assert out["ops"] == 300
    assert out["recorder_us"] > out["plain_us"] > 0  # a Python hook per op costs more than the op
    assert out["profiled_on_us"] > 0 and out["profiled_read_us"] > 0
