"""Eager simulate mode: attention over quantize->dequantize keys and values.

``enable_simulation(model, "vecinfer", bits=2, codebooks=cb, residual=R)`` switches a loaded
Hugging Face model to the attention implementation ``"vecinfer"`` (registered with transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` at import). Each attention call then
quantizes the keys and values it receives and attends over the dequantized tensors; with a
residual window ``R`` key ``j`` stays in full precision for query ``i`` when ``0 <= i - j < R``
(positions bottom-right aligned: the last query is the newest token; keys after the query, which
only a non-causal mask shows, are quantized). This is the reference
that the compiled backend and the compressed cache are tested against.

A model that mixes attention kinds (Gemma 3's sliding and full layers, Llama 4's chunked ones)
has only the layers a VecInferCache codes quantized (:mod:`vecinfer_compile.hf.layer_kinds`); the
others attend in full precision (SDPA), as they do through the cache. Every attention honours
the mask the model gives it, sliding windows included, and a T5-style ``position_bias`` (added to the
scores, as transformers' SDPA does). A call that needs more than SDPA (attention sinks, logit
softcapping, sparse indices, different query/key/value head dims) is refused
(:func:`~vecinfer_compile.hf.attention_support.check_attention_call`). An eager-only model (no SDPA
attention in transformers) attends under the implementation ``"vecinfer_unskipped_masks"``, the same
attention with every mask materialized (:func:`~vecinfer_compile.hf.attention_support.needs_unskipped_masks`).

``full_precision_prefill=True`` reproduces :class:`~vecinfer_compile.VecInferCache`'s
semantics during ``generate()``: a call with several queries (the prefill) attends in full
precision, and so does a KV-shared layer in the forward of a prefill (:meth:`LayerSimulator.is_prefill`);
single-token decode calls see quantized keys beyond the window.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .api_arguments import check_codebooks_type, check_count, codebooks_arg
from .codebooks import VecInferCodebooks
from .hf.attention_support import check_attention_call, needs_unskipped_masks, unskipped_sdpa_mask
from .hf.layer_kinds import kv_producers, some_coded_layers
from .methods import VQ_METHODS, check_method
from .quant.kivi import kivi_keys, kivi_values
from .window import simulate_mask

ATTN_NAME = "vecinfer"
UNSKIPPED_MASKS_NAME = "vecinfer_unskipped_masks"  # the same attention, for eager-only models
FULL_PRECISION = "full precision"  # the simulator of a layer the cache does not code
_PREVIOUS = "_vecinfer_attn_before_simulation"  # the model's implementation before enable_simulation


@dataclass
class LayerSimulator:
    """How one layer quantizes. method: a name of :mod:`vecinfer_compile.methods`."""

    method: str
    bits: float
    residual: int = 0
    codebooks: VecInferCodebooks | None = None
    layer_idx: int = 0
    full_precision_prefill: bool = False
    producer: LayerSimulator | None = None  # a layer that reads another's K/V: that layer's simulator
    prefilling: bool = False  # whether this layer's last call was a prefill

    def is_prefill(self, tq: int) -> bool:
        """Whether a call with ``tq`` queries is the prefill that ``full_precision_prefill`` keeps
        in full precision: several queries, or, for a layer that reads another's K/V
        (:func:`~vecinfer_compile.hf.layer_kinds.kv_producers`), the call in a forward whose
        producer prefilled (under ``generate()`` Gemma 4 gives its KV-shared layers only the
        prompt's last query, over the whole prompt's K/V)."""
        if not self.full_precision_prefill:
            return False
        self.prefilling = self.producer.prefilling if self.producer is not None else tq > 1
        return self.prefilling

    def quantize_kv(
        self, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v: [B, H_kv, T, D]`` -> dequantized ``(k_hat, v_hat)`` in the original domain and
        dtype. Pre-RoPE keys (:mod:`.quant.rope`) take their positions from the call's queries'
        ``position_ids: [B|1, Tq]`` (:func:`key_positions`); predicted values are
        ``P(k~_hat) + Q(v - P(k~_hat))`` (:mod:`.quant.value_prediction`). Each side is coded by its
        codec (:mod:`.codecs`; the codebooks' codes: nearest-centroid, score-aware and/or error-weighted)."""
        if self.method == "kivi":
            return kivi_keys(k, int(self.bits)), kivi_values(v, int(self.bits))
        layer = self.codebooks.layer(self.layer_idx)
        positions = None
        if layer.transform.rope_inv_freq is not None:
            positions = key_positions(position_ids, k.shape[2], k.device)
        kt = layer.transform.keys(k, positions)
        kt_hat = layer.key_codec.quantize_dequantize(
            layer.keys, kt, metric=layer.key_metric, parallel_weight=self.codebooks.key_parallel_weight
        )
        k_hat = layer.transform.keys_inverse(kt_hat, positions).to(k.dtype)
        if layer.value_predictor is None:
            return k_hat, layer.value_codec.quantize_dequantize(layer.values, v, metric=layer.value_metric)
        predicted = layer.value_predictor(kt_hat)
        v_hat = predicted + layer.value_codec.quantize_dequantize(layer.values, v.to(predicted.dtype) - predicted)
        return k_hat, v_hat.to(v.dtype)


