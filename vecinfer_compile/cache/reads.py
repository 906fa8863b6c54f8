"""Every read of one coded layer (its :class:`~.storage.LayerStorage` and
:class:`~.quantizer.LayerQuantizer`): the dequantized K/V, a chunk's K/V with its own tokens in
full precision, what a chunk's attention over the codes needs, and attention over the codes for
one query token (decode) or a chunk.

Shapes: ``B`` batch, ``H`` KV heads, ``Hq`` query heads (a multiple of ``H``), ``D`` head_dim,
``S = max_cache_len`` slots. Dequantized reads are ``[B, H, S, D]`` in the cache dtype, keys in
the original domain, zeros (``mu`` for keys under centring) past the valid slots. Queries are
``[B, Hq, T, D]`` in the model dtype; attention returns ``[B, Hq, T, D]``.

A chunk of several tokens appended to a non-empty layer reads by the rule of
:mod:`vecinfer_compile.ops.split_attention.chunk`: the coded slots and the window as they were before
the append, then its own tokens in full precision.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..log_once import log_once
from ..ops.decode_inputs import kv_start_from_mask, mask_is_a_range, transform_queries
from ..ops.split_attention import chunk as chunk_attention
from ..ops.split_attention.chunk import ChunkKeys
from .quantizer import LayerQuantizer
from .storage import LayerStorage

log = logging.getLogger(__name__)

DECODE_READ_BYTES = (
    1 << 30
)  # dequantized + repeated K/V of one row group of an eager step whose mask the op cannot read


def read(
    storage: LayerStorage,
    quantizer: LayerQuantizer,
    length: int | None = None,
    rows: slice = slice(None),
    window: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's read op (:meth:`~vecinfer_compile.codecs.base.Codec.read_kv`: K in the original
    domain, V), then, for the query-aware methods,
    ``K = (K~.float() @ key_read).to(dtype)`` (a plain matmul that
    :mod:`~vecinfer_compile.passes.cache_attention` recognises and moves to the query side), and for
    the centring methods ``+ key_mean`` before the cast (which that pass drops). Slots beyond the
    valid length then hold ``mu`` rather than zeros; the mask hides them.

    ``length``: read the first ``length`` slots only (``[B, H, length, D]``; eager); ``rows``:
    these batch rows only (eager); ``window``: ``(n_coded, k_window, v_window, n_window)`` read in
    place of the layer's own (windows ``[B, H, w, D]``, keys transformed: a chunk's read,
    :func:`chunk_window` compiled, :func:`dense` eager)."""
    s, q = storage, quantizer
    k_codes, v_codes = s.k_codes[rows], s.v_codes[rows]
    if length is not None:
        k_codes, v_codes = k_codes[:, :, :length], v_codes[:, :, :length]
    n_coded, k_window, v_window, n_window = window or (s.n_coded, s.k_window, s.v_window, s.n_window)
    k, v = q.codec.read_kv(k_codes, v_codes, n_coded, k_window[rows], v_window[rows], n_window, q)
    if q.key_read is None and q.key_mean is None:
        return k, v
    k = k.float()
    if q.key_read is not None:
        k = k @ q.key_read
    if q.key_mean is not None:
        k = k + q.key_mean[None, :, None, :]
    return k.to(s.dtype), v


