"""Vector-quantization codes: cut head vectors into sub-vectors and map each to a centroid.

One codebook ``[entries, dims]`` is shared by every sub-vector position of a head vector.
The codes here are centroid indices, ``uint8`` for codebooks of up to 256 entries and ``int16``
above (calibration, simulation, inspection). Where codes are stored (``vecinfer::encode``, the
attention kernels, ``VecInferCache``) they are packed at their nominal width: see
:mod:`.packing`.
"""

from __future__ import annotations

import torch

from .kmeans import nearest_centroid
from .score_aware import score_aware_indices
from .weighted_codes import weighted_indices


def code_dtype(entries: int) -> torch.dtype:
    if entries <= 256:
        return torch.uint8
    if entries <= 32768:
        return torch.int16
    raise ValueError(f"codebooks of {entries} entries are not supported (at most 32768)")


def subvectors(x: torch.Tensor, dims: int) -> torch.Tensor:
    """``x: [..., D] -> [..., D // dims, dims]``."""
    if x.shape[-1] % dims:
        raise ValueError(f"head_dim {x.shape[-1]} is not divisible by sub-vector size {dims}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // dims, dims)


def encode(
    x: torch.Tensor, centroids: torch.Tensor, parallel_weight: float = 1.0, metric: torch.Tensor | None = None
) -> torch.Tensor:
    """Codes of ``x: [..., D]`` (any float dtype) with ``centroids: [E, d]`` -> ``[..., D // d]``
    (uint8 if E <= 256 else int16): the nearest centroid of each sub-vector, or with
    ``parallel_weight > 1`` the score-aware codes of :mod:`.score_aware` (keys); with ``metric:
    [H, D, D]`` (``x: [B, H, T, D]``) those codes lowered further under the error metric
    (:mod:`.weighted_codes`)."""
    entries, dims = centroids.shape

    def nearest(y: torch.Tensor) -> torch.Tensor:
        sub = subvectors(y, dims)
        idx, _ = nearest_centroid(sub.reshape(-1, dims), centroids)
        return idx.reshape(sub.shape[:-1])

    idx = score_aware_indices(x, centroids, parallel_weight, nearest)
    if metric is not None:
        if x.dim() != 4:
            raise ValueError(f"error-weighted codes need head vectors [B, H, T, D], got {tuple(x.shape)}")
        idx = weighted_indices(x, idx, centroids, metric, parallel_weight)
    return idx.to(code_dtype(entries))


def decode(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``codes: [..., D // d]`` -> ``[..., D]`` in the centroids' dtype."""
    entries, dims = centroids.shape
    out = centroids[codes.long()]
    return out.reshape(*codes.shape[:-1], codes.shape[-1] * dims)


def quantize_dequantize(
    x: torch.Tensor, centroids: torch.Tensor, parallel_weight: float = 1.0, metric: torch.Tensor | None = None
) -> torch.Tensor:
    """``decode(encode(x, centroids, parallel_weight, metric))`` in x's dtype."""
    return decode(encode(x, centroids, parallel_weight, metric), centroids.to(torch.float32)).to(x.dtype)
