"""Which kernel runs ``vecinfer::decode_attention`` on CUDA: the CUDA kernel or the Triton one.

Requests, strongest first: :func:`use_decode_kernel` (the backend's ``decode_kernel`` option
sets it while it compiles), the environment variable ``VECINFER_DECODE_KERNEL`` (benchmarks),
then ``"auto"``. ``"auto"`` runs the CUDA kernel when it supports the inputs and builds on this
machine, else the Triton kernel, and logs one line saying why (once per reason). An explicit
``"cuda"`` that cannot run raises instead: an explicit request never falls back silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

import torch

from . import cuda_decode

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
