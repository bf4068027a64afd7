"""DeepUM (Jung, Kim, Lee, ASPLOS 2023): correlation prefetching for CUDA
Unified Memory, as a policy over any backend.

DeepUM is a driver-level system: its kernel module sees every GPU page fault
and its user-level runtime wraps every kernel launch (an *execution id* per
kernel name + arguments) and every allocation of PyTorch's caching allocator,
which it redirects to managed memory. Everything below uses only that:

* **Execution-id correlation table** — "3 previous ids -> next id", keeping
  the full history of successors (with counts) to predict the next kernels.
* **UM-block correlation tables** — one per execution id, at 2 MB UM-block
  granularity: 2048 rows, 2-way set-associative, 4 successor blocks per row
  (the paper's best of 13 configurations), plus a *start* block (first block
  faulted after entering the id) and an *end* block (last one before leaving).
  Learned from the faults the backend reports (``drain_faults()``).
* **Prefetch chaining** — starting at the current kernel, walk each predicted
  kernel's table from its start block, then predict the next kernel and
  continue, until the next ``degree`` (N = 32) kernels are covered; resume as
  kernels finish.
* **Pre-eviction** — when GPU memory is full, evict ahead of demand the blocks
  least recently migrated that are not expected in the current or next N
  kernels.
* **Invalidation** — when the caching allocator takes a block back (a Free
  after which no live object overlaps a 2 MB block), the block's contents are
  discarded instead of being copied back to the host; such dead blocks are
  the first pre-eviction victims (the driver's own order, uvm_pmm_gpu.c).
  DeepUM does this inside its own driver; on a stock CUDA 13 driver the call
  is ``cudaMemDiscardBatchAsync``, after which a kernel write refaults at
  0.8 GB/s, so a block reused for a new object is populated first.

Residency is tracked the way the driver orders it (by migration time), from
the faults and the policy's own migrations; where the backend does not report
faults (no ``drain_faults``), the tables stay empty and only invalidation acts.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from umrt.backends.base import HOST, ReportsFaults
from umrt.errors import ConfigError
from umrt.policy.base import Policy, PolicyContext
from umrt.policy.peers._common import BLOCK, BlockLiveness, block_ranges, blocks_of
from umrt.trace.events import Alloc, Free, Launch

__all__ = ["DeepUMPolicy", "BlockCorrelationTable"]

# Table geometry from the paper (Section 5, "best of 13 configurations").
TABLE_ROWS = 2048
TABLE_WAYS = 2
TABLE_SETS = TABLE_ROWS // TABLE_WAYS
TABLE_SUCCESSORS = 4
HISTORY = 3  # execution ids of context in the execution-id correlation table
MAX_BLOCKS_PER_KERNEL = TABLE_ROWS  # a walk never visits more rows than the table holds


class BlockCorrelationTable:
    """DeepUM's UM-block correlation table of one execution id.

    Rows are indexed by the 2 MB block number modulo the number of sets; each
    set holds ``TABLE_WAYS`` rows (least recently updated replaced first) and
    each row up to ``TABLE_SUCCESSORS`` successor blocks (most recent first).
    """

    __slots__ = ("_sets", "start", "end", "version")

    def __init__(self) -> None:
        self._sets: dict[int, list[list]] = {}
        self.start: int | None = None
        self.end: int | None = None
        self.version = 0

    def record(self, faults: list[int]) -> None:
        """Learn from the blocks one launch of this execution id faulted on, in order.

        The start block is the first block ever faulted under this id; later
        faults extend the chain from the current end block.
        """
        if not faults:
            return
        if self.start is None:
            self.start = faults[0]
        elif self.end is not None and faults[0] != self.start:
            # Blocks still faulting once prefetching works are the ones the chain
            # misses: hang them after its end so the walk keeps covering the rest.
            faults = [self.end, *faults]
        self.end = faults[-1]
        for a, b in zip(faults, faults[1:], strict=False):
            if a != b:
                self._link(a, b)
        self.version += 1

    def _link(self, a: int, b: int) -> None:
        rows = self._sets.setdefault((a // BLOCK) % TABLE_SETS, [])
        for i, row in enumerate(rows):
            if row[0] == a:
                succ = row[1]
                if b in succ:
                    succ.remove(b)
                succ.insert(0, b)
                del succ[TABLE_SUCCESSORS:]
                rows.insert(0, rows.pop(i))
                return
        rows.insert(0, [a, [b]])
        del rows[TABLE_WAYS:]

    def successors(self, a: int) -> list[int]:
        for row in self._sets.get((a // BLOCK) % TABLE_SETS, ()):
            if row[0] == a:
                return row[1]
        return []

    def walk(self) -> list[int]:
        """The blocks to prefetch for this id: from the start block, following
        successors breadth-first (the chain DeepUM's prefetcher follows)."""
        if self.start is None:
            return []
        seen = {self.start}
        order = [self.start]
        queue = deque(order)
        while queue and len(order) < MAX_BLOCKS_PER_KERNEL:
            for b in self.successors(queue.popleft()):
                if b not in seen:
                    seen.add(b)
                    order.append(b)
                    queue.append(b)
        return order


class DeepUMPolicy(Policy):
    """Fault-driven correlation prefetching with pre-eviction and invalidation.

    Options: ``degree`` (prefetch degree N, kernels ahead; default 32),
    ``prefetch`` / ``pre_evict`` / ``invalidate`` (switch each mechanism, for
    the paper's ablation; all on by default).
    """

    name = "deepum"

    def __init__(self, trace=None, *, degree: int = 32, prefetch: bool = True,
                 pre_evict: bool = True, invalidate: bool = True) -> None:
        if int(degree) < 1:
            raise ConfigError(f"deepum: degree must be >= 1, got {degree}")
        self.degree = int(degree)
        self.do_prefetch = bool(prefetch)
        self.do_pre_evict = bool(pre_evict)
        self.do_invalidate = bool(invalidate)
        # The trace is not used: DeepUM learns online from launches and faults.
        self._hist: deque[int] = deque(maxlen=HISTORY)
        self._successors: dict[tuple, dict[int, list[int]]] = {}
        self._tables: dict[int, BlockCorrelationTable] = {}
        self._walks: dict[int, tuple[int, list[int]]] = {}  # exec id -> (table version, walk)
        self._prev_exec: int | None = None
        self._tick = 0
        # Prefetch window: kernels predicted after the current one, with the blocks issued for each.
        self._window: deque[tuple[int, list[int]]] = deque()
        self._current_blocks: list[int] = []
        self._protected: dict[int, int] = {}  # block -> window entries needing it
        self._migrated: OrderedDict[int, None] = OrderedDict()  # resident blocks, least recently migrated first
        self._dead: OrderedDict[int, None] = OrderedDict()  # resident blocks whose contents were discarded
        self._live = BlockLiveness()
        self.counters = {"prefetched_blocks": 0, "pre_evicted_blocks": 0, "discarded_blocks": 0,
                         "faulted_blocks": 0, "mispredictions": 0}

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        self._drain = ctx.backend.drain_faults if isinstance(ctx.backend, ReportsFaults) else None

    # -- events -----------------------------------------------------------------

    def on_event(self, event) -> None:
        if isinstance(event, Launch):
            self._on_launch(event)
        elif isinstance(event, Alloc):
            ptr = self.ctx.layout.address(event.obj)
            self._live.alloc(event.obj, ptr, event.nbytes)
            reused = []
            for b in blocks_of(ptr, max(event.nbytes, 1)):
                if b in self._dead:  # the allocator reuses a dead block: live again where it is
                    del self._dead[b]
                    self._migrated[b] = None
                    reused.append(b)
            if reused:
                # DeepUM's driver drops a dead block's pages in place; on a stock CUDA 13 driver
                # a kernel writing discarded pages refaults at 0.8 GB/s (h100-measured.md), so a
                # user-level DeepUM populates them first, as umrt's runtime does.
                self.ctx.backend.populate(block_ranges(reused))
        elif isinstance(event, Free):
            dead = self._live.free(event.obj)
            if dead and self.do_invalidate:
                self.ctx.backend.discard(block_ranges(dead))
                self.counters["discarded_blocks"] += len(dead)
                for b in dead:
                    if self._migrated.pop(b, 0) is None:
                        self._dead[b] = None  # resident but dead: the first victim, free to evict

    def _on_launch(self, launch: Launch) -> None:
        self._learn_faults()
        e = launch.exec_id
        self._tick += 1
        if len(self._hist) == HISTORY:
            succ = self._successors.setdefault(tuple(self._hist), {})
            entry = succ.setdefault(e, [0, 0])
            entry[0] += 1
            entry[1] = self._tick
        self._hist.append(e)
        self._prev_exec = e
        if not self.do_prefetch:
            return
        self._release(self._current_blocks)
        if self._window and self._window[0][0] == e:
            _, self._current_blocks = self._window.popleft()
        else:
            # Misprediction (or nothing learned yet): restart the chain at this kernel.
            if self._window:
                self.counters["mispredictions"] += 1
            for _, blocks in self._window:
                self._release(blocks)
            self._window.clear()
            self._current_blocks = self._issue(self._walk(e))
        self._extend_window()

    # -- learning ---------------------------------------------------------------

    def _learn_faults(self) -> None:
        if self._drain is None or self._prev_exec is None:
            return
        faults = list(self._drain())
        if not faults:
            return
        self.counters["faulted_blocks"] += len(faults)
        table = self._tables.get(self._prev_exec)
        if table is None:
            table = self._tables[self._prev_exec] = BlockCorrelationTable()
        table.record(faults)
        for b in faults:  # a fault is a migration: the block is now the most recent
            self._dead.pop(b, None)
            self._migrated[b] = None
            self._migrated.move_to_end(b)
        self._trim()

    def _predict(self, hist: tuple) -> int | None:
        succ = self._successors.get(hist)
        if not succ:
            return None
        # Most frequent successor; the most recent one among equals.
        return max(succ.items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]

    def _walk(self, e: int) -> list[int]:
        table = self._tables.get(e)
        if table is None:
            return []
        cached = self._walks.get(e)
        if cached is not None and cached[0] == table.version:
            return cached[1]
        walk = table.walk()
        self._walks[e] = (table.version, walk)
        return walk

    # -- acting -----------------------------------------------------------------

    def _extend_window(self) -> None:
        hist = list(self._hist) + [k for k, _ in self._window]
        while len(self._window) < self.degree:
            nxt = self._predict(tuple(hist[-HISTORY:]))
            if nxt is None:
                return
            if self._window and (len(self._protected) + len(self._walk(nxt))) * BLOCK > self._capacity():
                return  # the window would not fit in GPU memory: chaining further only thrashes
            blocks = self._issue(self._walk(nxt))
            if blocks is None:
                return  # memory full of blocks the window needs: stop chaining for now
            self._window.append((nxt, blocks))
            hist.append(nxt)

    def _issue(self, walk: list[int]) -> list[int] | None:
        """Protect and prefetch one kernel's blocks; ``None`` when they do not fit."""
        missing = [b for b in walk if b not in self._migrated]
        if missing:
            room = self._free_bytes()
            need = len(missing) * BLOCK
            if need > room:
                if self.do_pre_evict:
                    room += self._pre_evict(need - room, set(walk))
                if need > room and self._window:
                    return None
            self.ctx.backend.prefetch(block_ranges(missing), self.ctx.backend.device)
            self.counters["prefetched_blocks"] += len(missing)
        for b in missing:  # only a migration moves a block in the driver's eviction order
            self._dead.pop(b, None)
            self._migrated[b] = None
        if missing:
            self._trim()
        for b in walk:
            self._protected[b] = self._protected.get(b, 0) + 1
        return walk

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            n = self._protected.get(b, 0) - 1
            if n <= 0:
                self._protected.pop(b, None)
            else:
                self._protected[b] = n

    def _pre_evict(self, nbytes: int, also_keep: set[int]) -> int:
        """Evict ahead of demand: dead blocks first (nothing to copy), then the
        least recently migrated blocks outside the window; return bytes freed."""
        victims = []
        while self._dead and len(victims) * BLOCK < nbytes:
            victims.append(self._dead.popitem(last=False)[0])
        for b in self._migrated:
            if len(victims) * BLOCK >= nbytes:
                break
            if b not in self._protected and b not in also_keep:
                victims.append(b)
        if not victims:
            return 0
        for b in victims:
            self._migrated.pop(b, None)
        self.ctx.backend.prefetch(block_ranges(victims), HOST)
        self.counters["pre_evicted_blocks"] += len(victims)
        return len(victims) * BLOCK

    def _capacity(self) -> int:
        try:
            return self.ctx.backend.mem_info()[1]
        except NotImplementedError:
            return self.ctx.budget_bytes

    def _free_bytes(self) -> int:
        """Free device memory as the driver sees it."""
        try:
            free, total = self.ctx.backend.mem_info()
        except NotImplementedError:
            total = self.ctx.budget_bytes
            free = total - (len(self._migrated) + len(self._dead)) * BLOCK
        self._trim(total)
        return max(0, free)

    def _trim(self, total: int | None = None) -> None:
        """The driver evicts on demand, dead blocks first, then in migration order
        (uvm_pmm_gpu.c), the order these lists keep: forget the entries it must
        have evicted for everything to fit."""
        if total is None:
            total = self._capacity()
        excess = len(self._migrated) + len(self._dead) - total // BLOCK
        while excess > 0 and self._dead:
            self._dead.popitem(last=False)
            excess -= 1
        while excess > 0 and self._migrated:
            self._migrated.popitem(last=False)
            excess -= 1

    def report(self) -> dict:
        return dict(self.counters, execution_ids=len(self._tables))
