"""Encoding to codes: ``vecinfer::encode``, ``vecinfer::quantize`` and ``vecinfer::weigh_codes``.

Schemas::

    vecinfer::encode(Tensor x, Tensor? lam, Tensor? rotation, Tensor centroids,
        float parallel_weight=1.0) -> Tensor
    vecinfer::quantize(Tensor x, Tensor? lam, Tensor? rotation, Tensor centroids,
        float parallel_weight=1.0) -> Tensor
    vecinfer::weigh_codes(Tensor x, Tensor stored, Tensor centroids, Tensor metric,
        float parallel_weight=1.0) -> Tensor

``encode`` returns the stored codes of ``x: [B, H, T, D]`` after the optional key transform
(``lam``, ``rotation``), ``quantize`` their dequantized values; contracts and oracles:
:func:`.reference.encode`, :func:`.reference.quantize`. On CUDA both run the Triton kernel
(:mod:`.triton.encode`, visible to Inductor), elsewhere the reference.

``weigh_codes`` lowers stored codes under an error metric (the coordinate descent of
:func:`~vecinfer_compile.quant.weighted_codes.weigh_stored`; on CUDA the kernel of
:mod:`.cuda.weigh` when :func:`choose_weigh` picks it). It is opaque: the descent is a loop over
sub-vectors that Inductor would otherwise unroll into thousands of nodes (minutes of compilation).
"""

from __future__ import annotations

import logging

import torch

from ..quant.weighted_codes import weigh_stored
from . import reference
from .cuda import weigh as cuda_weigh
from .kernel_request import fall_back, requested
from .registry import define
from .triton.encode import encode_triton


def _encode(
    x: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    centroids: torch.Tensor,
    parallel_weight: float = 1.0,
) -> torch.Tensor:
    if x.device.type == "cuda":
        return encode_triton(x, lam, rotation, centroids, parallel_weight=parallel_weight, wrap=True)
    return reference.encode(x, lam, rotation, centroids, parallel_weight)


def _quantize(
    x: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    centroids: torch.Tensor,
    parallel_weight: float = 1.0,
) -> torch.Tensor:
    if x.device.type == "cuda":
        return encode_triton(x, lam, rotation, centroids, values=True, parallel_weight=parallel_weight, wrap=True)[1]
    return reference.quantize(x, lam, rotation, centroids, parallel_weight)


def choose_weigh(x: torch.Tensor, centroids: torch.Tensor) -> str:
    """``"cuda"`` or ``"torch"`` for a ``vecinfer::weigh_codes`` call on CUDA tensors: the kernel of
    :mod:`.cuda.weigh` when it supports the inputs and builds, else the torch descent (logged once
    per reason, as a warning: it is many times slower)."""
    if requested() == "triton":
        return "torch"
    reason = cuda_weigh.unsupported_reason(x, centroids) or cuda_weigh.build_error(
        x, centroids, centroids, "vq_weigh_rows"
    )
    if reason is None:
        return "cuda"
    fall_back(
        reason,
        logging.WARNING,
        "error-weighted codes run the torch descent",
        "error-weighted codes cannot be encoded on CUDA",
    )
    return "torch"


def _weigh_codes_cuda(x, stored, centroids, metric, parallel_weight=1.0):
    if choose_weigh(x, centroids) == "cuda":
        return cuda_weigh.weigh_rows_cuda(x, stored, centroids, metric, parallel_weight)
    return weigh_stored(x, stored, centroids, metric, parallel_weight)


def quantize_weighted(
    x: torch.Tensor, centroids: torch.Tensor, metric: torch.Tensor, parallel_weight: float = 1.0
) -> torch.Tensor:
    """Error-weighted ``X^`` of ``x: [B, H, T, D]``: ``vecinfer::encode`` (score-aware for
    ``parallel_weight > 1``), ``vecinfer::weigh_codes`` under ``metric: [H, D, D]``, then the
    centroids' values (``centroids: [E, d]`` float32); returned in ``x.dtype``, as
    :func:`~vecinfer_compile.quant.codebook.quantize_dequantize` with a metric computes it. The
    simulate pass emits it into graphs (error-weighted codebooks)."""
    stored = torch.ops.vecinfer.encode(x, None, None, centroids, parallel_weight)
    stored = torch.ops.vecinfer.weigh_codes(x, stored, centroids, metric, parallel_weight)
    return reference.dequantize(stored, centroids).to(x.dtype)


def register() -> None:
    define("encode", _encode, kind="triton")
    define("quantize", _quantize, kind="triton")
    define(
        "weigh_codes",
        weigh_stored,
        kind="opaque",
        fake=lambda x, stored, centroids, metric, parallel_weight=1.0: torch.empty_like(stored),
        device_kernels={"cuda": _weigh_codes_cuda},
    )


register()
