"""umrt: a CUDA Unified Memory prefetching runtime for deep learning.

The package is organised in four layers that share one event model
(:mod:`umrt.trace.events`): capture -> predict -> plan (policy) -> act (backend).
"""
from __future__ import annotations

__version__ = "0.1.0"

from umrt.errors import UmrtError  # noqa: E402

__all__ = ["UmrtError", "__version__"]
