"""Triton kernels against the reference.

- ``test_interp_*``: the raw kernels, launched by the same launchers the ops use (``wrap=False``)
  on small CPU tensors under ``TRITON_INTERPRET=1``. The variable must be set before the kernels
  are decorated and breaks compile/opcheck, so ``test_kernels_under_triton_interpreter`` runs these
  tests in a child pytest with it set; they skip in a normal run.
- ``cuda``-marked tests: the registered ops on the GPU, with the rule
  ``err(ours) <= 2 * err(torch bf16 SDPA on the dequantized K/V) + atol``, both against float32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_reference import (
    SPECS,
    attention_case,
    decode_case,
    expected_attention,
    expected_decode,
    make_codes,
    reference_decode,
)

import vecinfer_compile.ops as ops
from vecinfer_compile.ops.coded_kv import bundle_coded_kv
from vecinfer_compile.quant import codebook, hadamard_matrix, unpack_codes
from vecinfer_compile.quant.score_aware import parallel_loss

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(not INTERPRET, reason="run by test_kernels_under_triton_interpreter")


@pytest.mark.skipif(INTERPRET, reason="this is the parent of the interpreter run")
def test_kernels_under_triton_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-k", "test_interp_", "-p", "no:cacheprovider"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def _fp32_tol(got, want):
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)


@interp_only
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tq=st.integers(1, 40).map(lambda t: t | 1),
    extra=st.integers(0, 70),
    d=st.sampled_from([16, 32, 64, 128]),
    kspec=st.sampled_from(SPECS),
    vspec=st.sampled_from(SPECS),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    causal=st.booleans(),
    residual=st.sampled_from([0, 1, 3, 17, 1000]),
)
def test_interp_attention(seed, b, hkv, group, tq, extra, d, kspec, vspec, mask_kind, causal, residual):
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
        dtype=torch.float32,
    )
    _fp32_tol(ops.attention_triton(*args), expected_attention(args))


@interp_only
@pytest.mark.parametrize("d", [256, 512])
def test_interp_decode_wide_heads(d):
    """Heads wider than 128 (Gemma 4's full layers: 512) run both kernels with fewer positions per
    step: a chunk of several steps and a window of several merge steps still give the reference."""
    gen = torch.Generator().manual_seed(d)
    args = decode_case(
        gen,
        b=1,
        hkv=1,
        group=2,
        tmax=300,
        n_coded=290,
        r=40,
        n_window=37,
        d=d,
        kspec=(256, 4),
        vspec=(4096, 8),
        with_start=True,
        dtype=torch.float32,
    )
    _fp32_tol(ops.decode_attention_triton(*bundle_coded_kv(args, 1)), expected_decode(args))


@interp_only
@pytest.mark.parametrize("score", ["dequant", "lut"])
@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tmax=st.integers(1, 700),
    frac=st.floats(0, 1),
    r=st.integers(1, 70),
    wfrac=st.floats(0, 1),
    d=st.sampled_from([16, 32, 64]),
    kspec=st.sampled_from(SPECS),
    vspec=st.sampled_from(SPECS),
    with_start=st.booleans(),
)
def test_interp_decode(score, seed, b, hkv, group, tmax, frac, r, wfrac, d, kspec, vspec, with_start):
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
        dtype=torch.float32,
    )
    _fp32_tol(ops.decode_attention_triton(*bundle_coded_kv(args, 1), score=score), expected_decode(args))


@interp_only
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    tmax=st.integers(1, 150),
    frac=st.floats(0, 1),
    d=st.sampled_from([16, 64, 128]),
    spec=st.sampled_from(SPECS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    strided=st.booleans(),
)
def test_interp_dequantize(seed, b, h, tmax, frac, d, spec, dtype, strided):
    """The chunk attention's prefix dequantization: the first ``length`` positions of every preset's
    stored codes (packed 12-bit too), a row slice of a larger buffer, into a position-major
    workspace, equal to the reference gather; positions past ``length`` untouched."""
    from vecinfer_compile.ops.triton.dequant import dequantize_triton

    gen = torch.Generator().manual_seed(seed)
    codes, cent = make_codes(gen, (b + int(strided), h, tmax), *spec, d)
    codes = codes[int(strided) :]
    length = round(frac * tmax)
    out = torch.full((b, tmax, h, d), float("nan"), dtype=dtype)
    dequantize_triton(codes, cent.to(dtype), length, out[:, :length])  # a strided view of out
    want = ops.reference.dequantize(codes, cent.to(dtype).float())[:, :, :length].transpose(1, 2).to(dtype)
    assert torch.equal(out[:, :length], want)
    assert out[:, length:].isnan().all()


ENCODE_CONFIGS = {
    "default": ops.triton.encode.DEFAULT_CONFIG,
    "other": ops.triton.encode.EncodeConfig(
        scan_block_n=1024, scan_unroll=8, scan_warps=4, dot_block_n=64, dot_block_e=128
    ),
}


@interp_only
@pytest.mark.parametrize("config,d", [("default", 32), ("other", 32), ("default", 24)])
@pytest.mark.parametrize("spec", SPECS + [(100, 4)])
def test_interp_encode(spec, config, d):
    """Each sub-vector gets a nearest centroid (its distance is the reference's) and the stored
    bytes are the reference's layout; transformed float32 input, and bfloat16 input read as it is.
    head_dim 24 gives an odd number of sub-vectors (3 of 8 channels) and one not a power of two."""
    gen = torch.Generator().manual_seed(spec[0] + spec[1] + d)
    # 4096-entry books take the tile kernel, 16-32 head vectors a program, which the interpreter runs
    # one by one: 9 positions (36 vectors) still launch several programs and a partial last one
    x = torch.randn(2, 2, 9 if spec[0] > 256 else 37, d, generator=gen)
    lam = torch.rand(2, d, generator=gen) + 0.5
    rot = hadamard_matrix(d, torch.float32, "cpu") if d == 32 else torch.eye(d)
    cent = torch.randn(*spec, generator=gen)
    for x_in, lam_in, rot_in in ((x, lam, rot), (x.bfloat16(), None, None)):
        stored, values = ops.encode_triton(x_in, lam_in, rot_in, cent, values=True, config=ENCODE_CONFIGS[config])
        want_stored = ops.reference.encode(x_in, lam_in, rot_in, cent)
        assert stored.dtype == want_stored.dtype == torch.uint8 and stored.shape == want_stored.shape
        got, want = unpack_codes(stored, spec[0]), unpack_codes(want_stored, spec[0])
        xt = x_in.float() if lam_in is None else (x / lam[None, :, None, :]) @ rot
        xt = codebook.subvectors(xt, spec[1])
        dist = lambda c: ((xt - cent[c.long()]) ** 2).sum(-1)  # noqa: E731
        torch.testing.assert_close(dist(got), dist(want), atol=1e-5, rtol=1e-5)
        # the interpreter rounds float32 -> bfloat16 toward zero, the GPU to nearest
        exact = x_in.dtype == torch.float32
        torch.testing.assert_close(
            values.float(), cent[got.long()].reshape(x.shape), atol=0, rtol=0 if exact else 2**-7
        )
        assert (ops.encode_triton(x_in, lam_in, rot_in, cent, config=ENCODE_CONFIGS[config]) == stored).all()


def _assert_score_aware_match(x, cent, stored, values, weight):
    """Triton's score-aware codes reach the reference's loss (equal codes but for near ties) and
    its values are its codes' centroids. A near tie of the nearest-centroid search of a scaled key
    ``a x`` is no tie for ``x``: where the two searches break it differently (1 row in 4,800 on an
    H200 with 4096-entry books) the candidate, and the row's loss, differ, so the loss must agree
    on all but such rows and on average."""
    entries = cent.shape[0]
    want = unpack_codes(ops.reference.encode(x, None, None, cent, weight), entries)
    got = unpack_codes(stored, entries)
    deq = lambda c: cent[c.long()].reshape(x.shape)  # noqa: E731
    loss = lambda c: parallel_loss(x.float(), deq(c), weight)  # noqa: E731
    mine, ref = loss(got), loss(want)
    assert torch.isclose(mine, ref, atol=1e-4, rtol=1e-4).float().mean() > 0.999
    assert mine.mean() <= ref.mean() * (1 + 1e-3)
    assert (got == want).float().mean() > 0.99
    torch.testing.assert_close(values.float(), deq(got).to(values.dtype).float(), atol=0, rtol=0)


@interp_only
@pytest.mark.parametrize("spec", SPECS)
def test_interp_encode_score_aware(spec):
    """parallel_weight > 1: one kernel launch per scale, the selection in torch."""
    gen = torch.Generator().manual_seed(spec[0] + spec[1])
    # 4096-entry books: 5 positions (the interpreter runs their tile programs one by one; the
    # programs' edges are test_interp_encode's)
    x = torch.randn(2, 2, 5 if spec[0] > 256 else 13, 32, generator=gen) * 2
    cent = torch.randn(*spec, generator=gen)
    stored, values = ops.encode_triton(x, None, None, cent, values=True, parallel_weight=8.0)
    _assert_score_aware_match(x, cent, stored, values, 8.0)


def _trellis_case(gen: torch.Generator, n: int, h: int, d: int, lbits: int, widest: int = 4):
    """Unit-scale components ``[n, h, d]``, per-head bits ``[h, d]`` (0..min(widest, L), decreasing like
    an allocation's, at least one coded) and tables ``[h, W, 2^L]`` of one codec."""
    from vecinfer_compile.codecs.trellis.walk import initial_luts

    bits = torch.randint(0, min(widest, lbits) + 1, (h, d), generator=gen).sort(1, descending=True).values
    bits[:, 0] = bits[:, 0].clamp_min(1)
    tables = torch.zeros(h, int(bits.max()), 1 << lbits)
    for i in range(h):
        for k, table in initial_luts(lbits, bits[i][bits[i] > 0].tolist(), seed=i).items():
            tables[i, k - 1] = table
    return torch.randn(n, h, d, generator=gen), bits, tables


def _assert_optimal_walks(x, bits, tables, walks):
    """Each head's walk costs what the torch Viterbi's costs (ties may pick other states)."""
    from vecinfer_compile.codecs.trellis.walk import reconstruct, viterbi

    for i in range(bits.shape[0]):
        cols = bits[i].nonzero()[:, 0].to(x.device)
        steps = bits[i][bits[i] > 0].tolist()
        luts = {k: tables[i, k - 1].to(x.device) for k in steps}
        want = viterbi(x[:, i, cols], steps, luts)
        cost = [((reconstruct(w, steps, luts) - x[:, i, cols]) ** 2).sum(1) for w in (walks[:, i, cols].long(), want)]
        torch.testing.assert_close(cost[0], cost[1], atol=1e-5, rtol=1e-5)
        assert bool((walks[:, i][:, bits[i].to(x.device) == 0] == 0).all())


@interp_only
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 5),
    h=st.sampled_from([1, 2, 8]),
    d=st.sampled_from([16, 64]),
    lbits=st.sampled_from([1, 3, 6]),
)
def test_interp_trellis_viterbi(seed, n, h, d, lbits):
    """The Viterbi kernel finds walks as cheap as the reference's: KV heads 1/2/8, widths 1..4; its
    packed output is those walks in the stored layout."""
    from vecinfer_compile.codecs.trellis.packing import pack_walks
    from vecinfer_compile.codecs.trellis.triton_kernels import viterbi_codes, viterbi_walks

    x, bits, tables = _trellis_case(torch.Generator().manual_seed(seed), n, h, d, lbits)
    walks = viterbi_walks(x, bits, tables)
    _assert_optimal_walks(x, bits, tables, walks)
    torch.testing.assert_close(viterbi_codes(x, bits, tables), pack_walks(walks, bits))  # the same launch, packed


@interp_only
def test_interp_trellis_viterbi_steps_wider_than_a_byte():
    """Steps of 9 and 10 bits (more than a trace byte holds) at 2^10 states: walks as cheap as the reference's."""
    from vecinfer_compile.codecs.trellis.triton_kernels import viterbi_walks

    x, bits, tables = _trellis_case(torch.Generator().manual_seed(3), 3, 2, 12, 10, widest=10)
    assert int(bits.max()) > 8
    _assert_optimal_walks(x, bits, tables, viterbi_walks(x, bits, tables))


def _trellis_decode_case(gen: torch.Generator, b: int, hkv: int, group: int, tmax: int, d: int, lbits: int):
    """Random key and value codecs of 2 bits an element (:func:`random_trellis_codec`), random
    stored codes ``[b, hkv, tmax, 2d/8]`` (any string is a valid code) and queries ``[b, hkv*group, d]``."""
    from vecinfer_compile.codecs.trellis.code import random_code as random_trellis_codec
    from vecinfer_compile.codecs.trellis.operands import TrellisOperands

    keys, values = (TrellisOperands.of(random_trellis_codec(gen, hkv, d, 2.0, lbits), "cpu") for _ in range(2))
    k_codes, v_codes = (
        torch.randint(0, 256, (b, hkv, tmax, d // 4), generator=gen, dtype=torch.uint8) for _ in range(2)
    )
    return torch.randn(b, hkv * group, d, generator=gen), k_codes, v_codes, keys, values


@interp_only
@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4, 16]),
    tmax=st.integers(1, 90),
    d=st.sampled_from([16, 64]),
    lbits=st.sampled_from([4, 10]),
    left_pad=st.booleans(),
    splits=st.sampled_from([None, 1, 3]),
    count_on_device=st.booleans(),
)
def test_interp_trellis_decode(seed, b, hkv, group, tmax, d, lbits, left_pad, splits, count_on_device):
    """Decode attention over trellis codes in the components = the reference (decode every key and
    value, then softmax): GQA 1-16, odd lengths, left padding (a row may have nothing to attend),
    the coded count as an int or as a tensor the kernel reads (a compiled step's)."""
    from vecinfer_compile.codecs.trellis.operands import query_components, values_out
    from vecinfer_compile.codecs.trellis.reference import decode_reference
    from vecinfer_compile.codecs.trellis.triton_kernels import decode_components

    gen = torch.Generator().manual_seed(seed)
    q, k_codes, v_codes, keys, values = _trellis_decode_case(gen, b, hkv, group, tmax, d, lbits)
    n_coded = int(torch.randint(0, tmax + 1, (1,), generator=gen))
    start = torch.randint(0, n_coded + 2, (b,), generator=gen) if left_pad else None
    want, want_lse = decode_reference(q, k_codes, v_codes, keys, values, n_coded, start, d**-0.5)
    count = torch.tensor(n_coded) if count_on_device else n_coded
    o, lse = decode_components(
        *query_components(q, keys), k_codes, v_codes, keys, values, count, start, d**-0.5, block_t=16, splits=splits
    )
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(values_out(o, lse, values), want, atol=1e-4, rtol=1e-4)


