"""Registration of the ``vecinfer`` ops with ``torch.library.triton_op``.

Each op's function is also its fake implementation: it only reads shapes and dtypes before
dispatching on ``q.device.type`` — CUDA launches the Triton kernels through ``wrap_triton`` (so
Inductor sees them), every other device runs the pure-torch reference. Registration happens once
per process, at import of :mod:`vecinfer_compile.ops`.

Decode attention has three ops of one schema. ``decode_attention`` is the public one: on CUDA it
runs the CUDA kernel (:mod:`.cuda_decode`) when :func:`.decode_kernels.choose` picks it, else the
Triton kernel. ``decode_attention_cuda`` is the CUDA kernel alone, an opaque ``custom_op`` (Inductor
calls it as an extern kernel; CUDA graphs capture it). ``decode_attention_triton`` is the Triton
kernel alone, visible to Inductor. The compile pass emits the kernel-specific op it resolved, so
the choice is part of the graph (and of Inductor's cache key) rather than hidden state.

Schemas::

    vecinfer::encode(Tensor x, Tensor? lam, Tensor? rotation, Tensor centroids,
        float parallel_weight=1.0) -> Tensor
    vecinfer::quantize(Tensor x, Tensor? lam, Tensor? rotation, Tensor centroids,
        float parallel_weight=1.0) -> Tensor
    vecinfer::attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_centroids,
        Tensor v_centroids, Tensor? k_full, Tensor? v_full, Tensor? attn_mask, bool is_causal,
        float scale, int residual) -> Tensor
    vecinfer::decode_attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_centroids,
        Tensor v_centroids, Tensor n_coded, Tensor k_window, Tensor v_window, Tensor n_window,
        Tensor? kv_start, float scale) -> Tensor
    vecinfer::decode_attention_cuda(...same...) -> Tensor
    vecinfer::decode_attention_triton(...same...) -> Tensor
    vecinfer::cache_append_cuda(...the schema of vecinfer::cache_append...) -> ()
    vecinfer::weigh_codes(Tensor x, Tensor stored, Tensor centroids, Tensor metric,
        float parallel_weight=1.0) -> Tensor

``cache_append_cuda`` is the CUDA kernel of :mod:`.cuda_append` as an opaque ``custom_op`` that
mutates the cache buffers in place (Inductor re-inplaces it: no copies of the buffers); the
dispatching op ``vecinfer::cache_append`` and its torch form are in :mod:`.cache_append`.
``weigh_codes`` (:func:`~vecinfer_compile.quant.weighted_codes.weigh_stored` in torch; on CUDA the
kernel of :mod:`.cuda_weigh` when :func:`.decode_kernels.choose_weigh` picks it) is opaque too:
the coordinate descent of error-weighted codes is a loop over sub-vectors that Inductor would
otherwise unroll into thousands of nodes (minutes of compilation).
"""

from __future__ import annotations

import torch

from ..quant.weighted_codes import weigh_stored
from . import decode_kernels, reference
from .cuda_append import cache_append_cuda
from .cuda_decode import decode_attention_cuda
from .cuda_weigh import weigh_rows_cuda
from .triton_attention import attention_triton
from .triton_decode import decode_attention_triton
from .triton_encode import encode_triton

NAMESPACE = "vecinfer"


def _encode(
    x: torch.Tensor, lam: torch.Tensor | None, rotation: torch.Tensor | None, centroids: torch.Tensor,
    parallel_weight: float = 1.0,
) -> torch.Tensor:
    if x.device.type == "cuda":
        return encode_triton(x, lam, rotation, centroids, parallel_weight=parallel_weight, wrap=True)
    return reference.encode(x, lam, rotation, centroids, parallel_weight)


def _quantize(
    x: torch.Tensor, lam: torch.Tensor | None, rotation: torch.Tensor | None, centroids: torch.Tensor,
    parallel_weight: float = 1.0,
) -> torch.Tensor:
    if x.device.type == "cuda":
        return encode_triton(x, lam, rotation, centroids, values=True, parallel_weight=parallel_weight, wrap=True)[1]
    return reference.quantize(x, lam, rotation, centroids, parallel_weight)


def _attention(
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
    args = (q, k_codes, v_codes, k_centroids, v_centroids, k_full, v_full, attn_mask, is_causal, scale, residual)
    if q.device.type == "cuda":
        return attention_triton(*args, wrap=True)
    return reference.attention(*args)


def _decode_attention_triton(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    kv_start: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    args = (q, k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window, kv_start, scale)
    if q.device.type == "cuda":
        return decode_attention_triton(*args, wrap=True)
    if q.device.type == "cpu" and type(q) is torch.Tensor and type(n_coded) is torch.Tensor:
        # Plain CPU tensors (not a tracer's fake or functional ones): reading n_coded costs no
        # synchronisation, so only the filled positions are dequantized and a step costs what the
        # cache holds, not its capacity (the reference masks every one of the Tmax positions).
        n = max(int(n_coded), 0)
        args = (q, k_codes[:, :, :n], v_codes[:, :, :n], *args[3:])
    return reference.decode_attention(*args)


def _decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    kv_start: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    args = (q, k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window, kv_start, scale)
    if q.device.type == "cuda" and decode_kernels.choose(q, k_codes, k_centroids, v_centroids) == "cuda":
        return torch.ops.vecinfer.decode_attention_cuda(*args)
    return _decode_attention_triton(*args)


_OPS = {"encode": _encode, "quantize": _quantize, "attention": _attention,
        "decode_attention_triton": _decode_attention_triton, "decode_attention": _decode_attention}


def _is_registered(name: str) -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def _decode_attention_cuda_fake(q, k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window,
                                n_window, kv_start, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _weigh_codes_cuda(x, stored, centroids, metric, parallel_weight=1.0):
    if decode_kernels.choose_weigh(x, centroids) == "cuda":
        return weigh_rows_cuda(x, stored, centroids, metric, parallel_weight)
    return weigh_stored(x, stored, centroids, metric, parallel_weight)


APPEND_MUTATES = ("k_codes", "v_codes", "k_window", "v_window", "n_coded", "n_window", "arrivals")


def register() -> None:
    """Register the ops (a no-op for those already registered in this process)."""
    if not _is_registered("cache_append_cuda"):
        op = torch.library.custom_op(f"{NAMESPACE}::cache_append_cuda", cache_append_cuda, mutates_args=APPEND_MUTATES)
        op.register_fake(lambda *args: None)
    if not _is_registered("weigh_codes"):
        op = torch.library.custom_op(f"{NAMESPACE}::weigh_codes", weigh_stored, mutates_args=())
        op.register_fake(lambda x, stored, centroids, metric, parallel_weight=1.0: torch.empty_like(stored))
        op.register_kernel("cuda", _weigh_codes_cuda)
    if not _is_registered("decode_attention_cuda"):
        op = torch.library.custom_op(f"{NAMESPACE}::decode_attention_cuda", decode_attention_cuda, mutates_args=())
        op.register_fake(_decode_attention_cuda_fake)
    for name, fn in _OPS.items():
        if not _is_registered(name):
            torch.library.triton_op(f"{NAMESPACE}::{name}", fn, mutates_args=())


register()
