"""The attention's output projection under its architectures' names
(:mod:`vecinfer_compile.hf.output_projection`): calibration weighs errors through it, so ``qaware``'s
default (error-weighted codes) calibrates GPT-NeoX, OPT, Phi, Falcon and GPT-2 as it does Llama-likes,
and a model without one is refused with the fix."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from vecinfer_compile.calibration import calibrate
from vecinfer_compile.hf.output_projection import output_projection_weight
from vecinfer_compile.quant.weighted_codes import value_metric
from vecinfer_compile.simulate import attention_modules
from vecinfer_compile.testing import FixedIds

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, bos_token_id=1, eos_token_id=2)
MODELS = {  # name: (model class, config); 4 heads of 16 dims, the projection's attribute in the comment
    "qwen3": (
        tf.Qwen3ForCausalLM,
        lambda: tf.Qwen3Config(intermediate_size=64, num_key_value_heads=2, head_dim=16, **SIZE),
    ),  # o_proj
    "gpt_neox": (tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(intermediate_size=64, **SIZE)),  # dense
    "phi": (tf.PhiForCausalLM, lambda: tf.PhiConfig(intermediate_size=64, **SIZE)),  # dense
    "falcon": (tf.FalconForCausalLM, lambda: tf.FalconConfig(**SIZE)),  # dense
    "opt": (tf.OPTForCausalLM, lambda: tf.OPTConfig(ffn_dim=64, word_embed_proj_dim=64, **SIZE)),  # out_proj
    "gpt2": (
        tf.GPT2LMHeadModel,
        lambda: tf.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=128, bos_token_id=1, eos_token_id=2),
    ),  # c_proj (Conv1D)
}


IDS = FixedIds(range(3, 67))  # calibrate()'s tokenizer


def _model(name):
    cls, config = MODELS[name]
    torch.manual_seed(0)
    return cls(config()).eval()


def _projection_module(attention, weight):
    """The submodule of ``attention`` that holds ``weight`` (transposed for Conv1D)."""
    return next(
        m
        for m in attention.children()
        if getattr(m, "weight", None) is not None and weight.data_ptr() == m.weight.data_ptr()
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_weight_found_is_the_map_of_the_heads_outputs(name):
    attention = attention_modules(_model(name))[0]
    weight = output_projection_weight(attention, 4, 16)
    assert weight is not None and weight.shape == (64, 64)
    proj = _projection_module(attention, weight)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    bias = proj.bias if getattr(proj, "bias", None) is not None else torch.zeros(64)
    torch.testing.assert_close(proj(x) - bias, x @ weight.T)


@pytest.mark.parametrize("name", ["gpt_neox", "gpt2"])
def test_qaware_default_calibrates_and_weighs_values_through_the_projection(name):
    model = _model(name)
    cb = calibrate(model, IDS, "x", bits=2, method="qaware", seq_len=32, max_tokens=64, iters=2, progress=False)
    attention = attention_modules(model)[0]
    layer = cb.layer(attention.layer_idx)
    expected = value_metric(output_projection_weight(attention, 4, 16), 4, 16)
    torch.testing.assert_close(layer.value_metric.float(), expected)


def test_a_model_without_an_output_projection_is_refused_with_the_fix():
    model = _model("qwen3")
    for attention in attention_modules(model):
        attention.o_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"has none that maps its 4 x 16 head outputs .*--no-weighted-codes"):
        calibrate(model, IDS, "x", bits=2, method="qaware", seq_len=32, max_tokens=64, iters=2, progress=False)
    cb = calibrate(
        model,
        IDS,
        "x",
        bits=2,
        method="qaware",
        weighted_codes=False,
        seq_len=32,
        max_tokens=64,
        iters=2,
        progress=False,
    )
    assert cb.layer(0).value_metric is None
