"""Triton encode: nearest centroid of every sub-vector of the transformed keys/values.

Smoothing and rotation run in torch (one float32 matmul, fused by Inductor); the kernel does the
argmin over the codebook in chunks of ``BLOCK_E`` centroids, by ``|c|^2 - 2 x.c``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.codebook import code_dtype
from .checks import check_encode_args
from .triton_common import launch

BLOCK_N = 64  # sub-vectors per program
BLOCK_E = 128  # centroids per step


@triton.jit
def _encode_kernel(x_ptr, cent_ptr, out_ptr, N, E, DSUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """x ``[N, DSUB]`` float32 contiguous, centroids ``[E, DSUB]`` float32 -> out ``[N]`` codes."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    best_d = tl.full([BLOCK_N], float("inf"), tl.float32)
    best_i = tl.zeros([BLOCK_N], tl.int32)
    for e0 in range(0, E, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        e_mask = offs_e < E
        dot = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
        c_sq = tl.zeros([BLOCK_E], tl.float32)
        for k in tl.static_range(DSUB):
            xk = tl.load(x_ptr + offs_n * DSUB + k, mask=n_mask, other=0.0)
            ck = tl.load(cent_ptr + offs_e * DSUB + k, mask=e_mask, other=0.0)
            dot += xk[:, None] * ck[None, :]
            c_sq += ck * ck
        dist = tl.where(e_mask[None, :], c_sq[None, :] - 2.0 * dot, float("inf"))
        chunk_d = tl.min(dist, 1)
        chunk_i = tl.argmin(dist, 1).to(tl.int32) + e0
        better = chunk_d < best_d
        best_d = tl.where(better, chunk_d, best_d)
        best_i = tl.where(better, chunk_i, best_i)
    tl.store(out_ptr + offs_n, best_i.to(out_ptr.dtype.element_ty), mask=n_mask)


def encode_triton(
    x: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    centroids: torch.Tensor,
    *,
    wrap: bool = False,
) -> torch.Tensor:
    """Same contract as :func:`vecinfer_compile.ops.reference.encode`.

    x ``[B, H, T, D]`` float -> codes ``[B, H, T, D // d]`` uint8 (E <= 256) or int16.
    ``wrap=True`` launches through ``torch.library.wrap_triton`` (inside the op)."""
    check_encode_args(x, lam, rotation, centroids)
    work = x.float()
    if lam is not None:
        work = work / lam.float()[None, :, None, :]
    if rotation is not None:
        work = work @ rotation.float()
    entries, dims = centroids.shape
    b, h, t, d = x.shape
    work = work.contiguous()
    out = torch.empty((b, h, t, d // dims), dtype=code_dtype(entries), device=x.device)
    n = b * h * t * (d // dims)
    grid = (triton.cdiv(n, BLOCK_N),)
    launch(_encode_kernel, grid, wrap, work, centroids.contiguous(), out, n, entries,
           DSUB=dims, BLOCK_N=BLOCK_N, BLOCK_E=BLOCK_E)
    return out
