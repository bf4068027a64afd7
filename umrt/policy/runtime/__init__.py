"""umrt's runtime: the event stream in, prefetch / pre-evict / discard out.

:class:`Runtime` (registered as policy ``"umrt"``) learns an iteration, compiles
a plan for its shape (:mod:`~umrt.policy.runtime.planner`) and acts on it in the
iterations after, on launches or, once trusted, on the launch-free clock of
allocations, frees and module boundaries (:mod:`~umrt.policy.runtime.launch_free`),
guarding against mispredictions (:mod:`~umrt.policy.runtime.guard`). Its
options, validated once, are a :class:`RuntimeOptions`.
"""
from umrt.policy.runtime.options import RuntimeOptions
from umrt.policy.runtime.policy import Runtime

__all__ = ["Runtime", "RuntimeOptions"]
