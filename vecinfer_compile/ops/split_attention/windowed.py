"""Windowed simulate attention: a fused kernel over the quantized keys, a blockwise band over the
full-precision window, merged by log-sum-exp.

With a residual window of R keys and ``off = Tk - Tq`` (queries bottom-right aligned: query ``i``
sits at key position ``i + off``), key ``j`` is read in full precision (``K~``, ``V``) by query
``i`` when ``0 <= (i + off) - j < R``: the R most recent keys up to the query's own position. Every
other key is read quantize-dequantized (``K^``, ``V^``): the older keys ``j <= i + off - R`` and
the keys after the query's position ``j > i + off``, which only a non-causal mask can make
visible (as :func:`vecinfer_compile.ops.reference.attention`). The two key sets are disjoint, so
the softmax over all visible keys splits into two attentions merged by their log-sum-exp
(:func:`vecinfer_compile.ops.split_attention.lse_merge.merge_by_lse`):

- the quantized part ``(o1, L1)``, over ``K^``/``V^``: one fused attention kernel that returns
  its log-sum-exp. Without a tensor mask and with ``is_causal`` (and ``Tk >= Tq``) the rule is
  ``j <= i - shift`` with ``shift = max(0, R - off)``: causal attention of ``q[:, :, shift:]``
  over ``K^[:, :, :Tq - shift]``, a square problem, so the kernel's causal alignment (top-left on
  CPU, bottom-right in the CUDA flash kernel) does not matter; rows ``i < shift`` have no
  quantized key. CUDA fp16/bf16: cuDNN attention (``aten._scaled_dot_product_cudnn_attention``)
  on sm90 and newer, SDPA's own first choice there (about twice as fast as FlashAttention-2 on
  Hopper: docs/studies/windowed-simulate-attention.md), else FlashAttention-2 (``aten._flash_attention_forward``, GQA
  without copies); CUDA fp32: ``aten._scaled_dot_product_efficient_attention(is_causal=True)``; CPU:
  ``aten._scaled_dot_product_flash_attention_for_cpu``. Otherwise (a bool or float mask, no
  causality, ``Tk < Tq``) the rule and the model's mask are composed into one additive bias
  ``[B|1, H|1, Tq + 1, Tk]`` (built once per graph) for ``_scaled_dot_product_efficient_attention``
  on CUDA (rows padded to a multiple of 16 columns and sliced back, expanded to ``[B, Hq, Tq + 1,
  Tk]``, as SDPA's frontend prepares it) or ``_scaled_dot_product_flash_attention_for_cpu``, with one
  zero query row more than Tq whose output is dropped (:func:`_fused` says why). These ops
  need equal head counts: under GQA ``K^``/``V^`` are expanded to ``Hq`` heads (a copy of
  ``[B, Hq, Tk, D]`` each, in q's dtype: the memory HF's ``repeat_kv`` would have used).
- the full-precision part ``(o2, L2)``, the band. CUDA fp16/bf16 without a tensor mask (and
  ``Tk >= Tq``): FlashAttention-2's sliding window (``aten._flash_attention_forward`` with
  ``window_size_left = W - 1, window_size_right = 0``, bottom-right aligned), which visits only
  the key blocks of the window. Without causality it reads all ``Tk`` keys with ``W = R``: key
  ``j`` is visible to query ``i`` iff ``i + off - R < j <= i + off``, the band rule. With SDPA's
  (top-left) ``is_causal`` the band also needs ``j <= i``: it reads the first ``Tq`` keys with
  ``W = R - off`` (``i - W < j <= i``), and with ``W <= 0`` no row has a full-precision key.
  Otherwise pure torch, blockwise, ``O(Tq * R)``. Query
  block ``c`` of ``blk = min(R, 128)`` rows reads a slab of ``blk + R - 1`` consecutive key
  positions starting at ``c * blk + off - R + 1`` (gathered with a clamped index; positions
  outside ``[0, Tk)`` masked), scores ``[B, Hkv, nc, G * blk, blk + R - 1]`` in float32 (GQA by
  grouping the query heads of one KV head, K/V never repeated), the band rule, causality and the
  model's mask gathered at each (query, slab key) applied as one additive bias built once per
  graph, then its own max, log-sum-exp and output.

A row with no visible key in either part is zeros (as SDPA's math backend and the reference);
a kernel's output and log-sum-exp for a row with no visible key are discarded (the CPU flash
kernel returns lse 0 there), using the visibility known from the mask.

:func:`window_plan` builds what depends only on sizes and the mask (the :class:`WindowPlan`);
the SDPA pass emits it once per graph for all layers that share it; :func:`windowed_attention`
runs one layer. Python branches are on sizes only (guards under ``dynamic=True``), never on
tensor values, so both trace under torch.compile (fullgraph, static or dynamic) on CPU and CUDA:
the three aten ops have meta kernels, Inductor calls them as fallback kernels.

Why not FlexAttention over ``[K^ ; K~]`` with a block-sparse mask (the previous form): on an
H200 with torch 2.11 its Inductor lowering failed on the graphs this backend makes. A compiled
``eval-ppl --residual 128`` on an HF Llama crashed with ``LoweringException: AssertionError:
convert FlexibleLayout to FixedLayout first`` (the mask_mod captured HF's attention mask, a tensor
computed inside the graph); the benchmark's second shape crashed under dynamic shapes with
``AttributeError: 'ShapeAsConstantBuffer' object has no attribute 'dtype'`` (symbolic ints
captured by the mask_mod); and where it ran, its first call took minutes to compile and it was
slower than the no-window form (docs/studies/windowed-simulate-attention.md). Its CPU stand-in
materialised the ``[Tq, 2 Tk]`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...window import in_window
from .flash import cudnn_serves as _cudnn_serves
from .flash import flash_serves as _flash_serves
from .lse_merge import merge_by_lse

aten = torch.ops.aten

BAND_BLOCK = 128  # query rows per band block at most (the block is min(R, BAND_BLOCK))
_MEM_EFF_ALIGNMENT = 16  # SDPA's frontend pads the efficient kernel's bias rows to this (preprocess_mask)


@dataclass
class WindowPlan:
    """What one windowed attention shape needs beyond q, K and V, built once per graph by
    :func:`window_plan`.

    shape: ``(B, Hq, Tq, Tk)``; residual: R; block: query rows per band block.
    shift: the causal form of the quantized part (no tensor mask, ``is_causal``, ``Tk >= Tq``):
    rows ``[0, shift)`` have no quantized key, row ``i >= shift`` reads ``K^[j]`` for
    ``j <= i - shift``; None for the bias form.
    quant_bias / quant_rows: the bias form: additive ``[B|1, Hq|1, Tq + 1, Tk]`` in the kernel's
    dtype, ``-inf`` outside the quantized keys (model mask included; the last row is padding),
    and bool ``[B|1, Hq|1, Tq]``, rows with some visible quantized key; None for the causal form.
    band_index: long ``[nc * (block + R - 1)]``, the key position of each band slab slot, clamped
    into ``[0, Tk)``; band_bias: float ``[B|1, Hkv|1, nc, G|1, block, block + R - 1]``, additive,
    ``-inf`` where the slot is not a visible full-precision key of the row (rows past Tq
    included); both None when FlashAttention-2's sliding window runs the band.
    flash_band: that sliding window, ``(keys, W)``: the band reads ``K~[:, :, :keys]`` with a
    window of ``W`` keys ending at each query's bottom-right aligned position (no key when
    ``W <= 0``); None for the torch band."""

    shape: tuple
    residual: int
    block: int
    shift: int | None
    quant_bias: torch.Tensor | None
    quant_rows: torch.Tensor | None
    band_index: torch.Tensor | None
    band_bias: torch.Tensor | None
    flash_band: tuple | None


def _flash_shape(q: torch.Tensor, max_dim: int = 256) -> bool:
    """q's dtype and head dim suit the CUDA flash and cuDNN kernels (fp16/bf16, head dim a multiple
    of 8 up to ``max_dim``: 256 for FlashAttention-2, 128 for cuDNN)."""
    d = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= max_dim


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs: the band's and the merge's precision."""
    return torch.promote_types(dtype, torch.float32)


