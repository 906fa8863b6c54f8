"""The codebooks' entry in the compile pass's table: ``vecinfer::cache_kv`` read ->
``decode_attention`` (the kernel the request resolves to on CUDA) / ``chunk_attention``.

``cache_kv``'s arguments: ``(k_codes, v_codes, key_centroids, value_centroids, n_coded, k_window,
v_window, n_window, lam, rotation)``; the decode and chunk ops take the first eight as they are.
"""

from __future__ import annotations

import contextlib

import torch
from torch._dynamo.utils import counters

from ...ops import decode, kernel_request
from ..base import CacheRewrite

K_CODES, K_CENT, V_CENT, LAM, ROT = 0, 2, 3, 8, 9
CODED = slice(0, 8)


def _example(node):
    value = getattr(node, "meta", {}).get("example_value", getattr(node, "meta", {}).get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _decode(q: torch.Tensor, args: tuple, kv_start, scale, kernel: str | None):
    """The decode op for this call: kernel-specific on CUDA (the choice is in the graph), the
    dispatching op elsewhere or where the read's shapes are unknown."""
    op = torch.ops.vecinfer.decode_attention.default
    examples = [_example(args[i]) for i in (K_CODES, K_CENT, V_CENT)]
    if q.device.type == "cuda" and all(e is not None for e in examples):
        request = contextlib.nullcontext() if kernel is None else kernel_request.use_decode_kernel(kernel)
        with request:
            chosen = decode.choose(q, *examples)
        counters["vecinfer"][f"cache_decode_{chosen}"] += 1
        op = getattr(torch.ops.vecinfer, f"decode_attention_{chosen}").default
    return op, (*args[CODED], kv_start, scale)


def _chunk(args: tuple, mask, scale):
    return torch.ops.vecinfer.chunk_attention.default, (*args[CODED], mask, scale)


REWRITE = CacheRewrite(
    read_op="cache_kv", transform=lambda a: (a[LAM], a[ROT]), decode=_decode, chunk=_chunk, write_ops=("cache_append",)
)
