"""K-Means in torch: k-means++ initialisation, Lloyd iterations, chunked distances.

Runs on whatever device ``x`` lives on (move it to CUDA for speed). Seeded and deterministic:
the same ``x``, ``k`` and ``seed`` give the same centroids on the same device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..heartbeat import beat

# Distances are computed for at most this many (point, centroid) pairs at once.
PAIR_BUDGET = 1 << 22


@dataclass
class KMeansResult:
    """centroids: ``[k, d]`` float32; objective: mean squared distance after each assignment."""

    centroids: torch.Tensor
    objective: list[float] = field(default_factory=list)


def _chunk_rows(k: int) -> int:
    return max(1, PAIR_BUDGET // max(k, 1))


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``x: [N, d]`` and ``centroids: [k, d]`` return ``(index [N] int64, sq_dist [N])``,
    computed in float32 over row chunks so memory stays bounded by ``PAIR_BUDGET``.

    Per chunk one fused ``addmm`` gives ``||c||^2 - 2 x.c``; ``||x||^2`` is added after the min.
    """
    c = centroids.float()
    c_sq = (c * c).sum(1)
    idx_parts, dist_parts = [], []
    for part in x.split(_chunk_rows(c.shape[0])):
        part = part.float()
        best, idx = torch.addmm(c_sq, part, c.T, alpha=-2.0).min(1)
        idx_parts.append(idx)
        dist_parts.append((best + (part * part).sum(1)).clamp_min(0))
    return torch.cat(idx_parts), torch.cat(dist_parts)


def _kmeans_pp(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: each next centroid is drawn with probability proportional to its
    squared distance to the nearest centroid chosen so far (inverse-CDF sampling)."""
    n = x.shape[0]
    picks = torch.empty(k, dtype=torch.long, device=x.device)
    picks[0] = torch.randint(n, (1,), generator=gen, device=x.device)
    best = ((x - x[picks[0]]) ** 2).sum(1)
    draws = torch.rand(k, generator=gen, device=x.device, dtype=torch.float64)
    for i in range(1, k):
        cdf = best.double().cumsum(0)
        pick = torch.searchsorted(cdf, draws[i : i + 1] * cdf[-1]).clamp_max(n - 1)
        picks[i] = pick[0]
        best = torch.minimum(best, ((x - x[pick]) ** 2).sum(1))
    return x[picks].clone()


def _cluster_sums(x: torch.Tensor, assign: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.device.type == "cpu":
        sums = torch.zeros(k, x.shape[1], dtype=torch.float32).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).float()
        return sums, counts
    # On GPUs index_add_ uses atomics (order-dependent sums); one-hot matmuls are deterministic.
    sums = torch.zeros(k, x.shape[1], dtype=torch.float32, device=x.device)
    counts = torch.zeros(k, dtype=torch.float32, device=x.device)
    for part, a in zip(x.split(_chunk_rows(k)), assign.split(_chunk_rows(k))):
        onehot = torch.nn.functional.one_hot(a, k).float()
        sums += onehot.T @ part
        counts += onehot.sum(0)
    return sums, counts


def kmeans(
    x: torch.Tensor,
    k: int,
    *,
    iters: int = 20,
    seed: int = 0,
    tol: float = 1e-4,
    init_sample: int | None = None,
) -> KMeansResult:
    """Cluster ``x: [N, d]`` into ``k`` centroids.

    k-means++ picks the initial centroids from a seeded sample of at most ``init_sample`` points
    (default ``max(8 k, 32768)``); Lloyd iterations then run on all points until the relative
    improvement of the objective drops below ``tol`` or ``iters`` is reached. An empty cluster is
    re-seeded at the point farthest from its centroid, which never increases the objective.
    """
    if x.ndim != 2:
        raise ValueError(f"kmeans expects x of shape [N, d], got {tuple(x.shape)}")
    x = x.float().contiguous()
    if not torch.isfinite(x).all():
        raise ValueError("calibration vectors contain NaN or inf: check the model's outputs")
    n = x.shape[0]
    if n == 0:
        raise ValueError("kmeans got no vectors: give calibration text with at least one token")
    gen = torch.Generator(device=x.device).manual_seed(seed)
    sample = init_sample or max(8 * k, 32768)
    if n > sample:
        pool = x[torch.randperm(n, generator=gen, device=x.device)[:sample]]
    else:
        pool = x
    centroids = _kmeans_pp(pool, k, gen)
    result = KMeansResult(centroids)
    for i in range(iters):
        beat(f"k-means {k} entries, iteration {i + 1}/{iters}")
        assign, dist = nearest_centroid(x, centroids)
        result.objective.append(dist.mean().item())
        if len(result.objective) > 1:
            prev, cur = result.objective[-2], result.objective[-1]
            if prev - cur <= tol * max(prev, 1e-30):
                break
        sums, counts = _cluster_sums(x, assign, k)
        empty = counts == 0
        centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
        if empty.any():
            far = dist.topk(min(int(empty.sum()), n)).indices
            centroids[empty.nonzero()[: far.numel(), 0]] = x[far]
    result.centroids = centroids
    return result