def _bias_dtype(q: torch.Tensor) -> torch.dtype:
    """The quantized part's bias dtype: q's on CUDA (the efficient kernel requires it), float32 (or
    float64) on CPU, where the flash kernel takes a float mask of another dtype."""
    return q.dtype if q.device.type == "cuda" else _acc_dtype(q.dtype)


def _split_mask(attn_mask: torch.Tensor | None, tq, tk):
    """SDPA's mask -> (allowed bool, bias float or None), both 4-d views expanded to
    ``[B|1, Hq|1, Tq, Tk]``; (None, None) without a mask."""
    if attn_mask is None:
        return None, None
    mask = _as_4d(attn_mask)
    size = (mask.shape[0], mask.shape[1], tq, tk)
    if mask.dtype == torch.bool:
        return mask.expand(size), None
    if mask.is_floating_point():
        mask = mask.expand(size)
        return mask > float("-inf"), mask
    raise ValueError(f"attn_mask must be bool (True = attend) or an additive float mask, got {mask.dtype}")


def _additive(visible: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """0 (or the model's bias) where visible, -inf elsewhere, in ``dtype``."""
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=visible.device)
    value = torch.zeros((), dtype=dtype, device=visible.device) if bias is None else bias.to(dtype)
    return torch.where(visible, value, neg_inf)


