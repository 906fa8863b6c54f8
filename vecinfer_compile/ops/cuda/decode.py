"""CUDA decode attention over a compressed cache: codebooks in shared memory, tensor-core maths.

The kernel is in ``decode.cu`` (read its header for the algorithm); this module picks a
variant for the inputs, compiles it once per process with NVRTC (:mod:`.nvrtc`), sizes the split
from shapes only, and launches it on torch's current stream with no host synchronisation, so CUDA
graphs capture it. The per-row arrival counters (which CTA merges the partials) are persistent
and per stream: the merging CTA zeroes its row's counter for the next launch, so a call launches
no memset (:func:`arrival_counters`).

Builds, chosen by the inputs' shapes (:class:`Variant`; each is a set of the source's defines):

- interleaved books (:attr:`Variant.interleaved`): two codebooks of at most 256 entries (the 4-, 2-
  and 1-bit presets) share shared memory as rows of 256 bytes at a 64 KiB boundary, entry e's key
  copies beside its value copies, so a gather's address is its code byte dropped into byte 1 of a
  per-lane base (one byte permute). Not where a CTA gets less than 128 KiB of shared memory.
- byte books (:meth:`Variant.byte_book`): a 4096-entry book of 4 or 8 dims (the 3-, 1.5- and
  1.25-bit presets) sits in shared memory as one byte a channel, 7-bit centroids on a power-of-two
  step per book that the kernel widens exactly after the gather
  (:mod:`vecinfer_compile.quant.byte_centroids`; the codebooks hold those values, so the output
  equals a 16-bit book's bit for bit): a gather moves half the bytes and collides on fewer banks.
- paired values (:attr:`Variant.paired_values`): for GQA groups of up to 4 query heads the value
  product contracts pairs of channels instead of pairs of positions (N = 8 columns hold 4 heads x 2
  channel parities), so a gathered centroid's words are the tensor-core A fragments as they land.
- the lean build (:attr:`Variant.lean`, :func:`lean_build`): for books that are not interleaved,
  the query fragments sit in shared memory and one block of codes in registers instead of two, so
  that the 3- and 1.5-bit presets run 12 warps an SM without spilling; a call takes it only when it
  gains warps and the call is long.
- the cluster merge (:func:`cluster_size`): on sm_90, the CTAs of one (batch row, KV head) form a
  thread-block cluster when the split is at most :data:`MAX_CLUSTER` CTAs and every row's cluster
  fits on the GPU at once (short calls); they merge their partials through distributed shared
  memory, with no global partials or counters. Elsewhere the last CTA of a row to arrive (the
  persistent counters) merges the global partials.

Every build's online softmax rescales lazily: the running max moves, and the accumulator is
rescaled, only when a block's score passes it by more than 2^8 (a warp vote). The codebooks are
filled a batch of centroid loads at a time, and the full-precision window's blocks go to the warps
that have codes.

Variants are cached per (head_dim, group size, key/value codebook geometry, dtype, device
architecture). Why a shared-memory codebook: the Triton kernel gathers 8-byte centroid rows
through L1, and those random gathers bound it below FP16 SDPA (``bench_gather_ceiling.py``).
Each 256-entry codebook is replicated ``64 // dims`` times (32 KiB) so that the lanes of one
shared-memory wavefront read distinct copies and never collide on a bank; 4096-entry codebooks
(32 or 64 KiB) are stored once, copied straight in with ``cp.async``. The kernel reads its
codebooks as 16-bit centroids in the query's dtype, converted once per codebook tensor and kept
(:func:`prepared_book`), so that a call moves half the bytes of the float32 ones and converts
nothing. Resident warps per SM hide the gathers' latency: a variant runs the first launch shape
of :data:`LAUNCHES` that fits shared memory and compiles without spilling registers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from ...quant.byte_centroids import BYTE_BOOK_ENTRIES, packed_byte_book
from ...quant.packing import is_packed
from ..checks import check_decode_args
from ..coded_kv import CodedKV
from ..split_attention.lse_merge import LOG2E
from .nvrtc import (
    CudaBuildError,
    Kernel,
    compile_source,
    device_copy,
    device_index,
    device_zeros_int32,
    load_kernels,
    sm_count,
    unfit_device_reason,
)

SOURCE = Path(__file__).with_name("decode.cu")

_log = logging.getLogger(__name__)
# (resident CTAs per SM, warps per CTA), in order of preference: twelve warps per SM, in one CTA
# first (faster than three CTAs of four at every shape measured), then fewer warps where registers
# spill, one CTA of 8 before several of 4 (faster for the presets that spill at 12); the
# measurements are in docs/studies/decode-kernel-bounds.md.
LAUNCHES = ((1, 12), (1, 8), (3, 4), (2, 4), (1, 4))
INTERLEAVED_BOOK_BYTES = 2 * 65536  # 64 KiB of rows at the first 64 KiB boundary of the allocation
BLOCK_T = 64  # positions per warp iteration (BLOCK_T in the source)
MAX_SPLITS = 64  # CTAs per (batch row, KV head): one wave's worth at B * Hkv = 2; more only add merge work
HEAD_DIMS = (64, 128)
CENTROID_DIMS = (2, 4, 8)
MAX_GROUP = 16
MAX_ENTRIES = 4096
SMEM_PER_SM = 228 * 1024  # shared memory per SM on sm_90 (the default; variant_for reads the device's)
RESERVED_SMEM = 1024  # per CTA, the driver's reservation (sm_80 on): a CTA may take the SM's rest
MIN_ARCH = 80  # mma.sync bf16 and cvt.bf16x2
CLUSTER_ARCH = 90  # thread-block clusters and distributed shared memory
MAX_CLUSTER = 8  # the portable cluster size; the source's MAX_CLUSTER define
DTYPES = {torch.bfloat16: 0, torch.float16: 1}


@dataclass(frozen=True)
class Variant:
    """One compiled specialisation of the kernels."""

    head_dim: int
    group: int
    k_entries: int
    k_dims: int
    v_entries: int
    v_dims: int
    fp16: bool
    cluster: bool = False  # the cluster build (sm_90): partials merged in distributed shared memory
    lean: bool = False  # the lean build of a non-interleaved variant (see lean_build)
    smem_per_sm: int = SMEM_PER_SM  # the device's (228 KiB on sm_90, 164 on sm_80, 100 on sm_86/89)

    def __post_init__(self) -> None:
        if self.lean and not self.can_be_lean:
            raise ValueError(f"{self}: no lean build (it needs a codebook of more than 256 entries)")

    @property
    def smem_limit(self) -> int:
        """Dynamic shared memory one CTA may take on the device."""
        return self.smem_per_sm - RESERVED_SMEM

    @staticmethod
    def copies(entries: int, dims: int) -> int:
        """Copies of a codebook in shared memory: one per lane of a 128-byte wavefront for
        256-entry books (``64 // dims``), one for larger books."""
        return 64 // dims if entries <= 256 else 1

    @property
    def interleaved(self) -> bool:
        """Two books of at most 256 entries (128 bytes of copies an entry): entry e's key and value
        copies share a 256-byte row, so a gather's address is one byte permute of its code (the
        source's INTERLEAVE). Not where the device's shared memory is too small for the layout's
        128 KiB (sm_86/89: 99 KiB a CTA): there each book keeps its own copies."""
        return self.k_entries <= 256 and self.v_entries <= 256 and INTERLEAVED_BOOK_BYTES <= self.smem_limit

    @property
    def paired_values(self) -> bool:
        """At most 4 query heads per KV head: the value product's N holds 4 heads x 2 channel
        parities and its A fragments are the gathered words, untransposed (the source's VPAIR; see
        block_step there)."""
        return self.group <= 4

    def byte_book(self, entries: int, dims: int) -> bool:
        """A book of more than 256 entries of 4 or 8 dims: one byte a channel in shared memory (the
        source's KBYTE / VBYTE; see :mod:`vecinfer_compile.quant.byte_centroids`)."""
        return entries >= BYTE_BOOK_ENTRIES and dims in (4, 8)

    @property
    def can_be_lean(self) -> bool:
        """Books not interleaved (a 4096-entry book): a lean build exists, with the query fragments
        in shared memory after the books instead of 16 registers a thread (the source's QSMEM) and
        one block of codes in registers, each part replaced by the next block's codes once gathered
        (STAGGER): 3- and 1.5-bit fit 12 warps an SM without spilling (the plain build: 8)."""
        return not self.interleaved

    def book_bytes(self) -> int:
        """Both codebooks in shared memory, copies included (interleaved: with the room to start
        them at a 64 KiB boundary)."""
        if self.interleaved:
            return INTERLEAVED_BOOK_BYTES
        query = (self.group + 7) // 8 * (self.head_dim // 16) * 32 * 8 if self.lean else 0
        return query + sum(
            e * self.copies(e, d) * d * (1 if self.byte_book(e, d) else 2)
            for e, d in ((self.k_entries, self.k_dims), (self.v_entries, self.v_dims))
        )

    def smem_bytes(self, nwarps: int) -> int:
        """The kernel's dynamic shared memory with ``nwarps`` warps per CTA: the codebooks, reused
        at the end for the warps' partials (``nwarps x G x (D + 2)`` floats; one more for the CTA's
        own partial in the cluster build) when those are larger."""
        partials = nwarps + int(self.cluster)
        return max(self.book_bytes(), partials * self.group * (self.head_dim + 2) * 4)

    @staticmethod
    def code_format(entries: int) -> int:
        """The source's KFMT/VFMT: 0 for one byte per code, 2 for packed 12-bit codes
        (:mod:`vecinfer_compile.quant.packing`)."""
        return 2 if is_packed(entries) else 0

    def defines(self, nwarps: int) -> list[str]:
        values = dict(
            D=self.head_dim,
            G=self.group,
            DK=self.k_dims,
            DV=self.v_dims,
            EK=self.k_entries,
            EV=self.v_entries,
            KFMT=self.code_format(self.k_entries),
            VFMT=self.code_format(self.v_entries),
            KCOPIES=self.copies(self.k_entries, self.k_dims),
            VCOPIES=self.copies(self.v_entries, self.v_dims),
            FP16=int(self.fp16),
            NWARPS=nwarps,
            CLUSTER=int(self.cluster),
            MAX_CLUSTER=MAX_CLUSTER,
            INTERLEAVE=int(self.interleaved),
            VPAIR=int(self.paired_values),
            KBYTE=int(self.byte_book(self.k_entries, self.k_dims)),
            VBYTE=int(self.byte_book(self.v_entries, self.v_dims)),
            QSMEM=int(self.lean),
            STAGGER=int(self.lean),
        )
        return [f"-D{k}={v}" for k, v in values.items()]


@functools.cache
def _smem_per_sm(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor


def variant_for(q: torch.Tensor, k_centroids: torch.Tensor, v_centroids: torch.Tensor, group: int) -> Variant:
    (ek, dk), (ev, dv) = (int(x) for x in k_centroids.shape), (int(x) for x in v_centroids.shape)
    smem = _smem_per_sm(device_index(q.device))
    return Variant(int(q.shape[-1]), int(group), ek, dk, ev, dv, q.dtype == torch.float16, smem_per_sm=smem)


def unsupported_reason(
    q: torch.Tensor, k_codes: torch.Tensor, k_centroids: torch.Tensor, v_centroids: torch.Tensor
) -> str | None:
    """Why the CUDA kernel cannot run these inputs (None if it can). Shapes and dtypes only;
    building (NVRTC, the driver) is checked by :func:`build_error`."""
    reason = unfit_device_reason(
        q,
        DTYPES,
        "queries are {dtype}; the CUDA kernel multiplies bfloat16/float16 on tensor cores",
        "the CUDA kernel",
        MIN_ARCH,
    )
    if reason is not None:
        return reason
    d = int(q.shape[-1])  # int(): a symbolic size (dynamic=True) is specialised here
    if d not in HEAD_DIMS:
        return f"head_dim {d} (the CUDA kernel is built for {HEAD_DIMS})"
    group = int(q.shape[1]) // max(int(k_codes.shape[1]), 1)
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (the CUDA kernel takes at most {MAX_GROUP})"
    for name, c in (("key", k_centroids), ("value", v_centroids)):
        entries, dims = (int(x) for x in c.shape)
        if dims not in CENTROID_DIMS or entries > MAX_ENTRIES:
            return f"a {entries}x{dims} {name} codebook (the CUDA kernel takes up to {MAX_ENTRIES} entries of 2, 4 or 8 dims)"
    variant = variant_for(q, k_centroids, v_centroids, group)
    if not launches_for(variant):
        smem = min(variant.smem_bytes(w) for _, w in LAUNCHES)
        return f"the codebooks need {smem} bytes of shared memory, more than this GPU's {variant.smem_limit} per block"
    return None


@functools.cache
def source() -> str:
    """The kernel's CUDA C++ source (every build compiles it with its own defines)."""
    return SOURCE.read_text()


@dataclass(frozen=True)
class Built:
    """The loaded kernel of one variant, its warps per CTA and resident CTAs per SM, and (on sm_90)
    its cluster build with the same launch shape."""

    kernel: Kernel
    nwarps: int
    ctas_per_sm: int
    cluster: Kernel | None = None


def launches_for(variant: Variant) -> list[tuple[int, int]]:
    """The (CTAs per SM, warps per CTA) of :data:`LAUNCHES` whose shared memory fits the SM, in
    order of preference; empty when none does (:func:`unsupported_reason` then names the need)."""
    return [
        (c, w)
        for c, w in LAUNCHES
        if variant.smem_bytes(w) <= variant.smem_limit
        and c * (variant.smem_bytes(w) + RESERVED_SMEM) <= variant.smem_per_sm
    ]


def _compile(variant: Variant, device: torch.device, ctas: int, nwarps: int) -> Kernel:
    major, minor = torch.cuda.get_device_capability(device)
    image, _ = compile_source(
        source(),
        "vq_decode",
        major * 10 + minor,
        ["--use_fast_math", "--std=c++17", *variant.defines(nwarps), f"-DMINB={ctas}"],
    )
    return load_kernels(image, ["vq_decode"], device)["vq_decode"]


@functools.cache
def _build(variant: Variant, device_index: int) -> Built:
    """Compile the first launch shape of :func:`launches_for` whose register budget does not make
    the compiler spill to local memory (the last one otherwise); on sm_90 also the cluster
    build of that shape, if its shared memory fits."""
    device = torch.device("cuda", device_index)
    shapes = launches_for(variant)
    if not shapes:
        raise CudaBuildError(f"no launch shape of the CUDA decode kernel fits {variant} in shared memory")
    for ctas, nwarps in shapes:
        kernel = _compile(variant, device, ctas, nwarps)
        if kernel.local_bytes == 0:
            break
    kernel.set_dynamic_smem(variant.smem_bytes(nwarps))
    cluster = None
    clustered = dataclasses.replace(variant, cluster=True)
    major, minor = torch.cuda.get_device_capability(device)
    if major * 10 + minor >= CLUSTER_ARCH and (ctas, nwarps) in launches_for(clustered):
        cluster = _compile(clustered, device, ctas, nwarps)
        cluster.set_dynamic_smem(clustered.smem_bytes(nwarps))
    return Built(kernel, nwarps, ctas, cluster)


def kernels_for(variant: Variant, device: torch.device) -> Built:
    """The compiled kernel of ``variant`` on ``device`` (compiled on first use, then cached)."""
    return _build(variant, device_index(device))


LEAN_MIN_BLOCKS_PER_WARP = 24  # the measured crossover: longer calls gain from the lean build, shorter ones lose
# (3-bit; docs/studies/decode-kernel-bounds.md)


def lean_may_gain(variant: Variant, plain: Built) -> bool:
    """Whether ``variant`` has a lean build that could run more warps an SM than its plain build
    ``plain`` (which does not already run the most that :data:`LAUNCHES` offers)."""
    most = max(c * w for c, w in LAUNCHES)
    return variant.can_be_lean and plain.ctas_per_sm * plain.nwarps < most


def lean_build(variant: Variant, device: torch.device, batch_heads: int, tmax: int) -> Built:
    """The build a call runs: the lean one (:attr:`Variant.can_be_lean`) when it runs more warps
    an SM than the plain one and the call is long, at least :data:`LEAN_MIN_BLOCKS_PER_WARP` blocks of
    64 positions for each of the plain build's warps on the GPU (its shapes only, as the split: the
    codes' capacity ``tmax``, not their fill); the plain build otherwise. More warps hide the
    4096-entry books' gathers better in a long call, and cost more than they hide in a short one
    (every CTA fills its books; the query comes from shared memory): see docs/results."""
    plain = kernels_for(variant, device)
    if not lean_may_gain(variant, plain):
        return plain
    blocks = batch_heads * math.ceil(tmax / BLOCK_T)
    if blocks < LEAN_MIN_BLOCKS_PER_WARP * sm_count(device_index(device)) * plain.ctas_per_sm * plain.nwarps:
        return plain
    lean = kernels_for(dataclasses.replace(variant, lean=True), device)
    return lean if lean.ctas_per_sm * lean.nwarps > plain.ctas_per_sm * plain.nwarps else plain


def num_splits(batch_heads: int, tmax: int, ctas_per_sm: int, sms: int, nwarps: int) -> int:
    """CTAs per (batch row, KV head): as many as fill one wave of the SMs without starting a second
    (a partial second wave doubles the time), but no more warps than there are 64-position blocks
    in ``tmax``, the codes' capacity (a cache's codes and window together hold at most that many
    positions). Depends on shapes only
    (never on the cache's fill), so CUDA graphs and compile do not specialise on the length; each
    warp's range is cut from the actual ``n_coded`` and ``n_window`` on the device."""
    wave = sms * ctas_per_sm
    by_length = math.ceil(max(tmax, 1) / (BLOCK_T * nwarps))
    return max(1, min(wave // batch_heads, by_length, MAX_SPLITS))


_ACTIVE_CLUSTERS: dict[tuple[int, int], int] = {}


def cluster_size(built: Built, batch_heads: int, splits: int) -> int | None:
    """The cluster of a launch: ``splits`` (each row's CTAs one cluster) when the cluster build
    exists (sm_90), the split is at most :data:`MAX_CLUSTER` CTAs, and all ``batch_heads`` rows'
    clusters fit on the GPU at once (a second wave of clusters would cost more than the merge
    saves; a split of one CTA is a cluster of one, scheduled as any CTA); None for the global merge."""
    if built.cluster is None or splits > MAX_CLUSTER:
        return None
    if splits == 1:
        return 1
    key = (built.cluster.handle.value, splits)
    if key not in _ACTIVE_CLUSTERS:
        try:
            _ACTIVE_CLUSTERS[key] = built.cluster.max_active_clusters((1, splits, 1), (built.nwarps * 32, 1, 1))
        except (CudaBuildError, AttributeError) as exc:  # a driver without the query: the global merge
            _log.info("no cluster launch for the CUDA decode kernel: %s", exc)
            _ACTIVE_CLUSTERS[key] = 0
    return splits if batch_heads <= _ACTIVE_CLUSTERS[key] else None


_BOOKS: dict[tuple[int, torch.dtype | None], tuple[weakref.ref, int, int, torch.Tensor]] = {}


def prepared_book(centroids: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """float32 centroids ``[E, d]`` -> the same ``[E, d]`` in ``dtype`` (16-bit, 16-byte aligned), as
    the kernel reads them, or for ``dtype`` None the byte book (int16 pairs of the bytes of
    :func:`vecinfer_compile.quant.byte_centroids.packed_byte_book`): converted once per codebook
    tensor and kept while that tensor lives, so that a decode step launches no conversion. The copy is made again when the tensor has been
    modified in place (its version counter moved) or moved in memory. Inside a CUDA-graph capture a
    missing copy is converted in the graph and not kept (graph pools must not be held outside the
    graph); torch's CUDA-graph trees and the benchmarks run every call once before capturing it.
    A kept CUDA copy lives outside torch's allocator (:func:`.nvrtc.device_copy`): made during a
    CUDA-graph tree's warm-up, a copy from torch's allocator would sit in that graph's pool, and
    the capture refuses live tensors there that it does not return.
    Inference tensors keep no version counter: theirs is read as 0, so a
    codebook made under ``torch.inference_mode`` and then changed in place there would not be
    seen; codebooks are constants after calibration. Each conversion bumps
    ``counters["vecinfer"]["decode_book_conversions"]`` (a compiled decode step should add none)."""
    key = (id(centroids), dtype)
    version = 0 if centroids.is_inference() else centroids._version
    hit = _BOOKS.get(key)
    if hit is not None and hit[0]() is centroids and hit[1] == version and hit[2] == centroids.data_ptr():
        return hit[3]
    counters["vecinfer"]["decode_book_conversions"] += 1
    source, kind = (
        (centroids, dtype) if dtype is not None else (packed_byte_book(centroids).view(torch.int16), torch.int16)
    )
    if centroids.is_cuda and torch.cuda.is_current_stream_capturing():
        return _aligned(source.to(kind))
    book = device_copy(source, kind) if centroids.is_cuda else _aligned(source.to(kind))
    _BOOKS[key] = (
        weakref.ref(centroids, lambda _, key=key: _BOOKS.pop(key, None)),
        version,
        centroids.data_ptr(),
        book,
    )
    return book


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """int32 ``[>= n]`` zeros: the arrival counters of a launch on the current stream.

    One buffer per (device, stream), so that launches sharing it are ordered by their stream; the
    merging CTA of each row zeroes it again. It lives outside torch's allocator (never freed):
    a CUDA graph that captured it keeps using it, and no graph pool can hand its memory to
    another tensor. A buffer is made only outside a capture; a capture on a stream that has none
    yet (its warm-up ran on another stream) gets zeros from torch's allocator, memset inside the
    graph. (A graph replayed while eager calls run on its capture
    stream at the same time would share counters; torch's CUDA-graph trees warm up and capture on
    a stream of their own and synchronize the device before each warm-up.)"""
    key = (device_index(device), torch.cuda.current_stream(device).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros((n,), dtype=torch.int32, device=device)
    buf = device_zeros_int32(max(n, 1024, 2 * (0 if buf is None else buf.numel())), torch.device("cuda", key[0]))
    _COUNTERS[key] = buf
    return buf


def _index_is64(t: torch.Tensor) -> int:
    return int(t.dtype == torch.int64)


def decode_attention_cuda(q: torch.Tensor, kv: CodedKV, kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Same contract as :func:`vecinfer_compile.ops.reference.decode_attention`: q ``[B, Hq, 1, D]``
    bf16/fp16 (q~), ``kv`` (:class:`~..coded_kv.CodedKV`) with stored codes ``[B, Hkv, Tmax, W]``
    uint8 (``W = D // d``, packed when 12-bit), centroids float32 ``[E, d]``,
    windows ``[B, Hkv, R, D]``, ``n_coded``/``n_window`` 0-d int tensors, ``kv_start`` ``[B]`` or
    None -> ``[B, Hq, 1, D]`` in q.dtype. Raises :class:`CudaBuildError` if the inputs or the
    machine do not fit the kernel (see :func:`unsupported_reason`)."""
    group = check_decode_args(q, kv, kv_start)
    k_codes, v_codes, k_centroids, v_centroids, n_coded, k_window, v_window, n_window = kv
    reason = unsupported_reason(q, k_codes, k_centroids, v_centroids)
    if reason is not None:
        raise CudaBuildError(f"the CUDA decode kernel cannot run this call: {reason}; use the Triton kernel")
    variant = variant_for(q, k_centroids, v_centroids, group)
    b, hq, _, d = q.shape
    hkv, tmax = k_codes.shape[1], k_codes.shape[2]
    built = lean_build(variant, q.device, b * hkv, tmax)
    q = q.contiguous()
    k_codes, v_codes = _aligned(k_codes), _aligned(v_codes)
    k_window, v_window = _aligned(k_window.to(q.dtype)), _aligned(v_window.to(q.dtype))
    k_centroids, v_centroids = (
        prepared_book(c, None if variant.byte_book(*c.shape) else q.dtype) for c in (k_centroids, v_centroids)
    )
    splits = num_splits(b * hkv, tmax, built.ctas_per_sm, sm_count(device_index(q.device)), built.nwarps)
    cluster = cluster_size(built, b * hkv, splits)
    if cluster is not None:  # partials stay in shared memory: none in global memory, no counters
        kernel, units, partials = built.cluster, splits, [None, None, None, None]
    else:
        kernel, units = built.kernel, splits  # one partial per CTA
        part_m = torch.empty((b * hkv, units, group), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((b * hkv, units, group, d), dtype=torch.float32, device=q.device)
        partials = [part_m, torch.empty_like(part_m), part_acc, arrival_counters(b * hkv, q.device)]
    out = torch.empty((b, hq, 1, d), dtype=q.dtype, device=q.device)
    start_kind = 0 if kv_start is None else 1 + _index_is64(kv_start)
    kernel.launch(
        (b * hkv, units, 1),
        (built.nwarps * 32, 1, 1),
        [
            q,
            k_codes,
            v_codes,
            k_centroids,
            v_centroids,
            k_window,
            v_window,
            n_coded,
            n_window,
            kv_start,
            *partials,
            out,
            hkv,
            tmax,
            k_window.shape[2],
            _index_is64(n_coded),
            _index_is64(n_window),
            start_kind,
            float(scale) * LOG2E,
        ],
        cluster=None if cluster is None else (1, cluster, 1),
    )
    return out


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous with a 16-byte aligned base (the kernel loads code and window slices as vectors)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def build_error(
    q: torch.Tensor, k_codes: torch.Tensor, k_centroids: torch.Tensor, v_centroids: torch.Tensor
) -> str | None:
    """None if the variant for these inputs, and its lean build where that may gain warps
    (:func:`lean_may_gain`; :func:`lean_build` picks between them at the call), compile and load on
    their device, else why not (compiles them as a side effect: call it before tracing, never inside
    a CUDA-graph capture). Reads no batch size or length, so a symbolic one (``dynamic=True``) is not
    specialised here."""
    group = int(q.shape[1]) // int(k_codes.shape[1])
    try:
        variant = variant_for(q, k_centroids, v_centroids, group)
        if lean_may_gain(variant, kernels_for(variant, q.device)):
            kernels_for(dataclasses.replace(variant, lean=True), q.device)
    except (CudaBuildError, OSError) as exc:
        return str(exc)
    return None
