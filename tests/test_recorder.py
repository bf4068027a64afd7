"""Recorder: events, storages, kinds, boundaries; meta and CPU agree op for op."""

from __future__ import annotations

import pytest
import torch

from umrt.capture import Recorder, StopRecording
from umrt.capture.modestack import ModeSwitch
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit
from umrt.trace.stats import summarize
from umrt.zoo import trace_model

TINY = "hf:GPT2Config:n_layer=2,n_embd=64,n_head=4,vocab_size=512,n_positions=64"


def _mlp(device: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), foreach=True)


def _train(rec, model, opt, steps, device="meta"):
    with rec:
        for _ in range(steps):
            with rec.paused():
                x = torch.randn(8, 16, device=device)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x, loss


def test_mlp_trace_structure():
    model, opt = _mlp("meta")
    rec = Recorder(model, opt)
    _train(rec, model, opt, 3)
    tr = rec.trace()
    assert tr.header.iterations == 3
    assert sum(isinstance(e, IterationBoundary) for e in tr.events) == 4
    # allocs precede every launch that touches the object; frees are last
    alive, dead = set(), set()
    for e in tr.events:
        if isinstance(e, Alloc):
            assert e.obj not in alive and e.obj not in dead
            alive.add(e.obj)
        elif isinstance(e, Free):
            alive.remove(e.obj)
            dead.add(e.obj)
        elif isinstance(e, Launch):
            for a in e.accesses:
                assert a.obj in alive, (e.op, a)
            assert e.bytes == sum(a.length for a in e.accesses)
    seqs = [e.seq for e in tr.launches()]
    assert seqs == list(range(len(seqs)))
    kinds = {e.obj: e.kind for e in tr.events if isinstance(e, Alloc)}
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert (
        sum(e.nbytes for e in tr.events if isinstance(e, Alloc) and e.kind == Kind.PARAMETER) == param_bytes
    )
    assert Kind.GRADIENT in kinds.values() and Kind.OPTIMIZER_STATE in kinds.values()
    assert Kind.INPUT in kinds.values() and Kind.ACTIVATION in kinds.values()
    mm = [e for e in tr.launches() if e.op == "aten::addmm.default"]
    assert mm and all(e.flops > 0 for e in mm)
    assert {e.module for e in mm} >= {"0", "2"}
    s = summarize(tr)
    assert s["end_live_bytes"] == 3 * param_bytes  # params + exp_avg + exp_avg_sq
    assert s["bytes_by_kind"]["gradient"] == param_bytes


def test_steady_iterations_repeat_exec_ids():
    model, opt = _mlp("meta")
    rec = Recorder(model, opt)
    _train(rec, model, opt, 3)
    tr = rec.trace()
    (_, _), (a1, b1), (a2, b2) = tr.iteration_spans()
    ids1 = [e.exec_id for e in tr.events[a1:b1] if isinstance(e, Launch)]
    ids2 = [e.exec_id for e in tr.events[a2:b2] if isinstance(e, Launch)]
    assert ids1 == ids2 and ids1


def test_views_resolve_to_storage_offsets():
    base = torch.zeros(4, 8, device="meta")
    rec = Recorder(device="meta", mark_start=True)
    with rec:
        base[1:3].add_(1.0)  # in-place write on a view
        _ = base.t().contiguous()  # read of a strided view
    launches = [e for e in rec.events if isinstance(e, Launch)]
    add = next(e for e in launches if e.op == "aten::add_.Tensor")
    (acc,) = add.accesses
    assert acc.write and acc.offset == 8 * 4 and acc.length == 2 * 8 * 4
    clone = next(e for e in launches if e.op == "aten::clone.default")
    read = [a for a in clone.accesses if not a.write]
    assert read[0].obj == acc.obj and read[0].length == 4 * 8 * 4


def test_live_listener_sees_events_and_learned_kinds():
    seen = []
    model, opt = _mlp("meta")
    rec = Recorder(model, opt, listeners=[seen.append])
    _train(rec, model, opt, 3)
    assert seen == rec.events
    tr = rec.trace()
    a2, b2 = tr.iteration_spans()[-1]
    final = {e.obj: e.kind for e in tr.events[a2:b2] if isinstance(e, Alloc)}
    live = {e.obj: e.kind for e in seen if isinstance(e, Alloc) and e.obj in final}
    # from the second iteration on, live kinds match the refined ones
    assert live == final


def test_layer_events_forward_and_backward():
    model, opt = _mlp("meta")
    rec = Recorder(model, opt)
    _train(rec, model, opt, 2)
    enters = [e for e in rec.trace().events if isinstance(e, LayerEnter)]
    assert any(e.phase == "forward" and e.module == "2" for e in enters)
    assert any(e.phase == "backward" for e in enters)


def test_gpt2_small_end_live_is_params_plus_adamw_states():
    tr = trace_model("gpt2", batch=2, seq=128, device="meta", steps=2)
    s = summarize(tr)
    mib = 2**20
    assert abs(s["end_live_bytes"] / (3 * 474.7 * mib) - 1) < 0.01
    assert abs(s["bytes_by_kind"]["parameter"] / (474.7 * mib) - 1) < 0.01
    ops = {e.op for e in tr.launches()}
    assert "aten::_scaled_dot_product_flash_attention.default" in ops
    assert "aten::_foreach_addcdiv_.ScalarList" in ops
    assert "aten::bmm.default" not in ops  # no math-path attention


def _op_seq(tr):
    a, b = tr.iteration_spans()[-1]
    return [
        (e.op, e.module, e.exec_id, [(x.offset, x.length, x.write) for x in e.accesses], e.flops)
        for e in tr.events[a:b]
        if isinstance(e, Launch)
    ]


