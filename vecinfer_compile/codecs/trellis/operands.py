"""A cache layer coded by the trellis codec (:mod:`.code`): the operands the kernels read, the encode
of new tokens, decode attention (the kernels' entry point; its float32 oracles are
:mod:`.reference`'s) and a decode step over codes and window. The registered ops over them are
:mod:`.ops`'.

A coded key is ``k~ = mean + (e * sd) @ synthesis`` (``e``: each component's unit table entry at
its state, read from the stored string, :mod:`vecinfer_compile.codecs.trellis.packing`; the scale
folded into ``synthesis``), so its score against a query ``q~`` (in the codec's domain) is
``q~ . mean + q'' . e`` with ``q'' = sd * (synthesis @ q~)``: the query goes to the components once
per step and the kernel never forms a key. Values likewise: attention over the values' entries,
then one ``mean + (o * sd) @ synthesis`` per query head. Only the coded prefix is read here; the
full-precision window is merged by log-sum-exp as for the codebooks' codes (:func:`decode_step`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from ...ops.append import append_through_window
from ...ops.kernel_request import fall_back, requested
from ...ops.split_attention.lse_merge import merge_by_lse
from .code import TrellisCodec, components, packed_codes
from .cuda import append as cuda_trellis_append
from .cuda import decode as cuda_trellis_decode
from .packing import read_states, state_windows
from .reference import decode_reference


class TrellisOperands(NamedTuple):
    """One codec (keys or values of a layer) as the kernels and ops read it, on one device.

    Decoding: ``first, shift, mask [H, D]`` int32, each component's window
    (:func:`~vecinfer_compile.codecs.trellis.packing.state_windows`); ``rows [H, D]`` int32, the offset
    of its table in ``tables`` (``[H, W, 2^L]`` float32, read flattened); ``sd [H, D]`` float32 (0 for
    a component of 0 bits); ``synthesis [H, D, D]`` float32, the scale folded in; ``mean [H, D]``
    float32. Encoding (:func:`encode`, float64 as the codec's own): ``center [H, D]`` (the mean),
    ``analysis [H, D, D]``, ``inverse_sd [H, D]``; ``bits [H, D]`` int32."""

    first: torch.Tensor
    shift: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    tables: torch.Tensor
    sd: torch.Tensor
    synthesis: torch.Tensor
    mean: torch.Tensor
    center: torch.Tensor
    analysis: torch.Tensor
    inverse_sd: torch.Tensor
    bits: torch.Tensor

    @classmethod
    def of(cls, codec: TrellisCodec, device) -> TrellisOperands:
        """``codec``'s operands on ``device``, from the parts its own coding reads
        (:meth:`~vecinfer_compile.codecs.trellis.code.TrellisCodec.on_device`)."""
        on = codec.on_device(device)
        windows = (t.to(on["rows"].device) for t in state_windows(codec.bits, codec.state_bits))
        parts = (
            *windows,
            on["rows"].int(),
            on["tables"],
            on["sd"].float(),
            on["synthesis"].float(),
            on["mean"].float(),
            on["mean"],
            on["analysis"],
            on["inverse_sd"],
            on["bits"],
        )
        return cls(*(t.contiguous() for t in parts))

    def entries(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes: [..., H, nbytes]`` uint8 -> unit table entries ``[..., H, D]`` float32 (0 for a
        component of 0 bits)."""
        states = read_states(codes, self.first, self.shift, self.mask)
        return torch.where(self.mask > 0, self.tables.flatten()[self.rows.long() + states], 0.0)

    def vectors(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes: [B, H, T, nbytes]`` -> the decoded vectors ``[B, H, T, D]`` float32."""
        e = self.entries(codes.transpose(1, 2)).transpose(1, 2)  # [B, H, T, D]
        return torch.einsum("bhtc,hcd->bhtd", e * self.sd[:, None], self.synthesis) + self.mean[:, None]


def encode(x: torch.Tensor, operands: TrellisOperands, nbytes: int) -> torch.Tensor:
    """``x [B, H, T, D]`` (keys in the codec's domain, or values; any float dtype) -> the stored codes
    ``[B, H, T, nbytes]`` uint8, as :meth:`~vecinfer_compile.codecs.trellis.code.TrellisCodec.encode_packed`
    codes them (one Viterbi launch on CUDA, no host sync)."""
    b, h, t, _ = x.shape
    unit = components(x, operands.center, operands.analysis, operands.inverse_sd)
    return packed_codes(unit, operands.bits, operands.tables, nbytes).view(b, t, h, nbytes).transpose(1, 2)


def append(
    kt: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_coded: torch.Tensor,
    n_window: torch.Tensor,
    arrivals: torch.Tensor,
    keys: TrellisOperands,
    values: TrellisOperands,
) -> None:
    """Append ``T`` tokens (``kt``: keys as ``K~``, ``value``: ``[B, H, T, D]`` in the windows'
    dtype) to a layer's buffers in place, without host syncs: the window rule of
    :func:`~.append.append_through_window` with this codec's codes. One token on CUDA: one launch
    (:mod:`.cuda.trellis_append`) where :func:`choose_append` picks it; else torch ops and an
    :func:`encode` a side. ``arrivals``: the kernel's int32 ``[1]`` scratch, zero."""
    if kt.is_cuda and choose_append(kt, k_window, keys, values) == "cuda":
        cuda_trellis_append.trellis_append_cuda(
            kt, value, k_codes, v_codes, k_window, v_window, n_coded, n_window, arrivals, keys, values
        )
        return
    append_through_window(
        kt,
        value,
        k_codes,
        v_codes,
        k_window,
        v_window,
        n_coded,
        n_window,
        lambda x: encode(x, keys, k_codes.shape[-1]),
        lambda x: encode(x, values, v_codes.shape[-1]),
    )


def choose_append(kt: torch.Tensor, k_window: torch.Tensor, keys: TrellisOperands, values: TrellisOperands) -> str:
    """``"cuda"`` or ``"torch"`` for an append of CUDA tensors (shapes only; may compile the kernel
    once), under :mod:`.kernel_request`'s request. Several new tokens (a prefill chunk) take the
    torch ops, whose encode walks them all in one launch."""
    if requested() == "triton" or int(kt.shape[2]) != 1:
        return "torch"
    reason, level = cuda_trellis_append.unsupported_reason(kt, k_window, keys, values), logging.INFO
    if reason is None:  # the inputs fit: a failure to build is the machine's, worth a warning
        reason, level = cuda_trellis_append.build_error(kt, keys, values), logging.WARNING
    if reason is None:
        return "cuda"
    fall_back(reason, level, "the trellis append runs as torch ops", "the CUDA trellis append cannot run")
    return "torch"


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


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    keys: TrellisOperands,
    values: TrellisOperands,
    n_coded,
    kv_start: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_reference`'s result, in the components on CUDA (reading a tensor ``n_coded``
    on the device): the CUDA kernel (:mod:`.cuda.trellis_decode`) where :func:`choose_decode` picks
    it, else the Triton kernel (:mod:`.triton.trellis`); by the reference elsewhere."""
    if not q.is_cuda:
        return decode_reference(q, k_codes, v_codes, keys, values, n_coded, kv_start, scale)
    qc, bias = query_components(q, keys)
    if choose_decode(qc, k_codes, v_codes, keys, values) == "cuda":
        decode_components = cuda_trellis_decode.decode_components_cuda
    else:
        from .triton_kernels import decode_components  # imports triton: only where it runs
    o, lse = decode_components(qc, bias, k_codes, v_codes, keys, values, n_coded, kv_start, scale)
    return values_out(o, lse, values), lse


def choose_decode(
    qc: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, keys: TrellisOperands, values: TrellisOperands
) -> str:
    """``"cuda"`` or ``"triton"`` for a trellis decode on CUDA tensors (shapes only; may compile the
    CUDA kernel once), under :mod:`.kernel_request`'s request."""
    if requested() == "triton":
        return "triton"
    reason, level = cuda_trellis_decode.unsupported_reason(qc, k_codes, v_codes, keys, values), logging.INFO
    if reason is None:  # the inputs fit: a failure to build is the machine's, worth a warning
        reason, level = cuda_trellis_decode.build_error(qc, k_codes, v_codes, keys, values), logging.WARNING
    if reason is None:
        return "cuda"
    fall_back(
        reason, level, "trellis decode attention runs the Triton kernel", "the CUDA trellis decode kernel cannot run"
    )
    return "triton"


def decode_step(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    kv_start: torch.Tensor | None,
    scale: float,
    keys: TrellisOperands,
    values: TrellisOperands,
) -> torch.Tensor:
    """One query token ``q: [B, Hq, 1, D]`` (in ``K~``'s domain) over a layer: the ``n_coded`` coded
    slots by :func:`decode_attention`, the window's ``n_window`` slots (``k_window, v_window [B, Hkv,
    R, D]``) exactly, merged by log-sum-exp; slots before ``kv_start [B]`` (left padding) hidden.
    The counters are 0-d tensors, read on the device. Returns ``[B, Hq, 1, D]`` in ``q``'s dtype."""
    b, hq, _, d = q.shape
    hkv = k_codes.shape[1]
    qf = q[:, :, 0].float()
    out_c, lse_c = decode_attention(qf, k_codes, v_codes, keys, values, n_coded, kv_start, scale)
    kw, vw = k_window.float(), v_window.float()
    scores = torch.einsum("bhgd,bhtd->bhgt", qf.view(b, hkv, hq // hkv, d), kw) * scale
    slot = torch.arange(kw.shape[2], device=q.device)
    hidden = slot >= n_window
    if kv_start is not None:
        hidden = hidden | (n_coded + slot < kv_start.to(q.device)[:, None, None, None])
    scores = scores.masked_fill(hidden, float("-inf"))
    lse_w = torch.logsumexp(scores, -1)
    p = torch.where(torch.isfinite(lse_w)[..., None], torch.exp(scores - lse_w[..., None]), 0.0)
    out_w = torch.einsum("bhgt,bhtd->bhgd", p, vw).reshape(b, hq, d)
    return merge_by_lse(out_c, lse_c, out_w, lse_w.reshape(b, hq), q.dtype)[:, :, None]
