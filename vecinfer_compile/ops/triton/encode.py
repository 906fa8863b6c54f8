"""Triton encode: nearest centroid of every sub-vector of the transformed keys/values.

Smoothing and rotation, when given, run in torch (one float32 matmul); a kernel does the argmin of
``|c|^2 - 2 x.c`` over the codebook, reading x in its own dtype. Two kernels, picked by codebook
size:

- ``_encode_scan_kernel`` (E <= 256 and a multiple of the unroll, 8-bit codes): every thread owns
  whole sub-vectors and scans the centroids one at a time (each one a broadcast load), keeping its
  best in registers. No cross-thread reduction at all.
- ``_encode_dot_kernel`` (E > 256, 12-bit codes): the dot products of a ``[BLOCK_N, BLOCK_E]``
  tile on the tensor cores (``tf32x3``: float32-accurate), then a row argmin per tile; at 4096
  centroids the scan's per-centroid loop costs more than the reductions.

Why a scan (``benchmarks/bench_encode.py`` times it; docs/studies/simulated-prefill-cost.md has
the measurements): a tiled ``tl.argmin`` spent its time in warp shuffles and spilled registers,
several times slower than the scan. A tensor-core variant for small codebooks (distances as one
bf16 product of split operands, argmin as an integer min over distance bits packed with the index)
was slower too at its best launch shapes: building the split operands and reducing 256 columns per
row cost more than the scan's arithmetic.

Both write the stored layout of :mod:`vecinfer_compile.quant.packing`: a program owns whole head
vectors (rows of ``D // d`` sub-vectors, padded to a power of two), so the two 12-bit codes that
share a high-nibble byte are packed in registers and the byte is written once.

With ``values`` given, a kernel also writes each sub-vector's centroid (quantize-dequantize in one
pass; the simulate path attends over those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...quant.packing import is_packed, pack_codes, packed_width, unpack_codes
from ...quant.score_aware import score_aware_indices
from ..checks import check_encode_args
from .common import launch

SCAN_MAX_ENTRIES = 256


@dataclass(frozen=True)
class EncodeConfig:
    """Launch shapes: the scan kernel takes ``scan_block_n`` sub-vectors per program and
    ``scan_unroll`` centroids per loop step; the tile kernel ``dot_block_n`` x ``dot_block_e``.
    The defaults were the fastest measured on the H200 (``benchmarks/bench_encode.py --sweep``
    times others)."""

    scan_block_n: int = 2048
    scan_unroll: int = 4
    scan_warps: int = 8
    dot_block_n: int = 128
    dot_block_e: int = 64
    dot_warps: int = 4


DEFAULT_CONFIG = EncodeConfig()


@triton.jit
def _lanes(ROWS, NSUB: tl.constexpr, SPAD: tl.constexpr, LANES: tl.constexpr):
    """This program's lanes: ``LANES // SPAD`` whole rows (head vectors) of ``SPAD`` sub-vector
    slots, the first ``NSUB`` of each real. Returns ``(row, s, ok, n)``: row, sub-vector index,
    validity and flat sub-vector index ``row * NSUB + s`` of each lane."""
    lane = tl.arange(0, LANES)
    row = tl.program_id(0) * (LANES // SPAD) + lane // SPAD
    s = lane % SPAD
    ok = (row < ROWS) & (s < NSUB)
    return row, s, ok, row * NSUB + s


@triton.jit
def _store(
    out_ptr,
    val_ptr,
    cent_ptr,
    ROWS,
    best_i,
    dd,
    NSUB: tl.constexpr,
    SPAD: tl.constexpr,
    WIDTH: tl.constexpr,
    DSUB: tl.constexpr,
    LANES: tl.constexpr,
    PACKED: tl.constexpr,
    VALUES: tl.constexpr,
):
    """Codes ``best_i`` (one per lane of :func:`_lanes`) -> out rows of ``WIDTH`` bytes in the
    stored layout of :mod:`vecinfer_compile.quant.packing`; with VALUES their centroids -> val
    ``[ROWS * NSUB, DSUB]`` (``dd``: channel offsets, possibly padded past DSUB).

    Packed (12-bit codes): lane pairs ``(2i, 2i + 1)`` are sub-vectors ``(2j, 2j + 1)`` of one row
    (``SPAD`` is even), so one program writes each high-nibble byte whole; a padding lane past
    ``NSUB`` contributes a 0 nibble."""
    row, s, ok, n = _lanes(ROWS, NSUB, SPAD, LANES)
    best_i = tl.where(ok, best_i, 0)
    if PACKED:
        tl.store(out_ptr + row * WIDTH + s, (best_i & 0xFF).to(tl.uint8), mask=ok)
        lo, hi = tl.split(tl.reshape(best_i >> 8, [LANES // 2, 2]))
        pair_lane = 2 * tl.arange(0, LANES // 2)
        p_row = tl.program_id(0) * (LANES // SPAD) + pair_lane // SPAD
        p_s = pair_lane % SPAD
        tl.store(
            out_ptr + p_row * WIDTH + NSUB + p_s // 2, (lo | (hi << 4)).to(tl.uint8), mask=(p_row < ROWS) & (p_s < NSUB)
        )
    else:
        tl.store(out_ptr + row * WIDTH + s, best_i.to(tl.uint8), mask=ok)
    if VALUES:
        c = tl.load(cent_ptr + best_i[:, None] * DSUB + dd[None, :], mask=(dd < DSUB)[None, :], other=0.0)
        tl.store(
            val_ptr + n[:, None] * DSUB + dd[None, :],
            c.to(val_ptr.dtype.element_ty),
            mask=ok[:, None] & (dd < DSUB)[None, :],
        )


@triton.jit
def _encode_scan_kernel(
    x_ptr,
    cent_ptr,
    out_ptr,
    val_ptr,
    ROWS,
    E,
    NSUB: tl.constexpr,
    SPAD: tl.constexpr,
    WIDTH: tl.constexpr,
    DSUB: tl.constexpr,
    LANES: tl.constexpr,
    UNROLL: tl.constexpr,
    PACKED: tl.constexpr,
    VALUES: tl.constexpr,
):
    """x ``[ROWS * NSUB, DSUB]`` (any float dtype), centroids ``[E, DSUB]`` float32 (E a multiple of
    UNROLL) -> out ``[ROWS, WIDTH]`` stored codes (and val ``[ROWS * NSUB, DSUB]`` centroid values
    when VALUES)."""
    row, s, ok, n = _lanes(ROWS, NSUB, SPAD, LANES)
    dd = tl.arange(0, DSUB)
    x = tl.load(x_ptr + n[:, None] * DSUB + dd[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    best_d = tl.full([LANES], float("inf"), tl.float32)
    best_i = tl.zeros([LANES], tl.int32)
    for e0 in range(0, E, UNROLL):
        for u in tl.static_range(UNROLL):
            c = tl.load(cent_ptr + (e0 + u) * DSUB + dd)
            dist = tl.sum(c * c, 0) - 2.0 * tl.sum(x * c[None, :], 1)
            better = dist < best_d
            best_d = tl.where(better, dist, best_d)
            best_i = tl.where(better, e0 + u, best_i)
    _store(out_ptr, val_ptr, cent_ptr, ROWS, best_i, dd, NSUB, SPAD, WIDTH, DSUB, LANES, PACKED, VALUES)


@triton.jit
def _encode_dot_kernel(
    x_ptr,
    cent_ptr,
    out_ptr,
    val_ptr,
    ROWS,
    E,
    NSUB: tl.constexpr,
    SPAD: tl.constexpr,
    WIDTH: tl.constexpr,
    DSUB: tl.constexpr,
    DPAD: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PACKED: tl.constexpr,
    VALUES: tl.constexpr,
):
    """As :func:`_encode_scan_kernel`; sub-vectors zero-padded to ``DPAD`` channels for tl.dot."""
    row, s, ok, n = _lanes(ROWS, NSUB, SPAD, LANES)
    dd = tl.arange(0, DPAD)
    d_ok = dd < DSUB
    x = tl.load(x_ptr + n[:, None] * DSUB + dd[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    best_d = tl.full([LANES], float("inf"), tl.float32)
    best_i = tl.zeros([LANES], tl.int32)
    for e0 in range(0, E, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        c = tl.load(cent_ptr + offs_e[:, None] * DSUB + dd[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0)
        dot = tl.dot(x, tl.trans(c), input_precision="tf32x3")
        dist = tl.where(e_ok[None, :], tl.sum(c * c, 1)[None, :] - 2.0 * dot, float("inf"))
        chunk_d = tl.min(dist, 1)
        chunk_i = tl.argmin(dist, 1).to(tl.int32) + e0
        better = chunk_d < best_d
        best_d = tl.where(better, chunk_d, best_d)
        best_i = tl.where(better, chunk_i, best_i)
    _store(out_ptr, val_ptr, cent_ptr, ROWS, best_i, dd, NSUB, SPAD, WIDTH, DSUB, LANES, PACKED, VALUES)


def encode_triton(
    x: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    centroids: torch.Tensor,
    *,
    values: bool = False,
    parallel_weight: float = 1.0,
    wrap: bool = False,
    config: EncodeConfig = DEFAULT_CONFIG,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`vecinfer_compile.ops.reference.encode`.

    x ``[B, H, T, D]`` float -> stored codes ``[B, H, T, packed_width(D // d, E)]`` uint8 (12-bit
    codes packed two in three bytes for E > 256); with ``values=True`` also the centroid values
    ``[B, H, T, D]`` in x.dtype (as :func:`vecinfer_compile.ops.reference.quantize`). ``wrap=True``
    launches through ``torch.library.wrap_triton`` (inside the op); ``config`` is the launch shape
    (benchmarks sweep it). ``parallel_weight > 1``: the score-aware codes of
    :mod:`vecinfer_compile.quant.score_aware`, one launch per scale of its search."""
    check_encode_args(x, lam, rotation, centroids)
    work = x
    if lam is not None or rotation is not None:
        work = x.float()
        if lam is not None:
            work = work / lam.float()[None, :, None, :]
        if rotation is not None:
            work = work @ rotation.float()
    if parallel_weight != 1.0:
        return _score_aware(work, x.dtype, centroids, values, parallel_weight, wrap, config)
    entries, dims = centroids.shape
    b, h, t, d = x.shape
    work = work.contiguous()
    centroids = centroids.contiguous()
    nsub = d // dims
    width, packed = packed_width(nsub, entries), is_packed(entries)
    out = torch.empty((b, h, t, width), dtype=torch.uint8, device=x.device)
    val = torch.empty((b, h, t, d), dtype=x.dtype, device=x.device) if values else out
    rows = b * h * t
    spad = max(2, triton.next_power_of_2(nsub))  # even: a packed byte's two codes share a program
    shape = dict(NSUB=nsub, SPAD=spad, WIDTH=width, DSUB=dims, PACKED=packed, VALUES=values)
    c = config
    if entries <= SCAN_MAX_ENTRIES and entries % c.scan_unroll == 0:
        lanes = max(c.scan_block_n, spad)
        launch(
            _encode_scan_kernel,
            (triton.cdiv(rows, lanes // spad),),
            wrap,
            work,
            centroids,
            out,
            val,
            rows,
            entries,
            LANES=lanes,
            UNROLL=c.scan_unroll,
            num_warps=c.scan_warps,
            **shape,
        )
    else:
        lanes = max(c.dot_block_n, spad)
        launch(
            _encode_dot_kernel,
            (triton.cdiv(rows, lanes // spad),),
            wrap,
            work,
            centroids,
            out,
            val,
            rows,
            entries,
            DPAD=max(16, triton.next_power_of_2(dims)),
            LANES=lanes,
            BLOCK_E=c.dot_block_e,
            num_warps=c.dot_warps,
            **shape,
        )
    return (out, val) if values else out


def _score_aware(work, dtype, centroids, values, parallel_weight, wrap, config):
    """:func:`encode_triton` with ``parallel_weight > 1`` of the transformed ``work``: each scale's
    nearest-centroid codes come from the kernels above, the selection is torch; values in ``dtype``."""
    entries = centroids.shape[0]

    def nearest(y: torch.Tensor) -> torch.Tensor:
        return unpack_codes(encode_triton(y, None, None, centroids, wrap=wrap, config=config), entries)

    idx = score_aware_indices(work, centroids, parallel_weight, nearest)
    codes = pack_codes(idx, entries)
    if not values:
        return codes
    return codes, centroids.float()[idx].reshape(work.shape).to(dtype)
