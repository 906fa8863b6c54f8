"""Calibration: collect post-RoPE keys and values from a Hugging Face causal LM
(:mod:`vecinfer_compile.hf.recording`), fit the key transform and the key/value codebooks of every
layer."""

from __future__ import annotations

import hashlib
import logging

import torch
from tqdm.auto import tqdm

from .allocate import allocation_choices, retrieval_allocation
from .codebooks import LayerCodebooks, VecInferCodebooks, average_bits, model_geometry
from .hf.layer_kinds import NO_KV_KINDS, coded_layers, kv_producers, layer_kinds
from .methods import VQ_METHODS, check_method
from .hf.output_projection import NAMES as OUTPUT_PROJECTION_NAMES, output_projection_weight
from .presets import get_preset
from .quant.codebook import quantize_dequantize, subvectors
from .quant.score_aware import check_parallel_weight
from .quant.weighted_codes import key_metric, value_metric
from .quant.kmeans import kmeans
from .quant.query_aware import DEFAULT_RIDGE, RIDGE_FORM, query_aware_matrices, second_moment
from .quant.refine import LayerAttention, RefineConfig, refine_codebooks
from .quant.rope import model_rope_frequencies, rotate
from .quant.transform import KeyTransform, centre_keys, smoothing_factors
from .quant.value_prediction import fit_value_predictor
from .hf.recording import collect_kv, recorded_positions, window_lengths
from .simulate import attention_modules
from .hf.weight_fingerprint import weight_fingerprint

log = logging.getLogger(__name__)

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


def text_hash(texts: list[str] | str) -> str:
    h = hashlib.sha256()
    for text in [texts] if isinstance(texts, str) else texts:
        h.update(text.encode("utf-8"))
    return h.hexdigest()[:16]


def _fit_codebook(vectors: torch.Tensor, entries: int, dims: int, *, iters: int, seed: int,
                  max_vectors: int, device) -> torch.Tensor:
    """k-means codebook ``[entries, dims]`` float32 (CPU) over sub-vectors of ``vectors [..., D]``."""
    sub = subvectors(vectors, dims).reshape(-1, dims)
    gen = torch.Generator().manual_seed(seed)
    if sub.shape[0] > max_vectors:
        sub = sub[torch.randperm(sub.shape[0], generator=gen)[:max_vectors]]
    return kmeans(sub.to(device), entries, iters=iters, seed=seed).centroids.cpu()


def recipe_mismatch(codebooks: VecInferCodebooks, method: str,
                    refine: RefineConfig | None = RefineConfig()) -> str | None:
    """Why ``codebooks`` (a file of ``method``) differ from what :func:`calibrate` fits for
    ``method`` with ``refine``, or None when they do not. A codebook cache checks it so that it
    never hands back files of an older recipe (``qaware`` files from before its refinement or
    before its error-weighted codes, or before the ridge of their matrices was diagonal)."""
    spec = VQ_METHODS[method]
    form = codebooks.metadata.get("qaware_ridge_form")
    if spec.query_aware and form != RIDGE_FORM:
        return (f"its query-aware matrices were fitted with an older ridge ({form or 'ridge * I'}), "
                f"{method!r} with a {RIDGE_FORM} one")
    if codebooks.key_parallel_weight != spec.key_parallel_weight:
        return (f"it encodes keys with parallel weight {codebooks.key_parallel_weight:g}, {method!r} with "
                f"{spec.key_parallel_weight:g}")
    if codebooks.weighted_codes != spec.weighted_codes:
        return (f"it {'has' if codebooks.weighted_codes else 'has no'} error metrics, which {method!r} "
                f"{'does not use' if codebooks.weighted_codes else 'needs'}")
    want = refine.as_dict() if VQ_METHODS[method].refine and refine is not None else None
    have = codebooks.metadata.get("refine")
    have = None if have is None else {k: v for k, v in have.items() if k != "loss_ratio"}
    if have == want:
        return None
    if want is None:
        return f"its centroids were refined ({have}), which {method!r} does not do"
    if have is None:
        return f"its centroids are k-means', from before {method!r} refined them"
    return f"its centroids were refined with {have}, not {want}"


