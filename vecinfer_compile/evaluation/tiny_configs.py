"""Tiny random configs for every causal-LM architecture of the installed transformers.

:func:`tiny_config` turns the default config of an architecture (a key of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) into a few-layer, 64-wide one: 4 query heads of head_dim 16
(2 KV heads for a GQA model, 1 for MQA, 4 for MHA: the default's flavour is kept), FFN 128, a
vocabulary of 128, 4 experts with 2 active, a window or chunk of 8 tokens for sliding-window and
chunked attention. Hybrid models keep at least one layer of each kind: the layers are the
shortest prefix of the default layer pattern that holds every kind (every per-layer list of the
config cut to it), or the first layer of each kind when that prefix is long. Per-layer overrides
of heterogeneous configs are cut and shrunk alike (a larger head_dim stays larger, by the same
power of two). Sub-configs (text, vision, audio) are shrunk the same way. :data:`OVERRIDES` holds
what the generic rules cannot know about one config type. :func:`attention_kinds` names a
config's decoder layers.

:func:`tiny_config` raises :class:`ConfigUnavailable` (with the reason) where no tiny config can
be made.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from .outcomes import one_line

WIDTH, HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 16, 128, 128
EXPERTS, ACTIVE_EXPERTS, EXPERT_FFN = 4, 2, 32
WINDOW = 8  # sliding window / attention chunk: prompts are longer than it
MIN_LAYERS, MAX_PREFIX = 2, 8

_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_SIZES = {
    **dict.fromkeys(
        (
            "hidden_size",
            "n_embd",
            "d_model",
            "emb_dim",
            "embed_dim",
            "embedding_dim",
            "word_embed_proj_dim",
            "attention_hidden_size",
            "lru_width",
            "hidden_size_global",
            "adapter_in_dim",
            "adapter_input_size",
            "adapter_out_dim",
        ),
        WIDTH,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "attention_heads",
            "decoder_attention_heads",
            "encoder_attention_heads",
            "num_decoder_attention_heads",
            "num_encoder_attention_heads",
            "swa_num_attention_heads",
        ),
        HEADS,
    ),
    **dict.fromkeys(
        (
            "head_dim",
            "d_head",
            "dim_head",
            "attention_head_size",
            "attention_head_dim",
            "kv_channels",
            "swa_head_dim",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "index_head_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_head_dim",
            "rotary_dim",
            "hidden_size_per_layer_input",
            "pronunciation_embed_dim",
            "shape_embed_dim",
        ),
        HEAD_DIM,
    ),
    **dict.fromkeys(
        (
            "intermediate_size",
            "n_inner",
            "ffn_dim",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
            "ffn_hidden_size",
            "dff",
            "dim_ff",
            "d_inner",
            "feed_forward_size",
            "intermediate_size_mlp",
            "dense_intermediate_size",
        ),
        FFN,
    ),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
            "expert_ffn_hidden_size",
        ),
        EXPERT_FFN,
    ),
    **dict.fromkeys(_EXPERT_COUNTS, EXPERTS),
    **dict.fromkeys(("n_group", "topk_group", "n_groups", "mamba_n_groups"), 1),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank"), 32),
    **dict.fromkeys(
        (
            "sliding_window",
            "attention_chunk_size",
            "sliding_window_size",
            "window_size",
            "local_attention",
            "attention_window_size",
        ),
        WINDOW,
    ),
    **dict.fromkeys(("index_n_heads", "linear_num_key_heads"), 2),
    **dict.fromkeys(("linear_num_value_heads", "linear_num_heads", "mamba_n_heads", "mamba_num_heads"), HEADS),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim"), 2 * WIDTH // HEADS),  # heads x head = expand (2) x width
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "state_size"), 16),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    **dict.fromkeys(
        (
            "vocab_size",
            "vocab_size_per_layer_input",
            "pronunciation_vocab_size",
            "shape_vocab_size",
            "encoder_hash_byte_group_vocab",
        ),
        VOCAB,
    ),
    "mamba_d_ssm": 2 * WIDTH,
    "index_topk": WINDOW,
    "zero_expert_num": 2,
}
_ACTIVE = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts")
_ALWAYS = ("head_dim",)  # set even where the default is None (some defaults leave it unset and do not build)
_LAYER_COUNTS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
)
_LAYER_PATTERNS = ("layer_types", "layers_block_type", "block_types", "attention_layers", "attn_layers")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads")
_SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# Per config class (sub-configs included): fields the generic rules get wrong, each with why.
OVERRIDES: dict[str, dict] = {
    # full_attn_idxs lists layer indices (not one entry per layer); the default makes every layer
    # attention: keep LFM2's mix of short convolutions and attention
    "Lfm2Config": {"full_attn_idxs": [1], "layer_types": ["conv", "full_attention"]},
    "Lfm2MoeConfig": {"num_hidden_layers": 3, "num_dense_layers": 1, "layer_types": ["conv", "full_attention", "conv"]},
    "GPTNeoConfig": {"attention_types": [[["global", "local"], 1]]},  # [[kinds, repeats]]: one of each
    # the default names routed experts but gives no count or top-k
    "Dots1Config": {"n_routed_experts": EXPERTS, "num_experts_per_tok": ACTIVE_EXPERTS, "n_shared_experts": 1},
    # its sliding layers' MLA needs head_dim = qk_nope_head_dim + qk_rope_head_dim
    "Dots3NoteTextConfig": {"head_dim": 2 * HEAD_DIM},
    "ZayaConfig": {"num_experts_per_tok": 1},  # ZAYA runs one expert per token only
    "XmodConfig": {"default_language": "en_XX"},  # its adapters need a language
    "Mamba2Config": {"head_dim": 2 * WIDTH // HEADS},  # heads x head_dim = expand (2) x hidden
    "MusicgenDecoderConfig": {"num_codebooks": 1},  # input_ids [B, T]: one audio codebook
    "MusicgenMelodyDecoderConfig": {"num_codebooks": 1},
    # transformers' defaults do not build: the attention reads rope_theta and clamps by clip_qkv
    "DbrxAttentionConfig": {"rope_theta": 500000.0, "clip_qkv": 8.0},
    # RoPE parameters per layer type (the default has none)
    "CohereCompassTextConfig": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the default leaves the sparse indexer of its indexed-attention layers unset
    "Qwen4ExpTextConfig": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": WINDOW,
        "indexer_compress_ratio": 2,
    },
    # one chunked (RoPE) and one full (NoPE) layer, MoE both, instead of the 4-layer prefix of
    # the 3:1 pattern (moe_layers lists layer indices)
    "Llama4TextConfig": {
        "num_hidden_layers": 2,
        "layer_types": ["chunked_attention", "full_attention"],
        "no_rope_layers": [1, 0],
        "moe_layers": [0, 1],
    },
    # axial position embeddings: dims summing to the width, a shape multiplying to the positions;
    # chunks shorter than the prompt
    "ReformerConfig": {
        "axial_pos_embds_dim": [WIDTH // 2, WIDTH // 2],
        "axial_pos_shape": [16, 16],
        "max_position_embeddings": 256,
        "local_attn_chunk_length": WINDOW,
        "lsh_attn_chunk_length": WINDOW,
        "num_buckets": 4,
    },
    # its attention is twice as wide as the hidden size
    "ZambaConfig": {"attention_hidden_size": 2 * WIDTH, "attention_head_dim": 2 * WIDTH // HEADS},
    # hybrids whose defaults have no attention layer at all (the released models have some)
    "BambaConfig": {"attn_layer_indices": [1]},
    "GraniteMoeHybridConfig": {"layer_types": ["linear_attention", "full_attention"]},
    # KV sharing: the last 5 of 10 layers reuse the caches of earlier layers of their kind
    "Gemma3nTextConfig": {"num_kv_shared_layers": 5},
    # its input, recurrent and output layer counts must add up to the layers kept (the defaults,
    # 8 + 8 of 4 layers, run every layer twice a forward, and transformers' own generate() fails)
    "DoryConfig": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    # a window no prompt reaches, as the released model's (3000 = its positions): with a shorter
    # one, transformers' own StaticCache and DynamicCache give different logits for Moshi
    "MoshiConfig": {"sliding_window": 32},
}
# Per config class: layers to keep (a prefix of the default pattern) where one of each kind is
# not enough.
PREFIX_LAYERS: dict[str, int] = {
    "ZambaConfig": 8,  # the shared transformer block is tied across hybrid layers: two of them (2, 7)
    "Gemma3nTextConfig": 10,  # two rounds of its 5-layer pattern: one producing KV, one sharing it
}


class ConfigUnavailable(Exception):
    """No tiny config can be built for this architecture; the message says why."""


def _fields(cls) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:  # a config class that is not a dataclass
        return set()


def _get(config, name: str):
    """``config.name``; for a field that a heterogeneous config holds per layer (which
    transformers refuses to read globally), its global value as serialized."""
    try:
        return getattr(config, name, None)
    except Exception:
        return config.to_dict().get(name)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kv_heads(values: dict, kv_names=_KV_HEADS) -> dict:
    """Tiny KV heads for ``values`` (name -> default): the default's flavour at 4 query heads."""
    heads = next((values[n] for n in ("num_attention_heads", "n_head", "num_heads") if _is_int(values.get(n))), None)
    return {
        name: HEADS if values[name] == heads else 1 if values[name] == 1 else 2
        for name in kv_names
        if _is_int(values.get(name))
    }


