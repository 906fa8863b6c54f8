"""The method's numerics: Hadamard, key transform, K-Means, VQ codes, KIVI baseline."""

from .codebook import code_dtype, decode, encode, quantize_dequantize
from .hadamard import hadamard_matrix
from .kivi import kivi_keys, kivi_values
from .transform import KeyTransform, smoothing_factors

__all__ = [
    "KeyTransform",
    "code_dtype",
    "decode",
    "encode",
    "hadamard_matrix",
    "kivi_keys",
    "kivi_values",
    "quantize_dequantize",
    "smoothing_factors",
]
