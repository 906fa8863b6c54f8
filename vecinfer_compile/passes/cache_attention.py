"""Rewrite attention over a :class:`~vecinfer_compile.cache.VecInferCache` to the fused ops, from a
table: each registered codec (:mod:`vecinfer_compile.codecs`) names the read op its cache layers
end in and how its decode and chunk ops are emitted from that read's arguments
(:class:`~vecinfer_compile.codecs.base.CacheRewrite`).

In a compiled step, each layer's cache update ends in its codec's read (for the default codebooks,
``vecinfer::cache_kv``: the dequantized full-length K/V) and attention reads it::

    kv   = vecinfer.cache_kv(k_codes, v_codes, kc, vc, n_coded, k_window, v_window, n_window, lam, H)
    out  = F.scaled_dot_product_attention(q, repeat_kv?(kv[0]), repeat_kv?(kv[1]), attn_mask, scale=s)

A site (:class:`Site`: the SDPA node, the read, the query, mask and scale, the query-aware chain)
is matched first; then a decode step (one query token) becomes::

    q~       = ((q.float() * lam_q) @ H).to(q.dtype)        (plain torch ops; Inductor fuses them)
    kv_start = first attended slot of each batch row of attn_mask  (left padding)
    out      = <the codec's decode op>(q~, <its arguments from the read's>, kv_start, s)

(for the codebooks on CUDA the kernel-specific op the request resolves to,
:func:`vecinfer_compile.ops.decode.choose`, so the choice is in the graph).

A chunk of several query tokens reads the coded slots and the window as they were before it, with
its own tokens after the window (:func:`vecinfer_compile.cache.reads.chunk_window`: the
read's window arguments), and becomes the codec's chunk op (the codebooks'
``vecinfer.chunk_attention(q~, <the same eight>, attn_mask, s)``,
:mod:`vecinfer_compile.ops.split_attention.chunk`), which reads the mask itself.

For the query-aware methods the cache returns ``K = (cache_kv(...)[0].float() @ key_read).to(dtype)``
(``key_read: [Hkv, D, D]``, the code domain back to keys, see :class:`~vecinfer_compile.cache.VecInferLayer`);
the rewrite recognises that chain and moves the matrix to the query side:
``q~ = (q.float() @ key_read^T).to(q.dtype)`` per query head's KV head. For the centring
methods the read adds the key mean before the cast (``(... + key_mean).to(dtype)``); the rewrite
drops it, exactly: window and codes both hold centred keys, so the mean only adds ``q . mu`` to
every score of a query, which softmax ignores.

after which ``cache_kv`` and the repetition are dead and erased, so the compiled graph holds no
dequantized full-length K/V. The cache state nodes are the read's arguments themselves, so
no layer lookup is needed. Each rewrite bumps ``counters["vecinfer"]["cache_decode_rewrites"]``
or ``cache_chunk_rewrites``, and ``cache_decode_<codec>`` / ``cache_chunk_<codec>``.

Run it BEFORE the generic SDPA rewrite (:mod:`.sdpa`). SDPA nodes over ``cache_kv`` that are not
rewritten (``is_causal=True``; a mask that is not 4-d; K and V of different reads) are left as
they are (correct, full-length dequantized K/V) and tagged ``node.meta["vecinfer_cache_read"] =
True``: the generic rewrite must skip those (quantizing them again would quantize twice).

Masks: ``kv_start`` is the index of the first attended slot of the mask's last query row (bool:
True = attend; float: 0 = attend). This is exact for HF's masks at decode (left padding + slots
beyond the valid length, which ``n_coded + n_window`` bounds anyway). A mask with holes after the
first attended slot (padding inside the sequence) is NOT representable by the fused decode op; it
cannot be detected without a device sync in a compiled graph, so it is documented, not checked.
The chunk op checks its mask on the host and applies one that is more than causal + left padding
as it is.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ..codecs import registry
from ..ops.decode_inputs import kv_start_from_mask, transform_queries
from ..ops.registry import is_op
from .repeat_kv import erase_dead_repetition, unwrap_repeat_kv

log = logging.getLogger(__name__)

SDPA = F.scaled_dot_product_attention
CACHE_READ_META = "vecinfer_cache_read"


def rewrites() -> dict[str, tuple[str, object]]:
    """``{read op name: (codec name, its CacheRewrite)}`` over the registered codecs."""
    return {c.rewrite.read_op: (c.name, c.rewrite) for c in registry.all_codecs()}


def _example(node):
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _read_name(node) -> str | None:
    """The registered read op ``node`` calls, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return None
    return next((name for name in rewrites() if is_op(node.target, name)), None)


def _cache_output(node: fx.Node, index: int) -> fx.Node | None:
    """The read node if ``node`` is ``getitem(<a codec's read>(...), index)``."""
    if (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and node.args[1] == index
        and _read_name(node.args[0]) is not None
    ):
        return node.args[0]
    return None


