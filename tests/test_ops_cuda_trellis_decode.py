"""The CUDA decode attention over trellis codes (``codecs/trellis/cuda/decode.cu``) against the oracle
:func:`vecinfer_compile.codecs.trellis.operands.decode_reference`.

- CPU: the kernel compiles with NVRTC to an sm_90 cubin (head_dim 64/128, GQA 1/4/16, 2^8 and
  2^10 states, 1.5- and 2-bit rows); what it refuses, with the reason.
- ``cuda``: against the oracle on random shapes (hypothesis: KV heads 1/2/8, GQA 1-16, head_dim
  64/128, odd lengths, left padding, the count on the host or the device); the choice and the
  request; a CUDA graph's replay gives the eager output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_cuda_decode import needs_cuda, nvrtc_or_skip
from test_ops_triton import _trellis_decode_case

from vecinfer_compile.codecs.trellis.cuda import decode as cuda_td
from vecinfer_compile.codecs.trellis.operands import (
    TrellisOperands,
    choose_decode,
    decode_attention,
    query_components,
    values_out,
)
from vecinfer_compile.codecs.trellis.reference import decode_reference
from vecinfer_compile.ops import kernel_request
from vecinfer_compile.ops.cuda.nvrtc import CudaBuildError, compile_source


@pytest.mark.parametrize(
    "head_dim, group, lbits, widths, nbytes",
    [(128, 4, 10, 4, 32), (64, 16, 10, 7, 12), (128, 1, 8, 4, 24), (64, 3, 10, 4, 16)],
)
def test_cuda_trellis_decode_compiles_for_sm90(head_dim, group, lbits, widths, nbytes):
    nvrtc_or_skip()
    variant = cuda_td.TrellisDecodeVariant(head_dim, group, lbits, widths, widths, nbytes, nbytes)
    assert variant.smem_bytes <= cuda_td.SMEM_LIMIT
    image, is_cubin = compile_source(
        cuda_td.SOURCE.read_text(), "trellis_decode", 90, ["--std=c++17", *variant.defines()]
    )
    assert is_cubin and image[:4] == b"\x7fELF" and b"trellis_decode" in image


def test_what_the_cuda_trellis_decode_refuses():
    q, k_codes, v_codes, keys, values = _trellis_decode_case(torch.Generator().manual_seed(0), 1, 2, 4, 9, 64, 8)
    qc, _ = query_components(q, keys)
    assert "on cpu, not CUDA" in cuda_td.unsupported_reason(qc, k_codes, v_codes, keys, values)
    with pytest.raises(CudaBuildError, match="cannot run this call: the queries are on cpu"):
        cuda_td.decode_components_cuda(qc, qc[..., 0], k_codes, v_codes, keys, values, 9, None, 0.1)


def _on_cuda(case):
    q, k_codes, v_codes, keys, values = case
    return (
        q.cuda(),
        k_codes.cuda(),
        v_codes.cuda(),
        TrellisOperands(*(t.cuda() for t in keys)),
        TrellisOperands(*(t.cuda() for t in values)),
    )


def _assert_matches_oracle(q, k_codes, v_codes, keys, values, n, kv_start, scale):
    want, want_lse = decode_reference(q, k_codes, v_codes, keys, values, n, kv_start, scale)
    qc, bias = query_components(q, keys)
    o, lse = cuda_td.decode_components_cuda(qc, bias, k_codes, v_codes, keys, values, n, kv_start, scale)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(values_out(o, lse, values), want, atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=16, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2, 8]),
    group=st.sampled_from([1, 3, 4, 16]),
    tmax=st.integers(1, 700),
    d=st.sampled_from([64, 128]),
    lbits=st.sampled_from([8, 10]),
    left_pad=st.booleans(),
    count_on_device=st.booleans(),
)
def test_cuda_trellis_decode_matches_the_oracle(seed, b, hkv, group, tmax, d, lbits, left_pad, count_on_device):
    gen = torch.Generator().manual_seed(seed)
    q, k_codes, v_codes, keys, values = _on_cuda(_trellis_decode_case(gen, b, hkv, group, tmax, d, lbits))
    n = int(torch.randint(0, tmax + 1, (1,), generator=gen))
    kv_start = torch.randint(0, n + 2, (b,), generator=gen).cuda() if left_pad else None
    _assert_matches_oracle(
        q, k_codes, v_codes, keys, values, torch.tensor(n).cuda() if count_on_device else n, kv_start, d**-0.5
    )


@pytest.mark.cuda
@needs_cuda
def test_cuda_trellis_decode_choice_and_graph_replay():
    q, k_codes, v_codes, keys, values = _on_cuda(
        _trellis_decode_case(torch.Generator().manual_seed(5), 2, 8, 4, 3000, 128, 10)
    )
    qc, _ = query_components(q, keys)
    assert choose_decode(qc, k_codes, v_codes, keys, values) == "cuda"
    with kernel_request.use_decode_kernel("triton"):
        assert choose_decode(qc, k_codes, v_codes, keys, values) == "triton"
        triton_out, _ = decode_attention(q, k_codes, v_codes, keys, values, 2999, None, 0.088)
    n = torch.tensor(2999).cuda()
    eager, _ = decode_attention(q, k_codes, v_codes, keys, values, n, None, 0.088)
    torch.testing.assert_close(eager, triton_out, atol=1e-3, rtol=1e-3)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(decode_attention(q, k_codes, v_codes, keys, values, n, None, 0.088)[0])
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager)
