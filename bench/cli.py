"""Command line of the bench (``python -m bench`` and ``umrt bench`` share it)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench.grid import DTYPES, PRESETS, Grid, check_dtype, preset, run_grid, split_list
from umrt.cli import PlainHelpParser, Renamed
from umrt.config import read_amount
from umrt.errors import ConfigError, UmrtError
from umrt.paths import check_writable, check_writable_dir

__all__ = ["add_arguments", "run", "main", "build_parser"]

DEFAULT_OUT = Path(__file__).resolve().parent / "out"

DESCRIPTION = """\
Simulate a grid of models x GPU memory x GPU profiles x policies and write a
JSON and a CSV of every cell, a markdown table (steady-state slowdown vs
ideal, speedup vs um, and the link bound no policy can beat) and plots
(throughput relative to ideal against GPU memory). Traces are made on the
meta device and cached under bench/.cache/. All results are simulated. The
default grid finishes within about 5 minutes on 2 cores.

GPU memory (--gpu-memory) is a percentage of the footprint the run needs
('20%': the GPU memory the trace's allocations take with nothing evicted, the
larger of umrt's pool and PyTorch's caching allocator replayed over the trace,
so 100% holds everything), of the trace's peak live bytes ('20%peak'), or a
size ('8GiB'). Every row reports its GPU memory in bytes and as a share of both.
"""

EPILOG = """\
presets:
  default  gpt2 and bert-base at the zoo's batch sizes; 20% and 50%;
           v100-pcie3-32g and h100-pcie5-80g; ideal, um, um-advise, oracle, umrt
  readme   gpt2-xl, bert-large, vit-large, resnet-152 at the zoo's batch sizes; 20% and 50%;
           both profiles; ideal, um, um-advise, oracle; fp32 and bf16 (the README's first table)
  targets  the same 4 models at 20% on both profiles; ideal, um, oracle, umrt and the
           peers deepum, sentinel, vdnn, swapadvisor (the README's "umrt against the peers";
           add --check-targets)

examples:
  python -m bench
  python -m bench --models gpt2 --gpu-memory 10% 30% --policies um oracle --json r.json
  python -m bench --preset targets --check-targets
  python -m bench --preset targets --check-targets --gpu-memory 20%peak   # 20% of peak live bytes
  python -m bench --models gpt2 --dtype float32 bfloat16
  python -m bench --from-json bench/out/results.json --check-targets
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("grid (each option overrides the preset)")
    g.add_argument("--preset", default="default", choices=sorted(PRESETS), help="starting grid (default: default)")
    g.add_argument("--models", nargs="+", metavar="MODEL",
                   help="zoo names (gpt2, gpt2-xl, bert-large, vit-large, resnet-152, ...) or hf:Config:k=v,... specs")
    g.add_argument("--gpu-memory", nargs="+", metavar="AMOUNT", dest="budgets",
                   help="GPU memory of each cell: 20%% (of the footprint the run needs), 20%%peak (of peak live "
                        "bytes) or a size (8GiB); several run side by side")
    g.add_argument("--budgets", nargs="+", dest="budgets", action=Renamed, new="--gpu-memory", prefix="bench")
    g.add_argument("--budget-base", choices=("footprint", "peak"), action=Renamed, prefix="bench",
                   note="--budget-base is gone: a percentage names its base, '20%' of the footprint the run needs, "
                        "'20%peak' of its peak live bytes; '--budget-base peak' reads a bare '20%' as '20%peak' "
                        "for this version")
    g.add_argument("--dtype", nargs="+", metavar="DTYPE",
                   help=f"training precision(s), as `umrt trace --dtype`: {', '.join(DTYPES)} "
                        "(default float32; several run side by side)")
    g.add_argument("--profiles", nargs="+", metavar="GPU", help="hardware profiles (e.g. v100-pcie3-32g h100-pcie5-80g)")
    g.add_argument("--policies", nargs="+", metavar="POLICY", help="policies (ideal, um, um-advise, oracle, umrt, peers)")
    g.add_argument("--batch", nargs="+", metavar="[MODEL=]N", help="batch size for every model, or per model")
    g.add_argument("--seq", nargs="+", metavar="[MODEL=]N", help="sequence length for every model, or per model")
    g.add_argument("--iterations", type=int, metavar="N", help="iterations simulated per cell (default 3)")
    o = p.add_argument_group("outputs")
    o.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: bench/out)")
    o.add_argument("--json", type=Path, metavar="FILE", help="results JSON (default: OUT/results.json)")
    o.add_argument("--csv", type=Path, metavar="FILE", help="results CSV (default: OUT/results.csv)")
    o.add_argument("--md", type=Path, metavar="FILE", help="markdown table (default: OUT/results.md)")
    o.add_argument("--plots", type=Path, metavar="DIR", help="plot directory (default: OUT/plots)")
    o.add_argument("--no-plots", action="store_true", help="skip the plots")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    x = p.add_argument_group("other")
    x.add_argument("--check-targets", action="store_true",
                   help="check the targets umrt is held to (the README's \"umrt against the peers\") on the "
                        "20%% cells and print pass/fail/n-a per target; exit 1 if one fails")
    x.add_argument("--from-json", type=Path, metavar="FILE",
                   help="do not simulate: re-render (and --check-targets) an earlier results JSON")
    x.add_argument("--refresh-traces", action="store_true", help="re-make cached traces")
    x.add_argument("--cache", type=Path, metavar="DIR", help="trace cache directory (default: bench/.cache)")
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    prog = "umrt bench" if sys.argv[:1] == ["umrt bench"] else "python -m bench"  # (umrt/cli/bench.py)
    p = PlainHelpParser(prog=prog, description=DESCRIPTION, epilog=EPILOG.replace("python -m bench", prog),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def _per_model(values: list[str] | None, models: tuple[str, ...], what: str) -> dict[str, int]:
    if not values:
        return {}
    out: dict[str, int] = {}
    for v in values:
        model, sep, n = v.rpartition("=")  # hf: specs hold "=" too: only a grid model counts
        if sep and model not in models:
            raise ConfigError(f"--{what} {v!r}: {model!r} is not in the grid's models ({', '.join(models)})")
        try:
            number = int(n)
        except ValueError:
            raise ConfigError(f"--{what} {v!r}: expected N or MODEL=N with an integer N") from None
        if number <= 0:
            raise ConfigError(f"--{what} {v!r}: must be positive")
        if sep:
            out[model] = number
        else:
            out.update({m: number for m in models})
    return out


def _based(budgets: tuple[str, ...], base: str | None) -> tuple[str, ...]:
    """``--budget-base peak`` (an old flag): each bare percentage as a percentage of peak live bytes."""
    if base != "peak":
        return budgets
    return tuple(f"{b.strip()}peak" if (a := read_amount(b)) is not None and a.implied else b for b in budgets)


def grid_from_args(args: argparse.Namespace) -> Grid:
    base = preset(args.preset)
    models = split_list(args.models) if args.models else base.models
    grid = replace(
        base,
        models=models,
        budgets=_based(split_list(args.budgets) if args.budgets else base.budgets, args.budget_base),
        profiles=split_list(args.profiles) if args.profiles else base.profiles,
        policies=split_list(args.policies) if args.policies else base.policies,
        batch={m: n for m, n in base.batch.items() if m in models} | _per_model(args.batch, models, "batch"),
        seq={m: n for m, n in base.seq.items() if m in models} | _per_model(args.seq, models, "seq"),
        iterations=args.iterations if args.iterations is not None else base.iterations,
        dtypes=tuple(check_dtype(d) for d in split_list(args.dtype)) if args.dtype else base.dtypes,
    )
    if grid.iterations < 2:
        raise ConfigError("--iterations must be at least 2 (the first iteration pays cold misses)")
    from umrt.policy import POLICY_NAMES

    unknown = [p for p in grid.policies if p not in POLICY_NAMES]
    if unknown:
        raise ConfigError(f"unknown policy {', '.join(map(repr, unknown))}; valid policies: {', '.join(POLICY_NAMES)}")
    from umrt.zoo import resolve

    for model in grid.models:  # a misspelt model fails here, not as a column of failed cells
        resolve(model)
    return grid


def run(args: argparse.Namespace) -> int:
    from bench import report

    out: Path = args.out
    json_path, csv_path = args.json or out / "results.json", args.csv or out / "results.csv"
    md_path, plots_dir = args.md or out / "results.md", args.plots or out / "plots"
    # Every output path is checked before the grid runs, not after minutes of simulation.
    if not (args.json and args.csv and args.md and (args.plots or args.no_plots)):
        check_writable_dir(out)
    for path in ([md_path] if args.from_json else [json_path, csv_path, md_path]):
        check_writable(path, make_dirs=True)
    if not args.no_plots:
        check_writable_dir(plots_dir)
    if args.from_json:
        rows = report.load_rows(args.from_json)
    else:
        grid = grid_from_args(args)
        from bench.grid import CACHE_DIR, trace_for

        cache = args.cache or CACHE_DIR
        done: list[dict] = []
        meta = {"grid": asdict(grid)}
        try:
            rows = run_grid(grid, progress=not args.no_progress, on_row=done.append,
                            trace_fn=lambda m, b, s, d: trace_for(m, b, s, cache_dir=cache, refresh=args.refresh_traces,
                                                                  dtype=d))
        except KeyboardInterrupt:
            if done:  # keep what was measured
                report.write_json(done, json_path, meta=meta | {"interrupted": True})
                report.write_csv(done, csv_path)
                print(f"bench: interrupted; the {len(done)} finished cell(s) are in {json_path}", file=sys.stderr)
            raise
        report.write_json(rows, json_path, meta=meta)
        report.write_csv(rows, csv_path)
    report.write_markdown(rows, md_path)
    written = [] if args.no_plots else report.write_plots(rows, plots_dir)
    print(report.markdown_table(rows))
    if not args.from_json:
        print(f"wrote {json_path}, {csv_path}, {md_path}"
              + (f" and {len(written)} plot(s) in {plots_dir}" if written else ""))
    failed = sum(1 for r in rows if r.get("error"))
    if failed:
        print(f"{failed} of {len(rows)} cell(s) failed; see the error column", file=sys.stderr)
    if args.check_targets:
        results = report.check_targets(rows)
        width = max(len(r.name) for r in results)
        for r in results:
            print(f"{r.status.upper():4}  {r.name:<{width}}  {r.detail}")
        if any(r.status == "fail" for r in results):
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UmrtError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
