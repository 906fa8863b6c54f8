"""Attention over a VecInferCache's codes in eager steps, decode and chunk alike, without its
dequantized copy: the attention implementation ``"vecinfer_sdpa"``.

``generate()`` runs its first step (the prompt's last token) eagerly, and every step when it is
given no compile config. Handing HF's attention the whole cache dequantized at such a step
(``[B, H_kv, max_cache_len, D]`` in the model dtype per layer), which transformers 5.17's SDPA path
then repeats per query head, would take 44 GiB for one repeated K at the 8B geometry, 32k slots
and 176 rows: that step, not the cache, would bound the batch.

``"vecinfer_sdpa"`` is transformers' SDPA attention with one exception. A VecInferCache layer whose
model runs this implementation answers an eager update of a non-empty cache with a *codes read*:
K and V of the usual shape that hold no memory (a 0-d NaN expanded) and name their layer. When this
attention function receives one it asks the layer instead: for one query token
:meth:`VecInferLayer.attend <vecinfer_compile.cache.VecInferLayer.attend>` runs its codec's decode
op over the codes and window (the query-side transform and ``kv_start``
of :mod:`~vecinfer_compile.ops.decode_inputs`), the op the compiled decode step runs (a mask that is
more than left padding over the valid slots gets SDPA over the dequantized cache instead); for a
chunk of several, :meth:`VecInferLayer.attend_chunk <vecinfer_compile.cache.VecInferLayer.attend_chunk>`
attends by the rule of :mod:`~vecinfer_compile.ops.split_attention.chunk` (the coded prefix and the
full-precision window and chunk, merged by log-sum-exp; on CUDA the prefix a few rows at a time into cuDNN or FlashAttention-2). Every other call (the prefill of an empty
cache, other caches, anything traced by Dynamo) goes to ``sdpa_attention_forward`` unchanged, so a
model on this implementation compiles to the same graph.

A codes read is a :class:`CodesRead`: its metadata (shape, dtype, strides, ``numel``) answers
without reading anything, and any torch op other than this attention (a model that splits,
repeats or computes with its cached K/V before attention: DiffLlama's value halves, JetMoE's
per-expert repeat, Doge's value-dependent mask) gets the layer's dequantized K/V in its place,
read once per step for K and V together (:meth:`VecInferLayer.dense_read
<vecinfer_compile.cache.VecInferLayer.dense_read>`): the read a compiled step or another attention
implementation gets. So the eager codes path and the dequantized path compute the same thing; when
attention then receives anything but the layer's own K and V reads, it attends over them by SDPA.

``VecInferCache(model, ...)`` switches a model on ``"sdpa"`` to this implementation
(:func:`use_codes_attention`, logged once); a model on any other implementation keeps it and its
eager steps get the dequantized read for the whole batch (a chunk's with its own tokens in full
precision, by the same rule).
"""

from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_map_only
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..log_once import log_once
from .attention_support import check_attention_call

ATTN_NAME = "vecinfer_sdpa"
_LAYER = "_vecinfer_codes_layer"  # the attribute of a codes read that names its layer
_CHUNK = "_vecinfer_chunk_keys"  # and, for a chunk, what its attention reads (ops.split_attention.chunk.ChunkKeys)
# (a sliding window is fine: transformers' SDPA path applies it through the mask, and so do the codes reads;
# a T5-style position_bias gets SDPA over the dequantized read, as transformers' SDPA adds it to the scores;
# what attention over codes cannot compute, sinks, softcap, sparse indices, is refused by
# attention_support.check_attention_call, as the backend and the simulate path refuse it)

log = logging.getLogger(__name__)


def is_active(config) -> bool:
    """Whether ``config``'s model attends through ``"vecinfer_sdpa"``."""
    return config is not None and getattr(config, "_attn_implementation", None) == ATTN_NAME