def _pattern(config) -> tuple[str, list] | None:
    for name in _LAYER_PATTERNS:
        value = _get(config, name)
        if isinstance(value, (list, tuple)) and value:
            return name, list(value)
    return None


def _layer_selection(kinds: list) -> list[int]:
    """Indices of the layers to keep: the shortest prefix holding every kind (at least
    MIN_LAYERS), or the first layer of each kind when that prefix is longer than MAX_PREFIX."""
    first: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        first.setdefault(str(kind), i)
    prefix = max(max(first.values()) + 1, min(MIN_LAYERS, len(kinds)))
    if prefix <= MAX_PREFIX:
        return list(range(prefix))
    keep = sorted(first.values())
    return keep if len(keep) >= MIN_LAYERS else sorted({*keep, next(i for i in range(len(kinds)) if i not in keep)})


def _shrunk_override(layer: dict, globals_: dict) -> dict:
    """One layer's overrides of a heterogeneous config, shrunk: sizes as everywhere, a head_dim
    that differs from the global one by the same power-of-two factor."""
    out = {}
    for key, value in layer.items():
        if key == "head_dim" and _is_int(value) and _is_int(globals_.get("head_dim")):
            factor = max(value / globals_["head_dim"], 1.0)
            out[key] = HEAD_DIM * 2 ** round(math.log2(factor))
        elif key in _SIZES and _is_int(value):
            out[key] = _SIZES[key]
        else:
            out[key] = value
    out.update(_kv_heads({**{k: globals_.get(k) for k in ("num_attention_heads",)}, **layer}))
    return out


