"""The simulated driver's state, as the numba engine (:mod:`umrt.sim.engine`) keeps it.

:class:`EngineState` owns the engine's flat arrays (per 64 KB page: flags,
copy record, per-launch marks; per 2 MB block: the eviction lists; the
scalar counters ``g`` and times ``tf``; the pending D2H copies and the
fault log) and makes every call into the engine, so that
:class:`umrt.sim.backend.SimBackend` deals in ranges and simulated time only.
:class:`EngineCount` reads one of the engine's counters as a backend attribute.
"""
from __future__ import annotations

import numpy as np

from umrt.backends.base import HOST, Advice
from umrt.config import format_bytes
from umrt.errors import ConfigError
from umrt.hardware import HardwareProfile
from umrt.sim import engine as E

__all__ = ["VA_BASE", "EngineCount", "EngineState"]

#: Where the simulated managed address space starts (2 MB aligned).
VA_BASE = 0x7F00_0000_0000
_QUEUE = 1 << 16  # pending D2H copies the ring holds (the oldest is long done when it is full)
_FAULT_LOG = 1 << 18  # faulted blocks remembered for drain_faults
_INITIAL_BLOCKS = 1024  # 2 GB of address space; doubled as allocations need

_RATES = (E.P_H2D, E.P_D2H, E.P_PF_H2D, E.P_PF_D2H, E.P_FAULT, E.P_TOUCH, E.P_POPULATE, E.P_HOSTPOP,
          E.P_REFAULT, E.P_REVALIDATE, E.P_COPY_H2D, E.P_COPY_D2H, E.P_DISCARD)


def engine_parameters(profile: HardwareProfile) -> np.ndarray:
    """The engine's parameter vector ``prm`` from a hardware profile (umrt/sim/MODEL.md says where
    each field is measured); every rate must be > 0."""
    p = profile
    prm = np.zeros(E.NP, np.float64)
    for index, value in ((E.P_H2D, p.h2d_bandwidth), (E.P_D2H, p.d2h_bandwidth),
                         (E.P_BATCH, p.fault_batch_size), (E.P_LAT, p.fault_batch_latency_s),
                         (E.P_THRESH, p.prefetch_threshold), (E.P_PF_H2D, p.prefetch_h2d_rate),
                         (E.P_PF_D2H, p.prefetch_d2h_rate), (E.P_SETUP_H2D, p.prefetch_h2d_setup_s),
                         (E.P_SETUP_D2H, p.prefetch_d2h_setup_s), (E.P_FAULT, p.fault_migration_rate),
                         (E.P_TOUCH, p.first_touch_rate), (E.P_POPULATE, p.prefetch_populate_rate),
                         (E.P_HOSTPOP, p.host_populate_rate), (E.P_REFAULT, p.discard_refault_rate),
                         (E.P_REVALIDATE, p.discard_prefetch_rate), (E.P_COPY_H2D, p.copy_rate("h2d")),
                         (E.P_COPY_D2H, p.copy_rate("d2h")), (E.P_DISCARD, p.discard_rate)):
        prm[index] = value
    if not all(prm[i] > 0 for i in _RATES):
        raise ConfigError(f"hardware profile {p.name!r} lacks a Unified Memory rate (every rate must be > 0)")
    return prm


def _grown(arr: np.ndarray, shape, dtype, fill=0) -> np.ndarray:
    """``arr`` copied to the front of a new array of ``shape``, the rest ``fill``."""
    new = np.full(shape, fill, dtype)
    new[: arr.shape[0]] = arr
    return new


