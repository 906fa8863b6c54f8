"""The environment variable ``VECINFER_KERNEL`` (``auto``, ``cuda`` or ``triton``): which kernels
the ``vecinfer`` ops may run on CUDA (append, encode, decode, chunk attention and each codec's
own kernels alike; :mod:`vecinfer_compile.ops.kernel_request` applies it). Read without torch,
so that the command line refuses a bad value before anything loads.

Its old name ``VECINFER_DECODE_KERNEL`` still works, with a FutureWarning (once) naming the new
one; when both are set, ``VECINFER_KERNEL`` wins.
"""

from __future__ import annotations

import os
import warnings

KERNELS = ("auto", "cuda", "triton")
ENV = "VECINFER_KERNEL"
OLD_ENV = "VECINFER_DECODE_KERNEL"
_warned: set[str] = set()


def env_kernel() -> str:
    """The kernel request of the environment (``"auto"`` when unset or empty); a ValueError naming
    the variable and its choices for any other value."""
    name = ENV if os.environ.get(ENV, "").strip() or OLD_ENV not in os.environ else OLD_ENV
    value = os.environ.get(name, "").strip().lower() or "auto"
    if value not in KERNELS:
        renamed = f" (renamed {ENV}: set that instead)" if name == OLD_ENV else ""
        raise ValueError(
            f"{name}={os.environ[name]!r} is not a kernel choice: use one of "
            f"{', '.join(KERNELS)}, or unset it (auto){renamed}"
        )
    if name == OLD_ENV and OLD_ENV not in _warned:
        _warned.add(OLD_ENV)
        warnings.warn(
            f"{OLD_ENV} is renamed {ENV} (it chooses the append, encode and Viterbi kernels too, "
            f"not only decode): set {ENV}={value}",
            FutureWarning,
            stacklevel=2,
        )
    return value
