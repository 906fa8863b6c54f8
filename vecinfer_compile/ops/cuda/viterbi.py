"""CUDA encoder of the trellis codec: the Viterbi walk of every vector, one warp a vector, written in
the stored layout (NVRTC).

Same contract as :func:`..triton.trellis.viterbi_codes`. The walk's steps are sequential, so one
vector's latency is the cost of its ~100 steps. The Triton program keeps the path costs in
registers but moves them through the compiler's cross-thread reductions and global memory every
step; this kernel (``viterbi.cu``) keeps them in one warp's registers, exchanges them by shuffles,
and keeps the trace as ballots in shared memory (no block barrier). On the H200 its codes equal
Triton's; one vector's walk takes about as long (1 and 8 vectors a head: 104 us against 95), many
are 3.4-3.7x faster (256 and 2,048 vectors a head: a prefill), so the ops take it from
:data:`MIN_VECTORS` vectors on (:mod:`vecinfer_compile.ops.viterbi`). Compiled once per process
and variant; launched on torch's current stream, no host sync (``nbytes`` given).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...quant.trellis_packing import packed_bytes
from .nvrtc import CudaBuildError, build_kernel, device_index, unfit_device_reason

SOURCE = Path(__file__).with_name("viterbi.cu")
MIN_ARCH = 80
MIN_STATE_BITS = 5  # a lane holds 2^L / 32 costs
MAX_STATE_BITS = 10  # 32 costs a lane (2^12 states spill the registers: slower than Triton's on the H200)
SMEM_LIMIT = 40 * 1024  # static shared memory of a block (its warps' traces and strings)
MAX_WARPS = 4
MIN_VECTORS = 256  # fewer vectors a head run Triton's kernel (measured faster at 1 and 8 on the H200)


def trace_words(state_bits: int, k: int) -> int:
    """32-bit words of one ``k``-bit step's trace: ``k`` ballots for each 32 of its ``2^(L-k)`` prefixes."""
    prefixes = (1 << state_bits) >> k
    return k * max(prefixes // 32, 1)


@dataclass(frozen=True)
class ViterbiVariant:
    """One compiled specialisation: ``2^state_bits`` states, ``head_dim`` components a vector,
    steps of at most ``widest`` bits."""

    state_bits: int
    head_dim: int
    widest: int

    @property
    def trace_words(self) -> int:
        return self.head_dim * max(trace_words(self.state_bits, k) for k in range(1, self.widest + 1))

    @property
    def max_bytes(self) -> int:
        return (self.head_dim * self.state_bits + 7) // 8

    @property
    def warp_smem(self) -> int:
        return 4 * (self.trace_words + (self.max_bytes + 3) // 4)

    @property
    def warps(self) -> int:
        return max(1, min(MAX_WARPS, SMEM_LIMIT // self.warp_smem))

    def defines(self) -> list[str]:
        return [f"-DL={self.state_bits}", f"-DD={self.head_dim}", f"-DMAXK={self.widest}",
                f"-DMAXB={self.max_bytes}", f"-DWPB={self.warps}", f"-DTW={self.trace_words}"]


def variant_for(unit: torch.Tensor, tables: torch.Tensor) -> ViterbiVariant:
    return ViterbiVariant(int(tables.shape[-1]).bit_length() - 1, int(unit.shape[-1]), int(tables.shape[1]))


def unsupported_reason(unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor) -> str | None:
    """Why the CUDA encoder cannot run this call (None if it can); building is :func:`build_error`'s.
    Reads shapes only (no host sync)."""
    reason = unfit_device_reason(unit, (torch.float32,), "the components are {dtype}, not float32",
                                 "the CUDA trellis encoder", MIN_ARCH, subject="the components are")
    if reason is not None:
        return reason
    variant = variant_for(unit, tables)
    if not MIN_STATE_BITS <= variant.state_bits <= MAX_STATE_BITS:
        return f"2^{variant.state_bits} states (the warp kernel takes 2^{MIN_STATE_BITS} to 2^{MAX_STATE_BITS})"
    if variant.warp_smem > SMEM_LIMIT:
        return (f"2^{variant.state_bits} states at head_dim {variant.head_dim}: a vector's trace needs "
                f"{variant.warp_smem} bytes of shared memory (at most {SMEM_LIMIT})")
    return None


@functools.cache
def _build(variant: ViterbiVariant, device_index: int):
    return build_kernel(SOURCE.read_text(), "trellis_viterbi_warp", torch.device("cuda", device_index),
                        ["--std=c++17", *variant.defines()])


def build_error(unit: torch.Tensor, tables: torch.Tensor) -> str | None:
    """None if this call's variant compiles and loads (compiling it as a side effect), else why not."""
    try:
        _build(variant_for(unit, tables), device_index(unit.device))
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    return None


def viterbi_codes_cuda(unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor,
                       nbytes: int | None = None) -> torch.Tensor:
    """Stored codes ``[N, H, nbytes]`` uint8 of the least-squared-error walks of ``unit [N, H, D]``
    float32 (unit-scale components; ``bits [H, D]`` integer bits a component, 0: not coded;
    ``tables [H, W, 2^L]`` float32, row ``k - 1`` the ``k``-bit table), as
    :func:`..triton.trellis.viterbi_codes` writes them. ``nbytes`` None reads it off ``bits`` (a
    host sync). Raises :class:`CudaBuildError` when the kernel cannot run it."""
    reason = unsupported_reason(unit, bits, tables)
    if reason is not None:
        raise CudaBuildError(f"the CUDA trellis encoder cannot run this call: {reason}")
    n, h, d = unit.shape
    lbits = int(tables.shape[-1]).bit_length() - 1 if tables.dim() == 3 else 0
    if bits.shape != (h, d) or tables.dim() != 3 or tables.shape[0] != h or tables.shape[1] > lbits:
        raise ValueError(f"unit [N, H, D], bits [H, D], tables [H, W, 2^L] with W <= L: got {tuple(unit.shape)}, "
                         f"{tuple(bits.shape)}, {tuple(tables.shape)}")
    nbytes = packed_bytes(bits) if nbytes is None else nbytes
    out = torch.empty(n, h, nbytes, dtype=torch.uint8, device=unit.device)
    if n == 0:
        return out
    variant = variant_for(unit, tables)
    kernel = _build(variant, device_index(unit.device))
    kernel.launch((-(-n // variant.warps), h, 1), (32 * variant.warps, 1, 1),
                  [unit.contiguous(), bits.to(device=unit.device, dtype=torch.int32).contiguous(),
                   tables.to(device=unit.device, dtype=torch.float32).contiguous(), out, n, h,
                   int(tables.shape[1]), nbytes])
    return out
