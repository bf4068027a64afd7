"""Observe a training iteration without changing it: umrt events from torch's profiler.

Why not the :class:`~umrt.capture.Recorder`: an active ``TorchDispatchMode``
makes autograd accumulate gradients out of place and composite ops take their
out-of-place paths, so a recorded GPT-2 step allocates differently (1,101
allocations against 1,053 unrecorded, on an H100). Torch's profiler sets no
dispatch key: the program allocates and computes the same with the capture on.

* ops: a launch is the outermost profiled aten op that is not
  ``CompositeImplicitAutograd``; written inputs come from the op's schema.
* objects: each allocation is one, announced where it happened (inside the op
  that asked for it, or ``launch = -1``). umrt's own pool, which torch does not
  report, calls :meth:`ProfiledCapture.note_alloc` / ``note_free``
  (``allocator_events=True``) to leave markers in the profile instead.
* layers, iterations, kinds: module and optimizer hooks leave ``umrt::``
  markers in the profile, read with the Recorder's semantics.

The profile is read once per iteration (at the first top-level forward after
an optimizer step): its tree is converted into events, delivered in program
order, and a new profile started. :data:`NOTES` lists what differs from the
Recorder's events. A live bridge matches each window's allocations with its
allocator's (:func:`align_allocations`) and renames objects (:func:`translate`).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._autograd import _enable_profiler, _prepare_profiler
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    _EventType,
    _ExperimentalConfig,
    _RecordFunctionFast,
    _TensorMetadata,
)
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from umrt import __version__
from umrt.capture import steer
from umrt.capture.hooks import ModulePaths, claim_backward, guarded, install_hooks
from umrt.capture.ops import (
    ALLOC_ONLY,
    FLASH_ATTENTION,
    FLASH_ATTENTION_BACKWARD,
    precision_of,
    tf32_switches,
)
from umrt.capture.phases import ALIVE, BACKWARD, FORWARD, SETUP, STEP, final_kind, lifetime_kind
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
    Trace,
    TraceHeader,
    execution_id,
)
from umrt.trace.fileformat import FORMAT_VERSION

Listener = Callable[[Event], None]

NOTES = [
    "captured with torch's profiler (no dispatch mode): allocations are the program's own, in its order",
    "objects are allocations (the allocator's blocks: on CUDA's caching allocator, sizes are rounded "
    "block sizes); temporaries an op allocates inside itself are objects too",
    "launches are the outermost ops that are not CompositeImplicitAutograd; on CPU, ops run their "
    "CPU paths (attention may decompose, dropout is bernoulli_/div_/mul) as the program does",
    "storage offsets are not recorded by the profiler: accesses start at the object's first byte "
    "and span the view's extent (clamped to the object)",
    "FLOPs from torch.utils.flop_counter where input shapes suffice (matmul, attention); "
    "convolutions and other ops count 0",
    "storages made before the capture started are announced when first seen, sized by the "
    "largest view seen (their true size when they are freed inside the capture)",
]

_PREFIX = "umrt::"
_FWD = "umrt::fwd::"
_BWD = "umrt::bwd::"
_STEP_PRE = "umrt::step_pre::"
_STEP_POST = "umrt::step_post::"
_MARK = "umrt::mark"
_ALLOC_MARK = "umrt::alloc"
_FREE_MARK = "umrt::free"
_EVALUATE = "autograd::engine::evaluate_function"

# A Python number an op's caller passes where the schema wants a tensor is wrapped
# into a 0-dim CPU tensor of one of these dtypes, allocated outside any op (``x * 0.5``;
# autograd saves it so for backward): a kernel argument, not memory, and a dispatch
# mode sees the number itself.
_WRAPPED_DTYPES = frozenset({torch.float64, torch.int64, torch.bool, torch.complex128})
_ALLOCATION = _EventType.Allocation
_TORCH_OP = _EventType.TorchOp
_TENSOR_METADATA = _TensorMetadata


# ---------------------------------------------------------------------------- alignment


@dataclass
class ProfiledWindow:
    """The events of one read of the profile: normally one iteration's, from the
    first top-level module forward after an optimizer step to the next."""

    index: int
    events: list[Event]
    # Each allocation on the traced device, in order: (object, address, bytes).
    allocations: list[tuple[int, int, int]] = field(default_factory=list)


class AlignmentError(ValueError):
    """The allocator's sequence and the profile's allocations do not match."""


def caching_block_fits(requested: int, block: int) -> bool:
    """Whether torch's CUDA caching allocator could have served ``requested``
    bytes with a block of ``block`` bytes (what the profiler reports there).

    Requests round up to 512 bytes (``kMinBlockSize``); a block is not split
    when the rest would be under 512 bytes (small pool) or 1 MiB (large pool,
    ``kSmallSize``), so it may exceed the rounded request by less than that
    (c10/cuda/CUDACachingAllocator.cpp: ``round_size``, ``should_split``).
    """
    rounded = max(512, -(-requested // 512) * 512)
    return rounded <= block < rounded + (1 << 20)


def _exact(requested: int, block: int) -> bool:
    return requested == block


def align_allocations(
    allocator: Sequence[tuple[int, int]],
    profile: ProfiledWindow | Sequence[tuple[int, int, int]],
    *,
    fits: Callable[[int, int], bool] = _exact,
    check_addresses: bool = True,
) -> dict[int, int]:
    """Match a profile's allocations with a live allocator's, one for one.

    Args:
        allocator: the allocator's ``(ptr, nbytes)`` of each allocation over
            the same span, in order (umrt's pool listener sees these).
        profile: a :class:`ProfiledWindow` (or its ``allocations``).
        fits: ``fits(allocator_nbytes, profile_nbytes)``; exact by default (a
            profile whose allocations came from the same allocator, e.g. umrt's
            pool through :meth:`ProfiledCapture.note_alloc`); use
            :func:`caching_block_fits` against torch's caching allocator.
        check_addresses: also require equal addresses (same run, same allocator).

    Returns:
        profile object -> position in ``allocator``.

    Raises:
        AlignmentError: the counts differ or a pair does not match (the message
            names the first position that differs).

    A live bridge on umrt's pool constructs the capture with
    ``allocator_events=True, window_listeners=[on_window]``; its pool listener
    calls :meth:`ProfiledCapture.note_alloc` / ``note_free`` and, when
    ``note_alloc`` returns True, appends ``(ptr, nbytes)`` and its own id to the
    running window's list; ``on_window`` aligns that list with the window (on
    :class:`AlignmentError` it does not learn from the window), starts a new
    list, and renames the window's events through :func:`translate` with ``{profile object: own id}``.
    """
    allocs = profile.allocations if isinstance(profile, ProfiledWindow) else list(profile)
    mapping: dict[int, int] = {}
    for i, ((ptr, nbytes), (obj, pptr, pbytes)) in enumerate(zip(allocator, allocs, strict=False)):
        if not fits(nbytes, pbytes):
            raise AlignmentError(
                f"allocation {i}: the allocator gave {nbytes} bytes, the profile shows {pbytes} "
                f"(object {obj}); the two sequences diverge here"
            )
        if check_addresses and ptr != pptr:
            raise AlignmentError(
                f"allocation {i}: the allocator's block is at {ptr:#x}, the profile's at {pptr:#x} (object {obj})"
            )
        mapping[obj] = i
    if len(allocator) != len(allocs):
        raise AlignmentError(
            f"the allocator made {len(allocator)} allocations, the profile shows {len(allocs)} "
            f"(the first {len(mapping)} match)"
        )
    return mapping


def translate(events: Sequence[Event], objects: dict[int, int]) -> list[Event]:
    """The events with each object renamed through ``objects`` (e.g. the live
    bridge's ids for the aligned positions); accesses to, and allocations and
    frees of, objects not in it are dropped."""
    out: list[Event] = []
    for ev in events:
        t = type(ev)
        if t is Launch:
            acc = tuple(Access(objects[a.obj], a.offset, a.length, a.write) for a in ev.accesses if a.obj in objects)
            out.append(Launch(ev.seq, ev.exec_id, ev.op, acc, ev.flops, ev.bytes, ev.module, ev.precision))
        elif t is Alloc:
            if ev.obj in objects:
                out.append(Alloc(objects[ev.obj], ev.nbytes, ev.kind, ev.launch))
        elif t is Free:
            if ev.obj in objects:
                out.append(Free(objects[ev.obj]))
        else:
            out.append(ev)
    return out


# ---------------------------------------------------------------------------- ops


@dataclass(slots=True)
class _OpInfo:
    name: str  # "aten::mm.default" (renamed as the Recorder renames)
    composite: bool  # CompositeImplicitAutograd: decomposes into the ops it calls
    skip: bool  # view/metadata only: no kernel
    alloc_only: bool
    returns_tensors: bool  # every return is a tensor (or list): without allocating or writing, they alias
    writes: frozenset  # positions of written arguments
    kwarg_only: tuple  # (position, name) of keyword-only arguments
    flop_fn: Any


@functools.lru_cache(maxsize=4096)
def _schemas(name: str) -> tuple:
    try:
        return tuple(torch._C._jit_get_schemas_for_operator(name)) if "::" in name else ()
    except RuntimeError:
        return ()


@functools.lru_cache(maxsize=4096)
def _op_info_for(name: str, overload: str) -> _OpInfo | None:
    """What umrt needs of an operator (None: not an operator, e.g. a user range)."""
    schemas = [s for s in _schemas(name) if s.overload_name == overload]
    if not schemas:
        return None
    schema = schemas[0]
    qual = f"{name}.{overload}" if overload else name
    try:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CompositeImplicitAutograd")
    except RuntimeError:
        composite = False
    writes = frozenset(
        i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )
    rets = schema.returns
    skip = (
        not writes
        and len(rets) > 0
        and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
    )
    full = f"{name}.{overload or 'default'}"
    packet = None
    with contextlib.suppress(AttributeError, RuntimeError):
        ns, op = name.split("::", 1)
        packet = getattr(getattr(torch.ops, ns), op)
    return _OpInfo(
        name=steer.OP_RENAMES.get(full, full),
        composite=bool(composite),
        skip=skip,
        alloc_only=full in ALLOC_ONLY,
        returns_tensors=len(rets) > 0 and all(str(r.type) in ("Tensor", "Tensor[]", "Tensor?") for r in rets),
        writes=writes,
        kwarg_only=tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.kwarg_only),
        flop_fn=flop_registry.get(packet) if packet is not None else None,
    )


def _op_info(ev: Any, overloads: bool) -> _OpInfo | None:
    """The op info of a profiler TorchOp event. ``overloads``: the profiler
    recorded overload names (``capture_overload_names``; "" is the default
    overload); else the schema is matched from the recorded arguments."""
    name = ev.name
    if "::" not in name or name.startswith(_PREFIX):
        return None
    if overloads:
        return _op_info_for(name, ev.overload_name)
    schemas = _schemas(name)
    if len(schemas) <= 1:
        return _op_info_for(name, schemas[0].overload_name) if schemas else None
    from torch.profiler._memory_profiler import SchemaMatcher  # torch's own matcher: arity and types

    matches = SchemaMatcher.match_schemas(ev.extra_fields)
    return _op_info_for(name, matches[0].overload_name) if matches else None


def _extent(sizes: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a tensor's view spans from its first element."""
    n = 1
    for s in sizes:
        n *= s
    if n == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(sizes, strides, strict=False) if s > 0)
    return span * dtype.itemsize