def dequantized(storage: LayerStorage, quantizer: LayerQuantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager: the full-length K (original domain) and V the layer stands for."""
    if storage.batch_size is None:
        raise RuntimeError("this VecInferCache layer holds nothing yet (it allocates at its first update)")
    return read(storage, quantizer)


def with_chunk(
    storage: LayerStorage, before: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager: the dequantized read of a chunk ``k``, ``v: [B, H, C, D]`` after its append:
    ``before`` (the layer's read of its valid slots before the append) padded to every slot, with
    the chunk's own ``k``, ``v`` at the slots after the tokens held before."""
    length = storage.max_cache_len
    held = storage.n_coded + storage.n_window - k.shape[2]  # after the append, less the chunk
    rk, rv = before
    if rk.shape[2] < length:
        pad = (0, 0, 0, length - rk.shape[2])
        rk, rv = F.pad(rk, pad), F.pad(rv, pad)
    pos = (held + torch.arange(k.shape[2], device=k.device)).clamp(max=length - 1)
    return rk.index_copy(2, pos, k), rv.index_copy(2, pos, v)


def chunk_keys(
    storage: LayerStorage, quantizer: LayerQuantizer, kt: torch.Tensor, v: torch.Tensor, n_coded: int, n_window: int
) -> ChunkKeys:
    """What a chunk's attention over the codes needs, taken before its append: the window's
    ``n_window`` slots then the chunk (``kt`` its keys transformed, ``v``: ``[B, H, C, D]``),
    position-major."""
    s = storage
    k_full = torch.cat([s.k_window[:, :, :n_window].transpose(1, 2), kt.transpose(1, 2)], dim=1)
    v_full = torch.cat([s.v_window[:, :, :n_window].transpose(1, 2), v.transpose(1, 2)], dim=1)
    return ChunkKeys(s.k_codes, s.v_codes, quantizer.codec.prefix(quantizer), n_coded, k_full, v_full)


def chunk_window(storage: LayerStorage, kt: torch.Tensor, v: torch.Tensor) -> tuple:
    """A compiled chunk's read, taken before its append, as :func:`read`'s ``window``: ``(n_coded,
    k_full, v_full, n_window + C)`` with ``k_full``, ``v_full: [B, H, R + C, D]`` the window's
    buffers with the chunk (``kt`` its keys transformed, ``v``: ``[B, H, C, D]``) written after
    the filled slots. No host sync and static shapes (capture-safe); the counters are copies, so
    the append that follows changes nothing this read names (it writes code slots at or after
    ``n_coded`` only)."""
    s, c = storage, kt.shape[2]
    pos = s.n_window + torch.arange(c, device=kt.device)
    k_full = torch.cat([s.k_window, torch.zeros_like(kt)], 2).index_copy(2, pos, kt)
    v_full = torch.cat([s.v_window, torch.zeros_like(v)], 2).index_copy(2, pos, v)
    return s.n_coded.clone(), k_full, v_full, s.n_window + c


def dense(storage: LayerStorage, quantizer: LayerQuantizer, chunk: ChunkKeys | None = None):
    """Eager: the ``[B, H, S, D]`` K and V that an eager step's codes read stands for
    (:mod:`vecinfer_compile.hf.attention_over_codes`): after one token, every slot (:func:`dequantized`);
    after a chunk (``chunk``: :func:`chunk_keys` before its append), the coded slots before it,
    then the old window and the chunk in full precision."""
    if chunk is None:
        return dequantized(storage, quantizer)
    device = storage.device
    full = torch.tensor(chunk.k_full.shape[1], device=device)
    window = (
        torch.tensor(chunk.n_coded, device=device),
        chunk.k_full.transpose(1, 2),
        chunk.v_full.transpose(1, 2),
        full,
    )
    return read(storage, quantizer, window=window)


def attend(
    storage: LayerStorage,
    quantizer: LayerQuantizer,
    q: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Decode attention of one query token ``q: [B, Hq, 1, D]`` over the codes and window:
    the codec's decode (:meth:`~vecinfer_compile.codecs.base.Codec.decode`, the compiled decode step's op). ``attn_mask``: None or HF's
    ``[B|1, 1|Hq, 1, L]`` (bool True = attend, or additive float): left padding, the first
    attended slot of each row, is all the op reads, so a mask that is more than that (holes,
    per-head differences, a bias: checked, one host sync) gets SDPA over the dequantized cache
    instead, a few rows at a time; ``scale``: None for ``D ** -0.5``."""
    s, qz = storage, quantizer
    kv_start = None
    if attn_mask is not None:
        if attn_mask.dim() != 4:
            raise ValueError(f"attn_mask must be 4-d [B, H, 1, L], got {tuple(attn_mask.shape)}")
        kv_start = kv_start_from_mask(attn_mask, q)
        if not bool(mask_is_a_range(attn_mask, kv_start, s.n_coded + s.n_window)):  # host sync
            log_once(
                log,
                logging.INFO,
                "mask",
                "vecinfer: an eager decode mask is not left padding over the valid slots (holes, "
                "per-head differences or a bias): that step attends over the dequantized cache",
            )
            return sdpa_by_rows(s, qz, q, attn_mask, scale, attn_mask.shape[-1])
    q_t = transform_queries(q, qz.lam, qz.rotation, qz.key_read)
    scale = s.head_dim**-0.5 if scale is None else float(scale)
    return qz.codec.decode(s, qz, q_t, kv_start, scale)


def attend_chunk(
    storage: LayerStorage,
    quantizer: LayerQuantizer,
    q: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    keys: ChunkKeys,
) -> torch.Tensor:
    """Attention of an eager chunk of ``C`` query tokens ``q: [B, Hq, C, D]`` by the rule of
    :mod:`vecinfer_compile.ops.split_attention.chunk` (``keys``: :func:`chunk_keys` before the append):
    the coded prefix and the full-precision window and chunk, merged by log-sum-exp, on CUDA
    without any dequantized copy of the whole batch. ``attn_mask``: HF's ``[B|1, 1|Hq, C, S]``
    over the layer's slots, or None (:func:`~vecinfer_compile.ops.split_attention.chunk.attend_masked`)."""
    q_t = transform_queries(q, quantizer.lam, quantizer.rotation, quantizer.key_read)
    scale = storage.head_dim**-0.5 if scale is None else float(scale)
    return chunk_attention.attend_masked(q_t, keys, attn_mask, scale, storage.max_cache_len)


def sdpa_by_rows(
    storage: LayerStorage,
    quantizer: LayerQuantizer,
    q: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float | None,
    length: int,
) -> torch.Tensor:
    """SDPA of ``q: [B, Hq, T, D]`` over the first ``length`` slots dequantized, with
    ``attn_mask: [B|1, 1|Hq, T, length]``, a row group at a time (:data:`DECODE_READ_BYTES`)."""
    b, hq, t, d = q.shape
    group = hq // storage.num_heads
    per_row = 2 * (1 + group) * storage.num_heads * length * d * torch.finfo(storage.dtype).bits // 8
    rows = max(1, DECODE_READ_BYTES // max(per_row, 1))
    out = q.new_empty((b, hq, t, d))
    for i in range(0, b, rows):
        j = min(i + rows, b)
        k, v = read(storage, quantizer, length, slice(i, j))
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
        mask = attn_mask if attn_mask.shape[0] == 1 else attn_mask[i:j]
        out[i:j] = F.scaled_dot_product_attention(q[i:j], k, v, attn_mask=mask, scale=scale)
        del k, v
    return out
