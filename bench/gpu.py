"""Measured iteration times on a real GPU: ``python -m bench.gpu``.

Trains one zoo model (default GPT-2 at its zoo batch and sequence length;
``umrt.zoo.build_model`` / ``make_inputs``, AdamW(foreach=True), the loop of
``examples/train_gpt2.py``) three ways, each in its own subprocess because
torch's allocator can be swapped only once per process:

``ideal``
    plain torch (cudaMalloc, PyTorch's caching allocator); the model must fit.
    Its peak allocated bytes are what a percentage ``--budget`` refers to,
    as the simulator's budget refers to the trace's peak live bytes.
``um``
    ``umrt.enable(policy="um", gpu_memory=BUDGET)``: every allocation in
    managed memory through umrt's pool, no prefetching policy.
``umrt``
    ``umrt.enable(gpu_memory=BUDGET)``: the default policy.

Oversubscription is emulated with umrt's budget (``gpu_memory``), never by
asking for more managed memory than the device has free (issue 5): the run is
refused when the ideal peak does not fit in the device's free memory. Note
that the driver itself evicts only when device memory is full, so under
``um`` the budget puts no pressure on the driver: ``um`` measures managed
memory's own cost (first-touch faults, the pool, the event recorder), not a
driver thrashing at the budget. ``umrt`` keeps itself within the budget.

The steady-state iteration time is the median of the ``--steps`` timed steps
after ``--warmup`` untimed ones (the runtime learns and plans in its first
iterations). Beside the measured figures: ``umrt.memory_stats()``, NVML
telemetry (peak device memory used, PCIe traffic) where NVML answers, and the
simulator's prediction for the same model and budget on the shipped hardware
profile closest to the detected GPU (``umrt.sim.replay.simulate`` on a meta
trace from ``umrt.zoo.trace_model``, cached like the bench grid's).

Without a CUDA GPU it exits with status 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("ideal", "um", "umrt")
DEFAULT_BUDGET = "50%"
# Managed memory umrt's pool may hold beyond the ideal peak (2 MB rounding,
# segments): the device must have this much more free than the ideal peak.
HEADROOM = 1.25
_TORCH_DEVICE = "cuda"  # the workers' torch device (a unit test runs the loop on the CPU)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")


class BenchError(Exception):
    """A bad argument or a machine that cannot run the benchmark (exit 2, one line)."""


# ---------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description="Measure ideal / um / umrt iteration times of a real training loop on this GPU.",
    )
    p.add_argument("--model", default="gpt2", help="zoo name or hf:ConfigClass:k=v,... (default gpt2)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the zoo's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length / image side (default: the zoo's)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help="umrt's GPU memory budget: %% of the ideal run's peak, or a size (8GiB) (default 50%%)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of ideal,um,umrt")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--profile", default=None,
                   help="hardware profile for the simulated column (default: closest to the GPU)")
    p.add_argument("--no-sim", action="store_true", help="skip the simulated prediction")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode (default 1800)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--budget-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def parse_budget_spec(text: str) -> tuple[float | None, int | None]:
    """``"50%"`` -> (0.5, None); ``"8GiB"`` / ``"1073741824"`` -> (None, bytes)."""
    from umrt.config import parse_amount
    from umrt.errors import ConfigError

    m = _PERCENT.match(text)
    if m:
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise BenchError(f"--budget {text!r}: a percentage must be in (0, 100]")
        return pct / 100.0, None
    try:
        amount = parse_amount(text, "--budget", allow_percent=False)
    except ConfigError:
        raise BenchError(f"--budget {text!r}: give a percentage of the ideal run's peak ('50%') "
                         "or a size ('8GiB', '512MB', a byte count)") from None
    nbytes = amount.resolve(0)
    if nbytes < (2 << 20):
        raise BenchError(f"--budget {text!r} is below one 2 MB block")
    return None, nbytes


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
    parse_budget_spec(args.budget)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise BenchError(f"--modes {args.modes!r}: use a comma-separated subset of {','.join(MODES)}")
    if any(m != "ideal" for m in modes) and "ideal" not in modes and parse_budget_spec(args.budget)[0]:
        raise BenchError("a percentage --budget refers to the ideal run's peak: keep ideal in --modes "
                         "or give the budget as a size (e.g. 8GiB)")
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


def run_worker(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.warmup + args.steps`` steps in this process under ``mode``; time each step."""
    import io

    import torch

    from umrt.telemetry import Sampler
    from umrt.zoo import _forward_kwargs, _loss, _quiet_transformers, build_model, make_inputs, resolve

    result: dict[str, Any] = {"mode": mode, "notes": []}
    session = None
    if mode != "ideal":
        import umrt

        session = umrt.enable(policy=mode, gpu_memory=int(args.budget_bytes), device=args.device)
        if not session.active:
            raise BenchError(f"umrt did not start ({'; '.join(session.notes)})")
        result["notes"] += list(session.notes)
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
    torch.manual_seed(0)
    with _quiet_transformers():
        model = build_model(spec, _TORCH_DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        fwd = _forward_kwargs(spec)
        sampler = None
        times: list[float] = []
        for step in range(args.warmup + args.steps):
            inputs = make_inputs(spec, batch, seq, _TORCH_DEVICE)  # the loader's work, outside the timing
            if step == args.warmup:  # peaks stay whole-run, as the simulator's budget base
                sampler = Sampler(args.device, pci_bus_id=_pci_bus_id(args.device), out=io.StringIO()).start()
            torch.cuda.synchronize(args.device)
            t0 = time.perf_counter()
            loss = _loss(model(**inputs, **fwd))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(args.device)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
            del loss, inputs
    summary = sampler.stop() if sampler is not None else None
    result.update(batch=batch, seq=seq, step_times_s=times)
    if mode == "ideal":
        result["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(args.device))
        result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(args.device))
    else:
        result["memory_stats"] = umrt.memory_stats()
        result["budget_bytes"] = int(session.budget_bytes)
        failed = getattr(session.runtime, "failed", None)
        if failed is not None:
            result["notes"].append(f"the runtime stopped acting: {type(failed).__name__}: {failed}")
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


def run_mode(mode: str, args: argparse.Namespace, budget_bytes: int, workdir: Path) -> dict[str, Any]:
    """One mode in a fresh subprocess; a failure is recorded, never raised."""
    out = workdir / f"{mode}.json"
    cmd = [sys.executable, "-m", "bench.gpu", "--worker", mode, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", str(args.device),
           "--budget-bytes", str(budget_bytes), "--out", str(out)]
    if args.batch is not None:
        cmd += ["--batch", str(args.batch)]
    if args.seq is not None:
        cmd += ["--seq", str(args.seq)]
    try:
        proc = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.timeout:.0f} s"}
    if proc.returncode != 0 or not out.is_file():
        lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
        return {"mode": mode, "error": lines[-1] if lines else f"exit status {proc.returncode}"}
    return json.loads(out.read_text())


