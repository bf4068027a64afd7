"""The live source of events: a training program on a real GPU.

:class:`LiveBridge` turns what the program does into events (objects from
umrt's allocator, launches and layer events from the capture recorder,
iteration boundaries of its own) and hands them to a
:class:`~umrt.drive.Driver`, which feeds the policy, the pool's learning and
the backend. It is closed-loop: the policy's ``wants_launches`` decides
whether the recorder captures ops at all. :func:`umrt.enable` starts one.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from umrt import stats
from umrt.backends.base import Advice, Backend, Range, SwapPath
from umrt.backends.ranges import RangeSet
from umrt.capture import Recorder
from umrt.capture.hooks import register_step_end_hook
from umrt.capture.ops import stored
from umrt.config import Config
from umrt.drive.driver import Driver
from umrt.errors import ConfigError, StoppedActing
from umrt.hardware import HardwareProfile, auto_profile_name, load_profile
from umrt.memory.base import Layout
from umrt.policy import make_policy
from umrt.policy.base import Policy, PolicyContext
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
)

__all__ = ["LiveBridge", "LivePool", "ManagedOnly", "LiveLayout", "profile_for", "set_budget"]

log = logging.getLogger("umrt")


class LiveSession(Protocol):
    """What the bridge reads of an enabled session (:class:`umrt.api.Session`)."""

    config: Config
    backend: Any  # the CUDA backend on managed memory
    pool: Any  # the managed pool (a LivePool where it announces blocks)
    budget_bytes: int
    steady: Any  # the allocator torch and CuPy call (umrt.native.server.SteadyServer)


@runtime_checkable
class LivePool(Protocol):
    """What the bridge needs of an allocator that announces its blocks (umrt's
    :class:`~umrt.allocators.managed.ManagedPool`)."""

    listeners: list[Callable[[str, int, int], None]]  # ("alloc" | "free", ptr, nbytes), from inside malloc/free
    before_malloc: list[Callable[[int], None]]  # nbytes, before the block is placed

    def observe(self, event: Event) -> None:
        """An iteration boundary or a layer event, for the pool's layouts."""

    def hint_kind(self, ptr: int, kind: Kind) -> bool:
        """What the live block at ``ptr`` holds."""

    def reserved_bytes(self) -> int:
        """Managed bytes the pool holds."""

    def peak_reserved_bytes(self) -> int:
        """The most managed bytes the pool has held at once."""

    def stop_planning(self, why: str, budget_bytes: int | None = None) -> None:
        """The pool's layouts place best-fit from now on (umrt stopped acting)."""

    def resume_planning(self) -> None:
        """The pool's layouts plan again (acting won over a step held back)."""

    def serve_unplanned(self, unplanned: bool) -> None:
        """Whether the pool's layouts serve the iteration starting now best-fit, plans kept."""


class ManagedOnly(Backend):
    """The backend as the live policy sees it: ranges outside umrt's managed
    allocations are dropped.

    Storages torch made before umrt was enabled (or pinned host buffers) show
    up in the live event stream; the backend would reject them, so they are
    skipped here instead of failing the training run.
    """

    def __init__(self, backend: Backend) -> None:
        self.inner = backend
        self.name, self.device = backend.name, backend.device
        self.muted = False  # drop every call (a replay of what a native schedule already did)
        self._swap: _ManagedSwap | None = None

    def _keep(self, ranges: Sequence[Range]) -> list[Range]:
        out = []
        for ptr, n in ranges:
            alloc = self.inner.allocation_of(ptr) if ptr else None
            if alloc is not None and ptr + n <= alloc[0] + alloc[1]:
                out.append((ptr, n))
        return out

    def malloc(self, nbytes: int) -> int:
        return self.inner.malloc(nbytes)

    def free(self, ptr: int) -> None:
        self.inner.free(ptr)

    def prefetch(self, ranges: Sequence[Range], device: int) -> None:
        if not self.muted:
            self.inner.prefetch(self._keep(ranges), device)

    def populate(self, ranges: Sequence[Range]) -> None:
        if not self.muted:
            self.inner.populate(self._keep(ranges))

    def discard(self, ranges: Sequence[Range]) -> None:
        if not self.muted:
            self.inner.discard(self._keep(ranges))

    def discard_and_prefetch(self, ranges: Sequence[Range], device: int) -> None:
        if not self.muted:
            self.inner.discard_and_prefetch(self._keep(ranges), device)

    def drop(self, ranges: Sequence[Range]) -> None:
        # In kernel order, as the interface's default: passed on (beside the kernels, on a
        # stream of the backend's own), the native steady state no longer armed on the H100's
        # served 8 GiB run (tests/test_native_steady.py); why is not known yet.
        if not self.muted:
            self.inner.discard(self._keep(ranges))

    def advise(self, ranges: Sequence[Range], advice: Advice, device: int) -> None:
        if not self.muted:
            self.inner.advise(self._keep(ranges), advice, device)

    def launch(self, reads: Sequence[Range], writes: Sequence[Range], flops: int = 0, nbytes: int = 0,
               precision: str = "") -> None:
        if not self.muted:
            self.inner.launch(self._keep(reads), self._keep(writes), flops, nbytes, precision)

    @property
    def swap(self) -> SwapPath:
        """The backend's swap path through this view (:class:`_ManagedSwap`): the live runtime
        plans copies through the copy engines where the backend has them."""
        if self._swap is None:
            self._swap = _ManagedSwap(self)
        return self._swap

    def synchronize(self) -> None:
        self.inner.synchronize()
        if self._swap is not None:
            self._swap.synchronized()

    def mem_info(self) -> tuple[int, int]:
        return self.inner.mem_info()


