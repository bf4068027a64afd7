"""``umrt calibrate [-o PROFILE.json]``: measure this GPU and write a hardware profile."""
from __future__ import annotations

import argparse
from typing import Any

from umrt.console import console as umrt_console
from umrt.errors import ConfigError
from umrt.hardware import save_profile


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this GPU's Unified Memory behaviour and write a hardware profile",
        description="Measures every Unified Memory cost the simulator models (prefetch set-up and rate each way, "
        "host population, fault latency and fault-driven migration, first touch, discard and the refault path, "
        "call costs by kind), the link (pinned copies), fp32 matmul and device-copy rates, names the card "
        "(SXM, PCIe, NVLink-C2C) from its name and attributes, and writes a profile file that "
        "`umrt simulate --profile FILE` and `UMRT_PROFILE=FILE` read. Never asks for more than half the free GPU "
        "memory. Needs a GPU (exit status 2 without one).",
    )
    p.add_argument("-o", "--output", default="calibrated.json", help="profile file to write (default %(default)s)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--base", default=None,
                   help="shipped profile for what is not measured (default: the card identified)")
    p.add_argument("--repeats", type=int, default=5, help="repetitions per measurement (median; default 5)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    # optional: umrt.calibrate loads the CUDA backend (numpy); not for `umrt --help`
    from umrt import calibrate

    if args.repeats < 1:
        raise ConfigError(f"--repeats={args.repeats} must be >= 1")
    console = umrt_console(stderr=True)
    probe = calibrate.CudaProbe(args.device)
    try:
        steps = calibrate.MEASURE_STEPS - (0 if probe.has_batch else 2)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"calibrating {probe.device_name}", total=steps)

            def step(label: str) -> None:
                progress.update(task, advance=1, description=label)

            m = calibrate.measure(probe, repeats=args.repeats, progress=step)
    finally:
        probe.close()
    profile = calibrate.build_profile(m, args.base)
    save_profile(profile, args.output)
    console.print(summary(profile))
    console.print(f"wrote {args.output}")
    return 0


def summary(p: Any) -> str:
    """One paragraph of what was measured, in the units h100-measured.md uses."""
    return (
        f"{p.description}\n"
        f"prefetch to GPU {p.prefetch_h2d_setup_s * 1e6:.0f} us + size at {p.prefetch_h2d_rate / 1e9:.1f} GB/s, "
        f"to host {p.prefetch_d2h_setup_s * 1e6:.0f} us + size at {p.prefetch_d2h_rate / 1e9:.1f} GB/s "
        f"(first time +{p.host_populate_rate / 1e9:.1f} GB/s host population); link {p.h2d_bandwidth / 1e9:.1f} / "
        f"{p.d2h_bandwidth / 1e9:.1f} GB/s\n"
        f"faults: {p.fault_batch_latency_s * 1e6:.0f} us per batch, migration {p.fault_migration_rate / 1e9:.2f} GB/s, "
        f"first touch {p.first_touch_rate / 1e9:.2f} GB/s, population by prefetch "
        f"{p.prefetch_populate_rate / 1e9:.0f} GB/s\n"
        f"discard {p.discard_rate / 1e9:.0f} GB/s + {p.discard_range_s * 1e6:.1f} us per range; a write after it "
        f"{p.discard_refault_rate / 1e9:.2f} GB/s, a prefetch after it {p.discard_prefetch_rate / 1e9:.0f} GB/s\n"
        f"calls: prefetch {p.prefetch_call_overhead_s * 1e6:.1f} us, advise {p.advise_call_s * 1e6:.0f} us, "
        f"batched {p.batch_range_s * 1e6:.0f} us per range (+{p.batch_d2h_range_s * 1e6:.0f} us to the host)\n"
        f"fp32 {p.peak_for('fp32') * p.compute_efficiency / 1e12:.1f} TFLOP/s, HBM "
        f"{p.achieved_hbm_bandwidth / 1e12:.2f} TB/s"
    )
