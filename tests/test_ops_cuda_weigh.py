"""The CUDA encoder of score-aware and error-weighted codes (``ops/cuda_weigh.cu``) against the
torch forms (:mod:`vecinfer_compile.quant.weighted_codes`, :mod:`vecinfer_compile.quant.score_aware`).

- CPU: both kernels compile with NVRTC to an sm_90 cubin for every preset, head_dim 64/128/256
  and every input dtype; the choice rules of the searched append and of ``weigh_codes``.
- ``cuda``: ``vq_weigh_rows`` against :func:`weigh_stored` on random shapes and metrics
  (hypothesis: every preset, GQA-sized head counts, odd lengths, weights 1 and 8); a one-sub-vector
  book where the descent is an exhaustive search (the kernel must find the brute-force optimum);
  the searched append (``vq_weigh_flush`` then the append kernel without its encode) against
  :func:`append_reference`, one call and a sequence replayed from a CUDA graph.

The arithmetic order differs from torch's, so a near-tie may resolve the other way and the descent
then walk to another local optimum: the comparisons are on the loss (every row no worse than its
start; the mean within 0.1% of torch's; codes equal on at least 90% of the rows), not on codes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_cuda_append import _args, _clone
from test_ops_cuda_decode import PRESET_SPECS, needs_cuda, nvrtc_or_skip

from vecinfer_compile.ops import append, encode, kernel_request
from vecinfer_compile.ops.append import append_reference, encode_flush
from vecinfer_compile.ops.cuda import append as cuda_append
from vecinfer_compile.ops.cuda import weigh as cuda_weigh
from vecinfer_compile.ops.cuda.nvrtc import compile_source
from vecinfer_compile.presets import PRESETS
from vecinfer_compile.quant.packing import unpack_codes
from vecinfer_compile.quant.weighted_codes import weigh_stored, weighted_loss


def spd(heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random symmetric positive definite ``[heads, dim, dim]`` with a spread of eigenvalues."""
    a = torch.randn(heads, dim, dim, generator=gen)
    m = a @ a.transpose(-1, -2) / dim + 0.1 * torch.eye(dim)
    return (m + m.transpose(-1, -2)) / 2


