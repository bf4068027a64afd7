"""umrt's lifetime-aware managed pool (Sentinel's arenas + SmartPool's plan).

:class:`LifetimePool` is the :class:`~umrt.memory.base.Layout` umrt's runtime
runs with. It sub-allocates objects from managed segments in arenas segregated
by lifetime (``persistent``, ``short-lived``, ``long-lived``, and the online
``learning`` / ``overflow`` arenas), block-aligned so that no 2 MB block (the
UVM driver's eviction unit) holds two lifetime classes at once. It learns the
first complete iteration from the event stream the driver feeds it
(:class:`~umrt.memory.base.LearningLayout`), then plans it with one SmartPool
pass, so that every recurring allocation gets the same address in every
iteration and objects never alive together share memory. ``live_feed=True``
is the mode a framework allocator feeds (no kinds, no launches).

The arenas, the plan keys, cyclic lifetimes, re-planning and the live feed are
described in ``umrt/memory/POOL.md``.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

from umrt.backends.base import BLOCK  # the UVM driver's VA block: its eviction unit (umrt/sim/MODEL.md)
from umrt.memory.arena import Arena
from umrt.memory.base import Layout
from umrt.memory.caching import LayoutError
from umrt.memory.smartpool import Lifetime, plan, quietest_point
from umrt.trace.events import Event, IterationBoundary, Kind, Launch, LayerEnter, LayerExit

__all__ = ["LifetimePool", "BLOCK", "ARENAS", "SHORT_PLAN", "MISSED_STEPS", "SAME_SHAPE", "FIRST_PLAN_BY"]

ALIGN = 512  # object alignment inside arenas, as PyTorch's kMinBlockSize
ARENAS = ("persistent", "short-lived", "long-lived", "learning", "overflow")

PlanKey = tuple  # (context exec id | None, nbytes, kind code (-1: live feed), ordinal)
# Never freed in training: served online, never planned. Gradients are Kind.persistent but
# PyTorch re-creates them every iteration (zero_grad(set_to_none=True), the default since 2.0),
# so they are planned with the transients, by their observed lifetimes.
_PERSISTENT = frozenset({Kind.PARAMETER, Kind.OPTIMIZER_STATE, Kind.OTHER})
_KIND_CODE = {k: int(k) for k in Kind}  # int(kind), as a lookup (plan keys hold plain ints)
_HINTED_PERSISTENT = frozenset({Kind.PARAMETER, Kind.OPTIMIZER_STATE})  # hints that leave a plan
# Live feed: allocations recorded in one iteration, at most (gpt2-xl makes ~3,600 per
# step: this covers gradient accumulation over ~70 micro-batches; ~40 MB of records).
_MAX_RECORDS = 1 << 18
# A plan replaced before it served this many training iterations was short-lived: the
# program's allocations changed again right after the pool planned for them.
SHORT_PLAN = 4
# A plan that missed most of the bytes of this many training iterations in a row, each of a
# shape unlike the one before, serves steps whose allocations do not repeat (one such step
# is a short last batch).
MISSED_STEPS = 2
# Two iterations have one shape where this share of each one's bytes is under keys the other has.
SAME_SHAPE = 0.9
# Live feed: the first plan waits for a training step of the shape of the step before it (the
# first step, which makes the optimizer's state and runs the set-up, has a shape of its own:
# planned from it, the pool would hold two regions, the learning iterations would run slower
# than a caching allocator's, and the runtime would time doing nothing on them), but plans at
# the latest from this many steps (loops whose steps take turns between shapes, unless two
# shapes strictly alternate: a GAN's discriminator and generator steps; a plan of one of them
# misses every other step, and the steps are served unplanned, as a caching allocator would).
FIRST_PLAN_BY = 5

log = logging.getLogger("umrt")
_NO_KIND = -1  # the kind code of every live-feed key: steady iterations get no hints


def _up(x: int, a: int) -> int:
    return -(-x // a) * a


def _same_shape(a: dict[PlanKey, int], b: dict[PlanKey, int]) -> bool:
    """Whether two iterations (plan key -> bytes) have one shape: at least
    :data:`SAME_SHAPE` of the bytes of each are under keys the other has."""
    ta, tb = sum(a.values()), sum(b.values())
    return bool(ta and tb) and (sum(n for k, n in a.items() if k in b) >= SAME_SHAPE * ta
                                and sum(n for k, n in b.items() if k in a) >= SAME_SHAPE * tb)


def _twin(key: PlanKey) -> PlanKey:
    """The key of ``key``'s second planned place (see :meth:`LifetimePool._make_plan`)."""
    return (*key[:3], -1 - key[3])


@dataclass(slots=True)
class _Record:
    """One non-persistent allocation of the iteration being observed."""

    key: PlanKey
    size: int  # aligned bytes
    kind: Kind
    start: int  # clock, relative to the iteration start
    tick: int  # layer events seen before it, in this iteration
    in_layer: bool  # allocated inside a module (not in the optimizer step or top-level code)
    end: int | None = None
    end_tick: int | None = None
    # Freed in the next iteration: there, at this clock / tick (relative to its start).
    end_next: int | None = None
    end_next_tick: int | None = None


