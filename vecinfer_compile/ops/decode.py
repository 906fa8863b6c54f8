"""Decode attention over a compressed cache: ``vecinfer::decode_attention`` and its two kernels.

Schema (the three ops share it)::

    vecinfer::decode_attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_centroids,
        Tensor v_centroids, Tensor n_coded, Tensor k_window, Tensor v_window, Tensor n_window,
        Tensor? kv_start, float scale) -> Tensor

q ``[B, Hq, 1, D]`` (the transformed query ``q~``); the coded K/V travel as one
:class:`CodedKV` in Python and flat in the schema; ``kv_start`` ``[B]`` int (left padding) or
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

import inspect
import logging
from typing import NamedTuple

import torch

from . import reference
from .cuda import decode as cuda_decode
from .cuda.decode import decode_attention_cuda
from .kernel_request import fall_back, requested
from .registry import define
from .triton.decode import decode_attention_triton


class CodedKV(NamedTuple):
    """One layer's coded K/V as the decode kernels read them (the flat order of the schema).

    ``k_codes``/``v_codes`` ``[B, Hkv, Tmax, W]`` uint8 stored codes; ``k_centroids``/
    ``v_centroids`` ``[E, d]`` float32; ``n_coded`` 0-d int (filled code slots); ``k_window``/
    ``v_window`` ``[B, Hkv, R, D]`` the full-precision window (``K~`` and ``V``); ``n_window`` 0-d
    int (filled window slots)."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_centroids: torch.Tensor
    v_centroids: torch.Tensor
    n_coded: torch.Tensor
    k_window: torch.Tensor
    v_window: torch.Tensor
    n_window: torch.Tensor


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


def _with_signature(fn):
    """``fn`` with the oracle's signature (:func:`.reference.decode_attention`), from which the
    op's schema is inferred: the dispatchers pass the arguments through."""
    fn.__signature__ = inspect.signature(reference.decode_attention)
    return fn


@_with_signature
def _triton_or_reference(q, k_codes, v_codes, *rest) -> torch.Tensor:
    if q.device.type == "cuda":
        return decode_attention_triton(q, k_codes, v_codes, *rest, wrap=True)
    n_coded = rest[2]
    if q.device.type == "cpu" and type(q) is torch.Tensor and type(n_coded) is torch.Tensor:
        # Plain CPU tensors (not a tracer's fake or functional ones): reading n_coded costs no
        # synchronisation, so only the filled positions are dequantized and a step costs what the
        # cache holds, not its capacity (the reference masks every one of the Tmax positions).
        n = max(int(n_coded), 0)
        k_codes, v_codes = k_codes[:, :, :n], v_codes[:, :, :n]
    return reference.decode_attention(q, k_codes, v_codes, *rest)


@_with_signature
def _decode_attention(*args) -> torch.Tensor:
    q, k_codes, _, k_centroids, v_centroids = args[:5]
    if q.device.type == "cuda" and choose(q, k_codes, k_centroids, v_centroids) == "cuda":
        return torch.ops.vecinfer.decode_attention_cuda(*args)
    return _triton_or_reference(*args)


def _fake(q, *rest) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def register() -> None:
    define("decode_attention_cuda", decode_attention_cuda, kind="opaque", fake=_fake)
    define("decode_attention_triton", _triton_or_reference, kind="triton")
    define("decode_attention", _decode_attention, kind="triton")


register()
