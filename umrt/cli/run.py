"""``umrt run [options] script.py [args...]``: run a training script under umrt (the help text,
:data:`DESCRIPTION`, says what it does); ``umrt run [options] -- torchrun ...`` runs a ``torchrun``
job with umrt in every rank (:mod:`umrt.launch`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from umrt import api, distributed, shadow_ranks
from umrt.config import LIVE_DEFAULT, SIMULATED_DEFAULT, Config, from_env, parse_amount
from umrt.errors import ConfigError
from umrt.launch import run_launcher
from umrt.scripts import run_script

DESCRIPTION = f"""\
Run a training script under umrt.

  on a CUDA GPU: umrt manages the script's memory (the UMRT_* settings, the flags
      below override them) and prints NVML telemetry at exit.
  --simulate PROFILE (or UMRT_SIMULATE): shadow mode, no GPU needed. The script runs
      unchanged on the CPU; umrt then reports what a GPU of that hardware profile
      would have done, against plain Unified Memory and unlimited memory, and how
      much memory the run can save at what cost (all simulated).
  without a GPU and without --simulate: the script runs unchanged.

GPU memory (--gpu-memory, UMRT_GPU_MEMORY): a size ('12GiB', '500MB', a byte count)
or a percentage of one named thing:
  '50%'        of the footprint the run needs (the GPU memory its allocations take
               with nothing evicted); shadow mode only: a live run does not know it
  '50%peak'    of the run's peak live bytes; shadow mode only
  '90%device'  of the GPU's memory; a live run only
Default: live, a fair share of the GPU ({LIVE_DEFAULT} when umrt is alone on it);
{SIMULATED_DEFAULT} in shadow mode.

examples:
  umrt run --simulate h100-pcie5-80g --gpu-memory 20% examples/train_gpt2.py
  umrt run --gpu-memory 90%device train.py --lr 3e-4
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a training script with umrt (or simulate it with --simulate)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--simulate", metavar="PROFILE", default=None,
                   help="shadow mode: simulate the script on this hardware profile (name or JSON path; "
                        "UMRT_SIMULATE)")
    p.add_argument("--gpu-memory", metavar="AMOUNT", default=None,
                   help=f"GPU memory umrt may use, see above (UMRT_GPU_MEMORY; default: live, a fair share, "
                        f"{LIVE_DEFAULT} alone; {SIMULATED_DEFAULT} in shadow mode)".replace("%", "%%"))
    p.add_argument("--policy", default=None, help="policy name (UMRT_POLICY; default umrt)")
    p.add_argument("--device", type=int, default=None, help="CUDA device index (UMRT_DEVICE; default 0)")
    p.add_argument("--no-telemetry", dest="telemetry", action="store_false", default=None,
                   help="do not sample NVML during the run")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="shadow mode: also draw the memory-savings curve into this PNG file")
    p.add_argument("script", help="the Python script to run (or `torchrun ...`, after `--`)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=main)


def config_from(args: argparse.Namespace) -> Config:
    """The run's settings: the ``UMRT_*`` variables with the flags over them, checked (a GPU memory
    this kind of run cannot read, a bad flag: a :class:`ConfigError` naming it)."""
    overrides: dict[str, object] = {"simulate": args.simulate, "policy": args.policy, "device": args.device}
    if args.gpu_memory is not None:
        overrides["gpu_memory"] = parse_amount(args.gpu_memory, "--gpu-memory")
    cfg = from_env().replace(**{k: v for k, v in overrides.items() if v is not None})
    cfg.budget()
    return cfg


def main(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    script = args.script
    if distributed.launcher_command([script, *args.args]):
        return _torchrun(args)
    if not os.path.isfile(script):
        raise ConfigError(f"script {script!r} not found")
    if cfg.shadow:
        return shadow(cfg, script, list(args.args), plot=args.plot)
    if args.plot is not None:
        raise ConfigError("--plot draws shadow mode's memory-savings curve: add --simulate PROFILE")

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
    if args.plot is not None:
        raise ConfigError("--plot draws one process's memory-savings curve; it does not apply to a torchrun job")
    settings = {"UMRT_SIMULATE": args.simulate, "UMRT_GPU_MEMORY": args.gpu_memory, "UMRT_POLICY": args.policy}
    if args.telemetry is False:
        settings["UMRT_TELEMETRY"] = "0"
    settings = {k: str(v) for k, v in settings.items() if v is not None}
    cfg = from_env({**os.environ, **settings})  # checked here, once, before any rank starts
    cfg.budget()
    return run_launcher(cfg, [args.script, *args.args], settings)


def shadow(cfg: Config, script: str, argv: list[str], plot: str | None = None) -> int:
    """Run ``script`` in shadow mode on ``cfg.simulate`` (``umrt run --simulate`` and ``UMRT_SIMULATE``),
    with the GPU memory ``cfg.budget()`` reads (``--gpu-memory``, else ``UMRT_GPU_MEMORY``, else the
    simulated default); an old spelling's note first. In a ``torchrun`` rank the report is left for
    the launcher (:mod:`umrt.shadow_ranks`)."""
    for note in cfg.notes():
        print(f"umrt: note: {note}", file=sys.stderr)
    extra: dict = {"plot": plot} if plot is not None else {}
    rank = distributed.rank_info()
    distributed.check_same_settings(cfg, rank)
    extra.update(shadow_ranks.rank_hooks(cfg, rank))  # a torchrun rank leaves its report for the launcher
    with shadow_ranks.simulated_share(cfg, rank):  # a share refused is said before shadow mode loads
        # optional: umrt.shadow (torch, the simulator) is loaded only in shadow mode (tests swap it in sys.modules)
        from umrt.shadow import run_shadow

        return int(run_shadow(script, argv, profile=cfg.simulate, policy=cfg.policy, gpu_memory=cfg.budget(),
                              **extra) or 0)
