"""``SimBackend``: a GPU with CUDA Unified Memory, simulated.

It implements :class:`umrt.backends.base.Backend`, so a policy or the umrt
runtime drives it exactly as it drives the real ``cuda`` backend, and it
keeps simulated time on three engines: one compute stream and the H2D and
D2H copy engines (they run concurrently and overlap compute).

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
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np

from umrt.backends.base import HOST, Advice, Backend, Range
from umrt.backends.ranges import RangeSet
from umrt.config import format_bytes
from umrt.errors import ConfigError, DataIntegrityError
from umrt.hardware import HardwareProfile, load_profile
from umrt.sim import engine as E

__all__ = ["SimBackend", "VA_BASE"]

#: Where the simulated managed address space starts (2 MB aligned).
VA_BASE = 0x7F00_0000_0000
_UNLIMITED_PAGES = 1 << 50
_QUEUE = 1 << 16
_FAULT_LOG = 1 << 18


class SimBackend(Backend):
    """The simulated GPU. ``capacity_bytes`` is the GPU memory budget
    (``None``: the profile's memory; ``math.inf``: unlimited)."""

    name = "sim"
    device = 0

    def __init__(self, profile: HardwareProfile | str, capacity_bytes: int | float | None = None) -> None:
        self.profile = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
        if capacity_bytes is None:
            capacity_bytes = self.profile.gpu_memory_bytes
        if capacity_bytes == math.inf:
            cap_pages = _UNLIMITED_PAGES
        else:
            if capacity_bytes < E.BLOCK:
                raise ConfigError(f"GPU memory budget {capacity_bytes} bytes is below one 2 MB block")
            cap_pages = int(capacity_bytes) // E.PAGE
        self.capacity_bytes = cap_pages * E.PAGE
        p = self.profile
        self._prm = np.zeros(E.NP, np.float64)
        for index, value in ((E.P_H2D, p.h2d_bandwidth), (E.P_D2H, p.d2h_bandwidth),
                             (E.P_BATCH, p.fault_batch_size), (E.P_LAT, p.fault_batch_latency_s),
                             (E.P_THRESH, p.prefetch_threshold), (E.P_PF_H2D, p.prefetch_h2d_rate),
                             (E.P_PF_D2H, p.prefetch_d2h_rate), (E.P_SETUP_H2D, p.prefetch_h2d_setup_s),
                             (E.P_SETUP_D2H, p.prefetch_d2h_setup_s), (E.P_FAULT, p.fault_migration_rate),
                             (E.P_TOUCH, p.first_touch_rate), (E.P_POPULATE, p.prefetch_populate_rate),
                             (E.P_HOSTPOP, p.host_populate_rate), (E.P_REFAULT, p.discard_refault_rate),
                             (E.P_REVALIDATE, p.discard_prefetch_rate)):
            self._prm[index] = value
        rates = (E.P_H2D, E.P_D2H, E.P_PF_H2D, E.P_PF_D2H, E.P_FAULT, E.P_TOUCH, E.P_POPULATE, E.P_HOSTPOP,
                 E.P_REFAULT, E.P_REVALIDATE)
        if not all(self._prm[i] > 0 for i in rates):
            raise ConfigError(f"hardware profile {p.name!r} lacks a Unified Memory rate (every rate must be > 0)")
        self._g, self._tf = E.new_scalars(cap_pages)
        self._q_r = np.zeros(_QUEUE, np.int64)  # pending D2H copies (copy records) ...
        self._rec_t = np.zeros((2, E.RING), np.float64)  # ... and every copy record's completion time
        self._q_n = np.zeros(_QUEUE, np.int64)
        self._flog = np.zeros(_FAULT_LOG, np.int64)
        self._flog_read = 0
        self._nblocks = 0
        self._grow(1024)
        self._ubuf = np.zeros(4096, np.int64)  # a launch's pages ...
        self._ebuf = np.zeros(4096, np.int64)  # ... and its fault entries
        self._etype = np.zeros(4096, np.uint8)
        # address space: 2 MB-aligned bump allocation with first-fit reuse
        self._top = 0  # blocks handed out so far
        self._holes: list[tuple[int, int]] = []  # (first block, count), sorted
        self._allocs: dict[int, int] = {}  # ptr -> nbytes
        self._starts: list[int] = []  # sorted ptrs
        self._defined = RangeSet()  # the defined bytes
        # time (seconds of simulated GPU time) and its breakdown
        self._t_compute = 0.0
        self._t_action = 0.0
        self._time = {"compute_s": 0.0, "fault_stall_s": 0.0, "transfer_wait_s": 0.0, "overhead_s": 0.0,
                      "remote_access_s": 0.0}
        self.launches = 0
        self.calls = 0  # prefetch/discard/advise calls

    # ------------------------------------------------------------ state arrays

    def _grow(self, nblocks: int) -> None:
        old = self._nblocks
        npages = nblocks * E.PAGES_PER_BLOCK

        def grown(arr, shape, dtype, fill=0):
            new = np.full(shape, fill, dtype)
            if old:
                new[: arr.shape[0]] = arr
            return new

        self._pf = grown(getattr(self, "_pf", None), (npages, E.NFLAGS), np.uint8)
        self._prec = grown(getattr(self, "_prec", None), npages, np.int64, -1)
        self._pmark = grown(getattr(self, "_pmark", None), npages, np.int64)
        self._pwmark = grown(getattr(self, "_pwmark", None), npages, np.uint8)
        self._pclass = grown(getattr(self, "_pclass", None), npages, np.uint8)
        bi = grown(getattr(self, "_bi", None), (nblocks, E.NBCOLS), np.int64)
        bi[old:, E.B_PREV] = -1
        bi[old:, E.B_NEXT] = -1
        bi[old:, E.B_LIST] = E.LIST_NONE
        bi[old:, E.B_PIN] = -1
        self._bi = bi
        self._nblocks = nblocks

    # ------------------------------------------------------------ Backend API

    def malloc(self, nbytes: int) -> int:
        """Managed allocation, 2 MB aligned (its pages start unpopulated)."""
        if nbytes <= 0:
            raise ValueError(f"malloc of {nbytes} bytes")
        nb = -(-nbytes // E.BLOCK)
        first = None
        for i, (start, count) in enumerate(self._holes):
            if count >= nb:
                first = start
                self._holes[i : i + 1] = [(start + nb, count - nb)] if count > nb else []
                break
        if first is None:
            first = self._top
            self._top += nb
            if self._top > self._nblocks:
                self._grow(max(self._top, 2 * self._nblocks))
        p0 = first * E.PAGES_PER_BLOCK
        self._pf[p0 : p0 + -(-nbytes // E.PAGE), E.F_MAPPED] = 1
        ptr = VA_BASE + first * E.BLOCK
        self._allocs[ptr] = nbytes
        self._starts.insert(bisect_left(self._starts, ptr), ptr)
        return ptr

    def free(self, ptr: int) -> None:
        """cudaFree: the pages are dropped without copy-back; content is gone."""
        nbytes = self._allocs.pop(ptr, None)
        if nbytes is None:
            raise ValueError(f"free of {ptr:#x}, which is not a live allocation")
        del self._starts[bisect_left(self._starts, ptr)]
        first = (ptr - VA_BASE) // E.BLOCK
        nb = -(-nbytes // E.BLOCK)
        E.release(self._pf, self._prec, self._bi, self._g, first, first + nb)
        self._defined.remove(ptr, nb * E.BLOCK)
        i = bisect_left(self._holes, (first, 0))
        self._holes.insert(i, (first, nb))

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
        merged: list[list[int]] = []
        for ptr, n in sorted((int(p), int(n)) for p, n in ranges):
            base = self._find(ptr, n)
            if merged and merged[-1][2] == base and merged[-1][0] + merged[-1][1] >= ptr:
                merged[-1][1] = max(merged[-1][0] + merged[-1][1], ptr + n) - merged[-1][0]
            else:
                merged.append([ptr, n, base])
        p = self.profile
        call = p.prefetch_call_overhead_s
        k = len(merged)
        t0 = self._issue(k * call)
        self.calls += k - 1  # k single calls
        issue = t0 - (k - 1 - np.arange(k)) * call  # call r ends (r + 1) calls into the run
        self._migrate([(a, n) for a, n, _ in merged], device, issue, 0.0)

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
        self._migrate(ranges, device, issue, p.batch_d2h_range_s if k > 1 else 0.0)

    def _migrate(self, ranges: Sequence[Range], device: int, issue: np.ndarray, d2h_extra_s: float) -> None:
        """Migrate each range (issued at ``issue[r]``) to ``device`` on the prefetch path;
        to the host each takes ``d2h_extra_s`` more."""
        lo, hi = self._page_spans(ranges, inward=False)
        if device == HOST:
            E.prefetch_host(self._pf, self._prec, self._rec_t, self._bi, self._g, self._tf, self._prm,
                            self._q_r, self._q_n, lo, hi, issue, d2h_extra_s)
        else:
            self._check(E.prefetch_gpu(self._pf, self._prec, self._rec_t, self._bi, self._g, self._tf, self._prm,
                                       self._q_r, self._q_n, lo, hi, issue))

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
        lo, hi = self._page_spans(ranges, inward=True)
        E.discard(self._pf, self._bi, self._g, lo, hi)
        for ptr, n in ranges:
            self._defined.remove(ptr, n)

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
        lo, hi = self._page_spans(ranges, inward=True)
        E.discard(self._pf, self._bi, self._g, lo, hi)
        for ptr, n in ranges:
            self._defined.remove(ptr, n)
        issue = np.full(len(ranges), t)
        if device == HOST:
            E.prefetch_host(self._pf, self._prec, self._rec_t, self._bi, self._g, self._tf, self._prm,
                            self._q_r, self._q_n, lo, hi, issue, 0.0)
        else:
            self._check(E.prefetch_gpu(self._pf, self._prec, self._rec_t, self._bi, self._g, self._tf, self._prm,
                                       self._q_r, self._q_n, lo, hi, issue))

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
        lo, hi = self._page_spans(ranges, inward=False)
        pf = self._pf
        for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
            if advice == Advice.SET_READ_MOSTLY:
                pf[a:b, E.F_RM] = 1
            elif advice == Advice.UNSET_READ_MOSTLY:
                pf[a:b, E.F_RM] = 0
                pf[a:b, E.F_HOSTCOPY] = 0  # duplicates collapse onto the GPU copy
            elif advice == Advice.SET_PREFERRED_LOCATION:
                pf[a:b, E.F_PREF] = E.PREF_HOST if device == HOST else E.PREF_GPU
            elif advice == Advice.UNSET_PREFERRED_LOCATION:
                pf[a:b, E.F_PREF] = E.PREF_NONE
            elif advice == Advice.SET_ACCESSED_BY:
                if device == self.device:
                    pf[a:b, E.F_ACCBY] = 1
            elif advice == Advice.UNSET_ACCESSED_BY:
                if device == self.device:
                    pf[a:b, E.F_ACCBY] = 0

    def launch(self, reads: Sequence[Range], writes: Sequence[Range], flops: int, nbytes: int,
               precision: str = "") -> None:
        """Execute one kernel: integrity check, faults and migrations, then compute."""
        defined = self._defined
        for ptr, n in reads:
            if n > 0 and not defined.covers(ptr, n):
                self._integrity_error(ptr, n)
        for ptr, n in writes:
            if n > 0:
                defined.add(ptr, n)
        t0 = max(self._t_compute, self._t_action)
        self._time["overhead_s"] += t0 - self._t_compute
        k = len(reads) + len(writes)
        t_ready = t_remote = t0
        if k:
            arr = np.array([*reads, *writes], dtype=np.int64).reshape(k, 2)
            starts = arr[:, 0] - VA_BASE
            ends = starts + arr[:, 1]
            if starts.min() < 0 or ends.max() > self._top * E.BLOCK:
                bad = next((p, n) for p, n in (*reads, *writes) if p < VA_BASE or p + n > VA_BASE + self._top * E.BLOCK)
                raise ValueError(f"launch touches {bad[1]} bytes at {bad[0]:#x}, outside every managed allocation")
            wflag = np.zeros(k, np.uint8)
            wflag[len(reads) :] = 1
            need = int(((ends - starts) >> E.PAGE_SHIFT).sum()) + 2 * k
            if need > self._ebuf.shape[0]:
                self._ubuf = np.zeros(2 * need, np.int64)
                self._ebuf = np.zeros(2 * need, np.int64)
                self._etype = np.zeros(2 * need, np.uint8)
            err = E.launch(self._pf, self._prec, self._rec_t, self._pmark, self._pwmark, self._pclass, self._bi,
                           self._g, self._tf, self._prm, self._q_r, self._q_n, self._flog,
                           starts, ends, wflag, t0, self._ubuf, self._ebuf, self._etype)
            self._check(err)
            t_ready = float(self._tf[E.T_OUT])
            t_remote = float(self._tf[E.T_REMOTE])
            wait = self._tf[E.T_WAIT]
            self._time["transfer_wait_s"] += float(wait)
            self._time["fault_stall_s"] += float(t_ready - t0 - wait)
        compute = self.profile.compute_time(flops, nbytes, precision)
        remote = t_remote - t_ready  # the remote accesses' share of the link, concurrent with compute
        self._time["compute_s"] += compute
        self._time["remote_access_s"] += max(0.0, remote - compute)
        self._t_compute = float(t_ready + max(compute, remote))
        self.launches += 1

    def synchronize(self) -> None:
        """Wait for every copy: the compute stream catches up with both engines."""
        start = max(self._t_compute, self._t_action)
        end = max(start, self._tf[E.T_H2D], self._tf[E.T_D2H])
        self._time["overhead_s"] += start - self._t_compute
        self._time["transfer_wait_s"] += end - start
        self._t_compute = end

    def mem_info(self) -> tuple[int, int]:
        used = int(self._g[E.G_RES] + self._g[E.G_PEND]) * E.PAGE
        return self.capacity_bytes - used, self.capacity_bytes

    # ------------------------------------------------------------ sim-only extras

    def mark_host_written(self, ranges: Sequence[Range]) -> None:
        """The host initialised these bytes (set-up data, inputs): defined, resident on the host."""
        lo, hi = self._page_spans(ranges, inward=False)
        E.host_write(self._pf, self._prec, self._bi, self._g, lo, hi)
        for ptr, n in ranges:
            if n > 0:
                self._defined.add(ptr, n)

    def mark_dead(self, ranges: Sequence[Range]) -> None:
        """A freed object: its bytes are undefined until written again.

        Bookkeeping only: the driver does not know, so nothing moves and its
        pages are still copied back if evicted (only :meth:`discard` avoids that).
        """
        for ptr, n in ranges:
            if n > 0:
                self._defined.remove(ptr, n)

    def drain_faults(self) -> list[int]:
        """2 MB block addresses that faulted since the last call, in order (one per block per batch)."""
        n = int(self._g[E.G_FLOG])
        size = self._flog.shape[0]
        start = max(self._flog_read, n - size)
        self._flog_read = n
        idx = np.arange(start, n) % size
        return (VA_BASE + self._flog[idx] * E.BLOCK).tolist()

    def now(self) -> float:
        """Current GPU time, seconds: when the next launch could begin."""
        return max(self._t_compute, self._t_action)

    def resident_fraction(self, ranges: Sequence[Range]) -> float:
        """Share of the ranges' 64 KB pages that are on the GPU (landed or in flight)."""
        lo, hi = self._page_spans(ranges, inward=False)
        total = int((hi - lo).sum())
        if not total:
            return 1.0
        res = sum(int(self._pf[a:b, E.F_GPU].sum()) for a, b in zip(lo.tolist(), hi.tolist(), strict=True))
        return res / total

    @property
    def resident_bytes(self) -> int:
        return int(self._g[E.G_RES]) * E.PAGE

    @property
    def faults(self) -> int:
        return int(self._g[E.G_FAULTS])

    @property
    def fault_batches(self) -> int:
        return int(self._g[E.G_BATCHES])

    @property
    def refaults(self) -> int:
        """Pages a launch had on the GPU, lost to its own fault servicing, and faulted again (thrashing)."""
        return int(self._g[E.G_REFAULTS])

    @property
    def evictions(self) -> int:
        return int(self._g[E.G_EVICTIONS])

    @property
    def h2d_bytes(self) -> int:
        """Bytes moved host-to-device: migrations plus remote reads."""
        return int(self._g[E.G_H2D] + self._g[E.G_REMOTE_R])

    @property
    def d2h_bytes(self) -> int:
        return int(self._g[E.G_D2H] + self._g[E.G_REMOTE_W])

    @property
    def peak_resident_bytes(self) -> int:
        return int(self._g[E.G_PEAK]) * E.PAGE

    @property
    def page_events(self) -> int:
        return int(self._g[E.G_EVENTS])

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds of GPU time by cause."""
        return dict(self._time)

    def reset_peak(self) -> None:
        """Restart the peak-resident count from what is resident now."""
        self._g[E.G_PEAK] = self._g[E.G_RES]

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
            **self._time,
        }

    # ------------------------------------------------------------ internals

    def _issue(self, cpu_s: float) -> float:
        """One policy call costing ``cpu_s`` of CPU time: it starts when the GPU reaches it; returns its end."""
        self.calls += 1
        self._t_action = max(self._t_action, self._t_compute) + cpu_s
        return self._t_action

    def _find(self, ptr: int, n: int) -> int:
        i = bisect_right(self._starts, ptr) - 1
        if i < 0 or n < 0 or ptr + n > self._starts[i] + self._allocs[self._starts[i]]:
            raise ValueError(f"range of {n} bytes at {ptr:#x} is not inside one managed allocation")
        return self._starts[i]

    def _page_spans(self, ranges: Sequence[Range], inward: bool) -> tuple[np.ndarray, np.ndarray]:
        lo = np.empty(len(ranges), np.int64)
        hi = np.empty(len(ranges), np.int64)
        for i, (ptr, n) in enumerate(ranges):
            base = self._find(ptr, n)
            a, b = ptr - VA_BASE, ptr + n - VA_BASE
            if inward:
                if ptr + n == base + self._allocs[base]:
                    b += E.PAGE - 1  # the allocation's tail page holds nothing else
                lo[i], hi[i] = -(-a // E.PAGE), b // E.PAGE
            else:
                lo[i], hi[i] = a // E.PAGE, -(-b // E.PAGE)
            if hi[i] < lo[i]:
                hi[i] = lo[i]
        return lo, hi

    def _check(self, err: int) -> None:
        if err == E.ERR_UNMAPPED:
            addr = VA_BASE + int(self._g[E.G_ERRPAGE]) * E.PAGE
            raise ValueError(f"launch touches page {addr:#x}, outside every managed allocation")
        if err == E.ERR_NO_VICTIM:
            blocks = int(self._g[E.G_ERRBLOCKS])
            batch = self.profile.fault_batch_size
            raise ConfigError(
                f"GPU memory budget {self.capacity_bytes} bytes ({format_bytes(self.capacity_bytes)}) cannot hold "
                f"one fault batch: the driver services up to {batch} faults of 64 KB together "
                f"({batch * E.PAGE >> 20} MiB) and keeps every 2 MB block they touch on the GPU until the batch "
                f"is done; this one spans at least {blocks} blocks ({blocks * E.BLOCK >> 20} MiB). Give the GPU more "
                f"memory than that (scattered faults can span up to {batch} blocks)"
            )

    def _integrity_error(self, ptr: int, n: int) -> None:
        bad = self._defined.first_gap(ptr, n)
        try:
            base = self._find(ptr, n)
            where = f"allocation {base:#x} + {ptr - base}"
        except ValueError:
            where = "no live allocation"
        raise DataIntegrityError(
            f"a launch reads {n} bytes at {ptr:#x} ({where}) but byte {bad:#x} holds no data: "
            "it was discarded while live, freed, or never written"
        )