def _quantized_bias(q, tq, tk, residual, is_causal, allowed, bias):
    """The bias form of the quantized part: (additive bias, rows with a visible key)."""
    i = torch.arange(tq, device=q.device)[:, None]
    j = torch.arange(tk, device=q.device)[None, :]
    visible = ~in_window(i + (tk - tq), j, residual)
    if is_causal:
        visible = visible & (j <= i)
    visible = visible[None, None] if allowed is None else visible & allowed
    out = _additive(visible, bias, _bias_dtype(q))
    # One row more than Tq, for _fused's extra query row. Rows padded to an aligned stride, as
    # SDPA's frontend pads them for the efficient kernel, and always by at least one column: a
    # slice back to Tk that is never the whole row keeps dynamic-shape graphs free of a guard on
    # Tk % 16 (its contiguity would depend on it). On every device, so the CPU tests trace it.
    padded = (tk // _MEM_EFF_ALIGNMENT + 1) * _MEM_EFF_ALIGNMENT
    out = F.pad(out, (0, padded - tk, 0, 1))[..., :tk]
    return out, visible.any(-1)


def _band_bias(q, hkv, tq, tk, residual, block, is_causal, allowed, bias):
    """(band_index, band_bias) of :class:`WindowPlan`."""
    hq = q.shape[1]
    group = hq // hkv
    off = tk - tq
    slab = block + residual - 1
    # blocks always cover more than Tq rows: _band_part's [:tq] slices are never whole, so no guard
    # on their contiguity under dynamic shapes depends on whether the block divides Tq
    nc = tq // block + 1
    c = torch.arange(nc, device=q.device)[:, None]
    rows = c * block + torch.arange(block, device=q.device)[None, :]  # [nc, block]
    keys = c * block + (off - residual + 1) + torch.arange(slab, device=q.device)[None, :]  # [nc, slab]
    i, j = rows[:, :, None], keys[:, None, :]
    visible = in_window(i + off, j, residual) & (j >= 0) & (j < tk) & (i < tq)  # [nc, block, slab]
    if is_causal:
        visible = visible & (j <= i)
    key_index = keys.clamp(0, tk - 1)
    model_bias = None
    if allowed is None:
        visible = visible[None, None]
    else:  # the model's mask at (row, slab key): [B|1, Hq|1, nc, block, slab]
        at = (rows.clamp(max=tq - 1)[:, :, None], key_index[:, None, :])
        visible = visible & allowed[:, :, at[0], at[1]]
        model_bias = None if bias is None else bias[:, :, at[0], at[1]]
    out = _additive(visible, model_bias, _acc_dtype(q.dtype))
    if out.shape[1] == 1:
        out = out.unsqueeze(3)  # [B|1, 1, nc, 1, block, slab]
    else:  # query head h = kv head h // G, member h % G
        out = out.reshape(out.shape[0], hkv, group, nc, block, slab).transpose(2, 3)
    return key_index.reshape(-1), out


def window_plan(
    q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, residual: int
) -> WindowPlan:
    """The :class:`WindowPlan` for queries ``q: [B, Hq, Tq, D]`` over keys ``k: [B, Hkv, Tk, D]``
    (only their sizes, dtype and device are read) with SDPA's ``attn_mask`` (None, bool or additive
    float, broadcastable to ``[B, Hq, Tq, Tk]``) and ``is_causal`` (top-left, as SDPA), and a window
    of ``residual`` keys (> 0)."""
    if residual <= 0:
        raise ValueError(f"window_plan needs residual > 0, got {residual}: without a window use plain SDPA")
    if q.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"windowed simulate attention runs on CPU and CUDA, not {q.device.type}")
    if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise NotImplementedError(f"windowed simulate attention on CUDA takes fp16, bf16 or fp32, not {q.dtype}")
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    allowed, bias = _split_mask(attn_mask, tq, tk)
    block = min(residual, BAND_BLOCK)
    index = band = flash_band = None
    if attn_mask is None and tk >= tq and _flash_shape(q) and _flash_serves(q.device):
        flash_band = (tq, residual - (tk - tq)) if is_causal else (tk, residual)
    else:
        index, band = _band_bias(q, hkv, tq, tk, residual, block, is_causal, allowed, bias)
    shift = quant_bias = quant_rows = None
    if attn_mask is None and is_causal and tk >= tq:
        shift = max(0, residual - (tk - tq))
    else:
        quant_bias, quant_rows = _quantized_bias(q, tq, tk, residual, is_causal, allowed, bias)
    return WindowPlan((b, hq, tq, tk), residual, block, shift, quant_bias, quant_rows, index, band, flash_band)


