"""Rewrite every ``F.scaled_dot_product_attention`` of a Dynamo graph to VecInfer attention.

For each SDPA node (any argument form: positional or keyword, bool or float ``attn_mask``,
``is_causal``, ``scale`` defaulting to ``1/sqrt(D)``, ``enable_gqa``)::

    q~ = ((q.float() * lam_q) @ H).to(q.dtype)          q: [B, Hq, Tq, D], lam_q: [Hq, 1, D]
    K~ = ((k.float() / lam) @ H).to(k.dtype)            k: [B, Hkv, Tk, D], lam: [Hkv, 1, D]
    (centring methods: ``k.float() - key_mean`` first, key_mean: [Hkv, 1, D]; queries unchanged,
    every key of a row, window and quantized, is shifted alike, so attention stays exact)
    (query-aware methods: ``q.float() @ (B_q @ H)`` and ``k.float() @ (A @ H)`` instead, with
    A: [Hkv, D, D] and B_q: [Hq, D, D] its inverse transpose for each query head's KV head)
    quantize, residual == 0:
                     K^ = vecinfer.quantize(K~, None, None, key_centroids[, key_parallel_weight])
                     V^ = vecinfer.quantize(v, None, None, value_centroids)
                     (error-weighted codes, the layer has metrics: quantize_weighted(K~, key_centroids,
                     key_metric, key_parallel_weight), the same for v: encode, vecinfer.weigh_codes,
                     the centroids' values)
                     out = F.scaled_dot_product_attention(q~, K^, V^, mask, is_causal=...,
                                                          scale=scale, enable_gqa=Hq != Hkv)
    quantize, residual > 0:
                     K^, V^ as above
                     plan = windowed.window_plan(q, k, mask, is_causal, residual)  (once per graph
                                                   for each distinct mask and sizes, shared by layers)
                     out = windowed.windowed_attention(q~, K^, K~, V^, v, plan, scale)
    quantize=False:  out = F.scaled_dot_product_attention(q~, K~, v, mask, is_causal=...,
                                                          scale=scale, enable_gqa=Hq != Hkv)

The simulate graph quantize-dequantizes K and V once (``K^``, ``V^``: centroid values, the size
of the K and V they replace): prefill attention is compute-bound, and re-gathering each K/V tile
from the codebook for every query block (what ``vecinfer.attention`` does) costs more than reading
it once dequantized. Without a residual window they go to the SDPA Inductor would have run. With a
window, keys near each query stay full precision, which one SDPA call cannot express: a fused
attention kernel over the quantized keys (cuDNN, FlashAttention-2 or the memory-efficient kernel,
which return the log-sum-exp) and the R full-precision keys of each query (FlashAttention-2's
sliding window, or a blockwise torch band under a mask), merged by log-sum-exp (:mod:`.windowed`;
the plan, the quantized part's bias and the band's mask, is built once per graph).

The transform is applied once, as plain torch ops in front of the ops (Inductor fuses them);
``encode`` gets ``lam=None, rotation=None``. K/V stay at ``Hkv`` heads: HF's ``repeat_kv`` is
unwrapped (:mod:`.repeat_kv`). ``lam``, ``H`` and the codebooks become buffers of the graph module
(``get_attr`` nodes). Layer identity comes from ``node.meta["nn_module_stack"]``. Each rewrite
bumps ``counters["vecinfer"]["sdpa_rewrites"]``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.source import ConstantSource
from torch._dynamo.utils import counters

from ..codebooks import LayerCodebooks
from ..ops.encode import quantize_weighted
from ..ops.split_attention.windowed import window_plan, windowed_attention
from .cache_attention import CACHE_READ_META
from .repeat_kv import erase_dead_repetition, unwrap_repeat_kv

log = logging.getLogger(__name__)

SDPA = F.scaled_dot_product_attention
FLOAT_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")
_SOURCE_PREFIX = re.compile(r"^L\['[^']*'\](?:\[\d+\])*\.?")
_MODULES_ITEM = re.compile(r"\._modules\['([^']*)'\]")


def concrete_int(x) -> int:
    """An int from an int or a SymInt (its hint: the size seen at this compile)."""
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        if hint is None:
            raise ValueError(f"size {x} has no concrete value at compile time")
        return int(hint)
    return int(x)


@dataclass
class SdpaSite:
    """One SDPA call of the graph, normalised.

    key/value: the KV-head tensors ``[B, Hkv, Tk, D]`` (repetition unwrapped); key_arg/value_arg:
    what SDPA read (the repeated tensors, or key/value); attn_mask: a node or None; scale: the
    explicit or default ``1/sqrt(D)`` scale (a SymFloat node when Dynamo made the model's float
    attribute symbolic under ``dynamic=True``)."""

    node: fx.Node
    layer: int
    query: fx.Node
    key: fx.Node
    value: fx.Node
    key_arg: fx.Node
    value_arg: fx.Node
    attn_mask: fx.Node | None
    is_causal: bool
    scale: float | fx.Node
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def is_sdpa(node: fx.Node) -> bool:
    """An SDPA call to rewrite: not one that :mod:`.cache_attention` left over a VecInferCache read
    (its K/V are already dequantized codes)."""
    return node.op == "call_function" and node.target is SDPA and not node.meta.get(CACHE_READ_META)


def _example(node: fx.Node) -> torch.Tensor:
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"vecinfer: node {node.name} has no example tensor; is this a Dynamo graph?")
    return value


def _below_root(path: str) -> str:
    """``"L['self'].model.layers.3.self_attn"`` -> ``"model.layers.3.self_attn"``: a module path
    without the Dynamo source of the compiled frame's root."""
    return _MODULES_ITEM.sub(r".\1", _SOURCE_PREFIX.sub("", path))


