"""umrt's benchmark harness: ``python -m bench`` (also ``umrt bench``).

Runs a grid of models x budgets x GPU profiles x policies through the Unified
Memory simulator and writes a JSON and a CSV of every cell, a markdown table
and plots. All figures it produces are *simulated*.
"""
from __future__ import annotations

from bench.grid import PRESETS, Cell, Grid, preset, run_grid

__all__ = ["PRESETS", "Cell", "Grid", "preset", "run_grid"]
