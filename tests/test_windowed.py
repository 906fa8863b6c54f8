"""Windowed simulate attention (:mod:`vecinfer_compile.ops.split_attention.windowed`: a fused kernel over the
quantized keys and a blockwise band over the full-precision window, merged by log-sum-exp)
against an independent float64 computation and against ``vecinfer::attention``'s reference:
eager, compiled on CPU (Inductor, fullgraph, dynamic), through the SDPA pass, and on CUDA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_reference import SPECS, assert_close, attention_case, dequant64, naive_attention
from torch._dynamo.utils import counters

import vecinfer_compile.ops as ops
from vecinfer_compile.ops.split_attention.windowed import window_plan, windowed_attention

MASK_KINDS = ["none", "bool", "float", "left_pad", "left_pad_float"]


def make_mask(gen, kind, b, hq, tq, tk):
    """None; a random bool (True = attend) or additive float mask with broadcast dims and one fully
    masked row; or a left-padding mask as HF builds one (per-batch pad count, key ``j`` visible
    from query ``i`` when ``pad[b] <= j <= i + Tk - Tq``), bool or additive float (``-inf``).
    Rows of padding positions see no key."""
    if kind == "none":
        return None
    if kind.startswith("left_pad"):
        pad = torch.randint(0, tk, (b,), generator=gen)
        i = torch.arange(tq)[:, None] + (tk - tq)
        j = torch.arange(tk)[None, :]
        mask = ((j <= i)[None] & (j[None] >= pad[:, None, None]))[:, None]  # [B, 1, Tq, Tk]
        return mask if kind == "left_pad" else torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
    shape = (b if torch.rand(1, generator=gen) < 0.5 else 1, hq if torch.rand(1, generator=gen) < 0.5 else 1, tq, tk)
    row = int(torch.randint(0, tq, (1,), generator=gen))
    if kind == "bool":
        mask = torch.rand(shape, generator=gen) < 0.7
        mask[..., row, :] = False
        return mask
    mask = torch.randn(shape, generator=gen).masked_fill(torch.rand(shape, generator=gen) < 0.2, -math.inf)
    mask[..., row, :] = -math.inf
    return mask


def windowed_case(gen, *, b, hkv, group, tq, tk, d, mask_kind, causal, residual, dtype, kspec=(256, 4), vspec=(256, 4)):
    """``vecinfer::attention`` arguments (codes + full K/V in ``dtype``) and the matching
    ``windowed_attention`` arguments (dequantized K^/V^ in ``dtype``)."""
    args = list(
        attention_case(
            gen,
            b=b,
            hkv=hkv,
            group=group,
            tq=tq,
            tk=tk,
            d=d,
            kspec=kspec,
            vspec=vspec,
            mask_kind="none",
            causal=causal,
            residual=residual,
            dtype=dtype,
        )
    )
    args[5], args[6] = args[5].to(dtype), args[6].to(dtype)
    args[7] = make_mask(gen, mask_kind, b, hkv * group, tq, tk)
    q, kc, vc, kcent, vcent, kf, vf = args[:7]
    k_hat = ops.reference.dequantize(kc, kcent).to(dtype)
    v_hat = ops.reference.dequantize(vc, vcent).to(dtype)
    return tuple(args), (q, k_hat, kf, v_hat, vf)


def expected(args):
    """float64 naive attention over the (dtype-rounded) dequantized and full K/V."""
    q, kc, vc, kcent, vcent, kf, vf, mask, causal, scale, residual = args
    dt = q.dtype
    return naive_attention(
        q, dequant64(kc, kcent).to(dt), dequant64(vc, vcent).to(dt), kf, vf, mask, causal, scale, residual
    )


def run_windowed(win_args, op_args):
    q, k_hat, kf, v_hat, vf = win_args
    mask, causal, scale, residual = op_args[7], op_args[8], op_args[9], op_args[10]
    return windowed_attention(q, k_hat, kf, v_hat, vf, window_plan(q, kf, mask, causal, residual), scale)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tq=st.integers(1, 300),
    extra=st.integers(-8, 12),
    d=st.sampled_from([16, 32, 64, 128]),
    kspec=st.sampled_from(SPECS),
    vspec=st.sampled_from(SPECS),
    mask_kind=st.sampled_from(MASK_KINDS),
    causal=st.booleans(),
    residual=st.sampled_from([1, 3, 16, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_windowed_matches_naive_and_reference_op(
    seed, b, hkv, group, tq, extra, d, kspec, vspec, mask_kind, causal, residual, dtype
):
    """Eager windowed attention == float64 naive == ``vecinfer::attention`` over GQA ratios,
    Tq != Tk both ways, T < R and T > R, T not a multiple of R, masks (broadcast dims, left
    padding, fully masked rows), causal or not, fp32 and bf16 (at bf16 tolerance)."""
    gen = torch.Generator().manual_seed(seed)
    tk = max(1, tq + extra)
    op_args, win_args = windowed_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        tq=tq,
        tk=tk,
        d=d,
        mask_kind=mask_kind,
        causal=causal,
        residual=residual,
        dtype=dtype,
        kspec=kspec,
        vspec=vspec,
    )
    got = run_windowed(win_args, op_args)
    assert got.shape == op_args[0].shape
    assert_close(got, expected(op_args), dtype)
    assert_close(got, torch.ops.vecinfer.attention(*op_args).double(), dtype)


def _flash_semantics(q, k, v, scale, window=None):
    """A dense CPU stand-in for :func:`windowed._flash` with FlashAttention-2's documented
    semantics: causal, bottom-right aligned (``off = Tk - Tq``), key ``j`` visible to query ``i``
    iff ``j <= i + off`` and, with a window ``W``, ``j > i + off - W``; GQA by head groups."""
    tq, tk = q.shape[2], k.shape[2]
    back = torch.arange(tq)[:, None] + (tk - tq) - torch.arange(tk)[None, :]
    visible = (back >= 0) & (back < (tk + 1 if window is None else window))
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (k, v))
    s = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1).nan_to_num(0.0) @ v).to(q.dtype), lse.float()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tq=st.integers(1, 60),
    extra=st.integers(0, 40),
    causal=st.booleans(),
    residual=st.sampled_from([1, 5, 16, 100]),
)
def test_flash_band_plan_matches_naive(seed, b, hkv, group, tq, extra, causal, residual):
    """The plan's sliding-window band ``(keys, W)`` and the FlashAttention-2 / cuDNN forms of the
    quantized part, on the CPU: the GPU kernels replaced by a dense stand-in with their semantics,
    so what runs here is the plan's index arithmetic (top-left ``is_causal`` against the kernel's
    bottom-right window, Tk > Tq, R below and above the offset) against the float64 reference;
    MHA (group 1), GQA and MQA (one KV head), batch 1-3."""
    import vecinfer_compile.ops.split_attention.windowed as windowed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(windowed, "_flash_serves", lambda device: True)
        patch.setattr(windowed, "_flash", _flash_semantics)
        _check_flash_band(seed, b, hkv, group, tq, extra, causal, residual)


def _check_flash_band(seed, b, hkv, group, tq, extra, causal, residual):
    gen = torch.Generator().manual_seed(seed)
    tk = tq + extra
    op_args, win_args = windowed_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        tq=tq,
        tk=tk,
        d=16,
        mask_kind="none",
        causal=causal,
        residual=residual,
        dtype=torch.bfloat16,
    )
    q, k_hat, kf, v_hat, vf = win_args
    plan = window_plan(q, kf, None, causal, residual)
    assert plan.flash_band == ((tq, residual - extra) if causal else (tk, residual)) and plan.band_bias is None
    got = windowed_attention(q, k_hat, kf, v_hat, vf, plan, op_args[9])
    assert_close(got, expected(op_args), torch.bfloat16)


@pytest.mark.parametrize("tq,tk,residual,shift", [(10, 10, 3, 3), (10, 14, 3, 0), (10, 12, 3, 1), (5, 5, 16, 16)])
def test_plan_causal_form_shifts_and_builds_no_square_mask(tq, tk, residual, shift):
    """Causal without a tensor mask: the quantized part is the square causal problem of the
    queries from ``shift`` on (no [Tq, Tk] bias); the band bias is O(Tq * R)."""
    q, k = torch.zeros(2, 4, tq, 8), torch.zeros(2, 2, tk, 8)
    plan = window_plan(q, k, None, True, residual)
    assert plan.shift == shift and plan.quant_bias is None and plan.quant_rows is None
    block = min(residual, 128)
    nc = tq // block + 1
    assert tuple(plan.band_bias.shape) == (1, 1, nc, 1, block, block + residual - 1)
    assert tuple(plan.band_index.shape) == (nc * (block + residual - 1),)


def test_plan_bias_form_without_causality_or_with_a_mask():
    """Any other case composes the rule (and the mask) into one additive bias and the rows that
    see a quantized key; the band bias keeps the mask's batch and head dims."""
    q, k = torch.zeros(2, 4, 6, 8), torch.zeros(2, 2, 9, 8)
    plan = window_plan(q, k, None, False, 2)
    assert (
        plan.shift is None and tuple(plan.quant_bias.shape) == (1, 1, 7, 9) and plan.quant_bias.dtype == torch.float32
    )
    mask = torch.ones(2, 4, 6, 9, dtype=torch.bool)
    mask[1, 3, 2] = False
    plan = window_plan(q, k, mask, True, 2)
    assert tuple(plan.quant_rows.shape) == (2, 4, 6) and not plan.quant_rows[1, 3, 2]
    assert tuple(plan.band_bias.shape) == (2, 2, 4, 2, 2, 3)  # [B, Hkv, nc, G, block, slab]
    assert torch.isinf(plan.band_bias[1, 1, 1, 1, 0]).all()  # query head 3 = kv head 1, member 1; row 2


