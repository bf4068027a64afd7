"""The recorder's dispatch mode, and leaving or re-entering it to suspend ops.

Torch keeps the dispatch-mode stack per thread, and autograd runs each backward
node with the modes that were on when ``backward()`` was called: the mode is left
or re-entered only on the thread that entered the recorder, outside autograd and
outside an op (at once where that is so, else at the next module or optimizer
hook). A mode of the user's on top of ours is never popped, and ours is
re-entered only onto the mode it was left from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # torch's private mode-stack helpers (2.x): without them ops cannot be suspended
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode,
        _get_current_dispatch_mode_stack,
        _pop_mode,
        _push_mode,
    )
    CAN_SUSPEND = True
except ImportError:  # pragma: no cover - a torch that moved them: record every op, as before
    CAN_SUSPEND = False


class OpsMode(TorchDispatchMode):
    """Hands every aten op to ``on_op(func, args, kwargs)``, which runs it."""

    def __init__(self, on_op: Callable[[Any, tuple, dict], Any]) -> None:
        super().__init__()
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.on_op(func, args, kwargs or {})


class ModeSwitch:
    """Whether ops are recorded (``ops_off``: what was asked) and whether the mode
    is on the owner thread's stack (``mode_on``); the two are brought in line at
    safe points. ``recording()`` says whether the recorder is still recording.
    The lock never wraps an emit, so any lock may be held by the caller."""

    def __init__(self, mode: OpsMode, recording: Callable[[], bool]) -> None:
        self.mode = mode
        self._recording = recording
        self.ops_off = False
        self.mode_on = False
        self._below: TorchDispatchMode | None = None  # the mode under ours when we left it
        self._owner: int | None = None  # thread that entered the recorder
        self._lock = threading.Lock()

    def enter(self) -> None:
        """Push the mode (on entering the recorder); this thread owns it."""
        self.mode.__enter__()
        self.mode_on = True
        self._owner = threading.get_ident()

    def suspend(self) -> bool:
        """Ask for ops to be suspended (see ``Recorder.suspend_ops``)."""
        with self._lock:
            if not self._recording() or not CAN_SUSPEND:
                return False
            if self.ops_off:
                return True
            if self.mode_on and self._owner == threading.get_ident():
                stack = _get_current_dispatch_mode_stack()
                if self.mode in stack and stack[-1] is not self.mode:
                    return False  # a user's mode on top: never pop it
            self.ops_off = True
            self._sync()
            return True

    def resume(self, at_once: bool) -> None:
        """Ask for ops to be recorded again (see ``Recorder.resume_ops``)."""
        with self._lock:
            if not self.ops_off:
                return
            self.ops_off = False
            if at_once and self._recording():
                self._sync()

    def sync_at_hook(self) -> None:
        """At a hook: bring the mode in line with what was asked (cheap when it is)."""
        if self.ops_off == self.mode_on:
            with self._lock:
                if self._recording():
                    self._sync()

    def leave(self) -> None:
        """Exit the mode for good (on leaving the recorder), whoever sits above it."""
        with self._lock:
            self._leave()
            self.ops_off = False

    def _sync(self) -> None:
        """Leave or re-enter the mode as asked, where that is safe (lock held).

        Safe: on the owner thread (the stack is per thread), outside autograd
        (each backward node runs with the modes of ``backward()``'s caller)
        and not inside an op (the mode being run is off the stack meanwhile).
        """
        if self._owner != threading.get_ident() or torch._C._current_graph_task_id() != -1:
            return
        if self.ops_off and self.mode_on:
            stack = _get_current_dispatch_mode_stack()
            if stack and stack[-1] is self.mode:
                self.mode.__exit__(None, None, None)
                self.mode_on = False
                self._below = stack[-2] if len(stack) > 1 else None
            elif self.mode in stack:
                self.ops_off = False  # a user's mode came on top meanwhile: stay on
            # else: inside one of our ops (the mode is off the stack): next time
        elif not self.ops_off and not self.mode_on:
            if _get_current_dispatch_mode() is self._below:
                self.mode.__enter__()
                self.mode_on = True
            # else: a mode entered since we left sits on top; entering ours above
            # it would make its exit pop ours: wait until it is gone

    def _leave(self) -> None:
        if not self.mode_on:
            return
        self.mode_on = False
        if not CAN_SUSPEND:  # never suspended: the mode is where enter() left it
            self.mode.__exit__(None, None, None)
            return
        stack = _get_current_dispatch_mode_stack()
        if self.mode not in stack:
            return  # another thread's stack, or an op of ours is running: nothing to pop here
        above = []
        while stack[-1] is not self.mode:  # modes entered on top of ours stay on
            above.append(_pop_mode())
            stack.pop()
        self.mode.__exit__(None, None, None)
        for mode in reversed(above):
            _push_mode(mode)
