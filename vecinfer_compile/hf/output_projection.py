"""The output projection of a transformers attention module: the linear map from the heads'
concatenated outputs ``[..., H_q * D]`` to the hidden size, through which calibration weighs
attention-output errors (:mod:`~vecinfer_compile.quant.refine`,
:mod:`~vecinfer_compile.quant.weighted_codes`).

Architectures name it differently: ``o_proj`` (Llama, Mistral, Qwen, Gemma, ...), ``dense``
(GPT-NeoX, Phi, Falcon), ``out_proj`` (OPT, GPT-J), ``c_proj`` (GPT-2, whose ``Conv1D`` stores the
weight transposed, and GPTBigCode).
"""

from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D

NAMES = ("o_proj", "dense", "out_proj", "c_proj")


def output_projection_weight(module, num_query_heads: int, head_dim: int) -> torch.Tensor | None:
    """``[hidden, H_q * D]`` (detached, the module's dtype) of the first attribute of ``module``
    named in :data:`NAMES` that maps ``H_q * D`` inputs (an ``nn.Linear``, or a ``Conv1D`` read
    transposed), or None when there is none (``module`` None included)."""
    width = num_query_heads * head_dim
    for name in NAMES:
        proj = getattr(module, name, None)
        weight = getattr(proj, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        weight = weight.detach()
        if isinstance(proj, Conv1D):
            weight = weight.t()
        if weight.shape[1] == width:
            return weight
    return None