def _flops(info: _OpInfo, inputs: Sequence[Any]) -> int:
    """FLOPs from torch.utils.flop_counter's formulas, on meta tensors shaped as
    the inputs (0 where a formula needs more than the profiler recorded)."""
    TM = _TENSOR_METADATA

    def meta(m: Any) -> Any:
        if isinstance(m, TM):
            return torch.empty_strided(tuple(m.sizes), tuple(m.strides), dtype=m.dtype, device="meta")
        if isinstance(m, list):
            return [meta(x) for x in m]
        return m

    try:
        if info.name == FLASH_ATTENTION:
            q, k, v = (tuple(m.sizes) for m in inputs[:3])
            return int(sdpa_flop_count(q, k, v))
        if info.name == FLASH_ATTENTION_BACKWARD:
            g, q, k, v = (tuple(m.sizes) for m in inputs[:4])
            return int(sdpa_backward_flop_count(g, q, k, v))
        if info.flop_fn is None:
            return 0
        kw_pos = {i for i, _ in info.kwarg_only}
        args = [meta(m) for i, m in enumerate(inputs) if i not in kw_pos]
        kwargs = {n: meta(inputs[i]) for i, n in info.kwarg_only if i < len(inputs)}
        return int(info.flop_fn(*args, **kwargs, out_val=None))
    except Exception:  # noqa: BLE001 - a formula that needs more than shapes: count nothing
        return 0


