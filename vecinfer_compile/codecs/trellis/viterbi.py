"""Which kernel walks the trellis codec's Viterbi on CUDA: :func:`.cuda.viterbi.viterbi_codes_cuda`
(one CTA a vector for a decode step's few vectors, one warp a vector for a prefill's many) where it
supports the inputs and builds, else :func:`.triton.trellis.viterbi_codes`. The request of
:mod:`.kernel_request` applies: ``"triton"`` runs no CUDA kernel, ``"cuda"`` raises instead of
falling back; one log line per reason."""

from __future__ import annotations

import logging

import torch

from ...ops.kernel_request import fall_back, requested
from .cuda import viterbi as cuda_viterbi
from .triton_kernels import viterbi_codes


def choose_viterbi(unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor) -> str:
    """``"cuda"`` or ``"triton"`` for these CUDA inputs ``unit [N, H, D]`` (shapes only; may compile
    the kernel once)."""
    request = requested()
    if request == "triton":
        return "triton"
    reason = cuda_viterbi.unsupported_reason(unit, bits, tables) or cuda_viterbi.build_error(unit, tables)
    if reason is None:
        return "cuda"
    fall_back(
        reason, logging.INFO, "the trellis encoder runs the Triton kernel", "the trellis encoder cannot run on CUDA"
    )
    return "triton"


def viterbi_codes_gpu(
    unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor, nbytes: int | None = None
) -> torch.Tensor:
    """Stored codes ``[N, H, nbytes]`` uint8 of the least-squared-error walks of ``unit [N, H, D]``
    on CUDA (:func:`.triton.trellis.viterbi_codes`' contract), by the kernel :func:`choose_viterbi` picks."""
    if choose_viterbi(unit, bits, tables) == "cuda":
        return cuda_viterbi.viterbi_codes_cuda(unit.float(), bits, tables, nbytes)
    return viterbi_codes(unit, bits, tables, nbytes=nbytes)
