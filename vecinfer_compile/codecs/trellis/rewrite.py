"""The trellis codec's entry in the compile pass's table: ``vecinfer::trellis_cache_kv`` read ->
``trellis_decode_attention`` / ``trellis_chunk_attention``.

``trellis_cache_kv``'s arguments: ``(k_codes, v_codes, n_coded, k_window, v_window, n_window, lam,
rotation, keys, values)`` (``keys``, ``values``: each side's operands as a list of tensors); the
decode and chunk ops take the first six, then the mask or ``kv_start`` and the scale, then the two
operand lists.
"""

from __future__ import annotations

import torch

from ..base import CacheRewrite

BUFFERS, LAM, ROT, KEYS, VALUES = slice(0, 6), 6, 7, 8, 9


def _decode(q, args: tuple, kv_start, scale, kernel):
    return torch.ops.vecinfer.trellis_decode_attention.default, (
        *args[BUFFERS],
        kv_start,
        scale,
        args[KEYS],
        args[VALUES],
    )


def _chunk(args: tuple, mask, scale):
    return torch.ops.vecinfer.trellis_chunk_attention.default, (*args[BUFFERS], mask, scale, args[KEYS], args[VALUES])


REWRITE = CacheRewrite(
    read_op="trellis_cache_kv",
    transform=lambda a: (a[LAM], a[ROT]),
    decode=_decode,
    chunk=_chunk,
    write_ops=("trellis_encode", "trellis_append"),
)
