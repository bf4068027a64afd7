"""A layout chosen after it is handed out (:class:`ChosenLayout`): the simulator asks a policy
for its layout before the policy is attached, and the oracle knows which it needs only then."""
from __future__ import annotations

from umrt.errors import ConfigError
from umrt.memory.base import Layout
from umrt.memory.pool import LifetimePool
from umrt.trace.events import Event, Kind


class ChosenLayout(Layout):
    """A layout bound after it is handed out: every call goes to the one bound (the
    oracle's, made once its plan is chosen, which needs the budget the simulator
    sizes after it asked for a layout)."""

    def __init__(self) -> None:
        self.target: Layout | None = None

    def bind(self, layout: Layout) -> None:
        self.target = layout

    def _layout(self) -> Layout:
        if self.target is None:
            raise ConfigError("a chosen layout is used before one was bound (the oracle binds its own when attached)")
        return self.target

    def alloc(self, obj: int, nbytes: int, kind: Kind) -> int:
        return self._layout().alloc(obj, nbytes, kind)

    def free(self, obj: int) -> None:
        self._layout().free(obj)

    def address(self, obj: int) -> int:
        return self._layout().address(obj)

    def footprint(self) -> int:
        return self._layout().footprint()

    # umrt's pool learns from the stream: the driver feeds it through here (ChosenLayout
    # is a LearningLayout). PyTorch's caching allocator learns nothing.
    def observe(self, event: Event) -> None:
        if (pool := self._pool()) is not None:
            pool.observe(event)

    def observe_launch(self, exec_id: int) -> None:
        if (pool := self._pool()) is not None:
            pool.observe_launch(exec_id)

    def observe_layer(self, enter: bool) -> None:
        if (pool := self._pool()) is not None:
            pool.observe_layer(enter)

    def _pool(self) -> LifetimePool | None:
        layout = self._layout()
        return layout if isinstance(layout, LifetimePool) else None
