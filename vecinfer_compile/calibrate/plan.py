"""What a calibration will do, checked before any work: the method and how it codes, the presets
each layer is fitted at, and what the recording needs (queries, positions, window lengths)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocate import allocation_choices
from ..codebooks import model_geometry
from ..hf.layer_kinds import coded_layers
from ..methods import VQ_METHODS, KeyTransformSpec, check_method
from ..presets import DEFAULT_TRELLIS_STATES, check_trellis_states, get_preset
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
    model's RoPE frequencies for the pre-RoPE methods (else None); ``key_codec_states`` /
    ``value_codec_states``: ``L`` when keys / values are coded by the trellis codec of ``2^L``
    states (:mod:`vecinfer_compile.quant.trellis_codec`), None for the codebooks' own codes."""

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
    key_codec_states: int | None = None
    value_codec_states: int | None = None

    @property
    def with_queries(self) -> bool:
        """Whether the recording keeps the queries (query-aware matrices, refinement, error metrics)."""
        return bool(self.spec.query_aware) or self.refine is not None or self.weighted_codes

    def gets_codebooks(self, layer: int, keys: torch.Tensor) -> bool:
        """Whether layer ``layer`` (recorded ``keys: [H_kv, N, D]``) gets codebooks: not an uncoded
        layer of another geometry than the coded ones (Gemma 4's sliding layers)."""
        geometry = self.geometry
        return self.coded[layer] or (keys.shape[0], keys.shape[-1]) == (geometry["num_kv_heads"], geometry["head_dim"])


def plan_calibration(model, bits: float | None, method: str, *, layer_bits: list[float] | None,
                     allocate: str | None, ridge: float, refine: RefineConfig | None,
                     key_parallel_weight: float | None, weighted_codes: bool | None,
                     key_codec: str | None = None, value_codec: str | None = None,
                     trellis_states: int = DEFAULT_TRELLIS_STATES) -> CalibrationPlan:
    """The plan of :func:`~vecinfer_compile.calibrate.calibrate` for ``model`` (its arguments of
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
    key_parallel_weight = check_parallel_weight(spec.key_parallel_weight if key_parallel_weight is None
                                                else key_parallel_weight)
    weighted_codes = spec.weighted_codes if weighted_codes is None else bool(weighted_codes)
    if spec.rotate:
        KeyTransform(head_dim).rotation(torch.float32, "cpu")  # clear error for bad head dims
    if spec.query_aware and not ridge > 0:
        raise ValueError(f"ridge must be > 0 (it keeps the query moment invertible), got {ridge}")
    if weighted_codes and (spec.pre_rope or spec.predict_values):
        raise ValueError(f"weighted codes need keys whose scores the query transform keeps exact and plain value "
                         f"codes; method {method!r} has neither: use --method qaware (or vecinfer)")
    key_codec_states, value_codec_states = (_check_codec(kind, codec, trellis_states, spec, method, candidates,
                                                         head_dim)
                                            for kind, codec in (("key", key_codec), ("value", value_codec)))
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
        key_codec_states=key_codec_states,
        value_codec_states=value_codec_states,
    )


def _check_codec(kind: str, codec: str | None, states: int, spec: KeyTransformSpec, method: str,
                 candidates: list[tuple[float, ...]], head_dim: int) -> int | None:
    """``L`` for a ``"trellis"`` codec of ``kind`` (``"key"`` or ``"value"``) with ``2^L = states``
    trellis states, None for no codec; a ValueError naming the fix for a codec, state count, method
    or bits it cannot run."""
    if codec is None:
        return None
    if codec != "trellis":
        raise ValueError(f"{kind}_codec must be 'trellis' or None, got {codec!r}")
    if states < 2 or states & (states - 1) or states > 1 << 16:
        raise ValueError(f"trellis_states must be a power of two in 2..65536, got {states}")
    if spec.predict_values:
        raise ValueError(f"method {method!r} predicts values from the key codebooks' codes; the trellis {kind} codec "
                         "needs plain key and value codes: use --method qaware (or vecinfer)")
    for b in {b for c in candidates for b in c}:
        check_trellis_states(b, states, "raise trellis_states")
        if abs(b * head_dim - round(b * head_dim)) > 1e-9:
            raise ValueError(f"the trellis {kind} codec spends a whole number of bits a vector: {b:g} bits x "
                             f"head_dim {head_dim} is not one; choose other bits")
    return states.bit_length() - 1
