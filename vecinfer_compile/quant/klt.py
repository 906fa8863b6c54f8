"""Per-head KLT (principal components) of coded keys and integer bit allocation across them.

A study tool for a key codec that spends more bits on the directions with more variance, where
today's Hadamard rotation spreads every channel's variance evenly and one codebook gives every
sub-vector the same bits. Squared error in the keys' coded domain is ``qaware``'s proxy for score
error (:mod:`.query_aware`), so the KLT of coded keys is the query-weighted one.

- :class:`KLT`: per head, ``y = (x - mean) @ basis`` with orthonormal ``basis`` (columns: principal
  directions, by decreasing variance); ``x = y @ basis^T + mean`` exactly.
- :func:`greedy_allocation`: integer bits per component (or per block of components) at a total
  budget, by the largest marginal decrease of ``variance * distortion(bits)``.
- :func:`rounded_water_filling`: reverse water-filling's rates rounded to integers with the same sum.
- :func:`lloyd_max`, :func:`gaussian_lloyd_max_distortion`: scalar Lloyd-Max levels of data and
  of a unit Gaussian.

The study that uses them: ``studies/key_codec_study.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rate_distortion import water_fill


@dataclass
class KLT:
    """Per-head principal components. ``mean: [H, D]``, ``basis: [H, D, D]`` (columns orthonormal,
    ``variance`` decreasing), ``variance: [H, D]`` (the eigenvalues of the covariance); float64."""

    mean: torch.Tensor
    basis: torch.Tensor
    variance: torch.Tensor

    @classmethod
    def fit(cls, x: torch.Tensor) -> KLT:
        """From samples ``x: [H, N, D]`` (N >= 2, any float dtype), covariance accumulated in float64."""
        if x.dim() != 3 or x.shape[1] < 2:
            raise ValueError(f"expected samples [H, N >= 2, D], got {tuple(x.shape)}")
        xd = x.double()
        mean = xd.mean(1)
        centred = xd - mean[:, None]
        cov = centred.transpose(1, 2) @ centred / (x.shape[1] - 1)
        lam, vec = torch.linalg.eigh((cov + cov.transpose(1, 2)) / 2)
        return cls(mean, vec.flip(-1), lam.flip(-1).clamp_min(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [H, N, D]`` -> coefficients ``y: [H, N, D]`` float64 (component 0: most variance)."""
        return (x.double() - self.mean[:, None]) @ self.basis

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """``y: [H, N, D]`` -> ``x: [H, N, D]`` float64."""
        return y.double() @ self.basis.transpose(1, 2) + self.mean[:, None]


def greedy_allocation(variances: torch.Tensor, budget: int, distortion: torch.Tensor) -> torch.Tensor:
    """Integer bits ``[M]`` int64 for ``M`` items (components, or blocks of them) of ``variances:
    [M]`` (>= 0) at a total of ``budget`` bits, where item ``i`` at ``b`` bits costs ``variances[i] *
    distortion[b]`` (``distortion: [B + 1]``, nonincreasing, ``distortion[0]`` the cost of sending
    nothing). Each bit goes where it lowers the total cost most; optimal when ``distortion``'s
    decrements shrink (convex), as for Lloyd-Max and k-means curves. Sums to ``min(budget, M * B)``."""
    if budget < 0:
        raise ValueError(f"the budget must be >= 0 bits, got {budget}")
    var = variances.double().clamp_min(0)
    dist = distortion.double()
    top = dist.shape[0] - 1
    bits = torch.zeros(var.shape[0], dtype=torch.long)
    for _ in range(min(budget, top * var.shape[0])):
        gain = torch.where(bits < top, var * (dist[bits] - dist[(bits + 1).clamp_max(top)]), -math.inf)
        bits[int(gain.argmax())] += 1
    return bits


def rounded_water_filling(variances: torch.Tensor, budget: int, max_bits: int | None = None) -> torch.Tensor:
    """Reverse water-filling's rates ``max(0, 1/2 log2(l_i / theta))`` over ``variances: [M]`` at
    ``budget`` bits, rounded to integers ``[M]`` int64 that sum to ``budget`` (largest remainders;
    each at most ``max_bits`` when given, the excess going to the others by their remainders: the
    sum is then ``min(budget, M * max_bits)``)."""
    if budget <= 0:
        return torch.zeros(variances.shape[0], dtype=torch.long)
    lam = variances.double().clamp_min(1e-30)
    d = water_fill(lam, float(budget))
    rate = (0.5 * torch.log2(lam / d)).clamp_min(0)
    if max_bits is not None:
        rate = rate.clamp_max(max_bits)
    bits = rate.floor().long()
    room = torch.ones_like(bits, dtype=torch.bool)
    while int(bits.sum()) < budget:
        if max_bits is not None:
            room = bits < max_bits
        if not room.any():
            break
        bits[int(torch.where(room, rate - bits, -math.inf).argmax())] += 1
    return bits


def lloyd_max(x: torch.Tensor, levels: int, iters: int = 50) -> torch.Tensor:
    """Lloyd-Max (1-D k-means) reconstruction levels ``[levels]`` (sorted, float64) of samples
    ``x: [N]``, started at the quantiles' midpoints; ``levels <= 1`` gives ``[mean]``."""
    xs = x.double().flatten().sort().values
    if levels <= 1 or xs.numel() <= 1:
        return xs.mean().reshape(1)
    q = torch.linspace(0, 1, 2 * levels + 1, dtype=torch.float64)[1::2]
    c = torch.quantile(xs[:: max(1, xs.numel() // 100000)], q)
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), xs.cumsum(0)])
    for _ in range(iters):
        edges = torch.searchsorted(xs, (c[1:] + c[:-1]) / 2)
        lo = torch.cat([torch.zeros(1, dtype=torch.long), edges])
        hi = torch.cat([edges, torch.tensor([xs.numel()])])
        count = hi - lo
        new = torch.where(count > 0, (csum[hi] - csum[lo]) / count.clamp_min(1), c)
        if torch.allclose(new, c, rtol=0, atol=1e-12 * (1 + c.abs().max().item())):
            c = new
            break
        c = new.sort().values
    return c


def scalar_quantize(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape) -> the nearest of sorted ``levels: [L]``, float64, same shape."""
    xd = x.double().contiguous()
    if levels.numel() == 1:
        return levels.expand_as(xd).clone()
    idx = torch.bucketize(xd, (levels[1:] + levels[:-1]) / 2)
    return levels[idx]


PANTER_DITE = math.pi * math.sqrt(3) / 2  # high-rate Lloyd-Max distortion of a unit Gaussian: this * 4^-b


def gaussian_lloyd_max_distortion(max_bits: int, points: int = 1 << 18) -> torch.Tensor:
    """``[max_bits + 1]`` float64: the mean squared error of the Lloyd-Max quantizer of a unit
    Gaussian at 0..max_bits bits (1, 0.3634, 0.1175, 0.0345, 0.0095, then the high-rate formula
    ``PANTER_DITE * 4^-b``, within 6% above 4 bits), from ``points`` equal-mass quantiles."""
    u = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    x = math.sqrt(2) * torch.erfinv(2 * u - 1)
    out = [float((x**2).mean())]
    for b in range(1, max_bits + 1):
        if b <= 4:
            out.append(float(((scalar_quantize(x, lloyd_max(x, 2**b, iters=500)) - x) ** 2).mean()))
        else:
            out.append(PANTER_DITE * 4.0**-b)
    return torch.tensor(out, dtype=torch.float64)
