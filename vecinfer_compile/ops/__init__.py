"""The ``vecinfer`` custom ops (registered at import, through :func:`.registry.define`), one module
per op family, each with its schema, fake, dispatch and kernel choice:

- :mod:`.decode`: ``decode_attention`` (and its kernels ``decode_attention_cuda`` /
  ``decode_attention_triton``), one query token over the codes;
- :mod:`.append`: ``cache_append`` (and ``cache_append_cuda``), ``record_undo``;
- :mod:`.encode`: ``encode``, ``quantize``, ``weigh_codes``;
- :mod:`.dequantize`: ``cache_kv`` (the cache's eager read), ``prefill_read``, a chunk's prefix;
- :mod:`.attention`: ``attention`` over codes (prefill, simulate);
- :mod:`.split_attention`: chunk (``chunk_attention``) and windowed attention, merged by log-sum-exp.

These are the default codec's ops and the ones every codec shares (the split attention, the
window's append rule); another codec's ops live in its package (:mod:`vecinfer_compile.codecs`).

Kernels: :mod:`.cuda` (NVRTC) and :mod:`.triton`; :mod:`.reference` holds every float32 oracle;
:mod:`.kernel_request` the user's choice of kernels; :mod:`.decode_inputs` the query-side inputs;
:mod:`.coded_kv` the bundle of a layer's coded K/V (:class:`.coded_kv.CodedKV`) that the decode and
``cache_kv`` implementations take, and their flat op functions.
"""

from . import append, attention, decode, dequantize, encode, reference
from .cuda.decode import decode_attention_cuda
from .split_attention import chunk
from .triton.attention import attention_triton
from .triton.decode import decode_attention_triton
from .triton.encode import encode_triton

__all__ = [
    "append",
    "attention",
    "attention_triton",
    "chunk",
    "decode",
    "decode_attention_cuda",
    "decode_attention_triton",
    "dequantize",
    "encode",
    "encode_triton",
    "reference",
]
