"""The CUDA cache append (``ops/cuda/append.cu``), its torch reference and the choice between them.

- CPU: every preset's and key transform's variant compiles with NVRTC to an sm_90 cubin; the
  choice rules; the backend pass puts the torch form into CPU graphs.
- ``cuda``: one append by the kernel against :func:`append_reference` on random states
  (hypothesis: every preset, head_dim 64/128, windows of 0/1/7/128 slots empty, partial or full,
  key mean / smoothing / shared or per-head matrix present or not, bf16 and fp16); a sequence of
  appends replayed from a CUDA graph; the op's dispatch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cache import assert_nearest
from test_ops_cuda_decode import PRESET_SPECS, needs_cuda, nvrtc_or_skip

from vecinfer_compile.ops import append, kernel_request
from vecinfer_compile.ops.append import append_reference, transform_keys
from vecinfer_compile.ops.cuda import append as cuda_append
from vecinfer_compile.ops.cuda.nvrtc import CudaBuildError, compile_source
from vecinfer_compile.quant.packing import pack_codes, unpack_codes

BUFFERS = ("k_codes", "v_codes", "k_window", "v_window", "n_coded", "n_window", "arrivals")


@pytest.mark.parametrize("kspec,vspec", PRESET_SPECS)
def test_cuda_append_source_compiles_for_sm90(kspec, vspec):
    nvrtc_or_skip()
    for head_dim, fp16, matrix, mean, lam in (
        (128, False, 1, False, True),
        (64, True, 2, True, False),
        (128, False, 0, False, False),
    ):
        variant = cuda_append.AppendVariant(head_dim, *kspec, *vspec, fp16, matrix, mean, lam)
        image, is_cubin = compile_source(cuda_append.source(), "vq_append", 90, ["--std=c++17", *variant.defines()])
        assert is_cubin and image[:4] == b"\x7fELF" and b"vq_append" in image


def _args(
    gen,
    *,
    b,
    hkv,
    d,
    tmax,
    r,
    n_coded,
    n_window,
    kspec,
    vspec,
    dtype,
    t=1,
    mean=False,
    lam=False,
    matrix=0,
    device="cpu",
):
    """The op's arguments for a random layer state (codes of every slot random and valid)."""
    (ek, dk), (ev, dv) = kspec, vspec

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen).to(dt)

    k_codes = pack_codes(torch.randint(0, ek, (b, hkv, tmax, d // dk), generator=gen), ek)
    v_codes = pack_codes(torch.randint(0, ev, (b, hkv, tmax, d // dv), generator=gen), ev)
    key_matrix = {0: None, 1: randn(d, d) / d**0.5, 2: randn(hkv, d, d) / d**0.5}[matrix]
    args = dict(
        key=randn(b, hkv, t, d, dt=dtype),
        value=randn(b, hkv, t, d, dt=dtype),
        k_codes=k_codes,
        v_codes=v_codes,
        k_window=randn(b, hkv, r, d, dt=dtype),
        v_window=randn(b, hkv, r, d, dt=dtype),
        n_coded=torch.tensor(n_coded),
        n_window=torch.tensor(n_window),
        arrivals=torch.zeros(1, dtype=torch.int32),
        k_centroids=randn(ek, dk),
        v_centroids=randn(ev, dv),
        key_mean=randn(hkv, d) * 0.1 if mean else None,
        lam=torch.rand(hkv, d, generator=gen) + 0.5 if lam else None,
        key_matrix=key_matrix,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _clone(args):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def test_choice_rules(monkeypatch):
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    gen = torch.Generator().manual_seed(0)
    chunk = _args(
        gen,
        b=1,
        hkv=2,
        d=64,
        tmax=8,
        r=2,
        n_coded=0,
        n_window=0,
        kspec=(256, 4),
        vspec=(256, 4),
        dtype=torch.bfloat16,
        t=3,
    )
    assert append.choose_append(*chunk.values()) == "torch"  # several tokens: always torch
    with kernel_request.use_decode_kernel("triton"):
        one = dict(chunk, key=chunk["key"][:, :, :1], value=chunk["value"][:, :, :1])
        assert append.choose_append(*one.values()) == "torch"
    reason = cuda_append.unsupported_reason(one["key"], one["k_window"], one["k_centroids"], one["v_centroids"])
    assert "not CUDA" in reason
    with pytest.raises(CudaBuildError, match="not CUDA"):
        torch.ops.vecinfer.cache_append_cuda(*one.values())


def test_reference_is_the_op_on_cpu():
    """The dispatching op runs the reference off CUDA: same state after two appends."""
    gen = torch.Generator().manual_seed(1)
    args = _args(
        gen,
        b=2,
        hkv=2,
        d=32,
        tmax=9,
        r=2,
        n_coded=3,
        n_window=1,
        kspec=(256, 4),
        vspec=(16, 8),
        dtype=torch.float32,
        lam=True,
        matrix=1,
    )
    want = _clone(args)
    for _ in range(2):
        append_reference(*want.values())
        torch.ops.vecinfer.cache_append(*args.values())
    for name in BUFFERS:
        assert torch.equal(args[name], want[name]), name
    assert int(args["n_coded"]) == 4 and int(args["n_window"]) == 2


def test_pass_applies_a_request_to_every_layer():
    """The backend's pass over a graph of several appends (fake CUDA tensors, no GPU needed) with
    a request in force: each node gets the requested form (the request is entered once)."""
    import torch.fx as fx
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vecinfer_compile.passes.cache_append import rewrite_cache_append

    gen = torch.Generator().manual_seed(2)
    real = _args(
        gen, b=1, hkv=2, d=64, tmax=8, r=2, n_coded=0, n_window=0, kspec=(256, 4), vspec=(256, 4), dtype=torch.bfloat16
    )
    graph = fx.Graph()
    with FakeTensorMode():
        fakes = {k: None if v is None else torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in real.items()}
    for _ in range(3):  # three layers
        args = []
        for name, fake in fakes.items():
            if fake is None:
                args.append(None)
                continue
            node = graph.placeholder(f"{name}_{len(graph.nodes)}")
            node.meta["example_value"] = fake
            args.append(node)
        graph.call_function(torch.ops.vecinfer.cache_append.default, tuple(args))
    graph.output(None)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    counters.clear()
    assert rewrite_cache_append(gm, "triton") == 3
    assert sum(n.target is append_reference for n in gm.graph.nodes) == 3
    assert counters["vecinfer"]["cache_append_torch"] == 3


# --- GPU -----------------------------------------------------------------------------------------


def _check_append(before, got, want):
    """The kernel's state ``got`` after one append from ``before``, against the reference's
    ``want``: counters equal; the valid window slots equal (the new key within an ulp: the
    transform's float32 sum runs in another order); codes equal beside the written slot and
    nearest there. Slots past ``n_window`` hold nothing (the reference fills them with copies)."""
    assert int(got["n_coded"]) == int(want["n_coded"]) and int(got["n_window"]) == int(want["n_window"])
    assert int(got["arrivals"]) == 0
    r, c, w = before["k_window"].shape[2], int(before["n_coded"]), int(want["n_window"])
    new_slot = min(int(before["n_window"]), r - 1)
    ulp = 2**-7 if got["k_window"].dtype == torch.bfloat16 else 2**-10
    assert torch.equal(got["v_window"][:, :, :w], want["v_window"][:, :, :w])
    if r:
        keep = [s for s in range(w) if s != new_slot]
        assert torch.equal(got["k_window"][:, :, keep], want["k_window"][:, :, keep])
        torch.testing.assert_close(
            got["k_window"][:, :, new_slot].float(), want["k_window"][:, :, new_slot].float(), rtol=ulp, atol=ulp * 1e-2
        )
    flushed = int(want["n_coded"]) > c
    for side, cent in (("k", "k_centroids"), ("v", "v_centroids")):
        codes = got[f"{side}_codes"]
        other = [s for s in range(codes.shape[2]) if not (flushed and s == c)]
        assert torch.equal(codes[:, :, other], before[f"{side}_codes"][:, :, other]), f"{side} codes beside slot {c}"
        if flushed:
            if r:
                x = before[f"{side}_window"][:, :, :1]
            else:  # no window: the new token itself (the key transformed, as the reference computes it)
                x = (
                    transform_keys(before["key"], before["key_mean"], before["lam"], before["key_matrix"])
                    if side == "k"
                    else before["value"]
                )
            tol = 4 * ulp if (side == "k" and not r) else 1e-5  # R == 0: the kernel's k~ may differ by an ulp
            _nearest(codes[:, :, c : c + 1], x, before[cent], f"{side} codes", tol)


def _nearest(codes, x, centroids, what, tol):
    dims = centroids.shape[1]
    sub = x.double().reshape(*x.shape[:-1], x.shape[-1] // dims, dims)
    dist = ((sub[..., None, :] - centroids.double()) ** 2).sum(-1)
    chosen = dist.gather(-1, unpack_codes(codes, centroids.shape[0])[..., None]).squeeze(-1)
    best = dist.min(-1).values
    assert torch.all(chosen <= best + tol * (1 + best)), f"{what}: not the nearest centroids"


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    specs=st.sampled_from(PRESET_SPECS),
    d=st.sampled_from([64, 128]),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2, 3, 8]),
    tmax=st.integers(1, 300),
    r=st.sampled_from([0, 1, 7, 128, 300]),  # 300: a window shift of more than one pass
    window=st.sampled_from(["empty", "partial", "full"]),
    mean=st.booleans(),
    lam=st.booleans(),
    matrix=st.sampled_from([0, 1, 2]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_cuda_append_matches_reference(seed, specs, d, b, hkv, tmax, r, window, mean, lam, matrix, dtype, data):
    n_window = {"empty": 0, "partial": r // 2, "full": r}[window]
    n_coded = data.draw(st.integers(0, tmax - 1))
    gen = torch.Generator().manual_seed(seed)
    before = _args(
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
        mean=mean,
        lam=lam,
        matrix=matrix,
        device="cuda",
    )
    want, got = _clone(before), _clone(before)
    append_reference(*want.values())
    torch.ops.vecinfer.cache_append_cuda(*got.values())
    _check_append(before, got, want)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("specs", [((256, 4), (256, 4)), ((4096, 8), (256, 8))])
def test_cuda_append_sequence_in_a_cuda_graph(specs):
    """One captured append replayed 20 times, new tokens copied in before each replay: the window
    fills, then every step flushes; the state equals 20 reference appends (codes nearest)."""
    gen = torch.Generator().manual_seed(3)
    state = _args(
        gen,
        b=2,
        hkv=8,
        d=128,
        tmax=64,
        r=5,
        n_coded=10,
        n_window=0,
        kspec=specs[0],
        vspec=specs[1],
        dtype=torch.bfloat16,
        lam=True,
        matrix=1,
        device="cuda",
    )
    want = _clone(state)
    keys = torch.randn(20, *state["key"].shape, generator=gen).to("cuda", torch.bfloat16)
    values = torch.randn(20, *state["value"].shape, generator=gen).to("cuda", torch.bfloat16)
    scratch = _clone(state)
    torch.ops.vecinfer.cache_append_cuda(*scratch.values())  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.vecinfer.cache_append_cuda(*state.values())
    for i in range(20):
        state["key"].copy_(keys[i]), state["value"].copy_(values[i])
        want["key"], want["value"] = keys[i], values[i]
        graph.replay()
        append_reference(*want.values())
    torch.cuda.synchronize()
    assert int(state["n_coded"]) == int(want["n_coded"]) == 25 and int(state["n_window"]) == 5
    assert int(state["arrivals"]) == 0
    assert torch.equal(state["v_window"], want["v_window"])
    torch.testing.assert_close(state["k_window"].float(), want["k_window"].float(), rtol=2**-7, atol=1e-3)
    kt = transform_keys(keys[:15].permute(1, 2, 0, 3, 4).flatten(2, 3), None, want["lam"], want["key_matrix"])
    # the kernel encoded its own k~ (an ulp from the reference's here): nearest within a loose bound
    _nearest(state["k_codes"][:, :, 10:25], kt, want["k_centroids"], "keys", 2**-5)
    assert_nearest(
        state["v_codes"][:, :, 10:25], values[:15].permute(1, 2, 0, 3, 4).flatten(2, 3), want["v_centroids"], "values"
    )


@pytest.mark.cuda
@needs_cuda
def test_op_dispatches_to_cuda_and_env_forces_torch(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    args = _args(
        gen,
        b=2,
        hkv=2,
        d=128,
        tmax=50,
        r=8,
        n_coded=20,
        n_window=8,
        kspec=(256, 4),
        vspec=(256, 4),
        dtype=torch.bfloat16,
        lam=True,
        matrix=1,
        device="cuda",
    )
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    assert append.choose_append(*args.values()) == "cuda"
    got, kernel = _clone(args), _clone(args)
    torch.ops.vecinfer.cache_append(*got.values())
    torch.ops.vecinfer.cache_append_cuda(*kernel.values())
    for name in BUFFERS:
        assert torch.equal(got[name], kernel[name]), name
    monkeypatch.setenv(kernel_request.ENV, "triton")
    assert append.choose_append(*args.values()) == "torch"
    fp32 = _args(
        gen,
        b=1,
        hkv=2,
        d=128,
        tmax=50,
        r=8,
        n_coded=20,
        n_window=8,
        kspec=(256, 4),
        vspec=(256, 4),
        dtype=torch.float32,
        device="cuda",
    )
    monkeypatch.setenv(kernel_request.ENV, "cuda")
    with pytest.raises(RuntimeError, match="cache append cannot run on CUDA.*bfloat16/float16"):
        append.choose_append(*fp32.values())
