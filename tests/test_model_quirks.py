"""VecInferCache, the simulate path and the backend on models that do something unusual with their
K/V or layers (the architecture sweep's crashes, docs/architectures.md): models that rearrange or
compute with the cached K/V before attention (DiffLlama, Doge, JetMoE), read a cache layer's K
directly (Mllama), share one layer's K/V with later layers (Gemma 3n, Gemma 4), put attention and a
state-space mixer in one layer (Falcon-H1), pass a position bias (T5-style), or break the graph
inside a decoder layer (DBRX, X-MOD). Tiny explicit configs; the oracle is the eager simulate path
with the cache's semantics, or the cache's own dequantized read."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    DogeConfig,
    DogeForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    InklingTextConfig,
    JetMoeConfig,
    JetMoeForCausalLM,
    MllamaForCausalLM,
    MllamaTextConfig,
)
from transformers.cache_utils import DummyLayer

from vecinfer_compile.backend import vecinfer_backend
from vecinfer_compile.cache import VecInferCache, VecInferHybridLayer, VecInferLayer
from vecinfer_compile.hf import attention_over_codes
from vecinfer_compile.hf.compat import cache_kwargs, forward_cache_kwargs
from vecinfer_compile.hf.layer_kinds import coded_layers, kv_producers
from vecinfer_compile.simulate import simulation
from vecinfer_compile.testing import cache_layer, random_codebooks, random_layer_codebooks

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPT, NEW, RESIDUAL = 12, 4, 4


def build(cls, config):
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def prompt() -> torch.Tensor:
    return torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def greedy(model, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy new tokens of :func:`prompt` and each step's logits."""
    ids = prompt()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
    return out.sequences[0, PROMPT:].tolist(), [step[0] for step in out.logits]


def through_cache(model, codebooks, *, implementation: str | None = None):
    """:func:`greedy` through a VecInferCache (eager); ``implementation``: the attention to run
    after the cache switched the model to ``vecinfer_sdpa`` (``"sdpa"``: the dequantized read)."""
    cache = VecInferCache(model, codebooks, max_cache_len=PROMPT + NEW, residual=RESIDUAL)
    if implementation is not None:
        model.set_attn_implementation(implementation)
    try:
        return greedy(model, **cache_kwargs(cache), disable_compile=True)
    finally:
        model.set_attn_implementation("sdpa")


def through_simulation(model, codebooks, method: str = "vecinfer"):
    """:func:`greedy` on the simulate path with the cache's semantics."""
    with simulation(model, method, bits=2, codebooks=codebooks, residual=RESIDUAL, full_precision_prefill=True):
        return greedy(model)


def assert_same(got, want):
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def layer_with_tokens(tokens: int = 10, heads: int = 2, dim: int = 16) -> VecInferLayer:
    """A coded layer (4-slot window) holding ``tokens`` random tokens, whose model attends with
    ``vecinfer_sdpa`` (its updates return codes reads)."""
    layer = cache_layer(
        random_layer_codebooks(heads, dim, seed=0), num_kv_heads=heads, head_dim=dim, max_cache_len=24, residual=4
    )
    layer.model_config = mock.Mock(_attn_implementation=attention_over_codes.ATTN_NAME)
    layer.update(torch.randn(1, heads, tokens, dim), torch.randn(1, heads, tokens, dim))
    return layer


# -- codes reads: metadata free, any other op reads the layer ------------------------------------
def test_a_codes_read_answers_metadata_and_is_dequantized_for_any_other_op():
    """Shape and size questions read nothing; splitting the values (DiffLlama) gets the layer's
    dequantized V, read once for K and V together."""
    torch.manual_seed(0)
    layer = layer_with_tokens()
    k, v = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    want_k, want_v = layer.dequantized()
    with mock.patch.object(VecInferLayer, "dense_read", autospec=True, side_effect=VecInferLayer.dense_read) as read:
        assert k.shape == (1, 2, 24, 16) and v.numel() == 2 * 24 * 16 and k.dim() == 4 and read.call_count == 0
        halves = torch.chunk(v, 2, dim=1)
        doubled = k.repeat(1, 2, 1, 1)
    assert read.call_count == 1
    assert type(halves[0]) is torch.Tensor
    torch.testing.assert_close(torch.cat(halves, dim=1), want_v)
    torch.testing.assert_close(doubled, want_k.repeat(1, 2, 1, 1))