def _repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` -> ``[B, Hkv * G, T, D]`` (query head h reads KV head h // G): a copy."""
    if group == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, group, t, d).reshape(b, h * group, t, d)


def _flash(q, k, v, scale, window: int | None = None):
    """Causal FlashAttention-2, bottom-right aligned (``off = Tk - Tq``): query ``i`` reads key ``j``
    for ``j <= i + off``, and with ``window`` only for ``i + off - window < j``. ``q: [B, Hq, Tq,
    D]``, ``k``, ``v``: ``[B, Hkv, Tk, D]`` (GQA read in the kernel, no copies). Returns (out
    ``[B, Hq, Tq, D]`` q.dtype, lse ``[B, Hq, Tq]`` float32)."""
    left = -1 if window is None else window - 1
    out, lse = aten._flash_attention_forward(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        True,
        False,
        scale=scale,
        window_size_left=left,
        window_size_right=0,
    )[:2]
    return out.transpose(1, 2), lse


def _cudnn_causal(q, k, v, scale):
    """Causal cuDNN attention of ``q: [B, H, T, D]`` over ``k``, ``v``: ``[B, H, T, D]`` (equal
    heads, square). Returns (out ``[B, H, T, D]`` q.dtype, lse ``[B, H, T]`` float32)."""
    out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def _fused(q, k, v, bias, is_causal: bool, scale):
    """One fused attention kernel: (out ``[B, H, Tq, D]`` q.dtype, lse ``[B, H, Tq]``). ``bias``:
    additive, broadcastable to ``[B, H, Tq + 1, Tk]`` (:func:`_quantized_bias`), or None.

    The CPU flash and CUDA efficient kernels get one zero query row more than Tq, dropped after:
    the efficient kernel pads its lse to a multiple of 32 rows, and slicing back to a Tq that is
    never the whole length keeps dynamic-shape graphs free of a guard on ``Tq % 32`` (causality
    is top-left in both: the first Tq rows are unchanged). The CUDA flash kernel (bottom-right
    causality; fp16/bf16 without a bias where FlashAttention-2 serves: a head dim that needs
    padding) gets q as it is; its lse is not padded."""
    tq, d = q.shape[2], q.shape[3]
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            F.pad(q, (0, 0, 0, 1)), k, v, 0.0, is_causal, attn_mask=bias, scale=scale
        )
        return out[:, :, :tq], lse[:, :, :tq]
    pad = -d % 8  # the CUDA kernels take head dims in multiples of 8: zeros change no score
    if pad:
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
    if bias is None and q.dtype in (torch.float16, torch.bfloat16) and d + pad <= 256 and _flash_serves(q.device):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    else:
        q = F.pad(q, (0, 0, 0, 1))  # the extra row
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], tq + 1, k.shape[2])
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, is_causal, scale=scale)[:2]
        out, lse = out[:, :, :tq], lse[:, :, :tq]
    return (out[..., :d] if pad else out), lse


def _quantized_part(q, k_hat, v_hat, plan: WindowPlan, scale):
    """(o1 ``[B, Hq, Tq, D]``, L1 ``[B, Hq, Tq]`` float) of the quantized keys, or None when no
    row has one (causal form only)."""
    hq, tq = plan.shape[1], plan.shape[2]
    group = hq // k_hat.shape[1]
    if plan.shift is None:
        out, lse = _fused(q, _repeat_heads(k_hat, group), _repeat_heads(v_hat, group), plan.quant_bias, False, scale)
        rows = plan.quant_rows
        return (
            torch.where(rows[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device)),
            torch.where(rows, lse, float("-inf")),
        )
    shift = plan.shift
    n = tq - shift
    if n <= 0:
        return None
    q_q, k_q, v_q = q[:, :, shift:], k_hat[:, :, :n], v_hat[:, :, :n]
    if _flash_shape(q, 128) and _cudnn_serves(q.device):
        out, lse = _cudnn_causal(q_q, _repeat_heads(k_q, group), _repeat_heads(v_q, group), scale)
    elif _flash_shape(q) and _flash_serves(q.device):
        out, lse = _flash(q_q, k_q, v_q, scale)
    else:
        out, lse = _fused(q_q, _repeat_heads(k_q, group), _repeat_heads(v_q, group), None, True, scale)
    if shift:
        out = F.pad(out, (0, 0, shift, 0))
        lse = F.pad(lse, (shift, 0), value=float("-inf"))
    return out, lse


def _band_part(q, k, v, plan: WindowPlan, scale):
    """(o2 ``[B, Hq, Tq, D]``, L2 ``[B, Hq, Tq]``) of the full-precision window: q's dtype and
    float32 from FlashAttention-2's sliding window, float from the blockwise torch band."""
    if plan.flash_band is not None:
        keys, window = plan.flash_band
        if window <= 0:  # every visible key is quantized
            return torch.zeros_like(q), torch.full(plan.shape[:3], float("-inf"), device=q.device)
        return _flash(q, k[:, :, :keys], v[:, :, :keys], scale, window=window)
    b, hq, tq, _ = plan.shape
    hkv, d = k.shape[1], k.shape[3]
    group, block = hq // hkv, plan.block
    slab = block + plan.residual - 1
    nc = plan.band_bias.shape[2]
    acc = _acc_dtype(q.dtype)
    qb = F.pad(q.to(acc), (0, 0, 0, nc * block - tq))
    qb = qb.reshape(b, hkv, group, nc, block, d).transpose(2, 3).reshape(b, hkv, nc, group * block, d)
    ks = k.index_select(2, plan.band_index).to(acc).reshape(b, hkv, nc, slab, d)
    vs = v.index_select(2, plan.band_index).to(acc).reshape(b, hkv, nc, slab, d)
    s = (qb @ ks.transpose(-1, -2)).reshape(b, hkv, nc, group, block, slab) * scale + plan.band_bias
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc, device=m.device))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = (p.reshape(b, hkv, nc, group * block, slab) @ vs).reshape(b, hkv, nc, group, block, d)
    out = out / torch.where(total > 0, total, torch.ones((), dtype=acc, device=m.device))
    lse = (m + torch.log(total)).squeeze(-1)  # -inf where nothing is visible
    out = out.permute(0, 1, 3, 2, 4, 5).reshape(b, hq, nc * block, d)[:, :, :tq]
    lse = lse.permute(0, 1, 3, 2, 4).reshape(b, hq, nc * block)[:, :, :tq]
    return out, lse


def windowed_attention(
    q: torch.Tensor, k_hat: torch.Tensor, k: torch.Tensor, v_hat: torch.Tensor, v: torch.Tensor, plan: WindowPlan, scale
) -> torch.Tensor:
    """Attention of ``q: [B, Hq, Tq, D]`` over dequantized ``k_hat``/``v_hat`` outside the window
    and full-precision ``k``/``v`` inside it (all ``[B, Hkv, Tk, D]``, q's dtype), ``plan`` from
    :func:`window_plan` for these sizes. Returns ``[B, Hq, Tq, D]`` in q.dtype; rows with no
    visible key are zeros."""
    o2, l2 = _band_part(q, k, v, plan, scale)
    quantized = _quantized_part(q, k_hat, v_hat, plan, scale)
    if quantized is None:
        return o2.to(q.dtype)
    o1, l1 = quantized
    return merge_by_lse(o1, l1, o2, l2, q.dtype)
