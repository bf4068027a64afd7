"""Steer a recording toward the kernels a CUDA run launches, where nothing real is computed.

On meta and CPU, PyTorch takes paths a CUDA run does not: attention runs as
its math decomposition (~15 small ops instead of one fused kernel) and dropout
as ``bernoulli_`` + ``div_`` + ``mul`` instead of the fused ``native_dropout``.
While a :class:`~umrt.capture.Recorder` records, these patches route the calls
on the steered devices to single ops that stand in for CUDA's fused kernels.

Steering changes what is computed: the stand-in attention drops attention
dropout and runs another kernel, and the fused dropout draws its random numbers
differently. So it applies only where no program's results are at stake:

* ``meta`` (the recorder's default): nothing is computed there at all;
* ``cpu`` as well only when asked (``Recorder(steer=True)``), for umrt's own
  synthetic training loops (:func:`umrt.zoo.trace_model`), whose CPU traces then
  match the meta ones op for op.

A user's script (shadow mode, ``umrt trace -- script.py``, a live run) runs
unsteered on the CPU and on CUDA: its ops, kernels and random stream are its
own. The notes in :func:`notes` say which of these a trace holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.nn.functional as F

# The CPU fused attention op stands in for CUDA's flash attention kernel; the
# recorder renames it so a trace reads like a CUDA one.
OP_RENAMES = {
    "aten::_scaled_dot_product_flash_attention_for_cpu.default": "aten::_scaled_dot_product_flash_attention.default",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default": (
        "aten::_scaled_dot_product_flash_attention_backward.default"
    ),
}

# The devices steering may act on (it never touches CUDA: the fused kernels run there anyway).
STEERABLE = ("meta", "cpu")

PACKED_SEQUENCE_NOTE = (
    "transformers' packed-sequence check (a few tiny ops and a host sync on CUDA) is not recorded"
)

STEERED_NOTES = [
    "attention: scaled_dot_product_attention without a mask is recorded as one fused op "
    "(aten::_scaled_dot_product_flash_attention, CPU flash kernel renamed); its outputs are the "
    "output and a float32 logsumexp, as on CUDA; attention dropout is not applied in the steered "
    "run (CUDA's flash kernel fuses it, so no launch is missing)",
    "attention with an explicit mask or grouped-query heads keeps PyTorch's meta/CPU path "
    "(the math decomposition), where CUDA would run the memory-efficient fused kernel",
    "dropout is recorded as aten::native_dropout (CUDA's fused kernel) instead of the "
    "bernoulli_/div_/mul decomposition meta and CPU use",
]

UNSTEERED_NOTE = (
    "attention and dropout are recorded as the program ran them on {device}: attention's math "
    "decomposition (or the CPU flash kernel, renamed to CUDA's, when neither dropout nor a mask "
    "applies) and dropout as bernoulli_/div_/mul, where CUDA runs fused kernels, so the trace holds "
    "more launches and temporaries than a CUDA run of the same program"
)

COMMON_NOTES = [
    "optimizer step counters live on the host as on CUDA (AdamW foreach, not capturable): ops that "
    "touch only host scalars are not recorded",
    "view and metadata-only ops (view, transpose, expand, detach, ...) launch no kernel and are not "
    "recorded; ops that only allocate (empty, empty_like, empty_strided, ...) launch nothing: their "
    "storage is announced by the first launch that touches it, as made by it when it writes it whole "
    "(else Alloc.launch = -1, data already there)",
    "FLOPs come from torch.utils.flop_counter (matmul, convolution, attention); other ops count 0",
    "no caching-allocator rounding: object sizes are exact storage sizes",
]

# Everything a steered trace's header says (meta, or a zoo trace on the CPU).
NOTES = STEERED_NOTES + COMMON_NOTES + [PACKED_SEQUENCE_NOTE]


def devices(steer: bool | Collection[str]) -> frozenset[str]:
    """The devices a ``Recorder(steer=...)`` value steers: True = meta and CPU, False = none,
    or the device types named (only meta and CPU can be steered).

    Raises:
        ValueError: a device steering cannot act on.
    """
    if steer is True:
        return frozenset(STEERABLE)
    if steer is False:
        return frozenset()
    if isinstance(steer, str):
        steer = (steer,)
    chosen = frozenset(steer)
    bad = chosen - set(STEERABLE)
    if bad:
        raise ValueError(f"steering acts only on {', '.join(STEERABLE)}; got {', '.join(sorted(bad))}")
    return chosen


def notes(steered: Collection[str], device: str) -> list[str]:
    """The trace-header notes for a recording of ``device`` with steering on ``steered``
    (empty: no patch installed at all)."""
    if device in steered:
        head = STEERED_NOTES
    elif device in STEERABLE:
        head = [UNSTEERED_NOTE.format(device=device)]
    else:  # CUDA: attention and dropout run as the fused kernels they are
        head = []
    return [*head, *COMMON_NOTES, *([PACKED_SEQUENCE_NOTE] if steered else [])]


_sdpa_orig = F.scaled_dot_product_attention
_dropout_orig = F.dropout


def _make_sdpa(on: frozenset[str]) -> Callable:
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        fusable = (
            attn_mask is None
            and not enable_gqa
            and query.device.type in on
            and query.dim() == 4
            and key.shape[1] == query.shape[1]
            and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        )
        if not fusable:
            return _sdpa_orig(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        # The CPU kernel rejects dropout; CUDA's flash kernel fuses it (same launch, same bytes).
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, scale=scale
        )[0]

    return sdpa


def _make_dropout(on: frozenset[str]) -> Callable:
    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and not inplace and input.device.type in on:
            return torch.native_dropout(input, p, True)[0]
        return _dropout_orig(input, p, training, inplace)

    return dropout


def _packed_sequence_patch(pause: Callable[[], ContextManager]) -> contextlib.AbstractContextManager:
    """transformers' packed-sequence check calls ``.all()``, which fails on meta.

    On meta it returns None (what it returns for ordinary batches); elsewhere the
    original runs, unchanged but unrecorded, so meta and CPU traces agree op for op.
    """
    try:
        from transformers import masking_utils
    except Exception:  # transformers missing or changed: nothing to patch
        return contextlib.nullcontext()
    # a transformers version probe, not torch: older releases have no packed-sequence check (5.24 has it)
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if orig is None:
        return contextlib.nullcontext()

    def find_packed_sequence_indices(position_ids):
        if position_ids.device.type == "meta":
            return None  # what it returns for ordinary (unpacked) batches
        with pause():
            return orig(position_ids)

    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
        try:
            yield
        finally:
            masking_utils.find_packed_sequence_indices = orig

    return patch()


@contextlib.contextmanager
def steered(
    pause: Callable[[], ContextManager] = contextlib.nullcontext, on: Collection[str] = STEERABLE
) -> Iterator[None]:
    """Install the patches for the duration of a recording.

    ``pause`` returns a context in which the recorder does not record; ``on``
    names the device types whose attention and dropout are steered (tensors
    elsewhere take PyTorch's own path, untouched).
    """
    chosen = devices(tuple(on))
    saved = F.scaled_dot_product_attention, F.dropout  # restore what was there, patched or not
    F.scaled_dot_product_attention = _make_sdpa(chosen)
    F.dropout = _make_dropout(chosen)
    try:
        with _packed_sequence_patch(pause):
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = saved
