"""What a trace needs in GPU memory, and a budget resolved against it: the records
:mod:`umrt.sim.budget` computes (data only, so a result can carry them without the
replay that measures them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from umrt.config import format_bytes
from umrt.errors import ConfigError

__all__ = ["BASES", "BASE_NAMES", "Needs", "Budget", "check_base", "percent"]

#: What a percentage budget can be of, in a simulated run.
BASES = ("footprint", "peak")
BASE_NAMES = {"footprint": "the footprint the run needs", "peak": "the trace's peak live bytes"}




@dataclass(frozen=True)
class Needs:
    """What a trace needs in GPU memory, in bytes."""

    peak_live_bytes: int  # largest sum of live object sizes
    pool_bytes: int  # most managed memory umrt's LifetimePool obtains over the trace, laying out no plan
    caching_bytes: int  # the same for the caching-allocator model

    @property
    def footprint_bytes(self) -> int:
        """The footprint the run needs: the larger of the two layouts' (see the module docstring)."""
        return max(self.pool_bytes, self.caching_bytes, self.peak_live_bytes)

    def base_bytes(self, base: str) -> int:
        """What a percentage is of, for ``base`` in :data:`BASES`."""
        check_base(base)
        return self.footprint_bytes if base == "footprint" else self.peak_live_bytes


@dataclass(frozen=True)
class Budget:
    """A resolved budget: its bytes, what it was given as, and what it is of."""

    bytes: int
    text: str  # as given: "20%", "8GiB", "1073741824"
    base: str  # what a percentage is of: "footprint" or "peak"
    needs: Needs

    @property
    def of_footprint(self) -> float:
        """The budget as a fraction of the footprint the run needs."""
        return self.bytes / self.needs.footprint_bytes if self.needs.footprint_bytes else math.nan

    @property
    def of_peak(self) -> float:
        """The budget as a fraction of the trace's peak live bytes."""
        return self.bytes / self.needs.peak_live_bytes if self.needs.peak_live_bytes else math.nan

    def share(self) -> str:
        """``20% of the footprint`` (and how it was given when that was of peak live)."""
        text = f"{percent(self.of_footprint)} of the footprint"
        if self.base == "peak":
            text += f" (given as {percent(self.of_peak)} of peak live)"
        return text

    def describe(self) -> str:
        """``budget 3.3 GiB = 20% of the footprint 16.3 GiB (peak live 15.6 GiB)`` (umrt.config.format_bytes)."""
        n = self.needs
        text = (f"budget {format_bytes(self.bytes)} = {percent(self.of_footprint)} of the footprint "
                f"{format_bytes(n.footprint_bytes)} (peak live {format_bytes(n.peak_live_bytes)}")
        if self.base == "peak":
            text += f"; given as {percent(self.of_peak)} of peak live"
        return text + ")"

    def to_json(self) -> dict:
        """Flat keys for result files: how the budget was given and both bases."""
        n = self.needs
        return {"budget_text": self.text, "budget_base": self.base,
                "needed_footprint_bytes": n.footprint_bytes, "pool_footprint_bytes": n.pool_bytes,
                "caching_footprint_bytes": n.caching_bytes, "budget_of_footprint": self.of_footprint,
                "budget_of_peak": self.of_peak}


def percent(fraction: float) -> str:
    """``20%``, ``73.5%``, ``3,746%`` (a size far above what the run needs: no exponent)."""
    if not math.isfinite(fraction):
        return "?%"
    pct = fraction * 100
    return f"{pct:.3g}%" if pct < 1000 else f"{pct:,.0f}%"


def check_base(base: str) -> None:
    """A clear error unless ``base`` is one of :data:`BASES`."""
    if base not in BASES:
        raise ConfigError(f"unknown budget base {base!r}; valid: {', '.join(BASES)}")