# ---------------------------------------------------------------------------- conversion


@dataclass(slots=True)
class _ProfiledObject:
    nbytes: int
    kind: Kind  # kind announced in its Alloc
    known: Kind | None  # a fact (parameter, gradient, optimizer state, input)
    phase: int
    iteration: int
    key: tuple | None  # (exec_id, occurrence, allocation index) of the creating launch
    event_index: int  # index of its Alloc in the capture's events
    ptr: int
    freed_phase: int = -1
    freed_iteration: int = ALIVE


# Items of one window, in program order: (time, kind, payload).
_ITEM_ALLOC, _ITEM_FREE, _ITEM_OP, _ITEM_ENTER, _ITEM_EXIT, _ITEM_BWD, _ITEM_STEP_PRE, _ITEM_STEP_POST, _ITEM_MARK, _ITEM_BARE = range(10)


class _ProfileWalker:
    """Flattens a profile's event trees into items, in program order: each
    thread's in time order, the threads merged by time."""

    def __init__(self, device: str, allocator_events: bool, overloads: bool) -> None:
        self.device = device
        self.allocator_events = allocator_events
        self.overloads = overloads  # the profile has overload names

    def items(self, roots: Sequence[Any]) -> Iterator[tuple]:
        streams: dict[int, list] = {}
        by_thread: dict[int, list] = {}
        for root in roots:
            by_thread.setdefault(root.start_tid, []).append(root)
        for tid, thread_roots in by_thread.items():
            self._walk(thread_roots, False, streams.setdefault(tid, []))
        order = [s for _, s in sorted(streams.items())]
        return (
            iter(order[0]) if len(order) == 1 else heapq.merge(*order, key=lambda it: it[0])
        ) if order else iter(())

    def _alloc_item(self, ev: Any, in_bwd: bool, items: list) -> None:
        ef = ev.extra_fields
        if self.allocator_events or ef.device.type != self.device:
            return
        size = ef.alloc_size
        items.append((ev.start_time_ns, _ITEM_ALLOC if size > 0 else _ITEM_FREE, (ef.ptr, abs(size), in_bwd)))

    def _walk(self, children: Sequence[Any], in_bwd: bool, items: list) -> None:
        """Items of a list of sibling events (one thread's, in time order)."""
        for ev in children:
            tag = ev.tag
            if tag == _ALLOCATION:
                ef = ev.extra_fields
                if ef.device.type == "cpu":  # a host block allocated outside any op (a wrapped number?)
                    items.append((ev.start_time_ns, _ITEM_BARE, (ef.ptr, ef.alloc_size)))
                self._alloc_item(ev, in_bwd, items)
                continue
            if tag != _TORCH_OP:
                self._walk(ev.children, in_bwd, items)
                continue
            name = ev.name
            if name.startswith(_PREFIX):
                self._marker(ev, name, in_bwd, items)
            else:
                info = _op_info(ev, self.overloads)
                if info is None or info.composite:
                    self._walk(ev.children, in_bwd or name.startswith(_EVALUATE), items)
                else:
                    nested: list = []
                    made = [False]
                    for c in ev.children:
                        self._nested(c, nested, made)
                    items.append((ev.start_time_ns, _ITEM_OP, (ev, info, nested, made[0], in_bwd)))

    def _nested(self, ev: Any, out: list, made: list) -> None:
        """Allocations (and allocator markers) anywhere inside a launch, in order
        (``made[0]``: it allocated anything, on any device)."""
        tag = ev.tag
        if tag == _ALLOCATION:
            if ev.extra_fields.alloc_size > 0:
                made[0] = True
            self._alloc_item(ev, False, out)
            return
        if tag == _TORCH_OP and ev.name in (_ALLOC_MARK, _FREE_MARK):
            if ev.name == _ALLOC_MARK:
                made[0] = True
            self._marker(ev, ev.name, False, out)
            return
        for c in ev.children:
            self._nested(c, out, made)

    def _marker(self, ev: Any, name: str, in_bwd: bool, items: list) -> None:
        t = ev.start_time_ns
        if name.startswith(_FWD):
            module = name[len(_FWD):]
            items.append((t, _ITEM_ENTER, (module, in_bwd)))
            self._walk(ev.children, in_bwd, items)
            items.append((max(t, ev.end_time_ns), _ITEM_EXIT, module))
        elif name.startswith(_BWD):
            items.append((t, _ITEM_BWD, name[len(_BWD):]))
        elif name in (_ALLOC_MARK, _FREE_MARK):
            if self.allocator_events:
                vals = list(ev.extra_fields.inputs)
                ptr, nbytes = int(vals[0]), int(vals[1])
                items.append((t, _ITEM_ALLOC if name == _ALLOC_MARK else _ITEM_FREE, (ptr, nbytes, in_bwd)))
        elif name.startswith(_STEP_PRE):
            items.append((t, _ITEM_STEP_PRE, name))
        elif name.startswith(_STEP_POST):
            items.append((t, _ITEM_STEP_POST, name))
        elif name == _MARK:
            items.append((t, _ITEM_MARK, None))
        else:
            self._walk(ev.children, in_bwd, items)


