"""A strong full-precision decode baseline for ``bench_generate.py``: a static cache whose
attention reads only the valid length, with the fastest kernel torch has for that, under CUDA graphs.

HF's ``StaticCache`` with SDPA attends over every one of ``max_cache_len`` slots and
materialises a mask over them; at 128k that falls off the fast SDPA kernels. A serving engine
instead calls a varlen flash-attention kernel with the number of used keys per row
(``seqused_k``), which skips the empty slots and splits long rows over the SMs (flash-decoding)
when ``Tq = 1`` and the heads are grouped. torch ships that kernel as
``aten::_flash_attention_forward`` (varlen mode: ``cum_seq_q``/``cum_seq_k`` + ``seqused_k``),
and that is what this baseline runs:

- :class:`ValidLengthCache` stores K/V position-major, ``[B, max_cache_len, H_kv, D]`` (what the
  varlen kernel reads without a copy), and hands those buffers themselves to attention (a
  transposed view of a buffer mutated in the compiled step made Inductor copy the whole buffer
  twice per layer and step). Llama-style attention passes the cache's K/V straight to the
  attention function, so only that function sees the layout.
- :func:`valid_length_attention`, registered with transformers' ``AttentionInterface`` as
  ``"vecinfer_bench_valid_length"``, calls ``vecinfer_bench::flash_valid_length`` (an opaque custom op, so
  Inductor leaves it alone and CUDA graphs capture it) with ``seqused_k = position_ids[:, -1] +
  1``. No attention mask is built (transformers builds none for an attention function it has no
  mask function for).

Valid for unpadded batches only (the benchmark's): the used length of a row is its last position
id plus one. On the CPU (``--smoke``) the op runs a per-row SDPA so the script can be checked.
Under transformers' tensor parallelism (``tp_plan="auto"``) it works unchanged: each rank's
layers allocate their buffers from the first key states they see (the rank's KV heads), and
``kv_bytes()`` is this rank's share.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

NAME = "vecinfer_bench_valid_length"


@torch.library.custom_op("vecinfer_bench::flash_valid_length", mutates_args=())
def flash_valid_length(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """Attention of ``q: [B, Hq, Tq, D]`` over the first ``used[b]`` positions of ``k, v: [B,
    Tmax, Hkv, D]`` (position-major, contiguous); ``used: [B]`` int32. ``causal``: query ``i``
    sees keys ``<= used - Tq + i`` (bottom-right). Returns ``[B, Tq, Hq, D]`` in q.dtype."""
    b, hq, tq, d = q.shape
    tmax, hkv = k.shape[1], k.shape[2]
    if q.device.type != "cuda":
        out = torch.empty(b, tq, hq, d, dtype=q.dtype, device=q.device)
        for i in range(b):
            n = int(used[i])
            kk, vv = k[i, :n].transpose(0, 1)[None], v[i, :n].transpose(0, 1)[None]
            mask = None
            if causal:
                mask = torch.ones(tq, n, dtype=torch.bool, device=q.device).tril(n - tq)
            o = F.scaled_dot_product_attention(q[i : i + 1], kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
            out[i] = o[0].transpose(0, 1)
        return out
    qv = q.transpose(1, 2).reshape(b * tq, hq, d)
    cu_q = torch.arange(0, (b + 1) * tq, tq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * tmax, tmax, dtype=torch.int32, device=q.device)
    out = torch.ops.aten._flash_attention_forward(
        qv,
        k.view(b * tmax, hkv, d),
        v.view(b * tmax, hkv, d),
        cu_q,
        cu_k,
        tq,
        tmax,
        0.0,
        causal,
        False,
        scale=scale,
        seqused_k=used,
    )[0]
    return out.view(b, tq, hq, d)


@flash_valid_length.register_fake
def _(q, k, v, used, scale, causal):
    b, hq, tq, d = q.shape
    return q.new_empty(b, tq, hq, d)


def valid_length_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [B, Hq, Tq, D]``, ``key``/``value`` the
    :class:`ValidLengthCache` buffers ``[B, Tmax, Hkv, D]``; returns ``([B, Tq, Hq, D], None)``."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(f"{NAME} attention needs position_ids (the used length is the last one + 1)")
    hkv = query.shape[1] // module.num_key_value_groups  # this rank's KV heads under tensor parallelism
    if key.dim() != 4 or key.shape[2] != hkv or not key.is_contiguous():
        raise RuntimeError(
            f"{NAME} attention reads a ValidLengthCache's [B, Tmax, {hkv}, D] buffers; "
            f"got K of shape {tuple(key.shape)} (pass a ValidLengthCache)"
        )
    used = (position_ids[:, -1] + 1).to(torch.int32).expand(query.shape[0]).contiguous()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = flash_valid_length(query, key, value, used, scale, query.shape[2] > 1)
    return out, None


AttentionInterface.register(NAME, valid_length_attention)


class ValidLengthLayer(CacheLayerMixin):
    """One layer: ``k_store``/``v_store [B, max_cache_len, H_kv, D]`` in the model dtype and a
    0-d int64 ``length`` (tokens stored). ``update`` writes the new tokens at ``length ..`` and
    returns the two buffers (position-major: only :func:`valid_length_attention` reads them)."""

    is_compileable = True
    is_croppable = True  # crop(-n) shortens length: what a deferred stop check needs
    is_sliding = False

    def __init__(self, max_cache_len: int):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        b, h, _, d = key_states.shape
        self.allocate(b, h, d, key_states.dtype, key_states.device)

    def allocate(self, b: int, h: int, d: int, dt: torch.dtype, dev: torch.device) -> None:
        self.k_store = torch.zeros(b, self.max_cache_len, h, d, dtype=dt, device=dev)
        self.v_store = torch.zeros(b, self.max_cache_len, h, d, dtype=dt, device=dev)
        self.length = torch.zeros((), dtype=torch.int64, device=dev)
        for t in (self.k_store, self.v_store, self.length):
            torch._dynamo.mark_static_address(t)
        self.device, self.dtype = dev, dt
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = self.length + torch.arange(key_states.shape[2], device=self.device)
        self.k_store.index_copy_(1, pos, key_states.transpose(1, 2))
        self.v_store.index_copy_(1, pos, value_states.transpose(1, 2))
        self.length.add_(key_states.shape[2])
        return self.k_store, self.v_store

    def row_view(self, start: int, stop: int) -> ValidLengthLayer:
        """An empty layer over rows ``[start, stop)`` of the buffers, with a length of its own."""
        part = copy.copy(self)
        part.k_store, part.v_store = self.k_store[start:stop], self.v_store[start:stop]
        part.length = torch.zeros_like(self.length)
        return part

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self, *args, **kwargs):
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (``crop(0)`` does nothing)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized:
            self.length.add_(tokens_to_remove)

    def offload(self):
        pass

    def prefetch(self):
        pass


class ValidLengthCache(Cache):
    """Full-precision static cache for :func:`valid_length_attention` (one
    :class:`ValidLengthLayer` per decoder layer)."""

    def __init__(self, config, max_cache_len: int):
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        super().__init__(layers=[ValidLengthLayer(max_cache_len) for _ in range(config.num_hidden_layers)])

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def allocate(self, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """The buffers up front (for :meth:`filling_rows`), as the first update would."""
        for layer in self.layers:
            layer.allocate(batch, num_kv_heads, head_dim, dtype, torch.device(device))

    @contextlib.contextmanager
    def filling_rows(self, start: int, stop: int):
        """Rows ``[start, stop)`` as a cache of their own (same storage), as
        ``VecInferCache.filling_rows``: the cache takes their length on exit."""
        part = copy.copy(self)
        part.layers = [layer.row_view(start, stop) for layer in self.layers]
        yield part
        for layer, filled in zip(self.layers, part.layers):
            layer.length.copy_(filled.length)

    def kv_bytes(self) -> int:
        """Bytes of the K/V buffers on this device (this rank's heads under tensor parallelism)."""
        return sum(t.nbytes for layer in self.layers if layer.is_initialized for t in (layer.k_store, layer.v_store))


def use_valid_length_attention(model) -> str:
    """Switch ``model`` to :func:`valid_length_attention`; returns the previous implementation."""
    previous = model.config._attn_implementation
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        model.config._attn_implementation = NAME
    return previous


def restore_attention(model, previous: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(previous)
    else:
        model.config._attn_implementation = previous
