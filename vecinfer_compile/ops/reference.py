"""Pure-torch reference of the ``vecinfer`` ops: the oracle for the kernels and the CPU path.

Everything is computed in float32 and returned in ``q.dtype`` (codes for :func:`encode`).
Codes are uint8 in the stored layout of :mod:`..quant.packing` (12-bit codes of codebooks over
256 entries packed two in three bytes); dequantization is ``centroids[unpack_codes(codes)]``.
GQA never repeats K/V: queries are viewed as ``[B, Hkv, G * Tq, D]`` (query head ``h`` uses KV
head ``h // G``). No ``.item()`` and no
data-dependent Python, so the functions trace with symbolic shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..quant.packing import pack_codes, unpack_codes
from ..quant.score_aware import score_aware_indices
from ..window import simulate_mask
from .checks import check_attention_args, check_decode_args, check_encode_args
from .coded_kv import CodedKV

if TYPE_CHECKING:
    from .split_attention.chunk import ChunkKeys


def dequantize(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Stored codes ``[B, H, T, packed_width(D // d, E)]`` uint8, centroids ``[E, d]`` ->
    ``[B, H, T, D]`` float32."""
    idx = unpack_codes(codes, centroids.shape[0])
    b, h, t, n = idx.shape
    return centroids.float()[idx].reshape(b, h, t, n * centroids.shape[1])


