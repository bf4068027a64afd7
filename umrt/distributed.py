"""umrt under ``torchrun``: which rank a process is, which GPU it drives, and that
every rank started with the same settings.

``torchrun`` (``torch.distributed.run``) is a launcher: it starts one worker
process per rank and tells each its place in the job through the environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``/``MASTER_PORT`` of the store its agent
hosts: ``torch.distributed.elastic.agent.server.local_elastic_agent``). With
``UMRT=1`` the launcher itself starts under umrt's start-up hook too (it is a
Python program that imports torch); umrt leaves it alone (:func:`is_launcher`)
and each worker runs its own umrt:

* **its own GPU** (:func:`rank_device`): ``UMRT_DEVICE`` if set, else the rank's
  ``LOCAL_RANK`` (modulo the GPUs it sees, as torch maps a rank to a device:
  ``ProcessGroupNCCL``'s ``getDeviceForRank``), else 0; a script that picks
  another one with ``torch.cuda.set_device`` before its first CUDA tensor is
  followed (:func:`umrt.api.follow_device`);
* **its own budget** of that GPU (a share of it: :mod:`umrt.share`);
* **its own plan**: nothing in umrt's hot path talks to another rank, so a rank
  that deviates from its plan (or dies) never holds the others up. The one
  exchange is at start-up: :func:`check_same_settings` compares every rank's
  umrt settings with rank 0's through the launcher's own store, once, with a
  time limit.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from umrt.config import Amount, Config, env_var
from umrt.errors import ConfigError

__all__ = ["RankInfo", "rank_info", "is_launcher", "launcher_command", "rank_device", "settings_of",
           "differences", "check_same_settings", "SETTINGS_WAIT_S"]

log = logging.getLogger("umrt")

#: The launchers umrt recognizes: ``torchrun`` and ``python -m torch.distributed.run``/``.launch``.
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
LAUNCHER_SCRIPTS = ("torchrun",)
#: How long a rank waits for rank 0's settings at start-up before it goes on unchecked.
SETTINGS_WAIT_S = 60.0
#: Settings that may differ between ranks (each rank's own device; how much it logs).
PER_RANK = ("enabled", "device", "log_level", "telemetry", "shadow_reports")


@dataclass(frozen=True)
class RankInfo:
    """A worker's place in a ``torchrun`` job (from its environment)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    run_id: str = ""
    restart: int = 0
    store: tuple[str, int] | None = None  # the launcher's store (TORCHELASTIC_USE_AGENT_STORE)


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """This process's rank, or None when it was not started by ``torchrun`` (or its
    variables do not parse)."""
    env = os.environ if environ is None else environ
    try:
        rank, local, world = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except (KeyError, ValueError):
        return None
    store = None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        try:
            store = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        except ValueError:
            store = None
    return RankInfo(rank, local, world, local_world, env.get("TORCHELASTIC_RUN_ID", ""), restart, store)


def is_launcher(argv: Sequence[str] | None = None) -> bool:
    """True in ``torchrun``'s own process (the launcher, not a rank): ``torchrun ...``,
    ``python -m torch.distributed.run ...`` or ``... torch.distributed.launch``.
    ``argv`` defaults to the interpreter's full command line (``sys.orig_argv``)."""
    args = list(argv if argv is not None else sys.orig_argv or sys.argv)
    if not args:
        return False
    if not _is_python(args[0]):
        return os.path.basename(args[0]) in LAUNCHER_SCRIPTS
    rest = iter(args[1:])
    for arg in rest:  # the interpreter's own options, up to what it runs
        if arg == "-m":
            return next(rest, "") in LAUNCHER_MODULES
        if arg == "-c":
            return False
        if arg in ("-X", "-W", "-Q"):
            next(rest, None)
        elif not arg.startswith("-"):
            return os.path.basename(arg) in LAUNCHER_SCRIPTS
    return False


