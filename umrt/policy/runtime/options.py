"""The runtime's options: what :class:`~umrt.policy.runtime.policy.Runtime` is
told at construction, validated once and never changed after.

:class:`Runtime` takes them as keyword arguments (``make_policy("umrt",
learn_iterations=3)``) and holds them as ``runtime.options``.
"""
from __future__ import annotations

from dataclasses import dataclass

from umrt.policy.runtime.planner import PAGE

__all__ = ["RuntimeOptions"]


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """How the runtime learns, plans and acts.

    Attributes
    ----------
    op_level:
        Act before every launch instead of at module boundaries.
    headroom:
        Fraction of the budget a plan may fill, in (0, 1].
    learn_iterations:
        Iterations to learn before acting the first time, at least 1 (2: a
        training loop's first step is special — lazy optimizer state, no
        gradients to free — so the plan comes from the second).
    probe_iterations:
        Iterations a new plan is acted on while still recorded launch by
        launch (a deviation then teaches the runtime the new shape) before it
        is trusted and runs without launches; 0 for a capture that delivers an
        iteration's launches only at its end.
    guard_window, guard_failures, guard_cooldown:
        The misprediction guard (see :class:`~umrt.policy.runtime.guard.Guard`);
        ``guard_window`` is at least 0.
    max_variants:
        Compiled plans kept per loop phase (one per iteration shape; the
        phase's least recently used dropped), at least 0.
    use_pool:
        Run with umrt's :class:`~umrt.memory.pool.LifetimePool` (default) or
        the caching-allocator layout.
    min_discard:
        Freed objects at least this large have their pages discarded.
    read_mostly:
        Advise parameters ReadMostly while acting, so evicting them costs no
        copy back. Off by default: in the simulator it changes iteration time
        by under 0.3% (parameter evictions are a small share of the traffic).
    freeze:
        Let a trusted plan whose objects keep their addresses (each allocation
        is checked against the last iteration of the same shape) reuse its
        decisions' ranges without resolving any key: the cheapest steady
        state. Moves are the same either way.
    launch_free:
        Act on a trusted plan from allocations, frees and module boundaries
        alone (``wants_launches`` turns False: a live driver may stop
        capturing launches, the costly part of capture; see
        :mod:`umrt.policy.runtime.launch_free`). Always False with
        ``op_level`` (a decision before every launch needs them all): every
        iteration is then followed launch by launch.
    swap:
        Where the backend has the copy-engine path (``Backend.swap.copy_engines``: CUDA
        13, discard, pinned staging), let the planner take objects off the GPU
        and back through it (``backend.swap.out`` / ``back``) where that costs less
        than page migration; False: page migration only, as before.
    discard_on_free:
        Discard a dead range at its ``Free`` instead of at the next
        allocation or launch: for a driver whose events arrive after the
        op's kernel was queued (a newborn's kernel may already be writing
        the range the pending discard would drop).
    payoff_window, payoff_margin:
        Do no harm (see :class:`~umrt.policy.runtime.payoff.Payoff`): once
        ``payoff_window`` iterations of a phase acted on a plan, their median
        time is compared with that of the phase's iterations that did not act;
        acting more than ``payoff_margin`` slower stops for that phase.
        ``payoff_window=0`` turns the check off.
    """

    op_level: bool = False
    headroom: float = 0.9
    learn_iterations: int = 2
    probe_iterations: int = 2
    guard_window: int = 4
    guard_failures: int = 3
    guard_cooldown: int = 2
    max_variants: int = 8
    use_pool: bool = True
    min_discard: int = PAGE
    read_mostly: bool = False
    freeze: bool = True
    launch_free: bool = True
    discard_on_free: bool = False
    swap: bool = True
    payoff_window: int = 3
    payoff_margin: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {self.headroom}")
        if self.learn_iterations < 1:
            raise ValueError("learn_iterations must be >= 1")
        if self.probe_iterations < 0:
            raise ValueError("probe_iterations must be >= 0")
        if self.guard_window < 0:
            raise ValueError(f"guard_window must be >= 0, got {self.guard_window}")
        if self.payoff_window < 0 or self.payoff_margin < 0:
            raise ValueError(f"payoff_window and payoff_margin must be >= 0, got {self.payoff_window}, "
                             f"{self.payoff_margin}")
        if self.max_variants < 0:
            raise ValueError(f"max_variants must be >= 0, got {self.max_variants}")
        if self.op_level and self.launch_free:
            object.__setattr__(self, "launch_free", False)  # frozen: set once, here

    @property
    def warmup_iterations(self) -> int:
        """Learned iterations, then ``probe_iterations`` acted on while still
        recorded before a plan is trusted and runs in steady state."""
        return self.learn_iterations + self.probe_iterations
