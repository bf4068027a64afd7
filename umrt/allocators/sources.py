"""Where umrt's C++ sources are, in a checkout and in an installed wheel.

The repository keeps them in ``kernels/`` beside the ``umrt`` package (with the numba
kernels of ``umrt calibrate``'s tests); a wheel carries them as package data of
``umrt`` (``umrt/_kernels/``, copied there by ``setup.py``), since only ``umrt`` is
installed. Found by path, not by import: an unrelated ``kernels`` package on
``sys.path`` cannot shadow them.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the umrt package
INSTALLED = PACKAGE_DIR / "_kernels"  # a wheel's copy
CHECKOUT = PACKAGE_DIR.parent / "kernels"  # the repository's


def native_source(name: str) -> Path:
    """The C++ source ``name`` (``steady_alloc.cpp``, ``steady_front.cpp``,
    ``torch_alloc_shim.cpp``): the installed copy if there is one, else the checkout's.
    The path may not exist (a broken install); the builders say so."""
    installed = INSTALLED / name
    return installed if installed.exists() else CHECKOUT / name
