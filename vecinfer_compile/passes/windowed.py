"""Windowed simulate attention: one FlexAttention call over ``[K^ ; K~]`` and ``[V^ ; V]``.

With a residual window of R keys, key ``j`` is full precision for query ``i`` when
``(i + Tk - Tq) - j < R`` (bottom-right aligned, as :func:`vecinfer_compile.ops.reference.attention`)
and quantize-dequantized otherwise. Concatenating the dequantized and the full-precision keys
along the sequence (index ``n`` in ``[0, 2 Tk)``: ``n < Tk`` is ``K^[n]``, ``n >= Tk`` is
``K~[n - Tk]``) turns that into plain attention with a mask: each query sees every key once, from
one half or the other. FlexAttention runs it block-sparsely, so a query reads about
``Tk + R`` keys, not ``2 Tk``; under torch.compile Inductor lowers it to its own kernel (Triton on
CUDA, C++ on CPU).

The mask composes, for key ``j`` of half ``n``:

- the window rule (``n < Tk`` iff ``j`` is outside the window),
- SDPA's ``is_causal`` (top-left: ``j <= i``),
- the model's ``attn_mask``: bool (True = attend) or additive float, broadcastable to
  ``[B, Hq, Tq, Tk]``; a float mask is added to the score (``score_mod``) and its ``-inf``
  entries are masked out.

:func:`window_mask` builds the :class:`WindowMask` once per (query length, key length, mask);
the SDPA pass emits it once per graph for all layers that share it. Without a tensor mask the
block structure is computed from the per-row key intervals (``O(Tq * 2 Tk / 128)`` work, never the
``Tq x 2 Tk`` mask); with one, FlexAttention's ``create_block_mask`` evaluates the composed rule.

On CPU the same attention runs as one SDPA call with the composed mask materialised
(:func:`dense_windowed`): Inductor's C++ FlexAttention template (torch 2.13) fails on the graphs the
backend makes — a mask tensor computed inside the graph, symbolic lengths under
``dynamic=True``, a query that is a view of a 3-d matmul — and has no float16 kernel. FlexAttention
itself still runs on CPU eagerly (the tests check it there against the reference).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BLOCK = 128  # FlexAttention's default sparse block size (query rows x keys)


@dataclass
class WindowMask:
    """The mask of one windowed attention shape ``[B, Hq, Tq, Tk]``. rule: ``mask_mod`` of the
    window rule and causality on the concatenated key index; allowed / bias: the model's mask
    as bool (True = attend) and additive float (or None), 4-d ``[B|1, Hq|1, Tq, Tk]``;
    block_mask: FlexAttention's mask over ``[Tq, 2 Tk]``, or None where attention runs dense."""

    shape: tuple
    rule: Callable
    allowed: torch.Tensor | None
    bias: torch.Tensor | None
    block_mask: BlockMask | None


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def _mask_mod(tq, tk, residual: int, is_causal: bool, allowed: torch.Tensor | None):
    """``mask_mod(b, h, i, n)`` on the concatenated key index; ``allowed``: bool
    ``[B, Hq, Tq, Tk]`` (an expanded view) or None."""
    offset = tk - tq

    def mask_mod(b, h, i, n):
        quantized = n < tk
        j = torch.where(quantized, n, n - tk)
        in_window = (i + offset - j) < residual
        keep = (quantized & ~in_window) | (~quantized & in_window)  # no `!=` on bools: Inductor's
        if is_causal:                                                 # value ranges reject it
            keep = keep & (j <= i)
        if allowed is not None:
            keep = keep & allowed[b, h, i, j]
        return keep

    return mask_mod


def _overlap(lo: torch.Tensor, hi: torch.Tensor, start: torch.Tensor, end: int) -> torch.Tensor:
    """Length of ``[lo, hi] ∩ [start, start + end)`` (broadcast), >= 0."""
    return (torch.minimum(hi, start + end - 1) - torch.maximum(lo, start) + 1).clamp_min(0)


def _index_block_mask(tq, tk, residual: int, is_causal: bool, device) -> BlockMask:
    """The block mask of the window rule and causality alone, from each query row's two key
    intervals: quantized ``j in [0, e(i)]`` and full precision ``j in [s(i), f(i)]`` with
    ``e(i) = min(i + Tk - Tq - R, Tk - 1[, i])``, ``s(i) = max(i + Tk - Tq - R + 1, 0)``,
    ``f(i) = min(Tk - 1[, i])`` (``[, i]``: with is_causal). A block is full when all its
    ``BLOCK x BLOCK`` pairs are visible, partial when some are."""
    q_blocks = (tq + BLOCK - 1) // BLOCK
    kv_blocks = (2 * tk + BLOCK - 1) // BLOCK
    i = torch.arange(q_blocks * BLOCK, device=device)[:, None]
    start = torch.arange(kv_blocks, device=device)[None, :] * BLOCK
    edge = i + (tk - tq) - residual
    last = torch.full_like(i, tk - 1)
    if is_causal:
        last = torch.minimum(last, i)
    quant_hi = torch.minimum(edge, last)
    full_lo = (edge + 1).clamp_min(0)
    visible = _overlap(torch.zeros_like(i), quant_hi, start, BLOCK) + _overlap(full_lo + tk, last + tk, start, BLOCK)
    visible = torch.where(i < tq, visible, torch.zeros_like(visible))
    counts = visible.reshape(q_blocks, BLOCK, kv_blocks).sum(1)[None, None]
    partial = ((counts > 0) & (counts < BLOCK * BLOCK)).to(torch.int32)
    full = (counts == BLOCK * BLOCK).to(torch.int32)
    return BlockMask.from_kv_blocks(
        partial.sum(-1, dtype=torch.int32), torch.argsort(partial, dim=-1, descending=True, stable=True).to(torch.int32),
        full.sum(-1, dtype=torch.int32), torch.argsort(full, dim=-1, descending=True, stable=True).to(torch.int32),
        BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=_mask_mod(tq, tk, residual, is_causal, None), seq_lengths=(tq, 2 * tk),
    )


