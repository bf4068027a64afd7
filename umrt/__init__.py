"""umrt: a CUDA Unified Memory prefetching runtime for deep learning.

The package is organised in four layers that share one event model
(:mod:`umrt.trace.events`): capture -> predict -> plan (policy) -> act (backend).
"""
from __future__ import annotations

__version__ = "0.1.0"

from umrt.api import disable, enable, session  # noqa: E402
from umrt.config import Config  # noqa: E402
from umrt.errors import UmrtError  # noqa: E402
from umrt.stats import memory_stats, reset_peak_memory_stats, statistics  # noqa: E402

__all__ = [
    "Config",
    "UmrtError",
    "__version__",
    "disable",
    "enable",
    "memory_stats",
    "reset_peak_memory_stats",
    "session",
    "statistics",
]
