"""SwapAdvisor (Huang, Jin, Li, ASPLOS 2020): a swap plan found by a genetic
search and scored by a simulator, as a policy over managed memory.

SwapAdvisor plans offline from the dataflow graph, so this policy is handed
the trace (``SwapAdvisorPolicy(trace)``) and plans for its last (steady-state)
iteration, naming tensors by allocation order so the plan applies to every
replayed iteration. A plan is built from a few genes:

* **memory limit** — the fraction of the budget the plan may fill (headroom
  for 2 MB-block sharing and the allocator's rounding);
* **swap-out = Belady** — whenever the planned resident bytes exceed the
  limit, swap out the tensor whose next use is furthest away (scaled by a
  per-tensor weight gene for the largest tensors), right after its last use;
* **swap-in as early as safe** — each swapped-out tensor comes back at the
  earliest launch from which the planned resident bytes stay within the limit
  until its next use (capped by a lookahead gene).

The genetic search (small population, uniform crossover, mutation, elitism)
scores every candidate plan by running the simulator itself on the trace,
``max_evaluations`` candidates (default 12, with ``search_seconds``, default
120 s, as a wall-clock cap; SwapAdvisor used ~30 minutes with a population
of 144). SwapAdvisor also searches operator schedules and memory
size classes; here the schedule is the program's and the layout PyTorch's,
which every policy shares.
"""
from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

from umrt.backends.base import HOST
from umrt.errors import ConfigError
from umrt.policy.base import Policy, PolicyContext
from umrt.policy.peers._common import (
    AllocationOrderKeys,
    IterationProfile,
    next_use,
    object_ranges,
    profile_trace,
)
from umrt.trace.events import IterationBoundary, Kind, Launch

__all__ = ["SwapAdvisorPolicy", "SwapPlan", "Genes"]

WEIGHTED = 64  # tensors (largest first) that carry a Belady weight gene
WEIGHTS = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class Genes:
    """One candidate of the search."""

    limit: float = 0.95  # fraction of the budget the plan may fill
    lookahead: int = 1 << 30  # launches a swap-in may be issued ahead of its use
    weights: tuple[float, ...] = ()  # Belady distance multipliers of the largest tensors


@dataclass
class SwapPlan:
    """Per launch ordinal of the iteration: tensors to swap out, then in, before it."""

    swap_out: dict[int, list[tuple]] = field(default_factory=dict)
    swap_in: dict[int, list[tuple]] = field(default_factory=dict)

    @property
    def swaps(self) -> int:
        return sum(map(len, self.swap_out.values()))


