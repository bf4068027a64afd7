"""Record what a PyTorch training loop launches, as umrt events.

A :class:`Recorder` is a context manager built on ``TorchDispatchMode`` (every
aten op, on meta, CPU and CUDA alike), global module hooks (layer boundaries
and module paths) and global optimizer step hooks (iteration boundaries)::

    rec = Recorder(model, optimizer)
    with rec:
        for batch in batches:
            loss = model(batch).loss
            loss.backward()
            optimizer.step()          # marks an iteration boundary
            optimizer.zero_grad(set_to_none=True)
    trace = rec.trace()

How the pieces are found:

* Objects are storages: ``tensor.untyped_storage()`` returns one Python object
  per live storage (shared by all its views); ``weakref.finalize`` on it emits
  the :class:`~umrt.trace.events.Free`. A storage first produced by an op is
  allocated by that launch; one first seen as an input (parameters, a batch
  loaded while recording was paused) is allocated with ``launch = -1``. One
  made by an op that only allocates (``empty_like``: no kernel) is announced
  by the first launch that touches it: made by that launch if it writes it
  whole (a CPU dropout's mask, filled by ``bernoulli_``), else ``launch = -1``.
* Kinds: parameters (the model's, or the optimizer's param groups), gradients
  (``param.grad`` at the optimizer step), optimizer state (``optimizer.state``
  after the step) and inputs (storages first seen mid-iteration) are facts.
  The rest is decided by lifetime: created in forward and freed in backward ->
  activation; freed in the iteration that made it -> temporary; otherwise ->
  other. Live listeners get the best kind known when the object is born: from
  the second iteration on that is the kind the same launch's output had in the
  previous iteration; :meth:`Recorder.trace` returns the refined kinds.
* Iteration boundaries: an optimizer step (or :meth:`Recorder.step`) marks
  one; it is emitted just before the next launch, so frees that follow the
  step (``zero_grad(set_to_none=True)``, dropping the batch) close the
  iteration they belong to. Without any marks, :meth:`Recorder.trace` finds
  the iterations as consecutive repeats (:mod:`umrt.capture.detect`).
* Module paths: forward ops carry the innermost running module's dotted path.
  Backward ops carry the module whose output gradient autograd most recently
  started on (a pre-hook on each module output's ``grad_fn``): backward layer
  events are therefore flat (enter/exit pairs, never nested), and ops between
  two modules' gradients (residual adds) are attributed to the last module.

Suspending ops (the live runtime's steady state): :meth:`Recorder.suspend_ops`
leaves the dispatch mode, so ops run at full speed and no ``Launch`` is
recorded, while the module, backward-layer and optimizer hooks keep emitting
``LayerEnter``/``LayerExit`` and iteration boundaries (module paths as
before), and storages already known still emit their ``Free``.
:meth:`Recorder.resume_ops` re-enters the same mode; storages made meanwhile
are announced when first seen after it, as for paused code. Torch keeps the
dispatch-mode stack per thread and autograd runs each backward node with the
modes that were on when ``backward()`` was called, so the mode itself is left
or re-entered only on the thread that entered the recorder, outside autograd
and outside an op: at once where that is so, else at the next module or
optimizer hook there (launches stop, or are recorded again, at once either
way, as far as the mode is on). With the mode left, the recorder cannot
tell that a C++ op is running: a caller that may be inside one (an
allocator's callback) resumes with ``at_once=False``. A mode of the user's
on top of the recorder's is never popped (:meth:`Recorder.suspend_ops` then
returns False and launches keep coming); the mode is re-entered only onto
the mode it was left from. While ops are suspended, a pending iteration
boundary is emitted at the next module or optimizer hook instead of before the
next launch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

try:  # torch's private mode-stack helpers (2.x): without them ops cannot be suspended
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode,
        _get_current_dispatch_mode_stack,
        _pop_mode,
        _push_mode,
    )
    _CAN_SUSPEND = True
except ImportError:  # pragma: no cover - a torch that moved them: record every op, as before
    _CAN_SUSPEND = False

from umrt.capture import steer as steer_mod
from umrt.trace.events import (
    Access,
    Alloc,
    Event,
    Free,
    IterationBoundary,
    Kind,
    Launch,
    LayerEnter,
    LayerExit,
    Trace,
    TraceHeader,
    execution_id,
)

Listener = Callable[[Event], None]

# Ops that only allocate: no kernel runs on CUDA, so they are not launches.
_ALLOC_ONLY = frozenset(
    {
        "aten::empty.memory_format",
        "aten::empty_strided.default",
        "aten::empty_like.default",
        "aten::new_empty.default",
        "aten::new_empty_strided.default",
    }
)
_SETUP, _FORWARD, _BACKWARD, _STEP = 0, 1, 2, 3


def _guarded(method: Callable) -> Callable:
    """A hook of a capture's (the Recorder's, the ProfiledCapture's): an exception
    of its own bookkeeping goes to its ``_error`` (re-raised unless the capture
    has ``on_error``)."""

    @functools.wraps(method)
    def hook(self: Any, *args: Any) -> Any:
        try:
            return method(self, *args)
        except Exception as exc:  # noqa: BLE001 - see Recorder(on_error=...)
            self._error(exc)
            return None

    return hook


def _lifetime_kind(info: Any) -> Kind:
    """An object's kind from its lifetime (``iteration``, ``phase``, ``freed_*``):
    born in forward and freed in backward of one iteration -> activation; freed in
    the iteration that made it -> temporary; otherwise -> other."""
    if info.iteration < 0 or info.freed_iteration != info.iteration:
        return Kind.OTHER
    if info.phase == _FORWARD and info.freed_phase == _BACKWARD:
        return Kind.ACTIVATION
    return Kind.TEMPORARY


class StopRecording(BaseException):
    """Raised into the recorded program once ``stop_after`` iterations are complete.

    A ``BaseException`` so that a script's ``except Exception`` does not swallow it.
    """


@dataclass(slots=True)
class _OpInfo:
    name: str  # recorded op name (renamed where steer stands in for a CUDA kernel)
    skip: bool  # a pure view/metadata op: no kernel
    alloc_only: bool
    write_pos: frozenset  # positional args the schema marks as written
    write_kw: frozenset  # keyword args the schema marks as written
    flop_fn: Any


@dataclass(slots=True)
class _Obj:
    nbytes: int
    kind: Kind  # kind announced in the Alloc event
    known: Kind | None  # kind established by a fact (parameter, gradient, ...)
    phase: int  # phase it was born in
    iteration: int  # iteration it was born in (-1: set-up)
    key: tuple | None  # (exec_id, occurrence, output index) of the creating launch
    event_index: int  # index of its Alloc event (-1: not announced yet, see Recorder._unwritten)
    freed_phase: int = -1
    freed_iteration: int = -2  # -2: still alive


def _itemsize(t: torch.Tensor) -> int:
    return t.element_size()


def _extent(t: torch.Tensor) -> int:
    """Bytes a view spans in its storage, from its sizes and strides."""
    n = t.numel()
    if n == 0:
        return 0
    if t.is_contiguous():
        return n * t.element_size()
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    return span * t.element_size()


_PRECISION = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def _precision_of(op: str, dtypes: Iterable[torch.dtype], tf32: tuple[bool, bool]) -> str:
    """What a launch's arithmetic runs in on CUDA: its first floating-point
    input's dtype, with FP32 on TF32 tensor cores where PyTorch allows it
    (``tf32`` = (matmuls: ``torch.get_float32_matmul_precision() != "highest"``,
    convolutions: ``torch.backends.cudnn.allow_tf32``); defaults False, True)."""
    for dt in dtypes:
        if dt.is_floating_point:
            p = _PRECISION.get(dt, "")
            if p == "fp32" and (tf32[1] if "conv" in op else tf32[0]):
                return "tf32"
            return p
    return ""


def _precision(op: str, inputs: list, tf32: tuple[bool, bool]) -> str:
    """:func:`_precision_of` for the recorder's ``(tensor, written, on device)`` inputs."""
    return _precision_of(op, (t.dtype for t, *_ in inputs), tf32)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y
            elif isinstance(y, (list, tuple)):
                yield from _tensors(y)


