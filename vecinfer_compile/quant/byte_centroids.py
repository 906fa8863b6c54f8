"""Centroids of the 4096-entry codebooks at 7-bit precision: ``k * step``, ``k`` an integer in
[-64, 63] and ``step`` one power of two per codebook.

Why: the CUDA decode kernel keeps a 4096-entry codebook (the 3-, 1.5- and 1.25-bit presets) as
one copy in shared memory, where random gathers collide on banks; as bytes, a gather moves half
the bytes of 16-bit centroids and meets fewer collisions, and the kernel widens each byte to the
exact 16-bit value (``ops/cuda/decode.cu``, ``widen``). Codebooks hold these centroids exactly
(:class:`vecinfer_compile.codebooks.LayerCodebooks` snaps them), so every path (simulate, the
reference, Triton, CUDA) reads the same values. Rounding to 7 bits moves a centroid by at most
half a step (1/126 of the book's largest magnitude), far below the quantization error of a
4096-entry book of 4 or 8 channels.
"""

from __future__ import annotations

import torch

BYTE_BOOK_ENTRIES = 257  # books with at least this many entries hold 7-bit centroids
K_MIN, K_MAX = -64, 63


def centroid_step(centroids: torch.Tensor) -> torch.Tensor:
    """The power-of-two step (float32, 0-d, on ``centroids``' device) whose multiples in
    [-63, 63] cover ``centroids``' largest magnitude (1.0 for an all-zero book). No host sync."""
    largest = centroids.detach().abs().amax().float()
    step = torch.exp2(torch.ceil(torch.log2(largest / K_MAX)))
    return torch.where(largest > 0, step, torch.ones_like(step))


def byte_codes(centroids: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``centroids [E, d]`` -> the integers ``k`` (int16, in [-64, 63]) nearest ``centroids / step``."""
    return torch.round(centroids.float() / step).clamp_(K_MIN, K_MAX).to(torch.int16)


def snap_centroids(centroids: torch.Tensor) -> torch.Tensor:
    """``centroids [E, d]`` float32 -> the nearest ``k * step`` (same shape and dtype) for books of
    :data:`BYTE_BOOK_ENTRIES` or more entries; smaller books, and books already snapped, are
    returned as they are (the same tensor: kernels keep prepared copies per codebook tensor)."""
    if centroids.shape[0] < BYTE_BOOK_ENTRIES:
        return centroids
    step = centroid_step(centroids)
    snapped = (byte_codes(centroids, step).float() * step).to(centroids.dtype)
    return centroids if torch.equal(snapped, centroids) else snapped


def packed_byte_book(centroids: torch.Tensor) -> torch.Tensor:
    """The kernel's byte book: uint8 ``[E * d + 16]``, bytes ``k + 64`` of the centroids in row
    order, then ``step`` as a float32 and 12 bytes of padding (the book stays a multiple of 16
    bytes). For centroids that are already snapped (:func:`snap_centroids`) the bytes are exact."""
    step = centroid_step(centroids)
    biased = (byte_codes(centroids, step) - K_MIN).to(torch.uint8).reshape(-1)
    tail = torch.zeros(16, dtype=torch.uint8, device=centroids.device)
    tail[:4] = step.reshape(1).view(torch.uint8)
    return torch.cat([biased, tail])
