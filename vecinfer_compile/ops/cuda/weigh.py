"""Score-aware and error-weighted codes on the GPU: the kernels of ``weigh.cu``.

The torch forms (:mod:`..quant.score_aware`, :mod:`..quant.weighted_codes`) make a decode step
many times slower (a dozen small kernels per sub-vector and sweep; docs/studies/code-choice.md);
here one CTA per head vector runs the whole search:

- :func:`weigh_rows_cuda`: ``vecinfer::weigh_codes`` on CUDA (the prefill: codes of many rows
  lowered under the metric from the encoder's codes);
- :func:`weigh_flush_cuda`: a decode step's leaving token (window slot 0), launched by
  :func:`.append.cache_append_cuda` before the append kernel, which then skips its own
  nearest-centroid encode.

Compiled with NVRTC (:mod:`.nvrtc`) once per process and variant, launched on torch's current
stream with no host synchronisation (CUDA graphs capture it). The metrics must be symmetric, as
calibration stores them (:func:`..quant.weighted_codes.normalized`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...quant.packing import is_packed, packed_width
from ...quant.weighted_codes import SWEEPS
from .nvrtc import CudaBuildError, build_kernel, device_index, unfit_device_reason, with_half_bits

SOURCE = Path(__file__).with_name("weigh.cu")
CENTROID_DIMS = (2, 4, 8)
MAX_ENTRIES = 4096
MIN_ARCH = 80  # redux.sync, cvt.rn.bf16.f32
INPUT_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def source() -> str:
    """The kernel's NVRTC source: ``half_bits.cuh``, then ``weigh.cu``."""
    return with_half_bits(SOURCE.read_text())


def threads_for(entries: int) -> int:
    """Threads per CTA: the descent's step scans the book across the CTA, so large books get more."""
    return 128 if entries <= 1024 else 256


@dataclass(frozen=True)
class WeighVariant:
    """One compiled specialisation (the value book is the key book's for the rows kernel)."""

    head_dim: int
    k_entries: int
    k_dims: int
    v_entries: int
    v_dims: int
    input_format: int  # 0 float32, 1 float16, 2 bfloat16

    @property
    def threads(self) -> int:
        return threads_for(max(self.k_entries, self.v_entries))

    def defines(self) -> list[str]:
        values = dict(
            D=self.head_dim,
            DK=self.k_dims,
            EK=self.k_entries,
            KFMT=2 if is_packed(self.k_entries) else 0,
            DV=self.v_dims,
            EV=self.v_entries,
            VFMT=2 if is_packed(self.v_entries) else 0,
            XFMT=self.input_format,
            NTHREADS=self.threads,
            SWEEPS=SWEEPS,
        )
        return [f"-D{k}={v}" for k, v in values.items()]


def unsupported_reason(x: torch.Tensor, *books: torch.Tensor) -> str | None:
    """Why the kernels cannot encode ``x: [..., D]`` with these ``[E, d]`` books (None if they can).
    Shapes and dtypes only, so it works on fake tensors."""
    reason = unfit_device_reason(
        x,
        INPUT_FORMATS,
        "the vectors are {dtype}; the CUDA encoder reads float32, float16 or bfloat16",
        "the CUDA encoder",
        MIN_ARCH,
    )
    if reason is not None:
        return reason
    d = int(x.shape[-1])
    for book in books:
        entries, dims = (int(v) for v in book.shape)
        if dims not in CENTROID_DIMS or entries > MAX_ENTRIES or d % dims or d // dims > threads_for(entries):
            return (
                f"a {entries}x{dims} codebook over head_dim {d} (the CUDA encoder takes up to {MAX_ENTRIES} entries "
                f"of 2, 4 or 8 dims, at most {threads_for(entries)} sub-vectors)"
            )
    return None


@functools.cache
def _build(variant: WeighVariant, name: str, device_index: int):
    return build_kernel(source(), name, torch.device("cuda", device_index), ["--std=c++17", *variant.defines()])


def build_error(x: torch.Tensor, k_centroids: torch.Tensor, v_centroids: torch.Tensor, name: str) -> str | None:
    """None if kernel ``name`` builds and loads for these inputs on their device, else why not
    (compiles it as a side effect: call it before tracing, never inside a CUDA-graph capture)."""
    try:
        _build(_variant(x, k_centroids, v_centroids), name, device_index(x.device))
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    return None


