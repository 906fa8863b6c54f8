"""The query-aware key transform: per KV head, ``M = S^(1/2)`` from the queries' second moment.

For a key error ``e`` (row vector, ``[D]``) the squared score error of a query ``q`` is
``(q e^T)^2``; over the queries that read the key it is, in expectation, ``e S e^T`` with
``S = E[q^T q]`` (``[D, D]``, over the tokens and the query heads of one KV head's group). With any
``A`` such that ``A A^T = S`` (``A = S^(1/2)``, or ``S^(1/2) H`` with an orthonormal Hadamard
``H``)::

    K~ = K A,    q~ = q A^(-T),    q~ K~^T = q K^T exactly,    |e A|^2 = e S e^T,

so the Euclidean error that k-means minimises on ``K~`` is the expected score error.

Ridge: ``S`` is estimated on finitely many calibration queries and can be near-singular (a
channel the queries never use would get ``M``'s eigenvalue ~0 and ``M^(-1)`` would blow up on the
query side). We use ``S_r = S / s + ridge * I`` with ``s = trace(S) / D`` (the mean eigenvalue),
so ``ridge`` is dimensionless: 0 is the pure query-aware metric, a large ridge tends to the
identity (plain keys up to a scale). Any ``ridge > 0`` keeps the transform exact (``S_r`` is SPD).
The default was chosen on held-out calibration text only (docs/results.md, "qaware").
"""

from __future__ import annotations

import torch

DEFAULT_RIDGE = 0.01


def query_second_moment(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``queries: [H_q, N, D]`` (post-RoPE, any float dtype) -> ``S: [H_kv, D, D]`` float64,
    ``S[h] = mean over the N tokens and the query heads of KV head h of q^T q`` (query head ``i``
    belongs to KV head ``i // (H_q // H_kv)``, as in Hugging Face's ``repeat_kv``)."""
    if queries.dim() != 3:
        raise ValueError(f"queries must be [H_q, N, D], got {tuple(queries.shape)}")
    hq, n, d = queries.shape
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {num_kv_heads} KV heads")
    if n == 0:
        raise ValueError("no calibration queries: give at least a few thousand tokens of text")
    q = queries.double()
    if not torch.isfinite(q).all():
        raise ValueError("query statistics contain NaN or inf: check the model's dtype and inputs")
    grouped = q.reshape(num_kv_heads, (hq // num_kv_heads) * n, d)
    return grouped.transpose(1, 2) @ grouped / grouped.shape[1]


def query_aware_matrices(second_moment: torch.Tensor, ridge: float = DEFAULT_RIDGE
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``S: [H_kv, D, D]`` -> ``(key_matrix, query_matrix)``, both ``[H_kv, D, D]`` float32:
    ``key_matrix = S_r^(1/2)`` and ``query_matrix = S_r^(-1/2)`` (its inverse transpose; both are
    symmetric) with ``S_r = S / (trace(S) / D) + ridge * I`` (module docstring)."""
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0 (it keeps S invertible), got {ridge}")
    if second_moment.dim() != 3 or second_moment.shape[1] != second_moment.shape[2]:
        raise ValueError(f"second moment must be [H_kv, D, D], got {tuple(second_moment.shape)}")
    s = second_moment.double()
    s = (s + s.transpose(1, 2)) / 2
    d = s.shape[-1]
    mean_eig = torch.diagonal(s, dim1=1, dim2=2).sum(-1) / d
    if not (mean_eig > 0).all():
        raise ValueError("a KV head's queries are all zero: the query-aware transform needs real queries")
    s_r = s / mean_eig[:, None, None] + ridge * torch.eye(d, dtype=s.dtype)
    eig, vec = torch.linalg.eigh(s_r)
    eig = eig.clamp_min(ridge)  # S/s is PSD: eigenvalues below ridge are rounding
    root = (vec * eig.sqrt()[:, None, :]) @ vec.transpose(1, 2)
    inv_root = (vec * eig.rsqrt()[:, None, :]) @ vec.transpose(1, 2)
    return root.float(), inv_root.float()
