"""Error-weighted codes: the codes of a head vector chosen for the error the model reads, not the
squared error.

A value's error ``r = v - v_hat`` reaches the model through ``o_proj``: query head ``g`` adds
``p W_o,g r`` to the layer's output, so the output error of a KV head's value is ``r^T G r`` with
``G = sum over its query heads of W_o,g^T W_o,g``, not ``|r|^2``. A key's error ``r`` (in the
code domain of :mod:`.transform`) moves the score of a query ``q~`` by ``q~ . r``; over the
calibration queries of the KV head that is ``r^T S r``, ``S`` their second moment in the code
domain. The shared codebooks are fitted by k-means to the squared error (a metric-weighted fit
through a transform does worse, docs/results.md); only the choice of codes changes here::

    loss(x_hat) = r^T M r + (w - 1) (r . u)^2       (u = x / |x|, w: the score-aware weight)

``M: [H, D, D]`` per KV head (symmetric, positive definite), ``value_metric = G / mean diag G`` and
``key_metric = I + S / mean diag S`` (:func:`value_metric`, :func:`key_metric`). The sub-vectors
are coupled through ``M``'s off-diagonal blocks, so the encoder starts from the nearest-centroid
(or score-aware) codes and runs :data:`SWEEPS` sweeps of coordinate descent: each sub-vector in
turn takes the centroid of the lowest loss with the others fixed, a ``[N, d] x [d, E]`` product
per sub-vector. The loss never rises (a property test checks it), the codes format, bytes,
codebooks and decode kernels do not change.

Measured (docs/results.md, "error-weighted codes"): evalmodel 2-bit ``qaware`` with score-aware
keys, WikiText-2 every token quantized 1.075x -> 1.051x full precision, with the cache's window
1.011x -> 1.009x, the needle through the cache 0.783 -> 0.800 (metrics and sweeps chosen on
held-out calibration text).
"""

from __future__ import annotations

import torch

from .packing import pack_codes, unpack_codes

SWEEPS = 2
CHUNK_ELEMENTS = 1 << 18  # rows x entries of one sub-vector's loss evaluated at once (1 MiB: the passes stay in cache)