def key_positions(position_ids: torch.Tensor | None, tk: int, device) -> torch.Tensor:
    """The positions of an attention call's ``tk`` keys: ``[B|1, tk]``, bottom-right aligned under
    its queries' ``position_ids: [B|1, Tq]`` (the newest key is at the last query's position, the
    keys before it one step apart: a left-padded row's pad slots get negative positions, which
    its mask hides), or ``[tk]`` = ``0 .. tk-1`` when the model passes none."""
    if position_ids is None:
        return torch.arange(tk, device=device)
    if position_ids.dim() != 2:
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} (several position axes, as in "
            "multimodal RoPE): the pre-RoPE methods undo one rotary position per token; use --method qaware"
        )
    return position_ids[:, -1:].to(device) - (tk - 1) + torch.arange(tk, device=device)


def simulated_attention(q, k, v, k_hat, v_hat, attn_mask, is_causal, scale, residual):
    """Attention where keys/values inside the residual window are exact and the rest are the
    dequantized ``k_hat``/``v_hat``. q: ``[B, Hq, Tq, D]``; k, v, k_hat, v_hat:
    ``[B, Hkv, Tk, D]``; attn_mask: None, bool (True = attend) or additive float, broadcastable to
    ``[B, Hq, Tq, Tk]``; is_causal: SDPA's top-left causal mask. Returns ``[B, Hq, Tq, D]``."""
    rep = q.shape[1] // k.shape[1]
    k, v, k_hat, v_hat = (t.repeat_interleave(rep, dim=1) for t in (k, v, k_hat, v_hat))
    if residual <= 0:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k_hat, v_hat, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )
    tq, tk = q.shape[2], k.shape[2]
    exact = simulate_mask(tq, tk, residual, q.device)
    qf = q.float()
    scores = torch.where(exact, qf @ k.float().transpose(-1, -2), qf @ k_hat.float().transpose(-1, -2))
    scores = scores * scale
    if is_causal:
        causal = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = (probs * exact) @ v.float() + (probs * ~exact) @ v_hat.float()
    return out.to(q.dtype)


def biased_mask(position_bias, attn_mask, is_causal, tq, tk):
    """One additive float mask, as transformers' SDPA attention makes it: ``position_bias``
    (broadcastable to ``[B, Hq, Tq, Tk]``) where ``attn_mask`` (None, bool or additive) and SDPA's
    top-left causal mask (``is_causal``) let a query read, the dtype's minimum elsewhere."""
    if is_causal:
        attn_mask = torch.ones(tq, tk, dtype=torch.bool, device=position_bias.device).tril()
    if attn_mask is None:
        return position_bias
    if attn_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attn_mask, torch.finfo(position_bias.dtype).min)
    return position_bias + attn_mask


