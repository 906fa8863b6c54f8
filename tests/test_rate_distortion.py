"""The Gaussian rate-distortion test channel (quant/rate_distortion.py) against its closed forms, and
studies/needle_ideal_quantizer.py end to end on the embedded tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.quant.rate_distortion import IdealChannel, water_fill

REPO = Path(__file__).resolve().parents[1]


def test_equal_eigenvalues_lose_a_factor_of_four_a_bit():
    d = water_fill(torch.full((8,), 3.0), bits=8 * 2.0)  # 2 bits an element
    assert torch.allclose(d, torch.full((8,), 3.0 / 16, dtype=torch.float64), rtol=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=16), st.floats(0.1, 40.0))
def test_property_water_filling_spends_exactly_the_rate(eigenvalues, bits):
    lam = torch.tensor(eigenvalues, dtype=torch.float64)
    d = water_fill(lam, bits)
    assert (d <= lam * (1 + 1e-12)).all()
    rate = (0.5 * torch.log2(lam / d)).sum().item()
    assert rate == pytest.approx(bits, rel=1e-6, abs=1e-6)
    above = lam > d * (1 + 1e-9)  # the components that get bits share one water level
    if above.any():
        assert torch.allclose(d[above], d[above].max().expand(int(above.sum())), rtol=1e-6)


def test_the_rate_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        water_fill(torch.ones(4), 0.0)


def test_channel_error_is_the_predicted_distortion_and_falls_with_the_rate():
    """Gaussian samples of a skewed covariance: the channel's empirical squared error matches
    ``sum d_i`` and its output keeps the mean; one bit more an element costs far less error."""
    g = torch.Generator().manual_seed(0)
    h, dim, n = 2, 16, 40000
    mix = torch.randn(h, dim, dim, generator=g) * torch.logspace(0, -1.5, dim)
    x = torch.einsum("nhd,hde->nhe", torch.randn(n, h, dim, generator=g), mix) + torch.randn(h, dim, generator=g)
    errors = []
    for bits in (1.0, 2.0):
        channel = IdealChannel.fit(x, bits)
        fresh = torch.einsum("nhd,hde->nhe", torch.randn(n, h, dim, generator=g), mix) + channel.mean
        noise = torch.randn(n, h, dim, generator=g)
        x_hat = channel(fresh.permute(1, 0, 2)[None], noise)[0].permute(1, 0, 2)  # [N, H, D]
        centred = ((fresh - fresh.mean(0)) ** 2).sum((0, 2))
        empirical = ((fresh - x_hat) ** 2).sum((0, 2)) / centred
        assert torch.allclose(empirical, channel.relative_error, rtol=0.05), (bits, empirical, channel.relative_error)
        assert torch.allclose(x_hat.mean(0), fresh.mean(0), atol=0.05)
        errors.append(channel.relative_error)
    # a skewed spectrum beats the equal-variance 2^-2R (water-filling), and a bit buys about 4x
    assert (errors[1] < 2**-4).all() and (errors[0] / errors[1] > 3).all()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.integers(1, 4), st.integers(1, 9), st.sampled_from([16, 64, 128]), st.integers(0, 99))
def test_property_channel_keeps_shapes_and_is_exact_at_a_very_high_rate(batch, heads, tokens, dim, seed):
    """Any batch, head count (MQA's one to MHA's several) and head_dim: the output has the input's
    shape, one noise draw a token serves every row of the batch, and 40 bits an element returns
    the input."""
    g = torch.Generator().manual_seed(seed)
    samples = torch.randn(4 * dim, heads, dim, generator=g) * torch.logspace(0, -1, dim)
    x = torch.randn(1, heads, tokens, dim, generator=g).expand(batch, -1, -1, -1)
    noise = torch.randn(tokens, heads, dim, generator=g)
    high, low = IdealChannel.fit(samples, 40.0), IdealChannel.fit(samples, 1.0)
    assert high.relative_error.shape == (heads,) and high.basis.shape == (heads, dim, dim)
    assert torch.allclose(high(x, noise), x, atol=1e-4)
    out = low(x, noise)
    assert out.shape == x.shape and torch.allclose(out[:1].expand_as(out), out, atol=1e-5)
    assert not torch.allclose(out, x, atol=1e-3)


def test_channel_refuses_samples_without_a_head_axis():
    with pytest.raises(ValueError, match=r"\[N >= 2, H, D\]"):
        IdealChannel.fit(torch.randn(10, 4), 2.0)


def _script():
    path = REPO / "studies" / "needle_ideal_quantizer.py"
    spec = importlib.util.spec_from_file_location("needle_ideal_quantizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_CODEBOOKS = REPO / "vecinfer_compile" / "data" / "tiny_codebooks" / "vecinfer-2bit.safetensors"
TINY_KV_HEADS, TINY_HEAD_DIM = 2, 64  # vecinfer_compile/data/tiny/config.json


@pytest.fixture(scope="module")
def tiny_codebooks_2bit():
    from vecinfer_compile.codebooks import load_codebooks

    return load_codebooks(TINY_CODEBOOKS)


def _simulator(codebooks):
    from vecinfer_compile.simulate import LayerSimulator

    return LayerSimulator(codebooks.method, codebooks.bits, 0, codebooks, layer_idx=1)


def test_codes_encoded_once_equal_the_codes_of_the_whole_sequence(tiny_codebooks_2bit):
    """The script's ``codes`` row encodes only a decode step's new slots; the result must be the
    simulate path's quantization of the whole sequence."""
    script, sim = _script(), _simulator(tiny_codebooks_2bit)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, TINY_KV_HEADS, 9, TINY_HEAD_DIM, generator=g) for _ in range(2))
    script.encoded_once(sim, k[:, :, :7], v[:, :, :7])
    k_hat, v_hat = script.encoded_once(sim, k, v)
    assert sim._encoded[0] is k  # the second call extended the first
    k_ref, v_ref = script.CODES_QUANTIZE(sim, k, v)
    assert torch.equal(k_hat, k_ref) and torch.equal(v_hat, v_ref)


