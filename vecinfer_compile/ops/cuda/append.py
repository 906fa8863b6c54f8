"""CUDA append of one decode token to a compressed cache layer: one launch per layer and step.

The kernel is in ``append.cu`` (its header states the semantics and the work split). In the
compiled decode step the same update as torch ops (:func:`.cache_append.append_reference`) becomes
about a dozen small Inductor kernels per layer (key transform, flush encode, code write, window
shift, counters), each a dependent launch in the step's chain. This kernel does all of it in one
launch of ``B * Hkv * D / 32`` CTAs, which shortens a whole generate() step, not only the append
(see docs/studies/decode-step-time.md).

Score-aware key codes (``key_parallel_weight > 1``) and error-weighted codes (the metrics) are a
search over the whole head vector, which this kernel's split of a row across CTAs cannot do: for
them :func:`.weigh.weigh_flush_cuda` encodes the leaving token first (one more launch, one
CTA per head vector) and the append kernel is built without its encode (``ENCODE=0``).

Compiled with NVRTC (:mod:`.nvrtc`) once per process and variant (head_dim, both codebook
geometries, dtype, which key transforms are present, whether it encodes) and launched on torch's
current stream with no host synchronisation, so CUDA graphs capture it. The counters are advanced
by the CTA that arrives last on the layer's ``arrivals`` counter, which that CTA resets to zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from ...quant.packing import is_packed, packed_width
from . import weigh as cuda_weigh
from .nvrtc import CudaBuildError, build_kernel, device_index, with_half_bits

SOURCE = Path(__file__).with_name("append.cu")
COLS = 32  # channels per CTA: whole sub-vectors, an even number of them (packed nibbles stay in one CTA)
THREADS = 128
CENTROID_DIMS = (2, 4, 8)
MAX_ENTRIES = 4096
MIN_ARCH = 80  # cvt.rn.bf16.f32
DTYPES = (torch.bfloat16, torch.float16)


def source() -> str:
    """The kernel's NVRTC source: ``half_bits.cuh``, then ``append.cu``."""
    return with_half_bits(SOURCE.read_text())


@dataclass(frozen=True)
class AppendVariant:
    """One compiled specialisation of the append kernel."""

    head_dim: int
    k_entries: int
    k_dims: int
    v_entries: int
    v_dims: int
    fp16: bool
    matrix: int  # 0 none, 1 one [D, D] matrix, 2 one per KV head
    mean: bool
    lam: bool
    encode: bool = True  # False: vq_weigh_flush wrote the leaving token's codes

    def defines(self) -> list[str]:
        values = dict(
            D=self.head_dim,
            COLS=COLS,
            DK=self.k_dims,
            DV=self.v_dims,
            EK=self.k_entries,
            EV=self.v_entries,
            KFMT=2 if is_packed(self.k_entries) else 0,
            VFMT=2 if is_packed(self.v_entries) else 0,
            FP16=int(self.fp16),
            MATRIX=self.matrix,
            MEAN=int(self.mean),
            LAM=int(self.lam),
            NTHREADS=THREADS,
            ENCODE=int(self.encode),
        )
        return [f"-D{k}={v}" for k, v in values.items()]


def variant_for(key, k_centroids, v_centroids, key_mean, lam, key_matrix, searched: bool = False) -> AppendVariant:
    (ek, dk), (ev, dv) = (int(x) for x in k_centroids.shape), (int(x) for x in v_centroids.shape)
    matrix = 0 if key_matrix is None else (1 if key_matrix.dim() == 2 else 2)
    return AppendVariant(
        int(key.shape[-1]),
        ek,
        dk,
        ev,
        dv,
        key.dtype == torch.float16,
        matrix,
        key_mean is not None,
        lam is not None,
        not searched,
    )


def is_searched(key_parallel_weight: float, key_metric, value_metric) -> bool:
    """Whether the leaving token's codes need the whole-vector search of :mod:`.weigh`
    (score-aware or error-weighted codes) rather than the append kernel's nearest centroids."""
    return key_parallel_weight != 1.0 or key_metric is not None or value_metric is not None


def unsupported_reason(
    key: torch.Tensor,
    k_window: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    searched: bool = False,
) -> str | None:
    """Why the CUDA append cannot run these inputs (None if it can); ``searched``: score-aware or
    error-weighted codes (:func:`is_searched`). Shapes and dtypes only, so it works on fake
    tensors; building is checked by :func:`build_error`."""
    if key.device.type != "cuda":
        return f"the inputs are on {key.device.type}, not CUDA"
    if int(key.shape[2]) != 1:
        return f"{int(key.shape[2])} new tokens (the CUDA append takes one: a decode step)"
    if k_window.dtype not in DTYPES:
        return f"the cache holds {k_window.dtype}; the CUDA append stores bfloat16/float16 windows"
    major, minor = torch.cuda.get_device_capability(key.device)
    if major * 10 + minor < MIN_ARCH:
        return f"the GPU is sm_{major}{minor}; the CUDA append needs sm_80 or newer"
    d = int(key.shape[-1])
    if d % COLS:
        return f"head_dim {d} is not a multiple of {COLS}"
    for name, c in (("key", k_centroids), ("value", v_centroids)):
        entries, dims = (int(x) for x in c.shape)
        if dims not in CENTROID_DIMS or entries > MAX_ENTRIES:
            return f"a {entries}x{dims} {name} codebook (the CUDA append takes up to {MAX_ENTRIES} entries of 2, 4 or 8 dims)"
    if searched:
        if int(k_window.shape[2]) == 0:
            return (
                "score-aware or error-weighted codes without a window (residual 0): the CUDA encoder reads the "
                "leaving token from the window"
            )
        return cuda_weigh.unsupported_reason(k_window, k_centroids, v_centroids)
    return None


