"""Where a training iteration is (set-up, forward, backward, optimizer step), the
kind an object's lifetime gives it (shared by both captures), and which phase of
the training loop runs (:class:`LoopPhase`: a training step or an evaluation)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
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


class LoopPhase:
    """Which phase of the training loop runs (``IterationBoundary.phase``): a
    training step, or one batch of an evaluation.

    The loop is in evaluation in inference mode or with every model seen (a
    root module with parameters) in eval mode; a forward of a model with
    gradients off is an evaluation's too, unless no optimizer steps that
    model's parameters while a model is in train mode (a distillation teacher,
    a reference model: the training step runs it). Once training is under way
    (a step has run), each forward of a model in another phase than the
    running iteration's opens an iteration of its phase, and so does each
    forward of an evaluation after the first (one iteration per batch); after
    an evaluation, the first op that writes the device in training mode (the
    next batch loaded) opens a training iteration again.
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.iteration = "train"  # the running iteration's phase
        self.steps = 0  # optimizer steps (step boundaries) so far
        self._forwards = 0  # forwards of a model in the running iteration
        self._leaving_eval = False  # an evaluation ran: training resumes at the next op in train mode
        self._models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def now(self) -> str:
        """The phase the loop is in now (see the class docstring)."""
        if torch.is_inference_mode_enabled():
            return "eval"
        models = list(self._models)
        if self.model is not None:
            models.append(self.model)
        return "eval" if models and not any(m.training for m in models) else "train"

    def stepping(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` starts a step: the models holding its parameters are trained."""
        self._optimizers.add(optimizer)

    def trained(self, module: torch.nn.Module) -> bool:
        """Whether an optimizer that stepped holds one of ``module``'s parameters."""
        stepped = {id(p) for opt in self._optimizers for group in opt.param_groups for p in group["params"]}
        return any(id(p) in stepped for p in module.parameters())

    def opened(self, phase: str) -> None:
        """An iteration of ``phase`` opens."""
        self.iteration = phase
        self._forwards = 0
        if phase == "train":
            self._leaving_eval = False

    def model_forward(self, module: torch.nn.Module, open_iteration: Callable[[str], None],
                      args: tuple = ()) -> None:
        """A model starts a forward on ``args``: ``open_iteration(phase)`` where it opens an
        iteration (the capture emits the boundary, which calls :meth:`opened`). A forward the
        backward runs, or with gradients off on inputs that need them (a block the loop itself
        checkpoints, recomputed in the backward), is the running step's, and so is a forward
        with gradients off of a model no optimizer steps while training runs (a teacher)."""
        self._models.add(module)
        if self.steps == 0:
            return  # before the first step: set-up and the first iteration, whatever they run
        grad = torch.is_grad_enabled()
        if torch._C._current_graph_task_id() != -1 or (
                not grad and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return
        if not grad and self.iteration == "train" and self.now() == "train" and not self.trained(module):
            return
        phase = "eval" if not grad else self.now()
        if phase != self.iteration or (phase == "eval" and self._forwards):
            open_iteration(phase)
        self._forwards += 1
        if phase == "eval":
            self._leaving_eval = True

    def resuming_training(self) -> bool:
        """Whether the next op that writes the device opens a training iteration: an
        evaluation ran and the loop is back in training (the model in train mode,
        gradients on). The live bridge opens that iteration itself, before the op's
        allocation."""
        return self._leaving_eval and torch.is_grad_enabled() and self.now() == "train"
