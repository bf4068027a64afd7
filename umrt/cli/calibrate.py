"""``umrt calibrate [-o PROFILE.json]``: measure this GPU and write a hardware profile."""
from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this GPU's Unified Memory behaviour and write a hardware profile",
        description="Measures fault-batch latency, fault-driven and prefetch bandwidth by transfer size, "
        "link rates and HBM bandwidth on a CUDA GPU, and writes a profile file that "
        "`umrt simulate --gpu FILE` and `UMRT_PROFILE=FILE` read. Needs a GPU (exit status 2 without one).",
    )
    p.add_argument("-o", "--output", default="calibrated.json", help="profile file to write (default %(default)s)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--base", default=None,
                   help="shipped profile to start from (default: chosen from the device name)")
    p.add_argument("--repeats", type=int, default=5, help="repetitions per measurement (median; default 5)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from umrt import calibrate
    from umrt.config import format_bytes
    from umrt.errors import ConfigError
    from umrt.hardware import save_profile

    if args.repeats < 1:
        raise ConfigError(f"--repeats={args.repeats} must be >= 1")
    console = Console(stderr=True)
    probe = calibrate.CudaProbe(args.device)
    try:
        steps = 2 * len([s for s in calibrate.SIZES if s <= probe.free_bytes // 2]) + 2
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"calibrating {probe.device_name}", total=steps)

            def step(label: str) -> None:
                progress.update(task, advance=1, description=label)

            m = calibrate.measure(probe, repeats=args.repeats, progress=step)
    finally:
        probe.close()
    profile = calibrate.build_profile(m, args.base)
    save_profile(profile, args.output)
    largest = max(m.h2d_rate)
    console.print(
        f"{m.device_name}: prefetch h2d {format_bytes(m.h2d_rate[largest])}/s, "
        f"d2h {format_bytes(m.d2h_rate[largest])}/s, fault-driven {format_bytes(m.fault_rate[largest])}/s "
        f"({format_bytes(largest)} transfers); fault latency {m.fault_latency_s * 1e6:.1f} us; "
        f"HBM {format_bytes(m.hbm_bandwidth)}/s"
    )
    console.print(f"wrote {args.output}")
    return 0