class EngineState:
    """Per-page and per-block state of a GPU with ``capacity_pages`` 64 KB pages, and the engine calls on it.

    Pages and blocks are numbered from :data:`VA_BASE`; the arrays grow (:meth:`grow`)
    as the address space does.
    """

    def __init__(self, profile: HardwareProfile, capacity_pages: int) -> None:
        self.profile = profile
        self.prm = engine_parameters(profile)
        self.g, self.tf = E.new_scalars(capacity_pages)  # counters, and the engines' times
        self.q_r = np.zeros(_QUEUE, np.int64)  # pending D2H copies (copy records) ...
        self.q_n = np.zeros(_QUEUE, np.int64)  # ... and the pages each frees once done
        self.rec_t = np.zeros((E.NRINGS, E.RING), np.float64)  # every record's completion time
        self.flog = np.zeros(_FAULT_LOG, np.int64)  # faulted blocks (a ring)
        self.flog_read = 0  # faults logged up to here were drained
        # per page: flags, copy record in flight, and a launch's marks (epoch, written, class)
        self.pf = np.zeros((0, E.NFLAGS), np.uint8)
        self.prec = np.zeros(0, np.int64)
        self.pmark = np.zeros(0, np.int64)
        self.pwmark = np.zeros(0, np.uint8)
        self.pclass = np.zeros(0, np.uint8)
        self.bi = np.zeros((0, E.NBCOLS), np.int64)  # per block: residency and eviction-list links
        self.nblocks = 0
        self.grow(_INITIAL_BLOCKS)
        self.ubuf = np.zeros(4096, np.int64)  # a launch's pages ...
        self.ebuf = np.zeros(4096, np.int64)  # ... and its fault entries
        self.etype = np.zeros(4096, np.uint8)

    def grow(self, nblocks: int) -> None:
        """Make room for ``nblocks`` 2 MB blocks (the new pages unmapped, the new blocks on no list)."""
        old = self.nblocks
        npages = nblocks * E.PAGES_PER_BLOCK
        self.pf = _grown(self.pf, (npages, E.NFLAGS), np.uint8)
        self.prec = _grown(self.prec, npages, np.int64, -1)
        self.pmark = _grown(self.pmark, npages, np.int64)
        self.pwmark = _grown(self.pwmark, npages, np.uint8)
        self.pclass = _grown(self.pclass, npages, np.uint8)
        bi = _grown(self.bi, (nblocks, E.NBCOLS), np.int64)
        bi[old:, E.B_PREV] = -1
        bi[old:, E.B_NEXT] = -1
        bi[old:, E.B_LIST] = E.LIST_NONE
        bi[old:, E.B_PIN] = -1
        self.bi = bi
        self.nblocks = nblocks

    # ------------------------------------------------------------ engine calls

    def map_pages(self, first_page: int, npages: int) -> None:
        """Pages of a new allocation: mapped, unpopulated."""
        self.pf[first_page : first_page + npages, E.F_MAPPED] = 1

    def back_on_gpu(self, first_page: int, npages: int) -> None:
        """Pages of a new allocation, backed on the GPU at once (device memory: no fault, no call)."""
        E.back_on_gpu(self.pf, self.prec, self.bi, self.g, first_page, first_page + npages)

    def release(self, first_block: int, end_block: int) -> None:
        """cudaFree of blocks ``[first_block, end_block)``: pages dropped without copy-back."""
        E.release(self.pf, self.prec, self.bi, self.g, first_block, end_block)

    def prefetch(self, lo: np.ndarray, hi: np.ndarray, device: int, issue: np.ndarray,
                 d2h_extra_s: float) -> None:
        """Migrate pages ``[lo[r], hi[r])`` (issued at ``issue[r]``) to ``device`` on the prefetch
        path; to the host each range takes ``d2h_extra_s`` more."""
        if device == HOST:
            E.prefetch_host(self.pf, self.prec, self.rec_t, self.bi, self.g, self.tf, self.prm,
                            self.q_r, self.q_n, lo, hi, issue, d2h_extra_s)
        else:
            self.check(E.prefetch_gpu(self.pf, self.prec, self.rec_t, self.bi, self.g, self.tf, self.prm,
                                      self.q_r, self.q_n, lo, hi, issue))

    def copy_out(self, lo: np.ndarray, hi: np.ndarray, nbytes: np.ndarray, dlo: np.ndarray, dhi: np.ndarray,
                 issue: np.ndarray) -> float:
        """Swap out: copy ``nbytes[r]`` of pages ``[lo[r], hi[r])`` to pinned memory on the D2H copy
        engine, then discard pages ``[dlo[r], dhi[r])``; returns when the last discard is done."""
        return float(E.copy_out(self.pf, self.prec, self.rec_t, self.bi, self.g, self.tf, self.prm, lo, hi,
                                nbytes, dlo, dhi, issue))

    def copy_in(self, lo: np.ndarray, hi: np.ndarray, nbytes: np.ndarray, issue: np.ndarray) -> None:
        """Swap in: populate pages ``[lo[r], hi[r])`` on the GPU, then copy ``nbytes[r]`` back into
        them on the H2D copy engine."""
        self.check(E.copy_in(self.pf, self.prec, self.rec_t, self.bi, self.g, self.tf, self.prm, self.q_r,
                             self.q_n, lo, hi, nbytes, issue))

    def ready_time(self, lo: np.ndarray, hi: np.ndarray) -> float:
        """When every page of ``[lo[r], hi[r])`` has arrived (its last migration or copy is done)."""
        return float(E.ready_time(self.prec, self.rec_t, self.g, lo, hi))

    def discard_beside(self, lo: np.ndarray, hi: np.ndarray, t: float) -> float:
        """Dead pages ``[lo[r], hi[r])`` discarded on the discard stream from ``t``; returns when done."""
        return float(E.discard_beside(self.pf, self.prec, self.rec_t, self.bi, self.g, self.tf, self.prm,
                                      lo, hi, t))

    def discard(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """Pages ``[lo[r], hi[r])`` lose their content (no copy-back; a kernel refaults them)."""
        E.discard(self.pf, self.bi, self.g, lo, hi)

    def host_write(self, lo: np.ndarray, hi: np.ndarray) -> None:
        """The host wrote pages ``[lo[r], hi[r])``: populated, resident on the host."""
        E.host_write(self.pf, self.prec, self.bi, self.g, lo, hi)

    def advise(self, lo: np.ndarray, hi: np.ndarray, advice: Advice, on_gpu: bool) -> None:
        """Set the advice flags of pages ``[lo[r], hi[r])`` (``on_gpu``: the advice names the GPU, not the host)."""
        pf = self.pf
        for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
            if advice == Advice.SET_READ_MOSTLY:
                pf[a:b, E.F_RM] = 1
            elif advice == Advice.UNSET_READ_MOSTLY:
                pf[a:b, E.F_RM] = 0
                pf[a:b, E.F_HOSTCOPY] = 0  # duplicates collapse onto the GPU copy
            elif advice == Advice.SET_PREFERRED_LOCATION:
                pf[a:b, E.F_PREF] = E.PREF_GPU if on_gpu else E.PREF_HOST
            elif advice == Advice.UNSET_PREFERRED_LOCATION:
                pf[a:b, E.F_PREF] = E.PREF_NONE
            elif advice == Advice.SET_ACCESSED_BY:
                if on_gpu:
                    pf[a:b, E.F_ACCBY] = 1
            elif advice == Advice.UNSET_ACCESSED_BY:
                if on_gpu:
                    pf[a:b, E.F_ACCBY] = 0

    def launch(self, starts: np.ndarray, ends: np.ndarray, wflag: np.ndarray, t0: float) -> None:
        """One kernel's memory side from GPU time ``t0`` over byte spans ``[starts, ends)`` (from
        :data:`VA_BASE`; ``wflag``: written). Results in ``tf[T_OUT]``, ``tf[T_WAIT]``, ``tf[T_REMOTE]``."""
        need = int(((ends - starts) >> E.PAGE_SHIFT).sum()) + 2 * starts.shape[0]
        if need > self.ebuf.shape[0]:
            self.ubuf = np.zeros(2 * need, np.int64)
            self.ebuf = np.zeros(2 * need, np.int64)
            self.etype = np.zeros(2 * need, np.uint8)
        err = E.launch(self.pf, self.prec, self.rec_t, self.pmark, self.pwmark, self.pclass, self.bi,
                       self.g, self.tf, self.prm, self.q_r, self.q_n, self.flog,
                       starts, ends, wflag, t0, self.ubuf, self.ebuf, self.etype)
        self.check(err)

    def check(self, err: int) -> None:
        """Raise the error an engine call returned (``ERR_*``), in the user's words."""
        if err == E.ERR_UNMAPPED:
            addr = VA_BASE + int(self.g[E.G_ERRPAGE]) * E.PAGE
            raise ValueError(f"launch touches page {addr:#x}, outside every managed allocation")
        if err == E.ERR_NO_VICTIM:
            capacity = int(self.g[E.G_CAP]) * E.PAGE
            blocks = int(self.g[E.G_ERRBLOCKS])
            batch = self.profile.fault_batch_size
            raise ConfigError(
                f"GPU memory budget {capacity} bytes ({format_bytes(capacity)}) cannot hold "
                f"one fault batch: the driver services up to {batch} faults of 64 KB together "
                f"({batch * E.PAGE >> 20} MiB) and keeps every 2 MB block they touch on the GPU until the batch "
                f"is done; this one spans at least {blocks} blocks ({blocks * E.BLOCK >> 20} MiB). Give the GPU more "
                f"memory than that (scattered faults can span up to {batch} blocks)"
            )

    # ------------------------------------------------------------ reading the state

    def drain_faults(self) -> list[int]:
        """2 MB block addresses that faulted since the last call, in order (one per block per batch)."""
        n = int(self.g[E.G_FLOG])
        size = self.flog.shape[0]
        start = max(self.flog_read, n - size)
        self.flog_read = n
        idx = np.arange(start, n) % size
        return (VA_BASE + self.flog[idx] * E.BLOCK).tolist()

    def gpu_pages(self, lo: np.ndarray, hi: np.ndarray) -> int:
        """How many of pages ``[lo[r], hi[r])`` the GPU holds (landed or in flight)."""
        return sum(int(self.pf[a:b, E.F_GPU].sum()) for a, b in zip(lo.tolist(), hi.tolist(), strict=True))


class EngineCount:
    """A backend attribute that reads the sum of engine counters ``indices`` (times ``unit``)."""

    def __init__(self, *indices: int, unit: int = 1, doc: str = "") -> None:
        self.indices = indices
        self.unit = unit
        self.__doc__ = doc

    def __get__(self, backend, owner=None):
        if backend is None:
            return self
        g = backend.engine.g
        return int(sum(g[i] for i in self.indices)) * self.unit