def _is_method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _is_call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _key_read(key: fx.Node) -> tuple[fx.Node, fx.Node | None, list[fx.Node]]:
    """``(inner, key_read, chain)``: for ``key = ((inner.float() [@ key_read]) [+ mean]).to(dtype)``
    (a query-aware and/or centred cache read, :meth:`VecInferLayer._read`) the inner node, the
    matrix node (or None) and the chain's nodes outermost first; otherwise ``(key, None, [])``.
    The mean is dropped with the chain: it adds ``q . mu`` to every score of a query's row (window
    and codes alike, both stored centred), which softmax ignores."""
    if not _is_method(key, "to"):
        return key, None, []
    chain, x = [key], key.args[0]
    if _is_call(x, operator.add, torch.add):
        mean = x.args[1]  # key_mean[None, :, None, :]: erased with the add when nothing else reads it
        chain += [x] + ([mean] if isinstance(mean, fx.Node) and mean.op == "call_function" else [])
        x = x.args[0]
    matrix = None
    if _is_call(x, operator.matmul, torch.matmul):
        chain.append(x)
        x, matrix = x.args[0], x.args[1]
    if len(chain) == 1 or not _is_method(x, "float") or _cache_output(x.args[0], 0) is None:
        return key, None, []
    return x.args[0], matrix, chain + [x]


