"""What a calibration will do, checked before any work: the method and how it codes, the presets
each layer is fitted at, and what the recording needs (queries, positions, window lengths)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..allocate import allocation_choices
from ..codebooks import model_geometry
from ..codecs import registry
from ..hf.layer_kinds import coded_layers
from ..methods import VQ_METHODS, KeyTransformSpec, check_method
from ..presets import get_preset
from ..quant.refine import RefineConfig
from ..quant.rope import model_rope_frequencies
from ..quant.score_aware import check_parallel_weight
from ..quant.transform import KeyTransform


@dataclass(frozen=True)
class CalibrationPlan:
    """``candidates``: per decoder layer, the bits of each preset it is fitted at (one, or the
    choices of a retrieval allocation); ``per_layer_bits``: the layers may end at different
    presets (every layer must then be recorded); ``coded``: per decoder layer, whether a
    VecInferCache codes it (:func:`~vecinfer_compile.hf.layer_kinds.coded_layers`); ``refine``: how
    centroids are refined (None: the method does not refine); ``rope_inv_freq [r/2]``: the
    model's RoPE frequencies for the pre-RoPE methods (else None); ``key_codec`` /
    ``value_codec``: the registered codec of each side (:mod:`vecinfer_compile.codecs`) and
    ``codec_options`` their options."""

    method: str
    spec: KeyTransformSpec
    geometry: dict
    candidates: list[tuple[float, ...]]
    per_layer_bits: bool
    coded: list[bool]
    key_parallel_weight: float
    weighted_codes: bool
    ridge: float
    refine: RefineConfig | None
    rope_inv_freq: torch.Tensor | None
    key_codec: str = registry.DEFAULT
    value_codec: str = registry.DEFAULT
    codec_options: dict = field(default_factory=dict)

    @property
    def with_queries(self) -> bool:
        """Whether the recording keeps the queries (query-aware matrices, refinement, error metrics)."""
        return bool(self.spec.query_aware) or self.refine is not None or self.weighted_codes

    def gets_codebooks(self, layer: int, keys: torch.Tensor) -> bool:
        """Whether layer ``layer`` (recorded ``keys: [H_kv, N, D]``) gets codebooks: not an uncoded
        layer of another geometry than the coded ones (Gemma 4's sliding layers)."""
        geometry = self.geometry
        return self.coded[layer] or (keys.shape[0], keys.shape[-1]) == (geometry["num_kv_heads"], geometry["head_dim"])


def plan_calibration(
    model,
    bits: float | None,
    method: str,
    *,
    layer_bits: list[float] | None,
    allocate: str | None,
    ridge: float,
    refine: RefineConfig | None,
    key_parallel_weight: float | None,
    weighted_codes: bool | None,
    key_codec: str | None = None,
    value_codec: str | None = None,
    codec_options: dict | None = None,
) -> CalibrationPlan:
    """The plan of :func:`~vecinfer_compile.calibrate` for ``model`` (its arguments of
    the same names), or a ValueError naming the fix for arguments it cannot run."""
    if layer_bits is not None and allocate is not None:
        raise ValueError("give either layer_bits or allocate, not both")
    if allocate not in (None, "uniform", "retrieval"):
        raise ValueError(f"allocate must be 'uniform' or 'retrieval', got {allocate!r}")
    check_method(method)
    if method not in VQ_METHODS:
        raise ValueError(f"method {method!r} needs no calibration; calibrate one of {list(VQ_METHODS)}")
    geometry = model_geometry(model.config)
    num_layers, head_dim = geometry["num_layers"], geometry["head_dim"]
    if layer_bits is not None:
        if len(layer_bits) != num_layers:
            raise ValueError(f"layer_bits gives {len(layer_bits)} presets for a model of {num_layers} layers")
        candidates = [(float(b),) for b in layer_bits]
    elif bits is None:
        raise ValueError("give bits (one preset for every layer, or the average to allocate) or layer_bits")
    elif allocate == "retrieval":
        candidates = [allocation_choices(float(bits))] * num_layers
    else:
        candidates = [(float(bits),)] * num_layers
    for b in {b for c in candidates for b in c}:
        preset = get_preset(b)
        preset.key.check_head_dim(head_dim)
        preset.value.check_head_dim(head_dim)
    spec = VQ_METHODS[method]
    key_parallel_weight = check_parallel_weight(
        spec.key_parallel_weight if key_parallel_weight is None else key_parallel_weight
    )
    weighted_codes = spec.weighted_codes if weighted_codes is None else bool(weighted_codes)
    if spec.rotate:
        KeyTransform(head_dim).rotation(torch.float32, "cpu")  # clear error for bad head dims
    if spec.query_aware and not ridge > 0:
        raise ValueError(f"ridge must be > 0 (it keeps the query moment invertible), got {ridge}")
    if weighted_codes and (spec.pre_rope or spec.predict_values):
        raise ValueError(
            f"weighted codes need keys whose scores the query transform keeps exact and plain value "
            f"codes; method {method!r} has neither: use --method qaware (or vecinfer)"
        )
    key_codec, value_codec = key_codec or registry.DEFAULT, value_codec or registry.DEFAULT
    codec_options = dict(codec_options or {})
    for side, name in (("key", key_codec), ("value", value_codec)):
        _check_codec(side, name, codec_options, spec, method, candidates, head_dim)
    return CalibrationPlan(
        method=method,
        spec=spec,
        geometry=geometry,
        candidates=candidates,
        per_layer_bits=layer_bits is not None or allocate == "retrieval",
        coded=coded_layers(model.config),
        key_parallel_weight=key_parallel_weight,
        weighted_codes=weighted_codes,
        ridge=ridge,
        refine=refine if spec.refine else None,
        rope_inv_freq=model_rope_frequencies(model, head_dim) if spec.pre_rope else None,
        key_codec=key_codec,
        value_codec=value_codec,
        codec_options=codec_options,
    )


def _check_codec(
    side: str,
    name: str,
    options: dict,
    spec: KeyTransformSpec,
    method: str,
    candidates: list[tuple[float, ...]],
    head_dim: int,
) -> None:
    """A ValueError naming the fix for a codec of ``side`` (``"key"`` or ``"value"``), its options, the
    method or the bits it cannot run."""
    codec = registry.get(name)
    if name != registry.DEFAULT and spec.predict_values:
        raise ValueError(
            f"method {method!r} predicts values from the default codec's key codes; the {name} {side} "
            "codec needs plain key and value codes: use --method qaware (or vecinfer)"
        )
    codec.check_plan(sorted({b for c in candidates for b in c}), head_dim, options)
