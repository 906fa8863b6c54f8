"""CUDA encoder of the trellis codec: the Viterbi walk of every vector, written in the stored layout (NVRTC).

Same contract as :func:`..triton.trellis.viterbi_codes`, which it replaces on CUDA where it builds.
The Triton program keeps the path costs in registers, and its min over a step's predecessors and
its trace go through the compiler's cross-thread reductions and global memory; one token's keys
took about 260 us a layer on the H100 (``bench_append.py``), the walk's 100-odd sequential steps
at about 2 us each. This kernel (``viterbi.cu``) keeps the costs and the whole trace in shared
memory, two barriers a step, and walks back from shared memory. Compiled once per process and
variant (state bits, head_dim); launched on torch's current stream, no host sync (``nbytes`` given).
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
MAX_THREADS = 512
SMEM_LIMIT = 200 * 1024  # the trace's D * 2^(L-1) bytes and the costs must fit one CTA's shared memory


@dataclass(frozen=True)
class ViterbiVariant:
    """One compiled specialisation: ``2^state_bits`` states, ``head_dim`` components a vector,
    ``wide``: a step may take more than 8 bits (a 16-bit trace)."""

    state_bits: int
    head_dim: int
    wide: bool

    @property
    def threads(self) -> int:
        return min(max((1 << self.state_bits) // 2, 32), MAX_THREADS)

    @property
    def max_bytes(self) -> int:
        return (self.head_dim * self.state_bits + 7) // 8

    @property
    def smem_bytes(self) -> int:
        s, d = 1 << self.state_bits, self.head_dim
        return 4 * (2 * s + s // 2 + 2 * d) + -(-self.max_bytes // 16) * 16 + d * s // 2 * (2 if self.wide else 1)

    def defines(self) -> list[str]:
        return [f"-DL={self.state_bits}", f"-DD={self.head_dim}", f"-DNTHREADS={self.threads}",
                f"-DMAXB={self.max_bytes}", f"-DWIDE={int(self.wide)}"]


def variant_for(unit: torch.Tensor, tables: torch.Tensor) -> ViterbiVariant:
    return ViterbiVariant(int(tables.shape[-1]).bit_length() - 1, int(unit.shape[-1]), int(tables.shape[1]) > 8)


def unsupported_reason(unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor) -> str | None:
    """Why the CUDA encoder cannot run this call (None if it can); building is :func:`build_error`'s.
    Reads shapes only (no host sync)."""
    reason = unfit_device_reason(unit, (torch.float32,), "the components are {dtype}, not float32",
                                 "the CUDA trellis encoder", MIN_ARCH, subject="the components are")
    if reason is not None:
        return reason
    variant = variant_for(unit, tables)
    if variant.smem_bytes > SMEM_LIMIT:
        return (f"2^{variant.state_bits} states at head_dim {variant.head_dim}: the trace needs "
                f"{variant.smem_bytes} bytes of shared memory (at most {SMEM_LIMIT})")
    return None


@functools.cache
def _build(variant: ViterbiVariant, device_index: int):
    kernel = build_kernel(SOURCE.read_text(), "trellis_viterbi", torch.device("cuda", device_index),
                          ["--std=c++17", *variant.defines()])
    kernel.set_dynamic_smem(variant.smem_bytes)
    return kernel


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
    ``tables [H, W, 2^L]`` float32), as :func:`..triton.trellis.viterbi_codes` writes them.
    ``nbytes`` None reads it off ``bits`` (a host sync). Raises :class:`CudaBuildError` when the
    kernel cannot run it."""
    reason = unsupported_reason(unit, bits, tables)
    if reason is not None:
        raise CudaBuildError(f"the CUDA trellis encoder cannot run this call: {reason}")
    n, h, d = unit.shape
    widest = int(tables.shape[2]).bit_length() - 1 if tables.dim() == 3 else 0
    if bits.shape != (h, d) or tables.dim() != 3 or tables.shape[0] != h or tables.shape[1] > widest:
        raise ValueError(f"unit [N, H, D], bits [H, D], tables [H, W, 2^L] with W <= L: got {tuple(unit.shape)}, "
                         f"{tuple(bits.shape)}, {tuple(tables.shape)}")
    nbytes = packed_bytes(bits) if nbytes is None else nbytes
    out = torch.empty(n, h, nbytes, dtype=torch.uint8, device=unit.device)
    if n == 0:
        return out
    variant = variant_for(unit, tables)
    kernel = _build(variant, device_index(unit.device))
    kernel.launch((n, h, 1), (variant.threads, 1, 1),
                  [unit.contiguous(), bits.to(device=unit.device, dtype=torch.int32).contiguous(),
                   tables.to(device=unit.device, dtype=torch.float32).contiguous(), out, h, int(tables.shape[1]),
                   nbytes])
    return out