def vecinfer_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, position_bias=None, **kwargs
):
    """The ``"vecinfer"`` attention implementation (transformers' AttentionInterface
    signature). query ``[B, Hq, Tq, D]``, key/value ``[B, Hkv, Tk, D]``, position_bias None or
    additive, broadcastable to ``[B, Hq, Tq, Tk]``; returns ``([B, Tq, Hq, D], None)``."""
    check_attention_call(module, query, key, value, kwargs)
    sim: LayerSimulator | str | None = getattr(module, "vecinfer_simulator", None)
    if sim == FULL_PRECISION:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            position_bias=position_bias,
            **kwargs,
        )
    if sim is None:
        raise RuntimeError(
            "attn_implementation='vecinfer' needs quantizers: call "
            "vecinfer_compile.enable_simulation(model, method, bits=..., codebooks=...) first"
        )
    if dropout and module.training:
        raise ValueError("vecinfer simulation is for evaluation: call model.eval() (dropout > 0)")
    tq = query.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = bool(
        tq > 1
        and attention_mask is None
        and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    )
    if position_bias is not None:
        attention_mask, causal = biased_mask(position_bias, attention_mask, causal, tq, key.shape[2]), False
    if sim.is_prefill(tq):
        k_hat, v_hat, residual = key, value, 0
    else:
        k_hat, v_hat = sim.quantize_kv(key, value, kwargs.get("position_ids"))
        residual = sim.residual
    out = simulated_attention(query, key, value, k_hat, v_hat, attention_mask, causal, scale, residual)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, vecinfer_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    AttentionInterface.register(UNSKIPPED_MASKS_NAME, vecinfer_attention_forward)
    AttentionMaskInterface.register(UNSKIPPED_MASKS_NAME, unskipped_sdpa_mask)


_register()


def attention_modules(model):
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not mods:
        mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not mods:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with a layer_idx: simulation supports "
            "transformers models whose attention dispatches through AttentionInterface"
        )
    return mods


def enable_simulation(
    model,
    method: str,
    *,
    bits: float,
    codebooks: VecInferCodebooks | str | None = None,
    residual: int = 0,
    full_precision_prefill: bool = False,
):
    """Make ``model`` attend over quantized K/V (see module docstring). ``fp16`` restores plain
    SDPA. VQ methods need ``codebooks`` (checked against the model, bits and method).
    ``codebooks`` may be a codebook file's path. Returns the model."""
    check_method(method, bits)
    codebooks = codebooks_arg(codebooks)  # a path is loaded, as the backend takes one
    check_codebooks_type(codebooks)
    check_count("residual", residual, 0)
    if method == "fp16":
        return disable_simulation(model)
    if method in VQ_METHODS:
        if codebooks is None:
            raise ValueError(
                f"method {method!r} needs codebooks: vecinfer_compile.calibrate(...) or load_codebooks(path)"
            )
        codebooks.check_model(model.config, bits=bits, method=method)
        codebooks.check_weights(model)  # warns once if calibrated on another model's weights
    if not is_simulating(model):  # what disable_simulation goes back to (kept when re-enabled)
        model.__dict__[_PREVIOUS] = getattr(model.config, "_attn_implementation", None)
    coded = some_coded_layers(model.config)
    modules = attention_modules(model)
    for module in modules:
        module.vecinfer_simulator = (
            LayerSimulator(method, float(bits), residual, codebooks, module.layer_idx, full_precision_prefill)
            if coded[module.layer_idx]
            else FULL_PRECISION
        )
    simulators = {m.layer_idx: m.vecinfer_simulator for m in modules}
    for i, producer in enumerate(kv_producers(model.config)):
        if producer != i and isinstance(simulators.get(i), LayerSimulator):
            simulators[i].producer = simulators[producer]
    model.set_attn_implementation(UNSKIPPED_MASKS_NAME if needs_unskipped_masks(model) else ATTN_NAME)
    return model


@contextlib.contextmanager
def simulation(
    model,
    method: str,
    *,
    bits: float,
    codebooks: VecInferCodebooks | str | None = None,
    residual: int = 0,
    full_precision_prefill: bool = False,
):
    """``with simulation(model, "vecinfer", bits=2, codebooks=cb): ...``: :func:`enable_simulation`
    inside the block, the model's own attention again after it (also on an exception)."""
    enable_simulation(
        model, method, bits=bits, codebooks=codebooks, residual=residual, full_precision_prefill=full_precision_prefill
    )
    try:
        yield model
    finally:
        disable_simulation(model)


def is_simulating(model) -> bool:
    """Whether :func:`enable_simulation` is in force on ``model``."""
    return any(hasattr(m, "vecinfer_simulator") for m in model.modules())


def disable_simulation(model):
    """Back to full precision: the attention implementation the model had before
    :func:`enable_simulation` (``"eager"`` stays eager), SDPA when that is unknown; returns the model."""
    for module in model.modules():
        if hasattr(module, "vecinfer_simulator"):
            del module.vecinfer_simulator
    previous = model.__dict__.pop(_PREVIOUS, None)
    model.set_attn_implementation(previous if previous not in (None, ATTN_NAME, UNSKIPPED_MASKS_NAME) else "sdpa")
    return model
