"""``vecinfer::cache_append``: append new tokens to one :class:`~vecinfer_compile.cache.VecInferCache`
layer, in place.

Schema::

    vecinfer::cache_append(Tensor key, Tensor value, Tensor(a!) k_codes, Tensor(b!) v_codes,
        Tensor(c!) k_window, Tensor(d!) v_window, Tensor(e!) n_coded, Tensor(f!) n_window,
        Tensor(g!) arrivals, Tensor k_centroids, Tensor v_centroids, Tensor? key_mean,
        Tensor? lam, Tensor? key_matrix, float key_parallel_weight=1.0, Tensor? key_metric=None,
        Tensor? value_metric=None) -> ()

``key``/``value`` ``[B, Hkv, T, D]`` are the new tokens (keys before the transform). The new keys
become ``K~ = ((key - key_mean) / lam) @ key_matrix`` (float32, each factor optional, rounded to
the window dtype; ``key_matrix`` is ``[D, D]`` or one per KV head ``[Hkv, D, D]``). With ``w =
n_window`` and ``R`` window slots, the virtual sequence ``window[:w] ++ new`` keeps its last
``min(w + T, R)`` tokens in the window; the ones before are encoded into code slots ``n_coded ..``
and ``n_coded`` advances by their count. ``arrivals`` (int32 ``[1]``, zero) is scratch for the
CUDA kernel. ``key_parallel_weight`` is how keys are encoded (1: the nearest centroid; above:
the score-aware codes of :mod:`vecinfer_compile.quant.score_aware`); ``key_metric`` /
``value_metric`` (``[Hkv, D, D]`` float32, both or neither) make the codes error-weighted
(:mod:`vecinfer_compile.quant.weighted_codes`).

Implementations: :func:`append_reference` (pure torch, any T; it is also what Inductor compiles
when the CUDA kernel does not run) and ``vecinfer::cache_append_cuda`` (:mod:`.cuda.append`, one
launch, T = 1, opaque and mutating its buffers in place; Inductor re-inplaces it). The op itself
is composite: run eagerly it dispatches to the CUDA kernel when :func:`choose_append` picks it,
else runs the reference. In a compiled graph the backend's pass
(:mod:`vecinfer_compile.passes.cache_append`) makes that choice part of the graph instead (so
Inductor's caches key on it).

``vecinfer::record_undo(Tensor(a!) undo_counts, Tensor(b!) undo_kv, Tensor n_coded, Tensor
n_window, Tensor k_window, Tensor v_window) -> ()`` keeps what undoing a decode step's append
needs, before the append: window slot 0 (the token a full window moves into the codes) and the
two counters, into the undo buffers of a layer that records its past (transformers' deferred stop
check). An opaque op, not ``copy_`` in the layer: compiled, Inductor computes a plain copy of a
window slice lazily, and when the append that follows is the opaque, re-inplaced CUDA kernel the
copy then read the window *after* the append (torch 2.11 on the H200, and 2.13 on the CPU with
any opaque mutating op; a clone does not help). Extern kernels run in graph order, so this one
reads the window before the append writes it.
"""

from __future__ import annotations

import logging

import torch

from ..quant.packing import pack_codes
from ..quant.rows import rows_matmul
from ..quant.score_aware import score_aware_indices
from .cuda import append as cuda_append
from .cuda.append import cache_append_cuda
from .kernel_request import fall_back, requested
from .registry import define

SCHEMA_ARGS = (
    "(Tensor key, Tensor value, Tensor(a!) k_codes, Tensor(b!) v_codes, Tensor(c!) k_window, "
    "Tensor(d!) v_window, Tensor(e!) n_coded, Tensor(f!) n_window, Tensor(g!) arrivals, Tensor k_centroids, "
    "Tensor v_centroids, Tensor? key_mean, Tensor? lam, Tensor? key_matrix, float key_parallel_weight=1.0, "
    "Tensor? key_metric=None, Tensor? value_metric=None) -> ()"
)
MUTATES = ("k_codes", "v_codes", "k_window", "v_window", "n_coded", "n_window", "arrivals")
UNDO_MUTATES = ("undo_counts", "undo_kv")
FLUSH_DIRECT_MAX = 16  # tokens per update encoded by the plain-torch form on CUDA (more: the Triton op)


