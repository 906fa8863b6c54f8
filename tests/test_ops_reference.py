"""The ``vecinfer`` ops on CPU (the reference path) against an independent float64 computation:
dequantize, repeat K/V per query head, plain masked softmax attention."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.ops import reference
from vecinfer_compile.ops.coded_kv import bundle_coded_kv
from vecinfer_compile.presets import PRESETS
from vecinfer_compile.quant import codebook, hadamard_matrix, pack_codes, packed_width, unpack_codes
from vecinfer_compile.quant.byte_centroids import snap_centroids

SPECS = sorted(
    {(p.key.entries, p.key.dims) for p in PRESETS.values()}
    | {(p.value.entries, p.value.dims) for p in PRESETS.values()}
)


def make_codes(gen, shape, entries, dims, head_dim):
    """Random stored codes (``head_dim // dims`` codes per head vector, packed as the ops take
    them) and a float32 codebook ``[entries, dims]`` (7-bit centroids for books of more than 256
    entries, as every codebook holds them: :mod:`vecinfer_compile.quant.byte_centroids`)."""
    cent = snap_centroids(torch.randn(entries, dims, generator=gen))
    codes = torch.randint(0, entries, (*shape, head_dim // dims), generator=gen)
    return pack_codes(codes, entries), cent


def dequant64(codes, cent):
    return codebook.decode(unpack_codes(codes, cent.shape[0]), cent.double())


def naive_attention(q, kq, vq, kf, vf, mask, causal, scale, residual):
    """float64 ``[B, Hq, Tq, D]`` with K/V repeated per query head; ``kf``/``vf`` None if residual 0."""
    b, hq, tq, d = q.shape
    g = hq // kq.shape[1]
    rep = lambda t: t.double().repeat_interleave(g, 1)  # noqa: E731
    q, kq, vq = q.double(), rep(kq), rep(vq)
    tk = kq.shape[2]
    s = q @ kq.transpose(-1, -2) * scale
    full = torch.zeros(tq, tk, dtype=torch.bool)
    if residual:
        i, j = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
        full = (i + tk - tq - j >= 0) & (i + tk - tq - j < residual)
        s = torch.where(full, q @ rep(kf).transpose(-1, -2) * scale, s)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).tril().logical_not(), -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = (p * ~full) @ vq
    if residual:
        out = out + (p * full) @ rep(vf)
    return out


def random_mask(gen, kind, b, hq, tq, tk):
    """None, a bool mask (True = attend) or an additive float mask, with broadcast dims."""
    if kind == "none":
        return None
    shape = (b if torch.rand(1, generator=gen) < 0.5 else 1, hq if torch.rand(1, generator=gen) < 0.5 else 1, tq, tk)
    if kind == "bool":
        return torch.rand(shape, generator=gen) < 0.7
    m = torch.randn(shape, generator=gen)
    return m.masked_fill(torch.rand(shape, generator=gen) < 0.2, -math.inf)


def attention_case(gen, *, b, hkv, group, tq, tk, d, kspec, vspec, mask_kind, causal, residual, dtype):
    q = torch.randn(b, hkv * group, tq, d, generator=gen).to(dtype)
    kc, kcent = make_codes(gen, (b, hkv, tk), *kspec, d)
    vc, vcent = make_codes(gen, (b, hkv, tk), *vspec, d)
    kf = torch.randn(b, hkv, tk, d, generator=gen) if residual else None
    vf = torch.randn(b, hkv, tk, d, generator=gen) if residual else None
    mask = random_mask(gen, mask_kind, b, hkv * group, tq, tk)
    return (q, kc, vc, kcent, vcent, kf, vf, mask, causal, d**-0.5, residual)


def expected_attention(args):
    q, kc, vc, kcent, vcent, kf, vf, mask, causal, scale, residual = args
    return naive_attention(q, dequant64(kc, kcent), dequant64(vc, vcent), kf, vf, mask, causal, scale, residual)


def decode_case(gen, *, b, hkv, group, tmax, n_coded, r, n_window, d, kspec, vspec, with_start, dtype):
    q = torch.randn(b, hkv * group, 1, d, generator=gen).to(dtype)
    kc, kcent = make_codes(gen, (b, hkv, tmax), *kspec, d)
    vc, vcent = make_codes(gen, (b, hkv, tmax), *vspec, d)
    kw = torch.randn(b, hkv, r, d, generator=gen).to(dtype)
    vw = torch.randn(b, hkv, r, d, generator=gen).to(dtype)
    start = torch.randint(0, n_coded + n_window + 1, (b,), generator=gen, dtype=torch.int32) if with_start else None
    return (
        q,
        kc,
        vc,
        kcent,
        vcent,
        torch.tensor(n_coded, dtype=torch.int32),
        kw,
        vw,
        torch.tensor(n_window, dtype=torch.int64),
        start,
        d**-0.5,
    )


def expected_decode(args):
    """Valid positions gathered explicitly, then plain attention."""
    q, kc, vc, kcent, vcent, n_coded, kw, vw, n_window, start, scale = args
    nc, nw = int(n_coded), int(n_window)
    k = torch.cat([dequant64(kc, kcent)[:, :, :nc], kw.double()[:, :, :nw]], 2)
    v = torch.cat([dequant64(vc, vcent)[:, :, :nc], vw.double()[:, :, :nw]], 2)
    b, hq = q.shape[:2]
    mask = None
    if start is not None:
        mask = (torch.arange(nc + nw)[None, :] >= start[:, None].long())[:, None, None, :]
    return naive_attention(q, k, v, None, None, mask, False, scale, 0)


def reference_decode(args):
    """float64 ``[B, Hq, 1, D]``: the reference over :func:`decode_case`'s arguments (on their
    device), with q in float32."""
    q, kv, kv_start, scale = bundle_coded_kv(args, 1)
    return reference.decode_attention(q.float(), kv, kv_start, scale).double()


def assert_close(got, want, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tq=st.integers(1, 9),
    extra=st.integers(0, 6),
    d=st.sampled_from([8, 16, 32]),
    kspec=st.sampled_from(SPECS),
    vspec=st.sampled_from(SPECS),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    causal=st.booleans(),
    residual=st.sampled_from([0, 1, 3, 5, 100]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_attention_matches_naive(seed, b, hkv, group, tq, extra, d, kspec, vspec, mask_kind, causal, residual, dtype):
    gen = torch.Generator().manual_seed(seed)
    args = attention_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        tq=tq,
        tk=tq + extra,
        d=d,
        kspec=kspec,
        vspec=vspec,
        mask_kind=mask_kind,
        causal=causal,
        residual=residual,
        dtype=dtype,
    )
    assert_close(torch.ops.vecinfer.attention(*args), expected_attention(args), dtype)


def test_fully_masked_rows_are_zero():
    gen = torch.Generator().manual_seed(0)
    args = list(
        attention_case(
            gen,
            b=1,
            hkv=1,
            group=2,
            tq=3,
            tk=4,
            d=8,
            kspec=(256, 4),
            vspec=(256, 4),
            mask_kind="none",
            causal=False,
            residual=0,
            dtype=torch.float32,
        )
    )
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = False
    args[7] = mask
    out = torch.ops.vecinfer.attention(*args)
    assert torch.isfinite(out).all() and (out[:, :, 1] == 0).all()


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tmax=st.integers(1, 13),
    frac=st.floats(0, 1),
    r=st.integers(1, 5),
    wfrac=st.floats(0, 1),
    d=st.sampled_from([8, 16, 32]),
    kspec=st.sampled_from(SPECS),
    vspec=st.sampled_from(SPECS),
    with_start=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_decode_matches_naive(seed, b, hkv, group, tmax, frac, r, wfrac, d, kspec, vspec, with_start, dtype):
    gen = torch.Generator().manual_seed(seed)
    args = decode_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        tmax=tmax,
        n_coded=round(frac * tmax),
        r=r,
        n_window=round(wfrac * r),
        d=d,
        kspec=kspec,
        vspec=vspec,
        with_start=with_start,
        dtype=dtype,
    )
    assert_close(torch.ops.vecinfer.decode_attention(*args), expected_decode(args), dtype)


def _chosen_distance(x, codes, cent):
    """Squared distance of every sub-vector of ``x`` to its chosen centroid (``codes``: indices)."""
    sub = codebook.subvectors(x.float(), cent.shape[1])
    return ((sub - cent[codes.long()]) ** 2).sum(-1)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    h=st.integers(1, 3),
    t=st.integers(1, 7),
    d=st.sampled_from([16, 32]),
    spec=st.sampled_from(SPECS),
    smooth=st.booleans(),
    rotate=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_encode_matches_codebook_encode(seed, h, t, d, spec, smooth, rotate, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, h, t, d, generator=gen).to(dtype)
    lam = torch.rand(h, d, generator=gen) + 0.5 if smooth else None
    rot = hadamard_matrix(d, torch.float32, "cpu") if rotate else None
    cent = torch.randn(*spec, generator=gen)
    stored = torch.ops.vecinfer.encode(x, lam, rot, cent)
    assert stored.dtype == torch.uint8 and stored.shape == (2, h, t, packed_width(d // spec[1], spec[0]))
    codes = unpack_codes(stored, spec[0])
    xt = x.float() / lam[None, :, None, :] if smooth else x.float()
    xt = xt @ rot if rotate else xt
    want = codebook.encode(xt, cent)
    assert codes.shape == want.shape
    # Equal codes, up to exact ties broken differently by float rounding.
    torch.testing.assert_close(
        _chosen_distance(xt, codes, cent), _chosen_distance(xt, want, cent), atol=1e-5, rtol=1e-5
    )
