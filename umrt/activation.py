"""``UMRT=1 python train.py``: switching umrt on with no code change.

A one-line ``umrt-activate.pth`` file in site-packages runs at every Python
start-up. It costs one environment lookup: only when ``UMRT`` is set to
something other than an off word (unset, empty, 0, false, no, off) does it
import this module and call :func:`activate_from_env`, which

1. validates every ``UMRT_*`` variable: a bad value prints one
   ``umrt: error: ...`` line and exits with status 2 before the script runs
   (``sys.exit`` is not possible while ``site`` runs: it is a fatal error there);
2. with ``UMRT_SIMULATE=PROFILE`` and a script path on the command line,
   runs the script in shadow mode (:func:`umrt.shadow.run_shadow`) and exits
   with its status;
3. in ``torchrun``'s own process (the launcher, not a rank:
   :func:`umrt.distributed.is_launcher`) does nothing more, except, in shadow
   mode, print the job's report once the ranks are done
   (:mod:`umrt.shadow_ranks`); each rank is a process of its own that starts
   under this hook;
4. otherwise waits, at no cost, for the program to import ``torch`` (or
   ``cupy``) and calls :func:`umrt.enable` right after that import, which is
   before the program can have made a CUDA allocation. A program that never
   imports either runs untouched.

``pip install`` puts the hook into site-packages, an editable install
(``pip install -e``) included (see ``setup.py``); by hand:
``python -m umrt.activation --install``. :func:`hook_status` (used by
``umrt doctor`` and ``python -m umrt.activation --check``) says whether it is
there and whether ``UMRT=1`` really switches umrt on in a fresh interpreter.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import site
import subprocess
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from umrt import distributed
from umrt.api import enable
from umrt.config import from_env
from umrt.errors import UmrtError

PTH_NAME = "umrt-activate.pth"
#: The .pth line: site runs lines that start with ``import``. Kept to one cheap test.
PTH_LINE = (
    "import os; exec('import umrt.activation as _umrt_activation; _umrt_activation.activate_from_env()') "
    "if os.environ.get('UMRT', '').strip().lower() not in ('', '0', 'false', 'no', 'off') else None\n"
)
HOOKED_MODULES = ("torch", "cupy")
#: The one command that installs the hook into this interpreter's site-packages.
INSTALL_COMMAND = "python -m umrt.activation --install"

_state: dict[str, Any] = {"activated": False, "enabled_by": None}


def _fail(message: str) -> None:
    sys.stdout.flush()
    print(f"umrt: error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


def activate_from_env() -> None:
    """What the .pth hook calls; idempotent (a venv may list site-packages twice)."""
    if _state["activated"]:
        return
    _state["activated"] = True

    try:
        cfg = from_env()
        cfg.budget()  # a GPU memory this kind of run cannot read fails now, before the script
    except UmrtError as exc:
        _fail(str(exc))
        return
    if not cfg.enabled:
        return
    if distributed.is_launcher():
        # torchrun's own process: its workers run umrt, the launcher never touches a GPU;
        # in shadow mode it prints the job's report when they are done.
        if cfg.shadow:
            # optional: shadow mode under torchrun only
            from umrt.shadow_ranks import collect_at_exit

            collect_at_exit(cfg)
        return
    if cfg.shadow:
        _run_shadow_and_exit(cfg)
        return
    install_import_hook()


def _run_shadow_and_exit(cfg: Any) -> None:
    argv = list(getattr(sys, "argv", []) or [])
    if not argv or not argv[0] or argv[0].startswith("-") or not os.path.isfile(argv[0]):
        print(
            f"umrt: UMRT_SIMULATE={cfg.simulate} needs a script (python script.py ...); "
            "for -m/-c use `umrt run --simulate PROFILE script.py`. Running unchanged.",
            file=sys.stderr,
        )
        return

    try:
        # optional: shadow mode only; the .pth hook imports this module in every Python start
        from umrt.cli.run import shadow

        rc = shadow(cfg, argv[0], argv[1:])
    except UmrtError as exc:
        _fail(str(exc))
        return
    except KeyboardInterrupt:
        rc = 130
    except BaseException:  # noqa: BLE001 - the script's own error: as Python shows it, then its status
        # Raised out of here it would reach `site`, which reports a failing .pth line and
        # then runs the script a second time, unrecorded.
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc or 0))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls :func:`_on_import` once a watched top-level module has finished importing."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in HOOKED_MODULES:
            return None
        sys.meta_path.remove(self)  # find the real spec without ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _on_import(name)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder = _AfterImport()


def install_import_hook() -> None:
    """Enable umrt right after torch or cupy is imported (or now, if one already is)."""
    if any(name in sys.modules for name in HOOKED_MODULES):
        _on_import(next(n for n in HOOKED_MODULES if n in sys.modules))
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _on_import(name: str) -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    if _state["enabled_by"] is not None:
        return
    _state["enabled_by"] = name

    try:
        session = enable()
    except UmrtError as exc:
        _fail(str(exc))
        return
    if session.active and "cupy" in sys.modules:
        import cupy

        # optional: cupy is installed only on some CUDA machines
        from umrt.allocators.cupy import allocator

        cupy.cuda.set_allocator(allocator)


def enabled_by() -> str | None:
    """Which import switched umrt on (``"torch"``/``"cupy"``), or None."""
    return _state["enabled_by"]


def site_packages() -> Path:
    """Where the .pth file belongs (this interpreter's purelib)."""
    return Path(sysconfig.get_paths()["purelib"])


def install_pth(directory: str | Path | None = None) -> Path:
    """Write ``umrt-activate.pth`` into ``directory`` (default: site-packages)."""
    target = Path(directory or site_packages()) / PTH_NAME
    target.write_text(PTH_LINE)
    return target


def site_dirs() -> list[Path]:
    """The directories whose .pth files this interpreter runs at start-up."""
    dirs = [Path(d) for d in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(Path(site.getusersitepackages()))
    return dirs


@dataclass(frozen=True)
class HookStatus:
    """Whether ``UMRT=1`` works in this interpreter.

    ``path``: the ``umrt-activate.pth`` that start-up runs (None: there is none);
    ``fires``: a fresh interpreter with ``UMRT=1`` imported umrt's hook (None: not tried);
    ``why_not``: what it printed when it did not.
    """

    path: Path | None
    fires: bool | None = None
    why_not: str = ""

    @property
    def works(self) -> bool:
        return self.path is not None and self.fires is not False

    def describe(self) -> str:
        """One line for a person: where the hook is and whether it works, or why not."""
        if self.path is None:
            return f"no {PTH_NAME} in {', '.join(str(d) for d in site_dirs())}: UMRT=1 does nothing here"
        if self.fires is False:
            return (f"{self.path} is there but UMRT=1 did not switch umrt on in a fresh interpreter "
                    f"({self.why_not or 'no output'})")
        return f"{self.path}: UMRT=1 switches umrt on" + (" (checked in a fresh interpreter)" if self.fires else "")


def hook_status(try_it: bool = True) -> HookStatus:
    """Find the installed hook and (``try_it``) start ``python`` with ``UMRT=1`` to see it fire.

    The trial runs ``sys.executable -c ...`` with every other ``UMRT_*`` variable removed,
    so a bad setting in this shell does not hide a working hook (~0.2 s).
    """
    path = next((d / PTH_NAME for d in site_dirs() if (d / PTH_NAME).is_file()), None)
    if path is None or not try_it:
        return HookStatus(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMRT")}
    env["UMRT"] = "1"
    code = "import sys; print('umrt-hook', 'umrt.activation' in sys.modules)"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return HookStatus(path, False, f"could not start {sys.executable}: {exc}")
    if "umrt-hook True" in out.stdout:
        return HookStatus(path, True)
    lines = [line for line in (out.stderr or out.stdout).strip().splitlines() if line.strip()]
    return HookStatus(path, False, lines[-1].strip() if lines else f"exit status {out.returncode}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m umrt.activation",
                                     description="Install or remove the UMRT=1 start-up hook.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--install", action="store_true", help=f"write {PTH_NAME} into site-packages")
    group.add_argument("--uninstall", action="store_true", help=f"remove {PTH_NAME}")
    group.add_argument("--print", action="store_true", help="print the .pth line")
    group.add_argument("--check", action="store_true",
                       help="say whether UMRT=1 works here (exit status 0) or not (2, with the fix)")
    args = parser.parse_args(argv)
    if args.print:
        sys.stdout.write(PTH_LINE)
    elif args.check:
        status = hook_status()
        print(f"umrt: {status.describe()}")
        if not status.works:
            print(f"umrt: fix: {INSTALL_COMMAND}")
        return 0 if status.works else 2
    elif args.install:
        print(f"umrt: wrote {install_pth()}")
    else:
        path = site_packages() / PTH_NAME
        path.unlink(missing_ok=True)
        print(f"umrt: removed {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
