"""``umrt simulate``: replay a trace under a policy on a simulated GPU.

    umrt simulate gpt2-xl.umrt --gpu v100-pcie3-32g --budget 20% --policy um
    umrt simulate gpt2-xl.umrt --budget 8GiB --policy oracle --iterations 5 --json
"""
from __future__ import annotations

import argparse
import json
import sys

from umrt.cli import make_console
from umrt.config import format_bytes
from umrt.errors import ConfigError
from umrt.hardware import PROFILES, load_profile
from umrt.policy import make_policy
from umrt.sim.budget import BASES

DEFAULT_GPU = "v100-pcie3-32g"
DEFAULT_BUDGET = "50%"
DEFAULT_POLICY = "um"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a trace under a policy on a simulated GPU",
        description=(
            "Replay TRACE (from `umrt trace`) on the Unified Memory simulator and report the "
            "steady-state iteration: time, slowdown against unlimited memory, traffic, faults, and the "
            "link bound no policy can beat at this budget (umrt.sim.bound)."
        ),
    )
    p.add_argument("trace", metavar="TRACE", help="trace file written by `umrt trace`")
    p.add_argument("--gpu", default=DEFAULT_GPU, metavar="PROFILE",
                   help=f"hardware profile: one of {', '.join(PROFILES)}, or a profile JSON file "
                        f"(default {DEFAULT_GPU})")
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help="GPU memory the run may use: a percentage of the footprint the run needs "
                        "('20%%'; 100%% holds everything: see --budget-base), a size ('8GiB', '512MB') or bytes "
                        f"(default {DEFAULT_BUDGET.replace('%', '%%')})")
    p.add_argument("--budget-base", choices=BASES, default="footprint",
                   help="what a percentage budget is of: 'footprint' (default), the managed memory the trace "
                        "needs with nothing evicted (the larger of umrt's pool and PyTorch's caching allocator "
                        "replayed over it), or 'peak', the trace's peak live bytes (umrt before 0.2)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"policy name, e.g. ideal, um, um-advise, oracle, deepum, umrt (default {DEFAULT_POLICY})")
    p.add_argument("--iterations", type=int, default=None, metavar="N",
                   help="iterations to simulate; the last one is reported (default 3, or as many as the "
                        "policy needs to reach its steady state: 5 for umrt)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # optional: the simulator (numpy, numba) is loaded only when a run is simulated, not for `umrt --help`
    from umrt.sim.bound import link_bound

    # optional: the simulator (numpy, numba) is loaded only when a run is simulated, not for `umrt --help`
    from umrt.sim.replay import simulate

    # optional: trace files need numpy; not for `umrt --help`
    from umrt.trace.fileformat import load

    if args.iterations is not None and args.iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {args.iterations}")
    profile = load_profile(args.gpu)  # before the (slow) trace load: fail fast on a typo
    trace = load(args.trace)
    policy = make_policy(args.policy, trace)
    iterations = args.iterations or policy.steady_iterations()
    result = simulate(trace, policy, profile, args.budget, iterations=iterations,
                      progress=not args.json and sys.stderr.isatty(), budget_base=args.budget_base)
    bound = link_bound(trace, profile, args.budget, iterations=iterations, budget_base=args.budget_base)
    if args.json:
        json.dump(result.to_json() | {"link_bound": bound.to_json()}, sys.stdout, indent=2)
        print()
    else:
        _print_table(result, bound)
    return 0


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1.0 else f"{t * 1e3:.2f} ms"


def _print_table(r, bound) -> None:
    from rich.table import Table

    budget = r.budget.describe() if r.budget is not None else f"budget {format_bytes(r.budget_bytes)}"
    # The title on a line of its own: a table's title wraps at the table's (narrow) width.
    title = f"{r.model} · {r.policy} · {r.profile} · {budget} · simulated, iteration {r.iterations} of {r.iterations}"
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("iteration time", _seconds(r.iteration_time_s)),
        ("ideal (unlimited memory)", _seconds(r.ideal_time_s)),
        ("slowdown vs ideal", f"{r.slowdown:.3f}x"),
        ("link bound (no policy is faster)", f"{_seconds(bound.time_s)} ({bound.slowdown:.3f}x ideal)"),
        ("  counting copy-back (estimate)", f"{_seconds(bound.conserving_s)} "
                                      f"({bound.conserving_s / bound.ideal_s:.3f}x ideal)"),
        ("  compute", _seconds(r.breakdown['compute_s'])),
        ("  fault stall", _seconds(r.breakdown['fault_stall_s'])),
        ("  transfer wait", _seconds(r.breakdown['transfer_wait_s'])),
        ("  call overhead", _seconds(r.breakdown['overhead_s'])),
        ("  remote access", _seconds(r.breakdown['remote_access_s'])),
        ("host to device", format_bytes(r.h2d_bytes)),
        ("device to host", format_bytes(r.d2h_bytes)),
        ("faults (64 KB pages)", f"{r.faults:,}"),
        ("fault batches", f"{r.fault_batches:,}"),
        ("evictions (2 MB blocks)", f"{r.evictions:,}"),
        ("peak resident", format_bytes(r.peak_resident_bytes)),
        ("trace peak live", format_bytes(r.peak_live_bytes)),
        ("layout footprint", format_bytes(r.footprint_bytes)),
        ("simulated in", f"{r.wall_s:.1f} s ({r.page_events_per_s:,.0f} page events/s)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = make_console()
    console.print(title, soft_wrap=True, highlight=False, markup=False)
    console.print(table)
