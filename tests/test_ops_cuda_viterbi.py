"""The CUDA trellis encoders (``codecs/trellis/cuda/viterbi.cu``, one warp a vector; ``viterbi_block.cu``, one
CTA a vector) against the torch Viterbi.

- CPU: both kernels compile with NVRTC to sm_90 cubins at every state count they take (2^5 to 2^10
  and 2^11), steps up to L bits, head_dim 64/128; which kernel a count gets; what they refuse.
- ``cuda``: each kernel's codes are walks as cheap as the reference's (hypothesis: KV heads 1/2/8,
  odd counts of vectors, 2^5 to 2^11 states, steps up to L bits: wider than a byte of trace,
  0-bit components); the dispatcher's choice by request; a CUDA graph's replay writes the eager codes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_cuda_decode import needs_cuda, nvrtc_or_skip
from test_ops_triton import _assert_optimal_walks, _trellis_case

from vecinfer_compile.codecs.trellis.cuda import viterbi as cuda_viterbi
from vecinfer_compile.codecs.trellis.packing import component_states, packed_bytes
from vecinfer_compile.ops import kernel_request
from vecinfer_compile.ops.cuda.nvrtc import CudaBuildError, compile_source


@pytest.mark.parametrize(
    "lbits, widest, head_dim", [(5, 5, 64), (8, 4, 128), (10, 7, 128), (10, 10, 64), (10, 10, 128)]
)
def test_cuda_viterbi_compiles_for_sm90(lbits, widest, head_dim):
    nvrtc_or_skip()
    variant = cuda_viterbi.ViterbiVariant(lbits, head_dim, widest)
    assert variant.warp_smem * variant.warps <= cuda_viterbi.SMEM_LIMIT
    image, is_cubin = compile_source(
        cuda_viterbi.warp_source(), "trellis_viterbi_warp", 90, ["--std=c++17", *variant.defines()]
    )
    assert is_cubin and image[:4] == b"\x7fELF" and b"trellis_viterbi_warp" in image


@pytest.mark.parametrize("lbits, widest, head_dim", [(5, 5, 64), (10, 7, 128), (10, 10, 64), (11, 11, 128)])
def test_cuda_block_viterbi_compiles_for_sm90(lbits, widest, head_dim):
    nvrtc_or_skip()
    variant = cuda_viterbi.BlockViterbiVariant(lbits, head_dim, widest)
    assert variant.smem_bytes <= cuda_viterbi.BLOCK_SMEM_LIMIT
    image, is_cubin = compile_source(
        cuda_viterbi.with_block_walk(cuda_viterbi.BLOCK_SOURCE),
        "trellis_viterbi_block",
        90,
        ["--std=c++17", *variant.defines()],
    )
    assert is_cubin and image[:4] == b"\x7fELF" and b"trellis_viterbi_block" in image


def test_the_kernel_a_count_gets():
    """Few vectors a head (a decode step) take the block kernel, a prefill's many the warp kernel,
    which holds at most 2^10 states."""
    x, _, tables = _trellis_case(torch.Generator().manual_seed(0), 1, 2, 16, 10)
    assert cuda_viterbi.warp_from(8, 132) == 34 and cuda_viterbi.warp_from(2, 132) == 133  # two CTAs an SM
    edge = cuda_viterbi.warp_from(2, cuda_viterbi.REFERENCE_SMS)
    many = x.expand(edge, -1, -1)
    assert cuda_viterbi.kernel_for(x, tables) == "block" and cuda_viterbi.kernel_for(many, tables) == "warp"
    assert cuda_viterbi.kernel_for(x.expand(edge - 1, -1, -1), tables) == "block"
    _, _, tables11 = _trellis_case(torch.Generator().manual_seed(0), 1, 2, 16, 11)
    assert cuda_viterbi.kernel_for(many, tables11) == "block"
    _, _, wide = _trellis_case(torch.Generator().manual_seed(0), 1, 2, 16, 10, widest=10)
    assert cuda_viterbi.kernel_for(x, wide) == "block"  # a wide step's choice takes two bytes of trace
    v = cuda_viterbi.BlockViterbiVariant(10, 128, 7)
    assert v.threads == 512 and v.smem_bytes == 4 * (2048 + 32 + 40 + 128) + 128 * 512


def test_trace_words_bound_every_step():
    """A step of k bits leaves k ballots for each 32 of its 2^(L-k) prefixes (at least one word a bit)."""
    assert cuda_viterbi.trace_words(10, 1) == 16 and cuda_viterbi.trace_words(10, 3) == 12
    assert cuda_viterbi.trace_words(10, 7) == 7 and cuda_viterbi.trace_words(12, 1) == 64
    v = cuda_viterbi.ViterbiVariant(10, 128, 7)
    assert v.trace_words == 128 * 16 and v.warps == 4 and v.warp_smem == 4 * (2048 + 40)


def test_what_the_cuda_encoder_refuses():
    x, bits, tables = _trellis_case(torch.Generator().manual_seed(0), 2, 2, 16, 4)
    assert "on cpu, not CUDA" in cuda_viterbi.unsupported_reason(x, bits, tables)
    with pytest.raises(ValueError, match="kernel must be 'block', 'warp' or None"):
        cuda_viterbi.viterbi_codes_cuda(x, bits, tables, kernel="thread")
    if torch.cuda.is_available():
        x12, bits12, tables12 = (t.cuda() for t in _trellis_case(torch.Generator().manual_seed(0), 1, 1, 16, 12))
        assert "2^12 states (the CUDA encoder takes 2^5 to 2^11)" in cuda_viterbi.unsupported_reason(
            x12, bits12, tables12
        )
        x11, bits11, tables11 = (t.cuda() for t in _trellis_case(torch.Generator().manual_seed(0), 1, 1, 16, 11, 11))
        assert cuda_viterbi.unsupported_reason(x11, bits11, tables11) is None
        assert "2^11 states (the warp kernel takes" in cuda_viterbi.unsupported_reason(x11, bits11, tables11, "warp")
    with pytest.raises(CudaBuildError, match="cannot run this call: the components are on cpu"):
        cuda_viterbi.viterbi_codes_cuda(x, bits, tables)


def _walks_of(codes, bits, lbits):
    return component_states(codes, bits, lbits).int()


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.sampled_from([1, 3, 33]),
    h=st.sampled_from([1, 2, 8]),
    d=st.sampled_from([64, 128]),
    lbits=st.sampled_from([5, 8, 10, 11]),
    widest=st.sampled_from([2, 4, 12]),
    kernel=st.sampled_from(["block", "warp"]),
)
def test_cuda_viterbi_codes_are_least_cost_walks(seed, n, h, d, lbits, widest, kernel):
    x, bits, tables = _trellis_case(torch.Generator().manual_seed(seed), n, h, d, lbits, widest)
    x, bits, tables = x.cuda(), bits.cuda(), tables.cuda()
    if lbits > cuda_viterbi.MAX_STATE_BITS:
        kernel = "block"
    codes = cuda_viterbi.viterbi_codes_cuda(x, bits, tables, packed_bytes(bits), kernel)
    _assert_optimal_walks(x, bits, tables, _walks_of(codes, bits, lbits))


@pytest.mark.cuda
@needs_cuda
def test_cuda_viterbi_dispatch_and_graph_replay():
    from vecinfer_compile.codecs.trellis.triton_kernels import viterbi_codes
    from vecinfer_compile.codecs.trellis.viterbi import choose_viterbi, viterbi_codes_gpu

    x, bits, tables = _trellis_case(
        torch.Generator().manual_seed(1),
        cuda_viterbi.warp_from(8, torch.cuda.get_device_properties(0).multi_processor_count),
        8,
        128,
        10,
        7,
    )
    x, bits, tables = x.cuda(), bits.cuda(), tables.cuda()
    nbytes = packed_bytes(bits)
    assert choose_viterbi(x, bits, tables) == "cuda" and choose_viterbi(x[:8], bits, tables) == "cuda"
    with kernel_request.use_decode_kernel("triton"):
        assert choose_viterbi(x, bits, tables) == "triton"
    for rows in (x, x[:8]):  # the warp kernel, then the block kernel
        eager = viterbi_codes_gpu(rows, bits, tables, nbytes)
        _assert_optimal_walks(rows, bits, tables, _walks_of(eager, bits, 10))
        triton_codes = viterbi_codes(rows, bits, tables, nbytes=nbytes)
        assert (eager == triton_codes).all(-1).float().mean() >= 0.9  # ties aside, the same walks
        out = torch.empty_like(eager)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(viterbi_codes_gpu(rows, bits, tables, nbytes))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