def test_meta_and_cpu_agree_op_for_op():
    meta = trace_model(TINY, batch=2, seq=16, device="meta", steps=2)
    cpu = trace_model(TINY, batch=2, seq=16, device="cpu", steps=2)
    assert _op_seq(meta) == _op_seq(cpu)
    assert summarize(meta) | {"device": ""} == summarize(cpu) | {"device": ""}


def test_stop_after_raises_and_closes():
    from umrt.capture import StopRecording

    model, opt = _mlp("meta")
    rec = Recorder(model, opt, stop_after=2)
    try:
        _train(rec, model, opt, 5)
    except StopRecording:
        pass
    else:
        raise AssertionError("StopRecording not raised")
    assert rec.trace().header.iterations == 2


@pytest.mark.slow
def test_gpt2_small_meta_and_cpu_agree_op_for_op():
    """The issue's must-show: GPT-2 small, batch 2, seq 128, meta vs a real CPU run."""
    meta = trace_model("gpt2", batch=2, seq=128, device="meta", steps=1)
    cpu = trace_model("gpt2", batch=2, seq=128, device="cpu", steps=1)
    assert _op_seq(meta) == _op_seq(cpu)
    assert summarize(meta)["peak_live_bytes"] == summarize(cpu)["peak_live_bytes"]


def test_steering_patches_are_removed_on_exit():
    import torch.nn.functional as F

    before = F.scaled_dot_product_attention, F.dropout
    q = torch.randn(1, 2, 4, 8, device="meta")
    rec = Recorder(device="meta")
    with rec:
        assert F.scaled_dot_product_attention is not before[0]
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.dropout(q, 0.1, training=True)
    assert (F.scaled_dot_product_attention, F.dropout) == before
    ops = [e.op for e in rec.events if isinstance(e, Launch)]
    assert ops == ["aten::_scaled_dot_product_flash_attention.default", "aten::native_dropout.default"]


def test_address_of_live_objects():
    import torch

    from umrt.capture import Recorder
    from umrt.trace.events import Alloc

    seen = []
    rec = Recorder(listeners=(seen.append,), auto_step=False)
    with rec:
        x = torch.ones(16)
        y = x * 2
        allocs = [e.obj for e in seen if isinstance(e, Alloc)]
        ptrs = {rec.address(o) for o in allocs}
        assert x.untyped_storage().data_ptr() in ptrs and y.untyped_storage().data_ptr() in ptrs
        del y
    assert rec.address(10**9) == 0
    with Recorder(auto_step=False) as meta_rec:
        torch.ones(4, device="meta") + 1
        assert all(meta_rec.address(o) == 0 for o in range(4))


def test_launches_record_the_precision_of_their_arithmetic():
    """FP32 matmuls on CUDA cores unless PyTorch allows TF32 for them; cuDNN
    convolutions on TF32 by default; half precisions as they are."""
    def precisions(build, dtype=torch.float32):
        with torch.device("meta"):
            model = build().to(dtype)
        rec = Recorder(model)
        with rec:
            for _ in range(2):
                x = torch.randn(*shape, device="meta", dtype=dtype)
                model(x).sum().backward()
                rec.step()
        return {e.op: e.precision for e in rec.trace().launches() if e.flops > 0}

    shape = (4, 16)
    lin = lambda: torch.nn.Linear(16, 16)  # noqa: E731
    assert precisions(lin)["aten::addmm.default"] == "fp32"
    assert precisions(lin, torch.bfloat16)["aten::addmm.default"] == "bf16"
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert precisions(lin)["aten::addmm.default"] == "tf32"
    finally:
        torch.set_float32_matmul_precision(old)
    shape = (2, 3, 8, 8)
    conv = precisions(lambda: torch.nn.Conv2d(3, 4, 3))
    assert {p for op, p in conv.items() if "conv" in op} == {"tf32" if torch.backends.cudnn.allow_tf32 else "fp32"}


