"""Which kernels the ``vecinfer`` ops may run on CUDA: the request, and one log line per reason
when a choice falls back.

Requests, strongest first: :func:`use_decode_kernel` (the backend's ``decode_kernel`` option sets
it while it compiles), the environment variable ``VECINFER_KERNEL`` (read by
:mod:`vecinfer_compile.kernel_env`), then ``"auto"``. ``"auto"`` runs a CUDA kernel where it
supports the inputs and builds on this machine; ``"triton"`` runs none (Triton kernels and torch
ops); an explicit ``"cuda"`` that cannot run raises instead of falling back. Each op family applies
it in its own ``choose`` function (:mod:`.decode`, :mod:`.append`, :mod:`.encode`, and each codec's
own, :mod:`vecinfer_compile.codecs`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

from ..kernel_env import ENV, KERNELS, env_kernel  # noqa: F401  (ENV: read here as before)
from ..log_once import log_once

log = logging.getLogger("vecinfer_compile.ops")

_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("vecinfer_decode_kernel", default=None)


def check_kernel_name(name: str) -> str:
    if name not in KERNELS:
        raise ValueError(f"decode_kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    return name


@contextlib.contextmanager
def use_decode_kernel(name: str):
    """Within the block, the ops on CUDA use ``name`` (auto / cuda / triton)."""
    token = _requested.set(check_kernel_name(name))
    try:
        yield
    finally:
        _requested.reset(token)


def requested() -> str:
    """The request in force: the context's, else ``$VECINFER_KERNEL``, else ``"auto"``."""
    name = _requested.get()
    return env_kernel() if name is None else name


def fall_back(reason: str, level: int, what: str, explicit: str) -> None:
    """A kernel choice that cannot take the CUDA kernel: raise under an explicit ``"cuda"`` request
    (``explicit`` names what could not run), else log ``what: reason`` once per reason."""
    if requested() == "cuda":
        raise RuntimeError(f"decode_kernel='cuda' was requested but {explicit}: {reason}; request 'auto' or 'triton'")
    log_once(log, level, reason, "vecinfer: %s: %s", what, reason)
