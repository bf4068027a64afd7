"""Model zoo: names, hf: configs, defaults, and a training step per model family."""

from __future__ import annotations

import pytest

from umrt import zoo
from umrt.errors import ConfigError
from umrt.trace.events import Launch
from umrt.trace.stats import summarize


def test_defaults_cover_every_model():
    assert set(zoo.DEFAULT_BATCH) == set(zoo.DEFAULT_SEQ) == set(zoo.MODELS)
    assert (zoo.DEFAULT_BATCH["gpt2-xl"], zoo.DEFAULT_SEQ["gpt2-xl"]) == (8, 1024)


@pytest.mark.parametrize(
    "name, attrs",
    [
        ("gpt2-medium", dict(n_embd=1024, n_layer=24, n_head=16)),
        ("gpt2-large", dict(n_embd=1280, n_layer=36, n_head=20)),
        ("gpt2-xl", dict(n_embd=1600, n_layer=48, n_head=25)),
        (
            "bert-large",
            dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
        ),
        ("vit-large", dict(hidden_size=1024, num_hidden_layers=24, image_size=224, patch_size=16)),
        ("resnet-152", dict(depths=[3, 8, 36, 3], layer_type="bottleneck")),
    ],
)
def test_builtin_configs(name, attrs):
    spec = zoo.resolve(name)
    for k, v in attrs.items():
        assert getattr(spec.config, k) == v


def test_hf_name_parsing():
    spec = zoo.resolve(
        "hf:LlamaConfig:num_hidden_layers=3,hidden_size=64,rms_norm_eps=1e-5,tie_word_embeddings=true"
    )
    assert spec.config.num_hidden_layers == 3 and spec.config.hidden_size == 64
    assert spec.config.rms_norm_eps == 1e-5 and spec.config.tie_word_embeddings is True
    assert spec.task == "causal-lm" and spec.model_class.__name__ == "LlamaForCausalLM"
    assert zoo.resolve("hf:BertConfig").task == "causal-lm"  # BertLMHeadModel is in the causal-LM mapping


@pytest.mark.parametrize(
    "name, match",
    [
        ("nosuchmodel", "unknown model"),
        ("hf:", "expected hf:ConfigClass"),
        ("hf:NoSuchConfig", "unknown transformers config"),
        ("hf:GPT2Config:n_layer", "expected key=value"),
        ("hf:GPT2Config:n_embd=65,n_head=4", "cannot build"),
    ],
)
def test_bad_names(name, match):
    with pytest.raises(ConfigError, match=match):
        zoo.trace_model(name, batch=1, seq=8, steps=1)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="steps"):
        zoo.trace_model("gpt2", steps=0)
    with pytest.raises(ConfigError, match="device"):
        zoo.trace_model("gpt2", device="tpu")
    with pytest.raises(ConfigError, match="batch"):
        zoo.trace_model("gpt2", batch=0)
    with pytest.raises(ConfigError, match="dtype"):
        zoo.trace_model("gpt2", dtype="float8")


def test_dtype_sets_the_training_precision():
    """float32 (default): matmuls on CUDA cores; bfloat16: the whole model in it."""
    name = "hf:GPT2Config:n_layer=1,n_embd=32,n_head=2,vocab_size=128,n_positions=32"
    f32 = zoo.trace_model(name, batch=2, seq=16, steps=2)
    b16 = zoo.trace_model(name, batch=2, seq=16, steps=2, dtype="bfloat16")
    assert f32.header.meta["dtype"] == "float32" and b16.header.meta["dtype"] == "bfloat16"
    mm32 = {e.precision for e in f32.launches() if e.op == "aten::addmm.default"}
    mm16 = {e.precision for e in b16.launches() if e.op == "aten::addmm.default"}
    assert mm32 == {"fp32"} and mm16 == {"bf16"}
    assert next(iter(summarize(b16)["flops_by_precision"])) == "bf16"  # the largest share first
    assert set(summarize(f32)["flops_by_precision"]) <= {"fp32", "tf32"}
    p32 = summarize(f32)["bytes_by_kind"]["parameter"]
    assert summarize(b16)["bytes_by_kind"]["parameter"] * 2 == p32


@pytest.mark.parametrize(
    "name, batch, seq, expect_op",
    [
        (
            "hf:BertConfig:num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,vocab_size=128",
            2,
            16,
            "aten::_scaled_dot_product_flash_attention.default",
        ),
        (
            "hf:ViTConfig:num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,patch_size=8",
            2,
            32,
            "aten::convolution.default",
        ),
        (
            "hf:ResNetConfig:depths=[1,1],hidden_sizes=[16,32],embedding_size=8,layer_type='bottleneck'",
            2,
            32,
            "aten::convolution_backward.default",
        ),
        ("hf:T5Config:num_layers=1,d_model=32,d_ff=64,num_heads=2,vocab_size=128", 2, 8, "aten::mm.default"),
    ],
)
def test_model_families_train(name, batch, seq, expect_op):
    tr = zoo.trace_model(name, batch=batch, seq=seq, steps=2)
    s = summarize(tr)
    assert s["iterations"] == 2
    ops = {e.op for e in tr.launches()}
    assert expect_op in ops
    assert any(op.startswith("aten::_foreach_") for op in ops)  # AdamW foreach
    params = s["bytes_by_kind"]["parameter"]
    assert params > 0 and s["bytes_by_kind"]["optimizer_state"] == 2 * params
    assert s["flops_per_iteration"] > 0
    assert tr.header.meta["batch"] == batch


def test_progress_bar_runs():
    tr = zoo.trace_model(
        "hf:GPT2Config:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=16",
        batch=1,
        seq=4,
        steps=1,
        progress=True,
    )
    assert tr.header.iterations == 1 and any(isinstance(e, Launch) for e in tr.events)