class _ManagedSwap(SwapPath):
    """The backend's swap path as the live runtime sees it (:attr:`ManagedOnly.swap`): ranges
    outside umrt's managed allocations are skipped, as by every call of the view, and a muted
    view sends nothing out but never strands what it sent out for real.

    Muted (a replay of a native window) an ``out`` is dropped: nothing was copied out natively (a
    schedule has no copy calls: a window that swaps is not repeated natively). ``back``, ``wait``
    and ``release`` may still concern ranges the view copied out for real before it was muted
    (the runtime restores or forgets them while it replays); dropping those would leave their
    data discarded on the GPU. So the view keeps two records: ``away``, what it passed on to
    ``out`` and has not passed on to ``back`` or ``release`` since, and ``coming``, what it
    passed on to ``back`` and has not passed on to ``wait`` since. Muted, a range is passed on
    whole if it overlaps the record its call reads (``away`` for ``back`` and ``release``,
    ``coming`` for ``wait``), else dropped. Passed on whole rather than cut to the overlap: the
    runtime brings a range back as it sent it out, and for bytes of it that are not away the
    backend's ``back`` is a prefetch to the GPU and its ``wait`` and ``release`` do nothing,
    never a loss. A record may outlive its range being away (the backend also brings back or
    releases swapped ranges inside its own prefetch, populate, discard and launch): the muted
    call it then passes on is such a harmless one. Not muted, every call is passed on."""

    def __init__(self, view: ManagedOnly) -> None:
        super().__init__(view)
        self._view = view
        self._inner = view.inner.swap
        self.away = RangeSet()
        self.coming = RangeSet()

    @property
    def pinned_copies(self) -> bool:  # type: ignore[override]
        return self._inner.pinned_copies

    def _passed(self, ranges: Sequence[Range], record: RangeSet) -> list[Range]:
        """``ranges`` inside managed allocations; muted, only those that overlap ``record``."""
        kept = self._view._keep(ranges)
        if self._view.muted:
            kept = [r for r in kept if record.overlaps(*r)]
        return kept

    def reserve(self, nbytes: int) -> None:
        # Passed on even muted: it moves no data and touches no managed memory (the pinned
        # staging, allocated once for the most a plan keeps away). A plan the runtime takes up
        # in a muted replay swaps for real once the replay ends: its staging must be there.
        self._inner.reserve(nbytes)

    def out(self, ranges: Sequence[Range]) -> None:
        if self._view.muted:
            return
        kept = self._view._keep(ranges)
        if kept:
            self._inner.out(kept)
            for p, n in kept:
                self.away.add(p, n)

    def back(self, ranges: Sequence[Range]) -> None:
        passed = self._passed(ranges, self.away)
        if passed:
            self._inner.back(passed)
            for p, n in passed:
                for q, m in self.away.take(p, n):
                    self.coming.add(q, m)

    def wait(self, ranges: Sequence[Range]) -> None:
        passed = self._passed(ranges, self.coming)
        if passed:
            self._inner.wait(passed)
            for p, n in passed:
                self.coming.remove(p, n)

    def release(self, ranges: Sequence[Range]) -> None:
        passed = self._passed(ranges, self.away)
        if passed:
            self._inner.release(passed)
            for p, n in passed:
                self.away.remove(p, n)
                self.coming.remove(p, n)

    def synchronized(self) -> None:
        """The backend was synchronized: every copy back is done, none is waited for."""
        self.coming.clear()


