"""The decode step's append to a trellis-coded layer in one CUDA launch (``codecs/trellis/cuda/append.cu``)
against its torch form (``append_through_window`` with the codec's encode).

- CPU: the kernel compiles with NVRTC to sm_90 cubins (2^5 to 2^11 states, head_dim 64/128, bf16
  and fp16 windows, steps wider than a byte of trace); the torch form runs off CUDA.
- ``cuda``: after a few appends the codes (slots below ``n_coded``), windows and counters equal
  the torch form's (hypothesis: batch 1-3, KV heads 1/2/8, head_dim 64/128, 2^5 to 2^10 states,
  windows of 0/1/5/16 slots from empty to full, bf16/fp16, key and value codecs of different
  allocations); what the kernel refuses and the choice by request; a CUDA graph's replay gives
  the eager buffers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_cuda_decode import needs_cuda, nvrtc_or_skip

from vecinfer_compile.codecs.trellis.code import TrellisCodec
from vecinfer_compile.codecs.trellis.cuda import append as cuda_ta
from vecinfer_compile.codecs.trellis.cuda.viterbi import BlockViterbiVariant
from vecinfer_compile.codecs.trellis.operands import TrellisOperands, append, choose_append, encode
from vecinfer_compile.codecs.trellis.packing import packed_bytes
from vecinfer_compile.ops import kernel_request
from vecinfer_compile.ops.append import append_through_window
from vecinfer_compile.ops.cuda.nvrtc import compile_source

TMAX = 12


@pytest.mark.parametrize(
    "lbits, head_dim, widest, fp16",
    [(5, 64, 5, False), (8, 64, 4, True), (10, 128, 7, False), (10, 128, 10, True), (11, 128, 8, False)],
)
def test_cuda_trellis_append_compiles_for_sm90(lbits, head_dim, widest, fp16):
    nvrtc_or_skip()
    variant = cuda_ta.TrellisAppendVariant(BlockViterbiVariant(lbits, head_dim, widest), fp16)
    image, is_cubin = compile_source(cuda_ta.source(), "trellis_append", 90, ["--std=c++17", *variant.defines()])
    assert is_cubin and image[:4] == b"\x7fELF" and b"trellis_append" in image


def _operands(gen: torch.Generator, h: int, d: int, bits: float, lbits: int, device) -> TrellisOperands:
    spectrum = torch.logspace(0, -1, d)
    vectors = (torch.randn(h, 256, d, generator=gen) * spectrum).to(device)  # the tables train there
    codec = TrellisCodec.fit(vectors, bits, lbits, train_vectors=128, rounds=1, seed=int(gen.initial_seed()) % 1000)
    return TrellisOperands.of(codec, device)


def _layer(gen, b, h, d, r, filled, keys, values, dtype, device):
    """A layer's buffers: ``filled`` window slots of ``r``, a few slots coded, room for every append."""
    k_codes = torch.randint(0, 256, (b, h, TMAX, packed_bytes(keys.bits.cpu())), generator=gen, dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (b, h, TMAX, packed_bytes(values.bits.cpu())), generator=gen, dtype=torch.uint8)
    k_window, v_window = (torch.randn(b, h, r, d, generator=gen).to(dtype) for _ in range(2))
    return dict(
        k_codes=k_codes.to(device),
        v_codes=v_codes.to(device),
        k_window=k_window.to(device),
        v_window=v_window.to(device),
        n_coded=torch.tensor(3, device=device),
        n_window=torch.tensor(filled, device=device),
        arrivals=torch.zeros(1, dtype=torch.int32, device=device),
    )


def _torch_form(kt, value, layer, keys, values):
    append_through_window(
        kt,
        value,
        layer["k_codes"],
        layer["v_codes"],
        layer["k_window"],
        layer["v_window"],
        layer["n_coded"],
        layer["n_window"],
        lambda x: encode(x, keys, layer["k_codes"].shape[-1]),
        lambda x: encode(x, values, layer["v_codes"].shape[-1]),
    )


def _assert_same_layer(got, want):
    n = int(want["n_coded"])
    assert int(got["n_coded"]) == n and int(got["n_window"]) == int(want["n_window"])
    assert int(got["arrivals"]) == 0
    w = int(want["n_window"])  # slots past the counters are never read (the torch form fills them)
    for name in ("k_window", "v_window"):
        assert torch.equal(got[name][:, :, :w], want[name][:, :, :w]), name
    for name in ("k_codes", "v_codes"):
        assert torch.equal(got[name][:, :, :n], want[name][:, :, :n]), name


