"""The codebooks' calibration: a k-means codebook over a side's sub-vectors."""

from __future__ import annotations

import torch

from ...quant.codebook import subvectors
from ...quant.kmeans import kmeans
from ..base import FitContext


def fit_codebook(vectors: torch.Tensor, entries: int, dims: int, ctx: FitContext) -> torch.Tensor:
    """k-means codebook ``[entries, dims]`` float32 over the sub-vectors of ``vectors [..., D]``, on
    ``vectors``' device (a short prompt may give fewer sub-vectors than entries: k-means then
    reuses points); at most ``ctx.max_vectors`` sub-vectors (a subset seeded by ``ctx.seed``),
    ``ctx.iters`` iterations on ``ctx.device``."""
    sub = subvectors(vectors, dims).reshape(-1, dims)
    if ctx.max_vectors is not None and sub.shape[0] > ctx.max_vectors:
        gen = torch.Generator().manual_seed(ctx.seed)
        sub = sub[torch.randperm(sub.shape[0], generator=gen)[: ctx.max_vectors]]
    device = ctx.device or sub.device
    return kmeans(sub.to(device), entries, iters=ctx.iters, seed=ctx.seed).centroids.to(vectors.device)
