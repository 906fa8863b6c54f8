"""KV-cache memory of each method: nominal bits and physical bytes.

Per token and layer the cache holds ``num_kv_heads * head_dim`` key elements and as many value
elements. What one element costs:

- ``fp16``: 2 bytes.
- VQ methods (``vecinfer``, ``vq``, ``smooth``, ``hadamard``): each sub-vector of ``dims``
  channels is one code of ``log2(entries)`` bits, stored at that width
  (:mod:`vecinfer_compile.quant.packing`: one byte for <= 256 entries, two 12-bit codes in three
  bytes for 4096), so physical bits equal nominal bits: 3 for the 3-bit preset (4096x4), 1.5 for
  1.5-bit (4096x8), 1.25 for 1.25-bit. Fixed cost, paid once
  and not per token: the fp16 codebooks (``entries * dims`` per layer, keys and values) and, for
  smoothing methods, the fp16 smoothing factors (``num_kv_heads * head_dim`` per layer); for the
  query-aware methods, two fp16 matrices per KV head (``2 * num_kv_heads * head_dim**2`` per layer);
  for the centring methods, the fp16 key mean (``num_kv_heads * head_dim`` per layer).
- ``kivi``: ``bits`` per element (packed) plus an fp16 scale and an fp16 zero-point per group of
  32 elements (keys: per channel over 32 tokens; values: per token over 32 channels), i.e.
  ``bits + 1`` physical bits per element.

A residual window of the most recent ``R`` tokens stays in fp16 (:meth:`KVBytes.total`).
``bytes_per_token`` is the steady-state cost of one more quantized token (codes + scales).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..methods import VQ_METHODS, check_method

FP16_BYTES = 2
KIVI_GROUP = 32


@dataclass(frozen=True)
class KVBytes:
    method: str
    nominal_bits: float  # bits per element the method is named after
    physical_bits_per_element: float  # as stored: codes (+ scales), K and V averaged
    bytes_per_token: float  # all layers, K and V, one quantized token
    fp16_bytes_per_token: int  # all layers, K and V, one full-precision token
    fixed_bytes: int  # codebooks + smoothing factors, matrices, key means (0 for fp16 / kivi)
    residual: int = 0  # most recent tokens kept in fp16

    def total(self, tokens: int) -> float:
        """Bytes of a cache holding ``tokens`` tokens (one sequence), fixed costs included."""
        full = min(tokens, self.residual) if self.method != "fp16" else tokens
        return full * self.fp16_bytes_per_token + (tokens - full) * self.bytes_per_token + self.fixed_bytes

    def per_token_at(self, tokens: int) -> float:
        """Average bytes per token for a cache of ``tokens`` tokens, everything included."""
        return self.total(tokens) / tokens

    def as_dict(self) -> dict:
        return asdict(self)


def _geometry(geometry) -> dict:
    """Accept a geometry dict (``codebooks.model_geometry``) or a HF config."""
    if isinstance(geometry, dict):
        return geometry
    from ..codebooks import model_geometry

    return model_geometry(geometry)


def kv_bytes(method: str, bits: float | None, geometry, *, residual: int = 0,
             layer_bits: list[float] | None = None) -> KVBytes:
    """The memory accounting of ``method`` at ``bits`` for a model ``geometry`` (a dict with
    ``num_layers``, ``num_kv_heads``, ``head_dim``, or a HF config). ``layer_bits``: one VQ
    preset per layer (a per-layer allocation; ``bits`` is then their average)."""
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
            fixed += spec.entries * spec.dims * FP16_BYTES
    if VQ_METHODS[method].smooth:
        fixed += layers * heads * head_dim * FP16_BYTES
    if VQ_METHODS[method].center:
        fixed += layers * heads * head_dim * FP16_BYTES
    if VQ_METHODS[method].query_aware:
        fixed += 2 * layers * heads * head_dim * head_dim * FP16_BYTES
    return KVBytes(
        method,
        average_bits(per_layer),
        8 * code_bytes / (2 * elems),
        float(code_bytes),
        fp16_token,
        fixed,
        residual,
    )


def kv_bytes_per_token(method: str, bits: float | None, geometry) -> float:
    """Steady-state bytes of one quantized token (all layers, K and V)."""
    return kv_bytes(method, bits, geometry).bytes_per_token
