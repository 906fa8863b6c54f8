"""The query-aware key transform: per KV head, a matrix ``A`` fitted to the layer's queries.

For a key error ``e`` (row vector, ``[D]``) the squared score error of a query ``q`` is
``(q e^T)^2``; over the queries that read the key it is, in expectation, ``e S e^T`` with
``S = E[q^T q]`` (``[D, D]``, over the tokens and the query heads of one KV head's group). Any
invertible ``A`` keeps scores exact::

    K~ = K A (then the Hadamard H),    q~ = q A^(-T) (then H),    q~ K~^T = q K^T,

and the error the codebook makes on ``K~`` maps back to ``e = e~ A^(-1)`` (H is orthonormal).

Two choices of ``A`` (both symmetric here):

- ``sqrt``: ``A = S^(1/2)``. Then ``|e A|^2 = e S e^T``: the Euclidean error k-means minimises on
  ``K~`` *is* the expected score error. Measured (docs/results.md), it is much worse than plain
  Hadamard: with ``H`` and one codebook shared by all sub-vectors every channel of ``K~`` gets
  about the same error ``delta ~ trace(A^T C A) / D`` (``C = E[k^T k]``, the keys' second moment),
  and ``S^(1/2)`` amplifies exactly the channels where keys are large too (queries and keys are
  large in the same RoPE channels), so ``delta`` grows more than the weighting saves.
- ``geomean`` (the default): under that equal-error model the expected score error is
  ``delta * trace(A^(-1) S A^(-T)) ~ trace(C P) * trace(S P^(-1)) / D`` with ``P = A A^T``, which
  is smallest (Cauchy-Schwarz) for ``P = C^(-1) # S``, the matrix geometric mean
  ``C^(-1/2) (C^(1/2) S C^(1/2))^(1/2) C^(-1/2)``; we take ``A = P^(1/2)``. In one channel this
  is ``K / (var_k / var_q)^(1/4)``, ``q * (var_k / var_q)^(1/4)``: the paper's smoothing
  (``lam = sqrt(max |K|)``) when queries are isotropic, with the query statistics added.

Ridge: ``S`` and ``C`` are estimated on finitely many calibration tokens and can be
near-singular. Each is normalised by its mean eigenvalue (``trace / D``) and gets ``ridge`` times
its own diagonal added (and :data:`RIDGE_FLOOR` of the mean eigenvalue, so that a channel without
variance stays invertible): ``ridge`` is dimensionless, any ``ridge > 0`` keeps the transform exact
and finite, and a large ridge tends to a per-channel scaling (the ``geomean`` of the diagonals,
``(var_q / var_k)^(1/4)``: the paper's smoothing with the query statistics). A ridge proportional
to the diagonal keeps the transform equivariant to a rescaling of key channels (keys ``K G``,
queries ``q G^(-1)``, ``G`` diagonal, scores unchanged): the geometric mean of the rescaled
moments is ``G^(-1) P G^(-1)``, so ``K~`` only turns by an orthogonal matrix. ``ridge * I`` (the
ridge before, docs/results.md "a ridge proportional to the diagonal") was dominated by the
outlier channels of a model whose keys have a few channels 10x the rest, and regularised the
other channels far more than their own variance. The default was chosen on held-out calibration
text only (docs/results.md, "query-aware key transform").
"""

from __future__ import annotations

import torch

DEFAULT_RIDGE = 0.1
RIDGE_FORM = "diagonal"  # written to calibrated files: ridge * diag(m), not the older ridge * I
RIDGE_FLOOR = 1e-6  # of the mean eigenvalue, on the diagonal: a channel without variance stays invertible
KINDS = ("geomean", "sqrt")


def second_moment(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``x: [H, N, D]`` (post-RoPE queries, ``H = H_q``, or keys, ``H = H_kv``; any float dtype)
    -> ``[H_kv, D, D]`` float64, ``mean over the N tokens and the heads of KV head h of x^T x``
    (head ``i`` belongs to KV head ``i // (H // H_kv)``, as in Hugging Face's ``repeat_kv``)."""
    if x.dim() != 3:
        raise ValueError(f"calibration queries/keys must be [H, N, D], got {tuple(x.shape)}")
    h, n, d = x.shape
    if h % num_kv_heads:
        raise ValueError(f"{h} heads are not a multiple of {num_kv_heads} KV heads")
    if n == 0:
        raise ValueError("no calibration tokens: give at least a few thousand tokens of text")
    x = x.double()
    if not torch.isfinite(x).all():
        raise ValueError("query/key statistics contain NaN or inf: check the model's dtype and inputs")
    grouped = x.reshape(num_kv_heads, (h // num_kv_heads) * n, d)
    return grouped.transpose(1, 2) @ grouped / grouped.shape[1]


def _ridged(m: torch.Tensor, ridge: float, what: str) -> torch.Tensor:
    """``[H, D, D]`` float64: ``m`` symmetrised, divided by its mean eigenvalue per head, plus
    ``ridge`` times its diagonal and :data:`RIDGE_FLOOR` on the diagonal."""
    m = (m.double() + m.double().transpose(1, 2)) / 2
    d = m.shape[-1]
    mean_eig = torch.diagonal(m, dim1=1, dim2=2).sum(-1) / d
    if not (mean_eig > 0).all():
        raise ValueError(f"a KV head's {what} are all zero: the query-aware transform needs real activations")
    m = m / mean_eig[:, None, None]
    return m + ridge * torch.diag_embed(torch.diagonal(m, dim1=1, dim2=2)) + RIDGE_FLOOR * torch.eye(d, dtype=m.dtype)


def _power(m: torch.Tensor, p: float) -> torch.Tensor:
    """``m^p`` of symmetric positive definite ``[H, D, D]`` float64 matrices."""
    eig, vec = torch.linalg.eigh(m)
    return (vec * eig.clamp_min(torch.finfo(m.dtype).tiny)[..., None, :] ** p) @ vec.transpose(1, 2)


def query_aware_matrices(
    query_moment: torch.Tensor, key_moment: torch.Tensor | None = None, ridge: float = DEFAULT_RIDGE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_matrix A, query_matrix A^(-T))``, both ``[H_kv, D, D]`` float32 and symmetric, from
    the queries' ``S`` and (for ``geomean``) the keys' ``C`` second moments ``[H_kv, D, D]``
    (:func:`second_moment`): ``A = S_r^(1/2)`` without ``key_moment`` (``sqrt``), else
    ``A = (C_r^(-1) # S_r)^(1/2)`` (``geomean``); ``_r``: normalised and ridged (module docstring)."""
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0 (it keeps the moments invertible), got {ridge}")
    for m, name in ((query_moment, "query moment"), (key_moment, "key moment")):
        if m is not None and (m.dim() != 3 or m.shape[1] != m.shape[2] or m.shape != query_moment.shape):
            raise ValueError(f"{name} must be [H_kv, D, D] like the query moment, got {tuple(m.shape)}")
    s = _ridged(query_moment, ridge, "queries")
    if key_moment is None:
        p = s
    else:
        c = _ridged(key_moment, ridge, "keys")
        c_half, c_inv_half = _power(c, 0.5), _power(c, -0.5)
        p = c_inv_half @ _power(c_half @ s @ c_half, 0.5) @ c_inv_half
        p = (p + p.transpose(1, 2)) / 2
    return _power(p, 0.5).float(), _power(p, -0.5).float()
