"""Property tests of the method's numerics (quant/)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.presets import PRESETS, get_preset
from vecinfer_compile.quant.codebook import code_dtype, decode, encode
from vecinfer_compile.quant.hadamard import hadamard_matrix
from vecinfer_compile.quant.kivi import kivi_keys, kivi_step, kivi_values
from vecinfer_compile.quant.kmeans import kmeans
from vecinfer_compile.quant.transform import KeyTransform, smoothing_factors

HEAD_DIMS = [16, 32, 64, 80, 96, 128, 192, 256]


@pytest.mark.parametrize("n", HEAD_DIMS + [512])
def test_hadamard_is_orthonormal(n):
    h = hadamard_matrix(n, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    # Every entry is +-1/sqrt(block): a real Hadamard, not just any orthonormal matrix.
    nonzero = h[h != 0].abs()
    assert torch.allclose(nonzero, nonzero[0].expand_as(nonzero))


@pytest.mark.parametrize("n", [8, 24, 72, 100])
def test_hadamard_rejects_head_dims_without_a_block(n):
    with pytest.raises(ValueError, match=f"head_dim {n} has no Hadamard rotation"):
        hadamard_matrix(n)


def _qk_case(draw_shape, dtype, seed):
    b, hkv, rep, tq, tk, d = draw_shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * rep, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=torch.float64)
    lam = torch.rand(hkv, d, generator=g, dtype=torch.float64) * 10 + 0.01
    return q.to(dtype), k.to(dtype), lam


shapes = st.tuples(
    st.integers(1, 2),
    st.integers(1, 3),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 9),
    st.integers(1, 17),
    st.sampled_from([16, 32, 64, 80, 96, 128]),
)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), smooth=st.booleans(), rotate=st.booleans())
def test_transform_preserves_scores_float64(shape, seed, smooth, rotate):
    q, k, lam = _qk_case(shape, torch.float64, seed)
    t = KeyTransform(q.shape[-1], lam if smooth else None, rotate)
    rep = q.shape[1] // k.shape[1]
    ref = q @ k.repeat_interleave(rep, 1).transpose(-1, -2)
    got = t.queries(q) @ t.keys(k).repeat_interleave(rep, 1).transpose(-1, -2)
    scale = ref.abs().max().clamp_min(1e-30)
    assert ((got - ref).abs().max() / scale) < 1e-9


@settings(max_examples=20, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_transform_preserves_scores_bf16(shape, seed):
    q, k, lam = _qk_case(shape, torch.bfloat16, seed)
    t = KeyTransform(q.shape[-1], lam.float(), True)
    rep = q.shape[1] // k.shape[1]
    qt, kt = t.queries(q), t.keys(k).to(torch.bfloat16)
    exact = q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2)
    got = (qt @ kt.repeat_interleave(rep, 1).transpose(-1, -2)).double()
    # bf16 rounding of q~, K~ and the product: a few units of bf16 epsilon (2^-8) times
    # |q~| |K~| per score, the usual bound for a rounded dot product.
    norms = qt.double().norm(dim=-1, keepdim=True) * kt.double().norm(dim=-1).repeat_interleave(rep, 1)[..., None, :]
    assert ((got - exact).abs() <= 4 * 2.0**-8 * norms + 1e-6).all()


def test_transform_inverse_round_trip():
    k = torch.randn(2, 2, 7, 64, dtype=torch.float64)
    t = KeyTransform(64, torch.rand(2, 64, dtype=torch.float64) + 0.1, True)
    torch.testing.assert_close(t.keys_inverse(t.keys(k)), k)


def test_smoothing_factors_are_sqrt_absmax_and_reject_nan():
    absmax = torch.tensor([[4.0, 0.0, 9.0]])
    lam = smoothing_factors(absmax)
    assert lam[0, 0] == 2 and lam[0, 2] == 3 and lam[0, 1] > 0
    with pytest.raises(ValueError, match="NaN or inf"):
        smoothing_factors(torch.tensor([float("nan")]))


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from(sorted(PRESETS)), seed=st.integers(0, 1000), n=st.integers(1, 5))
def test_encode_decode_idempotent(bits, seed, n):
    spec = get_preset(bits).key
    g = torch.Generator().manual_seed(seed)
    centroids = torch.randn(spec.entries, spec.dims, generator=g)
    x = torch.randn(n, 2, 3, 32, generator=g)
    codes = encode(x, centroids)
    assert codes.dtype == code_dtype(spec.entries) and codes.shape == (n, 2, 3, 32 // spec.dims)
    once = decode(codes, centroids)
    assert torch.equal(encode(once, centroids), codes)
    assert torch.equal(decode(encode(once, centroids), centroids), once)


def test_encode_picks_the_nearest_centroid():
    g = torch.Generator().manual_seed(0)
    centroids = torch.randn(256, 4, generator=g)
    x = torch.randn(500, 4, generator=g)
    dist = torch.cdist(x.double(), centroids.double())
    picked = dist.gather(1, encode(x, centroids).long())[:, 0]  # codes: [N, 1]
    # The fp32 expansion may break near-ties differently from fp64, never by more than rounding.
    assert torch.allclose(picked, dist.min(1).values, atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.sampled_from([2, 7, 32, 64]), d=st.sampled_from([1, 2, 4, 8]))
def test_kmeans_objective_never_increases(seed, k, d):
    g = torch.Generator().manual_seed(seed)
    # Clustered data so Lloyd iterations have work to do.
    centers = torch.randn(5, d, generator=g) * 5
    x = centers[torch.randint(5, (800,), generator=g)] + torch.randn(800, d, generator=g)
    res = kmeans(x, k, iters=15, seed=seed, tol=0.0)
    obj = res.objective
    assert all(b <= a * (1 + 1e-5) + 1e-7 for a, b in zip(obj, obj[1:])), obj
    assert res.centroids.shape == (k, d)


def test_kmeans_is_seeded_and_deterministic():
    x = torch.randn(3000, 4, generator=torch.Generator().manual_seed(1))
    a = kmeans(x, 16, seed=3).centroids
    assert torch.equal(a, kmeans(x, 16, seed=3).centroids)
    assert not torch.equal(a, kmeans(x, 16, seed=4).centroids)


def test_kmeans_beats_random_codebook():
    x = torch.randn(4000, 4, generator=torch.Generator().manual_seed(2))
    res = kmeans(x, 64, iters=10)
    rand_err = ((x - decode(encode(x, x[:64]), x[:64])) ** 2).sum(-1).mean()  # per vector, like objective
    assert res.objective[-1] < 0.8 * rand_err


def test_kmeans_rejects_nan():
    with pytest.raises(ValueError, match="NaN or inf"):
        kmeans(torch.tensor([[0.0], [float("inf")]]), 1)


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([2, 4]), t=st.integers(1, 70), seed=st.integers(0, 1000), scale=st.floats(1e-3, 1e3))
def test_kivi_error_is_at_most_half_a_step(bits, t, seed, scale):
    x = torch.randn(1, 2, t, 64, generator=torch.Generator().manual_seed(seed)) * scale
    for fn, per_channel in ((kivi_keys, True), (kivi_values, False)):
        err = (fn(x, bits) - x).abs()
        step = kivi_step(x, bits, 32, per_channel)
        assert (err <= step / 2 * (1 + 1e-4) + 1e-6 * scale).all()


def test_kivi_keys_group_over_tokens_values_over_channels():
    x = torch.randn(1, 1, 64, 64)
    x[..., :32, 5] *= 100  # one outlier channel in the first token group
    k_err = (kivi_keys(x, 2) - x).abs()
    # Per-channel key quantization confines the outlier's coarse step to channel 5.
    assert k_err[..., :32, 6].max() < k_err[..., :32, 5].max() / 10


@given(t=st.integers(1, 20), d=st.sampled_from([8, 16, 64]), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_rows_matmul_equals_matmul(t, d, seed):
    """The decode step's product-and-sum form (T <= FEW_ROWS) and the matmul it replaces agree."""
    from vecinfer_compile.quant.rows import FEW_ROWS, rows_matmul

    g = torch.Generator().manual_seed(seed)
    x, m = torch.randn(2, 3, t, d, generator=g), torch.randn(d, d, generator=g)
    torch.testing.assert_close(rows_matmul(x, m), x @ m, rtol=1e-5, atol=1e-5)
    assert (t <= FEW_ROWS) or rows_matmul(x, m).equal(x @ m)
    per_head = torch.randn(3, d, d, generator=g)  # one matrix per head, as the query-aware transform
    torch.testing.assert_close(rows_matmul(x, per_head), x @ per_head, rtol=1e-5, atol=1e-5)
