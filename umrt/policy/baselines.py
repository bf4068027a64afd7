"""The baseline policies every result is compared against.

* :class:`IdealPolicy` — infinite GPU memory: the upper bound on throughput.
* :class:`UMPolicy` — plain managed memory: no call at all, the driver alone
  (demand faults, its density prefetcher, LRU-by-migration eviction).
* :class:`UMAdvisePolicy` — managed memory plus static ``cudaMemAdvise`` by
  data kind, set once when an object is allocated, as PyTorch's private
  ``torch.cuda._use_uvm`` pool and Choi & Lee (2021) do. No prefetching.

These see only what a runtime could know at the time (the event just issued).
"""
from __future__ import annotations

from collections.abc import Iterable

from umrt.backends.base import Advice
from umrt.errors import ConfigError
from umrt.policy.base import Policy
from umrt.trace.events import Alloc, Event, Free, Kind, Trace

__all__ = ["IdealPolicy", "UMPolicy", "UMAdvisePolicy", "ADVICE_SCHEMES"]

GPU = "gpu"  # placeholder for "the backend's device", resolved at attach time

# Advice per kind, as (advice, where) pairs; where is GPU or HOST.
#
# "choi-lee" follows Choi & Lee, "Efficient Use of GPU Memory for Large-Scale
# Deep Learning Model Training", Applied Sciences 11(21):10377, 2021
# (doi:10.3390/app112110377), who split training data into three types and
# advise each by its access pattern (9.4% less time than plain UM):
#   - model parameters (with their gradients and optimizer state: created
#     before training, updated after every backward pass) "remain on the GPU
#     until training is complete": PreferredLocation = GPU, kept mapped there
#     (AccessedBy);
#   - intermediate results (activations, temporaries) are large and "may not
#     all reside in GPU memory": no advice, the driver migrates them;
#   - input data are delivered each iteration and not changed by training:
#     ReadMostly, so the GPU holds a read-only copy that is dropped, not copied
#     back, when evicted.
#
# "torch-uvm" follows ``torch.cuda._use_uvm`` (PyTorch main, 2026, private):
# every allocation of its managed MemPool gets PreferredLocation and
# AccessedBy set to the current device, whatever it holds.
_GPU_RESIDENT = ((Advice.SET_PREFERRED_LOCATION, GPU), (Advice.SET_ACCESSED_BY, GPU))
_READ_MOSTLY = ((Advice.SET_READ_MOSTLY, GPU),)

ADVICE_SCHEMES: dict[str, dict[Kind, tuple[tuple[Advice, object], ...]]] = {
    "choi-lee": {
        Kind.PARAMETER: _GPU_RESIDENT,
        Kind.GRADIENT: _GPU_RESIDENT,
        Kind.OPTIMIZER_STATE: _GPU_RESIDENT,
        Kind.OTHER: _GPU_RESIDENT,
        Kind.INPUT: _READ_MOSTLY,
        Kind.ACTIVATION: (),
        Kind.TEMPORARY: (),
    },
    "torch-uvm": {kind: _GPU_RESIDENT for kind in Kind},
}

# The advice that undoes each SET_* (CUDA: Unset = Set + 1).
_UNSET = {
    Advice.SET_READ_MOSTLY: Advice.UNSET_READ_MOSTLY,
    Advice.SET_PREFERRED_LOCATION: Advice.UNSET_PREFERRED_LOCATION,
    Advice.SET_ACCESSED_BY: Advice.UNSET_ACCESSED_BY,
}


class IdealPolicy(Policy):
    """Infinite GPU memory: every object stays resident, nothing ever moves.

    The simulator gives a policy with ``unlimited_memory = True`` unbounded
    capacity, so this policy needs no call of its own.
    """

    name = "ideal"
    wants_launches = False  # acts on allocations and frees only, if at all
    unlimited_memory = True

    def __init__(self, trace: Trace | None = None) -> None:
        del trace  # sees nothing of the future

    def on_event(self, event: Event) -> None:
        pass


class UMPolicy(Policy):
    """Plain CUDA managed memory: the driver alone decides what moves."""

    name = "um"
    wants_launches = False  # acts on allocations and frees only, if at all

    def __init__(self, trace: Trace | None = None) -> None:
        del trace

    def on_event(self, event: Event) -> None:
        pass


class UMAdvisePolicy(Policy):
    """Managed memory with static advice by data kind, set at allocation.

    ``scheme`` is ``"choi-lee"`` (Choi & Lee 2021, the default) or
    ``"torch-uvm"`` (PreferredLocation + AccessedBy on everything, as
    ``torch.cuda._use_uvm``); see :data:`ADVICE_SCHEMES`. The advice is
    withdrawn when the object is freed, so a caching allocator that reuses
    the range for another kind does not inherit it.
    """

    name = "um-advise"
    wants_launches = False  # acts on allocations and frees only, if at all

    def __init__(self, trace: Trace | None = None, *, scheme: str = "choi-lee") -> None:
        del trace
        if scheme not in ADVICE_SCHEMES:
            raise ConfigError(f"unknown um-advise scheme {scheme!r}; valid: {', '.join(ADVICE_SCHEMES)}")
        self.scheme = scheme
        self._table = ADVICE_SCHEMES[scheme]
        # obj -> (range, advice set) so Free can withdraw exactly what was set.
        self._advised: dict[int, tuple[tuple[int, int], tuple[tuple[Advice, int], ...]]] = {}
        self.calls = 0

    def on_event(self, event: Event) -> None:
        if isinstance(event, Alloc):
            advice = self._table.get(event.kind, ())
            if not advice or event.nbytes <= 0:
                return
            rng = (self.ctx.layout.address(event.obj), event.nbytes)
            resolved = tuple((a, self._device(where)) for a, where in advice)
            self._apply([rng], resolved)
            self._advised[event.obj] = (rng, resolved)
        elif isinstance(event, Free):
            entry = self._advised.pop(event.obj, None)
            if entry is not None:
                rng, resolved = entry
                self._apply([rng], tuple((_UNSET[a], dev) for a, dev in resolved))

    def report(self) -> dict:
        return {"scheme": self.scheme, "advise_calls": self.calls}

    def _device(self, where: object) -> int:
        return self.ctx.backend.device if where == GPU else int(where)  # type: ignore[arg-type]

    def _apply(self, ranges: list[tuple[int, int]], advice: Iterable[tuple[Advice, int]]) -> None:
        for a, device in advice:
            self.ctx.backend.advise(ranges, a, device)
            self.calls += 1
