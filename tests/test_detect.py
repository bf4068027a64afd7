"""Iteration detection from repeating execution ids."""

from __future__ import annotations

import random

import torch

from umrt.capture import Recorder
from umrt.capture.detect import find_repeats, insert_boundaries
from umrt.trace.events import IterationBoundary, Launch, Trace, TraceHeader


def test_find_repeats_simple():
    rng = random.Random(1)
    setup = [rng.randrange(10**6, 2 * 10**6) for _ in range(17)]
    body = [rng.randrange(100) for _ in range(50)] + list(range(1000, 1010))
    ids = setup + body * 4 + [5, 6, 7]
    r = find_repeats(ids)
    assert r is not None and r.period == len(body) and r.count == 4
    assert r.start == len(setup)


def test_find_repeats_prefers_the_true_period_not_a_multiple():
    body = list(range(30))
    r = find_repeats(body * 6)
    assert r.period == 30 and r.count == 6


def test_find_repeats_none_without_repeats():
    assert find_repeats(list(range(100))) is None
    assert find_repeats([]) is None


def test_insert_boundaries_on_a_synthetic_trace():
    body = list(range(40))
    events = []
    for i, x in enumerate([999, 998] + body * 3):
        events.append(Launch(i, x, "aten::op.default", (), 0, 0, ""))
    hdr = TraceHeader(1, "0", "t", "t", "meta", 0)
    tr = insert_boundaries(Trace(hdr, events))
    assert [e.index for e in tr.events if isinstance(e, IterationBoundary)] == [0, 1, 2, 3]
    spans = tr.iteration_spans()
    assert len(spans) == 3 and all(b - a == 41 for a, b in spans)


def test_recorder_without_step_marks_detects_iterations():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, opt, auto_step=False, mark_start=False)
    with rec:
        for _ in range(4):
            with rec.paused():
                x = torch.randn(8, 16, device="meta")
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x
    tr = rec.trace()
    assert tr.header.iterations >= 3
    per_iter = {sum(isinstance(e, Launch) for e in tr.events[a:b]) for a, b in tr.iteration_spans()}
    assert len(per_iter) == 1
    # aligned on the model's forward: each iteration starts with the root module's entry
    for a, _ in tr.iteration_spans():
        assert type(tr.events[a + 1]).__name__ in ("LayerEnter", "Alloc")


def test_teardown_frees_stay_outside_the_last_detected_iteration():
    from umrt.trace.stats import summarize

    rec = Recorder(device="meta", mark_start=False)
    with rec:
        w = torch.randn(64, 32, device="meta", requires_grad=True)
        for _ in range(4):
            with rec.paused():
                x = torch.randn(8, 64, device="meta")
            (x @ w).relu().sum().backward()
            with torch.no_grad():
                w -= 0.1 * w.grad
            w.grad = None
        del w, x  # the program tears down
    tr = rec.trace()
    assert tr.header.iterations >= 3
    assert summarize(tr)["end_live_bytes"] >= 64 * 32 * 4


def test_detection_recovers_the_recorded_iterations_of_a_transformer():
    from umrt.zoo import trace_model

    tr = trace_model(
        "hf:GPT2Config:n_layer=2,n_embd=32,n_head=2,vocab_size=128,n_positions=32", batch=2, seq=8, steps=4
    )
    a, b = tr.iteration_spans()[-1]
    truth = [e.exec_id for e in tr.events[a:b] if isinstance(e, Launch)]
    stripped = Trace(tr.header, [e for e in tr.events if not isinstance(e, IterationBoundary)])
    found = insert_boundaries(stripped)
    spans = found.iteration_spans()
    assert len(spans) >= 3  # the first iteration also builds AdamW's state, so it may not repeat
    a, b = spans[-1]
    assert [e.exec_id for e in found.events[a:b] if isinstance(e, Launch)] == truth
