"""The method's numerics: Hadamard, key transform, K-Means, VQ codes and their packed storage
layout, KIVI baseline."""

from .codebook import code_dtype, decode, encode, quantize_dequantize
from .hadamard import hadamard_matrix
from .kivi import kivi_keys, kivi_values
from .packing import pack_codes, packed_width, unpack_codes
from .transform import KeyTransform, smoothing_factors

__all__ = [
    "KeyTransform",
    "code_dtype",
    "decode",
    "encode",
    "hadamard_matrix",
    "kivi_keys",
    "kivi_values",
    "pack_codes",
    "packed_width",
    "quantize_dequantize",
    "smoothing_factors",
    "unpack_codes",
]
