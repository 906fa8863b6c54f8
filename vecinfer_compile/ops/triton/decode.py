"""Triton decode attention over a compressed cache (flash-decoding).

Three launches per step:

1. (``score="lut"`` only) ``_lut_kernel``: per query head, ``LUT[g, sub, e] = scale * log2(e) *
   q~_sub . centroid_e`` in float32, ``[B * Hkv, G, D // dk, E]``.
2. ``_split_kernel``: grid ``(splits, B * Hkv)``; each program reads one contiguous chunk of the
   coded positions ONCE for all ``G`` query heads of its KV head (the heads are the rows of the
   ``tl.dot`` M dimension, padded to 16) and writes its partial (max, sum, accumulator) to a
   float32 scratch buffer. Key scores: ``score="dequant"`` gathers centroid sub-vectors into a K
   tile and multiplies by q~; ``score="lut"`` sums ``LUT[sub, code]`` over sub-vectors.
3. ``_merge_kernel``: grid ``(B * Hkv,)``; log-sum-exp merge of the partials, then the
   full-precision residual window folded in by the same online softmax, then normalisation.

Codes are read in their stored layout (:mod:`vecinfer_compile.quant.packing`: 12-bit codes two
in three bytes, the high nibbles after the low bytes). Centroids are gathered from global memory
(a 256 x 4 bf16 codebook is 2 KiB and stays in L1), one vectorised centroid row per code. The
split kernel runs unpipelined (``num_stages=1``): with software pipelining Triton turns the
gathers into 8-byte ``cp.async`` copies through shared memory, which made the kernel several
times slower at large batches and long contexts (``bench_decode_attention.py --sweep``; see
docs/results/decode-speed.md). Holding the codebook as a
register tensor and gathering with ``tl.gather`` fails to compile on Triton 3.6 for these shapes
(an assertion that the gather be warp-local), so that variant is not offered.

The split count depends only on shapes (``B * Hkv`` and ``Tmax``), never on ``n_coded``, so CUDA
graphs and compile do not specialise on the cache length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ...quant.packing import is_packed
from ..checks import check_decode_args
from ..coded_kv import CodedKV
from ..split_attention.lse_merge import LOG2E
from .common import (
    block_rows,
    check_head_dim_pow2,
    dequant_tile,
    launch,
    load_codes,
    rows_for_head_dim,
    softmax_step,
    unit_last_stride,
)

BLOCK_R = 64  # window slots per step of the merge
BLOCK_E = 128  # centroids per LUT program
NUM_WARPS = 4  # LUT and merge kernels
MIN_CHUNK = 256  # fewest positions per split


@dataclass(frozen=True)
class SplitConfig:
    """Launch shape of the split kernel: ``block_n`` coded positions per loop step, ``waves``
    target waves of programs over the SMs (sets the split count)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 1
    waves: int = 3


DEFAULT_SPLIT = SplitConfig()
DEFAULT_SMS = 132  # H100/H200; used when the device cannot be queried (interpreter on CPU)
SCORES = ("dequant", "lut")