def _is_short(r: _Record, end_tick: int, saw_layers: bool, short_ticks: int) -> bool:
    """Sentinel's short-lived tensors are a layer's temporaries: born inside a module, dead
    within ``short_ticks`` layer events. Big temporaries of the optimizer step or top-level
    code are not: they join the long-lived groups, whose placement lets them reuse the
    memory of activations that are dead by then."""
    if not saw_layers:
        return r.kind == Kind.TEMPORARY
    return r.in_layer and end_tick - r.tick <= short_ticks


@dataclass(slots=True)
class _Region:
    """The planned region: one aligned backend allocation holding the short-lived
    arena (a block-aligned sub-range) and the long-lived arena (the rest)."""

    ptr: int
    nbytes: int
    short: tuple[int, int] = (0, 0)  # (ptr, nbytes) of the short-lived arena
    live: int = 0
    retired: bool = False
    # Which of its bytes are in use (planned places are taken from it, misses fit into it).
    space: Arena | None = None

    def best_fit(self, size: int, keep_classes: bool = True, on_gpu: Callable[[int, int], list[tuple[int, int]]]
                 | None = None, lowest: bool = False) -> tuple[int, str] | None:
        """Best fit of ``size`` where nothing lives now, and the memory's class as planned;
        None where no free range fits (with ``keep_classes``, none that does not straddle
        the short-lived range's edge: a block would hold two classes). With ``on_gpu``,
        free memory on the GPU first (:meth:`~umrt.memory.arena.Arena.fit_on_gpu`); with ``lowest``, then the
        lowest free range that holds it, not the smallest (an evaluation's batch in few blocks)."""
        lo, n = self.short
        edges = (lo, lo + n) if keep_classes and n else ()
        ptr = self.space.fit_on_gpu(size, on_gpu) if on_gpu is not None else None
        if ptr is not None and any(ptr < e < ptr + size for e in edges):
            self.space.free(ptr)
            ptr = None
        if ptr is None:
            ptr = self.space.first_fit(size, edges) if lowest else self.space.fit(size)
            if ptr is None:
                return None
            if any(ptr < e < ptr + size for e in edges):
                self.space.free(ptr)
                return None
        self.live += 1
        return ptr, ("short-lived" if lo <= ptr < lo + n else "long-lived")

    def ranges(self) -> dict[str, list[tuple[int, int]]]:
        lo, n = self.short
        end = self.ptr + self.nbytes
        if not n:
            return {"short-lived": [], "long-lived": [(self.ptr, self.nbytes)]}
        long = [(a, b - a) for a, b in ((self.ptr, lo), (lo + n, end)) if b > a]
        return {"short-lived": [(lo, n)], "long-lived": long}


@dataclass(slots=True)
class _Live:
    arena: str
    ptr: int
    size: int
    nbytes: int
    region: _Region | None = None  # planned objects
    record: _Record | None = None
    iteration: int | None = None


@dataclass(slots=True)
class _IterStats:
    eligible_bytes: int = 0
    missed_bytes: int = 0
    hits: int = 0
    misses: int = 0
    conflicts: int = 0


