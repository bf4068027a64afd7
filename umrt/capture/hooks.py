"""Module paths, and the recorder's module, backward and optimizer hooks.

Forward ops carry the innermost running module's dotted path. Backward ops carry
the module whose output gradient autograd most recently started on (a pre-hook
on each module output's ``grad_fn``): backward layer events are flat (enter/exit
pairs, never nested), and ops between two modules' gradients (residual adds) go
to the last module. An optimizer step ends an iteration.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from umrt.trace.events import Kind, LayerEnter, LayerExit

if TYPE_CHECKING:
    from umrt.capture.recorder import Recorder


def guarded(method: Callable) -> Callable:
    """A hook of a capture's: an exception of its own bookkeeping goes to the
    hook object's ``_error`` (re-raised unless the capture has ``on_error``)."""

    @functools.wraps(method)
    def hook(self: Any, *args: Any) -> Any:
        try:
            return method(self, *args)
        except Exception as exc:  # noqa: BLE001 - see Recorder(on_error=...)
            self._error(exc)
            return None

    return hook


def claim_backward(output: Any, key: str, make_hook: Callable[[], Callable]) -> None:
    """Register ``make_hook()`` before the backward node of each output tensor no
    inner module claimed under ``key`` yet (in its node's metadata), and claim it."""
    for t in output_tensors(output):
        node = t.grad_fn
        if node is None:
            continue
        md = node.metadata
        if key in md:  # an inner module claimed it first
            continue
        md[key] = True
        node.register_prehook(make_hook())


