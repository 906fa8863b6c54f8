"""The calibration artifact: per-layer key transform and key/value codebooks, with metadata.

:mod:`.model` (the data model: :class:`LayerCodebooks`, :class:`VecInferCodebooks` and their
checks against a model), :mod:`.file_format` (the current file format: writing, and the strict
reader), :mod:`.convert` (older formats brought to the current one), :mod:`.load`
(:func:`load_codebooks`)."""

from .file_format import FORMAT
from .load import load_codebooks
from .model import LayerCodebooks, VecInferCodebooks, average_bits, geometry_fingerprint, model_geometry

__all__ = [
    "FORMAT",
    "LayerCodebooks",
    "VecInferCodebooks",
    "average_bits",
    "geometry_fingerprint",
    "load_codebooks",
    "model_geometry",
]
