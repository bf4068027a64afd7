"""Plumbing for torch's module, backward and optimizer hooks: dotted module paths,
global hook registration, the end of a step (a GradScaler's skipped one too),
backward pre-hooks claimed once per output, a data loader's host-side work kept off
the trace, torch.compile'd code run eagerly, and the guard that hands a hook's own
failure to its capture (the recorder's hooks,
:class:`~umrt.capture.recorder.RecorderHooks`, are built on them).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

try:
    from torch.compiler import set_stance
except ImportError:  # torch before 2.6
    set_stance = None


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


def install_hooks(forward_pre: Callable, forward_post: Callable, step_pre: Callable, step_post: Callable,
                  step_skipped: Callable) -> list:
    """Register global module forward and optimizer step hooks (``step_skipped``: see
    :func:`register_step_end_hook`); returns their handles."""
    mm = torch.nn.modules.module
    return [
        mm.register_module_forward_pre_hook(forward_pre),
        mm.register_module_forward_hook(forward_post, always_call=True),
        register_optimizer_step_pre_hook(step_pre),
        register_step_end_hook(step_post, skipped=step_skipped),
    ]


class _StepCount(threading.local):
    steps = 0  # optimizer steps whose post hooks ran on this thread


_step_count = _StepCount()
_skipped_hooks: list[Callable] = []
_scaler_step: Callable | None = None  # GradScaler.step as torch defines it, while it is wrapped


def _count_step(*_hook_args: Any) -> None:
    _step_count.steps += 1


def _scaler_step_seen(step: Callable) -> Callable:
    @functools.wraps(step)
    def scaler_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        before = _step_count.steps
        out = step(self, optimizer, *args, **kwargs)
        if _step_count.steps == before:  # inf or NaN gradients: the scaler skipped the optimizer's step
            for hook in list(_skipped_hooks):
                hook(optimizer, args, kwargs)
        return out
    return scaler_step


class _StepEndHandle:
    """The handle :func:`register_step_end_hook` returns."""

    def __init__(self, post: Any, counter: Any, skipped: Callable) -> None:
        self._handles = [post, counter]
        self._skipped: Callable | None = skipped

    def remove(self) -> None:
        global _scaler_step
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._skipped is None:
            return
        _skipped_hooks.remove(self._skipped)
        self._skipped = None
        if not _skipped_hooks and _scaler_step is not None:
            torch.amp.GradScaler.step = _scaler_step
            _scaler_step = None


def register_step_end_hook(hook: Callable, *, skipped: Callable | None = None) -> _StepEndHandle:
    """Call ``hook(optimizer, args, kwargs)`` after every optimizer step, and
    ``skipped(optimizer, args, kwargs)`` (default: ``hook``) where a
    ``torch.amp.GradScaler``'s ``step`` found inf or NaN gradients and skipped the
    optimizer's: the loop's iteration ends there all the same. Returns a handle
    whose ``remove()`` undoes both."""
    global _scaler_step
    skipped = skipped or hook
    if _scaler_step is None:
        _scaler_step = torch.amp.GradScaler.step
        torch.amp.GradScaler.step = _scaler_step_seen(_scaler_step)
    _skipped_hooks.append(skipped)
    return _StepEndHandle(register_optimizer_step_post_hook(hook), register_optimizer_step_post_hook(_count_step),
                          skipped)


def compiled_code_eager() -> AbstractContextManager:
    """Run ``torch.compile``'d code eagerly inside (``torch.compiler.set_stance("force_eager")``).

    A capture records ops through a dispatch mode: torch.compile does not run under one
    (it skips the frame for good, and with ``fullgraph=True`` raises), and the kernels it
    compiles would hide the ops from the capture. Eager throughout, the program runs the
    same ops while ops are recorded and while they are not, so a plan learned from them
    holds. A torch without stances (before 2.6): nothing changes."""
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returned (torch's dynamo is
    loaded by then; it is not imported here)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


_PauseEntry = tuple[Callable[[], AbstractContextManager], Callable[[Any], Any]]
_loader_pauses: list[_PauseEntry] = []  # (paused, arrived): one per recorder that keeps loaders off
_loader_originals: dict[tuple[type, str], Callable] = {}


def _under_pauses(fn: Callable, *, hands_a_batch: bool = False) -> Callable:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for paused, _ in list(_loader_pauses):
                stack.enter_context(paused())
            out = fn(*args, **kwargs)
        if hands_a_batch:
            for _, arrived in list(_loader_pauses):
                out = arrived(out)
        return out
    return call


class _LoaderPause:
    """The handle :func:`pause_data_loaders` returns."""

    def __init__(self, entry: _PauseEntry) -> None:
        self._entry: _PauseEntry | None = entry

    def remove(self) -> None:
        if self._entry is None:
            return
        _loader_pauses.remove(self._entry)
        self._entry = None
        if not _loader_pauses:
            for (cls, name), fn in _loader_originals.items():
                setattr(cls, name, fn)
            _loader_originals.clear()


def pause_data_loaders(paused: Callable[[], AbstractContextManager],
                       arrived: Callable[[Any], Any] = lambda batch: batch) -> _LoaderPause:
    """Run a ``torch.utils.data.DataLoader``'s iterator creation, its sampler and the
    fetching of each batch (in the main process, or what its worker processes send)
    under ``paused()``, and pass each batch through ``arrived`` (its return value is what
    the loop gets), until the returned handle's ``remove()``.

    Traced on the CPU (shadow mode), everything is on the traced device; on a GPU the
    loader's seed (an 8-byte tensor each time an iterator is made, at every epoch), its
    sampler's permutation (at an epoch's first batch), the dataset and the batches
    collated from it stay in host memory until the loop copies them to the device, so
    they are kept off: the dataset read by a main-process collation, and the rebuilding
    of the batches workers send (in shared host memory, whenever they arrive, ahead or
    out of order). ``arrived`` records each batch as a GPU run's is born, at its copy."""
    from torch.utils.data import dataloader

    if not _loader_originals:
        for cls, name in ((dataloader.DataLoader, "__iter__"), (dataloader._BaseDataLoaderIter, "_next_index"),
                          (dataloader._SingleProcessDataLoaderIter, "_next_data"),
                          (dataloader._MultiProcessingDataLoaderIter, "_next_data")):
            fn = cls.__dict__.get(name)
            if fn is not None:  # (a torch whose loader is laid out otherwise: recorded as before)
                _loader_originals[(cls, name)] = fn
                setattr(cls, name, _under_pauses(fn, hands_a_batch=name == "_next_data"))
    entry = (paused, arrived)
    _loader_pauses.append(entry)
    return _LoaderPause(entry)


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
