"""The quantization methods the project compares, by name.

``fp16``: no quantization. ``vecinfer``: smoothing + Hadamard + VQ (the method).
``vq``: plain VQ of raw keys. ``smooth``: smoothing only + VQ. ``hadamard``: Hadamard only + VQ.
``kivi``: scalar per-channel keys / per-token values, group 32 (needs no calibration).
Values are always plain VQ in the VQ methods.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("fp16", "vecinfer", "kivi", "vq", "smooth", "hadamard")
KIVI_BITS = (2, 4)


@dataclass(frozen=True)
class KeyTransformSpec:
    smooth: bool
    rotate: bool


VQ_METHODS: dict[str, KeyTransformSpec] = {
    "vecinfer": KeyTransformSpec(smooth=True, rotate=True),
    "vq": KeyTransformSpec(smooth=False, rotate=False),
    "smooth": KeyTransformSpec(smooth=True, rotate=False),
    "hadamard": KeyTransformSpec(smooth=False, rotate=True),
}


def check_method(method: str, bits: float | None = None) -> None:
    """Raise a clear error for an unknown method or a bit-width it does not have."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "kivi" and bits is not None and float(bits) not in KIVI_BITS:
        raise ValueError(f"KIVI runs at 2 or 4 bits, not {bits}")
