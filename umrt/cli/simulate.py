"""``umrt simulate``: replay a trace under a policy on a simulated GPU.

    umrt simulate gpt2-xl.umrt --profile v100-pcie3-32g --gpu-memory 20% --policy um
    umrt simulate gpt2-xl.umrt --gpu-memory 8GiB --policy oracle --iterations 5 --json
"""
from __future__ import annotations

import argparse
import json
import sys

from umrt.cli import Renamed
from umrt.config import SIMULATED_DEFAULT, format_bytes
from umrt.console import console
from umrt.errors import ConfigError
from umrt.hardware import PROFILES, load_profile
from umrt.policy import make_policy

DEFAULT_PROFILE = "v100-pcie3-32g"
DEFAULT_POLICY = "umrt"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a trace under a policy on a simulated GPU",
        description=(
            "Replay TRACE (from `umrt trace`) on the Unified Memory simulator and report the "
            "steady-state iteration: time, slowdown against unlimited memory, traffic, faults, and the "
            "link bound no policy can beat at this GPU memory."
        ),
    )
    p.add_argument("trace", metavar="TRACE", help="trace file written by `umrt trace`")
    p.add_argument("--profile", default=DEFAULT_PROFILE, metavar="PROFILE",
                   help=f"hardware profile: one of {', '.join(PROFILES)}, or a profile JSON file "
                        f"(default {DEFAULT_PROFILE})")
    p.add_argument("--gpu-memory", default=SIMULATED_DEFAULT, metavar="AMOUNT",
                   help="GPU memory of the simulated GPU: a percentage of the footprint the run needs ('20%%'; "
                        "the GPU memory its allocations take with nothing evicted, so 100%% holds everything), "
                        "of its peak live bytes ('20%%peak'), or a size ('8GiB', '512MB', bytes) "
                        f"(default {SIMULATED_DEFAULT.replace('%', '%%')})")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"policy name, e.g. ideal, um, um-advise, oracle, deepum, umrt (default {DEFAULT_POLICY})")
    p.add_argument("--iterations", type=int, default=None, metavar="N",
                   help="iterations to simulate; the last one is reported (default 3, or as many as the "
                        "policy needs to reach its steady state: 5 for umrt)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    # Old spellings, for one version (each prints a note).
    p.add_argument("--gpu", dest="profile", action=Renamed, new="--profile")
    p.add_argument("--budget", dest="gpu_memory", action=Renamed, new="--gpu-memory")
    p.add_argument("--budget-base", dest="budget_base", action=Renamed, choices=("footprint", "peak"),
                   default="footprint",
                   note="--budget-base is gone: a percentage names its base, '20%' of the footprint the run "
                        "needs, '20%peak' of its peak live bytes; '--budget-base peak' reads a bare '20%' as "
                        "'20%peak' for this version")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # optional: the simulator (numpy, numba) is loaded only when a run is simulated, not for `umrt --help`
    from umrt.sim.bound import link_bound

    # optional: the simulator (numpy, numba) is loaded only when a run is simulated, not for `umrt --help`
    from umrt.sim.budget import budget_base

    # optional: the simulator (numpy, numba) is loaded only when a run is simulated, not for `umrt --help`
    from umrt.sim.replay import replayable_iterations, simulate

    # optional: trace files need numpy; not for `umrt --help`
    from umrt.trace.fileformat import load

    if args.iterations is not None and args.iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {args.iterations}")
    budget_base(args.gpu_memory)  # a base a simulated run cannot read fails before the trace loads
    profile = load_profile(args.profile)  # before the (slow) trace load: fail fast on a typo
    trace = load(args.trace)
    policy = make_policy(args.policy, trace)
    iterations = args.iterations or replayable_iterations(trace, policy.steady_iterations())
    result = simulate(trace, policy, profile, args.gpu_memory, iterations=iterations,
                      progress=not args.json and sys.stderr.isatty(), budget_base=args.budget_base)
    bound = link_bound(trace, profile, args.gpu_memory, iterations=iterations, budget_base=args.budget_base)
    if args.json:
        data = result.to_json() | {"link_bound": bound.to_json(), "layout_reserved_bytes": result.footprint_bytes}
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        _print_table(result, bound)
    return 0


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1.0 else f"{t * 1e3:.2f} ms"


def _print_table(r, bound) -> None:
    from rich.table import Table

    # optional: the simulator's budget module (numpy) is loaded only when a run is simulated
    from umrt.sim.budget import FOOTPRINT_DEFINITION, PEAK_LIVE_DEFINITION

    # The title on a line of its own: a table's title wraps at the table's (narrow) width.
    title = f"{r.model} · {r.policy} · {r.profile} · simulated, iteration {r.iterations} of {r.iterations}"
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    b = r.budget
    memory = f"{format_bytes(b.bytes)} = {b.share()}" if b is not None else format_bytes(r.budget_bytes)
    rows = [
        ("GPU memory", memory),
        ("footprint", format_bytes(b.needs.footprint_bytes) if b is not None else "-"),
        ("peak live", format_bytes(r.peak_live_bytes)),
        ("iteration time", _seconds(r.iteration_time_s)),
        ("ideal (unlimited memory)", _seconds(r.ideal_time_s)),
        ("slowdown vs ideal", f"{r.slowdown:.3f}x"),
        ("link bound (no policy is faster)", f"{_seconds(bound.time_s)} ({bound.slowdown:.3f}x ideal)"),
        ("  in a steady state", f"{_seconds(bound.steady_s)} ({bound.steady_s / bound.ideal_s:.3f}x ideal)"),
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
        (f"reserved by {r.policy}'s layout", format_bytes(r.footprint_bytes)),
        ("simulated in", f"{r.wall_s:.1f} s ({r.page_events_per_s:,.0f} page events/s)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out = console()
    out.print(title, soft_wrap=True, markup=False)
    out.print(table)
    out.print(f"{FOOTPRINT_DEFINITION}.")
    out.print(f"{PEAK_LIVE_DEFINITION}.")