def steady_time(times: list[float]) -> float:
    """The steady-state iteration time: the median of the timed steps."""
    return float(statistics.median(times)) if times else math.nan


def compute_ratios(seconds: dict[str, float]) -> dict[str, float | None]:
    """``um/ideal``, ``umrt/ideal``, ``um/umrt`` from per-mode seconds (None where one is missing)."""
    def ratio(a: str, b: str) -> float | None:
        x, y = seconds.get(a), seconds.get(b)
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)) or y <= 0:
            return None
        return x / y

    return {"um/ideal": ratio("um", "ideal"), "umrt/ideal": ratio("umrt", "ideal"), "um/umrt": ratio("um", "umrt")}


def resolve_budget(spec: str, ideal_peak: int | None) -> int:
    """Budget bytes from ``--budget``: a fraction of the ideal peak, or a size."""
    frac, nbytes = parse_budget_spec(spec)
    if nbytes is not None:
        return nbytes
    if not ideal_peak:
        raise BenchError("a percentage --budget needs the ideal run's peak, and the ideal run failed")
    return max(2 << 20, int(ideal_peak * frac))


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
    from umrt.sim.replay import simulate

    trace = trace_for(model, batch, seq)  # the bench grid's meta trace, cached
    out: dict[str, Any] = {"profile": profile, "budget": budget, "modes": {}}
    for mode in modes:
        try:
            policy = make_policy(mode, trace)
            # each mode in its steady state, as the timed steps after --warmup
            r = simulate(trace, policy, profile, budget, iterations=policy.steady_iterations())
        except UmrtError as exc:  # e.g. a budget too small for the simulated GPU
            out["modes"][mode] = {"error": str(exc), "iteration_time_s": math.nan}
            continue
        out["modes"][mode] = {"iteration_time_s": r.iteration_time_s, "h2d_bytes": r.h2d_bytes,
                              "d2h_bytes": r.d2h_bytes, "faults": r.faults, "budget_bytes": r.budget_bytes,
                              "peak_live_bytes": r.peak_live_bytes}
    out["ratios"] = compute_ratios({m: v["iteration_time_s"] for m, v in out["modes"].items()})
    return out