def test_a_chunks_codes_read_is_dequantized_by_the_chunk_rule():
    """A chunk's read, dequantized: the coded slots before the chunk, then the old window and the
    chunk's own K/V in full precision (what the dense path of a model on plain SDPA gets)."""
    torch.manual_seed(0)
    layer = layer_with_tokens(tokens=10)
    n_coded = int(layer.storage.n_coded)
    before_k, before_v = layer.dequantized()
    k_new, v_new = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    k, v = layer.update(k_new, v_new)
    got_k, got_v = attention_over_codes.dense(k), attention_over_codes.dense(v)
    torch.testing.assert_close(got_k[:, :, :10], before_k[:, :, :10], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v[:, :, :10], before_v[:, :, :10])
    torch.testing.assert_close(got_k[:, :, 10:13], k_new, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_v[:, :, 10:13], v_new)
    assert n_coded == 6 and not got_v[:, :, 13:].any()


def test_a_position_bias_attends_over_the_dequantized_read():
    """A T5-style position_bias (Inkling) is added to the scores as transformers' SDPA adds it."""
    torch.manual_seed(0)
    layer = layer_with_tokens()
    k, v = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    q, bias = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 24)
    mask = torch.arange(24)[None, None, None, :] < 11
    module = mock.Mock(num_key_value_groups=2, is_causal=True)
    got, _ = attention_over_codes.codes_attention_forward(module, q, k, v, mask, position_bias=bias)
    dk, dv = (t.repeat_interleave(2, dim=1) for t in layer.dequantized())
    want = F.scaled_dot_product_attention(q, dk, dv, attn_mask=bias.masked_fill(~mask, torch.finfo(q.dtype).min))
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


# -- models that rearrange or compute with the cached K/V -----------------------------------------
def test_diffllama_split_values_equal_the_simulate_path():
    """DiffLlama splits the cached V into two halves for two attention calls."""
    model = build(DiffLlamaForCausalLM, DiffLlamaConfig(**COMMON))
    cb = random_codebooks(model.config)
    assert_same(through_cache(model, cb), through_simulation(model, cb))


def test_doge_value_dependent_mask_reads_the_dequantized_values():
    """Doge builds its attention bias from the cached V: eagerly over codes it gets the layer's
    dequantized V, as the dequantized path does (finite logits, not the stand-ins' NaN)."""
    model = build(DogeForCausalLM, DogeConfig(**{**COMMON, "num_key_value_heads": 4}))
    for layer in model.model.layers:  # a bias that depends on V (the random init leaves A = 0)
        layer.self_attn.A.data.fill_(0.5)
    cb = random_codebooks(model.config)
    got = through_cache(model, cb)
    assert all(step.isfinite().all() for step in got[1])
    assert_same(got, through_cache(model, cb, implementation="sdpa"))


def test_jetmoe_repeated_heads_refuse_a_per_head_transform_and_run_without_one():
    """JetMoE repeats the cached K/V per expert after the cache: codebooks calibrated on the
    repeated heads (4 here, lam per head) cannot serve its 2 cached heads (one clear line); codes
    without a per-head transform ('vq') equal the simulate path."""
    config = JetMoeConfig(**{**COMMON, "kv_channels": 16, "num_local_experts": 4, "num_experts_per_tok": 2})
    model = build(JetMoeForCausalLM, config)
    per_head = random_codebooks(model.config)
    per_head.layers = [random_layer_codebooks(4, 16, seed=i) for i in range(2)]
    with pytest.raises(ValueError, match=r"lam is for 4 KV heads but the model caches 2.*method='vq'"):
        VecInferCache(model, per_head, max_cache_len=PROMPT + NEW, residual=RESIDUAL)
    cb = random_codebooks(model.config, method="vq")
    assert_same(through_cache(model, cb), through_simulation(model, cb, "vq"))


def test_mllama_reads_a_cache_layers_keys():
    """Mllama asks every cache layer whether it holds anything (``layer.keys.numel()``)."""
    config = MllamaTextConfig(**{k: v for k, v in COMMON.items() if k != "head_dim"}, cross_attention_layers=[1])
    model = build(MllamaForCausalLM, config)
    cb = random_codebooks(model.config)
    cache = VecInferCache(model, cb, max_cache_len=PROMPT + NEW, residual=RESIDUAL)
    assert cache.layers[0].keys is None
    assert_same(through_cache(model, cb), through_simulation(model, cb))


# -- layers that share K/V, hybrid layers ----------------------------------------------------------
def gemma3n():
    config = Gemma3nTextConfig(
        **{**COMMON, "num_hidden_layers": 4},
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128,
        laurel_rank=8,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4,
    )
    return build(Gemma3nForCausalLM, config)


def test_kv_shared_layers_store_nothing_and_read_their_producers_codes():
    """Gemma 3n's last layers reuse the K/V of the last earlier layer of their kind: they hold
    nothing in the cache, and with their producer's codebooks (what they quantize) the cache
    equals the simulate path."""
    model = gemma3n()
    assert kv_producers(model.config) == [0, 1, 0, 1] and coded_layers(model.config) == [False, True, False, True]
    cb = random_codebooks(model.config)
    assert cb.layers[2] is cb.layers[0] and cb.layers[3] is cb.layers[1]  # as calibrate() gives them
    cache = VecInferCache(model, cb, max_cache_len=PROMPT + NEW, residual=RESIDUAL)
    assert [type(layer) for layer in cache.layers[1:]] == [VecInferLayer, DummyLayer, DummyLayer]
    assert_same(through_cache(model, cb), through_simulation(model, cb))


