"""Keys quantized before RoPE with values predicted from them (methods ``prerope`` and
``prerope-keys``): the rotation against transformers' own RoPE, the transform's round trip, the
value prediction's fit, the eager simulate against an oracle built from transformers' functions,
calibration and the artifact, and the clear refusals of the paths that do not have it yet."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from vecinfer_compile.calibration import calibrate
from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.evaluation.generation import method_note
from vecinfer_compile.quant.codebook import quantize_dequantize
from vecinfer_compile.quant.hadamard import hadamard_matrix
from vecinfer_compile.quant.rope import model_rope_frequencies, rotate
from vecinfer_compile.quant.transform import KeyTransform
from vecinfer_compile.quant.value_prediction import fit_value_predictor
from vecinfer_compile.simulate import LayerSimulator, key_positions, simulation
from vecinfer_compile.testing import FixedIds, random_codebooks, tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_cache import tiny_config  # noqa: E402
from test_qaware import _rewrite  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = tiny_config()


def _hf_cos_sin(head_dim: int, positions: torch.Tensor, theta: float = 10000.0):
    """transformers' own cos/sin ``[B, T, D]`` for Llama's default RoPE at ``positions: [B, T]``."""
    config = tiny_config(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta})
    emb = LlamaRotaryEmbedding(config)
    return emb(torch.zeros(1, dtype=torch.float64), positions), emb.inv_freq


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 9),
    head_dim=st.sampled_from([8, 16, 64]),
    start=st.integers(0, 5000),
    theta=st.sampled_from([10000.0, 500000.0]),
    seed=st.integers(0, 2**16),
)
def test_rotation_is_transformers_rope_and_its_inverse_undoes_it(b, t, head_dim, start, theta, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = start + torch.randint(0, 3, (b, t), generator=gen).cumsum(-1)  # per-row, gaps allowed
    (cos, sin), inv_freq = _hf_cos_sin(head_dim, positions, theta)
    x = torch.randn(b, 2, t, head_dim, generator=gen, dtype=torch.float64)
    expected, _ = apply_rotary_pos_emb(x, x, cos.double(), sin.double())
    ours = rotate(x, inv_freq, positions)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)  # float32 angles, as transformers'
    torch.testing.assert_close(rotate(ours, inv_freq, positions, inverse=True), x, atol=1e-12, rtol=1e-12)


def test_partial_rotary_leaves_the_other_channels_and_one_row_of_positions_serves_every_row():
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    inv_freq = 10000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float32) / 8)  # 8 of 16 channels rotate
    pos = torch.arange(5)
    out = rotate(x, inv_freq, pos)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], rotate(x[..., :8], inv_freq, pos))
    torch.testing.assert_close(rotate(x, inv_freq, pos[None].expand(2, 5)), out)
    with pytest.raises(ValueError, match="do not fit"):
        rotate(x, inv_freq, torch.arange(4))


@settings(max_examples=25, deadline=None)
@given(hkv=st.integers(1, 3), t=st.integers(1, 8), rotate_=st.booleans(), seed=st.integers(0, 2**16))
def test_pre_rope_transform_round_trips_and_has_no_query_side(hkv, t, rotate_, seed):
    gen = torch.Generator().manual_seed(seed)
    d = 16
    transform = KeyTransform(
        d,
        0.5 + torch.rand(hkv, d, generator=gen, dtype=torch.float64),
        rotate_,
        mean=torch.randn(hkv, d, generator=gen, dtype=torch.float64),
        rope_inv_freq=10000.0 ** -(torch.arange(0, d, 2, dtype=torch.float32) / d),
    )
    k = 5 * torch.randn(2, hkv, t, d, generator=gen, dtype=torch.float64)
    pos = torch.arange(t) + 100
    torch.testing.assert_close(transform.keys_inverse(transform.keys(k, pos), pos), k)
    with pytest.raises(ValueError, match="need their positions"):
        transform.keys(k)
    with pytest.raises(ValueError, match="no query-side transform"):
        transform.queries(torch.randn(1, hkv, 1, d))


def test_value_predictor_recovers_a_linear_map_and_never_raises_the_residual():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 400, 8, generator=gen)
    w, c = torch.randn(2, 8, 8, generator=gen), torch.randn(2, 8, generator=gen)
    exact = fit_value_predictor(keys, keys @ w + c[:, None], ridge=0.0)
    torch.testing.assert_close(exact.matrix, w, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(exact.bias, c, atol=1e-4, rtol=1e-4)
    values = 0.5 * (keys @ w) + torch.randn(2, 400, 8, generator=gen)  # partly predictable
    fitted = fit_value_predictor(keys, values)
    residual = values - fitted(keys[None])[0]
    centred = values - values.mean(1, keepdim=True)
    assert (residual.pow(2).sum((1, 2)) < 0.5 * centred.pow(2).sum((1, 2))).all()
    with pytest.raises(ValueError, match="one shape"):
        fit_value_predictor(keys, values[:, :10])


def test_key_positions_follow_the_queries_position_ids():
    assert torch.equal(key_positions(None, 4, "cpu"), torch.arange(4))
    left_padded = torch.tensor([[7], [4]])  # the decode step of two rows, the second padded by 3
    assert torch.equal(
        key_positions(left_padded, 8, "cpu"), torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [-3, -2, -1, 0, 1, 2, 3, 4]])
    )
    with pytest.raises(ValueError, match="multimodal RoPE"):
        key_positions(torch.zeros(3, 1, 4, dtype=torch.long), 4, "cpu")


@pytest.mark.parametrize("method", ["prerope", "prerope-keys"])
@pytest.mark.parametrize("kv_heads, head_dim", [(4, 16), (2, 64), (1, 128)])  # MHA, GQA, MQA of 4 query heads
def test_simulate_is_the_oracle_built_from_transformers_rope(method, kv_heads, head_dim):
    """The eager simulate's ``(k_hat, v_hat)`` equal an oracle that undoes RoPE with transformers'
    own cos/sin (``apply_rotary_pos_emb`` with ``-sin``), quantizes ``((K - mu) / lam) H``, and
    predicts values from the dequantized code-domain keys."""
    cb = random_codebooks(tiny_config(num_key_value_heads=kv_heads, head_dim=head_dim), 2.0, method, seed=3)
    layer = cb.layer(1)
    t = layer.transform
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [-2, -1, 0, 1, 2, 3]])  # the second row left-padded by 2
    (cos, sin), inv_freq = _hf_cos_sin(head_dim, positions)
    assert torch.equal(inv_freq, t.rope_inv_freq)
    gen = torch.Generator().manual_seed(1)
    k, v = (3 * torch.randn(2, kv_heads, 6, head_dim, generator=gen) for _ in range(2))
    k_pre, _ = apply_rotary_pos_emb(k, k, cos.float(), -sin.float())
    h = hadamard_matrix(head_dim, torch.float32, "cpu")
    kt = ((k_pre - t.mean[None, :, None]) / t.lam[None, :, None]) @ h
    kt_hat = quantize_dequantize(kt, layer.keys)
    k_pre_hat = (kt_hat @ h.T) * t.lam[None, :, None] + t.mean[None, :, None]
    k_expected, _ = apply_rotary_pos_emb(k_pre_hat, k_pre_hat, cos.float(), sin.float())
    if layer.value_predictor is None:
        v_expected = quantize_dequantize(v, layer.values)
    else:
        pred = kt_hat @ layer.value_predictor.matrix + layer.value_predictor.bias[None, :, None]
        v_expected = pred + quantize_dequantize(v - pred, layer.values)
    sim = LayerSimulator(method, 2.0, 0, cb, layer_idx=1)
    k_hat, v_hat = sim.quantize_kv(k, v, positions[:, -1:])
    torch.testing.assert_close(k_hat, k_expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_hat, v_expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def calibrated(tiny_model, sample_text_path):
    model, tok = tiny_model
    return calibrate(
        model,
        tok,
        sample_text_path.read_text(),
        bits=2,
        method="prerope",
        max_tokens=1024,
        seq_len=256,
        iters=3,
        progress=False,
    )


def test_calibration_stores_the_models_rope_and_a_predictor_that_helps(calibrated, tiny_model, sample_text_path):
    """The file holds the model's own RoPE frequencies and a value predictor, round-trips, and the
    predictor explains part of the values it was fitted to (keys and values are two projections of
    one hidden state)."""
    from vecinfer_compile.calibration import calibration_token_ids
    from vecinfer_compile.hf.recording import collect_kv, recorded_positions

    model, tok = tiny_model
    head_dim = calibrated.head_dim
    layer = calibrated.layer(0)
    assert torch.equal(layer.transform.rope_inv_freq, model_rope_frequencies(model, head_dim))
    ids = calibration_token_ids(tok, sample_text_path.read_text(), 1024)
    keys, values = collect_kv(model, ids, 256, progress=False)
    pos = recorded_positions(model, ids, 256)
    assert pos.shape[0] == keys[0].shape[1]
    kt_hat = quantize_dequantize(layer.transform.keys(keys[0][None], pos), layer.keys)
    residual = values[0] - layer.value_predictor(kt_hat)[0]
    centred = values[0] - values[0].mean(1, keepdim=True)
    assert residual.pow(2).sum() < 0.9 * centred.pow(2).sum()
    assert "value predictors" in calibrated.state_bytes() and "RoPE frequencies" in calibrated.state_bytes()


def test_the_artifact_round_trips_and_names_missing_state(calibrated, tmp_path):
    path = calibrated.save(tmp_path / "cb.safetensors")
    back = load_codebooks(path)
    for a, b in zip(calibrated.layers, back.layers):
        assert torch.equal(a.value_predictor.matrix, b.value_predictor.matrix)
        assert torch.equal(a.value_predictor.bias, b.value_predictor.bias)
        assert torch.equal(a.transform.rope_inv_freq, b.transform.rope_inv_freq)
    with pytest.raises(ValueError, match=r"needs tensor 'value_matrix'.*--method prerope"):
        load_codebooks(_rewrite(path, tmp_path, drop=("value_matrix",)))
    with pytest.raises(ValueError, match=r"takes no 'value_bias'"):
        load_codebooks(_rewrite(path, tmp_path, meta={"method": "prerope-keys"}, drop=("value_matrix",)))


def test_simulation_runs_the_model_and_quantizes(calibrated, tiny_model):
    model, _ = tiny_model
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(ids).logits
        with simulation(model, "prerope", bits=2, codebooks=calibrated):
            quantized = model(ids).logits
            windowed = None
        with simulation(model, "prerope", bits=2, codebooks=calibrated, residual=64):
            windowed = model(ids).logits
    assert torch.isfinite(quantized).all() and not torch.allclose(quantized, exact, atol=1e-3)
    torch.testing.assert_close(windowed, exact, atol=1e-4, rtol=1e-4)  # every key inside the window


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_other_families_calibrate_and_simulate(family, sample_text_path):
    """A sliding-window config (Mistral) and one with q/k norms before RoPE (Qwen3): calibration
    finds their rotary embedding, and simulation with the window covering every key is exact."""
    model = tiny_model(family, sliding_window=16) if family == "mistral" else tiny_model(family)
    ids = torch.randint(3, 120, (1, 600), generator=torch.Generator().manual_seed(0))
    cb = calibrate(
        model, FixedIds(ids[0]), "ids", bits=2, method="prerope", max_tokens=600, seq_len=200, iters=2, progress=False
    )
    assert torch.equal(cb.layer(0).transform.rope_inv_freq, model_rope_frequencies(model, 16))
    x = ids[:, :40]
    with torch.no_grad():
        exact = model(x).logits
        with simulation(model, "prerope", bits=2, codebooks=cb):
            quantized = model(x).logits
        with simulation(model, "prerope", bits=2, codebooks=cb, residual=64):
            windowed = model(x).logits
    assert torch.isfinite(quantized).all() and not torch.allclose(quantized, exact, atol=1e-3)
    torch.testing.assert_close(windowed, exact, atol=1e-4, rtol=1e-4)


def test_the_cache_and_the_backend_refuse_with_the_fix():
    from vecinfer_compile import VecInferCache, vecinfer_backend

    cb = random_codebooks(CONFIG, 2.0, "prerope")
    with pytest.raises(ValueError, match="simulate mode only.*--method qaware"):
        VecInferCache(CONFIG, cb, max_cache_len=8)
    with pytest.raises(ValueError, match="simulate mode only"):
        vecinfer_backend.configure(codebooks=cb)
    assert "SIMULATE" in method_note("prerope", 2, 128)


def test_a_model_without_rope_is_refused():
    model = tiny_model(layers=1)
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            del module.inv_freq
    with pytest.raises(ValueError, match="no rotary embedding.*--method qaware"):
        model_rope_frequencies(model, 16)
