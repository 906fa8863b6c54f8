"""``x @ m`` for the few rows of a decode step, in a form Inductor fuses.

In the compiled decode step the query and key transforms multiply a handful of rows (``[B, H,
1, D]``) by a ``[D, D]`` float32 matrix. As a matmul each becomes a cuBLAS call of its own; on
the H200 one of the two took 54 us per layer (an fp32 GEMM kernel picked for the odd shape),
1.7 ms of a 17.6 ms step at B=1, T=128k. As a broadcast product and a sum over ``D`` Inductor
emits one small reduction kernel and fuses the scaling and the casts around it.
"""

from __future__ import annotations

import torch

FEW_ROWS = 16  # at most this many rows per head (``x.shape[-2]``) take the product-and-sum form


def rows_matmul(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x @ m`` for ``x: [..., T, D]``, ``m: [..., D, N]`` broadcasting as matmul does (one
    ``[D, N]`` matrix, or one per head: ``[H, D, N]`` against ``x: [B, H, T, D]``), same dtype;
    for ``T <= FEW_ROWS`` computed as ``(x[..., :, None] * m[..., None, :, :]).sum(-2)``
    (materialises ``[..., T, D, N]`` when run eagerly: small for the few rows this form is for)."""
    if x.shape[-2] <= FEW_ROWS:
        return (x.unsqueeze(-1) * m.unsqueeze(-3)).sum(-2)
    return x @ m