def window_mask(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                residual: int, *, flex: bool | None = None) -> WindowMask:
    """The :class:`WindowMask` for queries ``q: [B, Hq, Tq, D]`` over keys ``k: [B, Hkv, Tk, D]``
    (only their sizes and device are read) with SDPA's ``attn_mask`` (None, bool or additive
    float, broadcastable to ``[B, Hq, Tq, Tk]``) and ``is_causal``, and a window of ``residual``
    keys (> 0). flex: build FlexAttention's block mask (default: off the CPU)."""
    if residual <= 0:
        raise ValueError(f"window_mask needs residual > 0, got {residual}: without a window use plain SDPA")
    b, hq, tq, _ = q.shape
    tk = k.shape[2]
    flex = q.device.type != "cpu" if flex is None else flex
    allowed = bias = None
    if attn_mask is not None:
        mask = _as_4d(attn_mask)
        if mask.dtype == torch.bool:
            allowed = mask
        elif mask.is_floating_point():
            allowed, bias = mask > float("-inf"), mask
        else:
            raise ValueError(f"attn_mask must be bool (True = attend) or an additive float mask, got {mask.dtype}")
    rule = _mask_mod(tq, tk, residual, is_causal, None)
    block_mask = None
    if flex and allowed is None:
        block_mask = _index_block_mask(tq, tk, residual, is_causal, q.device)
    elif flex:
        mb, mh = allowed.shape[0], allowed.shape[1]
        # FlexAttention calls mask_mod with every (b, h) of the query: index an expanded view
        mask_mod = _mask_mod(tq, tk, residual, is_causal, allowed.expand(b, hq, tq, tk))
        block_mask = create_block_mask(mask_mod, None if mb == 1 else b, None if mh == 1 else hq, tq, 2 * tk,
                                       device=q.device, BLOCK_SIZE=BLOCK)
    return WindowMask((b, hq, tq, tk), rule, allowed, bias, block_mask)


def dense_windowed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: WindowMask,
                   scale) -> torch.Tensor:
    """The attention of :func:`flex_windowed` as one SDPA call with the composed mask
    materialised (``[B|1, Hq|1, Tq, 2 Tk]`` float32); rows with no visible key are zeros."""
    _, hq, tq, tk = mask.shape
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    i = torch.arange(tq, device=q.device)[:, None]
    n = torch.arange(2 * tk, device=q.device)[None, :]
    visible = mask.rule(zero, zero, i, n)[None, None]
    if mask.allowed is not None:
        visible = visible & torch.cat([mask.allowed, mask.allowed], dim=-1)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device).masked_fill(~visible, float("-inf"))
    if mask.bias is not None:
        bias = bias + torch.cat([mask.bias, mask.bias], dim=-1).float()
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=bias.to(q.dtype), scale=scale, enable_gqa=bool(hq != keys.shape[1]))
    return torch.where(visible.any(-1, keepdim=True), out, torch.zeros_like(out))


def _bias_score_mod(bias: torch.Tensor, tk):
    def score_mod(score, b, h, i, n):
        j = torch.where(n < tk, n, n - tk)
        return score + bias[b, h, i, j].to(score.dtype)

    return score_mod


def flex_windowed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: WindowMask,
                  scale) -> torch.Tensor:
    """FlexAttention of ``q: [B, Hq, Tq, D]`` over ``keys``/``values: [B, Hkv, 2 Tk, D]``
    (``[K^ ; K~]``) with ``mask.block_mask``; the model's float mask is added by a score_mod."""
    b, hq, tq, tk = mask.shape
    score_mod = None if mask.bias is None else _bias_score_mod(mask.bias.expand(b, hq, tq, tk), tk)
    call = dict(score_mod=score_mod, block_mask=mask.block_mask, scale=scale, enable_gqa=bool(hq != keys.shape[1]))
    if torch.compiler.is_dynamo_compiling():
        return flex_attention(q, keys, values, **call)
    with warnings.catch_warnings():
        # Outside Dynamo this call is either traced by the backend into the graph Inductor
        # compiles, or runs eagerly on small inputs (tests); the advice to compile
        # flex_attention is for neither.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, keys, values, **call)


def windowed_attention(q: torch.Tensor, k_hat: torch.Tensor, k: torch.Tensor, v_hat: torch.Tensor,
                       v: torch.Tensor, mask: WindowMask, scale) -> torch.Tensor:
    """Attention of ``q: [B, Hq, Tq, D]`` over dequantized ``k_hat``/``v_hat`` outside the window
    and full-precision ``k``/``v`` inside it (all ``[B, Hkv, Tk, D]``, q's dtype; GQA without
    repeating K/V). ``mask`` from :func:`window_mask` for these sizes: FlexAttention when it has a
    block mask, else :func:`dense_windowed`. Returns ``[B, Hq, Tq, D]`` in q.dtype; rows with no
    visible key are zeros."""
    keys = torch.cat([k_hat, k], dim=2)
    values = torch.cat([v_hat, v], dim=2)
    if mask.block_mask is None:
        return dense_windowed(q, keys, values, mask, scale)
    return flex_windowed(q, keys, values, mask, scale)
