"""Argument checks shared by the reference and the Triton launchers.

Every check raises ``ValueError``/``TypeError`` with a message that names the fix. Checks only
read shapes and dtypes, so they are traceable with symbolic shapes.
"""

from __future__ import annotations

import torch

from ..quant.packing import code_bits, packed_width
from .coded_kv import CodedKV

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}; cast it first")


def check_rank(t: torch.Tensor, rank: int, name: str, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def check_centroids(centroids: torch.Tensor, name: str) -> None:
    """``centroids: [E, d]`` float32."""
    check_rank(centroids, 2, name, "[entries, dims]")
    if centroids.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {centroids.dtype}; pass centroids.float()")


def check_head_dim(head_dim: int, centroids: torch.Tensor, name: str) -> None:
    dims = centroids.shape[1]
    if head_dim % dims != 0:
        raise ValueError(
            f"head_dim {head_dim} is not divisible by the sub-vector size {dims} of {name}; "
            f"use a codebook whose dims divides {head_dim}"
        )


def check_codes(codes: torch.Tensor, centroids: torch.Tensor, head_dim: int, name: str) -> None:
    """``codes: [B, H, T, packed_width(head_dim // d, entries)]`` uint8: one byte per code for
    <= 256 entries, two 12-bit codes in three bytes above (see :mod:`..quant.packing`)."""
    check_rank(codes, 4, name, "[B, H, T, packed_width(head_dim // dims, entries)]")
    entries, dims = centroids.shape
    check_head_dim(head_dim, centroids, f"the centroids of {name}")
    bits = code_bits(entries)
    if codes.dtype != torch.uint8:
        raise TypeError(
            f"{name} must be uint8 stored codes (as vecinfer::encode returns), got {codes.dtype}; "
            "pack centroid indices with vecinfer_compile.quant.packing.pack_codes(codes, entries)"
        )
    subvectors = head_dim // dims
    width = packed_width(subvectors, entries)
    if codes.shape[-1] != width:
        raise ValueError(
            f"{name} have {codes.shape[-1]} bytes per head vector but {subvectors} {bits}-bit codes of a "
            f"{entries}x{dims} codebook (head_dim {head_dim}) are stored in {width}; "
            + (
                "pack them with vecinfer_compile.quant.packing.pack_codes(codes, entries)"
                if bits == 12 and codes.shape[-1] == subvectors
                else "encode with this codebook"
            )
        )


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Returns the group size ``H_q // H_kv``."""
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return num_q_heads // num_kv_heads


def check_encode_args(x, lam, rotation, centroids) -> None:
    check_rank(x, 4, "x", "[B, H, T, D]")
    check_float(x, "x")
    check_centroids(centroids, "centroids")
    check_head_dim(x.shape[-1], centroids, "centroids")
    if lam is not None and tuple(lam.shape) != (x.shape[1], x.shape[3]):
        raise ValueError(f"lam must have shape [H, D] = {(x.shape[1], x.shape[3])}, got {tuple(lam.shape)}")
    if rotation is not None and tuple(rotation.shape) != (x.shape[3], x.shape[3]):
        raise ValueError(f"rotation must have shape [D, D] with D={x.shape[3]}, got {tuple(rotation.shape)}")


def check_attention_args(q, k_codes, v_codes, k_centroids, v_centroids, k_full, v_full, attn_mask, residual) -> int:
    """Checks the prefill op's arguments; returns the GQA group size."""
    check_rank(q, 4, "q", "[B, Hq, Tq, D]")
    check_float(q, "q")
    head_dim = q.shape[-1]
    check_centroids(k_centroids, "k_centroids")
    check_centroids(v_centroids, "v_centroids")
    check_codes(k_codes, k_centroids, head_dim, "k_codes")
    check_codes(v_codes, v_centroids, head_dim, "v_codes")
    if k_codes.shape[:3] != v_codes.shape[:3] or k_codes.shape[0] != q.shape[0]:
        raise ValueError(
            f"k_codes {tuple(k_codes.shape)} and v_codes {tuple(v_codes.shape)} must share [B, Hkv, Tk] "
            f"with B = q.shape[0] = {q.shape[0]}"
        )
    if residual < 0:
        raise ValueError(f"residual must be >= 0, got {residual}")
    if residual > 0:
        if k_full is None or v_full is None:
            raise ValueError(
                "residual > 0 needs k_full and v_full (the full-precision K~ and V); pass them or residual=0"
            )
        want = (*k_codes.shape[:3], head_dim)
        for t, name in ((k_full, "k_full"), (v_full, "v_full")):
            if tuple(t.shape) != tuple(want):
                raise ValueError(f"{name} must have shape [B, Hkv, Tk, D] = {tuple(want)}, got {tuple(t.shape)}")
            check_float(t, name)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            check_float(attn_mask, "attn_mask (bool, True = attend, or additive float)")
        if attn_mask.dim() > 4:
            raise ValueError(f"attn_mask must broadcast to [B, Hq, Tq, Tk], got {tuple(attn_mask.shape)}")
    return check_gqa(q.shape[1], k_codes.shape[1])


def check_decode_args(q: torch.Tensor, kv: CodedKV, kv_start: torch.Tensor | None) -> int:
    """Checks the decode op's arguments; returns the GQA group size."""
    k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window = kv
    check_rank(q, 4, "q", "[B, Hq, 1, D]")
    check_float(q, "q")
    if q.shape[2] != 1:
        raise ValueError(f"decode_attention takes one query position, q has {q.shape[2]}; use vecinfer::attention")
    head_dim = q.shape[-1]
    check_centroids(k_centroids, "k_centroids")
    check_centroids(v_centroids, "v_centroids")
    check_codes(k_codes, k_centroids, head_dim, "k_codes")
    check_codes(v_codes, v_centroids, head_dim, "v_codes")
    for t, name in ((n_coded, "n_coded"), (n_window, "n_window")):
        if t.dim() != 0 or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be a 0-d int32/int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    for t, name in ((k_window, "k_window"), (v_window, "v_window")):
        check_rank(t, 4, name, "[B, Hkv, R, D]")
        check_float(t, name)
        if t.shape[0] != q.shape[0] or t.shape[1] != k_codes.shape[1] or t.shape[3] != head_dim:
            raise ValueError(f"{name} must have shape [B, Hkv, R, D] matching q and k_codes, got {tuple(t.shape)}")
    if kv_start is not None and (kv_start.dim() != 1 or kv_start.dtype not in (torch.int32, torch.int64)):
        raise TypeError(f"kv_start must be a [B] int32 tensor or None, got {kv_start.dtype} {tuple(kv_start.shape)}")
    return check_gqa(q.shape[1], k_codes.shape[1])
