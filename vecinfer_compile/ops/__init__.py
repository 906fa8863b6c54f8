"""The ``vecinfer`` custom ops (registered at import) and their implementations.

- ``torch.ops.vecinfer.encode`` / ``quantize`` / ``attention`` / ``decode_attention``: see :mod:`.library`.
- :mod:`.reference`: pure-torch oracle (CPU path).
- :func:`encode_triton`, :func:`attention_triton`, :func:`decode_attention_triton`: the CUDA
  kernels' launchers, callable directly (benchmarks) or, with ``wrap=True``, inside the ops.
- ``torch.ops.vecinfer.cache_kv``: the compressed cache's eager read, see :mod:`.cache_ops`.
"""

from . import cache_ops, reference
from .library import register
from .triton_attention import attention_triton
from .triton_decode import decode_attention_triton
from .triton_encode import encode_triton

__all__ = ["attention_triton", "cache_ops", "decode_attention_triton", "encode_triton", "reference", "register"]
