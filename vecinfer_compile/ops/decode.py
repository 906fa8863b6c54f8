"""Decode attention over a compressed cache: ``vecinfer::decode_attention`` and its two kernels.

Schema (the three ops share it)::

    vecinfer::decode_attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_centroids,
        Tensor v_centroids, Tensor n_coded, Tensor k_window, Tensor v_window, Tensor n_window,
        Tensor? kv_start, float scale) -> Tensor

q ``[B, Hq, 1, D]`` (the transformed query ``q~``); the coded K/V travel as one
:class:`.coded_kv.CodedKV` in Python and flat in the schema; ``kv_start`` ``[B]`` int (left padding) or
None. Contract and oracle: :func:`.reference.decode_attention`.

- ``decode_attention`` is the public op: on CUDA it runs the CUDA kernel (:mod:`.cuda.decode`)
  when :func:`choose` picks it, else the Triton kernel; elsewhere the reference.
- ``decode_attention_cuda`` is the CUDA kernel alone, opaque (Inductor calls it as an extern
  kernel; CUDA graphs capture it).
- ``decode_attention_triton`` is the Triton kernel alone (:mod:`.triton.decode`), visible to
  Inductor.

The compile pass emits the kernel-specific op it resolved, so the choice is part of the graph
(and of Inductor's cache key) rather than hidden state.
"""

from __future__ import annotations

import logging

import torch

from . import reference
from .coded_kv import CodedKV, flat_op
from .cuda import decode as cuda_decode
from .cuda.decode import decode_attention_cuda
from .kernel_request import fall_back, requested
from .registry import define
from .triton.decode import decode_attention_triton


def decode_attention(q: torch.Tensor, kv: CodedKV, kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``vecinfer::decode_attention`` of ``q: [B, Hq, 1, D]`` over ``kv`` -> ``[B, Hq, 1, D]``."""
    return torch.ops.vecinfer.decode_attention(q, *kv, kv_start, scale)


def choose(q: torch.Tensor, k_codes: torch.Tensor, k_centroids: torch.Tensor, v_centroids: torch.Tensor) -> str:
    """``"cuda"`` or ``"triton"`` for a decode call on CUDA tensors (shapes and dtypes only, so it
    works on fake tensors while tracing; may compile the CUDA kernel once)."""
    if requested() == "triton":
        return "triton"
    reason, level = cuda_decode.unsupported_reason(q, k_codes, k_centroids, v_centroids), logging.INFO
    if reason is None:  # the inputs fit: a failure to build is the machine's, worth a warning
        reason, level = cuda_decode.build_error(q, k_codes, k_centroids, v_centroids), logging.WARNING
    if reason is None:
        return "cuda"
    fall_back(reason, level, "decode attention runs the Triton kernel", "the CUDA decode kernel cannot run")
    return "triton"


def _decode_op(impl):
    """The op function of ``impl(q, kv, kv_start, scale)``: its flat signature (the schema's)."""
    return flat_op(impl, {"q": torch.Tensor}, {"kv_start": torch.Tensor | None, "scale": float}, torch.Tensor)


def _triton_or_reference(q: torch.Tensor, kv: CodedKV, kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    if q.device.type == "cuda":
        return decode_attention_triton(q, kv, kv_start, scale, wrap=True)
    if q.device.type == "cpu" and type(q) is torch.Tensor and type(kv.n_coded) is torch.Tensor:
        # Plain CPU tensors (not a tracer's fake or functional ones): reading n_coded costs no
        # synchronisation, so only the filled positions are dequantized and a step costs what the
        # cache holds, not its capacity (the reference masks every one of the Tmax positions).
        n = max(int(kv.n_coded), 0)
        kv = kv._replace(k_codes=kv.k_codes[:, :, :n], v_codes=kv.v_codes[:, :, :n])
    return reference.decode_attention(q, kv, kv_start, scale)


def _decode_attention(q: torch.Tensor, kv: CodedKV, kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    if q.device.type == "cuda" and choose(q, kv.k_codes, kv.k_centroids, kv.v_centroids) == "cuda":
        return torch.ops.vecinfer.decode_attention_cuda(q, *kv, kv_start, scale)
    return _triton_or_reference(q, kv, kv_start, scale)


def _fake(q, *rest) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def register() -> None:
    define("decode_attention_cuda", _decode_op(decode_attention_cuda), kind="opaque", fake=_fake)
    define("decode_attention_triton", _decode_op(_triton_or_reference), kind="triton")
    define("decode_attention", _decode_op(_decode_attention), kind="triton")


register()
