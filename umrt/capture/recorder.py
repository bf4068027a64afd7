"""Record what a PyTorch training loop launches, as umrt events::

    rec = Recorder(model, optimizer)
    with rec:
        for batch in batches:
            loss = model(batch).loss
            loss.backward()
            optimizer.step()          # marks an iteration boundary
            optimizer.zero_grad(set_to_none=True)
    trace = rec.trace()

A ``TorchDispatchMode`` sees every aten op (:mod:`~umrt.capture.modestack`);
objects are storages (:mod:`~umrt.capture.identity`); module and optimizer
hooks (:class:`RecorderHooks`, below) give layer events and iterations.

* An object first produced by an op is allocated by that launch; one first seen
  as an input (parameters, a batch loaded while paused) has ``launch = -1``; one
  made by an op that only allocates is announced by the first launch that
  touches it (made by it if it writes it whole, else ``launch = -1``).
* Kinds: parameters, gradients (at the optimizer step), optimizer state and
  inputs are facts; the rest comes from lifetimes (:mod:`~umrt.capture.phases`).
  Live listeners get the kind the same launch's output had the previous
  iteration; :meth:`Recorder.trace` returns the refined kinds.
* An optimizer step (or :meth:`Recorder.step`) ends an iteration; its boundary
  is emitted just before the next launch (or, with ops suspended, the next
  hook), so frees after the step close the iteration they belong to. Without
  marks, :meth:`Recorder.trace` finds iterations as repeats
  (:mod:`umrt.capture.detect`).
* Phases (``IterationBoundary.phase``): once training is under way (after the
  first step), an evaluation is iterations of its own, one per forward of the
  model (a root module with parameters) with gradients off, in inference
  mode or with the model in eval mode (:class:`~umrt.capture.phases.LoopPhase`,
  :attr:`Recorder.loop`); the
  model's next training forward, or the first op before it that writes the
  device in training mode (the next batch loaded), opens a training
  iteration again. A step's
  boundary takes the phase the loop is in when it is emitted, at the first
  launch that writes the device (one that only reads it, a copy to the host
  such as ``loss.item()`` or a checkpoint's, ends the iteration it follows).
* :meth:`Recorder.suspend_ops` stops recording launches (the live runtime's
  steady state) while layer events, boundaries and frees keep coming.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_map_only

from umrt import __version__
from umrt.capture import steer as steer_mod
from umrt.capture.detect import insert_boundaries
from umrt.capture.hooks import (
    ModulePaths,
    claim_backward,
    compiled_code_eager,
    guarded,
    install_hooks,
    is_compiled_module,
    pause_data_loaders,
)
from umrt.capture.identity import StorageObjects, TracedObject
from umrt.capture.modestack import ModeSwitch, OpsMode
from umrt.capture.ops import (
    OpInfo,
    OpTable,
    extent,
    launch_flops,
    precision_of,
    stored,
    tensors_in,
    tf32_switches,
)
from umrt.capture.phases import BACKWARD, FORWARD, STEP, LoopPhase, Phases, lifetime_kind
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
from umrt.trace.fileformat import FORMAT_VERSION

log = logging.getLogger("umrt")
Listener = Callable[[Event], None]


class StopRecording(BaseException):
    """Raised into the recorded program once ``stop_after`` iterations are complete.

    A ``BaseException`` so that a script's ``except Exception`` does not swallow it.
    """


def script_recorder(command: Sequence[str], *, steps: int | None = None, device: str | None = None,
                    listeners: Sequence[Listener] = ()) -> Recorder:
    """The recorder of a user's training script, the same for ``umrt trace -- python script.py``
    and shadow mode (so one script gives one trace, and one footprint, either way): nothing
    steered (the script computes exactly what it computes without umrt), each optimizer step
    ending an iteration from the first one on (iteration 0 builds the model and the optimizer's
    lazy state), on the device the script uses unless ``device`` says; ``steps`` stops the
    script (:class:`StopRecording`) once that many iterations are recorded. A failure of the
    recorder's own ends the recording (:attr:`Recorder.failure`), never the script."""
    return Recorder(listeners=listeners, device=device, mark_start=True, stop_after=steps, steer=False,
                    model_name=" ".join(command)[:200], meta={"argv": list(command), "steps": steps},
                    on_error="stop")


