"""The registered ops of a cache layer coded by the trellis codec (:mod:`.trellis`), eager and compiled alike.

Schemas (``keys``, ``values``: a :class:`~.trellis.TrellisOperands` as its list of tensors)::

    vecinfer::trellis_encode(Tensor x, Tensor[] codec, int nbytes) -> Tensor
    vecinfer::trellis_append(Tensor kt, Tensor value, Tensor(a!) k_codes, Tensor(b!) v_codes,
        Tensor(c!) k_window, Tensor(d!) v_window, Tensor(e!) n_coded, Tensor(f!) n_window,
        Tensor(g!) arrivals, Tensor[] keys, Tensor[] values) -> ()
    vecinfer::trellis_cache_kv(Tensor k_codes, Tensor v_codes, Tensor n_coded, Tensor k_window,
        Tensor v_window, Tensor n_window, Tensor? lam, Tensor? rotation, Tensor[] keys,
        Tensor[] values) -> (Tensor, Tensor)
    vecinfer::trellis_decode_attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor n_coded,
        Tensor k_window, Tensor v_window, Tensor n_window, Tensor? kv_start, float scale,
        Tensor[] keys, Tensor[] values) -> Tensor
    vecinfer::trellis_chunk_attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor n_coded,
        Tensor k_window, Tensor v_window, Tensor n_window, Tensor? attn_mask, float scale,
        Tensor[] keys, Tensor[] values) -> Tensor

- ``trellis_encode``: ``x [B, H, T, D]`` -> stored codes ``[B, H, T, nbytes]`` uint8
  (:func:`.trellis.encode`; one Viterbi launch on CUDA; ``nbytes``: the codec's, given so that the
  output's shape needs no data).
- ``trellis_append``: ``T`` new tokens (keys as ``K~``, values; ``[B, H, T, D]`` in the windows'
  dtype) into a layer's buffers in place by the window rule of ``vecinfer::cache_append``
  (:func:`.trellis.append`: one launch for a decode step's token on CUDA, else torch ops and a
  ``trellis_encode`` a side).
- ``trellis_cache_kv``: ``vecinfer::cache_kv``'s contract over trellis codes: every slot's K and V
  ``[B, H, S, D]`` in the window's dtype, keys back through ``rotation^T`` and ``lam`` where given
  (the query-aware matrix and the mean follow as plain ops, as for ``cache_kv``), zeros past the
  valid slots. What a compiled chunk attends densely, and what
  :mod:`vecinfer_compile.passes.cache_attention` replaces at a decode step by
- ``trellis_decode_attention``: one query token ``q [B, Hq, 1, D]`` in ``K~``'s domain over the
  codes and the window (:func:`.trellis.decode_step`) -> ``[B, Hq, 1, D]`` in ``q``'s dtype.
- ``trellis_chunk_attention``: ``vecinfer::chunk_attention``'s contract over trellis codes (a chunk
  ``q [B, Hq, C, D]`` in ``K~``'s domain, its own keys the window's last filled slots; the split
  attention of :mod:`.split_attention.chunk` with :class:`.split_attention.prefix.TrellisPrefix`).

The first four are opaque (Inductor calls them as extern kernels) and read the counters on the device
only: no host sync, so CUDA graphs capture them. The chunk's, as ``chunk_attention``, reads them on
the host and is tagged ``cudagraph_unsafe``.
"""

from __future__ import annotations

import torch

from ...ops.dequantize import ROW_CHUNK_ELEMENTS
from ...ops.registry import define
from ...ops.split_attention.chunk import attend_over_buffers
from .operands import TrellisOperands, append, decode_step, encode
from .prefix import TrellisPrefix
from .reference import read


def trellis_encode(x: torch.Tensor, codec: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    return encode(x, TrellisOperands(*codec), nbytes).contiguous()


def _encode_fake(x: torch.Tensor, codec: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    b, h, t, _ = x.shape
    return x.new_empty((b, h, t, nbytes), dtype=torch.uint8)


def trellis_append(
    kt: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_coded: torch.Tensor,
    n_window: torch.Tensor,
    arrivals: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> None:
    append(
        kt,
        value,
        k_codes,
        v_codes,
        k_window,
        v_window,
        n_coded,
        n_window,
        arrivals,
        TrellisOperands(*keys),
        TrellisOperands(*values),
    )


def trellis_cache_kv(
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    k_out, v_out = _cache_kv_fake(k_codes, v_codes, n_coded, k_window, v_window, n_window, lam, rotation, keys, values)
    kops, vops = TrellisOperands(*keys), TrellisOperands(*values)
    b, h, s, d = k_out.shape
    rows = max(1, ROW_CHUNK_ELEMENTS // max(h * s * d, 1))
    for i in range(0, b, rows):
        j = min(i + rows, b)
        kt, v = read(k_codes[i:j], v_codes[i:j], n_coded, k_window[i:j], v_window[i:j], n_window, kops, vops)
        if rotation is not None:
            kt = kt @ rotation.float().T
        if lam is not None:
            kt = kt * lam.float()[None, :, None, :]
        k_out[i:j] = kt
        v_out[i:j] = v
    return k_out, v_out


def _cache_kv_fake(
    k_codes, v_codes, n_coded, k_window, v_window, n_window, lam, rotation, keys, values
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, s, _ = k_codes.shape
    d = k_window.shape[-1]
    return k_window.new_empty((b, h, s, d)), v_window.new_empty((b, h, s, d))


def trellis_decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    kv_start: torch.Tensor | None,
    scale: float,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    return decode_step(
        q,
        k_codes,
        v_codes,
        n_coded,
        k_window,
        v_window,
        n_window,
        kv_start,
        scale,
        TrellisOperands(*keys),
        TrellisOperands(*values),
    )


def _decode_fake(q, *args) -> torch.Tensor:
    return torch.empty_like(q)


def trellis_chunk_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    prefix = TrellisPrefix(TrellisOperands(*keys), TrellisOperands(*values))
    return attend_over_buffers(q, k_codes, v_codes, prefix, n_coded, k_window, v_window, n_window, attn_mask, scale)


def _chunk_fake(q, *args) -> torch.Tensor:
    b, hq, c, d = q.shape
    return q.new_empty((b, c, hq, d)).transpose(1, 2)


define("trellis_encode", trellis_encode, kind="opaque", fake=_encode_fake)
define(
    "trellis_append",
    trellis_append,
    kind="opaque",
    fake=lambda *args: None,
    mutates=("k_codes", "v_codes", "k_window", "v_window", "n_coded", "n_window", "arrivals"),
)
define("trellis_cache_kv", trellis_cache_kv, kind="opaque", fake=_cache_kv_fake)
define("trellis_decode_attention", trellis_decode_attention, kind="opaque", fake=_decode_fake)
define(
    "trellis_chunk_attention",
    trellis_chunk_attention,
    kind="opaque",
    fake=_chunk_fake,
    tags=(torch.Tag.cudagraph_unsafe,),
)