class LiveLayout(Layout):
    """The :class:`~umrt.memory.base.Layout` of a live program: torch already placed
    every storage (through umrt's pool); this layout only says where.

    ``locate(obj)`` gives a newborn object's address (a storage's data pointer,
    or the block the allocator just returned). With ``pool`` (umrt's
    :class:`~umrt.allocators.managed.ManagedPool`, objects from the allocator) it is a
    :class:`~umrt.memory.base.LearningLayout`: the driver's boundaries and layer
    events reach the pool's layouts, which plan from them.
    """

    def __init__(self, locate: Callable[[int], int], pool: LivePool | None, *, learn: bool) -> None:
        self.locate, self.pool, self.learn = locate, pool, learn
        self._where: dict[int, int] = {}

    def alloc(self, obj: int, nbytes: int, kind: Kind) -> int:
        ptr = self._where[obj] = self.locate(obj)
        return ptr

    def free(self, obj: int) -> None:
        self._where.pop(obj, None)

    def address(self, obj: int) -> int:
        return self._where.get(obj, 0)

    def footprint(self) -> int:
        return self.pool.reserved_bytes() if self.pool is not None else 0

    def peak_footprint_bytes(self) -> int | None:
        return self.pool.peak_reserved_bytes() if self.pool is not None else None

    def observe(self, event: Event) -> None:
        """An iteration boundary or a layer event, for the pool's layouts."""
        if self.learn:
            self.pool.observe(event)

    def observe_launch(self, exec_id: int) -> None:
        """Nothing: a live pool keys its plan by layers and boundaries (steady
        iterations run without launches)."""

    def stop_planning(self, why: str, budget_bytes: int | None = None) -> None:
        """The pool behind torch places best-fit from now on (a
        :class:`~umrt.memory.base.PlanningLayout`: the runtime says so when it stops
        acting in training steps); nothing without one."""
        if self.pool is not None:
            self.pool.stop_planning(why, budget_bytes)

    def resume_planning(self) -> None:
        """The pool behind torch plans again (the runtime held a training step back
        doing nothing, and acting won); nothing without one."""
        if self.pool is not None:
            self.pool.resume_planning()

    def serve_unplanned(self, unplanned: bool) -> None:
        """The pool behind torch serves the iteration starting now best-fit, its plan kept
        (a training step umrt learns, moving nothing); nothing without one."""
        if self.pool is not None:
            self.pool.serve_unplanned(unplanned)


_FACT_STEPS = 2  # optimizer steps whose facts the bridge hints to the pool (it plans after the first)


def profile_for(cfg: Config, backend: Backend) -> HardwareProfile | None:
    """The hardware profile the runtime plans with: ``UMRT_PROFILE``, else (auto)
    :func:`auto_profile_name`; None (the runtime's generic guesses) where the GPU
    cannot be read."""
    if cfg.profile:
        return load_profile(cfg.profile)
    try:
        import torch

        name = torch.cuda.get_device_name(cfg.device)
        total = backend.mem_info()[1]
    except Exception as exc:  # noqa: BLE001 - no CUDA device to read: plan without a profile
        log.info("umrt: no GPU to pick a hardware profile for (%s); set UMRT_PROFILE", exc)
        return None
    chosen, made_for_it = auto_profile_name(name, total)
    if not made_for_it:
        log.warning("umrt: no shipped hardware profile for %s; planning with %s. Run `umrt calibrate` "
                    "and set UMRT_PROFILE to its file for this GPU's own figures", name, chosen)
    return load_profile(chosen)


