"""``umrt run [options] -- torchrun ...``: a ``torchrun`` job with umrt in every rank.

The command after ``umrt run``'s options is run as written, with umrt's
settings in its environment (``UMRT=1`` and the ``UMRT_*`` variables the
options stand for): ``torchrun`` hands its environment to every worker, and
each worker starts under umrt's start-up hook (``UMRT=1``), on its own GPU
(:mod:`umrt.distributed`) or, with ``--simulate``, in shadow mode on its own
simulated GPU. In shadow mode this process collects the ranks' reports and
prints the job's (:mod:`umrt.shadow_ranks`) once ``torchrun`` has exited;
the exit status is ``torchrun``'s.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from umrt import shadow_ranks
from umrt.config import Config
from umrt.errors import ConfigError

__all__ = ["run_launcher"]

MARKER = shadow_ranks.COLLECTOR


def _executable(name: str) -> str:
    """``name`` on PATH, else beside this Python (a venv's ``bin``, not activated)."""
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if found is None:
        raise ConfigError(f"{name!r} not found on PATH or beside {sys.executable}; is torch installed here?")
    return found


def run_launcher(cfg: Config, command: Sequence[str], settings: Mapping[str, str]) -> int:
    """Run ``command`` (``torchrun ...``) with ``settings`` (``UMRT_*`` variables) and
    ``UMRT=1`` in its environment; in shadow mode (``cfg.shadow``) print the job's report
    after it exits. Returns its exit status."""
    env = dict(os.environ, UMRT="1", **settings)
    argv = [_executable(command[0]) if os.sep not in command[0] else command[0], *command[1:]]
    if not cfg.shadow:
        return subprocess.call(argv, env=env)
    folder = Path(cfg.shadow_reports) if cfg.shadow_reports else Path(tempfile.mkdtemp(prefix="umrt-ranks-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(str(os.getpid()))
    env[shadow_ranks.ENV] = str(folder)
    try:
        status = subprocess.call(argv, env=env)
        ranks = shadow_ranks.read(folder)
        sys.stdout.flush()
        print(shadow_ranks.render(ranks, cfg), flush=True)
        if not ranks:
            print("umrt: no rank ran under umrt: the UMRT=1 start-up hook is missing from this Python "
                  "(fix: python -m umrt.activation --install)", file=sys.stderr)
            return status or 2
        if cfg.shadow_reports:
            print(f"umrt: each rank's full report: {folder}/rank-N.txt", flush=True)
        return status
    finally:
        (folder / MARKER).unlink(missing_ok=True)
        if not cfg.shadow_reports:
            shutil.rmtree(folder, ignore_errors=True)
