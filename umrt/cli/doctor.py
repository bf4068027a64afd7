"""``umrt doctor``: check this machine for a GPU run of umrt (see :mod:`umrt.doctor`)."""
from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this machine for a GPU run: driver, CUDA, GPU, torch, shim, NVML, profile, UMRT=1, versions",
        description="Check what a GPU run of umrt needs, in order: the UMRT_* settings, the CUDA runtime "
        "umrt calls and the driver, the GPU (name, memory, concurrent managed access), the batched and "
        "discard calls (CUDA 13), torch's CUDA build, the torch allocator shim (built now when it is not "
        "cached), NVML, the hardware profile umrt will plan with, whether UMRT=1 is installed, and the "
        "versions of umrt's dependencies against those it is tested with. Exit status 0 when nothing "
        "is missing, 2 when something is (each missing piece is named with the command that fixes it).",
    )
    p.add_argument("--no-build", dest="build_shim", action="store_false",
                   help="do not build the torch allocator shim when it is not cached (it takes 10-60 s once)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    # optional: umrt.doctor loads the CUDA backend (numpy); not for `umrt --help`
    from umrt.doctor import run

    return run(build_shim=args.build_shim, as_json=args.json)
