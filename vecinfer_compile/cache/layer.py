"""One coded decoder layer of a :class:`~vecinfer_compile.cache.VecInferCache`: transformers'
``CacheLayerMixin`` protocol over its :class:`~.storage.LayerStorage` (buffers, counters) and
:mod:`.reads` (every read path), coding with a frozen :class:`~.quantizer.LayerQuantizer`.

``update(k, v)`` takes ``[B, H, T, D]`` K/V in the cache dtype:

- the first update of an empty layer (the prefill) stores them (:meth:`.LayerStorage.fill`) and
  returns them unchanged: the prompt attends in full precision;
- every later one appends (:meth:`.LayerStorage.append`) and returns ``[B, H, max_cache_len, D]``
  K/V for every slot: one token reads the layer after the append, a chunk of several what the
  rule of :mod:`vecinfer_compile.ops.split_attention.chunk` says (:mod:`.reads`). Compiled, that is
  ``vecinfer::cache_kv``; eagerly, when the model attends with ``"vecinfer_sdpa"``, a codes read
  (:mod:`vecinfer_compile.hf.attention_over_codes`) that holds no memory and attends through
  :meth:`VecInferLayer.attend` / :meth:`VecInferLayer.attend_chunk`; otherwise dequantized.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from ..hf import attention_over_codes
from ..hf.layer_kinds import SLIDING, attention_kinds
from ..ops.split_attention.chunk import ChunkKeys
from . import reads
from .quantizer import LayerQuantizer
from .storage import LayerStorage, count_bytes, indexed_device


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _storage_attribute(name: str) -> property:
    return property(lambda self: getattr(self.storage, name), doc=f"The storage's ``{name}``.")


class VecInferLayer(CacheLayerMixin):
    """A coded layer: ``VecInferLayer(quantizer, *, num_kv_heads, head_dim, max_cache_len,
    residual, dtype, device, batch_size=None, layer_idx=0, model_config=None)``. Without
    ``batch_size`` the buffers are allocated at the first update (which must run eagerly).
    ``model_config``: its attention implementation decides the eager reads, and its layer kinds
    whether this layer slides. ``storage`` holds the buffers, ``quantizer`` the codebooks and key
    transform."""

    is_compileable = True
    is_croppable = True  # the last one-token step only, while recording its past (crop)
    is_sliding = False  # per layer from model_config (__init__)

    def __init__(
        self,
        quantizer: LayerQuantizer,
        *,
        num_kv_heads: int,
        head_dim: int,
        max_cache_len: int,
        residual: int,
        dtype: torch.dtype,
        device,
        batch_size: int | None = None,
        layer_idx: int = 0,
        model_config=None,
    ):
        super().__init__()
        quantizer.check_fits(num_kv_heads, head_dim, layer_idx)
        device = indexed_device(device)
        self.quantizer = quantizer
        self.storage = LayerStorage(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_cache_len=max_cache_len,
            residual=residual,
            dtype=dtype,
            device=device,
            code_widths=quantizer.code_widths(head_dim),
            layer_idx=layer_idx,
        )
        self.k_head_dim = self.v_head_dim = head_dim
        self.dtype, self.device, self.layer_idx = dtype, device, layer_idx
        self.model_config = model_config
        # a coded sliding-window layer says so: transformers builds the sliding mask's sizes and query
        # offset from the first layer that does, else from layer 0, which may hold no K/V (RecurrentGemma's
        # recurrent layers)
        self.is_sliding = model_config is not None and attention_kinds(model_config)[layer_idx] == SLIDING
        self.is_initialized = False
        self.record_past = False  # Python flag, guarded by Dynamo: record the undo of each update
        if batch_size is not None:
            self._allocate(batch_size)

    # the geometry, read-only, as the storage has it (batch_size is None until allocated)
    batch_size = _storage_attribute("batch_size")
    num_heads = _storage_attribute("num_heads")
    head_dim = _storage_attribute("head_dim")
    max_cache_len = _storage_attribute("max_cache_len")
    residual = _storage_attribute("residual")

    def _allocate(self, batch_size: int) -> None:
        self.storage.allocate(batch_size)
        for t in self.quantizer.tensors():
            torch._dynamo.mark_static_address(t)
        self.is_initialized = True
        if self.record_past:
            self.storage.allocate_undo()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        """Allocate for ``key_states``' batch size if the cache was built without one, then check."""
        if not self.is_initialized:
            self._allocate(key_states.shape[0])
        self.storage.check_states(key_states, key_states if value_states is None else value_states)

    def transform_keys(self, k: torch.Tensor) -> torch.Tensor:
        """``K~`` of ``k: [B, H, T, D]`` in the cache dtype (:meth:`.LayerQuantizer.transform_keys`)."""
        return self.quantizer.transform_keys(k, self.dtype)

    # -- update --------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._allocate(key_states.shape[0])
        self.storage.check_states(key_states, value_states)
        if self.storage.empty:
            return self._prefill(key_states, value_states)
        return self._append(key_states, value_states)

    def _prefill(self, k: torch.Tensor, v: torch.Tensor):
        """First update of an empty layer: store, and return the full-precision K/V as given."""
        if k.shape[2] > self.max_cache_len:
            raise self.storage.overflow(k.shape[2])
        self.storage.fill(self.transform_keys(k), v, self.quantizer)
        if _is_compiling():  # marked: the backend keeps this attention in full precision
            return torch.ops.vecinfer.prefill_read(k, v)
        return k, v

    def _append(self, k: torch.Tensor, v: torch.Tensor):
        """Append ``T`` tokens, then return what attention reads. What a chunk of several needs
        of the old state is taken before the append (which writes only code slots at or after
        ``n_coded``)."""
        s, qz, t = self.storage, self.quantizer, k.shape[2]
        if self.record_past:
            s.record_undo()
        if _is_compiling():  # a chunk: the coded slots and the window before it, then itself
            window = reads.chunk_window(s, self.transform_keys(k), v) if t > 1 else None
            s.append(k, v, qz)
            return reads.read(s, qz, window=window)
        n_coded, n_window = int(s.n_coded), int(s.n_window)  # host syncs: eager only
        held = n_coded + n_window
        if held + t > self.max_cache_len:
            raise s.overflow(held + t)
        codes = self._codes_read()
        chunk = before = None
        if t > 1 and codes:
            chunk = reads.chunk_keys(s, qz, self.transform_keys(k), v, n_coded, n_window)
        elif t > 1:
            before = reads.read(s, qz, held)
        s.append(k, v, qz)
        # every slot, as the compiled step's read (generate() may build the step's mask before it
        # knows whether the step runs compiled: get_mask_sizes)
        if codes:
            return attention_over_codes.codes_read(self, self._full_shape(), self.dtype, self.device, chunk)
        if before is not None:
            return reads.with_chunk(s, before, k, v)
        return reads.read(s, qz)

    def _full_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.num_heads, self.max_cache_len, self.head_dim)

    # -- reads ---------------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        """Decode attention of ``q: [B, Hq, 1, D]`` over the codes and window (:func:`.reads.attend`)."""
        return reads.attend(self.storage, self.quantizer, q, attn_mask, scale)

    def attend_chunk(
        self, q: torch.Tensor, attn_mask: torch.Tensor | None, scale: float | None, keys: ChunkKeys
    ) -> torch.Tensor:
        """Attention of an eager chunk ``q: [B, Hq, C, D]`` over the codes (:func:`.reads.attend_chunk`)."""
        return reads.attend_chunk(self.storage, self.quantizer, q, attn_mask, scale, keys)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager: the ``[B, H, max_cache_len, D]`` K (original domain) and V (:func:`.reads.dequantized`)."""
        return reads.dequantized(self.storage, self.quantizer)

    def dense_read(self, chunk: ChunkKeys | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager: what an eager step's codes read stands for (:func:`.reads.dense`)."""
        return reads.dense(self.storage, self.quantizer, chunk)

    @property
    def keys(self) -> torch.Tensor | None:
        """What transformers code that reads a cache layer's K directly gets (Mllama asks whether a
        layer holds anything; compiled, it reads nothing): eagerly a codes read
        (:mod:`vecinfer_compile.hf.attention_over_codes`: no memory; any op on it reads the layer
        dequantized), compiled the dequantized K of every slot; None before the first update."""
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
        if _is_compiling() or not self._codes_read():
            return reads.read(self.storage, self.quantizer)[index]
        return attention_over_codes.codes_read(self, self._full_shape(), self.dtype, self.device)[index]

    def _codes_read(self) -> bool:
        """Whether an eager step returns a codes read (the model attends with ``"vecinfer_sdpa"``),
        else it reads dense K/V."""
        return attention_over_codes.is_active(self.model_config)

    # -- sizes ---------------------------------------------------------------------------------
    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older signature: cache_position
            query_length = query_length.shape[0]
        if self.storage.empty:  # prefill returns only the new tokens, in full precision
            return query_length, 0
        # every later step, one token or a chunk, eager or compiled: every slot (the mask hides the
        # empty ones). Static because generate() may build the mask eagerly and run the step compiled
        # (a chunked prefill with a compile config: a mask as long as the valid slots then met the
        # compiled full-length read and failed)
        return self.max_cache_len, 0

    def get_seq_length(self, *args, **kwargs):
        if self.storage.empty:
            return 0
        return self.storage.n_coded + self.storage.n_window

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def static_tensors(self) -> list[torch.Tensor]:
        """The buffers and the quantizer's tensors this layer holds."""
        return self.storage.tensors() + self.quantizer.tensors()

    def kv_bytes(self) -> int:
        return count_bytes(self.static_tensors())

    # -- lifecycle -------------------------------------------------------------------------------
    def reset(self) -> None:
        self.storage.reset()

    def activate_past_recording(self, **kwargs) -> None:
        """From now on every update first records what :meth:`crop` ``(-1)`` needs to undo it: the
        counters and window slot 0 (the token a full window moves into the codes), a copy of a
        few bytes. ``generate()`` calls this (through ``Cache.activate_past_recording``) when it
        defers its stop check by a step, and sets ``record_past`` back to False when it is done."""
        self.record_past = True
        if self.is_initialized:  # else _allocate makes them with the other buffers
            self.storage.allocate_undo()

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(0)`` does nothing; ``crop(-1)`` undoes the last update, when it appended one
        token while the layer recorded its past (:meth:`activate_past_recording`,
        :meth:`.LayerStorage.undo_last_token`). Nothing else can be undone."""
        if tokens_to_remove == 0:
            return
        if tokens_to_remove != -1 or not self.record_past:
            raise NotImplementedError(
                f"VecInferCache can drop only the last token of a decode step, and only while it records its past "
                f"(got crop({tokens_to_remove}), recording: {self.record_past}): tokens that left the full-precision "
                "window are encoded; reset() it and prefill again (assisted or speculative decoding, which crops "
                "rejected drafts, needs a cache that keeps every token: transformers' DynamicCache)"
            )
        self.storage.undo_last_token()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.storage.reorder(beam_idx)

    def row_view(self, start: int, stop: int) -> VecInferLayer:
        """An empty layer over rows ``[start, stop)`` of this one's buffers (:meth:`.LayerStorage.row_view`);
        :meth:`VecInferCache.filling_rows <vecinfer_compile.cache.VecInferCache.filling_rows>` uses it."""
        part = copy.copy(self)
        part.storage = self.storage.row_view(start, stop)
        return part

    def take_length(self, part: VecInferLayer, rows: str) -> None:
        """Adopt the length of ``part``, a filled :meth:`row_view` (:meth:`.LayerStorage.take_length`)."""
        self.storage.take_length(part.storage, rows)

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
    (:mod:`vecinfer_compile.hf.layer_kinds`; transformers' ``LinearAttentionAndStaticFullAttentionLayer``
    otherwise): the attention's K/V as codes (:class:`VecInferLayer`), the mixer's conv and
    recurrent states as transformers' ``LinearAttentionLayer`` keeps them (``update_conv_state`` /
    ``update_recurrent_state``, ``number_of_states`` of each, static addresses). Takes
    VecInferLayer's arguments besides."""

    is_croppable = False  # the mixer's state is not recorded for an undo

    def __init__(self, quantizer: LayerQuantizer, number_of_states: int = 1, **kwargs):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        VecInferLayer.__init__(self, quantizer, **kwargs)

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
            raise NotImplementedError(
                "this hybrid layer's mixer state cannot be rolled back with its attention's: "
                "a step cannot be undone (generate() then keeps its per-step stop check)"
            )

    def row_view(self, start: int, stop: int) -> VecInferLayer:
        raise NotImplementedError(
            "filling_rows needs every layer's state per row; this hybrid model's mixer "
            "state is not: prefill the whole batch"
        )
