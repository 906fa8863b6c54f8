"""Normalized Hadamard matrices (Sylvester construction), block-diagonal for non-powers of two."""

from __future__ import annotations

import functools

import torch

MIN_BLOCK = 16
MAX_BLOCK = 256


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / (n**0.5)


def hadamard_block_size(head_dim: int) -> int:
    """The largest power of two in [16, 256] that divides ``head_dim``; a clear error if none."""
    block = MAX_BLOCK
    while block >= MIN_BLOCK:
        if head_dim % block == 0:
            return block
        block //= 2
    raise ValueError(
        f"head_dim {head_dim} has no Hadamard rotation: it must be a multiple of 16 "
        f"(a power of two from 16 to 256, or a block-diagonal of such blocks, e.g. 80, 96, 192); "
        f"use method 'smooth' or 'vq' for this model (--method on the command line)"
    )


@functools.cache
def _hadamard_f64(head_dim: int) -> torch.Tensor:
    block = hadamard_block_size(head_dim)
    return torch.block_diag(*[_sylvester(block)] * (head_dim // block))


def hadamard_matrix(head_dim: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal ``H: [head_dim, head_dim]`` with ``H @ H.T == I``.

    A single Sylvester matrix when ``head_dim`` is a power of two in [16, 256]; otherwise a
    block-diagonal of the largest such block that divides ``head_dim`` (80 -> 5 blocks of 16,
    96 -> 3 of 32, 192 -> 3 of 64).
    """
    return _hadamard_f64(head_dim).to(dtype=dtype, device=device)
