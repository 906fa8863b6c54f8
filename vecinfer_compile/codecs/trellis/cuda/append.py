"""The decode step's append to a trellis-coded layer in one CUDA launch (``trellis_append.cu``,
NVRTC, after ``block_walk.cuh``): the token leaving the window coded (the codec's KLT in float64,
then the CTA-a-vector walk), the window shift, the new token, the counters; the keys' and the
values' walks side by side, one CTA each a (row, KV head).

The contract is :func:`vecinfer_compile.ops.append.append_through_window`'s for one new token with
the codec's encode (:func:`vecinfer_compile.codecs.trellis.operands.encode`): the same codes, window and
counters (slots at or past ``Tmax`` are not written). Compiled once per process and variant;
launched on torch's current stream; reads the counters on the device only (CUDA graphs capture it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ....ops.cuda.append import require_buffer, require_counters
from ....ops.cuda.nvrtc import CudaBuildError, build_kernel, device_index, unfit_device_reason, with_half_bits
from .viterbi import MIN_ARCH, BlockViterbiVariant, block_walk_unfit_reason, with_block_walk

SOURCE = Path(__file__).with_name("append.cu")
WINDOW_DTYPES = (torch.bfloat16, torch.float16)


def source() -> str:
    """The kernel's NVRTC source: ``half_bits.cuh``, the walk (``string_bits.cuh``,
    ``block_walk.cuh``), then ``trellis_append.cu``."""
    return with_half_bits(with_block_walk(SOURCE))


@dataclass(frozen=True)
class TrellisAppendVariant:
    """One compiled specialisation: the walk's (``2^state_bits`` states, ``head_dim``, steps of at
    most ``widest`` bits over both codecs) and the windows' dtype."""

    walk: BlockViterbiVariant
    fp16: bool

    def defines(self) -> list[str]:
        return [*self.walk.defines(), f"-DFP16={int(self.fp16)}"]


def variant_for(kt: torch.Tensor, keys, values) -> TrellisAppendVariant:
    """The variant for the new keys ``kt [B, H, 1, D]`` and the two codecs' operands
    (:class:`~vecinfer_compile.codecs.trellis.operands.TrellisOperands`)."""
    widest = max(int(keys.tables.shape[1]), int(values.tables.shape[1]))
    state_bits = int(keys.tables.shape[-1]).bit_length() - 1
    return TrellisAppendVariant(BlockViterbiVariant(state_bits, int(kt.shape[-1]), widest), kt.dtype == torch.float16)


def unsupported_reason(kt: torch.Tensor, k_window: torch.Tensor, keys, values) -> str | None:
    """Why the kernel cannot run this append (None if it can); building is :func:`build_error`'s.
    Reads shapes only (no host sync), so it works on fake tensors."""
    reason = unfit_device_reason(
        kt,
        WINDOW_DTYPES,
        "the window holds {dtype}, not bfloat16 or float16",
        "the CUDA trellis append",
        MIN_ARCH,
        subject="the new tokens are",
    )
    if reason is not None:
        return reason
    if int(kt.shape[2]) != 1:
        return f"{int(kt.shape[2])} new tokens (the kernel appends one)"
    k_states, v_states = int(keys.tables.shape[-1]), int(values.tables.shape[-1])
    if k_states != v_states:
        return f"keys of {k_states} states and values of {v_states} (the kernel walks one trellis size)"
    if int(kt.shape[-1]) % 8:
        return f"head_dim {int(kt.shape[-1])} (the window moves in 16-byte pieces: a multiple of 8)"
    if k_window.dtype != kt.dtype:
        return f"the new keys are {kt.dtype} but the window holds {k_window.dtype}"
    return block_walk_unfit_reason(variant_for(kt, keys, values).walk)


@functools.cache
def _build(variant: TrellisAppendVariant, device_index: int):
    kernel = build_kernel(
        source(), "trellis_append", torch.device("cuda", device_index), ["--std=c++17", *variant.defines()]
    )
    kernel.set_dynamic_smem(variant.walk.smem_bytes)
    return kernel


def build_error(kt: torch.Tensor, keys, values) -> str | None:
    """None if this append's kernel compiles and loads (compiling it as a side effect: call it
    before tracing, never inside a CUDA-graph capture), else why not."""
    try:
        _build(variant_for(kt, keys, values), device_index(kt.device))
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    return None


def trellis_append_cuda(
    kt: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_coded: torch.Tensor,
    n_window: torch.Tensor,
    arrivals: torch.Tensor,
    keys,
    values,
) -> None:
    """Append one token: ``kt`` (its key as ``K~``) and ``value`` ``[B, H, 1, D]`` in the windows'
    dtype (bf16/fp16); ``k_codes [B, H, Tmax, Wk]``, ``v_codes [B, H, Tmax, Wv]`` uint8 (each
    codec's string bytes); windows ``[B, H, R, D]``; ``n_coded``/``n_window`` 0-d int64;
    ``arrivals`` int32 ``[1]``, zero (left zero); ``keys``/``values`` the codecs'
    :class:`~vecinfer_compile.codecs.trellis.operands.TrellisOperands` on this device. Updates the buffers in
    place; raises :class:`CudaBuildError` when the inputs or the machine do not fit the kernel."""
    reason = unsupported_reason(kt, k_window, keys, values)
    if reason is not None:
        raise CudaBuildError(f"the CUDA trellis append cannot run this call: {reason}")
    b, h, _, d = kt.shape
    for t, name in ((value, "value"), (v_window, "v_window")):
        if t.dtype != kt.dtype or t.shape[-1] != d:
            raise ValueError(
                f"{name} is {t.dtype} {tuple(t.shape)}; the CUDA trellis append needs {kt.dtype} [..., {d}]"
            )
    require_counters(n_coded, n_window, arrivals)
    for codes, name in ((k_codes, "k_codes"), (v_codes, "v_codes")):
        if codes.dtype != torch.uint8 or tuple(codes.shape[:2]) != (b, h) or codes.shape[2] != k_codes.shape[2]:
            raise ValueError(
                f"{name} ({codes.dtype}, {tuple(codes.shape)}) are not [{b}, {h}, Tmax, bytes] uint8 codes"
            )
    for t, name in ((k_codes, "k_codes"), (v_codes, "v_codes"), (k_window, "k_window"), (v_window, "v_window")):
        require_buffer(t, name)
    variant = variant_for(kt, keys, values)
    kernel = _build(variant, device_index(kt.device))
    sides = [
        [
            ops.center.double().contiguous(),
            ops.analysis.double().contiguous(),
            ops.inverse_sd.double().contiguous(),
            ops.bits.int().contiguous(),
            ops.tables.float().contiguous(),
        ]
        for ops in (keys, values)
    ]
    kernel.launch(
        (b * h, 2, 1),
        (variant.walk.threads, 1, 1),
        [
            kt.contiguous(),
            value.contiguous(),
            k_codes,
            v_codes,
            k_window,
            v_window,
            n_coded,
            n_window,
            arrivals,
            *sides[0],
            *sides[1],
            h,
            k_codes.shape[2],
            k_window.shape[2],
            k_codes.shape[-1],
            v_codes.shape[-1],
            int(keys.tables.shape[1]),
            int(values.tables.shape[1]),
        ],
    )