def _is_python(path: str) -> bool:
    return os.path.basename(path).startswith("python") or os.path.realpath(path) == os.path.realpath(
        sys.executable)


def launcher_command(command: Sequence[str]) -> bool:
    """Whether ``command`` (``umrt run``'s script and arguments) starts a launcher:
    ``torchrun ...`` or ``python -m torch.distributed.run ...``."""
    if not command:
        return False
    if os.path.basename(command[0]) in LAUNCHER_SCRIPTS:
        return True
    return _is_python(command[0]) and is_launcher(list(command))


def rank_device(explicit: int | None, rank: RankInfo | None, count: int) -> int:
    """The GPU a process drives: ``explicit`` (``UMRT_DEVICE``), else the rank's
    ``LOCAL_RANK`` modulo the ``count`` GPUs it sees, else 0."""
    if explicit is not None:
        return explicit
    if rank is not None and count > 0:
        return rank.local_rank % count
    return 0


def settings_of(cfg: Config) -> dict[str, str]:
    """``cfg`` as the ``UMRT_*`` variables that must agree across ranks (each as text)."""
    out = {}
    for field in dataclasses.fields(cfg):
        if field.name in PER_RANK:
            continue
        value = getattr(cfg, field.name)
        text = (value.text or str(value)) if isinstance(value, Amount) else value
        out[env_var(field.name)] = "" if text is None else str(text)
    return out


def differences(mine: Mapping[str, str], theirs: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """``(variable, mine, theirs)`` for each setting that differs."""
    return [(k, mine.get(k, ""), theirs.get(k, "")) for k in sorted(set(mine) | set(theirs))
            if mine.get(k, "") != theirs.get(k, "")]


def _key(rank: RankInfo, who: int) -> str:
    return f"umrt/{rank.run_id}/{rank.restart}/settings/{who}"


def check_same_settings(cfg: Config, rank: RankInfo | None = None, *, store: Any = None,
                        wait_s: float = SETTINGS_WAIT_S) -> None:
    """Under ``torchrun``: leave this rank's settings in the launcher's store and compare
    them with rank 0's (once, at start-up). Does nothing outside ``torchrun``, in a
    one-rank job, or where the launcher hosts no store for its workers.

    Args:
        store: a ``torch.distributed.Store`` to use (default: a client of the launcher's).
        wait_s: how long to wait for rank 0's settings; then this rank goes on unchecked
            (with a warning): rank 0 may not run umrt at all.

    Raises:
        ConfigError: this rank's settings differ from rank 0's; the message names each
            variable, this rank's value and rank 0's.
    """
    rank = rank if rank is not None else rank_info()
    if rank is None or rank.world_size < 2 or (store is None and rank.store is None):
        return
    mine = settings_of(cfg)
    try:
        store = store if store is not None else _client(rank, wait_s)
        store.set(_key(rank, rank.rank), json.dumps(mine))
        if rank.rank == 0:
            return
        store.wait([_key(rank, 0)], timedelta(seconds=wait_s))
        theirs = json.loads(store.get(_key(rank, 0)))
    except Exception as exc:  # noqa: BLE001 - a store that cannot answer: unchecked, not an error
        log.warning("umrt: rank %d could not compare its UMRT_* settings with rank 0's (%s: %s); going on",
                    rank.rank, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return
    diff = differences(mine, theirs)
    if diff:
        said = "; ".join(f"{var}={m!r} here, {t!r} on rank 0" for var, m, t in diff)
        raise ConfigError(f"rank {rank.rank} was started with other umrt settings than rank 0: {said}. "
                          "Start every rank with the same UMRT_* variables (and umrt.enable() arguments)")


def _client(rank: RankInfo, wait_s: float) -> Any:
    """A client of the store ``torchrun``'s agent hosts for its workers."""
    # optional: torch.distributed only under torchrun; `import umrt` stays light
    from torch.distributed import TCPStore

    host, port = rank.store  # type: ignore[misc]
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s))
