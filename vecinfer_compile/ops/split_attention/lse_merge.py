"""Merging two attentions over disjoint key sets by their log-sum-exp.

If ``(o1, L1)`` and ``(o2, L2)`` are softmax attentions of the same queries over two disjoint key
sets (``L`` the log of the sum of ``exp(score)``), the attention over their union is::

    out = (exp(L1 - m) o1 + exp(L2 - m) o2) / (exp(L1 - m) + exp(L2 - m)),   m = max(L1, L2)

A row with no key in a set has ``L = -inf`` there; a row with none in either is zeros. Shared by
the windowed simulate attention (:mod:`.windowed`: quantized keys + the
full-precision band) and the chunk attention over a compressed cache (:mod:`.chunk`:
the coded prefix + the full-precision window and chunk).
"""

from __future__ import annotations

import torch


def merge_by_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """``o1``, ``o2``: ``[..., D]`` (any float dtypes); ``l1``, ``l2``: ``[...]`` float, ``-inf``
    where the row has no key in that set. Returns ``[..., D]`` in ``dtype``, computed in float32
    (float64 for float64 inputs)."""
    acc = torch.promote_types(torch.promote_types(l1.dtype, l2.dtype), torch.float32)
    l1, l2 = l1.to(acc), l2.to(acc)
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc, device=m.device))
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    total = w1 + w2
    out = (w1 * o1.to(acc) + w2 * o2.to(acc)) / torch.where(total > 0, total, torch.ones((), dtype=acc,
                                                                                         device=total.device))
    return out.to(dtype)


def flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2's log-sum-exp with its empty rows (``+inf``: a row that saw no key) as
    ``-inf``, the value :func:`merge_by_lse` reads as "no key"."""
    return torch.where(lse == float("inf"), torch.full((), float("-inf"), dtype=lse.dtype, device=lse.device), lse)
