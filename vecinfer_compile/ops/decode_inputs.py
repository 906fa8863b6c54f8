"""The inputs of ``vecinfer::decode_attention`` that come from outside the cache: the query-side
transform (the exact inverse of the cache's key transform, so scores do not change) and the
first attended slot of each batch row from HF's mask. Shared by the compiled rewrite
(:mod:`vecinfer_compile.passes.cache_attention`, which emits these functions into the graph) and the
eager one-token step (:mod:`vecinfer_compile.hf.attention_over_codes`)."""

from __future__ import annotations

import weakref

import torch

from ..quant.rows import rows_matmul


def transform_queries(
    q: torch.Tensor, lam: torch.Tensor | None, rotation: torch.Tensor | None, key_read: torch.Tensor | None = None
) -> torch.Tensor:
    """``q~ = ((q * lam_q) @ H)`` (or ``q @ key_read_q^T``) in float32, returned in q's dtype.
    ``q: [B, Hq, T, D]``, ``lam: [Hkv, D]`` (query head h uses KV head ``h // (Hq // Hkv)``),
    ``rotation: [D, D]``, ``key_read: [Hkv, D, D]``."""
    b, hq, t, d = q.shape
    work = q.float()
    if key_read is not None:
        hkv = key_read.shape[0]
        work = rows_matmul(work.reshape(b, hkv, hq // hkv, t, d), key_read.float().transpose(-1, -2)[None, :, None])
        work = work.reshape(b, hq, t, d)
    if lam is not None:
        hkv = lam.shape[0]
        work = work.reshape(b, hkv, hq // hkv, t, d) * lam.float()[None, :, None, None, :]
        work = work.reshape(b, hq, t, d)
    if rotation is not None:
        work = rows_matmul(work, rotation.float())
    return work.to(q.dtype)


def kv_start_from_mask(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[B] int32``: the first attended slot of the last query row of ``mask`` ``[B|1, H|1, Tq, L]``
    (bool True = attend, or additive float with 0 = attend): the left-padding length; ``L`` for a
    row that attends nothing (the kernels then return zeros, as the reference does).

    A min over ``where(attend, slot, L)`` rather than an argmax: Inductor splits a min
    reduction over many CTAs, while its argmax over a 128k-slot row ran in one (33 us per call
    on the H200). Unattended slots read as int32's max inside the min, and ``L`` comes in only
    after it: with ``L`` symbolic (a dynamic mask length) a fill of ``L`` gave the min's loop an
    int64 value beside its int32 start in torch 2.11's Inductor, a Triton compile error."""
    attend = mask if mask.dtype == torch.bool else mask == 0
    row = attend[:, 0, -1, :]
    length = row.shape[-1]
    slots = torch.arange(length, device=row.device, dtype=torch.int32)
    first = torch.where(row, slots, torch.iinfo(torch.int32).max).amin(-1)
    return first.clamp_max(length).to(torch.int32).expand(q.shape[0]).contiguous()


def mask_is_a_range(mask: torch.Tensor, kv_start: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """0-d bool, on the device: whether the last query row of ``mask`` ``[B|1, H|1, Tq, L]`` attends
    exactly the slots ``kv_start[b] <= s < valid`` in every head, without a bias (a float mask holds
    0 where it attends and at most ``finfo.min / 2`` elsewhere): all that ``vecinfer::decode_attention``
    reads of a mask. False for holes after the first attended slot, per-head differences, valid
    slots hidden, or additive biases. ``kv_start: [B]`` (:func:`kv_start_from_mask`), ``valid``: 0-d."""
    row = mask[:, :, -1, :]
    if mask.dtype == torch.bool:
        attend, plain = row, torch.ones((), dtype=torch.bool, device=mask.device)
    else:
        attend = row == 0
        plain = (attend | (row <= torch.finfo(row.dtype).min / 2)).all()
    slots = torch.arange(row.shape[-1], device=row.device)
    want = (slots >= kv_start.to(slots.dtype)[:, None, None]) & (slots < valid)
    return plain & (attend == want).all()


def chunk_mask_layout(mask: torch.Tensor, kv_start: torch.Tensor, length: int) -> tuple[bool, bool]:
    """``(standard, padded)`` for a chunk's mask ``[B|1, H|1, C, S]`` over ``S >= length`` slots
    of which the first ``length`` are valid, the chunk's ``C`` queries the last of them (bool True
    = attend, or additive float with 0 = attend and at most ``finfo.min / 2`` elsewhere), and its
    first attended slots ``kv_start [B]`` (:func:`kv_start_from_mask`). ``standard``: the mask is
    causal with left padding ``kv_start`` and nothing else (every head, row ``i`` attends exactly
    the slots ``kv_start[b] <= s <= length - C + i``): all that the chunk attention's fast path
    reads of a mask. ``padded``: some row starts after slot 0. One host sync; HF passes
    one mask object to every layer of a forward, so the answer for the last mask seen is kept (by
    identity and version) and each forward checks once."""
    global _last_chunk_mask
    seen = _last_chunk_mask
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return seen[2]
    b, _, c, width = mask.shape
    if mask.dtype == torch.bool:
        attend, plain = mask, torch.ones((), dtype=torch.bool, device=mask.device)
    else:
        attend = mask == 0
        plain = (attend | (mask <= torch.finfo(mask.dtype).min / 2)).all()
    i = torch.arange(c, device=mask.device)[:, None]
    j = torch.arange(width, device=mask.device)[None, :]
    causal = j <= i + (length - c)
    start = kv_start.to(mask.device).long()
    rows = max(1, CHECK_ELEMENTS // max(attend[:1].numel(), 1))  # bounds the comparison's temporaries
    ok = plain
    for r in range(0, b, rows):
        want = causal[None] & (j[None] >= start[r : r + rows, None, None])
        ok = ok & (attend[r : r + rows] == want[:, None]).all()
    standard, padded = (bool(x) for x in torch.stack([ok, (start > 0).any()]).tolist())
    _last_chunk_mask = (weakref.ref(mask), mask._version, (standard, padded))
    return standard, padded


CHECK_ELEMENTS = 1 << 28  # mask elements compared at once by chunk_mask_layout
_last_chunk_mask = None  # (weakref to the mask, its version, its layout)
