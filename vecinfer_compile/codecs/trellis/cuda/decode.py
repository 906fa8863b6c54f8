"""CUDA decode attention over trellis codes, in the components (NVRTC; ``trellis_decode.cu``).

Same contract as :func:`..triton.trellis.decode_components`, which it replaces on CUDA where it
supports the inputs and builds (:func:`vecinfer_compile.codecs.trellis.operands.decode_attention` chooses).
Triton cannot put the codec's tables in shared memory, so its kernel gathers every component's
entry through L1; this one loads a KV head's key and value tables into shared memory once a CTA
and gathers from there, reading each key row's string front to back through a sliding window.
Compiled once per process and variant; launched on torch's current stream (CUDA graphs capture
it); ``n_coded`` may be a 0-d int64 tensor read on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ....ops.cuda.nvrtc import CudaBuildError, build_kernel, device_index, sm_count, unfit_device_reason
from ....ops.split_attention.lse_merge import LOG2E, merge_splits

SOURCE = Path(__file__).with_name("decode.cu")
MIN_ARCH = 80
THREADS = 256  # tokens a tile and threads a CTA
MAX_GROUP = 16  # query heads a KV head (registers: a thread holds each head's score and accumulators)
SMEM_LIMIT = 200 * 1024
CTAS_PER_SM = 8  # splits fill about this many CTAs an SM (several waves: the tiles' barriers idle an SM)
MIN_SPLIT = 256  # tokens a split takes at least: a CTA loads its head's tables once


@dataclass(frozen=True)
class TrellisDecodeVariant:
    """One compiled specialisation: ``head_dim``, ``group`` query heads a KV head, ``2^state_bits``
    states, table widths ``key_widths`` / ``value_widths``, code row bytes ``key_bytes`` / ``value_bytes``."""

    head_dim: int
    group: int
    state_bits: int
    key_widths: int
    value_widths: int
    key_bytes: int
    value_bytes: int

    @property
    def padded_group(self) -> int:
        return max(16, 1 << (self.group - 1).bit_length())

    @property
    def value_groups(self) -> int:
        """Token groups of the value phase (each writes its partial sums as a split of its own)."""
        return max(1, THREADS // self.head_dim)

    @property
    def smem_bytes(self) -> int:
        rows = ((self.key_bytes // 4 + 1) | 1) + ((self.value_bytes // 4 + 1) | 1)
        g, d = self.group, self.head_dim
        return 4 * (
            (self.key_widths + self.value_widths) * (1 << self.state_bits)
            + g * d
            + g * THREADS
            + 2 * g * (THREADS // 32)
            + d
            + THREADS * rows
        )

    def defines(self) -> list[str]:
        return [
            f"-DD={self.head_dim}",
            f"-DG={self.group}",
            f"-DBG={self.padded_group}",
            f"-DL={self.state_bits}",
            f"-DWK={self.key_widths}",
            f"-DWV={self.value_widths}",
            f"-DNBK={self.key_bytes}",
            f"-DNBV={self.value_bytes}",
            f"-DNTHREADS={THREADS}",
        ]


def variant_for(qc: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, keys, values) -> TrellisDecodeVariant:
    return TrellisDecodeVariant(
        int(qc.shape[-1]),
        int(qc.shape[1]) // int(k_codes.shape[1]),
        int(keys.tables.shape[-1]).bit_length() - 1,
        int(keys.tables.shape[1]),
        int(values.tables.shape[1]),
        int(k_codes.shape[-1]),
        int(v_codes.shape[-1]),
    )


def unsupported_reason(qc: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, keys, values) -> str | None:
    """Why the CUDA kernel cannot run this call (None if it can); building is :func:`build_error`'s.
    Reads shapes, strides and pointers only (no host sync)."""
    reason = unfit_device_reason(
        qc,
        (torch.float32,),
        "the query components are {dtype}, not float32",
        "the CUDA trellis decode kernel",
        MIN_ARCH,
        subject="the queries are",
    )
    if reason is not None:
        return reason
    if keys.tables.shape[-1] != values.tables.shape[-1]:
        return "the key and value codecs have different state counts"
    v = variant_for(qc, k_codes, v_codes, keys, values)
    if v.group > MAX_GROUP:
        return f"{v.group} query heads a KV head (at most {MAX_GROUP})"
    if v.head_dim % 4:
        return f"head_dim {v.head_dim} is not a multiple of 4"
    for codes, what in ((k_codes, "key"), (v_codes, "value")):
        if codes.stride(-1) != 1 or any(s % 4 for s in codes.stride()[:3]) or codes.data_ptr() % 4:
            return (
                f"the {what} code rows are not 4-byte aligned ({codes.shape[-1]} bytes a row, strides {codes.stride()})"
            )
    if v.smem_bytes > SMEM_LIMIT:
        return f"the tables need {v.smem_bytes} bytes of shared memory (at most {SMEM_LIMIT})"
    return None


@functools.cache
def _build(variant: TrellisDecodeVariant, device_index: int):
    kernel = build_kernel(
        SOURCE.read_text(), "trellis_decode", torch.device("cuda", device_index), ["--std=c++17", *variant.defines()]
    )
    kernel.set_dynamic_smem(variant.smem_bytes)
    return kernel


def build_error(qc, k_codes, v_codes, keys, values) -> str | None:
    """None if this call's variant compiles and loads (compiling it as a side effect), else why not."""
    try:
        _build(variant_for(qc, k_codes, v_codes, keys, values), device_index(qc.device))
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    return None