def build_plan(p: IterationProfile, limit_bytes: int, genes: Genes) -> SwapPlan:
    """Belady swap-out and earliest-safe swap-in for one iteration under a byte limit."""
    n = p.n_launches
    plan = SwapPlan()
    if n == 0:
        return plan
    objs = p.objects
    big = sorted((k for k, o in objs.items() if o.kind != Kind.TEMPORARY), key=lambda k: -objs[k].nbytes)
    weight = {k: w for k, w in zip(big[:WEIGHTED], genes.weights, strict=False)}
    allocs: dict[int, list] = {}
    frees: dict[int, list] = {}
    resident: set = set()
    used = 0
    for k, o in objs.items():
        if o.alloc_at >= 0:
            allocs.setdefault(o.alloc_at, []).append(k)
        else:
            resident.add(k)
            used += o.nbytes
        if o.free_at >= 0:
            frees.setdefault(o.free_at, []).append(k)
    # Belady victims from a max-heap of (priority, tiebreak, key, version), lazily invalidated.
    heap: list = []
    version: dict = {}
    tie = 0

    def push(k, t) -> None:
        nonlocal tie
        o = objs[k]
        if o.kind == Kind.TEMPORARY:
            return
        u = next_use(o.uses, t)
        if u is None:
            if o.free_at >= 0:
                return  # dead until freed: moving it saves nothing
            u = (o.uses[0] + n) if o.uses else 2 * n
        v = version[k] = version.get(k, 0) + 1
        tie += 1
        heapq.heappush(heap, (-(t + (u - t) * weight.get(k, 1.0)), tie, k, v))

    for k in objs:  # in the profile's order, not the set's: ties must not depend on hashing
        if k in resident:
            push(k, -1)
    mem = np.zeros(n, np.int64)
    out_at: dict = {}  # key -> launch ordinal its current swap-out was issued at
    last_use: dict = {}
    ins: list[tuple[int, int, int, tuple]] = []  # (use, earliest, tiebreak, key)
    for t in range(n):
        for k in frees.get(t, ()):
            if k in resident:
                resident.discard(k)
                used -= objs[k].nbytes
                version[k] = version.get(k, 0) + 1
        for k in allocs.get(t, ()):
            resident.add(k)
            used += objs[k].nbytes
            push(k, t - 1)
        need = p.launch_keys[t]
        for k in need:
            if k not in resident:
                resident.add(k)
                used += objs[k].nbytes
                ins.append((t, out_at.pop(k, -1) + 1, len(ins), k))
        needed = set(need)
        held = []
        while used > limit_bytes and heap:
            _, _, k, v = heapq.heappop(heap)
            if version.get(k) != v or k not in resident:
                continue
            if k in needed:
                held.append(k)
                continue
            resident.discard(k)
            used -= objs[k].nbytes
            version[k] += 1
            at = last_use.get(k, t - 1) + 1  # right after its last use
            out_at[k] = at
            plan.swap_out.setdefault(at, []).append(k)
        for k in need:
            last_use[k] = t
            push(k, t)
        mem[t] = used
    # Swap-ins as early as safe: the earliest launch from which the planned
    # resident bytes stay within the limit until the use.
    for use, earliest, _, k in sorted(ins):
        size = objs[k].nbytes
        floor = max(earliest, use - genes.lookahead, 0)
        s = use
        if floor < use:
            bad = np.nonzero(mem[floor:use] + size > limit_bytes)[0]
            s = floor + int(bad[-1]) + 1 if len(bad) else floor
        mem[s:use] += size
        plan.swap_in.setdefault(s, []).append(k)
    return plan


