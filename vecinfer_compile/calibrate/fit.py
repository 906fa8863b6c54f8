"""The fit of one attention layer: its key transform, then key and value k-means codebooks at each
preset asked for (and, for the methods that have them, a value predictor, refined centroids and
error metrics). :func:`~vecinfer_compile.calibrate.calibrate` fits every layer with it, and so
does the backend's zero-config path (:mod:`vecinfer_compile.backend`) from the keys and values of
the call it compiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..codebooks import LayerCodebooks
from ..methods import KeyTransformSpec
from ..hf.output_projection import NAMES as OUTPUT_PROJECTION_NAMES, output_projection_weight
from ..presets import get_preset
from ..quant.codebook import quantize_dequantize, subvectors
from ..quant.kmeans import kmeans
from ..quant.query_aware import DEFAULT_RIDGE, query_aware_matrices, second_moment
from ..quant.refine import LayerAttention, RefineConfig, refine_codebooks
from ..quant.rope import rotate
from ..quant.transform import KeyTransform, centre_keys, smoothing_factors
from ..quant.trellis_codec import TrellisCodec
from ..quant.value_prediction import fit_value_predictor
from ..quant.weighted_codes import key_metric, value_metric


@dataclass(frozen=True)
class LayerSamples:
    """One layer's calibration tensors, float32. ``keys: [H_kv, N, D]`` post-RoPE; ``values:
    [H_kv, N, D]`` (any ``[..., D]`` when the method does not predict values: k-means takes their
    sub-vectors in row-major order); ``queries: [H_q, N, D]`` post-RoPE, for the query-aware
    methods, refinement and error metrics (else None); ``positions: [N]`` int64, each key's
    position in its window, for the pre-RoPE methods (else None); ``lengths``: the token count of
    each consecutive calibration window (summing to N), for refinement (else None)."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    lengths: list[int] | None = None


@dataclass(frozen=True)
class FitSettings:
    """How a layer is fitted beyond its method. ``iters``: k-means iterations; ``max_vectors``:
    the most sub-vectors a codebook is fitted on (a seeded random subset above it; None: all);
    ``device``: where k-means runs (None: where the samples are; results come back there);
    ``ridge``: of the query-aware matrices, relative to their mean eigenvalue
    (:mod:`vecinfer_compile.quant.query_aware`); ``rope_inv_freq [r/2]``: the model's RoPE
    frequencies, for the pre-RoPE methods; ``refine``: how refining methods move their centroids
    (:mod:`vecinfer_compile.quant.refine`; None: they keep k-means'); ``weighted_codes``: store the
    layer's error metrics (:mod:`vecinfer_compile.quant.weighted_codes`); ``key_codec_states``: ``L``
    to code keys by the trellis codec of ``2^L`` states (:mod:`vecinfer_compile.quant.trellis_codec`),
    fitted on the layer's keys in the transform's domain under the key error metric when
    ``weighted_codes`` (None: the key codebooks' codes); ``value_codec_states``: the same for the
    values, under the value error metric."""

    iters: int
    max_vectors: int | None = None
    device: torch.device | str | None = None
    ridge: float = DEFAULT_RIDGE
    rope_inv_freq: torch.Tensor | None = None
    refine: RefineConfig | None = None
    weighted_codes: bool = False
    key_codec_states: int | None = None
    value_codec_states: int | None = None


@dataclass
class LayerFit:
    """``codebooks``: the layer's quantizer at each preset asked for, by bits (one key transform
    shared by all); ``loss_ratio``: refinement's attention-output loss after / before, by bits
    (empty when not refined)."""

    codebooks: dict[float, LayerCodebooks]
    loss_ratio: dict[float, float] = field(default_factory=dict)


def fit_codebook(vectors: torch.Tensor, entries: int, dims: int, settings: FitSettings, seed: int) -> torch.Tensor:
    """k-means codebook ``[entries, dims]`` float32 over the sub-vectors of ``vectors [..., D]``, on
    ``vectors``' device (a short prompt may give fewer sub-vectors than entries: k-means then
    reuses points)."""
    sub = subvectors(vectors, dims).reshape(-1, dims)
    if settings.max_vectors is not None and sub.shape[0] > settings.max_vectors:
        gen = torch.Generator().manual_seed(seed)
        sub = sub[torch.randperm(sub.shape[0], generator=gen)[:settings.max_vectors]]
    device = settings.device or sub.device
    return kmeans(sub.to(device), entries, iters=settings.iters, seed=seed).centroids.to(vectors.device)


def fit_key_transform(samples: LayerSamples, spec: KeyTransformSpec, settings: FitSettings) -> KeyTransform:
    """The key transform of ``spec`` fitted to ``samples``: the key mean (centring methods), the
    smoothing factors or the query-aware matrices of the centred keys, and the rotation; for the
    pre-RoPE methods, of the keys with RoPE undone at their positions."""
    keys, inv_freq = samples.keys, settings.rope_inv_freq if spec.pre_rope else None
    if inv_freq is not None:  # the statistics of the keys RoPE gets
        keys = rotate(keys[None], inv_freq, samples.positions, inverse=True)[0]
    mean, centred = centre_keys(keys, spec.center)
    lam = smoothing_factors(centred.abs().amax(dim=1)) if spec.smooth else None
    matrices = (None, None)
    if spec.query_aware:
        num_kv_heads = keys.shape[0]
        key_moment = second_moment(centred, num_kv_heads) if spec.query_aware == "geomean" else None
        matrices = query_aware_matrices(second_moment(samples.queries, num_kv_heads), key_moment, settings.ridge)
    return KeyTransform(keys.shape[-1], lam, spec.rotate, *matrices, mean=mean, rope_inv_freq=inv_freq)


