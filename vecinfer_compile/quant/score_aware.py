"""Score-aware key codes: the codes of a key chosen for its scores, not its squared error alone.

K-Means centroids are the means of their cells, so a dequantized key is shorter than the key
along the key's own direction on average, and the most where the key is atypical: a key that a
query attends to strongly (large ``q . k``, so ``q`` close to ``k``'s direction) loses part of its
score. Anisotropic vector quantization (Guo et al., 2020, for maximum inner-product search) counts
the error along the vector's direction more: for a head vector ``x: [D]`` in the code domain and
its dequantized ``x_hat``, with ``r = x - x_hat`` and ``u = x / |x|``::

    loss(x_hat) = |r|^2 + (w - 1) (r . u)^2        (w = parallel_weight; w = 1: the squared error)

The sub-vectors' codes are coupled through ``r . u``. The encoder here searches the path of the
relaxed problem: for a multiplier ``m``, ``sum_s |r_s|^2 + 2 m (r . u)`` is minimised by the
nearest-centroid codes of ``x (1 + m / |x|)``, so each scale ``a`` of :data:`SCALES` gives a
candidate (the nearest-centroid codes of ``a x``, every sub-vector independently) and each head
vector keeps the candidate of the smallest ``loss``. ``a = 1`` is among the scales, so the loss
never exceeds the nearest-centroid codes' (a property test checks it). Each candidate is one
nearest-centroid encode, so every encoder of the package (torch, Triton) runs this search over its
own nearest-centroid kernel; the codes format, the bytes and the decode kernels do not change.

Measured (docs/results.md, "score-aware key codes"): evalmodel 2-bit ``qaware`` with ``w = 8``
(chosen on held-out calibration text) lowers held-out perplexity 2% and raises the needle through
the cache from 0.717 to 0.783; for keys only (values gain nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SCALES = (0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.4, 1.5, 1.7, 2.0)


def check_parallel_weight(weight: float) -> float:
    """``weight`` as a float, or a ValueError naming the valid range."""
    w = float(weight)
    if not (w >= 1.0 and w < float("inf")):
        raise ValueError(
            f"the key parallel weight must be a finite number >= 1 (1: nearest-centroid codes), got {weight}"
        )
    return w


def parallel_loss(x: torch.Tensor, x_hat: torch.Tensor, weight: float) -> torch.Tensor:
    """``|r|^2 + (weight - 1) (r . x / |x|)^2`` over the last dim, float32: ``x, x_hat: [..., D]``
    -> ``[...]`` (a zero ``x`` has no direction: its loss is the squared error)."""
    xf, r = x.float(), x.float() - x_hat.float()
    sq = (r * r).sum(-1)
    if weight == 1.0:
        return sq
    norm = xf.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return sq + (weight - 1.0) * ((r * xf).sum(-1) / norm) ** 2


def score_aware_indices(
    x: torch.Tensor,
    centroids: torch.Tensor,
    weight: float,
    nearest: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Centroid indices ``[..., D // d]`` (int64) of ``x: [..., D]`` under :func:`parallel_loss`.

    ``centroids: [E, d]``; ``nearest(y)`` gives the nearest-centroid indices ``[..., D // d]`` of a
    float32 ``y`` shaped like ``x`` (the caller's kernel). ``weight == 1`` is one call of
    ``nearest``; otherwise one per scale, ties kept by the earlier scale."""
    weight = check_parallel_weight(weight)
    xf = x.float()
    if weight == 1.0:
        return nearest(xf).long()
    c = centroids.float()
    entries, dims = c.shape
    best = best_loss = None
    for scale in SCALES:
        idx = nearest(xf * scale).long()
        x_hat = c[idx].reshape(*idx.shape[:-1], idx.shape[-1] * dims)
        loss = parallel_loss(xf, x_hat, weight)
        if best is None:
            best, best_loss = idx, loss
            continue
        take = loss < best_loss
        best = torch.where(take[..., None], idx, best)
        best_loss = torch.where(take, loss, best_loss)
    return best
