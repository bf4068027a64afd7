"""DeepUM-style prediction tables, learned online across iterations.

Two tables, both bounded in memory:

* :class:`CorrelationTable` — execution-id correlation: the last ``order``
  (3) execution ids -> every successor seen, with counts. It predicts the
  next kernels and, walked forward, a whole predicted sequence.
* :class:`DataTable` — per execution id, the objects it touches, with the
  first and last object touched and a confidence (how often each object was
  touched when the id ran).

Objects must be identified stably across iterations: a storage's integer id
changes every time PyTorch re-allocates an activation. :class:`ObjectKeys`
assigns *keys* instead: an object allocated inside an iteration is keyed by
its allocation ordinal in that iteration (the same role gets the same
ordinal every time the same iteration shape runs, which is also what the
lifetime pool plans its slots from); an object that survives an iteration
boundary (parameters, gradients, optimizer state) is re-keyed by the
iteration's signature and its ordinal (:func:`carried_key`), so the
gradients a step leaves behind have the same key after every step.
"""
from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

# A context position before the first launch of an iteration.
START = -1


def persistent_key(obj: int) -> int:
    """Fallback key of a survivor whose carried key is taken (negative, in a
    range carried keys never use)."""
    return -(obj + 1)


_CARRY_BASE = 1 << 40  # carried keys lie below -_CARRY_BASE; object ids stay above


def carried_key(signature: int, ordinal: int) -> int:
    """Key of the object born as allocation ``ordinal`` of an iteration with
    ``signature``, once it has survived that iteration. The same role (the
    gradients of the last step, say) gets the same key every iteration."""
    h = hashlib.blake2b(f"{signature}:{ordinal}".encode(), digest_size=7).digest()
    return -(_CARRY_BASE + 1 + int.from_bytes(h, "little"))


class ObjectKeys:
    """Stable keys for the objects of a trace (see the module docstring).

    ``obj_of`` maps each live key to its current object id, the way the
    runtime resolves a planned key to an address.
    """

    __slots__ = ("key_of", "obj_of", "ordinal")

    def __init__(self) -> None:
        self.key_of: dict[int, int] = {}  # live obj -> key
        self.obj_of: dict[int, int] = {}  # live key -> obj
        self.ordinal = 0  # next in-iteration allocation ordinal

    def alloc(self, obj: int) -> int:
        key = self.ordinal
        self.ordinal = key + 1
        old = self.key_of.get(obj)
        if old is not None:  # re-allocated without a free: forget the old role
            self.obj_of.pop(old, None)
        self.key_of[obj] = key
        self.obj_of[key] = obj
        return key

    def free(self, obj: int) -> int | None:
        key = self.key_of.pop(obj, None)
        if key is not None and self.obj_of.get(key) == obj:
            del self.obj_of[key]
        return key

    def key(self, obj: int) -> int | None:
        return self.key_of.get(obj)

    def boundary(self, signature: int) -> dict[int, int]:
        """An iteration with ``signature`` ends: survivors born in it get
        carried keys, ordinals restart. Returns ``{ordinal key: carried key}``."""
        moved: dict[int, int] = {}
        for key, obj in [(k, o) for k, o in self.obj_of.items() if k >= 0]:
            new = carried_key(signature, key)
            if new in self.obj_of:
                new = persistent_key(obj)
            del self.obj_of[key]
            self.obj_of[new] = obj
            self.key_of[obj] = new
            moved[key] = new
        self.ordinal = 0
        return moved


