"""What an aten op is to the recorder: its recorded name, the arguments it writes,
whether it runs a kernel, and its cost (FLOPs, bytes a view spans, precision)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from umrt.capture.steer import OP_RENAMES

# Ops that only allocate: no kernel runs on CUDA, so they are not launches.
ALLOC_ONLY = frozenset(
    {
        "aten::empty.memory_format",
        "aten::empty_strided.default",
        "aten::empty_like.default",
        "aten::new_empty.default",
        "aten::new_empty_strided.default",
    }
)
FLASH_ATTENTION = "aten::_scaled_dot_product_flash_attention.default"
FLASH_ATTENTION_BACKWARD = "aten::_scaled_dot_product_flash_attention_backward.default"

_PRECISION = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


@dataclass(slots=True)
class OpInfo:
    name: str  # recorded op name (renamed where steer stands in for a CUDA kernel)
    skip: bool  # a pure view/metadata op: no kernel
    alloc_only: bool
    write_pos: frozenset  # positional args the schema marks as written
    write_kw: frozenset  # keyword args the schema marks as written
    flop_fn: Any


class OpTable:
    """The :class:`OpInfo` of each op a dispatch mode sees, read from its schema once."""

    def __init__(self) -> None:
        self._known: dict[Any, OpInfo] = {}

    def info(self, func: torch._ops.OpOverload) -> OpInfo:
        info = self._known.get(func)
        if info is None:
            info = self._known[func] = _read_schema(func)
        return info


def _read_schema(func: torch._ops.OpOverload) -> OpInfo:
    schema = func._schema
    name = f"{schema.name}.{func._overloadname}"
    write_pos: set[int] = set()
    write_kw: set[str] = set()
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only:
                write_kw.add(a.name)
            else:
                write_pos.add(i)
                write_kw.add(a.name)
    rets = schema.returns
    skip = (
        not write_pos
        and not write_kw
        and len(rets) > 0
        and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
    )
    return OpInfo(
        name=OP_RENAMES.get(name, name),
        skip=skip,
        alloc_only=name in ALLOC_ONLY,
        write_pos=frozenset(write_pos),
        write_kw=frozenset(write_kw),
        flop_fn=flop_registry.get(func._overloadpacket),
    )


def launch_flops(info: OpInfo, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op from torch.utils.flop_counter's formulas (0 where none fits)."""
    try:
        if info.flop_fn is not None:
            return int(info.flop_fn(*args, **kwargs, out_val=out))
        if info.name == FLASH_ATTENTION:
            q, k, v = args[:3]
            return int(sdpa_flop_count(q.shape, k.shape, v.shape))
        if info.name == FLASH_ATTENTION_BACKWARD:
            g, q, k, v = args[:4]
            return int(sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))
    except Exception:  # a flop formula that does not fit these args: count nothing
        return 0
    return 0


def extent(t: torch.Tensor) -> int:
    """Bytes a view spans in its storage, from its sizes and strides."""
    n = t.numel()
    if n == 0:
        return 0
    if t.is_contiguous():
        return n * t.element_size()
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    return span * t.element_size()


def precision_of(op: str, dtypes: Iterable[torch.dtype], tf32: tuple[bool, bool]) -> str:
    """What a launch's arithmetic runs in on CUDA: its first floating-point
    input's dtype, with FP32 on TF32 tensor cores where PyTorch allows it
    (``tf32`` = (matmuls: ``torch.get_float32_matmul_precision() != "highest"``,
    convolutions: ``torch.backends.cudnn.allow_tf32``); defaults False, True)."""
    for dt in dtypes:
        if dt.is_floating_point:
            p = _PRECISION.get(dt, "")
            if p == "fp32" and (tf32[1] if "conv" in op else tf32[0]):
                return "tf32"
            return p
    return ""


def tf32_switches() -> tuple[bool, bool]:
    """PyTorch's TF32 switches (matmuls, convolutions): which FP32 kernels run on tensor cores."""
    return (torch.get_float32_matmul_precision() != "highest", bool(torch.backends.cudnn.allow_tf32))


_SPARSE_PARTS: dict[torch.layout, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    torch.sparse_coo: lambda t: (t._indices(), t._values()),
    torch.sparse_csr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_bsr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_csc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
    torch.sparse_bsc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
}


def stored(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that hold ``t``'s memory, each with a storage: ``t`` itself; a sparse
    tensor's index and value tensors (it has no storage of its own: ``nn.Embedding(sparse=True)``'s
    gradient); none for a torch.func transform's wrapper (what it wraps is seen where ops use it)."""
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is not None:
        yield from parts(t)
    elif not torch._C._functorch.is_functorch_wrapped_tensor(t):
        yield t


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's argument or result (nested lists and tuples), a sparse
    tensor as its parts (:func:`stored`)."""
    if isinstance(x, torch.Tensor):
        yield from stored(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield from stored(y)
            elif isinstance(y, (list, tuple)):
                yield from tensors_in(y)
