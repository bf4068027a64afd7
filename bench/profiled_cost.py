"""CPU cost of capturing a training step: ``python -m bench.profiled_cost``.

Times a CPU GPT-2 step (transformers' GPT2LMHeadModel, AdamW foreach) three
ways, each on a fresh copy of the same model: plain; under umrt's
dispatch-mode :class:`~umrt.capture.Recorder`; under the profiler-based
:class:`~umrt.capture.profiled.ProfiledCapture`, whose cost has two parts: the
step with the profiler on (what the program waits for while it runs), and the
read of the profile at the next iteration's start (stop, event tree,
conversion into umrt events). Costs are per launch (the capture's launches of
one iteration), over the median of ``--steps`` steps; intra-op threads are set
to 1 so that a shared machine disturbs the figures less.

A second figure isolates the per-op price of each observer: a loop of tiny
``x + y`` ops (one op, one allocation, one free each).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time


def _gpt2(layers: int, hidden: int, batch: int, seq: int):
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=8192,
                        n_positions=max(seq, 128), use_cache=False)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    return model, tokens


def _runner(template, tokens):
    import torch

    model = copy.deepcopy(template)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> None:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state made
    return model, opt, step


def _timed(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def measure_step(layers: int, hidden: int, batch: int, seq: int, steps: int) -> dict:
    """Per-step and per-launch costs of the three ways (seconds, microseconds)."""
    from umrt.capture import Recorder
    from umrt.capture.profiled import ProfiledCapture
    from umrt.trace.events import Launch

    template, tokens = _gpt2(layers, hidden, batch, seq)
    _, _, step = _runner(template, tokens)
    plain = statistics.median(_timed(step, steps))

    model, opt, step = _runner(template, tokens)
    rec = Recorder(model, opt, steer=False)
    with rec:
        recorded = statistics.median(_timed(step, steps))

    model, opt, step = _runner(template, tokens)
    cap = ProfiledCapture(model, opt, per_iteration=False)
    on, reads = [], []
    with cap:
        for _ in range(steps):
            on.append(_timed(step, 1)[0])
            t0 = time.perf_counter()
            cap.flush()  # what the next iteration's first forward does
            reads.append(time.perf_counter() - t0)
    launches = sum(isinstance(e, Launch) for e in cap.events) / steps
    profiled, read = statistics.median(on), statistics.median(reads)

    def per_launch(t: float) -> float:
        return round((t - plain) / launches * 1e6, 1)

    return {
        "config": {"layers": layers, "hidden": hidden, "batch": batch, "seq": seq},
        "launches_per_step": launches,
        "plain_ms": round(plain * 1e3, 2),
        "recorder_ms": round(recorded * 1e3, 2),
        "profiled_on_ms": round(profiled * 1e3, 2),
        "profiled_read_ms": round(read * 1e3, 2),
        "recorder_us_per_launch": per_launch(recorded),
        "profiled_on_us_per_launch": per_launch(profiled),
        "profiled_read_us_per_launch": round(read / launches * 1e6, 1),
    }


def measure_tiny_ops(n: int) -> dict:
    """Microseconds per tiny op: plain, profiler on (as the capture sets it), its
    read afterwards, and the Recorder's."""
    import torch
    from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
    from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState

    from umrt.capture import Recorder
    from umrt.capture.profiled import ProfileConverter, _experimental_config

    x, y = torch.randn(16), torch.randn(16)

    def loop() -> None:
        for _ in range(n):
            x + y

    def per_op(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) / n * 1e6

    loop()
    plain = per_op(loop)
    config = ProfilerConfig(ProfilerState.KINETO, True, True, False, False, False, _experimental_config()[0])
    _prepare_profiler(config, {ProfilerActivity.CPU})
    _enable_profiler(config, {ProfilerActivity.CPU})
    on = per_op(loop)
    t0 = time.perf_counter()
    result = _disable_profiler()
    conv = ProfileConverter("cpu", (False, True), allocator_events=False)
    conv.open_window()
    conv.convert(result.experimental_event_tree())
    read = (time.perf_counter() - t0) / n * 1e6
    with Recorder(steer=False, device="cpu"):
        recorded = per_op(loop)
    return {"ops": n, "plain_us": round(plain, 2), "profiled_on_us": round(on, 2),
            "profiled_read_us": round(read, 2), "recorder_us": round(recorded, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ops", type=int, default=20000, help="tiny ops timed in the per-op loop")
    args = parser.parse_args(argv)
    if min(args.layers, args.hidden, args.batch, args.seq, args.steps, args.ops) < 1:
        parser.error("all sizes must be positive")
    import torch

    torch.set_num_threads(1)
    out = {"step": measure_step(args.layers, args.hidden, args.batch, args.seq, args.steps),
           "tiny_ops": measure_tiny_ops(args.ops)}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
