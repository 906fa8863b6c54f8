"""Dequantizing a cache: ``vecinfer::cache_kv``, ``vecinfer::prefill_read`` and the chunk's prefix workspace.

``vecinfer::cache_kv``: the full-length K/V that a :class:`~vecinfer_compile.cache.VecInferCache`
layer stands for, dequantized in the original (untransformed) key domain.

Schema::

    vecinfer::cache_kv(Tensor k_codes, Tensor v_codes, Tensor k_centroids, Tensor v_centroids,
        Tensor n_coded, Tensor k_window, Tensor v_window, Tensor n_window, Tensor? lam,
        Tensor? rotation) -> (Tensor, Tensor)

Codes are uint8 in the stored layout of :mod:`vecinfer_compile.quant.packing`. It is the
cache's *eager* read: ``K[b, h, t] = keys_inverse(decode(k_codes))[t]`` for
``t < n_coded``, ``keys_inverse(k_window[t - n_coded])`` for ``n_coded <= t < n_coded + n_window``,
zero beyond; ``V`` likewise without the inverse transform. Both ``[B, Hkv, Tmax, D]`` in the
window's dtype. The op is pure (no mutation) and opaque, so in a Dynamo graph it is one node whose
arguments are exactly the cache state: :mod:`vecinfer_compile.passes.cache_attention` finds
``scaled_dot_product_attention(q, <cache_kv>[0], <cache_kv>[1], mask)`` and replaces it with
``vecinfer::decode_attention`` over the codes, after which this node is dead and removed.
"""

from __future__ import annotations

import logging

import torch

from ..log_once import log_once
from ..quant.packing import packed_width, unpack_codes
from .coded_kv import CodedKV, flat_op
from .cuda import dequant as cuda_dequant
from .registry import define
from .triton.dequant import dequantize_triton

log = logging.getLogger(__name__)


