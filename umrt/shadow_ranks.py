"""Shadow mode under ``torchrun``: each rank simulates its own GPU, one report for the job.

    umrt run --simulate h100-pcie5-80g --gpu-memory 20% -- torchrun --nproc_per_node 2 train.py
    UMRT=1 UMRT_SIMULATE=h100-pcie5-80g torchrun --nproc_per_node 2 train.py      # the same

Both start ``torchrun`` as the user wrote it, with umrt's start-up hook on. In
the launcher's process the hook does only this module's part
(:func:`collect_at_exit`): it names a folder for the ranks' reports
(``UMRT_SHADOW_REPORTS``, inherited by every worker) and, when ``torchrun``
exits, prints one report with a row per rank and the step the slowest rank
sets. Each worker runs its script in shadow mode as a single process would
(:func:`umrt.shadow.run_shadow`), on the CPU, with its own simulated GPU, and
leaves its report in the folder (:func:`keep`) instead of printing it. No rank
waits for another: the launcher reads the reports after every rank has ended,
so a rank that dies leaves a row that says so and nothing hangs.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

from umrt import distributed, share
from umrt.config import Config, format_bytes
from umrt.distributed import RankInfo
from umrt.hardware import load_profile

__all__ = ["collect_at_exit", "rank_hooks", "simulated_share", "started", "keep", "read", "render"]

ENV = "UMRT_SHADOW_REPORTS"
#: In a reports folder: ``umrt run`` collects the ranks' reports itself (:mod:`umrt.launch`).
COLLECTOR = ".collected-by-umrt-run"


def collect_at_exit(cfg: Config) -> Path:
    """In ``torchrun``'s own process: the folder the ranks leave their reports in (set in
    ``UMRT_SHADOW_REPORTS`` for the workers), and the combined report printed at exit.
    A folder the user named (``UMRT_SHADOW_REPORTS``) is kept; umrt's own is removed."""
    named = cfg.shadow_reports
    folder = Path(named) if named else Path(tempfile.mkdtemp(prefix="umrt-ranks-"))
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(folder)
    if (folder / COLLECTOR).exists():  # `umrt run -- torchrun ...` prints the report itself
        return folder

    def report() -> None:
        try:
            text = render(read(folder), cfg)
            sys.stdout.flush()
            print(text, flush=True)
            if named:
                print(f"umrt: each rank's full report: {folder}/rank-N.txt", flush=True)
        finally:
            if not named:
                shutil.rmtree(folder, ignore_errors=True)

    atexit.register(report)
    return folder


def rank_hooks(cfg: Config, rank: RankInfo | None) -> dict[str, Any]:
    """What :func:`umrt.shadow.run_shadow` is given in a ``torchrun`` rank of a shadow run
    (``out`` and ``on_report``: the report is left for the launcher, not printed); empty
    outside one."""
    folder = cfg.shadow_reports
    if rank is None or not folder:
        return {}
    started(folder, rank)
    text: list[str] = []

    def on_report(report: dict, status: int) -> None:
        keep(folder, rank, report, "\n".join(text), status)

    return {"out": text.append, "on_report": on_report}


@contextlib.contextmanager
def simulated_share(cfg: Config, rank: RankInfo | None) -> Iterator[share.Share | None]:
    """A shadow run's share of its simulated GPU, held while the script runs: only for a
    budget in bytes (a percentage is of the footprint, known once the script has run).
    Its GPU is the profile's, one per ``LOCAL_RANK``: two shadow jobs started alone share
    device 0, the ranks of one job each have their own.

    Raises:
        ShareError: the simulated GPU cannot give this job its share (exit status 2).
    """
    fixed = cfg.gpu_memory.bytes if cfg.gpu_memory is not None else None
    if cfg.shares_off or fixed is None:
        yield None
        return
    profile = load_profile(cfg.simulate)
    device = distributed.rank_device(cfg.device if rank is None else None, rank, rank.local_world_size if rank else 1)
    registry = share.Registry(cfg.share_dir or share.default_folder(), f"sim-{profile.name}-{device}")
    held = share.join(registry, profile.gpu_memory_bytes, fixed=fixed, minimum=0,
                      wait=cfg.share_wait, label=share.job_label(),
                      describe=f"the simulated {profile.name} GPU {device}")
    if held.others:
        print(f"umrt: the simulated {profile.name} GPU {device} is shared with {held.others} other umrt "
              f"job(s): this job's share is {format_bytes(held.held)}", file=sys.stderr)
    try:
        yield held
    finally:
        held.close()


