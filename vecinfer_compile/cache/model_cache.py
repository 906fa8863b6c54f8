"""VecInferCache: a compileable Hugging Face ``Cache`` that stores K/V as VQ codes plus a small
full-precision window of the most recent tokens, built from a model (or its config) and its
codebooks.

Use it like HF's ``StaticCache``::

    cache = VecInferCache(model, codebooks, max_cache_len=4096)   # batch size from the first update
    out = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=64)

(:func:`cache_kwargs` is ``{"cache": cache}`` on transformers that take ``cache=``, 5.24 on, and
``{"past_key_values": cache}`` before.)

This module picks each decoder layer's cache layer (:mod:`vecinfer_compile.hf.layer_kinds`: coded
:class:`~.layer.VecInferLayer` s, hybrid ones, transformers' own static layers elsewhere), cuts the
quantizer state to the rank's KV heads under tensor parallelism, fills a batch a few rows at a time
(:meth:`VecInferCache.filling_rows`) and counts bytes. See :class:`VecInferCache` for the exact
semantics and :mod:`vecinfer_compile.passes.cache_attention` for the compiled decode rewrite.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers.cache_utils import Cache, StaticCache

from ..codebooks import VecInferCodebooks, model_geometry
from ..hf import attention_over_codes
from ..hf.layer_kinds import HYBRID_KINDS, SLIDING, check_codable, kv_producers, layer_kinds
from ..hf.tensor_parallel import local_kv_heads, local_layer, model_shard, total_kv_bytes
from ..kernel_env import env_kernel
from ..methods import check_runs_over_codes
from .layer import VecInferHybridLayer, VecInferLayer
from .quantizer import LayerQuantizer
from .storage import count_bytes, indexed_device


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


def held_tensors(layer) -> list[torch.Tensor]:
    """The tensors one layer of a VecInferCache holds: a VecInferLayer's static buffers and
    codebook state, then :func:`full_precision_tensors`."""
    coded = layer.static_tensors() if isinstance(layer, VecInferLayer) else []
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


def _config_of(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _check_takes_a_generic_cache(model: torch.nn.Module) -> None:
    """Raise a ValueError when ``model``'s transformers module defines a cache class of its own
    (MiniMax's ``MiniMaxCache``): such a model refuses any other cache, a VecInferCache included."""
    import inspect
    import sys

    module = sys.modules.get(type(model).__module__)
    own = [
        name
        for name, obj in (vars(module) if module else {}).items()
        if inspect.isclass(obj) and issubclass(obj, Cache) and obj.__module__ == module.__name__
    ]
    if own:
        raise ValueError(
            f"{type(model).__name__} keeps a cache class of its own ({', '.join(own)}) and accepts "
            "no other, so a VecInferCache cannot hold its K/V: use the simulate path "
            "(vecinfer_compile.simulation) to measure accuracy, or transformers' own cache"
        )


def _dtype_of(model_or_config, config) -> torch.dtype:
    dtype = getattr(model_or_config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _layers(
    config,
    codebooks: VecInferCodebooks,
    coded: list[bool],
    shard,
    *,
    max_cache_len: int,
    batch_size: int | None,
    residual: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list:
    """One cache layer per decoder layer of ``config``: a coded layer where ``coded`` says so and the
    layer stores its own K/V (a hybrid one beside a state-space mixer), with the quantizer state cut
    to the rank's KV heads under tensor parallelism (``shard``); elsewhere transformers' own static
    layer for its kind (bounded sliding/chunked windows, linear-attention state; nothing for a layer
    that reads another's K/V), allocated at its first update."""
    geometry = model_geometry(config)
    heads, num_kv_heads = local_kv_heads(shard, geometry["num_kv_heads"])
    rotations: dict = {}  # one rotation tensor shared by all layers
    kinds = layer_kinds(config)
    stores = [c and p == i for i, (c, p) in enumerate(zip(coded, kv_producers(config)))]
    static = StaticCache(config=config, max_cache_len=max_cache_len).layers
    layers = []
    for i in range(geometry["num_layers"]):
        if not stores[i]:
            layers.append(static[i])
            continue
        lc = codebooks.layer(i) if shard is None else local_layer(codebooks.layer(i), heads)
        quantizer = LayerQuantizer.from_codebooks(
            lc, device=device, key_parallel_weight=codebooks.key_parallel_weight, rotations=rotations
        )
        mixer = {"number_of_states": static[i].number_of_states} if kinds[i] in HYBRID_KINDS else {}
        layers.append(
            (VecInferHybridLayer if mixer else VecInferLayer)(
                quantizer,
                **mixer,
                batch_size=batch_size,
                num_kv_heads=num_kv_heads,
                head_dim=geometry["head_dim"],
                max_cache_len=max_cache_len,
                residual=residual,
                dtype=dtype,
                device=device,
                layer_idx=i,
                model_config=config,
            )
        )
    return layers


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
      chunk and its own tokens, the last two in full precision, and is encoded only after (the
      cache rule of :mod:`vecinfer_compile.window`, which states it as a mask too). So no query
      sees fewer than its last ``R`` keys in full precision.
    - **What decode returns**: full-length ``[B, H_kv, max_cache_len, D]`` dequantized K
      (original domain) and V, zero beyond the valid length; HF's mask (``get_mask_sizes`` ->
      ``max_cache_len``, padding, cache position) makes attention exact over them. Compiled,
      that is ``vecinfer::cache_kv`` over every slot, which
      :func:`vecinfer_compile.passes.cache_attention.rewrite_cache_attention` replaces, with the
      SDPA that reads it, by ``vecinfer::decode_attention`` over the codes. Eagerly too, one token
      or a chunk gets every slot (generate() may build a step's mask eagerly and run the step
      compiled): as a *codes read* when the model attends with ``"vecinfer_sdpa"`` (which
      ``VecInferCache(model, ...)`` switches an SDPA model to), which holds no memory and makes the
      attention run the same decode op, or for a chunk the chunk attention over the codes
      (:mod:`vecinfer_compile.hf.attention_over_codes`); otherwise dequantized (a chunk's with its own tokens
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
    state-space mixer) also keeps the mixer's state (:class:`~.layer.VecInferHybridLayer`).
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
        env_kernel()  # a bad $VECINFER_KERNEL refused now, not at the first append on CUDA
        config = _config_of(model_or_config)
        if isinstance(model_or_config, torch.nn.Module):
            from ..simulate import is_simulating

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
        if dtype is None:
            dtype = _dtype_of(model_or_config, config)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if device is None:
            device = getattr(model_or_config, "device", None) or "cpu"
        device = indexed_device(device)
        self.tp_shard = model_shard(model_or_config)  # None unless the model is tensor parallel
        layers = _layers(
            config,
            codebooks,
            coded,
            self.tp_shard,
            max_cache_len=max_cache_len,
            batch_size=batch_size,
            residual=residual,
            dtype=dtype,
            device=device,
        )
        super().__init__(layers=layers)
        self.codebooks = codebooks
        # (no `max_cache_len` attribute: transformers 5.17 has a read-only property of that name;
        # use get_max_length())
        self.residual, self.dtype, self.device = residual, dtype, device
        if isinstance(model_or_config, torch.nn.Module):
            attention_over_codes.use_codes_attention(model_or_config)

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
            raise NotImplementedError(
                "filling_rows needs every layer coded; this model keeps some layers in "
                "transformers' own cache layers: prefill the whole batch"
            )
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
        return count_bytes(t for layer in self.layers for t in held_tensors(layer))

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
            raise RuntimeError(
                "the cache has no batch size yet: it allocates at its first update (or build it with batch_size=)"
            )
        l0 = coded[0]
        per_layer = 2 * l0.batch_size * l0.num_heads * l0.max_cache_len * l0.head_dim
        others = sum(t.numel() * t.element_size() for layer in self.layers for t in full_precision_tensors(layer))
        return len(coded) * per_layer * torch.empty((), dtype=self.dtype).element_size() + others
