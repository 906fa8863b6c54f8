"""The VecInfer key transform and its exact query-side inverse.

Keys:    ``K~ = (K / lam) @ H``          (channel-wise smoothing, then Hadamard rotation)
Queries: ``q~ = (q * lam) @ H``          so that ``q~ @ K~^T == q @ K^T`` exactly (H orthonormal).

The query-aware method (:mod:`.query_aware`) replaces ``lam`` by a per-KV-head matrix ``A``
(``key_matrix``) and its inverse transpose ``B = A^(-T)`` (``query_matrix``)::

    K~ = (K @ A) @ H,    q~ = (q @ B) @ H,    K = (K~ @ H^T) @ B^T.

Centring (``mean``, ``mu: [H_kv, D]``, the calibration keys' mean per KV head) makes the key
transform affine: ``K~ = ((K - mu) / lam) @ H`` or ``((K - mu) @ A) @ H``, queries unchanged.
Scores then change by ``-q . mu``, the same for every key a query reads, and softmax ignores a
constant added to a row: attention is exact as long as *every* key of the row (quantized or
full-precision window) is in the same shifted space. ``keys_inverse`` adds ``mu`` back.

Pre-RoPE keys (``rope_inv_freq``, :mod:`.rope`): the key at position ``t`` is first un-rotated by
RoPE, ``K~_t = ((R_t^-1 K_t - mu) / lam) @ H``, and ``keys_inverse`` rotates it back, so both need
the keys' positions. No fixed query transform makes those scores exact (the rotation differs per
key), so :meth:`KeyTransform.queries` refuses: such keys are attended in the original domain.

``lam: [H_kv, D]`` holds one factor per KV head and channel; with GQA each query head uses its
KV head's factors (query head ``h`` belongs to KV head ``h // (H_q // H_kv)``, as in Hugging
Face's ``repeat_kv``). Either part can be switched off (``lam=None`` or ``rotate=False``) for the
ablations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hadamard import hadamard_matrix
from .rope import rotate as rope_rotate

LAM_FLOOR = 1e-4


def smoothing_factors(key_absmax: torch.Tensor) -> torch.Tensor:
    """``lam = sqrt(max_t |K|)`` from per-channel key absmax ``[..., D]``, floored at 1e-4 so an
    all-zero channel never divides by zero (any positive lam keeps the transform exact)."""
    if not torch.isfinite(key_absmax).all():
        raise ValueError("key statistics contain NaN or inf: check the model's dtype and inputs")
    return key_absmax.float().clamp_min(LAM_FLOOR**2).sqrt()


def key_mean(keys: torch.Tensor) -> torch.Tensor:
    """``mu: [H_kv, D]`` float32, the mean of calibration keys ``[H_kv, N, D]`` over the tokens
    (accumulated in float64)."""
    if keys.dim() != 3 or keys.shape[1] == 0:
        raise ValueError(f"calibration keys must be [H_kv, N, D] with N > 0, got {tuple(keys.shape)}")
    if not torch.isfinite(keys).all():
        raise ValueError("key statistics contain NaN or inf: check the model's dtype and inputs")
    return keys.double().mean(1).float()


def centre_keys(keys: torch.Tensor, center: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(mu, keys - mu)`` for calibration keys ``[H_kv, N, D]`` (``(None, keys)`` without
    ``center``): the statistics the rest of the transform is fitted to are those of the keys it
    will see, the centred ones."""
    if not center:
        return None, keys
    mean = key_mean(keys)
    return mean, keys - mean[:, None, :].to(keys.dtype)


