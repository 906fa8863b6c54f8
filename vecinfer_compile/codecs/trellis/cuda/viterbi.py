"""CUDA encoders of the trellis codec: the Viterbi walk of every vector, written in the stored
layout (NVRTC), with :func:`..triton.trellis.viterbi_codes`' contract.

A walk's steps are sequential, so a vector's latency is its ~100 steps. Two kernels:

- ``viterbi_block.cu``, one CTA a vector (the walk itself in ``block_walk.cuh``, which the decode
  step's append kernel shares): the 2^L path costs in shared memory, up to 512 threads a CTA with
  a state or a few each (512 measured faster than 1,024), a barrier a step. Few vectors (a decode
  step's one token a head) finish sooner than in a warp or in Triton's kernel
  (``benchmarks/bench_viterbi.py``; see docs/results/decode-speed.md).
- ``viterbi.cu``, one warp a vector: the costs in the warp's registers, exchanged by shuffles, the
  trace as ballots in shared memory (no block barrier). A vector takes longer than in a CTA but
  uses a 32nd of its threads, so many vectors (a prefill) go faster; it holds up to 2^10 states.

:func:`viterbi_codes_cuda` runs the block kernel while it puts at most two CTAs on an SM (a
decode step's append, short chunks), the warp kernel from there (:func:`warp_from`). Compiled once
per process and variant; launched on torch's current stream, no host sync (``nbytes`` given).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ....ops.cuda.nvrtc import CudaBuildError, build_kernel, device_index, sm_count, unfit_device_reason
from ..packing import packed_bytes

SOURCE = Path(__file__).with_name("viterbi.cu")
STRING_BITS = Path(__file__).with_name("string_bits.cuh")
BLOCK_WALK = Path(__file__).with_name("block_walk.cuh")
BLOCK_SOURCE = Path(__file__).with_name("viterbi_block.cu")
MIN_ARCH = 80
MIN_STATE_BITS = 5  # the warp kernel: a lane holds 2^L / 32 costs; the block kernel: a warp's states
MAX_STATE_BITS = 10  # the warp kernel: 32 costs a lane (2^12 states spill the registers)
MAX_BLOCK_STATE_BITS = 11  # the block kernel: its trace (at most 2^(L-1) bytes a step) in shared memory
SMEM_LIMIT = 40 * 1024  # static shared memory of a warp kernel's block (its warps' traces and strings)
BLOCK_SMEM_LIMIT = 200 * 1024  # dynamic shared memory of the block kernel's CTA
MAX_WARPS = 4
BLOCK_CTAS_AN_SM = 2  # the block kernel's CTAs (one a vector) an SM runs before the warp kernel is faster: its
# time grows with the CTAs on the busiest SM while the warp kernel's stays flat up to 512 vectors
# (bench_viterbi.py --kernel block / warp; see docs/studies/trellis-kernels.md)
REFERENCE_SMS = 132  # the H100's and H200's, for a choice asked about tensors on no GPU


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
        return [
            f"-DL={self.state_bits}",
            f"-DD={self.head_dim}",
            f"-DMAXK={self.widest}",
            f"-DMAXB={self.max_bytes}",
            f"-DWPB={self.warps}",
            f"-DTW={self.trace_words}",
        ]


@dataclass(frozen=True)
class BlockViterbiVariant:
    """The block kernel's specialisation: ``2^state_bits`` states, ``head_dim`` components a
    vector, steps of at most ``widest`` bits."""

    state_bits: int
    head_dim: int
    widest: int

    @property
    def threads(self) -> int:
        return min(1 << self.state_bits, 512)

    @property
    def max_bytes(self) -> int:
        return (self.head_dim * self.state_bits + 7) // 8

    @property
    def smem_bytes(self) -> int:
        """The walk's dynamic shared memory (``WALK_SMEM_BYTES`` of ``block_walk.cuh``): two cost
        buffers, the final reduction, the string, each step's bits, and the trace: a byte for each
        of a step's 2^(L-k) prefixes (two above 8 bits), at most 2^(L-1) a step."""
        states = 1 << self.state_bits
        words = 2 * states + 2 * (self.threads // 32) + (self.max_bytes + 3) // 4 + self.head_dim
        return 4 * words + self.head_dim * states // 2

    def defines(self) -> list[str]:
        return [
            f"-DL={self.state_bits}",
            f"-DD={self.head_dim}",
            f"-DMAXK={self.widest}",
            f"-DMAXB={self.max_bytes}",
            f"-DBT={self.threads}",
        ]


def warp_source() -> str:
    """The warp kernel's source, after the string writer it calls."""
    return STRING_BITS.read_text() + SOURCE.read_text()


def with_block_walk(kernel_source: Path) -> str:
    """The source of a kernel that calls ``block_walk`` (``kernel_source``), after the walk's own."""
    return STRING_BITS.read_text() + BLOCK_WALK.read_text() + kernel_source.read_text()


def variant_for(unit: torch.Tensor, tables: torch.Tensor) -> ViterbiVariant:
    return ViterbiVariant(int(tables.shape[-1]).bit_length() - 1, int(unit.shape[-1]), int(tables.shape[1]))


def block_variant_for(unit: torch.Tensor, tables: torch.Tensor) -> BlockViterbiVariant:
    return BlockViterbiVariant(int(tables.shape[-1]).bit_length() - 1, int(unit.shape[-1]), int(tables.shape[1]))


def warp_from(heads: int, sms: int) -> int:
    """Vectors a head from which the warp kernel runs on a GPU of ``sms`` SMs: where the block kernel
    (a CTA a vector) would put more than :data:`BLOCK_CTAS_AN_SM` CTAs on one of them."""
    return BLOCK_CTAS_AN_SM * sms // heads + 1


def kernel_for(unit: torch.Tensor, tables: torch.Tensor) -> str:
    """``"warp"`` or ``"block"``: the kernel :func:`viterbi_codes_cuda` runs for ``unit [N, H, D]``
    (the warp kernel from :func:`warp_from` vectors a head where it takes the states)."""
    warp_fits = MIN_STATE_BITS <= variant_for(unit, tables).state_bits <= MAX_STATE_BITS
    sms = sm_count(device_index(unit.device)) if unit.is_cuda else REFERENCE_SMS
    return "warp" if warp_fits and unit.shape[0] >= warp_from(unit.shape[1], sms) else "block"


def unsupported_reason(
    unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor, kernel: str | None = None
) -> str | None:
    """Why the CUDA encoder (``kernel``: ``"block"``, ``"warp"``, None for :func:`kernel_for`'s)
    cannot run this call (None if it can); building is :func:`build_error`'s. Reads shapes only (no
    host sync)."""
    reason = unfit_device_reason(
        unit,
        (torch.float32,),
        "the components are {dtype}, not float32",
        "the CUDA trellis encoder",
        MIN_ARCH,
        subject="the components are",
    )
    if reason is not None:
        return reason
    if (kernel or kernel_for(unit, tables)) == "warp":
        variant = variant_for(unit, tables)
        if not MIN_STATE_BITS <= variant.state_bits <= MAX_STATE_BITS:
            return f"2^{variant.state_bits} states (the warp kernel takes 2^{MIN_STATE_BITS} to 2^{MAX_STATE_BITS})"
        if variant.warp_smem > SMEM_LIMIT:
            return (
                f"2^{variant.state_bits} states at head_dim {variant.head_dim}: a vector's trace needs "
                f"{variant.warp_smem} bytes of shared memory (at most {SMEM_LIMIT})"
            )
        return None
    return block_walk_unfit_reason(block_variant_for(unit, tables))


def block_walk_unfit_reason(block: BlockViterbiVariant) -> str | None:
    """Why ``block_walk.cuh`` cannot walk this specialisation (its states, its shared memory), or
    None; the block kernel's and the decode-step append's check."""
    if not MIN_STATE_BITS <= block.state_bits <= MAX_BLOCK_STATE_BITS:
        return f"2^{block.state_bits} states (the CUDA encoder takes 2^{MIN_STATE_BITS} to 2^{MAX_BLOCK_STATE_BITS})"
    if block.smem_bytes > BLOCK_SMEM_LIMIT:
        return (
            f"2^{block.state_bits} states at head_dim {block.head_dim}: a vector's trace needs "
            f"{block.smem_bytes} bytes of shared memory (at most {BLOCK_SMEM_LIMIT})"
        )
    return None


@functools.cache
def _build(variant: ViterbiVariant | BlockViterbiVariant, device_index: int):
    block = isinstance(variant, BlockViterbiVariant)
    kernel = build_kernel(
        with_block_walk(BLOCK_SOURCE) if block else warp_source(),
        "trellis_viterbi_block" if block else "trellis_viterbi_warp",
        torch.device("cuda", device_index),
        ["--std=c++17", *variant.defines()],
    )
    if block:
        kernel.set_dynamic_smem(variant.smem_bytes)
    return kernel


def _variant(
    unit: torch.Tensor, tables: torch.Tensor, kernel: str | None = None
) -> ViterbiVariant | BlockViterbiVariant:
    return (variant_for if (kernel or kernel_for(unit, tables)) == "warp" else block_variant_for)(unit, tables)


def build_error(unit: torch.Tensor, tables: torch.Tensor) -> str | None:
    """None if this call's kernel compiles and loads (compiling it as a side effect), else why not."""
    try:
        _build(_variant(unit, tables), device_index(unit.device))
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    return None


def viterbi_codes_cuda(
    unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor, nbytes: int | None = None, kernel: str | None = None
) -> torch.Tensor:
    """Stored codes ``[N, H, nbytes]`` uint8 of the least-squared-error walks of ``unit [N, H, D]``
    float32 (unit-scale components; ``bits [H, D]`` integer bits a component, 0: not coded;
    ``tables [H, W, 2^L]`` float32, row ``k - 1`` the ``k``-bit table), as
    :func:`..triton.trellis.viterbi_codes` writes them. ``nbytes`` None reads it off ``bits`` (a
    host sync); ``kernel`` ``"block"`` or ``"warp"`` (None: :func:`kernel_for`'s). Raises
    :class:`CudaBuildError` when the kernel cannot run it."""
    if kernel not in (None, "block", "warp"):
        raise ValueError(f"kernel must be 'block', 'warp' or None, got {kernel!r}")
    reason = unsupported_reason(unit, bits, tables, kernel)
    if reason is not None:
        raise CudaBuildError(f"the CUDA trellis encoder cannot run this call: {reason}")
    n, h, d = unit.shape
    lbits = int(tables.shape[-1]).bit_length() - 1 if tables.dim() == 3 else 0
    if bits.shape != (h, d) or tables.dim() != 3 or tables.shape[0] != h or tables.shape[1] > lbits:
        raise ValueError(
            f"unit [N, H, D], bits [H, D], tables [H, W, 2^L] with W <= L: got {tuple(unit.shape)}, "
            f"{tuple(bits.shape)}, {tuple(tables.shape)}"
        )
    nbytes = packed_bytes(bits) if nbytes is None else nbytes
    out = torch.empty(n, h, nbytes, dtype=torch.uint8, device=unit.device)
    if n == 0:
        return out
    variant = _variant(unit, tables, kernel)
    launcher = _build(variant, device_index(unit.device))
    operands = [
        unit.contiguous(),
        bits.to(device=unit.device, dtype=torch.int32).contiguous(),
        tables.to(device=unit.device, dtype=torch.float32).contiguous(),
        out,
    ]
    if isinstance(variant, BlockViterbiVariant):
        launcher.launch((n, h, 1), (variant.threads, 1, 1), [*operands, h, int(tables.shape[1]), nbytes])
    else:
        launcher.launch(
            (-(-n // variant.warps), h, 1), (32 * variant.warps, 1, 1), [*operands, n, h, int(tables.shape[1]), nbytes]
        )
    return out