def _layers(cls, default) -> dict:
    """Layer counts, every per-layer list and per-layer overrides cut to the kept layers."""
    fields = _fields(cls)
    count_names = [n for n in _LAYER_COUNTS if n in fields and _is_int(_get(default, n))]
    total = next((_get(default, n) for n in count_names), None)
    pattern = _pattern(default)
    if cls.__name__ in PREFIX_LAYERS:
        keep = list(range(PREFIX_LAYERS[cls.__name__]))
    elif pattern:
        keep = _layer_selection(pattern[1])
    else:
        keep = list(range(min(MIN_LAYERS, total or MIN_LAYERS)))
    out = {n: len(keep) for n in count_names}
    for name in fields:
        value = _get(default, name)
        if isinstance(value, list) and total is not None and len(value) == total and name != "architectures":
            out[name] = [value[i] for i in keep]
    if pattern and pattern[0] in fields:
        out[pattern[0]] = [pattern[1][i] for i in keep]
    serialized = default.to_dict() if hasattr(default, "to_dict") else {}
    per_layer = serialized.get("per_layer_config")
    if per_layer:
        by_index = {int(i): layer for i, layer in per_layer.items()}
        out["per_layer_config"] = {
            new: _shrunk_override(by_index[old], serialized) for new, old in enumerate(keep) if old in by_index
        }
    return out