def _step(model, opt, device="meta"):
    x = torch.randn(8, 16, device=device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_suspended_ops_keep_layer_events_and_boundaries():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model, opt = _mlp("meta")
    rec = Recorder(model, opt)

    def one_step():
        mark = len(rec.events)
        _step(model, opt)
        tail = rec.events[mark:]
        layers = [e for e in tail if isinstance(e, (LayerEnter, LayerExit))]
        return sum(isinstance(e, Launch) for e in tail), layers, sum(isinstance(e, IterationBoundary) for e in tail)

    with rec:
        one_step()
        launches_on, layers_on, _ = one_step()
        assert rec.suspend_ops() and rec.suspend_ops()  # idempotent
        assert rec.ops_suspended and _get_current_dispatch_mode_stack() == []
        launches_off, layers_off, boundaries_off = one_step()
        rec.resume_ops()
        rec.resume_ops()
        assert not rec.ops_suspended and len(_get_current_dispatch_mode_stack()) == 1
        launches_again, _, _ = one_step()
    assert launches_on > 0 and launches_off == 0 and launches_again == launches_on
    assert layers_off == layers_on  # forward and backward layers, module paths as with ops on
    assert {e.phase for e in layers_off} == {"forward", "backward"}
    assert boundaries_off == 1


def test_storages_made_while_suspended_are_announced_when_first_seen():
    rec = Recorder(device="meta", auto_step=False)
    with rec:
        rec.suspend_ops()
        x = torch.ones(64, device="meta") * 2  # no launch, no alloc
        assert not any(isinstance(e, (Launch, Alloc)) for e in rec.events)
        rec.resume_ops()
        (x + 1).sum()
    allocs = [e for e in rec.events if isinstance(e, Alloc)]
    assert allocs[0].nbytes == 64 * 4 and allocs[0].kind == Kind.INPUT
    assert rec.events.index(allocs[0]) < next(i for i, e in enumerate(rec.events) if isinstance(e, Launch))


def test_a_users_mode_on_top_is_never_popped():
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class Mine(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    rec = Recorder(device="meta", auto_step=False)
    with rec:
        with Mine() as mine:
            assert rec.suspend_ops() is False and not rec.ops_suspended
            n = sum(isinstance(e, Launch) for e in rec.events)
            torch.ones(4, device="meta") + 1
            assert sum(isinstance(e, Launch) for e in rec.events) > n
            assert _get_current_dispatch_mode_stack()[-1] is mine
        assert rec.suspend_ops()
        with Mine():
            rec.resume_ops()  # would sit above the user's mode: waits until it is gone
            assert len(_get_current_dispatch_mode_stack()) == 1
        model = torch.nn.Linear(4, 4, device="meta")
        model(torch.ones(2, 4, device="meta"))  # a module hook re-enters it
        assert len(_get_current_dispatch_mode_stack()) == 1
        n = sum(isinstance(e, Launch) for e in rec.events)
        torch.ones(4, device="meta") + 1
        assert sum(isinstance(e, Launch) for e in rec.events) > n
    assert _get_current_dispatch_mode_stack() == []


def test_suspending_from_inside_an_op_leaves_the_mode_at_the_next_hook():
    """The live bridge suspends from a listener, i.e. while one of the recorder's
    ops runs: launches stop at once, the mode is left at the next module hook."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model, opt = _mlp("meta")
    launches = []

    def listener(ev):
        if isinstance(ev, Launch):
            launches.append(ev)
            if len(launches) == 2:
                assert rec.suspend_ops()

    rec = Recorder(model, opt, listeners=[listener])
    with rec:
        x = torch.randn(8, 16, device="meta")
        y = x * 2
        y = y + 1  # the second launch suspends
        y * 3
        assert len(launches) == 2 and len(_get_current_dispatch_mode_stack()) == 1
        model(x)
        assert _get_current_dispatch_mode_stack() == []
    assert len(launches) == 2


def test_exit_while_suspended_is_clean():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model, opt = _mlp("meta")
    rec = Recorder(model, opt)
    with rec:
        _step(model, opt)
        rec.suspend_ops()
        _step(model, opt)
    assert _get_current_dispatch_mode_stack() == [] and not rec.ops_suspended
    assert rec.suspend_ops() is False  # closed
    rec.resume_ops()
    assert _get_current_dispatch_mode_stack() == []
    tr = rec.trace()
    assert tr.header.iterations == 2
    _step(model, opt)  # torch runs on, unrecorded
    assert len(rec.events) == len(tr.events)


def test_a_recorder_that_keeps_no_events_stays_bounded():
    """A live listener's recorder runs for a whole training: with keep_events=False
    it passes every event on and holds only what is alive."""
    model, opt = _mlp("meta")
    seen = []
    rec = Recorder(model, opt, listeners=[seen.append], keep_events=False)
    with rec:
        _step(model, opt)
        _step(model, opt)
        tracked = len(rec._objects.objects)
        for _ in range(3):
            _step(model, opt)
        assert len(rec._objects.objects) == tracked  # freed objects are forgotten
    assert rec.events == [] and sum(isinstance(e, Launch) for e in seen) > 0
    with pytest.raises(RuntimeError, match="keeps no events"):
        rec.trace()


def test_suspending_from_another_thread_takes_effect_at_the_owners_next_hook():
    """Torch keeps dispatch modes per thread (autograd's worker runs CUDA backward):
    a request from another thread stops launches at once; the mode itself is left,
    and re-entered, on the thread that entered the recorder, at its next hook."""
    import threading

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def elsewhere(call):
        out = []
        t = threading.Thread(target=lambda: out.append(call()))
        t.start()
        t.join()
        return out[0]

    model, opt = _mlp("meta")
    rec = Recorder(model, opt)
    with rec:
        x = torch.randn(8, 16, device="meta")
        assert elsewhere(rec.suspend_ops) is True
        n = sum(isinstance(e, Launch) for e in rec.events)
        x * 2
        assert sum(isinstance(e, Launch) for e in rec.events) == n  # at once
        assert len(_get_current_dispatch_mode_stack()) == 1  # still on here
        model(x)
        assert _get_current_dispatch_mode_stack() == []  # left at the module hook
        elsewhere(rec.resume_ops)
        assert _get_current_dispatch_mode_stack() == []
        model(x)
        assert len(_get_current_dispatch_mode_stack()) == 1
        x * 2
        assert sum(isinstance(e, Launch) for e in rec.events) > n


def test_a_deferred_resume_reenters_the_mode_at_the_next_hook():
    """resume_ops(at_once=False), for a caller that may be inside a C++ op (the
    live bridge's allocator listener): the mode is not pushed there and then,
    but at the next module hook."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model, opt = _mlp("meta")
    rec = Recorder(model, opt)

    def launches():
        return sum(isinstance(e, Launch) for e in rec.events)

    with rec:
        assert rec.suspend_ops() and _get_current_dispatch_mode_stack() == []
        rec.resume_ops(at_once=False)
        assert not rec.ops_suspended and _get_current_dispatch_mode_stack() == []
        n = launches()
        x = torch.randn(8, 16, device="meta") * 2
        assert launches() == n  # the mode is still off
        model(x)
        assert len(_get_current_dispatch_mode_stack()) == 1 and launches() > n


def test_gradient_accumulation_closes_each_backward_layer_with_ops_suspended():
    """Two backwards before a step: with no launch to close it, the last backward
    layer is closed at the next forward's first module hook, as with ops on."""

    def layer_events(suspend):
        model, opt = _mlp("meta")
        rec = Recorder(model, opt)
        with rec:
            if suspend:
                assert rec.suspend_ops()
            for _ in range(2):
                model(torch.randn(8, 16, device="meta")).sum().backward()
            opt.step()
        return [e for e in rec.events if isinstance(e, (LayerEnter, LayerExit))]

    on, off = layer_events(False), layer_events(True)
    assert off == on
    second_forward = [i for i, e in enumerate(off) if e == LayerEnter("", "forward")][1]
    assert off[second_forward - 1] == LayerExit("0", "backward")


def test_suspended_ops_skip_the_optimizers_facts():
    """With ops suspended nothing reads kinds: the optimizer's tensors are not
    marked (a pass over every parameter each step); resumed, they are again."""
    model, opt = _mlp("meta")
    rec = Recorder(model, opt)
    marked = []
    real = rec._mark_optimizer
    rec._mark_optimizer = lambda o, *, grads: (marked.append(grads), real(o, grads=grads))

    def marks_in_a_step() -> list:
        n = len(marked)
        _step(model, opt)
        return marked[n:]

    with rec:
        on = marks_in_a_step()
        rec.suspend_ops()
        off = marks_in_a_step()
        rec.resume_ops()
        again = marks_in_a_step()
    assert on == again == [True, False] and off == []  # step pre (with gradients) and post


def test_its_own_failures_propagate_unless_on_error_takes_them(monkeypatch):
    """A trace must not silently miss ops: by default the recorder's own failure
    reaches the program. With on_error (a live run) it goes there instead, from
    ops and hooks alike, and the program runs on."""
    def broken(self, *args, **kwargs):
        raise RuntimeError("cannot read this op")

    monkeypatch.setattr(Recorder, "_record", broken)
    model, opt = _mlp("meta")
    with pytest.raises(RuntimeError, match="cannot read this op"):
        _train(Recorder(model, opt), model, opt, 1)
    seen = []
    _train(Recorder(model, opt, on_error=seen.append), model, opt, 2)
    assert seen and all("cannot read this op" in str(e) for e in seen)
    monkeypatch.setattr(ModeSwitch, "sync_at_hook", broken)  # a hook's own bookkeeping
    with pytest.raises(RuntimeError, match="cannot read this op"):
        _train(Recorder(model, opt), model, opt, 1)
    hooks = []
    _train(Recorder(model, opt, on_error=hooks.append), model, opt, 2)
    assert len(hooks) > len(seen)  # the module and optimizer hooks' failures too


def test_without_torchs_mode_stack_helpers_ops_are_never_suspended(monkeypatch):
    """A torch that moved its private mode-stack helpers: the recorder still
    records (every op, as before suspending existed) and exits cleanly."""
    import umrt.capture.modestack as modestack

    monkeypatch.setattr(modestack, "CAN_SUSPEND", False)
    model, opt = _mlp("meta")
    rec = Recorder(model, opt)
    with rec:
        assert rec.suspend_ops() is False and not rec.ops_suspended
        mark = len(rec.events)
        _step(model, opt)
        assert any(isinstance(e, Launch) for e in rec.events[mark:])
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_dispatch_mode_stack() == []


class _OnAccelerator(torch.Tensor):
    """A CPU tensor that says it lives on CUDA: how an op touching a GPU tensor looks to
    the recorder, on a machine without one."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_without_a_model_the_recorder_follows_the_programs_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, a CPU program
    seen = []
    rec = Recorder(listeners=(seen.append,), auto_step=False)
    assert rec.device == "cpu"
    with rec:
        host = torch.ones(8) * 2  # traced: the program has touched nothing but the CPU
        assert any(isinstance(e, Launch) and e.op == "aten::mul.Tensor" for e in seen)
        on_gpu = torch.Tensor._make_subclass(_OnAccelerator, torch.zeros(8))
        on_gpu.add_(1)  # the program's first op on an accelerator
        assert rec.device == "cuda"
        born = {e.obj for e in seen if isinstance(e, Alloc)}
        freed = {e.obj for e in seen if isinstance(e, Free)}
        assert born - freed == {max(born)}  # the CPU objects left the trace; on_gpu's storage is in it
        n = len(seen)
        _ = host * 3  # host memory now: not traced
        assert len(seen) == n
    tr = rec.trace()
    assert tr.header.device == "cuda"
    assert any("traced device cuda: the program's, from its first op on it" in note for note in tr.header.notes)


def test_a_cpu_program_is_traced_on_the_cpu_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, opt = _mlp("cpu")
    rec = Recorder()  # neither model nor device: the program's own
    _train(rec, model, opt, 2, device="cpu")
    tr = rec.trace()
    assert tr.header.device == "cpu" and len(tr.launches()) > 20
    assert any("no op touched a tensor on an accelerator" in note for note in tr.header.notes)


def _dropout_attention(seed: int) -> torch.Tensor:
    import torch.nn.functional as F

    torch.manual_seed(seed)
    q = torch.randn(2, 4, 16, 8)
    x = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3, is_causal=True)
    return F.dropout(x, 0.2, training=True)


def test_recording_on_the_cpu_computes_what_the_program_computes():
    """Steering acts on meta only unless asked: a CPU program's attention dropout, kernels
    and random stream are its own under the recorder (shadow mode and live capture)."""
    plain = _dropout_attention(0)
    for rec in (Recorder(), Recorder(steer=False)):
        with rec:
            recorded = _dropout_attention(0)
        assert torch.equal(recorded, plain)
        ops = {e.op for e in rec.events if isinstance(e, Launch)}
        assert "aten::bernoulli_.float" in ops and "aten::native_dropout.default" not in ops
        notes = rec.trace().header.notes
        assert any("recorded as the program ran them on cpu" in note for note in notes)
    steered = Recorder(steer=True)  # umrt's own synthetic loops only: it changes the numbers
    with steered:
        assert not torch.equal(_dropout_attention(0), plain)
    assert "aten::native_dropout.default" in {e.op for e in steered.events if isinstance(e, Launch)}


def test_steering_a_device_it_cannot_steer_is_a_clear_error():
    with pytest.raises(ValueError, match="steering acts only on meta, cpu; got cuda"):
        Recorder(device="meta", steer=("cuda",))


def test_a_storage_from_an_op_that_only_allocates_is_made_by_the_launch_that_writes_it():
    """empty_like launches nothing: its storage holds no data (on a GPU nothing is copied
    in) until a kernel writes it, so it is announced by that launch, not as host data."""
    seen = []
    rec = Recorder(listeners=(seen.append,), auto_step=False)
    with rec:
        x = torch.ones(16)
        mask = torch.empty_like(x)
        n = len(seen)
        mask.bernoulli_(0.5)  # writes it whole
        assert isinstance(seen[n], Alloc) and isinstance(seen[n + 1], Launch)
        assert seen[n].launch == seen[n + 1].seq and seen[n + 1].op == "aten::bernoulli_.float"
        part = torch.empty(16)
        part[:8].fill_(1.0)  # written in part: the rest is whatever was there
        unused = torch.empty(4)  # touched by no launch: never in the trace
        del unused
        _ = x + mask + part
    allocs = [e for e in rec.events if isinstance(e, Alloc)]
    assert sum(e.launch == -1 for e in allocs) == 1  # part only: x, mask and the sums were made by launches
    assert not any(e.nbytes == 16 for e in allocs + rec.trace().events if isinstance(e, Alloc))  # unused
    assert not any(isinstance(e, Free) and e.obj not in {a.obj for a in allocs} for e in rec.events)


def test_layer_events_stop_and_restart_with_emit_layers():
    import torch

    from umrt.capture import Recorder
    from umrt.trace.events import LayerEnter

    got = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with Recorder(listeners=(got.append,), device="cpu", keep_events=False):
        model(torch.ones(2, 4))
        on = sum(isinstance(e, LayerEnter) for e in got)
        got.clear()
        rec_off = None
    assert on >= 2
    with Recorder(listeners=(got.append,), device="cpu", keep_events=False) as rec:
        rec.emit_layers(False)
        model(torch.ones(2, 4))
        rec_off = sum(isinstance(e, LayerEnter) for e in got)
        rec.emit_layers(True)
        model(torch.ones(2, 4))
        back = sum(isinstance(e, LayerEnter) for e in got)
    assert rec_off == 0 and back == on


def _phased_loop(rec, model, opt, *, eval_batches=3, how="no_grad"):
    """Two training steps, an evaluation of ``eval_batches`` batches (model.eval() and
    ``how``: no_grad, inference_mode, or eval mode alone), then two more steps."""
    def step():
        with rec.paused():
            x = torch.randn(8, 16)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with rec:
        step()
        step()
        model.eval()
        ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how)
        with ctx() if ctx else torch.enable_grad():
            for _ in range(eval_batches):
                x = torch.randn(8, 16)
                model(x).square().mean().item()
        model.train()
        step()
        step()


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "eval_mode"])
def test_an_evaluation_is_iterations_of_its_own_phase(how):
    model, opt = _mlp("cpu")
    rec = Recorder(steer=False)
    _phased_loop(rec, model, opt, eval_batches=3, how=how)
    tr = rec.trace()
    assert tr.iteration_phases() == ["train", "train", "eval", "eval", "eval", "train", "train"]
    # Each evaluation batch is one forward of the model, and no training iteration runs one in eval.
    spans = tr.iteration_spans()
    for (a, b), phase in zip(spans, tr.iteration_phases(), strict=True):
        roots = [e for e in tr.events[a:b] if isinstance(e, LayerEnter) and e.module == "" and e.phase == "forward"]
        backward = [e for e in tr.events[a:b] if isinstance(e, LayerEnter) and e.phase == "backward"]
        assert len(roots) == 1
        assert bool(backward) == (phase == "train")


def test_a_no_grad_forward_before_the_first_step_is_set_up_not_a_phase():
    model, opt = _mlp("cpu")
    rec = Recorder(steer=False)
    with rec:
        with torch.no_grad():
            model(torch.randn(8, 16))  # a sanity check before training: iteration 0's
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    assert rec.trace().iteration_phases() == ["train", "train"]


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_called_from_the_loop_is_part_of_the_training_step(reentrant):
    """Blocks checkpointed from the loop itself (no module around them): the reentrant checkpoint
    runs each block's forward with gradients off, on inputs that need them, and again inside the
    backward. Neither is an evaluation, nor opens an iteration (it took 8 steps for 60 iterations,
    most of them evaluation batches)."""
    from torch.utils.checkpoint import checkpoint

    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                     torch.nn.Linear(32, 16)) for _ in range(3))
    opt = torch.optim.SGD(blocks.parameters(), lr=0.01)
    rec = Recorder(steer=False)
    with rec:
        for _ in range(4):
            h = torch.randn(8, 16, requires_grad=True)
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=reentrant)
            h.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert rec.trace().iteration_phases() == ["train"] * 4


def test_a_frozen_teacher_run_without_gradients_is_part_of_the_training_step():
    """Distillation: every step runs a teacher no optimizer steps, in eval mode under
    ``no_grad``, before the student. That is the step's, not an evaluation (12 steps were
    reported as 34 iterations, a third of them evaluation batches). An evaluation of the
    student, or of the teacher with the student in eval mode, still is one."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    student = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    rec = Recorder(steer=False)
    with rec:
        for _ in range(3):
            x = torch.randn(8, 16)
            with torch.no_grad():
                target = teacher(x)
            (student(x) - target).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        student.eval()
        with torch.no_grad():
            for model in (student, teacher):
                model(torch.randn(8, 16)).sum().item()
        student.train()
        x = torch.randn(8, 16)
        with torch.no_grad():
            target = teacher(x)
        (student(x) - target).square().mean().backward()
        opt.step()
    assert rec.trace().iteration_phases() == ["train"] * 3 + ["eval"] * 2 + ["train"]


def test_stop_after_counts_training_steps_not_evaluation_batches():
    model, opt = _mlp("cpu")
    rec = Recorder(steer=False, stop_after=3)
    with pytest.raises(StopRecording):
        _phased_loop(rec, model, opt, eval_batches=4)
    assert rec.trace().iteration_phases().count("train") == 3


def test_training_resumes_at_the_first_op_that_writes_in_train_mode_after_an_evaluation():
    """A Lightning-style loop loads the next batch after its validation, before the
    forward: that batch belongs to the training step, as every other step's does."""
    model, opt = _mlp("cpu")
    rec = Recorder(steer=False)
    rows = [torch.randn(16) for _ in range(8)]

    def step():
        x = torch.stack(rows)  # the batch, collated on the device
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with rec:
        step()
        step()
        model.eval()
        with torch.no_grad():
            model(torch.stack(rows)).sum().item()
        model.train()
        step()
        step()
    tr = rec.trace()
    assert tr.iteration_phases() == ["train", "train", "eval", "train", "train"]
    starts = []
    for a, b in tr.iteration_spans():
        first = next(e for e in tr.events[a:b] if isinstance(e, Launch))
        starts.append(first.op)
    assert starts[1:] == ["aten::stack.default"] * 4, starts  # every step, after the evaluation too


def test_an_iterations_first_factory_op_is_no_parameter_because_the_models_first_one_was():
    """A script builds its model inside iteration 0 (``aten::empty`` for each parameter, in
    no module). A DataLoader's iterator later draws its 8-byte seed the same way
    (``torch.empty((), dtype=torch.int64).random_()``), the first such op of an evaluation
    batch: same execution id, same occurrence. Its size tells it apart from the parameter."""
    rec = Recorder(steer=False, mark_start=True)
    with rec:
        model, opt = _mlp("cpu")  # made while recording, as a script does
        for _ in range(2):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            for _ in range(2):
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                model(torch.full((8, 16), float(seed % 7))).sum().item()
        model.train()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    tr = rec.trace()
    assert tr.iteration_phases()[2:4] == ["eval", "eval"]
    seeds = [e for e in rec.events if isinstance(e, Alloc) and e.nbytes == 8]
    assert len(seeds) == 2
    assert all(e.kind is not Kind.PARAMETER for e in seeds), seeds
    params = {e.obj for e in tr.events if isinstance(e, Alloc) and e.kind is Kind.PARAMETER}
    assert len(params) == 4  # the model's two weights and two biases, nothing else


def test_a_data_loaders_host_side_work_stays_off_the_trace():
    """On a GPU a DataLoader's seed (8 bytes, each time an iterator is made) and its
    sampler's permutation stay in host memory; traced on the CPU they would be ops on the
    traced device at every epoch's start. Its batch is born written by a copy where the loop
    takes it, as a GPU run's is by its copy to the device. After the recorder closes,
    DataLoader is as torch made it."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data import dataloader as dl

    originals = (DataLoader.__iter__, dl._BaseDataLoaderIter._next_index, dl._SingleProcessDataLoaderIter._next_data)
    loader = DataLoader(TensorDataset(torch.randn(30, 16)), batch_size=5, shuffle=True)
    rec = Recorder(steer=False)
    with rec:
        model, opt = _mlp("cpu")
        for _ in range(2):  # two epochs: two iterators, two seeds
            for (x,) in loader:
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert (DataLoader.__iter__, dl._BaseDataLoaderIter._next_index, dl._SingleProcessDataLoaderIter._next_data) == originals
    tr = rec.trace()
    assert not [e for e in tr.events if isinstance(e, Alloc) and e.nbytes in (8, 30 * 8)]  # seed, permutation
    assert not [e for e in tr.events if isinstance(e, Launch) and e.op.startswith(("aten::random", "aten::randperm"))]
    copies = [e for e in tr.events if isinstance(e, Launch) and e.op == "aten::clone.default"]
    assert len(copies) == 12 and all(not e.reads for e in copies)  # a batch each, born written by its copy
    assert not [e for e in tr.events if isinstance(e, Launch) and e.op.startswith("aten::stack")]  # (host work)


def test_a_data_loader_laid_out_otherwise_is_recorded_as_before(monkeypatch):
    """A torch whose loader has no ``_next_index``: the recorder installs what it finds and runs."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data import dataloader as dl

    monkeypatch.delattr(dl._BaseDataLoaderIter, "_next_index")
    monkeypatch.setattr(dl._SingleProcessDataLoaderIter, "_next_data",
                        lambda self: self._dataset_fetcher.fetch(next(self._sampler_iter)))
    rec = Recorder(steer=False)
    with rec:
        batches = list(DataLoader(TensorDataset(torch.randn(6, 4)), batch_size=3))
    assert len(batches) == 2 and "_next_index" not in dl._BaseDataLoaderIter.__dict__


def test_a_step_the_grad_scaler_skips_still_ends_its_iteration():
    """fp16 training with a GradScaler: a step whose gradients overflow calls no
    optimizer step, and the iteration ends there all the same (not merged with the next)."""
    from umrt.capture.hooks import register_step_end_hook

    model, opt = _mlp("cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rec = Recorder(steer=False)
    overflow = {2}
    with rec:
        for i in range(5):
            x = torch.randn(8, 16)
            loss = model(x).square().mean()
            if i in overflow:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    tr = rec.trace()
    assert tr.iteration_phases() == ["train"] * 5
    ops = [[e.op for e in tr.events[a:b] if isinstance(e, Launch)] for a, b in tr.iteration_spans()]
    stepped = [any("adam" in op or "lerp" in op for op in it) for it in ops]
    assert stepped == [True, True, False, True, True], stepped
    # the wrapper is gone once no hook wants it
    original = torch.amp.GradScaler.__dict__["step"]
    handle = register_step_end_hook(lambda *a: None)
    assert torch.amp.GradScaler.__dict__["step"] is not original
    handle.remove()
    assert torch.amp.GradScaler.__dict__["step"] is original


def test_a_compiled_model_runs_eagerly_while_recording_and_fullgraph_does_not_raise(caplog):
    """torch.compile does not run under a dispatch mode (with ``fullgraph=True`` it raises):
    under the recorder compiled code runs eagerly, every op recorded, and the stance the
    program had comes back when the recorder exits."""
    from torch._dynamo import eval_frame

    model, opt = _mlp("cpu")
    compiled = torch.compile(model, fullgraph=True)
    rec = Recorder(steer=False)
    with caplog.at_level("WARNING", logger="umrt"), rec:
        for _ in range(3):
            compiled(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert eval_frame._stance.stance == "default"
    tr = rec.trace()
    assert tr.header.iterations == 3
    ops = {e.op for e in tr.launches()}
    assert "aten::addmm.default" in ops and any("adam" in op or "lerp" in op for op in ops), ops
    told = [r.message for r in caplog.records if "torch.compile" in r.message]
    assert len(told) == 1 and "Sequential" in told[0], told


def _accesses_are_to_live_objects(tr):
    alive = set()
    for e in tr.events:
        if isinstance(e, Alloc):
            alive.add(e.obj)
        elif isinstance(e, Free):
            alive.discard(e.obj)
        elif isinstance(e, Launch):
            assert all(a.obj in alive for a in e.accesses), e.op


def test_sparse_gradients_are_recorded_as_their_index_and_value_tensors():
    """``nn.Embedding(sparse=True)`` makes a sparse gradient, which has no storage of its
    own: its index and value tensors are what ops read and write (the recorder raised
    ``Cannot access storage of SparseTensorImpl`` into the script)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(1000, 16, sparse=True)
    head = torch.nn.Linear(16, 1)
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()))
    dense_opt = torch.optim.Adam(head.parameters())
    rec = Recorder(steer=False)
    with rec:
        for _ in range(3):
            head(emb(torch.randint(0, 1000, (32,)))).square().mean().backward()
            sparse_opt.step()
            dense_opt.step()
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
    tr = rec.trace()
    _accesses_are_to_live_objects(tr)
    ops = [e.op for e in tr.launches()]
    assert any("sparse" in op for op in ops), sorted(set(ops))
    assert any("coalesce" in op for op in ops), sorted(set(ops))


def test_a_torch_func_transform_inside_the_step_is_recorded():
    """Per-sample gradients with ``torch.func`` (``vmap`` over ``grad`` of a
    ``functional_call``): the module hooks see the transform's wrapped parameters,
    which have no storage (the recorder raised into the script)."""
    from torch.func import functional_call, grad, vmap

    model, opt = _mlp("cpu")

    def loss_one(params, x):
        return functional_call(model, params, (x.unsqueeze(0),)).square().mean()

    rec = Recorder(steer=False)
    with rec:
        for _ in range(3):
            params = {k: v.detach() for k, v in model.named_parameters()}
            per_sample = vmap(grad(loss_one), in_dims=(None, 0))(params, torch.randn(8, 16))
            for k, p in model.named_parameters():
                p.grad = per_sample[k].mean(0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    tr = rec.trace()
    assert tr.header.iterations == 3
    _accesses_are_to_live_objects(tr)
    assert sum(1 for _ in tr.launches()) > 30


def test_on_error_stop_ends_the_recording_and_never_the_program():
    """``on_error="stop"`` (a script's recorder): the recorder's own failure ends the
    recording, kept in ``failure`` with the op it was recording; the program runs on."""
    model, opt = _mlp("cpu")
    launches = []

    def fail_at_the_tenth(e):
        if isinstance(e, Launch):
            launches.append(e)
            if len(launches) == 10:
                raise RuntimeError("planted")

    rec = Recorder(steer=False, on_error="stop", listeners=[fail_at_the_tenth])
    losses = []
    with rec:
        for _ in range(3):
            loss = model(torch.randn(8, 16)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    assert len(losses) == 3
    assert rec.failure is not None and rec.failure.startswith("RuntimeError: planted (recording aten::")
    assert len(launches) == 10  # nothing recorded after it


def _fit(model, opt, loader, steps: int | None = None) -> None:
    """A regression loop over ``loader``'s ``(x, y)`` batches, ``steps`` of them at most."""
    for step, (x, y) in enumerate(loader, 1):
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == steps:
            break  # (before the loader fetches another)


def _loader_steps(workers: int):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model, opt = _mlp("cpu")
    loader = DataLoader(TensorDataset(torch.randn(96, 16), torch.randn(96, 4)), batch_size=8, num_workers=workers)
    rec = Recorder(steer=False)
    with rec:
        _fit(model, opt, loader)
    tr = rec.trace()
    shapes = []
    for a, b in tr.iteration_spans()[1:]:
        ops = [(type(e).__name__, getattr(e, "op", None), getattr(e, "nbytes", None), getattr(e, "launch", 0) >= 0)
               for e in tr.events[a:b] if isinstance(e, (Alloc, Launch))]
        shapes.append(tuple(("batch", *rest) if op == "aten::clone.default" else (kind, op, *rest)
                            for kind, op, *rest in ops))  # (a batch: copied where the loop takes it)
    return shapes


def test_batches_from_dataloader_workers_are_recorded_as_the_main_process_collating_them():
    """A DataLoader with worker processes: each batch arrives in shared memory, rebuilt
    whenever the worker's message comes (ahead, out of order), and iterations took turns
    holding two batches or none (12 of 16 learned in a probe). Each batch is now born
    written where the loop takes it, as collated in the main process (and as a GPU run's
    copy to the device makes it): every step records alike, and as with no workers."""
    with_workers = _loader_steps(2)
    assert len(with_workers) == 11 and len(set(with_workers)) == 1
    assert with_workers == _loader_steps(0)


def test_a_dataset_a_main_process_dataloader_collates_from_stays_off_the_trace():
    """On a GPU the dataset stays in host memory and each batch is born at its copy to the
    device; traced on the CPU, a main-process DataLoader's collation read the dataset, which
    made the whole dataset an object of device memory (its footprint, its faults) and the
    stacked batch an op's output. Now the fetch is kept off and each batch is recorded as
    copied where the loop takes it, as from worker processes."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 4))  # (as loaded from disk: no op made it)
    model, opt = _mlp("cpu")
    rec = Recorder(steer=False)
    with rec:
        _fit(model, opt, DataLoader(data, batch_size=8, shuffle=True), steps=6)
    tr = rec.trace()
    launches = [e for e in tr.events if isinstance(e, Launch)]
    assert not any(e.op.startswith("aten::stack") for e in launches)
    sizes = {e.nbytes for e in tr.events if isinstance(e, Alloc)}
    assert 4096 * 16 * 4 not in sizes and 4096 * 4 * 4 not in sizes  # the dataset is no object
    copies = [e for e in launches if e.op == "aten::clone.default"]
    assert len(copies) == 2 * 6 and all(not e.reads and len(e.writes) == 1 for e in copies)  # x and y, each step


def test_a_dataset_made_by_ops_while_recording_is_released_at_the_loaders_first_fetch():
    """A synthetic dataset (``torch.randn`` under the recorder) is an object of the trace from
    its making; on a GPU it is host memory the loop copies batches from. The loader's first
    fetch reads it: it is released there (its Free), and no launch after touches it."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model, opt = _mlp("cpu")
    rec = Recorder(steer=False)
    with rec:
        data = TensorDataset(torch.randn(512, 16), torch.randn(512, 4))  # (made by ops: traced objects)
        _fit(model, opt, DataLoader(data, batch_size=8), steps=4)
    tr = rec.trace()
    made = {e.obj for e in tr.events if isinstance(e, Alloc) and e.nbytes in (512 * 16 * 4, 512 * 4 * 4)}
    assert len(made) == 2  # the dataset's two tensors, made by ops
    first = next(i for i, e in enumerate(tr.events) if isinstance(e, IterationBoundary))
    freed = [i for i, e in enumerate(tr.events) if isinstance(e, Free) and e.obj in made]
    assert len(freed) == 2 and all(i < tr.iteration_spans()[1][0] for i in freed), (first, freed)
    touched = [e for e in tr.events[max(freed):] if isinstance(e, Launch) and {a.obj for a in e.accesses} & made]
    assert not touched


def test_a_dataset_on_the_traced_device_is_collated_by_recorded_kernels():
    """Traced on a device (here meta, as CUDA would be), a dataset the program put there is
    device memory: its collation is kernels reading it, recorded, and nothing of it is released."""
    from torch.utils.data import DataLoader, TensorDataset

    model, opt = _mlp("meta")
    data = TensorDataset(torch.randn(64, 16, device="meta"), torch.randn(64, 4, device="meta"))
    rec = Recorder(device="meta", steer=False)
    with rec:
        _fit(model, opt, DataLoader(data, batch_size=8))
    tr = rec.trace()
    stacks = [e for e in tr.events if isinstance(e, Launch) and e.op.startswith("aten::stack")]
    assert len(stacks) == 2 * 8 and all(e.reads for e in stacks)  # x and y, each batch, from the dataset
    dataset = {a.obj for e in stacks for a in e.reads}
    assert not [e for e in tr.events if isinstance(e, Free) and e.obj in dataset]


def test_writes_in_place_after_a_step_stay_in_it_and_an_evaluation_opens_its_own():
    """Gradients zeroed without being freed (``zero_grad(set_to_none=False)``) after the step,
    then an evaluation: the zeroing writes in place what is already there, so it ends the step
    instead of opening a training iteration of its own (one of a few ops, before each
    evaluation: 24 training iterations for 20 steps in a probe)."""

    def phases(set_to_none: bool) -> list[str]:
        model, opt = _mlp("cpu")
        rec = Recorder(steer=False)
        with rec:
            for step in range(4):
                model.train()
                model(torch.randn(8, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
                if step == 1:
                    model.eval()
                    with torch.no_grad():
                        model(torch.randn(8, 16)).sum().item()
        return rec.trace().iteration_phases()

    assert phases(False) == phases(True) == ["train", "train", "eval", "train", "train"]