@interp_only
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 3]),
    tmax=st.integers(1, 70),
    d=st.sampled_from([16, 64]),
    lbits=st.sampled_from([4, 10]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_interp_trellis_entries_into(seed, b, hkv, tmax, d, lbits, dtype):
    """A chunk's prefix workspace of trellis codes: the unit entries of the first ``length`` slots of a
    row slice, position-major, as :meth:`TrellisOperands.entries` reads them (bf16 within its
    rounding: the interpreter's cast truncates); nothing past ``length`` written."""
    from vecinfer_compile.codecs.trellis.triton_kernels import entries_into

    gen = torch.Generator().manual_seed(seed)
    _, k_codes, _, keys, _ = _trellis_decode_case(gen, b + 1, hkv, 1, tmax, d, lbits)
    length = int(torch.randint(0, tmax + 1, (1,), generator=gen))
    out = torch.full((b, tmax, hkv, d), float("nan"), dtype=dtype)
    entries_into(k_codes[1:], keys, length, out[:, :length])
    want = keys.entries(k_codes[1:, :, :length].transpose(1, 2))
    torch.testing.assert_close(out[:, :length].float(), want, atol=0, rtol=0 if dtype == torch.float32 else 2**-7)
    assert out[:, length:].isnan().all()


# ----------------------------------------------------------------------------------- CUDA


def _sdpa_error(q, k, v, mask, causal, scale, want):
    """Max error of bf16 SDPA on dequantized, GQA-repeated K/V against ``want`` (float64)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.bfloat16()  # some SDPA backends want an additive mask in the query's dtype
    out = F.scaled_dot_product_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask, is_causal=causal, scale=scale
    )
    return (out.double().nan_to_num(0.0) - want).abs().max().item()


def _check_rule(got, want, baseline_err, atol=2e-3):
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * baseline_err + atol, f"err {err:.3g} > 2 * SDPA bf16 err {baseline_err:.3g} + {atol}"


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


# Every value of each axis (dtype, mask rule, shape, codebook geometry) appears, in 10 combinations
# rather than the 90 of the full product: each combination compiles its own Triton kernels, and
# the whole product did not fit the GPU suite's time (86 cases in 420 s).
ATTENTION_CASES = [
    (torch.bfloat16, "none", True, 0, 1, 1, (256, 4), (256, 4)),
    (torch.bfloat16, "bool", True, 37, 200, 333, (4096, 8), (256, 8)),
    (torch.bfloat16, "float", True, 0, 512, 512, (256, 4), (256, 4)),
    (torch.float16, "bool", False, 0, 200, 333, (256, 4), (256, 4)),
    (torch.float16, "none", True, 128, 512, 512, (4096, 8), (256, 8)),
    (torch.float16, "float", True, 0, 1, 1, (4096, 8), (256, 8)),
    (torch.float32, "none", True, 128, 200, 333, (256, 4), (256, 4)),
    (torch.float32, "bool", True, 37, 512, 512, (256, 4), (256, 4)),
    (torch.float32, "bool", False, 0, 1, 1, (4096, 8), (256, 8)),
    (torch.bfloat16, "none", True, 128, 200, 333, (4096, 8), (256, 8)),
]


@pytest.mark.parametrize("dtype,mask_kind,causal,residual,tq,tk,kspec,vspec", ATTENTION_CASES)
def test_cuda_attention(dtype, mask_kind, causal, residual, tq, tk, kspec, vspec):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(tq + tk)
    args = attention_case(
        gen,
        b=2,
        hkv=4,
        group=4,
        tq=tq,
        tk=tk,
        d=128,
        kspec=kspec,
        vspec=vspec,
        mask_kind=mask_kind,
        causal=causal,
        residual=residual,
        dtype=dtype,
    )
    if mask_kind == "bool":  # keep every row attending somewhere so SDPA has no NaN rows
        args[7][..., :, 0] = True
    args = _cuda(args)
    want = ops.reference.attention(args[0].float(), *args[1:]).double()
    got = torch.ops.vecinfer.attention(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
        return
    q, kc, vc, kcent, vcent, _, _, mask, _, scale, _ = args
    plain = ops.reference.attention(q.float(), kc, vc, kcent, vcent, None, None, mask, causal, scale, 0).double()
    base = _sdpa_error(
        q, ops.reference.dequantize(kc, kcent), ops.reference.dequantize(vc, vcent), mask, causal, scale, plain
    )
    _check_rule(got, want, base)


test_cuda_attention = pytest.mark.cuda(test_cuda_attention)


def _decode_args(dtype, score_seed, *, b, hkv, group, tmax, n_coded, r, n_window, kspec, vspec, with_start, d=128):
    gen = torch.Generator().manual_seed(score_seed)
    return _cuda(
        decode_case(
            gen,
            b=b,
            hkv=hkv,
            group=group,
            tmax=tmax,
            n_coded=n_coded,
            r=r,
            n_window=n_window,
            d=d,
            kspec=kspec,
            vspec=vspec,
            with_start=with_start,
            dtype=dtype,
        )
    )


def _decode_baseline_err(args, want):
    q, kc, vc, kcent, vcent, n_coded, kw, vw, n_window, start, scale = args
    nc, nw = int(n_coded), int(n_window)
    k = torch.cat([ops.reference.dequantize(kc, kcent)[:, :, :nc], kw.float()[:, :, :nw]], 2)
    v = torch.cat([ops.reference.dequantize(vc, vcent)[:, :, :nc], vw.float()[:, :, :nw]], 2)
    mask = None
    if start is not None:
        mask = (torch.arange(nc + nw, device=q.device)[None, :] >= start[:, None])[:, None, None, :]
    return _sdpa_error(q, k, v, mask, False, scale, want)


@pytest.mark.parametrize("score", ["dequant", "lut"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kspec,vspec", [((256, 4), (256, 4)), ((4096, 8), (4096, 8)), ((256, 2), (256, 2))])
def test_cuda_decode_realistic(score, dtype, kspec, vspec):
    """B=2, Hq=32, Hkv=8, D=128, Tmax=5000 (4871 coded), R=128 (77 in the window)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _decode_args(
        dtype,
        0,
        b=2,
        hkv=8,
        group=4,
        tmax=5000,
        n_coded=4871,
        r=128,
        n_window=77,
        kspec=kspec,
        vspec=vspec,
        with_start=True,
    )
    want = reference_decode(args)
    got = ops.decode_attention_triton(*bundle_coded_kv(args, 1), score=score, wrap=False)
    assert got.dtype == dtype
    _check_rule(got, want, _decode_baseline_err(args, want))
    torch.testing.assert_close(
        torch.ops.vecinfer.decode_attention_triton(*args),
        ops.decode_attention_triton(*bundle_coded_kv(args, 1)),
        atol=0,
        rtol=0,
    )
    _check_rule(
        torch.ops.vecinfer.decode_attention(*args), want, _decode_baseline_err(args, want)
    )  # CUDA kernel if it runs


test_cuda_decode_realistic = pytest.mark.cuda(test_cuda_decode_realistic)


@pytest.mark.parametrize("d", [256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_wide_heads(d, dtype):
    """Gemma 4's head dims (its coded full layers are 512 wide; the CUDA kernel takes 64/128, so
    the Triton kernels serve them): the tiles fit the GPU's shared memory (a 64 x 512 float32 tile
    did not) and the output is the reference's, eagerly and through the op."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _decode_args(
        dtype,
        d,
        b=2,
        hkv=2,
        group=4,
        tmax=3000,
        n_coded=2900,
        r=128,
        n_window=77,
        kspec=(256, 4),
        vspec=(256, 4),
        with_start=True,
        d=d,
    )
    want = reference_decode(args)
    _check_rule(ops.decode_attention_triton(*bundle_coded_kv(args, 1)), want, _decode_baseline_err(args, want))
    _check_rule(torch.ops.vecinfer.decode_attention(*args), want, _decode_baseline_err(args, want))


test_cuda_decode_wide_heads = pytest.mark.cuda(test_cuda_decode_wide_heads)


@pytest.mark.parametrize("tmax,n_coded,n_window", [(1, 0, 0), (1, 1, 0), (63, 0, 5), (4097, 4097, 128), (333, 100, 1)])
@pytest.mark.parametrize("score", ["dequant", "lut"])
def test_cuda_decode_edges(tmax, n_coded, n_window, score):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _decode_args(
        torch.bfloat16,
        tmax,
        b=3,
        hkv=2,
        group=8,
        tmax=tmax,
        n_coded=n_coded,
        r=128,
        n_window=n_window,
        kspec=(256, 4),
        vspec=(4096, 8),
        with_start=False,
    )
    want = reference_decode(args)
    got = ops.decode_attention_triton(*bundle_coded_kv(args, 1), score=score)
    if n_coded + n_window == 0:
        assert (got == 0).all()
        return
    _check_rule(got, want, _decode_baseline_err(args, want))


test_cuda_decode_edges = pytest.mark.cuda(test_cuda_decode_edges)


@pytest.mark.parametrize("entries,dims", SPECS)
def test_cuda_encode(entries, dims):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
    lam = torch.rand(8, 128, device="cuda") + 0.5
    rot = hadamard_matrix(128, torch.float32, "cuda")
    cent = torch.randn(entries, dims, device="cuda")
    for lam_in, rot_in in ((lam, rot), (None, None)):
        stored = torch.ops.vecinfer.encode(x, lam_in, rot_in, cent)
        want_stored = ops.reference.encode(x, lam_in, rot_in, cent)
        assert stored.dtype == want_stored.dtype and stored.shape == want_stored.shape
        got, want = unpack_codes(stored, entries), unpack_codes(want_stored, entries)
        xt = x.float() if lam_in is None else (x.float() / lam[None, :, None, :]) @ rot
        xt = codebook.subvectors(xt, dims)
        dist = lambda c: ((xt - cent[c.long()]) ** 2).sum(-1)  # noqa: E731
        torch.testing.assert_close(dist(got), dist(want), atol=1e-4, rtol=1e-4)
        values = torch.ops.vecinfer.quantize(x, lam_in, rot_in, cent)
        assert values.dtype == x.dtype
        # quantize picks its own nearest centroid: where it differs from encode's (a near tie), its
        # distance must be as small
        chosen = codebook.subvectors(values.float(), dims)
        exact = (values == cent[got.long()].reshape(x.shape).to(x.dtype)).reshape(chosen.shape).all(-1)
        assert exact.float().mean() > 0.999
        dist_q = ((xt - chosen) ** 2).sum(-1)
        torch.testing.assert_close(dist_q[~exact], dist(got)[~exact], atol=1e-2, rtol=1e-2)


test_cuda_encode = pytest.mark.cuda(test_cuda_encode)


@pytest.mark.cuda
@pytest.mark.parametrize("entries,dims", SPECS)
def test_cuda_encode_score_aware(entries, dims):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16) * 2
    cent = torch.randn(entries, dims, device="cuda")
    stored = torch.ops.vecinfer.encode(x, None, None, cent, 8.0)
    values = torch.ops.vecinfer.quantize(x, None, None, cent, 8.0)
    assert values.dtype == x.dtype
    _assert_score_aware_match(x, cent, stored, values, 8.0)


def test_cuda_compiled_ops_fullgraph_dynamic():
    """The ops inside ``torch.compile(fullgraph=True, dynamic=True)``: Inductor sees the kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(0)

    def step(*args):
        return torch.ops.vecinfer.attention(*args)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for tq in (17, 64):
        args = _cuda(
            attention_case(
                gen,
                b=1,
                hkv=2,
                group=4,
                tq=tq,
                tk=tq,
                d=128,
                kspec=(256, 4),
                vspec=(256, 4),
                mask_kind="none",
                causal=True,
                residual=5,
                dtype=torch.bfloat16,
            )
        )
        torch.testing.assert_close(compiled(*args), torch.ops.vecinfer.attention(*args), atol=2e-2, rtol=2e-2)
    dec = _decode_args(
        torch.bfloat16,
        1,
        b=2,
        hkv=8,
        group=4,
        tmax=1000,
        n_coded=900,
        r=128,
        n_window=3,
        kspec=(256, 4),
        vspec=(256, 4),
        with_start=False,
    )
    compiled_dec = torch.compile(lambda *a: torch.ops.vecinfer.decode_attention(*a), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled_dec(*dec), torch.ops.vecinfer.decode_attention(*dec), atol=2e-2, rtol=2e-2)


test_cuda_compiled_ops_fullgraph_dynamic = pytest.mark.cuda(test_cuda_compiled_ops_fullgraph_dynamic)


@pytest.mark.cuda
@pytest.mark.parametrize("lbits, widest", [(8, 4), (10, 4), (12, 4), (10, 10)])
def test_cuda_trellis_viterbi(lbits, widest):
    """The Viterbi kernel on the GPU at the codec's sizes (head_dim 128, 8 KV heads, up to 2^12 states,
    steps up to 10 bits: wider than a trace byte)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vecinfer_compile.codecs.trellis.triton_kernels import viterbi_walks

    x, bits, tables = _trellis_case(torch.Generator().manual_seed(lbits + widest), 33, 8, 128, lbits, widest)
    x, bits, tables = x.cuda(), bits.cuda(), tables.cuda()
    _assert_optimal_walks(x, bits, tables, viterbi_walks(x, bits, tables))


@pytest.mark.cuda
@pytest.mark.parametrize("group", [1, 4, 16])
def test_cuda_trellis_decode(group):
    """Decode attention over trellis codes on the GPU, head_dim 128, 2^10 states, left padding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vecinfer_compile.codecs.trellis.operands import TrellisOperands, decode_attention
    from vecinfer_compile.codecs.trellis.reference import decode_reference

    gen = torch.Generator().manual_seed(group)
    q, k_codes, v_codes, keys, values = _trellis_decode_case(gen, 3, 2, group, 1000, 128, 10)
    start = torch.tensor([0, 17, 990])
    args = [t.cuda() for t in (q, k_codes, v_codes)]
    keys, values = (TrellisOperands(*(t.cuda() for t in ops)) for ops in (keys, values))
    want, want_lse = decode_reference(*args, keys, values, 995, start.cuda(), 128**-0.5)
    got, lse = decode_attention(*args, keys, values, 995, start.cuda(), 128**-0.5)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