@triton.jit
def _lut_kernel(
    q_ptr,
    cent_ptr,
    lut_ptr,
    sq_b,
    sq_h,
    H_KV,
    E,
    qk_scale,
    G: tl.constexpr,
    DSUB: tl.constexpr,
    NSUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """LUT ``[B * Hkv, G, NSUB, E]`` float32 for q ``[B, Hq, 1, D]`` and centroids ``[E, DSUB]``."""
    qk_scale = tl.full([], qk_scale, tl.float32)  # Inductor passes Python floats as fp64
    row = tl.program_id(0)  # (b * H_KV + kvh) * G + g
    sub = tl.program_id(1)
    b = row // (H_KV * G)
    head = row % (H_KV * G)
    offs_e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    acc = tl.zeros([BLOCK_E], tl.float32)
    for k in tl.static_range(DSUB):
        qk = tl.load(q_ptr + b * sq_b + head * sq_h + sub * DSUB + k).to(tl.float32)
        acc += qk * tl.load(cent_ptr + offs_e * DSUB + k, mask=e_mask, other=0.0)
    tl.store(lut_ptr + (row * NSUB + sub) * E + offs_e, acc * qk_scale, mask=e_mask)


@triton.jit
def _split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    kcent_ptr,
    vcent_ptr,
    lut_ptr,
    n_coded_ptr,
    start_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    sq_b,
    sq_h,
    skc_b,
    skc_h,
    skc_t,
    svc_b,
    svc_h,
    svc_t,
    H_KV,
    NUM_SPLITS,
    CHUNK,
    qk_scale,
    E_K: tl.constexpr,
    PACKED_K: tl.constexpr,
    PACKED_V: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    DSUB_K: tl.constexpr,
    DSUB_V: tl.constexpr,
    SCORE_LUT: tl.constexpr,
    HAS_START: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    qk_scale = tl.full([], qk_scale, tl.float32)  # Inductor passes Python floats as fp64
    pid_s = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H_KV
    kvh = bh % H_KV
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (kvh * G + g)[:, None] * sq_h + d[None, :], mask=g_ok[:, None], other=0.0)
    n_coded = tl.load(n_coded_ptr)
    start = 0
    if HAS_START:
        start = tl.load(start_ptr + b)
    lo = pid_s * CHUNK
    hi = tl.minimum(lo + CHUNK, n_coded)
    kc_base = kc_ptr + b * skc_b + kvh * skc_h
    vc_base = vc_ptr + b * svc_b + kvh * svc_h
    NSUB_K: tl.constexpr = D // DSUB_K
    sub = tl.arange(0, NSUB_K)
    lut_base = lut_ptr + bh * G * NSUB_K * E_K

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        offs = j0 + tl.arange(0, BLOCK_N)
        in_chunk = offs < hi
        if SCORE_LUT:
            codes = load_codes(kc_base, skc_t, offs, in_chunk, NSUB_K, PACKED_K)
            s = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
            for gi in tl.static_range(G):
                part = tl.load(lut_base + (gi * NSUB_K + sub[None, :]) * E_K + codes, mask=in_chunk[:, None], other=0.0)
                s = tl.where(g[:, None] == gi, tl.sum(part, 1)[None, :], s)
        else:
            k = dequant_tile(kc_base, skc_t, offs, in_chunk, kcent_ptr, BLOCK_N, D, DSUB_K, PACKED_K)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where((in_chunk & (offs >= start))[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        v = dequant_tile(vc_base, svc_t, offs, in_chunk, vcent_ptr, BLOCK_N, D, DSUB_V, PACKED_V)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
    part_row = (bh * NUM_SPLITS + pid_s) * BLOCK_G + g
    tl.store(pm_ptr + part_row, m_i)
    tl.store(pl_ptr + part_row, l_i)
    tl.store(pacc_ptr + part_row[:, None] * D + d[None, :], acc)


@triton.jit
def _merge_kernel(
    q_ptr,
    kw_ptr,
    vw_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    out_ptr,
    n_coded_ptr,
    n_window_ptr,
    start_ptr,
    sq_b,
    sq_h,
    skw_b,
    skw_h,
    skw_t,
    svw_b,
    svw_h,
    svw_t,
    so_b,
    so_h,
    H_KV,
    NUM_SPLITS,
    R,
    qk_scale,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    HAS_START: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    qk_scale = tl.full([], qk_scale, tl.float32)  # Inductor passes Python floats as fp64
    bh = tl.program_id(0)
    b = bh // H_KV
    kvh = bh % H_KV
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    d = tl.arange(0, D)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for split in range(0, NUM_SPLITS):
        row = (bh * NUM_SPLITS + split) * BLOCK_G + g
        m_s = tl.load(pm_ptr + row)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(m_s - m_safe)
        l_i = l_i * alpha + tl.load(pl_ptr + row) * beta
        acc = acc * alpha[:, None] + tl.load(pacc_ptr + row[:, None] * D + d[None, :]) * beta[:, None]
        m_i = m_new

    q = tl.load(q_ptr + b * sq_b + (kvh * G + g)[:, None] * sq_h + d[None, :], mask=g_ok[:, None], other=0.0)
    n_coded = tl.load(n_coded_ptr)
    n_window = tl.minimum(tl.load(n_window_ptr), R)
    start = 0
    if HAS_START:
        start = tl.load(start_ptr + b)
    kw_base = kw_ptr + b * skw_b + kvh * skw_h
    vw_base = vw_ptr + b * svw_b + kvh * svw_h
    for r0 in range(0, n_window, BLOCK_R):
        slot = r0 + tl.arange(0, BLOCK_R)
        ok = slot < n_window
        kw = tl.load(kw_base + slot[:, None] * skw_t + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        vw = tl.load(vw_base + slot[:, None] * svw_t + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(kw), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(kw)) * qk_scale
        s = tl.where((ok & (n_coded + slot >= start))[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vw, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vw)
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(
        out_ptr + b * so_b + (kvh * G + g)[:, None] * so_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None],
    )


def num_splits(
    batch_heads: int, tmax: int, device: torch.device, config: SplitConfig = DEFAULT_SPLIT
) -> tuple[int, int]:
    """``(splits, chunk)`` for ``batch_heads = B * Hkv`` programs over ``tmax`` coded positions:
    enough splits for ~``config.waves`` waves of the device's SMs, chunks of at least
    ``MIN_CHUNK`` positions, a multiple of ``config.block_n``."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SMS
    splits = max(1, min(triton.cdiv(config.waves * sms, batch_heads), triton.cdiv(tmax, MIN_CHUNK)))
    chunk = triton.cdiv(triton.cdiv(max(tmax, 1), splits), config.block_n) * config.block_n
    return triton.cdiv(max(tmax, 1), chunk), chunk


def decode_attention_triton(
    q: torch.Tensor,
    kv: CodedKV,
    kv_start: torch.Tensor | None,
    scale: float,
    *,
    score: str = "dequant",
    wrap: bool = False,
    config: SplitConfig = DEFAULT_SPLIT,
) -> torch.Tensor:
    """Same contract as :func:`vecinfer_compile.ops.reference.decode_attention`; returns
    ``[B, Hq, 1, D]`` in q.dtype. ``score``: ``"dequant"`` (gather centroids into a K tile) or
    ``"lut"`` (per-query lookup table). ``wrap=True`` launches through ``wrap_triton``;
    ``config`` is the split kernel's launch shape (benchmarks sweep it); heads wider than 128 take
    fewer positions per step in both kernels (:func:`~.common.rows_for_head_dim`)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    group = check_decode_args(q, kv, kv_start)
    k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window = kv
    b, hq, _, d = q.shape
    hkv, tmax = k_codes.shape[1], k_codes.shape[2]
    check_head_dim_pow2(d)
    config = replace(config, block_n=rows_for_head_dim(config.block_n, d))
    q = unit_last_stride(q)
    k_codes, v_codes = k_codes.contiguous(), v_codes.contiguous()
    k_window, v_window = unit_last_stride(k_window), unit_last_stride(v_window)
    k_centroids = k_centroids.contiguous()
    # Centroids in q's dtype: the tiles are cast to it anyway, and half the bytes to gather.
    k_cent_q, v_cent_q = k_centroids.to(q.dtype), v_centroids.to(q.dtype).contiguous()
    (e_k, dsub_k), dsub_v = k_centroids.shape, v_centroids.shape[1]
    qk_scale = scale * LOG2E
    block_g = block_rows(group)
    ieee = q.dtype == torch.float32
    start = kv_start if kv_start is not None else n_coded
    splits, chunk = num_splits(b * hkv, tmax, q.device, config)
    part_m = torch.empty((b * hkv, splits, block_g), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((b * hkv, splits, block_g, d), dtype=torch.float32, device=q.device)
    use_lut = score == "lut"
    if use_lut:
        lut = torch.empty((b * hkv, group, d // dsub_k, e_k), dtype=torch.float32, device=q.device)
        launch(
            _lut_kernel,
            (b * hq, d // dsub_k, triton.cdiv(e_k, BLOCK_E)),
            wrap,
            q,
            k_centroids,
            lut,
            q.stride(0),
            q.stride(1),
            hkv,
            e_k,
            qk_scale,
            G=group,
            DSUB=dsub_k,
            NSUB=d // dsub_k,
            BLOCK_E=BLOCK_E,
        )
    else:
        lut = part_m  # unused by the dequant variant
    launch(
        _split_kernel,
        (splits, b * hkv),
        wrap,
        q,
        k_codes,
        v_codes,
        k_cent_q,
        v_cent_q,
        lut,
        n_coded,
        start,
        part_m,
        part_l,
        part_acc,
        q.stride(0),
        q.stride(1),
        k_codes.stride(0),
        k_codes.stride(1),
        k_codes.stride(2),
        v_codes.stride(0),
        v_codes.stride(1),
        v_codes.stride(2),
        hkv,
        splits,
        chunk,
        qk_scale,
        E_K=e_k,
        PACKED_K=is_packed(e_k),
        PACKED_V=is_packed(v_centroids.shape[0]),
        G=group,
        BLOCK_G=block_g,
        D=d,
        DSUB_K=dsub_k,
        DSUB_V=dsub_v,
        SCORE_LUT=use_lut,
        HAS_START=kv_start is not None,
        IEEE=ieee,
        BLOCK_N=config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    out = torch.empty((b, hq, 1, d), dtype=q.dtype, device=q.device)
    launch(
        _merge_kernel,
        (b * hkv,),
        wrap,
        q,
        k_window,
        v_window,
        part_m,
        part_l,
        part_acc,
        out,
        n_coded,
        n_window,
        start,
        q.stride(0),
        q.stride(1),
        k_window.stride(0),
        k_window.stride(1),
        k_window.stride(2),
        v_window.stride(0),
        v_window.stride(1),
        v_window.stride(2),
        out.stride(0),
        out.stride(1),
        hkv,
        splits,
        k_window.shape[2],
        qk_scale,
        G=group,
        BLOCK_G=block_g,
        D=d,
        HAS_START=kv_start is not None,
        IEEE=ieee,
        BLOCK_R=rows_for_head_dim(BLOCK_R, d),
        num_warps=NUM_WARPS,
    )
    return out
