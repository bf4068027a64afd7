"""``SimResult``: what one simulation reports (its steady-state iteration)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from umrt.sim.needs import Budget

__all__ = ["SimResult", "BREAKDOWN_KEYS"]

#: Where the steady iteration's GPU time went, in seconds.
BREAKDOWN_KEYS = ("compute_s", "fault_stall_s", "transfer_wait_s", "overhead_s", "remote_access_s")


@dataclass
class SimResult:
    """The steady-state (last simulated) iteration of one simulation.

    Byte, fault and time counters cover that iteration only (``page_events``
    and ``wall_s`` cover the whole simulation); ``iteration_times_s`` lists
    every simulated iteration (the first pays the cold misses).
    """

    model: str
    policy: str
    profile: str
    budget_bytes: int
    iterations: int
    iteration_time_s: float
    ideal_time_s: float  # the same iteration's compute time with unlimited memory
    h2d_bytes: int
    d2h_bytes: int
    faults: int
    fault_batches: int
    evictions: int
    peak_resident_bytes: int
    page_events: int  # over the whole simulation: the simulator's work, for page events/s
    launches: int
    breakdown: dict[str, float]
    iteration_times_s: list[float] = field(default_factory=list)
    peak_live_bytes: int = 0  # of the trace (a percentage budget is of the footprint: see budget)
    footprint_bytes: int = 0  # managed memory the layout obtained (>= live bytes: rounding, fragmentation)
    wall_s: float = 0.0  # host seconds the whole simulation took
    policy_report: dict = field(default_factory=dict)
    budget: Budget | None = None  # what budget_bytes is of (umrt.sim.budget)

    @property
    def slowdown(self) -> float:
        """Steady iteration time over the unlimited-memory time (1.0 = no cost)."""
        return self.iteration_time_s / self.ideal_time_s if self.ideal_time_s > 0 else float("nan")

    @property
    def page_events_per_s(self) -> float:
        """Simulator throughput: page events handled per host second."""
        return self.page_events / self.wall_s if self.wall_s > 0 else float("nan")

    def to_json(self) -> dict:
        """A JSON-serialisable dict (every field, plus ``slowdown``)."""
        out = asdict(self)
        del out["budget"]
        if self.budget is not None:
            out.update(self.budget.to_json(), budget_description=self.budget.describe())
        out["slowdown"] = self.slowdown
        out["page_events_per_s"] = self.page_events_per_s
        return out