def dequant(stored: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    idx = unpack_codes(stored, centroids.shape[0])
    return centroids[idx].reshape(*idx.shape[:-1], idx.shape[-1] * centroids.shape[1])


def assert_same_descent(x, start, got, want, centroids, metric, weight, what):
    """The kernel's stored codes ``got`` against torch's ``want`` from the codes ``start`` (all
    ``[B, H, T, W]``): see the module docstring."""
    c = centroids.float()
    loss = {
        k: weighted_loss(x.float(), dequant(v, c), metric.float(), weight).double()
        for k, v in (("start", start), ("got", got), ("want", want))
    }
    scale = loss["start"].abs().mean() + 1e-6
    assert torch.all(loss["got"] <= loss["start"] + 1e-4 * scale), f"{what}: a row's loss rose above its start"
    assert abs(float(loss["got"].mean() - loss["want"].mean())) <= 1e-3 * float(scale), (
        f"{what}: mean loss {float(loss['got'].mean()):.6g} vs torch {float(loss['want'].mean()):.6g}"
    )
    same = (unpack_codes(got, c.shape[0]) == unpack_codes(want, c.shape[0])).all(-1).float().mean()
    assert float(same) >= 0.9, f"{what}: codes equal on only {float(same):.1%} of the rows"


@pytest.mark.parametrize("kspec,vspec", PRESET_SPECS)
def test_cuda_weigh_source_compiles_for_sm90(kspec, vspec):
    nvrtc_or_skip()
    for head_dim, fmt in ((128, 2), (64, 1), (256, 0)):
        variant = cuda_weigh.WeighVariant(head_dim, *kspec, *vspec, fmt)
        for name in ("vq_weigh_rows", "vq_weigh_flush"):
            image, is_cubin = compile_source(cuda_weigh.source(), name, 90, ["--std=c++17", *variant.defines()])
            assert is_cubin and name.encode() in image
    append = cuda_append.AppendVariant(128, *kspec, *vspec, False, 1, False, True, encode=False)
    image, _ = compile_source(cuda_append.source(), "vq_append", 90, ["--std=c++17", *append.defines()])
    assert b"vq_append" in image


def test_the_append_asks_for_the_search_when_the_codes_need_it(monkeypatch, caplog):
    """Score-aware keys or metrics make the append ``searched``; a reason against it sends the step
    to the torch form with a warning (the torch search is ~20x slower), and an explicit 'cuda'
    request raises."""
    seen = []

    def reason(key, k_window, kc, vc, searched=False):
        seen.append(searched)
        return "no window" if searched else None

    monkeypatch.setattr(cuda_append, "unsupported_reason", reason)
    monkeypatch.setattr(cuda_append, "build_error", lambda *a, **k: None)
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    key = torch.zeros(1, 2, 1, 32)
    args = (key, key, None, None, None, None, None, None, None, None, None, None, None, None)
    metric = torch.eye(32).expand(2, 32, 32)
    assert append.choose_append(*args, 1.0) == "cuda" and seen == [False]
    with caplog.at_level(logging.WARNING, logger=kernel_request.log.name):
        assert append.choose_append(*args, 8.0) == "torch"
        assert append.choose_append(*args, 1.0, metric, metric) == "torch"
    assert seen == [False, True, True] and "no window" in caplog.text
    with pytest.raises(RuntimeError, match="no window"), kernel_request.use_decode_kernel("cuda"):
        append.choose_append(*args, 1.0, metric, metric)


def test_weigh_codes_takes_the_torch_descent_when_the_kernel_cannot_run(monkeypatch, caplog):
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    x, c = torch.zeros(1, 2, 3, 32), torch.zeros(256, 4)
    with kernel_request.use_decode_kernel("triton"):
        assert encode.choose_weigh(x, c) == "torch"
    with caplog.at_level(logging.WARNING, logger=kernel_request.log.name):
        assert encode.choose_weigh(x, c) == "torch"  # CPU tensors
    assert "torch descent" in caplog.text
    with pytest.raises(RuntimeError, match="not CUDA"), kernel_request.use_decode_kernel("cuda"):
        encode.choose_weigh(x, c)


# --- GPU -----------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    spec=st.sampled_from(sorted({(p.key.entries, p.key.dims) for p in PRESETS.values()})),
    d=st.sampled_from([64, 128]),
    b=st.integers(1, 2),
    h=st.sampled_from([1, 2, 8]),
    t=st.integers(1, 70),
    weight=st.sampled_from([1.0, 8.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_rows_kernel_matches_the_torch_descent(seed, spec, d, b, h, t, weight, dtype):
    gen = torch.Generator().manual_seed(seed)
    entries, dims = spec
    x = (torch.randn(b, h, t, d, generator=gen) * 2).to(dtype)
    c = torch.randn(entries, dims, generator=gen)
    m = spd(h, d, gen)
    start = encode_flush(x.float(), c, weight)
    want = weigh_stored(x, start, c, m, weight)
    got = cuda_weigh.weigh_rows_cuda(x.cuda(), start.cuda(), c.cuda(), m.cuda(), weight).cpu()
    assert got.shape == want.shape and got.dtype == torch.uint8
    assert_same_descent(x, start, got, want, c, m, weight, f"{spec} d={d} w={weight} {dtype}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("weight", [1.0, 8.0])
def test_one_subvector_the_kernel_finds_the_brute_force_optimum(weight):
    """head_dim 8 with 8-dim centroids: one sub-vector, so one sweep is an exhaustive search."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 500, 8, generator=gen)
    c = torch.randn(256, 8, generator=gen)
    m = spd(2, 8, gen)
    got = cuda_weigh.weigh_rows_cuda(x.cuda(), encode_flush(x, c).cuda(), c.cuda(), m.cuda(), weight).cpu()
    every = c[None, None, None].expand(1, 2, 500, 256, 8)
    losses = weighted_loss(
        x[:, :, :, None].expand_as(every).reshape(1, 2, -1, 8), every.reshape(1, 2, -1, 8), m, weight
    ).reshape(1, 2, 500, 256)
    chosen = losses.gather(-1, got.long())[..., 0]
    torch.testing.assert_close(chosen, losses.min(-1).values, rtol=1e-5, atol=1e-5)


def _searched_args(gen, *, specs, b, hkv, d, tmax, r, n_coded, n_window, weight, metrics, dtype):
    args = _args(
        gen,
        b=b,
        hkv=hkv,
        d=d,
        tmax=tmax,
        r=r,
        n_coded=n_coded,
        n_window=n_window,
        kspec=specs[0],
        vspec=specs[1],
        dtype=dtype,
        lam=True,
        matrix=1,
        device="cuda",
    )
    args["key_parallel_weight"] = weight
    args["key_metric"] = spd(hkv, d, gen).cuda() if metrics else None
    args["value_metric"] = spd(hkv, d, gen).cuda() if metrics else None
    return args


def _check_searched(before, got, want, what):
    """Everything but the written codes equal to the reference's; those of the same loss (the
    leaving token is window slot 0, untouched by the transform)."""
    c = int(before["n_coded"])
    for name in ("n_coded", "n_window", "arrivals"):
        assert torch.equal(got[name], want[name]), f"{what}: {name}"
    w = int(want["n_window"])  # slots past it hold nothing (the reference fills them with copies)
    assert torch.equal(got["v_window"][:, :, :w], want["v_window"][:, :, :w]), f"{what}: v_window"
    ulp = 2**-7 if got["k_window"].dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(
        got["k_window"][:, :, :w].float(), want["k_window"][:, :, :w].float(), rtol=ulp, atol=1e-3
    )
    flushed = int(want["n_coded"]) > c
    for side, weight, metric in (
        ("k", before["key_parallel_weight"], before["key_metric"]),
        ("v", 1.0, before["value_metric"]),
    ):
        codes, cent = got[f"{side}_codes"], before[f"{side}_centroids"]
        other = [s for s in range(codes.shape[2]) if not (flushed and s == c)]
        assert torch.equal(codes[:, :, other], before[f"{side}_codes"][:, :, other]), f"{what}: {side} codes beside {c}"
        if flushed:
            x = before[f"{side}_window"][:, :, :1]
            start = encode_flush(x.float(), cent, weight)
            m = torch.eye(x.shape[-1], device=x.device).expand(x.shape[1], -1, -1) if metric is None else metric
            assert_same_descent(
                x,
                start,
                codes[:, :, c : c + 1],
                want[f"{side}_codes"][:, :, c : c + 1],
                cent,
                m,
                weight,
                f"{what} {side}",
            )


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    specs=st.sampled_from(PRESET_SPECS),
    d=st.sampled_from([64, 128]),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2, 8]),
    r=st.sampled_from([1, 7, 128]),
    window=st.sampled_from(["partial", "full"]),
    weight=st.sampled_from([1.0, 8.0]),
    metrics=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_searched_append_matches_reference(seed, specs, d, b, hkv, r, window, weight, metrics, dtype):
    if weight == 1.0 and not metrics:
        metrics = True  # plain nearest codes are test_ops_cuda_append's
    gen = torch.Generator().manual_seed(seed)
    before = _searched_args(
        gen,
        specs=specs,
        b=b,
        hkv=hkv,
        d=d,
        tmax=40,
        r=r,
        n_coded=17,
        n_window=r if window == "full" else r // 2,
        weight=weight,
        metrics=metrics,
        dtype=dtype,
    )
    assert append.choose_append(*before.values()) == "cuda"
    want, got = _clone(before), _clone(before)
    append_reference(*want.values())
    torch.ops.vecinfer.cache_append_cuda(*got.values())
    _check_searched(before, got, want, f"{specs} d={d} r={r} w={weight} metrics={metrics}")


@pytest.mark.cuda
@needs_cuda
def test_searched_append_sequence_in_a_cuda_graph():
    """Both launches captured once and replayed 20 times against 20 reference appends."""
    gen = torch.Generator().manual_seed(5)
    state = _searched_args(
        gen,
        specs=((256, 4), (256, 4)),
        b=2,
        hkv=8,
        d=128,
        tmax=64,
        r=5,
        n_coded=10,
        n_window=0,
        weight=8.0,
        metrics=True,
        dtype=torch.bfloat16,
    )
    want = _clone(state)
    keys = torch.randn(20, *state["key"].shape, generator=gen).to("cuda", torch.bfloat16)
    values = torch.randn(20, *state["value"].shape, generator=gen).to("cuda", torch.bfloat16)
    torch.ops.vecinfer.cache_append_cuda(*_clone(state).values())  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.vecinfer.cache_append_cuda(*state.values())
    windows = []
    for i in range(20):
        windows.append((want["k_window"][:, :, :1].clone(), want["v_window"][:, :, :1].clone()))
        state["key"].copy_(keys[i]), state["value"].copy_(values[i])
        want["key"], want["value"] = keys[i], values[i]
        graph.replay()
        append_reference(*want.values())
    torch.cuda.synchronize()
    assert int(state["n_coded"]) == int(want["n_coded"]) == 25 and int(state["n_window"]) == 5
    for name in ("arrivals", "v_window"):
        assert torch.equal(state[name], want[name]), name
    # tokens 0..14 left the window at steps 5..19, as window slot 0 of the reference's state then
    kx = torch.cat([k for k, _ in windows[5:]], 2)
    vx = torch.cat([v for _, v in windows[5:]], 2)
    for side, x, weight, metric in (("k", kx, 8.0, state["key_metric"]), ("v", vx, 1.0, state["value_metric"])):
        cent = state[f"{side}_centroids"]
        start = encode_flush(x.float(), cent, weight)
        assert_same_descent(
            x,
            start,
            state[f"{side}_codes"][:, :, 10:25],
            want[f"{side}_codes"][:, :, 10:25],
            cent,
            metric,
            weight,
            f"graph {side}",
        )


@pytest.mark.cuda
@needs_cuda
def test_weigh_codes_op_dispatches_to_the_kernel(monkeypatch):
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2, 33, 128, generator=gen).cuda()
    c = torch.randn(256, 4, generator=gen).cuda()
    m = spd(2, 128, gen).cuda()
    start = encode_flush(x, c, 8.0)
    assert encode.choose_weigh(x, c) == "cuda"
    assert torch.equal(
        torch.ops.vecinfer.weigh_codes(x, start, c, m, 8.0), cuda_weigh.weigh_rows_cuda(x, start, c, m, 8.0)
    )
    monkeypatch.setenv(kernel_request.ENV, "triton")
    assert torch.equal(torch.ops.vecinfer.weigh_codes(x, start, c, m, 8.0), weigh_stored(x, start, c, m, 8.0))
