"""The runtime's options: what :class:`~umrt.policy.runtime.policy.Runtime` is
told at construction, validated once and never changed after.

:class:`Runtime` takes them as keyword arguments (``make_policy("umrt",
learn_iterations=3)``) and holds them as ``runtime.options``.
"""
from __future__ import annotations

from dataclasses import dataclass

from umrt.config import Config

__all__ = ["RuntimeOptions"]


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """How the runtime learns, plans and acts: what a live run, the CLI or a bench sets.

    What only tests change is a constant of the module that uses it: the planner's
    ``headroom`` (:class:`~umrt.policy.runtime.planner.Planner`), the misprediction
    guard's (:mod:`umrt.policy.runtime.guard`), the payoff check's
    (:mod:`umrt.policy.runtime.payoff`), the plans kept per phase
    (:data:`umrt.policy.runtime.learning.MAX_VARIANTS`), and the runtime's own
    (:mod:`umrt.policy.runtime.policy`: probing, freezing, ReadMostly, swapping, the
    smallest discard).

    Attributes
    ----------
    op_level:
        Act before every launch instead of at module boundaries (``UMRT_GRANULARITY=op``).
    learn_iterations:
        Iterations to learn before acting the first time, at least 1
        (``UMRT_LEARN_ITERATIONS``; its default is :class:`~umrt.config.Config`'s).
    use_pool:
        Run with umrt's :class:`~umrt.memory.pool.LifetimePool` (default) or
        the caching-allocator layout (a live run: the allocator's pool places objects).
    launch_free:
        Act on a trusted plan from allocations, frees and module boundaries
        alone (``wants_launches`` turns False: a live driver may stop
        capturing launches, the costly part of capture; see
        :mod:`umrt.policy.runtime.launch_free`). Always False with
        ``op_level`` (a decision before every launch needs them all): every
        iteration is then followed launch by launch.
    discard_on_free:
        Discard a dead range at its ``Free`` instead of at the next
        allocation or launch: for a driver whose events arrive after the
        op's kernel was queued (a newborn's kernel may already be writing
        the range the pending discard would drop).
    """

    op_level: bool = False
    learn_iterations: int = Config.learn_iterations
    use_pool: bool = True
    launch_free: bool = True
    discard_on_free: bool = False

    def __post_init__(self) -> None:
        if self.learn_iterations < 1:
            raise ValueError("learn_iterations must be >= 1")
        if self.op_level and self.launch_free:
            object.__setattr__(self, "launch_free", False)  # frozen: set once, here
