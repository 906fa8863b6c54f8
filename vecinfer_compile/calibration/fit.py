"""The fit of one attention layer: its key transform, then each side's codes by its codec at each
preset asked for (:meth:`vecinfer_compile.codecs.base.Codec.fit`; by default k-means codebooks), and,
for the methods that have them, a value predictor, refined codes and error metrics. :func:`~vecinfer_compile.calibrate` fits every layer with it, and so
does the backend's zero-config path (:mod:`vecinfer_compile.backend`) from the keys and values of
the call it compiles."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..codebooks import LayerCodebooks
from ..codecs import registry
from ..codecs.base import FitContext
from ..hf.output_projection import NAMES as OUTPUT_PROJECTION_NAMES
from ..hf.output_projection import output_projection_weight
from ..methods import KeyTransformSpec
from ..quant.query_aware import DEFAULT_RIDGE, query_aware_matrices, second_moment
from ..quant.refine import LayerAttention, RefineConfig
from ..quant.rope import rotate
from ..quant.transform import KeyTransform, centre_keys, smoothing_factors
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
    layer's error metrics (:mod:`vecinfer_compile.quant.weighted_codes`); ``key_codec``,
    ``value_codec``: the registered codec of each side (:mod:`vecinfer_compile.codecs`), fitted on
    the layer's keys in the transform's domain / its values, under the side's error metric when
    ``weighted_codes``, with the codecs' ``codec_options`` (e.g. ``{"states": 4096}``)."""

    iters: int
    max_vectors: int | None = None
    device: torch.device | str | None = None
    ridge: float = DEFAULT_RIDGE
    rope_inv_freq: torch.Tensor | None = None
    refine: RefineConfig | None = None
    weighted_codes: bool = False
    key_codec: str = registry.DEFAULT
    value_codec: str = registry.DEFAULT
    codec_options: dict | None = None

    def context(self, bits: float, metric: torch.Tensor | None, seed: int) -> FitContext:
        """What a codec's fit of one side at ``bits`` gets (:class:`~vecinfer_compile.codecs.base.FitContext`)."""
        return FitContext(
            bits=bits,
            metric=metric,
            seed=seed,
            iters=self.iters,
            max_vectors=self.max_vectors,
            device=self.device,
            options=self.codec_options or {},
        )


@dataclass
class LayerFit:
    """``codebooks``: the layer's quantizer at each preset asked for, by bits (one key transform
    shared by all); ``loss_ratio``: refinement's attention-output loss after / before, by bits
    (empty when not refined)."""

    codebooks: dict[float, LayerCodebooks]
    loss_ratio: dict[float, float] = field(default_factory=dict)


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


def error_metrics(
    module,
    out_weight: torch.Tensor | None,
    transform: KeyTransform,
    queries: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_metric, value_metric)`` ``[H_kv, D, D]`` of one layer (:mod:`.quant.weighted_codes`):
    the code-domain second moment of the calibration ``queries: [H_q, N, D]`` (post-RoPE) per KV
    head, and the Gram matrix of the attention ``module``'s output projection ``out_weight``
    (:func:`~vecinfer_compile.hf.output_projection.output_projection_weight`; None is refused)."""
    if out_weight is None:
        raise ValueError(
            f"weighted codes weigh value errors through the attention's output projection, and "
            f"{type(module).__name__} has none that maps its {queries.shape[0]} x {head_dim} head outputs "
            f"(looked for {', '.join(OUTPUT_PROJECTION_NAMES)}): calibrate with --no-weighted-codes "
            "(weighted_codes=False)"
        )
    q = transform.queries(queries[None].float())[0]  # [H_q, N, D]
    group = q.reshape(num_kv_heads, -1, q.shape[-1])  # [H_kv, group * N, D] (repeat_kv's grouping)
    moment = (group.transpose(1, 2).double() @ group.double()).float() / max(1, q.shape[1])
    return key_metric(moment), value_metric(out_weight, num_kv_heads, head_dim)


def fit_layer(
    samples: LayerSamples,
    spec: KeyTransformSpec,
    bits: Sequence[float],
    settings: FitSettings,
    *,
    key_seed: int,
    value_seed: int,
    module=None,
) -> LayerFit:
    """Fit one attention layer at each preset of ``bits`` (one key transform for all of them).

    Keys are coded in the transform's domain; for the methods that predict values, the value
    side is fitted to the residuals of a linear prediction from the dequantized keys (what the
    cache reads, not the exact keys). The refining methods (with ``settings.refine``) then move
    both codebooks to lower the attention-output error of ``module`` (the layer's transformers
    attention module: its output projection, scaling and sliding window); with
    ``settings.weighted_codes`` the layer stores its error metrics. ``key_seed`` seeds the key
    side's fit and refinement, ``value_seed`` the value side's. Each side is fitted by its codec
    (``settings.key_codec`` / ``value_codec``); refinement applies where both sides share a codec
    that refines (:meth:`~vecinfer_compile.codecs.base.Codec.refine`)."""
    keys, values, queries = samples.keys, samples.values, samples.queries
    num_kv_heads, head_dim = keys.shape[0], keys.shape[-1]
    key_codec, value_codec = registry.get(settings.key_codec), registry.get(settings.value_codec)
    transform = fit_key_transform(samples, spec, settings)
    k_t = transform.keys(keys[None], samples.positions)[0]  # [H_kv, N, D]
    refine = settings.refine if spec.refine else None
    out_weight = None
    if refine is not None or settings.weighted_codes:
        out_weight = output_projection_weight(module, queries.shape[0], head_dim)
    key_w, value_w = (
        error_metrics(module, out_weight, transform, queries, num_kv_heads, head_dim)
        if settings.weighted_codes
        else (None, None)
    )
    device = settings.device or k_t.device
    fit = LayerFit({})
    for b in bits:
        key_code = key_codec.fit(k_t, "key", settings.context(b, key_w, key_seed))
        predictor, v_fit = None, values
        if spec.predict_values:
            kt_hat = key_codec.quantize_dequantize(key_code, k_t[None].to(device)).to(k_t.device)
            predictor = fit_value_predictor(kt_hat[0], values)
            v_fit = values - predictor(kt_hat)[0]
        value_code = value_codec.fit(v_fit, "value", settings.context(b, value_w, value_seed))
        refined = None
        if refine is not None and key_codec is value_codec:
            attn = LayerAttention.of(module, out_weight, head_dim)
            refined = key_codec.refine(
                queries,
                keys,
                values,
                samples.lengths,
                transform,
                key_code,
                value_code,
                attn,
                refine,
                seed=key_seed,
                device=settings.device,
            )
        if refined is not None:
            key_code, value_code, before, after = refined
            fit.loss_ratio[b] = round(after / before, 4) if before > 0 else 1.0
        fit.codebooks[b] = LayerCodebooks(transform, key_code, value_code, predictor, key_w, value_w)
    return fit
