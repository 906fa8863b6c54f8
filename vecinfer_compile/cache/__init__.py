"""The compressed KV cache: :class:`VecInferCache` and its parts.

- :mod:`.model_cache`: :class:`VecInferCache`, the layers of a model (layer kinds, hybrid layers,
  tensor parallelism, filling a batch by rows).
- :mod:`.layer`: :class:`VecInferLayer`, transformers' cache-layer protocol for one coded layer;
  :class:`VecInferHybridLayer` beside a state-space mixer.
- :mod:`.storage`: one layer's buffers and counters (allocate, write, reset, reorder, row views,
  undo, bytes).
- :mod:`.reads`: every read of one layer (dequantized, a chunk's, codes for the attention kernels).
- :mod:`.quantizer`: :class:`LayerQuantizer`, one layer's frozen codebooks and key transform.

Which keys a forward reads in full precision is the cache rule of :mod:`vecinfer_compile.window`.
"""

from .layer import VecInferHybridLayer, VecInferLayer
from .model_cache import VecInferCache, full_precision_tensors
from .quantizer import LayerQuantizer

__all__ = ["LayerQuantizer", "VecInferCache", "VecInferHybridLayer", "VecInferLayer", "full_precision_tensors"]
