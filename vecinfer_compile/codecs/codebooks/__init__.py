"""The codebooks' codes, the default codec: each side's sub-vectors of ``d`` numbers coded as the
index of a centroid in a k-means codebook ``[E, d]`` (float32; its side code is that tensor), one
codebook a layer and side shared by every sub-vector position and head (VecInfer's method).

Codes are stored at their nominal width (:mod:`vecinfer_compile.quant.packing`); keys may be coded
score-aware (``key_parallel_weight``) and both sides under the layer's error metrics
(:mod:`vecinfer_compile.quant.weighted_codes`). The kernels are the op families of
:mod:`vecinfer_compile.ops` (encode, append, dequantize, decode, split attention); its file section
is ``layers.{i}.{side}_centroids`` (each layer's own preset); its calibration is k-means
(:mod:`.fit`), and the refining methods move both books together (:meth:`CodebooksCodec.refine`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...ops.append import weigh_codes
from ...ops.coded_kv import CodedKV
from ...ops.decode import decode_attention
from ...ops.split_attention.prefix import CodebookPrefix
from ...presets import get_preset
from ...quant.byte_centroids import snap_centroids
from ...quant.codebook import quantize_dequantize
from ...quant.packing import packed_width
from ..base import CacheRewrite, Codec, FitContext
from .fit import fit_codebook
from .rewrite import REWRITE


class CodebookOperands(NamedTuple):
    """A layer's two books on the cache's device: ``key_centroids [Ek, dk]``, ``value_centroids
    [Ev, dv]`` float32."""

    key_centroids: torch.Tensor
    value_centroids: torch.Tensor


class CodebooksCodec(Codec):
    name = "codebooks"
    code_type = torch.Tensor
    rewrite: CacheRewrite = REWRITE

    # -- calibration ------------------------------------------------------------------------------
    def fit(self, vectors: torch.Tensor, side: str, ctx: FitContext) -> torch.Tensor:
        spec = getattr(get_preset(ctx.bits), side)
        return fit_codebook(vectors, spec.entries, spec.dims, ctx)

    def normalize(self, code: torch.Tensor) -> torch.Tensor:
        """Books of more than 256 entries hold 7-bit centroids, snapped here (the CUDA decode kernel's
        byte books, :mod:`vecinfer_compile.quant.byte_centroids`), so that every path reads the same."""
        return snap_centroids(code)

    def refine(
        self, queries, keys, values, lengths, transform, key_code, value_code, attention, config, *, seed: int, device
    ):
        """Both books moved to lower the layer's attention-output error
        (:func:`~vecinfer_compile.quant.refine.refine_codebooks`): ``(key, value, loss before, after)``."""
        from ...quant.refine import refine_codebooks

        return refine_codebooks(
            queries, keys, values, lengths, transform, key_code, value_code, attention, config, seed=seed, device=device
        )

    # -- the file ---------------------------------------------------------------------------------
    def write(self, side: str, codes: list, present: list[int]) -> dict[str, torch.Tensor]:
        return {f"layers.{i}.{side}_centroids": c.float().cpu() for i, c in zip(present, codes)}

    def read(self, side, tensors, *, path, present, layer_bits, geometry) -> list[torch.Tensor]:
        out = []
        for i in present:
            name = f"layers.{i}.{side}_centroids"
            if name not in tensors:
                raise ValueError(f"{path}: tensor {name!r} is missing (corrupt file)")
            books = tensors[name]
            spec = getattr(get_preset(layer_bits[i]), side)
            if tuple(books.shape) != (spec.entries, spec.dims):
                raise ValueError(
                    f"{path}: layer {i} codebook shapes ({side} {tuple(books.shape)}) do not match its "
                    f"{layer_bits[i]:g}-bit preset {(spec.entries, spec.dims)} (corrupt file)"
                )
            if not torch.isfinite(books).all():
                raise ValueError(
                    f"{path}: {name} holds NaN or inf (corrupt file): recalibrate with `vecinfer calibrate`"
                )
            out.append(books.float())
        return out

    def tensor_names(self, side: str, tensors) -> list[str]:
        suffix = f".{side}_centroids"
        return [n for n in tensors if n.startswith("layers.") and n.endswith(suffix)]

    # -- simulate, bytes, tests -----------------------------------------------------------------------
    def quantize_dequantize(self, code, x, *, metric=None, parallel_weight: float = 1.0) -> torch.Tensor:
        return quantize_dequantize(x, code.to(x.device), parallel_weight, metric)

    def code_bytes(self, code, head_dim: int) -> int:
        if head_dim % code.shape[1]:
            raise ValueError(
                f"head_dim {head_dim} is not divisible by the codebook's sub-vector size "
                f"{code.shape[1]}: these codebooks do not fit this model"
            )
        return packed_width(head_dim // code.shape[1], code.shape[0])

    def state_tensors(self, code) -> list[torch.Tensor]:
        return [code]

    def random_code(self, gen, kv_heads: int, head_dim: int, bits: float, side: str) -> torch.Tensor:
        spec = getattr(get_preset(bits), side)
        return torch.randn(spec.entries, spec.dims, generator=gen)

    # -- the cache ------------------------------------------------------------------------------------
    def operands(self, layer, device) -> CodebookOperands:
        return CodebookOperands(*(c.to(device, torch.float32).contiguous() for c in (layer.keys, layer.values)))

    def operand_tensors(self, operands) -> list[torch.Tensor]:
        return list(operands)

    def fill(self, storage, kt, v, quantizer) -> None:
        books, q, ops = quantizer.operands, quantizer, torch.ops.vecinfer

        def code(x, centroids, metric, weight=1.0):
            stored = ops.encode(x, None, None, centroids, weight)
            return weigh_codes(x, stored, centroids, metric, weight)

        storage.fill_by_window(
            kt,
            v,
            lambda x: code(x, books.key_centroids, q.key_metric, q.key_parallel_weight),
            lambda x: code(x, books.value_centroids, q.value_metric),
        )

    def append(self, storage, k, v, quantizer) -> None:
        s, q = storage, quantizer
        torch.ops.vecinfer.cache_append(
            k,
            v,
            s.k_codes,
            s.v_codes,
            s.k_window,
            s.v_window,
            s.n_coded,
            s.n_window,
            s.append_arrivals,
            q.operands.key_centroids,
            q.operands.value_centroids,
            q.key_mean,
            q.lam,
            q.key_transform_matrix,
            q.key_parallel_weight,
            q.key_metric,
            q.value_metric,
        )

    def read_kv(self, k_codes, v_codes, n_coded, k_window, v_window, n_window, quantizer):
        books = quantizer.operands
        return torch.ops.vecinfer.cache_kv(
            k_codes,
            v_codes,
            books.key_centroids,
            books.value_centroids,
            n_coded,
            k_window,
            v_window,
            n_window,
            quantizer.lam,
            quantizer.rotation,
        )

    def decode(self, storage, quantizer, q_t, kv_start, scale) -> torch.Tensor:
        return decode_attention(q_t, coded_kv(storage, quantizer), kv_start, scale)

    def prefix(self, quantizer) -> CodebookPrefix:
        return CodebookPrefix(*quantizer.operands)


def coded_kv(storage, quantizer) -> CodedKV:
    """A layer's codes, window and counters with its books: what the decode kernels read."""
    s, books = storage, quantizer.operands
    return CodedKV(
        s.k_codes, s.v_codes, books.key_centroids, books.value_centroids, s.n_coded, s.k_window, s.v_window, s.n_window
    )


CODEC = CodebooksCodec()