def layer_from_module_path(path: str) -> int | None:
    """``"L['self'].model.layers.3.self_attn"`` -> 3: the first integer component of the module
    path (after the Dynamo source prefix), or None."""
    match = _LAYER_INDEX.search(_below_root(path))
    return int(match.group(1)) if match else None


def _layer_of(node: fx.Node) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        layer = layer_from_module_path(path)
        if layer is not None:
            return layer
    return None


def _sdpa_kwargs(gm: fx.GraphModule, node: fx.Node) -> dict:
    normalized = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if normalized is None:
        raise ValueError(f"vecinfer: could not normalise the arguments of {node.format_node()}")
    return dict(normalized.kwargs)


def _site(gm: fx.GraphModule, node: fx.Node, layer: int) -> SdpaSite:
    kw = _sdpa_kwargs(gm, node)
    dropout = kw.get("dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0.0:
        raise NotImplementedError(
            f"vecinfer: SDPA in layer {layer} has dropout_p={dropout}; VecInfer attention has no "
            "dropout: call model.eval() (or set attention_dropout=0.0 in the config)"
        )
    is_causal = kw.get("is_causal", False)
    if not isinstance(is_causal, bool):
        raise NotImplementedError(f"vecinfer: SDPA in layer {layer} has a non-constant is_causal")
    mask = kw.get("attn_mask")
    if mask is not None and not isinstance(mask, fx.Node):
        raise NotImplementedError(f"vecinfer: SDPA in layer {layer} has an unsupported attn_mask {mask!r}")
    if mask is not None and _example(mask).dtype not in (torch.bool, *FLOAT_MASK_DTYPES):
        raise NotImplementedError(
            f"vecinfer: SDPA in layer {layer} has an attn_mask of dtype {_example(mask).dtype}; "
            "pass a bool mask (True = attend) or an additive float mask"
        )
    query, key, value = kw["query"], unwrap_repeat_kv(kw["key"]), unwrap_repeat_kv(kw["value"])
    q, k, v = _example(query), _example(key), _example(value)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise NotImplementedError(
            f"vecinfer: SDPA in layer {layer} has query/key/value of ranks {q.dim()}/{k.dim()}/"
            f"{v.dim()}; VecInfer attention needs [B, H, T, D] tensors"
        )
    q_heads, kv_heads = concrete_int(q.shape[1]), concrete_int(k.shape[1])
    head_dim = concrete_int(q.shape[-1])
    if q_heads % kv_heads or concrete_int(v.shape[1]) != kv_heads:
        raise NotImplementedError(
            f"vecinfer: SDPA in layer {layer} has {q_heads} query heads, {kv_heads} key heads and "
            f"{concrete_int(v.shape[1])} value heads; query heads must be a multiple of the KV heads"
        )
    if concrete_int(k.shape[-1]) != head_dim or concrete_int(v.shape[-1]) != head_dim:
        raise NotImplementedError(
            f"vecinfer: SDPA in layer {layer} has different query/key/value head dims; "
            "VecInfer attention needs one head_dim"
        )
    scale = kw.get("scale")
    if isinstance(scale, fx.Node) and not isinstance(scale.meta.get("example_value"), torch.SymFloat):
        raise NotImplementedError(f"vecinfer: SDPA in layer {layer} has a scale that is not a float")
    return SdpaSite(
        node=node,
        layer=layer,
        query=query,
        key=key,
        value=value,
        key_arg=kw["key"],
        value_arg=kw["value"],
        attn_mask=mask,
        is_causal=is_causal,
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=q.dtype,
        device=q.device,
    )


def find_sdpa_sites(gm: fx.GraphModule) -> list[SdpaSite]:
    """Every SDPA node of ``gm`` as a :class:`SdpaSite`, in graph order. Raises
    NotImplementedError naming the fix for a form VecInfer cannot run (never silently skips).

    A node's layer is the index in its module path. A node of a module (inside one, or in the
    compiled frame's own module, whose parameters the graph reads) without one is refused: its
    graph starts inside a decoder layer (a graph break there makes Dynamo compile the rest of the
    layer's code on its own) and serves every layer, so no layer's codebooks may be placed in it.
    Nodes of a compiled function are numbered by their order in the graph."""
    nodes = [n for n in gm.graph.nodes if is_sdpa(n)]
    layers = [_layer_of(n) for n in nodes]
    for node, layer in zip(nodes, layers):
        stack = node.meta.get("nn_module_stack")
        if layer is None and (stack or getattr(gm, "_param_name_to_source", None)):
            where = f"module {_below_root(list(stack.values())[-1][0])!r}" if stack else "a module's own forward"
            raise NotImplementedError(
                f"vecinfer: the attention in {where} has no layer index: a graph break inside a decoder layer "
                "compiled one graph for every layer; remove it (fullgraph=True names it)"
            )
    if any(layer is None for layer in layers):
        log.warning(
            "vecinfer: %d attention call(s) have no module path in node.meta['nn_module_stack']; "
            "numbering them by their order in this graph, which is only right without graph breaks",
            sum(layer is None for layer in layers),
        )
        layers = list(range(len(nodes)))
    return [_site(gm, n, layer) for n, layer in zip(nodes, layers)]


class _Emitter:
    """Inserts nodes before one SDPA node and registers constants on the graph module."""

    def __init__(self, gm: fx.GraphModule, site: SdpaSite):
        self.gm, self.site, self.graph = gm, site, gm.graph

    def constant(self, name: str, value: torch.Tensor) -> fx.Node:
        qualified = f"vecinfer_layer{self.site.layer}_{name}"
        if not hasattr(self.gm, qualified):
            self.gm.register_buffer(qualified, value.detach().to(self.site.device).clone())
            # AOTAutograd lifts buffers of a Dynamo graph module as inputs and looks up where
            # each came from; a constant has no user-visible source.
            sources = getattr(self.gm, "_param_name_to_source", None)
            if sources is not None:
                sources[qualified] = ConstantSource(qualified)
        return self.graph.get_attr(qualified)

    def call(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)

    def transform(
        self,
        x: fx.Node,
        lam: torch.Tensor | None,
        rotation: torch.Tensor | None,
        op,
        name: str,
        matrix: tuple[str, torch.Tensor] | None = None,
        mean: torch.Tensor | None = None,
    ) -> fx.Node:
        """``(((x.float() - mean) op lam) @ M @ H).to(x.dtype)``, ``matrix = (name, M)`` with
        ``M: [H, D, D]`` per head, ``mean: [H, D]``; x itself when there is no transform."""
        if lam is None and rotation is None and matrix is None and mean is None:
            return x
        out = self.graph.call_method("float", (x,))
        if mean is not None:
            out = self.call(torch.sub, out, self.constant("key_mean", mean[:, None, :].float()))
        if lam is not None:
            out = self.call(op, out, self.constant(name, lam[:, None, :].float()))
        if matrix is not None:
            out = self.call(torch.matmul, out, self.constant(matrix[0], matrix[1].float()))
        if rotation is not None:
            out = self.call(torch.matmul, out, self.constant("rotation", rotation.float()))
        return self.graph.call_method("to", (out, self.site.dtype))


def _window_key(site: SdpaSite) -> tuple:
    """Sites with equal keys share one window plan: same mask node, causality, sizes, dtype."""
    q, k = _example(site.query), _example(site.key)
    return (
        site.attn_mask,
        site.is_causal,
        str(q.shape[0]),
        site.q_heads,
        site.kv_heads,
        str(q.shape[2]),
        str(k.shape[2]),
        str(q.device),
        q.dtype,
    )


def _shared_window_plan(emit: _Emitter, site: SdpaSite, residual: int, plans: dict) -> fx.Node:
    """The window-plan node for ``site``: emitted before the first site of its key, reused after."""
    key = _window_key(site)
    if key not in plans:
        plans[key] = emit.call(window_plan, site.query, site.key, site.attn_mask, site.is_causal, residual)
        counters["vecinfer"]["window_plans"] += 1
    return plans[key]


def _rewrite_site(
    gm: fx.GraphModule,
    site: SdpaSite,
    layer: LayerCodebooks,
    *,
    quantize: bool,
    residual: int,
    plans: dict,
    key_parallel_weight: float,
) -> None:
    transform = layer.transform
    lam, key_m = transform.lam, transform.key_matrix
    heads, dim = site.kv_heads, site.head_dim
    for what, state, shape in (
        ("smoothing factors", lam, (heads, dim)),
        ("a key mean", transform.mean, (heads, dim)),
        ("query-aware matrices", key_m, (heads, dim, dim)),
        ("key error metrics", layer.key_metric, (heads, dim, dim)),
        ("value error metrics", layer.value_metric, (heads, dim, dim)),
    ):
        if state is not None and tuple(state.shape) != shape:
            raise ValueError(
                f"vecinfer: layer {site.layer} has {what} of shape {tuple(state.shape)} but its "
                f"attention has {heads} KV heads of dim {dim}: these codebooks were "
                "calibrated for another model; run `vecinfer calibrate` on this model"
            )
    rotation = transform.rotation(torch.float32, "cpu")
    group = site.q_heads // site.kv_heads
    lam_q = None if lam is None else lam.repeat_interleave(group, dim=0)
    query_m = None
    if key_m is not None:  # one matmul per side: the Hadamard folded into the matrices
        fold = (lambda m: m.float()) if rotation is None else (lambda m: m.float() @ rotation)
        query_m = ("query_matrix", fold(transform.query_matrix.repeat_interleave(group, dim=0)))
        key_m, rotation = ("key_matrix", fold(key_m)), None
    node = site.node
    with gm.graph.inserting_before(node):
        emit = _Emitter(gm, site)
        q_t = emit.transform(site.query, lam_q, rotation, torch.mul, "lam_q", query_m)
        k_t = emit.transform(site.key, lam, rotation, torch.div, "lam", key_m, transform.mean)
        k_in, v_in = k_t, site.value
        if quantize:
            kc = emit.constant("key_centroids", layer.keys.float())  # the default codec's books
            vc = emit.constant("value_centroids", layer.values.float())  # (check_compiled_simulate)
            weight = () if key_parallel_weight == 1.0 else (key_parallel_weight,)  # the schema's default: left out
            if layer.key_metric is not None:
                km = emit.constant("key_metric", layer.key_metric.float())
                vm = emit.constant("value_metric", layer.value_metric.float())
                k_in = emit.call(quantize_weighted, k_t, kc, km, *weight)
                v_in = emit.call(quantize_weighted, site.value, vc, vm)
            else:
                k_in = emit.call(torch.ops.vecinfer.quantize.default, k_t, None, None, kc, *weight)
                v_in = emit.call(torch.ops.vecinfer.quantize.default, site.value, None, None, vc)
        if quantize and residual:
            plan = _shared_window_plan(emit, site, residual, plans)
            out = emit.call(windowed_attention, q_t, k_in, k_t, v_in, site.value, plan, site.scale)
        else:
            out = emit.call(
                SDPA,
                q_t,
                k_in,
                v_in,
                attn_mask=site.attn_mask,
                dropout_p=0.0,
                is_causal=site.is_causal,
                scale=site.scale,
                enable_gqa=site.q_heads != site.kv_heads,
            )
    out.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    erase_dead_repetition(site.key_arg, site.key)
    erase_dead_repetition(site.value_arg, site.value)
    counters["vecinfer"]["sdpa_rewrites"] += 1


def rewrite_sdpa(
    gm: fx.GraphModule,
    sites: list[SdpaSite],
    layers: Mapping[int, LayerCodebooks],
    *,
    quantize: bool = True,
    residual: int = 0,
    key_parallel_weight: float = 1.0,
) -> int:
    """Replace each site's SDPA node (see the module docstring); ``layers[site.layer]`` gives its
    transform, codebooks and error metrics (error-weighted codes when present),
    ``key_parallel_weight`` how their keys are encoded (:mod:`vecinfer_compile.quant.score_aware`). Returns the number of rewrites and recompiles ``gm``."""
    if residual < 0:
        raise ValueError(f"residual must be >= 0, got {residual}")
    plans: dict = {}
    for site in sites:
        _rewrite_site(
            gm,
            site,
            layers[site.layer],
            quantize=quantize,
            residual=residual,
            plans=plans,
            key_parallel_weight=key_parallel_weight,
        )
    gm.graph.lint()
    gm.recompile()
    return len(sites)
