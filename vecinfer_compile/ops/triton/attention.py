"""Triton prefill / simulate attention over VQ codes.

One program handles one (batch, KV head, block of ``BLOCK_M`` rows). The rows pack the KV head's
group of query heads into the M dimension, interleaved (``row = i * G + g`` for query position i
and group member g), so every K/V tile is dequantized once for the whole group and causal loop
bounds stay tight. K/V tiles are dequantized in registers by gathering centroid rows with
code-derived offsets, each code loaded once from its stored layout (12-bit codes packed, see
:mod:`vecinfer_compile.quant.packing`; the codebook, a few KiB in q's dtype, stays in L1).
Online softmax in base 2; keys inside the residual window (``0 <= (i + Tk - Tq) - j < residual``)
use the full-precision tiles instead of codes, which are only loaded for key blocks that can
contain such keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...quant.packing import is_packed
from ..checks import check_attention_args
from ..split_attention.lse_merge import LOG2E
from .common import check_head_dim_pow2, dequant_tile_2d, launch, softmax_step, unit_last_stride


@dataclass(frozen=True)
class AttentionConfig:
    """Launch shape: ``block_m`` rows (query position x group member) per program, ``block_n``
    keys per loop step. The default was the fastest of the shapes that
    ``benchmarks/bench_simulate_attention.py --sweep`` times on the H200, at both of its cases
    and in repeated runs (ahead of ``(64, 64, 4, 2)``)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 1


DEFAULT_CONFIG = AttentionConfig()

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2