def not_recorded(failure: str, then: str) -> str:
    """What to tell the user of a script :func:`script_recorder` could not follow to its
    end (``failure``: :attr:`Recorder.failure`), and ``then`` what came of it."""
    return (f"umrt could not record the script ({failure}); the script ran on to its end unrecorded, and {then}. "
            "The limit is umrt's, not the script's: please report it with this message")


class EventLog:
    """Hands each event to the listeners, and keeps it unless told not to."""

    def __init__(self, listeners: list[Listener], keep: bool) -> None:
        self.events: list[Event] = []
        self.listeners = listeners
        self.keep = keep

    def emit(self, ev: Event) -> None:
        if self.keep:
            self.events.append(ev)
        for listener in self.listeners:
            listener(ev)

    def next_index(self) -> int:
        """The index the next kept event will have."""
        return len(self.events)


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
            many training iterations (optimizer steps) are complete (after the
            trace is closed).
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
            the program: a live run must not stop for umrt's sake. ``"stop"``:
            the first one ends the recording for good (kept in :attr:`failure`,
            the program runs on unrecorded; its caller says so). Default:
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
        on_error: Callable[[BaseException], None] | Literal["stop"] | None = None,
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
        self._following = device is None and model is None
        self._released_on_move = -1  # objects released when the program moved (-1: it did not)
        if device is None:
            first = next(iter(model.parameters()), None) if model is not None else None
            device = first.device.type if first is not None else "cpu"
        self.device = torch.device(device).type

        self._log = EventLog(self.listeners, keep_events)
        self._on_error = on_error
        self.failure: str | None = None  # with on_error="stop": what ended the recording
        self._objects = StorageObjects()
        self._phases = Phases()
        self._ops = OpTable()
        self._exec_ids: dict[tuple, int] = {}  # (op, shapes, dtypes, module) -> execution id
        self._occurrence: dict[int, int] = {}  # exec id -> launches so far this iteration
        self._seq = 0
        self._pending_boundary = False
        self.loop = LoopPhase(model)  # the phase of the training loop (IterationBoundary.phase)
        self._stop_requested = False
        self._closed = False
        self._recording = False
        self._paused = 0
        # While a data loader fetches (RecorderHooks.fetching): traced objects it reads, by storage id
        self.fetch_reads: dict[int, int] | None = None
        self._lock = threading.RLock()
        self._hooks = RecorderHooks(self)
        self._mode_switch = ModeSwitch(OpsMode(self._on_op), lambda: self._recording and not self._closed)
        self._exit_stack: contextlib.ExitStack | None = None

    # ------------------------------------------------------------------ public API
    def __enter__(self) -> Recorder:
        if self._recording or self._closed:
            raise RuntimeError("a Recorder can be entered only once")
        stack = contextlib.ExitStack()
        self._tf32 = tf32_switches()  # read once
        if self._steer:
            stack.enter_context(steer_mod.steered(self.paused, self._steer))
        stack.enter_context(compiled_code_eager())
        self._hooks.install()
        self._setup()
        self._exit_stack = stack
        self._mode_switch.enter()  # outside the exit stack: suspend_ops may leave it
        self._recording = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._recording = False
        self._mode_switch.leave()
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None
        self._hooks.remove()
        with self._lock:
            if self._pending_boundary and not self._closed:
                self._emit_boundary()  # the last step's iteration is complete
            self._close()

    def step(self) -> None:
        """Mark the end of an iteration (emitted before the next launch)."""
        with self._lock:
            if self._closed:
                return
            if self._phases.iteration < 0:
                self._emit_boundary("train")  # the first mark only ends set-up
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

        Module, backward-layer and optimizer hooks keep emitting layer events and
        iteration boundaries, and storages already known still emit their Free;
        storages made meanwhile are announced when first seen after
        :meth:`resume_ops`. The mode itself is left on the thread that entered
        the recorder, outside autograd and outside an op: at once where that is
        so, else at the next hook there (see :mod:`umrt.capture.modestack`).

        Returns True when ops are (or already were) suspended; False when the
        recorder is not recording or a mode of the user's is on top of its own
        (the mode stays on and launches keep coming), or torch lacks the
        helpers to move its mode stack. Safe from any thread.
        """
        return self._mode_switch.suspend()

    def resume_ops(self, *, at_once: bool = True) -> None:
        """Record ops again, re-entering the dispatch mode.

        Args:
            at_once: re-enter the mode now where that is safe; False leaves it to
                the next module or optimizer hook. A caller that may be inside a
                C++ op (an allocator's callback) passes False: the recorder cannot
                tell, and a mode pushed in the middle of an op would catch the rest
                of a composite op's inner ops.
        """
        self._mode_switch.resume(at_once)

    def emit_layers(self, on: bool) -> None:
        """Stop (``False``) or restart emitting layer events: off, the module hooks are
        removed (they cost a Python call per module per step); optimizer hooks keep
        emitting. Call it outside any forward (an optimizer step's hook)."""
        if on:
            self._hooks.resume_layers()
        else:
            self._hooks.suspend_layers()

    @property
    def ops_suspended(self) -> bool:
        """Whether ops are suspended (:meth:`suspend_ops`)."""
        return self._mode_switch.ops_off

    def address(self, obj: int) -> int:
        """Device address of a live object's storage (0 if dead, unknown, or on meta).

        The live runtime uses it to find where torch (through umrt's pool) put an object.
        """
        return self._objects.address(obj)

    def trace(self) -> Trace:
        """The trace so far, with refined kinds (and detected iterations if unmarked).

        Raises:
            RuntimeError: the recorder was made with ``keep_events=False``.
        """
        if not self._log.keep:
            raise RuntimeError("this Recorder keeps no events (keep_events=False): it has no trace")
        with self._lock:
            if self._pending_boundary and not self._closed:
                self._emit_boundary()
            events = self._objects.refined(self._log.events, self._phases.iteration)
        header = TraceHeader(
            format_version=FORMAT_VERSION,
            umrt_version=__version__,
            model=self.model_name,
            torch_version=torch.__version__,
            device=self.device,
            iterations=0,
            notes=steer_mod.notes(self._steer, self.device) + self._device_notes(),
            meta=dict(self._meta),
        )
        trace = Trace(header, events)
        if sum(isinstance(e, IterationBoundary) for e in events) < 2:
            trace = insert_boundaries(trace)
            trace.header.notes.append("iteration boundaries detected from repeating launches (no step marks)")
        trace.header.iterations = len(trace.iteration_spans())
        return trace

    @property
    def events(self) -> list[Event]:
        """Events as emitted so far (kinds as announced live; none with ``keep_events=False``)."""
        return self._log.events

    # ------------------------------------------------------------------ facts (kinds)
    def _setup(self) -> None:
        if self.model is not None:
            for p in self.model.parameters():
                self._mark(p, Kind.PARAMETER)
            for b in self.model.buffers():
                self._mark(b, Kind.OTHER)
        if self.optimizer is not None:
            self._mark_optimizer(self.optimizer, grads=False)
        if self.mark_start:
            self._emit_boundary("train")

    def _mark(self, t: Any, kind: Kind) -> None:
        """Record a fact about a tensor's storage (announcing it if new)."""
        if not isinstance(t, torch.Tensor) or t.device.type != self.device:
            return
        for part in stored(t):
            obj = self._obj_for(part.untyped_storage(), first_seen_kind=kind)
            info = self._objects.objects[obj]
            info.known = kind
            if info.key is not None:
                self._objects.learned[info.key] = kind

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

    def _error(self, exc: Exception, during: str = "") -> None:
        """The recorder's own bookkeeping failed (``during``: what it was recording):
        re-raise, stop recording, or hand it to ``on_error``."""
        if self._on_error is None:
            raise exc
        if self._on_error == "stop":
            if self.failure is None:
                self.failure = f"{type(exc).__name__}: {exc}" + (f" ({during})" if during else "")
                self._close()
            return
        self._on_error(exc)

    # ------------------------------------------------------------------ iterations
    def _emit_boundary(self, phase: str | None = None) -> None:
        """Open an iteration of ``phase``; None: the one a step left pending, of the
        loop's phase now (``stop_after`` counts these)."""
        step = phase is None
        self._pending_boundary = False
        self._hooks.end_backward()
        self._phases.iteration += 1
        self._occurrence.clear()
        phase = self.loop.now() if step else phase
        self.loop.opened(phase)
        self._log.emit(IterationBoundary(self._phases.iteration, phase))
        if step:
            self.loop.steps += 1
            if self.stop_after is not None and self.loop.steps >= self.stop_after:
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
        self._objects.detach_all()

    # ------------------------------------------------------------------ objects
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
        obj = self._objects.find(storage)
        if obj is not None:
            return obj
        obj = self._objects.new_id()
        if phase is None:
            phase = self._phases.current()
        if kind is None:
            if first_seen_kind is not None:
                kind = first_seen_kind
            elif self._phases.iteration < 0:
                kind = Kind.OTHER
            else:
                kind = Kind.INPUT  # pre-existing storage first seen mid-iteration: batch data
        known = None if key is not None else kind  # first seen, not made by an op: a fact
        nbytes = storage.nbytes()
        index = self._log.next_index() if announce else -1
        info = TracedObject(nbytes, kind, known, phase, self._phases.iteration, key, index)
        self._objects.add(obj, storage, info, self._on_free)
        if announce:
            self._log.emit(Alloc(obj, nbytes, kind, launch))
        else:
            self._objects.unannounced.add(obj)
        return obj

    @guarded
    def _on_free(self, obj: int, sid: int) -> None:
        with self._lock:
            objects = self._objects
            objects.forget_storage(obj, sid)
            if self._closed:
                return
            if obj in objects.unannounced:  # no launch ever touched it: it never was in the trace
                objects.unannounced.discard(obj)
                del objects.objects[obj]
                return
            info = objects.objects[obj]
            info.freed_phase = self._phases.current()
            info.freed_iteration = self._phases.iteration
            if info.key is not None and info.known is None and info.iteration == self._phases.iteration:
                objects.learned[info.key] = lifetime_kind(info)
            if not self._log.keep:
                del objects.objects[obj]  # kept only to refine the trace's kinds
            self._log.emit(Free(obj))

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
        self._following = False
        self.device = device
        released = self._objects.alive()
        self._released_on_move = len(released)
        for sid, obj in released:
            self._objects.release(obj, sid, self._on_free)
        return True

    def _device_notes(self) -> list[str]:
        """How the traced device was chosen, when the program chose it."""
        if self._following:
            return [f"traced device {self.device}: the program's, as no op touched a tensor on an accelerator"]
        if self._released_on_move >= 0:
            return [f"traced device {self.device}: the program's, from its first op on it; the "
                    f"{self._released_on_move} objects traced on the CPU before then were released there"]
        return []

    # ------------------------------------------------------------------ ops
    def _on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self._recording or self._closed or self._paused or self._mode_switch.ops_off:
            reads = self.fetch_reads
            if reads is not None and self._paused:  # a data loader's fetch: note the traced objects it reads
                for t in (*tensors_in(args), *tensors_in(tuple(kwargs.values()))):
                    storage = t.untyped_storage()
                    obj = self._objects.find(storage)
                    if obj is not None:
                        reads[id(storage)] = obj
            return func(*args, **kwargs)
        try:
            info = self._ops.info(func)
        except Exception as exc:  # noqa: BLE001 - see on_error; the op itself still runs
            self._error(exc)
            return func(*args, **kwargs)
        if info.skip:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self._mode_switch.ops_off:  # suspended while it ran (a listener of the allocator's): no launch after that
            return out
        try:
            with self._lock:
                self._record(func, info, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 - see on_error
            self._error(exc, f"recording {info.name}, iteration {self._phases.iteration}")
        return out

    def _record(self, func: Any, info: OpInfo, args: tuple, kwargs: dict, out: Any) -> None:
        dev = self.device
        # (tensor, written, on the traced device): each tensor's device is read once per op.
        inputs: list[tuple[torch.Tensor, bool, bool]] = []
        for i, a in enumerate(args):
            w = i in info.write_pos
            for t in tensors_in(a):
                inputs.append((t, w, t.device.type == dev))
        for k, a in kwargs.items():
            w = k in info.write_kw
            for t in tensors_in(a):
                inputs.append((t, w, t.device.type == dev))
        outs = [(t, t.device.type == dev) for t in tensors_in(out)]
        if self._following and not (all(on for *_, on in inputs) and all(on for _, on in outs)):
            moved = self._follow_to([t for t, *_ in inputs] + [t for t, _ in outs])
            if moved:
                dev = self.device
                inputs = [(t, w, t.device.type == dev) for t, w, _ in inputs]
                outs = [(t, t.device.type == dev) for t, _ in outs]
        if not any(on for *_, on in inputs) and not any(on for _, on in outs):
            return  # a host op: no kernel on the traced device
        if (
            self._phases.in_step
            and dev == "cpu"
            and all(t.dim() == 0 for t, _, _ in inputs)
            and all(t.dim() == 0 for t, _ in outs)
        ):
            return  # optimizer step counters: host scalars on CUDA too
        if not self._pending_boundary or any(on and self._objects.find(t.untyped_storage()) is None
                                                 for t, on in outs):
            # After a step, the next iteration opens at the first op that makes a tensor (the next
            # batch), or at a model's forward. A launch that only reads the device (a copy to the
            # host: .item(), a checkpoint's torch.save) belongs to the iteration it follows, and so
            # does one that writes in place what is already there (gradients zeroed without being
            # freed, an EMA of the weights, a GradScaler's update): an evaluation next opens its own.
            self._flush()
            if self.loop.resuming_training():
                self._emit_boundary("train")  # the next batch after an evaluation: training's
        in_graph = torch._C._current_graph_task_id() != -1
        hooks = self._hooks
        if hooks.backward_module is not None and not in_graph:
            hooks.end_backward()

        phase = self._phases.current(in_graph)
        if phase == BACKWARD:
            module = hooks.backward_module or ""
        elif phase == STEP:
            module = ""
        else:
            module = hooks.current_module() or ""
        shapes = tuple(tuple(t.shape) for t, _, _ in inputs)
        dtypes = tuple(str(t.dtype)[6:] for t, _, _ in inputs)
        exec_key = (info.name, shapes, dtypes, module)
        exec_id = self._exec_ids.get(exec_key)
        if exec_id is None:
            exec_id = execution_id(info.name, shapes, dtypes, module)
            self._exec_ids[exec_key] = exec_id
        occurrence = self._occurrence.get(exec_id, 0)
        self._occurrence[exec_id] = occurrence + 1

        seq = -1 if info.alloc_only else self._seq
        touched: dict[tuple[int, int, int], bool] = {}
        in_objs: set[int] = set()
        for t, w, on in inputs:
            if not on:
                continue
            obj = self._obj_for(t.untyped_storage(), phase=phase)
            in_objs.add(obj)
            length = extent(t)
            if length:
                span = (obj, t.storage_offset() * t.element_size(), length)
                touched[span] = touched.get(span, False) or w
        created = False
        for j, (t, on) in enumerate(outs):
            if not on:
                continue
            st = t.untyped_storage()
            obj = self._objects.find(st)
            if obj is None:
                # The size too: a factory op's execution id knows no size (no tensor
                # argument), and the iteration's first 8-byte ``aten::empty`` (a DataLoader's
                # seed) is no parameter because a model's first empty was one.
                key = (exec_id, occurrence, j, st.nbytes())
                kind = self._objects.learned.get(key)
                if kind is None:
                    kind = Kind.ACTIVATION if phase == FORWARD else Kind.TEMPORARY
                obj = self._obj_for(st, launch=seq, key=key, kind=kind, phase=phase,
                                    announce=not info.alloc_only)
                created = True
            elif obj in in_objs:
                continue  # a view of an input, or an input written in place (schema says so)
            length = extent(t)
            if length:
                span = (obj, t.storage_offset() * t.element_size(), length)
                touched[span] = True
        if created and dev != "cpu" and any(t.is_cpu and t.dim() > 0 for t, _, _ in inputs):
            for t, on in outs:  # a host-to-device copy: batch data arriving
                if on:
                    self._objects.objects[self._objects.find(t.untyped_storage())].known = Kind.INPUT
        if info.alloc_only:
            return
        if outs and not created and not any(touched.values()):
            return  # every output aliases an input and nothing is written: no kernel
        if self._objects.unannounced:
            self._objects.announce(touched, seq, self._log)
        accesses = tuple(Access(o, off, ln, w) for (o, off, ln), w in touched.items())
        flops = launch_flops(info, args, kwargs, out)
        nbytes = sum(ln for _, _, ln in touched)
        self._seq += 1
        precision = precision_of(info.name, (t.dtype for t, *_ in inputs), self._tf32)
        self._log.emit(Launch(seq, exec_id, info.name, accesses, flops, nbytes, module, precision))


class RecorderHooks:
    """The :class:`Recorder`'s module, backward and optimizer hooks: layer events, the
    running module, and the optimizer's facts and steps. They act on the recorder's own
    state (its lock, its log, its pending boundary), which is why they live in its module.

    Forward ops carry the innermost running module's dotted path. Backward ops carry
    the module whose output gradient autograd most recently started on (a pre-hook
    on each module output's ``grad_fn``): backward layer events are flat (enter/exit
    pairs, never nested), and ops between two modules' gradients (residual adds) go
    to the last module. An optimizer step ends an iteration.
    """

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.paths = ModulePaths()
        self._stack: list[str | None] = []  # running forwards (None: not recorded)
        self.backward_module: str | None = None
        self._handles: list[Any] = []
        self._told_compiled = False  # that a compiled model runs eagerly (said once)

    def install(self) -> None:
        """Register the hooks; module paths are relative to the recorder's model."""
        self._handles = install_hooks(self._forward_pre, self._forward_post, self._step_pre, self._step_post,
                                      self._step_skipped)
        self._handles.append(pause_data_loaders(self.fetching, self._batch_arrived))
        self.paths = ModulePaths(self.rec.model)

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """Traced on the CPU, run a data loader's own work (its iterator's making, its sampler,
        a batch's fetch) unrecorded. The traced objects it reads are released at its end (their
        Free emitted; an op that touches one later announces it again, as data already there):
        a dataset made by ops while umrt records stays in host memory on a GPU, where the loop
        copies each batch from it. Traced on a device, the loader runs as the program wrote it:
        its host work is recorded nowhere, and a dataset it keeps on the device is collated by
        kernels that read device memory."""
        rec = self.rec
        if rec.device != "cpu":
            yield
            return
        outer = rec.fetch_reads
        if outer is None:
            rec.fetch_reads = {}
        try:
            with rec.paused():
                yield
        finally:
            if outer is None:
                reads, rec.fetch_reads = rec.fetch_reads, None
                if rec._recording and not rec._closed:
                    for sid, obj in reads.items():
                        rec._objects.release(obj, sid, rec._on_free)

    def _batch_arrived(self, batch: Any) -> Any:
        """A batch a DataLoader fetched (collated in the main process, or sent by a worker
        process), as the loop gets it. Traced on the CPU, each tensor is copied here (the
        values are the same) and the copy recorded as born written by a launch that reads
        nothing traced: a GPU run's batch is born at its copy to the device, from host
        memory, where the dataset it was collated from stays. (A worker's batch comes in
        shared memory, rebuilt whenever the worker's message arrives, ahead or out of
        order, which a GPU run's device memory never sees.)"""
        rec = self.rec
        if rec.device != "cpu" or not rec._recording or rec._closed or rec._paused or rec.ops_suspended:
            return batch
        clone = torch.ops.aten.clone.default

        def copied(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu":
                return t
            with rec.paused():
                copy = t.clone()
            try:
                with rec._lock:
                    rec._record(clone, rec._ops.info(clone), (), {}, copy)
            except Exception as exc:  # noqa: BLE001 - see on_error
                rec._error(exc, "recording a DataLoader's batch")
            return copy

        return tree_map_only(torch.Tensor, copied, batch)

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
        if self.current_module() is None and not self._told_compiled and is_compiled_module(module):
            self._told_compiled = True
            log.warning("umrt: %s is compiled (torch.compile); it runs eagerly while umrt runs: umrt plans from the "
                        "operators it sees, which compiled kernels hide", type(module._orig_mod).__name__)
        if self.current_module() is None and next(module.parameters(), None) is not None:
            with rec._lock:  # the model's forward: it may open an iteration of another phase
                rec._flush()
                if not rec._closed:
                    rec.loop.model_forward(module, rec._emit_boundary, args)
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
            rec.loop.stepping(opt)
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

    def _step_skipped(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """A GradScaler skipped ``opt``'s step (inf or NaN gradients): the iteration ends
        as at a step, with no optimizer launches in it."""
        self._step_pre(opt, args, kwargs)
        self._step_post(opt, args, kwargs)
