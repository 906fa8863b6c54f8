"""Which decoder layers hold codes: the rule for models that mix attention kinds, written once for
:class:`~vecinfer_compile.cache.VecInferCache` and the simulate path (:mod:`.simulate`).

A layer's kind is transformers' ``config.layer_types`` entry (``"full_attention"``,
``"sliding_attention"``, ``"chunked_attention"``, ``"conv"``, ``"linear_attention"``, ...), or, for
configs without that list (Mistral), ``"sliding_attention"`` on every layer when
``config.sliding_window`` is set, ``"chunked_attention"`` when ``attention_chunk_size`` is, else
``"full_attention"``.

- A model with full-attention layers (Gemma 3, Cohere2, OLMo3, EXAONE 4, Llama 4, ...): those are
  coded; every other layer keeps transformers' own bounded cache layer in full precision (a
  sliding layer holds at most its window ``W`` in 16 bits, which is smaller than 2-bit codes of a
  context longer than ``8 W``, and costs no accuracy).
- A model whose every attention layer is sliding (Mistral v0.1 with ``sliding_window``): those are
  coded over the whole context, the sliding mask deciding what a query reads (the decode kernels
  start at the mask's first attended slot), so the cache is smaller than a full-precision sliding
  cache while the context is shorter than ``8 W`` at 2 bits. Needs the full-precision window
  ``R <= W`` (the kernels read the whole window).
- Chunked layers alone are never coded (a query at the start of a chunk sees only itself, less
  than any window), nor are linear-attention or convolution layers (their state is not K/V).
"""

from __future__ import annotations

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def layer_kinds(config) -> list[str]:
    """One kind per decoder layer of ``config`` (a transformers config)."""
    config = _text_config(config)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        kind = SLIDING
    elif getattr(config, "attention_chunk_size", None) is not None:
        kind = CHUNKED
    else:
        kind = FULL
    return [kind] * config.num_hidden_layers


def coded_layers(config) -> list[bool]:
    """Per decoder layer: whether a VecInferCache stores it as codes (and the simulate path
    quantizes it). See the module docstring."""
    kinds = layer_kinds(config)
    if FULL in kinds:
        return [k == FULL for k in kinds]
    return [k == SLIDING for k in kinds]


def sliding_window(config) -> int | None:
    """The sliding window of ``config``'s sliding layers (None without one)."""
    return getattr(_text_config(config), "sliding_window", None)


def check_codable(config, residual: int) -> list[bool]:
    """:func:`coded_layers`, after the checks a VecInferCache needs: at least one coded layer,
    and ``residual <= W`` when sliding layers are coded. Raises ValueError naming the fix."""
    coded = coded_layers(config)
    kinds = layer_kinds(config)
    if not any(coded):
        raise ValueError(
            f"VecInferCache has nothing to compress in this model: its layers are {sorted(set(kinds))} "
            "(codes are for full-attention or sliding-window layers); use transformers' own cache"
        )
    window = sliding_window(config)
    if SLIDING in kinds and window is None:
        raise ValueError("the config lists sliding_attention layers but sets no sliding_window: set "
                         "config.sliding_window (or make those layers full_attention)")
    if any(c and k == SLIDING for c, k in zip(coded, kinds)) and window is not None and residual > window:
        raise ValueError(
            f"residual={residual} is longer than the model's sliding window ({window}): a query reads only "
            f"its last {window} keys, so pass residual <= {window}"
        )
    return coded
