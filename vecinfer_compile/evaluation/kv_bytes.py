"""KV-cache memory of each method: nominal bits and physical bytes.

Per token and layer the cache holds ``num_kv_heads * head_dim`` key elements and as many value
elements. What one element costs:

- ``fp16``: 2 bytes.
- VQ methods (``vecinfer``, ``vq``, ``smooth``, ``hadamard``): each sub-vector of ``dims``
  channels is one code of ``log2(entries)`` bits, stored at that width
  (:mod:`vecinfer_compile.quant.packing`: one byte for <= 256 entries, two 12-bit codes in three
  bytes for 4096), so physical bits equal nominal bits: 3 for the 3-bit preset (4096x4), 1.5 for
  1.5-bit (4096x8), 1.25 for 1.25-bit. Fixed state, held whatever the cache's length and batch
  (``fixed_bytes``), float32 as the cache holds and uses it (and as the codebook file stores it):
  the codebooks (``entries * dims`` per layer, keys and values); for the smoothing methods the
  smoothing factors (``num_kv_heads * head_dim`` per layer); for the query-aware methods two
  matrices per KV head (``2 * num_kv_heads * head_dim**2`` per layer, the Hadamard folded in); for
  the centring methods the key mean (``num_kv_heads * head_dim`` per layer); for the other methods
  that rotate, one ``head_dim**2`` Hadamard matrix shared by all layers. The query-aware matrices
  dominate on a small model: on ``evalmodel`` (6 layers, 2 KV heads, head_dim 128) 1.57 MB, as
  much as 256 tokens of a full-precision cache.
- ``kivi``: ``bits`` per element (packed) plus an fp16 scale and an fp16 zero-point per group of
  32 elements (keys: per channel over 32 tokens; values: per token over 32 channels), i.e.
  ``bits + 1`` physical bits per element.

A residual window of the most recent ``R`` tokens stays in fp16 (:meth:`KVBytes.total`).
``bytes_per_token`` is the steady-state cost of one more quantized token (codes + scales).

:func:`cache_bytes` measures a real :class:`~vecinfer_compile.cache.VecInferCache` the same way:
its fixed state apart from the bytes that grow with tokens and batch (codes, window).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..methods import VQ_METHODS, check_method

FP16_BYTES = 2
STATE_BYTES = 4  # float32: codebooks, smoothing factors, matrices, key means, rotation
KIVI_GROUP = 32


@dataclass(frozen=True)
class KVBytes:
    method: str
    nominal_bits: float  # bits per element the method is named after
    physical_bits_per_element: float  # as stored: codes (+ scales), K and V averaged
    bytes_per_token: float  # all layers, K and V, one quantized token
    fp16_bytes_per_token: int  # all layers, K and V, one full-precision token
    fixed_bytes: (
        int  # float32 codebooks, smoothing factors, matrices, key means, error metrics, rotation (0 for fp16 / kivi)
    )
    residual: int = 0  # most recent tokens kept in fp16

    def total(self, tokens: int) -> float:
        """Bytes of a cache holding ``tokens`` tokens (one sequence), fixed costs included."""
        full = min(tokens, self.residual) if self.method != "fp16" else tokens
        return full * self.fp16_bytes_per_token + (tokens - full) * self.bytes_per_token + self.fixed_bytes

    def per_token_at(self, tokens: int) -> float:
        """Average bytes per token for a cache of ``tokens`` tokens, everything included."""
        return self.total(tokens) / tokens

    def break_even_tokens(self) -> int | None:
        """The fewest tokens at which the cache (fixed state included) holds fewer bytes than a
        full-precision one of as many tokens; None for fp16, or when a token costs no less."""
        saving = self.fp16_bytes_per_token - self.bytes_per_token  # per token past the window
        if self.method == "fp16" or saving <= 0:
            return None
        return self.residual + math.floor(self.fixed_bytes / saving) + 1

    def as_dict(self) -> dict:
        return asdict(self)


def _geometry(geometry) -> dict:
    """Accept a geometry dict (``codebooks.model_geometry``) or a HF config."""
    if isinstance(geometry, dict):
        return geometry
    from ..codebooks import model_geometry

    return model_geometry(geometry)


def kv_bytes(
    method: str,
    bits: float | None,
    geometry,
    *,
    residual: int = 0,
    layer_bits: list[float] | None = None,
    weighted_codes: bool | None = None,
) -> KVBytes:
    """The memory accounting of ``method`` at ``bits`` for a model ``geometry`` (a dict with
    ``num_layers``, ``num_kv_heads``, ``head_dim``, or a HF config). ``layer_bits``: one VQ
    preset per layer (a per-layer allocation; ``bits`` is then their average). ``weighted_codes``:
    whether the cache holds error metrics (two ``[heads, D, D]`` per layer; default: the method's,
    :data:`~vecinfer_compile.methods.VQ_METHODS`)."""
    check_method(method, bits)
    g = _geometry(geometry)
    layers, heads, head_dim = g["num_layers"], g["num_kv_heads"], g["head_dim"]
    elems = layers * heads * head_dim  # per token, keys only (values: as many)
    fp16_token = 2 * elems * FP16_BYTES
    if method == "fp16":
        return KVBytes("fp16", 16.0, 16.0, float(fp16_token), fp16_token, 0, 0)
    if method == "kivi":
        b = int(bits)
        phys = b + 2 * FP16_BYTES * 8 / KIVI_GROUP  # codes + fp16 scale & zero per group
        return KVBytes("kivi", float(b), phys, 2 * elems * phys / 8, fp16_token, 0, residual)
    from ..codebooks import average_bits
    from ..presets import get_preset
    from ..quant.packing import packed_width

    per_layer = [float(bits)] * layers if layer_bits is None else [float(b) for b in layer_bits]
    if len(per_layer) != layers:
        raise ValueError(f"layer_bits gives {len(per_layer)} presets for {layers} layers")
    code_bytes = 0
    fixed = 0
    for b in per_layer:
        preset = get_preset(b)
        for spec in (preset.key, preset.value):
            spec.check_head_dim(head_dim)
            code_bytes += heads * packed_width(head_dim // spec.dims, spec.entries)  # per token, this layer
            fixed += spec.entries * spec.dims * STATE_BYTES
    spec = VQ_METHODS[method]
    fixed += _transform_bytes(spec, layers, heads, head_dim)
    if spec.weighted_codes if weighted_codes is None else weighted_codes:
        fixed += STATE_BYTES * layers * heads * 2 * head_dim * head_dim  # the key and value error metrics
    return KVBytes(
        method,
        average_bits(per_layer),
        8 * code_bytes / (2 * elems),
        float(code_bytes),
        fp16_token,
        fixed,
        residual,
    )


def _transform_bytes(spec, layers: int, heads: int, head_dim: int) -> int:
    """Bytes of the key transform's state in a cache (float32): smoothing factors, key means,
    query-aware matrices and value predictors ``[layers, heads, ...]``, one shared Hadamard matrix
    and, for the pre-RoPE methods, the RoPE frequencies."""
    per_head = 0
    if spec.smooth:
        per_head += head_dim
    if spec.center:
        per_head += head_dim
    if spec.query_aware:
        per_head += 2 * head_dim * head_dim  # A @ H and (B @ H)^T
    if spec.predict_values:
        per_head += (head_dim + 1) * head_dim  # W and c of the value prediction
    rotation = head_dim * head_dim if spec.rotate and not spec.query_aware else 0
    rope = head_dim // 2 if spec.pre_rope else 0  # the RoPE frequencies (a full-width rotary embedding)
    return STATE_BYTES * (layers * heads * per_head + rotation + rope)


def kv_bytes_per_token(method: str, bits: float | None, geometry) -> float:
    """Steady-state bytes of one quantized token (all layers, K and V)."""
    return kv_bytes(method, bits, geometry).bytes_per_token


@dataclass(frozen=True)
class CacheBytes:
    """The bytes a :class:`~vecinfer_compile.cache.VecInferCache` holds on its device (this rank's
    under tensor parallelism), by how they grow; ``total`` equals ``cache.kv_bytes()``.

    - ``fixed``: the codec's operands (:meth:`~vecinfer_compile.codecs.base.Codec.operands`: the
      codebooks, or another codec's state), smoothing factors, rotation, query-aware matrices, key
      means and error metrics (float32): the same whatever the length and batch.
    - ``codes``: the code slots ``[B, H, max_cache_len, W]`` uint8, keys and values, every layer:
      allocated for every slot up front.
    - ``window``: the full-precision window ``[B, H, R, D]`` in the cache dtype and the counters.
    - ``bytes_per_token``: ``codes`` per slot and batch row (all layers, K and V); None until the
      cache has allocated (it allocates at its first update without ``batch_size``).
    - ``full_precision_layers``: the layers of a model of mixed attention kinds that the cache keeps
      in transformers' own layers (:mod:`vecinfer_compile.hf.layer_kinds`), bounded by their window.
    """

    fixed: int
    codes: int
    window: int
    bytes_per_token: float | None
    full_precision_layers: int = 0  # layers a model of mixed kinds keeps uncoded (sliding windows...)

    @property
    def total(self) -> int:
        return self.fixed + self.codes + self.window + self.full_precision_layers


_FIXED_STATE = ("operands", "lam", "rotation", "key_matrix", "key_read", "key_mean", "key_metric", "value_metric")
_CODE_SLOTS = ("k_codes", "v_codes")
_WINDOW_STATE = ("k_window", "v_window", "n_coded", "n_window")


def cache_bytes(cache) -> CacheBytes:
    """Measure ``cache`` (a VecInferCache) from its layers' buffers (:class:`CacheBytes`); a tensor
    shared by layers (the rotation) counts once."""
    from ..cache import full_precision_tensors

    seen: set[tuple[int, int]] = set()
    coded = cache.coded_layers()

    def held(part: str, names: tuple[str, ...]) -> int:
        total = 0
        for layer in coded:
            for name in names:
                holder = getattr(layer, part)
                held_state = getattr(holder, name)
                if name == "operands":
                    held_state = holder.codec.operand_tensors(held_state)
                for t in held_state if isinstance(held_state, (tuple, list)) else (held_state,):
                    if t is not None and (t.data_ptr(), t.numel()) not in seen:
                        seen.add((t.data_ptr(), t.numel()))
                        total += t.numel() * t.element_size()
        return total

    fixed = held("quantizer", _FIXED_STATE)
    codes, window = held("storage", _CODE_SLOTS), held("storage", _WINDOW_STATE)
    first = coded[0]
    per_token = codes / (first.batch_size * first.max_cache_len) if first.is_initialized else None
    other = sum(t.numel() * t.element_size() for layer in cache.layers for t in full_precision_tensors(layer))
    return CacheBytes(fixed, codes, window, per_token, other)