def transform_keys(
    k: torch.Tensor, key_mean: torch.Tensor | None, lam: torch.Tensor | None, key_matrix: torch.Tensor | None
) -> torch.Tensor:
    """``K~ = ((k - key_mean) / lam) @ key_matrix`` for ``k: [B, Hkv, T, D]``, computed in float32
    and returned in ``k.dtype`` (``key_mean``/``lam`` ``[Hkv, D]``, ``key_matrix`` ``[D, D]`` or
    ``[Hkv, D, D]``; each may be None)."""
    work = k.float()
    if key_mean is not None:
        work = work - key_mean[None, :, None, :]
    if lam is not None:
        work = work / lam[None, :, None, :]
    if key_matrix is not None:
        work = rows_matmul(work, key_matrix)
    return work.to(k.dtype)


def encode_flush(
    x: torch.Tensor, centroids: torch.Tensor, parallel_weight: float = 1.0, metric: torch.Tensor | None = None
) -> torch.Tensor:
    """Stored codes (uint8, packed as :mod:`..quant.packing` says) of the tokens an update moves
    out of the window (``x`` already transformed).

    Nearest centroid by ``((x - c) ** 2).sum()``, which Inductor compiles into one reduction
    kernel parallel over sub-vectors and entries. On CUDA an update of more than
    ``FLUSH_DIRECT_MAX`` tokens runs ``vecinfer::encode`` (Triton) instead: this form
    materialises ``[N, E, d]`` floats when eager. Not the Triton op for a decode step's one
    token: its scan over the entries is serial per sub-vector (56 us per call on the H200). Not
    the op's reference form ``argmin(|x|^2 - 2 x c^T + |c|^2)`` either: Inductor's CPU backend in
    torch 2.11 miscompiles it (the fused argmin returns indices rounded down to a multiple of 8);
    this one compiles correctly on 2.11 and 2.13. ``parallel_weight > 1``: score-aware codes
    (:mod:`..quant.score_aware`) over the same search; ``metric`` (``[Hkv, D, D]``): those codes
    then error-weighted (:func:`weigh_codes`).
    """
    if x.device.type == "cuda" and x.shape[2] > FLUSH_DIRECT_MAX:
        stored = torch.ops.vecinfer.encode(x, None, None, centroids, parallel_weight)
    else:
        entries, dims = centroids.shape

        def nearest(y: torch.Tensor) -> torch.Tensor:
            b, h, t, d = y.shape
            sub = y.reshape(b, h, t, d // dims, 1, dims)
            return ((sub - centroids) ** 2).sum(-1).argmin(-1)

        stored = pack_codes(score_aware_indices(x, centroids, parallel_weight, nearest), entries)
    return weigh_codes(x, stored, centroids, metric, parallel_weight)


def weigh_codes(
    x: torch.Tensor,
    stored: torch.Tensor,
    centroids: torch.Tensor,
    metric: torch.Tensor | None,
    parallel_weight: float = 1.0,
) -> torch.Tensor:
    """The stored codes ``[B, Hkv, T, W]`` (uint8, packed) of ``x: [B, Hkv, T, D]`` lowered under the
    error ``metric: [Hkv, D, D]`` by the opaque op ``vecinfer::weigh_codes``
    (:func:`~vecinfer_compile.quant.weighted_codes.weigh_stored`); ``stored`` itself when
    ``metric`` is None."""
    if metric is None:
        return stored
    return torch.ops.vecinfer.weigh_codes(x, stored, centroids, metric, parallel_weight)


def append_reference(
    key,
    value,
    k_codes,
    v_codes,
    k_window,
    v_window,
    n_coded,
    n_window,
    arrivals,
    k_centroids,
    v_centroids,
    key_mean,
    lam,
    key_matrix,
    key_parallel_weight=1.0,
    key_metric=None,
    value_metric=None,
) -> None:
    """The op's semantics in torch, without data-dependent Python (compiles with fullgraph=True):
    :func:`append_through_window` with the codebooks' codes. ``arrivals`` is unused."""
    append_through_window(
        transform_keys(key, key_mean, lam, key_matrix),
        value,
        k_codes,
        v_codes,
        k_window,
        v_window,
        n_coded,
        n_window,
        lambda x: encode_flush(x, k_centroids, key_parallel_weight, key_metric),
        lambda x: encode_flush(x, v_centroids, metric=value_metric),
    )


def append_through_window(
    kt, value, k_codes, v_codes, k_window, v_window, n_coded, n_window, encode_keys, encode_values
) -> None:
    """Append ``T`` tokens (``kt``: keys transformed, ``value``: ``[B, H, T, D]``) to a layer's buffers
    in place, without host syncs: ``encode_keys`` / ``encode_values`` map ``[B, H, T, D]`` to stored
    codes ``[B, H, T, W]``.

    Virtual sequence ``S = window[:w] ++ new[:T]``. The first ``f = w + T - min(w + T, R)``
    tokens of ``S`` are encoded into code slots ``n_coded .. n_coded + f``; the window becomes
    ``S[f:]``. ``S[v]`` sits at index ``v`` of ``cat(window, new)`` if ``v < w``, else at ``R + v
    - w``. Codes computed for ``S[f:T]`` are written to slots ``n_coded + f .. n_coded + T`` (in
    bounds when the tokens fit, beyond the new ``n_coded``, so never read) instead of branching."""
    t, r, tmax, dev = kt.shape[2], k_window.shape[2], k_codes.shape[2], kt.device
    c, w = n_coded, n_window
    ck = torch.cat([k_window, kt], dim=2)
    cv = torch.cat([v_window, value], dim=2)
    w_new = torch.clamp(w + t, max=r)
    f = w + t - w_new

    def source(virtual: torch.Tensor) -> torch.Tensor:
        idx = torch.where(virtual < w, virtual, virtual - w + r)
        return idx.clamp(0, r + t - 1)

    j = torch.arange(t, device=dev)
    flush = source(j)
    k_flush = encode_keys(ck.index_select(2, flush))
    v_flush = encode_values(cv.index_select(2, flush))
    pos = (c + j).clamp(max=tmax - 1)
    k_codes.index_copy_(2, pos, k_flush)
    v_codes.index_copy_(2, pos, v_flush)
    if r > 0:
        keep = source(f + torch.arange(r, device=dev))
        k_window.copy_(ck.index_select(2, keep))
        v_window.copy_(cv.index_select(2, keep))
    n_coded.add_(f)
    n_window.copy_(w_new)


def choose_append(
    key,
    value,
    k_codes,
    v_codes,
    k_window,
    v_window,
    n_coded,
    n_window,
    arrivals,
    k_centroids,
    v_centroids,
    key_mean,
    lam,
    key_matrix,
    key_parallel_weight=1.0,
    key_metric=None,
    value_metric=None,
) -> str:
    """``"cuda"`` or ``"torch"`` for a ``vecinfer::cache_append`` call on CUDA tensors (the op's
    arguments; shapes and dtypes only, so it works on fake tensors; may compile the kernel once).
    Several new tokens (a prefill chunk) always take the torch form, whose encode is the Triton
    kernel for many tokens; the request (:mod:`.kernel_request`) governs the one-token decode
    append. Score-aware key codes (``key_parallel_weight > 1``) and error-weighted codes
    (``key_metric``/``value_metric``) add the CUDA encoder of :mod:`.cuda.weigh` (a window is
    needed: it reads the leaving token there)."""
    if requested() == "triton" or int(key.shape[2]) != 1:
        return "torch"
    searched = cuda_append.is_searched(key_parallel_weight, key_metric, value_metric)
    reason = cuda_append.unsupported_reason(key, k_window, k_centroids, v_centroids, searched)
    level = logging.WARNING if searched else logging.INFO  # the torch search makes a decode step ~20x slower
    if reason is None:
        reason, level = (
            cuda_append.build_error(key, k_centroids, v_centroids, key_mean, lam, key_matrix, searched),
            logging.WARNING,
        )
    if reason is None:
        return "cuda"
    fall_back(reason, level, "the cache append runs as torch ops", "the cache append cannot run on CUDA")
    return "torch"


def _cache_append(*args) -> None:
    if args[0].device.type == "cuda" and choose_append(*args) == "cuda":
        torch.ops.vecinfer.cache_append_cuda(*args)
    else:
        append_reference(*args)


def record_undo(
    undo_counts: torch.Tensor,
    undo_kv: torch.Tensor,
    n_coded: torch.Tensor,
    n_window: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
) -> None:
    """``undo_counts`` (int64 ``[2]``) <- ``(n_coded, n_window)`` (0-d int64); ``undo_kv [2, B, H,
    D]`` <- slot 0 of ``k_window``/``v_window [B, H, R, D]`` (nothing when ``R == 0``). Two
    kernels (``stack`` into the buffers), not four copies: inside a decode step's CUDA graph every
    launch of every layer counts."""
    torch.stack((n_coded, n_window), out=undo_counts)
    if k_window.shape[2]:
        torch.stack((k_window[:, :, 0], v_window[:, :, 0]), out=undo_kv)


def register() -> None:
    define(
        "cache_append_cuda",
        cache_append_cuda,
        kind="opaque",
        schema="cache_append_cuda" + SCHEMA_ARGS,
        mutates=MUTATES,
        fake=lambda *args: None,
    )
    define("cache_append", _cache_append, kind="composite", schema="cache_append" + SCHEMA_ARGS)
    define("record_undo", record_undo, kind="opaque", mutates=UNDO_MUTATES, fake=lambda *args: None)


register()