@triton.jit
def _attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    kcent_ptr,
    vcent_ptr,
    kf_ptr,
    vf_ptr,
    mask_ptr,
    out_ptr,
    sq_b,
    sq_h,
    sq_t,
    skc_b,
    skc_h,
    skc_t,
    svc_b,
    svc_h,
    svc_t,
    skf_b,
    skf_h,
    skf_t,
    svf_b,
    svf_h,
    svf_t,
    sm_b,
    sm_h,
    sm_i,
    sm_j,
    so_b,
    so_h,
    so_t,
    H_KV,
    TQ,
    TK,
    residual,
    qk_scale,
    G: tl.constexpr,
    D: tl.constexpr,
    DSUB_K: tl.constexpr,
    DSUB_V: tl.constexpr,
    PACKED_K: tl.constexpr,
    PACKED_V: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    qk_scale = tl.full([], qk_scale, tl.float32)  # Inductor passes Python floats as fp64
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H_KV
    kvh = bh % H_KV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    head = kvh * G + rows % G
    row_ok = qi < TQ
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_t + d[None, :], mask=row_ok[:, None], other=0.0
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    i_lo = (pid_m * BLOCK_M) // G
    i_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, TQ - 1)
    k_end = TK
    if IS_CAUSAL:
        k_end = tl.minimum(TK, i_hi + 1)
    kc_base = kc_ptr + b * skc_b + kvh * skc_h
    vc_base = vc_ptr + b * svc_b + kvh * svc_h
    for j0 in range(0, k_end, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_ok = offs_j < TK
        k = dequant_tile_2d(kc_base, skc_t, offs_j, j_ok, kcent_ptr, BLOCK_N, D, DSUB_K, PACKED_K)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if HAS_RESIDUAL:
            near = (i_lo + TK - TQ) - (j0 + BLOCK_N - 1) < residual
            back = qi[:, None] + (TK - TQ) - offs_j[None, :]  # the simulate rule of vecinfer_compile.window
            full = (back >= 0) & (back < residual)
            if near:
                kf = tl.load(
                    kf_ptr + b * skf_b + kvh * skf_h + offs_j[:, None] * skf_t + d[None, :],
                    mask=j_ok[:, None],
                    other=0.0,
                ).to(q.dtype)
                if IEEE:
                    s_full = tl.dot(q, tl.trans(kf), input_precision="ieee")
                else:
                    s_full = tl.dot(q, tl.trans(kf))
                s = tl.where(full, s_full, s)
        s = s * qk_scale
        if MASK_KIND == 1:
            mv = tl.load(
                mask_ptr + b * sm_b + head[:, None] * sm_h + qi[:, None] * sm_i + offs_j[None, :] * sm_j,
                mask=row_ok[:, None] & j_ok[None, :],
                other=1,
            )
            s = tl.where(mv != 0, s, float("-inf"))
        if MASK_KIND == 2:
            mv = tl.load(
                mask_ptr + b * sm_b + head[:, None] * sm_h + qi[:, None] * sm_i + offs_j[None, :] * sm_j,
                mask=row_ok[:, None] & j_ok[None, :],
                other=0.0,
            )
            s = s + mv.to(tl.float32) * 1.4426950408889634
        keep = j_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_j[None, :] <= qi[:, None])
        s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None]
        v = dequant_tile_2d(vc_base, svc_t, offs_j, j_ok, vcent_ptr, BLOCK_N, D, DSUB_V, PACKED_V)
        if HAS_RESIDUAL:
            if near:
                vf = tl.load(
                    vf_ptr + b * svf_b + kvh * svf_h + offs_j[:, None] * svf_t + d[None, :],
                    mask=j_ok[:, None],
                    other=0.0,
                ).to(q.dtype)
                p_full = tl.where(full, p, 0.0)
                p = p - p_full
                if IEEE:
                    acc += tl.dot(p_full.to(q.dtype), vf, input_precision="ieee")
                else:
                    acc += tl.dot(p_full.to(q.dtype), vf)
        if IEEE:
            acc += tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(q.dtype), v)

    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(
        out_ptr + b * so_b + head[:, None] * so_h + qi[:, None] * so_t + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def _mask_view(attn_mask: torch.Tensor | None, b: int, hq: int, tq: int, tk: int):
    """-> (kind, tensor, strides over [B, Hq, Tq, Tk] with 0 on broadcast dims)."""
    if attn_mask is None:
        return MASK_NONE, None, (0, 0, 0, 0)
    kind = MASK_BOOL if attn_mask.dtype == torch.bool else MASK_FLOAT
    # A bool mask is converted (a copy of the un-expanded mask), not viewed as uint8: Inductor
    # on torch 2.11 cannot lower a dtype view of a bool tensor.
    mask = attn_mask.to(torch.uint8) if kind == MASK_BOOL else attn_mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mask = mask.expand(b, hq, tq, tk)
    return kind, mask, mask.stride()


def attention_triton(
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
    *,
    wrap: bool = False,
    config: AttentionConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Same contract as :func:`vecinfer_compile.ops.reference.attention`; returns
    ``[B, Hq, Tq, D]`` in q.dtype. ``wrap=True`` launches through ``wrap_triton`` (inside the op);
    ``config`` is the launch shape (benchmarks sweep it)."""
    group = check_attention_args(q, k_codes, v_codes, k_centroids, v_centroids, k_full, v_full, attn_mask, residual)
    b, hq, tq, d = q.shape
    hkv, tk = k_codes.shape[1], k_codes.shape[2]
    check_head_dim_pow2(d)
    q = unit_last_stride(q)
    k_codes, v_codes = k_codes.contiguous(), v_codes.contiguous()
    has_residual = residual > 0
    kf = k_full if has_residual else k_codes
    vf = v_full if has_residual else v_codes
    if has_residual:
        kf, vf = unit_last_stride(kf), unit_last_stride(vf)
    kind, mask, mask_strides = _mask_view(attn_mask, b, hq, tq, tk)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    grid = (triton.cdiv(tq * group, config.block_m), b * hkv)
    launch(
        _attention_kernel,
        grid,
        wrap,
        # Centroids in q's dtype: the tiles are cast to it anyway, and half the bytes to gather.
        q,
        k_codes,
        v_codes,
        k_centroids.to(q.dtype).contiguous(),
        v_centroids.to(q.dtype).contiguous(),
        kf,
        vf,
        mask if mask is not None else q,
        out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_codes.stride(0),
        k_codes.stride(1),
        k_codes.stride(2),
        v_codes.stride(0),
        v_codes.stride(1),
        v_codes.stride(2),
        kf.stride(0),
        kf.stride(1),
        kf.stride(2),
        vf.stride(0),
        vf.stride(1),
        vf.stride(2),
        *mask_strides,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        hkv,
        tq,
        tk,
        residual,
        scale * LOG2E,
        G=group,
        D=d,
        DSUB_K=k_centroids.shape[1],
        DSUB_V=v_centroids.shape[1],
        PACKED_K=is_packed(k_centroids.shape[0]),
        PACKED_V=is_packed(v_centroids.shape[0]),
        MASK_KIND=kind,
        IS_CAUSAL=is_causal,
        HAS_RESIDUAL=has_residual,
        IEEE=q.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
