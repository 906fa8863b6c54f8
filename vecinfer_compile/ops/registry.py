"""How every ``vecinfer`` op is registered: one function, :func:`define`, that each op family
calls at import.

Three kinds of op, by what Inductor should see:

- ``"opaque"``: ``torch.library.custom_op``; Inductor calls it as an extern kernel and CUDA graphs
  capture it (the NVRTC kernels, and torch code Inductor should not trace into);
- ``"triton"``: ``torch.library.triton_op``; its function launches Triton kernels through
  ``wrap_triton`` on CUDA, so Inductor sees and may fuse them, and runs the reference elsewhere;
- ``"composite"``: a ``CompositeImplicitAutograd`` kernel; tracing inlines its body (the torch
  form of an op whose CUDA kernel the compile pass picks explicitly).

Registration is idempotent per process (a module reloaded by a test registers nothing twice).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "vecinfer"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept alive: it owns composite registrations


def is_registered(name: str) -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def define(
    name: str,
    fn: Callable,
    *,
    kind: str,
    schema: str | None = None,
    mutates: tuple[str, ...] = (),
    fake: Callable | None = None,
    device_kernels: dict[str, Callable] | None = None,
    tags: tuple[torch.Tag, ...] = (),
) -> None:
    """Register ``vecinfer::<name>`` running ``fn`` (a no-op when this process has it already).

    ``schema``: the full schema (``"name(...) -> ..."``), needed for ``"composite"`` and for an
    opaque op whose ``fn`` takes ``*args``; otherwise inferred from ``fn``'s signature (a triton
    op's always is). ``mutates``: the
    arguments an opaque op writes. ``fake``: an opaque op's fake implementation (a triton op's
    function is its own). ``device_kernels``: per-device replacements of an opaque op's ``fn``.
    ``tags``: an opaque op's tags (``torch.Tag.cudagraph_unsafe`` for one that syncs with the host)."""
    if is_registered(name):
        return
    qualname = f"{NAMESPACE}::{name}"
    inferred = None if schema is None else schema.split(name, 1)[1]
    if kind == "opaque":
        op = torch.library.custom_op(qualname, fn, mutates_args=mutates, schema=inferred, tags=tags or None)
        op.register_fake(fake if fake is not None else fn)
        for device, kernel in (device_kernels or {}).items():
            op.register_kernel(device, kernel)
    elif kind == "triton":
        torch.library.triton_op(qualname, fn, mutates_args=mutates)
    elif kind == "composite":
        if schema is None:
            raise ValueError(f"a composite op needs its schema: {name}")
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, fn, "CompositeImplicitAutograd")
    else:
        raise ValueError(f"kind must be 'opaque', 'triton' or 'composite', got {kind!r}")


def is_op(target, name: str) -> bool:
    """Whether an FX node target is ``vecinfer::<name>`` (the packet or its default overload)."""
    op = getattr(getattr(torch.ops, NAMESPACE), name)
    return target is op or target is op.default
