"""The acting state the runtime shares with its guard and its launch-free clock.

:class:`~umrt.policy.runtime.policy.Runtime` holds it, as plain attributes its hot
path (``Runtime.on_event``) reads at every event. The guard
(:class:`~umrt.policy.runtime.guard.Guard`) and the launch-free clock
(:class:`~umrt.policy.runtime.launch_free.LaunchFreeClock`) change it through
:class:`Acting` only: they are handed the runtime as an :class:`Acting` and never
import it. What each of them decides alone (the guard's outcomes and cooldowns, the
clock's next event and the events it counts launches from) is its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from umrt.policy.runtime.planner import Action, IterationRecord, Plan
    from umrt.predict.tables import ObjectKeys

__all__ = ["Acting"]


class Acting(Protocol):
    """The runtime as its guard and launch-free clock see it."""

    counters: dict[str, int]
    keys: ObjectKeys  # the live objects' keys (a plan whose long-lived keys are gone is not switched to)
    # The plan followed, its decisions and the next one, what it discards and host-maps.
    plan: Plan | None
    actions: list[Action]
    next_action: int
    discard_keys: frozenset[int]
    oversized: dict[int, tuple[int, ...]]
    keymap: tuple[int, ...] | None  # acting without launches: the plan variant's allocation ordinal -> key
    record: IterationRecord | None  # the iteration's record, while learning or probing
    # The iteration's clocks: launches, non-launch events and their running hash,
    # and (a launch-free clock not yet confirmed) those events as tokens.
    n_launches: int
    n_events: int
    events_hash: int
    shape_hash: int  # after a rare shape only: events_hash without freed sizes (Plan.events_match)
    after_rare: bool  # the iteration follows a rare shape of its phase (its first frees are that one's)
    event_tokens: list[int] | None
    token_objects: list[int]
    # Acting without launches: counting them for a stretch, the next event something is due at.
    acting_launch_free: bool
    counting_launches: bool
    due_event: int
    wants_launches: bool

    def act(self, a: Action, destructive: bool = True) -> None:
        """Issue decision ``a``'s moves."""

    def arm(self) -> None:
        """Set the trigger of the next decision."""

    def unfreeze(self) -> None:
        """Addresses can no longer be trusted this iteration."""

    def restore_swapped(self) -> None:
        """Copy back every range still swapped out."""

    def stop_acting(self, mode: str, *, wants_launches: bool) -> None:
        """Leave the acting state for ``mode``, with no decision due."""
