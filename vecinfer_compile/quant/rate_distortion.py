"""The Gaussian rate-distortion test channel: what an ideal quantizer of ``R`` bits an element does.

A reference point for the codes, not a method: no finite code reaches it. For head vectors
``x: [D]`` of mean ``mu`` and covariance ``S = U diag(l) U^T``, the least mean squared error
that any code of ``R * D`` bits a vector reaches (at infinite block length) when ``x`` is
Gaussian is ``sum_i d_i`` with ``d_i = min(l_i, theta)``, ``theta`` set by reverse water-filling:
``sum_i max(0, 1/2 log2(l_i / theta)) = R * D`` (Cover & Thomas, thm. 10.3.3). Gaussian is the
hardest source of a given covariance, so for a real source this error is reachable in principle
(an upper bound on the optimum), and the practical codes that come closest (lattice and other long-block
quantizers) stay a little above it.

The forward test channel realizes that error: per principal component ``y_i = u_i . (x - mu)``,
``y_hat_i = a_i y_i + sqrt(a_i d_i) z_i`` with ``a_i = 1 - d_i / l_i`` and ``z ~ N(0, 1)``
independent of ``x``; then ``E (y_i - y_hat_i)^2 = d_i``. A component below the water level
(``l_i <= theta``) is sent as its mean.

Used by ``studies/needle_ideal_quantizer.py`` to ask how far the needle's retrieval bar is
from any 2-bit code, not only from ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def water_fill(eigenvalues: torch.Tensor, bits: float) -> torch.Tensor:
    """Per-component distortions ``d_i = min(l_i, theta)`` of ``eigenvalues: [D]`` (>= 0) at a
    total rate of ``bits`` (``sum_i max(0, 1/2 log2(l_i / theta)) = bits``), float64."""
    if bits <= 0:
        raise ValueError(f"the rate must be positive, got {bits} bits")
    lam = eigenvalues.double().clamp_min(1e-30)
    lo, hi = math.log(lam.min().item()) - 2 * bits * math.log(2) - 1, math.log(lam.max().item())
    for _ in range(200):  # bisection on log(theta): the rate falls as theta rises
        mid = (lo + hi) / 2
        rate = (0.5 * torch.log2(lam / math.exp(mid))).clamp_min(0).sum().item()
        lo, hi = (mid, hi) if rate > bits else (lo, mid)
    return lam.clamp_max(math.exp(hi))


@dataclass
class IdealChannel:
    """The test channel of one tensor kind (keys or values) of one layer, per head.

    mean: ``[H, D]``; basis: ``[H, D, D]`` (columns: principal directions); gain and
    noise_scale: ``[H, D]`` (``a_i`` and ``sqrt(a_i d_i)``); relative_error: ``[H]``, the
    expected squared error over the squared deviation from the mean (``sum d / sum l``). float32."""

    mean: torch.Tensor
    basis: torch.Tensor
    gain: torch.Tensor
    noise_scale: torch.Tensor
    relative_error: torch.Tensor

    @classmethod
    def fit(cls, x: torch.Tensor, bits_per_element: float) -> IdealChannel:
        """From samples ``x: [N, H, D]`` (N >= 2) at ``bits_per_element`` (``* D`` bits a vector)."""
        if x.dim() != 3 or x.shape[0] < 2:
            raise ValueError(f"expected samples [N >= 2, H, D], got {tuple(x.shape)}")
        parts = []
        for h in range(x.shape[1]):
            xh = x[:, h].double()
            mu = xh.mean(0)
            lam, basis = torch.linalg.eigh(torch.cov((xh - mu).T))
            lam = lam.clamp_min(0)
            d = water_fill(lam, bits_per_element * x.shape[2])
            gain = torch.where(lam > 0, 1 - d / lam.clamp_min(1e-30), torch.zeros_like(lam))
            parts.append((mu, basis, gain, (gain * d).clamp_min(0).sqrt(), d.sum() / lam.sum().clamp_min(1e-30)))
        mean, basis, gain, scale, rel = (torch.stack(t).float() for t in zip(*parts))
        return cls(mean, basis, gain, scale, rel)

    def __call__(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``x: [B, H, T, D]`` -> ``x_hat`` of the same shape (float32) given the channel's
        ``noise: [T, H, D]`` (standard normal; one draw per token, shared across the batch)."""
        mean, basis = self.mean.to(x.device), self.basis.to(x.device)
        y = torch.einsum("bhtd,hde->bhte", x.float() - mean[None, :, None], basis)
        y_hat = (
            self.gain.to(x.device)[None, :, None] * y
            + self.noise_scale.to(x.device)[None, :, None] * noise.to(x.device).transpose(0, 1)[None]
        )
        return torch.einsum("bhte,hde->bhtd", y_hat, basis) + mean[None, :, None]
