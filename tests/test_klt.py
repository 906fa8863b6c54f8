"""Per-head KLT and integer bit allocation (quant/klt.py): exact reconstruction, budgets, known
Lloyd-Max figures; and studies/key_codec_study.py's codecs on synthetic keys."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.quant.klt import (
    KLT,
    gaussian_lloyd_max_distortion,
    greedy_allocation,
    lloyd_max,
    rounded_water_filling,
    scalar_quantize,
)
from vecinfer_compile.quant.rate_distortion import water_fill

REPO = Path(__file__).resolve().parents[1]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.sampled_from([2, 4, 8, 16]), st.integers(0, 2**16))
def test_property_klt_is_orthonormal_and_exact_at_infinite_rate(heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(heads, dim, dim, generator=gen)
    x = torch.randn(heads, 4 * dim, dim, generator=gen) @ mix + torch.randn(heads, 1, dim, generator=gen)
    klt = KLT.fit(x)
    eye = torch.eye(dim, dtype=torch.float64).expand(heads, dim, dim)
    assert torch.allclose(klt.basis.transpose(1, 2) @ klt.basis, eye, atol=1e-10)
    assert torch.allclose(klt.inverse(klt.forward(x)), x.double(), atol=1e-9)
    assert (klt.variance[:, :-1] >= klt.variance[:, 1:] - 1e-12).all()  # decreasing
    y = klt.forward(x)  # uncorrelated components whose variances are the eigenvalues
    assert torch.allclose(y.var(1), klt.variance, rtol=1e-6, atol=1e-9)


def test_klt_wants_samples_heads_first():
    with pytest.raises(ValueError, match="H, N >= 2, D"):
        KLT.fit(torch.randn(5, 8))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1e3), min_size=1, max_size=24), st.integers(0, 200), st.integers(1, 8))
def test_property_greedy_allocation_spends_the_budget_and_favours_variance(variances, budget, top):
    var = torch.tensor(variances, dtype=torch.float64)
    bits = greedy_allocation(var, budget, gaussian_lloyd_max_distortion(top))
    assert int(bits.sum()) == min(budget, top * var.numel())
    assert ((bits >= 0) & (bits <= top)).all()
    order = var.argsort(descending=True)  # more variance never gets fewer bits (ties aside)
    for a, b in zip(order[:-1].tolist(), order[1:].tolist()):
        if var[a] > var[b]:
            assert bits[a] >= bits[b]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=24), st.integers(1, 100))
def test_property_rounded_water_filling_sums_to_the_budget(variances, budget):
    var = torch.tensor(variances, dtype=torch.float64)
    bits = rounded_water_filling(var, budget)
    assert int(bits.sum()) == budget and (bits >= 0).all()
    capped = rounded_water_filling(var, budget, max_bits=6)
    assert (capped <= 6).all() and int(capped.sum()) == min(budget, 6 * var.numel())


def test_gaussian_lloyd_max_figures():
    d = gaussian_lloyd_max_distortion(4)  # Max (1960): 0.3634, 0.1175, 0.03454, 0.009497
    assert d.tolist() == pytest.approx([1.0, 0.3634, 0.1175, 0.03454, 0.009497], rel=2e-3)


def test_lloyd_max_of_samples_and_nearest_levels():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    levels = lloyd_max(x, 2)
    assert levels.tolist() == pytest.approx([-0.798, 0.798], abs=0.01)
    assert scalar_quantize(torch.tensor([-5.0, -0.1, 0.2, 3.0]), levels).tolist() == [
        levels[0].item(),
        levels[0].item(),
        levels[1].item(),
        levels[1].item(),
    ]
    assert lloyd_max(x, 1).item() == pytest.approx(x.mean().item())


def _study():
    spec = importlib.util.spec_from_file_location("key_codec_study", REPO / "studies" / "key_codec_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_codecs_on_gaussian_keys_sit_between_the_bound_and_one():
    study = _study()
    gen = torch.Generator().manual_seed(1)
    scale = torch.logspace(0, -2, 16)  # a steep spectrum (bound 0.005 at 2 bits), 2 heads, 16 dims
    fit, test = (torch.randn(2, n, 16, generator=gen) * scale for n in (4096, 2048))
    klt = KLT.fit(fit)
    bound = (water_fill(klt.variance[0], 32).sum() / klt.variance[0].sum()).item()
    curves = {1: gaussian_lloyd_max_distortion(8), 2: study.kmeans_curve(2, 8, samples=2048)}
    for g in (1, 2):
        codec = study.BlockCodec(klt.forward(fit), g, 32, curves[g], seed=0)
        assert (codec.bits.sum(1) == 32).all()
        err = study.relative_error(test, klt.inverse(codec(klt.forward(test))))
        assert 0.9 * bound < err < 3 * bound  # Lloyd-Max: 1.9x the bound at 2 bits, 2.7x at high rates
    gs = study.GainShape(klt.forward(fit), 1, 32, curves[1], seed=0)
    # 8 of 32 bits on the norm is a heavy price at 16 dims (128-dim heads pay 8 of 256)
    assert 0.9 * bound < study.relative_error(test, klt.inverse(gs(klt.forward(test)))) < 0.1


def test_study_end_to_end_on_the_tiny_model(tiny_dir, calibration_text_path, sample_text_path, tmp_path, capsys):
    import json

    with pytest.raises(ValueError, match="the study needs 40960"):
        _study().main(["--model", str(tiny_dir), "--calib-text", str(sample_text_path)])
    out = tmp_path / "study.json"
    _study().main(
        [
            "--model",
            str(tiny_dir),
            "--calib-text",
            str(calibration_text_path),
            "--layers",
            "1",
            "--rows",
            "kmeans,g1,trellis",
            "--trellis-bits",
            "6",
            "--trellis-vectors",
            "64",
            "--json",
            str(out),
        ]
    )
    row = json.loads(out.read_text())["layers"]["1"]
    assert "| kmeans_256x4 |" in capsys.readouterr().out
    assert row["bound_flat"] == 1 / 16 and 0 < row["bound_wf_klt"] <= row["bound_sub4"] <= 1 / 16 + 1e-9
    assert row["bound_wf_klt"] < row["klt_gauss_int"] < row["klt_lloyd"] < 0.2
    assert row["bound_wf_klt"] < row["kmeans_256x4"] < 0.2 and 0 < row["klt_trellis6"] < 0.3
