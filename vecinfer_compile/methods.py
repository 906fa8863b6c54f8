"""The quantization methods the project compares, by name.

``fp16``: no quantization. ``vecinfer``: smoothing + Hadamard + VQ (the method).
``vq``: plain VQ of raw keys. ``smooth``: smoothing only + VQ. ``hadamard``: Hadamard only + VQ.
``kivi``: scalar per-channel keys / per-token values, group 32 (needs no calibration).
``qaware``: the query-aware key transform (beyond the paper): ``K~ = K M`` with ``M = S^(1/2)``,
``S`` the second moment of the layer's post-RoPE queries per KV head (calibration), then the
Hadamard, so that k-means on ``K~`` minimises the expected attention-score error
(:mod:`vecinfer_compile.quant.query_aware`). ``qaware-nohadamard``: the same without the
Hadamard (an ablation row; ``qaware`` keeps the Hadamard because it had the lower loss on held-out
calibration text, docs/results.md).
Values are always plain VQ in the VQ methods.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("fp16", "vecinfer", "kivi", "vq", "smooth", "hadamard", "qaware", "qaware-nohadamard")
KIVI_BITS = (2, 4)


@dataclass(frozen=True)
class KeyTransformSpec:
    smooth: bool
    rotate: bool
    query_aware: bool = False


VQ_METHODS: dict[str, KeyTransformSpec] = {
    "vecinfer": KeyTransformSpec(smooth=True, rotate=True),
    "vq": KeyTransformSpec(smooth=False, rotate=False),
    "smooth": KeyTransformSpec(smooth=True, rotate=False),
    "hadamard": KeyTransformSpec(smooth=False, rotate=True),
    "qaware": KeyTransformSpec(smooth=False, rotate=True, query_aware=True),
    "qaware-nohadamard": KeyTransformSpec(smooth=False, rotate=False, query_aware=True),
}


def check_method(method: str, bits: float | None = None) -> None:
    """Raise a clear error for an unknown method or a bit-width it does not have."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "kivi" and bits is not None and float(bits) not in KIVI_BITS:
        raise ValueError(f"KIVI runs at 2 or 4 bits, not {bits}")
