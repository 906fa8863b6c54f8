"""Codebook refinement against the attention-output error (vecinfer_compile.quant.refine) and its
place in calibration (qaware refines, qaware-norefine does not)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.quant.codebook import quantize_dequantize
from vecinfer_compile.quant.kmeans import kmeans
from vecinfer_compile.quant.refine import LayerAttention, RefineConfig, _mask, refine_codebooks
from vecinfer_compile.quant.transform import KeyTransform

SMALL = RefineConfig(rounds=2, steps=15, windows=3, lr=1e-2)


def _layer(hq=4, hkv=2, d=16, lengths=(24, 24, 20, 24), seed=0):
    """Random recorded tensors of one layer, a centred Hadamard transform and k-means books."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(hq, n, d, generator=gen) * 2
    k = torch.randn(hkv, n, d, generator=gen) + torch.linspace(-1, 1, d)
    v = torch.randn(hkv, n, d, generator=gen)
    transform = KeyTransform(d, rotate=True, mean=k.mean(1))
    kt = transform.keys(k[None])[0]
    ck = kmeans(kt.reshape(-1, 4), 16, iters=5, seed=seed).centroids
    cv = kmeans(v.reshape(-1, 4), 16, iters=5, seed=seed + 1).centroids
    w = torch.randn(8, hq * d, generator=gen) / d
    return q, k, v, list(lengths), transform, ck, cv, LayerAttention(w, d**-0.5)


def _loss(q, k, v, lengths, transform, ck, cv, attn):
    """The attention-output error through o_proj, averaged over every window, computed here
    from the definition (keys and values quantized by nearest centroid)."""
    k_hat = transform.keys_inverse(quantize_dequantize(transform.keys(k[None]), ck))[0]
    v_hat = quantize_dequantize(v, cv)
    rep, total, start = q.shape[0] // k.shape[0], 0.0, 0
    for n in lengths:
        s = slice(start, start + n)
        start += n

        def out(kk, vv):
            o = F.scaled_dot_product_attention(
                q[:, s],
                kk[:, s].repeat_interleave(rep, 0),
                vv[:, s].repeat_interleave(rep, 0),
                is_causal=True,
                scale=attn.scaling,
            )
            return o.transpose(0, 1).reshape(n, -1) @ attn.out_weight.T

        total += (out(k_hat, v_hat) - out(k, v)).pow(2).mean().item()
    return total / len(lengths)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4), (8, 1)])  # GQA 2, MHA, MQA
def test_refinement_lowers_the_attention_output_error_it_reports(hq, hkv):
    q, k, v, lengths, transform, ck, cv, attn = _layer(hq=hq, hkv=hkv)
    ck2, cv2, before, after = refine_codebooks(q, k, v, lengths, transform, ck, cv, attn, SMALL, seed=3)
    assert ck2.shape == ck.shape and cv2.shape == cv.shape and ck2.dtype == cv2.dtype == torch.float32
    assert after < 0.9 * before
    # the reported losses are the definition's, over the probe windows (the first SMALL.windows)
    probe = lengths[: SMALL.windows]
    n = sum(probe)
    args = (q[:, :n], k[:, :n], v[:, :n], probe, transform)
    assert before == pytest.approx(_loss(*args, ck, cv, attn), rel=1e-4)
    assert after == pytest.approx(_loss(*args, ck2, cv2, attn), rel=1e-4)
    # and on every window, including the one the probe leaves out
    assert _loss(q, k, v, lengths, transform, ck2, cv2, attn) < _loss(q, k, v, lengths, transform, ck, cv, attn)


