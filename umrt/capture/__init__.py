"""Live capture of PyTorch training loops into umrt traces."""
from __future__ import annotations

from umrt.capture.recorder import Recorder, StopRecording

__all__ = ["Recorder", "StopRecording"]
