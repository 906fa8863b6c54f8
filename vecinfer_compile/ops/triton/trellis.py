"""Triton Viterbi: the trellis codec's encoder (:mod:`vecinfer_compile.quant.trellis`) in one launch.

One program codes one vector (a token's components of one KV head): the ``2^L`` path costs live in
registers, and each step is the reference's move, a min over the high bits of the cost vector
viewed ``[2^k, 2^(L-k)]``, then the new states' squared errors added. The step's width ``k`` is
read at run time from the head's bit allocation (one branch per width, widths up to ``MAX_K``);
components with 0 bits are skipped. The argmin's high bits (one byte a state) go to a scratch
buffer in global memory and the walk is traced back at the end of the same program. Every row
and head of a call is one launch, where the torch reference takes a few kernels a component and
head (about 1,500 launches a layer per decode step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import launch

SCRATCH_BYTES = 1 << 30  # trace-back bytes one launch may use; larger calls go in row chunks
MAX_STATE_BITS = 13  # 2^13 path costs a program: 64 float32 registers a thread at 4 warps


@triton.jit
def _viterbi_kernel(x_ptr, bits_ptr, tables_ptr, trace_ptr, walk_ptr, H, D,
                    stride_xn, stride_xh, stride_bh, stride_th, stride_tw, stride_wn, stride_wh,
                    L: tl.constexpr, MAX_K: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    S: tl.constexpr = 1 << L
    HALF: tl.constexpr = S // 2
    states = tl.arange(0, S)
    cost = tl.where(states == 0, 0.0, float("inf"))
    trace = trace_ptr + (row * H + h).to(tl.int64) * D * HALF
    for t in range(D):
        k = tl.load(bits_ptr + h * stride_bh + t)
        x = tl.load(x_ptr + row * stride_xn + h * stride_xh + t)
        for kk in tl.static_range(1, MAX_K + 1):
            if k == kk:
                view = tl.reshape(cost, (1 << kk, S >> kk))
                best, high = tl.min(view, axis=0, return_indices=True)
                tl.store(trace + t * HALF + tl.arange(0, S >> kk), high.to(tl.uint8))
                table = tl.load(tables_ptr + h * stride_th + (kk - 1) * stride_tw + states)
                err = x - table
                spread = tl.broadcast_to(tl.reshape(best, (S >> kk, 1)), (S >> kk, 1 << kk))
                cost = tl.reshape(spread, (S,)) + err * err
    s = tl.argmin(cost, axis=0).to(tl.int32)
    for i in range(D):
        t = D - 1 - i
        k = tl.load(bits_ptr + h * stride_bh + t)
        if k > 0:
            tl.store(walk_ptr + row * stride_wn + h * stride_wh + t, s)
            high = tl.load(trace + t * HALF + (s >> k)).to(tl.int32)
            s = (s >> k) | (high << (L - k))


def viterbi_walks(x: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor, wrap: bool = False) -> torch.Tensor:
    """Least-squared-error walks of every row and head: ``x: [N, H, D]`` float32 components (unit
    scale), ``bits: [H, D]`` integer bits of each component (0: not coded), ``tables: [H, W, 2^L]``
    float32 (row ``k - 1``: the ``k``-bit table) -> states ``[N, H, D]`` int32 (0 where a component
    has 0 bits). The same walks as :func:`vecinfer_compile.quant.trellis.viterbi` on each head's
    coded components, up to ties in cost."""
    n, h, d = x.shape
    if bits.shape != (h, d) or tables.dim() != 3 or tables.shape[0] != h:
        raise ValueError(f"x [N, H, D], bits [H, D], tables [H, W, 2^L]: got {tuple(x.shape)}, {tuple(bits.shape)}, "
                         f"{tuple(tables.shape)}")
    width, states = tables.shape[1:]
    lbits = states.bit_length() - 1
    if states != 1 << lbits or not 1 <= lbits <= MAX_STATE_BITS or width > lbits:
        raise ValueError(f"tables of 2^L entries (1 <= L <= {MAX_STATE_BITS}) and at most L widths, got "
                         f"{tuple(tables.shape)}; larger trellises run the torch reference")
    x = x.float().contiguous()
    bits = bits.to(device=x.device, dtype=torch.int32).contiguous()
    tables = tables.to(device=x.device, dtype=torch.float32).contiguous()
    walks = torch.zeros(n, h, d, dtype=torch.int32, device=x.device)
    rows = max(1, SCRATCH_BYTES // (h * d * (states // 2)))
    for start in range(0, n, rows):
        part = x[start:start + rows]
        out = walks[start:start + rows]
        trace = torch.empty(part.shape[0] * h * d * (states // 2), dtype=torch.uint8, device=x.device)
        launch(_viterbi_kernel, (part.shape[0], h), wrap, part, bits, tables, trace, out, h, d,
               part.stride(0), part.stride(1), bits.stride(0), tables.stride(0), tables.stride(1),
               out.stride(0), out.stride(1), L=lbits, MAX_K=width, num_warps=4 if lbits <= 10 else 8)
    return walks