def _check_recorded_layers(config, recorded: list[int], *, per_layer_bits: bool) -> None:
    """Raise a ValueError unless the layers whose attention was recorded are the model's attention
    layers: every decoder layer, or all but a hybrid model's linear-attention, convolution or
    state-space layers (:func:`~vecinfer_compile.hf.layer_kinds.layer_kinds`), which have no K/V and
    get no codebooks. Per-layer bits (``per_layer_bits``) need every layer recorded."""
    kinds = layer_kinds(config)
    missing = [i for i in range(len(kinds)) if i not in recorded]
    outside = [i for i in recorded if not 0 <= i < len(kinds)]
    if any(i < 0 for i in outside):
        raise ValueError(f"an attention module has layer index {min(outside)}: one attention block shared by "
                         "several decoder layers, whose K/V per-layer codebooks cannot describe: this model is "
                         "not supported")
    if outside:
        raise ValueError(f"recorded attention in layers {outside}, which the config's {len(kinds)} decoder "
                         "layers do not have: the config does not describe this model")
    attention = [i for i in missing if kinds[i] not in NO_KV_KINDS]
    if attention:
        raise ValueError(
            f"recorded attention in {len(recorded)} of the model's {len(kinds)} layers: layers {attention} "
            f"(kinds {sorted({kinds[i] for i in attention})}) ran no attention through transformers' "
            "AttentionInterface (they share or reuse another layer's attention, or call their own kernel), "
            "so their K/V cannot be calibrated: this model is not supported"
        )
    if missing and per_layer_bits:
        raise ValueError(f"layers {missing} have no attention ({sorted({kinds[i] for i in missing})}): per-layer "
                         "bits (layer_bits / allocate='retrieval') are for models whose every layer has "
                         "attention; calibrate one preset (bits=...)")


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
    True, the others 1 and False).
    By default every layer uses the preset of ``bits``;
    ``layer_bits`` gives one preset per layer instead (``bits`` is then ignored: their average
    is the file's bits), and ``allocate="retrieval"`` chooses them at an average of exactly
    ``bits`` (:mod:`vecinfer_compile.allocate`; ``residual`` is the cache window it assumes).
    K-Means runs on ``device`` (default: the model's device) over at most ``max_fit_vectors``
    sub-vectors per codebook. Returns a :class:`VecInferCodebooks`, with the model's name and
    weight fingerprint in its metadata (:meth:`VecInferCodebooks.check_weights` compares another
    model with it); ``.save(path)`` writes it.
    """
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
    device = device or next(model.parameters()).device

    token_ids = calibration_token_ids(tokenizer, texts, max_tokens)
    if spec.query_aware and not ridge > 0:
        raise ValueError(f"ridge must be > 0 (it keeps the query moment invertible), got {ridge}")
    inv_freq = model_rope_frequencies(model, head_dim) if spec.pre_rope else None
    if weighted_codes and (spec.pre_rope or spec.predict_values):
        raise ValueError(f"weighted codes need keys whose scores the query transform keeps exact and plain value "
                         f"codes; method {method!r} has neither: use --method qaware (or vecinfer)")
    refine = refine if spec.refine else None
    with_queries = bool(spec.query_aware) or refine is not None or weighted_codes
    recorded = collect_kv(model, token_ids, seq_len, progress, with_queries=with_queries)
    keys, values = recorded[:2]
    positions = recorded_positions(model, token_ids, seq_len) if spec.pre_rope else None
    _check_recorded_layers(model.config, sorted(keys), per_layer_bits=layer_bits is not None or allocate == "retrieval")
    fitted: dict[int, dict[float, LayerCodebooks]] = {}
    refined: dict[str, float] = {}  # "layer/bits" -> attention-output loss after / before refinement
    if refine is not None:
        lengths = window_lengths(model, token_ids, seq_len)
    modules = {m.layer_idx: m for m in attention_modules(model)} if refine is not None or weighted_codes else {}
    coded = coded_layers(model.config)
    for layer in tqdm(sorted(keys), desc="fitting codebooks", disable=not progress):
        k, v = keys[layer][None], values[layer][None]  # [1, H_kv, N, D]
        if not coded[layer] and (k.shape[1], k.shape[-1]) != (geometry["num_kv_heads"], head_dim):
            continue  # an uncoded layer of another geometry (Gemma 4's sliding layers): no codebooks
        k_stat = k if inv_freq is None else rotate(k, inv_freq, positions, inverse=True)  # the keys RoPE gets
        mean, centred = centre_keys(k_stat[0], spec.center)  # lam and C: of the keys to quantize
        lam = smoothing_factors(centred.abs().amax(dim=1)) if spec.smooth else None
        matrices = (None, None)
        if spec.query_aware:
            key_moment = second_moment(centred, k.shape[1]) if spec.query_aware == "geomean" else None
            matrices = query_aware_matrices(second_moment(recorded[2][layer], k.shape[1]), key_moment, ridge)
        transform = KeyTransform(head_dim, lam, spec.rotate, *matrices, mean=mean, rope_inv_freq=inv_freq)
        k_t = transform.keys(k, positions)
        layer_seed = seed + 1000 * layer
        module = modules.get(layer)  # queries are recorded when modules are needed (refinement, metrics)
        out_weight = output_projection_weight(module, recorded[2][layer].shape[0], head_dim) if modules else None
        metrics = error_metrics(module, out_weight, transform, recorded[2][layer], k.shape[1],
                                head_dim) if weighted_codes else ()
        fitted[layer] = {}
        for b in candidates[layer]:
            preset = get_preset(b)
            key_cb = _fit_codebook(k_t, preset.key.entries, preset.key.dims, iters=iters,
                                   seed=layer_seed, max_vectors=max_fit_vectors, device=device)
            predictor, v_fit = None, v
            if spec.predict_values:  # fitted to the keys it will read: dequantized, not exact
                kt_hat = quantize_dequantize(k_t.to(device), key_cb.to(device)).cpu()
                predictor = fit_value_predictor(kt_hat[0], v[0])
                v_fit = v - predictor(kt_hat)
            value_cb = _fit_codebook(v_fit, preset.value.entries, preset.value.dims, iters=iters,
                                     seed=layer_seed + 1, max_vectors=max_fit_vectors, device=device)
            if refine is not None:
                q = recorded[2][layer]
                attn = LayerAttention.of(module, out_weight, head_dim)
                key_cb, value_cb, before, after = refine_codebooks(q, k[0], v[0], lengths, transform, key_cb, value_cb,
                                                                   attn, refine, seed=layer_seed, device=device)
                refined[f"{layer}/{b:g}"] = round(after / before, 4) if before > 0 else 1.0
            fitted[layer][b] = LayerCodebooks(transform, key_cb, value_cb, predictor, *metrics)
    fingerprint = weight_fingerprint(model.named_parameters())
    metadata = {
        "model_name": getattr(model.config, "_name_or_path", "") or "",
        "coded_layers": coded,  # the layers a VecInferCache codes (layer_kinds)
        **({"weight_fingerprint": fingerprint} if fingerprint is not None else {}),
        "calibration_text_hash": text_hash(texts),
        "calibration_tokens": int(token_ids.numel()),
        "seq_len": seq_len,
        "kmeans_iters": iters,
        "seed": seed,
        "key_parallel_weight": key_parallel_weight,
        **({"qaware_ridge": ridge, "qaware_ridge_form": RIDGE_FORM} if spec.query_aware else {}),
        **({"refine": {**refine.as_dict(), "loss_ratio": refined}} if refine is not None else {}),
    }
    if allocate == "retrieval":
        text = texts if isinstance(texts, str) else "\n".join(texts)
        allocation = retrieval_allocation(model, tokenizer, text, token_ids, fitted, float(bits),
                                          method, seq_len=seq_len, residual=residual, seed=seed,
                                          progress=progress)
        layer_bits = allocation.layer_bits
        metadata["allocation"] = {**allocation.as_dict(), "residual": residual}
        log.info("retrieval allocation: layer bits %s (retrieval scores %s)", layer_bits,
                 [round(s, 3) for s in allocation.retrieval])
    for i, producer in enumerate(kv_producers(model.config)):  # a layer reading another's K/V: its codebooks
        if producer != i and producer in fitted:
            fitted[i] = fitted[producer]
    per_layer = [c[0] for c in candidates] if layer_bits is None else [float(b) for b in layer_bits]
    layers = [fitted[i][b] if i in fitted else None for i, b in enumerate(per_layer)]
    average = average_bits(per_layer)
    log.info("calibrated %g-bit %s codebooks on %d tokens", average, method, token_ids.numel())
    return VecInferCodebooks(method, average, layers, geometry, metadata, layer_bits=per_layer)