def _variant(x, k_centroids, v_centroids) -> WeighVariant:
    (ek, dk), (ev, dv) = (int(v) for v in k_centroids.shape), (int(v) for v in v_centroids.shape)
    return WeighVariant(int(x.shape[-1]), ek, dk, ev, dv, INPUT_FORMATS[x.dtype])


def _require(reason: str | None) -> None:
    if reason is not None:
        raise CudaBuildError(f"the CUDA encoder cannot run this call: {reason}")


def weigh_rows_cuda(
    x: torch.Tensor, stored: torch.Tensor, centroids: torch.Tensor, metric: torch.Tensor, parallel_weight: float = 1.0
) -> torch.Tensor:
    """:func:`~vecinfer_compile.quant.weighted_codes.weigh_stored` on CUDA: ``x: [B, H, T, D]``
    (float32/float16/bfloat16), ``stored [B, H, T, W]`` uint8 start codes, ``centroids [E, d]``,
    ``metric [H, D, D]`` symmetric -> new stored codes ``[B, H, T, W]``."""
    _require(unsupported_reason(x, centroids))
    b, h, t, d = x.shape
    entries, dims = (int(v) for v in centroids.shape)
    width = packed_width(d // dims, entries)
    if stored.dtype != torch.uint8 or tuple(stored.shape) != (b, h, t, width):
        raise ValueError(f"stored codes ({stored.dtype}, {tuple(stored.shape)}) are not [{b}, {h}, {t}, {width}] uint8")
    if tuple(metric.shape) != (h, d, d):
        raise ValueError(f"the metric is {tuple(metric.shape)}, not [{h}, {d}, {d}]")
    out = torch.empty_like(stored, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    variant = _variant(x, centroids, centroids)
    kernel = _build(variant, "vq_weigh_rows", device_index(x.device))
    kernel.launch(
        (b * h * t, 1, 1),
        (variant.threads, 1, 1),
        [
            x.contiguous(),
            stored.contiguous(),
            out,
            centroids.float().contiguous(),
            metric.float().contiguous(),
            float(parallel_weight),
            h,
            t,
        ],
    )
    return out


def weigh_flush_cuda(
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    n_window: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    key_metric: torch.Tensor | None,
    value_metric: torch.Tensor | None,
    key_parallel_weight: float,
) -> None:
    """Encode the token the next append moves out of the window (slot 0, when ``n_window`` is the
    window's ``R > 0`` slots): score-aware key codes for ``key_parallel_weight`` (1: nearest),
    nearest value codes, each lowered under its metric when given, written at code slot
    ``n_coded`` (when below ``Tmax``). Shapes as :func:`.append.cache_append_cuda`
    checks them; metrics ``[Hkv, D, D]`` float32, symmetric."""
    _require(unsupported_reason(k_window, k_centroids, v_centroids))
    b, h, r, d = k_window.shape
    if r == 0:
        raise CudaBuildError(
            "the CUDA encoder reads the leaving token from the window; a cache without one "
            "(residual 0) runs score-aware and error-weighted appends as torch ops"
        )
    for metric, name in ((key_metric, "key_metric"), (value_metric, "value_metric")):
        if metric is not None and tuple(metric.shape) != (h, d, d):
            raise ValueError(f"{name} is {tuple(metric.shape)}, not [{h}, {d}, {d}]")
    variant = _variant(k_window, k_centroids, v_centroids)
    kernel = _build(variant, "vq_weigh_flush", device_index(k_window.device))
    metrics = [None if m is None else m.float().contiguous() for m in (key_metric, value_metric)]
    kernel.launch(
        (b * h, 2, 1),
        (variant.threads, 1, 1),
        [
            k_window,
            v_window,
            k_codes,
            v_codes,
            n_coded,
            n_window,
            k_centroids.float().contiguous(),
            v_centroids.float().contiguous(),
            *metrics,
            float(key_parallel_weight),
            h,
            k_codes.shape[2],
            r,
        ],
    )
