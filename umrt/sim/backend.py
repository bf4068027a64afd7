"""``SimBackend``: a GPU with CUDA Unified Memory, simulated.

It implements :class:`umrt.backends.base.Backend`, so a policy or the umrt
runtime drives it exactly as it drives the real ``cuda`` backend, and it
keeps simulated time on its engines: one compute stream, the link per
direction with the driver's one migration path, a copy engine per direction
for the swap path's ``cudaMemcpyAsync`` (:attr:`SimBackend.swap`, :class:`SimSwap`,
out and back: they run beside each other and beside compute,
sharing the link with migrations), and the streams discards run on beside
the kernels (umrt/sim/MODEL.md, "The swap path").

Time model, chosen to be fair to every policy:

* A launch starts when the previous one ended and every prefetch it needs
  has landed (that wait is *transfer wait*, not a fault); its non-resident
  pages fault (*fault stall*); then it computes for the roofline time
  ``max(flops/(peak*eff), bytes/(hbm*eff), launch floor)``, or longer when it
  accesses host memory over the link (AccessedBy / PreferredLocation=host):
  remote reads and writes are link traffic in the H2D / D2H direction at the
  link rate, sharing it with the copies queued in that direction like a
  fault-path copy (below), so they delay those copies and are slowed by them.
* The CPU is taken to be synchronised with the GPU: policy calls issued
  between launch i-1 and launch i start no earlier than the GPU time at which
  launch i would begin. Each call costs CPU time by kind, as measured
  (``prefetch_call_overhead_s`` per prefetch or discard call,
  ``batch_range_s`` per range of a batched prefetch, ``advise_call_s`` per
  advised range, a discard's own work per range and byte); launch i starts
  after the calls issued before it (*overhead*).
* ``cudaMallocManaged``/``cudaFree`` cost no time.
* Prefetches in both directions go through one migration path, one at a
  time in issue order (h100-measured.md: 2 GiB each way at once took as long
  as both one after the other); each range that moves pays a set-up, then its
  bytes over the direction's rate (``umrt/sim/MODEL.md``).
* Fault migrations do not queue behind pending prefetches: the driver's
  fault-servicing copies run on their own channels and share the link with
  them (time-sliced copy engines), at half rate while both run; total link
  work is conserved (the prefetch queue ends that much later, and every
  queued copy still running arrives later by the link time the fault copy
  took from it). Eviction copy-back in the fault path
  is synchronous, as in the driver (uvm_pmm_gpu.c evicts before allocating).
* A prefetch to the GPU that needs room first waits for the policy's own
  pending prefetches to host to finish (their memory is not free before);
  only if that is not enough does the driver evict (LRU by migration).

Data integrity is tracked per byte, apart from the page state: every byte
is *defined* once written (by a launch or :meth:`SimBackend.mark_host_written`)
and undefined again when discarded, freed or marked dead. A launch that
reads an undefined byte raises :class:`~umrt.errors.DataIntegrityError`.

The backend keeps simulated time and the policy's calls; three collaborators
keep the rest: :class:`~umrt.sim.engine_state.EngineState` (the per-page
state and every call into the numba engine), :class:`~umrt.sim.address_space.AddressSpace`
(allocations, page spans) and :class:`~umrt.sim.address_space.DefinedBytes`
(which bytes hold data).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from umrt.backends.base import HOST, SWAP_COPY_DEFAULT, Advice, Backend, Range, SwapPath
from umrt.backends.ranges import RangeSet
from umrt.config import checked_swap_copy, swap_copy_in_env
from umrt.errors import ConfigError
from umrt.hardware import HardwareProfile, load_profile
from umrt.sim import engine as E
from umrt.sim.address_space import AddressSpace, DefinedBytes
from umrt.sim.engine_state import VA_BASE, EngineCount, EngineState

__all__ = ["SimBackend", "VA_BASE"]

_UNLIMITED_PAGES = 1 << 50


class SimBackend(Backend):
    """The simulated GPU. ``capacity_bytes`` is the GPU memory budget
    (``None``: the profile's memory; ``math.inf``: a GPU with enough memory, whose
    allocations are device memory: backed on the GPU at allocation, never faulted in).
    ``swap_copy``: what copies swapped ranges (:data:`umrt.backends.base.SWAP_COPIES`; None:
    as ``UMRT_SWAP_COPY`` says, SM copies by default)."""

    name = "sim"
    device = 0

    # Counters the engine keeps, read as attributes.
    resident_bytes = EngineCount(E.G_RES, unit=E.PAGE, doc="Bytes on the GPU (landed or in flight).")
    faults = EngineCount(E.G_FAULTS, doc="64 KB pages faulted.")
    fault_batches = EngineCount(E.G_BATCHES, doc="Fault batches serviced.")
    refaults = EngineCount(E.G_REFAULTS, doc="Pages a launch had on the GPU, lost to its own fault servicing, "
                                             "and faulted again (thrashing).")
    evictions = EngineCount(E.G_EVICTIONS, doc="2 MB blocks evicted.")
    h2d_bytes = EngineCount(E.G_H2D, E.G_REMOTE_R, E.G_COPY_H2D,
                            doc="Bytes moved host-to-device: migrations, remote reads and copies (swap.back).")
    d2h_bytes = EngineCount(E.G_D2H, E.G_REMOTE_W, E.G_COPY_D2H,
                            doc="Bytes moved device-to-host: migrations, remote writes and copies (swap.out).")
    peak_resident_bytes = EngineCount(E.G_PEAK, unit=E.PAGE, doc="Most bytes on the GPU since :meth:`reset_peak`.")
    page_events = EngineCount(E.G_EVENTS, doc="Pages visited by launches, migrations and evictions (simulator work).")
    swapped_out_bytes = EngineCount(E.G_COPY_D2H, doc="Bytes the swap path copied out to pinned memory (swap.out).")
    swapped_in_bytes = EngineCount(E.G_COPY_H2D, doc="Bytes the swap path copied back from pinned memory (swap.back).")

    def __init__(self, profile: HardwareProfile | str, capacity_bytes: int | float | None = None,
                 swap_copy: str | None = None) -> None:
        self.profile = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
        if capacity_bytes is None:
            capacity_bytes = self.profile.gpu_memory_bytes
        self._unlimited = capacity_bytes == math.inf
        if self._unlimited:
            cap_pages = _UNLIMITED_PAGES
        else:
            if capacity_bytes < E.BLOCK:
                raise ConfigError(f"GPU memory budget {capacity_bytes} bytes is below one 2 MB block")
            cap_pages = int(capacity_bytes) // E.PAGE
        self.capacity_bytes = cap_pages * E.PAGE
        self.engine = EngineState(self.profile, cap_pages)
        self.space = AddressSpace()
        self.contents = DefinedBytes(self.space)
        # time (seconds of simulated GPU time) and its breakdown
        self._t_compute = 0.0
        self._t_action = 0.0
        self._time = {"compute_s": 0.0, "fault_stall_s": 0.0, "transfer_wait_s": 0.0, "overhead_s": 0.0,
                      "remote_access_s": 0.0}
        self.launches = 0
        self.calls = 0  # prefetch/discard/advise/copy calls
        # the swap path: SM copies or the copy engines (None: as UMRT_SWAP_COPY says)
        self._swap = SimSwap(self, swap_copy_in_env() if swap_copy is None else checked_swap_copy(swap_copy))

    # ------------------------------------------------------------ Backend API

    def malloc(self, nbytes: int) -> int:
        """Managed allocation, 2 MB aligned (its pages start unpopulated; with unlimited
        capacity, device memory: populated on the GPU)."""
        if nbytes <= 0:
            raise ValueError(f"malloc of {nbytes} bytes")
        ptr = self.space.allocate(nbytes)
        engine = self.engine
        if self.space.top > engine.nblocks:
            engine.grow(max(self.space.top, 2 * engine.nblocks))
        engine.map_pages((ptr - VA_BASE) // E.PAGE, -(-nbytes // E.PAGE))
        if self._unlimited:
            engine.back_on_gpu((ptr - VA_BASE) // E.PAGE, -(-nbytes // E.PAGE))
        return ptr

    def free(self, ptr: int) -> None:
        """cudaFree: the pages are dropped without copy-back; content is gone."""
        first, nb = self.space.release(ptr)
        self.engine.release(first, first + nb)
        self.contents.forget([(ptr, nb * E.BLOCK)])
        self._swap.staged.remove(ptr, nb * E.BLOCK)

    def prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """Migrate to the GPU (``device == 0``) or host on the prefetch path.

        As the ``cuda`` backend issues it: ranges that touch within one
        allocation are merged, and each merged range is one
        ``cudaMemPrefetchAsync`` (``prefetch_call_overhead_s`` of CPU time),
        starting to migrate once issued (the batched call costs 55 us per
        range on the H100 even when nothing moves, so the backend does not
        use it: :meth:`prefetch_batch` models it). An empty call costs nothing.
        """
        if not ranges:
            return
        if device not in (HOST, self.device):
            raise ValueError(f"prefetch to device {device}: the simulator has GPU 0 and HOST (-1)")
        if device != HOST and self._swap.staged and any(self._swap.staged.overlaps(p, n) for p, n in ranges):
            self._swap.back(ranges)  # what was swapped out comes back by its copy, never by a bare prefetch
            return
        merged = self.space.coalesce(ranges)
        call = self.profile.prefetch_call_overhead_s
        k = len(merged)
        t0 = self._issue(k * call)
        self.calls += k - 1  # k single calls
        issue = t0 - (k - 1 - np.arange(k)) * call  # call r ends (r + 1) calls into the run
        lo, hi = self.space.page_spans(merged, inward=False)
        self.engine.prefetch(lo, hi, device, issue, 0.0)

    def prefetch_batch(self, ranges: Sequence[Range], device: int) -> None:
        """One ``cudaMemPrefetchBatchAsync`` (what ``umrt calibrate`` measures):
        ``prefetch_call_overhead_s`` plus ``batch_range_s`` of CPU time per range,
        each range starting to migrate once issued (and, to the host,
        ``batch_d2h_range_s`` more of migration each). An empty call costs nothing.
        """
        if not ranges:
            return
        if device not in (HOST, self.device):
            raise ValueError(f"prefetch to device {device}: the simulator has GPU 0 and HOST (-1)")
        p = self.profile
        k = len(ranges)
        per_range = p.batch_range_s if k > 1 else 0.0
        t0 = self._issue(p.prefetch_call_overhead_s + k * per_range)
        issue = t0 - (k - 1 - np.arange(k)) * per_range  # range r is issued (r + 1) ranges into the call
        lo, hi = self.space.page_spans(ranges, inward=False)
        self.engine.prefetch(lo, hi, device, issue, p.batch_d2h_range_s if k > 1 else 0.0)

    def discard(self, ranges: Sequence[Range]) -> None:
        """Contents become undefined: no copy-back, and reading them is an integrity error.

        One ``cudaMemDiscardBatchAsync`` call, as the ``cuda`` backend makes
        it: ``prefetch_call_overhead_s`` plus ``discard_range_s`` per range
        plus the bytes over ``discard_rate``, in order with the kernels. The
        pages are *discarded*: a kernel writing one before a prefetch to the
        GPU takes the refault path (``discard_refault_rate``). Only whole
        64 KB pages inside a range lose their content physically (the rest
        still migrates); the byte ranges become undefined exactly.
        """
        if not ranges:
            return
        p = self.profile
        self._issue(p.prefetch_call_overhead_s + len(ranges) * p.discard_range_s
                    + sum(n for _, n in ranges) / p.discard_rate)
        lo, hi = self.space.page_spans(ranges, inward=True)
        self.engine.discard(lo, hi)
        self.contents.forget(ranges)

    @property
    def swap(self) -> SimSwap:
        """The swap path: through the copy engines (:class:`SimSwap`)."""
        return self._swap

    def drop(self, ranges: Sequence[Range]) -> None:
        """Dead ranges discarded beside the kernels, as the ``cuda`` backend issues it: one
        ``cudaMemDiscardBatchAsync`` (``prefetch_call_overhead_s`` plus ``discard_range_s``
        per range of CPU time) on its discard stream after the kernels queued so far; the
        work (bytes over ``discard_rate``) runs there, one discard after the other, and no
        launch waits for it. The pages are *discarded* as with :meth:`discard`; a later
        population of them (:meth:`populate`) waits until the discard is done, and so does
        any reuse of their memory."""
        if not ranges:
            return
        p = self.profile
        t = self._issue(p.prefetch_call_overhead_s + len(ranges) * p.discard_range_s)
        lo, hi = self.space.page_spans(ranges, inward=True)
        self.engine.discard_beside(lo, hi, max(t, self._t_compute))
        self.contents.forget(ranges)
        self._swap.release(ranges)

    def discard_and_prefetch(self, ranges: Sequence[Range], device: int) -> None:
        """``cudaMemDiscardAndPrefetchBatchAsync``: contents undefined, and the pages placed on ``device``.

        Costs one call (``prefetch_call_overhead_s`` and ``discard_range_s``
        per range); to the GPU, the pages then come as a prefetch brings
        discarded ones (``discard_prefetch_rate`` for those still on the GPU,
        population without a copy for the others), so a kernel may write them
        at once; to the host they leave the GPU copying nothing.
        """
        if not ranges:
            return
        if device not in (HOST, self.device):
            raise ValueError(f"discard_and_prefetch to device {device}: the simulator has GPU 0 and HOST (-1)")
        p = self.profile
        t = self._issue(p.prefetch_call_overhead_s + len(ranges) * p.discard_range_s)
        lo, hi = self.space.page_spans(ranges, inward=True)
        self.engine.discard(lo, hi)
        self.contents.forget(ranges)
        self.engine.prefetch(lo, hi, device, np.full(len(ranges), t), 0.0)

    def advise(self, ranges: Sequence[Range], advice: Advice, device: int) -> None:
        """cudaMemAdvise: ReadMostly, PreferredLocation (GPU or host), AccessedBy(GPU).

        One call per range, as the ``cuda`` backend makes them (``advise_call_s`` each).
        """
        if not ranges:
            return
        advice = Advice(advice)
        if device not in (HOST, self.device):
            raise ValueError(f"advise for device {device}: the simulator has GPU 0 and HOST (-1)")
        self._issue(len(ranges) * self.profile.advise_call_s)
        lo, hi = self.space.page_spans(ranges, inward=False)
        self.engine.advise(lo, hi, advice, on_gpu=device == self.device)

    def launch(self, reads: Sequence[Range], writes: Sequence[Range], flops: int, nbytes: int,
               precision: str = "") -> None:
        """Execute one kernel: integrity check, faults and migrations, then compute.

        A kernel that touches bytes still swapped out gets them back first, as the ``cuda``
        backend's ``launch`` does (the plan should have: counted in ``late_swap_ins``)."""
        if self._swap.staged:
            late = [r for r in (*reads, *writes) if self._swap.staged.overlaps(*r)]
            if late:
                self._swap.late += 1
                self._swap.back(late)
                self._swap.wait(late)
        self.contents.launch(reads, writes)
        t0 = max(self._t_compute, self._t_action)
        self._time["overhead_s"] += t0 - self._t_compute
        k = len(reads) + len(writes)
        t_ready = t_remote = t0
        if k:
            arr = np.array([*reads, *writes], dtype=np.int64).reshape(k, 2)
            starts = arr[:, 0] - VA_BASE
            ends = starts + arr[:, 1]
            top = self.space.top
            if starts.min() < 0 or ends.max() > top * E.BLOCK:
                bad = next((p, n) for p, n in (*reads, *writes) if p < VA_BASE or p + n > VA_BASE + top * E.BLOCK)
                raise ValueError(f"launch touches {bad[1]} bytes at {bad[0]:#x}, outside every managed allocation")
            wflag = np.zeros(k, np.uint8)
            wflag[len(reads) :] = 1
            tf = self.engine.tf
            self.engine.launch(starts, ends, wflag, t0)
            t_ready = float(tf[E.T_OUT])
            t_remote = float(tf[E.T_REMOTE])
            wait = tf[E.T_WAIT]
            self._time["transfer_wait_s"] += float(wait)
            self._time["fault_stall_s"] += float(t_ready - t0 - wait)
        compute = self._swap.beside(t_ready, self.profile.compute_time(flops, nbytes, precision))
        remote = t_remote - t_ready  # the remote accesses' share of the link, concurrent with compute
        self._time["compute_s"] += compute
        self._time["remote_access_s"] += max(0.0, remote - compute)
        self._t_compute = float(t_ready + max(compute, remote))
        self.launches += 1

    def synchronize(self) -> None:
        """Wait for every copy: the compute stream catches up with both engines."""
        tf = self.engine.tf
        start = max(self._t_compute, self._t_action)
        end = max(start, tf[E.T_H2D], tf[E.T_D2H], tf[E.T_MIG], tf[E.T_CE_H2D], tf[E.T_CE_D2H], tf[E.T_DISC], tf[E.T_DROP])
        self._time["overhead_s"] += start - self._t_compute
        self._time["transfer_wait_s"] += end - start
        self._t_compute = end

    def mem_info(self) -> tuple[int, int]:
        g = self.engine.g
        used = int(g[E.G_RES] + g[E.G_PEND]) * E.PAGE
        return self.capacity_bytes - used, self.capacity_bytes

    # ------------------------------------------------------------ sim-only extras

    def mark_host_written(self, ranges: Sequence[Range]) -> None:
        """The host initialised these bytes (set-up data, inputs): defined, resident on the host."""
        lo, hi = self.space.page_spans(ranges, inward=False)
        self.engine.host_write(lo, hi)
        self.contents.write(ranges)

    def check_defined(self, ranges: Sequence[Range]) -> None:
        """A kernel is about to read ``ranges``: each must hold data."""
        self.contents.launch(ranges, ())

    def mark_dead(self, ranges: Sequence[Range]) -> None:
        """A freed object: its bytes are undefined until written again.

        Bookkeeping only: the driver does not know, so nothing moves and its
        pages are still copied back if evicted (only :meth:`discard` avoids that).
        A pinned copy the swap path made of them is dropped too.
        """
        self.contents.forget(ranges)
        self._swap.release(ranges)

    def drain_faults(self) -> list[int]:
        """2 MB block addresses that faulted since the last call, in order (one per block per batch)."""
        return self.engine.drain_faults()

    def now(self) -> float:
        """Current GPU time, seconds: when the next launch could begin."""
        return max(self._t_compute, self._t_action)

    def resident_fraction(self, ranges: Sequence[Range]) -> float:
        """Share of the ranges' 64 KB pages that are on the GPU (landed or in flight)."""
        lo, hi = self.space.page_spans(ranges, inward=False)
        total = int((hi - lo).sum())
        if not total:
            return 1.0
        return self.engine.gpu_pages(lo, hi) / total

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds of GPU time by cause."""
        return dict(self._time)

    def reset_peak(self) -> None:
        """Restart the peak-resident count from what is resident now."""
        g = self.engine.g
        g[E.G_PEAK] = g[E.G_RES]

    def counters(self) -> dict:
        """A snapshot of every counter (the replay diffs two of them)."""
        return {
            "time_s": self._t_compute,
            "faults": self.faults,
            "fault_batches": self.fault_batches,
            "evictions": self.evictions,
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "page_events": self.page_events,
            "launches": self.launches,
            "calls": self.calls,
            "swapped_out_bytes": self.swapped_out_bytes,
            "swapped_in_bytes": self.swapped_in_bytes,
            "late_swap_ins": self._swap.late,
            **self._time,
        }

    # ------------------------------------------------------------ internals

    def _issue(self, cpu_s: float) -> float:
        """One policy call costing ``cpu_s`` of CPU time: it starts when the GPU reaches it; returns its end."""
        self.calls += 1
        self._t_action = max(self._t_action, self._t_compute) + cpu_s
        return self._t_action


class SimSwap(SwapPath):
    """The simulated GPU's swap path (:attr:`SimBackend.swap`): copies to and from pinned
    memory, a discard after each copy out, a population before each copy back
    (umrt/sim/MODEL.md, "The swap path"). ``swap_copy``: what moves the bytes, ``"sm"`` (a
    kernel of umrt's own: nothing waits for it, the kernels beside it lose
    ``sm_copy_share`` of the GPU while it runs) or ``"engines"`` (``cudaMemcpyAsync`` on the
    copy engines: the thread waits ``copy_host_wait`` of it). ``staged``: the bytes whose
    data is in pinned memory now; ``peak_bytes``: the most at once (the staging a live run
    needs)."""

    pinned_copies = True

    def __init__(self, backend: SimBackend, swap_copy: str = SWAP_COPY_DEFAULT) -> None:
        super().__init__(backend)
        self.backend: SimBackend = backend
        self.swap_copy = swap_copy
        self.staged = RangeSet()
        self.peak_bytes = 0
        self.late = 0  # launches that touched swapped-out bytes no plan had brought back
        # SM copies: per direction (the engine's queue index), the busy period of the copy
        # kernels queued there, (start, end): one after the other on their stream
        self._busy: dict[int, tuple[float, float]] = {}

    def out(self, ranges: Sequence[Range]) -> None:
        """Copy live ranges to pinned host memory on the GPU -> host copy queue, then discard them.

        As the ``cuda`` backend issues it: one copy per coalesced range (an SM copy
        kernel or a ``cudaMemcpyAsync``, ``prefetch_call_overhead_s`` of CPU time each,
        the measured cost of a runtime call), then one ``cudaMemDiscardBatchAsync`` of
        their whole 64 KB pages (``prefetch_call_overhead_s`` plus ``discard_range_s``
        per range), ordered after the copies. The copy of range ``r`` starts once
        issued and once its pages have arrived, at ``copy_d2h_rate`` on the D2H
        queue beside the other direction; on the copy engines the CPU waits for the
        copies (``copy_host_wait``), SM copies slow the kernels beside them instead
        (:meth:`beside`); the discard's work
        (bytes over ``discard_rate``) follows it on a stream of its own, and the
        pages' memory is free once that is done (umrt/sim/MODEL.md).
        Their bytes hold no data on the GPU until :meth:`back` copies them
        back: a launch reading them first is an integrity error. An empty
        call costs nothing.
        """
        if not ranges:
            return
        b = self.backend
        merged = b.space.coalesce(ranges)
        p = b.profile
        call = p.prefetch_call_overhead_s
        k = len(merged)
        t0 = b._issue(k * call + call + k * p.discard_range_s)
        b.calls += k  # k copies, and the discard (counted by _issue)
        issue = t0 - (k - np.arange(k)) * call - k * p.discard_range_s
        lo, hi = b.space.page_spans(merged, inward=False)
        dlo, dhi = b.space.page_spans(merged, inward=True)
        nbytes = np.array([n for _, n in merged], np.float64)
        before = float(b.engine.tf[E.T_CE_D2H])
        b.engine.copy_out(lo, hi, nbytes, dlo, dhi, issue)
        self._copied(E.T_CE_D2H, t0, float(issue[0]), before)
        for ptr, n in b.contents.take(merged):
            self.staged.add(ptr, n)
        self.peak_bytes = max(self.peak_bytes, self.staged.nbytes())

    def back(self, ranges: Sequence[Range]) -> None:
        """Populate ranges on the GPU, then copy back what :meth:`out` copied out.

        As the ``cuda`` backend issues it, per coalesced range that holds swapped
        bytes: a ``cudaMemPrefetchAsync`` to the GPU (population: discarded pages
        still there revalidate, others populate, no copy) and a copy (an SM copy kernel
        or a ``cudaMemcpyAsync``) from pinned memory after it on the host -> GPU copy
        queue at ``copy_h2d_rate``, ``prefetch_call_overhead_s`` of CPU time each. A launch
        that reads the range waits for its copy (transfer wait). Ranges (or
        parts) that were never swapped out are prefetched (:meth:`SimBackend.prefetch`).
        """
        if not ranges:
            return
        b = self.backend
        staged: list[Range] = []
        rest: list[Range] = []
        for ptr, n in b.space.coalesce(ranges):
            at = ptr
            for q, m in self.staged.take(ptr, n):
                if q > at:
                    rest.append((at, q - at))
                staged.append((q, m))
                at = q + m
            if at < ptr + n:
                rest.append((at, ptr + n - at))
        if staged:
            merged = b.space.coalesce(staged)
            call = b.profile.prefetch_call_overhead_s
            k = len(merged)
            t0 = b._issue(2 * k * call)
            b.calls += 2 * k - 1
            issue = t0 - (k - 1 - np.arange(k)) * 2 * call
            lo, hi = b.space.page_spans(merged, inward=False)
            nbytes = np.array([n for _, n in merged], np.float64)
            before = float(b.engine.tf[E.T_CE_H2D])
            b.engine.copy_in(lo, hi, nbytes, issue)
            self._copied(E.T_CE_H2D, t0, float(issue[0]), before)
            b.contents.write(merged)
        if rest:
            b.prefetch(rest, b.device)

    def _copied(self, queue: int, issued: float, first: float, before: float) -> None:
        """Copies were queued on ``queue`` (``E.T_CE_*``), the first issued at ``first``, the
        last by ``issued``; the queue was busy until ``before``. On the copy engines the CPU
        returns from them only ``copy_host_wait`` of the way to their end (1, measured: once
        they are done), so nothing it issues later, kernels included, starts before. SM copies
        are kernels: the CPU goes on, and the queue's busy period grows (:meth:`beside`)."""
        b = self.backend
        done = float(b.engine.tf[queue])
        if self.swap_copy == "engines":
            if done > issued:
                b._t_action = max(b._t_action, issued + b.profile.copy_host_wait * (done - issued))
            return
        start, end = self._busy.get(queue, (0.0, 0.0))
        if before < first or end < first:  # the queue had gone idle: a new busy period
            start = first
        self._busy[queue] = (start, max(end, done))

    def beside(self, start: float, compute: float) -> float:
        """A kernel computing ``compute`` seconds from ``start``: how long it takes beside the SM
        copies running then. While one runs, the kernel has ``1 - sm_copy_share`` of the GPU
        (umrt/sim/MODEL.md, "SM copies"): each second of overlap costs ``share / (1 - share)``
        more."""
        if not self._busy or compute <= 0.0:
            return compute
        share = self.backend.profile.sm_copy_share
        extra = 0.0
        for lo, hi in self._busy.values():
            overlap = min(start + compute, hi) - max(start, lo)
            if overlap > 0.0:
                extra += overlap * share / (1.0 - share)
        return compute + extra

    def wait(self, ranges: Sequence[Range]) -> None:
        """The compute stream waits for the copies into these ranges (a ``cudaStreamWaitEvent``,
        as the ``cuda`` backend makes it: the next launch starts no earlier, whatever it touches)."""
        if not ranges:
            return
        b = self.backend
        lo, hi = b.space.page_spans(ranges, inward=False)
        t = b.engine.ready_time(lo, hi)
        old = b._t_compute
        if t > old:
            busy = min(t, b._t_action)
            b._time["overhead_s"] += max(0.0, busy - old)
            b._time["transfer_wait_s"] += t - max(old, busy)
            b._t_compute = t

    def release(self, ranges: Sequence[Range]) -> None:
        """Swapped-out ranges died: their pinned copies are dropped (nothing is copied back)."""
        for ptr, n in ranges:
            self.staged.remove(ptr, n)

    @property
    def staged_bytes(self) -> int:
        """Bytes held in pinned host memory by :meth:`out` now."""
        return self.staged.nbytes()
