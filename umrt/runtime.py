"""The umrt runtime: events in, prefetch / pre-evict / discard out.

:class:`Runtime` is a :class:`~umrt.policy.base.Policy` (registered as
``"umrt"``). It consumes the program's event stream one event at a time —
from the live :class:`umrt.capture.Recorder`, or from a replay in the
simulator — and drives any :class:`~umrt.backends.base.Backend` through that
interface only. It never looks ahead in the stream.

Life cycle, per iteration (between two :class:`IterationBoundary` events):

``learn``
    Record the iteration in stable keys (:mod:`umrt.predict.tables`): every
    launch, what it touches, where objects are born and die, where module
    boundaries fall; feed the correlation and data tables. The runtime does
    nothing to memory (plain managed-memory behaviour). At the boundary the
    iteration's signature is known; :class:`~umrt.policy.planner.Planner`
    compiles a :class:`~umrt.policy.planner.Plan` for it (cached per
    signature, so a few iteration shapes — eval steps, sequence-length
    buckets — are each learned once).
``act``
    The variant table predicts which shape comes next; its plan runs. The
    per-event work is a counter for launches and a dictionary update for
    allocations and frees; the real work happens only at the plan's decision
    points (module boundaries by default, at least ~5 ms of predicted compute
    apart), where the expected launch and allocation counts are checked
    before any move is issued. A mismatch is a deviation: the runtime first
    tries another learned shape that matches there (an eval step instead of
    a train step) and continues with its plan; otherwise it stops acting. A
    plan not yet confirmed by two full iterations is acted on while the
    iteration is still recorded, so a deviation turns it into a learned one;
    a trusted plan runs without a record (cheapest), and after a deviation
    the next iteration is learned. A trusted plan whose objects came back at
    the same addresses as in the last iteration of its shape is *frozen*:
    its decisions reuse their memoized ranges without resolving a single key,
    while every allocation is still checked against that reference (one that
    lands elsewhere ends freezing for the iteration). Discards never rely on
    it: they always use the freed object's own address.

    A trusted plan also runs *without launches* (``launch_free``, default):
    its decisions are placed on the clock of the other events — allocations,
    frees, module boundaries — which a live driver gets from the allocator
    and module hooks, without capturing ops (the costly part of capture). The
    iteration is checked against its plan by a running hash of every
    allocation's size, every freed size and every module boundary, at each
    decision and at the iteration's end. ``wants_launches`` tells the driver
    when launches are needed after all: from the event before a decision that
    no event precedes (inside an optimizer step) or an oversized launch, to
    the next event, and for every iteration that is learned or probed.

Discards and newborns. While acting, the plan's long-lived dead objects
are discarded when they die (only where the plan evicts: when everything
fits, nothing is discarded and a dead range is reused in place), batched
until the next allocation or launch: before any newborn can be written into
a dead range (``discard_on_free`` for a driver whose events arrive after
their op's kernel was queued). In every mode, a newborn placed on pages umrt
took off the GPU (discarded, evicted, host-mapped) or that nobody populated
yet (a new pool segment) is prefetched to the GPU before its kernel runs:
on the H100 a kernel writing discarded memory refaults at 0.8 GB/s and a
first touch populates at 3.4-8 GB/s, where a prefetch populates 2 GiB in
~11 ms (``../shared/reference/h100-measured.md``).
``guard``
    If plans keep failing part-way (``guard_failures`` of the last
    ``guard_window`` acted iterations deviate after their first decision
    point held; a deviation at the very first one just means a new shape,
    learned at once), predictions are not paying: the
    runtime drops its plans, does nothing for ``guard_cooldown`` iterations
    and re-learns.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import replace
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

from umrt.backends.base import HOST, Advice, Backend, SegmentWatch
from umrt.backends.ranges import RangeSet
from umrt.policy.base import Policy, PolicyContext
from umrt.policy.planner import (
    PAGE,
    SPARE_KEY,
    Action,
    IterationRecord,
    Plan,
    Planner,
    min_host_map_bytes,
    rebase,
)
from umrt.predict.tables import CorrelationTable, DataTable, ObjectKeys, VariantTable
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit

if TYPE_CHECKING:  # pragma: no cover
    from umrt.memory.base import Layout
    from umrt.trace.events import Event, Trace

__all__ = ["Runtime"]


class _Unknown:
    """What the runtime knows of an object it never saw allocated."""

    __slots__ = ()
    nbytes = 0
    kind = None


_NOINFO = _Unknown()


class _Where:
    """Where a live object is: ``.ptr`` and ``.nbytes`` (as the pool's live records)."""

    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


_PTR_N = attrgetter("ptr", "nbytes")  # a live record -> (ptr, nbytes), at C speed
_N = itemgetter(1)  # a range -> its bytes
_MEMO_MAX = 4096  # memoized decision ranges kept (cleared beyond; 8 shapes x ~300 decisions fit)


class _AddressIndex:
    """``obj -> _Where`` over ``Layout.address`` and the runtime's own sizes,
    for a layout without a ``live_index`` (the caching-allocator model)."""

    __slots__ = ("_address", "_info")

    def __init__(self, address, info: dict) -> None:
        self._address, self._info = address, info

    def __getitem__(self, obj: int) -> _Where:
        return _Where(self._address(obj), self._info.get(obj, _NOINFO).nbytes)


_MASK = (1 << 63) - 1  # the iteration signature's width
_MAX_REBASES = 2  # light clocks re-based per plan before a mismatch counts as a deviation


def _ref_key(plan: Plan) -> tuple[int, bool]:
    """What an iteration's addresses (by allocation ordinal) are a reference for: the
    plan's shape, run with launches or as its light variant (other ordinals)."""
    return plan.signature, plan.keymap is not None


class Runtime(Policy):
    """umrt's runtime policy (see the module docstring).

    Parameters
    ----------
    trace:
        Ignored: the runtime learns from the events it is given, never from a
        trace's future (the argument exists for the policy registry).
    op_level:
        Act before every launch instead of at module boundaries.
    headroom:
        Fraction of the budget a plan may fill.
    learn_iterations:
        Iterations to learn before acting the first time (2: a training
        loop's first step is special — lazy optimizer state, no gradients to
        free — so the plan comes from the second).
    probe_iterations:
        Iterations a new plan is acted on while still recorded launch by
        launch (a deviation then teaches the runtime the new shape) before it
        is trusted and runs without launches; 0 for a capture that delivers an
        iteration's launches only at its end.
    guard_window, guard_failures, guard_cooldown:
        The misprediction guard (see the module docstring).
    max_variants:
        Compiled plans kept (one per iteration shape; least recently used dropped).
    min_discard:
        Freed objects at least this large have their pages discarded.
    read_mostly:
        Advise parameters ReadMostly while acting, so evicting them costs no
        copy back. Off by default: in the simulator it changes iteration time
        by under 0.3% (parameter evictions are a small share of the traffic).
    freeze:
        Let a trusted plan whose objects keep their addresses (each allocation
        is checked against the last iteration of the same shape) reuse its
        decisions' ranges without resolving any key: the cheapest steady
        state. Moves are the same either way.
    use_pool:
        Run with umrt's :class:`~umrt.memory.pool.LifetimePool` (default) or
        the caching-allocator layout.
    launch_free:
        Act on a trusted plan from allocations, frees and module boundaries
        alone (``wants_launches`` turns False: a live driver may stop
        capturing launches, the costly part of capture). Off, or with
        ``op_level`` (a decision before every launch needs them all): every
        iteration is followed launch by launch.
    discard_on_free:
        Discard a dead range at its ``Free`` instead of at the next
        allocation or launch: for a driver whose events arrive after the
        op's kernel was queued (a newborn's kernel may already be writing
        the range the pending discard would drop).
    """

    name = "umrt"

    def __init__(
        self,
        trace: Trace | None = None,
        *,
        op_level: bool = False,
        headroom: float = 0.9,
        learn_iterations: int = 2,
        probe_iterations: int = 2,
        guard_window: int = 4,
        guard_failures: int = 3,
        guard_cooldown: int = 2,
        max_variants: int = 8,
        use_pool: bool = True,
        min_discard: int = PAGE,
        read_mostly: bool = False,
        freeze: bool = True,
        launch_free: bool = True,
        discard_on_free: bool = False,
    ) -> None:
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        if learn_iterations < 1:
            raise ValueError("learn_iterations must be >= 1")
        if probe_iterations < 0:
            raise ValueError("probe_iterations must be >= 0")
        self.probe_iterations = probe_iterations
        self.op_level = op_level
        self.headroom = headroom
        self.learn_iterations = learn_iterations
        self.guard_window = guard_window
        self.guard_failures = guard_failures
        self.guard_cooldown = guard_cooldown
        self.max_variants = max_variants
        self.use_pool = use_pool
        self.min_discard = min_discard
        self.read_mostly = read_mostly
        self.freeze = freeze
        self.launch_free = launch_free and not op_level
        self.discard_on_free = discard_on_free
        # False while the runtime acts without launches (a live driver may stop capturing them).
        self.wants_launches = True

        self.keys = ObjectKeys()
        self.correlation = CorrelationTable()
        self.data = DataTable()
        self.variants = VariantTable()
        self.plans: OrderedDict[int, Plan] = OrderedDict()

        self._info: dict[int, Alloc] = {}  # live obj -> its Alloc event (bytes, kind)
        # Keys whose range is discarded when they die: the acting plan's (none while
        # learning: without a plan there is no pressure to relieve, and a discarded
        # range costs a prefetch before its next owner may use it).
        self._discard_keys: frozenset[int] = frozenset()
        # Pages umrt itself took off the GPU (discarded, evicted, host-mapped) or that
        # no one has populated yet (new pool segments): a newborn landing on them is
        # prefetched to the GPU before its kernel (see _populate).
        self._away = RangeSet()
        self._away_ends = self._away.ends  # empty while nothing is away (the hot path's test)
        self._mode = "learn"
        self._iteration: int | None = None
        self._learned = 0
        self._cooldown = 0
        self._relearn = False
        self._confirmed: dict[int, int] = {}  # signature -> iterations its plan ran through
        self._outcomes: deque[bool] = deque(maxlen=guard_window)
        self._rec: IterationRecord | None = None
        self._sig = 0
        self._plan: Plan | None = None
        self._actions: list[Action] = []
        self._ai = 0
        self._next_at = -1  # the next decision's launch ordinal, when launches decide it
        self._light = False  # acting on the clock of non-launch events (launch_free): implies mode act
        self._next_light = -1  # the next decision's light event, when that clock decides it
        self._counting = False  # acting light, but counting launches for decisions no event precedes
        self._resume: dict[int, tuple[int, int]] = {}
        self._resume_at: list[int] = []  # its events, in order
        self._due = -1  # the next light event something is due at (-1: none)
        self._ne = 0  # non-launch events this iteration
        self._lh = 0  # their running hash (sizes, freed sizes, module names)
        self._nl = 0
        self._nf = 0
        self._probe = 0
        # Acting without launches on a plan whose light clock is not yet confirmed:
        # this iteration's non-launch events as tokens (see planner.rebase), and the
        # plan variant's allocation ordinal -> key map (None: ordinals are keys).
        self._tokens: list[int] | None = None
        self._token_objs: list[int] = []  # the objects those allocation tokens announced
        self._keymap: tuple[int, ...] | None = None
        self._light_ok: set[int] = set()  # signatures whose light clock ran a whole iteration
        self._light_failed = False  # this iteration left its plan while acting without launches
        self._seek = 0  # iterations still learned to find a shape that ran without launches
        self._rebased: dict[int, int] = {}  # signature -> times its light clock was re-based
        self._advised: dict[int, tuple[int, int]] = {}  # host-mapped obj -> range
        self._mostly: set[int] = set()  # objects advised ReadMostly
        self._over: dict[int, tuple[int, ...]] = {}  # the acting plan's oversized launches
        self._temp: list[tuple[int, int]] = []  # ranges host-mapped for the launch that just ran
        self._pending: list[tuple[int, int]] = []  # dead ranges to discard before the next allocation or launch
        # Decision ranges memoized per key tuple (see _resolve), evictions and prefetches apart.
        self._memo_evict: dict[int, tuple] = {}
        self._memo_prefetch: dict[int, tuple] = {}
        # Frozen: a trusted plan whose objects keep their addresses (checked at
        # every allocation against the last iteration of the same shape) reuses
        # its memoized decision ranges without resolving a key (see _resolve).
        self._frozen = False
        self._ptrs: list[int] | None = None  # this iteration's addresses, by allocation ordinal
        self._ref: tuple[int, list[int]] | None = None  # (signature, addresses) of the last full iteration
        self._n_discard_calls = 0  # hot counters as attributes (report() adds them up)
        self._n_discarded = 0
        self._n_populate_calls = 0
        self._n_populated = 0
        self.counters = {
            "iterations": 0, "learned": 0, "acted": 0, "deviations": 0, "guard_trips": 0,
            "plans_compiled": 0, "decisions": 0, "prefetch_calls": 0, "prefetched_bytes": 0,
            "evicted_bytes": 0, "discarded_bytes": 0, "unresolved": 0, "host_mapped_bytes": 0, "switches": 0, "discard_calls": 0, "launch_host_mapped_bytes": 0,
            "frozen_iterations": 0, "unfreezes": 0, "light_iterations": 0, "late_decisions": 0, "light_rebases": 0,
        }
        self.log: list[dict] = []  # one line per iteration: mode, signature, moves

    # -- Policy -----------------------------------------------------------------

    @property
    def warmup_iterations(self) -> int:
        """Learned iterations, then ``probe_iterations`` acted on while still
        recorded before the plan is trusted and runs in steady state."""
        return self.learn_iterations + self.probe_iterations

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        self.backend: Backend = ctx.backend
        self.layout: Layout = ctx.layout
        # obj -> record with .ptr and .nbytes: the pool's own index (a dict lookup
        # instead of a call per address on the hot path), else one over address().
        lives = getattr(ctx.layout, "live_index", None)
        self._lives = lives if lives is not None else _AddressIndex(ctx.layout.address, self._info)
        self.profile = ctx.profile
        self.set_budget(ctx.budget_bytes)

    def set_budget(self, budget_bytes: int) -> None:
        """Change the GPU memory the runtime plans for (plans are recompiled
        lazily). Shadow mode sets it once the peak is known."""
        self.ctx.budget_bytes = int(budget_bytes)
        self.planner = Planner(max(1, int(budget_bytes)), self.profile, headroom=self.headroom,
                               op_level=self.op_level)
        self.plans.clear()
        self._light_ok.clear()
        self._rebased.clear()
        if self._mode == "act":
            self._mode = "off"
            self._light = self._counting = False
            self._due = -1
            self.wants_launches = True
            self._discard_keys = frozenset()
            self._over = {}

    def make_layout(self, backend: Backend, *, live_feed: bool = False) -> Layout:
        """umrt's lifetime-aware pool (the caching-allocator model with
        ``use_pool=False``); ``live_feed``: the pool as a live allocator feeds it
        (kinds unknown at allocation, see :class:`~umrt.memory.pool.LifetimePool`)."""
        if self.use_pool:
            from umrt.memory.pool import LifetimePool

            return LifetimePool(SegmentWatch(backend, self._segment_made, self._released), live_feed=live_feed)
        return super().make_layout(SegmentWatch(backend, self._segment_made, self._released))

    def _segment_made(self, ptr: int, nbytes: int) -> None:
        """The pool made a segment: nothing has populated its pages yet, so each
        newborn placed there is populated by a prefetch, not by first-touch faults."""
        self._away.add(ptr, nbytes)

    def _released(self, ptr: int, nbytes: int) -> None:
        """The pool handed a segment back: pending discards inside it are moot, and
        advice held for the launch that just ran must not be undone on freed memory."""
        end = ptr + nbytes
        self._away.remove(ptr, nbytes)
        if self._pending:
            self._pending = [r for r in self._pending if not ptr <= r[0] < end]
        if self._temp:
            self._temp = [r for r in self._temp if not ptr <= r[0] < end]
        # Memoized decision ranges may point into it: never reuse them unchecked.
        self._unfreeze()
        self._ref = None
        self._memo_evict.clear()
        self._memo_prefetch.clear()

    def on_event(self, event: Event) -> None:
        # The hot path: every event of every iteration comes through here, so
        # the common cases are inlined and attributes read once (see
        # bench/overhead.py for what it costs per iteration).
        t = type(event)
        if t is Alloc:
            obj = event.obj
            keys = self.keys  # ObjectKeys.alloc, inlined
            ordinal = keys.ordinal
            keys.ordinal = ordinal + 1
            km = self._keymap
            key = ordinal if km is None else (km[ordinal] if ordinal < len(km) else SPARE_KEY + ordinal)
            key_of = keys.key_of
            old = key_of.get(obj)
            if old is not None:
                keys.obj_of.pop(old, None)
            key_of[obj] = key
            keys.obj_of[key] = obj
            self._info[obj] = event  # its nbytes and kind, for as long as it lives
            ptrs = self._ptrs
            away = self._away_ends
            if ptrs is not None or self._frozen or away:
                try:
                    ptr = self._lives[obj].ptr
                except KeyError:
                    ptr = self._not_live(obj)
                if ptrs is not None:
                    ptrs.append(ptr)
                elif self._frozen:
                    ref = self._ref[1]
                    if ordinal >= len(ref) or ref[ordinal] != ptr:
                        self._unfreeze()
            if self._pending and event.launch == -1:
                # Born holding data written by the host (a batch copied in): a
                # pending discard of the dead range it reuses must not hit it.
                ptr = self.layout.address(obj)
                end = ptr + event.nbytes
                self._pending = [r for r in self._pending if r[0] + r[1] <= ptr or r[0] >= end]
            ne = self._ne  # the clock of non-launch events
            self._ne = ne + 1
            lh = self._lh = ((self._lh * 1000003) ^ (event.nbytes << 1)) & _MASK
            rec = self._rec
            if rec is not None:
                rec.allocs.append((self._nl, key))
                rec.sizes[key] = event.nbytes
                rec.kinds[key] = event.kind
                rec.light.append((self._nl, lh))
                rec.tokens.append(event.nbytes << 3)  # planner.light_token(nbytes << 1, ALLOC_TOKEN)
            if self._tokens is not None:
                self._tokens.append(event.nbytes << 3)
                self._token_objs.append(obj)
            # Dead ranges are discarded before the newborn that may reuse one is
            # written (a live allocation arrives before its op's kernel is queued),
            # and what of its range umrt took off the GPU comes back first.
            if self._pending:
                self._flush()
            if away and self._away.overlaps(ptr, event.nbytes):
                self._populate(ptr, event.nbytes)
            if ne == self._due:
                self._light_event(ne)
        elif t is Free:
            obj = event.obj
            keys = self.keys  # ObjectKeys.free, inlined
            key = keys.key_of.pop(obj, None)
            if key is not None:
                other = keys.obj_of.pop(key, obj)
                if other != obj:  # the key has passed to another object meanwhile: keep it
                    keys.obj_of[key] = other
            if self._advised and obj in self._advised:
                self._unmap(obj)
            if self._mostly and obj in self._mostly:
                self._mostly.discard(obj)
                self.backend.advise([(self.layout.address(obj), self._info.get(obj, _NOINFO).nbytes)],
                                    Advice.UNSET_READ_MOSTLY, self.backend.device)
            # The acting plan's long-lived dead are dropped (their pages would be
            # evicted, i.e. copied, under pressure), batched until the next allocation
            # or launch (nothing can write them before).
            nb = self._info.pop(obj, _NOINFO).nbytes
            if nb >= self.min_discard:
                if key in self._discard_keys:
                    try:
                        ptr = self._lives[obj].ptr
                    except KeyError:
                        ptr = self._not_live(obj)
                    start = -(-ptr // PAGE) * PAGE  # whole pages only: never a neighbour's bytes
                    end = (ptr + nb) // PAGE * PAGE
                    if end > start:
                        self._pending.append((start, end - start))
            self._nf += 1
            ne = self._ne
            self._ne = ne + 1
            lh = self._lh = ((self._lh * 1000003) ^ ((nb << 1) | 1)) & _MASK
            rec = self._rec
            if rec is not None:
                if key is not None:
                    rec.frees.append((self._nl, key))
                rec.light.append((self._nl, lh))
                rec.tokens.append((nb << 3) | 5)  # light_token((nb << 1) | 1, FREE_TOKEN)
            if self._tokens is not None:
                self._tokens.append((nb << 3) | 5)
            if self.discard_on_free and self._pending:
                self._flush()
            if ne == self._due:
                self._light_event(ne)
        elif t is Launch:
            if self._light and not self._counting:
                return  # acting on the other events' clock: launches are not needed
            if self._rec is not None:
                self._record_launch(event)
            if self._temp:
                self._unmap_temp()
            if self._pending:
                self._flush()
            n = self._nl
            self._nl = n + 1
            if n == self._next_at and self._mode == "act":
                self._decide(event)
            if self._over and n in self._over and self._mode == "act":
                self._map_temp(self._over[n])
        elif t is LayerEnter or t is LayerExit:
            ne = self._ne
            self._ne = ne + 1
            v = hash(event.module) ^ (t is LayerEnter)
            lh = self._lh = ((self._lh * 1000003) ^ v) & _MASK
            rec = self._rec
            if rec is not None:
                rec.boundaries.append(self._nl)
                rec.light.append((self._nl, lh))
                rec.tokens.append((v << 2) | 2)  # light_token(v, LAYER_TOKEN)
            if self._tokens is not None:
                self._tokens.append((v << 2) | 2)
            if self._light:
                if self._pending:
                    self._flush()
                if ne == self._due:
                    self._light_event(ne)
        elif t is IterationBoundary:
            self._boundary(event.index)

    def hint_kind(self, obj: int, kind: Kind) -> None:
        """What a live object holds, learned after it was announced (a live
        allocator announces every block as ``Kind.OTHER``; the optimizer's
        facts come after its step). Plans compiled from then on see it."""
        ev = self._info.get(obj)
        if ev is None or ev.kind == kind:
            return
        self._info[obj] = replace(ev, kind=kind)
        rec = self._rec
        key = self.keys.key_of.get(obj)
        if rec is not None and key is not None:
            rec.kinds[key] = kind

    def report(self) -> dict:
        """Counters: iterations learned / acted, deviations, moves, table sizes."""
        out = dict(self.counters)
        out["discard_calls"] += self._n_discard_calls
        out["discarded_bytes"] += self._n_discarded
        out["prefetch_calls"] += self._n_populate_calls
        out["populate_calls"] = self._n_populate_calls
        out["populated_bytes"] = self._n_populated
        out.update(
            mode=self._mode,
            variants=len(self.plans),
            correlation_rows=len(self.correlation),
            correlation_accuracy=round(self.correlation.accuracy, 4),
            data_rows=len(self.data),
        )
        if self._plan is not None:
            out["plan"] = dict(self._plan.stats)
        return out

    # -- learning ---------------------------------------------------------------

    def _record_launch(self, ev: Launch) -> None:
        rec = self._rec
        key_of = self.keys.key_of
        seen: dict[int, None] = {}
        for a in ev.accesses:
            k = key_of.get(a.obj)
            if k is not None:
                seen[k] = None
        keys = tuple(seen)
        rec.exec_ids.append(ev.exec_id)
        rec.uses.append(keys)
        rec.times.append(self._compute_time(ev.flops, ev.bytes, ev.precision))
        rec.alloc_counts.append(self.keys.ordinal)
        rec.free_counts.append(self._nf)
        self.correlation.observe(ev.exec_id)
        self.data.observe(ev.exec_id, keys)
        # The signature covers the launch sequence and where objects are born
        # and die, so two shapes that launch alike but allocate differently differ.
        self._sig = ((self._sig * 1000003) ^ ev.exec_id ^ (self.keys.ordinal << 20) ^ self._nf) & _MASK

    def _compute_time(self, flops: int, nbytes: int, precision: str = "") -> float:
        prof = self.profile
        if prof is not None:
            return prof.compute_time(flops, nbytes, precision)
        return max(flops / 100e12, nbytes / 1e12, 5e-6)  # no profile: a V100-class guess

    # -- iteration boundaries -----------------------------------------------------

    def _boundary(self, index: int) -> None:
        c = self.counters
        if self._light:
            self._light_tail()
        if self._mode == "act" and self._rec is not None and self._sig != self._plan.signature:
            # A probed iteration (recorded launch by launch) of another shape that no
            # decision told apart (a plan with nothing to do has none): learn it.
            c["switches"] += 1
            self._mode = "learn"
        if self._iteration is not None:
            c["iterations"] += 1
            self._finish_iteration()
        self._iteration = index
        # The signature of the iteration that just ended names its survivors.
        sig = self._sig if self._mode == "learn" else (self._plan.signature if self._plan else 0)
        if self._mode not in ("learn", "act", "rebase"):
            sig = self._sig ^ 0x5A5A  # a shape we never finished; its keys must not clash
        moved = self.keys.boundary(sig)
        if self._rec is not None and self._mode == "learn":
            self._rec.carried = moved
            new = self._compile(self._rec)
            # After a shape no plan knew ran without launches, the iterations after
            # it are learned until one is new (an eval pass every few steps comes
            # back only then), at most max_variants of them.
            if self._seek:
                self._seek = 0 if new else self._seek - 1
                self._relearn = self._seek > 0
        self._start_iteration()

    def _finish_iteration(self) -> None:
        mode = self._mode
        entry = {"iteration": self._iteration, "mode": mode}
        # The addresses of a complete iteration of a known shape are the reference
        # the next one of that shape is checked against (a frozen one held them).
        if self._frozen:
            self.counters["frozen_iterations"] += 1
        if self._light:
            self.counters["light_iterations"] += 1
        if self._ptrs is not None and mode in ("act", "learn"):
            self._ref = (_ref_key(self._plan) if mode == "act" else (self._sig, False), self._ptrs)
        elif not self._frozen:
            self._ref = None
        if mode == "act":
            self._outcomes.append(True)
            sig = self._plan.signature
            if self._tokens is not None:  # its light clock held for a whole iteration
                self._light_ok.add(sig)
            self._confirmed[sig] = self._confirmed.get(sig, 0) + 1
            if len(self._confirmed) > 4 * self.max_variants:
                self._confirmed = {k: v for k, v in self._confirmed.items() if k in self.plans}
            self.variants.observe(self._plan.signature)
            self.counters["acted"] += 1
            entry["signature"] = self._plan.signature
        elif mode == "rebase":
            self._rebase_light(entry)
        elif mode == "off":
            self.variants.last = None  # an unknown shape: predict from scratch, learn next
            self._relearn = True
            if self._light_failed:  # unknown, and not recorded: seek it (see _boundary)
                self._seek = self.max_variants
        elif mode == "learn" and self._rec is not None:
            self._rec.signature = self._sig
            self.variants.observe(self._sig)
            self.counters["learned"] += 1
            self._learned += 1
            entry["signature"] = self._sig
        self._tokens = None
        self._token_objs = []
        self.log.append(entry)
        if len(self.log) > 256:
            del self.log[:128]

    def _rebase_light(self, entry: dict) -> None:
        """An iteration acted on without launches left its plan's light clock and ran on
        without acting: its events are the clock of iterations that run the way acting
        ones do (a capture can change what a program allocates). The plan's decisions
        are placed on them (planner.rebase) for the next iteration of its shape, and
        the survivors born in it take the keys the plan knows them by."""
        sig = self._plan.signature
        base = self.plans.get(sig)
        variant = rebase(base, self._tokens) if base is not None else None
        entry["signature"] = sig
        if variant is None:  # not the same shape after all: as a deviation
            self.counters["deviations"] += 1
            self.variants.last = None
            self._relearn = True
            return
        base.light_variant = variant
        self._rebased[sig] = self._rebased.get(sig, 0) + 1
        self.counters["light_rebases"] += 1
        self.variants.observe(sig)
        keys = self.keys
        for ordinal, obj in enumerate(self._token_objs):
            old = keys.key_of.get(obj)
            if old is None or old < 0 or keys.obj_of.get(old) != obj:
                continue  # dead, or carried over from an earlier iteration
            new = variant.keymap[ordinal]
            del keys.obj_of[old]
            keys.obj_of[new] = obj
            keys.key_of[obj] = new

    def _compile(self, rec: IterationRecord) -> bool:
        """A plan for the learned iteration's shape; whether the shape was new."""
        sig = rec.signature
        if sig in self.plans:
            self.plans.move_to_end(sig)
            return False
        plan = self.planner.plan(rec)
        self.counters["plans_compiled"] += 1
        self.plans[sig] = plan
        while len(self.plans) > self.max_variants:
            self.plans.popitem(last=False)
        return True

    def _start_iteration(self) -> None:
        self._light_failed = False
        self._nl = 0
        self._nf = 0
        self._ne = 0
        self._lh = 0
        self._sig = 0
        self._rec = None
        self._plan = None
        # Misprediction guard: too many recent deviations -> do nothing, re-learn.
        if sum(1 for ok in self._outcomes if not ok) >= self.guard_failures:
            self.counters["guard_trips"] += 1
            self._outcomes.clear()
            self.plans.clear()
            self._light_ok.clear()
            self._rebased.clear()
            self._cooldown = self.guard_cooldown
        plan = None
        if self._cooldown > 0:
            self._cooldown -= 1
        elif self._relearn:
            self._relearn = False
        elif self._learned >= self.learn_iterations:
            for sig in self.variants.predict():
                plan = self.plans.get(sig)
                if plan is not None:
                    break
        # Record from the start: learning needs the whole iteration, and so
        # does acting on a plan not yet confirmed (a deviation then turns the
        # iteration into a learned one). A plan that ran through two iterations is
        # trusted and followed without a record (an early deviation then costs
        # one more iteration of plain UM before the new shape is learned).
        trusted = plan is not None and self._confirmed.get(plan.signature, 0) >= self.probe_iterations
        self._rec = None if trusted else self._new_record()
        # A trusted plan with a clock of non-launch events needs no launches; it acts
        # on its variant re-based on an iteration that ran without them, once there
        # is one, and records this iteration's events until that clock has held.
        self._light = light = bool(self.launch_free and trusted and plan.light_end is not None)
        if light:
            plan = plan.light_variant or plan
            if plan.signature not in self._light_ok:
                self._tokens, self._token_objs = [], []
        self._keymap = plan.keymap if light else None
        ref = self._ref
        self._frozen = bool(self.freeze and trusted and ref is not None and ref[0] == _ref_key(plan))
        self._ptrs = None if self._frozen else []
        self._counting = False
        self.wants_launches = not light
        self._resume = plan.light_resume if light else {}
        self._resume_at = sorted(self._resume)
        if light and -1 in self._resume:  # a decision before the iteration's first event
            self._counting = self.wants_launches = True
        if plan is not None:  # a plan with nothing to do (everything fits) is acted on too: no capture
            self._mode = "act"
            self._plan = plan
            self._actions = plan.actions
            self._ai = 0
            self._arm()
            # A plan not yet confirmed twice is probed (recorded) all along,
            # so a late deviation still teaches the runtime the new shape.
            self._probe = 0 if trusted else len(plan.actions) + 1
            self._discard_keys = plan.discard
            self._over = plan.remote_at
            self.plans.move_to_end(plan.signature)
            if plan.remote:
                self._host_map(plan.remote)
            if plan.read_mostly and self.read_mostly:
                self._read_mostly(plan.read_mostly)
        else:
            self._mode = "learn"
            self._next_at = self._next_light = -1
            self._discard_keys = frozenset()
            self._over = {}
        self._set_due(-1)

    def _new_record(self) -> IterationRecord:
        """A record of the iteration starting now, with what is alive."""
        live = self.keys.obj_of
        rec = IterationRecord(start_live=set(live))
        info = self._info
        for k, obj in live.items():
            ev = info.get(obj, _NOINFO)
            rec.sizes[k], rec.kinds[k] = ev.nbytes, ev.kind
        return rec

    # -- acting -----------------------------------------------------------------

    def _decide(self, ev: Launch) -> None:
        a = self._actions[self._ai]
        # Acting without launches, the iteration was checked at the event the
        # count started from; a live driver may deliver launches late (its
        # capture resumes at the next hook), so the count can only lag: late.
        if not self._light and (ev.exec_id != a.exec_id or self.keys.ordinal != a.n_alloc
                                or self._nf != a.n_free):
            a = self._switch(ev)
            if a is None:
                self._deviate()
                return
        if self._probe:
            self._probe -= 1
            if not self._probe:
                self._rec = None  # the plan holds: stop recording
        self._ai += 1
        self._arm()
        self._act(a)

    def _arm(self) -> None:
        """Set the trigger of the next decision: its launch ordinal, or (acting
        without launches) its light event, or for a decision no event precedes
        its launch ordinal, counted from the event named in Plan.light_resume."""
        if self._ai >= len(self._actions):
            self._next_at = self._next_light = -1
            return
        a = self._actions[self._ai]
        if not self._light:
            self._next_at = a.at
        elif a.light_at >= 0:
            self._next_at, self._next_light = -1, a.light_at
        else:  # counted from the event before it (Plan.light_resume)
            self._next_at, self._next_light = a.at, -1

    def _act(self, a: Action) -> None:
        """Issue one decision's moves."""
        c = self.counters
        c["decisions"] += 1
        away = self._away
        if a.evict:
            ranges, moved, _ = self._resolve(a.evict, self._memo_evict, True)
            if ranges:
                self.backend.prefetch(ranges, HOST)
                c["prefetch_calls"] += 1
                c["evicted_bytes"] += moved
                for p, n in ranges:
                    away.add(p, n)
        if a.prefetch:
            ranges, moved, unresolved = self._resolve(a.prefetch, self._memo_prefetch, False)
            c["unresolved"] += unresolved
            if ranges:
                self.backend.prefetch(ranges, self.backend.device)
                c["prefetch_calls"] += 1
                c["prefetched_bytes"] += moved
                if away:
                    for p, n in ranges:
                        away.remove(p, n)

    # -- acting without launches -------------------------------------------------

    def _light_event(self, ne: int) -> None:
        """Non-launch event ``ne`` of an iteration acted on without launches,
        when something is due at it (_set_due): decisions among the launches
        counted since the last event that were not taken, the decisions placed
        on this event (Action.light_at), counting launches from it or not."""
        if self._temp:
            self._unmap_temp()  # the oversized launch it was made for has been queued
        if self._counting:
            # The launches counted since an earlier event are all queued by now:
            # a decision among them not yet taken (a launch not delivered) is taken now.
            actions = self._actions
            while self._ai < len(actions) and actions[self._ai].light_at < 0 and actions[self._ai].light_from < ne:
                a = actions[self._ai]
                self._ai += 1
                self.counters["late_decisions"] += 1
                self._act(a)
            self._arm()
        if ne == self._next_light:
            self._decide_light(ne)
        # Launches are counted from an event the plan names to the next event.
        r = self._resume.get(ne)
        if r is None:
            if self._counting:
                self._counting = self.wants_launches = False
        elif self._light:  # not if the decision above deviated
            if r[1] != self._lh:
                if not self._switch_light(ne):
                    self._light_mismatch()
                    return
                r = self._resume.get(ne)  # the shape switched to counts from here, or not
            if r is not None:
                self._nl = r[0]  # launches before this event, as recorded
                self._counting = self.wants_launches = True
            elif self._counting:
                self._counting = self.wants_launches = False
        self._set_due(ne)

    def _set_due(self, ne: int) -> None:
        """The next light event after ``ne`` that something is due at: a
        decision, a count to start, or (counting, or a launch host-mapped)
        the very next one; -1 when nothing is (the hot path compares one int)."""
        if not self._light:
            self._due = -1
        elif self._counting or self._temp:
            self._due = ne + 1
        else:
            nxt = self._next_light if self._next_light > ne else -1
            i = bisect.bisect_right(self._resume_at, ne)
            if i < len(self._resume_at) and (nxt < 0 or self._resume_at[i] < nxt):
                nxt = self._resume_at[i]
            self._due = nxt

    def _decide_light(self, ne: int) -> None:
        """The decision at event ``ne`` (one at most: light_points places each
        launch's action on its own event), if the iteration has matched its
        plan so far: the running hash of every allocation's size, every freed
        size and every module boundary must be the recorded one."""
        a = self._actions[self._ai]
        if self._lh != a.light_hash:
            if not self._switch_light(ne):
                self._light_mismatch()
                return
            a = self._actions[self._ai] if self._ai < len(self._actions) else None
            if a is None or a.light_at != ne:  # the other shape decides nothing here
                self._arm()
                return
        self._ai += 1
        self._arm()
        self._act(a)

    def _switch_light(self, ne: int) -> bool:
        """Another learned shape whose events so far are this iteration's (its running
        hash after event ``ne`` is ours: an eval step instead of a train step, say):
        continue with its plan from its next decision (as :meth:`_switch`)."""
        for sig in reversed(self.plans):
            plan = self.plans[sig]
            plan = plan.light_variant or plan
            if plan is self._plan or plan.light_end is None or plan.hash_after(ne) != self._lh:
                continue
            idx = plan.index_at_light(ne)
            self._adopt(plan, idx if idx is not None else plan.index_after_light(ne))
            return True
        return False

    def _light_tail(self) -> None:
        """The iteration ends: if it matched its plan to the last event, the
        decisions counted from that event whose launches were not delivered
        run now, late (they prepare the next iteration)."""
        end = (self._ne, self._lh)
        if end != self._plan.light_end:
            other = next((p for p in (q.light_variant or q for q in self.plans.values())
                          if p is not self._plan and p.light_end == end), None)
            if other is None:
                self._light_mismatch()
                return
            self._adopt(other, len(other.actions))  # it was that shape, to its last event
        if self._pending:
            self._flush()
        while self._ai < len(self._actions):
            self.counters["late_decisions"] += 1
            self._act(self._actions[self._ai])
            self._ai += 1

    def _flush(self) -> None:
        """Discard the ranges freed since the last flush in one call. Ranges
        of segments the pool gave back meanwhile were dropped (_released)."""
        ranges = self._pending
        self._pending = []
        self.backend.discard(ranges)
        self._n_discard_calls += 1
        self._n_discarded += sum(map(_N, ranges))
        away = self._away
        for p, n in ranges:
            away.add(p, n)

    def _populate(self, ptr: int, nbytes: int) -> None:
        """A newborn at ``[ptr, ptr + nbytes)``: the parts of it umrt took off the GPU
        (discarded, evicted, host-mapped) or that were never populated are prefetched
        to the GPU now, in one call, before its op's kernel can touch them: a kernel
        writing a discarded range refaults at 0.8 GB/s, a fresh one populates at
        3.4-8 GB/s, where a prefetch populates 2 GiB in ~11 ms (h100-measured.md)."""
        pieces = self._away.take(ptr, nbytes)
        if pieces:
            self.backend.populate(pieces)
            self._n_populate_calls += 1
            self._n_populated += sum(map(_N, pieces))

    def _resolve(self, keys: tuple[int, ...], memo: dict, evict: bool) -> tuple[list, int, int]:
        """The ranges a decision moves for ``keys``: ``(ranges, bytes, keys not alive)``.

        Where each object is, ``(ptr, nbytes)``, is read for all keys at once
        (C-level lookups); the ranges are a pure function of that, memoized per
        key tuple: in steady state the pool gives every role the same address
        each iteration, so the page rounding is done once. Anything that moved
        (or a key that is not alive) is simply computed afresh.
        """
        hit = memo.get(id(keys))
        if self._frozen and hit is not None and hit[4] is keys:
            return hit[1], hit[2], hit[3]  # every object since is where it was then
        objs = tuple(map(self.keys.obj_of.get, keys))
        try:
            if None in objs:
                lives = self._lives
                where = tuple(None if o is None else _PTR_N(lives[o]) for o in objs)
            else:
                where = tuple(map(_PTR_N, map(self._lives.__getitem__, objs)))
        except KeyError as e:
            self._not_live(e.args[0])
            raise
        if hit is None or hit[0] != where or hit[4] is not keys:
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            hit = memo[id(keys)] = (where, *_moves(where, evict), keys)
        return hit[1], hit[2], hit[3]

    def _not_live(self, obj: int) -> int:
        """An object the runtime was told of is not in the layout's live index:
        the layout's own error says why (a driver that skipped ``layout.alloc``)."""
        return self.layout.address(obj)

    def _unfreeze(self) -> None:
        """Addresses can no longer be trusted this iteration: decisions resolve
        every key again, and this iteration is no reference for the next."""
        if self._frozen:
            self.counters["unfreezes"] += 1
        self._frozen = False
        self._ptrs = None

    def _switch(self, ev: Launch) -> Action | None:
        """Another learned shape may match where this one failed (an eval
        step instead of a train step): continue with its plan from here."""
        n = self._nl - 1
        for sig in reversed(self.plans):
            plan = self.plans[sig]
            if plan is self._plan:
                continue
            idx = plan.index_at(n)
            if idx is None:
                continue
            a = plan.actions[idx]
            if ev.exec_id == a.exec_id and self.keys.ordinal == a.n_alloc and self._nf == a.n_free:
                self._adopt(plan, idx)
                return a
        return None

    def _adopt(self, plan: Plan, idx: int) -> None:
        """Continue with another shape's plan from its action ``idx``: everything
        keyed by that plan's keys and launches comes with it."""
        self.counters["switches"] += 1
        self._unfreeze()  # the addresses seen so far were checked against another shape
        self._plan = plan
        self._actions = plan.actions
        self._ai = idx
        self._discard_keys = plan.discard
        self._over = plan.remote_at
        if self._light:
            self._keymap = plan.keymap  # allocations from here on (those before keep their keys)
            self._resume = plan.light_resume
            self._resume_at = sorted(plan.light_resume)

    def _light_mismatch(self) -> None:
        """Acting without launches, the iteration's running hash is not the plan's.
        While the plan's light clock is unconfirmed (the iteration's events are being
        recorded) that is what a capture changes in a program (the recorded
        iteration ran with the capture on; this one without it): stop acting, but let
        the iteration run on without launches, as acting ones do, and re-base the
        plan on it at its end (_rebase_light). Otherwise it is a deviation."""
        if self._tokens is None or self._rebased.get(self._plan.signature, 0) >= _MAX_REBASES:
            self._deviate()
            return
        self._unfreeze()
        if self._temp:
            self._unmap_temp()
        self._mode = "rebase"
        self._light = self._counting = False
        self._due = -1
        self.wants_launches = False
        self._discard_keys = frozenset()
        self._over = {}

    def _deviate(self) -> None:
        """The program left the plan: stop acting. Early in the iteration the
        probe record is still running, so the runtime learns this iteration
        instead; later it waits for the next boundary."""
        self.counters["deviations"] += 1
        self._unfreeze()
        if self._ai > 0:  # failed after it had started to hold: the guard counts that
            self._outcomes.append(False)
        self._light_failed = self._light
        self._mode = "learn" if self._rec is not None else "off"
        self._light = self._counting = False
        self._due = -1
        self.wants_launches = True  # the next iteration is learned
        self._plan = None
        self._tokens = None
        self._discard_keys = frozenset()
        self._over = {}

    def _live_ranges(self, keys, skip) -> list[tuple[int, tuple[int, int]]]:
        """``(obj, (ptr, nbytes))`` for each key's live, non-empty object not
        in ``skip``, in key order."""
        out = []
        obj_of, info, address = self.keys.obj_of, self._info, self.layout.address
        for k in keys:
            obj = obj_of.get(k)
            if obj is None or obj in skip:  # checked first: most are skipped every iteration
                continue
            n = info.get(obj, _NOINFO).nbytes
            if n > 0:
                out.append((obj, (address(obj), n)))
        return out

    def _read_mostly(self, keys) -> None:
        """Parameters are only read between two optimizer steps: with
        ReadMostly the GPU holds a duplicate, and evicting it costs no copy
        back (the step's write collapses the duplicates; the next read makes
        them again)."""
        ranges = []
        for obj, r in self._live_ranges(keys, self._mostly):
            self._mostly.add(obj)
            ranges.append(r)
        if ranges:
            self.backend.advise(ranges, Advice.SET_READ_MOSTLY, self.backend.device)

    def _host_map(self, keys) -> None:
        """Keep these long-lived objects on the host, read over the link
        (PreferredLocation=host + AccessedBy=GPU), and move them out now."""
        ranges = []
        for obj, r in self._live_ranges(keys, self._advised):
            self._advised[obj] = r
            ranges.append(r)
        if not ranges:
            return
        be = self.backend
        be.advise(ranges, Advice.SET_PREFERRED_LOCATION, HOST)
        be.advise(ranges, Advice.SET_ACCESSED_BY, be.device)
        out = [r for r in (_inner(p, n) for p, n in ranges) if r is not None]
        if out:
            be.prefetch(out, HOST)
            for p, n in out:
                self._away.add(p, n)
        self.counters["host_mapped_bytes"] += sum(n for _, n in ranges)

    def _map_temp(self, keys) -> None:
        """A launch larger than the budget is about to run: what of it is not
        resident is read and written over the link (PreferredLocation=host +
        AccessedBy=GPU) instead of being faulted in and evicted again within
        the launch. Undone before the next launch. Only ranges large enough to
        pay for their four cudaMemAdvise calls (112 us each on the H100; see
        :func:`~umrt.policy.planner.min_host_map_bytes`): the rest faults in as
        it would anyway."""
        least = min_host_map_bytes(self.profile)
        ranges = [r for _, r in self._live_ranges(keys, self._advised) if r[1] >= least]
        if ranges:
            be = self.backend
            be.advise(ranges, Advice.SET_PREFERRED_LOCATION, HOST)
            be.advise(ranges, Advice.SET_ACCESSED_BY, be.device)
            self._temp = ranges
            self.counters["launch_host_mapped_bytes"] += sum(n for _, n in ranges)

    def _unmap_temp(self) -> None:
        ranges, self._temp = self._temp, []
        be = self.backend
        be.advise(ranges, Advice.UNSET_ACCESSED_BY, be.device)
        be.advise(ranges, Advice.UNSET_PREFERRED_LOCATION, HOST)

    def _unmap(self, obj: int) -> None:
        """A host-mapped object dies: its range must not pass the advice on."""
        r = self._advised.pop(obj)
        self.backend.advise([r], Advice.UNSET_ACCESSED_BY, self.backend.device)
        self.backend.advise([r], Advice.UNSET_PREFERRED_LOCATION, HOST)


def _moves(where: tuple, evict: bool) -> tuple[tuple[tuple[int, int], ...], int, int]:
    """``(ranges, bytes, not alive)`` for objects at ``where`` (``(ptr, nbytes)``
    or ``None`` for a key not alive): moved out as whole pages only
    (``evict``, :func:`_inner`), or in as they are."""
    ranges = []
    moved = unresolved = 0
    for w in where:
        if w is None:
            unresolved += not evict
            continue
        ptr, n = w
        if evict:
            r = _inner(ptr, n)
            if r is not None:
                ranges.append(r)
                moved += r[1]
        elif n > 0:
            ranges.append((ptr, n))
            moved += n
        else:
            unresolved += 1
    return tuple(ranges), moved, unresolved


def _inner(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """The whole pages inside ``[ptr, ptr + nbytes)``: moving a page out or
    discarding it must never touch a neighbour's bytes."""
    start = -(-ptr // PAGE) * PAGE
    end = (ptr + nbytes) // PAGE * PAGE
    return (start, end - start) if end > start else None
