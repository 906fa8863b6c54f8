"""What VecInfer's attention supports (:mod:`vecinfer_compile.hf.attention_support`): models it cannot
code are refused in one line, by calibration's recorder and by the simulate attention alike,
before anything crashes; configs without a BOS token calibrate; an eager-only model whose
attention modules do not say they are causal (BigBirdPegasus) simulates under its real mask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    BigBirdPegasusConfig,
    BigBirdPegasusForCausalLM,
    BltConfig,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    MambaConfig,
    PegasusConfig,
    PegasusForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vecinfer_compile.calibration import calibrate
from vecinfer_compile.codebooks import model_geometry
from vecinfer_compile.evaluation.outcomes import REFUSED, outcome_of
from vecinfer_compile.hf.attention_support import UNSUPPORTED_KWARGS, check_attention_call
from vecinfer_compile.hf.recording import bos_token_id, collect_kv
from vecinfer_compile.simulate import LayerSimulator, simulation, vecinfer_attention_forward
from vecinfer_compile.testing import FixedIds, random_codebooks

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
REFUSED_MODELS = {  # name: (model class, config, the feature its refusal names)
    "gpt_oss": (
        GptOssForCausalLM,
        lambda: GptOssConfig(
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **COMMON,
        ),
        r"attention sinks \(s_aux\) are not supported by VecInfer's attention: GptOssAttention \(layer 0\)",
    ),
    "gemma2": (
        Gemma2ForCausalLM,
        lambda: Gemma2Config(attn_logit_softcapping=50.0, **COMMON),
        r"attention logit softcapping \(softcap\) is not supported by VecInfer's attention",
    ),
    "deepseek_v3": (
        DeepseekV3ForCausalLM,
        lambda: DeepseekV3Config(
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=2,
            **{**COMMON, "num_key_value_heads": 4},
        ),
        r"DeepseekV3Attention \(layer 0\) has different query/key/value head dims \(32/32/16\); VecInfer attention "
        r"needs one head_dim",
    ),
}


def _build(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


def _ids(n: int = 12) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(1))


def _refusal(exc_info) -> str:
    """The refusal's message, checked to be one the sweep counts as refused (a raise of this package)."""
    assert outcome_of(exc_info.value).status == REFUSED
    return str(exc_info.value)


@pytest.fixture(scope="module", params=sorted(REFUSED_MODELS))
def refused_model(request):
    cls, config, message = REFUSED_MODELS[request.param]
    return _build(cls, config()), message


def test_calibration_refuses_attention_that_needs_more_than_sdpa(refused_model):
    """Sinks, softcapping and MLA's head dims are refused by the recorder on the first attention
    call (before transformers' SDPA refuses softcap, or a codebook fit crashes on the dims)."""
    model, message = refused_model
    with pytest.raises(NotImplementedError) as info:
        calibrate(model, FixedIds(range(3, 35)), "text", bits=2, max_tokens=32, seq_len=32, iters=1, progress=False)
    assert "\n" not in _refusal(info)
    assert info.match(message)


def test_simulation_refuses_attention_that_needs_more_than_sdpa(refused_model):
    model, message = refused_model
    with simulation(model, "vecinfer", bits=2, codebooks=random_codebooks(model.config), residual=4):
        with pytest.raises(NotImplementedError, match=message) as info, torch.no_grad():
            model(input_ids=_ids())
    _refusal(info)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_KWARGS))
def test_each_unsupported_keyword_is_refused_and_none_is_not(name):
    module = SimpleNamespace(layer_idx=3)
    q = k = v = torch.zeros(1, 2, 4, 8)
    check_attention_call(module, q, k, v, {name: None})
    with pytest.raises(NotImplementedError, match=rf"\({name}\) (is|are) not supported .* \(layer 3\)"):
        check_attention_call(module, q, k, v, {name: torch.zeros(2)})