def _output_tensors(x: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a module's output (tuples, lists, dicts, ModelOutput)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif depth < 3 and isinstance(x, (list, tuple)):
        for y in x:
            yield from _output_tensors(y, depth + 1)
    elif depth < 3 and isinstance(x, dict):
        for y in x.values():
            yield from _output_tensors(y, depth + 1)


class _Mode(TorchDispatchMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.rec._on_op(func, args, kwargs or {})


class Recorder:
    """Records a training loop into a :class:`~umrt.trace.events.Trace`.

    Args:
        model: the model, if known: its parameters and buffers are announced
            at set-up and module paths are relative to it. Without one, every
            module that runs is seen through global hooks.
        optimizer: the optimizer, if known: its parameters are PARAMETER, its
            state OPTIMIZER_STATE. Without one, any optimizer that steps is used.
        listeners: callables that receive each event the moment it is recorded.
        device: the device whose memory is traced ("meta", "cpu", "cuda");
            default: the model's device; without a model, the device the
            program uses: the CPU until an op touches a tensor on an
            accelerator (CUDA, ...), that device from then on (objects seen on
            the CPU before are released from the trace then: a model built on
            the CPU and moved is traced from its move). Ops that touch no
            tensor on it (host scalars) are not recorded.
        auto_step: mark an iteration boundary after every optimizer step.
        mark_start: emit ``IterationBoundary(0)`` on entry (after set-up);
            otherwise the first step marks it and what runs before is set-up.
        stop_after: raise :class:`StopRecording` into the program once this
            many iterations are complete (after the trace is closed).
        model_name: recorded in the trace header.
        steer: where attention and dropout are routed to single fused ops
            (see :mod:`umrt.capture.steer`): default meta only, where nothing
            is computed; True adds the CPU (it changes what the CPU computes:
            only for umrt's own synthetic loops); False never.
        keep_events: keep the events for :meth:`trace` and :attr:`events`;
            False for a live listener's recorder that runs for a whole training
            (events are only passed on, so memory stays bounded).
        on_error: called with an exception the recorder's own bookkeeping
            raised (in an op, a hook, a finalizer), which then never reaches
            the program: a live run must not stop for umrt's sake. Default:
            the exception propagates (a trace must not silently miss ops).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        listeners: Sequence[Listener] = (),
        *,
        device: str | None = None,
        auto_step: bool = True,
        mark_start: bool = True,
        stop_after: int | None = None,
        model_name: str = "",
        steer: bool | Collection[str] = ("meta",),
        meta: dict | None = None,
        keep_events: bool = True,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.listeners = list(listeners)
        self.auto_step = auto_step
        self.mark_start = mark_start
        self.stop_after = stop_after
        self.model_name = model_name or (type(model).__name__ if model is not None else "")
        self._steer = steer_mod.devices(steer)
        self._meta = dict(meta or {})
        # Without a device or a model, the program's own device is followed (see device=).
        self._follow = device is None and model is None
        self._released_on_move = -1  # objects released when the program moved (-1: it did not)
        if device is None:
            first = next(iter(model.parameters()), None) if model is not None else None
            device = first.device.type if first is not None else "cpu"
        self.device = torch.device(device).type

        self._events: list[Event] = []
        self._keep = keep_events
        self._on_error = on_error
        self._objs: dict[int, _Obj] = {}  # obj id -> facts
        # Storages made by an op that only allocates (empty, empty_like): announced
        # by the first launch that touches them (see _announce_unwritten).
        self._unwritten: set[int] = set()
        self._by_storage: dict[int, int] = {}  # id(storage object) -> obj id
        self._finalizers: dict[int, weakref.finalize] = {}
        self._next_obj = 0
        self._seq = 0
        self._iteration = -1  # index of the running iteration (-1: set-up)
        self._pending_boundary = False
        self._closed = False
        self._recording = False
        self._paused = 0
        self._in_step = 0
        self._op_cache: dict[Any, _OpInfo] = {}
        self._exec_cache: dict[tuple, int] = {}
        self._occurrence: dict[int, int] = {}  # exec id -> launches so far this iteration
        self._learned: dict[tuple, Kind] = {}  # creating-launch key -> kind seen last iteration
        self._module_names: dict[int, str] = {}
        self._stack: list[str | None] = []
        self._bwd_module: str | None = None
        self._lock = threading.RLock()
        self._handles: list[Any] = []
        self._exit_stack: contextlib.ExitStack | None = None
        self._mode: _Mode | None = None
        self._stop_requested = False
        # Suspending ops (see the module docstring): _ops_off is what was asked
        # (launches are not recorded while it is set), _mode_on whether the mode
        # is on the owner thread's dispatch stack; they are brought in line at
        # safe points (_sync_mode). The lock never wraps an emit, so any lock
        # may be held by the caller.
        self._ops_off = False
        self._mode_on = False
        self._below: TorchDispatchMode | None = None  # the mode under ours when we left it
        self._owner: int | None = None  # thread that entered the recorder
        self._mode_lock = threading.Lock()

    # ------------------------------------------------------------------ public API
    def __enter__(self) -> Recorder:
        if self._recording or self._closed:
            raise RuntimeError("a Recorder can be entered only once")
        stack = contextlib.ExitStack()
        # PyTorch's TF32 switches, read once: which FP32 kernels run on tensor cores.
        self._tf32 = (torch.get_float32_matmul_precision() != "highest", bool(torch.backends.cudnn.allow_tf32))
        if self._steer:
            stack.enter_context(steer_mod.steered(self.paused, self._steer))
        mm = torch.nn.modules.module
        self._handles = [
            mm.register_module_forward_pre_hook(self._forward_pre),
            mm.register_module_forward_hook(self._forward_post, always_call=True),
            register_optimizer_step_pre_hook(self._step_pre),
            register_optimizer_step_post_hook(self._step_post),
        ]
        if self.model is not None:
            for name, m in self.model.named_modules():
                self._module_names[id(m)] = name
        self._setup()
        self._mode = _Mode(self)
        self._exit_stack = stack
        self._mode.__enter__()  # outside the exit stack: suspend_ops may leave it
        self._mode_on = True
        self._owner = threading.get_ident()
        self._recording = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recording = False
        with self._mode_lock:
            self._leave_mode()
            self._ops_off = False
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None
        for h in self._handles:
            h.remove()
        self._handles = []
        with self._lock:
            if self._pending_boundary and not self._closed:
                self._emit_boundary()  # the last step's iteration is complete
            self._close()

    def step(self) -> None:
        """Mark the end of an iteration (emitted before the next launch)."""
        with self._lock:
            if self._closed:
                return
            if self._iteration < 0:
                self._emit_boundary()  # the first mark only ends set-up
            elif self._seq > 0:
                self._pending_boundary = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run code unrecorded (e.g. loading a batch, as a data loader would off-trace).

        Storages created here and used later are announced as INPUT when first seen.
        """
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def suspend_ops(self) -> bool:
        """Stop recording ops and leave the dispatch mode; hooks keep emitting.

        Returns True when ops are (or already were) suspended; False when the
        recorder is not recording or a mode of the user's is on top of its own
        (the mode stays on and launches keep coming), or torch lacks the
        helpers to move its mode stack. Safe from any thread.
        """
        with self._mode_lock:
            if not self._recording or self._closed or not _CAN_SUSPEND:
                return False
            if self._ops_off:
                return True
            if self._mode_on and self._owner == threading.get_ident():
                stack = _get_current_dispatch_mode_stack()
                if self._mode in stack and stack[-1] is not self._mode:
                    return False  # a user's mode on top: never pop it
            self._ops_off = True
            self._sync_mode()
            return True

    def resume_ops(self, *, at_once: bool = True) -> None:
        """Record ops again, re-entering the dispatch mode (see the module docstring).

        Args:
            at_once: re-enter the mode now where that is safe; False leaves it to
                the next module or optimizer hook. A caller that may be inside a
                C++ op (an allocator's callback) passes False: the recorder cannot
                tell, and a mode pushed in the middle of an op would catch the rest
                of a composite op's inner ops.
        """
        with self._mode_lock:
            if not self._ops_off:
                return
            self._ops_off = False
            if at_once and self._recording and not self._closed:
                self._sync_mode()

    @property
    def ops_suspended(self) -> bool:
        """Whether ops are suspended (:meth:`suspend_ops`)."""
        return self._ops_off

    def address(self, obj: int) -> int:
        """Device address of a live object's storage (0 if dead, unknown, or on meta).

        The live runtime uses it to find where torch (through umrt's pool) put an object.
        """
        fin = self._finalizers.get(obj)
        item = fin.peek() if fin is not None else None
        if not item:
            return 0
        storage = item[0]
        return 0 if storage.device.type == "meta" else int(storage.data_ptr())

    def trace(self) -> Trace:
        """The trace so far, with refined kinds (and detected iterations if unmarked).

        Raises:
            RuntimeError: the recorder was made with ``keep_events=False``.
        """
        if not self._keep:
            raise RuntimeError("this Recorder keeps no events (keep_events=False): it has no trace")
        with self._lock:
            if self._pending_boundary and not self._closed:
                self._emit_boundary()
            events = self._refined_events()
        from umrt.trace.fileformat import FORMAT_VERSION

        header = TraceHeader(
            format_version=FORMAT_VERSION,
            umrt_version=_umrt_version(),
            model=self.model_name,
            torch_version=torch.__version__,
            device=self.device,
            iterations=0,
            notes=steer_mod.notes(self._steer, self.device) + self._device_notes(),
            meta=dict(self._meta),
        )
        trace = Trace(header, events)
        if sum(isinstance(e, IterationBoundary) for e in events) < 2:
            from umrt.capture.detect import insert_boundaries

            trace = insert_boundaries(trace)
            trace.header.notes.append("iteration boundaries detected from repeating launches (no step marks)")
        trace.header.iterations = len(trace.iteration_spans())
        return trace

    @property
    def events(self) -> list[Event]:
        """Events as emitted so far (kinds as announced live; none with ``keep_events=False``)."""
        return self._events

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> None:
        if self.model is not None:
            for p in self.model.parameters():
                self._mark(p, Kind.PARAMETER)
            for b in self.model.buffers():
                self._mark(b, Kind.OTHER)
        if self.optimizer is not None:
            self._mark_optimizer(self.optimizer, grads=False)
        if self.mark_start:
            self._emit_boundary()

    def _mark(self, t: Any, kind: Kind) -> None:
        """Record a fact about a tensor's storage (announcing it if new)."""
        if not isinstance(t, torch.Tensor) or t.device.type != self.device:
            return
        obj = self._obj_for(t.untyped_storage(), first_seen_kind=kind)
        info = self._objs[obj]
        info.known = kind
        if info.key is not None:
            self._learned[info.key] = kind

    def _mark_optimizer(self, opt: torch.optim.Optimizer, *, grads: bool) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self._mark(p, Kind.PARAMETER)
                if grads and p.grad is not None:
                    self._mark(p.grad, Kind.GRADIENT)
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    if k == "step" and v.dim() == 0 and v.device.type == "cpu":
                        continue  # a host step counter, as on CUDA (not capturable)
                    self._mark(v, Kind.OPTIMIZER_STATE)

    # ------------------------------------------------------------------ the dispatch mode
    def _sync_mode(self) -> None:
        """Leave or re-enter the mode as asked, where that is safe (mode lock held).

        Safe: on the owner thread (the stack is per thread), outside autograd
        (each backward node runs with the modes of ``backward()``'s caller)
        and not inside an op (the mode being run is off the stack meanwhile).
        """
        if self._owner != threading.get_ident() or torch._C._current_graph_task_id() != -1:
            return
        if self._ops_off and self._mode_on:
            stack = _get_current_dispatch_mode_stack()
            if stack and stack[-1] is self._mode:
                self._mode.__exit__(None, None, None)
                self._mode_on = False
                self._below = stack[-2] if len(stack) > 1 else None
            elif self._mode in stack:
                self._ops_off = False  # a user's mode came on top meanwhile: stay on
            # else: inside one of our ops (the mode is off the stack): next time
        elif not self._ops_off and not self._mode_on:
            if _get_current_dispatch_mode() is self._below:
                self._mode.__enter__()
                self._mode_on = True
            # else: a mode entered since we left sits on top; entering ours above
            # it would make its exit pop ours: wait until it is gone

    def _maybe_sync(self) -> None:
        """At a hook: bring the mode in line with what was asked (cheap when it is)."""
        if self._ops_off == self._mode_on:
            with self._mode_lock:
                if self._recording and not self._closed:
                    self._sync_mode()

    def _leave_mode(self) -> None:
        """Exit the mode for good (mode lock held), whoever sits above it."""
        if not self._mode_on:
            return
        self._mode_on = False
        if not _CAN_SUSPEND:  # never suspended: the mode is where __enter__ left it
            self._mode.__exit__(None, None, None)
            return
        stack = _get_current_dispatch_mode_stack()
        if self._mode not in stack:
            return  # another thread's stack, or an op of ours is running: nothing to pop here
        above = []
        while stack[-1] is not self._mode:  # modes entered on top of ours stay on
            above.append(_pop_mode())
            stack.pop()
        self._mode.__exit__(None, None, None)
        for mode in reversed(above):
            _push_mode(mode)

    # ------------------------------------------------------------------ hooks
    def _error(self, exc: Exception) -> None:
        """The recorder's own bookkeeping failed: re-raise, or hand it to ``on_error``."""
        if self._on_error is None:
            raise exc
        self._on_error(exc)

    @_guarded
    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self._recording or self._closed or self._paused:
            self._stack.append(None)  # keeps pushes and pops paired
            return
        self._maybe_sync()
        if self._bwd_module is not None and torch._C._current_graph_task_id() == -1:
            with self._lock:  # forward after a backward without a step (gradient accumulation)
                self._end_backward()
        name = self._module_names.get(id(module))
        if name is None:
            parent = self._current_module()
            if parent is not None:
                name = f"{parent}.{type(module).__name__.lower()}".lstrip(".")
            else:  # a root we were not told about: name its tree
                for sub, m in module.named_modules():
                    self._module_names.setdefault(id(m), sub)
                name = ""
            self._module_names[id(module)] = name
        if self.model is None and self._current_module() is None:
            if self._follow:
                with self._lock:
                    self._follow_to(module.parameters())
            for p in module.parameters():
                if p.device.type == self.device:
                    with self._lock:
                        self._flush()
                        self._mark(p, Kind.PARAMETER)
        self._stack.append(name)
        with self._lock:
            self._flush()
            self._emit(LayerEnter(name, "forward"))

    @_guarded
    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        name = self._stack.pop()
        if name is None or self._closed or not self._recording:
            return
        self._maybe_sync()
        with self._lock:
            self._emit(LayerExit(name, "forward"))
        if torch.is_grad_enabled():
            for t in _output_tensors(output):
                node = t.grad_fn
                if node is None:
                    continue
                md = node.metadata
                if "umrt_module" in md:  # an inner module claimed it first
                    continue
                md["umrt_module"] = name
                node.register_prehook(self._backward_hook(name))

    def _current_module(self) -> str | None:
        for name in reversed(self._stack):
            if name is not None:
                return name
        return None

    def _backward_hook(self, name: str) -> Callable:
        def hook(grad_outputs: Any) -> None:
            if not self._recording or self._closed:
                return
            try:
                with self._lock:
                    if self._bwd_module == name:
                        return
                    if self._bwd_module is not None:
                        self._emit(LayerExit(self._bwd_module, "backward"))
                    self._bwd_module = name
                    self._emit(LayerEnter(name, "backward"))
            except Exception as exc:  # noqa: BLE001 - see on_error
                self._error(exc)

        return hook

    def _end_backward(self) -> None:
        if self._bwd_module is not None:
            self._emit(LayerExit(self._bwd_module, "backward"))
            self._bwd_module = None

    @_guarded
    def _step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._recording or self._closed:
            return
        self._maybe_sync()
        with self._lock:
            if self._follow:
                self._follow_to(p for group in opt.param_groups for p in group["params"])
            self._flush()
            self._end_backward()
            # Facts about the optimizer's tensors (kinds) are for recorded ops; with
            # ops suspended they would cost a pass over every parameter each step.
            if (self.optimizer is None or opt is self.optimizer) and not self._ops_off:
                self._mark_optimizer(opt, grads=True)
        self._in_step += 1

    @_guarded
    def _step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._in_step = max(0, self._in_step - 1)
        if not self._recording or self._closed:
            return
        self._maybe_sync()
        if self.optimizer is not None and opt is not self.optimizer:
            return
        if not self._ops_off:
            with self._lock:
                self._mark_optimizer(opt, grads=False)
        if self.auto_step:
            self.step()

    # ------------------------------------------------------------------ events
    def _emit(self, ev: Event) -> None:
        if self._keep:
            self._events.append(ev)
        for listener in self.listeners:
            listener(ev)

    def _emit_boundary(self) -> None:
        self._pending_boundary = False
        self._end_backward()
        self._iteration += 1
        self._occurrence.clear()
        self._emit(IterationBoundary(self._iteration))
        if self.stop_after is not None and self._iteration >= self.stop_after:
            self._close()
            self._stop_requested = True

    def _flush(self) -> None:
        """Emit a pending boundary (called before anything of the next iteration)."""
        if self._pending_boundary:
            self._emit_boundary()
            if self._stop_requested:
                self._stop_requested = False
                raise StopRecording(f"recorded {self.stop_after} iterations")

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        self._by_storage.clear()

    def _obj_for(
        self,
        storage: Any,
        *,
        first_seen_kind: Kind | None = None,
        launch: int = -1,
        key: tuple | None = None,
        kind: Kind | None = None,
        phase: int | None = None,
        announce: bool = True,
    ) -> int:
        """The object id of a storage, announcing it (Alloc) when new (``phase``: the
        running phase, when the caller has it; ``announce=False``: the first launch that
        touches it announces it)."""
        sid = id(storage)
        obj = self._by_storage.get(sid)
        if obj is not None:
            return obj
        obj = self._next_obj
        self._next_obj += 1
        if phase is None:
            phase = self._phase()
        if kind is None:
            if first_seen_kind is not None:
                kind = first_seen_kind
            elif self._iteration < 0:
                kind = Kind.OTHER
            else:
                kind = Kind.INPUT  # pre-existing storage first seen mid-iteration: batch data
        known = None if key is not None else kind  # first seen, not made by an op: a fact
        nbytes = storage.nbytes()
        index = len(self._events) if announce else -1
        self._objs[obj] = _Obj(nbytes, kind, known, phase, self._iteration, key, index)
        self._by_storage[sid] = obj
        self._finalizers[obj] = weakref.finalize(storage, self._on_free, obj, sid)
        if announce:
            self._emit(Alloc(obj, nbytes, kind, launch))
        else:
            self._unwritten.add(obj)
        return obj

    @_guarded
    def _on_free(self, obj: int, sid: int) -> None:
        with self._lock:
            self._finalizers.pop(obj, None)
            if self._by_storage.get(sid) == obj:
                del self._by_storage[sid]
            if self._closed:
                return
            if obj in self._unwritten:  # no launch ever touched it: it never was in the trace
                self._unwritten.discard(obj)
                del self._objs[obj]
                return
            info = self._objs[obj]
            info.freed_phase = self._phase()
            info.freed_iteration = self._iteration
            if info.key is not None and info.known is None and info.iteration == self._iteration:
                self._learned[info.key] = _lifetime_kind(info)
            if not self._keep:
                del self._objs[obj]  # kept only to refine the trace's kinds
            self._emit(Free(obj))

    def _follow_to(self, tensors: Any) -> bool:
        """Follow the program onto the first accelerator one of ``tensors`` is on (lock held).

        From then on that device is traced; the objects traced on the CPU until
        then are released (their Free is emitted now): they are host memory.
        Returns whether the device changed.
        """
        device = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)
                       and t.device.type not in ("cpu", "meta")), None)
        if device is None:
            return False
        self._follow = False
        self.device = device
        released = list(self._by_storage.items())
        self._released_on_move = len(released)
        for sid, obj in released:
            fin = self._finalizers.get(obj)
            if fin is not None:
                fin.detach()
                self._on_free(obj, sid)
        return True

    def _device_notes(self) -> list[str]:
        """How the traced device was chosen, when the program chose it."""
        if self._follow:
            return [f"traced device {self.device}: the program's, as no op touched a tensor on an accelerator"]
        if self._released_on_move >= 0:
            return [f"traced device {self.device}: the program's, from its first op on it; the "
                    f"{self._released_on_move} objects traced on the CPU before then were released there"]
        return []

    def _phase(self, in_graph: bool | None = None) -> int:
        """The running phase (``in_graph``: whether autograd is running, when known)."""
        if self._iteration < 0:
            return _SETUP
        if self._in_step:
            return _STEP
        if in_graph if in_graph is not None else torch._C._current_graph_task_id() != -1:
            return _BACKWARD
        return _FORWARD

    # ------------------------------------------------------------------ ops
    def _op_info(self, func: Any) -> _OpInfo:
        info = self._op_cache.get(func)
        if info is not None:
            return info
        schema = getattr(func, "_schema", None)
        name = f"{schema.name}.{func._overloadname}" if schema is not None else str(func)
        write_pos: set[int] = set()
        write_kw: set[str] = set()
        skip = False
        if schema is not None:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    if a.kwarg_only:
                        write_kw.add(a.name)
                    else:
                        write_pos.add(i)
                        write_kw.add(a.name)
            rets = schema.returns
            skip = (
                not write_pos
                and not write_kw
                and len(rets) > 0
                and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
            )
        else:
            skip = True
        from torch.utils.flop_counter import flop_registry

        flop_fn = flop_registry.get(getattr(func, "_overloadpacket", None))
        info = _OpInfo(
            name=steer_mod.OP_RENAMES.get(name, name),
            skip=skip,
            alloc_only=name in _ALLOC_ONLY,
            write_pos=frozenset(write_pos),
            write_kw=frozenset(write_kw),
            flop_fn=flop_fn,
        )
        self._op_cache[func] = info
        return info

    def _on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self._recording or self._closed or self._paused or self._ops_off:
            return func(*args, **kwargs)
        try:
            info = self._op_info(func)
        except Exception as exc:  # noqa: BLE001 - see on_error; the op itself still runs
            self._error(exc)
            return func(*args, **kwargs)
        if info.skip:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self._ops_off:  # suspended while it ran (a listener of the allocator's): no launch after that
            return out
        try:
            with self._lock:
                self._record(func, info, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - see on_error
            self._error(exc)
        return out

    def _record(self, func: Any, info: _OpInfo, args: tuple, kwargs: dict, out: Any) -> None:
        dev = self.device
        # (tensor, written, on the traced device): each tensor's device is read once per op.
        inputs: list[tuple[torch.Tensor, bool, bool]] = []
        for i, a in enumerate(args):
            w = i in info.write_pos
            for t in _tensors(a):
                inputs.append((t, w, t.device.type == dev))
        for k, a in kwargs.items():
            w = k in info.write_kw
            for t in _tensors(a):
                inputs.append((t, w, t.device.type == dev))
        outs = [(t, t.device.type == dev) for t in _tensors(out)]
        if self._follow and not (all(on for *_, on in inputs) and all(on for _, on in outs)):
            moved = self._follow_to([t for t, *_ in inputs] + [t for t, _ in outs])
            if moved:
                dev = self.device
                inputs = [(t, w, t.device.type == dev) for t, w, _ in inputs]
                outs = [(t, t.device.type == dev) for t, _ in outs]
        if not any(on for *_, on in inputs) and not any(on for _, on in outs):
            return  # a host op: no kernel on the traced device
        if (
            self._in_step
            and dev == "cpu"
            and all(t.dim() == 0 for t, _, _ in inputs)
            and all(t.dim() == 0 for t, _ in outs)
        ):
            return  # optimizer step counters: host scalars on CUDA too
        self._flush()
        in_graph = torch._C._current_graph_task_id() != -1
        if self._bwd_module is not None and not in_graph:
            self._end_backward()

        phase = self._phase(in_graph)
        if phase == _BACKWARD:
            module = self._bwd_module or ""
        elif phase == _STEP:
            module = ""
        else:
            module = self._current_module() or ""
        shapes = tuple(tuple(t.shape) for t, _, _ in inputs)
        dtypes = tuple(str(t.dtype)[6:] for t, _, _ in inputs)
        ck = (info.name, shapes, dtypes, module)
        exec_id = self._exec_cache.get(ck)
        if exec_id is None:
            exec_id = execution_id(info.name, shapes, dtypes, module)
            self._exec_cache[ck] = exec_id
        occ = self._occurrence.get(exec_id, 0)
        self._occurrence[exec_id] = occ + 1

        seq = -1 if info.alloc_only else self._seq
        acc: dict[tuple[int, int, int], bool] = {}
        in_objs: set[int] = set()
        for t, w, on in inputs:
            if not on:
                continue
            obj = self._obj_for(t.untyped_storage(), phase=phase)
            in_objs.add(obj)
            length = _extent(t)
            if length:
                k3 = (obj, t.storage_offset() * t.element_size(), length)
                acc[k3] = acc.get(k3, False) or w
        created = False
        for j, (t, on) in enumerate(outs):
            if not on:
                continue
            st = t.untyped_storage()
            obj = self._by_storage.get(id(st))
            if obj is None:
                key = (exec_id, occ, j)
                kind = self._learned.get(key)
                if kind is None:
                    kind = Kind.ACTIVATION if phase == _FORWARD else Kind.TEMPORARY
                obj = self._obj_for(st, launch=seq, key=key, kind=kind, phase=phase,
                                    announce=not info.alloc_only)
                created = True
            elif obj in in_objs:
                continue  # a view of an input, or an input written in place (schema says so)
            length = _extent(t)
            if length:
                k3 = (obj, t.storage_offset() * t.element_size(), length)
                acc[k3] = True
        if created and dev != "cpu" and any(t.is_cpu and t.dim() > 0 for t, _, _ in inputs):
            for t, on in outs:  # a host-to-device copy: batch data arriving
                if on:
                    self._objs[self._by_storage[id(t.untyped_storage())]].known = Kind.INPUT
        if info.alloc_only:
            return
        if outs and not created and not any(acc.values()):
            return  # every output aliases an input and nothing is written: no kernel
        if self._unwritten:
            self._announce_unwritten(acc, seq)
        accesses = tuple(Access(o, off, ln, w) for (o, off, ln), w in acc.items())
        flops = self._flops(func, info, args, kwargs, out)
        nbytes = sum(ln for _, _, ln in acc)
        self._seq += 1
        precision = _precision(info.name, inputs, self._tf32)
        self._emit(Launch(seq, exec_id, info.name, accesses, flops, nbytes, module, precision))

    def _announce_unwritten(self, acc: dict[tuple[int, int, int], bool], seq: int) -> None:
        """Announce the storages of ops that only allocate which launch ``seq`` touches.

        Written whole by it: made by it (``Alloc.launch = seq``), like any op's
        output; its bytes hold nothing before (on a GPU: no copy in, the pages
        are populated where the kernel runs). Otherwise (read first, or partly
        written) as data already there (``launch = -1``), the safe reading of
        uninitialized memory a program uses.
        """
        written: dict[int, int] = {}
        for (obj, _, length), w in acc.items():
            if obj in self._unwritten:
                written[obj] = written.get(obj, 0) + (length if w else 0)
        for obj, nbytes in written.items():
            self._unwritten.discard(obj)
            info = self._objs[obj]
            info.event_index = len(self._events)
            self._emit(Alloc(obj, info.nbytes, info.kind, seq if nbytes >= info.nbytes else -1))

    @staticmethod
    def _flops(func: Any, info: _OpInfo, args: tuple, kwargs: dict, out: Any) -> int:
        try:
            if info.flop_fn is not None:
                return int(info.flop_fn(*args, **kwargs, out_val=out))
            if info.name == "aten::_scaled_dot_product_flash_attention.default":
                from torch.utils.flop_counter import sdpa_flop_count

                q, k, v = args[:3]
                return int(sdpa_flop_count(q.shape, k.shape, v.shape))
            if info.name == "aten::_scaled_dot_product_flash_attention_backward.default":
                from torch.utils.flop_counter import sdpa_backward_flop_count

                g, q, k, v = args[:4]
                return int(sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))
        except Exception:  # a flop formula that does not fit these args: count nothing
            return 0
        return 0

    # ------------------------------------------------------------------ refinement
    def _refined_events(self) -> list[Event]:
        events = list(self._events)
        for info in self._objs.values():
            if info.event_index < 0:  # made by an op that only allocates, touched by no launch yet
                continue
            if info.known is not None:
                kind = info.known
            elif info.freed_iteration == -2:  # never freed while recording
                born_last = info.iteration == self._iteration and info.phase in (_FORWARD, _BACKWARD)
                kind = info.kind if born_last else Kind.OTHER
            else:
                kind = _lifetime_kind(info)
            ev = events[info.event_index]
            if ev.kind != kind:
                events[info.event_index] = Alloc(ev.obj, ev.nbytes, kind, ev.launch)
        return events


def _umrt_version() -> str:
    from umrt import __version__

    return __version__