def encode(
    x: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    centroids: torch.Tensor,
    parallel_weight: float = 1.0,
) -> torch.Tensor:
    """Codes of ``((x / lam) @ rotation)``.

    x ``[B, H, T, D]`` float; lam ``[H, D]`` float32 or None; rotation ``[D, D]`` or None;
    centroids ``[E, d]`` float32 -> stored codes ``[B, H, T, packed_width(D // d, E)]`` uint8 (one
    byte per code for E <= 256, 12-bit codes packed two in three bytes above): the nearest
    centroid by squared distance in float32 (as ``quant.codebook.encode``), or with
    ``parallel_weight > 1`` the score-aware codes of :mod:`..quant.score_aware` over that search.
    """
    check_encode_args(x, lam, rotation, centroids)
    work = x.float()
    if lam is not None:
        work = work / lam.float()[None, :, None, :]
    if rotation is not None:
        work = work @ rotation.float()
    entries, dims = centroids.shape
    c = centroids.float()

    def nearest(y: torch.Tensor) -> torch.Tensor:
        b, h, t, d = y.shape
        sub = y.reshape(b, h, t, d // dims, dims)
        dist = (sub * sub).sum(-1, keepdim=True) - 2.0 * (sub @ c.T) + (c * c).sum(-1)
        return dist.argmin(-1)

    return pack_codes(score_aware_indices(work, c, parallel_weight, nearest), entries)


def quantize(
    x: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    centroids: torch.Tensor,
    parallel_weight: float = 1.0,
) -> torch.Tensor:
    """Quantize-dequantize: the centroid values of :func:`encode`'s codes, ``[B, H, T, D]`` in
    x.dtype (in the transformed space when ``lam``/``rotation`` are given)."""
    return dequantize(encode(x, lam, rotation, centroids, parallel_weight), centroids).to(x.dtype)


def _safe_softmax_weights(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised weights and their row sums; a row of all ``-inf`` gives zeros (no NaN)."""
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    return p, p.sum(-1, keepdim=True)


def _normalise(acc: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    return torch.where(denom > 0, acc / denom.clamp_min(torch.finfo(acc.dtype).tiny), torch.zeros_like(acc))


def _mask_bias(attn_mask: torch.Tensor, b: int, hq: int, tq: int, tk: int, hkv: int) -> torch.Tensor:
    """bool (True = attend) or additive float mask -> additive float32 ``[B|1, Hkv, G, Tq, Tk]``."""
    mask = attn_mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mb = mask.shape[0]
    mask = mask.expand(mb, hq, tq, tk).reshape(mb, hkv, hq // hkv, tq, tk)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float()


def attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    k_full: torch.Tensor | None,
    v_full: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    residual: int,
) -> torch.Tensor:
    """Attention of transformed queries over quantized keys/values (prefill / simulate).

    q ``[B, Hq, Tq, D]`` (q~) fp16/bf16/fp32; k_codes ``[B, Hkv, Tk, Wk]``, v_codes
    ``[B, Hkv, Tk, Wv]`` uint8 stored codes (``W = packed_width(D // d, E)``); centroids float32 ``[E, d]``; k_full/v_full ``[B, Hkv, Tk, D]``
    replace the codes of key j for query i inside its window of ``residual`` keys by the simulate
    rule of :mod:`vecinfer_compile.window` (keys after the query's position, which only a
    non-causal mask makes visible, stay quantized); attn_mask bool
    (True = attend) or additive float, broadcastable to ``[B, Hq, Tq, Tk]``; is_causal: key
    ``j <= i`` (top-left, as SDPA). Fully masked rows give zeros. Returns ``[B, Hq, Tq, D]``
    in q.dtype.
    """
    group = check_attention_args(q, k_codes, v_codes, k_centroids, v_centroids, k_full, v_full, attn_mask, residual)
    b, hq, tq, d = q.shape
    hkv, tk = k_codes.shape[1], k_codes.shape[2]
    k = dequantize(k_codes, k_centroids)
    v = dequantize(v_codes, v_centroids)
    qf = q.float().reshape(b, hkv, group * tq, d)
    scores = (qf @ k.transpose(-1, -2)).reshape(b, hkv, group, tq, tk) * scale
    i = torch.arange(tq, device=q.device)[:, None]
    j = torch.arange(tk, device=q.device)[None, :]
    if residual > 0:
        full = simulate_mask(tq, tk, residual, q.device)
        full_scores = (qf @ k_full.float().transpose(-1, -2)).reshape(b, hkv, group, tq, tk) * scale
        scores = torch.where(full, full_scores, scores)
    if attn_mask is not None:
        scores = scores + _mask_bias(attn_mask, b, hq, tq, tk, hkv)
    if is_causal:
        scores = scores.masked_fill(j > i, float("-inf"))
    p, denom = _safe_softmax_weights(scores)
    if residual > 0:
        p_full = torch.where(full, p, torch.zeros_like(p))
        acc = (p - p_full).reshape(b, hkv, group * tq, tk) @ v
        acc = acc + p_full.reshape(b, hkv, group * tq, tk) @ v_full.float()
    else:
        acc = p.reshape(b, hkv, group * tq, tk) @ v
    out = _normalise(acc, denom.reshape(b, hkv, group * tq, 1))
    return out.reshape(b, hq, tq, d).to(q.dtype)


def decode_attention(q: torch.Tensor, kv: CodedKV, kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One decode step over a compressed cache.

    q ``[B, Hq, 1, D]`` (q~); ``kv`` (:class:`~.coded_kv.CodedKV`): k_codes/v_codes
    ``[B, Hkv, Tmax, W]`` uint8 stored codes (``W = packed_width(D // d, E)``) of which the first
    ``n_coded`` (0-d int tensor) positions are valid; k_window (K~) / v_window ``[B, Hkv, R, D]``
    full precision, first ``n_window`` valid, slot s is position ``n_coded + s``; kv_start ``[B]``
    int or None masks positions ``< kv_start[b]``. Returns ``[B, Hq, 1, D]`` in q.dtype.
    """
    group = check_decode_args(q, kv, kv_start)
    k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window = kv
    b, hq, _, d = q.shape
    hkv, tmax = k_codes.shape[1], k_codes.shape[2]
    r = k_window.shape[2]
    keys = torch.cat([dequantize(k_codes, k_centroids), k_window.float()], dim=2)
    values = torch.cat([dequantize(v_codes, v_centroids), v_window.float()], dim=2)
    coded_pos = torch.arange(tmax, device=q.device)
    slot = torch.arange(r, device=q.device)
    pos = torch.cat([coded_pos, n_coded + slot])
    valid = torch.cat([coded_pos < n_coded, slot < n_window])[None, :]
    if kv_start is not None:
        valid = valid & (pos[None, :] >= kv_start[:, None])
    qf = q.float().reshape(b, hkv, group, d)
    scores = (qf @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p, denom = _safe_softmax_weights(scores)
    out = _normalise(p @ values, denom)
    return out.reshape(b, hq, 1, d).to(q.dtype)


def chunk_mask(batch: int, chunk: int, length: int, kv_start: torch.Tensor | None, device) -> torch.Tensor:
    """The rule's visibility as a bool mask ``[B|1, 1, C, L]`` (True = attend) over the ``L``
    slots: the chunk's queries are the last ``C`` slots (bottom-right causal), slots before
    ``kv_start[b]`` (``[B]`` int, or None for no padding) hidden. HF's mask for a chunk with left
    padding is exactly this."""
    i = torch.arange(chunk, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    visible = (j <= i + (length - chunk))[None]
    if kv_start is not None:
        visible = visible & (j[None] >= kv_start.to(device).long()[:, None, None])
    return visible[:, None]


def chunk_kv_dense(keys: ChunkKeys, rows: slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, H, L, D]`` keys and values of ``rows`` of a chunk's
    :class:`~vecinfer_compile.ops.split_attention.chunk.ChunkKeys`: the prefix decoded by its codec, then
    the full-precision part (the chunk case of :mod:`vecinfer_compile.window`)."""
    n = keys.n_coded
    k_coded, v_coded = keys.prefix.dense(keys.k_codes[rows, :, :n], keys.v_codes[rows, :, :n])
    k = torch.cat([k_coded.to(dtype), keys.k_full[rows].transpose(1, 2).to(dtype)], dim=2)
    v = torch.cat([v_coded.to(dtype), keys.v_full[rows].transpose(1, 2).to(dtype)], dim=2)
    return k, v


def chunk_attention(
    q: torch.Tensor, keys: ChunkKeys, kv_start: torch.Tensor | None, scale: float, attn_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The chunk attention's oracle (:mod:`.split_attention.chunk`): float32 attention of ``q: [B, Hq, C, D]`` (``q~``) over all ``L`` slots of
    ``keys`` with :func:`chunk_mask` (or ``attn_mask``, bool True = attend or additive float,
    broadcastable to ``[B, Hq, C, L]``). Rows with no visible key are zeros. Returns
    ``[B, Hq, C, D]`` in q.dtype."""
    b, hq, c, d = q.shape
    k, v = chunk_kv_dense(keys, slice(None), torch.float32)
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    mask = chunk_mask(b, c, keys.length, kv_start, q.device) if attn_mask is None else attn_mask
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    top = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    total = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(total > 0, total, torch.ones_like(total))
    return out.to(q.dtype)