def test_keywords_common_models_pass_are_accepted():
    harmless = dict(
        dropout=0.0,
        scaling=0.25,
        is_causal=True,
        sliding_window=8,
        position_ids=torch.arange(4)[None],
        cu_seq_lens_q=torch.tensor([0, 4]),
        cu_seq_lens_k=torch.tensor([0, 4]),
        max_length_q=4,
        max_length_k=4,
        output_attentions=False,
        use_cache=False,
        s_aux=None,
        softcap=None,
        indices=None,
    )
    check_attention_call(SimpleNamespace(layer_idx=0), *[torch.zeros(1, 2, 4, 8)] * 3, harmless)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            MambaConfig(num_hidden_layers=2, hidden_size=64),
            r"^this model has no attention layers \(MambaConfig has no num_attention_heads\): VecInfer compresses attention K/V",
        ),
        (
            BltConfig(),
            r"^BltConfig has its attention in sub-configs \(patcher_config, encoder_config, decoder_config, "
            r"global_config\), not in one stack of decoder layers: not supported by VecInfer$",
        ),
        (
            Gemma4TextConfig(layer_types=["full_attention"] * 2, per_layer_config={1: {"head_dim": 32}}, **COMMON),
            r"^the layers VecInfer codes have different head_dim \(16 in layer 0, 32 in layer 1\): not supported",
        ),
    ],
    ids=["mamba", "blt", "coded-layers-of-two-head-dims"],
)
def test_geometry_refuses_configs_without_one_attention_geometry(config, message):
    with pytest.raises(ValueError, match=message) as info:
        model_geometry(config)
    _refusal(info)


def test_a_per_layer_attribute_with_one_value_is_that_value():
    config = Gemma4TextConfig(global_head_dim=16, layer_types=["sliding_attention", "full_attention"], **COMMON)
    assert config.is_heterogeneous and model_geometry(config)["head_dim"] == 16


def test_the_geometry_is_the_coded_layers():
    """Gemma 4's sliding layers keep transformers' own cache: their smaller head_dim and other KV
    head count do not make the model's geometry, its full (coded) layers' do."""
    config = Gemma4TextConfig(
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"],
        **COMMON,
    )
    assert [config.per_layer_config[i].head_dim for i in range(2)] == [16, 32]
    geometry = model_geometry(config)
    assert (geometry["head_dim"], geometry["num_kv_heads"], geometry["num_layers"]) == (32, 1, 2)


def test_bos_is_read_where_the_config_keeps_it():
    """A composite config keeps it in its text config; a strict config without one has none."""
    text = Gemma3TextConfig(**COMMON)
    assert bos_token_id(SimpleNamespace(config=Gemma3Config(text_config=text.to_dict()))) == 1
    assert bos_token_id(SimpleNamespace(config=PegasusConfig(), generation_config=SimpleNamespace(bos_token_id=5))) == 5


def test_a_model_without_bos_records_its_tokens_alone():
    config = PegasusConfig(
        vocab_size=128,
        d_model=64,
        decoder_layers=2,
        encoder_layers=2,
        decoder_attention_heads=4,
        encoder_attention_heads=4,
        decoder_ffn_dim=64,
        encoder_ffn_dim=64,
    )
    model = _build(PegasusForCausalLM, config)
    keys, values = collect_kv(model, torch.arange(3, 23), seq_len=10, progress=False)
    assert sorted(keys) == [0, 1] and keys[0].shape == values[0].shape == (4, 20, 16)


def test_an_eager_only_model_simulates_under_its_real_mask():
    """BigBirdPegasus's decoder self-attention says is_causal=False (transformers runs it eager only):
    with SDPA's skipped causal mask it would attend to later tokens. Every key in the window: eager."""
    config = BigBirdPegasusConfig(
        vocab_size=128,
        d_model=64,
        decoder_layers=2,
        encoder_layers=2,
        decoder_attention_heads=4,
        encoder_attention_heads=4,
        decoder_ffn_dim=64,
        encoder_ffn_dim=64,
        attention_type="original_full",
        is_decoder=True,
    )
    model, ids = _build(BigBirdPegasusForCausalLM, config), _ids(16)
    with torch.no_grad():
        eager = model(input_ids=ids, use_cache=False).logits
        with simulation(model, "vecinfer", bits=2, codebooks=random_codebooks(model.config), residual=16):
            simulated = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(simulated, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "bool-mask"])
def test_simulation_adds_a_position_bias_as_sdpa_does(masked):
    """A T5-style relative bias reaches the scores (every key in the window: SDPA's output)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 2, 6, 6, generator=g)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril() if masked else None
    if masked:
        mask[..., 2:, 0] = False  # the later queries skip the first key
    module = SimpleNamespace(
        layer_idx=0, is_causal=True, training=False, vecinfer_simulator=LayerSimulator("kivi", 2, residual=6)
    )
    got, _ = vecinfer_attention_forward(module, q, k, v, mask, position_bias=bias)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, position_bias=bias)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, vecinfer_attention_forward(module, q, k, v, mask)[0])
