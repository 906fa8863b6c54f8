"""Which kernel runs ``vecinfer::decode_attention`` on CUDA: the CUDA kernel or the Triton one; and
whether ``vecinfer::cache_append`` runs the CUDA kernel or its torch form (compiled by Inductor).

Requests, strongest first: :func:`use_decode_kernel` (the backend's ``decode_kernel`` option
sets it while it compiles), the environment variable ``VECINFER_DECODE_KERNEL`` (benchmarks),
then ``"auto"``. ``"auto"`` runs the CUDA kernel when it supports the inputs and builds on this
machine, else the Triton kernel, and logs one line saying why (once per reason). An explicit
``"cuda"`` that cannot run raises instead: an explicit request never falls back silently.
One request covers these ops and ``vecinfer::weigh_codes`` (the prefill's error-weighted codes):
``"triton"`` runs no CUDA kernel (the Triton decode kernel, the append and the descent as torch
ops), ``"cuda"`` requires the CUDA kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

import torch

from . import cuda_append, cuda_decode, cuda_weigh

log = logging.getLogger(__name__)

KERNELS = ("auto", "cuda", "triton")
ENV = "VECINFER_DECODE_KERNEL"
_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("vecinfer_decode_kernel", default=None)
_logged: set[str] = set()


def check_kernel_name(name: str) -> str:
    if name not in KERNELS:
        raise ValueError(f"decode_kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    return name


@contextlib.contextmanager
def use_decode_kernel(name: str):
    """Within the block, decode attention on CUDA uses ``name`` (auto / cuda / triton)."""
    token = _requested.set(check_kernel_name(name))
    try:
        yield
    finally:
        _requested.reset(token)


def requested() -> str:
    """The request in force: the context's, else ``$VECINFER_DECODE_KERNEL``, else ``"auto"``."""
    name = _requested.get()
    if name is not None:
        return name
    env = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if env not in KERNELS:
        raise ValueError(f"{ENV}={env!r}: use one of {', '.join(KERNELS)}")
    return env


def choose(q: torch.Tensor, k_codes: torch.Tensor, k_centroids: torch.Tensor, v_centroids: torch.Tensor) -> str:
    """``"cuda"`` or ``"triton"`` for a decode call on CUDA tensors (shapes and dtypes only, so it
    works on fake tensors while tracing; may compile the CUDA kernel once)."""
    want = requested()
    if want == "triton":
        return "triton"
    reason, level = cuda_decode.unsupported_reason(q, k_codes, k_centroids, v_centroids), logging.INFO
    if reason is None:  # the inputs fit: a failure to build is the machine's, worth a warning
        reason, level = cuda_decode.build_error(q, k_codes, k_centroids, v_centroids), logging.WARNING
    if reason is None:
        return "cuda"
    if want == "cuda":
        raise RuntimeError(f"decode_kernel='cuda' was requested but {reason}; request 'auto' or 'triton'")
    if reason not in _logged:
        _logged.add(reason)
        log.log(level, "vecinfer: decode attention runs the Triton kernel: %s", reason)
    return "triton"


def choose_append(key, value, k_codes, v_codes, k_window, v_window, n_coded, n_window, arrivals,
                  k_centroids, v_centroids, key_mean, lam, key_matrix, key_parallel_weight=1.0,
                  key_metric=None, value_metric=None) -> str:
    """``"cuda"`` or ``"torch"`` for a ``vecinfer::cache_append`` call on CUDA tensors (the op's
    arguments; shapes and dtypes only, so it works on fake tensors; may compile the kernel once).
    Several new tokens (a prefill chunk) always take the torch form, whose encode is the Triton
    kernel for many tokens; the request governs the one-token decode append. Score-aware key
    codes (``key_parallel_weight > 1``) and error-weighted codes (``key_metric``/``value_metric``)
    add the CUDA encoder of :mod:`.cuda_weigh` (a window is needed: it reads the leaving token
    there)."""
    want = requested()
    if want == "triton" or int(key.shape[2]) != 1:
        return "torch"
    searched = cuda_append.is_searched(key_parallel_weight, key_metric, value_metric)
    reason = cuda_append.unsupported_reason(key, k_window, k_centroids, v_centroids, searched)
    level = logging.WARNING if searched else logging.INFO  # the torch search makes a decode step ~20x slower
    if reason is None:
        reason, level = cuda_append.build_error(key, k_centroids, v_centroids, key_mean, lam, key_matrix,
                                                searched), logging.WARNING
    if reason is None:
        return "cuda"
    if want == "cuda":
        raise RuntimeError(f"decode_kernel='cuda' was requested but the cache append cannot run on CUDA: {reason}; "
                           "request 'auto' or 'triton'")
    if reason not in _logged:
        _logged.add(reason)
        log.log(level, "vecinfer: the cache append runs as torch ops: %s", reason)
    return "torch"


def choose_weigh(x: torch.Tensor, centroids: torch.Tensor) -> str:
    """``"cuda"`` or ``"torch"`` for a ``vecinfer::weigh_codes`` call on CUDA tensors: the kernel of
    :mod:`.cuda_weigh` when it supports the inputs and builds, else the torch descent (logged once
    per reason, as a warning: it is many times slower)."""
    want = requested()
    if want == "triton":
        return "torch"
    reason = cuda_weigh.unsupported_reason(x, centroids) or cuda_weigh.build_error(x, centroids, centroids,
                                                                                   "vq_weigh_rows")
    if reason is None:
        return "cuda"
    if want == "cuda":
        raise RuntimeError(f"decode_kernel='cuda' was requested but error-weighted codes cannot be encoded on CUDA: "
                           f"{reason}; request 'auto' or 'triton'")
    if reason not in _logged:
        _logged.add(reason)
        log.warning("vecinfer: error-weighted codes run the torch descent: %s", reason)
    return "torch"
