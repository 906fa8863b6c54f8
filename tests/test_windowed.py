"""Windowed simulate attention (FlexAttention over ``[K^ ; K~]``, :mod:`vecinfer_compile.passes.windowed`)
against an independent float64 computation and against ``vecinfer::attention``'s reference: the
block structure, eager, compiled on CPU (Inductor), through the SDPA pass, and on CUDA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

import vecinfer_compile.ops as ops
from test_ops_reference import SPECS, assert_close, attention_case, dequant64, naive_attention
from vecinfer_compile.passes.windowed import (BLOCK, dense_windowed, _index_block_mask, _mask_mod, window_mask,
                                              windowed_attention)


def windowed_case(gen, *, b, hkv, group, tq, tk, d, mask_kind, causal, residual, dtype, kspec=(256, 4), vspec=(256, 4)):
    """``vecinfer::attention`` arguments (codes + full K/V in ``dtype``) and the matching
    ``windowed_attention`` arguments (dequantized K^/V^ in ``dtype``)."""
    args = list(attention_case(gen, b=b, hkv=hkv, group=group, tq=tq, tk=tk, d=d, kspec=kspec, vspec=vspec,
                               mask_kind=mask_kind, causal=causal, residual=residual, dtype=dtype))
    args[5], args[6] = args[5].to(dtype), args[6].to(dtype)
    q, kc, vc, kcent, vcent, kf, vf, mask = args[:8]
    k_hat = ops.reference.dequantize(kc, kcent).to(dtype)
    v_hat = ops.reference.dequantize(vc, vcent).to(dtype)
    return tuple(args), (q, k_hat, kf, v_hat, vf)


def expected(args):
    """float64 naive attention over the (dtype-rounded) dequantized and full K/V."""
    q, kc, vc, kcent, vcent, kf, vf, mask, causal, scale, residual = args
    dt = q.dtype
    return naive_attention(q, dequant64(kc, kcent).to(dt), dequant64(vc, vcent).to(dt), kf, vf, mask, causal, scale, residual)


def run_windowed(flex_args, op_args, flex):
    q, k_hat, kf, v_hat, vf = flex_args
    mask, causal, scale, residual = op_args[7], op_args[8], op_args[9], op_args[10]
    window = window_mask(q, kf, mask, causal, residual, flex=flex)
    assert (window.block_mask is not None) == flex
    return windowed_attention(q, k_hat, kf, v_hat, vf, window, scale)


@settings(max_examples=40, deadline=None)
@given(tq=st.integers(1, 300), extra=st.integers(0, 140), residual=st.sampled_from([1, 3, 100, 128, 129, 1000]),
       causal=st.booleans())
def test_index_block_mask_equals_dense_evaluation(tq, extra, residual, causal):
    """The block counts computed from row intervals equal FlexAttention's own evaluation of the
    mask over every (query, key) pair: same partial and full blocks, same dense mask."""
    tk = tq + extra
    ours = _index_block_mask(tq, tk, residual, causal, "cpu")
    dense = create_block_mask(_mask_mod(tq, tk, residual, causal, None), None, None, tq, 2 * tk, device="cpu",
                              BLOCK_SIZE=BLOCK)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(dense, name)), name
    assert torch.equal(ours.to_dense(), dense.to_dense())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    tq=st.integers(1, 160),
    extra=st.integers(0, 9),
    d=st.sampled_from([16, 32]),
    kspec=st.sampled_from(SPECS),
    vspec=st.sampled_from(SPECS),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    causal=st.booleans(),
    residual=st.sampled_from([1, 3, 17, 128, 1000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    flex=st.booleans(),
)
def test_windowed_matches_naive_and_reference_op(seed, b, hkv, group, tq, extra, d, kspec, vspec, mask_kind, causal,
                                                 residual, dtype, flex):
    """Eager windowed attention, FlexAttention and dense forms, == float64 naive ==
    ``vecinfer::attention`` (today's path), over GQA ratios, T < R and T > R, lengths across
    block edges, masks (broadcast dims, fully masked rows) and dtypes."""
    gen = torch.Generator().manual_seed(seed)
    op_args, flex_args = windowed_case(gen, b=b, hkv=hkv, group=group, tq=tq, tk=tq + extra, d=d, mask_kind=mask_kind,
                                       causal=causal, residual=residual, dtype=dtype, kspec=kspec, vspec=vspec)
    got = run_windowed(flex_args, op_args, flex)
    assert got.shape == op_args[0].shape
    assert_close(got, expected(op_args), dtype)
    assert_close(got, torch.ops.vecinfer.attention(*op_args).double(), dtype)


def test_window_mask_refuses_no_window():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="plain SDPA"):
        window_mask(q, q, None, True, 0)
    with pytest.raises(ValueError, match="bool .* or an additive float"):
        window_mask(q, q, torch.zeros(4, 4, dtype=torch.int64), True, 2)


def _compiled_forward(q, k_hat, k, v_hat, v, mask, causal: bool, residual: int):
    if mask is not None:  # computed in the graph, as a model's mask is
        mask = mask if mask.dtype == torch.bool else mask * 1.0
    return windowed_attention(q, k_hat, k, v_hat, v, window_mask(q, k, mask, causal, residual), q.shape[-1] ** -0.5)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_compiled_cpu_matches_naive_with_symbolic_lengths(mask_kind):
    """Inductor on CPU (fullgraph; the dense form there), a mask computed inside the graph as a
    model's is; the second length compiles once with symbolic lengths (automatic dynamic: heads
    stay static, as a model's do)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_compiled_forward, fullgraph=True)
    for tq, tk in ((150, 157), (37, 40), (300, 300)):
        residual = 5
        gen = torch.Generator().manual_seed(tq)
        op_args, flex_args = windowed_case(gen, b=2, hkv=2, group=2, tq=tq, tk=tk, d=32, mask_kind=mask_kind,
                                           causal=True, residual=residual, dtype=torch.float32)
        got = compiled(*flex_args, op_args[7], True, residual)
        assert_close(got, expected(op_args), torch.float32)
    if mask_kind == "none":  # (random masks change their broadcast dims, hence their graphs)
        assert counters["stats"]["unique_graphs"] == 2  # static, then symbolic lengths (reused by the third)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,mask_kind,causal,residual,tq,tk", [
    (torch.bfloat16, "none", True, 128, 1024, 1024), (torch.bfloat16, "none", False, 37, 200, 333),
    (torch.bfloat16, "bool", True, 128, 200, 333), (torch.bfloat16, "float", True, 5, 1024, 1024),
    (torch.bfloat16, "none", True, 128, 1, 300), (torch.float16, "bool", False, 128, 200, 333),
    (torch.float32, "none", True, 128, 1024, 1024), (torch.float32, "float", True, 37, 200, 333),
])
def test_cuda_compiled_windowed(dtype, mask_kind, causal, residual, tq, tk):
    """FlexAttention's Triton kernel (compiled) against the float64 reference, with the
    low-precision rule: err(ours) <= 2 * err(torch SDPA in ``dtype`` over [K^ ; K~] with the
    composed mask materialised) + atol."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(tq + tk)
    op_args, flex_args = windowed_case(gen, b=2, hkv=2, group=4, tq=tq, tk=tk, d=128, mask_kind=mask_kind,
                                       causal=causal, residual=residual, dtype=dtype)
    if mask_kind == "bool":  # every row attends somewhere: SDPA has no NaN rows
        op_args[7][..., :, 0] = True
    want = expected(op_args).cuda()
    q, k_hat, k, v_hat, v = (t.cuda() for t in flex_args)
    mask = None if op_args[7] is None else op_args[7].cuda()
    torch._dynamo.reset()  # each case compiles fresh (no recompile limit, no fallback to eager)
    got = torch.compile(_compiled_forward, fullgraph=True)(q, k_hat, k, v_hat, v, mask, causal, residual)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.double() - want).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-3
        return
    window = window_mask(q, k, mask, causal, residual)
    sdpa = dense_windowed(q, torch.cat([k_hat, k], 2), torch.cat([v_hat, v], 2), window, q.shape[-1] ** -0.5)
    base = (sdpa.double() - want).abs().max().item()
    assert err <= 2 * base + 2e-3, f"err {err:.3g} > 2 * SDPA {dtype} err {base:.3g} + 2e-3"


def test_backend_builds_one_window_mask_per_graph():
    """Through the backend on a two-layer model: both SDPA calls become windowed attention over
    one shared window mask; the output matches the eager simulate with the same codebooks."""
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
    assert counters["vecinfer"]["sdpa_rewrites"] == 2 and counters["vecinfer"]["window_masks"] == 1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