def build_report(results: dict[str, dict[str, Any]], *, model: str, budget_spec: str, budget_bytes: int,
                 simulated: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON report from per-mode worker results (each with ``step_times_s``, or ``error``)."""
    measured: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    gpu: dict[str, Any] = {}
    for mode, r in results.items():
        entry = {k: v for k, v in r.items() if k not in ("gpu", "mode")}
        if "error" not in r:
            times = r.get("step_times_s", [])
            entry["iteration_time_s"] = seconds[mode] = steady_time(times)
            entry["min_time_s"] = min(times) if times else math.nan
            gpu = gpu or r.get("gpu", {})
        measured[mode] = entry
    ideal = results.get("ideal", {})
    peak = ideal.get("peak_allocated_bytes")
    first_ok = next((r for r in results.values() if "error" not in r), {})
    return {
        "label": f"measured on {gpu.get('name', 'an unknown GPU')}",
        "gpu": gpu,
        "model": model,
        "batch": first_ok.get("batch"),
        "seq": first_ok.get("seq"),
        "budget": {"spec": budget_spec, "bytes": budget_bytes,
                   "fraction_of_ideal_peak": budget_bytes / peak if peak else None},
        "measured": measured,
        "ratios": compute_ratios(seconds),
        "simulated": simulated,
        "notes": ["um: the driver evicts only when device memory is full, so the budget puts no pressure on "
                  "plain UM here; um is managed memory's own cost (faults, pool, recorder), a lower bound "
                  "on oversubscribed UM"],
    }


def render(report: dict[str, Any], console: Any = None) -> None:
    """Print the report as rich tables."""
    from rich.console import Console
    from rich.table import Table

    from umrt.config import format_bytes

    console = console or Console()
    sim = report.get("simulated") or {}
    sim_modes = sim.get("modes", {})
    b = report["budget"]
    frac = f" = {b['fraction_of_ideal_peak']:.0%} of ideal peak" if b.get("fraction_of_ideal_peak") else ""
    t = Table(title=f"{report['model']} batch {report['batch']} x {report['seq']}, budget "
                    f"{format_bytes(b['bytes'])}{frac}, {report['label']}")
    t.caption = (f"ms: median of the timed steps, min: fastest; sim = simulated on {sim['profile']}; migrated = by umrt's "
                 "prefetches (umrt.memory_stats); NVML = device memory used / PCIe host->GPU"
                 if sim else "median of the timed steps; no simulated column")
    t.add_column("mode", min_width=5, no_wrap=True)
    for col in ("ms", "min", "×ideal", "sim ms", "sim×", "migrated", "NVML peak", "NVML H2D"):
        t.add_column(col, justify="right", no_wrap=True)
    ideal_s = report["measured"].get("ideal", {}).get("iteration_time_s")
    ideal_sim = sim_modes.get("ideal", {}).get("iteration_time_s")
    for mode, m in report["measured"].items():
        s = sim_modes.get(mode, {}).get("iteration_time_s")
        if "error" in m:
            t.add_row(mode, "[red]failed[/red]", "", "", _ms(s), _x(s, ideal_sim), "", "", "")
            continue
        it = m["iteration_time_s"]
        ms, tel = m.get("memory_stats", {}), m.get("telemetry", {})
        t.add_row(mode, _ms(it), _ms(m["min_time_s"]), _x(it, ideal_s), _ms(s), _x(s, ideal_sim),
                  format_bytes(ms["migrated_bytes"]) if ms else "-",
                  format_bytes(tel["peak_used_bytes"]) if tel.get("samples") else "-",
                  format_bytes(tel["h2d_bytes"]) if tel.get("samples") else "-")
    console.print(t)
    peak = report["measured"].get("ideal", {}).get("peak_allocated_bytes")
    sim_peak = next((v.get("peak_live_bytes") for v in sim_modes.values() if v.get("peak_live_bytes")), None)
    if peak or sim_peak:
        console.print(f"budget base (peak bytes): measured ideal {format_bytes(peak) if peak else '-'}, "
                      f"simulated trace {format_bytes(sim_peak) if sim_peak else '-'}")
    for mode, v in sim_modes.items():
        if v.get("error"):
            console.print(f"simulated {mode}: {v['error']}")
    r, sr = report["ratios"], sim.get("ratios", {})
    console.print("ratios (measured | simulated): " + ", ".join(
        f"{k} {_f(v)} | {_f(sr.get(k))}" for k, v in r.items()))
    for mode, m in report["measured"].items():
        if "error" in m:
            console.print(f"[red]{mode} failed:[/red] {m['error']}")
        if m.get("memory_stats"):
            console.print(f"{mode} umrt.memory_stats(): " + ", ".join(
                f"{k}={format_bytes(v) if k.endswith('bytes') else v}" for k, v in m["memory_stats"].items()))
        for note in m.get("notes", []):
            console.print(f"{mode}: {note}")
    for note in report["notes"]:
        console.print(f"[dim]note: {note}[/dim]")


def _ms(s: float | None) -> str:
    return "-" if s is None or not math.isfinite(s) else f"{s * 1e3:.1f}"


def _x(a: float | None, b: float | None) -> str:
    return "-" if not a or not b or not math.isfinite(a) or not math.isfinite(b) else f"{a / b:.2f}x"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark: modes in subprocesses, then the simulated prediction."""
    from rich.console import Console

    modes = validate(args)
    require_gpu()
    console = Console(stderr=True)
    results: dict[str, dict[str, Any]] = {}
    budget_bytes = 0
    with tempfile.TemporaryDirectory(prefix="umrt-bench-gpu-") as tmp:
        for mode in modes:
            if mode != "ideal" and not budget_bytes:
                budget_bytes = resolve_budget(args.budget, results.get("ideal", {}).get("peak_allocated_bytes"))
                _check_fits(results, budget_bytes)
            with console.status(f"measuring {mode} ({args.warmup} + {args.steps} steps)"):
                results[mode] = run_mode(mode, args, budget_bytes, Path(tmp))
            if mode == "ideal" and "error" in results[mode]:
                raise BenchError(f"the ideal run failed ({results[mode]['error']}); the model must fit on "
                                 "the GPU: pick a smaller --batch/--seq/--model")
    if not budget_bytes:
        budget_bytes = resolve_budget(args.budget, results.get("ideal", {}).get("peak_allocated_bytes"))
    simulated = None
    if not args.no_sim:
        gpu = next((r["gpu"] for r in results.values() if "gpu" in r), None)
        if gpu is not None or args.profile:
            profile = args.profile or closest_profile(gpu["name"], gpu["total_bytes"])
            frac, nbytes = parse_budget_spec(args.budget)
            with console.status(f"simulating on {profile}"):
                simulated = simulate_modes(args.model, args.batch, args.seq, args.budget if frac else nbytes,
                                           profile, modes)
    return build_report(results, model=args.model, budget_spec=args.budget, budget_bytes=budget_bytes,
                        simulated=simulated)


def _check_fits(results: dict[str, dict[str, Any]], budget_bytes: int) -> None:
    """Issue 5's rule: managed memory must fit in what the device has free."""
    ideal = results.get("ideal", {})
    peak, free = ideal.get("peak_reserved_bytes"), ideal.get("gpu", {}).get("free_bytes_at_start")
    if peak and free and peak * HEADROOM > free:
        raise BenchError(f"the model's peak ({peak / 2**30:.1f} GiB, x{HEADROOM} headroom) does not fit in the "
                         f"device's free memory ({free / 2**30:.1f} GiB); oversubscription is emulated with the "
                         "budget, so pick a smaller --batch/--seq/--model")
    if free and budget_bytes > free:
        raise BenchError(f"--budget {budget_bytes / 2**30:.1f} GiB exceeds the device's free memory")


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
    return 0 if all("error" not in m for m in report["measured"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
