"""The full-precision window: which keys a query reads in full precision, and which as codes.

This module is the one place the rule is written; every path (the simulate attention, its
windowed form, the reference and Triton attention over codes, the cache's reads and the chunk
attention) calls it or follows the layout it states.

**Simulate rule.** With a window of ``R`` keys, key ``j`` is full precision for query ``i`` iff
``0 <= i - j < R``, positions bottom-right aligned (query row ``r`` of ``Tq`` over ``Tk`` keys sits
at position ``i = r + Tk - Tq``). Keys after a query's position, visible only through a
non-causal mask, count as quantized.

**Cache rule** (:class:`~vecinfer_compile.cache.VecInferCache`):

- the first update of an empty cache (prefill) attends in full precision, then encodes;
- one new token (a decode step) is appended first and reads the window of the ``R`` newest
  tokens, itself included: the simulate rule for its position;
- a chunk of ``C >= 2`` tokens entering a non-empty cache attends over
  ``[coded prefix ; the window as it was before the chunk ; the chunk's own keys]``, the last two
  in full precision, causal within the chunk, and only then is encoded: key ``j`` of ``Tk`` slots
  is full precision iff ``j >= Tk - C - R`` (:func:`chunk_full_start`). No query ever sees fewer
  than its last ``R`` keys in full precision, so a chunked prompt is never less accurate than the
  simulate path at the same ``R``.
"""

from __future__ import annotations

import torch

__all__ = ["cache_mask", "chunk_full_start", "in_window", "simulate_mask", "split_prefill"]


def in_window(i, j, residual: int):
    """Whether key position ``j`` is inside query position ``i``'s full-precision window of
    ``residual`` keys (``0 <= i - j < residual``). ``i``, ``j``: ints or broadcastable integer
    tensors (any index layout: dense rows, band blocks, a kernel's tiles)."""
    back = i - j
    return (back >= 0) & (back < residual)


def simulate_mask(tq: int, tk: int, residual: int, device=None) -> torch.Tensor:
    """``[Tq, Tk]`` bool, True where key ``j`` is inside query row ``i``'s window by the simulate
    rule, queries bottom-right aligned."""
    i = torch.arange(tq, device=device)[:, None] + (tk - tq)
    j = torch.arange(tk, device=device)[None, :]
    return in_window(i, j, residual)


def chunk_full_start(tk: int, tq: int, residual: int) -> int:
    """The first of ``Tk`` slots a chunk of ``Tq >= 2`` new tokens (the last ``Tq`` slots) reads in
    full precision: the window before the chunk, then the chunk itself."""
    return max(tk - tq - residual, 0)


def cache_mask(tq: int, tk: int, residual: int, *, prefill: bool = False, device=None) -> torch.Tensor:
    """``[Tq, Tk]`` bool, True where key ``j`` is read in full precision by query ``i`` in a
    :class:`~vecinfer_compile.cache.VecInferCache` forward of ``Tq`` new tokens over ``Tk`` cached
    slots (queries are the last ``Tq`` slots, bottom-right aligned, as in HF): everything for a
    ``prefill``; the simulate rule for one token; from :func:`chunk_full_start` on for a chunk.
    Causality is not part of this mask (combine it with the causal/padding mask as usual)."""
    if prefill:
        return torch.ones(tq, tk, dtype=torch.bool, device=device)
    if tq == 1:
        return simulate_mask(1, tk, residual, device)
    j = torch.arange(tk, device=device)
    return (j >= chunk_full_start(tk, tq, residual))[None, :].expand(tq, tk).clone()


def split_prefill(tokens: int, residual: int) -> tuple[int, int]:
    """``(coded, window)``: how the prefill of ``tokens`` into an empty cache layer is stored: all but
    the newest ``residual`` as codes, those (or all, for a shorter prompt) in the window, so that the
    next token reads its last ``R`` keys in full precision (:func:`in_window`)."""
    coded = max(tokens - residual, 0)
    return coded, tokens - coded
