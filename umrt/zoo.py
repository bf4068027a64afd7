"""Training steps of well-known models, recorded into traces.

Every model is built from a transformers config with random weights (nothing
is downloaded) and trained the way a CUDA run trains it: forward, loss,
backward, ``AdamW(foreach=True).step()``, ``zero_grad(set_to_none=True)``,
with sdpa attention. On ``device="meta"`` no memory is touched, so even GPT-2
XL records in seconds.

Names: ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``, ``bert-base``,
``bert-large``, ``vit-large``, ``resnet-152``, and ``hf:ConfigClass:k=v,...``
for any transformers config (e.g. ``hf:LlamaConfig:num_hidden_layers=8``);
the model class is picked from transformers' Auto mappings: causal LM, else
masked LM, else image or sequence classification, else the base model trained
on the mean of its output. For image models ``seq`` is the image side in pixels.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from umrt.capture import Recorder
from umrt.errors import ConfigError
from umrt.trace.events import Trace

# Paper-like defaults. GPT-2 at 8 x 1024 as in the issue; BERT pre-training at
# 32 x 512 (the phase-2 sequence length; DeepUM/Sentinel-style large batches);
# vision models at batch 64 of 224-pixel images (ImageNet training).
DEFAULT_BATCH: dict[str, int] = {
    "gpt2": 8,
    "gpt2-medium": 8,
    "gpt2-large": 8,
    "gpt2-xl": 8,
    "bert-base": 32,
    "bert-large": 32,
    "vit-large": 64,
    "resnet-152": 64,
}
DEFAULT_SEQ: dict[str, int] = {
    "gpt2": 1024,
    "gpt2-medium": 1024,
    "gpt2-large": 1024,
    "gpt2-xl": 1024,
    "bert-base": 512,
    "bert-large": 512,
    "vit-large": 224,
    "resnet-152": 224,
}
HF_DEFAULT_BATCH = 8
HF_DEFAULT_SEQ = 512

MODELS = tuple(DEFAULT_BATCH)


@dataclass
class ModelSpec:
    """How to build a model and feed it one batch."""

    name: str
    config: Any
    model_class: Any
    task: str  # "causal-lm", "seq2seq-lm", "masked-lm", "image-classification", "seq-classification", "base"
    default_batch: int
    default_seq: int
    meta: dict = field(default_factory=dict)


def _gpt2(n_embd: int, n_layer: int, n_head: int) -> Callable[[], Any]:
    def make():
        from transformers import GPT2Config

        return GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head)

    return make


def _bert(hidden: int, layers: int, heads: int, inter: int) -> Callable[[], Any]:
    def make():
        from transformers import BertConfig

        return BertConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=inter
        )

    return make


def _vit_large():
    from transformers import ViTConfig

    return ViTConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        image_size=224,
        patch_size=16,
        num_labels=1000,
    )


def _resnet152():
    from transformers import ResNetConfig

    return ResNetConfig(
        depths=[3, 8, 36, 3],
        layer_type="bottleneck",
        hidden_sizes=[256, 512, 1024, 2048],
        embedding_size=64,
        num_labels=1000,
    )


_BUILTIN: dict[str, tuple[Callable[[], Any], str, str]] = {
    "gpt2": (_gpt2(768, 12, 12), "GPT2LMHeadModel", "causal-lm"),
    "gpt2-medium": (_gpt2(1024, 24, 16), "GPT2LMHeadModel", "causal-lm"),
    "gpt2-large": (_gpt2(1280, 36, 20), "GPT2LMHeadModel", "causal-lm"),
    "gpt2-xl": (_gpt2(1600, 48, 25), "GPT2LMHeadModel", "causal-lm"),
    "bert-base": (_bert(768, 12, 12, 3072), "BertForMaskedLM", "masked-lm"),
    "bert-large": (_bert(1024, 24, 16, 4096), "BertForMaskedLM", "masked-lm"),
    "vit-large": (_vit_large, "ViTForImageClassification", "image-classification"),
    "resnet-152": (_resnet152, "ResNetForImageClassification", "image-classification"),
}


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        return text


def _split_overrides(text: str) -> list[str]:
    """Split ``k=v,k=[1,2],...`` on the commas outside brackets and quotes."""
    items, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    items.append("".join(cur))
    return [i for i in items if i.strip()]


def _hf_spec(name: str) -> ModelSpec:
    import transformers
    from transformers.models.auto import modeling_auto as ma

    parts = name.split(":", 2)
    if len(parts) < 2 or not parts[1]:
        raise ConfigError(f"bad model name {name!r}: expected hf:ConfigClass[:key=value,...]")
    cls_name = parts[1]
    config_cls = getattr(transformers, cls_name, None)
    if config_cls is None or not (
        isinstance(config_cls, type) and issubclass(config_cls, transformers.PretrainedConfig)
    ):
        raise ConfigError(f"unknown transformers config class {cls_name!r} in {name!r}")
    overrides: dict[str, Any] = {}
    if len(parts) == 3 and parts[2]:
        for item in _split_overrides(parts[2]):
            if "=" not in item:
                raise ConfigError(f"bad override {item!r} in {name!r}: expected key=value")
            k, v = item.split("=", 1)
            overrides[k.strip()] = _parse_value(v.strip())
    try:
        config = config_cls(**overrides)
    except Exception as exc:
        raise ConfigError(f"{cls_name}({parts[2] if len(parts) == 3 else ''}) failed: {exc}") from exc
    model_type = getattr(config, "model_type", "")
    for mapping, task in (  # noqa: B007 (task is used after the break)
        ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-lm"),
        ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq-lm"),
        ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked-lm"),
        ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image-classification"),
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "seq-classification"),
        ("MODEL_MAPPING_NAMES", "base"),
    ):
        model_name = getattr(ma, mapping, {}).get(model_type)
        if isinstance(model_name, (tuple, list)):
            model_name = model_name[0]
        if model_name and hasattr(transformers, model_name):
            break
    else:
        raise ConfigError(f"no trainable model class for config {cls_name} (model_type {model_type!r})")
    seq = HF_DEFAULT_SEQ
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:
        seq = min(seq, limit)
    if task == "image-classification":
        seq = int(getattr(config, "image_size", 224) or 224)
    return ModelSpec(
        name,
        config,
        getattr(transformers, model_name),
        task,
        HF_DEFAULT_BATCH,
        seq,
        {"config": cls_name, "overrides": overrides},
    )


def resolve(name: str) -> ModelSpec:
    """The :class:`ModelSpec` for a zoo name or ``hf:ConfigClass:k=v,...``."""
    if name.startswith("hf:"):
        return _hf_spec(name)
    if name not in _BUILTIN:
        raise ConfigError(
            f"unknown model {name!r}; known: {', '.join(MODELS)}, or hf:ConfigClass:key=value,..."
        )
    import transformers

    make_config, cls_name, task = _BUILTIN[name]
    return ModelSpec(
        name, make_config(), getattr(transformers, cls_name), task, DEFAULT_BATCH[name], DEFAULT_SEQ[name]
    )


def build_model(spec: ModelSpec, device: str) -> torch.nn.Module:
    """A randomly initialised model on ``device`` (sdpa attention where supported)."""
    with torch.device(device), contextlib.redirect_stderr(io.StringIO()):
        try:
            model = spec.model_class._from_config(copy.deepcopy(spec.config), attn_implementation="sdpa")
        except (ValueError, TypeError, ImportError):  # no sdpa for this architecture (e.g. ResNet)
            model = spec.model_class._from_config(copy.deepcopy(spec.config))
    model.train()
    return model


def make_inputs(spec: ModelSpec, batch: int, seq: int, device: str) -> dict[str, torch.Tensor]:
    """One random batch (token ids and labels, or images and class labels)."""
    cfg = spec.config
    if (
        spec.task == "image-classification"
        or getattr(spec.model_class, "main_input_name", "") == "pixel_values"
    ):
        channels = int(getattr(cfg, "num_channels", 3) or 3)
        inputs = {"pixel_values": torch.randn(batch, channels, seq, seq, device=device)}
        if spec.task == "image-classification":
            inputs["labels"] = torch.randint(0, max(1, int(cfg.num_labels)), (batch,), device=device)
        return inputs
    vocab = int(getattr(cfg, "vocab_size", None) or 1000)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    inputs = {"input_ids": ids}
    if getattr(cfg, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids  # teacher forcing on the same tokens
    if spec.task in ("causal-lm", "masked-lm", "seq2seq-lm"):
        inputs["labels"] = ids.clone()
    elif spec.task == "seq-classification":
        inputs["labels"] = torch.randint(
            0, max(1, int(getattr(cfg, "num_labels", 2))), (batch,), device=device
        )
    return inputs


def training_loss(out: Any) -> torch.Tensor:
    """The loss a model's output carries, else the mean of its first tensor (a stand-in to backpropagate)."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    first = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", None)
    if first is None:
        first = next(v for v in out.values() if isinstance(v, torch.Tensor))
    return first.float().mean()


