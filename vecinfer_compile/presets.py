"""Bit-width presets of the VecInfer method (DESIGN.md, "The method").

A preset says how keys and values are vector-quantized: each head vector of ``head_dim``
channels is cut into sub-vectors of ``dims`` channels, and each sub-vector is replaced by the
index of its nearest centroid among ``entries``. Bits per element = log2(entries) / dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class VQSpec:
    """One vector-quantizer geometry: ``entries`` centroids of ``dims`` channels each."""

    entries: int
    dims: int

    @property
    def bits(self) -> float:
        return math.log2(self.entries) / self.dims

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.dims != 0:
            raise ValueError(
                f"head_dim {head_dim} is not divisible by the sub-vector size {self.dims} of a "
                f"{self.entries}x{self.dims} codebook; pick a preset whose dims divides {head_dim}"
            )


@dataclass(frozen=True)
class Preset:
    """Key and value quantizers for one nominal bit-width."""

    bits: float
    key: VQSpec
    value: VQSpec


PRESETS: dict[float, Preset] = {
    4.0: Preset(4.0, VQSpec(256, 2), VQSpec(256, 2)),
    3.0: Preset(3.0, VQSpec(4096, 4), VQSpec(4096, 4)),
    2.0: Preset(2.0, VQSpec(256, 4), VQSpec(256, 4)),
    1.5: Preset(1.5, VQSpec(4096, 8), VQSpec(4096, 8)),
    1.25: Preset(1.25, VQSpec(4096, 8), VQSpec(256, 8)),
    1.0: Preset(1.0, VQSpec(256, 8), VQSpec(256, 8)),
}


def get_preset(bits: float) -> Preset:
    """The preset for ``bits`` (one of 4, 3, 2, 1.5, 1.25, 1); a clear error otherwise."""
    try:
        return PRESETS[float(bits)]
    except KeyError:
        known = ", ".join(f"{b:g}" for b in PRESETS)
        raise ValueError(f"no VecInfer preset for {bits} bits; choose one of: {known}") from None


def _byte_coded(bits: float) -> bool:
    """Whether ``bits`` is a preset whose key and value codes fit in 8 bits."""
    return bits in PRESETS and max(PRESETS[bits].key.entries, PRESETS[bits].value.entries) <= 256


def allocation_choices(bits: float) -> tuple[float, float, float]:
    """The presets a retrieval allocation mixes: ``bits / 2``, ``bits`` and ``2 * bits``, each
    with 8-bit codes so that physical size follows nominal bits."""
    choices = (bits / 2, bits, 2 * bits)
    if not all(map(_byte_coded, choices)):
        usable = [b for b in PRESETS if all(map(_byte_coded, (b / 2, b, 2 * b)))]
        raise ValueError(
            f"a per-layer allocation at {bits:g} bits needs 8-bit-code presets at {bits / 2:g}, "
            f"{bits:g} and {2 * bits:g} bits; available for bits={', '.join(f'{b:g}' for b in usable)}"
        )
    return choices