def output_tensors(x: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a module's output (tuples, lists, dicts, ModelOutput)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif depth < 3 and isinstance(x, (list, tuple)):
        for y in x:
            yield from output_tensors(y, depth + 1)
    elif depth < 3 and isinstance(x, dict):
        for y in x.values():
            yield from output_tensors(y, depth + 1)


def install_hooks(forward_pre: Callable, forward_post: Callable, step_pre: Callable, step_post: Callable) -> list:
    """Register global module forward and optimizer step hooks; returns their handles."""
    mm = torch.nn.modules.module
    return [
        mm.register_module_forward_pre_hook(forward_pre),
        mm.register_module_forward_hook(forward_post, always_call=True),
        register_optimizer_step_pre_hook(step_pre),
        register_optimizer_step_post_hook(step_post),
    ]


class ModulePaths:
    """Dotted module paths: the model's own names, else one made from the parent's."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self._names: dict[int, str] = {}
        if model is not None:
            for name, m in model.named_modules():
                self._names[id(m)] = name

    def name(self, module: torch.nn.Module, parent: str | None) -> str:
        """The path of ``module``, running inside the module at ``parent`` (None: at top level)."""
        name = self._names.get(id(module))
        if name is None:
            if parent is not None:
                name = f"{parent}.{type(module).__name__.lower()}".lstrip(".")
            else:  # a root we were not told about: name its tree
                for sub, m in module.named_modules():
                    self._names.setdefault(id(m), sub)
                name = ""
            self._names[id(module)] = name
        return name


class RecorderHooks:
    """The :class:`~umrt.capture.Recorder`'s module, backward and optimizer hooks:
    layer events, the running module, and the optimizer's facts and steps."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.paths = ModulePaths()
        self._stack: list[str | None] = []  # running forwards (None: not recorded)
        self.backward_module: str | None = None
        self._handles: list[Any] = []

    def install(self) -> None:
        """Register the hooks; module paths are relative to the recorder's model."""
        self._handles = install_hooks(self._forward_pre, self._forward_post, self._step_pre, self._step_post)
        self.paths = ModulePaths(self.rec.model)

    def remove(self) -> None:
        for h in self._handles:
            if h is not None:
                h.remove()
        self._handles = []

    def suspend_layers(self) -> None:
        """Remove the module forward hooks (no layer events, no backward hooks from
        them); the optimizer hooks stay. Call it outside any forward."""
        if self._handles and self._handles[0] is not None:
            for i in (0, 1):
                self._handles[i].remove()
                self._handles[i] = None
            self._stack.clear()

    def resume_layers(self) -> None:
        """Register the module forward hooks again (outside any forward)."""
        if self._handles and self._handles[0] is None:
            mm = torch.nn.modules.module
            self._handles[0] = mm.register_module_forward_pre_hook(self._forward_pre)
            self._handles[1] = mm.register_module_forward_hook(self._forward_post, always_call=True)

    def current_module(self) -> str | None:
        """The innermost running module's path (None: outside any recorded module)."""
        for name in reversed(self._stack):
            if name is not None:
                return name
        return None

    def end_backward(self) -> None:
        """Close the running backward layer (lock held)."""
        if self.backward_module is not None:
            self.rec._log.emit(LayerExit(self.backward_module, "backward"))
            self.backward_module = None

    def _error(self, exc: Exception) -> None:
        self.rec._error(exc)

    @guarded
    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        rec = self.rec
        if not rec._recording or rec._closed or rec._paused:
            self._stack.append(None)  # keeps pushes and pops paired
            return
        rec._mode_switch.sync_at_hook()
        if self.backward_module is not None and torch._C._current_graph_task_id() == -1:
            with rec._lock:  # forward after a backward without a step (gradient accumulation)
                self.end_backward()
        name = self.paths.name(module, self.current_module())
        if self.current_module() is None and next(module.parameters(), None) is not None:
            with rec._lock:  # the model's forward: it may open an iteration of another phase
                rec._flush()
                if not rec._closed:
                    rec.loop.model_forward(module, rec._emit_boundary)
        if rec.model is None and self.current_module() is None:
            if rec._following:
                with rec._lock:
                    rec._follow_to(module.parameters())
            for p in module.parameters():
                if p.device.type == rec.device:
                    with rec._lock:
                        rec._flush()
                        rec._mark(p, Kind.PARAMETER)
        self._stack.append(name)
        with rec._lock:
            rec._flush()
            rec._log.emit(LayerEnter(name, "forward"))

    @guarded
    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        rec = self.rec
        if not self._stack:
            return
        name = self._stack.pop()
        if name is None or rec._closed or not rec._recording:
            return
        rec._mode_switch.sync_at_hook()
        with rec._lock:
            rec._log.emit(LayerExit(name, "forward"))
        if torch.is_grad_enabled():
            claim_backward(output, "umrt_module", lambda: self._backward_hook(name))

    def _backward_hook(self, name: str) -> Callable:
        rec = self.rec

        def hook(grad_outputs: Any) -> None:
            if not rec._recording or rec._closed:
                return
            try:
                with rec._lock:
                    if self.backward_module == name:
                        return
                    if self.backward_module is not None:
                        rec._log.emit(LayerExit(self.backward_module, "backward"))
                    self.backward_module = name
                    rec._log.emit(LayerEnter(name, "backward"))
            except Exception as exc:  # noqa: BLE001 - see on_error
                self._error(exc)

        return hook

    @guarded
    def _step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        rec = self.rec
        if not rec._recording or rec._closed:
            return
        rec._mode_switch.sync_at_hook()
        with rec._lock:
            if rec._following:
                rec._follow_to(p for group in opt.param_groups for p in group["params"])
            rec._flush()
            self.end_backward()
            # Facts about the optimizer's tensors (kinds) are for recorded ops; with
            # ops suspended they would cost a pass over every parameter each step.
            if (rec.optimizer is None or opt is rec.optimizer) and not rec._mode_switch.ops_off:
                rec._mark_optimizer(opt, grads=True)
        rec._phases.in_step += 1

    @guarded
    def _step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        rec = self.rec
        rec._phases.in_step = max(0, rec._phases.in_step - 1)
        if not rec._recording or rec._closed:
            return
        rec._mode_switch.sync_at_hook()
        if rec.optimizer is not None and opt is not rec.optimizer:
            return
        if not rec._mode_switch.ops_off:
            with rec._lock:
                rec._mark_optimizer(opt, grads=False)
        if rec.auto_step:
            rec.step()
