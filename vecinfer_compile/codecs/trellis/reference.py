"""The trellis codec's float32 oracles over a cache layer's codes: every slot decoded (:func:`read`)
and decode attention over the coded slots (:func:`decode_reference`). The kernels and the cache's
ops are tested against these; the Viterbi walk's own reference is :func:`.walk.viterbi`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .operands import TrellisOperands


def read(
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window,
    keys: TrellisOperands,
    values: TrellisOperands,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of a layer: ``(K~, V)`` ``[B, H, S, D]`` float32 (``S = k_codes.shape[2]``), slots
    ``< n_coded`` decoded from ``k_codes, v_codes [B, H, S, nbytes]``, the next ``n_window`` from
    the windows ``[B, H, R, D]``, zeros after. ``n_coded``, ``n_window``: ints or 0-d tensors (no
    host sync: the compiled read)."""
    s = k_codes.shape[2]
    slot = torch.arange(s, device=k_codes.device)[:, None]
    kt, v = keys.vectors(k_codes), values.vectors(v_codes)
    r = k_window.shape[2]
    if r:
        at = (slot[:, 0] - n_coded).clamp(0, r - 1)
        in_window = (slot >= n_coded) & (slot < n_coded + n_window)
        kt = torch.where(in_window, k_window.float().index_select(2, at), kt)
        v = torch.where(in_window, v_window.float().index_select(2, at), v)
    valid = slot < n_coded + n_window
    return torch.where(valid, kt, 0.0), torch.where(valid, v, 0.0)


def decode_reference(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    keys: TrellisOperands,
    values: TrellisOperands,
    n_coded,
    kv_start: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: decode every key and value, then softmax attention in float32.

    q ``[B, Hq, D]`` in the key codec's domain; k_codes / v_codes ``[B, Hkv, Tmax, nbytes]`` uint8;
    slots ``[kv_start[b], n_coded)`` of row ``b`` attend (kv_start None: from 0; ``n_coded`` an int
    or a 0-d tensor). Returns ``(out [B, Hq, D], lse [B, Hq])`` float32 (natural log; a row with
    nothing to attend: zeros, ``-inf``)."""
    b, hq, d = q.shape
    hkv = k_codes.shape[1]
    group = hq // hkv
    n = n_coded if isinstance(n_coded, int) else k_codes.shape[2]
    k = keys.vectors(k_codes[:, :, :n])
    v = values.vectors(v_codes[:, :, :n])
    scores = torch.einsum("bhgd,bhtd->bhgt", q.float().view(b, hkv, group, d), k) * scale
    slot = torch.arange(n, device=q.device)
    start = torch.zeros(b, dtype=torch.long, device=q.device) if kv_start is None else kv_start.long()
    hidden = (slot < start[:, None, None, None]) | (slot >= n_coded)
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    return torch.einsum("bhgt,bhtd->bhgd", p, v).reshape(b, hq, d), lse.reshape(b, hq)