class ProfileConverter:
    """Turns profiler event trees into umrt events; its state (objects alive,
    iteration, learned kinds) carries over from one window to the next."""

    def __init__(self, device: str, tf32: tuple[bool, bool], allocator_events: bool, *, overloads: bool = True) -> None:
        self.device = device
        self._walker = _ProfileWalker(device, allocator_events, overloads)
        self.tf32 = tf32
        self.objs: dict[int, _ProfiledObject] = {}
        self.live: dict[int, int] = {}  # address -> object alive there
        self.next_obj = 0
        self.seq = 0
        self.iteration = -1
        self.pending_boundary = False
        self.in_step = 0
        self.bwd_module: str | None = None
        self.fwd_stack: list[str] = []
        self.occurrence: dict[int, int] = {}
        self.learned: dict[tuple, Kind] = {}
        self.exec_cache: dict[tuple, int] = {}
        self.facts: dict[str, list[tuple[int, int, Kind]]] = {}  # marker -> (ptr, nbytes, kind)
        self.bare_host: set[int] = set()  # host blocks allocated outside any op, alive
        self.auto_step = True
        # Per window:
        self._out: list[Event] = []
        self._base = 0  # index of self._out[0] among all events
        self._born: list[int] = []
        self._allocs: list[tuple[int, int, int]] = []

    # -- emission ------------------------------------------------------------
    def _emit(self, ev: Event) -> None:
        self._out.append(ev)

    def _index(self) -> int:
        return self._base + len(self._out)

    def boundary(self) -> None:
        self.pending_boundary = False
        self._end_backward()
        self.iteration += 1
        self.occurrence.clear()
        self._emit(IterationBoundary(self.iteration))

    def _flush(self) -> None:
        if self.pending_boundary:
            self.boundary()

    def step(self) -> None:
        """An iteration ends (its boundary is emitted before the next alloc, launch or layer entry)."""
        if self.iteration < 0:
            self.boundary()
        elif self.seq > 0:
            self.pending_boundary = True

    def _end_backward(self) -> None:
        if self.bwd_module is not None:
            self._emit(LayerExit(self.bwd_module, "backward"))
            self.bwd_module = None

    def _phase(self, in_bwd: bool) -> int:
        if self.iteration < 0:
            return SETUP
        if self.in_step:
            return STEP
        return BACKWARD if in_bwd else FORWARD

    # -- objects -------------------------------------------------------------
    def _new(self, ptr: int, nbytes: int, kind: Kind, known: Kind | None, phase: int, key: tuple | None,
             launch: int) -> int:
        old = self.live.get(ptr)
        if old is not None:  # its free was never seen (made before the capture): it is gone now
            self._free(old, 0, phase)
        obj = self.next_obj
        self.next_obj += 1
        self.objs[obj] = _ProfiledObject(nbytes, kind, known, phase, self.iteration, key, self._index(), ptr)
        self.live[ptr] = obj
        self._born.append(obj)
        self._emit(Alloc(obj, nbytes, kind, launch))
        return obj

    def allocated(self, ptr: int, nbytes: int, phase: int, key: tuple | None = None, launch: int = -1) -> int:
        """An allocation the allocator made (kind: learned for the same launch's
        allocation last iteration, else by the phase it is born in)."""
        kind = Kind.ACTIVATION if phase == FORWARD else (Kind.OTHER if phase == SETUP else Kind.TEMPORARY)
        if key is not None:
            kind = self.learned.get(key, kind)
        obj = self._new(ptr, nbytes, kind, None, phase, key, launch)
        self._allocs.append((obj, ptr, nbytes))
        return obj

    def first_seen(self, ptr: int, nbytes: int, phase: int, kind: Kind | None = None) -> int:
        """A storage the capture did not see allocated (made before it started)."""
        if kind is None:
            kind = Kind.OTHER if self.iteration < 0 else Kind.INPUT
        return self._new(ptr, nbytes, kind, kind, phase, None, -1)

    def _resize(self, obj: int, nbytes: int) -> None:
        """A storage first seen through a view turns out larger (a wider view, or
        its free): its Alloc, not yet delivered, says so."""
        info = self.objs[obj]
        if nbytes > info.nbytes and info.key is None and info.event_index >= self._base:
            info.nbytes = nbytes
            i = info.event_index - self._base
            ev = self._out[i]
            self._out[i] = Alloc(ev.obj, nbytes, ev.kind, ev.launch)

    def _free(self, obj: int, nbytes: int, phase: int) -> None:
        info = self.objs[obj]
        if self.live.get(info.ptr) == obj:
            del self.live[info.ptr]
        self._resize(obj, nbytes)
        info.freed_phase = phase
        info.freed_iteration = self.iteration
        if info.key is not None and info.known is None and info.iteration == self.iteration:
            self.learned[info.key] = lifetime_kind(info)
        self._emit(Free(obj))

    def freed(self, ptr: int, nbytes: int, phase: int) -> None:
        """The allocator freed the block at ``ptr`` (unknown blocks are ignored)."""
        obj = self.live.get(ptr)
        if obj is not None:
            self._free(obj, nbytes, phase)

    def fact(self, ptr: int, nbytes: int, kind: Kind, phase: int) -> None:
        """What the storage at ``ptr`` holds, from the optimizer."""
        obj = self.live.get(ptr)
        if obj is None:
            obj = self.first_seen(ptr, nbytes, phase, kind)
        info = self.objs[obj]
        info.known = kind
        if info.key is not None:
            self.learned[info.key] = kind

    # -- a window ------------------------------------------------------------
    def convert(self, roots: Sequence[Any]) -> ProfiledWindow:
        """Convert one profile's event tree; returns the window (events not yet delivered)."""
        for item in self._walker.items(roots):
            self._handle(item)
        return self._finish()

    def open_window(self) -> None:
        self._base = self._base + len(self._out)
        self._out = []
        self._born = []
        self._allocs = []

    def _finish(self) -> ProfiledWindow:
        # Kinds the window now knows (facts found after the birth, lifetimes that ended in it).
        for obj in self._born:
            info = self.objs[obj]
            if info.known is not None:
                kind = info.known
            elif info.freed_iteration != ALIVE:
                kind = lifetime_kind(info)
            else:
                kind = info.kind
            if kind != info.kind:
                info.kind = kind
                i = info.event_index - self._base
                ev = self._out[i]
                self._out[i] = Alloc(ev.obj, ev.nbytes, kind, ev.launch)
        return ProfiledWindow(0, list(self._out), list(self._allocs))

    # -- items ---------------------------------------------------------------
    def _handle(self, item: tuple) -> None:
        _, what, payload = item
        if what == _ITEM_OP:
            self._op(*payload)
        elif what == _ITEM_ALLOC:
            self._flush()
            self.allocated(payload[0], payload[1], self._phase(payload[2]))
        elif what == _ITEM_FREE:
            self.freed(payload[0], payload[1], self._phase(payload[2]))
        elif what == _ITEM_ENTER:
            module, in_bwd = payload
            if self.bwd_module is not None and not in_bwd:
                self._end_backward()  # a forward after a backward without a step
            self._flush()
            self.fwd_stack.append(module)
            self._emit(LayerEnter(module, "forward"))
        elif what == _ITEM_EXIT:
            if self.fwd_stack:
                self.fwd_stack.pop()
            self._emit(LayerExit(payload, "forward"))
        elif what == _ITEM_BWD:
            if self.bwd_module != payload:
                self._end_backward()
                self.bwd_module = payload
                self._emit(LayerEnter(payload, "backward"))
        elif what == _ITEM_STEP_PRE:
            self._flush()
            self._end_backward()
            for ptr, nbytes, kind in self.facts.pop(payload, ()):
                self.fact(ptr, nbytes, kind, self._phase(False))
            self.in_step += 1
        elif what == _ITEM_STEP_POST:
            self.in_step = max(0, self.in_step - 1)
            for ptr, nbytes, kind in self.facts.pop(payload, ()):
                self.fact(ptr, nbytes, kind, self._phase(False))
            if self.auto_step:
                self.step()
        elif what == _ITEM_MARK:
            self.step()
        elif what == _ITEM_BARE:
            if payload[1] > 0:
                self.bare_host.add(payload[0])
            else:
                self.bare_host.discard(payload[0])

    def _op(self, ev: Any, info: _OpInfo, nested: list, made: bool, in_bwd: bool) -> None:
        dev = self.device
        TM = _TENSOR_METADATA
        inputs = list(ev.extra_fields.inputs)
        # (storage address, sizes, strides, dtype, device type, written), each read once
        tensors: list[tuple[int, tuple, tuple, torch.dtype, str, bool]] = []
        for i, m in enumerate(inputs):
            if isinstance(m, TM):
                group = (m,)
            elif isinstance(m, list):
                group = tuple(x for x in m if isinstance(x, TM))
            else:
                continue
            w = i in info.writes
            for x in group:
                ptr, sizes, dtype = x.storage_data_ptr or 0, tuple(x.sizes), x.dtype
                if not sizes and ptr in self.bare_host and dtype in _WRAPPED_DTYPES:
                    continue  # a wrapped Python scalar: an argument of the kernel, not memory it reads
                tensors.append((ptr, sizes, tuple(x.strides), dtype, x.device.type, w))
        on_dev = [t for t in tensors if t[0] and t[4] == dev]
        launch = not (info.skip or info.alloc_only) and (on_dev or any(k == _ITEM_ALLOC for _, k, _ in nested))
        if launch and info.returns_tensors and not made and not any(t[5] for t in tensors):
            launch = False  # its outputs alias its inputs and nothing is written: no kernel
        if launch and self.in_step and dev == "cpu" and all(not t[1] for t in tensors):
            launch = False  # optimizer step counters: host scalars on CUDA too
        if not launch:
            self._plain(nested, in_bwd)
            return
        self._flush()
        if self.bwd_module is not None and not in_bwd:
            self._end_backward()
        phase = self._phase(in_bwd)
        if phase == BACKWARD:
            module = self.bwd_module or ""
        elif phase == STEP:
            module = ""
        else:
            module = self.fwd_stack[-1] if self.fwd_stack else ""
        shapes = tuple(t[1] for t in tensors)
        dtypes = tuple(t[3] for t in tensors)
        ck = (info.name, shapes, dtypes, module)
        exec_id = self.exec_cache.get(ck)
        if exec_id is None:
            exec_id = execution_id(info.name, shapes, [str(d)[6:] for d in dtypes], module)
            self.exec_cache[ck] = exec_id
        occ = self.occurrence.get(exec_id, 0)
        self.occurrence[exec_id] = occ + 1
        seq = self.seq

        acc: dict[tuple[int, int, int], bool] = {}
        for ptr, sizes, strides, dtype, _, w in on_dev:
            length = _extent(sizes, strides, dtype)
            obj = self.live.get(ptr)
            if obj is None:
                obj = self.first_seen(ptr, length, phase)
            self._resize(obj, length)
            length = min(length, self.objs[obj].nbytes)
            if length:
                k3 = (obj, 0, length)
                acc[k3] = acc.get(k3, False) or w
        # The launch goes after the last allocation it made; what it frees before
        # that (its own temporaries) stays in place, the frees of its inputs and
        # everything after its last allocation follow it.
        inputs_objs = {o for o, _, _ in acc}
        last_alloc = max((i for i, (_, k, _) in enumerate(nested) if k == _ITEM_ALLOC), default=-1)
        created: list[int] = []
        after: list[tuple[int, int]] = []
        for i, (_, k, (ptr, nbytes, _)) in enumerate(nested):
            if k == _ITEM_ALLOC:
                created.append(self.allocated(ptr, nbytes, phase, key=(exec_id, occ, len(created)), launch=seq))
                continue
            obj = self.live.get(ptr)
            if obj is None:
                continue
            if i > last_alloc or obj in inputs_objs:
                del self.live[ptr]  # gone for the allocator; its Free follows the launch
                after.append((obj, nbytes))
            else:
                self._free(obj, nbytes, phase)
        gone = {obj for obj, _ in after}
        outputs = [o for o in created if self.objs[o].freed_iteration == ALIVE and o not in gone]
        for obj in outputs:  # what it made and keeps; temporaries it frees itself are no access
            nb = self.objs[obj].nbytes
            if nb:
                acc[(obj, 0, nb)] = True
        if outputs and dev != "cpu" and any(t[4] == "cpu" and t[1] for t in tensors):
            for obj in outputs:  # a host-to-device copy: batch data arriving
                self.objs[obj].known = Kind.INPUT
        accesses = tuple(Access(o, off, ln, w) for (o, off, ln), w in acc.items())
        flops = _flops(info, inputs) if info.flop_fn is not None or "attention" in info.name else 0
        nbytes_moved = 0
        for _, _, ln in acc:
            nbytes_moved += ln
        precision = precision_of(info.name, dtypes, self.tf32)
        self.seq += 1
        self._emit(Launch(seq, exec_id, info.name, accesses, flops, nbytes_moved, module, precision))
        for obj, nbytes in after:
            self._free(obj, nbytes, phase)

    def _plain(self, nested: list, in_bwd: bool) -> None:
        """Allocations and frees inside an op that launches nothing."""
        phase = self._phase(in_bwd)
        for _, k, (ptr, nbytes, _) in nested:
            if k == _ITEM_ALLOC:
                self._flush()
                self.allocated(ptr, nbytes, phase)
            else:
                self.freed(ptr, nbytes, phase)