def _sizes(cls, default, layers: int) -> dict:
    fields = _fields(cls)
    out = {}
    for name, size in _SIZES.items():
        value = _get(default, name)
        if name in fields and (value is not None or name in _ALWAYS):
            out[name] = [size] * layers if isinstance(value, list) else size
    if any(name in out for name in _EXPERT_COUNTS):
        out.update({name: ACTIVE_EXPERTS for name in _ACTIVE if name in fields})
    out.update(_kv_heads({n: _get(default, n) for n in ("num_attention_heads", "n_head", "num_heads", *_KV_HEADS)}))
    if "num_key_value_heads" in fields and _get(default, "num_key_value_heads") is None:
        out["num_key_value_heads"] = HEADS  # None means one KV head per query head
    if "is_decoder" in fields:
        out["is_decoder"] = True  # BERT-like models are causal only as decoders
    return out


def _tokens(default, vocab: int) -> dict:
    out = {}
    for name, small in _SPECIAL_TOKENS.items():
        value = _get(default, name)
        ids = value if isinstance(value, list) else [value]
        if any(_is_int(i) and i >= vocab for i in ids):
            out[name] = small
    return out


def shrink(cls, default=None):
    """A tiny instance of config class ``cls`` from its default instance ``default``."""
    default = cls() if default is None else default
    layers = _layers(cls, default)
    count = next((v for k, v in layers.items() if k in _LAYER_COUNTS), MIN_LAYERS)
    kwargs = {**_sizes(cls, default, count), **layers}
    kwargs.update(_tokens(default, kwargs.get("vocab_size", VOCAB)))
    for name in getattr(cls, "sub_configs", None) or {}:
        sub = _get(default, name)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[name] = shrink(type(sub), sub)
    kwargs.update(OVERRIDES.get(cls.__name__, {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**kwargs)


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (a key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``).
    Raises :class:`ConfigUnavailable` naming why not."""
    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError as exc:
        raise ConfigUnavailable(f"no config class for {model_type!r} in this transformers") from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            default = cls()
    except Exception as exc:
        raise ConfigUnavailable(f"its default config does not build ({type(exc).__name__}: {one_line(exc)})") from exc
    try:
        return shrink(cls, default)
    except Exception as exc:
        raise ConfigUnavailable(f"no tiny config ({type(exc).__name__}: {one_line(exc)})") from exc


_KIND_NAMES = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
    "indexed_attention": "indexed",
    "attention": "full",
    "global": "full",
    "local": "sliding",
    "lsh": "lsh (hashed buckets)",
}


def attention_kinds(config) -> list[str]:
    """Kinds of the config's decoder layers, in order of first appearance: ``full``, ``sliding``,
    ``chunked``, ``linear``, ``indexed`` (sparse indexer) or the config's own name for others
    (``conv``, ``recurrent``, ``hybrid``, ...). A config without a layer pattern is one kind:
    sliding with a ``sliding_window``, chunked with an ``attention_chunk_size``, else full."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    pattern = _pattern(text)
    if pattern:
        return list(dict.fromkeys(_KIND_NAMES.get(str(k), str(k)) for k in pattern[1]))
    if _get(text, "attention_chunk_size"):
        return ["chunked"]
    if _get(text, "sliding_window") and _get(text, "use_sliding_window") is not False:
        return ["sliding"]
    return ["full"]
