"""A tiny synthetic training loop as a trace, for tests and quick experiments.

Real traces come from :mod:`umrt.capture` or :mod:`umrt.zoo`; this builds
the same event shapes in microseconds: ``layers`` linear layers with
parameters, AdamW-like state, activations saved in forward and freed in
backward, a temporary per layer, gradients re-allocated every step
(``zero_grad(set_to_none=True)``), module boundaries and iteration
boundaries. Variations the runtime must survive are switches: sequence
length per step, gradient accumulation, eval steps between train steps.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from umrt.hardware import MIB
from umrt.trace.events import (
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
    execution_id,
)


class _Builder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.next_obj = 0
        self.seq = 0

    def alloc(self, nbytes: int, kind: Kind, *, host: bool = False) -> int:
        obj = self.next_obj
        self.next_obj += 1
        # launch -1: made on the host before recording (initialised data)
        self.events.append(Alloc(obj, nbytes, kind, -1 if host else self.seq))
        return obj

    def free(self, obj: int) -> None:
        self.events.append(Free(obj))

    def launch(self, op: str, module: str, shape: Sequence[int], reads: Iterable[tuple[int, int]],
               writes: Iterable[tuple[int, int]], flops: int) -> None:
        acc = tuple(Access(o, 0, n, False) for o, n in reads) + tuple(Access(o, 0, n, True) for o, n in writes)
        moved = sum(a.length for a in acc)
        eid = execution_id(op, [shape], ["float32"], module)
        self.events.append(Launch(self.seq, eid, op, acc, flops, moved, module))
        self.seq += 1


def training_trace(
    *,
    layers: int = 8,
    param_mb: int = 8,
    act_mb: int = 4,
    steps: int = 3,
    seqs: Sequence[int] | None = None,
    accum: int = 1,
    eval_every: int = 0,
    eval_batches: int = 0,
    flops_per_mb: int = 2 * 10**9,
    hold_batch: bool = False,
    two_optimizers: bool = False,
) -> Trace:
    """A trace of ``steps`` training iterations (see the module docstring).

    ``seqs`` gives each step's sequence length (activation size scales with
    it, and the shapes in execution ids change); ``accum`` micro-batches per
    step; with ``eval_every=k`` a forward-only eval pass runs before every
    k-th step, inside that step's iteration, or, with ``eval_batches=n``, as
    ``n`` iterations of the ``"eval"`` phase of their own (one forward each),
    as the recorder records an evaluation. With ``hold_batch`` a step's input lives on
    until the next step's has arrived, as in a loop that rebinds ``batch``: a step frees
    the one before it's input first (of that step's length). With ``two_optimizers`` the
    second half of the layers has an optimizer of its own, stepped after the first one's:
    each step is two iterations of two shapes (a step boundary each), the second reading
    gradients the first one's backward wrote.
    """
    b = _Builder()
    P, A = param_mb * MIB, act_mb * MIB
    params = [b.alloc(P, Kind.PARAMETER, host=True) for _ in range(layers)]
    states = [(b.alloc(P, Kind.OPTIMIZER_STATE, host=True), b.alloc(P, Kind.OPTIMIZER_STATE, host=True))
              for _ in range(layers)]
    grads: list[int] = []
    seqs = list(seqs) if seqs else [128] * steps
    index = 0
    held = None  # hold_batch: the last step's input
    for step in range(steps):
        s = seqs[step % len(seqs)]
        a = A * s // 128
        evaluates = eval_every and step % eval_every == eval_every - 1
        for _ in range(eval_batches if evaluates else 0):
            b.events.append(IterationBoundary(index, "eval"))
            index += 1
            for g in grads:  # zero_grad(set_to_none=True)
                b.free(g)
            grads = []
            _forward(b, params, a, s, flops_per_mb, P, train=False)
        b.events.append(IterationBoundary(index))
        index += 1
        for g in grads:  # zero_grad(set_to_none=True)
            b.free(g)
        grads = []
        if evaluates and not eval_batches:
            _forward(b, params, a, s, flops_per_mb, P, train=False)
        for _ in range(accum):
            x, acts = _forward(b, params, a, s, flops_per_mb, P, train=True, release=held)
            new = _backward(b, params, acts, x, a, s, flops_per_mb, grads, P, keep_input=hold_batch)
            held = x if hold_batch else None
            if not grads:
                grads = new
        for i in range(layers):
            if two_optimizers and i == layers // 2:
                b.events.append(IterationBoundary(index))
                index += 1
            m1, m2 = states[i]
            b.launch("aten::_fused_adamw_.default", "", (P,),
                     [(grads[i], P)], [(params[i], P), (m1, P), (m2, P)], 10 * P // 4)
    b.events.append(IterationBoundary(index))
    header = TraceHeader(1, "synthetic", "synthetic", "", "meta", index,
                         meta={"layers": layers, "seqs": seqs, "accum": accum})
    return Trace(header, b.events)


def _forward(b: _Builder, params, a, s, fpm, P, *, train: bool, release: int | None = None):
    x = b.alloc(a, Kind.INPUT)
    b.launch("aten::copy_.default", "", (s,), [], [(x, a)], 0)
    if release is not None:
        b.free(release)
    acts = []
    prev = x
    for i, p in enumerate(params):
        mod = f"layers.{i}"
        b.events.append(LayerEnter(mod, "forward"))
        out = b.alloc(a, Kind.ACTIVATION)
        tmp = b.alloc(a // 2, Kind.TEMPORARY)
        b.launch("aten::mm.default", mod, (s, i), [(prev, a), (p, P)], [(tmp, a // 2)], fpm * a // MIB)
        b.launch("aten::gelu.default", mod, (s,), [(tmp, a // 2)], [(out, a)], fpm * a // MIB // 8)
        b.free(tmp)
        b.events.append(LayerExit(mod, "forward"))
        if not train and prev is not x:
            b.free(prev)
        acts.append(out)
        prev = out
    b.launch("aten::sum.default", "", (s,), [(prev, a)], [], a)
    if not train:
        b.free(prev)
        b.free(x)
        return x, []
    return x, acts


def _backward(b: _Builder, params, acts, x, a, s, fpm, grads, P, *, keep_input: bool = False):
    new = []
    for i in reversed(range(len(params))):
        mod = f"layers.{i}"
        b.events.append(LayerEnter(mod, "backward"))
        g = grads[i] if grads else b.alloc(P, Kind.GRADIENT)
        inp = acts[i - 1] if i else x
        b.launch("aten::mm.default", mod + ".bwd", (s, i), [(acts[i], a), (inp, a), (params[i], P)],
                 [(g, P)], 2 * fpm * a // MIB)
        b.free(acts[i])
        b.events.append(LayerExit(mod, "backward"))
        new.append(g)
    if not keep_input:
        b.free(x)
    new.reverse()
    return new
