"""Score-aware key codes (:mod:`vecinfer_compile.quant.score_aware`): the search, every encoder
that runs it, the file, the compiled pass and the CUDA append's refusal (the cache's codes:
tests/test_weighted_codes.py, with and without error metrics)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.ops import reference
from vecinfer_compile.ops.append import encode_flush
from vecinfer_compile.quant import codebook
from vecinfer_compile.quant.kmeans import kmeans
from vecinfer_compile.quant.packing import unpack_codes
from vecinfer_compile.quant.score_aware import SCALES, check_parallel_weight, parallel_loss, score_aware_indices
from vecinfer_compile.testing import random_codebooks

pytestmark = pytest.mark.usefixtures("one_thread")


def nearest_fn(centroids):
    dims = centroids.shape[1]

    def nearest(y):
        sub = y.reshape(*y.shape[:-1], y.shape[-1] // dims, dims)
        return ((sub[..., None, :] - centroids) ** 2).sum(-1).argmin(-1)

    return nearest


def dequant(idx, centroids):
    return centroids[idx].reshape(*idx.shape[:-1], idx.shape[-1] * centroids.shape[1])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    subs=st.integers(1, 8),
    dims=st.sampled_from([1, 2, 4, 8]),
    entries=st.sampled_from([2, 16, 256]),
    weight=st.sampled_from([1.0, 1.5, 8.0, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_property_never_worse_than_nearest_and_one_is_nearest(rows, subs, dims, entries, weight, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, subs * dims, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    c = torch.randn(entries, dims, generator=gen)
    nearest = nearest_fn(c)
    idx = score_aware_indices(x, c, weight, nearest)
    assert idx.shape == (rows, subs) and idx.dtype == torch.int64
    plain = nearest(x)
    if weight == 1.0:
        assert torch.equal(idx, plain)
    mine, base = parallel_loss(x, dequant(idx, c), weight), parallel_loss(x, dequant(plain, c), weight)
    assert torch.all(mine <= base * (1 + 1e-6) + 1e-6)
    # each row's codes are the nearest-centroid codes of one of the scaled vectors
    candidates = torch.stack([nearest(x * s) for s in SCALES])  # [S, rows, subs]
    assert torch.all((candidates == idx).all(-1).any(0))


def test_it_removes_the_k_means_shrinkage():
    """K-Means centroids are cell means, so keys come back shorter along their own direction
    (the parallel error r . u is positive on average). Score-aware codes take most of it away for
    some more squared error (measured: parallel 2.94 -> 0.59, squared 11.8 -> 15.2)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=gen) * torch.linspace(0.5, 2.0, 32)
    centroids = kmeans(x.reshape(-1, 4), 64, iters=10, seed=0).centroids
    nearest = nearest_fn(centroids)
    u = x / x.norm(dim=-1, keepdim=True)

    def errors(idx):
        r = x - dequant(idx, centroids)
        return (r * u).sum(-1), (r * r).sum(-1).mean()

    par_plain, sq_plain = errors(nearest(x))
    par_aware, sq_aware = errors(score_aware_indices(x, centroids, 8.0, nearest))
    assert par_plain.mean() > 0.3 * par_plain.abs().mean()  # the shrinkage is there
    assert (par_aware**2).mean() < 0.25 * (par_plain**2).mean()
    assert sq_aware < 1.5 * sq_plain


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 9),
    dims=st.sampled_from([2, 4, 8]),
    entries=st.sampled_from([16, 256, 4096]),
    weight=st.sampled_from([1.0, 8.0]),
    seed=st.integers(0, 2**16),
)
def test_property_every_torch_encoder_agrees(b, h, t, dims, entries, weight, seed):
    """quant.codebook.encode (simulate, calibration), the op's reference (prefill, compiled
    simulate) and the cache append's flush form give codes of the same loss: the same codes but
    for last-ulp ties of their distance formulas."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, 16, generator=gen)
    c = torch.randn(entries, dims, generator=gen)
    ways = {
        "codebook": codebook.encode(x, c, weight).long(),
        "reference": unpack_codes(reference.encode(x, None, None, c, weight), entries),
        "flush": unpack_codes(encode_flush(x, c, weight), entries),
        "op": unpack_codes(torch.ops.vecinfer.encode(x, None, None, c, weight), entries),
    }
    losses = {k: parallel_loss(x, dequant(v, c), weight) for k, v in ways.items()}
    for k, loss in losses.items():
        torch.testing.assert_close(loss, losses["codebook"], rtol=1e-5, atol=1e-6, msg=k)
    quantized = torch.ops.vecinfer.quantize(x, None, None, c, weight)
    torch.testing.assert_close(quantized, dequant(ways["op"], c))


def test_op_schemas_take_the_weight():
    x, c = torch.randn(1, 2, 3, 8), torch.randn(16, 4)
    for op in (torch.ops.vecinfer.encode.default, torch.ops.vecinfer.quantize.default):
        torch.library.opcheck(op, (x, None, None, c, 8.0))
    assert "float parallel_weight=1." in str(torch.ops.vecinfer.encode.default._schema)
    assert "float key_parallel_weight=1." in str(torch.ops.vecinfer.cache_append.default._schema)


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("inf"), -1.0])
def test_a_bad_weight_is_refused(bad):
    with pytest.raises(ValueError, match="parallel weight must be a finite number >= 1"):
        check_parallel_weight(bad)
    with pytest.raises(ValueError, match="parallel weight must be a finite number >= 1"):
        torch.ops.vecinfer.encode(torch.randn(1, 1, 2, 8), None, None, torch.randn(4, 4), bad)


def tiny_config():
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )


def test_the_file_keeps_the_weight_and_refuses_a_bad_one(tmp_path):
    cb = random_codebooks(tiny_config(), bits=2.0, method="qaware")
    assert cb.key_parallel_weight == 1.0
    cb.metadata["key_parallel_weight"] = 8.0
    assert load_codebooks(cb.save(tmp_path / "cb.safetensors")).key_parallel_weight == 8.0
    cb.metadata["key_parallel_weight"] = 0.0
    with pytest.raises(ValueError, match="parallel weight"):
        load_codebooks(cb.save(tmp_path / "bad.safetensors"))