class SwapAdvisorPolicy(Policy):
    """Options: ``max_evaluations`` (simulated candidates the genetic search
    scores, default 12 — a count, so results do not depend on machine speed),
    ``search_seconds`` (a wall-clock safety cap, default 120; the report says
    when it cut the search short), ``population`` (default 8), ``seed``
    (default 0), ``genes`` (a fixed :class:`Genes`, skipping the search)."""

    name = "swapadvisor"

    def __init__(self, trace=None, *, search_seconds: float = 120.0, max_evaluations: int = 12,
                 population: int = 8, seed: int = 0, genes: Genes | None = None,
                 score_iterations: int = 2) -> None:
        if trace is None:
            raise ConfigError("swapadvisor plans offline from the dataflow graph: it needs the trace "
                              "(make_policy('swapadvisor', trace=...))")
        if float(search_seconds) < 0:
            raise ConfigError(f"swapadvisor: search_seconds must be >= 0, got {search_seconds}")
        if int(max_evaluations) < 1:
            raise ConfigError(f"swapadvisor: max_evaluations must be >= 1, got {max_evaluations}")
        if int(population) < 2:
            raise ConfigError(f"swapadvisor: population must be >= 2, got {population}")
        self.trace = trace
        self.search_seconds = float(search_seconds)
        self.max_evaluations = int(max_evaluations)
        self.population = int(population)
        self.seed = int(seed)
        self.score_iterations = int(score_iterations)
        self.genes = genes
        self.profile, _ = profile_trace(trace)
        self.plan: SwapPlan | None = None
        self.keys = AllocationOrderKeys()
        self._launch = 0
        self.search: dict = {}
        self.counters = {"swapped_out_bytes": 0, "swapped_in_bytes": 0}

    # -- planning ---------------------------------------------------------------

    def attach(self, ctx: PolicyContext) -> None:
        super().attach(ctx)
        if self.plan is None:
            genes = self.genes if self.genes is not None else self._search(ctx)
            self.genes = genes
            self.plan = build_plan(self.profile, int(ctx.budget_bytes * genes.limit), genes)

    def _score(self, genes: Genes, ctx: PolicyContext) -> float:
        cand = SwapAdvisorPolicy(self.trace, genes=genes, population=self.population)
        cand.profile = self.profile
        result = ctx.simulate(self.trace, cand, ctx.profile, ctx.budget_bytes,
                          iterations=self.score_iterations, progress=False)
        return float(result.iteration_time_s)

    def _search(self, ctx: PolicyContext) -> Genes:
        rng = random.Random(self.seed)
        default = Genes(weights=(1.0,) * WEIGHTED)
        if ctx.profile is None or ctx.simulate is None or self.search_seconds == 0:
            return default  # no simulator to score candidates on: the default genes
        n = max(self.profile.n_launches, 1)
        deadline = time.monotonic() + self.search_seconds
        scores: dict[Genes, float] = {}

        def score(g: Genes) -> float:
            if g not in scores:
                scores[g] = self._score(g, ctx)
            return scores[g]

        def rand() -> Genes:
            return Genes(limit=rng.uniform(0.4, 1.0),
                         lookahead=rng.choice([n // 64 + 1, n // 16 + 1, n // 4 + 1, 1 << 30]),
                         weights=tuple(rng.choice(WEIGHTS) for _ in range(WEIGHTED)))

        def exhausted() -> bool:
            return bool(scores) and (len(scores) >= self.max_evaluations or time.monotonic() > deadline)

        pop = [default] + [rand() for _ in range(self.population - 1)]
        generations = 0
        while True:
            ranked = []
            for g in pop:
                if g not in scores and exhausted():
                    break
                ranked.append((score(g), g))
            ranked.sort(key=lambda x: x[0])
            if exhausted() or len(ranked) < len(pop):
                break
            generations += 1
            elite = [g for _, g in ranked[: max(2, self.population // 2)]]
            children = []
            while len(elite) + len(children) < self.population:
                a, b = rng.sample(elite, 2)
                child = Genes(
                    limit=min(1.0, max(0.3, rng.choice([a.limit, b.limit]) + rng.gauss(0, 0.03))),
                    lookahead=rng.choice([a.lookahead, b.lookahead]),
                    weights=tuple(rng.choice(WEIGHTS) if rng.random() < 0.05 else rng.choice(pair)
                                  for pair in zip(a.weights, b.weights, strict=False)),
                )
                children.append(child)
            pop = elite + children
        best = min(scores, key=scores.get)
        self.search = {"evaluated": len(scores), "generations": generations,
                       "stopped_by": "evaluations" if len(scores) >= self.max_evaluations else "time",
                       "best_time_s": scores[best], "default_time_s": scores.get(default, math.nan),
                       "limit": best.limit, "lookahead": best.lookahead}
        return best

    # -- acting -----------------------------------------------------------------

    def on_event(self, event) -> None:
        self.keys.observe(event)
        if isinstance(event, Launch):
            self._act(self._launch)
            self._launch += 1
        elif isinstance(event, IterationBoundary):
            self._launch = 0
        self.keys.forget(event)

    def _ranges(self, keys) -> list[tuple[int, int]]:
        return object_ranges(self.keys.ranges(keys, self.ctx.layout.address))

    def _act(self, t: int) -> None:
        if self.keys.iterations_seen == 0 or self.plan is None:
            return
        out = self.plan.swap_out.get(t)
        if out:
            ranges = self._ranges(out)
            if ranges:
                self.ctx.backend.prefetch(ranges, HOST)
                self.counters["swapped_out_bytes"] += sum(r[1] for r in ranges)
        inn = self.plan.swap_in.get(t)
        if inn:
            ranges = self._ranges(inn)
            if ranges:
                self.ctx.backend.prefetch(ranges, self.ctx.backend.device)
                self.counters["swapped_in_bytes"] += sum(r[1] for r in ranges)

    def report(self) -> dict:
        return dict(self.counters, swaps=self.plan.swaps if self.plan else 0, search=self.search)
