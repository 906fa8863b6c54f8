"""CUDA dequantization of stored codes into a position-major workspace (NVRTC).

Same contract as :func:`.triton_dequant.dequantize_triton`, which it replaces on CUDA where it
builds: the Triton kernel writes the workspace far below the memory bandwidth (its centroid
gathers go through L1 one small load at a time; ``bench_prefill_attention.py``'s dequantize
column), which at small chunks and large batches made the dequantization a large share of a
chunk's attention (docs/studies/chunk-attention.md).
This kernel (``dequant.cu``: the codebook in shared memory, 32 bytes of output per thread in
two 16-byte stores) is bound by the output's write bandwidth. Compiled once per process and
variant (head_dim, codebook geometry); launched on torch's current stream, no host sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...quant.packing import is_packed
from .nvrtc import CudaBuildError, build_kernel, device_index, sm_count, unfit_device_reason

SOURCE = Path(__file__).with_name("dequant.cu")
THREADS = 256
CENTROID_DIMS = (2, 4, 8)
MAX_ENTRIES = 4096
MIN_ARCH = 80
DTYPES = (torch.bfloat16, torch.float16)
CTAS_PER_SM = 4  # the grid: about this many CTAs per SM, each walking its row's positions


@dataclass(frozen=True)
class DequantVariant:
    head_dim: int
    entries: int
    dims: int

    def defines(self) -> list[str]:
        return [
            f"-DD={self.head_dim}",
            f"-DDIM={self.dims}",
            f"-DE={self.entries}",
            f"-DFMT={2 if is_packed(self.entries) else 0}",
            f"-DNTHREADS={THREADS}",
        ]

    @property
    def smem_bytes(self) -> int:
        return self.entries * self.dims * 2


def unsupported_reason(codes: torch.Tensor, centroids: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why the CUDA kernel cannot run this call (None if it can); building is :func:`build_error`'s."""
    reason = unfit_device_reason(
        out,
        DTYPES,
        "the workspace is {dtype}; the CUDA dequantization writes bfloat16/float16",
        "the CUDA dequantization",
        MIN_ARCH,
        subject="the workspace is",
    )
    if reason is not None:
        return reason
    entries, dims = (int(x) for x in centroids.shape)
    d = int(out.shape[-1])
    if dims not in CENTROID_DIMS or entries > MAX_ENTRIES or (entries * dims) % 8:
        return (
            f"a {entries}x{dims} codebook (the CUDA dequantization takes up to {MAX_ENTRIES} entries of 2, 4 or 8 dims)"
        )
    if d < 16 or d % dims or THREADS % ((d // dims) // (16 // dims)):
        return f"head_dim {d}"
    if out.data_ptr() % 16 or any(s % 8 for s in out.stride()[:-1]):
        return "the workspace is not 16-byte aligned"
    return None


@functools.cache
def _build(variant: DequantVariant, device_index: int):
    kernel = build_kernel(
        SOURCE.read_text(), "vq_dequant", torch.device("cuda", device_index), ["--std=c++17", *variant.defines()]
    )
    kernel.set_dynamic_smem(variant.smem_bytes)
    return kernel


def build_error(codes: torch.Tensor, centroids: torch.Tensor, out: torch.Tensor) -> str | None:
    """None if this call's variant compiles and loads (compiling it as a side effect), else why not."""
    try:
        _build(DequantVariant(int(out.shape[-1]), *(int(x) for x in centroids.shape)), device_index(out.device))
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    return None


def dequantize_cuda(codes: torch.Tensor, centroids: torch.Tensor, length: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`.triton_dequant.dequantize_triton`'s contract: the first ``length`` positions of
    ``codes`` ``[B, H, Tmax, W]`` dequantized by ``centroids`` ``[E, d]`` (in ``out``'s dtype) into
    ``out`` ``[B, length, H, D]``. Raises :class:`CudaBuildError` when the kernel cannot run it."""
    reason = unsupported_reason(codes, centroids, out)
    if reason is not None:
        raise CudaBuildError(f"the CUDA dequantization cannot run this call: {reason}")
    b, h, _, _ = codes.shape
    if length == 0 or b == 0:
        return out
    variant = DequantVariant(int(out.shape[-1]), *(int(x) for x in centroids.shape))
    kernel = _build(variant, device_index(out.device))
    codes = codes if codes.stride(-1) == 1 else codes.contiguous()
    book = centroids.to(out.dtype).contiguous()
    per_pass = THREADS // ((variant.head_dim // variant.dims) // (16 // variant.dims))
    ctas = max(1, min(-(-length // per_pass), -(-CTAS_PER_SM * sm_count(device_index(out.device)) // (b * h))))
    kernel.launch(
        (ctas, b * h, 1), (THREADS, 1, 1), [codes, book, out, *codes.stride()[:3], *out.stride()[:3], h, length]
    )
    return out