def _check(kv: CodedKV, lam: torch.Tensor | None, rotation: torch.Tensor | None) -> None:
    k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window = kv
    for t, name in ((k_codes, "k_codes"), (v_codes, "v_codes"), (k_window, "k_window"), (v_window, "v_window")):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-d [B, Hkv, T, *], got {tuple(t.shape)}")
    for t, name in ((k_centroids, "k_centroids"), (v_centroids, "v_centroids")):
        if t.dim() != 2 or t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 [entries, dims], got {t.dtype} {tuple(t.shape)}")
    for t, name in ((n_coded, "n_coded"), (n_window, "n_window")):
        if t.dim() != 0 or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be a 0-d int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
    d = k_window.shape[-1]
    for codes, cent, name in ((k_codes, k_centroids, "k_codes"), (v_codes, v_centroids, "v_codes")):
        entries, dims = cent.shape
        if d % dims:
            raise ValueError(f"head_dim {d} is not divisible by the {entries}x{dims} codebook of {name}")
        width = packed_width(d // dims, entries)
        if codes.dtype != torch.uint8 or codes.shape[-1] != width:
            raise ValueError(
                f"{name} ({codes.dtype}, {tuple(codes.shape)}) are not stored codes of a {entries}x{dims} codebook "
                f"for head_dim {d} (uint8, {width} bytes per head vector): build them with vecinfer::encode"
            )
    if lam is not None and tuple(lam.shape) != (k_window.shape[1], d):
        raise ValueError(f"lam must be [Hkv, D] = {(k_window.shape[1], d)}, got {tuple(lam.shape)}")
    if rotation is not None and tuple(rotation.shape) != (d, d):
        raise ValueError(f"rotation must be [D, D] = {(d, d)}, got {tuple(rotation.shape)}")


def _assemble(codes, centroids, n_coded, window, n_window) -> torch.Tensor:
    """float32 ``[B, H, Tmax, D]``: decoded codes below n_coded, window slots after, zeros beyond."""
    idx = unpack_codes(codes, centroids.shape[0])
    b, h, tmax, n = idx.shape
    r = window.shape[2]
    dec = centroids.float()[idx].reshape(b, h, tmax, n * centroids.shape[1])
    t = torch.arange(tmax, device=codes.device)
    slot = t - n_coded
    in_window = (slot >= 0) & (slot < n_window)
    if r > 0:
        win = window.float().index_select(2, slot.clamp(0, r - 1))
    else:
        win = torch.zeros_like(dec)
        in_window = torch.zeros_like(in_window)
    out = torch.where(in_window[:, None], win, torch.zeros_like(dec))
    return torch.where((t < n_coded)[:, None], dec, out)


def _empty_outputs(
    kv: CodedKV, lam: torch.Tensor | None, rotation: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks the arguments; uninitialised outputs ``[B, Hkv, Tmax, D]`` in the window's dtype (the
    op's fake, and what :func:`cache_kv` fills)."""
    _check(kv, lam, rotation)
    b, h, tmax, _ = kv.k_codes.shape
    d = kv.k_window.shape[-1]
    return kv.k_window.new_empty((b, h, tmax, d)), kv.v_window.new_empty((b, h, tmax, d))


ROW_CHUNK_ELEMENTS = 1 << 26  # float32 elements of K (or V) dequantized at once: 256 MiB of temporaries


def cache_kv(kv: CodedKV, lam: torch.Tensor | None, rotation: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Computed a few batch rows at a time into outputs of the window dtype, so the float32
    temporaries stay near :data:`ROW_CHUNK_ELEMENTS` whatever the batch (at 160 rows of 32k the
    whole-batch form needed 20 GiB more than the outputs)."""
    k_out, v_out = _empty_outputs(kv, lam, rotation)
    k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window = kv
    b, h, tmax, d = k_out.shape
    rows = max(1, ROW_CHUNK_ELEMENTS // max(h * tmax * d, 1))
    for i in range(0, b, rows):
        j = min(i + rows, b)
        kt = _assemble(k_codes[i:j], k_centroids, n_coded, k_window[i:j], n_window)
        if rotation is not None:
            kt = kt @ rotation.float().T
        if lam is not None:
            kt = kt * lam.float()[None, :, None, :]
        k_out[i:j] = kt
        del kt
        v_out[i:j] = _assemble(v_codes[i:j], v_centroids, n_coded, v_window[i:j], n_window)
    return k_out, v_out


def prefill_read(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the prefill of an empty cache layer returns when compiled: its own K/V (copies: an op
    cannot return its inputs), marked so that :mod:`vecinfer_compile.passes.cache_attention` keeps
    the attention over them in full precision, as the eager prefill does, instead of the generic
    rewrite quantizing it (the pass then reads the inputs directly and this node is dead).
    transformers compiles a chunked prefill's forwards when the cache is compileable, the first
    chunk's included."""
    return key.clone(), value.clone()


def dequantize_into(codes: torch.Tensor, centroids: torch.Tensor, length: int, out: torch.Tensor) -> torch.Tensor:
    """A chunk's prefix workspace (:mod:`.split_attention.chunk`): :func:`.cuda.dequant.dequantize_cuda`
    where it runs, else :func:`.triton.dequant.dequantize_triton` (one log line says why, once per
    reason)."""
    reason = cuda_dequant.unsupported_reason(codes, centroids, out) or cuda_dequant.build_error(codes, centroids, out)
    if reason is None:
        return cuda_dequant.dequantize_cuda(codes, centroids, length, out)
    log_once(log, logging.INFO, reason, "vecinfer: a chunk's prefix is dequantized by the Triton kernel: %s", reason)
    return dequantize_triton(codes, centroids, length, out)


_OPTIONAL_TRANSFORMS = {"lam": torch.Tensor | None, "rotation": torch.Tensor | None}
_KV_PAIR = tuple[torch.Tensor, torch.Tensor]
define(
    "cache_kv",
    flat_op(cache_kv, {}, _OPTIONAL_TRANSFORMS, _KV_PAIR),
    kind="opaque",
    fake=flat_op(_empty_outputs, {}, _OPTIONAL_TRANSFORMS, _KV_PAIR),
)
define(
    "prefill_read",
    prefill_read,
    kind="opaque",
    fake=lambda key, value: (torch.empty_like(key), torch.empty_like(value)),
)
