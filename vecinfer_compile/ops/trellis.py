"""Decode attention over trellis codes (:mod:`vecinfer_compile.quant.trellis_codec`): the operands a
kernel reads, the pure-torch reference (the oracle) and the entry point.

A coded key is ``k~ = mean + (e * sd) @ synthesis`` (``e``: each component's unit table entry at
its state, read from the stored string, :mod:`vecinfer_compile.quant.trellis_packing`; the scale
folded into ``synthesis``), so its score against a query ``q~`` (in the codec's domain) is
``q~ . mean + q'' . e`` with ``q'' = sd * (synthesis @ q~)``: the query goes to the components once
per step and the kernel never forms a key. Values likewise: attention over the values' entries,
then one ``mean + (o * sd) @ synthesis`` per query head. Only the coded prefix is read here; the
full-precision window is merged by log-sum-exp as for the codebooks' codes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..quant.trellis_codec import TrellisCodec
from ..quant.trellis_packing import read_states, state_windows


class TrellisOperands(NamedTuple):
    """One codec (keys or values of a layer) as the kernels read it. ``first, shift, mask [H, D]``
    int32: each component's window (:func:`~vecinfer_compile.quant.trellis_packing.state_windows`);
    ``rows [H, D]`` int32: the offset of its table in ``tables`` (flattened ``[H, W, 2^L]``
    float32); ``sd [H, D]`` float32 (0 for a component of 0 bits); ``synthesis [H, D, D]`` float32,
    the scale folded in; ``mean [H, D]`` float32."""

    first: torch.Tensor
    shift: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    tables: torch.Tensor
    sd: torch.Tensor
    synthesis: torch.Tensor
    mean: torch.Tensor

    @classmethod
    def of(cls, codec: TrellisCodec, device) -> TrellisOperands:
        """``codec``'s operands on ``device``, from the parts its own decoding reads
        (:meth:`~vecinfer_compile.quant.trellis_codec.TrellisCodec.on_device`), in the kernels' dtypes."""
        on = codec.on_device(device)
        windows = (t.to(on["rows"].device) for t in state_windows(codec.bits, codec.state_bits))
        parts = (*windows, on["rows"].int(), on["tables"].flatten(), on["sd"].float(), on["synthesis"].float(),
                 on["mean"].float())
        return cls(*(t.contiguous() for t in parts))

    def entries(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes: [..., H, nbytes]`` uint8 -> unit table entries ``[..., H, D]`` float32 (0 for a
        component of 0 bits)."""
        states = read_states(codes, self.first, self.shift, self.mask)
        return torch.where(self.mask > 0, self.tables[self.rows.long() + states], 0.0)

    def vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes: [B, H, T, nbytes]`` -> the decoded vectors ``[B, H, T, D]`` float32."""
        e = self.entries(codes.transpose(1, 2)).transpose(1, 2)  # [B, H, T, D]
        return torch.einsum("bhtc,hcd->bhtd", e * self.sd[:, None], self.synthesis) + self.mean[:, None]


def decode_reference(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, keys: TrellisOperands,
                     values: TrellisOperands, n_coded: int, kv_start: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: decode every key and value, then softmax attention in float32.

    q ``[B, Hq, D]`` in the key codec's domain; k_codes / v_codes ``[B, Hkv, Tmax, nbytes]`` uint8;
    slots ``[kv_start[b], n_coded)`` of row ``b`` attend (kv_start None: from 0). Returns ``(out
    [B, Hq, D], lse [B, Hq])`` float32 (natural log; a row with nothing to attend: zeros, ``-inf``)."""
    b, hq, d = q.shape
    hkv = k_codes.shape[1]
    group = hq // hkv
    k = keys.vectors(k_codes[:, :, :n_coded])
    v = values.vectors(v_codes[:, :, :n_coded])
    scores = torch.einsum("bhgd,bhtd->bhgt", q.float().view(b, hkv, group, d), k) * scale
    slot = torch.arange(n_coded, device=q.device)
    start = torch.zeros(b, dtype=torch.long, device=q.device) if kv_start is None else kv_start.long()
    scores = scores.masked_fill(slot < start[:, None, None, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    return torch.einsum("bhgt,bhtd->bhgd", p, v).reshape(b, hq, d), lse.reshape(b, hq)


def query_components(q: torch.Tensor, keys: TrellisOperands) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hq, D]`` -> ``(q'' [B, Hq, D], bias [B, Hq])`` float32 with ``q~ . k~ = bias + q'' . e``."""
    b, hq, d = q.shape
    hkv = keys.mean.shape[0]
    qg = q.float().view(b, hkv, hq // hkv, d)
    qc = torch.einsum("bhgd,hcd->bhgc", qg, keys.synthesis) * keys.sd[:, None]
    bias = torch.einsum("bhgd,hd->bhg", qg, keys.mean)
    return qc.reshape(b, hq, d), bias.reshape(b, hq)


def values_out(o: torch.Tensor, lse: torch.Tensor, values: TrellisOperands) -> torch.Tensor:
    """Attention over the values' unit entries ``o [B, Hq, D]`` (weights summing to 1) -> the output
    ``mean + (o * sd) @ synthesis`` ``[B, Hq, D]``; 0 for a row with nothing to attend (``lse [B, Hq]``
    ``-inf``)."""
    b, hq, d = o.shape
    hkv = values.mean.shape[0]
    og = o.view(b, hkv, hq // hkv, d)
    out = torch.einsum("bhgc,hcd->bhgd", og * values.sd[:, None], values.synthesis) + values.mean[:, None]
    return torch.where(torch.isfinite(lse)[..., None], out.reshape(b, hq, d), 0.0)


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, keys: TrellisOperands,
                     values: TrellisOperands, n_coded: int, kv_start: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_reference`'s result, in the components on CUDA (the Triton kernel of
    :mod:`vecinfer_compile.ops.triton.trellis`), by the reference elsewhere."""
    if not q.is_cuda:
        return decode_reference(q, k_codes, v_codes, keys, values, n_coded, kv_start, scale)
    from .triton.trellis import decode_components

    qc, bias = query_components(q, keys)
    o, lse = decode_components(qc, bias, k_codes, v_codes, keys, values, n_coded, kv_start, scale)
    return values_out(o, lse, values), lse
