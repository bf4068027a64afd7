"""Where a training iteration is (set-up, forward, backward, optimizer step), and
the kind an object's lifetime gives it. Shared by both captures."""

from __future__ import annotations

from typing import Protocol

import torch

from umrt.trace.events import Kind

SETUP, FORWARD, BACKWARD, STEP = 0, 1, 2, 3
ALIVE = -2  # ``freed_iteration`` of an object not freed yet


class Lifetime(Protocol):
    """What a capture knows of an object's life (the iteration -1 is set-up)."""

    kind: Kind  # the kind announced in its Alloc
    known: Kind | None  # a fact (parameter, gradient, optimizer state, input)
    phase: int
    iteration: int
    freed_phase: int
    freed_iteration: int


class Phases:
    """The running iteration (-1: set-up) and how many optimizer steps are running."""

    def __init__(self) -> None:
        self.iteration = -1
        self.in_step = 0

    def current(self, in_backward: bool | None = None) -> int:
        """The running phase (``in_backward``: whether autograd runs, when known;
        else asked of autograd)."""
        if self.iteration < 0:
            return SETUP
        if self.in_step:
            return STEP
        if in_backward if in_backward is not None else torch._C._current_graph_task_id() != -1:
            return BACKWARD
        return FORWARD


def lifetime_kind(info: Lifetime) -> Kind:
    """An object's kind from its lifetime: born in forward and freed in backward of
    one iteration -> activation; freed in the iteration that made it -> temporary;
    otherwise -> other."""
    if info.iteration < 0 or info.freed_iteration != info.iteration:
        return Kind.OTHER
    if info.phase == FORWARD and info.freed_phase == BACKWARD:
        return Kind.ACTIVATION
    return Kind.TEMPORARY


def final_kind(info: Lifetime, last_iteration: int) -> Kind:
    """An object's kind once the capture is over: a fact if one is known; for an
    object still alive, the announced kind if it was born in the last iteration's
    forward or backward, else other; for a freed one, its lifetime's."""
    if info.known is not None:
        return info.known
    if info.freed_iteration == ALIVE:
        born_last = info.iteration == last_iteration and info.phase in (FORWARD, BACKWARD)
        return info.kind if born_last else Kind.OTHER
    return lifetime_kind(info)