@functools.cache
def _build(variant: AppendVariant, device_index: int):
    return build_kernel(source(), "vq_append", torch.device("cuda", device_index), ["--std=c++17", *variant.defines()])


def build_error(key, k_centroids, v_centroids, key_mean, lam, key_matrix, searched: bool = False) -> str | None:
    """None if the variant for these inputs (and, ``searched``, the encoder of :mod:`.weigh`)
    compiles and loads on their device, else why not (compiles them as a side effect: call it
    before tracing, never inside a CUDA-graph capture)."""
    variant = variant_for(key, k_centroids, v_centroids, key_mean, lam, key_matrix, searched)
    try:
        _build(variant, device_index(key.device))
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    if searched:
        return cuda_weigh.build_error(key, k_centroids, v_centroids, "vq_weigh_flush")
    return None


def require_counters(n_coded: torch.Tensor, n_window: torch.Tensor, arrivals: torch.Tensor) -> None:
    """The counters an append kernel reads and moves on the device: 0-d int64, and its int32
    arrival scratch of one element."""
    for t, name in ((n_coded, "n_coded"), (n_window, "n_window")):
        if t.dim() != 0 or t.dtype != torch.int64:
            raise TypeError(f"{name} must be a 0-d int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if arrivals.dtype != torch.int32 or arrivals.numel() < 1:
        raise TypeError(
            f"arrivals must be an int32 tensor of one element, got {arrivals.dtype} {tuple(arrivals.shape)}"
        )


def require_buffer(t: torch.Tensor, name: str) -> None:
    """A buffer the kernel writes in place: it must be contiguous and 16-byte aligned (a copy
    would lose the write)."""
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(
            f"{name} must be a contiguous, 16-byte aligned buffer for the CUDA append "
            f"(got strides {t.stride()}); VecInferCache allocates it so"
        )


def cache_append_cuda(
    key: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_coded: torch.Tensor,
    n_window: torch.Tensor,
    arrivals: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    key_mean: torch.Tensor | None,
    lam: torch.Tensor | None,
    key_matrix: torch.Tensor | None,
    key_parallel_weight: float = 1.0,
    key_metric: torch.Tensor | None = None,
    value_metric: torch.Tensor | None = None,
) -> None:
    """The contract of ``vecinfer::cache_append`` (:mod:`.cache_append`) for one new token: key
    and value ``[B, Hkv, 1, D]`` in the windows' dtype (bf16/fp16); ``k_codes [B, Hkv, Tmax, Wk]``,
    ``v_codes`` uint8; windows ``[B, Hkv, R, D]``; ``n_coded``/``n_window`` 0-d int64;
    ``arrivals`` int32 ``[1]``, zero (the kernel leaves it zero); centroids float32 ``[E, d]``;
    ``key_mean``/``lam`` float32 ``[Hkv, D]`` or None; ``key_matrix`` float32 ``[D, D]`` or
    ``[Hkv, D, D]`` or None. ``key_parallel_weight`` (score-aware key codes) and
    ``key_metric``/``value_metric`` (``[Hkv, D, D]`` float32, symmetric: error-weighted codes) add
    the launch of :func:`.weigh.weigh_flush_cuda` before the append. Updates the buffers in
    place; raises :class:`CudaBuildError` when the inputs or the machine do not fit the kernels."""
    searched = is_searched(key_parallel_weight, key_metric, value_metric)
    reason = unsupported_reason(key, k_window, k_centroids, v_centroids, searched)
    if reason is not None:
        raise CudaBuildError(f"the CUDA append cannot run this call: {reason}")
    b, h, _, d = key.shape
    for t, name in ((value, "value"), (k_window, "k_window"), (v_window, "v_window")):
        if t.dtype != k_window.dtype or t.shape[-1] != d:
            raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; the CUDA append needs {k_window.dtype} [..., {d}]")
    if key.dtype != k_window.dtype:
        raise ValueError(f"key is {key.dtype} but the window holds {k_window.dtype}")
    require_counters(n_coded, n_window, arrivals)
    for codes, cent, name in ((k_codes, k_centroids, "k_codes"), (v_codes, v_centroids, "v_codes")):
        width = packed_width(d // int(cent.shape[1]), int(cent.shape[0]))
        if codes.dtype != torch.uint8 or tuple(codes.shape[:2]) != (b, h) or codes.shape[-1] != width:
            raise ValueError(
                f"{name} ({codes.dtype}, {tuple(codes.shape)}) are not [{b}, {h}, Tmax, {width}] uint8 codes"
            )
    for t, name in ((k_codes, "k_codes"), (v_codes, "v_codes"), (k_window, "k_window"), (v_window, "v_window")):
        require_buffer(t, name)
    if searched:
        cuda_weigh.weigh_flush_cuda(
            k_window,
            v_window,
            k_codes,
            v_codes,
            n_coded,
            n_window,
            k_centroids,
            v_centroids,
            key_metric,
            value_metric,
            key_parallel_weight,
        )
    variant = variant_for(key, k_centroids, v_centroids, key_mean, lam, key_matrix, searched)
    kernel = _build(variant, device_index(key.device))
    contiguous = [
        None if t is None else t.float().contiguous() for t in (k_centroids, v_centroids, key_mean, lam, key_matrix)
    ]
    kernel.launch(
        (b * h, d // COLS, 1),
        (THREADS, 1, 1),
        [
            key.contiguous(),
            value.contiguous(),
            k_codes,
            v_codes,
            k_window,
            v_window,
            n_coded,
            n_window,
            arrivals,
            *contiguous,
            h,
            k_codes.shape[2],
            k_window.shape[2],
        ],
    )