# ---------------------------------------------------------------------------- the capture


def _experimental_config() -> tuple[_ExperimentalConfig, bool]:
    """The profiler's experimental settings, and whether it records overload names."""
    try:
        return _ExperimentalConfig(capture_overload_names=True), True
    except TypeError:  # an older torch: overloads are matched from the inputs (SchemaMatcher)
        return _ExperimentalConfig(), False


def _storages(tensors: Iterator[Any], device: str) -> list[tuple[int, int]]:
    """(address, bytes) of the storages of ``tensors`` on ``device``."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device:
            st = t.untyped_storage()
            if st.data_ptr():
                out.append((st.data_ptr(), st.nbytes()))
    return out


def _setup_facts(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 device: str) -> list[tuple[Kind, list[tuple[int, int]]]]:
    """The kinds of the model's and optimizer's storages at the start."""
    out: list[tuple[Kind, list[tuple[int, int]]]] = []
    if model is not None:
        out.append((Kind.PARAMETER, _storages(model.parameters(), device)))
        out.append((Kind.OTHER, _storages(model.buffers(), device)))
    if optimizer is not None:
        out.extend(_optimizer_facts(optimizer, device, grads=False))
    return out


def _optimizer_facts(opt: torch.optim.Optimizer, device: str, *, grads: bool) -> list[tuple[Kind, list]]:
    """The kinds of an optimizer's storages: parameters, gradients (``grads``), state."""
    params = [p for g in opt.param_groups for p in g["params"]]
    facts = [(Kind.PARAMETER, _storages(iter(params), device))]
    if grads:
        facts.append((Kind.GRADIENT, _storages((p.grad for p in params), device)))
    state = []
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0 and v.device.type == "cpu"):
                state.append(v)  # (a host step counter is not device memory on CUDA)
    facts.append((Kind.OPTIMIZER_STATE, _storages(iter(state), device)))
    return facts


