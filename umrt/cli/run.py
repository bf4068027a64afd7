"""``umrt run [options] script.py [args...]``: run a training script under umrt.

* ``--simulate PROFILE`` (or ``UMRT_SIMULATE``): shadow mode, no GPU needed:
  the script runs on the CPU and umrt simulates its GPU on ``PROFILE``
  (:func:`umrt.shadow.run_shadow`).
* On a CUDA machine: umrt is enabled (managed pool, torch allocator, runtime
  policy), the script runs as ``__main__`` with ``sys.argv`` set, and an NVML
  telemetry summary prints at exit.
* Without a GPU and without ``--simulate``: one line says so and the script
  runs unchanged.
* ``umrt run [options] -- torchrun --nproc_per_node N train.py``: the
  ``torchrun`` job as written, umrt in every rank (:mod:`umrt.launch`); with
  ``--simulate`` each rank simulates its own GPU and one report has a row per rank.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from umrt import api, distributed, shadow_ranks
from umrt.config import Config, from_env, parse_amount
from umrt.errors import ConfigError
from umrt.launch import run_launcher
from umrt.scripts import run_script
from umrt.sim.budget import parse_budget


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a training script with umrt (or simulate it with --simulate)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--simulate", metavar="PROFILE", default=None,
                   help="shadow mode: simulate the script on this hardware profile (name or JSON path)")
    p.add_argument("--gpu-memory", metavar="AMOUNT", default=None,
                   help="GPU memory budget: '20%%' or bytes like '12GiB' (UMRT_GPU_MEMORY)")
    p.add_argument("--policy", default=None, help="policy name (UMRT_POLICY; default umrt)")
    p.add_argument("--device", type=int, default=None, help="CUDA device index (UMRT_DEVICE)")
    p.add_argument("--no-telemetry", dest="telemetry", action="store_false", default=None,
                   help="do not sample NVML during the run")
    p.add_argument("script", help="the Python script to run (or `torchrun ...`, after `--`)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.gpu_memory is not None:  # an error that names the flag and what a percentage is of
        if args.simulate is not None or os.environ.get("UMRT_SIMULATE"):
            try:
                parse_budget(args.gpu_memory, 1 << 40)
            except ConfigError as exc:
                raise ConfigError(f"--gpu-memory in shadow mode: {exc}") from None
        else:
            parse_amount(args.gpu_memory, "--gpu-memory")
    script = args.script
    if distributed.launcher_command([script, *args.args]):
        return _torchrun(args)
    if not os.path.isfile(script):
        raise ConfigError(f"script {script!r} not found")
    overrides = {"simulate": args.simulate, "gpu_memory": args.gpu_memory, "policy": args.policy,
                 "device": args.device}
    cfg = from_env().replace(**{k: v for k, v in overrides.items() if v is not None})
    if cfg.shadow:
        return shadow(cfg, script, list(args.args))

    if api.gpu_count() == 0:  # looked up on the module: tests replace it
        api.say_no_gpu_once(f"running {os.path.basename(script)} unchanged (use --simulate PROFILE for shadow mode)")
        return run_script(script, list(args.args))
    # Telemetry is on by default under `umrt run`; --no-telemetry or UMRT_TELEMETRY=0 turn it off.
    telemetry = args.telemetry if args.telemetry is not None else (
        cfg.telemetry if "UMRT_TELEMETRY" in os.environ else True)
    session = api.enable(cfg, telemetry=telemetry)
    for note in session.notes:
        print(f"umrt: {note}", file=sys.stderr)
    try:
        return run_script(script, list(args.args))
    finally:
        api.disable()


def _torchrun(args: argparse.Namespace) -> int:
    """``umrt run [options] -- torchrun ...``: the options become ``UMRT_*`` variables of
    every rank (:func:`umrt.launch.run_launcher`)."""
    if args.device is not None:
        raise ConfigError("--device does not apply to a torchrun job: each rank drives the GPU of its "
                          "LOCAL_RANK (or what it sets with torch.cuda.set_device); use CUDA_VISIBLE_DEVICES")
    settings = {"UMRT_SIMULATE": args.simulate, "UMRT_GPU_MEMORY": args.gpu_memory, "UMRT_POLICY": args.policy}
    if args.telemetry is False:
        settings["UMRT_TELEMETRY"] = "0"
    settings = {k: str(v) for k, v in settings.items() if v is not None}
    cfg = from_env({**os.environ, **settings})  # checked here, once, before any rank starts
    return run_launcher(cfg, [args.script, *args.args], settings)


def shadow(cfg: Config, script: str, argv: list[str]) -> int:
    """Run ``script`` in shadow mode on ``cfg.simulate`` (``umrt run --simulate`` and ``UMRT_SIMULATE``).

    The budget is ``cfg.gpu_memory`` as it was given (``--gpu-memory``, else ``UMRT_GPU_MEMORY``):
    in shadow mode a percentage is of the footprint the script needs, so the text is read again by
    :func:`umrt.sim.budget.parse_budget`; unset keeps :func:`~umrt.shadow.run_shadow`'s default.
    """
    budget = cfg.gpu_memory.text
    extra: dict = {"gpu_memory": budget} if budget else {}
    rank = distributed.rank_info()
    distributed.check_same_settings(cfg, rank)
    extra.update(shadow_ranks.rank_hooks(cfg, rank))  # a torchrun rank leaves its report for the launcher
    with shadow_ranks.simulated_share(cfg, rank):  # a share refused is said before shadow mode loads
        # optional: umrt.shadow is loaded only in shadow mode (tests swap it in sys.modules)
        from umrt.shadow import run_shadow

        return int(run_shadow(script, argv, profile=cfg.simulate, policy=cfg.policy, **extra) or 0)
