"""A live program's steady state, served natively; Python caught up when it ends.

:class:`SteadyServer` is the allocator umrt gives torch and CuPy (``malloc`` /
``free`` over umrt's :class:`~umrt.allocators.managed.ManagedPool`). While the
program is learned it only forwards to the pool. Then, at optimizer steps
(the live bridge calls :meth:`SteadyServer.on_step`):

1. **following**: once the policy acts without launches, it starts recording
   *windows* (one optimizer step to the next): the pool's allocations and frees,
   every CUDA call the backend makes between them
   (:class:`~umrt.native.recorder.SteadyRecorder`, and the backend's
   :class:`CallSource`), and the module boundaries (:meth:`SteadyServer.mark`:
   kernels ran there, so calls made after one replay at the next allocation or
   free, never before those kernels; a window that would carry such calls past the
   optimizer step's kernels does not compile).
2. **recording**: when a cycle of up to :data:`MAX_PERIOD` windows compiles
   (:func:`~umrt.native.schedule.compile_cycle`) to exactly the arrays of the
   cycle before it, that is the steady state: the blocks of the cycle still live
   become the schedule's (``adopt``), the schedule is armed on the pool's stream
   and installed in the native front (:mod:`umrt.native.front`), and the
   bridge stops feeding Python (recorder ops and module hooks off).
3. **native**: torch's allocations and frees are served by the schedule
   without entering Python; its CUDA calls are replayed from its table. At each
   step Python drops the step's events (counted natively: one call) and, at the
   end of a cycle, credits the backend's call counters and ``umrt.statistics()``.
4. A **deviation** (the schedule declines an allocation: size, hash, a block
   still live, a decision that would touch a block freed later than recorded, a
   failed call; or ``empty_cache()`` while it serves) hands back to Python, in the allocator callback
   that got the refusal or at the next step: the schedule gives up its live
   blocks (``disown``), the backend waits for the work the schedule queued and
   forgets its stream-ordering state (``settle``: one synchronization), and the
   cycle's events so far are replayed into the pool, the bridge and the policy
   (their CUDA calls muted: the schedule made them), so Python stands where it
   would have stood had it served the cycle itself, and re-learns as it does
   today; recording starts again :data:`REARM_AFTER` steps later. If Python's
   view disagrees with the blocks the schedule handed out (the pool placed a
   block elsewhere), or the replay fails, the pool retires its layout for the
   stream (it never hands that memory out again), adopts the schedule's
   blocks, and umrt stops acting: data is never put at risk.

One lock (the server's) is held around a Python-path allocation or free, arming
and handing back, so no allocation lands in the pool while a schedule is armed.
Without the native front (no compiler) the same schedule runs in Python, inside
the allocator callbacks (:class:`~umrt.native.twin.PythonSteadySchedule`).
"""
from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from umrt import stats
from umrt.allocators.managed import ManagedPool
from umrt.backends.cuda import CudaBackend
from umrt.native.binding import cudart_table, load_steady
from umrt.native.constants import EV_ALLOC, EV_BOUNDARY, EV_FREE, DecisionKind
from umrt.native.recorder import CallAt, RecordingApi, SteadyRecorder
from umrt.native.schedule import ScheduleArrays, SteadyError, compile_cycle, lives_across
from umrt.native.tables import ApiTable, loaded_libcudart

__all__ = ["SteadyServer", "Phase", "CallSource", "BackendCalls", "SteadyBridge", "SteadyReport"]

log = logging.getLogger("umrt")

MAX_PERIOD = 4  # windows a repeating cycle may span (CudaBackend's spare events can alternate)
MAX_TRIES = 2 * MAX_PERIOD + 2  # windows recorded without a repeat before recording pauses
RETRY_AFTER = 16  # steps to wait before recording again after MAX_TRIES windows without a repeat
REARM_AFTER = 2  # steps to wait after a hand-back before recording again
SHORT_LIVED = 4  # native steps: a schedule handed back sooner did not last
MAX_SHORT_LIVED = 4  # schedules in a row that did not last, after which it is not tried again


