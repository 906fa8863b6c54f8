"""Calibration: collect post-RoPE keys and values from a Hugging Face causal LM, fit the key
transform and the key/value codebooks of every layer.

Keys and values are recorded inside attention (after RoPE, before any GQA repetition) through a
temporary attention implementation that records and then runs SDPA, so any model whose attention
goes through transformers' ``AttentionInterface`` can be calibrated.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging

import torch
from tqdm.auto import tqdm

from .codebooks import LayerCodebooks, VecInferCodebooks, model_geometry
from .methods import VQ_METHODS, check_method
from .presets import get_preset
from .quant.codebook import subvectors
from .quant.kmeans import kmeans
from .quant.transform import KeyTransform, smoothing_factors

log = logging.getLogger(__name__)

RECORDER = "vecinfer_calibration_recorder"


class _Recorder:
    """Per-layer lists of ``[B, H, T, D]`` float32 CPU tensors: keys, values and (optionally)
    queries, as attention receives them (post-RoPE, before any GQA repetition)."""

    def __init__(self, with_queries: bool) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}
        self.queries: dict[int, list[torch.Tensor]] | None = {} if with_queries else None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(
                f"{type(module).__name__} has no layer_idx: recording attention inputs needs a "
                "transformers model whose attention modules carry their layer index"
            )
        self.keys.setdefault(layer, []).append(key.detach().float().cpu())
        self.values.setdefault(layer, []).append(value.detach().float().cpu())
        if self.queries is not None:
            self.queries.setdefault(layer, []).append(query.detach().float().cpu())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def _recording(model, with_queries: bool):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    recorder = _Recorder(with_queries)
    AttentionInterface.register(RECORDER, recorder)
    AttentionMaskInterface.register(RECORDER, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDER)
    try:
        yield recorder
    finally:
        model.set_attn_implementation(previous)


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


@torch.no_grad()
def collect_kv(model, token_ids: torch.Tensor, seq_len: int, progress: bool = True, *,
               with_queries: bool = False):
    """Run ``model`` over ``token_ids: [N]`` in windows of ``seq_len`` tokens (each starting
    with BOS when the tokenizer has one) and return per-layer ``(keys, values)``, each
    ``{layer: [H_kv, N_tokens, D]}`` float32 on the CPU; with ``with_queries`` also
    ``{layer: [H_q, N_tokens, D]}`` queries as a third element."""
    device = next(model.parameters()).device
    bos = model.config.bos_token_id
    windows = token_ids.split(seq_len)
    with _recording(model, with_queries) as rec:
        for window in tqdm(windows, desc="recording attention inputs", disable=not progress):
            ids = window if bos is None else torch.cat([torch.tensor([bos]), window])
            model(input_ids=ids[None].to(device), use_cache=False)
    if not rec.keys:
        raise ValueError(
            "recorded no attention calls: the model does not dispatch attention "
            "through transformers' AttentionInterface"
        )

    def join(store):
        return {l: torch.cat([t[0] for t in ts], dim=1) for l, ts in sorted(store.items())}

    out = (join(rec.keys), join(rec.values))
    return out + (join(rec.queries),) if with_queries else out


def _fit_codebook(vectors: torch.Tensor, entries: int, dims: int, *, iters: int, seed: int,
                  max_vectors: int, device) -> torch.Tensor:
    """k-means codebook ``[entries, dims]`` float32 (CPU) over sub-vectors of ``vectors [..., D]``."""
    sub = subvectors(vectors, dims).reshape(-1, dims)
    gen = torch.Generator().manual_seed(seed)
    if sub.shape[0] > max_vectors:
        sub = sub[torch.randperm(sub.shape[0], generator=gen)[:max_vectors]]
    return kmeans(sub.to(device), entries, iters=iters, seed=seed).centroids.cpu()


def calibrate(
    model,
    tokenizer,
    texts: list[str] | str,
    bits: float = 2,
    method: str = "vecinfer",
    *,
    max_tokens: int = 32768,
    seq_len: int = 1024,
    iters: int = 20,
    seed: int = 0,
    max_fit_vectors: int = 262144,
    device=None,
    progress: bool = True,
) -> VecInferCodebooks:
    """Fit per-layer smoothing factors (``lam = sqrt(max_t |K|)`` per KV head and channel) and
    key/value K-Means codebooks for ``bits`` (a preset of :mod:`vecinfer_compile.presets`).

    ``method`` is ``vecinfer`` (smoothing + Hadamard), or an ablation: ``vq`` (neither),
    ``smooth`` or ``hadamard``. K-Means runs on ``device`` (default: the model's device) over at
    most ``max_fit_vectors`` sub-vectors per codebook. Returns a :class:`VecInferCodebooks`;
    ``.save(path)`` writes it.
    """
    check_method(method, bits)
    if method not in VQ_METHODS:
        raise ValueError(f"method {method!r} needs no calibration; calibrate one of {list(VQ_METHODS)}")
    preset = get_preset(bits)
    geometry = model_geometry(model.config)
    head_dim = geometry["head_dim"]
    preset.key.check_head_dim(head_dim)
    preset.value.check_head_dim(head_dim)
    spec = VQ_METHODS[method]
    if spec.rotate:
        KeyTransform(head_dim).rotation(torch.float32, "cpu")  # clear error for bad head dims
    device = device or next(model.parameters()).device

    token_ids = calibration_token_ids(tokenizer, texts, max_tokens)
    keys, values = collect_kv(model, token_ids, seq_len, progress)
    layers = []
    for layer in tqdm(sorted(keys), desc=f"fitting {bits:g}-bit codebooks", disable=not progress):
        k, v = keys[layer][None], values[layer][None]  # [1, H_kv, N, D]
        lam = smoothing_factors(k.abs().amax(dim=(0, 2))) if spec.smooth else None
        transform = KeyTransform(head_dim, lam, spec.rotate)
        layer_seed = seed + 1000 * layer
        key_cb = _fit_codebook(transform.keys(k), preset.key.entries, preset.key.dims,
                               iters=iters, seed=layer_seed, max_vectors=max_fit_vectors, device=device)
        value_cb = _fit_codebook(v, preset.value.entries, preset.value.dims,
                                 iters=iters, seed=layer_seed + 1, max_vectors=max_fit_vectors,
                                 device=device)
        layers.append(LayerCodebooks(transform, key_cb, value_cb))
    if len(layers) != geometry["num_layers"]:
        raise ValueError(
            f"recorded {len(layers)} attention layers but the config has {geometry['num_layers']}"
        )
    metadata = {
        "model_name": getattr(model.config, "_name_or_path", "") or "",
        "calibration_text_hash": text_hash(texts),
        "calibration_tokens": int(token_ids.numel()),
        "seq_len": seq_len,
        "kmeans_iters": iters,
        "seed": seed,
    }
    log.info("calibrated %s-bit %s codebooks on %d tokens", bits, method, token_ids.numel())
    return VecInferCodebooks(method, float(bits), layers, geometry, metadata)
