"""What VecInfer's attention supports: one rule and one message each, for every path that runs it.

VecInfer quantizes the keys and values an attention call receives and attends over them as SDPA
does. A model is refused, in one line naming why, when

- its config describes no attention it can code (:func:`attention_config`, read by
  :func:`~vecinfer_compile.codebooks.model_geometry`): no attention layers at all (Mamba, RWKV,
  xLSTM), attention only in sub-configs of several stacks (BLT), or a geometry that differs between
  the layers it codes (:func:`uniform_attribute`; Gemma 4's sliding layers have a smaller
  ``head_dim`` than its full ones, which is fine: only the full ones are coded);
- an attention call does more than SDPA (:func:`check_attention_call`, run by the calibration
  recorder, :mod:`.recording`, and the simulate attention, :mod:`~vecinfer_compile.simulate`,
  before they compute anything): attention sinks (GPT-OSS's ``s_aux``), logit softcapping
  (Gemma 2's ``softcap``), sparse attention indices (DeepSeek V3.2's ``indices``), or
  query/key/value of different head dims (multi-head latent attention).

:func:`needs_unskipped_masks` says which mask they ask transformers for.
"""

from __future__ import annotations

import torch

# AttentionInterface keywords that change what attention computes, and that VecInfer's attention does
# not implement: keyword -> (what it is, what the module does with it). None means unused.
UNSUPPORTED_KWARGS = {
    "s_aux": ("attention sinks (s_aux) are", "adds learned sink logits to the softmax"),
    "sinks": ("attention sinks (sinks) are", "adds learned sink logits to the softmax"),
    "softcap": ("attention logit softcapping (softcap) is", "caps its attention scores with tanh"),
    "indices": ("sparse attention indices (indices) are", "attends only to the keys an indexer selects"),
    "block_indices": (
        "block-sparse attention indices (block_indices) are",
        "attends only to the key blocks an indexer selects",
    ),
}


def _where(module) -> str:
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def check_attention_call(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict) -> None:
    """Raise a NotImplementedError naming the feature when an AttentionInterface call needs more than
    SDPA over one head_dim. query ``[B, Hq, Tq, Dq]``, key ``[B, Hkv, Tk, Dk]``, value
    ``[B, Hkv, Tk, Dv]``; ``kwargs``: the call's other keywords."""
    dims = (query.shape[-1], key.shape[-1], value.shape[-1])
    if len(set(dims)) > 1:
        raise NotImplementedError(
            f"{_where(module)} has different query/key/value head dims ({'/'.join(map(str, dims))}); "
            "VecInfer attention needs one head_dim (multi-head latent attention is not supported)"
        )
    for name, (feature, what) in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{feature} not supported by VecInfer's attention: {_where(module)} {what}; "
                "run this model without VecInfer"
            )


def _layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"layers 0-2, 5"``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
    return ("layers " if len(layers) > 1 else "layer ") + text


def uniform_attribute(cfg, name: str, layers: list[bool] | None = None):
    """``cfg.<name>`` (None when the config has no such attribute). On a heterogeneous config
    (transformers' ``per_layer_config``: Gemma 4's ``head_dim`` and ``num_key_value_heads``) its one
    value over the layers marked in ``layers`` (every layer when None; the coded ones for the
    geometry), or a ValueError naming the layers when they differ: codebooks and the cache hold one
    geometry."""
    if not getattr(cfg, "is_heterogeneous", False):
        return getattr(cfg, name, None)
    picked = [i for i in range(cfg.num_hidden_layers) if layers is None or layers[i]]
    per_layer = {i: getattr(cfg.per_layer_config[i], name, None) for i in picked}
    values = list(dict.fromkeys(per_layer.values()))
    if len(values) > 1:
        groups = ", ".join(f"{v} in {_layer_ranges([i for i, x in per_layer.items() if x == v])}" for v in values)
        which = "layers" if layers is None else "the layers VecInfer codes"
        raise ValueError(
            f"{which} have different {name} ({groups}): not supported, VecInfer's codebooks "
            f"and cache need one {name} for every coded layer"
        )
    return values[0] if values else None


def attention_config(config):
    """The (text) config that describes ``config``'s attention layers, or a ValueError saying why
    there is none VecInfer can code."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if uniform_attribute(cfg, "num_attention_heads") is not None:
        return cfg
    stacks = [
        name
        for name in getattr(type(cfg), "sub_configs", None) or {}
        if getattr(getattr(cfg, name, None), "num_attention_heads", None) is not None
    ]
    if stacks:
        raise ValueError(
            f"{type(cfg).__name__} has its attention in sub-configs ({', '.join(stacks)}), not in one "
            "stack of decoder layers: not supported by VecInfer"
        )
    raise ValueError(
        f"this model has no attention layers ({type(cfg).__name__} has no num_attention_heads): VecInfer "
        "compresses attention K/V; use transformers' own cache for this model"
    )


def needs_unskipped_masks(model) -> bool:
    """Whether a VecInfer attention implementation on ``model`` needs every mask materialized.
    transformers' SDPA mask leaves a purely causal mask out (None), and causality to the attention
    modules' ``is_causal``, which is kept right only in models transformers runs on SDPA; an
    eager-only model's may be wrong (BigBirdPegasus's decoder self-attention says False)."""
    return not getattr(model, "_supports_sdpa", True)


def unskipped_sdpa_mask(*args, **kwargs):
    """transformers' ``sdpa_mask`` (same arguments), never None: a purely causal or bidirectional
    mask is materialized too, as for eager attention."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})
