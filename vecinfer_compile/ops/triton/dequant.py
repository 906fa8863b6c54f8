"""Triton dequantization of stored codes into a position-major workspace.

The chunk attention of :mod:`..split_attention.chunk` reads a layer's coded prefix through a varlen
flash-attention kernel, which wants keys and values as ``[B * T, H, D]`` rows. This kernel
writes exactly that from the stored codes in one pass: one program per (batch row, KV head,
block of ``BLOCK_T`` positions) loads each code once (12-bit codes unpacked as
:mod:`vecinfer_compile.quant.packing` stores them), gathers its centroid as one ``DSUB``-wide
vector from the codebook (a few KiB in the output dtype, served by L1), and stores the
``[BLOCK_T, D]`` tile. It moves the bytes a torch ``centroids[codes]`` gather would (which
materialises int64 indices, then transposes), once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant.packing import is_packed
from .common import check_head_dim_pow2, launch, load_codes

BLOCK_T = 64
NUM_WARPS = 4


@triton.jit
def _dequant_kernel(
    codes_ptr,
    cent_ptr,
    out_ptr,
    s_cb,
    s_ch,
    s_ct,
    s_ob,
    s_ot,
    s_oh,
    H,
    T,
    D: tl.constexpr,
    DSUB: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid_t * BLOCK + tl.arange(0, BLOCK)
    t_ok = offs_t < T
    NSUB: tl.constexpr = D // DSUB
    code = load_codes(codes_ptr + b * s_cb + h * s_ch, s_ct, offs_t, t_ok, NSUB, PACKED)
    c = tl.arange(0, DSUB)
    vals = tl.load(cent_ptr + code[:, :, None] * DSUB + c[None, None, :])
    sub = tl.arange(0, NSUB)
    dst = out_ptr + b * s_ob + offs_t[:, None, None] * s_ot + h * s_oh + sub[None, :, None] * DSUB + c[None, None, :]
    tl.store(dst, vals, mask=t_ok[:, None, None])


def dequantize_triton(codes: torch.Tensor, centroids: torch.Tensor, length: int, out: torch.Tensor) -> torch.Tensor:
    """Write the first ``length`` positions of ``codes`` dequantized into ``out``.

    codes ``[B, H, Tmax, W]`` uint8 stored codes (any strides but a unit last one), centroids
    ``[E, d]`` in ``out``'s dtype (contiguous), out ``[B, length, H, D]`` with a unit last stride
    (position-major: ``out.view(B * length, H, D)`` when contiguous). Returns ``out``. The raw kernel
    runs under ``TRITON_INTERPRET=1`` on CPU tensors (the tests)."""
    b, h, tmax, _ = codes.shape
    d = out.shape[-1]
    check_head_dim_pow2(d)
    if tuple(out.shape) != (b, length, h, d) or out.stride(-1) != 1:
        raise ValueError(
            f"out must be [B, length, H, D] = {(b, length, h, d)} with a unit last stride, "
            f"got {tuple(out.shape)} strides {out.stride()}"
        )
    if not 0 <= length <= tmax:
        raise ValueError(f"length {length} is outside the {tmax} code slots")
    if centroids.dtype != out.dtype or not centroids.is_contiguous():
        raise ValueError(f"centroids must be contiguous in out's dtype {out.dtype}, got {centroids.dtype}")
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    if length == 0 or b == 0:
        return out
    grid = (triton.cdiv(length, BLOCK_T), b * h)
    launch(
        _dequant_kernel,
        grid,
        False,
        codes,
        centroids,
        out,
        codes.stride(0),
        codes.stride(1),
        codes.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        h,
        length,
        D=d,
        DSUB=centroids.shape[1],
        PACKED=is_packed(centroids.shape[0]),
        BLOCK=BLOCK_T,
        num_warps=NUM_WARPS,
    )
    return out