def test_ideal_quantizer_at_a_very_high_rate_returns_its_input(tiny_codebooks_2bit):
    script, sim = _script(), _simulator(tiny_codebooks_2bit)
    g = torch.Generator().manual_seed(1)
    layers = len(tiny_codebooks_2bit.layers)
    heads, d = TINY_KV_HEADS, TINY_HEAD_DIM
    keys = {i: torch.randn(heads, 400, d, generator=g) for i in range(layers)}
    values = {i: torch.randn(heads, 400, d, generator=g) for i in range(layers)}
    ideal = script.IdealQuantizer(tiny_codebooks_2bit, keys, values, 40.0, noise_seed=0)
    k, v = torch.randn(1, heads, 5, d, generator=g), torch.randn(1, heads, 5, d, generator=g)
    k_hat, v_hat = ideal(sim, k, v)
    assert torch.allclose(k_hat, k, atol=1e-4) and torch.allclose(v_hat, v, atol=1e-4)
    low = script.IdealQuantizer(tiny_codebooks_2bit, keys, values, 0.5, noise_seed=0)
    k_low, _ = low(sim, k, v)
    assert (k_low - k).abs().max() > 0.1


def test_ideal_quantizer_leaves_layers_the_codebooks_do_not_code(tiny_codebooks_2bit):
    """A hybrid model's full-precision layers (None in the codebooks) get no channel."""
    import dataclasses

    script = _script()
    hybrid = dataclasses.replace(tiny_codebooks_2bit, layers=[None, *tiny_codebooks_2bit.layers[1:]])
    g = torch.Generator().manual_seed(2)
    recorded = {i: torch.randn(TINY_KV_HEADS, 300, TINY_HEAD_DIM, generator=g) for i in range(len(hybrid.layers))}
    ideal = script.IdealQuantizer(hybrid, recorded, recorded, 2.0, noise_seed=0)
    assert sorted(ideal.keys) == sorted(ideal.values) == list(range(1, len(hybrid.layers)))


def test_needle_ideal_quantizer_runs_every_row_on_the_tiny_model(tmp_path, tiny_dir, sample_text_path, capsys):
    """The script's rows on the embedded model: full precision, the file's codes, an ideal channel
    at a very high rate (no error to speak of) and at a low one."""
    haystack = tmp_path / "hay"
    haystack.mkdir()
    (haystack / "a.txt").write_text(sample_text_path.read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "rows.json"
    _script().main(
        [
            "--model",
            str(tiny_dir),
            "--haystack",
            str(haystack),
            "--calib-text",
            str(sample_text_path),
            "--codebooks",
            str(TINY_CODEBOOKS),
            "--rows",
            "fp,codes,ideal@30,ideal@0.25",
            "--calib-tokens",
            "512",
            "--lengths",
            "160",
            "--depths",
            "0,100",
            "--trials",
            "2",
            "--residual",
            "16",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())
    assert [r["row"] for r in rows] == ["fp", "codes", "ideal@30 (noise seed 0)", "ideal@0.25 (noise seed 0)"]
    assert all(0 <= c <= 1 for r in rows for line in r["grid"] for c in line)
    assert "mean accuracy" in capsys.readouterr().out
    assert rows[0]["relative_error"] is None and rows[1]["relative_error"] is None
    high, low = rows[2]["relative_error"], rows[3]["relative_error"]
    assert len(high["keys"]) == len(high["values"]) == 4  # the tiny model's layers
    assert max(high["keys"] + high["values"]) < 1e-6 < min(low["keys"] + low["values"])
