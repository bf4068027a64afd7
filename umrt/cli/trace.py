"""``umrt trace``: record traces and inspect trace files.

umrt trace --model gpt2-xl --device meta --steps 3 -o gpt2-xl.umrt
umrt trace -o train.umrt --steps 3 -- python train.py --lr 1e-4
umrt trace info gpt2-xl.umrt [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from umrt.config import format_bytes
from umrt.console import console as umrt_console
from umrt.errors import ConfigError, UmrtError
from umrt.paths import check_writable
from umrt.scripts import run_module, run_script
from umrt.trace.events import IterationBoundary
from umrt.trace.stats import summarize


class ScriptFailed(UmrtError):
    """The traced script raised; its traceback was printed above."""

    exit_code = 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "trace",
        help="record a training trace (zoo model or your script), or inspect a trace file",
        description=(
            "Record a training trace of a zoo model (--model) or of the first steps of any script "
            "(-- python train.py ...), or show what a trace file holds (trace info FILE)."
        ),
        epilog=(
            "examples:\n"
            "  umrt trace --model gpt2-xl --device meta --steps 3 -o gpt2-xl.umrt\n"
            "  umrt trace --model hf:LlamaConfig:num_hidden_layers=8,hidden_size=2048 -o llama.umrt\n"
            "  umrt trace -o train.umrt --steps 3 -- python train.py --lr 1e-4\n"
            "  umrt trace info gpt2-xl.umrt --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        help="zoo model (gpt2, gpt2-medium, gpt2-large, gpt2-xl, bert-base, bert-large, "
        "vit-large, resnet-152) or hf:ConfigClass:key=value,...",
    )
    p.add_argument("--batch", type=int, help="batch size (default: the model's paper-like default)")
    p.add_argument("--seq", type=int, help="sequence length, or image side for vision models")
    p.add_argument(
        "--device",
        choices=("meta", "cpu", "cuda"),
        help="whose memory to trace: a zoo model runs there (default meta: no memory touched); a script "
        "runs where it chooses, and by default the device it uses is traced",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="training steps (optimizer steps) to record (default 3); the first builds the model and the "
        "optimizer's state, the ones after it repeat",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="zoo model training precision (default float32, as the papers umrt compares with; "
        "bfloat16/float16: the whole model in that dtype)",
    )
    p.add_argument("-o", "--output", help="trace file to write (default MODEL.umrt or trace.umrt)")
    p.add_argument("--json", action="store_true", help="trace info: print JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="info FILE | -- python SCRIPT [ARGS]",
        help="inspect a trace file, or trace a script (everything after -- is the command that runs it)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rest = list(args.rest or [])
    if rest and rest[0] == "info":
        return _info(rest[1:], args.json)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if rest:
        if args.model:
            raise ConfigError("give either --model or a script after --, not both")
        if args.batch is not None or args.seq is not None:
            raise ConfigError("--batch and --seq apply to --model only; a script chooses its own shapes")
        _check_output(args.output or "trace.umrt")
        return _trace_script(rest, args)
    if not args.model:
        raise ConfigError("nothing to trace: give --model NAME, '-- python script.py', or 'info FILE'")
    return _trace_zoo(args)


def _check_steps(steps: int) -> None:
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")


def _trace_zoo(args: argparse.Namespace) -> int:
    # optional: trace files need numpy; not for `umrt --help`
    from umrt.trace import fileformat

    # optional: torch: not for `umrt --help`
    from umrt.zoo import trace_model

    _check_steps(args.steps)
    out = args.output or _default_name(args.model)
    _check_output(out)
    t0 = time.perf_counter()
    trace = trace_model(
        args.model,
        batch=args.batch,
        seq=args.seq,
        device=args.device or "meta",
        steps=args.steps,
        progress=not args.quiet and sys.stderr.isatty(),
        dtype=args.dtype,
    )
    fileformat.save(trace, out)
    if not args.quiet:
        _report(trace, out, time.perf_counter() - t0)
    return 0


def _check_output(path: str) -> None:
    """Fail before a long recording, not after it, when the output cannot be written."""
    check_writable(path)


def _default_name(model: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return f"{safe[:80]}.umrt"


def _trace_script(cmd: list[str], args: argparse.Namespace) -> int:
    # optional: torch: not for `umrt --help`
    from umrt.capture import StopRecording

    # optional: torch: not for `umrt --help`
    from umrt.capture.recorder import not_recorded, script_recorder

    # optional: trace files need numpy; not for `umrt --help`
    from umrt.trace import fileformat

    # optional: torch: not for `umrt --help`
    from umrt.zoo import progress_bar

    _check_steps(args.steps)
    if Path(cmd[0]).name.startswith("python"):
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("no script given after --")
    module = None
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise ConfigError("-m needs a module name")
        module, argv = cmd[1], cmd[1:]
    else:
        script = Path(cmd[0])
        if not script.is_file():
            raise ConfigError(f"script not found: {cmd[0]!r}")
        argv = cmd
    out = args.output or "trace.umrt"
    t0 = time.perf_counter()
    rec = script_recorder(cmd, steps=args.steps, device=args.device)
    with (
        progress_bar(not args.quiet and sys.stderr.isatty(), "recording steps", args.steps) as advance,
        rec,
    ):
        rec.listeners.append(lambda e: advance() if isinstance(e, IterationBoundary) and e.index > 0 else None)
        try:
            if module is not None:
                status = run_module(module, argv[1:], passthrough=(StopRecording,))
            else:
                status = run_script(argv[0], argv[1:], passthrough=(StopRecording,))
        except StopRecording:
            status = 0  # recorded the steps asked for
    if rec.failure is not None:
        raise UmrtError(not_recorded(rec.failure, "no trace was written"))
    if status:
        raise ScriptFailed(f"the script exited with status {status} before the trace was complete; "
                           "no trace written")
    trace = rec.trace()
    if not trace.iteration_spans():
        n = sum(isinstance(e, IterationBoundary) for e in trace.events)
        raise UmrtError(
            f"no complete iteration recorded ({n} optimizer step(s) seen; the first one only ends set-up): "
            "does the script call optimizer.step() at least twice?"
        )
    fileformat.save(trace, out)
    if not args.quiet:
        _report(trace, out, time.perf_counter() - t0)
    return 0


def _report(trace: Any, path: str, seconds: float) -> None:
    s = summarize(trace)
    print(
        f"wrote {path}: {s['iterations']} iterations, {s['ops_per_iteration']} launches/iteration, "
        f"peak live {format_bytes(s['peak_live_bytes'])}, end live {format_bytes(s['end_live_bytes'])} "
        f"({seconds:.1f} s, {format_bytes(os.path.getsize(path))} file)"
    )


def _info(argv: list[str], as_json: bool) -> int:
    # optional: trace files need numpy; not for `umrt --help`
    from umrt.trace import fileformat

    p = argparse.ArgumentParser(prog="umrt trace info", description="Show what a trace file holds.")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    try:
        ns = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    trace = fileformat.load(ns.file)
    s = summarize(trace)
    h = trace.header
    s["header"] = {
        "format_version": h.format_version,
        "umrt_version": h.umrt_version,
        "model": h.model,
        "torch_version": h.torch_version,
        "device": h.device,
        "iterations": h.iterations,
        "notes": h.notes,
        "meta": h.meta,
    }
    if as_json or ns.json:
        try:
            print(json.dumps(s, indent=2, default=str), flush=True)
        except BrokenPipeError:  # e.g. piped into head
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    from rich.table import Table

    t = Table(title=f"{ns.file}", show_header=False, title_justify="left")
    t.add_row(
        "model",
        f"{h.model} ({h.device}, torch {h.torch_version}, umrt {h.umrt_version}, format v{h.format_version})",
    )
    if h.meta:
        t.add_row("meta", ", ".join(f"{k}={v}" for k, v in h.meta.items()))
    t.add_row("iterations", str(s["iterations"]))
    t.add_row("launches / iteration", f"{s['ops_per_iteration']:,}")
    t.add_row("objects", f"{s['objects']:,}")
    t.add_row("peak live", format_bytes(s["peak_live_bytes"]))
    t.add_row("end live", format_bytes(s["end_live_bytes"]))
    t.add_row("FLOPs / iteration", f"{s['flops_per_iteration'] / 1e12:.3f} TFLOP")
    total = s["flops_per_iteration"] or 1
    if s["flops_by_precision"]:
        t.add_row("  by precision", ", ".join(f"{p} {100 * f / total:.1f}%" for p, f in s["flops_by_precision"].items()))
    t.add_row("bytes moved / iteration", format_bytes(s["bytes_moved_per_iteration"]))
    for k, v in s["bytes_by_kind"].items():
        if v:
            t.add_row(f"  peak {k}", f"{format_bytes(v)} ({s['objects_by_kind'][k]} objects)")
    console = umrt_console()
    console.print(t)
    if h.notes:
        console.print("[bold]known differences from a CUDA run[/bold]")
        for n in h.notes:
            console.print(f"  - {n}", highlight=False)
    return 0
