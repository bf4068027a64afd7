"""The Unified Memory simulator (the ``sim`` backend).

* :class:`umrt.sim.backend.SimBackend` — a simulated GPU with managed memory
  that implements :class:`umrt.backends.base.Backend`;
* :func:`umrt.sim.replay.simulate` — replay a trace under a policy and report
  the steady-state iteration as a :class:`umrt.sim.result.SimResult`;
* :mod:`umrt.sim.engine` — the numba hot loops (faults, prefetcher, eviction).

Names are imported lazily (numba takes a moment to load).
"""
from __future__ import annotations

__all__ = ["SimBackend", "SimResult", "simulate"]


def __getattr__(name: str):
    if name == "SimBackend":
        # optional: the simulator (numpy, numba) is loaded only when a run is simulated, not for `umrt --help`: a lazy attribute
        from umrt.sim.backend import SimBackend

        return SimBackend
    if name == "SimResult":
        # optional: a lazy attribute, as its siblings
        from umrt.sim.result import SimResult

        return SimResult
    if name == "simulate":
        # optional: the simulator (numpy, numba) is loaded only when a run is simulated, not for `umrt --help`: a lazy attribute
        from umrt.sim.replay import simulate

        return simulate
    raise AttributeError(f"module 'umrt.sim' has no attribute {name!r}")
