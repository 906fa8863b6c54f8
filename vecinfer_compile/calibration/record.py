"""Recording the calibration inputs: the text as token ids, then the post-RoPE keys, values (and,
when the plan needs them, queries) of every attention layer over windows of that text
(:mod:`vecinfer_compile.hf.recording`), checked against the model's layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hf.layer_kinds import NO_KV_KINDS, layer_kinds
from ..hf.recording import collect_kv, recorded_positions, window_lengths
from .fit import LayerSamples
from .plan import CalibrationPlan


def calibration_token_ids(tokenizer, texts: list[str] | str, max_tokens: int) -> torch.Tensor:
    """Tokenize and concatenate ``texts`` into one ``[N]`` int64 tensor of at most max_tokens."""
    if isinstance(texts, str):
        texts = [texts]
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= max_tokens:
            break
    if not ids:
        raise ValueError("calibration text is empty: give at least a few thousand tokens of text")
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


@dataclass
class Recording:
    """What calibration recorded, float32 on the CPU: ``keys``/``values`` ``{layer: [H_kv, N, D]}``;
    ``queries`` ``{layer: [H_q, N, D]}`` when the plan needs them (else None); ``positions [N]``
    int64 for the pre-RoPE methods and ``lengths`` (the windows' token counts) for refinement,
    else None."""

    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    queries: dict[int, torch.Tensor] | None = None
    positions: torch.Tensor | None = None
    lengths: list[int] | None = None

    def layer(self, index: int) -> LayerSamples:
        """The samples of layer ``index``, as :func:`~vecinfer_compile.calibration.fit.fit_layer` takes them."""
        queries = None if self.queries is None else self.queries[index]
        return LayerSamples(self.keys[index], self.values[index], queries, self.positions, self.lengths)


def record(model, token_ids: torch.Tensor, plan: CalibrationPlan, seq_len: int, progress: bool) -> Recording:
    """Run ``model`` over ``token_ids: [N]`` in windows of ``seq_len`` tokens and record what
    ``plan`` fits from; a ValueError when some attention layer recorded nothing
    (:func:`check_recorded_layers`)."""
    recorded = collect_kv(model, token_ids, seq_len, progress, with_queries=plan.with_queries)
    positions = recorded_positions(model, token_ids, seq_len) if plan.spec.pre_rope else None
    check_recorded_layers(model.config, sorted(recorded[0]), per_layer_bits=plan.per_layer_bits)
    lengths = window_lengths(model, token_ids, seq_len) if plan.refine is not None else None
    queries = recorded[2] if plan.with_queries else None
    return Recording(recorded[0], recorded[1], queries, positions, lengths)


def check_recorded_layers(config, recorded: list[int], *, per_layer_bits: bool) -> None:
    """Raise a ValueError unless the layers whose attention was recorded are the model's attention
    layers: every decoder layer, or all but a hybrid model's linear-attention, convolution or
    state-space layers (:func:`~vecinfer_compile.hf.layer_kinds.layer_kinds`), which have no K/V and
    get no codebooks. Per-layer bits (``per_layer_bits``) need every layer recorded."""
    kinds = layer_kinds(config)
    missing = [i for i in range(len(kinds)) if i not in recorded]
    outside = [i for i in recorded if not 0 <= i < len(kinds)]
    if any(i < 0 for i in outside):
        raise ValueError(
            f"an attention module has layer index {min(outside)}: one attention block shared by "
            "several decoder layers, whose K/V per-layer codebooks cannot describe: this model is "
            "not supported"
        )
    if outside:
        raise ValueError(
            f"recorded attention in layers {outside}, which the config's {len(kinds)} decoder "
            "layers do not have: the config does not describe this model"
        )
    attention = [i for i in missing if kinds[i] not in NO_KV_KINDS]
    if attention:
        raise ValueError(
            f"recorded attention in {len(recorded)} of the model's {len(kinds)} layers: layers {attention} "
            f"(kinds {sorted({kinds[i] for i in attention})}) ran no attention through transformers' "
            "AttentionInterface (they share or reuse another layer's attention, or call their own kernel), "
            "so their K/V cannot be calibrated: this model is not supported"
        )
    if missing and per_layer_bits:
        raise ValueError(
            f"layers {missing} have no attention ({sorted({kinds[i] for i in missing})}): per-layer "
            "bits (layer_bits / allocate='retrieval') are for models whose every layer has "
            "attention; calibrate one preset (bits=...)"
        )
