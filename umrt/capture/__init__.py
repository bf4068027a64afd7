"""Live capture of PyTorch training loops into umrt traces.

:class:`Recorder` records what a training loop launches with a dispatch mode
(see its module for how objects, kinds, boundaries and module paths are
found); the mode changes what the program allocates (out-of-place gradient
accumulation). :func:`insert_boundaries` finds iterations in a trace without
step marks.
"""

from __future__ import annotations

from umrt.capture.detect import Repeats, find_repeats, insert_boundaries
from umrt.capture.recorder import Recorder, StopRecording

__all__ = ["Recorder", "Repeats", "StopRecording", "find_repeats", "insert_boundaries"]
