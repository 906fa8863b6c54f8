"""What a calibrated file records of its calibration (the model's name, its coded layers and
weight fingerprint, a hash of the text, the settings of the fit), and whether a file's recipe is
the one :func:`~vecinfer_compile.calibrate` fits today. The file itself adds the
method, bits, presets, geometry (layer count, KV heads, head_dim) and package version
(:mod:`vecinfer_compile.codebooks.file_format`)."""

from __future__ import annotations

import hashlib

from ..codebooks import VecInferCodebooks
from ..hf.weight_fingerprint import weight_fingerprint
from ..methods import VQ_METHODS
from ..quant.query_aware import RIDGE_FORM
from ..quant.refine import RefineConfig
from .plan import CalibrationPlan


def text_hash(texts: list[str] | str) -> str:
    """16 hex digits of the SHA-256 of the calibration text(s), in order."""
    h = hashlib.sha256()
    for text in [texts] if isinstance(texts, str) else texts:
        h.update(text.encode("utf-8"))
    return h.hexdigest()[:16]


def calibration_metadata(
    model,
    plan: CalibrationPlan,
    texts: list[str] | str,
    tokens: int,
    *,
    seq_len: int,
    iters: int,
    seed: int,
    loss_ratio: dict[str, float],
) -> dict:
    """The metadata of codebooks calibrated on ``model`` by ``plan`` from ``tokens`` tokens of
    ``texts``; ``loss_ratio``: refinement's attention-output loss after / before, by ``"layer/bits"``."""
    fingerprint = weight_fingerprint(model.named_parameters())
    return {
        "model_name": getattr(model.config, "_name_or_path", "") or "",
        "coded_layers": plan.coded,  # the layers a VecInferCache codes (layer_kinds)
        **({"weight_fingerprint": fingerprint} if fingerprint is not None else {}),
        "calibration_text_hash": text_hash(texts),
        "calibration_tokens": tokens,
        "seq_len": seq_len,
        "kmeans_iters": iters,
        "seed": seed,
        "key_parallel_weight": plan.key_parallel_weight,
        **({"qaware_ridge": plan.ridge, "qaware_ridge_form": RIDGE_FORM} if plan.spec.query_aware else {}),
        **({"refine": {**plan.refine.as_dict(), "loss_ratio": loss_ratio}} if plan.refine is not None else {}),
    }


def recipe_mismatch(
    codebooks: VecInferCodebooks, method: str, refine: RefineConfig | None = RefineConfig()
) -> str | None:
    """Why ``codebooks`` (a file of ``method``) differ from what :func:`calibrate` fits for
    ``method`` with ``refine``, or None when they do not. A codebook cache checks it so that it
    never hands back files of an older recipe (``qaware`` files from before its refinement or
    before its error-weighted codes, or before the ridge of their matrices was diagonal)."""
    spec = VQ_METHODS[method]
    form = codebooks.metadata.get("qaware_ridge_form")
    if spec.query_aware and form != RIDGE_FORM:
        return (
            f"its query-aware matrices were fitted with an older ridge ({form or 'ridge * I'}), "
            f"{method!r} with a {RIDGE_FORM} one"
        )
    if codebooks.key_parallel_weight != spec.key_parallel_weight:
        return (
            f"it encodes keys with parallel weight {codebooks.key_parallel_weight:g}, {method!r} with "
            f"{spec.key_parallel_weight:g}"
        )
    if codebooks.weighted_codes != spec.weighted_codes:
        return (
            f"it {'has' if codebooks.weighted_codes else 'has no'} error metrics, which {method!r} "
            f"{'does not use' if codebooks.weighted_codes else 'needs'}"
        )
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