def test_the_torch_form_runs_off_cuda():
    gen = torch.Generator().manual_seed(0)
    keys, values = _operands(gen, 2, 16, 2.0, 5, "cpu"), _operands(gen, 2, 16, 1.5, 5, "cpu")
    layer = _layer(gen, 1, 2, 16, 4, 4, keys, values, torch.bfloat16, "cpu")
    want = {n: t.clone() for n, t in layer.items()}
    kt, value = (torch.randn(1, 2, 1, 16, generator=gen).bfloat16() for _ in range(2))
    assert "on cpu, not CUDA" in cuda_ta.unsupported_reason(kt, layer["k_window"], keys, values)
    append(kt, value, *layer.values(), keys, values)
    _torch_form(kt, value, want, keys, values)
    _assert_same_layer(layer, want)
    assert int(layer["n_coded"]) == 4 and int(layer["n_window"]) == 4


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    h=st.sampled_from([1, 2, 8]),
    d=st.sampled_from([64, 128]),
    lbits=st.sampled_from([5, 8, 10]),
    r=st.sampled_from([0, 1, 5, 16]),
    start=st.sampled_from(["empty", "short", "full"]),
    fp16=st.booleans(),
    value_bits=st.sampled_from([1.5, 2.0, 3.0]),
)
def test_cuda_trellis_append_matches_the_torch_form(seed, b, h, d, lbits, r, start, fp16, value_bits):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if fp16 else torch.bfloat16
    keys, values = _operands(gen, h, d, 2.0, lbits, "cuda"), _operands(gen, h, d, value_bits, lbits, "cuda")
    filled = {"empty": 0, "short": max(r - 2, 0), "full": r}[start]
    got = _layer(gen, b, h, d, r, filled, keys, values, dtype, "cuda")
    want = {n: t.clone() for n, t in got.items()}
    for _ in range(3):  # the window fills, then tokens leave it into the codes
        kt, value = (torch.randn(b, h, 1, d, generator=gen).to(dtype).cuda() for _ in range(2))
        cuda_ta.trellis_append_cuda(kt, value, *got.values(), keys, values)
        _torch_form(kt, value, want, keys, values)
        _assert_same_layer(got, want)


@pytest.mark.cuda
@needs_cuda
def test_what_the_cuda_trellis_append_refuses_and_the_choice():
    gen = torch.Generator().manual_seed(1)
    keys, values = _operands(gen, 2, 64, 2.0, 8, "cuda"), _operands(gen, 2, 64, 2.0, 8, "cuda")
    layer = _layer(gen, 1, 2, 64, 4, 4, keys, values, torch.bfloat16, "cuda")
    one, two = torch.randn(1, 2, 1, 64).bfloat16().cuda(), torch.randn(1, 2, 2, 64).bfloat16().cuda()
    assert choose_append(one, layer["k_window"], keys, values) == "cuda"
    assert choose_append(two, layer["k_window"], keys, values) == "torch"
    assert "2 new tokens (the kernel appends one)" in cuda_ta.unsupported_reason(two, layer["k_window"], keys, values)
    assert "the window holds torch.float32" in cuda_ta.unsupported_reason(one.float(), layer["k_window"], keys, values)
    with kernel_request.use_decode_kernel("triton"):
        assert choose_append(one, layer["k_window"], keys, values) == "torch"
    other = _operands(gen, 2, 64, 2.0, 6, "cuda")
    assert "keys of 256 states and values of 64" in cuda_ta.unsupported_reason(one, layer["k_window"], keys, other)
    with kernel_request.use_decode_kernel("cuda"), pytest.raises(RuntimeError, match="CUDA trellis append cannot run"):
        choose_append(one, layer["k_window"], keys, other)


@pytest.mark.cuda
@needs_cuda
def test_cuda_trellis_append_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(2)
    keys, values = _operands(gen, 8, 128, 2.0, 10, "cuda"), _operands(gen, 8, 128, 2.0, 10, "cuda")
    layer = _layer(gen, 2, 8, 128, 16, 14, keys, values, torch.bfloat16, "cuda")
    tokens = [tuple(torch.randn(2, 8, 1, 128, generator=gen).bfloat16().cuda() for _ in range(2)) for _ in range(4)]
    eager = {n: t.clone() for n, t in layer.items()}
    for kt, value in tokens:
        append(kt, value, *eager.values(), keys, values)
    append(*tokens[0], *{n: t.clone() for n, t in layer.items()}.values(), keys, values)  # builds outside the capture
    start = {n: t.clone() for n, t in layer.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for kt, value in tokens:
            append(kt, value, *layer.values(), keys, values)
    for n, t in layer.items():
        t.copy_(start[n])
    graph.replay()
    torch.cuda.synchronize()
    _assert_same_layer(layer, eager)
    assert int(layer["n_coded"]) == 5 and int(layer["n_window"]) == 16
