"""Pick the implementation of each ``vecinfer::cache_append`` in a compiled graph.

A :class:`~vecinfer_compile.cache.VecInferCache` update emits ``vecinfer::cache_append`` (the
dispatching op of :mod:`vecinfer_compile.ops.append`). Left in the graph, its
``CompositeImplicitAutograd`` kernel would decide while AOTAutograd traces it, out of sight of
Inductor's graph caches (a later compile with another ``decode_kernel`` would reuse the first
decision). This pass decides on the Dynamo graph instead, so the choice is part of the graph:

- ``vecinfer::cache_append_cuda`` (one CUDA launch; an opaque op that mutates the cache buffers,
  which Inductor re-inplaces) where :func:`~vecinfer_compile.ops.append.choose_append`
  picks the CUDA kernel (CUDA inputs, one new token, a supported geometry);
- :func:`~vecinfer_compile.ops.append.append_reference` (torch ops, compiled by Inductor)
  everywhere else.

Counters: ``counters["vecinfer"]["cache_append_cuda"]`` / ``["cache_append_torch"]``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from ..ops import append, kernel_request
from ..ops.append import append_reference
from ..ops.registry import is_op
from .cache_attention import _example


def rewrite_cache_append(gm: fx.GraphModule, decode_kernel: str | None = None) -> int:
    """Replace every ``vecinfer::cache_append`` node by the implementation chosen for it (see the
    module docstring); ``decode_kernel`` is the backend's request (None: ``$VECINFER_KERNEL``
    or auto). Returns the number of nodes replaced; recompiles ``gm`` if any."""
    done = 0
    request = contextlib.nullcontext() if decode_kernel is None else kernel_request.use_decode_kernel(decode_kernel)
    with request:  # entered once: the request's context manager is not re-entrant
        for node in gm.graph.nodes:
            if node.op != "call_function" or not is_op(node.target, "cache_append"):
                continue
            examples = [_example(a) if isinstance(a, fx.Node) else a for a in node.args]  # None: an absent optional
            key = examples[0]
            cuda = key is not None and key.device.type == "cuda"
            kernel = append.choose_append(*examples) if cuda else "torch"
            node.target = torch.ops.vecinfer.cache_append_cuda.default if kernel == "cuda" else append_reference
            counters["vecinfer"][f"cache_append_{kernel}"] += 1
            done += 1
    if done:
        gm.recompile()
    return done