class _OpenForwards(threading.local):
    """Per thread: the forward ranges open, innermost last ((module, range); None: not recorded)."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, Any] | None] = []


class ProfiledCapture:
    """Captures a training loop into umrt events through torch's profiler,
    without changing what the loop allocates (see the module docstring)::

        cap = ProfiledCapture(model, optimizer)
        with cap:
            for batch in batches:
                loss = model(batch).loss
                loss.backward()
                optimizer.step()          # an iteration boundary
                optimizer.zero_grad(set_to_none=True)
        trace = cap.trace()

    Events reach listeners one window (normally one iteration) at a time, in
    program order, when the window is read: at the first top-level module
    forward after an optimizer step, at :meth:`flush`, and at :meth:`stop`.

    Args:
        model: the model, if known: its parameters and buffers are announced at
            the start and module paths are relative to it.
        optimizer: the optimizer, if known (else any optimizer that steps).
        listeners: callables that receive each event.
        window_listeners: callables that receive each :class:`ProfiledWindow`
            after its events went to ``listeners`` (a live bridge aligns it).
        device: the device whose memory is traced ("cpu", "cuda"); default: the
            model's, else "cuda" if available, else "cpu".
        auto_step: an optimizer step ends an iteration.
        mark_start: emit ``IterationBoundary(0)`` at the start.
        per_iteration: read the profile once per iteration (False: only at
            :meth:`flush` and :meth:`stop`).
        iterations: stop profiling once this many iterations are complete (the
            hooks stay until :meth:`stop`, inert): a live run learns a few
            iterations, then runs at full speed.
        allocator_events: allocations come from :meth:`note_alloc` /
            :meth:`note_free` (umrt's pool, which torch's profiler does not see)
            instead of the profiler's own memory events for ``device``.
        keep_events: keep the events for :meth:`trace`, :attr:`events` and
            :attr:`windows`.
        on_error: called with an exception of the capture's own (in a hook or
            while reading a profile), which then never reaches the program; the
            capture stops profiling. Default: the exception propagates.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        listeners: Sequence[Listener] = (),
        *,
        window_listeners: Sequence[Callable[[ProfiledWindow], None]] = (),
        device: str | None = None,
        auto_step: bool = True,
        mark_start: bool = True,
        per_iteration: bool = True,
        iterations: int | None = None,
        allocator_events: bool = False,
        keep_events: bool = True,
        model_name: str = "",
        meta: dict | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if iterations is not None and iterations < 1:
            raise ValueError(f"iterations must be at least 1, got {iterations}")
        self.model = model
        self.optimizer = optimizer
        self.listeners = list(listeners)
        self.window_listeners = list(window_listeners)
        if device is None:
            if model is not None:
                first = next(iter(model.parameters()), None)
                device = first.device.type if first is not None else "cpu"
            else:
                device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device).type
        self.auto_step = auto_step
        self.mark_start = mark_start
        self.per_iteration = per_iteration
        self.iterations = iterations
        self.allocator_events = allocator_events
        self.model_name = model_name or (type(model).__name__ if model is not None else "")
        self._meta = dict(meta or {})
        self._keep = keep_events
        self._on_error = on_error
        self.failed: BaseException | None = None  # the capture's own error, once on_error took one
        self._events: list[Event] = []
        self._windows: list[ProfiledWindow] = []
        self._conv: ProfileConverter | None = None
        self._handles: list[Any] = []
        self._paths = ModulePaths()
        self._forwards = _OpenForwards()  # per thread: the open forward ranges
        self._owner: int | None = None
        self._started = False
        self._stopped = False
        self._profiling = False  # torch's profiler is on (ours)
        self._active = False  # markers are being left
        self._rotate_pending = False
        self._steps = 0
        self._window_count = 0

    # ------------------------------------------------------------------ public API
    def __enter__(self) -> ProfiledCapture:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        """Install the hooks, announce the model's and optimizer's tensors, start profiling.

        Raises:
            RuntimeError: started before, or another torch profiler is running.
        """
        if self._started:
            raise RuntimeError("a ProfiledCapture can be started only once")
        if torch._C._autograd._profiler_enabled() or torch.autograd.profiler._is_profiler_enabled:
            raise RuntimeError("another torch profiler is running: umrt's profiled capture needs the profiler to itself")
        self._started = True
        tf32 = tf32_switches()
        conv = ProfileConverter(self.device, tf32, self.allocator_events, overloads=_experimental_config()[1])
        conv.auto_step = self.auto_step
        self._conv = conv
        self._paths = ModulePaths(self.model)
        conv.open_window()
        for kind, tensors in _setup_facts(self.model, self.optimizer, self.device):
            for ptr, nbytes in tensors:
                conv.fact(ptr, nbytes, kind, SETUP)
        if self.mark_start:
            conv.boundary()
        self._deliver(conv._finish(), as_window=False)
        self._handles = install_hooks(self._forward_pre, self._forward_post, self._step_pre, self._step_post)
        self._owner = threading.get_ident()
        self._start_profiler()

    def stop(self) -> None:
        """Read the last profile, close a completed iteration, remove the hooks."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        for h in self._handles:
            h.remove()
        self._handles = []
        try:
            if self._profiling:
                self._read_profile(restart=False)
            conv = self._conv
            if conv is not None and conv.pending_boundary:
                conv.open_window()
                conv.boundary()
                self._deliver(conv._finish(), as_window=False)
        except Exception as exc:  # noqa: BLE001 - see on_error
            self._error(exc)
        finally:
            self._active = False
            if self._profiling:  # reading failed: still give the profiler back
                self._profiling = False
                with contextlib.suppress(Exception):
                    torch._C._autograd._disable_profiler()

    def step(self) -> None:
        """Mark the end of an iteration here (for loops without an optimizer step)."""
        if self._active:
            with _RecordFunctionFast(_MARK):
                pass
            self._rotate_pending = self.per_iteration

    def flush(self) -> None:
        """Read what was profiled so far and deliver it now. Call it outside any
        op and outside autograd (e.g. between iterations)."""
        if self._profiling:
            self._read_profile(restart=True)

    def note_alloc(self, ptr: int, nbytes: int) -> bool:
        """The allocator (umrt's pool) made a block: leave its marker in the profile,
        inside the op that asked for it (``allocator_events=True``).

        Returns whether the profile holds it: False while not profiling, and on
        a thread the profiler does not follow (it follows the thread that
        started it and autograd's threads; not a data loader's pin-memory
        thread): such a block is in no window. Never raises.
        """
        return self._note(_ALLOC_MARK, ptr, nbytes)

    def note_free(self, ptr: int, nbytes: int = 0) -> bool:
        """The allocator freed the block at ``ptr`` (see :meth:`note_alloc`). Never raises."""
        return self._note(_FREE_MARK, ptr, nbytes)

    def _note(self, marker: str, ptr: int, nbytes: int) -> bool:
        if not self._active:
            return False
        try:
            if not torch._C._autograd._profiler_enabled():  # (per thread)
                return False
            with _RecordFunctionFast(marker, (int(ptr), int(nbytes))):
                pass
            return True
        except Exception:  # noqa: BLE001 - called from inside the allocator: never raise there
            return False

    @property
    def events(self) -> list[Event]:
        """Events delivered so far (kinds as delivered; none with ``keep_events=False``)."""
        return self._events

    @property
    def windows(self) -> list[ProfiledWindow]:
        """The windows read so far (none with ``keep_events=False``)."""
        return self._windows

    @property
    def profiling(self) -> bool:
        """Whether torch's profiler is on for the capture now."""
        return self._profiling

    def trace(self) -> Trace:
        """The events so far as a trace, with kinds refined by what came later.

        Raises:
            RuntimeError: the capture keeps no events (``keep_events=False``).
        """
        if not self._keep:
            raise RuntimeError("this ProfiledCapture keeps no events (keep_events=False): it has no trace")
        if self.failed is not None:
            raise RuntimeError(f"the capture stopped after an error of its own ({self.failed!r}): its events are partial")
        events = list(self._events)
        conv = self._conv
        if conv is not None:
            for info in conv.objs.values():
                kind = final_kind(info, conv.iteration)
                ev = events[info.event_index]
                if ev.kind != kind:
                    events[info.event_index] = Alloc(ev.obj, ev.nbytes, kind, ev.launch)
        header = TraceHeader(
            format_version=FORMAT_VERSION,
            umrt_version=__version__,
            model=self.model_name,
            torch_version=torch.__version__,
            device=self.device,
            iterations=0,
            notes=list(NOTES),
            meta=dict(self._meta),
        )
        trace = Trace(header, events)
        trace.header.iterations = len(trace.iteration_spans())
        return trace

    # ------------------------------------------------------------------ profiler
    def _start_profiler(self) -> None:
        config = ProfilerConfig(ProfilerState.KINETO, True, True, False, False, False, _experimental_config()[0])
        activities = {ProfilerActivity.CPU}
        _prepare_profiler(config, activities)
        _enable_profiler(config, activities)
        self._profiling = True
        self._active = True

    def _read_profile(self, *, restart: bool) -> None:
        """Stop the profiler, convert and deliver its events, start it again
        (unless ``restart`` is False or the iteration limit is reached)."""
        conv = self._conv
        assert conv is not None
        self._active = False
        self._rotate_pending = False
        result = torch._C._autograd._disable_profiler()
        self._profiling = False
        conv.open_window()
        window = conv.convert(result.experimental_event_tree())
        del result
        done = conv.iteration + (1 if conv.pending_boundary else 0)
        limit_reached = self.iterations is not None and done >= self.iterations
        if limit_reached and conv.pending_boundary:
            conv.boundary()  # the last iteration is complete: close it now
            window = conv._finish()
        self._deliver(window)
        if restart and not limit_reached:
            self._start_profiler()

    def _deliver(self, win: ProfiledWindow, *, as_window: bool = True) -> None:
        """Hand a converted window's events to the listeners (and keep them)."""
        conv = self._conv
        assert conv is not None
        if as_window:
            win.index = self._window_count
            self._window_count += 1
        if self._keep:
            self._events.extend(win.events)
            if as_window:
                self._windows.append(win)
        else:  # bounded memory: forget the objects that are gone
            for obj in [o for o, info in conv.objs.items() if info.freed_iteration != ALIVE]:
                del conv.objs[obj]
        for ev in win.events:
            for listener in self.listeners:
                listener(ev)
        if as_window:
            for wl in self.window_listeners:
                wl(win)

    def _error(self, exc: Exception) -> None:
        """The capture's own bookkeeping failed: re-raise, or stop profiling and
        hand it to ``on_error``."""
        if self._on_error is None:
            raise exc
        self.failed = exc
        self._active = False
        if self._profiling:
            self._profiling = False
            with contextlib.suppress(Exception):
                torch._C._autograd._disable_profiler()
        self._on_error(exc)

    # ------------------------------------------------------------------ facts
    def _leave_facts(self, marker: str, opt: torch.optim.Optimizer, *, grads: bool) -> None:
        """Read the optimizer's facts now, to be applied at ``marker``'s place."""
        conv = self._conv
        assert conv is not None
        if self.optimizer is None or opt is self.optimizer:
            conv.facts[marker] = [(p, n, k) for k, pairs in _optimizer_facts(opt, self.device, grads=grads) for p, n in pairs]
        with _RecordFunctionFast(marker):
            pass

    # ------------------------------------------------------------------ hooks
    @guarded
    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        stack = self._forwards.stack
        if (
            self._rotate_pending
            and not stack
            and self._profiling
            and threading.get_ident() == self._owner
            and torch._C._current_graph_task_id() == -1
        ):
            self._read_profile(restart=True)
        if not self._active:
            stack.append(None)  # keeps pushes and pops paired
            return
        name = self._paths.name(module, next((e[0] for e in reversed(stack) if e is not None), None))
        rf = _RecordFunctionFast(_FWD + name)
        rf.__enter__()
        stack.append((name, rf))

    @guarded
    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._forwards.stack
        if not stack:
            return
        entry = stack.pop()
        if entry is None:
            return
        name, rf = entry
        rf.__exit__(None, None, None)
        if not self._active or not torch.is_grad_enabled():
            return
        claim_backward(output, "umrt_profiled_module", lambda: self._backward_hook(_BWD + name))

    def _backward_hook(self, marker: str) -> Callable:
        def hook(grad_outputs: Any) -> None:
            if self._active:
                with contextlib.suppress(Exception), _RecordFunctionFast(marker):
                    pass

        return hook

    @guarded
    def _step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._active:
            self._steps += 1
            self._leave_facts(f"{_STEP_PRE}{self._steps}", opt, grads=True)

    @guarded
    def _step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        if self.optimizer is not None and opt is not self.optimizer:
            return
        self._leave_facts(f"{_STEP_POST}{self._steps}", opt, grads=False)
        if self.auto_step:
            self._rotate_pending = self.per_iteration
