"""umrt's runtime policy: the event stream in, prefetch / pre-evict / discard out.

:class:`Runtime` learns the first iterations in stable keys, compiles a plan
per iteration shape, then acts on the predicted shape's plan at its decision
points, checking the program against it as it goes. Its collaborators, one job
each: :class:`~umrt.policy.runtime.learning.Learner` (recording and compiling),
:class:`~umrt.policy.runtime.launch_free.LaunchFreeClock` (acting without
launches), :class:`~umrt.policy.runtime.guard.Guard` (mispredictions),
:class:`~umrt.policy.runtime.host_map.HostMapper` (advice) and
:class:`~umrt.policy.runtime.ranges.DecisionRanges` (what a decision moves).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from umrt.backends.base import BLOCK, HOST, Backend, SegmentWatch
from umrt.backends.ranges import RangeSet
from umrt.memory.base import IndexedLayout, PlanningLayout
from umrt.memory.pool import LifetimePool
from umrt.policy.base import Policy, PolicyContext
from umrt.policy.runtime import payoff
from umrt.policy.runtime.guard import Guard
from umrt.policy.runtime.host_map import HostMapper
from umrt.policy.runtime.launch_free import LaunchFreeClock
from umrt.policy.runtime.learning import SIGNATURE_MASK, Learner
from umrt.policy.runtime.options import RuntimeOptions
from umrt.policy.runtime.path_trial import MIGRATE, TRIAL_ITERATIONS, PathTrial
from umrt.policy.runtime.payoff import ACTING, BASELINE, Payoff
from umrt.policy.runtime.phases import LoopPhases
from umrt.policy.runtime.planner import PAGE, SPARE_KEY, Action, IterationRecord, Plan
from umrt.policy.runtime.ranges import NO_ALLOC, AddressIndex, DecisionRanges, free_blocks, touch_blocks
from umrt.policy.runtime.ranges import free_pieces as _free_pieces
from umrt.policy.runtime.rest import Rest
from umrt.policy.runtime.reuse import DeadRangeReuse, without
from umrt.policy.runtime.swapped import Swapped
from umrt.predict.tables import ObjectKeys, VariantTable
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit

if TYPE_CHECKING:  # pragma: no cover
    from umrt.memory.base import Layout
    from umrt.trace.events import Event, Trace

__all__ = ["Runtime"]

log = logging.getLogger("umrt")

_N = itemgetter(1)  # a range -> its bytes
# Pinned staging beyond the plan's figure: objects' whole pages and the 64 KiB slots round up,
# and an iteration may keep a little more away than the one it was planned on.
STAGING_MARGIN = 1.25
# A pool segment at least this large is populated whole when it is made (see _segment_made):
# one call instead of one per object to come; a small one holds few.
WHOLE_SEGMENT = 8 << 20
# Where an iteration's signature starts, by loop phase: an evaluation batch and a
# training step never share a plan, even where their launches would agree.
_PHASE_SEED = {"train": 0, "eval": 0x5EED_E7A1}
# What no user sets (tests change them with monkeypatch); RuntimeOptions holds what a user does.
#: Iterations a new plan is acted on while still recorded launch by launch (a deviation then
#: teaches the runtime the new shape) before it is trusted and runs without launches; 0 for a
#: capture that delivers an iteration's launches only at its end.
PROBE_ITERATIONS = 2
#: Freed objects at least this large have their pages discarded.
MIN_DISCARD = PAGE
#: Advise parameters ReadMostly while acting, so evicting them costs no copy back. Off: in the
#: simulator it changes iteration time by under 0.3% (parameter evictions are a small share of the traffic).
READ_MOSTLY = False
#: Let a trusted plan whose objects keep their addresses (each allocation is checked against the
#: last iteration of the same shape) reuse its decisions' ranges without resolving any key: the
#: cheapest steady state. Moves are the same either way.
FREEZE = True
#: Where the backend has the pinned-copy path (``Backend.swap.pinned_copies``: CUDA 13, discard,
#: pinned staging), let the planner take objects off the GPU and back through it where that costs
#: less than page migration; False: page migration only.
SWAP = True


def _reference_key(plan: Plan) -> tuple[int, bool]:
    """What an iteration's addresses (by allocation ordinal) are a reference for: the
    plan's shape, run with launches or as its launch-free variant (other ordinals)."""
    return plan.signature, plan.keymap is not None