def started(folder: str | Path, rank: RankInfo) -> None:
    """A rank started: its row says so even if it never ends."""
    Path(folder, f"rank-{rank.rank}.started").write_text(json.dumps({"rank": rank.rank, "pid": os.getpid()}))


def keep(folder: str | Path, rank: RankInfo, report: dict, text: str, status: int) -> None:
    """A rank's shadow report (the dict :func:`umrt.shadow.run_shadow` builds, its rendered
    text and the script's exit status), left for the launcher."""
    path = Path(folder, f"rank-{rank.rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank.rank, "world_size": rank.world_size, "status": status,
                               "report": report}, default=float))
    tmp.replace(path)  # whole or absent, never half-written
    Path(folder, f"rank-{rank.rank}.txt").write_text(text + "\n")


def read(folder: str | Path) -> dict[int, dict | None]:
    """Rank -> its report (None: it started and left no report)."""
    out: dict[int, dict | None] = {}
    for path in Path(folder).glob("rank-*.started"):
        with contextlib.suppress(ValueError):
            out[int(path.stem.split("-", 1)[1])] = None
    for path in Path(folder).glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads(path.read_text())
            out[int(data["rank"])] = data
    return dict(sorted(out.items()))


def _live_row(report: dict) -> dict | None:
    return next((r for r in report.get("rows", []) if r.get("how") == "live"), None)


def render(ranks: dict[int, dict | None], cfg: Config) -> str:
    """The job's report: a row per rank (its own simulated GPU's steady iteration) and the
    step the slowest rank sets (every rank waits for it in each collective)."""
    from rich.console import Console
    from rich.table import Table

    profile = next((d["report"].get("profile") for d in ranks.values() if d), cfg.simulate)
    table = Table(title=f"umrt shadow run under torchrun — a {profile} GPU per rank (SIMULATED)")
    for col in ("rank", "iterations", "GPU memory", "umrt iteration", "vs ideal", "vs um", "H2D", "D2H",
                "deviations", "exit"):
        table.add_column(col, justify="left" if col == "rank" else "right")
    notes, slowest = [], None
    for rank, data in ranks.items():
        if data is None:
            table.add_row(str(rank), "-", "-", "-", "-", "-", "-", "-", "-", "no report")
            notes.append(f"rank {rank} started but left no report: it died or was stopped (see torchrun's "
                         "messages above)")
            continue
        rep, live = data["report"], _live_row(data["report"])
        rt = rep.get("runtime") or {}
        if live is None:
            table.add_row(str(rank), str(rep.get("iterations", 0)), "-", "-", "-", "-", "-", "-", "-",
                          str(data.get("status", "")))
            notes.extend(f"rank {rank}: {n}" for n in rep.get("notes", []))
            continue
        if slowest is None or live["iteration_time_s"] > slowest[1]:
            slowest = (rank, live["iteration_time_s"], live["vs_ideal"])
        vs_um = rep.get("speedup_vs_um")
        table.add_row(str(rank), str(rep.get("iterations", 0)), format_bytes(rep.get("budget_bytes") or 0),
                      f"{live['iteration_time_s'] * 1e3:.2f} ms", f"{live['vs_ideal']:.2f}x",
                      f"{vs_um:.2f}x faster" if vs_um and vs_um >= 1 else (f"{1 / vs_um:.2f}x slower" if vs_um
                                                                           else "learned only" if rt.get("acted") == 0
                                                                           else "-"),
                      format_bytes(live["h2d_bytes"]), format_bytes(live["d2h_bytes"]),
                      str(rt.get("deviations", 0)), str(data.get("status", "")))
    lines = [
        "Each rank ran its script unchanged on the CPU (its losses are a plain run's) and drove a simulated "
        "GPU of its own; a row is that rank's steady-state training iteration under umrt.",
        "  vs ideal: against a GPU with enough memory; vs um: against plain Unified Memory over the whole run "
        "(learned only: the rank learned on every iteration and acted on none); deviations: "
        "iterations that left the rank's learned plan (a rank deviates on its own, no other rank waits for "
        "its runtime).",
    ]
    if slowest is not None:
        lines.append(f"The job steps at the pace of its slowest rank: rank {slowest[0]}, "
                     f"{slowest[1] * 1e3:.2f} ms per iteration ({slowest[2]:.2f}x ideal), simulated; the "
                     "others wait for it in their collectives (communication time itself is not simulated).")
    if not ranks:
        lines.append("No rank left a report: did the workers start under umrt (UMRT=1 hook installed)?")
    buf = StringIO()
    Console(file=buf, width=130, highlight=False).print(table)
    return buf.getvalue() + "\n".join(lines + notes)