def decode_components_cuda(
    qc: torch.Tensor,
    bias: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    keys,
    values,
    n_coded,
    kv_start: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`..triton.trellis.decode_components`' contract (``qc [B, Hq, D]``, ``bias [B, Hq]``
    float32; codes ``[B, Hkv, Tmax, nbytes]`` uint8; ``n_coded`` an int or a 0-d tensor) ->
    ``(o [B, Hq, D], lse [B, Hq])`` float32. Raises :class:`CudaBuildError` when it cannot run."""
    reason = unsupported_reason(qc, k_codes, v_codes, keys, values)
    if reason is not None:
        raise CudaBuildError(f"the CUDA trellis decode kernel cannot run this call: {reason}")
    b, hq, d = qc.shape
    hkv = k_codes.shape[1]
    variant = variant_for(qc, k_codes, v_codes, keys, values)
    kernel = _build(variant, device_index(qc.device))
    on_device = isinstance(n_coded, torch.Tensor)
    span = k_codes.shape[2] if on_device else max(n_coded, 1)
    splits = max(1, min(-(-span // MIN_SPLIT), CTAS_PER_SM * sm_count(device_index(qc.device)) // max(1, b * hkv)))
    per_split = -(-span // splits)  # ceiling divisions
    split_len = -(-per_split // THREADS) * THREADS
    bg, groups = variant.padded_group, variant.value_groups
    acc = torch.empty(b * hkv, splits * groups, bg, d, dtype=torch.float32, device=qc.device)
    m = torch.empty(b * hkv, splits * groups, bg, dtype=torch.float32, device=qc.device)
    l_sum = torch.empty_like(m)
    start = kv_start.to(device=qc.device, dtype=torch.int32).contiguous() if kv_start is not None else None
    n_arg = n_coded.to(device=qc.device, dtype=torch.int64) if on_device else None
    kernel.launch(
        (b * hkv, splits, 1),
        (THREADS, 1, 1),
        [
            qc.contiguous(),
            bias.float().contiguous(),
            k_codes,
            v_codes,
            keys.first,
            keys.shift,
            keys.mask,
            keys.rows,
            keys.tables,
            values.first,
            values.shift,
            values.mask,
            values.rows,
            values.tables,
            start,
            n_arg,
            acc,
            m,
            l_sum,
            0 if on_device else int(n_coded),
            hkv,
            split_len,
            scale * LOG2E,
            *k_codes.stride()[:3],
            *v_codes.stride()[:3],
        ],
    )
    o, lse = merge_splits(acc, m, l_sum, variant.group)
    return o.reshape(b, hq, d), lse.reshape(b, hq)
