"""Recording bench: what the Recorder costs per launch, and trace file speed.

    python -m bench.recording [--models gpt2,bert-base] [--batch 2] [--seq 128]
                              [--device meta] [--steps 3] [--repeat 5] [--out bench/out/recording.json]

For each model the same training steps run four ways, on the same device
and with the same meta/CPU steering (so the same ops run):

* ``plain`` — no dispatch mode at all;
* ``mode`` — an empty ``TorchDispatchMode`` that only forwards each op (the
  floor any Python-level recorder pays);
* ``recorder`` — the umrt :class:`~umrt.capture.Recorder` with module and
  optimizer hooks and full bookkeeping;
* ``hooks`` — the same Recorder with its ops suspended
  (:meth:`~umrt.capture.Recorder.suspend_ops`): module, backward-layer and
  optimizer hooks only, what the live runtime's steady state pays.

Per-launch cost = (time per step with the recorder, the empty mode or the hooks
- plain time per step) / launches per step (the recorder's count, for all
three, so they compare), in CPU time of this process (robust on a shared
machine); the best of ``--repeat`` runs is taken for each. The bench
also saves and loads the recorded trace and reports the file size and times.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from umrt.capture import Recorder, steer
from umrt.errors import UmrtError
from umrt.trace import fileformat
from umrt.trace.events import Launch
from umrt.zoo import _forward_kwargs, _loss, _quiet_transformers, build_model, make_inputs, resolve

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "recording.json"


class _Forward(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _steps(model, opt, spec, batch, seq, device, steps, rec=None) -> float:
    """Seconds per training step (inputs made off the clock)."""
    fwd = _forward_kwargs(spec)
    total = 0.0
    for _ in range(steps):
        if rec is not None:
            with rec.paused():
                inputs = make_inputs(spec, batch, seq, device)
        else:
            inputs = make_inputs(spec, batch, seq, device)
        t0 = time.process_time()
        out = model(**inputs, **fwd)
        _loss(out).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, inputs
        total += time.process_time() - t0
    return total / steps


def bench_model(name: str, batch: int, seq: int, device: str, steps: int, repeat: int) -> dict:
    spec = resolve(name)
    with _quiet_transformers():
        model = build_model(spec, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        with steer.steered():
            _steps(model, opt, spec, batch, seq, device, 1)  # warm-up: AdamW state, lazy imports
        plain_times, mode_times, rec_times, hook_times = [], [], [], []
        trace = None
        for _ in range(repeat):  # interleaved, so load from other processes hits all four alike
            with steer.steered():
                plain_times.append(_steps(model, opt, spec, batch, seq, device, steps))
                with _Forward():
                    mode_times.append(_steps(model, opt, spec, batch, seq, device, steps))
            rec = Recorder(model, opt, device=device, model_name=name, steer=True)
            with rec:
                rec_times.append(_steps(model, opt, spec, batch, seq, device, steps, rec))
            trace = rec.trace()
            hooks = Recorder(model, opt, device=device, model_name=name, steer=True)
            with hooks:
                if not hooks.suspend_ops():
                    raise UmrtError("the recorder's ops could not be suspended (another dispatch mode is on)")
                hook_times.append(_steps(model, opt, spec, batch, seq, device, steps, hooks))
        plain = min(plain_times)
    launches = sum(isinstance(e, Launch) for e in trace.events)
    per_step = launches / steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.umrt"
        t0 = time.process_time()
        fileformat.save(trace, path)
        t_save = time.process_time() - t0
        t0 = time.process_time()
        fileformat.load(path)
        t_load = time.process_time() - t0
        size = path.stat().st_size
    recorder, mode, hooks_s = min(rec_times), min(mode_times), min(hook_times)
    return {
        "model": name,
        "batch": batch,
        "seq": seq,
        "device": device,
        "steps": steps,
        "launches_per_step": per_step,
        "plain_s_per_step": plain,
        "mode_s_per_step": mode,
        "recorder_s_per_step": recorder,
        "hooks_s_per_step": hooks_s,
        "mode_us_per_launch": (mode - plain) / per_step * 1e6,
        "recorder_us_per_launch": (recorder - plain) / per_step * 1e6,
        "hooks_us_per_launch": (hooks_s - plain) / per_step * 1e6,
        "trace_events": len(trace.events),
        "file_bytes": size,
        "save_s": t_save,
        "load_s": t_load,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recording", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,bert-base")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--device", default="meta", choices=("meta", "cpu"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    try:
        rows = []
        for name in [m for m in args.models.split(",") if m]:
            seq = args.seq if resolve(name).task != "image-classification" else 224
            row = bench_model(name, args.batch, seq, args.device, args.steps, args.repeat)
            rows.append(row)
            print(
                f"{name:>12} {args.device}: {row['launches_per_step']:.0f} launches/step, "
                f"plain {row['plain_s_per_step'] * 1e3:.0f} ms, empty mode +{row['mode_us_per_launch']:.0f} us/launch, "
                f"recorder +{row['recorder_us_per_launch']:.0f} us/launch, "
                f"hooks only (ops suspended) +{row['hooks_us_per_launch']:.1f} us/launch; "
                f"file {row['file_bytes'] / 1024:.0f} KiB, "
                f"save {row['save_s'] * 1e3:.0f} ms, load {row['load_s'] * 1e3:.0f} ms",
                flush=True,
            )
    except UmrtError as exc:
        print(f"bench.recording: error: {exc}", file=sys.stderr)
        return exc.exit_code
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