def updates_a_cache(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` stores into or reads a VecInferCache (``vecinfer::prefill_read``, or a
    registered codec's read or write ops). In such a
    graph every attention over the cache is the cache's business (rewritten to the decode op, or
    tagged to stay as it is), and the others read layers the cache keeps in full precision (a
    hybrid model's sliding windows): the generic simulate rewrite must quantize none of them."""
    names = {"prefill_read"}
    for codec in registry.all_codecs():
        names |= {codec.rewrite.read_op, *codec.rewrite.write_ops}
    ops = [getattr(torch.ops.vecinfer, name) for name in sorted(names)]
    targets = {op for op in ops} | {op.default for op in ops}
    return any(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def keep_prefill_in_full_precision(gm: fx.GraphModule) -> int:
    """Every SDPA over an empty cache's prefill (``getitem(prefill_read(k, v), 0 | 1)``, through
    HF's repeat_kv chain or not) is tagged ``vecinfer_cache_read``, so the generic rewrite leaves
    it in full precision as the eager prefill is; then the marker's outputs are replaced by its
    inputs and it is erased. Returns the number of tagged attentions."""
    markers = [n for n in gm.graph.nodes if n.op == "call_function" and is_op(n.target, "prefill_read")]
    if not markers:
        return 0
    tagged = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        key = unwrap_repeat_kv(node.kwargs.get("key", node.args[1] if len(node.args) > 1 else None))
        if (
            isinstance(key, fx.Node)
            and key.target is operator.getitem
            and isinstance(key.args[0], fx.Node)
            and key.args[0] in markers
        ):
            node.meta[CACHE_READ_META] = True
            tagged += 1
    for marker in markers:
        for user in list(marker.users):  # the getitems of K and V
            user.replace_all_uses_with(marker.args[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(marker)
    counters["vecinfer"]["cache_prefill_full_precision"] += tagged
    gm.graph.lint()
    gm.recompile()
    return tagged


def _static_int(x) -> int | None:
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt) and x.node.is_constant():
        return int(x)
    try:
        return int(x) if not isinstance(x, torch.SymInt) else None
    except Exception:  # noqa: BLE001
        return None


def _unfusable(node: fx.Node, why: str) -> None:
    """Tag ``node`` to stay as it is (:data:`CACHE_READ_META`), with a warning; returns None."""
    node.meta[CACHE_READ_META] = True
    counters["vecinfer"]["cache_decode_unfused"] += 1
    log.warning("vecinfer: attention over VecInferCache left unfused (%s): %s", why, node.format_node())


@dataclass
class Site:
    """One SDPA over a codec's cache read, matched: ``node`` the SDPA, ``read`` the read node (its
    arguments the layer's buffers and operands), ``query``/``mask``/``scale`` its arguments, ``q``
    the query's example, ``key_read`` the query-aware matrix node (or None) and ``chain`` the read
    chain's nodes, ``key_arg``/``value_arg`` SDPA's K/V arguments and ``key``/``value`` the read's
    outputs under them."""

    node: fx.Node
    read: fx.Node
    query: fx.Node
    mask: fx.Node | None
    scale: float | fx.Node
    q: torch.Tensor
    key_read: fx.Node | None
    chain: list[fx.Node]
    key_arg: fx.Node
    key_outer: fx.Node
    key: fx.Node
    value_arg: fx.Node
    value: fx.Node

    @property
    def one_token(self) -> bool:
        return _static_int(self.q.shape[2]) == 1


def match(gm: fx.GraphModule, node: fx.Node) -> Site | None:
    """The :class:`Site` of ``node`` if it is an SDPA over a codec's cache read that the fused ops
    can take; None otherwise (a read it cannot take is tagged :data:`CACHE_READ_META` and logged)."""
    if node.op != "call_function" or node.target is not SDPA:
        return None
    normalized = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return None
    kw = dict(normalized.kwargs)
    key_arg, value_arg = kw["key"], kw["value"]
    key_outer, value = unwrap_repeat_kv(key_arg), unwrap_repeat_kv(value_arg)
    key, key_read, read_chain = _key_read(key_outer)
    cache = _cache_output(key, 0)
    if cache is None:
        return None
    if _cache_output(value, 1) is not cache:
        return _unfusable(node, "key and value come from different cache reads")
    query, mask = kw["query"], kw.get("attn_mask")
    q = _example(query)
    if q is None or q.dim() != 4:
        return _unfusable(node, "the query is not a [B, H, T, D] tensor")
    if kw.get("is_causal", False) is not False:
        return _unfusable(node, "is_causal=True")
    dropout = kw.get("dropout_p", 0.0)
    if not isinstance(dropout, (int, float)) or dropout != 0.0:
        raise NotImplementedError("vecinfer: attention over VecInferCache has dropout_p != 0: call model.eval()")
    if mask is not None:
        m = _example(mask)
        if not isinstance(mask, fx.Node) or m is None or m.dim() != 4:
            return _unfusable(node, "attn_mask is not a [B, H, T, L] tensor")
    scale = kw.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(int(q.shape[-1]))
    if isinstance(scale, (int, float)):
        scale = float(scale)
    elif not isinstance(scale, fx.Node):  # a SymFloat node (dynamic=True) passes through
        return _unfusable(node, "unsupported scale")
    return Site(node, cache, query, mask, scale, q, key_read, read_chain, key_arg, key_outer, key, value_arg, value)


def emit(gm: fx.GraphModule, site: Site, decode_kernel: str | None, starts: dict) -> fx.Node:
    """The codec's decode (one token) or chunk op in place of ``site``'s SDPA, from the table entry of
    its read; ``starts``: the ``kv_start`` node of each mask node, shared by the layers."""
    graph = gm.graph
    codec_name, entry = rewrites()[_read_name(site.read)]
    a = tuple(site.read.args)
    lam, rot = entry.transform(a)
    with graph.inserting_before(site.node):
        q_t = graph.call_function(transform_queries, (site.query, lam, rot, site.key_read))
        q_t.meta["example_value"] = site.q
        counters["vecinfer"]["cache_decode_rewrites"] += 1
        if site.one_token:
            kv_start = None
            if site.mask is not None:  # one per mask: every layer usually shares HF's
                kv_start = starts.get(site.mask)
                if kv_start is None:
                    kv_start = starts[site.mask] = graph.call_function(kv_start_from_mask, (site.mask, site.query))
            op, args = entry.decode(site.q, a, kv_start, site.scale, decode_kernel)
            counters["vecinfer"][f"cache_decode_{codec_name}"] += 1
        else:  # a chunk: its read's window ends with its own tokens (cache.reads.chunk_window)
            op, args = entry.chunk(a, site.mask, site.scale)
            counters["vecinfer"]["cache_chunk_rewrites"] += 1
            counters["vecinfer"][f"cache_chunk_{codec_name}"] += 1
        out = graph.call_function(op, (q_t, *args))
    out.meta.update(
        {k: v for k, v in site.node.meta.items() if k in ("nn_module_stack", "stack_trace", "example_value")}
    )
    return out


def _erase(graph: fx.Graph, site: Site, out: fx.Node) -> None:
    """Put ``out`` in place of the site's SDPA; the repetition, read chain and read go where unused."""
    site.node.replace_all_uses_with(out)
    graph.erase_node(site.node)
    erase_dead_repetition(site.key_arg, site.key_outer)
    erase_dead_repetition(site.value_arg, site.value)
    for item in (*site.chain, site.key, site.value):
        if not item.users:
            graph.erase_node(item)
    if not site.read.users:
        graph.erase_node(site.read)


def rewrite_cache_attention(gm: fx.GraphModule, decode_kernel: str | None = None) -> int:
    """Replace every SDPA over a codec's cache read by that codec's decode or chunk op over the codes
    (see the module docstring); ``decode_kernel`` (auto / cuda / triton; None: the environment's
    request or auto) picks the CUDA implementation.
    Returns the number of rewrites; recompiles ``gm`` if any."""
    rewritten = 0
    starts: dict[fx.Node, fx.Node] = {}  # kv_start per mask node
    for node in list(gm.graph.nodes):
        site = match(gm, node)
        if site is None:
            continue
        _erase(gm.graph, site, emit(gm, site, decode_kernel, starts))
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
