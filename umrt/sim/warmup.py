"""Compile the simulator before anything is recorded: :func:`warm_up`.

The simulator's hot loops (:mod:`umrt.sim.engine`) are numba functions,
compiled on their first call, or loaded from numba's on-disk cache when an
earlier run compiled them. A cold cache costs from seconds to about a minute.

Shadow mode must not pay that inside the recorder's listener, in the middle
of the user's iteration: besides the long silent pause, numba's compiler
leaves reference cycles (exceptions with their tracebacks) that hold every
frame on the stack at that moment, and with them the program's tensors. They
then die whenever Python's cyclic garbage collector next runs, not when the
program drops them, and the trace (and the report) would differ between a
cold and a warm cache. :func:`warm_up` runs before the script instead: it
calls every method of the :class:`~umrt.sim.backend.SimBackend` interface
once on a small simulated GPU, with the argument types a replay uses, and
says so on stderr when that takes longer than a moment.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from numba.core import event

from umrt.backends.base import HOST, Advice
from umrt.hardware import load_profile
from umrt.sim.backend import SimBackend

__all__ = ["warm_up"]

_MIB = 1 << 20
_done = False  # compiled in this process: numba keeps the machine code for its lifetime
_lock = threading.Lock()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def warm_up(*, say: Callable[[str], None] = _say) -> float:
    """Compile (or load from numba's cache) the simulator's numba code now.

    ``say`` gets a line when a real compilation starts (a cold cache; loading
    from the cache says nothing) and one when it is done. Returns the
    seconds it took (0 when this process already did it).
    """
    global _done
    with _lock:
        if _done:
            return 0.0
        started = time.perf_counter()
        compiling = _FirstCompile(say)
        with event.install_listener("numba:compile", compiling):
            _exercise()
        took = time.perf_counter() - started
        if compiling.told:
            say(f"umrt: simulator compiled in {took:.0f} s (numba caches it for later runs)")
        _done = True
        return took


class _FirstCompile(event.Listener):
    """A numba event listener that speaks once, when the first real compilation starts."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.told = False

    def on_end(self, ev: event.Event) -> None:
        pass

    def on_start(self, ev: event.Event) -> None:
        if not self.told:
            self.told = True
            self.say("umrt: compiling the simulator (numba; the first run on this machine only, "
                     "up to a minute)...")


def _exercise() -> None:
    """One call of every SimBackend method, on a GPU small enough to evict."""
    gpu = SimBackend(load_profile("h100-pcie5-80g"), 32 * _MIB)  # any profile: the code is the same
    a, b, c = (gpu.malloc(24 * _MIB) for _ in range(3))
    gpu.mark_host_written([(a, 24 * _MIB)])
    gpu.launch([(a, 24 * _MIB)], [(b, 24 * _MIB)], 1 << 20, 48 * _MIB, "fp32")  # faults
    gpu.launch([(b, 24 * _MIB)], [(c, 24 * _MIB)], 1 << 20, 48 * _MIB, "fp32")  # faults, evicts
    gpu.prefetch([(a, 8 * _MIB)], gpu.device)
    gpu.prefetch([(c, 8 * _MIB)], HOST)
    gpu.populate([(c, 4 * _MIB)])
    for advice in Advice:
        gpu.advise([(b, 2 * _MIB)], advice, gpu.device)
    gpu.discard([(b, 4 * _MIB)])
    gpu.discard_and_prefetch([(b, 4 * _MIB)], gpu.device)
    gpu.discard_and_prefetch([(c, 4 * _MIB)], HOST)
    gpu.launch([(a, 4 * _MIB)], [(b, 4 * _MIB)], 1 << 20, 8 * _MIB, "fp32")  # writes the discarded range
    gpu.mark_dead([(c, _MIB)])
    gpu.synchronize()
    gpu.mem_info()
    gpu.drain_faults()
    gpu.resident_fraction([(a, _MIB)])
    gpu.counters()
    for ptr in (a, b, c):
        gpu.free(ptr)
