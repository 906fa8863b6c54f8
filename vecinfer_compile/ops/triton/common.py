"""Pieces shared by the Triton kernels and their launchers.

- :func:`launch`: one launch path for the op (``wrap=True``: through ``torch.library.wrap_triton``
  so Inductor sees the kernel) and for direct calls (benchmarks, ``TRITON_INTERPRET=1`` tests on
  CPU tensors, ``wrap=False``).
- ``@triton.jit`` helpers: centroid gather (dequantization inside the kernel; the codebook, a few
  KiB, is served by L1) and the online softmax step in base 2 that returns zeros for fully masked rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def launch(kernel, grid: tuple, wrap: bool, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, through ``wrap_triton`` when ``wrap``."""
    runner = torch.library.wrap_triton(kernel) if wrap else kernel
    runner[grid](*args, **kwargs)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last dim is contiguous (the kernels index it with stride 1), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_head_dim_pow2(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(
            f"the Triton kernels need a power-of-two head_dim >= 16, got {head_dim}; "
            "run the op on CPU (reference) for other sizes"
        )


def rows_for_head_dim(rows: int, head_dim: int) -> int:
    """``rows`` of a ``[rows, head_dim]`` tile for heads up to 128 wide; for wider heads fewer (down
    to 16, ``tl.dot``'s minimum) so that the tile's elements, and its shared memory, stay those of
    128 (Gemma 4's 512-wide heads: a 64-row float32 tile of the decode kernel asked the H200 for
    548 KiB of shared memory)."""
    return max(16, min(rows, rows * 128 // head_dim))


def block_rows(n: int) -> int:
    """Rows of a ``tl.dot`` operand holding ``n`` rows: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def load_codes(codes_ptr, stride_t, offs_t, t_mask, NSUB: tl.constexpr, PACKED: tl.constexpr):
    """``[len(offs_t), NSUB]`` int32 codes of rows ``offs_t`` (0 where ``t_mask`` is False).

    A row is the stored layout of :mod:`vecinfer_compile.quant.packing`: ``NSUB`` bytes (8-bit
    codes), or with ``PACKED`` (12-bit codes) ``NSUB`` low bytes then ``NSUB // 2`` bytes of high
    nibbles, code ``2i`` in the low nibble of byte ``NSUB + i`` and ``2i + 1`` in its high nibble."""
    sub = tl.arange(0, NSUB)
    row = codes_ptr + offs_t[:, None] * stride_t
    code = tl.load(row + sub[None, :], mask=t_mask[:, None], other=0).to(tl.int32)
    if PACKED:
        nib = tl.load(row + NSUB + (sub // 2)[None, :], mask=t_mask[:, None], other=0).to(tl.int32)
        code = code | (((nib >> ((sub % 2) * 4)[None, :]) & 0xF) << 8)
    return code


@triton.jit
def dequant_tile(
    codes_ptr,
    stride_t,
    offs_t,
    t_mask,
    cent_ptr,
    N: tl.constexpr,
    D: tl.constexpr,
    DSUB: tl.constexpr,
    PACKED: tl.constexpr,
):
    """Rows ``offs_t`` (``N`` of them) of a stored code matrix (``stride_t`` bytes between rows,
    each row as :func:`load_codes` reads it) -> ``[N, D]`` centroid values in the dtype of
    ``cent_ptr``. Rows outside ``t_mask`` hold centroid 0.

    Each code is loaded once and its centroid row is fetched as one contiguous ``DSUB``-wide
    vector (one 8-byte load for a 4-channel bf16 centroid), not channel by channel."""
    row = load_codes(codes_ptr, stride_t, offs_t, t_mask, D // DSUB, PACKED) * DSUB
    rows = tl.load(cent_ptr + row[:, :, None] + tl.arange(0, DSUB)[None, None, :])
    return tl.reshape(rows, [N, D])


@triton.jit
def dequant_tile_2d(
    codes_ptr,
    stride_t,
    offs_t,
    t_mask,
    cent_ptr,
    N: tl.constexpr,
    D: tl.constexpr,
    DSUB: tl.constexpr,
    PACKED: tl.constexpr,
):
    """:func:`dequant_tile` through a 2-D ``[N, D]`` gather: each code is loaded once and
    broadcast to its ``DSUB`` channels before the gather, so no 3-D tile is reshaped into a
    ``tl.dot`` operand (Triton 3.6 rejects that shared layout for 16-bit wgmma operands on
    sm_90: "Illegal shared layout"). Rows outside ``t_mask`` hold centroid 0."""
    NSUB: tl.constexpr = D // DSUB
    code = load_codes(codes_ptr, stride_t, offs_t, t_mask, NSUB, PACKED)
    row = tl.reshape(tl.broadcast_to((code * DSUB)[:, :, None], [N, NSUB, DSUB]), [N, D])
    return tl.load(cent_ptr + row + (tl.arange(0, D) % DSUB)[None, :])


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax step for log2-scaled scores ``s [M, N]`` (``-inf`` = masked).

    Returns ``(p, alpha, m_new, l_new)``: unnormalised weights, the factor that rescales the old
    accumulator, and the new running max / sum. A row with no finite score keeps ``p = 0``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