def test_window_plan_refuses_no_window():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="plain SDPA"):
        window_plan(q, q, None, True, 0)
    with pytest.raises(ValueError, match="bool .* or an additive float"):
        window_plan(q, q, torch.zeros(4, 4, dtype=torch.int64), True, 2)


def _compiled_forward(q, k_hat, k, v_hat, v, pad, mask_kind: str, causal: bool, residual: int):
    """Windowed attention with the left-padding mask computed inside the graph from ``pad``, as
    a model computes its mask (the case that crashed FlexAttention's CUDA lowering)."""
    mask = None
    if mask_kind != "none":
        tq, tk = q.shape[2], k.shape[2]
        i = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
        j = torch.arange(tk, device=q.device)[None, :]
        mask = ((j <= i)[None] & (j[None] >= pad[:, None, None]))[:, None]
        if mask_kind == "float":
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    return windowed_attention(q, k_hat, k, v_hat, v, window_plan(q, k, mask, causal, residual), q.shape[-1] ** -0.5)


def _compiled_case(tq, tk, mask_kind, causal, residual, dtype, device, *, d=32, group=2):
    """(inputs of _compiled_forward on ``device``, the float64 expected output on ``device``, the
    bool mask that _compiled_forward builds, on ``device``, or None)."""
    gen = torch.Generator().manual_seed(tq * 1000 + tk)
    op_args, win_args = windowed_case(
        gen, b=2, hkv=2, group=group, tq=tq, tk=tk, d=d, mask_kind="none", causal=causal, residual=residual, dtype=dtype
    )
    pad = torch.tensor([0, min(3, tk - 1)])
    op_args = list(op_args)
    if mask_kind != "none":
        i = torch.arange(tq)[:, None] + (tk - tq)
        j = torch.arange(tk)[None, :]
        op_args[7] = ((j <= i)[None] & (j[None] >= pad[:, None, None]))[:, None]
    want = expected(tuple(op_args)).to(device)
    mask = None if op_args[7] is None else op_args[7].to(device)
    return tuple(t.to(device) for t in win_args) + (pad.to(device),), want, mask


