"""Attention over codes for prefill and the simulate path: ``vecinfer::attention``.

Schema::

    vecinfer::attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_centroids,
        Tensor v_centroids, Tensor? k_full, Tensor? v_full, Tensor? attn_mask, bool is_causal,
        float scale, int residual) -> Tensor

q ``[B, Hq, Tq, D]`` (``q~``) over ``Tk`` coded keys and values, the keys inside each query's
window of ``residual`` (the simulate rule of :mod:`vecinfer_compile.window`) read from
``k_full``/``v_full``. Contract and oracle: :func:`.reference.attention`. On CUDA the Triton
kernel of :mod:`.triton.attention` (visible to Inductor), elsewhere the reference.
"""

from __future__ import annotations

import inspect

import torch

from . import reference
from .registry import define
from .triton.attention import attention_triton


def _attention(*args) -> torch.Tensor:
    if args[0].device.type == "cuda":
        return attention_triton(*args, wrap=True)
    return reference.attention(*args)


_attention.__signature__ = inspect.signature(reference.attention)  # the op's schema is inferred from it
define("attention", _attention, kind="triton")
