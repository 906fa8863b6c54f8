"""Rewrite attention over a :class:`~vecinfer_compile.cache.VecInferCache` to the fused ops.

In a compiled step, each layer's cache update ends in ``vecinfer::cache_kv`` (the dequantized
full-length K/V) and attention reads it::

    kv   = vecinfer.cache_kv(k_codes, v_codes, kc, vc, n_coded, k_window, v_window, n_window, lam, H)
    out  = F.scaled_dot_product_attention(q, repeat_kv?(kv[0]), repeat_kv?(kv[1]), attn_mask, scale=s)

A decode step (one query token) becomes::

    q~       = ((q.float() * lam_q) @ H).to(q.dtype)        (plain torch ops; Inductor fuses them)
    kv_start = first attended slot of each batch row of attn_mask  (left padding)
    out      = vecinfer.decode_attention(q~, k_codes, v_codes, kc, vc, n_coded,
                                         k_window, v_window, n_window, kv_start, s)

On CUDA the op emitted is the kernel-specific one the request resolves to
(:func:`vecinfer_compile.ops.decode.choose`): ``decode_attention_cuda`` (the NVRTC kernel)
or ``decode_attention_triton``, so the choice is in the graph; elsewhere ``decode_attention``.

A layer the trellis codec codes (:mod:`vecinfer_compile.cache.trellis_layer`) reads through
``vecinfer::trellis_cache_kv`` instead (the same chain after it); its decode step becomes
``vecinfer.trellis_decode_attention(q~, k_codes, v_codes, n_coded, k_window, v_window, n_window,
kv_start, s, keys, values)`` (``counters["vecinfer"]["cache_decode_trellis"]``), and a chunk over it
``vecinfer.trellis_chunk_attention(q~, <the same six>, attn_mask, s, keys, values)``
(``cache_trellis_chunk_rewrites``).

A chunk of several query tokens reads the coded slots and the window as they were before it, with
its own tokens after the window (:func:`vecinfer_compile.cache.reads.chunk_window`: the
``cache_kv`` node's window arguments), and becomes
``vecinfer.chunk_attention(q~, <the same eight>, attn_mask, s)``
(:mod:`vecinfer_compile.ops.split_attention.chunk`), which reads the mask itself.

For the query-aware methods the cache returns ``K = (cache_kv(...)[0].float() @ key_read).to(dtype)``
(``key_read: [Hkv, D, D]``, the code domain back to keys, see :class:`~vecinfer_compile.cache.VecInferLayer`);
the rewrite recognises that chain and moves the matrix to the query side:
``q~ = (q.float() @ key_read^T).to(q.dtype)`` per query head's KV head. For the centring
methods the read adds the key mean before the cast (``(... + key_mean).to(dtype)``); the rewrite
drops it, exactly: window and codes both hold centred keys, so the mean only adds ``q . mu`` to
every score of a query, which softmax ignores.

after which ``cache_kv`` and the repetition are dead and erased, so the compiled graph holds no
dequantized full-length K/V. The cache state nodes are the ``cache_kv`` arguments themselves, so
no layer lookup is needed. Each rewrite bumps ``counters["vecinfer"]["cache_decode_rewrites"]``
(a chunk's also ``cache_chunk_rewrites``).

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

import contextlib
import logging
import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ..ops import decode, kernel_request
from ..ops.registry import is_op
from ..ops.decode_inputs import kv_start_from_mask, transform_queries
from .repeat_kv import erase_dead_repetition, unwrap_repeat_kv

log = logging.getLogger(__name__)

SDPA = F.scaled_dot_product_attention
CACHE_READ_META = "vecinfer_cache_read"

# positions of the cache_kv arguments
K_CODES, V_CODES, K_CENT, V_CENT, N_CODED, K_WIN, V_WIN, N_WIN, LAM, ROT = range(10)
# and of trellis_cache_kv's: (k_codes, v_codes, n_coded, k_window, v_window, n_window), lam, rotation, keys, values
T_LAM, T_ROT, T_KEYS, T_VALUES = range(6, 10)


def _example(node):
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _cache_output(node: fx.Node, index: int) -> fx.Node | None:
    """The read node if ``node`` is ``getitem(cache_kv(...) | trellis_cache_kv(...), index)``."""
    if (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and node.args[1] == index
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "call_function"
        and (is_op(node.args[0].target, "cache_kv") or is_op(node.args[0].target, "trellis_cache_kv"))
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
    """Whether ``gm`` stores into or reads a VecInferCache (``vecinfer::cache_append``,
    ``cache_kv``, ``prefill_read``, ``trellis_encode``, ``trellis_append`` or ``trellis_cache_kv``
    nodes). In such a
    graph every attention over the cache is the cache's business (rewritten to the decode op, or
    tagged to stay as it is), and the others read layers the cache keeps in full precision (a
    hybrid model's sliding windows): the generic simulate rewrite must quantize none of them."""
    ops = [getattr(torch.ops.vecinfer, name)
           for name in ("cache_append", "cache_kv", "prefill_read", "trellis_encode", "trellis_append",
                        "trellis_cache_kv")]
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
        if (isinstance(key, fx.Node) and key.target is operator.getitem and isinstance(key.args[0], fx.Node)
                and key.args[0] in markers):
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
    node.meta[CACHE_READ_META] = True
    counters["vecinfer"]["cache_decode_unfused"] += 1
    log.warning("vecinfer: attention over VecInferCache left unfused (%s): %s", why, node.format_node())


def _decode_op(q, cache_args, decode_kernel: str):
    """The decode op for this call: kernel-specific on CUDA, the dispatching op elsewhere."""
    if q.device.type != "cuda":
        return torch.ops.vecinfer.decode_attention.default
    k_codes, k_cent, v_cent = (_example(cache_args[i]) for i in (K_CODES, K_CENT, V_CENT))
    if k_codes is None or k_cent is None or v_cent is None:  # no shapes here: the op decides when traced
        return torch.ops.vecinfer.decode_attention.default
    request = contextlib.nullcontext() if decode_kernel is None else kernel_request.use_decode_kernel(decode_kernel)
    with request:
        kernel = decode.choose(q, k_codes, k_cent, v_cent)
    counters["vecinfer"][f"cache_decode_{kernel}"] += 1
    return getattr(torch.ops.vecinfer, f"decode_attention_{kernel}").default


def rewrite_cache_attention(gm: fx.GraphModule, decode_kernel: str | None = None) -> int:
    """Replace every SDPA over ``vecinfer::cache_kv`` by a decode-attention op over the codes (see
    the module docstring); ``decode_kernel`` (auto / cuda / triton; None: ``$VECINFER_KERNEL``
    or auto) picks the CUDA implementation.
    Returns the number of rewrites; recompiles ``gm`` if any."""
    rewrites = 0
    starts: dict[fx.Node, fx.Node] = {}  # kv_start per mask node
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        normalized = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
        if normalized is None:
            continue
        kw = dict(normalized.kwargs)
        key_arg, value_arg = kw["key"], kw["value"]
        key_outer, value = unwrap_repeat_kv(key_arg), unwrap_repeat_kv(value_arg)
        key, key_read, read_chain = _key_read(key_outer)
        cache = _cache_output(key, 0)
        if cache is None:
            continue
        if _cache_output(value, 1) is not cache:
            _unfusable(node, "key and value come from different cache reads")
            continue
        query, mask = kw["query"], kw.get("attn_mask")
        q = _example(query)
        if q is None or q.dim() != 4:
            _unfusable(node, "the query is not a [B, H, T, D] tensor")
            continue
        one_token = _static_int(q.shape[2]) == 1
        if kw.get("is_causal", False) is not False:
            _unfusable(node, "is_causal=True")
            continue
        dropout = kw.get("dropout_p", 0.0)
        if not isinstance(dropout, (int, float)) or dropout != 0.0:
            raise NotImplementedError(
                "vecinfer: attention over VecInferCache has dropout_p != 0: call model.eval()"
            )
        if mask is not None:
            m = _example(mask)
            if not isinstance(mask, fx.Node) or m is None or m.dim() != 4:
                _unfusable(node, "attn_mask is not a [B, H, T, L] tensor")
                continue
        scale = kw.get("scale")
        if scale is None:
            scale = 1.0 / math.sqrt(int(q.shape[-1]))
        if isinstance(scale, (int, float)):
            scale = float(scale)
        elif not isinstance(scale, fx.Node):  # a SymFloat node (dynamic=True) passes through
            _unfusable(node, "unsupported scale")
            continue
        a = cache.args
        trellis = is_op(cache.target, "trellis_cache_kv")
        if trellis:
            lam, rot = a[T_LAM], a[T_ROT]
        else:
            lam, rot = a[LAM], a[ROT]
            coded = (a[K_CODES], a[V_CODES], a[K_CENT], a[V_CENT], a[N_CODED], a[K_WIN], a[V_WIN], a[N_WIN])
        with graph.inserting_before(node):
            q_t = graph.call_function(transform_queries, (query, lam, rot, key_read))
            q_t.meta["example_value"] = q
            if one_token:
                kv_start = None
                if mask is not None:  # one per mask: every layer usually shares HF's
                    kv_start = starts.get(mask)
                    if kv_start is None:
                        kv_start = starts[mask] = graph.call_function(kv_start_from_mask, (mask, query))
                if trellis:
                    out = graph.call_function(torch.ops.vecinfer.trellis_decode_attention.default,
                                              (q_t, *a[:6], kv_start, scale, a[T_KEYS], a[T_VALUES]))
                    counters["vecinfer"]["cache_decode_trellis"] += 1
                else:
                    out = graph.call_function(_decode_op(q, a, decode_kernel), (q_t, *coded, kv_start, scale))
            else:  # a chunk: its read's window ends with its own tokens (cache.reads.chunk_window)
                if trellis:
                    out = graph.call_function(torch.ops.vecinfer.trellis_chunk_attention.default,
                                              (q_t, *a[:6], mask, scale, a[T_KEYS], a[T_VALUES]))
                    counters["vecinfer"]["cache_trellis_chunk_rewrites"] += 1
                else:
                    out = graph.call_function(torch.ops.vecinfer.chunk_attention.default, (q_t, *coded, mask, scale))
                    counters["vecinfer"]["cache_chunk_rewrites"] += 1
        out.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "example_value")})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        erase_dead_repetition(key_arg, key_outer)
        erase_dead_repetition(value_arg, value)
        for item in read_chain:
            if not item.users:
                graph.erase_node(item)
        for item in (key, value):
            if not item.users:
                graph.erase_node(item)
        if not cache.users:
            graph.erase_node(cache)
        counters["vecinfer"]["cache_decode_rewrites"] += 1
        rewrites += 1
    if rewrites:
        graph.lint()
        gm.recompile()
    return rewrites
