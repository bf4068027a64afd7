"""Steer a meta/CPU run toward the kernels a CUDA run launches.

On meta and CPU, PyTorch takes paths a CUDA run does not: attention runs as
its math decomposition (~15 small ops instead of one fused kernel) and dropout
as ``bernoulli_`` + ``div_`` + ``mul`` instead of the fused ``native_dropout``.
While a :class:`~umrt.capture.Recorder` records, these patches route the calls
to single ops that stand in for CUDA's fused kernels. Each difference that
remains is listed in :data:`NOTES` and copied into every trace header.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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

NOTES = [
    "attention: scaled_dot_product_attention without a mask is recorded as one fused op "
    "(aten::_scaled_dot_product_flash_attention, CPU flash kernel renamed); its outputs are the "
    "output and a float32 logsumexp, as on CUDA; attention dropout is not applied while recording "
    "(CUDA's flash kernel fuses it, so no launch is missing)",
    "attention with an explicit mask or grouped-query heads keeps PyTorch's meta/CPU path "
    "(the math decomposition), where CUDA would run the memory-efficient fused kernel",
    "dropout is recorded as aten::native_dropout (CUDA's fused kernel) instead of the "
    "bernoulli_/div_/mul decomposition meta and CPU use",
    "optimizer step counters live on the host as on CUDA (AdamW foreach, not capturable): ops that "
    "touch only host scalars are not recorded",
    "view and metadata-only ops (view, transpose, expand, detach, ...) launch no kernel and are not "
    "recorded; empty/empty_strided allocate without a launch (Alloc.launch = -1)",
    "transformers' packed-sequence check (a few tiny ops and a host sync on CUDA) is not recorded",
    "FLOPs come from torch.utils.flop_counter (matmul, convolution, attention); other ops count 0",
    "no caching-allocator rounding: object sizes are exact storage sizes",
]

_sdpa_orig = F.scaled_dot_product_attention
_dropout_orig = F.dropout


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    fusable = (
        attn_mask is None
        and not enable_gqa
        and query.device.type in ("meta", "cpu")
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


def _dropout(input, p=0.5, training=True, inplace=False):
    if training and 0.0 < p < 1.0 and not inplace and input.device.type in ("meta", "cpu"):
        return torch.native_dropout(input, p, True)[0]
    return _dropout_orig(input, p, training, inplace)


def _packed_sequence_patch(pause: Callable[[], ContextManager]) -> contextlib.AbstractContextManager:
    """transformers' packed-sequence check calls ``.all()``, which fails on meta.

    On meta it returns None (what it returns for ordinary batches); elsewhere it
    runs unrecorded, so meta and CPU traces agree op for op.
    """
    try:
        from transformers import masking_utils
    except Exception:  # transformers missing or changed: nothing to patch
        return contextlib.nullcontext()
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
def steered(pause: Callable[[], ContextManager] = contextlib.nullcontext) -> Iterator[None]:
    """Install the patches for the duration of a recording.

    ``pause`` returns a context in which the recorder does not record.
    """
    saved = F.scaled_dot_product_attention, F.dropout  # restore what was there, patched or not
    F.scaled_dot_product_attention = _sdpa
    F.dropout = _dropout
    try:
        with _packed_sequence_patch(pause):
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = saved