@pytest.mark.parametrize("mask_kind,causal", [("none", True), ("bool", False), ("float", False)])
def test_compiled_cpu_dynamic_two_lengths(mask_kind, causal):
    """Inductor on CPU, fullgraph, dynamic=True: the mask computed inside the graph, two square
    lengths in a row (above R, the first a multiple of it) run on one graph with symbolic lengths,
    a third with Tq != Tk compiles once more."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_compiled_forward, fullgraph=True, dynamic=True)
    residual = 16
    for n, (tq, tk) in enumerate(((160, 160), (77, 77), (37, 45))):
        inputs, want, _ = _compiled_case(tq, tk, mask_kind, causal, residual, torch.float32, "cpu")
        got = compiled(*inputs, mask_kind, causal, residual)
        assert_close(got, want, torch.float32)
        if n == 1:
            assert counters["stats"]["unique_graphs"] == 1  # the second length reused the dynamic graph


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_static_short(dtype):
    """Static shapes, T < R (no row has a quantized key in the causal form), bf16 at its tolerance."""
    torch._dynamo.reset()
    compiled = torch.compile(_compiled_forward, fullgraph=True)
    inputs, want, _ = _compiled_case(9, 9, "none", True, 16, dtype, "cpu")
    assert_close(compiled(*inputs, "none", True, 16), want, dtype)


def _dense_sdpa_baseline(q, k_hat, k, v_hat, v, mask, causal, scale, residual):
    """Torch SDPA in q's dtype over ``[K^ ; K~]`` with the window rule, causality and the mask
    materialised over ``[Tq, 2 Tk]`` (the low-precision baseline of the tolerance rule)."""
    tq, tk = q.shape[2], k.shape[2]
    i = torch.arange(tq, device=q.device)[:, None]
    j = torch.arange(tk, device=q.device)[None, :]
    back = i + (tk - tq) - j
    full = (back >= 0) & (back < residual)
    visible = torch.cat([~full, full], -1)[None, None]
    if causal:
        visible = visible & torch.cat([j <= i, j <= i], -1)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device)
    if mask is not None:
        mask = (
            mask.float()
            if mask.dtype != torch.bool
            else torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
        )
        bias = bias + torch.cat([mask, mask], -1)
    bias = bias.masked_fill(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(
        q,
        torch.cat([k_hat, k], 2),
        torch.cat([v_hat, v], 2),
        attn_mask=bias.to(q.dtype),
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.nan_to_num(0.0)


@pytest.mark.cuda
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4, 8]),
    tq=st.integers(1, 700),
    extra=st.integers(0, 300),
    d=st.sampled_from([64, 128]),
    mask_kind=st.sampled_from(["none", "none", "bool", "left_pad_float"]),
    causal=st.booleans(),
    residual=st.sampled_from([1, 7, 64, 128, 1000]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_cuda_eager_windowed_property(seed, b, hkv, group, tq, extra, d, mask_kind, causal, residual, dtype):
    """Eager on CUDA, random shapes: the kernels the plan picks (cuDNN or FlashAttention-2 for the
    quantized part and FlashAttention-2's sliding window for the band without a mask; the
    efficient kernel and the torch band with one) against the float64 reference, with the
    low-precision rule of :func:`test_cuda_compiled_windowed`. GQA 1-8, lengths that are no
    multiple of any block, R below, near and above T."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(seed)
    tk = tq + extra
    op_args, win_args = windowed_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        tq=tq,
        tk=tk,
        d=d,
        mask_kind=mask_kind,
        causal=causal,
        residual=residual,
        dtype=dtype,
    )
    want = expected(op_args).cuda()
    q, k_hat, k, v_hat, v = (t.cuda() for t in win_args)
    mask = None if op_args[7] is None else op_args[7].cuda()
    scale = d**-0.5
    plan = window_plan(q, k, mask, causal, residual)
    assert (plan.flash_band is not None) == (mask is None)  # no mask: FlashAttention-2's window runs the band
    got = windowed_attention(q, k_hat, k, v_hat, v, plan, scale)
    err = (got.double() - want).abs().max().item()
    base = (
        (_dense_sdpa_baseline(q, k_hat, k, v_hat, v, mask, causal, scale, residual).double() - want).abs().max().item()
    )
    assert err <= 2 * base + 2e-3, f"err {err:.3g} > 2 * SDPA {dtype} err {base:.3g} + 2e-3"


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype,mask_kind,causal,residual,tq,tk,d",
    [
        (torch.bfloat16, "none", True, 128, 1024, 1024, 128),  # cuDNN (sm90+) or flash, shifted; flash band
        (torch.bfloat16, "none", True, 128, 200, 333, 128),  # as above, Tk > Tq: shift 0
        (torch.float16, "none", True, 37, 300, 320, 128),  # as above, shift 17
        (torch.bfloat16, "none", True, 128, 1, 300, 128),  # one query
        (torch.bfloat16, "none", True, 128, 100, 100, 128),  # T < R: no quantized key
        (torch.bfloat16, "none", False, 37, 200, 333, 128),  # efficient, rule bias; flash band
        (torch.bfloat16, "bool", True, 128, 200, 333, 128),  # efficient, mask bias; torch band
        (torch.bfloat16, "float", True, 5, 1024, 1024, 128),
        (torch.float16, "bool", False, 128, 200, 333, 128),
        (torch.bfloat16, "none", True, 16, 300, 300, 36),  # head dim 36: the padded kernels, torch band
        (torch.float32, "none", True, 128, 1024, 1024, 128),  # efficient, is_causal, shifted
        (torch.float32, "float", True, 37, 200, 333, 128),
        (torch.float32, "none", True, 128, 333, 200, 128),  # Tk < Tq: bias form
    ],
)
def test_cuda_compiled_windowed(dtype, mask_kind, causal, residual, tq, tk, d):
    """Compiled (fullgraph) on CUDA against the float64 reference, with the low-precision rule:
    err(ours) <= 2 * err(torch SDPA in ``dtype`` over [K^ ; K~] with the composed mask
    materialised) + atol; fp32 within 1e-3."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(tq + tk)
    op_args, win_args = windowed_case(
        gen,
        b=2,
        hkv=2,
        group=4,
        tq=tq,
        tk=tk,
        d=d,
        mask_kind=mask_kind,
        causal=causal,
        residual=residual,
        dtype=dtype,
        vspec=(256, 4),
    )
    want = expected(op_args).cuda()
    q, k_hat, k, v_hat, v = (t.cuda() for t in win_args)
    mask = None if op_args[7] is None else op_args[7].cuda()
    scale = d**-0.5

    def forward(q, k_hat, k, v_hat, v, mask):
        return windowed_attention(q, k_hat, k, v_hat, v, window_plan(q, k, mask, causal, residual), scale)

    torch._dynamo.reset()  # each case compiles fresh (no recompile limit, no fallback to eager)
    got = torch.compile(forward, fullgraph=True)(q, k_hat, k, v_hat, v, mask)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.double() - want).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-3
        return
    sdpa = _dense_sdpa_baseline(q, k_hat, k, v_hat, v, mask, causal, scale, residual)
    base = (sdpa.double() - want).abs().max().item()
    assert err <= 2 * base + 2e-3, f"err {err:.3g} > 2 * SDPA {dtype} err {base:.3g} + 2e-3"


@pytest.mark.cuda
@pytest.mark.parametrize(
    "mask_kind,dtype", [("bool", torch.bfloat16), ("none", torch.bfloat16), ("float", torch.float32)]
)
def test_cuda_compiled_mask_inside_graph_dynamic(mask_kind, dtype):
    """The FlexAttention crash on a GPU: a mask computed inside the compiled graph, dynamic=True,
    two lengths in a row (one graph with symbolic lengths), then a third with Tq != Tk."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_compiled_forward, fullgraph=True, dynamic=True)
    residual, causal = 128, mask_kind == "none"
    for n, (tq, tk) in enumerate(((1024, 1024), (777, 777), (300, 410))):
        inputs, want, mask = _compiled_case(tq, tk, mask_kind, causal, residual, dtype, "cuda", d=128, group=4)
        got = compiled(*inputs, mask_kind, causal, residual)
        assert got.dtype == dtype and got.shape == inputs[0].shape
        err = (got.double() - want).abs().max().item()
        if dtype == torch.float32:
            assert err <= 1e-3, (tq, tk, err)
        else:
            base = (
                (_dense_sdpa_baseline(*inputs[:5], mask, causal, 128**-0.5, residual).double() - want)
                .abs()
                .max()
                .item()
            )
            assert err <= 2 * base + 2e-3, (tq, tk, err, base)
        if n == 1:
            assert counters["stats"]["unique_graphs"] == 1


