"""The event model every umrt layer speaks.

A trace is a flat sequence of events, in the order the program issued them:

* :class:`Alloc` / :class:`Free` — an object (one storage, i.e. one allocation
  the caching allocator or umrt's pool would serve) comes to life or dies.
* :class:`Launch` — one kernel (one aten op), with the byte ranges of the
  objects it reads and writes, its FLOPs and the module it ran in.
* :class:`IterationBoundary` — iteration ``index`` starts here. A trace of N
  complete iterations holds N + 1 boundaries: the last one closes iteration
  N - 1. Events before the first boundary are set-up (parameters created,
  the model moved to the device). Its ``phase`` says what the iteration is:
  a training step (``"train"``: forward, backward, optimizer step) or one
  batch of an evaluation (``"eval"``: a forward pass with gradients off or
  the model in eval mode; see :data:`PHASES`).
* :class:`LayerEnter` / :class:`LayerExit` — a module's forward or backward
  starts or ends (module boundaries; the runtime acts at these by default).

Objects are identified by small integers unique within a trace. Views never
appear: the recorder resolves them to their storage plus a byte offset.
"""
from __future__ import annotations

import enum
import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class Kind(enum.IntEnum):
    """What an object holds, as far as the recorder actually knows it."""

    PARAMETER = 0
    GRADIENT = 1
    OPTIMIZER_STATE = 2
    ACTIVATION = 3  # saved by forward, used again in backward
    TEMPORARY = 4  # born and dead within a short span (workspaces, intermediates)
    INPUT = 5  # batch data and labels
    OTHER = 6  # anything else that is long-lived (buffers, step counters)

    @property
    def persistent(self) -> bool:
        """Lives across iterations (parameters, gradients, optimizer state)."""
        return self in (Kind.PARAMETER, Kind.GRADIENT, Kind.OPTIMIZER_STATE, Kind.OTHER)


@dataclass(frozen=True, slots=True)
class Access:
    """A byte range of one object that a launch reads or writes."""

    obj: int
    offset: int
    length: int
    write: bool


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch."""

    seq: int  # position among the trace's launches, from 0
    exec_id: int  # stable across iterations, processes and machines; see execution_id()
    op: str  # aten overload name, e.g. "aten::mm.default"
    accesses: tuple[Access, ...]
    flops: int
    bytes: int  # bytes moved to or from device memory (roofline input)
    module: str = ""  # dotted module path it ran in ("" at top level)
    # What its arithmetic runs in: "fp32" (CUDA cores), "tf32", "bf16", "fp16", "fp64";
    # "" where the trace does not say (format 1). See HardwareProfile.peak_for.
    precision: str = ""

    @property
    def reads(self) -> tuple[Access, ...]:
        return tuple(a for a in self.accesses if not a.write)

    @property
    def writes(self) -> tuple[Access, ...]:
        return tuple(a for a in self.accesses if a.write)

    @property
    def updates_in_place(self) -> bool:
        """Whether the launch reads every range it writes before writing it (see :func:`updates_in_place`)."""
        return updates_in_place(self.op)


# In-place elementwise updates: ``x.mul_(y)``, ``torch._foreach_lerp_(xs, ys, w)``. The recorder
# marks an operand the schema says is mutated as written only; these ops read it too.
_ELEMENTWISE = frozenset({
    "abs", "add", "addcdiv", "addcmul", "ceil", "clamp", "clamp_max", "clamp_min", "cos", "div", "elu", "erf",
    "exp", "expm1", "floor", "gelu", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu", "lerp", "log",
    "log1p", "maximum", "minimum", "mul", "nan_to_num", "neg", "pow", "reciprocal", "relu", "round", "rsqrt",
    "sigmoid", "sign", "silu", "sin", "sqrt", "square", "sub", "tanh", "threshold", "trunc",
})
# Fused optimizer steps and mixed precision's unscaling: every operand they mutate they read.
_FUSED_UPDATES = frozenset({
    "_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_",
    "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
})


@functools.lru_cache(maxsize=4096)
def updates_in_place(op: str) -> bool:
    """Whether a launch of aten op ``op`` reads every range it writes before writing it.

    True for in-place elementwise updates (``aten::mul_.Tensor``,
    ``aten::_foreach_lerp_.Scalar``) and fused optimizer steps: the data they
    write over is live. False for everything else, which may overwrite what it
    writes (``copy_``, ``fill_``, ``zero_``, a new output), write part of the
    span it touches (``index_put_``), or ignore it (``addmm_`` with ``beta=0``).
    """
    base = op.rpartition("::")[2].partition(".")[0]
    if base in _FUSED_UPDATES:
        return True
    return base.endswith("_") and base[:-1].removeprefix("_foreach_") in _ELEMENTWISE


@dataclass(frozen=True, slots=True)
class Alloc:
    """An object is created."""

    obj: int
    nbytes: int
    kind: Kind
    launch: int = -1  # seq of the launch that created it, -1 if none yet


@dataclass(frozen=True, slots=True)
class Free:
    """An object dies; its bytes are dead from here on."""

    obj: int


#: The phases of a training loop an iteration can belong to, in report order:
#: a training step, and one batch of an evaluation (forward only).
PHASES = ("train", "eval")


@dataclass(frozen=True, slots=True)
class IterationBoundary:
    """Iteration ``index`` starts here (and iteration ``index - 1`` ends); it
    belongs to ``phase`` (one of :data:`PHASES`)."""

    index: int
    phase: str = "train"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"an iteration's phase is one of {', '.join(PHASES)}, got {self.phase!r}")


@dataclass(frozen=True, slots=True)
class LayerEnter:
    module: str
    phase: str = "forward"  # "forward" or "backward"


@dataclass(frozen=True, slots=True)
class LayerExit:
    module: str
    phase: str = "forward"


Event = Launch | Alloc | Free | IterationBoundary | LayerEnter | LayerExit


def execution_id(op: str, shapes: Iterable[Sequence[int]], dtypes: Iterable[str], module: str) -> int:
    """A launch's execution id: a 63-bit digest of what identifies the kernel.

    Built from the op overload name, argument shapes, dtypes and the module
    path — never from Python's ``hash`` (randomised per process), so the same
    launch gets the same id in every iteration, process and machine.
    """
    text = "|".join([op, ";".join("x".join(map(str, s)) for s in shapes), ",".join(dtypes), module])
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class TraceHeader:
    """What a trace file says about itself."""

    format_version: int
    umrt_version: str
    model: str
    torch_version: str
    device: str  # where it was recorded: "meta", "cpu" or "cuda"
    iterations: int  # complete iterations in the trace
    notes: list[str] = field(default_factory=list)  # known differences from a CUDA run
    meta: dict = field(default_factory=dict)  # free-form: batch, seq, argv, ...


@dataclass
class Trace:
    """A header plus the events, in program order."""

    header: TraceHeader
    events: list[Event]

    def iteration_spans(self) -> list[tuple[int, int]]:
        """Event-index spans ``[start, stop)`` of the complete iterations.

        ``start`` is the index of the iteration's boundary event, ``stop``
        the index of the next boundary.
        """
        marks = [i for i, e in enumerate(self.events) if isinstance(e, IterationBoundary)]
        return list(zip(marks[:-1], marks[1:], strict=False))

    def iteration_phases(self) -> list[str]:
        """The phase of each complete iteration (as :meth:`iteration_spans`)."""
        return [self.events[a].phase for a, _ in self.iteration_spans()]

    def launches(self) -> list[Launch]:
        return [e for e in self.events if isinstance(e, Launch)]
