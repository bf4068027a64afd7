"""Measured iteration times on a real GPU: ``python -m bench.gpu``.

Trains one zoo model (default GPT-2 at its zoo batch and sequence length;
``umrt.zoo.build_model`` / ``make_inputs``, AdamW(foreach=True), the loop of
``examples/train_gpt2.py``) several ways, each in its own subprocess because
torch's allocator can be swapped only once per process:

``ideal``
    plain torch (cudaMalloc, PyTorch's caching allocator); the model must fit.
    Its peak allocated bytes are the run's peak live bytes (``--gpu-memory 50%peak``),
    its peak reserved bytes what PyTorch's caching allocator needs.
``um``
    ``umrt.enable(policy="um")``: every allocation in managed memory through
    umrt's pool, no prefetching policy. Its pool's peak reserved bytes are what
    umrt's pool needs. **The footprint** a percentage ``--gpu-memory 50%``
    refers to is the larger of the two, as the simulator's footprint is the
    larger of its model of each (:mod:`umrt.sim.budget`).
``umrt``
    ``umrt.enable(gpu_memory=BYTES)``: the default policy, once per
    ``--gpu-memory`` (repeat the flag to measure several side by side).
``checkpoint``
    what a user picks instead: plain torch with the model's own activation
    checkpointing (``gradient_checkpointing_enable()``, as
    ``../shared/gpu-probes/alternatives.py`` runs it). Its peak allocated bytes
    are what ``--gpu-memory checkpoint`` refers to, so
    ``--modes ideal,checkpoint,um,umrt --gpu-memory checkpoint`` puts umrt and
    checkpointing side by side at the same peak, in one run.

Every mode trains on the same batches and dropout masks (step ``s`` seeds
torch with ``SEED + s``) from the same initial weights, so each step's loss is
compared with plain PyTorch's. Each step is shown as it completes (time, loss,
bytes and CUDA calls umrt issued, NVML's PCIe bytes, the pool's size), and a
watchdog stops a mode that exceeds ``--timeout`` or makes no progress for
``--stall`` seconds: it shows the Python stacks of the mode's threads and goes
on with the next mode (:mod:`bench.gpu_watch`).

Oversubscription is emulated with umrt's budget (``gpu_memory``), never by
asking for more managed memory than the device has free (issue 5): the run is
refused when the ideal peak does not fit in the device's free memory. Note
that the driver itself evicts only when device memory is full, so under
``um`` the budget puts no pressure on the driver: ``um`` measures managed
memory's own cost (first-touch faults, the pool, the event recorder), not a
driver thrashing at the budget. ``umrt`` keeps itself within the budget.

The steady-state iteration time is the median of the ``--steps`` timed steps
after ``--warmup`` untimed ones (the runtime learns and plans in its first
iterations); bytes and calls per step are means over the timed steps. Beside
the measured figures: ``umrt.memory_stats()``, NVML telemetry (peak device
memory used; PCIe bytes from NVML's byte counters, :class:`bench.gpu_measure.PcieCounters`),
issue 10's targets (:func:`bench.gpu_measure.check_targets`, reported, not
asserted), and the simulator's prediction for the same model and budget on
the shipped hardware profile closest to the detected GPU
(``umrt.sim.replay.simulate`` on a meta trace from ``umrt.zoo.trace_model``,
cached like the bench grid's).

Without a CUDA GPU it exits with status 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu_measure import (
    BenchError,
    BudgetSpec,
    PcieCounters,
    TargetCheck,
    check_losses,
    check_targets,
    compare_losses,
    read_counters,
    steady_per_step,
    steady_time,
)
from bench.gpu_watch import StepRecord, Watchdog, format_step, install_stack_dump, supervise
from umrt.cli import PlainHelpParser, Renamed
from umrt.config import format_bytes
from umrt.policy.runtime import Runtime

__all__ = ["BenchError", "main", "run", "steady_time"]

MODES = ("ideal", "checkpoint", "um", "umrt")
DEFAULT_MODES = ("ideal", "um", "umrt")
#: Untimed steps: until umrt's runtime acts in its steady state (learned, probed, swap or migrate tried).
DEFAULT_WARMUP = Runtime().warmup_iterations
DEFAULT_BUDGET = "50%"
# Managed memory umrt's pool may hold beyond the ideal peak (2 MB rounding,
# segments): the device must have this much more free than the ideal peak.
HEADROOM = 1.25
SEED = 1000  # step s trains on torch.manual_seed(SEED + s)'s batch and dropout masks, in every mode
DEFAULT_STALL = 300.0  # seconds without a finished step (umrt's first steps took 49-50 s on an H100)
_TORCH_DEVICE = "cuda"  # the workers' torch device (a unit test runs the loop on the CPU)


# ---------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = PlainHelpParser(
        prog="python -m bench.gpu",
        description="Measure ideal / um / umrt iteration times of a real training loop on this GPU.",
    )
    p.add_argument("--model", default="gpt2", help="zoo name or hf:ConfigClass:k=v,... (default gpt2)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the zoo's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length / image side (default: the zoo's)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"untimed steps first (default {DEFAULT_WARMUP}: umrt's learning, probing and path trial)")
    p.add_argument("--gpu-memory", action="append", default=None, metavar="AMOUNT", dest="budget",
                   help="GPU memory umrt may use: a percentage of the footprint the run needs (50%%: the larger "
                        "of the ideal run's peak reserved bytes and umrt's pool's in the um run), of the ideal "
                        "run's peak allocated bytes (50%%peak) or of the GPU's memory (90%%device), or a size "
                        "(7.5GiB, a byte count), or the checkpoint run's peak (checkpoint). Repeat to measure umrt at several "
                        f"(default {DEFAULT_BUDGET.replace('%', '%%')})")
    p.add_argument("--budget", action=Renamed, dest="budget", new="--gpu-memory", append=True, prefix="bench.gpu")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated subset of ideal,checkpoint,um,umrt (default ideal,um,umrt)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--profile", default=None,
                   help="hardware profile for the simulated column (default: closest to the GPU)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulated prediction")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode (default 1800)")
    p.add_argument("--stall", type=float, default=DEFAULT_STALL,
                   help=f"stop a mode that finishes no step for this many seconds (default {DEFAULT_STALL:g})")
    p.add_argument("--strict", action="store_true",
                   help="run umrt with UMRT_STRICT: a mode whose runtime stops acting fails")
    p.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)  # the workers on the CPU
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--budget-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def budget_specs(args: argparse.Namespace) -> list[BudgetSpec]:
    """The ``--budget`` flags, parsed, in order, without repeats (default 50%)."""
    texts = list(dict.fromkeys(args.budget or [DEFAULT_BUDGET]))
    return [BudgetSpec.parse(t) for t in texts]


def validate(args: argparse.Namespace) -> list[str]:
    """Check the arguments without touching CUDA; return the modes to run."""
    for name in ("batch", "seq"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise BenchError(f"--{name} must be a positive integer, got {v}")
    if args.steps < 1:
        raise BenchError(f"--steps must be a positive integer, got {args.steps}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if args.device < 0:
        raise BenchError(f"--device must be >= 0, got {args.device}")
    if args.timeout <= 0:
        raise BenchError(f"--timeout must be positive, got {args.timeout}")
    if args.stall <= 0:
        raise BenchError(f"--stall must be positive, got {args.stall}")
    specs = budget_specs(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise BenchError(f"--modes {args.modes!r}: use a comma-separated subset of {','.join(MODES)}")
    if any(m != "ideal" for m in modes) and "ideal" not in modes and any(b.kind == "peak" for b in specs):
        raise BenchError("a percentage of the ideal run's peak (--gpu-memory ...%peak) needs it: keep ideal in "
                         "--modes or give a size (e.g. 8GiB)")
    if "umrt" in modes and not {"ideal", "um"} <= set(modes) and any(b.kind == "footprint" for b in specs):
        raise BenchError("a percentage of the footprint (--gpu-memory 50%) is measured by the ideal and um runs: "
                         "keep both in --modes or give a size (e.g. 8GiB)")
    for b in specs if args.budget else ():  # what an old spelling the user wrote means now (not the default)
        if b.note:
            print(f"bench.gpu: note: {b.note}", file=sys.stderr)
    if "umrt" in modes and "checkpoint" not in modes and any(b.kind == "checkpoint" for b in specs):
        raise BenchError("--gpu-memory checkpoint is the checkpoint run's peak: keep checkpoint in --modes "
                         "or give a size (e.g. 8GiB)")
    from umrt.errors import ConfigError
    from umrt.zoo import resolve

    try:
        resolve(args.model)  # a zoo name or an hf: spec that builds
    except ConfigError as exc:
        raise BenchError(str(exc)) from None
    if args.profile is not None:
        from umrt.hardware import PROFILES

        if args.profile not in PROFILES and not Path(args.profile).is_file():
            raise BenchError(f"unknown --profile {args.profile!r}; known: {', '.join(PROFILES)} or a JSON file")
    return list(dict.fromkeys(m for m in MODES if m in modes))


def require_gpu() -> None:
    """Raise :class:`BenchError` unless a CUDA device and a CUDA build of torch are present."""
    from umrt.api import gpu_count

    if gpu_count() == 0:
        raise BenchError("no CUDA GPU found: bench.gpu measures on a real GPU "
                         "(use `python -m bench` for the simulated grid)")
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        raise BenchError("torch is a CPU build (or cannot see the GPU): install a CUDA build of torch")


# ---------------------------------------------------------------- the worker (one mode per process)


def _pci_bus_id(device: int) -> str | None:
    try:
        import cupy

        return str(cupy.cuda.runtime.deviceGetPCIBusId(device))
    except Exception:  # noqa: BLE001 - NVML then goes by index
        return None


def _start_pcie(device: int) -> tuple[PcieCounters | None, Any, str | None]:
    """NVML's PCIe counters of ``device``: (counters, the pynvml module to shut down, a note)."""
    try:
        import pynvml
    except ImportError:
        return None, None, "no NVML PCIe figures (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - pynvml.NVMLError and friends
        return None, None, f"no NVML PCIe figures ({exc})"
    try:
        bus = _pci_bus_id(device)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus) if bus else pynvml.nvmlDeviceGetHandleByIndex(device)
    except Exception as exc:  # noqa: BLE001
        pynvml.nvmlShutdown()
        return None, None, f"no NVML PCIe figures ({exc})"
    return PcieCounters(pynvml, handle).start(), pynvml, None