class Runtime(Policy):
    """umrt's runtime policy, registered as ``"umrt"``.

    It consumes the program's event stream one event at a time (from the live
    capture or a replay in the simulator), never looks ahead in it, and drives
    any :class:`~umrt.backends.base.Backend` through that interface only.
    Per iteration (between two :class:`IterationBoundary` events) it is in one
    mode: ``learn`` (record the iteration, do nothing to memory; at the boundary
    compile a plan for its signature), ``act`` (follow the predicted shape's
    plan, see :meth:`_start_iteration`), ``rebase`` (see
    :meth:`LaunchFreeClock.mismatch`), ``off`` (after a deviation) or
    ``none`` (do nothing: acting loses in this loop phase, or this iteration is held back
    to check that it does, see :class:`~umrt.policy.runtime.payoff.Payoff`; or the
    phase rests, its shapes never repeating, :mod:`~umrt.policy.runtime.rest`). Each loop phase
    (``IterationBoundary.phase``: a training step, an evaluation batch) has its
    own plans, learned and predicted apart.

    Parameters
    ----------
    trace:
        Ignored: the runtime learns from the events it is given, never from a
        trace's future (the argument exists for the policy registry).
    op_level, learn_iterations, ...:
        The fields of :class:`~umrt.policy.runtime.options.RuntimeOptions`
        (what each means, and their limits), held as ``self.options``.
    """

    name = "umrt"

    def __init__(self, trace: Trace | None = None, **options: Any) -> None:
        # The knobs and their defaults: RuntimeOptions, validated there (one place for each).
        unknown = sorted(set(options) - set(RuntimeOptions.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown runtime option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(RuntimeOptions.__dataclass_fields__)}")
        self.options = options = RuntimeOptions(**options)
        # The options on_event reads at every Free, copied: one attribute read, not two.
        self._min_discard = MIN_DISCARD
        self._discard_on_free = options.discard_on_free
        # False while the runtime acts without launches (a live driver may stop capturing them).
        self.wants_launches = True

        self.counters = {
            "iterations": 0, "learned": 0, "acted": 0, "deviations": 0, "guard_trips": 0,
            "plans_compiled": 0, "decisions": 0, "prefetch_calls": 0, "prefetched_bytes": 0,
            "evicted_bytes": 0, "discarded_bytes": 0, "unresolved": 0, "host_mapped_bytes": 0, "switches": 0,
            "discard_calls": 0, "launch_host_mapped_bytes": 0, "frozen_iterations": 0, "unfreezes": 0,
            "light_iterations": 0, "late_decisions": 0, "light_rebases": 0, "held_iterations": 0,
            "unsure_iterations": 0, "rested_iterations": 0, "stopped_acting": 0, "swapped_out_bytes": 0, "swapped_in_bytes": 0, "swap_calls": 0, "swap_restores": 0,
            "populated_ahead_bytes": 0,
        }
        self._n_discard_calls = 0  # hot counters as attributes (report() adds them up)
        self._n_discarded = 0
        self._n_populate_calls = 0
        self._n_populated = 0
        self._populated_segments: dict[int, int] = {}  # pool segment -> bytes populated at its making
        self._segments: dict[int, int] = {}  # the layout's managed segments: ptr -> nbytes
        self._peak_held = 0  # the most bytes they held at once in this iteration
        self._held_known = False  # the layout is one make_layout made: its segments are counted
        self.log: list[dict] = []  # one line per iteration: mode, signature, moves
        self._predicted: int | None = None  # the running iteration's predicted plan (acted on or not)
        self._dry = False  # that plan is only checked, not acted on (Guard.unsure)
        self._rested = False  # this iteration rests: its phase's shapes never repeat (Rest)

        self.keys = ObjectKeys()
        self.variants = VariantTable()
        self.plans: OrderedDict[int, Plan] = OrderedDict()
        self._alloc_of: dict[int, Alloc] = {}  # live obj -> its Alloc event (bytes, kind)
        # Pages umrt itself took off the GPU (discarded, evicted, host-mapped) or that no one populated
        # yet (new pool segments): a newborn landing there is prefetched to the GPU before its kernel.
        self._off_gpu = RangeSet()
        self._off_gpu_ends = self._off_gpu.ends  # empty while nothing is off the GPU (the hot path's test)
        # The part of it no live object holds (dead ranges discarded, segments never populated):
        # a newborn's population takes in what of its 2 MB blocks lies there, in the same call.
        self._free_off_gpu = RangeSet()
        # Live ranges umrt swapped out (data in the backend's pinned staging; each range as swap.out had
        # it: one allocation's whole pages): back with swap.back before a kernel reads it, or released.
        self._swapped = Swapped(self.counters, self._off_gpu)
        self._paths = PathTrial()  # per shape: its swapping plan or its migration-only twin, by measured times

        self._learner = Learner(self.keys, self.plans, self.counters)
        self.phases = LoopPhases(self._learner, self.plans, self.variants)
        self._guard = Guard(self, self.plans, self.phases)
        self._host = HostMapper(self.keys, self._alloc_of, self._off_gpu, self.counters)
        self._clock = LaunchFreeClock(self, self._guard, self._host, self.plans, self.phases, self.keys,
                                      self.variants, self._learner)
        self._checks_payoff = payoff.WINDOW > 0
        self._payoff = Payoff(payoff.WINDOW or 1, payoff.MARGIN)
        self._rest = Rest()  # phases whose shapes never repeat: not recorded
        self._ranges = DecisionRanges(self.keys)
        # The mapper's collections, read on the hot path (never rebound).
        self._host_mapped = self._host.mapped
        self._read_mostly_objects = self._host.read_mostly_objects
        self._launch_mapped = self._host.launch_mapped

        # The iteration.
        self._mode = "learn"
        self._iteration: int | None = None
        self.record: IterationRecord | None = None  # while learning or probing
        self.n_launches = 0  # launches this iteration (as recorded, when acting without them)
        self._n_frees = 0
        self.n_events = 0  # the launch-free clock: non-launch events this iteration
        self.events_hash = 0  # their running hash (sizes, freed sizes, module names)
        self.after_rare = False  # the iteration follows a rare shape of its phase: freed sizes do not count
        self.shape_hash = 0  # after a rare shape only: events_hash without freed sizes (Plan.events_match)
        self.sizes_hash = 0  # the running hash of the sizes allocated this iteration (Plan.allocates)
        # Acting.
        self.plan: Plan | None = None
        self.actions: list[Action] = []
        self.next_action = 0  # index in actions
        self._next_launch = -1  # the next decision's launch ordinal, when launches decide it
        self._probe_left = 0  # decisions still acted on while recording (a plan not yet trusted)
        self.acting_launch_free = False  # acting on the launch-free clock (implies mode act)
        self.counting_launches = False  # acting launch-free, but counting launches for decisions no event precedes
        self.due_event = -1  # the next launch-free event something is due at (-1: none)
        # Acting without launches on a plan whose launch-free clock is not yet confirmed:
        # this iteration's non-launch events as tokens (see launch_free.rebase), and the
        # plan variant's allocation ordinal -> key map (None: ordinals are keys).
        self.event_tokens: list[int] | None = None
        self.token_objects: list[int] = []  # the objects those allocation tokens announced
        self.keymap: tuple[int, ...] | None = None
        self.oversized: dict[int, tuple[int, ...]] = {}  # the acting plan's oversized launch -> keys
        # Keys whose range is discarded when they die: the acting plan's (none while learning: without a
        # plan there is no pressure to relieve, and a discarded range costs a prefetch before its next owner).
        self.discard_keys: frozenset[int] = frozenset()
        self._drop_at_free: set[int] = set()  # keys the acting plan found dead: discarded when freed
        self._pending_discards: list[tuple[int, int]] = []  # dead ranges to discard at the next allocation or boundary
        self._reuse = DeadRangeReuse()  # dead ranges a newborn takes at once: held for it
        # Frozen: a trusted plan whose objects keep their addresses (checked at every allocation against
        # the last iteration of the same shape) reuses its memoized decision ranges (DecisionRanges.resolve).
        self._frozen = False
        # The shape whose last iteration, just before this one, put every object where the one
        # before it had: where the newborns of this one will be (Action.populate), before their birth.
        self._steady_shape: int | None = None
        self._addresses: list[int] | None = None  # this iteration's addresses, by allocation ordinal
        self._reference: tuple[tuple[int, bool], list[int]] | None = None  # the running iteration's reference
        # The last full iteration's addresses of each shape (a training step's survive an evaluation).
        self._references: OrderedDict[tuple[int, bool], list[int]] = OrderedDict()
        self._moved = False  # this iteration issued a move of a plan's (what the payoff check counts)
        self._pool_held = False  # the pool stopped planning for a held training step, not timed yet
        self._held_shape = 0  # the shape of an iteration held back for a fresh baseline (Payoff.wants_baseline)
        self._deviations_before = 0  # deviations when this iteration started
        self._left_plan = False  # this iteration left the plan it was given (a deviation, or a probe's other shape)
        self._touched: set[int] | None = None  # the 2 MB blocks a recorded evaluation's launches touched

    # -- Policy -----------------------------------------------------------------

    @property
    def warmup_iterations(self) -> int:
        """Learned iterations, then :data:`PROBE_ITERATIONS` acted on while still
        recorded before the plan is trusted and runs in steady state (and, where the
        plan may swap, the iterations that try it against page migration: PathTrial)."""
        return self.options.learn_iterations + PROBE_ITERATIONS + (TRIAL_ITERATIONS if SWAP else 0)

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        self.backend: Backend = ctx.backend
        self.layout: Layout = ctx.layout
        # obj -> record with .ptr and .nbytes: the pool's own index (a dict lookup
        # instead of a call per address on the hot path), else one over address().
        if isinstance(ctx.layout, IndexedLayout):
            self._live_index = ctx.layout.live_index
        else:
            self._live_index = AddressIndex(ctx.layout.address, self._alloc_of)
        self.profile = ctx.profile
        self._ranges.connect(self._live_index, ctx.layout.address)
        self._host.connect(ctx.backend, ctx.layout.address, ctx.profile)
        self._swapped.connect(ctx.backend.swap)
        self.set_budget(ctx.budget_bytes)

    def set_budget(self, budget_bytes: int) -> None:
        """Change the GPU memory the runtime plans for (plans are recompiled lazily)."""
        self.ctx.budget_bytes = int(budget_bytes)
        self._learner.new_planner(budget_bytes, self.profile, op_level=self.options.op_level,
                                  swap=SWAP and self.ctx.backend.swap.pinned_copies)
        self.plans.clear()
        self._clock.forget_plans()
        if self._mode == "act":
            self.stop_acting("off", wants_launches=True)

    def stop_acting(self, mode: str, *, wants_launches: bool) -> None:
        """Leave the acting state for ``mode`` ("off": learn again; "rebase": wait
        for a launch-free iteration to re-base the plan on; "none": do nothing this
        iteration, acting loses in its phase, so no decision, reference address or
        key map either), with no decision due."""
        self._mode = mode
        self.acting_launch_free = self.counting_launches = False
        self.due_event = -1
        self.wants_launches = wants_launches
        self.discard_keys = frozenset()
        self.oversized = {}
        if mode == "none":
            self._frozen = False
            self._addresses = self._reference = self.keymap = None
            self._next_launch = self._clock.next_event = -1
            self._clock.follow({})
        self.restore_swapped()

    def unfreeze(self) -> None:
        """Addresses can no longer be trusted this iteration: decisions resolve
        every key again, and this iteration is no reference for the next."""
        if self._frozen:
            self.counters["unfreezes"] += 1
        self._frozen = False
        self._addresses = None

    def detach(self) -> None:
        """The live source stopped for good: what is swapped out comes back now."""
        self.restore_swapped()

    def restore_swapped(self) -> None:
        """Copy back every range still swapped out (see :meth:`Swapped.restore`)."""
        self._swapped.restore()

    def make_layout(self, backend: Backend, *, live_feed: bool = False) -> Layout:
        """umrt's lifetime-aware pool (the caching-allocator model with ``use_pool=False``); ``live_feed``:
        the pool as a live allocator feeds it (kinds unknown at allocation, see :class:`~umrt.memory.pool.LifetimePool`)."""
        self._held_known = True
        if self.options.use_pool:
            # The pool plans its layout for moves: none are needed while all it holds fits the GPU,
            # nor while umrt only checks its training-step predictions (Guard.unsure), where a plan
            # made from one step would spread the next over more memory.
            def needs_plan(held: int) -> bool:
                return held > self.ctx.budget_bytes and not self._guard.unsure("train")
            return LifetimePool(SegmentWatch(backend, self._segment_made, self._released), live_feed=live_feed,
                                on_idle=self._pool_idle, needs_plan=needs_plan,
                                on_gpu=self._off_gpu.gaps)
        return super().make_layout(SegmentWatch(backend, self._segment_made, self._released))

    def _pool_idle(self, ranges: list[tuple[int, int]]) -> None:
        """The pool leaves ``ranges`` idle (nothing lives there): their whole pages are
        discarded with the next batch of dead ranges, so no eviction copies them out."""
        for ptr, nbytes in ranges:
            start = -(-ptr // PAGE) * PAGE
            end = (ptr + nbytes) // PAGE * PAGE
            if end - start >= self._min_discard:
                self._pending_discards.append((start, end - start))
        if self._pending_discards:
            self._flush()  # now: before the new plan's memory is populated

    def _segment_made(self, ptr: int, nbytes: int) -> None:
        """The pool made a segment: nothing has populated its pages yet. A large one (a plan's
        region: many objects to come) is populated on the GPU at once, in one call, while the
        segments populated so fit the budget (as the live allocator populates its segments,
        :class:`~umrt.allocators.managed.ManagedPool`); else each newborn placed there is
        populated by a prefetch, not by first-touch faults."""
        self._segments[ptr] = nbytes
        self._peak_held = max(self._peak_held, sum(self._segments.values()))
        if nbytes >= WHOLE_SEGMENT and sum(self._populated_segments.values()) + nbytes <= self.ctx.budget_bytes:
            self.backend.populate([(ptr, nbytes)])
            self._populated_segments[ptr] = nbytes
            self._n_populate_calls += 1
            self._n_populated += nbytes
            return
        self._off_gpu.add(ptr, nbytes)
        self._free_off_gpu.add(ptr, nbytes)

    def _released(self, ptr: int, nbytes: int) -> None:
        """The pool handed a segment back: pending discards inside it are moot, and
        advice held for the launch that just ran must not be undone on freed memory."""
        end = ptr + nbytes
        self._segments.pop(ptr, None)
        self._populated_segments.pop(ptr, None)
        self._off_gpu.remove(ptr, nbytes)
        self._free_off_gpu.remove(ptr, nbytes)
        if self._swapped:  # only dead objects lie in a segment the pool gives back
            self._swapped.forget(ptr, end, release=False)
        if self._pending_discards:
            self._pending_discards = [r for r in self._pending_discards if not ptr <= r[0] < end]
        self._reuse.released(ptr, end)
        self._host.released(ptr, end)
        # Memoized decision ranges may point into it: never reuse them unchecked.
        self.unfreeze()
        self._reference = None
        self._references.clear()
        self._ranges.forget()

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
            km = self.keymap
            key = ordinal if km is None else (km[ordinal] if ordinal < len(km) else SPARE_KEY + ordinal)
            key_of = keys.key_of
            old = key_of.get(obj)
            if old is not None:
                keys.obj_of.pop(old, None)
            key_of[obj] = key
            keys.obj_of[key] = obj
            self._alloc_of[obj] = event  # its nbytes and kind, for as long as it lives
            addresses = self._addresses
            off_gpu = self._off_gpu_ends
            ptr = -1  # where the layout placed it, once read
            if addresses is not None or self._frozen or off_gpu:
                try:
                    ptr = self._live_index[obj].ptr
                except KeyError:
                    ptr = self.layout.address(obj)  # not live: the layout's error says why
                if addresses is not None:
                    addresses.append(ptr)
                elif self._frozen:
                    ref = self._reference[1]
                    if ordinal >= len(ref) or ref[ordinal] != ptr:
                        self.unfreeze()
            if self._reuse:
                self._pending_discards += self._reuse.born(self.layout.address(obj), event.nbytes, self.n_events)
            if self._pending_discards:
                # A newborn on a dead range not discarded yet takes it as it is: a discard
                # would only cost the call and then a population of the same pages before
                # its kernel writes them (or hit the data of one born written by the host).
                ptr = self.layout.address(obj)
                self._pending_discards = without(self._pending_discards, ptr, ptr + event.nbytes)
            n_events = self.n_events  # the launch-free clock
            self.n_events = n_events + 1
            events_hash = self.events_hash = ((self.events_hash * 1000003) ^ (event.nbytes << 1)) & SIGNATURE_MASK
            self.sizes_hash = ((self.sizes_hash * 1000003) ^ event.nbytes) & SIGNATURE_MASK  # (sizes_hash_step)
            if self.after_rare:
                self.shape_hash = ((self.shape_hash * 1000003) ^ (event.nbytes << 1)) & SIGNATURE_MASK
            rec = self.record
            if rec is not None:
                rec.add_alloc(self.n_launches, key, event)
                rec.launch_free_clock.append((self.n_launches, events_hash))
                rec.tokens.append(event.nbytes << 3)  # planner.launch_free_token(nbytes << 1, ALLOC_TOKEN)
            if self.event_tokens is not None:
                self.event_tokens.append(event.nbytes << 3)
                self.token_objects.append(obj)
            # Dead ranges are discarded before the newborn that may reuse one is
            # written (a live allocation arrives before its op's kernel is queued),
            # and what of its range umrt took off the GPU comes back first.
            if self._pending_discards:
                self._flush()
            if self._swapped:
                self._check_swapped(n_events, events_hash)
            if off_gpu:  # (the flush may have just filled it)
                if ptr < 0:
                    ptr = self.layout.address(obj)
                if self._off_gpu.overlaps(ptr, event.nbytes):
                    self._populate(ptr, event.nbytes)
            if n_events == self.due_event:
                self._clock.on_due_event(n_events)
        elif t is Free:
            obj = event.obj
            keys = self.keys  # ObjectKeys.free, inlined
            key = keys.key_of.pop(obj, None)
            if key is not None:
                other = keys.obj_of.pop(key, obj)
                if other != obj:  # the key has passed to another object meanwhile: keep it
                    keys.obj_of[key] = other
            if self._host_mapped and obj in self._host_mapped:
                self._host.unmap(obj)
            if self._read_mostly_objects and obj in self._read_mostly_objects:
                self._host.unset_read_mostly(obj)
            # The acting plan's long-lived dead are dropped (their pages would be
            # evicted, i.e. copied, under pressure), batched until the next allocation
            # or module boundary (nothing can write them before an allocation): the same
            # events whether or not launches are seen, so a plan acts alike either way.
            nb = self._alloc_of.pop(obj, NO_ALLOC).nbytes
            if self._swapped:  # what of it is still swapped out is dropped from the staging
                try:
                    ptr = self._live_index[obj].ptr
                except KeyError:
                    pass  # never placed by the layout: nothing of it was swapped
                else:
                    self._swapped.forget(ptr, ptr + nb, release=True)
            if nb >= self._min_discard:
                if key in self.discard_keys or key in self._drop_at_free:
                    try:
                        ptr = self._live_index[obj].ptr
                    except KeyError:
                        ptr = self.layout.address(obj)  # not live: the layout's error says why
                    start = -(-ptr // PAGE) * PAGE  # whole pages only: never a neighbour's bytes
                    end = (ptr + nb) // PAGE * PAGE
                    if end > start and not self._reuse.died(start, end, key, self.n_events):
                        self._pending_discards.append((start, end - start))
            self._n_frees += 1
            n_events = self.n_events
            self.n_events = n_events + 1
            events_hash = self.events_hash = ((self.events_hash * 1000003) ^ ((nb << 1) | 1)) & SIGNATURE_MASK
            if self.after_rare:
                self.shape_hash = ((self.shape_hash * 1000003) ^ 1) & SIGNATURE_MASK  # (FREED, any size)
            rec = self.record
            if rec is not None:
                if key is not None:
                    rec.frees.append((self.n_launches, key))
                rec.launch_free_clock.append((self.n_launches, events_hash))
                rec.tokens.append((nb << 3) | 5)  # launch_free_token((nb << 1) | 1, FREE_TOKEN)
            if self.event_tokens is not None:
                self.event_tokens.append((nb << 3) | 5)
            if self._discard_on_free and self._pending_discards:
                self._flush()
            if self._swapped:
                self._check_swapped(n_events, events_hash)
            if n_events == self.due_event:
                self._clock.on_due_event(n_events)
        elif t is Launch:
            if self.acting_launch_free and not self.counting_launches:
                return  # acting on the launch-free clock: launches are not needed
            if self.record is not None:
                self._learner.record_launch(self.record, event, self._n_frees)
                if self._touched is not None:
                    touch_blocks(self._touched, event.accesses, self._live_index)
            if self._launch_mapped:
                self._host.unmap_launch()
            n = self.n_launches
            self.n_launches = n + 1
            if self._swapped and (self.plan is None or n >= self.plan.n_launches):
                self.restore_swapped()  # a launch the plan never saw: it may read what is away
            if n == self._next_launch and self._mode == "act":
                self._decide(event)
            if self.oversized and n in self.oversized and self._mode == "act":
                self._host.map_for_launch(self.oversized[n], self.plan.remote_fresh.get(n, frozenset()),
                                          self.plan.remote_head.get(n))
        elif t is LayerEnter or t is LayerExit:
            n_events = self.n_events
            self.n_events = n_events + 1
            v = hash(event.module) ^ (t is LayerEnter)
            events_hash = self.events_hash = ((self.events_hash * 1000003) ^ v) & SIGNATURE_MASK
            if self.after_rare:
                self.shape_hash = ((self.shape_hash * 1000003) ^ v) & SIGNATURE_MASK
            rec = self.record
            if rec is not None:
                rec.boundaries.append(self.n_launches)
                rec.launch_free_clock.append((self.n_launches, events_hash))
                rec.tokens.append((v << 2) | 2)  # launch_free_token(v, LAYER_TOKEN)
            if self.event_tokens is not None:
                self.event_tokens.append((v << 2) | 2)
            if self._pending_discards:
                self._flush()
            if self._swapped:
                self._check_swapped(n_events, events_hash)
            if self.acting_launch_free and n_events == self.due_event:
                self._clock.on_due_event(n_events)
        elif t is IterationBoundary:
            self._boundary(event.index, event.phase)
            if isinstance(self.layout, PlanningLayout):  # a training step umrt moves nothing in, memory short
                self.layout.serve_unplanned(self._mode != "act" and event.phase == "train"
                                            and "train" in self._payoff.acting
                                            and self.layout.footprint() > self.ctx.budget_bytes)

    def hint_kind(self, obj: int, kind: Kind) -> None:
        """What a live object holds, learned after it was announced (a live
        allocator announces every block as ``Kind.OTHER``; the optimizer's
        facts come after its step). Plans compiled from then on see it."""
        ev = self._alloc_of.get(obj)
        if ev is None or ev.kind == kind:
            return
        self._alloc_of[obj] = replace(ev, kind=kind)
        rec = self.record
        key = self.keys.key_of.get(obj)
        if rec is not None and key is not None:
            rec.kinds[key] = kind

    def iteration_time(self, index: int, seconds: float) -> None:
        """Iteration ``index`` took ``seconds`` (simulated, or measured live): where
        acting is found to lose in its phase, the runtime stops acting there."""
        decided = self._paths.timed(index, seconds)
        if decided is not None and decided[0] in self.plans:  # the shape keeps one path from now on
            sig, kept = decided
            plan = self.plans[sig]
            if plan.migration_only is not None:
                self.plans[sig] = plan.migration_only if kept == MIGRATE else replace(plan, migration_only=None)
        if not self._checks_payoff:
            return
        phase = self._payoff.timed(index, seconds)
        if phase is not None:
            self.counters["stopped_acting"] += 1
            log.info("umrt: stopped acting in %s iterations: %s", phase, self._payoff.stopped[phase])
        if self._pool_held and not self._payoff.checking("train"):  # the held step decided
            self._pool_held = False
            # acting won: its steps get the pool's planned layout back
            if self._payoff.allows("train") and isinstance(self.layout, PlanningLayout):
                self.layout.resume_planning()

    def report(self) -> dict:
        """Counters: iterations learned / acted, deviations, moves, table sizes."""
        out = dict(self.counters)
        out["discard_calls"] += self._n_discard_calls
        out["discarded_bytes"] += self._n_discarded
        out["prefetch_calls"] += self._n_populate_calls
        out["populate_calls"] = self._n_populate_calls
        out["populated_bytes"] = self._n_populated
        out.update(
            mode=self._mode, variants=len(self.plans), correlation_rows=len(self._learner.correlation),
            correlation_accuracy=round(self._learner.correlation.accuracy, 4),
            data_rows=len(self._learner.data),
            phases=self.phases.report(self._payoff.report()),
            paths=self._paths.report(),  # shapes settled on swapping or on page migration
        )
        for phase, row in out["phases"].items():
            row.update(unsure=self._guard.unsure(phase), resting=self._rest.resting(phase))  # (see guard.py, rest.py)
        if self.plan is not None:
            out["plan"] = dict(self.plan.stats)
        return out

    # -- iteration boundaries -----------------------------------------------------

    def _boundary(self, index: int, phase: str) -> None:
        """One iteration ends (its plan finished, its record compiled); the next, of ``phase``, starts."""
        c = self.counters
        # The most managed memory the layout has held: while it fits the GPU nothing has to move.
        held, budget = self._peak_held if self._held_known else self.layout.peak_footprint_bytes(), self.ctx.budget_bytes
        self._peak_held = sum(self._segments.values())  # (the next iteration's peak starts at what is held now)
        # The dead ranges held for a step's newborns are discarded as the step ends, unless
        # an evaluation comes next: its newborns take them in place (the pool gives an
        # evaluation free memory on the GPU first), as plain Unified Memory reuses resident pages.
        held_dead = self._reuse.release()
        if phase == "train":
            self._pending_discards += held_dead
        # Training resumes after iterations no training plan acted on (learned, or an evaluation),
        # or an evaluation opens after training: the driver has left the dead where it chose,
        # evicted with their bytes or resident, where a training plan assumes dead memory holds
        # nothing and an evaluation takes free memory umrt did not take off the GPU for resident.
        # Where memory is short, every 2 MB block no live object touches is discarded (else the driver copies
        # dead bytes out, or back where a newborn lands; pages among live ones would scatter the next faults).
        resumes = phase == "train" and not (self._mode == "act" and self.phases.phase == "train")
        if (resumes or (phase == "eval" and self.phases.phase == "train")) and self._iteration is not None and (
                held is not None and held > budget and not isinstance(self._live_index, AddressIndex)):
            self._pending_discards += free_blocks(self._segments, self._live_index.values(), self._free_off_gpu, BLOCK)
        if self._pending_discards:  # as at any other event: whether or not launches are seen
            self._flush()
        if self.acting_launch_free:
            self._clock.finish_iteration()
        if self._mode == "act" and self.record is not None and self._learner.signature != self.plan.signature:
            # A probed iteration (recorded launch by launch) of another shape that no
            # decision told apart (a plan with nothing to do has none): learn it.
            c["switches"] += 1
            self._mode = "learn"
            self._left_plan = True
        elif self._mode == "act" and self.record is None and not self.actions and (
                self.n_launches > self.plan.n_launches or not self.plan.allocates(self.keys.ordinal, self.sizes_hash)):
            # A trusted plan with no decision to tell the iteration apart, which ran launches the plan never saw (an
            # unfrozen backbone's backward) or allocated otherwise (a longer context): not of its shape, which the
            # variant table must not learn. (Fewer launches tell nothing: a capture may resume late.)
            self._guard.deviate(nothing_held=True)
        if self._iteration is not None:
            c["iterations"] += 1
            self._finish_iteration()
        self._iteration = index
        # The signature of the iteration that just ended names its survivors.
        signature = self._learner.signature
        sig = signature if self._mode == "learn" else (self.plan.signature if self.plan else 0)
        if self._mode not in ("learn", "act", "rebase"):
            sig = signature ^ 0x5A5A  # a shape we never finished; its keys must not clash
        moved = self.keys.boundary(sig)
        if self.record is not None and self._mode == "learn":
            self.record.carried = moved
            # Nothing to move where all the layout has held fits the GPU, or (an evaluation)
            # where the 2 MB blocks the learned iteration touched do: doing nothing, once they are
            # in, nothing of it is evicted (issue 24: an evaluation that fits runs with nothing moved).
            fits = ("held" if held is not None and held <= budget else
                    "touched" if self._touched is not None and len(self._touched) * BLOCK <= budget else None)
            if self._learner.learn(self.record, self.phases.phase, fits=fits, left=self._guard.left_shape):
                self._payoff.new_shape(self.phases.phase)
        if held is not None and held > budget and self._learner.forget_held_fits():
            self._clock.forget_plans()  # the layout outgrew the GPU: plans that moved nothing move now
        self.phases.boundary(phase)
        self._start_iteration()

    def _finish_iteration(self) -> None:
        """The iteration that ended: the guard's outcome, the plan's runs, reference addresses, the log."""
        mode, phase = self._mode, self.phases.phase
        entry = {"iteration": self._iteration, "mode": mode}
        # The addresses of a complete iteration of a known shape are the reference
        # the next one of that shape is checked against (a frozen one held them).
        if self._frozen:
            self.counters["frozen_iterations"] += 1
        ref = self._reference
        steady = mode == "act" and ref is not None and ref[0] == _reference_key(self.plan) and (
            self._frozen or self._addresses == ref[1])  # (frozen to its end: every address checked)
        self._steady_shape = self.plan.signature if steady else None
        if self.acting_launch_free:
            self.counters["light_iterations"] += 1
        if self._addresses is not None and mode in ("act", "learn"):
            key = _reference_key(self.plan) if mode == "act" else (self._learner.signature, False)
            self._references[key] = self._addresses
            self._references.move_to_end(key)
            if len(self._references) > max(1, self._learner.max_variants):
                self._references.popitem(last=False)
        elif not self._frozen and self._reference is not None:
            self._references.pop(self._reference[0], None)
        entry["phase"] = phase
        if self.counters["deviations"] > self._deviations_before or self._left_plan:
            entry["deviated"] = True
        if self._dry:
            entry["unsure"] = True
        if self._rested:
            entry["rested"] = True
        if self._predicted is not None:
            # Acted on: right unless the program left the plan in its first half (a plan that
            # held most of the way, or a shape that only ends otherwise, paid as far as it went).
            # Only checked (unsure): right if the iteration was that shape.
            self._guard.predicted(phase, self._learner.signature == self._predicted if self._dry
                                  else not self._guard.left_early)
            self._predicted = None
        if mode == "act":
            self._guard.outcomes(phase).append(True)
            sig = self.plan.signature
            if self.event_tokens is not None:  # its launch-free clock held for a whole iteration
                self._clock.confirmed.add(sig)
            self._learner.ran(sig)
            self.variants.observe(self.plan.signature)
            self.counters["acted"] += 1
            entry["signature"] = self.plan.signature
        elif mode == "rebase":
            self._clock.rebase(entry)
        elif mode == "off":
            self.variants.forget_last()  # an unknown shape: predict from scratch, learn next
            self._learner.seek(phase)
            if self._guard.left_launch_free:  # unknown, and not recorded: seek it (see Learner.learn)
                self._learner.seek_left[phase] = self._learner.max_variants
        elif mode == "learn" and self.record is not None:
            self.record.signature = self._learner.signature
            self.variants.observe(self._learner.signature)
            self.counters["learned"] += 1
            entry["signature"] = self._learner.signature
        # The payoff check's samples: an iteration that followed its plan to the end, or
        # one that moved nothing of a plan's (not the run's first: set-up's costs).
        role, shape = None, 0
        if mode == "act":
            role, shape = ACTING, self.plan.signature
            self._paths.ran(self._iteration, self.plan)
        elif not self._moved and mode in ("learn", "none") and self.counters["iterations"] > 1:
            role, shape = BASELINE, (self._learner.signature if mode == "learn" else self._held_shape)
        self._held_shape = 0
        self._payoff.iteration(self._iteration, phase, role, shape)
        if mode == "none" and not entry.get("rested"):
            self.counters["held_iterations"] += 1
        self._rest.ran(phase, self.sizes_hash, True if mode == "learn" and self.record is not None
                       else False if mode == "act" else None)
        self.phases.finished(phase, entry.get("signature"))
        self.event_tokens = None
        self.token_objects = []
        self.log.append(entry)
        if len(self.log) > 256:
            del self.log[:128]

    def _start_iteration(self) -> None:
        """Choose what this iteration does: learn it, or act on the plan of the
        shape the variant table predicts.

        A plan not yet confirmed by :data:`PROBE_ITERATIONS` full iterations is acted
        on while the iteration is still recorded, so a deviation turns it into a
        learned one; a trusted plan runs without a record (cheapest), on the
        launch-free clock where it has one (``launch_free``), and *frozen* where
        its objects came back at the same addresses as in the last iteration of
        its shape: its decisions reuse their memoized ranges without resolving a
        single key, while every allocation is still checked against that
        reference (one that lands elsewhere ends freezing for the iteration).
        """
        self._guard.new_iteration()
        self.n_launches = 0
        self._n_frees = 0
        self.n_events = 0
        self.events_hash = self.shape_hash = self.sizes_hash = 0
        self.after_rare = False
        self._moved = False
        self._deviations_before = self.counters["deviations"]
        self._left_plan = False
        self._dry = self._rested = False
        phase = self.phases.phase
        self._learner.signature = _PHASE_SEED.get(phase, 0)  # shapes of two phases never share a plan
        self._drop_at_free.clear()
        self.record = self._touched = None
        self.plan = None
        # Misprediction guard: too many recent deviations in this phase -> do nothing
        # there for a while, then re-learn its shapes (the other phases' plans stay).
        if self._guard.tripped(phase):
            self.counters["guard_trips"] += 1
            for sig in self._learner.phase_plans(phase):
                del self.plans[sig]
            self._clock.forget_plans()
        plan = None
        learner = self._learner
        if not self._payoff.allows(phase):
            # Do nothing (what is swapped out comes back: no plan runs in this phase's iterations).
            self.stop_acting("none", wants_launches=False)
            if phase == "train" and isinstance(self.layout, PlanningLayout):
                # The pool's plan is the training step's, made for moves that no longer come:
                # from now on it places as a caching allocator does, as plain Unified Memory runs.
                self.layout.stop_planning("umrt stopped acting in training steps", self.ctx.budget_bytes)
            return
        if self._rest.resting(phase):  # its shapes never repeat: run as plain UM, not recorded (rest.py)
            self.counters["rested_iterations"] += 1
            self._rested = True
            self.stop_acting("none", wants_launches=False)
            return
        probing = False
        if not self._guard.cooling(phase):
            if phase in learner.relearn:
                # A shape no plan knew ran (and left no record): this iteration is recorded whatever it
                # runs. Acting on the predicted plan meanwhile costs nothing if the shape is a known one
                # (a short last batch was the stranger): only a deviation makes it a learned iteration.
                probing = True
                if learner.seek_left.get(phase, 0) > 1:
                    learner.seek_left[phase] -= 1
                else:
                    learner.seek_left.pop(phase, None)
                    learner.relearn.discard(phase)
            if learner.learned.get(phase, 0) >= self.options.learn_iterations:
                plan = self.phases.predict(phase)
                if plan is not None and plan.outlived(self.keys.obj_of):  # (its shape is learned again)
                    learner.forget(plan.signature)
                    self._clock.forget_plans()
                    plan = None
                if plan is not None:
                    plan = self._paths.pick(plan)
                if plan is not None and not self.phases.opens_run and self._payoff.wants_baseline(phase):
                    # Acting looks like losing, against a baseline older than acting: do nothing
                    # for one iteration, after one of the same phase (as the acting ones ran), on
                    # the layout doing nothing falls back to, and let that decide.
                    self._payoff.holding(phase)
                    self._held_shape = plan.signature
                    self.stop_acting("none", wants_launches=False)
                    if phase == "train" and isinstance(self.layout, PlanningLayout):
                        self.layout.stop_planning("umrt held a training step back to time doing nothing",
                                                 self.ctx.budget_bytes)
                        self._pool_held = True
                    return
        self._predicted = plan.signature if plan is not None else None
        self._dry = plan is not None and self._guard.unsure(phase)
        if self._dry:
            self.counters["unsure_iterations"] += 1
            plan = None  # learned (recorded), its prediction only checked
        # Record from the start: learning needs the whole iteration, and so
        # does acting on a plan not yet confirmed (a deviation then turns the
        # iteration into a learned one). A plan that ran through two iterations is
        # trusted and followed without a record (an early deviation then costs
        # one more iteration of plain UM before the new shape is learned).
        trusted = (plan is not None and not probing and not self._paths.trying(plan)
                   and self._learner.runs(plan.signature) >= PROBE_ITERATIONS)
        self.record = None if trusted else self._learner.new_record(self._alloc_of)
        self._touched = set() if self.record is not None and phase == "eval" else None
        # A trusted plan with a launch-free clock needs no launches; it acts on its
        # variant re-based on an iteration that ran without them, once there is
        # one, and records this iteration's events until that clock has held.
        # Its clock hashes the sizes the iteration frees, its first frees of the iteration before
        # it: the clock is followed only after an iteration of its own shape or of one as usual
        # (half as many seen, or more). After a rare one (a short last batch) the step that frees
        # that batch's tensors first would leave it: unconfirmed, the clock re-based on that step,
        # then again on the next one, acting on neither; confirmed, the step deviated. It follows
        # launches instead, checked without freed sizes (Plan.events_match).
        before = self.phases.last.get(phase)
        usual = plan is not None and (before is None or before == plan.signature
                                      or 2 * self.variants.seen(before) >= self.variants.seen(plan.signature))
        self.acting_launch_free = launch_free = bool(
            self.options.launch_free and trusted and plan.launch_free_end is not None and usual)
        self.after_rare = plan is not None and not usual
        if launch_free:
            plan = plan.launch_free_variant or plan
            if plan.signature not in self._clock.confirmed:
                self.event_tokens, self.token_objects = [], []
        self.keymap = plan.keymap if launch_free else None
        key = _reference_key(plan) if plan is not None else None
        addresses = self._references.get(key) if key is not None else None
        self._reference = ref = (key, addresses) if addresses is not None else None
        self._frozen = bool(FREEZE and trusted and ref is not None)
        self._addresses = None if self._frozen else []
        self.counting_launches = False
        self.wants_launches = not launch_free
        self._clock.follow(plan.launch_free_resume if launch_free else {})
        if launch_free and -1 in self._clock.resume:  # a decision before the iteration's first event
            self.counting_launches = self.wants_launches = True
        path = (plan.signature, bool(plan.swap)) if plan is not None else None
        if self._swapped and path != self._swapped.signature:
            self.restore_swapped()  # another plan (or none, or its migration-only twin) would not bring them back
        if plan is not None and plan.swap:
            # pinned staging for the most the plan keeps away at once (allocated once; a host
            # without that much memory is an error naming both figures, before anything moves)
            self.backend.swap.reserve(int(plan.stats.get("planned_swap_peak_bytes", 0) * STAGING_MARGIN))
        if plan is not None:  # a plan with nothing to do (everything fits) is acted on too: no capture
            self._mode = "act"
            self.plan = plan
            self.actions = plan.actions
            self.next_action = 0
            self.arm()
            # A plan not yet confirmed twice is probed (recorded) all along,
            # so a late deviation still teaches the runtime the new shape.
            self._probe_left = 0 if trusted else len(plan.actions) + 1
            self.discard_keys = plan.discard
            self.oversized = plan.remote_at
            self.plans.move_to_end(plan.signature)
            if plan.remote:
                self._host.map(plan.remote)
            if plan.read_mostly and READ_MOSTLY:
                self._host.advise_read_mostly(plan.read_mostly)
        else:
            self._mode = "learn"
            self._next_launch = self._clock.next_event = -1
            self.discard_keys = frozenset()
            self.oversized = {}
        self._clock.set_due(-1)

    # -- acting -----------------------------------------------------------------

    def _decide(self, ev: Launch) -> None:
        """The decision before launch ``ev``, if the iteration is where the plan
        expects it (the launch, the allocations and frees so far, their sizes)."""
        a = self.actions[self.next_action]
        # Acting without launches, the iteration was checked at the event the
        # count started from; a live driver may deliver launches late (its
        # capture resumes at the next hook), so the count can only lag: late.
        rare = self.after_rare
        if not self.acting_launch_free and (ev.exec_id != a.exec_id or self.keys.ordinal != a.n_alloc
                                             or self._n_frees != a.n_free
                                             or not self.plan.events_match(a, self.n_events, self.shape_hash if rare
                                                                           else self.events_hash, not rare)):
            a = self._guard.switch(ev, self.keys.ordinal, self._n_frees)
            if a is None:
                self._guard.deviate()
                return
        if self._probe_left:
            self._probe_left -= 1
            if not self._probe_left:
                self.record = None  # the plan holds: stop recording
        self.next_action += 1
        self.arm()
        self.act(a)

    def arm(self) -> None:
        """Set the trigger of the next decision: its launch ordinal, or (acting
        without launches) its launch-free event, or for a decision no event precedes
        its launch ordinal, counted from the event named in Plan.launch_free_resume."""
        if self.next_action >= len(self.actions):
            self._next_launch = self._clock.next_event = -1
            return
        a = self.actions[self.next_action]
        if not self.acting_launch_free:
            self._next_launch = a.at
        elif a.launch_free_at >= 0:
            self._next_launch, self._clock.next_event = -1, a.launch_free_at
        else:  # counted from the event before it (Plan.launch_free_resume)
            self._next_launch, self._clock.next_event = a.at, -1

    def act(self, a: Action, destructive: bool = True) -> None:
        """Issue one decision's moves (``destructive`` False: not its swaps out and drops, which
        leave data only in pinned memory or nowhere: a decision taken off its place skips them)."""
        c = self.counters
        c["decisions"] += 1
        self._moved = True
        off_gpu = self._off_gpu
        if a.swap_out and destructive:
            ranges, moved, _ = self._ranges.resolve(a.swap_out, True, self._frozen)
            if ranges:
                self._swapped.out(ranges, moved, by=(self.plan.signature, True))
        if a.drop:
            # Dead data no launch reads again: its pages leave without a copy. Before the program
            # frees it only on a plan that ran whole (trusted): a plan still probed, or one the
            # guard switched to mid-iteration that has not run whole, may have been learned on
            # steps an exception cut short, whose objects died early. Else when freed.
            sig, drop = self.plan.signature, a.drop
            if self.plan.carried_drops and self.variants.successors(sig) != {sig}:  # (another shape may read them)
                drop = tuple(k for k in drop if k not in self.plan.carried_drops)
            if self.record is None and destructive and self._learner.runs(sig) >= PROBE_ITERATIONS:
                ranges, moved, _ = self._ranges.resolve(drop, True, self._frozen)
                if ranges:
                    self.backend.drop(ranges)
                    self._n_discard_calls += 1
                    self._n_discarded += moved
                    for p, n in ranges:
                        off_gpu.add(p, n)
                        self._free_off_gpu.add(p, n)  # dead data: no launch reads it again
            else:
                self._drop_at_free.update(drop)
        if a.evict:
            ranges, moved, _ = self._ranges.resolve(a.evict, True, self._frozen)
            if ranges:
                self.backend.prefetch(ranges, HOST)
                c["prefetch_calls"] += 1
                c["evicted_bytes"] += moved
                for p, n in ranges:
                    off_gpu.add(p, n)
        if a.swap_in:
            # Whole pages, as they went out; what of them was never swapped out is prefetched.
            ranges, moved, unresolved = self._ranges.resolve(a.swap_in, True, self._frozen)
            c["unresolved"] += unresolved
            if ranges:
                self._swapped.back(ranges, moved)
        if a.ready:
            ranges, _, _ = self._ranges.resolve(a.ready, True, self._frozen)
            if ranges:
                self._swapped.ready(ranges)
        if a.prefetch:
            ranges, moved, unresolved = self._ranges.resolve(a.prefetch, False, self._frozen)
            c["unresolved"] += unresolved
            if ranges:
                self.backend.prefetch(ranges, self.backend.device)
                c["prefetch_calls"] += 1
                c["prefetched_bytes"] += moved
                if off_gpu:
                    for p, n in ranges:
                        off_gpu.remove(p, n)
                        self._free_off_gpu.remove(p, n)
        if a.populate and self._steady_shape == self.plan.signature and self._free_off_gpu and self._reference:
            # The newborns the plan makes room for from here: where the last iteration placed them
            # (steady: this one's will be there too), memory off the GPU with nothing live in it
            # is populated now, in one call, so that their kernels find it there instead of
            # waiting for it at birth.
            born = self.keys.ordinal
            pieces = _free_pieces(self._off_gpu, self._free_off_gpu, self._reference[1],
                                  [(o, n) for o, n in self.plan.newborns(a.populate) if o >= born])
            if pieces:
                self.backend.populate(pieces)
                self._n_populate_calls += 1
                n = sum(map(_N, pieces))
                self._n_populated += n
                c["populated_ahead_bytes"] += n

    def _check_swapped(self, event: int, events_hash: int) -> None:
        """While something is swapped out, every allocation, free and module boundary must be the
        plan's (the running hash after it the recorded one): a program that leaves the plan may
        read what only the plan would have brought back, so it all comes back now. After a rare
        shape (a short last batch), freed sizes do not count, as at a decision (:meth:`_decide`)."""
        plan = self.plan
        if self.after_rare:
            events_hash = self.shape_hash
        if plan is None or plan.launch_free_end is None or plan.hash_after(event, not self.after_rare) != events_hash:
            self.restore_swapped()


    def _flush(self) -> None:
        """Discard the ranges freed since the last flush in one call. Ranges
        of segments the pool gave back meanwhile were dropped (_released)."""
        ranges = self._pending_discards
        self._pending_discards = []
        self._reuse.discarded(ranges, self.n_events)
        self.backend.drop(ranges)
        self._n_discard_calls += 1
        self._n_discarded += sum(map(_N, ranges))
        off_gpu, free = self._off_gpu, self._free_off_gpu
        for p, n in ranges:
            off_gpu.add(p, n)
            free.add(p, n)

    def _populate(self, ptr: int, nbytes: int) -> None:
        """A newborn at ``[ptr, ptr + nbytes)``: the parts of it umrt took off the GPU
        (discarded, evicted, host-mapped) or that were never populated are prefetched
        to the GPU now, in one call, before its op's kernel can touch them: a kernel
        writing a discarded range refaults at 0.8 GB/s, a fresh one populates at
        3.4-8 GB/s, where a prefetch populates 2 GiB in ~11 ms (h100-measured.md).

        The same call takes in the memory of the newborn's 2 MB blocks that lies off the GPU
        with nothing live in it (dead ranges, fresh segments): the next newborns there then
        need no call of their own, each of which the next kernel would wait for."""
        off_gpu, free = self._off_gpu, self._free_off_gpu
        pieces = off_gpu.take(ptr, nbytes)
        if free:
            free.remove(ptr, nbytes)  # live now
            lo = ptr // BLOCK * BLOCK
            for p, n in free.take(lo, -(-(ptr + nbytes) // BLOCK) * BLOCK - lo):
                pieces += off_gpu.take(p, n)
            pieces.sort()
        if pieces:
            self.backend.populate(pieces)
            self._n_populate_calls += 1
            self._n_populated += sum(map(_N, pieces))
