"""The window rule of a :class:`~vecinfer_compile.cache.VecInferCache` forward as a mask (tests
compare the eager simulate path against it)."""

from __future__ import annotations

import torch


def cache_window_mask(tq: int, tk: int, residual: int, *, prefill: bool = False, device=None) -> torch.Tensor:
    """``[Tq, Tk]`` bool, True where key ``j`` is read in full precision by query ``i`` in a
    :class:`VecInferCache` forward of ``Tq`` new tokens over ``Tk`` cached slots (queries are the
    last ``Tq`` slots, bottom-right aligned, as in HF).

    - ``prefill=True`` (the first update of an empty cache): everything is full precision.
    - one new token (decode): key ``j`` is full precision iff ``(Tk - 1) - j < residual``, the
      simulate rule ``i - j < residual``.
    - a chunk of ``Tq >= 2`` tokens appended to a non-empty cache: the window as it was before the
      chunk and the chunk itself, i.e. iff ``j >= Tk - Tq - residual`` (the rule of
      :mod:`vecinfer_compile.ops.chunk_attention`): at least the simulate rule's keys for every query.

    Causality is not part of this mask (combine with the causal/padding mask as usual).
    """
    if prefill:
        return torch.ones(tq, tk, dtype=torch.bool, device=device)
    j = torch.arange(tk, device=device)
    full = (tk - 1 - j) < residual if tq == 1 else j >= tk - tq - residual
    return full[None, :].expand(tq, tk).clone()