def value_metric(o_proj_weight: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[H_kv, D, D]`` float32 from ``o_proj_weight: [hidden, H_q * D]``: per KV head
    ``G = sum_g W_g^T W_g`` over its query heads (``repeat_kv``'s grouping), divided by its mean
    diagonal."""
    w = o_proj_weight.detach().float()
    heads = w.shape[1] // head_dim
    if heads * head_dim != w.shape[1] or heads % num_kv_heads:
        raise ValueError(
            f"o_proj's input width {w.shape[1]} is not H_q * head_dim with H_q a multiple of "
            f"{num_kv_heads} KV heads (head_dim {head_dim})"
        )
    per_head = w.reshape(w.shape[0], heads, head_dim).transpose(0, 1)  # [H_q, hidden, D]
    gram = per_head.transpose(1, 2) @ per_head  # [H_q, D, D]
    return normalized(gram.reshape(num_kv_heads, heads // num_kv_heads, head_dim, head_dim).sum(1))


def key_metric(query_moment: torch.Tensor) -> torch.Tensor:
    """``I + S / mean diag S`` per KV head from the code-domain query second moment ``S: [H_kv, D, D]``
    (summed over each KV head's query heads): the expected score error plus the squared error
    the codebooks were fitted to."""
    s = normalized(query_moment.float())
    return s + torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)


def normalized(m: torch.Tensor) -> torch.Tensor:
    """``m: [H, D, D]`` symmetrised and divided by its mean diagonal per head (a ValueError when
    it is not finite or a head's diagonal is not positive)."""
    m = (m + m.transpose(-1, -2)) / 2
    scale = m.diagonal(dim1=-2, dim2=-1).mean(-1)
    if not torch.isfinite(m).all() or not (scale > 0).all():
        raise ValueError(
            "an error metric must be finite with a positive diagonal (check the model's weights "
            "and the calibration queries)"
        )
    return m / scale[:, None, None]


def check_metric(metric: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """A ValueError unless ``metric`` is ``[num_heads, head_dim, head_dim]`` floating point."""
    if metric.dim() != 3 or tuple(metric.shape) != (num_heads, head_dim, head_dim) or not metric.is_floating_point():
        raise ValueError(
            f"an error metric must be a float [H={num_heads}, D={head_dim}, D] tensor, got "
            f"{metric.dtype} {tuple(metric.shape)}"
        )


def weighted_loss(
    x: torch.Tensor, x_hat: torch.Tensor, metric: torch.Tensor, parallel_weight: float = 1.0
) -> torch.Tensor:
    """``r^T M r + (w - 1) (r . u)^2`` float32: ``x, x_hat: [B, H, T, D]``, ``metric: [H, D, D]``
    -> ``[B, H, T]``."""
    xf, r = x.float(), (x.float() - x_hat.float())
    loss = torch.einsum("bhtd,hde,bhte->bht", r, metric.float(), r)
    if parallel_weight != 1.0:
        norm = xf.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        loss = loss + (parallel_weight - 1.0) * ((r * xf).sum(-1) / norm) ** 2
    return loss


def weighted_indices(
    x: torch.Tensor,
    start: torch.Tensor,
    centroids: torch.Tensor,
    metric: torch.Tensor,
    parallel_weight: float = 1.0,
    sweeps: int = SWEEPS,
) -> torch.Tensor:
    """Codes ``[B, H, T, D // d]`` (int64) of ``x: [B, H, T, D]`` lowering :func:`weighted_loss`
    from ``start`` (same shape, the nearest-centroid or score-aware codes) by ``sweeps`` sweeps of
    coordinate descent over the sub-vectors; ``centroids: [E, d]``, ``metric: [H, D, D]``.
    A sub-vector keeps its code on a tie, so the loss never rises."""
    b_, h_, t_, dim = x.shape
    entries, d = centroids.shape
    check_metric(metric, h_, dim)
    if b_ * t_ == 0:
        return start.long()
    c = centroids.float().to(x.device)
    m = metric.float().to(x.device)
    blocks = m.unflatten(1, (dim // d, d)).unflatten(-1, (dim // d, d)).diagonal(dim1=1, dim2=3)  # [H, d, d, S]
    cmc = torch.einsum("ed,hdfs,ef->she", c, blocks, c)  # [S, H, E]: c^T M_ss c of every entry
    step = max(1, CHUNK_ELEMENTS // max(1, b_ * h_ * entries))
    return torch.cat(
        [
            _descend(x[:, :, i : i + step], start[:, :, i : i + step], c, m, cmc, parallel_weight, sweeps)
            for i in range(0, t_, step)
        ],
        dim=2,
    )


def _descend(x, start, c, m, cmc, parallel_weight, sweeps):
    """:func:`weighted_indices` of one chunk of tokens (``c``, ``m`` float32 on x's device;
    ``cmc: [S, H, E]``)."""
    entries, d = c.shape
    xf = x.float()
    idx = start.long().clone()
    x_hat = c[idx].flatten(-2)  # [B, H, T, D]
    r = xf - x_hat
    u = xf / xf.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    parallel = parallel_weight - 1.0
    c_t = c.T.contiguous()  # [d, E]
    for _ in range(sweeps):
        for s in range(idx.shape[-1]):
            sl = slice(s * d, (s + 1) * d)
            m_cols, m_block = m[:, :, sl], m[:, sl, sl]  # [H, D, d], [H, d, d]
            z = torch.einsum("bhtd,hde->bhte", r, m_cols) + torch.einsum("bhtd,hde->bhte", x_hat[..., sl], m_block)
            cmc_s = cmc[s][None, :, None, :]
            # loss: [B, H, T, E], up to a per-row constant
            if parallel:
                alpha = (
                    (r * u).sum(-1, keepdim=True)
                    - (r[..., sl] * u[..., sl]).sum(-1, keepdim=True)
                    + (xf[..., sl] * u[..., sl]).sum(-1, keepdim=True)
                )
                # parallel * (alpha - u_s . c)^2 expanded, its parallel * alpha^2 (a per-row constant)
                # left out: two products and two passes over the losses
                uc = u[..., sl] @ c_t
                y = (z + parallel * alpha * u[..., sl]) @ c_t
                loss = torch.addcmul(cmc_s, uc, uc, value=parallel).sub_(y, alpha=2)
            else:
                loss = torch.add(cmc_s, z @ c_t, alpha=-2)
            current = loss.gather(-1, idx[..., s : s + 1])
            best_loss, best = loss.min(-1, keepdim=True)
            best = torch.where(best_loss < current, best, idx[..., s : s + 1])
            idx[..., s] = best[..., 0]
            x_hat[..., sl] = c[best[..., 0]]
            r[..., sl] = xf[..., sl] - x_hat[..., sl]
    return idx


def weigh_stored(
    x: torch.Tensor, stored: torch.Tensor, centroids: torch.Tensor, metric: torch.Tensor, parallel_weight: float = 1.0
) -> torch.Tensor:
    """Stored codes ``[B, H, T, W]`` (uint8, packed as :mod:`.packing` writes) of ``x: [B, H, T, D]``
    lowered by :func:`weighted_indices` from the codes in ``stored`` (a new tensor; the body of
    the opaque op ``vecinfer::weigh_codes``, so compiled graphs do not unroll the descent)."""
    entries = int(centroids.shape[0])
    return pack_codes(weighted_indices(x, unpack_codes(stored, entries), centroids, metric, parallel_weight), entries)
