"""Eager simulate mode (attn_implementation="vecinfer") and calibration on real models."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import vecinfer_compile as vc
from vecinfer_compile.simulate import simulated_attention
from vecinfer_compile.testing import random_codebooks as make_codebooks

CONFIG = LlamaConfig(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=128,
    attn_implementation="sdpa",
)


@pytest.fixture(scope="module")
def random_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _explicit(q, k, v, kh, vh, residual):
    """float64, loops over (i, j): the window rule written out literally (causal, Tq == Tk)."""
    b, hq, t, d = q.shape
    rep = hq // k.shape[1]
    out = torch.zeros(b, hq, t, d, dtype=torch.float64)
    for h in range(hq):
        kv = h // rep
        for i in range(t):
            js = range(i + 1)
            keys = torch.stack([k[:, kv, j] if i - j < residual else kh[:, kv, j] for j in js], 1)
            vals = torch.stack([v[:, kv, j] if i - j < residual else vh[:, kv, j] for j in js], 1)
            p = torch.softmax((keys.double() @ q[:, h, i].double()[..., None])[..., 0] / d**0.5, -1)
            out[:, h, i] = (p[..., None] * vals.double()).sum(1)
    return out


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 12), residual=st.integers(0, 14), rep=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_window_semantics_match_the_literal_rule(t, residual, rep, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2 * rep, t, 8, generator=g)
    k, v, kh, vh = (torch.randn(2, 2, t, 8, generator=g) for _ in range(4))
    got = simulated_attention(q, k, v, kh, vh, None, t > 1, 8**-0.5, residual)
    torch.testing.assert_close(got.double(), _explicit(q, k, v, kh, vh, residual), atol=1e-5, rtol=1e-5)


def test_window_covering_everything_is_full_precision(random_llama):
    ids = torch.randint(0, 128, (2, 19))
    fp = _logits(random_llama, ids)
    try:
        vc.enable_simulation(random_llama, "vecinfer", bits=2, codebooks=make_codebooks(CONFIG), residual=19)
        torch.testing.assert_close(_logits(random_llama, ids), fp, atol=1e-5, rtol=1e-5)
        vc.enable_simulation(random_llama, "vecinfer", bits=2, codebooks=make_codebooks(CONFIG), residual=0)
        assert (_logits(random_llama, ids) - fp).abs().max() > 1e-3
    finally:
        vc.disable_simulation(random_llama)


def test_full_precision_prefill(random_llama):
    ids = torch.randint(0, 128, (1, 9))
    fp = _logits(random_llama, ids)
    try:
        vc.enable_simulation(random_llama, "kivi", bits=2, full_precision_prefill=True)
        torch.testing.assert_close(_logits(random_llama, ids), fp)
    finally:
        vc.disable_simulation(random_llama)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_simulation_block_restores_the_models_attention(impl):
    """After ``with simulation(...)`` (or disable_simulation) the model attends as it did before:
    a model loaded with attn_implementation="eager" used to come out on "sdpa"."""
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG.to_dict(), "attn_implementation": impl})).eval()
    cb = make_codebooks(model.config, 2.0)
    with vc.simulation(model, "vecinfer", bits=2, codebooks=cb):
        assert model.config._attn_implementation == "vecinfer"
        vc.enable_simulation(model, "vecinfer", bits=2, codebooks=cb, residual=4)  # re-enabled inside
    assert model.config._attn_implementation == impl
    vc.enable_simulation(model, "kivi", bits=2)
    vc.disable_simulation(model)
    assert model.config._attn_implementation == impl


def test_simulation_errors(random_llama):
    with pytest.raises(ValueError, match="needs codebooks"):
        vc.enable_simulation(random_llama, "vecinfer", bits=2)
    with pytest.raises(ValueError, match="unknown method"):
        vc.enable_simulation(random_llama, "gptq", bits=2)
    with pytest.raises(ValueError, match="KIVI runs at 2 or 4 bits"):
        vc.enable_simulation(random_llama, "kivi", bits=3)
    with pytest.raises(ValueError, match="for 2 bits, not 1.5"):
        vc.enable_simulation(random_llama, "vecinfer", bits=1.5, codebooks=make_codebooks(CONFIG))
    random_llama.set_attn_implementation("vecinfer")
    try:
        with pytest.raises(RuntimeError, match="enable_simulation"):
            _logits(random_llama, torch.randint(0, 128, (1, 4)))
    finally:
        random_llama.set_attn_implementation("sdpa")


def test_calibrate_tiny_model(tiny_model, sample_text_path, tmp_path):
    model, tok = tiny_model
    text = sample_text_path.read_text()[:20000]
    cb = vc.calibrate(model, tok, text, bits=2, max_tokens=1024, seq_len=256, iters=5, progress=False)
    geo = cb.geometry
    assert len(cb.layers) == geo["num_layers"] == model.config.num_hidden_layers
    assert cb.layer(0).keys.shape == (256, 4)
    lam = cb.layer(0).transform.lam
    assert lam.shape == (geo["num_kv_heads"], geo["head_dim"]) and (lam > 0).all()
    assert cb.metadata["calibration_tokens"] == 1024
    back = vc.load_codebooks(cb.save(tmp_path / "cb.safetensors"))
    ids = tok(text[:3000], return_tensors="pt")["input_ids"][:, :128]
    fp = _logits(model, ids)
    try:
        vc.enable_simulation(model, "vecinfer", bits=2, codebooks=back)
        sim = _logits(model, ids)
    finally:
        vc.disable_simulation(model)
    # Quantized, yet close: calibrated 2-bit codebooks keep the argmax mostly intact.
    assert (sim - fp).abs().max() > 0
    assert (sim.argmax(-1) == fp.argmax(-1)).float().mean() > 0.7


def test_calibration_rejects_nan_activations(tiny_model):
    model, tok = tiny_model
    weight = model.model.layers[0].self_attn.k_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0, 0] = float("nan")
        with pytest.raises(ValueError, match="NaN or inf"):
            vc.calibrate(model, tok, "some text " * 50, bits=2, max_tokens=128, progress=False)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_calibration_needs_a_vq_method(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ValueError, match="needs no calibration"):
        vc.calibrate(model, tok, "text", bits=2, method="kivi")