def step_record(step: int, seconds: float, timed: bool, loss: float | None, counted: Any, pcie: Any,
                stats: dict[str, Any] | None) -> StepRecord:
    """The progress record of one step: ``counted`` is umrt's counters over the step
    (a :class:`~bench.gpu_measure.Counters` or None), ``pcie`` NVML's (h2d, d2h) bytes
    over it or None, ``stats`` ``umrt.memory_stats()`` after it (None: no umrt)."""
    rec = StepRecord(step, seconds, timed, loss)
    if counted is not None:
        rec.h2d_bytes, rec.d2h_bytes, rec.discarded_bytes = counted.h2d_bytes, counted.d2h_bytes, counted.discarded_bytes
        rec.calls = None if counted.calls is None else dict(counted.calls)
    if pcie is not None:
        rec.pcie_h2d_bytes, rec.pcie_d2h_bytes = pcie
    if stats is not None:
        rec.reserved_bytes = int(stats.get("reserved_bytes", 0))
        rec.acting, rec.stopped_reason = stats.get("acting"), stats.get("stopped_reason")
    return rec


def _print_step(rec: StepRecord) -> None:
    print(rec.to_line(), flush=True)


def run_worker(mode: str, args: argparse.Namespace, emit: Any = _print_step) -> dict[str, Any]:
    """Train ``args.warmup + args.steps`` steps in this process under ``mode``; time each
    step and ``emit`` a :class:`~bench.gpu_watch.StepRecord` as each one completes."""
    import io

    import torch

    from umrt.telemetry import Sampler
    from umrt.zoo import build_model, forward_kwargs, make_inputs, quiet_transformers, resolve, training_loss

    dry = bool(getattr(args, "dry_run_cpu", False))
    device = "cpu" if dry else _TORCH_DEVICE
    result: dict[str, Any] = {"mode": mode, "notes": []}
    session = None
    plain = mode in ("ideal", "checkpoint")  # plain torch: PyTorch's caching allocator, no umrt
    if not plain:
        import umrt

        session = umrt.enable(policy=mode, gpu_memory=int(args.budget_bytes) or "100%", device=args.device,
                              strict=bool(getattr(args, "strict", False)))
        if not session.active:
            raise BenchError(f"umrt did not start ({'; '.join(session.notes)})")
        result["notes"] += list(session.notes)
    if dry:
        result["gpu"] = {"name": "CPU (dry run)", "total_bytes": 0, "free_bytes_at_start": 0,
                         "capability": "-", "torch": torch.__version__, "cuda": None}
    else:
        torch.cuda.set_device(args.device)
        props = torch.cuda.get_device_properties(args.device)
        free, total = torch.cuda.mem_get_info(args.device)
        result["gpu"] = {"name": props.name, "total_bytes": int(total), "free_bytes_at_start": int(free),
                         "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
                         "cuda": torch.version.cuda}
    spec = resolve(args.model)
    batch = spec.default_batch if args.batch is None else args.batch
    seq = spec.default_seq if args.seq is None else args.seq
    if spec.task == "image-classification" and isinstance(getattr(spec.config, "image_size", None), int):
        spec.config.image_size = seq

    def sync() -> None:
        if not dry:
            torch.cuda.synchronize(args.device)

    pcie, nvml, note = (None, None, "CPU dry run: no NVML") if dry else _start_pcie(args.device)
    if note:
        result["notes"].append(note)
    backend = session.backend if session is not None else None
    times: list[float] = []
    losses: list[float] = []
    records: list[StepRecord] = []
    sampler = None
    try:
        with quiet_transformers():
            torch.manual_seed(0)  # the same initial weights in every mode
            model = build_model(spec, device)
            if mode == "checkpoint":
                if not getattr(model, "supports_gradient_checkpointing", False):
                    raise BenchError(f"{args.model} has no activation checkpointing of its own "
                                     "(transformers' gradient_checkpointing_enable)")
                model.gradient_checkpointing_enable()  # as ../shared/gpu-probes/alternatives.py
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            fwd = forward_kwargs(spec)
            for step in range(args.warmup + args.steps):
                torch.manual_seed(SEED + step)  # the same batch and dropout masks in every mode
                inputs = make_inputs(spec, batch, seq, device)  # the loader's work, outside the timing
                if step == args.warmup and not dry:  # peaks stay whole-run, as the simulator's budget base
                    sampler = Sampler(args.device, pci_bus_id=_pci_bus_id(args.device), out=io.StringIO()).start()
                sync()
                c0, p0 = read_counters(backend), pcie.read() if pcie is not None else None
                t0 = time.perf_counter()
                loss = training_loss(model(**inputs, **fwd))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync()
                dt = time.perf_counter() - t0
                c1, p1 = read_counters(backend), pcie.read() if pcie is not None else None
                value = float(loss.detach())
                losses.append(value)
                if step >= args.warmup:
                    times.append(dt)
                rec = step_record(step, dt, step >= args.warmup, value,
                                  c1.minus(c0) if c0 is not None and c1 is not None else None,
                                  (p1[0] - p0[0], p1[1] - p0[1]) if p0 is not None and p1 is not None else None,
                                  umrt.memory_stats() if session is not None else None)
                records.append(rec)
                emit(rec)
                del loss, inputs
    finally:
        if pcie is not None:
            pcie.stop()
            result["pcie_source"] = pcie.source
            result["notes"] += pcie.notes
            nvml.nvmlShutdown()
    summary = sampler.stop() if sampler is not None else None
    steps = [dataclasses.asdict(r) for r in records]
    result.update(batch=batch, seq=seq, step_times_s=times, losses=losses, steps=steps,
                  per_step=steady_per_step(steps))
    if plain:
        if not dry:
            result["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(args.device))
            result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(args.device))
    else:
        result["memory_stats"] = umrt.memory_stats()
        result["budget_bytes"] = int(session.budget_bytes)
        result["pool_peak_reserved_bytes"] = max((r.reserved_bytes or 0 for r in records), default=0)
        reason = result["memory_stats"].get("stopped_reason")
        if reason:
            result["notes"].append(f"the runtime stopped acting: {reason}")
        events = getattr(session.runtime, "events", None)
        if events is not None:
            result["runtime_events"] = int(events)
        # What the policy did (umrt: iterations learned / acted / acted without launches,
        # deviations, late decisions, moves): the first thing to read on a real GPU.
        report = getattr(getattr(session.runtime, "policy", None), "report", None)
        if callable(report):
            result["policy_report"] = {k: v for k, v in report().items() if not isinstance(v, dict)}
    if summary is not None:
        result["telemetry"] = {
            "samples": summary.samples, "peak_used_bytes": summary.peak_used_bytes,
            "total_bytes": summary.total_bytes, "h2d_bytes": summary.rx_bytes, "d2h_bytes": summary.tx_bytes,
            "peak_h2d_rate": summary.peak_rx_rate, "peak_d2h_rate": summary.peak_tx_rate,
            "notes": list(summary.notes),
        }
    return result


