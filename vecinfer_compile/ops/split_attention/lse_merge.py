"""Merging two attentions over disjoint key sets by their log-sum-exp.

If ``(o1, L1)`` and ``(o2, L2)`` are softmax attentions of the same queries over two disjoint key
sets (``L`` the log of the sum of ``exp(score)``), the attention over their union is::

    out = (exp(L1 - m) o1 + exp(L2 - m) o2) / (exp(L1 - m) + exp(L2 - m)),   m = max(L1, L2)

A row with no key in a set has ``L = -inf`` there; a row with none in either is zeros. Shared by
the windowed simulate attention (:mod:`.windowed`: quantized keys + the
full-precision band) and the chunk attention over a compressed cache (:mod:`.chunk`:
the coded prefix + the full-precision window and chunk). :func:`merge_splits` is the same merge
over the splits of a flash-decoding kernel (a codec's split decode kernels).
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # log2(e): the decode kernels take their scores in log2 units


def merge_by_lse(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``o1``, ``o2``: ``[..., D]`` (any float dtypes); ``l1``, ``l2``: ``[...]`` float, ``-inf``
    where the row has no key in that set. Returns ``[..., D]`` in ``dtype``, computed in float32
    (float64 for float64 inputs)."""
    acc = torch.promote_types(torch.promote_types(l1.dtype, l2.dtype), torch.float32)
    l1, l2 = l1.to(acc), l2.to(acc)
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc, device=m.device))
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    total = w1 + w2
    out = (w1 * o1.to(acc) + w2 * o2.to(acc)) / torch.where(
        total > 0, total, torch.ones((), dtype=acc, device=total.device)
    )
    return out.to(dtype)


def merge_splits(
    acc: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A split decode kernel's partials, ``acc [N, splits, BG, D]`` (the unnormalised sums of its
    split), ``m, l_sum [N, splits, BG]`` (the split's running max and sum of ``exp2``: scores in log2
    units), float32, ``BG >= group`` rows padded -> ``(o [N, group, D], lse [N, group])`` float32:
    the attention over every split and its natural log-sum-exp (zeros and ``-inf`` for a row with
    nothing to attend)."""
    m, l_sum, acc = m[:, :, :group], l_sum[:, :, :group], acc[:, :, :group]
    top = m.amax(1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    w = torch.exp2(m - top)  # [N, splits, G]
    total = (w * l_sum).sum(1)
    o = (w[..., None] * acc).sum(1) / total.clamp_min(1e-30)[..., None]
    lse = torch.where(total > 0, (top[:, 0] + torch.log2(total.clamp_min(1e-30))) / LOG2E, float("-inf"))
    return torch.where(total[..., None] > 0, o, 0.0), lse


def flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2's log-sum-exp with its empty rows (``+inf``: a row that saw no key) as
    ``-inf``, the value :func:`merge_by_lse` reads as "no key"."""
    return torch.where(lse == float("inf"), torch.full((), float("-inf"), dtype=lse.dtype, device=lse.device), lse)
