"""The ``vecinfer`` custom ops (registered at import) and their implementations.

- ``torch.ops.vecinfer.encode`` / ``quantize`` / ``attention`` / ``decode_attention`` (and its
  kernel-specific twins ``decode_attention_cuda`` / ``decode_attention_triton``): see :mod:`.library`.
- :mod:`.reference`: pure-torch oracle (CPU path).
- :func:`encode_triton`, :func:`attention_triton`, :func:`decode_attention_triton`: the CUDA
  kernels' launchers, callable directly (benchmarks) or, with ``wrap=True``, inside the ops;
  :func:`decode_attention_cuda`: the CUDA decode kernel (NVRTC, :mod:`.nvrtc`); :mod:`.decode_kernels`
  chooses between it and Triton.
- ``torch.ops.vecinfer.cache_kv``: the compressed cache's eager read, see :mod:`.cache_ops`.
- ``torch.ops.vecinfer.cache_append`` (and ``cache_append_cuda``): the compressed cache's
  in-place append, see :mod:`.cache_append` and :mod:`.cuda_append`; ``record_undo``: what
  undoing it needs, see :mod:`.cache_undo`.
"""

from . import cache_append, cache_ops, cache_undo, decode_kernels, nvrtc, reference
from .cuda_decode import decode_attention_cuda
from .library import register
from .triton_attention import attention_triton
from .triton_decode import decode_attention_triton
from .triton_encode import encode_triton

__all__ = ["attention_triton", "cache_append", "cache_ops", "cache_undo", "decode_attention_cuda", "decode_attention_triton", "decode_kernels",
           "encode_triton", "nvrtc", "reference", "register"]