class Phase(enum.Enum):
    """Where the steady state is served."""

    OFF = "off"  # never native (disabled, no policy to follow, or schedules that kept deviating at once)
    FOLLOWING = "following"  # Python serves; waiting for a policy acting without launches
    RECORDING = "recording"  # Python serves; windows recorded and compared
    NATIVE = "native"  # the schedule serves


@runtime_checkable
class CallSource(Protocol):
    """The backend's CUDA calls as a steady schedule records and replays them."""

    def record(self, log: list | None) -> None:
        """Append each CUDA call made from now on to ``log`` (a ``CallAt``, or an
        entry ``compile_schedule`` rejects for a call a schedule cannot repeat);
        ``None`` stops."""

    def attach(self, schedule: Any) -> bool:
        """Give ``schedule`` the table its decisions run through; True when its calls
        never enter Python (a table of C functions)."""

    def count(self, calls: Counter, windows: int) -> None:
        """Add ``windows`` windows' worth of ``calls`` (CUDA name -> count) to the
        backend's call counters (calls the schedule made for it)."""

    def settle(self) -> None:
        """Wait for the work the schedule queued and drop the backend's ordering state
        (its events now stand for other work): Python's calls start from a clean slate."""


CUDA_NAMES = {  # a decision kind -> the CUDA call it is (CudaBackend's counter names)
    DecisionKind.PREFETCH: "cudaMemPrefetchAsync",
    DecisionKind.POPULATE: "cudaMemPrefetchAsync",
    DecisionKind.DISCARD: "cudaMemDiscardBatchAsync",
    DecisionKind.DISCARD_PREFETCH: "cudaMemDiscardAndPrefetchBatchAsync",
    DecisionKind.ADVISE: "cudaMemAdvise",
    DecisionKind.RECORD_EVENT: "cudaEventRecord",
    DecisionKind.WAIT_EVENT: "cudaStreamWaitEvent",
}


class BackendCalls:
    """The :class:`CallSource` of a :class:`umrt.backends.cuda.CudaBackend`: its runtime
    adapter is wrapped in a :class:`~umrt.native.recorder.RecordingApi` while a window
    is recorded, so the schedule replays exactly the calls (streams, events) the backend
    made. A native schedule on this process's CUDA runtime gets the C table over the
    libcudart the process loaded (torch's), so its decisions never take the GIL; where
    none is loaded, or the backend's runtime is a stand-in (the fake runtime in tests),
    a table of Python callbacks over the backend's adapter."""

    def __init__(self, backend: CudaBackend, *, c_table: Callable[[], Any] | None = None) -> None:
        self.backend = backend
        self.api = backend.api
        self.c_table = c_table  # a native schedule's table instead of libcudart's (benches: counting_table)
        self.table_kind = ""  # "libcudart", "given" or "python" once a schedule was given a table

    def record(self, log: list | None) -> None:
        api = self.api if log is None else RecordingApi(self.api, log)
        self.backend.api = self.backend.order.api = api

    def attach(self, schedule: Any) -> bool:
        if schedule.native and self.c_table is not None:
            schedule.set_c_table(self.c_table())
            self.table_kind = "given"
            return True
        if schedule.native and self.api.process_runtime:  # (a stand-in runtime gets its own calls)
            path, reason = loaded_libcudart()
            if path is not None:
                schedule.set_c_table(cudart_table(path))
                self.table_kind = "libcudart"
                return True
            log.info("umrt: the native schedule's CUDA calls go through Python: %s", reason)
        schedule.set_table(ApiTable(self.api))
        self.table_kind = "python"
        return False

    def count(self, calls: Counter, windows: int) -> None:
        counts = self.backend.calls
        for name, n in calls.items():
            counts[name] += n * windows

    def settle(self) -> None:
        self.backend.synchronize()