class LifetimePool(Layout):
    """Lifetime-segregated, SmartPool-planned managed pool (see the module docstring).

    Parameters
    ----------
    backend:
        Anything with ``malloc(nbytes) -> ptr`` and ``free(ptr)``.
    short_lived_bytes:
        Cap on the short-lived arena (the region a runtime keeps resident);
        ``None``: as large as the plan needs.
    block:
        Arena alignment and segment granularity (the 2 MB UVM block).
    alignment:
        Alignment of objects inside arenas.
    short_ticks:
        An object born inside a module that lives across at most this many
        layer events (:class:`LayerEnter`/:class:`LayerExit`, and top-level
        launches such as the optimizer step's) is short-lived.
    min_group_bytes:
        A long-lived group (objects alive across the same layers) holding at
        least this many bytes (default ``16 * block``, so aligning it to
        blocks costs at most 1/16 of it) gets block-aligned memory of its own;
        smaller groups are placed object by object.
    replan_threshold:
        Re-plan when more than this fraction of an iteration's planned-class
        bytes missed the plan and the iteration before it had the same shape
        (:data:`SAME_SHAPE`: the shape changed for good, not for one short last
        batch) (``None``: never re-plan).
    max_short_plans:
        Stop planning once this many re-plans in a row each replaced a plan
        that served fewer than :data:`SHORT_PLAN` training iterations (the
        program's allocations do not repeat: bucketed sequence lengths,
        batches that change every step), or once the plan missed most of
        :data:`MISSED_STEPS` training iterations in a row, none of the shape
        of the one before (none to plan again from): the ``learning`` arena then serves
        every allocation best-fit, as a caching allocator does, and each planned
        region is handed back once its objects are dead (``None``: never stop).
    live_feed:
        Allocations come from a framework allocator: :attr:`Kind.OTHER` means
        unknown (hinted later with :meth:`hint_kind`, or never), launches are
        ignored and plan keys hold neither context nor kind (see "The live
        feed" in the module docstring). ``False`` (the simulator's feed):
        kinds are true at allocation and launches give the keys' context.
    needs_plan:
        Asked, with the most memory the pool has held so far, before its first plan
        (at each training boundary where it would plan): while it says no, the pool
        serves as it learned (best-fit; a plan's region would add to what it holds).
        umrt's runtime says no while that memory fits the GPU: nothing has to move.
        ``None``: plan as soon as the pool can.
    on_idle:
        Called with ``[(ptr, nbytes), ...]``: memory the pool holds, nothing lives in,
        and the pool leaves idle from now on (what the learning iterations left free
        once a plan serves them; the free part of a region a new plan replaced). Its
        pages hold dead bytes that a GPU short of memory would copy out to make room:
        the runtime discards them.
    on_gpu:
        ``on_gpu(ptr, nbytes)``: the parts of that range on the GPU, as far as the caller
        knows (``[(ptr, nbytes), ...]``). An evaluation's allocation then takes free memory
        there first, as plain Unified Memory reuses resident pages, else the lowest there is.
    """

    def __init__(
        self,
        backend,
        *,
        short_lived_bytes: int | None = None,
        block: int = BLOCK,
        alignment: int = ALIGN,
        short_ticks: int = 2,
        min_group_bytes: int | None = None,
        replan_threshold: float | None = 0.5,
        max_short_plans: int | None = 2,
        live_feed: bool = False,
        on_idle: Callable[[list[tuple[int, int]]], None] | None = None,
        needs_plan: Callable[[int], bool] | None = None,
        on_gpu: Callable[[int, int], list[tuple[int, int]]] | None = None,
    ) -> None:
        if block <= 0 or alignment <= 0 or block % alignment:
            raise LayoutError(f"block ({block}) must be a positive multiple of alignment ({alignment})")
        if short_lived_bytes is not None and short_lived_bytes < 0:
            raise LayoutError(f"short_lived_bytes must be >= 0, got {short_lived_bytes}")
        self.backend = backend
        self.block, self.alignment = block, alignment
        self.short_lived_bytes = short_lived_bytes
        self.short_ticks = short_ticks
        self.min_group_bytes = 16 * block if min_group_bytes is None else min_group_bytes
        self.replan_threshold = replan_threshold
        self.max_short_plans = max_short_plans
        self.live_feed = live_feed
        self._on_idle = on_idle
        self.needs_plan = needs_plan  # (public: umrt's live allocator sets it on the layouts it makes)
        self._on_gpu = on_gpu

        self._raw: dict[int, tuple[int, int]] = {}  # aligned ptr -> (backend ptr, bytes)
        self._footprint = 0
        self.peak_footprint = 0
        self._arena = partial(Arena, self._malloc, self._release, alignment=alignment, block=block)
        self._online = {
            "persistent": self._arena("persistent", slab=32 * block),
            "learning": self._arena("learning"),
            "overflow": self._arena("overflow"),
        }
        self._regions: list[_Region] = []
        self._live: dict[int, _Live] = {}
        # Live planned objects: sorted start addresses, and start -> end.
        self._plan: dict[PlanKey, tuple[_Region, int, str]] = {}
        self.planned = False
        self.plans_made = 0
        # False once the plans kept missing (see max_short_plans): every allocation is
        # served best-fit from then on, and why is in stopped_planning.
        self.planning = True
        self.stopped_planning: str | None = None
        self._drain = False  # stopped: the planned regions get nothing new (stop_planning)
        self._resume = False  # stopped, told to plan again: from the next training step's records
        self._unplanned_now = False  # this iteration is served best-fit, its plan kept (serve_unplanned)
        self._learned_footprint = 0  # the most memory the pool held before its first plan
        self._fits_unplanned = False  # needs_plan said no: nothing planned, nothing handed back
        self._plan_served = 0  # training iterations the current plan served
        self._last_shape: dict[PlanKey, int] = {}  # the last training iteration's plan keys -> bytes
        self._recent_shapes: deque[dict[PlanKey, int]] = deque(maxlen=FIRST_PLAN_BY)  # unplanned steps'
        self._unplanned_steps = 0  # training iterations learned before the first plan (live feed)
        self._short_plans = 0  # re-plans in a row that replaced a plan serving < SHORT_PLAN of them
        self._missed_steps = 0  # training iterations in a row the plan missed, none of the shape before it

        self._clock = 0
        self._iteration: int | None = None  # None: set-up, before the first boundary
        self._iter_clock = 0
        self._tick = 0
        self._depth = 0  # module nesting depth from LayerEnter/LayerExit
        self._context: int | None = None
        self._ordinals: dict[tuple, int] = {}
        self._records: list[_Record] = []
        self._prev_records: list[_Record] = []  # the previous iteration's (indexed by key when planning)
        self._refine = False  # the plan assumed unknown-end objects alive all along
        self._clean_before = False  # the iteration before the last one had no plan miss (live feed)
        self._recording = True  # False: this (live-feed) iteration grew too long to plan from, or is no step
        self._training = True  # the running iteration is a training step (IterationBoundary.phase)
        self._stats = _IterStats()
        self.last_iteration_stats: _IterStats | None = None
        self.totals = _IterStats()  # over the pool's life
        self.live_bytes = 0
        self.peak_live_bytes = 0

    # -- Layout -----------------------------------------------------------------

    def alloc(self, obj: int, nbytes: int, kind: Kind) -> int:
        if obj in self._live:
            raise LayoutError(f"object {obj} is already live in the pool")
        if nbytes < 0:
            raise LayoutError(f"object {obj}: negative size {nbytes}")
        if type(kind) is not Kind:
            try:
                kind = Kind(kind)
            except ValueError:
                raise LayoutError(f"object {obj}: unknown kind {kind!r}") from None
        align = self.alignment
        size = -(-(nbytes or 1) // align) * align  # (nbytes >= 0 here: ``or 1`` is max(nbytes, 1))
        self._clock += 1
        if kind in _PERSISTENT and not (self.live_feed and kind is Kind.OTHER and self._iteration is not None):
            online = self._online
            if self._fits_unplanned and not self.planned and not online["persistent"].fits(size):
                online["learning"].release_empty()  # (a model the program dropped: k-fold's next fold)
            live = _Live("persistent", online["persistent"].alloc(size), size, nbytes)
        else:  # recurring, or (live feed, in an iteration) not known yet
            live = self._alloc_transient(size, nbytes, kind)
        self._live[obj] = live
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
        return live.ptr

    def free(self, obj: int) -> None:
        live = self._live.pop(obj, None)
        if live is None:
            raise LayoutError(f"free of object {obj}, which is not live in the pool")
        self._clock += 1
        self.live_bytes -= live.nbytes
        rec = live.record
        if rec is not None and live.iteration == self._iteration:
            rec.end, rec.end_tick = self._clock - self._iter_clock, self._tick
        elif rec is not None and rec.end is None and rec.end_next is None:
            rec.end_next, rec.end_next_tick = self._clock - self._iter_clock, self._tick
        if live.region is not None:
            live.region.space.free(live.ptr)  # (the region is handed back whole, never by its space)
            live.region.live -= 1
            if live.region.retired and live.region.live == 0:
                self._release(live.region.ptr)
                self._regions.remove(live.region)
        else:
            arena = self._online[live.arena]
            emptied = arena.free(live.ptr)
            if live.arena == "learning" and self.planned and self.planning and not arena.used:
                arena.release()
            elif emptied is not None and self.live_feed and (
                    live.arena == "learning" and self.planned and self.planning
                    or live.arena == "persistent" and not self.planned and self._recording
                    and self._iteration is not None and not self._fits_unplanned):
                # Live feed: learning is done with once planned; a persistent segment emptied
                # while learning held objects wrongly guessed persistent: it goes back before
                # persistent state is placed in it (not forever: a run with no boundaries
                # would return and re-obtain a segment at every top-level allocation).
                arena.release_segment(emptied)

    def address(self, obj: int) -> int:
        try:
            return self._live[obj].ptr
        except KeyError:
            raise LayoutError(f"object {obj} is not live in the pool") from None

    def footprint(self) -> int:
        return self._footprint

    def release(self) -> None:
        """Hand every online segment nothing lives in back to the backend now (what
        ``torch.cuda.empty_cache()`` asks of umrt's pool); the planned region stays."""
        for arena in self._online.values():
            arena.release_empty()

    def hint_kind(self, obj: int, kind: Kind) -> None:
        """What live ``obj`` holds, learned after its allocation (the live feed's kinds).

        Used when the pool next plans: a :attr:`Kind.PARAMETER` or
        :attr:`Kind.OPTIMIZER_STATE` object is left out of the plan, any other
        kind is planned by its lifetime as before. :attr:`Kind.OTHER` says
        nothing and is ignored, as is a hint for an object allocated outside an
        iteration (already persistent). The object's address never changes.

        Raises:
            LayoutError: ``obj`` is not live, or ``kind`` is not a :class:`Kind`.
        """
        live = self._live.get(obj)
        if live is None:
            raise LayoutError(f"kind hint for object {obj}, which is not live in the pool")
        try:
            kind = Kind(kind)
        except ValueError:
            raise LayoutError(f"object {obj}: unknown kind {kind!r}") from None
        if live.record is not None and kind is not Kind.OTHER:
            live.record.kind = kind

    @property
    def live_index(self) -> Mapping[int, _Live]:
        """``obj -> record`` of every live object, each with ``.ptr`` (its
        address) and ``.nbytes`` (as allocated). Read-only: for a caller that
        resolves many addresses per event (the runtime's hot path) without a
        call per object; :meth:`address` is the checked way."""
        return self._live

    # -- what the runtime asks ------------------------------------------------

    def arena_of(self, obj: int) -> str:
        """The arena serving live ``obj`` (one of :data:`ARENAS`): its lifetime class once planned.

        A long-lived object whose whole life falls outside the short-lived
        arena's span (e.g. in the optimizer step) may be placed inside that
        arena's range, which is idle then; it is still reported long-lived.
        """
        try:
            return self._live[obj].arena
        except KeyError:
            raise LayoutError(f"object {obj} is not live in the pool") from None

    def arena_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """``name -> [(ptr, nbytes), ...]`` of the managed memory each arena holds.

        Every range is block-aligned in address and size; e.g. a runtime keeps
        ``arena_ranges()["short-lived"]`` resident on the GPU.
        """
        out: dict[str, list[tuple[int, int]]] = {name: [] for name in ARENAS}
        for name, arena in self._online.items():
            out[name].extend(arena.segments)
        for region in self._regions:
            for name, ranges in region.ranges().items():
                out[name].extend(ranges)
        return out

    def on_iteration_boundary(self, index: int, phase: str = "train") -> None:
        """Iteration ``index`` of loop phase ``phase`` starts now (and the previous one,
        if any, is complete). Only training iterations are planned from: an
        evaluation's allocations take the plan's places where their keys match
        (the same forward, the same sizes) and overflow otherwise, and never make
        the pool re-plan."""
        if index == self._iteration:
            return  # told twice (driver and event stream)
        if self._iteration is not None:
            self._finish_iteration()
        self._iteration = index
        self._iter_clock = self._clock
        self._tick = 0
        self._context = None
        self._ordinals = {}
        if self._training:  # an evaluation's (empty) records never replace a step's
            self._prev_records = self._records
        self._training = phase == "train"
        self._recording = self._training
        self._records = []
        self._stats = _IterStats()

    def observe(self, event: Event) -> None:
        """Feed one event of the program's stream (boundaries, launches, layer events)."""
        t = type(event)
        if t is Launch:
            self.observe_launch(event.exec_id)
        elif t is LayerEnter or t is LayerExit:
            self.observe_layer(t is LayerEnter)
        elif t is IterationBoundary:
            self.on_iteration_boundary(event.index, event.phase)

    def observe_launch(self, exec_id: int) -> None:
        """``observe(Launch)`` for a caller that already knows the event's type
        (the runtime's hot path); only its execution id matters. Ignored with
        ``live_feed``: steady iterations have no launches to key by."""
        if self.live_feed:
            return
        self._clock += 1
        self._context = exec_id
        if self._depth == 0 and self._tick:
            self._tick += 1  # a top-level op (optimizer step, loss) counts as a layer of its own

    def observe_layer(self, enter: bool) -> None:
        """``observe(LayerEnter)`` (``enter``) or ``observe(LayerExit)``, by type already known."""
        self._clock += 1
        self._tick += 1
        if enter:
            self._depth += 1
        elif self._depth > 0:
            self._depth -= 1

    def report(self) -> dict:
        """Counters for reports: footprint, peak live bytes, plan hits/misses, arena sizes."""
        st = self.last_iteration_stats or _IterStats()
        return {
            "planned": self.planned,
            "plans_made": self.plans_made,
            "stopped_planning": self.stopped_planning,
            "footprint": self._footprint,
            "peak_footprint": self.peak_footprint,
            "peak_live_bytes": self.peak_live_bytes,
            "arena_bytes": {k: sum(n for _, n in v) for k, v in self.arena_ranges().items()},
            "last_iteration": {
                "plan_hits": st.hits, "plan_misses": st.misses, "conflicts": st.conflicts,
                "missed_bytes": st.missed_bytes, "eligible_bytes": st.eligible_bytes,
            },
            "total": {
                "plan_hits": self.totals.hits, "plan_misses": self.totals.misses,
                "conflicts": self.totals.conflicts, "missed_bytes": self.totals.missed_bytes,
            },
        }

    # -- internals --------------------------------------------------------------

    def _alloc_transient(self, size: int, nbytes: int, kind: Kind) -> _Live:
        record = key = None
        stats = self._stats
        if self._iteration is not None:
            context = self._context
            code = _NO_KIND if self.live_feed else _KIND_CODE[kind]
            ctx = (context, size, code)
            ordinals = self._ordinals
            ordinal = ordinals.get(ctx, 0)
            ordinals[ctx] = ordinal + 1
            key = (context, size, code, ordinal)
            if self._recording:
                record = _Record(key, size, kind, self._clock - self._iter_clock, self._tick, self._depth > 0)
                self._records.append(record)
                if self.live_feed and len(self._records) >= _MAX_RECORDS:
                    # No boundary for this long (no optimizer step, or the feed stopped): stop
                    # recording an iteration that will not be planned, so memory stays bounded.
                    self._recording = False
                    self._records = []
                    log.warning("umrt: %d allocations without an optimizer step; umrt's pool serves this "
                                "iteration without a planned layout", _MAX_RECORDS)
            stats.eligible_bytes += size
        if not self.planned:
            # Live feed, kind unknown: outside any module is where persistent state is born.
            name = "persistent" if self.live_feed and self._depth == 0 and kind is Kind.OTHER else "learning"
            if name == "persistent" and not self._online[name].fits(size) and not self._fits_unplanned:
                self._online["learning"].release_empty()  # what the layers freed, before more is obtained
            ptr = self._online[name].alloc(size)
            return _Live(name, ptr, size, nbytes, record=record, iteration=self._iteration)
        if not self.planning or self._unplanned_now:  # best fit in what the pool holds, as a caching allocator does
            if self.planning and key is not None and key not in self._plan:  # (a new shape: planned again at its end)
                stats.misses += 1
                stats.missed_bytes += size
            for region in () if self._drain else reversed(self._regions):
                fit = region.best_fit(size, keep_classes=False)  # (no plan to keep them for)
                if fit is not None:
                    return _Live(fit[1], fit[0], size, nbytes, region, record, self._iteration)
            return _Live("learning", self._online["learning"].alloc(size), size, nbytes, record=record,
                         iteration=self._iteration)
        hit = self._plan.get(key) if key is not None else None
        region = next((r for r in reversed(self._regions) if not r.retired), None)  # the plan's
        fit = None
        # A training step's allocation takes its planned place; one whose place is taken, or
        # that the plan does not know, takes memory the pool holds already before more is
        # obtained, as a caching allocator reuses its blocks: the planned region where nothing
        # lives now (best fit), what the learning iterations left free, then the overflow arena.
        # An evaluation's die at once, where its places were planned for a step's lifetimes:
        # the region's free memory comes first, on the GPU, else the lowest (see POOL.md).
        for how in ("planned", "fit") if self._training else ("fit", "planned"):
            if how == "planned" and hit is not None:
                for place in filter(None, (hit, self._plan.get(_twin(key)))):  # (second place: _make_plan)
                    planned, offset, name = place
                    ptr = planned.ptr + offset
                    if planned.space.take(ptr, size):
                        planned.live += 1
                        stats.hits += 1
                        self.totals.hits += 1
                        return _Live(name, ptr, size, nbytes, planned, record, self._iteration)
                stats.conflicts += 1
                self.totals.conflicts += 1
            elif how == "fit":  # (an evaluation's allocation counts as a miss of the plan's)
                stats.misses += 1
                stats.missed_bytes += size
                self.totals.misses += 1
                self.totals.missed_bytes += size
                on_gpu = None if self._training else self._on_gpu
                fit = region.best_fit(size, on_gpu=on_gpu, lowest=not self._training) if region is not None else None
                if fit is not None:
                    break
        if fit is not None:
            return _Live(fit[1], fit[0], size, nbytes, region, record, self._iteration)
        name = "learning" if self._online["learning"].fits(size) else "overflow"
        return _Live(name, self._online[name].alloc(size), size, nbytes, record=record, iteration=self._iteration)

    def _finish_iteration(self) -> None:
        st = self._stats
        self.last_iteration_stats = st
        if self.live_feed:
            self._release_empty(st)
        if self._resume and self._records and self._training and self._recording:
            self._resume, self.planning, self.stopped_planning = False, True, None
            if self.planned:
                self._make_plan(self._recurring_records())  # (a step served best-fit: its own layout)
                return
            self._last_shape, self._unplanned_steps = {}, 0  # never planned: its steps' shapes are learned again
            self._recent_shapes.clear()
        if not self._records or not self._training or not self.planning:
            return
        if self.planned:
            self._plan_served += 1
        records = self._recurring_records()  # what a plan would place
        shape = {r.key: r.size for r in records}
        same_shape, self._last_shape = _same_shape(shape, self._last_shape), shape
        if not self.planned:
            self._unplanned_steps += 1
            # By FIRST_PLAN_BY steps, shapes that take turns have repeated; a step whose shape is
            # not that of half the recent ones (bucketed lengths in a varying order: one of many
            # shapes, some of which repeat by chance) would have most of the next steps miss a
            # plan made from it.
            recent = self._recent_shapes
            repeated = sum(_same_shape(shape, s) for s in recent) * 2 >= len(recent)
            turns = len(recent) >= 3 and _same_shape(shape, recent[-2]) and _same_shape(recent[-1], recent[-3])
            recent.append(shape)
            if turns and self.live_feed and not same_shape:
                self._fits_unplanned = True  # two shapes in strict turns: a caching allocator's cache
            elif same_shape or not self.live_feed or (self._unplanned_steps >= FIRST_PLAN_BY and repeated):
                if self.needs_plan is None or self.needs_plan(self.peak_footprint):
                    self._fits_unplanned = False  # (planned: the learning arena goes back once empty, as always)
                    self._make_plan(records)
                else:  # from now on a caching allocator's cache: what the layers freed is kept for them
                    self._fits_unplanned = True
        elif self._refine:
            self._make_plan(records)  # once: the ends of objects that outlived the learned iteration are known now
        elif self.replan_threshold is not None and st.missed_bytes > self.replan_threshold * st.eligible_bytes:
            if same_shape:  # the shape changed for good, not for one step (a short last batch)
                self._short_plans = self._short_plans + 1 if self._plan_served < SHORT_PLAN else 0
                if self.max_short_plans is not None and self._short_plans >= self.max_short_plans:
                    self.stop_planning(f"{self._short_plans} plans in a row were replaced within "
                                       f"{SHORT_PLAN} training iterations (the allocations do not repeat)")
                else:
                    self._make_plan(records)
                return
            # No shape to plan again from: steps whose shapes never repeat (bucketed lengths in a
            # varying order) keep missing a plan that only spreads them over more memory.
            self._missed_steps += 1
            if self.max_short_plans is not None and self._missed_steps >= MISSED_STEPS:
                self.stop_planning(f"its plan missed most of the bytes of {self._missed_steps} training "
                                   "iterations in a row, each of a shape unlike the one before (the allocations "
                                   "do not repeat)")
        else:
            self._missed_steps = 0

    def _make_plan(self, records: list[_Record]) -> None:
        """Plan from ``records``, this iteration's recurring records (:meth:`_recurring_records`)."""
        if not self.planned:
            self._learned_footprint = self.peak_footprint  # (before the region: what learning held)
        old_regions = list(self._regions)
        length = max(self._clock - self._iter_clock, 1)
        ticks = self._tick
        saw_layers = ticks > 0

        # Cyclic lifetimes: an object still alive at the boundary ends where its counterpart
        # (same key) from the previous iteration ended, one iteration later; if that is not
        # known yet, it is planned as alive all along and the plan is refined once later.
        ends: dict[int, tuple[int, int] | None] = {}
        unknown = 0
        prev_records = {r.key: r for r in self._prev_records if r.kind not in _HINTED_PERSISTENT}
        for r in records:
            if r.end is not None:
                ends[id(r)] = (r.end, r.end_tick)
                continue
            prev = prev_records.get(r.key)
            if prev is not None and prev.end_next is not None and prev.end_next < r.start:
                ends[id(r)] = (length + prev.end_next, ticks + 1 + prev.end_next_tick)
            else:
                ends[id(r)] = None
                unknown += 1
        self._refine = unknown > 0 and not self.planned
        # An object still alive at its next counterpart's birth (a loop holds a step's tensor until
        # the next step's replaces it) gets a second place: one would send every other one elsewhere.
        twins = [replace(r, key=_twin(r.key)) for r in records if ends[id(r)] is None and (
            (p := prev_records.get(r.key)) is not None and p.end_next is not None and p.end_next >= r.start)]
        ends.update((id(r), None) for r in twins)
        records = records + twins
        cut = quietest_point([(r.start, None if ends[id(r)] is None else ends[id(r)][0], r.size) for r in records],
                             length)

        def lifetime(r: _Record) -> Lifetime:
            e = ends[id(r)]
            if e is None:
                return Lifetime(0, length, r.size)
            start = (r.start - cut) % length
            end = start + (e[0] - r.start)
            return Lifetime(start, end, r.size) if end <= length else Lifetime(0, length, r.size)

        def span(r: _Record) -> tuple:
            if not saw_layers:
                return ()
            e = ends[id(r)]
            return (0, ticks + 1) if e is None else (r.tick, e[1])

        short: list[_Record] = []
        groups: dict[tuple, list[_Record]] = {}
        for r in records:
            e = ends[id(r)]
            if e is not None and e[0] <= length and _is_short(r, e[1], saw_layers, self.short_ticks):
                short.append(r)
            else:
                groups.setdefault(span(r), []).append(r)

        # The units placed in the planned region by one SmartPool pass, as
        # (records, their offsets inside the unit, the unit's name):
        # * the short-lived arena, packed on its own (capped; what does not fit is long-lived),
        #   as one block-aligned super-object alive from its first to its last temporary;
        # * each long-lived group of objects alive across the same layers that is big enough
        #   (>= min_group_bytes), packed on its own, as a block-aligned super-object;
        # * the objects of small long-lived groups, one by one in the gaps.
        # Units never alive together reuse the same memory, and no 2 MB block is shared
        # by two super-objects, so neither by two lifetime classes at once.
        units: list[tuple[list[_Record], tuple[int | None, ...], str]] = []
        items: list[Lifetime] = []
        aligns: list[int] = []

        def add_group(members: list[_Record], name: str) -> None:
            lts = [lifetime(r) for r in members]
            p = plan(lts, alignment=self.alignment)
            units.append((members, p.offsets, name))
            start = min(lt.start for lt in lts)
            end = max(max(lt.end, lt.start + 1) for lt in lts)
            items.append(Lifetime(start, end, _up(p.footprint, self.block)))
            aligns.append(self.block)

        if short:
            p = plan([lifetime(r) for r in short], alignment=self.alignment, limit=self.short_lived_bytes)
            fits = [r for r, off in zip(short, p.offsets, strict=True) if off is not None]
            for r, off in zip(short, p.offsets, strict=True):
                if off is None:
                    groups.setdefault(span(r), []).append(r)
            if fits:
                add_group(fits, "short-lived")
        for key in sorted(groups):
            members = groups[key]
            if sum(r.size for r in members) >= self.min_group_bytes:
                add_group(members, "long-lived")
            else:
                for r in members:
                    units.append(([r], (0,), "long-lived"))
                    items.append(lifetime(r))
                    aligns.append(self.alignment)

        # Return what is already empty before asking for the new region (a lower peak). The old
        # plan points into the regions returned here: it goes first, so that if the new region
        # cannot be had (out of memory) every allocation is served online, never from freed memory.
        self._plan = {}
        learning = self._online["learning"]
        if learning.segments and not learning.used:
            learning.release()
        idle = learning.free_blocks()
        for old in old_regions:  # the previous plan's region goes once its objects die
            old.retired = True
            if old.live == 0:
                self._release(old.ptr)
                self._regions.remove(old)
            else:
                idle.extend(old.space.free_blocks())
        if idle and self._on_idle is not None:
            self._on_idle(idle)

        new_plan: dict[PlanKey, tuple[_Region, int, str]] = {}
        if units:
            outer = plan(items, alignments=aligns)
            nbytes = _up(max(outer.footprint, 1), self.block)
            region = _Region(self._malloc(nbytes), nbytes)
            self._regions.append(region)
            for (members, offsets, name), base, item in zip(units, outer.offsets, items, strict=True):
                if name == "short-lived":
                    region.short = (region.ptr + base, item.nbytes)
                for r, off in zip(members, offsets, strict=True):
                    new_plan[r.key] = (region, base + off, name)
            region.space = self._arena("region")
            region.space.adopt(region.ptr, region.nbytes, [])

        self._plan = new_plan
        self.planned = True
        self.plans_made += 1
        self._plan_served = 0
        self._missed_steps = 0

    def stop_planning(self, why: str, budget_bytes: int | None = None) -> None:
        """Serve every allocation best-fit from now on, as a caching allocator does. In the
        ``learning`` arena, as the iterations before the first plan ran (the planned regions
        drain), where the memory the pool held while it learned fits ``budget_bytes`` (the GPU
        memory the run has: the runtime stops it, its steps repeat), or with no budget (the
        pool stops itself: its plans kept missing steps whose allocations do not repeat, so
        its regions' layout fits none of them). Otherwise in the planned regions' free blocks
        first (memory the pool holds, laid out for these steps), then in the ``learning``
        arena. Each planned region keeps its live objects where they are and is handed back
        once nothing lives in it (``why`` goes to :attr:`stopped_planning` and the log)."""
        self._resume = False
        if not self.planning:
            return
        self.planning = False
        self._drain = budget_bytes is None or self._learned_footprint <= budget_bytes
        self.stopped_planning = why
        self._plan = {}
        for region in list(self._regions):
            if region.live == 0:
                self._regions.remove(region)
                self._release(region.ptr)
            else:
                region.retired = True
        log.info("umrt: the pool stopped planning: %s; it serves every allocation best-fit", why)

    def serve_unplanned(self, unplanned: bool) -> None:
        """Whether the iteration starting now is served best-fit in what the pool holds, as a
        caching allocator reuses its blocks, its plan kept for the next ones: umrt's runtime
        asks it for a training step it moves nothing in, once it has acted, where the pool
        holds more than the GPU (see ``POOL.md``, "One step at a time")."""
        self._unplanned_now = unplanned

    def resume_planning(self) -> None:
        """Plan again after :meth:`stop_planning`: from the records of the next training
        step that runs to its end, served best-fit as the steps since the stop were (the
        runtime stopped the plan to time a step doing nothing, and acting won). Live
        objects stay where they are; the regions the stop retired drain as before."""
        if not self.planning:
            self._resume = True

    def _recurring_records(self) -> list[_Record]:
        """This iteration's records without those hinted persistent, whose keys
        (ordinals) are then counted again without them: the next iterations do
        not allocate them again."""
        records = self._records
        kept = [r for r in records if r.kind not in _HINTED_PERSISTENT]
        if len(kept) < len(records):
            ordinals: dict[tuple, int] = {}
            for r in kept:
                ctx = r.key[:3]
                ordinal = ordinals.get(ctx, 0)
                ordinals[ctx] = ordinal + 1
                r.key = (*ctx, ordinal)
        return kept

    def _release_empty(self, st: _IterStats) -> None:
        # Live feed: objects guessed persistent that died, learning segments pinned by an
        # object that outlives the learned iteration, and overflow segments left over once
        # the plan has served every allocation two iterations in a row (not before: a
        # recurring miss, or iterations of two shapes taking turns, would re-obtain them
        # every iteration, a cudaMallocManaged and a cudaFree each time).
        if self._fits_unplanned:  # all the pool holds fits the GPU: keep it, as a caching allocator does
            return
        online = self._online
        online["persistent"].release_empty()
        if self.planned and self.planning:  # (before, every step allocates there: returned, it would be obtained again)
            online["learning"].release_empty()
        clean = self.planned and not st.misses
        if clean and self._clean_before and self.planning:  # (a caching allocator's cache stays)
            online["overflow"].release_empty()
        self._clean_before = clean

    def _malloc(self, nbytes: int) -> int:
        """A block-aligned backend allocation of ``nbytes`` (a multiple of ``block``)."""
        ptr = self.backend.malloc(nbytes)
        raw, raw_n = ptr, nbytes
        if ptr % self.block:
            self.backend.free(ptr)
            raw_n = nbytes + self.block
            raw = self.backend.malloc(raw_n)
            ptr = _up(raw, self.block)
        self._raw[ptr] = (raw, raw_n)
        self._footprint += raw_n
        self.peak_footprint = max(self.peak_footprint, self._footprint)
        return ptr

    def _release(self, ptr: int) -> None:
        raw, raw_n = self._raw.pop(ptr)
        self.backend.free(raw)
        self._footprint -= raw_n