def expand_to_query_heads(per_kv_head: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """``[H_kv, ...] -> [H_q, ...]`` with the GQA mapping of ``repeat_kv``."""
    num_kv_heads = per_kv_head.shape[0]
    if num_query_heads % num_kv_heads != 0:
        raise ValueError(f"{num_query_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return per_kv_head.repeat_interleave(num_query_heads // num_kv_heads, dim=0)


@dataclass
class KeyTransform:
    """Smoothing factors and rotation of one layer.

    lam: ``[H_kv, D]`` float32 or None (no smoothing); rotate: apply the Hadamard matrix;
    key_matrix / query_matrix: ``[H_kv, D, D]`` float32 ``A`` and ``B = A^(-T)`` of the
    query-aware method, or both None. Smoothing and the matrices exclude each other.
    mean: ``[H_kv, D]`` float32 ``mu`` subtracted from the keys first (centring), or None.
    rope_inv_freq: ``[r/2]`` float32, the model's RoPE frequencies, undone before everything else
    (the pre-RoPE methods), or None.
    """

    head_dim: int
    lam: torch.Tensor | None = None
    rotate: bool = True
    key_matrix: torch.Tensor | None = None
    query_matrix: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    rope_inv_freq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.key_matrix is None) != (self.query_matrix is None):
            raise ValueError("key_matrix and query_matrix go together (one is the other's inverse transpose)")
        if self.key_matrix is not None and self.lam is not None:
            raise ValueError("a key transform has smoothing factors or query-aware matrices, not both")

    def rotation(self, dtype: torch.dtype, device) -> torch.Tensor | None:
        return hadamard_matrix(self.head_dim, dtype, device) if self.rotate else None

    def _positions(self, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            raise ValueError("keys quantized before RoPE need their positions: pass positions=[T]")
        return positions

    def keys(self, k: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``k: [B, H_kv, T, D] -> K~`` of the same shape, computed in float32 (or k's dtype
        if float64) and returned in float32/float64. ``positions: [T]`` int: the keys' positions,
        needed (only) with ``rope_inv_freq``."""
        work = k.double() if k.dtype == torch.float64 else k.float()
        if self.rope_inv_freq is not None:
            work = rope_rotate(work, self.rope_inv_freq, self._positions(positions), inverse=True)
        if self.mean is not None:
            work = work - self.mean.to(work)[None, :, None, :]
        if self.lam is not None:
            work = work / self.lam.to(work)[None, :, None, :]
        if self.key_matrix is not None:
            work = work @ self.key_matrix.to(work)
        h = self.rotation(work.dtype, work.device)
        return work @ h if h is not None else work

    def keys_inverse(self, kt: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``K~ -> K``: ``(K~ @ H^T) * lam`` or ``(K~ @ H^T) @ B^T``, plus ``mu`` when centred, then
        RoPE at ``positions: [T]`` for pre-RoPE keys; ``kt: [B, H_kv, T, D]``."""
        h = self.rotation(kt.dtype, kt.device)
        out = kt @ h.T if h is not None else kt
        if self.query_matrix is not None:
            out = out @ self.query_matrix.to(out).transpose(-1, -2)
        if self.lam is not None:
            out = out * self.lam.to(out)[None, :, None, :]
        if self.mean is not None:
            out = out + self.mean.to(out)[None, :, None, :]
        if self.rope_inv_freq is not None:
            out = rope_rotate(out, self.rope_inv_freq, self._positions(positions))
        return out

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q: [B, H_q, T, D] -> q~`` in q's dtype: ``(q * lam_q) @ H`` or ``(q @ B_q) @ H`` (the
        key mean plays no part: it shifts each query's scores by one constant). Pre-RoPE keys have
        no such query transform (a ValueError)."""
        if self.rope_inv_freq is not None:
            raise ValueError(
                "keys quantized before RoPE have no query-side transform (their rotation differs "
                "per position): attend over keys_inverse(...) instead"
            )
        out = q
        if self.lam is not None:
            lam_q = expand_to_query_heads(self.lam, q.shape[1]).to(q)
            out = out * lam_q[None, :, None, :]
        if self.query_matrix is not None:
            out = out @ expand_to_query_heads(self.query_matrix, q.shape[1]).to(q)
        h = self.rotation(q.dtype, q.device)
        return out @ h if h is not None else out
