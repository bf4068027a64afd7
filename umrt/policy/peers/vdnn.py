"""vDNN (Rhu, Gimelshein, Clemons, Zulfiqar, Keckler, MICRO 2016): layer-wise
offload of feature maps in forward, prefetch in backward — as a policy over
managed memory.

The first complete iteration is profiled to learn the layer structure: for
every activation (a tensor forward saves for backward) the layer boundary
after its last forward use and the backward layer that first needs it again.
From the next iteration on:

* **offload** — when the layer that last uses an activation in forward
  finishes, the activation is migrated to the host (``prefetch(..., HOST)``,
  vDNN's ``cudaMemcpyAsync`` to pinned host memory);
* **prefetch** — in backward, when a layer starts, the activations the next
  ``lookahead`` layers (default 1, as vDNN) will need are migrated back.

Weights, gradients and workspaces stay where the driver puts them: vDNN
manages feature maps only (``vDNN_all``: every layer's, not just conv
layers', since the traces are not CNN-only).
"""
from __future__ import annotations

import bisect

from umrt.backends.base import HOST
from umrt.errors import ConfigError
from umrt.policy.peers._common import IterationProfile, ProfilingPolicy, object_ranges
from umrt.trace.events import IterationBoundary, Kind, LayerEnter, LayerExit

__all__ = ["VDNNPolicy"]


class VDNNPolicy(ProfilingPolicy):
    """Options: ``lookahead`` (backward layers prefetched ahead; default 1)."""

    name = "vdnn"

    def __init__(self, trace=None, *, lookahead: int = 1) -> None:
        if int(lookahead) < 1:
            raise ConfigError(f"vdnn: lookahead must be >= 1 layer, got {lookahead}")
        self.lookahead = int(lookahead)
        super().__init__()
        self._mark = 0  # layer events seen in the current iteration
        self._offload_at: dict[int, list[tuple]] = {}  # layer-event ordinal -> keys
        self._fetch_at: dict[int, list[tuple]] = {}
        self.counters = {"offloaded_bytes": 0, "prefetched_bytes": 0, "plans": 0}

    def on_event(self, event) -> None:
        self.keys.observe(event)
        self.profiler.observe(event)
        if isinstance(event, (LayerEnter, LayerExit)):
            self._move(self._offload_at.get(self._mark), HOST, "offloaded_bytes")
            self._move(self._fetch_at.get(self._mark), self.ctx.backend.device, "prefetched_bytes")
            self._mark += 1
        elif isinstance(event, IterationBoundary):
            self.next_iteration()
            self._mark = 0
        self.keys.forget(event)

    def _move(self, keys, device: int, counter: str) -> None:
        if not keys:
            return
        ranges = object_ranges(self.keys.ranges(keys, self.ctx.layout.address))
        if ranges:
            self.ctx.backend.prefetch(ranges, device)
            self.counters[counter] += sum(n for _, n in ranges)

    def _plan(self, p: IterationProfile) -> None:
        self.counters["plans"] += 1
        self._offload_at, self._fetch_at = {}, {}
        marks = p.layer_marks  # launch ordinal at each layer event (non-decreasing)
        if not marks:
            return
        # Backward layer starts, as (layer-event ordinal, launch ordinal).
        bwd_starts = [(i, m) for i, (m, e) in enumerate(zip(marks, p.layer_events, strict=False))
                      if isinstance(e, LayerEnter) and e.phase == "backward"]
        bwd_launch = [m for _, m in bwd_starts]
        for k, o in p.objects.items():
            if o.kind != Kind.ACTIVATION or not o.uses:
                continue
            fwd = [u for u in o.uses if u < p.backward_from]
            bwd = [u for u in o.uses if u >= p.backward_from]
            if not bwd:
                continue  # not saved for backward: nothing to offload
            last_fwd = fwd[-1] if fwd else max(o.alloc_at, 0)
            # Offload at the first layer boundary after the last forward use.
            j = bisect.bisect_right(marks, last_fwd)
            if j >= len(marks) or marks[j] >= bwd[0]:
                continue  # no layer boundary between the uses
            # Prefetch when the layer `lookahead` before the one using it starts.
            s = bisect.bisect_right(bwd_launch, bwd[0]) - 1  # backward layer holding the use
            if s < 0:
                continue
            fetch = bwd_starts[max(s - self.lookahead, 0)][0]
            if fetch <= j:
                continue  # it would come straight back: keep it
            self._offload_at.setdefault(j, []).append(k)
            self._fetch_at.setdefault(fetch, []).append(k)

    def report(self) -> dict:
        return dict(self.counters)
