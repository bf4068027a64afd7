"""Live capture of PyTorch training loops into umrt traces.

:class:`Recorder` records what a training loop launches with a dispatch mode
(see its module for how objects, kinds, boundaries and module paths are
found); the mode changes what the program allocates (out-of-place gradient
accumulation). :class:`ProfiledCapture` records the same through torch's
profiler without changing it, one iteration at a time.
:func:`insert_boundaries` finds iterations in a trace without step marks.
"""

from __future__ import annotations

from umrt.capture.detect import Repeats, find_repeats, insert_boundaries
from umrt.capture.profiled import ProfiledCapture
from umrt.capture.recorder import Recorder, StopRecording

__all__ = ["ProfiledCapture", "Recorder", "Repeats", "StopRecording", "find_repeats", "insert_boundaries"]
