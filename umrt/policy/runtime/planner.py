"""umrt's planner: a learned iteration in, a schedule of moves out.

The runtime records one iteration in its stable key space
(:class:`IterationRecord`: the launches in order with the objects each
touches and its estimated compute time, where objects are born and die, and
where module boundaries fall). :class:`Planner` turns it into a
:class:`Plan`: at each *decision point* (the launch right after a module
boundary, plus extra points where a segment is too long to plan as one), the
objects to pre-evict to the host and the objects to prefetch to the GPU, and
which objects to discard when they die (see :meth:`Planner.plan`).
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field, replace

from umrt.backends.base import BLOCK, PAGE  # the driver's units (PAGE re-exported for the runtime)
from umrt.hardware import HardwareProfile
from umrt.trace.events import Access, Alloc, Kind

INF = float("inf")


@dataclass
class IterationRecord:
    """One iteration in the runtime's key space (see :mod:`umrt.predict.tables`).

    Launch ``i`` is the i-th launch of the iteration; positions of births,
    deaths and boundaries are launch ordinals ("before launch i").
    """

    exec_ids: list[int] = field(default_factory=list)
    uses: list[tuple[int, ...]] = field(default_factory=list)  # keys each launch touches
    times: list[float] = field(default_factory=list)  # predicted compute seconds per launch
    sizes: dict[int, int] = field(default_factory=dict)  # key -> bytes
    kinds: dict[int, Kind] = field(default_factory=dict)
    start_live: set[int] = field(default_factory=set)  # keys alive when the iteration starts
    allocs: list[tuple[int, int]] = field(default_factory=list)  # (position, key)
    frees: list[tuple[int, int]] = field(default_factory=list)  # (position, key)
    boundaries: list[int] = field(default_factory=list)  # positions right after a module boundary
    carried: dict[int, int] = field(default_factory=dict)  # survivor's key -> its key next iteration
    alloc_counts: list[int] = field(default_factory=list)  # allocations before launch i (validation)
    free_counts: list[int] = field(default_factory=list)  # frees before launch i
    # Every event but launches (allocations, frees, module boundaries), in order:
    # (position, the runtime's running hash after it). The clock a runtime that
    # no longer sees launches acts on (see Plan.launch_free_end).
    launch_free_clock: list[tuple[int, int]] = field(default_factory=list)
    # The same events as tokens (see launch_free_token): what rebase() aligns.
    tokens: list[int] = field(default_factory=list)
    signature: int = 0
    # Keys that hold data from their birth in the iteration: born outside every launch (the
    # host, or a kernel umrt does not see, wrote them: a collective's output under gloo), or
    # first touched by a launch that reads them. No plan treats them as born but unwritten.
    born_written: set[int] = field(default_factory=set)
    touched: set[int] = field(default_factory=set)  # keys a launch of the iteration has touched

    def __len__(self) -> int:
        return len(self.exec_ids)

    def sizes_hash(self) -> tuple[int, int]:
        """``(count, running hash)`` of the sizes the iteration allocated, in order (:meth:`Plan.allocates`)."""
        return len(self.allocs), hash_of_sizes(self.sizes[key] for _, key in self.allocs)

    def add_alloc(self, at: int, key: int, ev: Alloc) -> None:
        """``key`` born before launch ``at``, by the allocation ``ev``."""
        self.allocs.append((at, key))
        self.sizes[key], self.kinds[key] = ev.nbytes, ev.kind
        if ev.launch == -1:  # made outside every launch: it may hold data already
            self.born_written.add(key)

    def add_uses(self, accesses: Iterable[Access], key: Callable[[int], int | None]) -> tuple[int, ...]:
        """The keys one launch touches (``key(obj)``; None: not in the record), in order,
        appended to :attr:`uses` and returned."""
        reads: dict[int, bool] = {}  # key -> whether the launch reads it
        for a in accesses:
            k = key(a.obj)
            if k is not None:
                reads[k] = reads.get(k, False) or not a.write
        for k, read in reads.items():
            if k not in self.touched:
                self.touched.add(k)
                if read and k not in self.start_live:
                    self.born_written.add(k)
        keys = tuple(reads)
        self.uses.append(keys)
        return keys


@dataclass(frozen=True, slots=True)
class Action:
    """What to do just before launch ``at`` (validated by its expected state)."""

    at: int
    exec_id: int  # the launch expected at this point
    n_alloc: int  # allocations the iteration has made by then
    n_free: int
    evict: tuple[int, ...]  # keys to move to the host
    prefetch: tuple[int, ...]  # keys to move to the GPU, in need order
    # The copy-engine path (Backend.swap: out / back): keys copied out to pinned memory
    # and discarded, keys copied back, and keys whose copy back the kernels from this
    # point on must wait for (their first reader comes before the next decision).
    swap_out: tuple[int, ...] = ()
    swap_in: tuple[int, ...] = ()
    ready: tuple[int, ...] = ()
    # Keys whose data no launch reads again though they are not freed yet: discarded when
    # the program frees them (their pages leave without a copy; a free later than recorded
    # means the data is still read), never moved.
    drop: tuple[int, ...] = ()
    # Keys born before the decision after next, holding nothing yet, that the plan holds room for
    # from here: their memory is populated on the GPU now (where the last iteration of the shape
    # placed them), not at birth, where their first kernel would wait for it.
    populate: tuple[int, ...] = ()
    # The same point on the clock of non-launch events (IterationRecord.launch_free_clock):
    # the event right before launch ``at`` and the running hash expected there;
    # -1 where no event falls between launches at - 1 and at: the runtime then
    # counts launches from event ``launch_free_from`` (-1: the iteration's start).
    launch_free_at: int = -1
    launch_free_hash: int = 0
    launch_free_from: int = -1


def sizes_hash_step(h: int, nbytes: int) -> int:
    """The running hash of an iteration's allocation sizes, after one of ``nbytes`` (the runtime
    keeps it inline, per allocation: ``Runtime.sizes_hash``)."""
    return ((h * 1000003) ^ nbytes) & HASH_MASK


def hash_of_sizes(sizes: Iterable[int]) -> int:
    """The running hash (:func:`sizes_hash_step`) of allocation sizes, in order."""
    h = 0
    for nbytes in sizes:
        h = sizes_hash_step(h, nbytes)
    return h


@dataclass
class Plan:
    """A compiled schedule for one iteration shape."""

    signature: int
    n_launches: int
    actions: list[Action]
    discard: frozenset[int]  # keys whose range is discarded when they die
    stats: dict = field(default_factory=dict)
    swap: frozenset[int] = frozenset()  # keys the plan moves through the copy engines (Backend.swap: out / back)
    # Dropped keys that survive the iteration: dead only if the next iteration is of this shape
    # (two optimizers stepped in turn: the second one's step reads the first one's gradients).
    carried_drops: frozenset[int] = frozenset()
    # Keys alive all through the iteration (weights, optimizer state) -> bytes: where most of
    # them name no live object, the program made them again and the plan moves nothing of theirs.
    persistent: dict[int, int] = field(default_factory=dict)
    migration_only: Plan | None = None  # a plan that swaps: the same shape's plan by page migration alone
    remote: frozenset[int] = frozenset()  # long-lived keys kept on the host, read over the link
    read_mostly: frozenset[int] = frozenset()  # long-lived keys only read until the optimizer step
    remote_at: dict[int, tuple[int, ...]] = field(default_factory=dict)  # oversized launch -> keys over the link
    # Per oversized launch, the keys of remote_at that it touches first (born for it, holding nothing
    # yet): placed on the host without a copy before it runs, so that its writes go over the
    # link, not into GPU pages it would evict its own reads for.
    remote_fresh: dict[int, frozenset[int]] = field(default_factory=dict)
    # Per oversized launch, the fresh key whose first bytes it writes on the GPU (key -> bytes, whole
    # 2 MB blocks that fit the room left): only the rest crosses the link, out and back for the next
    # reader (a loss's 1.6 GB gradient, for 0.5 GB missing). Only where that key is all the launch
    # reaches over the link (one that reads data there, or an optimizer's foreach writing many
    # temporaries, has pages come and go as it runs), and not where the next launch to touch the
    # key is itself oversized (it reads the key over the link where it lies: a head takes its room).
    remote_head: dict[int, dict[int, int]] = field(default_factory=dict)
    # Acting without launches: (events, running hash) at the iteration's end
    # (None: the record had no launch-free events), and where the runtime must
    # count launches until the next event: launch-free event -> (launches before
    # it, running hash there), for decisions no event precedes and oversized
    # launches (host-mapped for their own duration).
    launch_free_end: tuple[int, int] | None = None
    launch_free_resume: dict[int, tuple[int, int]] = field(default_factory=dict)
    # The recorded iteration's non-launch events as tokens (launch_free_token), in order.
    tokens: tuple[int, ...] = ()
    # Acting without launches, the program may run differently from the recorded
    # iteration (a capture can change what it allocates): the plan re-based on an
    # iteration that ran without launches (see rebase), and, in such a variant,
    # each allocation ordinal's key in the recorded iteration (None: the same).
    launch_free_variant: Plan | None = field(default=None, repr=False, compare=False)
    keymap: tuple[int, ...] | None = None
    _launch_free_index: dict[int, int] | None = field(default=None, repr=False, compare=False)
    _hashes: list[int] | None = field(default=None, repr=False, compare=False)
    _shape_hashes: list[int] | None = field(default=None, repr=False, compare=False)
    _alloc_sizes: list[int] | None = field(default=None, repr=False, compare=False)
    _sizes_hash: int | None = field(default=None, repr=False, compare=False)
    _ordinal_of: dict[int, int] | None = field(default=None, repr=False, compare=False)

    def on_events(self, actions: list[Action], resume: dict[int, tuple[int, int]], tokens: Sequence[int],
                  keymap: Sequence[int], hashes: list[int]) -> Plan:
        """These decisions placed on another iteration's non-launch events ``tokens`` (whose
        running hashes are ``hashes``; see ``launch_free.rebase``): what is derived from the
        events starts afresh."""
        return replace(self, actions=actions, launch_free_end=(len(tokens), hashes[-1]), launch_free_resume=resume,
                       tokens=tuple(tokens), keymap=tuple(keymap), launch_free_variant=None, _launch_free_index=None,
                       _hashes=hashes, _shape_hashes=None, _alloc_sizes=None, _ordinal_of=None)

    def newborns(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """``(ordinal, nbytes)`` of the allocations ``keys`` name in an iteration of this shape."""
        sizes = self._alloc_sizes
        if sizes is None:
            sizes = self._alloc_sizes = [tok >> 3 for tok in self.tokens if tok & 3 == ALLOC_TOKEN]
            if self.keymap is not None:
                self._ordinal_of = {k: o for o, k in enumerate(self.keymap)}
        of = self._ordinal_of
        out = []
        for k in keys:
            o = k if of is None else of.get(k, -1)
            if 0 <= o < len(sizes):
                out.append((o, sizes[o]))
        return out

    def allocates(self, count: int, sizes_hash: int) -> bool:
        """Whether an iteration that made ``count`` allocations, whose sizes in order have the
        running hash ``sizes_hash`` (:func:`hash_of_sizes`), allocated as this shape does."""
        if self._sizes_hash is None:
            self.newborns(())  # (fills _alloc_sizes)
            self._sizes_hash = hash_of_sizes(self._alloc_sizes or ())
        return count == len(self._alloc_sizes or ()) and sizes_hash == self._sizes_hash

    def action_at(self) -> dict[int, Action]:
        return {a.at: a for a in self.actions}

    def outlived(self, live: Container[int]) -> bool:
        """Whether at least half the bytes this plan's iteration used and kept across iterations
        are under keys not ``live`` now: the program made them again (a new model and optimizer
        for k-fold's next fold, or a sweep's next trial), and this plan would move none of the new
        ones. (What it kept but never touched does not count: a dataset freed later, say.)"""
        total = sum(self.persistent.values())
        return total > 0 and 2 * sum(n for k, n in self.persistent.items() if k not in live) >= total

    def index_at(self, launch: int) -> int | None:
        """Index of the action tied to launch ordinal ``launch``, if any."""
        i = bisect.bisect_left(self.actions, launch, key=lambda a: a.at)
        return i if i < len(self.actions) and self.actions[i].at == launch else None

    def hash_after(self, event: int, freed_sizes: bool = True) -> int | None:
        """The runtime's running hash after this shape's launch-free event ``event``
        (None past its last event): what an iteration of this shape shows there.
        Without ``freed_sizes``, a free of any size counts as one (the runtime's ``shape_hash``)."""
        if freed_sizes:
            h = self._hashes
            if h is None:
                h = self._hashes = running_hashes(self.tokens)
        else:
            h = self._shape_hashes
            if h is None:
                free = launch_free_token(1, FREE_TOKEN)  # (a free of any size: as the runtime mixes it)
                h = self._shape_hashes = running_hashes([free if tok & 3 == FREE_TOKEN else tok for tok in self.tokens])
        return h[event] if 0 <= event < len(h) else None

    def events_match(self, a: Action, n_events: int, events_hash: int, freed_sizes: bool = True) -> bool:
        """Whether an iteration that has seen ``n_events`` launch-free events, with running hash
        ``events_hash``, is where this shape is at its decision ``a``: yes unless it has seen as
        many events as the shape has there and their hash differs (the sizes allocated and
        freed, the modules entered: a short last batch runs the same kernels at other sizes).
        Without ``freed_sizes`` the hash counts a free without its size (the runtime's
        ``shape_hash``: the step after a short one frees that one's batch first). Fewer or more
        events: a live driver may deliver the launch late; the counts decide."""
        e = a.launch_free_at if a.launch_free_at >= 0 else a.launch_free_from
        if n_events != e + 1:
            return True
        expected = self.hash_after(e, freed_sizes) if e >= 0 else 0
        return expected is None or expected == events_hash

    def index_after_launch_free(self, event: int) -> int:
        """Index of the first action still to come once launch-free event ``event`` has
        been seen: placed after it, or counted from it."""
        for i, a in enumerate(self.actions):
            if a.launch_free_at > event or (a.launch_free_at < 0 and a.launch_free_from >= event):
                return i
        return len(self.actions)

    def index_at_launch_free(self, event: int) -> int | None:
        """Index of the first action tied to launch-free event ``event``, if any."""
        idx = self._launch_free_index
        if idx is None:
            idx = self._launch_free_index = {}
            for i, a in enumerate(self.actions):
                if a.launch_free_at >= 0:
                    idx.setdefault(a.launch_free_at, i)
        return idx.get(event)


ALLOC_TOKEN, FREE_TOKEN, LAYER_TOKEN = 0, 1, 2
SPARE_KEY = 1 << 32  # keys of allocations a re-based plan's recorded iteration did not make


def launch_free_token(value: int, kind: int) -> int:
    """A non-launch event as one int: the value it mixes into the runtime's running
    hash (see Runtime.on_event) and its kind (ALLOC_TOKEN, FREE_TOKEN, LAYER_TOKEN)."""
    return (value << 2) | kind


def running_hashes(tokens: Sequence[int]) -> list[int]:
    """The runtime's running hash after each token (as Runtime.on_event mixes them)."""
    out = []
    h = 0
    for tok in tokens:
        h = ((h * 1000003) ^ (tok >> 2)) & HASH_MASK
        out.append(h)
    return out


HASH_MASK = (1 << 63) - 1  # the running hash's and the iteration signature's width


def ordered_union(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """``a``, then what of ``b`` is not in it, in order."""
    seen = set(a)
    return a + tuple(k for k in b if k not in seen)


def launch_free_points(clock: Sequence[tuple[int, int]], actions: list[Action], oversized: Sequence[int]
                       ) -> tuple[list[Action], dict[int, tuple[int, int]]]:
    """Place each action on the clock of non-launch events.

    An action before launch ``at`` goes to the last event between launches
    ``at - 1`` and ``at`` (a module boundary, the launch's own output
    allocations, a free). Where there is none (inside an optimizer step:
    launch after launch, nothing allocated), the runtime counts launches
    from the last event before ``at`` to the next event (``resume``); the
    action keeps ``launch_free_at = -1`` and is acted on at its launch. It counts
    around each oversized launch the same way, so that the launch is
    host-mapped for its own duration. Positions are "before launch i"
    (IterationRecord).
    """
    pos = [p for p, _ in clock]
    placed = []
    resume: dict[int, tuple[int, int]] = {}

    def count_from(at: int) -> int:
        e = bisect.bisect_right(pos, at) - 1
        # before the iteration's first event: count from its start
        resume.setdefault(e, (pos[e], clock[e][1]) if e >= 0 else (0, 0))
        return e

    for a in actions:
        e = bisect.bisect_right(pos, a.at) - 1
        if e >= 0 and pos[e] == a.at:
            placed.append(replace(a, launch_free_at=e, launch_free_hash=clock[e][1]))
        else:
            placed.append(replace(a, launch_free_from=count_from(a.at)))
    for n in oversized:
        count_from(n)
    return placed, resume


def min_host_map_bytes(profile: HardwareProfile | None) -> int:
    """The smallest range worth host-mapping for one oversized launch: its four
    ``cudaMemAdvise`` calls (set and unset PreferredLocation and AccessedBy)
    cost what reading it over the link instead of faulting it in saves,
    ``bytes x (1 / fault path rate - 1 / link rate)``; 0 where the profile does
    not say (3.2 MiB on the H100's measured rates)."""
    if profile is None:
        return 0
    advise, fault, link = profile.advise_call_s, profile.fault_migration_rate, profile.h2d_bandwidth
    if advise <= 0 or fault <= 0 or link <= 0 or fault >= link:
        return 0
    return int(4 * advise / (1 / fault - 1 / link))


def peak_live(rec: IterationRecord) -> int:
    """The most bytes the iteration holds alive at once, from what is alive at its
    start and its allocations and frees (2 MB-block rounding aside; at a launch
    boundary, allocations are counted before frees: an upper bound). What was
    alive at the start and the iteration neither touches nor frees does not
    count (an evaluation leaves the optimizer state alone: its working set is
    the parameters and its own activations)."""
    sizes = rec.sizes
    involved = {k for keys in rec.uses for k in keys}
    involved.update(k for _, k in rec.frees)
    live = sum(sizes.get(k, 0) for k in rec.start_live if k in involved)
    peak = live
    frees = sorted((p, k) for p, k in rec.frees if k not in rec.start_live or k in involved)
    fi = 0
    for p, k in sorted(rec.allocs):
        while fi < len(frees) and frees[fi][0] < p:
            live -= sizes.get(frees[fi][1], 0)
            fi += 1
        live += sizes.get(k, 0)
        peak = max(peak, live)
    return peak


#: Decision points at least this much predicted compute apart: finer decisions cost calls and CPU
#: and gained nothing in the simulator for plans by page migration.
MIN_SEGMENT_S = 5e-3
#: ... and for plans with the copy engines, where a copy out starts at the first decision
#: after its object's last use: the GPU -> host engine bounds the forward there, and idles
#: while the compute waits at a far decision for the room those copies free (SIMULATED,
#: ``python -m bench.alternatives``: GPT-2 8x1024 fp32 at 45% of peak 2.16x -> 1.99x ideal,
#: BERT-large 32x512 fp32 at 33% 2.21x -> 2.07x).
SWAP_MIN_SEGMENT_S = 1e-3
#: Objects too small to swap stay resident in a plan that swaps, the smallest first, within this
#: share of its capacity (BERT-large's 1,341 biases, norms and their gradients and moments take
#: 88 MB, 1% of its plan at 25% of peak; ResNet-152's more than 5% of its plan at 20% of its
#: footprint). What it changed, SIMULATED: README, "umrt against what users pick instead".
SMALL_SHARE = 0.05


def swap_pays(profile: HardwareProfile | None, nbytes: int) -> bool:
    """Whether taking ``nbytes`` off the GPU and back costs less through the copy engines
    (a copy out, a discard, a population, a copy back: four runtime calls) than by page
    migration (a prefetch each way on the driver's one migration path), on the profile's
    measured costs, which are the simulator's; never for less than two pages (a discard
    needs one whole 64 KB page inside the object)."""
    if profile is None or nbytes < 2 * PAGE:
        return False
    p = profile
    migrate = p.prefetch_time(nbytes, "d2h") + p.prefetch_time(nbytes, "h2d")
    swap = 4 * p.prefetch_call_overhead_s + nbytes / p.copy_rate("d2h") + nbytes / p.copy_rate("h2d")
    return swap < migrate


def _round(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


class Planner:
    """Compiles :class:`IterationRecord` into :class:`Plan` for a budget.

    Parameters
    ----------
    budget_bytes:
        GPU memory the plan may keep resident.
    profile:
        ``umrt.hardware.HardwareProfile`` (link rate for the time window);
        ``None`` assumes a PCIe 3 link.
    headroom:
        Fraction of the budget the plan fills; the rest absorbs 2 MB-block
        rounding and allocations the record did not see.
    op_level:
        Decide before every launch instead of at module boundaries.
    max_segment_s:
        Split segments whose predicted compute exceeds this (default: the
        time to move an eighth of the budget over the link).
    min_segment_s:
        Module boundaries closer than this (in predicted compute) to the last
        decision point are not decision points: fewer, larger moves (default
        :data:`MIN_SEGMENT_S`, or :data:`SWAP_MIN_SEGMENT_S` for a plan with the
        copy engines).
    min_discard:
        Objects smaller than this are not discarded (a call costs more than
        it saves).
    short_launches:
        Objects that live across at most this many launches are never
        pre-evicted (the short-lived arena stays resident).
    early_evict:
        Issue each pre-eviction right after the victim's last use instead of
        when its room is needed.
    swap:
        The backend has the pinned-copy path (``Backend.swap.pinned_copies``: SM copies or the copy engines): an object
        the plan takes off the GPU and needs again goes by ``swap.out`` /
        ``swap.back`` where :func:`swap_pays` says that is cheaper than page
        migration for its size, by migration otherwise.
    remote_access:
        Keep optimizer state, and long-lived data only oversized launches
        touch, on the host, accessed over the link (see :meth:`remote_keys`).
    """

    def __init__(
        self,
        budget_bytes: int,
        profile: HardwareProfile | None = None,
        *,
        headroom: float = 0.9,
        op_level: bool = False,
        max_segment_s: float | None = None,
        min_segment_s: float | None = None,
        min_discard: int = PAGE,
        short_launches: int = 4,
        remote_access: bool = True,
        early_evict: bool = True,
        swap: bool = False,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        if not 0 < headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")
        self.budget = budget_bytes
        # 2 MB blocks shared between objects and arenas cost a few blocks of
        # room that object-level accounting does not see: keep 4 spare.
        self.cap = max(int(budget_bytes * headroom) // 2, min(int(budget_bytes * headroom), budget_bytes - 4 * BLOCK))
        self.profile = profile
        # Migration rates by direction (a prefetch call's data rate on the profile; the
        # H100 moved 48 GB/s to the GPU but 10-15 GB/s to the host): evictions take
        # four times as long as prefetches of the same bytes there.
        # Without a profile: 12 GB/s both ways (PCIe 3's practical rate).
        self.rate = float(profile.prefetch_h2d_rate) if profile is not None else 12e9
        self.d2h_rate = float(profile.prefetch_d2h_rate) if profile is not None else self.rate
        self.op_level = op_level
        self.swap = bool(swap and profile is not None)
        if min_segment_s is None:
            min_segment_s = SWAP_MIN_SEGMENT_S if self.swap else MIN_SEGMENT_S
        self.min_segment_s = min_segment_s
        self.max_segment_s = max_segment_s if max_segment_s is not None else (self.cap / 8) / self.rate
        self.min_discard = min_discard
        self.short_launches = short_launches
        self.remote_access = remote_access
        self.early_evict = early_evict
        # The copy engines (Backend.swap: out / back): where the backend has them and the profile
        # says what they cost. Their rates, per direction.
        self.swap_d2h_rate = float(profile.copy_rate("d2h")) if profile is not None else self.d2h_rate
        self.swap_h2d_rate = float(profile.copy_rate("h2d")) if profile is not None else self.rate

    # -- public ---------------------------------------------------------------

    def decision_points(self, rec: IterationRecord) -> list[int]:
        """Launch ordinals to act at: 0, after each module boundary, and
        wherever a segment would otherwise run longer than ``max_segment_s``
        or touch more than an eighth of the plan's capacity."""
        n = len(rec)
        if self.op_level:
            return list(range(n))
        marks = set(p for p in rec.boundaries if 0 <= p < n)
        marks.add(0)
        points: list[int] = [0]
        seg_t = 0.0
        seg_b = 0
        limit_b = self.cap // 8
        sizes = rec.sizes
        for i in range(1, n):
            seg_t += rec.times[i - 1]
            seg_b += sum(sizes.get(k, 0) for k in rec.uses[i - 1])
            if (i in marks and seg_t >= self.min_segment_s) or seg_t >= self.max_segment_s or seg_b >= limit_b:
                points.append(i)
                seg_t, seg_b = 0.0, 0
        return points

    def plan(self, rec: IterationRecord, *, fits: str | None = None) -> Plan:
        """The plan for ``rec``'s shape: a Belady schedule with prefetch; one with nothing
        to do where everything fits: the live objects at their peak, or what ``fits`` names,
        ``"held"`` (all the memory the layout has held: then no page, touched or not, is ever
        evicted) or ``"touched"`` (the 2 MB blocks the learned iteration touched).

        * **Window in time.** Walk the coming launches. Every launch up to the next
          decision point must be covered (we cannot act again before it), and the
          segment after it too, so its copies overlap this segment's compute. Beyond
          that, keep going while the copy engine's queue would drain before the next
          decision point: ``link_free < t(next point) + slack``, where ``link_free``
          is when the queued host-to-device bytes finish at the profile's link rate
          and ``t(x)`` the predicted compute time to reach launch ``x``. So the
          window is as long, in kernels, as the hardware needs to hide the missing
          bytes — short on a fast link, long on a slow one.
        * **Prefetch** each missing object of a covered launch, in the order they
          are needed (objects that are not born yet only reserve room: the runtime
          populates them on the GPU at birth where their pages are not there).
        * **Pre-evict** to make room, choosing resident objects whose next use is
          farthest ahead and never one the window needs; if nothing qualifies the
          window stops (capacity-bound), so the plan never holds more bytes than
          ``budget * headroom`` and the driver never has to evict on a fault.
        * **Host-map** what migration cannot help: optimizer state and long-lived
          data that only launches larger than the budget touch stay on the host
          (PreferredLocation=host + AccessedBy=GPU) and are read over the link.
        * **Discard** long-lived objects when they die, where the plan evicts,
          instead of letting the driver copy dead bytes back; when everything fits
          nothing is discarded (a dead range is reused in place). Short-lived
          temporaries are never evicted (they stay resident), nor, in a plan that
          swaps, objects too small to swap (``SMALL_SHARE`` of the capacity at most).

        The schedule is cyclic: it is planned twice over the iteration and the
        second pass, which starts from the residency the first one ends with, is the
        steady-state plan.
        """
        n = len(rec)
        if n == 0:
            return Plan(rec.signature, 0, [], frozenset(), {"empty": True})
        launch_free_end = (len(rec.launch_free_clock), rec.launch_free_clock[-1][1]) if rec.launch_free_clock else None
        peak = peak_live(rec)
        if peak <= self.cap or fits:
            # Everything fits: once touched, every object stays resident and a dead
            # range is reused in place. Nothing to move, advise or discard.
            stats = {"fits": True, "planned_peak_bytes": peak, "capacity_bytes": self.cap,
                     "planned_h2d_bytes": 0, "planned_d2h_bytes": 0, "decision_points": 0}
            if peak > self.cap:
                stats[f"fits_as_{fits}"] = True  # (fits_as_held: dropped once the layout outgrows the GPU)
            return Plan(rec.signature, n, [], frozenset(), stats, launch_free_end=launch_free_end, tokens=tuple(rec.tokens))
        remote = self.remote_keys(rec) if self.remote_access else frozenset()
        if remote:
            uses = [tuple(k for k in u if k not in remote) for u in rec.uses]
            rec = replace(rec, uses=uses)
        points = self.decision_points(rec)
        state = None
        away = None
        for _ in range(2):  # pass 1 warms the cyclic state; pass 2 is the plan
            start_away = away
            actions, (state, away), stats, remote_at, swapped, fresh, heads = self._pass(rec, points, state, away)
        # The plan runs cyclically: what it leaves swapped out at the iteration's end must be
        # what it expects away at the start. Where pass 2 ends with more away than it began
        # with, the first decision copies those back (and waits for them): never a read of data
        # that is only in pinned memory.
        missing = tuple(sorted(away - (start_away or set())))
        if missing and actions:
            first = actions[0]
            if first.at == 0:
                actions[0] = replace(first, swap_in=ordered_union(missing, first.swap_in),
                                     ready=ordered_union(missing, first.ready))
            else:
                actions.insert(0, Action(0, rec.exec_ids[0], (rec.alloc_counts or [0])[0], (rec.free_counts or [0])[0],
                                         (), (), (), missing, missing))
            stats["planned_restored_at_start"] = len(missing)
        # Discard what dies after a long life, where the plan evicts: its pages
        # may be evicted (or were), so dropping them saves a copy. When
        # everything fits nothing is evicted and a dead range is reused in
        # place, resident: a discard would only cost a call and a prefetch
        # before the range's next owner may use it. Short-lived temporaries
        # die resident and their range is reused at once; a call would be waste.
        # A temporary so large that its range is a sizeable share of the budget (the logits of
        # a language model's loss) is dropped too, however short its life: the pool keeps its
        # range for it, and until it comes back that memory holds dead bytes the driver would
        # copy back to make room for what the plan moves in (a newborn there is populated).
        born = {k: p for p, k in rec.allocs}
        pressure = stats["planned_d2h_bytes"] > 0 or bool(remote)
        big = max(self.min_discard, PAGE, self.cap // 8)  # more than an eighth of what the plan may hold
        discard = frozenset(
            k for p, k in rec.frees
            if rec.sizes.get(k, 0) >= max(self.min_discard, PAGE)
            and (p - born.get(k, -len(rec)) > self.short_launches or rec.sizes.get(k, 0) > big)
        ) if pressure else frozenset()
        stats["decision_points"] = len(points)
        stats["remote_bytes"] = sum(rec.sizes.get(k, 0) for k in remote)
        # Parameters: read by forward and backward, written once by the step.
        dead = {k for _, k in rec.frees}
        mostly = frozenset(k for k in rec.start_live if k not in dead and k not in remote
                           and rec.kinds.get(k) == Kind.PARAMETER)
        resume: dict[int, tuple[int, int]] = {}
        if launch_free_end is not None:
            actions, resume = launch_free_points(rec.launch_free_clock, actions, sorted(remote_at))
        carried_drops = frozenset(k for a in actions for k in a.drop if k in rec.carried)
        used = {k for keys in rec.uses for k in keys}  # (one the iteration never touches tells nothing: a dataset)
        persistent = {k: rec.sizes.get(k, 0) for k in rec.start_live if k not in dead and k in used}
        return Plan(rec.signature, n, actions, discard, stats, swap=swapped, remote=remote, read_mostly=mostly,
                    carried_drops=carried_drops, persistent=persistent,
                    remote_at=remote_at, remote_fresh=fresh, remote_head=heads, launch_free_end=launch_free_end, launch_free_resume=resume, tokens=tuple(rec.tokens))

    def oversize(self, rec: IterationRecord) -> set[int]:
        """Launches whose own working set exceeds the plan's capacity."""
        cap = self.cap
        return {i for i, keys in enumerate(rec.uses) if sum(_round(rec.sizes.get(k, 0)) for k in keys) > cap}

    def remote_keys(self, rec: IterationRecord) -> frozenset[int]:
        """Long-lived keys to keep on the host and access over the link.

        Optimizer state that one launch per step reads and rewrites (a fused
        optimizer): streaming it over the link moves the same bytes as
        migrating it in and out, without evicting anything. State that several
        launches touch (foreach AdamW reads its moments in two or three passes)
        would cross the link once per pass: it is migrated instead. Then any
        long-lived key that only launches larger than the budget touch would
        be faulted in and evicted again within that launch: it too stays on
        the host. Taking keys out can make a launch fit, so this repeats until
        stable.
        """
        dead = {k for _, k in rec.frees}
        persistent = {k for k in rec.start_live if k not in dead}
        users: dict[int, list[int]] = {}
        for i, keys in enumerate(rec.uses):
            for k in keys:
                if k in persistent:
                    users.setdefault(k, []).append(i)
        remote = {k for k in persistent if rec.kinds.get(k) == Kind.OPTIMIZER_STATE and len(users.get(k, ())) == 1}
        for _ in range(4):
            over = {i for i, keys in enumerate(rec.uses)
                    if sum(_round(rec.sizes.get(k, 0)) for k in keys if k not in remote) > self.cap}
            more = {k for k, at in users.items() if k not in remote and all(i in over for i in at)}
            if not more:
                break
            remote |= more
        return frozenset(remote)

    # -- one pass over the iteration -----------------------------------------

    def _pass(self, rec: IterationRecord, points: Sequence[int], start: set[int] | None,
              start_away: set[int] | None = None):
        n = len(rec)
        uses_of: dict[int, list[int]] = {}
        for i, keys in enumerate(rec.uses):
            for k in keys:
                lst = uses_of.setdefault(k, [])
                if not lst or lst[-1] != i:
                    lst.append(i)
        size = {k: _round(b) for k, b in rec.sizes.items()}
        born = {k: p for p, k in rec.allocs}
        t = [0.0] * (n + 1)
        for i, dt in enumerate(rec.times):
            t[i + 1] = t[i] + dt
        # Where a key is next needed after this iteration: persistent keys
        # come back at their first use; survivors under their carried key.
        dead = {k for _, k in rec.frees}
        beyond: dict[int, float] = {}
        for k, lst in uses_of.items():
            if k in rec.start_live and k not in dead:
                beyond[k] = n + lst[0]
        for k, ck in rec.carried.items():
            lst = uses_of.get(ck)
            beyond[k] = n + lst[0] if lst else INF
        # Short-lived objects (born and dead within a few launches) stay put:
        # moving them costs more than the room they free. Lifetime, not the
        # announced kind, decides: live kinds are only a best guess.
        died = {k: p for p, k in rec.frees}
        pinned = {k for k, b in born.items() if died.get(k, n + 1) - b <= self.short_launches}
        if self.swap:
            # Objects too small for the swap path (under two pages: its discard frees whole
            # 64 KB pages) would go by page migration, each a prefetch's set-up on the driver's
            # one migration path, behind the swap path's copies on the link: every population
            # issued after it would wait for those copies too. They stay put as well, the
            # smallest first, within a sliver of the capacity.
            room = self.cap * SMALL_SHARE
            for k in sorted((k for k, b in rec.sizes.items() if b < 2 * PAGE), key=lambda k: (rec.sizes[k], k)):
                if size[k] > room:
                    break
                room -= size[k]
                pinned.add(k)
        rate, d2h_rate = self.rate, self.d2h_rate
        # Keys whose data dies: born in this iteration and freed in it, or carried to the next one
        # and never used there. Only they are ever dropped; a key with no use left that never
        # dies (one the plan reads over the link, say), or one alive before the iteration (what a
        # script's teardown frees after its last step looks the same), keeps its data.
        mortal = {k for k in died if k in born} | {k for k, ck in rec.carried.items() if not uses_of.get(ck)}
        # Keys that go through the copy engines when the plan takes them off the GPU.
        # Not what a launch larger than the budget touches: that is read over the link where it
        # lies, so its data must be in its own pages (migrated there), not in pinned memory.
        mapped = {k for i in (self.oversize(rec) if self.remote_access else ()) for k in rec.uses[i]}
        swaps = ({k for k in size if k not in pinned and k not in mapped and swap_pays(self.profile, rec.sizes[k])}
                 if self.swap else set())
        swap_h2d, swap_d2h = self.swap_h2d_rate, self.swap_d2h_rate

        def out_s(k: int) -> float:
            """Seconds to take ``k`` off the GPU (a copy out, or a prefetch to the host)."""
            return size[k] / (swap_d2h if k in swaps else d2h_rate)

        def in_s(k: int) -> float:
            """Seconds to bring ``k`` back (a copy back, or a prefetch to the GPU)."""
            return size[k] / (swap_h2d if k in swaps else rate)

        def dies_first(k: int, cursor: int) -> bool:
            """Used for the last time and freed before copying it out would be
            done: evicting it would copy dead data for room its death frees anyway."""
            d = died.get(k)
            return d is not None and t[min(d, n)] - t[cursor] <= out_s(k)

        ptr = {k: 0 for k in uses_of}

        def next_use(k: int) -> float:
            lst = uses_of.get(k)
            j = ptr.get(k, 0)
            if lst is not None and j < len(lst):
                return lst[j]
            return beyond.get(k, INF)

        # residency: key -> bytes
        resident: dict[int, int] = {}
        if start:
            for k in start:
                if k in size:
                    resident[k] = size[k]
        used = sum(resident.values())
        heap: list[tuple[float, int]] = []  # (-next use, key); lazily invalidated

        def push(k: int) -> None:
            heapq.heappush(heap, (-next_use(k), k))

        for k in resident:
            push(k)
        # Keys that hold data: what was alive at the start or was born with data, then whatever
        # a launch has touched. A key born but not yet written needs room, not a copy.
        holding = set(rec.start_live) | rec.born_written

        frees = sorted(rec.frees)
        fi = 0
        # The window's own place in the frees: what dies before the launch the window reaches
        # takes no room there, though the launches before its death still use it (``gone``).
        wfi = 0
        gone: set[int] = set()
        gone_bytes = 0
        moves: list[tuple[list[int], list[int]]] = [([], []) for _ in points]  # per point: evict, prefetch
        ready: list[list[int]] = [[] for _ in points]  # per point: keys copied back that launches from it read
        drops: list[list[int]] = [[] for _ in points]  # per point: keys whose data is dead, discarded
        births: list[list[int]] = [[] for _ in points]  # per point: keys not born yet that it makes room for
        births_at = sorted(rec.allocs)
        bi = 0
        dropped = 0
        # Keys swapped out (their data is in pinned memory, not on the GPU): at the start, what
        # the cyclic plan may have left away at the end of the last iteration.
        away: set[int] = ({k for k in rec.start_live if k in swaps and k not in resident} if start_away is None
                          else {k for k in start_away if k in swaps})
        oversize = self.oversize(rec) if self.remote_access else set()
        remote_at: dict[int, list[int]] = {}  # oversized launch -> keys it reaches over the link
        fresh: dict[int, set[int]] = {}  # ... of which the launch is the first to touch
        heads: dict[int, dict[int, int]] = {}  # ... and of those, the bytes it writes on the GPU
        last_pi: dict[int, int] = {}  # key -> decision point of its last use so far
        cap = self.cap
        cursor = 0
        link_free = 0.0
        d2h_free = 0.0
        h2d = d2h = faults = late = away_peak = 0
        peak = used
        ac = rec.alloc_counts or [0] * n
        fc = rec.free_counts or [0] * n

        for pi, d in enumerate(points):
            nxt = points[pi + 1] if pi + 1 < len(points) else n
            while fi < len(frees) and frees[fi][0] <= d:
                k = frees[fi][1]
                fi += 1
                b = resident.pop(k, None)
                if b is not None:
                    used -= b
                if k in gone:
                    gone.discard(k)
                    gone_bytes -= size[k]
                away.discard(k)  # dead: its pinned copy is dropped
            evict: list[int] = []
            prefetch: list[int] = []
            if cursor < d:
                cursor = d
            link_free = max(link_free, t[d])
            # Cover this segment and the next (so the next one's copies overlap
            # this one's compute), then go on while the queued copies would
            # finish before the next decision point: the window is as long as
            # the link needs, in time.
            nxt2 = points[pi + 2] if pi + 2 < len(points) else n
            horizon = t[nxt] + (t[nxt] - t[d])
            # With the copy engines, copies out run beside copies in: the window also goes on
            # while the queued copies out would be done before the horizon, so the D2H engine
            # is never idle while room will be needed (each copy out starts right after its
            # object's last use, early_evict).
            pressed = False  # this window had to make room
            while cursor < n:
                # Beyond what the link needs in time, a plan with the copy engines goes on filling
                # the room that is free (never evicting for it): when copies back are the
                # bottleneck, the H2D engine then always has the next ranges queued.
                free_only = not (cursor < nxt2 or link_free < horizon or (pressed and swaps and d2h_free < horizon))
                if free_only and not swaps:
                    break
                while wfi < len(frees) and frees[wfi][0] <= cursor:
                    k = frees[wfi][1]
                    if k in resident and k not in gone:
                        gone.add(k)
                        gone_bytes += size[k]
                    wfi += 1
                need = [k for k in rec.uses[cursor] if k not in resident and k in size]
                nbytes = sum(size[k] for k in need)
                if free_only and used + nbytes > cap:
                    break  # (room free now, at this decision point, as the copies are issued now)
                if nbytes > cap:  # one launch larger than the budget: the driver must stream it
                    cursor += 1
                    continue
                if used - gone_bytes + nbytes > cap:
                    if (swaps and cursor >= nxt2 and need
                            and max(d2h_free, t[d]) + (used - gone_bytes + nbytes - cap) / swap_d2h > t[cursor]):
                        # Room for an early copy back would come from copies out that cannot be
                        # done before it is needed: the D2H engine is the bottleneck here, and
                        # more copies out would only delay the launches that wait for room.
                        break
                    before = len(evict)
                    used = self._make_room(heap, resident, used, cap - nbytes + gone_bytes, cursor, next_use,
                                           pinned, size, evict, spare=dies_first)
                    for k in evict[before:]:
                        if k in gone:  # evicted before its death: it no longer takes room
                            gone.discard(k)
                            gone_bytes -= size[k]
                    if len(evict) > before:  # room comes from copies to the host, on the D2H engine
                        pressed = True
                        d2h_free = max(d2h_free, t[d]) + sum(out_s(k) for k in evict[before:])
                        # The migration path is one queue both ways: prefetches wait behind the
                        # evictions on it. Copies out run on their own engine, beside the copies
                        # back (and a copy back waits only for its own room: the simulator's
                        # population makes room as a prefetch does).
                        if not swaps:
                            link_free = max(link_free, d2h_free)
                        else:
                            migrated = sum(out_s(k) for k in evict[before:] if k not in swaps)
                            if migrated:
                                link_free = max(link_free, t[d]) + migrated
                        away.update(k for k in evict[before:] if k in swaps and k in holding and next_use(k) != INF)
                    if used - gone_bytes + nbytes > cap:
                        break  # capacity-bound: the window ends here
                for k in need:
                    resident[k] = size[k]
                    used += size[k]
                    push(k)
                    if k in holding:  # holds data: move it; born but unwritten or unborn: room only
                        # born later with data (written by the host): moved at the first decision
                        # after its birth (before it, the runtime finds nothing to move)
                        pj = bisect.bisect_left(points, born[k]) if born.get(k, -1) > d else pi
                        if pi < pj < len(points) and points[pj] <= cursor:
                            moves[pj][1].append(k)
                            h2d += size[k]
                        else:
                            prefetch.append(k)
                        link_free += in_s(k)
                        if k in away:  # copied back: the kernels of its first reader's segment wait for it
                            away.discard(k)
                            ready[bisect.bisect_right(points, cursor) - 1].append(k)
                cursor += 1
            if used - gone_bytes > peak:
                peak = used - gone_bytes
            # Newborns due before the decision after next that the plan holds room for by now
            # (holding nothing yet): their memory is populated from here, ahead of their kernels.
            # Each is named at both decisions before it: its pages may come free between them.
            while bi < len(births_at) and births_at[bi][0] <= d:
                bi += 1
            j = bi
            while j < len(births_at) and births_at[j][0] < nxt2:
                if births_at[j][1] in resident and births_at[j][1] not in rec.born_written:
                    births[pi].append(births_at[j][1])
                j += 1
            if away:  # the most bytes swapped out at once: the pinned staging it needs
                away_peak = max(away_peak, sum(size[k] for k in away))
            evict = [k for k in evict if k in holding]  # unwritten pages hold nothing to move
            # Pre-evict as early as it is safe: right after the victim's last
            # use, so its copy-out is long done when the room is needed and the
            # prefetch that needs the room never waits for it. A victim no launch
            # uses again holds dead data: it is dropped (discarded), not copied.
            for k in evict:
                at = last_pi.get(k, -1) + 1 if self.early_evict else pi
                if swaps and k in mortal and next_use(k) == INF:  # (a backend with the copy engines can discard)
                    drops[min(at, pi)].append(k)
                    dropped += size[k]
                    continue
                moves[min(at, pi)][0].append(k)
                d2h += size[k]
            moves[pi][1].extend(prefetch)
            h2d += sum(size[k] for k in prefetch)
            # Run the segment: what the window did not cover faults in.
            for i in range(d, nxt):
                while fi < len(frees) and frees[fi][0] <= i:
                    k = frees[fi][1]
                    fi += 1
                    b = resident.pop(k, None)
                    if b is not None:
                        used -= b
                    if k in gone:
                        gone.discard(k)
                        gone_bytes -= size[k]
                    away.discard(k)
                big = i in oversize
                for k in rec.uses[i]:
                    if k not in size:
                        continue
                    if k in away:
                        # Swapped out and not brought back by a window: its data is only in
                        # pinned memory, so it is copied back now and this segment waits for it
                        # (never faulted in, never read over the link: both would read nothing).
                        away.discard(k)
                        late += 1
                        moves[pi][1].append(k)
                        ready[pi].append(k)
                        h2d += size[k]
                        resident[k] = size[k]
                        used += size[k]
                        if used > cap:
                            used = self._make_room(heap, resident, used, cap, i, next_use, pinned, size, [])
                    if big and k not in resident:
                        # Larger than the budget: what is not resident is read
                        # and written over the link for this launch only.
                        remote_at.setdefault(i, []).append(k)
                        if k not in holding:
                            fresh.setdefault(i, set()).add(k)
                            # its first whole blocks that fit the room left stay on the GPU (Plan.remote_head)
                            later = uses_of[k][ptr.get(k, 0) + 1] if ptr.get(k, 0) + 1 < len(uses_of[k]) else n
                            head = min(size[k] - PAGE, (cap - used - sum(heads.get(i, {}).values())) // BLOCK * BLOCK)
                            if head > 0 and later not in oversize:
                                heads.setdefault(i, {})[k] = head
                        ptr[k] = ptr.get(k, 0) + 1
                        last_pi[k] = pi
                        holding.add(k)
                        push(k)
                        continue
                    if k not in resident:
                        faults += 1
                        resident[k] = size[k]
                        used += size[k]
                        if used > cap:  # the driver evicts; model it as farthest-first
                            used = self._make_room(heap, resident, used, cap, i, next_use, pinned, size, [])
                    ptr[k] = ptr.get(k, 0) + 1
                    last_pi[k] = pi
                    holding.add(k)
                    push(k)
        while fi < len(frees):  # deaths after the last launch (zero_grad after the step)
            resident.pop(frees[fi][1], None)
            away.discard(frees[fi][1])
            fi += 1
        # What the next iteration starts with: survivors under their carried keys.
        carried = {c for c in (rec.carried.get(k, k) for k in resident) if c in rec.start_live}
        out = [k for ev, _ in moves for k in ev if k in swaps]
        stats = {"planned_h2d_bytes": h2d, "planned_d2h_bytes": d2h, "planned_faults": faults,
                 "planned_peak_bytes": peak, "capacity_bytes": cap,
                 "planned_swap_out_bytes": sum(size[k] for k in out), "planned_late_swap_ins": late,
                 "planned_drop_bytes": dropped, "planned_swap_peak_bytes": away_peak}
        actions = [Action(d, rec.exec_ids[d], ac[d], fc[d],
                          tuple(k for k in ev if k not in swaps), tuple(k for k in pf if k not in swaps),
                          tuple(k for k in ev if k in swaps), tuple(k for k in pf if k in swaps), tuple(rd), tuple(dr),
                          tuple(po))
                   for d, (ev, pf), rd, dr, po in zip(points, moves, ready, drops, births, strict=True)
                   if ev or pf or rd or dr or po]
        # ... and what it leaves swapped out, under the keys the next iteration knows them by.
        end_away = {c for c in (rec.carried.get(k, k) for k in away) if c in rec.start_live}
        heads = {i: h for i, h in heads.items() if len(remote_at[i]) == 1}  # (see Plan.remote_head)
        return (actions, (carried, end_away), stats, {i: tuple(ks) for i, ks in remote_at.items()},
                frozenset(out), {i: frozenset(ks) for i, ks in fresh.items()}, heads)

    @staticmethod
    def _make_room(heap, resident, used, target, cursor, next_use, pinned, size, out, spare=None) -> int:
        """Evict farthest-next-use keys not needed before ``cursor`` until
        ``used <= target``; returns the new ``used``. Keys with no use left
        that ``spare(key, cursor)`` says to keep are passed over."""
        keep: list[tuple[float, int]] = []
        while used > target and heap:
            neg, k = heapq.heappop(heap)
            if k not in resident:
                continue
            nu = next_use(k)
            if -neg != nu:
                continue  # stale entry; a fresher one is in the heap
            if nu <= cursor or k in pinned or (nu == INF and spare is not None and spare(k, cursor)):
                keep.append((neg, k))
                if nu <= cursor:
                    break  # everything left is needed sooner
                continue
            del resident[k]
            used -= size[k]
            out.append(k)
        for item in keep:
            heapq.heappush(heap, item)
        return used