def forward_kwargs(spec: ModelSpec) -> dict:
    """Keyword arguments a training forward of ``spec`` takes (no KV cache for causal LMs)."""
    if spec.task in ("causal-lm",) and getattr(spec.config, "use_cache", False) is not None:
        return {"use_cache": False}
    return {}


#: Training precisions :func:`trace_model` offers.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trace_model(
    name: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    device: str = "meta",
    steps: int = 3,
    progress: bool = False,
    dtype: str = "float32",
) -> Trace:
    """Record ``steps`` training iterations of a zoo model.

    Args:
        name: a zoo name or ``hf:ConfigClass:k=v,...``.
        batch, seq: batch size and sequence length (image side for vision
            models); default :data:`DEFAULT_BATCH` / :data:`DEFAULT_SEQ`.
        device: "meta" (no memory touched, fast), "cpu" or "cuda".
        steps: iterations to record (the last one is the steady state; the
            first also creates AdamW's state).
        progress: show a rich progress bar.
        dtype: the training precision: "float32" (default, as the papers umrt is
            compared with), or "bfloat16" / "float16" (the whole model and its
            inputs in that dtype: pure half-precision training).
    """
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device not in ("meta", "cpu", "cuda"):
        raise ConfigError(f"device must be meta, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but no CUDA device is available")
    spec = resolve(name)
    batch = spec.default_batch if batch is None else batch
    seq = spec.default_seq if seq is None else seq
    if batch < 1 or seq < 1:
        raise ConfigError(f"batch and seq must be >= 1, got batch={batch} seq={seq}")
    if spec.task == "image-classification" and isinstance(getattr(spec.config, "image_size", None), int):
        spec.config.image_size = seq  # ViT-style models size their position embeddings by it
    torch.manual_seed(0)
    with quiet_transformers():
        try:
            model = build_model(spec, device)
        except (ValueError, TypeError, AttributeError) as exc:  # a config the model rejects
            raise ConfigError(f"cannot build {name}: {exc}") from exc
    model.to(DTYPES[dtype])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    fwd = forward_kwargs(spec)
    meta = {
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "dtype": dtype,
        "task": spec.task,
        "model_class": spec.model_class.__name__,
        **spec.meta,
    }
    rec = Recorder(model, opt, device=device, model_name=name, meta=meta, steer=True)  # meta and CPU agree
    bar = progress_bar(progress, f"tracing {name}", steps)
    with bar as advance, quiet_transformers():
        with rec:
            for _ in range(steps):
                with rec.paused():  # the batch arrives from a loader, off the trace
                    inputs = make_inputs(spec, batch, seq, device)
                    inputs = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in inputs.items()}
                out = model(**inputs, **fwd)
                loss = training_loss(out)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del out, loss, inputs
                advance()
    return rec.trace()


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' config chatter (e.g. the loss_type notice) while tracing."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def progress_bar(show: bool, label: str, total: int):
    """A transient rich progress bar of ``total`` steps; yields ``advance()`` (a no-op if not ``show``)."""
    if not show:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    ) as p:
        task = p.add_task(label, total=total)
        yield lambda: p.advance(task)