def test_backend_builds_one_window_plan_per_graph():
    """Through the backend on a two-layer model: both SDPA calls become windowed attention over
    one shared window plan; the output matches the eager simulate with the same codebooks."""
    from vecinfer_compile.backend import vecinfer_backend
    from vecinfer_compile.codebooks import VecInferCodebooks
    from vecinfer_compile.simulate import simulation
    from vecinfer_compile.testing import model_geometry, random_layer_codebooks, tiny_model

    model = tiny_model("llama")
    layers = [random_layer_codebooks(2, 16, bits=2.0, seed=i) for i in range(2)]
    codebooks = VecInferCodebooks("vecinfer", 2.0, layers, model_geometry(model.config))
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    counters.clear()
    with torch.no_grad():
        compiled = torch.compile(model, backend=vecinfer_backend.configure(codebooks, residual=6), fullgraph=True)
        got = compiled(input_ids=ids, use_cache=False).logits
        with simulation(model, "vecinfer", bits=2.0, codebooks=codebooks, residual=6):
            want = model(input_ids=ids, use_cache=False).logits
    assert counters["vecinfer"]["sdpa_rewrites"] == 2 and counters["vecinfer"]["window_plans"] == 1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_backend_dynamic_with_padding_mask_matches_eager_simulate():
    """The eval-ppl case that crashed FlexAttention on a GPU, on CPU: an HF model through the
    backend with a window, dynamic=True, HF's own mask computed inside the graph (left padding),
    two lengths in a row on one graph, against the eager simulate."""
    from vecinfer_compile.backend import vecinfer_backend
    from vecinfer_compile.codebooks import VecInferCodebooks
    from vecinfer_compile.simulate import simulation
    from vecinfer_compile.testing import model_geometry, random_layer_codebooks, tiny_model

    model = tiny_model("llama")
    layers = [random_layer_codebooks(2, 16, bits=2.0, seed=i) for i in range(2)]
    codebooks = VecInferCodebooks("vecinfer", 2.0, layers, model_geometry(model.config))
    compiled = torch.compile(
        model, backend=vecinfer_backend.configure(codebooks, residual=5), fullgraph=True, dynamic=True
    )
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for t in (23, 31):
            ids = torch.randint(0, model.config.vocab_size, (2, t), generator=torch.Generator().manual_seed(t))
            attention_mask = torch.ones(2, t, dtype=torch.long)
            attention_mask[1, :4] = 0  # left padding
            got = compiled(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
            with simulation(model, "vecinfer", bits=2.0, codebooks=codebooks, residual=5):
                want = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
            torch.testing.assert_close(got[:, 4:], want[:, 4:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