def error_metrics(module, out_weight: torch.Tensor | None, transform: KeyTransform, queries: torch.Tensor,
                  num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_metric, value_metric)`` ``[H_kv, D, D]`` of one layer (:mod:`.quant.weighted_codes`):
    the code-domain second moment of the calibration ``queries: [H_q, N, D]`` (post-RoPE) per KV
    head, and the Gram matrix of the attention ``module``'s output projection ``out_weight``
    (:func:`~vecinfer_compile.hf.output_projection.output_projection_weight`; None is refused)."""
    if out_weight is None:
        raise ValueError(f"weighted codes weigh value errors through the attention's output projection, and "
                         f"{type(module).__name__} has none that maps its {queries.shape[0]} x {head_dim} head outputs "
                         f"(looked for {', '.join(OUTPUT_PROJECTION_NAMES)}): calibrate with --no-weighted-codes "
                         "(weighted_codes=False)")
    q = transform.queries(queries[None].float())[0]  # [H_q, N, D]
    group = q.reshape(num_kv_heads, -1, q.shape[-1])  # [H_kv, group * N, D] (repeat_kv's grouping)
    moment = (group.transpose(1, 2).double() @ group.double()).float() / max(1, q.shape[1])
    return key_metric(moment), value_metric(out_weight, num_kv_heads, head_dim)


def fit_layer(samples: LayerSamples, spec: KeyTransformSpec, bits: Sequence[float], settings: FitSettings, *,
              key_seed: int, value_seed: int, module=None) -> LayerFit:
    """Fit one attention layer at each preset of ``bits`` (one key transform for all of them).

    Keys are coded in the transform's domain; for the methods that predict values, the value
    codebook is fitted to the residuals of a linear prediction from the dequantized keys (what the
    cache reads, not the exact keys). The refining methods (with ``settings.refine``) then move
    both codebooks to lower the attention-output error of ``module`` (the layer's transformers
    attention module: its output projection, scaling and sliding window); with
    ``settings.weighted_codes`` the layer stores its error metrics. ``key_seed`` seeds the key
    codebook, refinement and the key codec's tables, ``value_seed`` the value codebook. With
    ``settings.key_codec_states`` / ``value_codec_states`` the keys / values get the trellis codec
    (the codebooks are fitted and refined as without and stay in the file; the codec codes in their
    place; the value codec's tables are seeded by ``value_seed``)."""
    keys, values, queries = samples.keys, samples.values, samples.queries
    num_kv_heads, head_dim = keys.shape[0], keys.shape[-1]
    transform = fit_key_transform(samples, spec, settings)
    k_t = transform.keys(keys[None], samples.positions)  # [1, H_kv, N, D]
    refine = settings.refine if spec.refine else None
    out_weight = None
    if refine is not None or settings.weighted_codes:
        out_weight = output_projection_weight(module, queries.shape[0], head_dim)
    metrics = error_metrics(module, out_weight, transform, queries, num_kv_heads,
                            head_dim) if settings.weighted_codes else ()
    fit = LayerFit({})
    for b in bits:
        preset = get_preset(b)
        key_cb = fit_codebook(k_t, preset.key.entries, preset.key.dims, settings, key_seed)
        predictor, v_fit = None, values
        if spec.predict_values:
            device = settings.device or k_t.device
            kt_hat = quantize_dequantize(k_t.to(device), key_cb.to(device)).to(k_t.device)
            predictor = fit_value_predictor(kt_hat[0], values)
            v_fit = values - predictor(kt_hat)[0]
        value_cb = fit_codebook(v_fit, preset.value.entries, preset.value.dims, settings, value_seed)
        if refine is not None:
            attn = LayerAttention.of(module, out_weight, head_dim)
            key_cb, value_cb, before, after = refine_codebooks(queries, keys, values, samples.lengths, transform,
                                                               key_cb, value_cb, attn, refine, seed=key_seed,
                                                               device=settings.device)
            fit.loss_ratio[b] = round(after / before, 4) if before > 0 else 1.0
        device = settings.device or k_t.device
        key_codec = value_codec = None
        if settings.key_codec_states is not None:
            key_codec = TrellisCodec.fit(k_t[0].to(device), b, settings.key_codec_states,
                                         metric=metrics[0] if metrics else None, seed=key_seed)
        if settings.value_codec_states is not None:
            value_codec = TrellisCodec.fit(values.to(device), b, settings.value_codec_states,
                                           metric=metrics[1] if metrics else None, seed=value_seed)
        fit.codebooks[b] = LayerCodebooks(transform, key_cb, value_cb, predictor, *(metrics or (None, None)),
                                          key_codec, value_codec)
    return fit
