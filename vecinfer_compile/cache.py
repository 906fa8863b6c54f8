"""VecInferCache: a compileable Hugging Face ``Cache`` that stores K/V as VQ codes plus a small
full-precision window of the most recent tokens.

Use it like HF's ``StaticCache``::

    cache = VecInferCache(model, codebooks, max_cache_len=4096)   # batch size from the first update
    out = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=64)

(:func:`cache_kwargs` is ``{"cache": cache}`` on transformers that take ``cache=``, 5.24 on, and
``{"past_key_values": cache}`` before.)

See :class:`VecInferCache` for the exact semantics, :func:`cache_window_mask` for the same
semantics as a mask (used by the eager simulate path), and
:mod:`vecinfer_compile.passes.cache_decode` for the compiled decode rewrite.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer, StaticCache

from .hf import eager_decode
from .codebooks import VecInferCodebooks, model_geometry
from .hf.layer_kinds import HYBRID_KINDS, SLIDING, attention_kinds, check_codable, kv_producers, layer_kinds
from .methods import check_runs_over_codes
from .ops.append import transform_keys, weigh_codes
from .ops.split_attention import chunk as chunk_attention
from .ops.split_attention.chunk import ChunkKeys
from .ops.decode_inputs import chunk_mask_layout, kv_start_from_mask, mask_is_a_range, transform_queries
from .quant.packing import packed_width
from .quant.score_aware import check_parallel_weight
from .quant.weighted_codes import check_metric
from .hf.tensor_parallel import local_kv_heads, local_layer, model_shard, total_kv_bytes

__all__ = ["VecInferCache", "VecInferLayer", "cache_kwargs", "cache_window_mask"]


@functools.cache
def _generate_cache_keyword() -> str:
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:
        return "past_key_values"
    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"


def cache_kwargs(cache) -> dict:
    """The ``generate()`` keyword for a cache on the installed transformers: ``cache=`` where it
    exists (5.24 deprecates ``past_key_values=``), ``past_key_values=`` before."""
    return {_generate_cache_keyword(): cache}


def _ops():
    """Import (and so register) the vecinfer ops lazily: cache.py stays importable on its own."""
    from . import ops  # noqa: F401  registers vecinfer::encode / decode_attention / cache_append / cache_kv

    return torch.ops.vecinfer


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def cache_window_mask(tq: int, tk: int, residual: int, *, prefill: bool = False, device=None) -> torch.Tensor:
    """``[Tq, Tk]`` bool, True where key ``j`` is read in full precision by query ``i`` in a
    :class:`VecInferCache` forward of ``Tq`` new tokens over ``Tk`` cached slots (queries are the
    last ``Tq`` slots, bottom-right aligned, as in HF).

    - ``prefill=True`` (the first update of an empty cache): everything is full precision.
    - one new token (decode): key ``j`` is full precision iff ``(Tk - 1) - j < residual``, the
      simulate rule ``i - j < residual``.
    - a chunk of ``Tq >= 2`` tokens appended to a non-empty cache: the window as it was before the
      chunk and the chunk itself, i.e. iff ``j >= Tk - Tq - residual`` (the rule of
      :mod:`vecinfer_compile.ops.split_attention.chunk`): at least the simulate rule's keys for every query.

    Causality is not part of this mask (combine with the causal/padding mask as usual).
    """
    if prefill:
        return torch.ones(tq, tk, dtype=torch.bool, device=device)
    j = torch.arange(tk, device=device)
    full = (tk - 1 - j) < residual if tq == 1 else j >= tk - tq - residual
    return full[None, :].expand(tq, tk).clone()


log = logging.getLogger(__name__)
_logged: set[str] = set()

DECODE_READ_BYTES = 1 << 30  # dequantized + repeated K/V of one row group of an eager step whose mask the op cannot read


class VecInferLayer(CacheLayerMixin):
    """One decoder layer's compressed cache: static buffers, allocated up front.

    Buffers (``B`` batch, ``H`` KV heads, ``D`` head_dim, ``R`` residual):

    - ``k_codes [B, H, max_cache_len, Wk]``, ``v_codes [B, H, max_cache_len, Wv]`` uint8 stored
      codes, ``W = packed_width(D // d, entries)``: one byte per code for codebooks of <= 256
      entries, 12-bit codes packed two in three bytes above (:mod:`.quant.packing`), so physical
      bits equal nominal bits. Slot ``t < n_coded`` holds position ``t``.
    - ``k_window`` (transformed keys ``K~``), ``v_window`` (raw values) ``[B, H, R, D]`` in the
      model dtype: slot ``s < n_window`` holds position ``n_coded + s``.
    - ``n_coded``, ``n_window``: 0-d int64 tensors (never Python ints: no recompiles).
    - ``append_arrivals``: int32 ``[1]``, zero between updates: the CUDA append's arrival counter.
    - while ``record_past`` (transformers' deferred stop check, :func:`vecinfer_compile.defer_stop_check`):
      ``undo_counts`` (int64 ``[2]``: ``n_coded``, ``n_window``) and ``undo_kv [2, B, H, D]``
      (window slot 0 of K~ and V), the state before the last update, so :meth:`crop` ``(-1)`` can
      undo it.
    - ``key_centroids [Ek, dk]``, ``value_centroids [Ev, dv]``, ``lam [H, D]`` (or None), float32;
      ``rotation [D, D]`` float32 (or None), shared by all layers of a cache.
    - query-aware methods: ``key_matrix [H, D, D] = A @ H`` (keys into the code domain) and
      ``key_read [H, D, D] = (B @ H)^T`` (code domain back to keys; its transpose is the query
      side), float32, with the Hadamard folded in (``rotation`` is then None).
    - centring methods: ``key_mean [H, D]`` float32, ``mu``, subtracted before the rest of the
      transform (window and codes alike) and added back by the eager read; the compiled decode
      drops it (it shifts every score of a query by ``-q . mu``, which softmax ignores).
    """

    is_compileable = True
    is_croppable = True  # the last one-token step only, while recording its past (crop)
    is_sliding = False  # per layer from model_config (__init__)

    def __init__(
        self,
        *,
        batch_size: int | None,
        num_kv_heads: int,
        head_dim: int,
        max_cache_len: int,
        residual: int,
        dtype: torch.dtype,
        device,
        key_centroids: torch.Tensor,
        value_centroids: torch.Tensor,
        lam: torch.Tensor | None,
        rotation: torch.Tensor | None,
        layer_idx: int = 0,
        key_matrix: torch.Tensor | None = None,
        query_matrix: torch.Tensor | None = None,
        key_mean: torch.Tensor | None = None,
        model_config=None,
        key_parallel_weight: float = 1.0,
        key_metric: torch.Tensor | None = None,
        value_metric: torch.Tensor | None = None,
    ):
        super().__init__()
        _ops()  # register the ops now, never while tracing
        if residual < 0:
            raise ValueError(f"residual must be >= 0, got {residual}")
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        self.batch_size, self.num_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.k_head_dim = self.v_head_dim = head_dim
        self.max_cache_len, self.residual = max_cache_len, residual
        self.dtype, self.device, self.layer_idx = dtype, _indexed(device), layer_idx
        dk, dv = key_centroids.shape[1], value_centroids.shape[1]
        for dims, what in ((dk, "key"), (dv, "value")):
            if head_dim % dims:
                raise ValueError(
                    f"head_dim {head_dim} is not divisible by the {what} sub-vector size {dims}: "
                    "these codebooks do not fit this model"
                )
        _check_transform_heads(layer_idx, num_kv_heads, lam=lam, key_matrix=key_matrix, key_mean=key_mean)
        dev = self.device
        self.key_centroids = key_centroids.to(dev, torch.float32).contiguous()
        self.value_centroids = value_centroids.to(dev, torch.float32).contiguous()
        self.lam = None if lam is None else lam.to(dev, torch.float32).contiguous()
        self.rotation = None if rotation is None else rotation.to(dev, torch.float32).contiguous()
        self.key_mean = None if key_mean is None else key_mean.to(dev, torch.float32).contiguous()
        self.key_matrix = self.key_read = None
        if key_matrix is not None:  # A @ H and (B @ H)^T: one matmul each way, no separate rotation
            fold = (lambda m: m) if self.rotation is None else (lambda m: m @ self.rotation)
            self.key_matrix = fold(key_matrix.to(dev, torch.float32)).contiguous()
            self.key_read = fold(query_matrix.to(dev, torch.float32)).transpose(-1, -2).contiguous()
            self.rotation = None
        self.key_parallel_weight = check_parallel_weight(key_parallel_weight)
        if (key_metric is None) != (value_metric is None):
            raise ValueError("key_metric and value_metric go together (error-weighted codes of keys and values)")
        for metric in (key_metric, value_metric):
            if metric is not None:
                check_metric(metric, num_kv_heads, head_dim)
        self.key_metric = None if key_metric is None else key_metric.to(dev, torch.float32).contiguous()
        self.value_metric = None if value_metric is None else value_metric.to(dev, torch.float32).contiguous()
        self.model_config = model_config  # its attention implementation decides the eager reads
        # a coded sliding-window layer says so: transformers builds the sliding mask's sizes and query
        # offset from the first layer that does, else from layer 0, which may hold no K/V (RecurrentGemma's
        # recurrent layers)
        self.is_sliding = model_config is not None and attention_kinds(model_config)[layer_idx] == SLIDING
        self._empty = True  # Python flag: prefill (first update) vs decode; guarded by Dynamo
        self.is_initialized = False
        self.k_codes = self.v_codes = self.k_window = self.v_window = self.n_coded = self.n_window = None
        self.append_arrivals = None
        self.record_past = False  # Python flag, guarded by Dynamo: record the undo of each update
        self.undo_counts = self.undo_kv = None
        if batch_size is not None:
            self._allocate(batch_size)

    def _allocate(self, batch_size: int) -> None:
        """The static buffers for ``batch_size`` rows (eagerly, never while compiling)."""
        if _is_compiling():
            raise RuntimeError(
                "VecInferCache allocates its buffers at its first update, which ran inside compiled "
                "code: pass batch_size= when building the cache, or run the prefill eagerly (as generate() does)"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        b, h, dev = batch_size, self.num_heads, self.device
        dk, dv = self.key_centroids.shape[1], self.value_centroids.shape[1]
        self.batch_size = batch_size
        wk = packed_width(self.head_dim // dk, self.key_centroids.shape[0])
        wv = packed_width(self.head_dim // dv, self.value_centroids.shape[0])
        self.k_codes = torch.zeros(b, h, self.max_cache_len, wk, dtype=torch.uint8, device=dev)
        self.v_codes = torch.zeros(b, h, self.max_cache_len, wv, dtype=torch.uint8, device=dev)
        self.k_window = torch.zeros(b, h, self.residual, self.head_dim, dtype=self.dtype, device=dev)
        self.v_window = torch.zeros(b, h, self.residual, self.head_dim, dtype=self.dtype, device=dev)
        self.n_coded = torch.zeros((), dtype=torch.int64, device=dev)
        self.n_window = torch.zeros((), dtype=torch.int64, device=dev)
        self.append_arrivals = torch.zeros(1, dtype=torch.int32, device=dev)  # CUDA append scratch, zero between calls
        for t in [*self._static_tensors(), self.append_arrivals]:
            torch._dynamo.mark_static_address(t)
        self.is_initialized = True
        if self.record_past:
            self._allocate_undo()

    # -- bookkeeping -------------------------------------------------------------------------
    def _static_tensors(self) -> list[torch.Tensor]:
        ts = [self.k_codes, self.v_codes, self.k_window, self.v_window, self.n_coded, self.n_window,
              self.key_centroids, self.value_centroids, self.lam, self.rotation, self.key_matrix, self.key_read,
              self.key_mean, self.undo_counts, self.undo_kv]
        return [t for t in ts if t is not None]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        """Allocate for ``key_states``' batch size if the cache was built without one, then check."""
        if not self.is_initialized:
            self._allocate(key_states.shape[0])
        self._check_states(key_states, key_states if value_states is None else value_states)

    def _check_states(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() == v.dim() == 4 and k.shape[-1] != v.shape[-1]:
            raise NotImplementedError(
                f"VecInferCache layer {self.layer_idx} gets keys of head dim {k.shape[-1]} and values of "
                f"{v.shape[-1]}; VecInfer attention needs one head_dim (multi-head latent attention is not "
                "supported)"
            )
        for t, name in ((k, "key_states"), (v, "value_states")):
            if t.dim() != 4:
                raise ValueError(f"{name} must be [B, H_kv, T, D], got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(
                    f"VecInferCache layer {self.layer_idx} holds {self.dtype} but the model gives {name} in "
                    f"{t.dtype}: build the cache with dtype={t.dtype} (or load the model in {self.dtype})"
                )
            if t.shape[-1] != self.head_dim:
                raise ValueError(
                    f"{name} have head_dim {t.shape[-1]} but the cache was built for {self.head_dim}: "
                    "build the cache from this model's config"
                )
            if t.shape[1] != self.num_heads:
                raise ValueError(
                    f"{name} have {t.shape[1]} KV heads but the cache was built for {self.num_heads}: "
                    "build the cache from this model (under tensor parallelism pass the model itself, "
                    "VecInferCache(model, ...), not its config: each rank holds only its own KV heads)"
                )
            if t.shape[0] != self.batch_size:
                raise ValueError(
                    f"{name} have batch size {t.shape[0]} but the cache was built for batch_size="
                    f"{self.batch_size}: build a VecInferCache with batch_size={t.shape[0]} (or none: it "
                    "then takes the first update's)"
                )
            if t.device != self.device:
                raise ValueError(f"{name} are on {t.device} but the cache is on {self.device}: pass device=")

    def _overflow(self, total) -> ValueError:
        return ValueError(
            f"VecInferCache layer {self.layer_idx}: {total} tokens do not fit max_cache_len="
            f"{self.max_cache_len}: increase max_cache_len (prompt length + max_new_tokens)"
        )

    def transform_keys(self, k: torch.Tensor) -> torch.Tensor:
        """``K~ = ((K - mu) / lam) @ H`` (or ``(K - mu) @ key_matrix``; ``mu`` only when centred)
        computed in float32, returned in the cache dtype."""
        return transform_keys(k, self.key_mean, self.lam, self._key_matrix()).to(self.dtype)

    def _key_matrix(self) -> torch.Tensor | None:
        """The one matrix of the key transform: ``key_matrix`` (query-aware, Hadamard folded in)
        or the rotation."""
        return self.key_matrix if self.key_matrix is not None else self.rotation

    # -- update --------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._allocate(key_states.shape[0])
        self._check_states(key_states, value_states)
        if self._empty:
            return self._prefill(key_states, value_states)
        return self._append(key_states, value_states)

    def _prefill(self, k: torch.Tensor, v: torch.Tensor):
        """First update of an empty cache: store, and return the full-precision K/V as given."""
        ops = torch.ops.vecinfer
        t = k.shape[2]
        if t > self.max_cache_len:
            raise self._overflow(t)
        kt = self.transform_keys(k)
        n_code = max(t - self.residual, 0)
        n_win = t - n_code
        if n_code > 0:
            k_code, v_code = kt[:, :, :n_code], v[:, :, :n_code]
            k_stored = ops.encode(k_code, None, None, self.key_centroids, self.key_parallel_weight)
            v_stored = ops.encode(v_code, None, None, self.value_centroids)
            self.k_codes[:, :, :n_code].copy_(weigh_codes(k_code, k_stored, self.key_centroids, self.key_metric,
                                                          self.key_parallel_weight))
            self.v_codes[:, :, :n_code].copy_(weigh_codes(v_code, v_stored, self.value_centroids, self.value_metric))
        if n_win > 0:
            self.k_window[:, :, :n_win].copy_(kt[:, :, n_code:])
            self.v_window[:, :, :n_win].copy_(v[:, :, n_code:])
        self.n_coded.fill_(n_code)
        self.n_window.fill_(n_win)
        self._empty = False
        if _is_compiling():  # marked: the backend keeps this attention in full precision
            return torch.ops.vecinfer.prefill_read(k, v)
        return k, v

    def _append(self, k: torch.Tensor, v: torch.Tensor):
        """Append ``T`` tokens with ``vecinfer::cache_append`` (:mod:`.ops.append`: no
        data-dependent Python, so it compiles with fullgraph=True; one CUDA launch per decode
        step where the kernel runs), then return what attention reads.

        One token reads the layer after the append. A chunk of several reads what the rule of
        :mod:`.ops.split_attention.chunk` says: the coded slots and the window as they were before the
        append, then its own tokens in full precision; what it needs of the old state is taken
        before the append (the append writes only code slots at or after ``n_coded``)."""
        t = k.shape[2]
        if self.record_past:
            self._record_undo()
        if _is_compiling():
            before = self._read(torch.ops.vecinfer) if t > 1 else None
            self._cache_append(k, v)
            if before is None:
                return self._read(torch.ops.vecinfer)
            return self._with_chunk(before, k, v, self.max_cache_len)
        n_coded, n_window = int(self.n_coded), int(self.n_window)  # host syncs: eager only
        held = n_coded + n_window
        if held + t > self.max_cache_len:
            raise self._overflow(held + t)
        codes = eager_decode.is_active(self.model_config)
        chunk = before = None
        if t > 1 and codes:
            chunk = self._chunk_keys(k, v, n_coded, n_window)
        elif t > 1:
            before = self._read(torch.ops.vecinfer, held)
        self._cache_append(k, v)
        # every slot, as the compiled step's read (generate() may build the step's mask before it
        # knows whether the step runs compiled: get_mask_sizes)
        if codes:
            shape = (self.batch_size, self.num_heads, self.max_cache_len, self.head_dim)
            return eager_decode.codes_read(self, shape, self.dtype, self.device, chunk)
        if before is not None:
            return self._with_chunk(before, k, v, self.max_cache_len)
        return self._read(torch.ops.vecinfer)

    def _cache_append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        torch.ops.vecinfer.cache_append(
            k, v, self.k_codes, self.v_codes, self.k_window, self.v_window, self.n_coded, self.n_window,
            self.append_arrivals, self.key_centroids, self.value_centroids, self.key_mean, self.lam,
            self._key_matrix(), self.key_parallel_weight, self.key_metric, self.value_metric,
        )

    def _chunk_keys(self, k: torch.Tensor, v: torch.Tensor, n_coded: int, n_window: int) -> ChunkKeys:
        """What a chunk's attention over the codes needs, before the append: the window's
        ``n_window`` slots then the chunk, position-major, keys transformed."""
        kt = self.transform_keys(k)
        k_full = torch.cat([self.k_window[:, :, :n_window].transpose(1, 2), kt.transpose(1, 2)], dim=1)
        v_full = torch.cat([self.v_window[:, :, :n_window].transpose(1, 2), v.transpose(1, 2)], dim=1)
        return ChunkKeys(self.k_codes, self.v_codes, self.key_centroids, self.value_centroids, n_coded,
                         k_full, v_full)

    def _with_chunk(self, before: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized read of a chunk (``[B, H, length, D]``, original key domain, zeros past
        the valid slots): ``before`` (the layer's read before the append: its valid slots, or every
        slot when compiling) with the chunk's own ``k``, ``v`` at the slots after the tokens held
        before."""
        held = self.n_coded + self.n_window - k.shape[2]  # after the append, less the chunk
        rk, rv = before
        if rk.shape[2] < length:
            pad = (0, 0, 0, length - rk.shape[2])
            rk, rv = F.pad(rk, pad), F.pad(rv, pad)
        pos = (held + torch.arange(k.shape[2], device=k.device)).clamp(max=length - 1)
        return rk.index_copy(2, pos, k), rv.index_copy(2, pos, v)

    def attend(self, q: torch.Tensor, attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        """Decode attention of one query token over this layer's codes and window:
        ``vecinfer::decode_attention`` (the compiled decode step's op). ``q: [B, Hq, 1, D]`` in the
        model dtype (``Hq`` a multiple of ``H``); ``attn_mask``: None or HF's ``[B|1, 1|Hq, 1, L]``
        (bool True = attend, or additive float): left padding, the first attended slot of each
        row, is all the op reads, so a mask that is more than that (holes, per-head differences,
        a bias: checked, one host sync) gets SDPA over the dequantized cache instead, a few rows
        at a time; ``scale``: None for ``D ** -0.5``. Returns ``[B, Hq, 1, D]``."""
        kv_start = None
        if attn_mask is not None:
            if attn_mask.dim() != 4:
                raise ValueError(f"attn_mask must be 4-d [B, H, 1, L], got {tuple(attn_mask.shape)}")
            kv_start = kv_start_from_mask(attn_mask, q)
            if not bool(mask_is_a_range(attn_mask, kv_start, self.n_coded + self.n_window)):  # host sync
                if "mask" not in _logged:
                    _logged.add("mask")
                    log.info("vecinfer: an eager decode mask is not left padding over the valid slots (holes, "
                             "per-head differences or a bias): that step attends over the dequantized cache")
                return self._sdpa_by_rows(q, attn_mask, scale, attn_mask.shape[-1])
        q_t = transform_queries(q, self.lam, self.rotation, self.key_read)
        scale = self.head_dim ** -0.5 if scale is None else float(scale)
        return torch.ops.vecinfer.decode_attention(
            q_t, self.k_codes, self.v_codes, self.key_centroids, self.value_centroids, self.n_coded,
            self.k_window, self.v_window, self.n_window, kv_start, scale,
        )

    def attend_chunk(self, q: torch.Tensor, attn_mask: torch.Tensor | None, scale: float | None,
                     keys: ChunkKeys) -> torch.Tensor:
        """Attention of an eager chunk of ``C`` query tokens over this layer by the rule of
        :mod:`.ops.split_attention.chunk` (``keys``: what :meth:`_chunk_keys` took before the append):
        the coded prefix and the full-precision window and chunk, merged by log-sum-exp, on CUDA
        without any dequantized copy of the whole batch. ``q: [B, Hq, C, D]``; ``attn_mask``: HF's
        ``[B|1, 1|Hq, C, S]`` over the cache's ``S = max_cache_len`` slots (or the ``L =
        keys.length`` valid ones; bool True = attend, or additive float), or None for bottom-right
        causal over the ``L`` valid slots. Left padding is read from the mask; a mask that is more
        than causal + left padding over the valid slots (checked once per mask, one host sync) is
        applied as it is by the dense path. Returns ``[B, Hq, C, D]``."""
        c, length = q.shape[2], keys.length
        kv_start = explicit = None
        if attn_mask is not None:
            if attn_mask.dim() != 4 or attn_mask.shape[-1] not in (length, self.max_cache_len) \
                    or attn_mask.shape[-2] != c:
                raise ValueError(f"attn_mask must be [B, H, {c}, {self.max_cache_len}] (the chunk over the cache's "
                                 f"slots), got {tuple(attn_mask.shape)}")
            kv_start = kv_start_from_mask(attn_mask, q)
            standard, padded = chunk_mask_layout(attn_mask, kv_start, length)
            attn_mask = attn_mask[..., :length]
            if not padded:
                kv_start = None  # the fast path's prefix then runs cuDNN (no per-row key start)
            if not standard:
                explicit = attn_mask
                if "chunk mask" not in _logged:
                    _logged.add("chunk mask")
                    log.info("vecinfer: an eager chunk's mask is more than causal + left padding: that chunk "
                             "attends by the dense path (SDPA over its slots dequantized, a few rows at a time)")
        q_t = transform_queries(q, self.lam, self.rotation, self.key_read)
        scale = self.head_dim ** -0.5 if scale is None else float(scale)
        return chunk_attention.attend(q_t, keys, kv_start, scale, explicit)

    def _sdpa_by_rows(self, q: torch.Tensor, attn_mask: torch.Tensor, scale: float | None, length: int) -> torch.Tensor:
        """SDPA of ``q: [B, Hq, T, D]`` over the first ``length`` slots dequantized, with
        ``attn_mask: [B|1, 1|Hq, T, length]``, a row group at a time (:data:`DECODE_READ_BYTES`)."""
        b, hq, t, d = q.shape
        group = hq // self.num_heads
        per_row = 2 * (1 + group) * self.num_heads * length * d * torch.finfo(self.dtype).bits // 8
        rows = max(1, DECODE_READ_BYTES // max(per_row, 1))
        out = q.new_empty((b, hq, t, d))
        for i in range(0, b, rows):
            j = min(i + rows, b)
            k, v = self._read(torch.ops.vecinfer, length, slice(i, j))
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
            mask = attn_mask if attn_mask.shape[0] == 1 else attn_mask[i:j]
            out[i:j] = F.scaled_dot_product_attention(q[i:j], k, v, attn_mask=mask, scale=scale)
            del k, v
        return out

    def _read(self, ops, length: int | None = None, rows: slice = slice(None),
              window: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``vecinfer::cache_kv`` (K in the original domain, V), then, for the query-aware
        methods, ``K = (K~.float() @ key_read).to(dtype)`` (a plain matmul that
        :mod:`~vecinfer_compile.passes.cache_decode` recognises and moves to the query side), and
        for the centring methods ``+ key_mean`` before the cast (which that pass drops). Slots
        beyond the valid length then hold ``mu`` rather than zeros; the mask hides them.

        ``length``: read the first ``length`` slots only (``[B, H, length, D]``; eager);
        ``rows``: these batch rows only (eager); ``window``: ``(n_coded, k_window, v_window,
        n_window)`` read in place of the layer's own (eager; windows ``[B, H, w, D]``, keys transformed)."""
        k_codes, v_codes = self.k_codes[rows], self.v_codes[rows]
        if length is not None:
            k_codes, v_codes = k_codes[:, :, :length], v_codes[:, :, :length]
        n_coded, k_window, v_window, n_window = window or (self.n_coded, self.k_window, self.v_window, self.n_window)
        k, v = ops.cache_kv(
            k_codes, v_codes, self.key_centroids, self.value_centroids, n_coded,
            k_window[rows], v_window[rows], n_window, self.lam, self.rotation,
        )
        if self.key_read is None and self.key_mean is None:
            return k, v
        k = k.float()
        if self.key_read is not None:
            k = k @ self.key_read
        if self.key_mean is not None:
            k = k + self.key_mean[None, :, None, :]
        return k.to(self.dtype), v

    # -- reads ---------------------------------------------------------------------------------
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager: the full-length ``[B, H, max_cache_len, D]`` K (original domain) and V the
        cache stands for (zeros beyond the valid length; ``mu`` for K when centred)."""
        if not self.is_initialized:
            raise RuntimeError("this VecInferCache layer holds nothing yet (it allocates at its first update)")
        return self._read(_ops())

    def dense_read(self, chunk: ChunkKeys | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager: the ``[B, H, max_cache_len, D]`` K (original domain) and V that an eager step's
        codes read stands for (:mod:`.hf.eager_decode`), zeros past the valid slots: after one token,
        every slot (:meth:`dequantized`); after a chunk (``chunk``: what :meth:`_chunk_keys` took
        before its append), the coded slots before it, then the old window and the chunk in full
        precision, the rule of :mod:`.ops.split_attention.chunk`."""
        if chunk is None:
            return self.dequantized()
        full = torch.tensor(chunk.k_full.shape[1], device=self.device)
        window = (torch.tensor(chunk.n_coded, device=self.device), chunk.k_full.transpose(1, 2),
                  chunk.v_full.transpose(1, 2), full)
        return self._read(_ops(), window=window)

    @property
    def keys(self) -> torch.Tensor | None:
        """What transformers code that reads a cache layer's K directly gets (Mllama asks whether a
        layer holds anything; compiled, it reads nothing): eagerly a codes read
        (:mod:`.hf.eager_decode`: no memory; any op on it reads the layer dequantized), compiled
        the dequantized K of every slot; None before the first update."""
        return self._direct_read(0)

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ sets None; the codes are the storage
        if value is not None:
            raise AttributeError("a VecInferCache layer's K/V are its codes: update() it instead")

    @property
    def values(self) -> torch.Tensor | None:
        """V as :attr:`keys` gives K."""
        return self._direct_read(1)

    @values.setter
    def values(self, value) -> None:
        self.keys = value

    def _direct_read(self, index: int) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        if _is_compiling():
            return self._read(torch.ops.vecinfer)[index]
        shape = (self.batch_size, self.num_heads, self.max_cache_len, self.head_dim)
        return eager_decode.codes_read(self, shape, self.dtype, self.device)[index]

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older signature: cache_position
            query_length = query_length.shape[0]
        if self._empty:  # prefill returns only the new tokens, in full precision
            return query_length, 0
        # every later step, one token or a chunk, eager or compiled: every slot (the mask hides the
        # empty ones). Static because generate() may build the mask eagerly and run the step compiled
        # (a chunked prefill with a compile config: a mask as long as the valid slots then met the
        # compiled full-length read and failed)
        return self.max_cache_len, 0

    def get_seq_length(self, *args, **kwargs):
        if self._empty:
            return 0
        return self.n_coded + self.n_window

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def kv_bytes(self) -> int:
        seen, total = set(), 0
        for t in self._static_tensors():
            key = (t.data_ptr(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    # -- lifecycle -------------------------------------------------------------------------------
    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.k_codes, self.v_codes, self.k_window, self.v_window, self.n_coded, self.n_window,
                      self.append_arrivals):
                t.zero_()
        self._empty = True

    # -- undoing the last step (transformers' deferred stop check) -----------------------------
    def activate_past_recording(self, **kwargs) -> None:
        """From now on every update first records what :meth:`crop` ``(-1)`` needs to undo it: the
        counters and window slot 0 (the token a full window moves into the codes), a copy of a
        few bytes. ``generate()`` calls this (through ``Cache.activate_past_recording``) when it
        defers its stop check by a step, and sets ``record_past`` back to False when it is done."""
        self.record_past = True
        if self.is_initialized:  # else _allocate makes them with the other buffers
            self._allocate_undo()

    def _allocate_undo(self) -> None:
        if self.undo_kv is None or self.undo_kv.shape[1] != self.batch_size:
            self.undo_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
            self.undo_kv = torch.zeros(2, self.batch_size, self.num_heads, self.head_dim, dtype=self.dtype,
                                       device=self.device)
            for t in (self.undo_counts, self.undo_kv):
                torch._dynamo.mark_static_address(t)

    def _record_undo(self) -> None:
        torch.ops.vecinfer.record_undo(self.undo_counts, self.undo_kv, self.n_coded, self.n_window,
                                       self.k_window, self.v_window)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(0)`` does nothing; ``crop(-1)`` undoes the last update, when it appended one
        token while the layer recorded its past (:meth:`activate_past_recording`): the counters go
        back and, when that token pushed the window's oldest one into the codes, the window
        shifts back and gets it again in full precision (the code it left behind sits beyond
        ``n_coded``, unread, and is overwritten by the next step). Nothing else can be undone."""
        if tokens_to_remove == 0:
            return
        if tokens_to_remove != -1 or not self.record_past:
            raise NotImplementedError(
                f"VecInferCache can drop only the last token of a decode step, and only while it records its past "
                f"(got crop({tokens_to_remove}), recording: {self.record_past}): tokens that left the full-precision "
                "window are encoded; reset() it and prefill again (assisted or speculative decoding, which crops "
                "rejected drafts, needs a cache that keeps every token: transformers' DynamicCache)"
            )
        was_coded, was_window = self.undo_counts.tolist()
        was = was_coded + was_window
        if int(self.n_coded) + int(self.n_window) != was + 1:
            raise NotImplementedError(
                f"VecInferCache layer {self.layer_idx}: the last update appended "
                f"{int(self.n_coded) + int(self.n_window) - was} tokens; only a one-token step can be undone"
            )
        if self.residual and int(self.n_coded) > was_coded:  # the window's oldest left it
            for window, oldest in ((self.k_window, self.undo_kv[0]), (self.v_window, self.undo_kv[1])):
                window[:, :, 1:].copy_(window[:, :, :-1].clone())
                window[:, :, 0].copy_(oldest)
        self.n_coded.fill_(was_coded)
        self.n_window.fill_(was_window)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        for t in (self.k_codes, self.v_codes, self.k_window, self.v_window):
            t.copy_(t.index_select(0, idx))

    def row_view(self, start: int, stop: int) -> "VecInferLayer":
        """An empty layer over rows ``[start, stop)`` of this one's buffers (views: what it
        stores lands here) with counters of its own; :meth:`VecInferCache.filling_rows` uses it."""
        part = copy.copy(self)
        part.batch_size = stop - start
        for name in ("k_codes", "v_codes", "k_window", "v_window"):
            setattr(part, name, getattr(self, name)[start:stop])
        part.n_coded, part.n_window = torch.zeros_like(self.n_coded), torch.zeros_like(self.n_window)
        part.append_arrivals = torch.zeros_like(self.append_arrivals)
        part._empty = True
        return part

    def take_length(self, part: "VecInferLayer", rows: str) -> None:
        """Adopt the counters of ``part`` (a filled :meth:`row_view`): the first group filled sets
        them, every later one must end at the same length."""
        got = (int(part.n_coded), int(part.n_window))
        if self._empty:
            self.n_coded.copy_(part.n_coded)
            self.n_window.copy_(part.n_window)
            self._empty = part._empty
        elif got != (int(self.n_coded), int(self.n_window)):
            raise ValueError(
                f"VecInferCache layer {self.layer_idx}: rows {rows} hold {sum(got)} tokens but the rows filled "
                f"before hold {int(self.n_coded) + int(self.n_window)}: fill every row group to the same length "
                "(one length per cache; left-pad shorter prompts)"
            )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("VecInferCache has a fixed batch size: build it with the expanded batch_size")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("VecInferCache has a fixed batch size: build a new cache for the selected rows")

    def offload(self):  # static buffers stay on device
        pass

    def prefetch(self):
        pass


class VecInferHybridLayer(VecInferLayer, LinearAttentionLayer):
    """A coded layer of a hybrid model, attention beside a state-space mixer in one layer
    (:mod:`.hf.layer_kinds`; transformers' ``LinearAttentionAndStaticFullAttentionLayer`` otherwise):
    the attention's K/V as codes (:class:`VecInferLayer`), the mixer's conv and recurrent states
    as transformers' ``LinearAttentionLayer`` keeps them (``update_conv_state`` /
    ``update_recurrent_state``, ``number_of_states`` of each, static addresses). Takes
    VecInferLayer's arguments besides."""

    is_croppable = False  # the mixer's state is not recorded for an undo

    def __init__(self, number_of_states: int = 1, **kwargs):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        VecInferLayer.__init__(self, **kwargs)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # the attention's update: (key_states, value_states)
            VecInferLayer.lazy_initialization(self, *args, **kwargs)
        else:  # the mixer's: conv_states= / recurrent_states=, state_idx=
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        VecInferLayer.reset(self)
        LinearAttentionLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        VecInferLayer.reorder_cache(self, beam_idx)
        LinearAttentionLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("this hybrid layer's mixer state cannot be rolled back with its attention's: "
                                      "a step cannot be undone (generate() then keeps its per-step stop check)")

    def row_view(self, start: int, stop: int) -> "VecInferLayer":
        raise NotImplementedError("filling_rows needs every layer's state per row; this hybrid model's mixer "
                                  "state is not: prefill the whole batch")


def _check_generate_masks(config) -> None:
    """Raise a NotImplementedError when transformers' ``generate()`` would mask a sliding layer of
    ``config`` as full attention: with any static cache it builds the masks from
    ``masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``, which maps ``"hybrid_sliding"`` to a
    full causal mask in transformers 5.24 (Inkling); such a mask, as long as the cache, meets the
    layer's window (its own StaticCache fails alike)."""
    from transformers import masking_utils

    table = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    for kind in sorted(set(layer_kinds(config))):
        mask = table.get(kind)
        mask = mask.get(SLIDING) if isinstance(mask, dict) else mask
        if HYBRID_KINDS.get(kind, kind) == SLIDING and mask is masking_utils.create_causal_mask:
            raise NotImplementedError(
                f"transformers' generate() masks this model's {kind} layers as full attention with any static "
                "cache (its own StaticCache fails too): generate with transformers' DynamicCache"
            )


def _check_transform_heads(layer_idx: int, num_kv_heads: int, **state: torch.Tensor | None) -> None:
    """Raise a ValueError unless the per-KV-head key transform (``lam [H, D]``, ``key_matrix
    [H, D, D]``, ``key_mean [H, D]``) has the cache's ``num_kv_heads`` heads. Calibration records
    the K/V attention receives: more heads there than the model caches means its attention reads
    K/V built from the cache's after the update (JetMoE repeats them per expert), whose per-head
    transform the cached heads cannot take."""
    for name, t in state.items():
        if t is not None and t.shape[0] != num_kv_heads:
            raise ValueError(
                f"VecInferCache layer {layer_idx}: the codebooks' {name} is for {t.shape[0]} KV heads but the "
                f"model caches {num_kv_heads} (its attention repeats K/V after the cache): calibrate method='vq' "
                "or 'hadamard'"
            )


def held_tensors(layer) -> list[torch.Tensor]:
    """The tensors one layer of a VecInferCache holds: a VecInferLayer's static buffers and
    codebook state, then :func:`full_precision_tensors`."""
    coded = layer._static_tensors() if isinstance(layer, VecInferLayer) else []
    return coded + full_precision_tensors(layer)


def full_precision_tensors(layer) -> list[torch.Tensor]:
    """What one layer of a VecInferCache holds besides codes: a transformers layer's tensors (its
    K/V once allocated, counters, linear-attention states), a hybrid layer's conv/recurrent states
    (linear-attention layers keep those in dicts by state index)."""
    found = []
    for value in vars(layer).values():
        if isinstance(value, dict):
            found += [t for t in value.values() if isinstance(t, torch.Tensor)]
        elif isinstance(value, torch.Tensor) and not isinstance(layer, VecInferLayer):
            found.append(value)
    return found


def _indexed(device) -> torch.device:
    """``device`` with its index: ``"cuda"`` is the current CUDA device (``cuda:0``), so that states
    on it pass the device check."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _config_of(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _check_takes_a_generic_cache(model: torch.nn.Module) -> None:
    """Raise a ValueError when ``model``'s transformers module defines a cache class of its own
    (MiniMax's ``MiniMaxCache``): such a model refuses any other cache, a VecInferCache included."""
    import inspect
    import sys

    module = sys.modules.get(type(model).__module__)
    own = [name for name, obj in (vars(module) if module else {}).items()
           if inspect.isclass(obj) and issubclass(obj, Cache) and obj.__module__ == module.__name__]
    if own:
        raise ValueError(f"{type(model).__name__} keeps a cache class of its own ({', '.join(own)}) and accepts "
                         "no other, so a VecInferCache cannot hold its K/V: use the simulate path "
                         "(vecinfer_compile.simulation) to measure accuracy, or transformers' own cache")


def _dtype_of(model_or_config, config) -> torch.dtype:
    dtype = getattr(model_or_config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


class VecInferCache(Cache):
    """A transformers ``Cache`` holding a VecInfer-compressed KV cache; compileable.

    ``VecInferCache(model_or_config, codebooks, *, max_cache_len, batch_size=None, residual=128,
    dtype=None, device=None)``; ``dtype``/``device`` default to the model's (or the config's
    dtype, then float32, and CPU). Without ``batch_size`` the buffers are allocated at the first
    update, for its batch size, as transformers' static layers do (that update must run eagerly,
    as ``generate()``'s prefill does; pass ``batch_size`` to allocate up front).

    Semantics (positions are cache slots: with left padding, slot = index in the padded row):

    - **Prefill** (the first update of an empty layer; ``generate()`` runs it eagerly): ``update``
      returns the given K/V unchanged, so the prompt attends in full precision. It stores all but
      the last ``R = residual`` tokens as codes ``encode(K~)`` / ``encode(V)`` and keeps the last
      ``R`` in the window (keys transformed, ``K~ = ((K - mu) / lam) @ H``, in the cache dtype; ``mu``
      the key mean of the centring methods, else 0).
    - **Decode** (every later update, usually one token): the new tokens are appended to the
      window; tokens pushed out of it are encoded from their stored ``K~``/``V`` and moved to the
      codes. After each update exactly the last ``min(R, length)`` tokens are in full precision:
      the decode query at slot ``i`` reads key ``j`` in full precision iff ``i - j < R``, older
      keys from codes (``keys_inverse(decode(codes))``).
    - **A chunk** of several tokens appended to a non-empty cache (a chunked prefill, ``generate()``
      with ``prefill_chunk_size``) attends over the coded slots, the window as it was before the
      chunk and its own tokens, the last two in full precision, and is encoded only after: the
      rule of :mod:`vecinfer_compile.ops.split_attention.chunk`, where it is written once. So no query
      sees fewer than its last ``R`` keys in full precision. :func:`cache_window_mask` states
      these rules as masks.
    - **What decode returns**: full-length ``[B, H_kv, max_cache_len, D]`` dequantized K
      (original domain) and V, zero beyond the valid length; HF's mask (``get_mask_sizes`` ->
      ``max_cache_len``, padding, cache position) makes attention exact over them. Compiled,
      that is ``vecinfer::cache_kv`` over every slot, which
      :func:`vecinfer_compile.passes.cache_decode.rewrite_cache_attention` replaces, with the
      SDPA that reads it, by ``vecinfer::decode_attention`` over the codes. Eagerly too, one token
      or a chunk gets every slot (generate() may build a step's mask eagerly and run the step
      compiled): as a *codes read* when the model attends with ``"vecinfer_sdpa"`` (which
      ``VecInferCache(model, ...)`` switches an SDPA model to), which holds no memory and makes the
      attention run the same decode op, or for a chunk the chunk attention over the codes
      (:mod:`vecinfer_compile.hf.eager_decode`); otherwise dequantized (a chunk's with its own tokens
      in place, by the same rule; compiled too).
    - Codes of a token are ``encode(K~ rounded to the cache dtype)``: identical to the simulate
      path in float32; in bf16/fp16 the simulate path encodes the float32 ``K~`` (argmin may
      differ on near-ties).

    No full-precision copy of older tokens is kept anywhere. :meth:`kv_bytes` counts every byte
    held (codes, windows, codebooks, lam, rotation or query-aware matrices, key means, counters).
    Croppable by the last one-token step only, while it records its past (what transformers'
    deferred stop check needs: :func:`vecinfer_compile.defer_stop_check`); encoded tokens are
    never un-flushed otherwise. Fixed batch size. Models that mix
    attention kinds have codes in the layers :mod:`vecinfer_compile.hf.layer_kinds` names (their
    full-attention layers; every layer of a model whose every layer slides) and transformers' own
    static layers elsewhere (sliding or chunked windows in full precision, linear-attention state,
    nothing for a layer that reads another layer's K/V); a coded hybrid layer (attention beside a
    state-space mixer) also keeps the mixer's state (:class:`VecInferHybridLayer`).
    :meth:`coded_layers` lists the coded ones, :meth:`kv_bytes` counts both kinds.

    Tensor parallelism (a model loaded with ``tp_plan="auto"`` under ``torchrun``): pass the
    model, not its config; the cache finds the rank's KV heads from the model's device mesh
    (:mod:`vecinfer_compile.hf.tensor_parallel`) and allocates ``[B, H_kv / N, ...]`` buffers, with
    the smoothing factors / query-aware matrices / key means cut to those heads and the codebooks whole.
    ``tp_shard`` is the shard (None without TP); :meth:`kv_bytes` is per rank,
    :meth:`total_kv_bytes` all ranks.
    """

    def __init__(
        self,
        model_or_config,
        codebooks: VecInferCodebooks,
        *,
        max_cache_len: int,
        batch_size: int | None = None,
        residual: int = 128,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        config = _config_of(model_or_config)
        if isinstance(model_or_config, torch.nn.Module):
            from .simulate import is_simulating

            _check_takes_a_generic_cache(model_or_config)

            if is_simulating(model_or_config):
                raise ValueError(
                    "this model has simulation on (enable_simulation): generating with a VecInferCache "
                    "would quantize K/V twice and run ~8x slower. Call disable_simulation(model) first, "
                    "or simulate inside `with vecinfer_compile.simulation(model, ...):` only"
                )
        if not isinstance(codebooks, VecInferCodebooks):
            raise TypeError(
                f"codebooks must be a VecInferCodebooks (load_codebooks(path) or calibrate(...)), got "
                f"{type(codebooks).__name__}"
            )
        check_runs_over_codes(codebooks.method)
        codebooks.check_model(config)
        if isinstance(model_or_config, torch.nn.Module):  # warns once if calibrated on other weights
            codebooks.check_weights(model_or_config)
        coded = check_codable(config, residual)
        _check_generate_masks(config)
        geometry = model_geometry(config)
        if dtype is None:
            dtype = _dtype_of(model_or_config, config)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if device is None:
            device = getattr(model_or_config, "device", None) or "cpu"
        head_dim = geometry["head_dim"]
        self.tp_shard = model_shard(model_or_config)  # None unless the model is tensor parallel
        heads, num_kv_heads = local_kv_heads(self.tp_shard, geometry["num_kv_heads"])
        rotation_cache: dict[bool, torch.Tensor | None] = {}
        # the layers that hold no codes: transformers' own static layers for their kind (bounded
        # sliding/chunked windows, linear-attention state; nothing for a layer that reads another's
        # K/V), allocated at their first update
        kinds = layer_kinds(config)
        stores = [c and p == i for i, (c, p) in enumerate(zip(coded, kv_producers(config)))]
        static = StaticCache(config=config, max_cache_len=max_cache_len).layers
        layers = []
        for i in range(geometry["num_layers"]):
            if not stores[i]:
                layers.append(static[i])
                continue
            lc = codebooks.layer(i) if self.tp_shard is None else local_layer(codebooks.layer(i), heads)
            rotate = bool(lc.transform.rotate)
            if rotate not in rotation_cache:  # one rotation tensor shared by all layers
                rotation_cache[rotate] = lc.transform.rotation(torch.float32, device)
            mixer = {"number_of_states": static[i].number_of_states} if kinds[i] in HYBRID_KINDS else {}
            layers.append(
                (VecInferHybridLayer if mixer else VecInferLayer)(
                    **mixer,
                    batch_size=batch_size,
                    num_kv_heads=num_kv_heads,
                    head_dim=head_dim,
                    max_cache_len=max_cache_len,
                    residual=residual,
                    dtype=dtype,
                    device=device,
                    key_centroids=lc.key_centroids,
                    value_centroids=lc.value_centroids,
                    lam=lc.transform.lam,
                    rotation=rotation_cache[rotate],
                    layer_idx=i,
                    key_matrix=lc.transform.key_matrix,
                    query_matrix=lc.transform.query_matrix,
                    key_mean=lc.transform.mean,
                    model_config=config,
                    key_parallel_weight=codebooks.key_parallel_weight,
                    key_metric=lc.key_metric,
                    value_metric=lc.value_metric,
                )
            )
        super().__init__(layers=layers)
        self.codebooks = codebooks
        # (no `max_cache_len` attribute: transformers 5.17 has a read-only property of that name;
        # use get_max_length())
        self.residual, self.dtype, self.device = residual, dtype, _indexed(device)
        if isinstance(model_or_config, torch.nn.Module):
            eager_decode.use_codes_attention(model_or_config)

    @contextlib.contextmanager
    def filling_rows(self, start: int, stop: int):
        """Prefill rows ``[start, stop)`` of this cache on their own: yields a cache over those
        rows (the same storage, so nothing is copied) that a prefill fills like any empty cache,
        e.g. ``model(ids[start:stop], past_key_values=part, ...)`` in chunks. So a batch whose
        decode fits in memory is filled a few rows at a time, with each forward's activations
        sized for those rows instead of the whole batch. On exit the cache takes the rows'
        length; every group must end at the same length, and the cache must be empty before the
        first (``reset()`` it). Needs ``batch_size=`` at construction (the buffers exist)."""
        if not all(isinstance(layer, VecInferLayer) for layer in self.layers):
            raise NotImplementedError("filling_rows needs every layer coded; this model keeps some layers in "
                                      "transformers' own cache layers: prefill the whole batch")
        if not all(layer.is_initialized for layer in self.layers):
            raise RuntimeError("filling_rows needs the cache's buffers: build it with batch_size=")
        batch = self.layers[0].batch_size
        if not 0 <= start < stop <= batch:
            raise ValueError(f"rows [{start}, {stop}) are not inside the cache's {batch} rows")
        part = copy.copy(self)
        part.layers = [layer.row_view(start, stop) for layer in self.layers]
        yield part
        for layer, filled in zip(self.layers, part.layers):
            layer.take_length(filled, f"[{start}, {stop})")

    def kv_bytes(self) -> int:
        """Bytes of everything the cache holds on its device (shared tensors counted once); under
        tensor parallelism, this rank's share (its KV heads, and its copy of the codebooks): see
        :meth:`total_kv_bytes`."""
        seen, total = set(), 0
        for layer in self.layers:
            for t in held_tensors(layer):
                key = (t.data_ptr(), t.numel())
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
        return total

    def coded_layers(self) -> list[VecInferLayer]:
        """The layers that hold codes (all of them unless the model mixes attention kinds:
        :mod:`vecinfer_compile.hf.layer_kinds`)."""
        return [layer for layer in self.layers if isinstance(layer, VecInferLayer)]

    def total_kv_bytes(self, group=None) -> int:
        """:meth:`kv_bytes` summed over all ranks by an all-reduce (every rank of ``group`` must
        call it: it is a collective); equal to :meth:`kv_bytes` without torch.distributed. Each
        rank's codebooks are counted once per rank, as each holds its own copy."""
        return total_kv_bytes(self, group)

    def fp_kv_bytes(self) -> int:
        """Bytes a full-precision static cache of the same shape would hold (for ratios): every
        coded layer at ``max_cache_len`` in the cache dtype, the other layers as they are."""
        coded = self.coded_layers()
        if not coded[0].is_initialized:
            raise RuntimeError("the cache has no batch size yet: it allocates at its first update "
                               "(or build it with batch_size=)")
        l0 = coded[0]
        per_layer = 2 * l0.batch_size * l0.num_heads * l0.max_cache_len * l0.head_dim
        others = sum(t.numel() * t.element_size() for layer in self.layers for t in full_precision_tensors(layer))
        return len(coded) * per_layer * torch.empty((), dtype=self.dtype).element_size() + others
