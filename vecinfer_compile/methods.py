"""The quantization methods the project compares, by name.

``fp16``: no quantization. ``vecinfer``: smoothing + Hadamard + VQ (the method).
``vq``: plain VQ of raw keys. ``smooth``: smoothing only + VQ. ``hadamard``: Hadamard only + VQ.
``kivi``: scalar per-channel keys / per-token values, group 32 (needs no calibration).
``qaware``: the query-aware key transform (beyond the paper): ``K~ = (K - mu) A`` then the
Hadamard, ``q~ = q A^(-T)`` then the Hadamard, ``mu`` the calibration keys' mean and ``A`` per
layer and KV head from the second moments of the post-RoPE calibration queries and the centred
keys (their matrix geometric mean, see :mod:`vecinfer_compile.quant.query_aware`). Subtracting
``mu`` shifts every score of a query by the same ``-q . mu``, which softmax ignores; centring is
on by default because it lowered the loss on held-out calibration text (docs/results.md).
After k-means, ``qaware``'s centroids are refined against the layer's attention-output error on
the calibration text (:mod:`vecinfer_compile.quant.refine`; no change at inference); ablation
``qaware-norefine``: the k-means centroids as they were. ``qaware`` then chooses its codes for the
error the model reads, not the squared error: score-aware keys (weight 8,
:mod:`vecinfer_compile.quant.score_aware`) lowered under the calibration queries' metric, values
under ``o_proj``'s (:mod:`vecinfer_compile.quant.weighted_codes`); same bytes, books and decode
kernels. Ablations ``qaware-nearest`` (nearest-centroid codes, as ``qaware`` was before its
error-weighted codes) and ``qaware-scoreaware`` (score-aware keys alone). The other ``qaware-*``
ablations keep nearest-centroid codes, as they were measured.
Ablation rows: ``qaware-nocenter`` (no centring, no refinement), and, uncentred as they were measured,
``qaware-nohadamard`` (no Hadamard) and ``qaware-sqrt`` (``A = S^(1/2)``, the queries alone:
k-means error = expected score error). ``vecinfer-center``: VecInfer with centred keys (smoothing
factors of ``K - mu``), beyond the paper.
``prerope`` (beyond the paper): keys quantized *before* RoPE (each key un-rotated by its
position, then ``vecinfer-center``'s smoothing and Hadamard, rotated back after dequantization) and
values coded as the residual of a linear prediction from their own token's dequantized key
(:mod:`vecinfer_compile.quant.value_prediction`); ablation ``prerope-keys``: the same keys, values
plain VQ. They run in simulate mode (eval-ppl, ablation, calibration); the cache and the compiled
decode do not have them yet (:data:`SIMULATE_ONLY`).
Values are plain VQ in the other VQ methods.
"""

from __future__ import annotations

from dataclasses import dataclass

from .presets import get_preset

METHODS = (
    "fp16",
    "vecinfer",
    "kivi",
    "vq",
    "smooth",
    "hadamard",
    "qaware",
    "qaware-nearest",
    "qaware-scoreaware",
    "qaware-norefine",
    "qaware-nocenter",
    "qaware-nohadamard",
    "qaware-sqrt",
    "vecinfer-center",
    "prerope",
    "prerope-keys",
)
KIVI_BITS = (2, 4)


@dataclass(frozen=True)
class KeyTransformSpec:
    """smooth: channel-wise smoothing; rotate: the Hadamard; query_aware: None, or the kind of
    query-aware matrix (``geomean`` or ``sqrt``, :mod:`vecinfer_compile.quant.query_aware`);
    center: subtract the calibration keys' mean per KV head first (exact for attention, see
    :mod:`vecinfer_compile.quant.transform`); pre_rope: undo RoPE before the rest
    (:mod:`vecinfer_compile.quant.rope`); predict_values: code values as the residual of a
    prediction from the dequantized key (:mod:`vecinfer_compile.quant.value_prediction`); refine: move
    the k-means centroids to lower the attention-output error (:mod:`vecinfer_compile.quant.refine`);
    key_parallel_weight and weighted_codes: how codes are chosen unless calibration is told
    otherwise (score-aware keys, :mod:`vecinfer_compile.quant.score_aware`; error-weighted codes,
    :mod:`vecinfer_compile.quant.weighted_codes`)."""

    smooth: bool
    rotate: bool
    query_aware: str | None = None
    center: bool = False
    pre_rope: bool = False
    predict_values: bool = False
    refine: bool = False
    key_parallel_weight: float = 1.0
    weighted_codes: bool = False


VQ_METHODS: dict[str, KeyTransformSpec] = {
    "vecinfer": KeyTransformSpec(smooth=True, rotate=True),
    "vq": KeyTransformSpec(smooth=False, rotate=False),
    "smooth": KeyTransformSpec(smooth=True, rotate=False),
    "hadamard": KeyTransformSpec(smooth=False, rotate=True),
    "qaware": KeyTransformSpec(
        smooth=False,
        rotate=True,
        query_aware="geomean",
        center=True,
        refine=True,
        key_parallel_weight=8.0,
        weighted_codes=True,
    ),
    "qaware-nearest": KeyTransformSpec(smooth=False, rotate=True, query_aware="geomean", center=True, refine=True),
    "qaware-scoreaware": KeyTransformSpec(
        smooth=False, rotate=True, query_aware="geomean", center=True, refine=True, key_parallel_weight=8.0
    ),
    "qaware-norefine": KeyTransformSpec(smooth=False, rotate=True, query_aware="geomean", center=True),
    "qaware-nocenter": KeyTransformSpec(smooth=False, rotate=True, query_aware="geomean"),
    "qaware-nohadamard": KeyTransformSpec(smooth=False, rotate=False, query_aware="geomean"),
    "qaware-sqrt": KeyTransformSpec(smooth=False, rotate=True, query_aware="sqrt"),
    "vecinfer-center": KeyTransformSpec(smooth=True, rotate=True, center=True),
    "prerope": KeyTransformSpec(smooth=True, rotate=True, center=True, pre_rope=True, predict_values=True),
    "prerope-keys": KeyTransformSpec(smooth=True, rotate=True, center=True, pre_rope=True),
}
SIMULATE_ONLY = tuple(m for m, spec in VQ_METHODS.items() if spec.pre_rope)


def check_runs_over_codes(method: str) -> None:
    """Raise a ValueError naming the fix when ``method`` has no cache or compiled decode yet."""
    if method in SIMULATE_ONLY:
        raise ValueError(
            f"method {method!r} runs in simulate mode only (vecinfer eval-ppl / ablation, enable_simulation): "
            "the cache and the compiled decode do not yet rotate keys per position or predict values; use "
            "--method qaware for VecInferCache, generate() and vecinfer_backend"
        )


def check_method(method: str, bits: float | None = None) -> None:
    """Raise a clear error for an unknown method or a bit-width it does not have."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "kivi" and bits is not None and float(bits) not in KIVI_BITS:
        raise ValueError(f"KIVI runs at 2 or 4 bits, not {bits}")


def normalize_bits(method: str, bits: float | None) -> float:
    """Default and validate ``bits`` for ``method`` (fp16: 16; others: 2). Clear errors."""
    check_method(method)
    if method == "fp16":
        return 16.0
    bits = 2.0 if bits is None else float(bits)
    if bits <= 0:
        raise ValueError(f"bits must be positive, got {bits:g}")
    check_method(method, bits)
    if method in VQ_METHODS:
        get_preset(bits)
    return bits