class CodesRead(torch.Tensor):
    """K or V of a codes read: ``[B, H_kv, L, D]``, a 0-d NaN expanded (no memory), naming its
    layer (``_vecinfer_codes_layer``), its chunk (``_vecinfer_chunk_keys``, None for one token)
    and the :class:`_Pending` read it shares with its partner. Metadata answers as such; every
    other torch op runs on the layer's dequantized K/V instead (a plain tensor comes out)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(CodesRead, dense, (args, kwargs))
        return func(*args, **kwargs)


_METADATA = frozenset(
    [
        getattr(torch.Tensor, name).__get__
        for name in ("shape", "dtype", "device", "ndim", "layout", "is_cuda", "requires_grad")
    ]
    + [
        getattr(torch.Tensor, name)
        for name in (
            "size",
            "dim",
            "numel",
            "nelement",
            "stride",
            "element_size",
            "is_floating_point",
            "is_contiguous",
            "untyped_storage",
            "__len__",
        )
    ]
)


class _Pending:
    """The dequantized K/V a pair of codes reads stands for, read from ``layer`` on first use."""

    def __init__(self, layer, chunk):
        self.layer, self.chunk, self.kv = layer, chunk, None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv is None:
            self.kv = self.layer.dense_read(self.chunk)
        return self.kv


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a :class:`CodesRead` the dequantized K or V it stands for."""
    if not isinstance(t, CodesRead):
        return t
    return t._vecinfer_pending.dense()[t._vecinfer_index]


def codes_read(
    layer, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, chunk=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for ``(K, V)`` of ``shape`` ``[B, H_kv, L, D]``: :class:`CodesRead` s naming
    ``layer`` for :func:`codes_attention_forward`; a chunk's also carry ``chunk`` (its
    :class:`~vecinfer_compile.ops.split_attention.chunk.ChunkKeys`)."""
    pending = _Pending(layer, chunk)
    reads = []
    for index in range(2):
        t = torch.full((), float("nan"), dtype=dtype, device=device).expand(shape).as_subclass(CodesRead)
        t._vecinfer_pending, t._vecinfer_index = pending, index
        setattr(t, _LAYER, layer)
        setattr(t, _CHUNK, chunk)
        reads.append(t)
    return reads[0], reads[1]


def _is_pair(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``key`` and ``value`` are the K and V of one codes read, as the layer returned them."""
    return (
        isinstance(key, CodesRead)
        and isinstance(value, CodesRead)
        and key._vecinfer_index == 0
        and value._vecinfer_index == 1
        and key._vecinfer_pending is value._vecinfer_pending
    )


def codes_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' AttentionInterface signature. ``query: [B, Hq, Tq, D]``, ``key``/``value``:
    ``[B, H_kv, L, D]`` (or a codes read); returns ``([B, Tq, Hq, D], None)``."""
    if not _is_pair(key, value) or kwargs.get("position_bias") is not None:  # SDPA over what they hold
        return sdpa_attention_forward(
            module,
            query,
            dense(key),
            dense(value),
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    layer = getattr(key, _LAYER)
    if dropout:
        raise ValueError("vecinfer: attention over a VecInferCache has dropout > 0: call model.eval()")
    check_attention_call(module, query, key, value, kwargs)
    chunk = getattr(key, _CHUNK, None)
    if chunk is None:
        if query.shape[2] != 1:
            raise RuntimeError(f"vecinfer: {query.shape[2]} queries over a one-token codes read")
        out = layer.attend(query, attention_mask, scaling)
    else:
        out = layer.attend_chunk(query, attention_mask, scaling, chunk)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .decode_mask import decode_sdpa_mask

    AttentionInterface.register(ATTN_NAME, codes_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, decode_sdpa_mask)  # sdpa_mask's, faster for a decode step


_register()


def use_codes_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` from ``"sdpa"`` to ``"vecinfer_sdpa"``; True when it runs the latter after
    the call. Other implementations are left alone (one log line says what that costs)."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == ATTN_NAME:
        return True
    if current == "sdpa":
        model.set_attn_implementation(ATTN_NAME)
        log_once(
            log,
            logging.INFO,
            "switched",
            "vecinfer: attention 'sdpa' -> '%s' (SDPA, but eager steps over a "
            "VecInferCache read its codes instead of the whole batch dequantized)",
            ATTN_NAME,
        )
        return True
    log_once(
        log,
        logging.INFO,
        str(current),
        "vecinfer: the model attends with %r, so eager steps over a "
        "VecInferCache get the whole batch dequantized (load it with attn_implementation='sdpa' to read codes)",
        current,
    )
    return False