def test_gemma4_kv_shared_layers_of_a_prefill_read_the_prompt_in_full_precision():
    """Under generate() Gemma 4 gives its KV-shared layers only the prompt's last query (over the
    whole prompt's K/V from their producer): that call is still the prefill, which the cache reads
    in full precision, so the simulate path must too (it took one query for a decode step, and the
    first token's logits differed). Full layers of their own head_dim and KV heads, values from the
    key projection."""
    if not hasattr(transformers, "Gemma4ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    config = transformers.Gemma4TextConfig(
        **{**COMMON, "num_hidden_layers": 4},
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        num_kv_shared_layers=2,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
    )
    model = build(transformers.Gemma4ForCausalLM, config)
    assert kv_producers(model.config) == [0, 1, 0, 1] and coded_layers(model.config) == [False, True, False, True]
    cb = random_codebooks(model.config)
    plain = greedy(model)
    simulated = through_simulation(model, cb)
    torch.testing.assert_close(simulated[1][0], plain[1][0])  # the prefill: full precision
    assert_same(through_cache(model, cb), simulated)


def test_hybrid_layers_hold_codes_beside_the_mixer_state():
    """Falcon-H1's layers put attention beside a Mamba mixer: the attention is coded, the conv and
    recurrent states kept (and counted), and generate equals the simulate path."""
    config = FalconH1Config(
        **COMMON,
        mamba_d_ssm=128,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_chunk_size=16,
    )
    model = build(FalconH1ForCausalLM, config)
    cb = random_codebooks(model.config)
    cache = VecInferCache(model, cb, batch_size=1, max_cache_len=PROMPT + NEW, residual=RESIDUAL)
    assert all(isinstance(layer, VecInferHybridLayer) for layer in cache.layers)
    with torch.no_grad():
        model(prompt(), **forward_cache_kwargs(model, cache), use_cache=True)
    mixer = sum(
        t.nbytes
        for layer in cache.layers
        for states in (layer.conv_states, layer.recurrent_states)
        for t in states.values()
    )
    coded = sum(t.nbytes for t in {t.data_ptr(): t for layer in cache.layers for t in layer.static_tensors()}.values())
    assert mixer > 0 and cache.kv_bytes() == coded + mixer
    assert not cache.is_croppable  # so generate() never defers its stop check over it
    with pytest.raises(NotImplementedError, match="mixer state cannot be rolled back"):
        cache.layers[0].crop(-1)
    assert_same(through_cache(model, cb), through_simulation(model, cb))


def test_sliding_hybrid_layers_that_generate_masks_as_full_are_refused():
    """transformers 5.24's generate() gives Inkling's hybrid_sliding layers a full causal mask as
    long as any static cache (its own StaticCache fails on it): one clear line instead of a crash
    inside transformers' SDPA. transformers 5.25 maps them to the sliding-window mask: the cache
    then takes the model."""
    from transformers import masking_utils

    config = InklingTextConfig(**COMMON, layer_types=["hybrid_sliding", "hybrid"], sliding_window=8)
    table = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    if table.get("hybrid_sliding", {}).get("sliding_attention") is masking_utils.create_causal_mask:
        with pytest.raises(NotImplementedError, match="hybrid_sliding layers as full attention"):
            VecInferCache(config, random_codebooks(config), max_cache_len=PROMPT + NEW, residual=RESIDUAL)
    else:
        assert table["hybrid_sliding"]["sliding_attention"] is masking_utils.create_sliding_window_causal_mask
        cache = VecInferCache(config, random_codebooks(config), max_cache_len=PROMPT + NEW, residual=RESIDUAL)
        assert len(cache.layers) == 2


# -- the backend: a graph break inside a decoder layer --------------------------------------------
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x):  # x: [B, T, 16] -> one head of dim 16
        torch._dynamo.graph_break()  # the rest of the block compiles on its own, rooted at the block
        q, k, v = self.proj(x)[:, None].chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]


def test_a_graph_break_inside_a_decoder_layer_is_refused():
    """Dynamo compiles the block's code after the break once and runs it for both blocks (DBRX,
    X-MOD): one layer's codebooks would serve every layer, so the backend refuses, naming the fix."""
    model = torch.nn.Sequential(Block(), Block()).eval()
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="has no layer index: a graph break inside a decoder layer"):
            torch.compile(model, backend=vecinfer_backend.configure(quantize=False))(torch.randn(1, 5, 16))
    finally:
        torch._dynamo.reset()