class CorrelationTable:
    """Execution-id correlation: last ``order`` ids -> successors with counts.

    Rows are evicted least-recently-used beyond ``max_rows`` so the table
    stays bounded however long training runs or however many shapes it sees.
    """

    def __init__(self, order: int = 3, max_rows: int = 1 << 18) -> None:
        if order < 1 or max_rows < 1:
            raise ValueError("order and max_rows must be positive")
        self.order = order
        self.max_rows = max_rows
        self._rows: dict[tuple[int, ...], Counter] = {}  # insertion order = recency
        self._ctx: tuple[int, ...] = (START,) * order
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def context(self) -> tuple[int, ...]:
        return self._ctx

    def reset_context(self) -> None:
        """Start of an iteration: the next id is predicted from START."""
        self._ctx = (START,) * self.order

    def observe(self, exec_id: int) -> bool:
        """Record that ``exec_id`` followed the current context; return
        whether it was the most likely prediction (for confidence)."""
        ctx = self._ctx
        row = self._rows.pop(ctx, None)
        if row is None:
            row = Counter()
            hit = False
        else:
            hit = row.most_common(1)[0][0] == exec_id
        row[exec_id] += 1
        self._rows[ctx] = row  # re-insert: most recently used at the end
        if len(self._rows) > self.max_rows:
            self._evict()
        self.hits += hit
        self.misses += not hit
        self._ctx = ctx[1:] + (exec_id,)
        return hit

    def _evict(self) -> None:
        # Drop the coldest eighth at once so eviction is amortised.
        drop = max(1, len(self._rows) // 8)
        for ctx in list(self._rows)[:drop]:
            del self._rows[ctx]

    def successors(self, context: Iterable[int] | None = None) -> list[tuple[int, float]]:
        """Every successor seen after ``context`` (default: the current one),
        most likely first, with its probability."""
        row = self._rows.get(tuple(context) if context is not None else self._ctx)
        if not row:
            return []
        total = sum(row.values())
        return [(eid, n / total) for eid, n in row.most_common()]

    def predict(self, context: Iterable[int] | None = None) -> tuple[int, float] | None:
        """The most likely next id and its probability, or None if unseen."""
        succ = self.successors(context)
        return succ[0] if succ else None

    def walk(self, n: int, context: Iterable[int] | None = None) -> Iterator[tuple[int, float]]:
        """Predict up to ``n`` ids ahead, each with the running confidence
        (product of the step probabilities); stops where the table is blind."""
        ctx = tuple(context) if context is not None else self._ctx
        conf = 1.0
        for _ in range(n):
            guess = self.predict(ctx)
            if guess is None:
                return
            conf *= guess[1]
            yield guess[0], conf
            ctx = ctx[1:] + (guess[0],)

    @property
    def accuracy(self) -> float:
        """Fraction of observed ids that were the top prediction."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class DataRow:
    """What one execution id touches."""

    runs: int = 0
    objects: Counter = field(default_factory=Counter)
    first: int | None = None  # first object touched on the last run
    last: int | None = None  # last object touched on the last run

    def confident(self, min_confidence: float) -> list[int]:
        """Objects touched in at least ``min_confidence`` of the runs."""
        need = min_confidence * self.runs
        return [k for k, n in self.objects.items() if n >= need]

    def confidence(self, key: int) -> float:
        return self.objects.get(key, 0) / self.runs if self.runs else 0.0


class DataTable:
    """Per execution id, the object keys it touches (DeepUM's block table,
    at object granularity), bounded by ``max_rows`` rows of at most
    ``max_objects`` objects each (coldest dropped first)."""

    def __init__(self, max_rows: int = 1 << 16, max_objects: int = 64) -> None:
        if max_rows < 1 or max_objects < 1:
            raise ValueError("max_rows and max_objects must be positive")
        self.max_rows = max_rows
        self.max_objects = max_objects
        self._rows: dict[int, DataRow] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, exec_id: int) -> bool:
        return exec_id in self._rows

    def observe(self, exec_id: int, keys: Iterable[int]) -> None:
        row = self._rows.pop(exec_id, None) or DataRow()
        self._rows[exec_id] = row  # most recently used last
        row.runs += 1
        first = last = None
        for k in keys:
            if first is None:
                first = k
            last = k
            row.objects[k] += 1
        row.first, row.last = first, last
        if len(row.objects) > self.max_objects:
            for k, _ in row.objects.most_common()[self.max_objects:]:
                del row.objects[k]
        if len(self._rows) > self.max_rows:
            for eid in list(self._rows)[: max(1, len(self._rows) // 8)]:
                del self._rows[eid]

    def row(self, exec_id: int) -> DataRow | None:
        return self._rows.get(exec_id)

    def predict(self, exec_id: int, min_confidence: float = 0.5) -> list[int]:
        """Object keys ``exec_id`` is expected to touch."""
        row = self._rows.get(exec_id)
        return row.confident(min_confidence) if row else []


class VariantTable:
    """Which iteration shape follows which: signature -> successor counts.

    Training loops alternate a few iteration shapes (a train step, an eval
    step, sequence-length buckets, a last short batch). Each shape has a
    signature (a digest of its launch sequence); this table predicts the
    next one from the last, the correlation idea one level up, and from the
    last two, which tell apart the places a shape takes in a longer cycle (an
    evaluation's batches). Bounded to ``max_rows`` rows of each.

    A shape seen only once may be a stray (a free that another thread made
    late, one odd batch): after one that has no successors yet, the table
    predicts from the latest shape before it that recurs, then the stray
    itself; among successors as likely, the last shape comes first (loops
    repeat: a stray that once followed the same two shapes does not outweigh
    the last shape's own repeats). So a stray costs the iterations it changed, not one more each
    time its predecessor recurs.
    """

    #: weight of the last two shapes' successor counts beside the last one's
    PAIR_WEIGHT = 1.0

    def __init__(self, max_rows: int = 64) -> None:
        self.max_rows = max_rows
        self._rows: dict[int | None, Counter] = {}
        self._pairs: dict[tuple[int | None, int | None], Counter] = {}
        self._seen: Counter = Counter()  # signature -> iterations of that shape
        self._recent: deque[int] = deque(maxlen=8)  # the last shapes, latest last
        self.last: int | None = None
        self._before: int | None = None  # the shape before the last (None: none, or unknown)

    def observe(self, signature: int) -> None:
        for table, key in ((self._rows, self.last), (self._pairs, (self._before, self.last))):
            row = table.pop(key, None) or Counter()
            row[signature] += 1
            table[key] = row
            if len(table) > self.max_rows:
                for old in list(table)[: max(1, len(table) // 8)]:
                    del table[old]
        self._seen[signature] += 1
        if len(self._seen) > 4 * self.max_rows:
            self._seen = Counter(dict(self._seen.most_common(self.max_rows)))
        self._recent.append(signature)
        self._before, self.last = self.last, signature

    def seen(self, signature: int) -> int:
        """Iterations of shape ``signature`` observed (0: none, or forgotten)."""
        return self._seen[signature]

    def successors(self, signature: int) -> set[int]:
        """The shapes seen right after one of shape ``signature``."""
        return set(self._rows.get(signature) or ())

    def forget_last(self) -> None:
        """An iteration of unknown shape ran: predict as after the start of a run."""
        self._before = self.last = None

    def _anchor(self) -> int | None:
        """The latest shape before the last one that recurs and has successors."""
        return next((sig for sig in reversed(self._recent) if sig != self.last
                     and self._seen[sig] >= 2 and self._rows.get(sig)), None)

    def predict(self) -> list[int]:
        """Likely next signatures, most likely first (with no history after
        the last shape, the last shape itself: training loops repeat)."""
        last = self.last
        row = self._rows.get(last)
        if not row:
            anchor = self._anchor() if last is not None and self._seen[last] < 2 else None
            if anchor is None:
                return [last] if last is not None else []
            # a stray with no successors yet: what recurs after the latest recurring shape, then itself
            after = self._rows[anchor]
            ranked = sorted((sig for sig in after if sig != last), key=after.__getitem__, reverse=True)
            return [sig for sig in ranked if self._seen[sig] >= 2] + [last] + [sig for sig in ranked if self._seen[sig] < 2]
        pair = self._pairs.get((self._before, last)) or {}
        score = {sig: n + self.PAIR_WEIGHT * pair.get(sig, 0) for sig, n in row.items()}
        return sorted(score, key=lambda sig: (score[sig], sig == last), reverse=True)
