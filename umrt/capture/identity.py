"""Object identity for the recorder: one object per storage.

``tensor.untyped_storage()`` returns one Python object per live storage (shared
by all its views); ``weakref.finalize`` on it reports the object's free. An
object made by an op that only allocates (``empty_like``: no kernel) is
*unannounced* until the first launch that touches it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from umrt.capture.phases import ALIVE, final_kind
from umrt.trace.events import Alloc, Event, Kind


class EventSink(Protocol):
    """Where announced objects' events go (the recorder's :class:`~umrt.capture.recorder.EventLog`)."""

    def emit(self, ev: Event) -> None: ...


@dataclass(slots=True)
class TracedObject:
    nbytes: int
    kind: Kind  # kind announced in the Alloc event
    known: Kind | None  # kind established by a fact (parameter, gradient, ...)
    phase: int  # phase it was born in
    iteration: int  # iteration it was born in (-1: set-up)
    key: tuple | None  # (exec_id, occurrence, output index, nbytes) of the creating launch
    event_index: int  # index of its Alloc event (-1: not announced yet)
    freed_phase: int = -1
    freed_iteration: int = ALIVE


class StorageObjects:
    """The objects the recorder knows, by id and by storage, and the kinds learned
    for the outputs of each launch (by its key) in the previous iteration."""

    def __init__(self) -> None:
        self.objects: dict[int, TracedObject] = {}
        self.unannounced: set[int] = set()
        self.learned: dict[tuple, Kind] = {}  # creating-launch key -> kind seen last iteration
        self._by_storage: dict[int, int] = {}  # id(storage object) -> object id
        self._finalizers: dict[int, weakref.finalize] = {}
        self._next = 0

    def find(self, storage: Any) -> int | None:
        """The object id of a storage already known."""
        return self._by_storage.get(id(storage))

    def new_id(self) -> int:
        obj = self._next
        self._next += 1
        return obj

    def add(self, obj: int, storage: Any, info: TracedObject, on_free: Callable[[int, int], None]) -> None:
        """Know ``storage`` as ``obj``; ``on_free(obj, id(storage))`` runs when it dies."""
        sid = id(storage)
        self.objects[obj] = info
        self._by_storage[sid] = obj
        self._finalizers[obj] = weakref.finalize(storage, on_free, obj, sid)

    def forget_storage(self, obj: int, sid: int) -> None:
        """The storage of ``obj`` died: no finalizer, no storage maps to it any more."""
        self._finalizers.pop(obj, None)
        if self._by_storage.get(sid) == obj:
            del self._by_storage[sid]

    def alive(self) -> list[tuple[int, int]]:
        """(storage id, object id) of every storage alive."""
        return list(self._by_storage.items())

    def release(self, obj: int, sid: int, on_free: Callable[[int, int], None]) -> None:
        """Release ``obj`` now, as if its storage died (its finalizer will not run)."""
        fin = self._finalizers.get(obj)
        if fin is not None:
            fin.detach()
            on_free(obj, sid)

    def detach_all(self) -> None:
        """Stop following every storage (the recording is over)."""
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()
        self._by_storage.clear()

    def address(self, obj: int) -> int:
        """Device address of a live object's storage (0 if dead, unknown, or on meta)."""
        fin = self._finalizers.get(obj)
        item = fin.peek() if fin is not None else None
        if not item:
            return 0
        storage = item[0]
        return 0 if storage.device.type == "meta" else int(storage.data_ptr())

    def announce(self, accesses: dict[tuple[int, int, int], bool], seq: int, log: EventSink) -> None:
        """Announce the unannounced objects that launch ``seq`` touches.

        Written whole by it: made by it (``Alloc.launch = seq``), like any op's
        output; its bytes hold nothing before (on a GPU: no copy in, the pages
        are populated where the kernel runs). Otherwise (read first, or partly
        written) as data already there (``launch = -1``), the safe reading of
        uninitialized memory a program uses.
        """
        written: dict[int, int] = {}
        for (obj, _, length), w in accesses.items():
            if obj in self.unannounced:
                written[obj] = written.get(obj, 0) + (length if w else 0)
        for obj, nbytes in written.items():
            self.unannounced.discard(obj)
            info = self.objects[obj]
            info.event_index = log.next_index()
            log.emit(Alloc(obj, info.nbytes, info.kind, seq if nbytes >= info.nbytes else -1))

    def refined(self, events: list[Event], last_iteration: int) -> list[Event]:
        """A copy of ``events`` whose Allocs carry each object's :func:`final_kind`."""
        events = list(events)
        for info in self.objects.values():
            if info.event_index < 0:  # made by an op that only allocates, touched by no launch yet
                continue
            kind = final_kind(info, last_iteration)
            ev = events[info.event_index]
            if ev.kind != kind:
                events[info.event_index] = Alloc(ev.obj, ev.nbytes, kind, ev.launch)
        return events
