"""Which decoder layers hold codes: the rule for models that mix attention kinds, written once for
:class:`~vecinfer_compile.cache.VecInferCache` and the simulate path (:mod:`~vecinfer_compile.simulate`).

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
- A hybrid layer (``"hybrid"``, ``"hybrid_sliding"``: attention beside a state-space mixer in the
  same layer, Falcon-H1, ZAYA) counts as its attention (full, sliding) for the rules above; a coded
  one keeps the mixer's conv/recurrent state beside its codes.
- A layer that reads another layer's K/V (transformers' ``config.kv_sharing_modes[i] == "reuse"``:
  the last layers of Gemma 3n and Gemma 4) stores nothing (:func:`kv_producers` names the layer it
  reads); it is coded when its kind is, and reads its producer's codes.
"""

from __future__ import annotations

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
# layers without attention K/V: linear attention / state-space ("mamba" is its legacy name),
# short convolutions, and nemotron_h's MLP-only and MoE-only layers. They get no codebooks.
NO_KV_KINDS = ("linear_attention", "mamba", "conv", "moe", "mlp")
HYBRID_KINDS = {"hybrid": FULL, "hybrid_sliding": SLIDING}  # hybrid kind -> the kind of its attention


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


def attention_kinds(config) -> list[str]:
    """:func:`layer_kinds` with a hybrid layer named by its attention (``"hybrid"`` -> full)."""
    return [HYBRID_KINDS.get(kind, kind) for kind in layer_kinds(config)]


def coded_layers(config) -> list[bool]:
    """Per decoder layer: whether its attention reads codes in a VecInferCache (and the simulate
    path quantizes it). See the module docstring."""
    kinds = attention_kinds(config)
    if FULL in kinds:
        return [k == FULL for k in kinds]
    return [k == SLIDING for k in kinds]


def kv_producers(config) -> list[int]:
    """Per decoder layer, the layer whose cache entries its attention reads: itself, or for a layer
    that reuses another's K/V (``config.kv_sharing_modes[i] == "reuse"``) the last earlier layer
    of its kind that stores its own, as transformers' models pick it."""
    kinds = layer_kinds(config)
    modes = getattr(_text_config(config), "kv_sharing_modes", None) or [None] * len(kinds)
    return [
        i if mode != "reuse" else max(j for j in range(i) if kinds[j] == kind and modes[j] != "reuse")
        for i, (kind, mode) in enumerate(zip(kinds, modes))
    ]


def sliding_window(config) -> int | None:
    """The sliding window of ``config``'s sliding layers (None without one)."""
    return getattr(_text_config(config), "sliding_window", None)


def some_coded_layers(config) -> list[bool]:
    """:func:`coded_layers`, or a ValueError when there are none (the cache and the simulate path
    refuse such a model alike)."""
    coded = coded_layers(config)
    if not any(coded):
        raise ValueError(
            f"VecInfer has nothing to compress in this model: its layers are {sorted(set(attention_kinds(config)))} "
            "(codes are for full-attention or sliding-window layers); use transformers' own cache"
        )
    return coded


def check_codable(config, residual: int) -> list[bool]:
    """:func:`coded_layers`, after the checks a VecInferCache needs: at least one coded layer,
    and ``residual <= W`` when sliding layers are coded. Raises ValueError naming the fix."""
    coded = some_coded_layers(config)
    kinds = attention_kinds(config)
    window = sliding_window(config)
    if SLIDING in kinds and window is None:
        raise ValueError(
            "the config lists sliding_attention layers but sets no sliding_window: set "
            "config.sliding_window (or make those layers full_attention)"
        )
    if any(c and k == SLIDING for c, k in zip(coded, kinds)) and window is not None and residual > window:
        raise ValueError(
            f"residual={residual} is longer than the model's sliding window ({window}): a query reads only "
            f"its last {window} keys, so pass residual <= {window}"
        )
    return coded