def _worker_main(args: argparse.Namespace) -> int:
    install_stack_dump()  # the parent's watchdog asks for the stacks of a mode that hangs
    try:
        result = run_worker(args.worker, args)
    except BenchError as exc:
        print(f"bench.gpu: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the parent reports the mode as failed, with this line
        oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
        print(f"bench.gpu {args.worker}: {'out of memory: ' if oom else ''}{type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 3
    Path(args.out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- the parent


def _child_env() -> dict[str, str]:
    """The environment without UMRT_* (the .pth hook must not switch umrt on in the ideal run)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("UMRT")}


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def run_mode(mode: str, args: argparse.Namespace, budget_bytes: int, workdir: Path, *,
             label: str | None = None, console: Any = None) -> dict[str, Any]:
    """One mode in a fresh subprocess, each step shown as it completes, under a
    :class:`~bench.gpu_watch.Watchdog` (``--timeout``, ``--stall``); a failure or a
    time-out is recorded, never raised."""
    label = label or mode
    console = console or _console()
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
    out = workdir / f"{stem}.json"
    cmd = [sys.executable, "-m", "bench.gpu", "--worker", mode, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", str(args.device),
           "--budget-bytes", str(budget_bytes), "--out", str(out)]
    if args.batch is not None:
        cmd += ["--batch", str(args.batch)]
    if args.seq is not None:
        cmd += ["--seq", str(args.seq)]
    if getattr(args, "strict", False):
        cmd.append("--strict")
    if getattr(args, "dry_run_cpu", False):
        cmd.append("--dry-run-cpu")
    total = args.warmup + args.steps
    budget = f", budget {format_bytes(budget_bytes)}" if mode == "umrt" else ""
    console.print(f"[bold]{label}[/bold]: {args.warmup} warm-up + {args.steps} timed steps{budget} "
                  f"(limit {args.timeout:g} s, {args.stall:g} s without a step)")
    said: list[str] = []

    def on_step(rec: StepRecord) -> None:
        console.print(format_step(label, rec, total), markup=False)
        if rec.acting is False and rec.stopped_reason and not said:
            said.append(rec.stopped_reason)
            console.print(f"[red]{label}: umrt stopped acting at step {rec.step}: {rec.stopped_reason}[/red]")

    def on_line(line: str) -> None:  # anything else the worker prints
        console.print(f"{label} | {line}", markup=False, style="dim")

    outcome = supervise(cmd, env=_child_env(), watchdog=Watchdog(args.timeout, args.stall),
                        stderr_path=workdir / f"{stem}.stderr", on_step=on_step, on_line=on_line)
    steps = [dataclasses.asdict(r) for r in outcome.steps]
    if outcome.timed_out:
        last = f"after step {outcome.steps[-1].step}" if outcome.steps else "before its first step"
        r: dict[str, Any] = {"mode": mode, "error": f"timed out {last}: it {outcome.timed_out}",
                             "timed_out": True, "stacks": outcome.stacks}
        console.print(f"[red]{label} timed out {last}: it {outcome.timed_out}; "
                      f"{'its threads were here' if outcome.stacks else 'no stacks came back'}:[/red]")
        if outcome.stacks:
            console.print(outcome.stacks, markup=False)
    elif outcome.returncode != 0 or not out.is_file():
        r = {"mode": mode, "error": outcome.last_error_line()}
        console.print(f"[red]{label} failed:[/red] {r['error']}", markup=True)
    else:
        return json.loads(out.read_text())
    if steps:
        r["steps"] = steps
    return r


def compute_ratios(seconds: dict[str, float]) -> dict[str, float | None]:
    """``um/ideal``, ``umrt/ideal``, ``um/umrt`` from per-mode seconds (None where one is missing)."""
    def ratio(a: str, b: str) -> float | None:
        x, y = seconds.get(a), seconds.get(b)
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)) or y <= 0:
            return None
        return x / y

    return {"um/ideal": ratio("um", "ideal"), "umrt/ideal": ratio("umrt", "ideal"), "um/umrt": ratio("um", "umrt"),
            "checkpoint/ideal": ratio("checkpoint", "ideal"), "umrt/checkpoint": ratio("umrt", "checkpoint")}


def resolve_budget(spec: str, ideal_peak: int | None, footprint: int | None = None) -> int:
    """Budget bytes from one ``--gpu-memory``: a share of the footprint or of the ideal peak, or a size."""
    return BudgetSpec.parse(spec).resolve(ideal_peak, footprint)


def measured_footprint(results: dict[str, dict[str, Any]]) -> int | None:
    """The footprint the run needs, as measured: the larger of plain PyTorch's peak reserved bytes
    (the ideal run) and umrt's pool's peak reserved bytes (the um run); None before the um run."""
    pool = results.get("um", {}).get("pool_peak_reserved_bytes")
    if not pool:
        return None
    ideal = results.get("ideal", {})
    return max(int(pool), int(ideal.get("peak_reserved_bytes") or 0), int(ideal.get("peak_allocated_bytes") or 0))


def closest_profile(gpu_name: str, total_bytes: int) -> str:
    """The shipped hardware profile nearest to a GPU: same family by name, then nearest memory size."""
    from umrt.hardware import PROFILES, load_profile

    name = gpu_name.lower()
    family = next((f for f in ("gh200", "h200", "h100", "a100", "v100") if f in name), None)
    family = {"h200": "h100"}.get(family, family)  # Hopper on PCIe/SXM: the H100 profile's link and compute
    names = [p for p in PROFILES if family and p.startswith(family)] or list(PROFILES)
    return min(names, key=lambda p: (abs(load_profile(p).gpu_memory_bytes - total_bytes), p))


def simulate_modes(model: str, batch: int | None, seq: int | None, budget: int | str, profile: str,
                   modes: list[str]) -> dict[str, Any]:
    """The simulator's prediction for ``modes`` on ``profile`` (a meta trace of the same model)."""
    from bench.grid import trace_for
    from umrt.errors import UmrtError
    from umrt.policy import make_policy
    from umrt.sim.replay import replayable_iterations, simulate

    trace = trace_for(model, batch, seq)  # the bench grid's meta trace, cached
    out: dict[str, Any] = {"profile": profile, "budget": budget, "modes": {}}
    for mode in modes:
        if mode == "checkpoint":  # recomputation is no Unified Memory policy: measured only
            continue
        try:
            policy = make_policy(mode, trace)
            # each mode in its steady state, as the timed steps after --warmup
            r = simulate(trace, policy, profile, budget,
                         iterations=replayable_iterations(trace, policy.steady_iterations()))
        except UmrtError as exc:  # e.g. a budget too small for the simulated GPU
            out["modes"][mode] = {"error": str(exc), "iteration_time_s": math.nan}
            continue
        out["modes"][mode] = {"iteration_time_s": r.iteration_time_s, "h2d_bytes": r.h2d_bytes,
                              "d2h_bytes": r.d2h_bytes, "faults": r.faults, "budget_bytes": r.budget_bytes,
                              "peak_live_bytes": r.peak_live_bytes}
    out["ratios"] = compute_ratios({m: v["iteration_time_s"] for m, v in out["modes"].items()})
    return out


def _entry(r: dict[str, Any], ideal_losses: list[float] | None) -> dict[str, Any]:
    """A worker's result as a report row: steady time, per-step figures, losses against plain PyTorch's."""
    entry = {k: v for k, v in r.items() if k not in ("gpu", "mode")}
    if "error" in r:
        return entry
    times = r.get("step_times_s", [])
    entry["iteration_time_s"] = steady_time(times)
    entry["min_time_s"] = min(times) if times else math.nan
    if "per_step" not in entry and "steps" in r:
        entry["per_step"] = steady_per_step(r["steps"])
    if r.get("mode") != "ideal" and ideal_losses and r.get("losses"):
        entry["loss_check"] = compare_losses(ideal_losses, r["losses"])
    return entry


def build_report(results: dict[str, dict[str, Any]], *, model: str, budget_spec: str, budget_bytes: int,
                 simulated: dict[str, Any] | None = None, budgets: list[dict[str, Any]] | None = None,
                 footprint_bytes: int | None = None, dry_run: bool = False) -> dict[str, Any]:
    """The JSON report from per-row worker results (each with ``step_times_s``, or ``error``).

    ``results`` holds ``ideal``, ``um`` and one row per umrt budget; ``budgets``
    lists those budgets (``spec``, ``bytes``, ``label``: the row's key in
    ``results``, ``simulated``), in order; without it the one umrt row is
    ``results["umrt"]`` at ``budget_spec`` / ``budget_bytes``. ``measured``
    holds ideal, um and the first budget's umrt, as before several budgets
    existed; ``budgets`` every budget's umrt row with its targets.
    """
    if budgets is None:
        budgets = [{"spec": budget_spec, "bytes": budget_bytes, "label": "umrt", "simulated": None}] \
            if "umrt" in results else []
    ideal = results.get("ideal", {})
    ideal_losses = ideal.get("losses") if "error" not in ideal else None
    gpu: dict[str, Any] = {}
    for r in results.values():
        if "error" not in r:
            gpu = gpu or r.get("gpu", {})
    entries = {label: _entry(r, ideal_losses) for label, r in results.items()}
    first_umrt = budgets[0]["label"] if budgets else None
    measured = {m: entries[m] for m in ("ideal", "checkpoint", "um") if m in entries}
    if first_umrt in entries:
        measured["umrt"] = entries[first_umrt]
    seconds = {m: e["iteration_time_s"] for m, e in measured.items() if "error" not in e}
    peak = ideal.get("peak_allocated_bytes")
    ideal_entry = entries.get("ideal", {"error": "not measured"})
    checks: list[TargetCheck] = []
    for plainer in ("checkpoint", "um"):  # their losses are plain PyTorch's too
        if plainer in entries:
            row = entries[plainer]
            checks.append(TargetCheck(plainer, "ran", row["error"], "completes", False) if "error" in row
                          else check_losses(plainer, row))
    budget_rows = []
    for b in budgets:
        row = entries.get(b["label"], {"error": "not measured"})
        frac_fp = b["bytes"] / footprint_bytes if footprint_bytes and b.get("bytes") else None
        shown = f"umrt@{b['spec']}"
        targets = check_targets(shown, row, ideal_entry, frac_fp)
        if "error" not in row:
            targets.insert(0, check_losses(shown, row))
        checks += targets
        t = row.get("iteration_time_s") if "error" not in row else None
        budget_rows.append({
            "spec": b["spec"], "bytes": b.get("bytes"), "label": b["label"],
            "fraction_of_ideal_peak": b["bytes"] / peak if peak and b.get("bytes") else None,
            "fraction_of_footprint": frac_fp,
            "measured": row,
            "ratios": compute_ratios({**seconds, "umrt": t} if t is not None else
                                     {k: v for k, v in seconds.items() if k != "umrt"}),
            "simulated": b.get("simulated"),
            "targets": [dataclasses.asdict(c) for c in targets],
        })
    # every row that should have trained: equal losses (True), one unequal (False), or unknown (None)
    loss_checks = [c.passed if c.name.startswith("losses") else None for c in checks
                   if c.name.startswith("losses") or c.name == "ran"]
    first_ok = next((r for r in results.values() if "error" not in r), {})
    label = ("CPU dry run (not a GPU measurement)" if dry_run
             else f"measured on {gpu.get('name', 'an unknown GPU')}")
    return {
        "label": label,
        "gpu": gpu,
        "model": model,
        "batch": first_ok.get("batch"),
        "seq": first_ok.get("seq"),
        "budget": {"spec": budget_spec, "bytes": budget_bytes,
                   "fraction_of_ideal_peak": budget_bytes / peak if peak and budget_bytes else None,
                   "fraction_of_footprint": budget_bytes / footprint_bytes if footprint_bytes else None},
        "measured": measured,
        "ratios": compute_ratios(seconds),
        "simulated": simulated,
        "footprint_bytes": footprint_bytes,
        "budgets": budget_rows,
        "targets": [dataclasses.asdict(c) for c in checks],
        "losses_equal": False if False in loss_checks else None if not loss_checks or None in loss_checks else True,
        "notes": ["um: the driver evicts only when device memory is full, so the budget puts no pressure on "
                  "plain UM here; um is managed memory's own cost (faults, pool, recorder), a lower bound "
                  "on oversubscribed UM",
                  "footprint: the GPU memory the run needs with nothing evicted, measured as the larger of the "
                  "ideal run's peak reserved bytes (PyTorch's caching allocator) and umrt's pool's in the um run; "
                  "peak live: the ideal run's peak allocated bytes; each umrt row shows its own pool's peak"],
    }


def _rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(shown label, row, simulated) for every measured row: ideal, um, each umrt budget."""
    sim_modes = (report.get("simulated") or {}).get("modes", {})
    rows = [(m, report["measured"][m], sim_modes.get(m, {})) for m in ("ideal", "um") if m in report["measured"]]
    budgets = report.get("budgets") or []
    many = len(budgets) > 1
    for i, b in enumerate(budgets):
        sim = (b.get("simulated") or {}).get("modes", {}).get("umrt") or (sim_modes.get("umrt", {}) if i == 0 else {})
        rows.append((f"umrt@{b['spec']}" if many else "umrt", b["measured"], sim))
    if not budgets and "umrt" in report["measured"]:
        rows.append(("umrt", report["measured"]["umrt"], sim_modes.get("umrt", {})))
    return rows


def render(report: dict[str, Any], console: Any = None) -> None:
    """Print the report as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    sim = report.get("simulated") or {}
    sim_modes = sim.get("modes", {})
    b = report["budget"]
    frac = f" = {b['fraction_of_ideal_peak']:.0%} of ideal peak" if b.get("fraction_of_ideal_peak") else ""
    budgets = report.get("budgets") or []
    shown_budget = (", budgets " + ", ".join(f"{x['spec']} = {format_bytes(x['bytes'])}" if x.get("bytes") else x["spec"]
                                             for x in budgets)) if len(budgets) > 1 else \
        f", budget {format_bytes(b['bytes'])}{frac}"
    t = Table(title=f"{report['model']} batch {report['batch']} x {report['seq']}{shown_budget}, {report['label']}")
    t.caption = ("ms: median of the timed steps, min: fastest; sim = simulated"
                 + (f" on {sim['profile']}" if sim else " (not run)")
                 + "; umrt H2D / D2H / calls: what umrt issued per timed step (umrt.memory_stats, the backend's "
                   "counters); PCIe: NVML's byte counters per timed step; pool: umrt's pool at its peak; "
                   "losses: equal to ideal's at every step")
    t.add_column("mode", min_width=5, no_wrap=True)
    for col in ("ms", "min", "×ideal", "sim ms", "sim×", "umrt H2D", "umrt D2H", "calls", "PCIe H2D", "PCIe D2H",
                "pool", "losses"):
        t.add_column(col, justify="right", no_wrap=True)
    ideal_s = report["measured"].get("ideal", {}).get("iteration_time_s")
    ideal_sim = sim_modes.get("ideal", {}).get("iteration_time_s")
    for label, m, s_row in _rows(report):
        s = s_row.get("iteration_time_s")
        if "error" in m:
            t.add_row(label, "[red]timed out[/red]" if m.get("timed_out") else "[red]failed[/red]", "", "",
                      _ms(s), _x(s, ideal_sim), *[""] * 7)
            continue
        it = m["iteration_time_s"]
        per = m.get("per_step") or {}
        lc = m.get("loss_check")
        losses = "-" if not lc else ("[green]equal[/green]" if lc["equal"] else "[red]differ[/red]")
        pool = m.get("pool_peak_reserved_bytes")
        calls = per.get("calls")
        t.add_row(label, _ms(it), _ms(m["min_time_s"]), _x(it, ideal_s), _ms(s), _x(s, ideal_sim),
                  _bytes(per.get("h2d_bytes")), _bytes(per.get("d2h_bytes")),
                  "-" if calls is None else f"{calls:.0f}",
                  _bytes(per.get("pcie_h2d_bytes")), _bytes(per.get("pcie_d2h_bytes")),
                  format_bytes(pool) if pool else "-", losses)
    console.print(t)
    peak = report["measured"].get("ideal", {}).get("peak_allocated_bytes")
    sim_peak = next((v.get("peak_live_bytes") for v in sim_modes.values() if v.get("peak_live_bytes")), None)
    fp = report.get("footprint_bytes")
    if peak or sim_peak or fp:
        console.print(f"measured: footprint {format_bytes(fp) if fp else '-'}, peak live "
                      f"{format_bytes(peak) if peak else '-'}; simulated trace's peak live "
                      f"{format_bytes(sim_peak) if sim_peak else '-'}")
    for mode, v in sim_modes.items():
        if v.get("error"):
            console.print(f"simulated {mode}: {v['error']}")
    r, sr = report["ratios"], sim.get("ratios", {})
    console.print("ratios (measured | simulated): " + ", ".join(
        f"{k} {_f(v)} | {_f(sr.get(k))}" for k, v in r.items()))
    for label, m, _ in _rows(report):
        if "error" in m:
            console.print(f"[red]{label} {'timed out' if m.get('timed_out') else 'failed'}:[/red] {m['error']}")
        if m.get("memory_stats"):
            console.print(f"{label} umrt.memory_stats(): " + ", ".join(
                f"{k}={format_bytes(v) if k.endswith('bytes') and isinstance(v, (int, float)) else v}"
                for k, v in m["memory_stats"].items()))
        by_name = (m.get("per_step") or {}).get("calls_by_name")
        if by_name:
            console.print(f"{label} CUDA calls per timed step: " + ", ".join(f"{k} {v:.1f}" for k, v in by_name.items()))
        for note in m.get("notes", []):
            console.print(f"{label}: {note}")
    checks = report.get("targets") or []
    if checks:
        tt = Table(title="targets umrt is held to on a GPU (reported, not asserted)")
        for col in ("budget", "check", "measured", "target", "result"):
            tt.add_column(col, overflow="fold")
        for c in checks:
            result = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "-"}[c["passed"]]
            tt.add_row(c["budget"], c["name"], c["value"], c["target"], result)
        console.print(tt)
        for c in checks:
            for note in c.get("notes", []):
                console.print(f"[dim]{c['budget']} {c['name']}: {note}[/dim]")
    for note in report["notes"]:
        console.print(f"[dim]note: {note}[/dim]")


def _ms(s: float | None) -> str:
    return "-" if s is None or not math.isfinite(s) else f"{s * 1e3:.1f}"


def _x(a: float | None, b: float | None) -> str:
    return "-" if not a or not b or not math.isfinite(a) or not math.isfinite(b) else f"{a / b:.2f}x"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark: ideal, um, umrt at each budget, in subprocesses; then the simulated prediction."""
    modes = validate(args)
    specs = budget_specs(args)
    dry = bool(getattr(args, "dry_run_cpu", False))
    if not dry:
        require_gpu()
    console = _console()
    results: dict[str, dict[str, Any]] = {}
    budgets: list[dict[str, Any]] = []
    footprint: int | None = None
    with tempfile.TemporaryDirectory(prefix="umrt-bench-gpu-") as tmp:
        if "ideal" in modes:
            results["ideal"] = run_mode("ideal", args, 0, Path(tmp), console=console)
            if "error" in results["ideal"]:
                raise BenchError(f"the ideal run failed ({results['ideal']['error']}); the model must fit on "
                                 "the GPU: pick a smaller --batch/--seq/--model")
            _check_model_fits(results["ideal"])
        peak = results.get("ideal", {}).get("peak_allocated_bytes")
        checkpoint_peak = None
        if "checkpoint" in modes:
            results["checkpoint"] = run_mode("checkpoint", args, 0, Path(tmp), console=console)
            checkpoint_peak = results["checkpoint"].get("peak_allocated_bytes") or None
        total = results.get("ideal", {}).get("gpu", {}).get("total_bytes")
        if "um" in modes:
            um_budget = next((_try_resolve(b, peak, None, total, checkpoint_peak) for b in specs if b.kind != "footprint"), None) or \
                results.get("ideal", {}).get("gpu", {}).get("free_bytes_at_start", 0)
            results["um"] = _run_checked("um", args, int(um_budget), Path(tmp), results, console)
            footprint = measured_footprint(results)
        if "umrt" in modes:
            many = len(specs) > 1
            for i, spec in enumerate(specs):
                label = "umrt" if i == 0 else f"umrt@{spec.text}"
                shown = f"umrt@{spec.text}" if many else "umrt"
                try:
                    nbytes = spec.resolve(peak, footprint, total, checkpoint_peak)
                except BenchError as exc:
                    results[label] = {"mode": "umrt", "error": str(exc)}
                    console.print(f"[red]{shown} skipped:[/red] {exc}")
                    budgets.append({"spec": spec.text, "bytes": None, "label": label, "simulated": None})
                    continue
                results[label] = _run_checked("umrt", args, nbytes, Path(tmp), results, console, shown=shown)
                budgets.append({"spec": spec.text, "bytes": nbytes, "label": label, "simulated": None})
    first = budgets[0] if budgets else None
    budget_bytes = first["bytes"] if first and first["bytes"] else (_try_resolve(specs[0], peak, footprint, total, checkpoint_peak) or 0)
    simulated = None
    if not args.no_sim and not dry:
        gpu = next((r["gpu"] for r in results.values() if "gpu" in r), None)
        if gpu is not None or args.profile:
            profile = args.profile or closest_profile(gpu["name"], gpu["total_bytes"])
            with console.status(f"simulating on {profile}"):
                simulated = simulate_modes(args.model, args.batch, args.seq,
                                           _sim_budget(specs[0], budget_bytes), profile, modes)
                for b, spec in zip(budgets[1:], specs[1:], strict=True):
                    if b["bytes"]:
                        b["simulated"] = simulate_modes(args.model, args.batch, args.seq,
                                                        _sim_budget(spec, b["bytes"]), profile, ["umrt"])
    return build_report(results, model=args.model, budget_spec=specs[0].text, budget_bytes=budget_bytes,
                        simulated=simulated, budgets=budgets, footprint_bytes=footprint, dry_run=dry)


def _sim_budget(spec: BudgetSpec, nbytes: int) -> int | str:
    """The simulator's GPU memory: a percentage of the footprint or of peak live stays one (of the
    simulated trace's); anything else in bytes."""
    return spec.simulated or nbytes


def _try_resolve(spec: BudgetSpec, peak: int | None, footprint: int | None, total: int | None = None,
                 checkpoint_peak: int | None = None) -> int | None:
    try:
        return spec.resolve(peak, footprint, total, checkpoint_peak)
    except BenchError:
        return None


def _run_checked(mode: str, args: argparse.Namespace, budget_bytes: int, workdir: Path,
                 results: dict[str, dict[str, Any]], console: Any, shown: str | None = None) -> dict[str, Any]:
    """:func:`run_mode` unless the budget exceeds the device's free memory (then an error row)."""
    free = results.get("ideal", {}).get("gpu", {}).get("free_bytes_at_start")
    if free and budget_bytes > free:
        msg = f"budget {format_bytes(budget_bytes)} exceeds the device's free memory ({format_bytes(free)})"
        console.print(f"[red]{shown or mode} skipped:[/red] {msg}")
        return {"mode": mode, "error": msg}
    return run_mode(mode, args, budget_bytes, workdir, label=shown or mode, console=console)


def _check_model_fits(ideal: dict[str, Any]) -> None:
    """Issue 5's rule: managed memory must fit in what the device has free."""
    peak, free = ideal.get("peak_reserved_bytes"), ideal.get("gpu", {}).get("free_bytes_at_start")
    if peak and free and peak * HEADROOM > free:
        raise BenchError(f"the model's peak ({format_bytes(peak)}, x{HEADROOM} headroom) does not fit in the "
                         f"device's free memory ({format_bytes(free)}); oversubscription is emulated with the "
                         "budget, so pick a smaller --batch/--seq/--model")


def _strict(value: Any) -> Any:
    """NaN/inf (a failed or missing figure) as JSON null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker_main(args)
    try:
        report = run(args)
    except BenchError as exc:
        print(f"bench.gpu: {exc}", file=sys.stderr)
        return 2
    render(report)
    if args.json:
        Path(args.json).write_text(json.dumps(_strict(report), indent=2, allow_nan=False) + "\n")
    rows = [*report["measured"].values(), *(b["measured"] for b in report.get("budgets") or [])]
    return 0 if all("error" not in m for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
