"""``calibrate()``: plan the calibration, record the model's attention inputs over the text, fit
every layer, choose per-layer bits when asked to, and assemble the codebooks."""

from __future__ import annotations

import logging

from tqdm.auto import tqdm

from ..allocate import retrieval_allocation
from ..api_arguments import check_calibrate
from ..codebooks import LayerCodebooks, VecInferCodebooks, average_bits
from ..heartbeat import reporting
from ..hf.layer_kinds import kv_producers
from ..quant.query_aware import DEFAULT_RIDGE
from ..quant.refine import RefineConfig
from ..simulate import attention_modules
from .fit import FitSettings, fit_layer
from .metadata import calibration_metadata
from .plan import plan_calibration
from .record import calibration_token_ids, record

log = logging.getLogger(__package__)  # vecinfer_compile.calibrate


def calibrate(
    model,
    tokenizer,
    texts: list[str] | str,
    bits: float | None = 2,
    method: str = "vecinfer",
    *,
    layer_bits: list[float] | None = None,
    allocate: str | None = None,
    residual: int = 128,
    max_tokens: int = 32768,
    seq_len: int = 1024,
    iters: int = 20,
    seed: int = 0,
    max_fit_vectors: int = 262144,
    ridge: float = DEFAULT_RIDGE,
    refine: RefineConfig | None = RefineConfig(),
    key_parallel_weight: float | None = None,
    weighted_codes: bool | None = None,
    key_codec: str | None = None,
    value_codec: str | None = None,
    codec_options: dict | None = None,
    device=None,
    progress: bool = True,
) -> VecInferCodebooks:
    """Fit per-layer smoothing factors (``lam = sqrt(max_t |K|)`` per KV head and channel) and
    key/value K-Means codebooks for ``bits`` (a preset of :mod:`vecinfer_compile.presets`).

    ``method`` is ``vecinfer`` (smoothing + Hadamard), or an ablation: ``vq`` (neither),
    ``smooth`` or ``hadamard``; ``qaware`` (ablations ``qaware-nohadamard``, ``qaware-sqrt``)
    replaces smoothing by a per-KV-head matrix fitted to the post-RoPE calibration queries (and
    keys), with ``ridge`` relative to their mean eigenvalue
    (:mod:`vecinfer_compile.quant.query_aware`); ``prerope`` (ablation ``prerope-keys``) fits
    ``vecinfer-center``'s transform to the keys with the model's RoPE undone (each key at its
    position in its calibration window) and the value codebooks to the residuals of a linear
    prediction from the dequantized keys (:mod:`vecinfer_compile.quant.value_prediction`).
    The methods that refine (``qaware``; not ``qaware-norefine``) then move each layer's k-means
    centroids to lower its attention-output error on the calibration windows by ``refine``
    (:mod:`vecinfer_compile.quant.refine`; None skips it). ``key_parallel_weight`` (stored in the
    file) is how every path then encodes keys: 1 for the nearest centroid, above 1 for score-aware
    codes (:mod:`vecinfer_compile.quant.score_aware`; the codebooks are fitted as for 1).
    ``weighted_codes`` stores each layer's error metrics (the calibration queries' second moment
    for keys, ``o_proj``'s Gram matrix for values) and every path then chooses codes under them
    (:mod:`vecinfer_compile.quant.weighted_codes`; the codebooks are fitted as without). Both
    default to the method's (:data:`~vecinfer_compile.methods.VQ_METHODS`: ``qaware`` 8 and
    True, the others 1 and False). ``key_codec`` / ``value_codec`` name the registered
    codec of each side (:mod:`vecinfer_compile.codecs`; None: the default codebooks), with
    ``codec_options`` for them (e.g. ``{"states": 4096}``); files whose sides differ run in the
    simulate path, and in VecInferCache (eager or compiled) when one codec codes both.
    By default every layer uses the preset of ``bits``;
    ``layer_bits`` gives one preset per layer instead (``bits`` is then ignored: their average
    is the file's bits), and ``allocate="retrieval"`` chooses them at an average of exactly
    ``bits`` (:mod:`vecinfer_compile.allocate`; ``residual`` is the cache window it assumes).
    K-Means runs on ``device`` (default: the model's device) over at most ``max_fit_vectors``
    sub-vectors per codebook. Returns a :class:`VecInferCodebooks`, with the model's name and
    weight fingerprint in its metadata (:meth:`VecInferCodebooks.check_weights` compares another
    model with it); ``.save(path)`` writes it.
    """
    check_calibrate(
        model,
        tokenizer,
        texts,
        max_tokens=(max_tokens, 1),
        seq_len=(seq_len, 2),
        iters=(iters, 1),
        seed=(seed, 0),
        max_fit_vectors=(max_fit_vectors, 1),
        residual=(residual, 0),
    )
    plan = plan_calibration(
        model,
        bits,
        method,
        layer_bits=layer_bits,
        allocate=allocate,
        ridge=ridge,
        refine=refine,
        key_parallel_weight=key_parallel_weight,
        weighted_codes=weighted_codes,
        key_codec=key_codec,
        value_codec=value_codec,
        codec_options=codec_options,
    )
    device = device or next(model.parameters()).device
    token_ids = calibration_token_ids(tokenizer, texts, max_tokens)
    recording = record(model, token_ids, plan, seq_len, progress)
    settings = FitSettings(
        iters=iters,
        max_vectors=max_fit_vectors,
        device=device,
        ridge=ridge,
        rope_inv_freq=plan.rope_inv_freq,
        refine=plan.refine,
        weighted_codes=plan.weighted_codes,
        key_codec=plan.key_codec,
        value_codec=plan.value_codec,
        codec_options=plan.codec_options,
    )
    needs_modules = plan.refine is not None or plan.weighted_codes
    modules = {m.layer_idx: m for m in attention_modules(model)} if needs_modules else {}
    fitted: dict[int, dict[float, LayerCodebooks]] = {}
    loss_ratio: dict[str, float] = {}  # "layer/bits" -> attention-output loss after / before refinement
    bar = tqdm(sorted(recording.keys), desc="fitting codebooks", unit="layer", disable=not progress)
    with reporting(bar):  # k-means and refinement say where they are within a layer
        for layer in bar:
            samples = recording.layer(layer)
            if not plan.gets_codebooks(layer, samples.keys):
                continue  # an uncoded layer of another geometry: no codebooks
            layer_seed = seed + 1000 * layer
            fit = fit_layer(
                samples,
                plan.spec,
                plan.candidates[layer],
                settings,
                key_seed=layer_seed,
                value_seed=layer_seed + 1,
                module=modules.get(layer),
            )
            fitted[layer] = fit.codebooks
            loss_ratio.update({f"{layer}/{b:g}": ratio for b, ratio in fit.loss_ratio.items()})
    metadata = calibration_metadata(
        model, plan, texts, int(token_ids.numel()), seq_len=seq_len, iters=iters, seed=seed, loss_ratio=loss_ratio
    )
    if allocate == "retrieval":
        text = texts if isinstance(texts, str) else "\n".join(texts)
        allocation = retrieval_allocation(
            model,
            tokenizer,
            text,
            token_ids,
            fitted,
            float(bits),
            method,
            seq_len=seq_len,
            residual=residual,
            seed=seed,
            progress=progress,
        )
        layer_bits = allocation.layer_bits
        metadata["allocation"] = {**allocation.as_dict(), "residual": residual}
        log.info(
            "retrieval allocation: layer bits %s (retrieval scores %s)",
            layer_bits,
            [round(s, 3) for s in allocation.retrieval],
        )
    for i, producer in enumerate(kv_producers(model.config)):  # a layer reading another's K/V: its codebooks
        if producer != i and producer in fitted:
            fitted[i] = fitted[producer]
    per_layer = [c[0] for c in plan.candidates] if layer_bits is None else [float(b) for b in layer_bits]
    layers = [fitted[i][b] if i in fitted else None for i, b in enumerate(per_layer)]
    average = average_bits(per_layer)
    log.info("calibrated %g-bit %s codebooks on %d tokens", average, method, token_ids.numel())
    return VecInferCodebooks(method, average, layers, plan.geometry, metadata, layer_bits=per_layer)