class LiveBridge:
    """A live program as a source of events for a :class:`~umrt.drive.Driver`.

    Two sources of objects:

    * **the allocator** (the live GPU case: ``device="cuda"`` and a pool with
      ``listeners``, umrt's :class:`~umrt.allocators.managed.ManagedPool`):
      each ``malloc`` is a new object, announced at once as
      ``Alloc(obj, nbytes, Kind.OTHER, launch=0)``, from inside the op that
      asked for it and so before its kernel is enqueued; each ``free`` is its
      ``Free``. The capture :class:`~umrt.capture.Recorder` adds layer events
      and launches, whose accesses are mapped from its storages to these
      objects by address (storages umrt did not allocate are dropped).
      Iteration boundaries are the bridge's own, so they fall at the same place
      whether ops are recorded or not: after the recorder's first one, the
      next alloc, layer event or launch after an optimizer step opens the next
      iteration (frees after the step still close the old one). The policy
      may set ``wants_launches = False`` to have the recorder's ops suspended
      (:meth:`~umrt.capture.Recorder.suspend_ops`) until it sets it True again.
      The driver feeds the pool's layouts (umrt's ``LifetimePool`` in its
      live feed) the same boundaries (opened from the pool's
      ``before_malloc`` hook when an allocation opens the iteration, so the
      block counts in it) and layer events; the bridge tells the pool and the
      policy what blocks hold (``hint_kind``): the recorder's kind for
      each storage it announces, and in the first two optimizer steps the
      optimizer's facts (its parameters, their gradients, its state).
    * **the recorder** (otherwise, e.g. CPU tensors in tests): every event as
      the recorder emits it, after its op ran; ops are never suspended, and
      umrt's runtime discards a freed range at the ``Free`` itself.

    A failure in any callback stops umrt's actions with one warning, never the
    training (and suspends the recorder's ops: nothing reads them);
    ``umrt.memory_stats()`` shows it (``acting``, ``stopped_reason``). With
    ``UMRT_STRICT`` (``config.strict``) the failure is raised as
    :class:`~umrt.errors.StoppedActing`, once, in the training program's
    thread at the next safe point: the end of the next ``optimizer.step()``
    (a post hook that runs after the recorder's own), else ``umrt.disable()``.
    Not where it happens: failures arrive inside torch's allocator callbacks
    (an exception out of malloc or free would leave a block the pool handed
    out with no owner, or unwind through torch's C++ free) and inside the
    recorder's dispatch and module hooks, which run in autograd's threads too
    (an exception there unwinds half-done bookkeeping in an arbitrary op). At
    the end of a step no umrt or allocator frame is on the stack and the
    step's work is complete. Events come from torch's autograd thread too:
    one lock orders their delivery to the policy.

    Args:
        session: the enabled session (backend, pool, budget, config).
        device: the device whose tensors are recorded.
        policy: a policy object to feed instead of the one ``session.config`` names.
        from_allocator: force the source of objects (None: as described above).

    Raises:
        ConfigError: ``from_allocator=True`` without umrt's ``ManagedPool``.
    """

    def __init__(self, session: LiveSession, device: str = "cuda", *, policy: Policy | None = None,
                 from_allocator: bool | None = None) -> None:
        cfg = session.config
        announces_blocks = isinstance(session.pool, LivePool)
        if from_allocator is None:
            from_allocator = device == "cuda" and announces_blocks
        elif from_allocator and not announces_blocks:
            raise ConfigError("objects from the allocator need a pool with listeners (umrt's ManagedPool); "
                              f"got {type(session.pool).__name__}")
        self.from_allocator: bool = from_allocator
        self.policy = policy if policy is not None else _live_policy(cfg, discard_on_free=not from_allocator)
        self.recorder = Recorder(listeners=(self.on_event,), device=device, steer=False, keep_events=False,
                                 on_error=self._recorder_failed)
        self.pool = session.pool
        self.failed: BaseException | None = None
        self.strict: bool = cfg.strict  # raise a failure at the next safe point (UMRT_STRICT)
        self._failure_raised = False
        self._strict_hook: Any = None
        self._lock = threading.RLock()  # re-entrant: a free can fire inside our own handling
        self._ids = itertools.count(1)  # allocator objects (pointers are reused, ids never)
        self._obj_at: dict[int, int] = {}  # block start -> the allocator object living there
        self._born: dict[int, int] = {}  # object -> block, until the layout takes it
        self._next_boundary: int | None = None  # None until the recorder's first boundary
        self._step_ended = False
        self._recorder_step_due = False  # a step ended: the recorder's next boundary is that step's
        self._recorder_resume_due = False  # the bridge opened training after an evaluation: the recorder's is that
        self._phase = "train"  # the running iteration's loop phase
        self.clock: IterationClock | None = None  # CUDA events at boundaries (the live policy's iteration times)
        self._step_hook: Any = None
        self._device = device
        self._facts_left = _FACT_STEPS if from_allocator else 0  # optimizer steps still read for hints
        self.backend = ManagedOnly(session.backend)
        self.layout = LiveLayout(self._born.pop if from_allocator else self.recorder.address,
                                 session.pool if announces_blocks else None, learn=from_allocator)
        profile = profile_for(cfg, session.backend)
        self.policy.attach(PolicyContext(self.backend, self.layout, session.budget_bytes, profile))
        self.driver = Driver(self.policy, self.layout, self.backend)
        # The native steady state (umrt.native.server.SteadyServer): told of every step; while
        # it serves, the bridge feeds nothing (recorder ops and module hooks off).
        self.steady: Any = session.steady if from_allocator else None
        self.native = False
        self._resume_layers = False

    @property
    def events(self) -> int:
        """Events delivered to the policy."""
        return self.driver.events

    # -- callbacks ------------------------------------------------------------

    def on_event(self, ev: Any) -> None:
        """The recorder's listener: one live event."""
        if self.failed is not None or self.native:
            return
        with self._lock:
            if self.failed is not None:
                return
            try:
                if self.from_allocator:
                    self._from_recorder(ev)
                    self._follow_wants()
                else:
                    self.driver.feed(ev)
                    if type(ev) is IterationBoundary and self.clock is not None:
                        self.clock.boundary(ev.index, self.policy.iteration_time)
            except Exception as exc:  # noqa: BLE001 - umrt stops acting, the training goes on
                self._fail(exc)

    def on_pool_event(self, what: str, ptr: int, nbytes: int) -> None:
        """The pool's listener (``("alloc"|"free", ptr, nbytes)``, from inside
        malloc/free): never raises into torch's allocator."""
        if self.failed is None:
            self._in_allocator(self._pool_event, what, ptr, nbytes)

    def _pool_event(self, what: str, ptr: int, nbytes: int) -> None:
        if what == "alloc":
            self._boundary_if_stepped()
            obj = next(self._ids)
            self._obj_at[ptr] = obj
            self._born[obj] = ptr
            self.driver.feed(Alloc(obj, nbytes, Kind.OTHER, 0))
        elif what == "free":
            obj = self._obj_at.pop(ptr, None)
            if obj is not None:  # else allocated before the bridge started
                self.driver.feed(Free(obj))
        self._follow_wants(in_op=True)

    def _in_allocator(self, fn: Any, *args: Any) -> None:
        """``fn(*args)`` under the bridge's lock, called from inside torch's allocator:
        a failure stops umrt's actions; nothing, not even a failing warning, reaches
        the allocator."""
        try:
            with self._lock:
                if self.failed is not None:
                    return
                try:
                    fn(*args)
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)
        except BaseException:  # noqa: BLE001
            pass

    def _on_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._step_ended = True  # the next alloc, layer event or launch opens an iteration
        self._recorder_step_due = True
        if self._facts_left > 0 and self.from_allocator and self.failed is None:
            self._facts_left -= 1
            with self._lock:
                try:
                    self._hint_optimizer(opt)
                except Exception as exc:  # noqa: BLE001 - umrt stops acting, the training goes on
                    self._fail(exc)
        if self._resume_layers:  # handed back from the native steady state: outside any forward now
            self._resume_layers = False
            self.recorder.emit_layers(True)
        if self.steady is not None:  # outside the bridge's lock: the server takes its own lock first
            self.steady.on_step()

    # -- the native steady state (umrt.native.server.SteadyBridge) ---------------------

    def can_go_native(self) -> bool:
        """Whether the policy acts without launches (ops suspended) and nothing failed."""
        return (self.failed is None and self.from_allocator and not self.policy.wants_launches
                and self.recorder.ops_suspended)

    def go_native(self) -> None:
        """The native schedule serves from now on (called at a step): feed nothing,
        record nothing (recorder ops and module hooks off)."""
        self.native = True
        self.recorder.suspend_ops()
        self.recorder.emit_layers(False)

    def leave_native(self) -> None:
        """Python serves again: events are fed again, module hooks from the next step."""
        self.native = False
        self._resume_layers = True
        with self._lock:
            if self.failed is None:
                self._follow_wants(in_op=True)

    def muted(self, on: bool) -> None:
        """Drop (``on``) or pass the policy's CUDA calls (a replay of a native window)."""
        self.backend.muted = on

    def replayed_step(self) -> None:
        """An optimizer step ended here in a replayed native cycle: the next allocation
        opens an iteration."""
        self._step_ended = True

    def stop(self, exc: BaseException) -> None:
        """Stop acting, as after any failure of umrt's (memory stays managed)."""
        with self._lock:
            self._fail(exc)

    def _before_malloc(self, nbytes: int) -> None:
        """The pool's ``before_malloc`` hook: an iteration a step ended opens before the
        block is placed, so the pool's layout counts the block in it. Never raises."""
        if (self._step_ended or self._phase == "eval") and self.failed is None:
            self._in_allocator(self._boundary_if_stepped)

    def _hint_optimizer(self, opt: Any) -> None:
        """The optimizer's facts as kind hints: persistent state (parameters, optimizer
        state made lazily in the first step) is kept out of the pool's plan."""
        import torch

        def hint(t: Any, kind: Kind) -> None:
            if isinstance(t, torch.Tensor) and t.device.type == self._device:
                for part in stored(t):  # a sparse gradient: its parts
                    self._hint(part.untyped_storage().data_ptr(), kind)

        for group in opt.param_groups:
            for p in group["params"]:
                hint(p, Kind.PARAMETER)
                hint(p.grad, Kind.GRADIENT)
        for state in opt.state.values():
            for v in state.values():
                hint(v, Kind.OPTIMIZER_STATE)

    def _recorder_failed(self, exc: BaseException) -> None:
        """The recorder's own bookkeeping failed (an op it cannot read, say): as any
        failure of umrt's, it stops umrt's actions, never the training."""
        with self._lock:
            if self.failed is None:
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Stop acting: the first failure is kept, said once and shown in
        ``umrt.memory_stats()``; later ones are dropped."""
        if self.failed is not None:
            return
        self.failed = exc
        reason = f"{type(exc).__name__}: {exc}"
        stats.runtime_stopped(reason)
        then = ("UMRT_STRICT: raising it at the next optimizer step" if self.strict
                else "memory stays managed, no longer prefetched")
        log.warning("umrt: runtime stopped acting after an error (%s); %s", reason, then)
        self.recorder.suspend_ops()  # nothing reads its launches any more: stop paying for them
        # What the runtime swapped out lives only in pinned memory: it comes back before any
        # later kernel, since no plan will bring it back now.
        try:
            self.policy.detach()
        except Exception as again:  # noqa: BLE001 - said, never raised into the training
            log.warning("umrt: could not copy back what was swapped out (%s: %s)", type(again).__name__, again)

    def raise_if_failed(self, *_hook_args: Any) -> None:
        """With ``strict``: raise the failure as :class:`~umrt.errors.StoppedActing`
        (once; the original error is its cause). Called at safe points only
        (an optimizer step's post hook, ``umrt.disable()``)."""
        exc = self.failed
        if exc is None or not self.strict or self._failure_raised:
            return
        self._failure_raised = True
        raise StoppedActing(f"umrt stopped acting: {type(exc).__name__}: {exc} (UMRT_STRICT is set; "
                            "unset it to train on with memory managed but not prefetched)") from exc

    # -- allocator-sourced objects ------------------------------------------------

    def _from_recorder(self, ev: Any) -> None:
        """A recorder event when objects come from the allocator: its own objects
        and boundaries give way to the allocator's and the bridge's."""
        t = type(ev)
        if t is Launch:  # (it opens no iteration: the recorder's boundary before it does, if any)
            self.driver.feed(self._translate(ev))
        elif t is LayerEnter or t is LayerExit:
            self._boundary_if_stepped()
            if self.steady is not None:  # kernels ran since the last pool event: a recorded window notes it
                self.steady.mark()
            self.driver.feed(ev)
        elif t is IterationBoundary:
            if self._next_boundary is None:  # the recorder's first: iterations start here
                self._next_boundary = ev.index + 1
                self._step_ended = False
                self._recorder_step_due = False
                self.driver.feed(ev)
                if self.clock is not None:
                    self.clock.boundary(ev.index, self.policy.iteration_time)
            elif self._recorder_step_due:  # the recorder's boundary for a step: the bridge opens its own
                self._recorder_step_due = False
                if self._step_ended:
                    self._boundary_if_stepped(ev.phase)
            elif self._recorder_resume_due and ev.phase == "train":  # training resumed: opened already
                self._recorder_resume_due = False
            else:  # an evaluation batch, or training again after one (the model's forward): open it now
                self._recorder_resume_due = False
                self._boundary_if_stepped(ev.phase)
        elif t is Alloc:
            # The allocator announced the object; the recorder knows better what it holds.
            if ev.kind is not Kind.OTHER:
                ptr = self.recorder.address(ev.obj)
                if ptr:
                    self._hint(ptr, ev.kind)
        # Free of the recorder's storages: the allocator announced it

    def _hint(self, ptr: int, kind: Kind) -> None:
        """What the block at ``ptr`` holds, for the pool's layout and the policy
        (umrt's runtime plans with kinds: optimizer state read by one launch is
        kept on the host)."""
        self.pool.hint_kind(ptr, kind)
        obj = self._obj_at.get(ptr)
        if obj is not None:
            self.policy.hint_kind(obj, kind)

    def _translate(self, ev: Launch) -> Launch:
        """The launch with each storage mapped to the allocator object at its address."""
        address, obj_at = self.recorder.address, self._obj_at
        accesses = []
        for a in ev.accesses:
            obj = obj_at.get(address(a.obj))
            if obj is not None:
                accesses.append(Access(obj, a.offset, a.length, a.write))
        return Launch(ev.seq, ev.exec_id, ev.op, tuple(accesses), ev.flops, ev.bytes, ev.module, ev.precision)

    def _boundary_if_stepped(self, phase: str | None = None) -> None:
        """Open the next iteration: of ``phase`` where given (the recorder's boundary
        for a step, or of a phase); else the one a step (or the end of an evaluation)
        left pending, if any. The iteration clock marks it on the GPU and hands the
        policy the times of iterations the GPU has passed (never waits)."""
        if self._next_boundary is None:
            return
        if phase is None:
            if self._step_ended:
                phase = self.recorder.loop.now()
            elif self._phase == "eval" and not self._recorder_resume_due and self.recorder.loop.resuming_training():
                self._recorder_resume_due = True  # the recorder emits its own after this op: that one is ours
                phase = "train"
            else:
                return
        self._step_ended = False
        self._phase = phase
        index, self._next_boundary = self._next_boundary, self._next_boundary + 1
        self.driver.feed(IterationBoundary(index, phase))
        if self.clock is not None:
            self.clock.boundary(index, self.policy.iteration_time)

    def _follow_wants(self, *, in_op: bool = False) -> None:
        """Suspend or resume the recorder's ops so that they follow the policy's
        ``wants_launches``; a suspension refused or undone by the recorder (not
        recording yet at its first boundary, a user's mode on top) is asked for
        again at the next event. ``in_op``: called from the allocator, inside the
        op that asked for memory: the recorder's mode is re-entered at its next
        hook, not in the middle of that op."""
        want = self.policy.wants_launches
        if want == self.recorder.ops_suspended:
            if want:
                self.recorder.resume_ops(at_once=not in_op)
            else:
                self.recorder.suspend_ops()

    # -- life ---------------------------------------------------------------------

    def start(self) -> None:
        """Start listening: the pool and optimizer hooks first, then the recorder
        (whose first iteration boundary opens the policy's first iteration)."""
        if self.steady is not None:
            self.steady.attach(self)
        if self.from_allocator:
            self._step_hook = register_step_end_hook(self._on_step)
            self.pool.listeners.append(self.on_pool_event)
            self.pool.before_malloc.append(self._before_malloc)
        if self.from_allocator and self.clock is None:
            self.clock = IterationClock.for_cuda()
        self.recorder.__enter__()
        stats.runtime_started()

        def phases() -> dict:  # memory_stats()'s "phases": whether the policy acts in each, and why not
            with self._lock:
                return dict((self.policy.report() or {}).get("phases") or {})

        stats.watch_phases(phases)
        if self.strict:  # after the recorder's: its step bookkeeping is done when this raises
            self._strict_hook = register_step_end_hook(self.raise_if_failed)
        if self.from_allocator:
            with self._lock:  # a policy may want no launches from the start
                if self.failed is None:
                    self._follow_wants()

    def close(self) -> None:
        """Stop listening; a completed last iteration is closed with its boundary."""
        if self.steady is not None:
            self.steady.close()  # the pool's books up to date, events fed again
        for hook in (self._step_hook, self._strict_hook):
            if hook is not None:
                hook.remove()
        self._step_hook = self._strict_hook = None
        if self.from_allocator:
            with contextlib.suppress(ValueError):
                self.pool.listeners.remove(self.on_pool_event)
            with contextlib.suppress(ValueError):
                self.pool.before_malloc.remove(self._before_malloc)
        self.recorder.__exit__(None, None, None)
        if self.from_allocator:
            with self._lock:
                if self.failed is None:
                    try:
                        self._boundary_if_stepped()
                    except Exception as exc:  # noqa: BLE001
                        self._fail(exc)
        stats.runtime_closed()


class IterationClock:
    """How long each iteration took on the GPU: an event recorded on the current
    stream at each iteration boundary, read once the GPU has passed the next one
    (``query()``, never a wait), so times arrive an iteration or two late.

    ``make_event``: a new CUDA event with timing (``torch.cuda.Event(enable_timing=True)``:
    ``record()``, ``query()``, ``elapsed_time(end)`` in milliseconds).
    """

    def __init__(self, make_event: Callable[[], Any], keep: int = 8) -> None:
        self._make_event = make_event
        self._marks: list[tuple[int, Any]] = []  # (iteration opened there, its event), oldest first
        self._keep = keep

    @classmethod
    def for_cuda(cls) -> IterationClock | None:
        """A clock on torch's CUDA events; None where there are none (no CUDA device)."""
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            return cls(lambda: torch.cuda.Event(enable_timing=True))
        except Exception as exc:  # noqa: BLE001 - no timing: the policy's payoff check waits for none
            log.info("umrt: no CUDA events to time iterations with (%s)", exc)
            return None

    def boundary(self, index: int, timed: Callable[[int, float], None]) -> None:
        """Iteration ``index`` opens now: ``timed(iteration, seconds)`` for each
        iteration the GPU has finished since the last call, oldest first."""
        event = self._make_event()
        event.record()
        self._marks.append((index, event))
        while len(self._marks) >= 2 and self._marks[1][1].query():
            (i, start), (_, end) = self._marks[0], self._marks[1]
            self._marks.pop(0)
            timed(i, start.elapsed_time(end) / 1e3)
        del self._marks[: max(0, len(self._marks) - self._keep)]  # a GPU far behind: the oldest go untimed


def set_budget(bridge: LiveBridge, budget_bytes: int) -> None:
    """``bridge``'s policy plans for ``budget_bytes`` from now on (the job's share of its GPU
    moved; called at an optimizer step's end). A native steady state hands back to Python
    first (its schedule's calls were planned for the old budget); the policy re-learns."""
    if bridge.native and bridge.steady is not None:
        bridge.steady.catch_up()  # takes the server's lock, then the bridge's: never under the bridge's
    with bridge._lock:
        if bridge.failed is None:
            try:
                bridge.policy.set_budget(budget_bytes)
                bridge._follow_wants()
            except Exception as exc:  # noqa: BLE001 - umrt stops acting, the training goes on
                bridge._fail(exc)


def _live_policy(cfg: Config, *, discard_on_free: bool) -> Policy:
    """The policy ``cfg`` names, with the live runtime's options for ``umrt``
    (``discard_on_free``: events come after their op ran, so a freed range is
    discarded at its ``Free`` rather than before the next allocation)."""
    options: dict[str, Any] = {}
    if cfg.policy == "umrt":
        options = {"learn_iterations": cfg.learn_iterations, "op_level": cfg.granularity == "op",
                   "use_pool": False}
        if discard_on_free:
            options["discard_on_free"] = True
    return make_policy(cfg.policy, **options)