def test_refinement_is_deterministic_and_keeps_exact_books():
    q, k, v, lengths, transform, ck, cv, attn = _layer(seed=1)
    a = refine_codebooks(q, k, v, lengths, transform, ck, cv, attn, SMALL, seed=5)
    b = refine_codebooks(q, k, v, lengths, transform, ck, cv, attn, SMALL, seed=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # a book holding every sub-vector exactly has nothing to lower: it comes back as it was
    k_exact = torch.randint(0, 3, k.shape).float()
    v_exact = torch.randint(0, 3, v.shape).float()
    plain = KeyTransform(k.shape[-1], rotate=False)
    grid = torch.cartesian_prod(*[torch.arange(3.0)] * 4)
    ck2, cv2, before, after = refine_codebooks(q, k_exact, v_exact, lengths, plain, grid, grid, attn, SMALL)
    assert before == after == 0.0 and torch.equal(ck2, grid) and torch.equal(cv2, grid)


@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 40), window=st.one_of(st.none(), st.integers(1, 50)))
def test_sliding_window_mask_is_transformers(length, window):
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    mask = _mask(length, window, "cpu")
    fn = sliding_window_causal_mask_function(window) if window else None
    expected = sdpa_mask(1, length, length, allow_is_causal_skip=False, **({"mask_function": fn} if fn else {}))[0, 0]
    got = torch.ones(length, length, dtype=torch.bool).tril() if mask is None else mask
    assert torch.equal(got, expected)


def test_layer_attention_reads_the_module():
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralAttention

    from vecinfer_compile.hf.output_projection import output_projection_weight

    cfg = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=7)
    module = MistralAttention(cfg, layer_idx=0)
    attn = LayerAttention.of(module, output_projection_weight(module, 4, 16), 16)
    assert torch.equal(attn.out_weight, module.o_proj.weight) and attn.scaling == module.scaling
    assert attn.sliding_window == getattr(module, "sliding_window", None)
    bare = LayerAttention.of(None, None, 16)
    assert bare.out_weight is None and bare.scaling == 16**-0.5 and bare.sliding_window is None


def test_calibration_refines_qaware_only(tiny_model, sample_text_path, tmp_path):
    from vecinfer_compile.calibration import calibrate, recipe_mismatch
    from vecinfer_compile.evaluation.ablation import codebook_filename, get_codebooks

    model, tokenizer = tiny_model
    text = sample_text_path.read_text()
    kw = dict(bits=2, max_tokens=384, seq_len=128, iters=3, progress=False)
    refined = calibrate(model, tokenizer, text, method="qaware", refine=SMALL, **kw)
    plain = calibrate(model, tokenizer, text, method="qaware-norefine", **kw)
    ratios = refined.metadata["refine"]["loss_ratio"]
    assert set(ratios) == {f"{i}/2" for i in range(len(refined.layers))} and max(ratios.values()) <= 1.0
    assert min(ratios.values()) < 1.0
    assert "refine" not in plain.metadata
    for a, b in zip(refined.layers, plain.layers):
        assert torch.equal(a.transform.key_matrix, b.transform.key_matrix)  # only the centroids move
    assert any(not torch.equal(a.keys, b.keys) for a, b in zip(refined.layers, plain.layers))
    # a file knows its recipe: a codebook cache must not hand back k-means qaware files as refined
    assert recipe_mismatch(refined, "qaware", SMALL) is None and recipe_mismatch(plain, "qaware-norefine") is None
    assert recipe_mismatch(refined, "qaware").startswith("its centroids were refined with")  # other settings
    old = dataclasses.replace(refined, metadata={k: v for k, v in refined.metadata.items() if k != "refine"})
    assert "k-means" in recipe_mismatch(old, "qaware")  # a qaware file written before refinement
    older = dataclasses.replace(plain, method="qaware")  # and before its score-aware, error-weighted codes
    assert "parallel weight 1" in recipe_mismatch(older, "qaware")
    isotropic = dataclasses.replace(
        refined, metadata={k: v for k, v in refined.metadata.items() if k != "qaware_ridge_form"}
    )  # and before its diagonal ridge
    assert "older ridge (ridge * I)" in recipe_mismatch(isotropic, "qaware", SMALL)
    cache = tmp_path / "cache"
    cache.mkdir()
    old.save(cache / codebook_filename("qaware", 2))
    with pytest.raises(ValueError, match="delete it to recalibrate"):
        get_codebooks(model, tokenizer, "qaware", 2, cache_dir=cache, progress=False)
    given_file = get_codebooks(model, tokenizer, "qaware", 2, codebooks_path=cache / codebook_filename("qaware", 2))
    assert "refine" not in given_file.metadata  # named explicitly: used as it is