@runtime_checkable
class SteadyBridge(Protocol):
    """What the server needs of the live bridge (:class:`umrt.drive.live.LiveBridge`)."""

    def can_go_native(self) -> bool:
        """Whether the policy acts without launches and nothing failed."""

    def go_native(self) -> None:
        """Stop feeding Python: recorder ops and module hooks off (called at a step)."""

    def leave_native(self) -> None:
        """Feed Python again (module hooks from the next step)."""

    def muted(self, on: bool) -> None:
        """Drop (``True``) or pass the policy's CUDA calls: a replay must not repeat them."""

    def replayed_step(self) -> None:
        """An optimizer step ended at this point of a replayed cycle (the next
        allocation opens an iteration, as after a live step)."""

    def stop(self, exc: BaseException) -> None:
        """Stop acting (the failure path: memory stays managed)."""


@dataclass
class SteadyReport:
    """What the native steady state did (``umrt.memory_stats()["native_steady"]``)."""

    phase: str
    native_front: bool
    windows_recorded: int = 0
    arms: int = 0
    steps_native: int = 0
    events_drained: int = 0
    catch_ups: int = 0
    layouts_retired: int = 0
    last_deviation: str = ""
    schedule_allocations: int = 0
    schedule_calls: int = 0


class SteadyServer:
    """umrt's allocator for torch and CuPy: the pool, plus a native steady state.

    Args:
        pool: umrt's managed pool.
        front: the native front (:func:`umrt.native.front.load_front`); ``None``
            serves the steady state from the Python schedule.
        calls: the backend's CUDA calls (:class:`CallSource`); ``None``: the
            native steady state is never tried (nothing could replay decisions).
        device: the CUDA device allocations are made on.
        enabled: ``True`` (``UMRT_NATIVE=1``) tries the native steady state; ``False``
            (the default: opt-in until a GPU run has checked it) forwards everything to the pool.
    """

    def __init__(self, pool: ManagedPool, *, front: Any = None, calls: CallSource | None = None,
                 device: int = 0, enabled: bool = False) -> None:
        self.pool, self.front, self.calls, self.device = pool, front, calls, device
        self.bridge: SteadyBridge | None = None
        self.phase = Phase.FOLLOWING if enabled and calls is not None else Phase.OFF
        self.schedule: Any = None
        self.report = SteadyReport(self.phase.value, front is not None)
        self._recorder = SteadyRecorder()
        self._windows: list[list[Any]] = []  # recorded windows, oldest first
        self._tries = 0
        self._wait = 0  # steps before recording may start again
        self._stream: Any = 0
        self._tracked: set[int] = set()  # blocks the schedule owned since it was armed
        self._in_front = False  # the schedule is installed in the native front (else served here)
        self._window_calls: Counter = Counter()  # CUDA calls per cycle, credited to the backend
        self._period, self._credited, self._steps_armed = 1, 0, 0
        self._cycle_allocations = (0, 0)
        self._short_lived = 0  # schedules in a row handed back within SHORT_LIVED steps
        # Held to decide and act: around a Python-path allocation or free, arming and
        # handing back. Taken before the pool's and the bridge's locks, never inside them
        # (the bridge calls on_step outside its own lock).
        self._lock = threading.RLock()

    # -- the allocator torch and CuPy call -------------------------------------------

    def malloc(self, nbytes: int, stream: Any = 0) -> int:
        """A block for ``nbytes``: from the schedule while it serves and is not in the front,
        else the pool (after catching Python up, if the schedule just declined). Under the
        server's lock, so a schedule is never armed between the check and the pool's placing
        a block."""
        with self._lock:
            if self.phase is Phase.NATIVE:
                schedule = self.schedule
                if not self._in_front:
                    ptr = schedule.malloc(nbytes, self.device, stream or 0)
                    if ptr:
                        return ptr
                self.catch_up()
            return self.pool.malloc(nbytes, stream)

    def free(self, ptr: int) -> None:
        """Return a block: the schedule's if it handed it out (and is not in the front),
        else the pool's."""
        with self._lock:
            schedule = self.schedule
            if schedule is not None and not self._in_front and schedule.free(ptr, 0, self.device, self._stream):
                return
            self.pool.free(ptr)

    def mark(self, what: str = "module") -> None:
        """The program's kernels may have run since the last allocation or free (a module
        boundary, where the policy acts): while a window is recorded, calls made from here
        on replay at the next allocation or free, after those kernels
        (:class:`~umrt.native.recorder.Mark`)."""
        if self.phase is Phase.RECORDING:
            self._recorder.mark(what)

    def record_stream(self, ptr: int, stream: Any) -> None:
        """torch's ``Tensor.record_stream``: the block at ``ptr`` is used on ``stream`` too.
        A block the schedule serves makes it deviate (it orders nothing across streams;
        the front told the native one already): Python hands back first. Then the pool
        orders the block's next use and discard after that stream's work."""
        with self._lock:
            if self.phase is Phase.NATIVE:
                schedule = self.schedule
                if not self._in_front:
                    schedule.record_stream(ptr, stream or 0)
                if not schedule.armed:
                    self.catch_up()
            self.pool.record_stream(ptr, stream)

    def empty_cache(self) -> None:
        """The pool's cached, unused memory back (``torch.cuda.empty_cache()``). While a
        schedule serves, Python hands back first: the pool's view is the one at arming, and
        segments that look empty to it may hold blocks the schedule serves (or will serve
        later in the step); once caught up, the pool frees only what is really unused."""
        with self._lock:
            if self.phase is Phase.NATIVE:
                self.catch_up("empty_cache() while the native schedule served: handed back first")
            self.pool.empty_cache()

    def reserved_bytes(self) -> int:
        """Managed bytes the pool holds."""
        return self.pool.reserved_bytes()

    # -- driven by the live bridge -------------------------------------------------

    def attach(self, bridge: SteadyBridge) -> None:
        """Follow ``bridge``'s policy (the live bridge calls :meth:`on_step` at each step)."""
        self.bridge = bridge

    def on_step(self) -> None:
        """An optimizer step ended (the end of a window). Never raises: a failure
        stops the native steady state for good, with one warning."""
        if self.phase is Phase.OFF or self.bridge is None:
            return
        try:
            self._step()
        except Exception as exc:  # noqa: BLE001 - the training goes on
            log.warning("umrt: the native steady state stopped after an error (%s: %s); Python serves "
                        "every allocation from now on", type(exc).__name__, exc)
            self.report.last_deviation = f"stopped: {type(exc).__name__}: {exc}"
            self._stop_recording()
            if self.phase is Phase.NATIVE:
                self.catch_up()
            self._set_phase(Phase.OFF)

    def close(self) -> None:
        """Hand back to Python (the session ends): the pool's books are brought up to date."""
        if self.phase is Phase.NATIVE:
            self.catch_up()
        self._stop_recording()
        self._set_phase(Phase.OFF)

    def _step(self) -> None:
        if self.phase is Phase.NATIVE:
            self._drain()
            if not self.schedule.armed:
                self.catch_up()
            return
        if self.phase is Phase.FOLLOWING:
            if self._wait > 0:
                self._wait -= 1
            elif self.bridge.can_go_native():
                self._start_recording()
            return
        # RECORDING: a window just ended.
        self._windows.append(self._recorder.take())
        del self._windows[:-2 * MAX_PERIOD]
        self.report.windows_recorded += 1
        cycle = self._repeating() if self.bridge.can_go_native() else None
        if cycle is not None:
            self._stop_recording()
            self._arm(*cycle)
            return
        self._tries += 1
        if self._tries >= MAX_TRIES or not self.bridge.can_go_native():
            self._stop_recording()
            self._wait = RETRY_AFTER
            self._set_phase(Phase.FOLLOWING)

    def _repeating(self) -> tuple[list[Any], ScheduleArrays] | None:
        """The shortest cycle of recorded windows that repeats exactly (allocations,
        addresses, CUDA calls), compiled; None if none does yet."""
        w = self._windows
        for period in range(1, MAX_PERIOD + 1):
            if 2 * period > len(w):
                return None
            try:
                last, before = compile_cycle(w[-period:]), compile_cycle(w[-2 * period:-period])
            except SteadyError as exc:
                log.debug("umrt: no %d-window cycle: %s", period, exc)
                continue
            if last == before:
                return [e for window in w[-period:] for e in window], last
        return None

    # -- recording and arming ------------------------------------------------------

    def _start_recording(self) -> None:
        self._recorder.take()
        self._windows, self._tries = [], 0
        self.pool.listeners.insert(0, self._recorder.on_pool_event)  # before the bridge's
        self.calls.record(self._recorder.log)
        self._set_phase(Phase.RECORDING)

    def _stop_recording(self) -> None:
        if self._recorder.on_pool_event in self.pool.listeners:
            self.pool.listeners.remove(self._recorder.on_pool_event)
            self.calls.record(None)
        self._recorder.take()

    def _arm(self, window: Sequence[Any], arrays: ScheduleArrays) -> None:
        """Serve ``arrays`` (compiled from ``window``, one cycle of windows) from the next step.
        Under the server's lock: no other thread's allocation lands in the pool meanwhile."""
        with self._lock:
            self._arm_locked(window, arrays)

    def _arm_locked(self, window: Sequence[Any], arrays: ScheduleArrays) -> None:
        survivors = sorted(lives_across(window).items())  # (address, allocation ordinal)
        live = self.pool.live_blocks()
        if any(live.get(ptr) != arrays.sizes[ordinal] for ptr, ordinal in survivors):
            raise SteadyError("a block the window left live is not live in the pool at its size")
        schedule = load_steady(arrays, native=self.front is not None)
        without_python = self.calls.attach(schedule)
        missing = schedule.missing_calls()
        if missing:  # it would disarm at its first such decision, every time it is armed
            raise SteadyError(f"the CUDA calls the schedule replays include {', '.join(missing)}, which the "
                              f"runtime it would call lacks (torch built for CUDA 12 with umrt's calls on CUDA 13?)")
        schedule.adopt(survivors)
        self._stream = self.pool.stream
        schedule.arm(self.device, self._stream or 0)
        self._tracked = {ptr for ptr, _ in survivors}
        self._window_calls = Counter(CUDA_NAMES[e.kind] for e in window if isinstance(e, CallAt))
        self._period = max(1, len(arrays.iteration_starts))  # windows per cycle
        self._credited = self._steps_armed = 0
        self._cycle_allocations = (len(arrays.sizes), sum(arrays.sizes))  # for umrt.statistics() totals
        self.schedule = schedule
        self.bridge.go_native()
        # Into the front (torch's threads call it, the GIL held or not) only when no Python
        # can run under the schedule's lock: a decision's Python callback would wait for the
        # GIL held by a thread waiting for that lock. Otherwise the server serves it from
        # its Python callbacks (ctypes drops the GIL before taking the lock).
        self._in_front = schedule.native and (without_python or not arrays.dec_kind)
        if self._in_front:
            self.front.install(schedule)
        self.report.arms += 1
        self.report.schedule_allocations = len(arrays.sizes)
        self.report.schedule_calls = len(arrays.dec_kind)
        self._set_phase(Phase.NATIVE)
        log.info("umrt: steady state: %d allocations per step served %s", len(arrays.sizes),
                 "natively" if self._in_front else "by the schedule, from umrt's callbacks")

    def _drain(self) -> None:
        """A native step's one piece of Python: at the end of a cycle drop its events
        (counted natively), credit the backend with the CUDA calls the schedule made for it."""
        self.report.steps_native += 1
        self._steps_armed += 1  # a window ended
        if self._steps_armed % self._period == 0:  # a cycle ended: a hand-back replays from here
            self.report.events_drained += self.schedule.clear_events()
        cycles = self._steps_armed // self._period
        if cycles > self._credited:
            if self._window_calls:
                self.calls.count(self._window_calls, cycles - self._credited)
            n, nbytes = self._cycle_allocations
            stats.record_served(n * (cycles - self._credited), nbytes * (cycles - self._credited))
        self._credited = cycles

    # -- handing back ----------------------------------------------------------------

    def catch_up(self, why: str = "") -> None:
        """Hand the steady state back to Python (see the module docstring, 4.); ``why``:
        the reason reported when the schedule itself did not deviate. Never raises: a
        replay that fails is handled as a view that is off (:meth:`_quarantine`)."""
        with self._lock:
            if self.phase is not Phase.NATIVE:
                return  # another thread did it
            schedule = self.schedule
            was_armed = schedule.armed
            blocks = schedule.disown()
            if self._in_front:
                self.front.install(None)
            self._in_front = False
            events = schedule.drain()
            self.schedule = None
            self.report.catch_ups += 1
            self.report.last_deviation = (why or schedule.deviation()[2]) if was_armed else schedule.deviation()[2]
            self.report.events_drained += len(events)
            self._short_lived = self._short_lived + 1 if self._steps_armed < SHORT_LIVED else 0
            self._set_phase(Phase.FOLLOWING if self._short_lived < MAX_SHORT_LIVED else Phase.OFF)
            self._wait = REARM_AFTER
            log.info("umrt: steady state handed back to Python: %s", self.report.last_deviation)
            native_live = {ptr: size for ptr, size, _ in blocks}
            try:
                self.calls.settle()  # the replay below is muted: the backend's ordering state must not lie
                self.bridge.leave_native()
                self._replay(events, native_live)
            except Exception as exc:  # noqa: BLE001 - a hand-back never fails the allocation that asked
                self.bridge.muted(False)
                self._quarantine(native_live, [f"the replay failed: {type(exc).__name__}: {exc}"])

    def _replay(self, events: Sequence[tuple[int, int, int, int]], native_live: dict[int, int]) -> None:
        """The window's events so far, into the pool, the bridge and the policy."""
        pool, tracked, wrong = self.pool, self._tracked, []
        self.bridge.muted(True)
        try:
            for kind, _, ptr, size in events:
                if kind == EV_BOUNDARY:
                    self.bridge.replayed_step()
                elif kind == EV_ALLOC:
                    got = pool.malloc(size, self._stream)
                    tracked.add(got)
                    if got != ptr:
                        wrong.append(f"allocation of {size} bytes: Python placed it at {got:#x}, "
                                     f"the schedule at {ptr:#x}")
                elif kind == EV_FREE and ptr in tracked:
                    tracked.discard(ptr)
                    pool.free(ptr)
            live = pool.live_blocks()
            phantoms = [ptr for ptr in sorted(tracked - native_live.keys()) if ptr in live]
            for ptr in phantoms:  # freed by the schedule, live in Python: only if Python was off
                wrong.append(f"block {ptr:#x} is live in Python, freed natively")
            for ptr, size in native_live.items():
                if live.get(ptr) != size:
                    wrong.append(f"block {ptr:#x} ({size} bytes) is live natively, not in Python")
        finally:
            self.bridge.muted(False)
            self._tracked = set()
        if wrong:
            self._quarantine(native_live, wrong, phantoms)

    def _quarantine(self, native_live: dict[int, int], wrong: list[str], phantoms: Sequence[int] = ()) -> None:
        """Python's view of the pool is off: its layout never places a block again, the
        schedule's blocks are the pool's, blocks the program freed natively that Python
        still counts live (``phantoms``) are freed (into the retired layout), and umrt
        stops acting."""
        pool = self.pool
        pool.retire_layout(self._stream)
        self.report.layouts_retired += 1
        self.bridge.muted(True)  # these frees are books only: no call of the policy's may touch the memory
        try:
            for ptr in phantoms:
                pool.free(ptr)
            live = pool.live_blocks()
            for ptr, size in native_live.items():
                if live.get(ptr) != size:
                    if ptr in live:  # Python holds a block of another size there: into the retired layout
                        pool.free(ptr)
                    pool.adopt(ptr, size)
        finally:
            self.bridge.muted(False)
        self._set_phase(Phase.OFF)
        self.bridge.stop(SteadyError("after the native steady state, Python's view of the pool did not "
                                     f"match the schedule's ({len(wrong)} differences; first: {wrong[0]}); "
                                     "the pool's layout was retired, no data is at risk"))

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self.report.phase = phase.value
