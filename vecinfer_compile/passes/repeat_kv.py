"""Unwrap GQA head repetition in front of SDPA back to the KV-head tensor.

A model with fewer KV heads than query heads either calls SDPA with ``enable_gqa=True`` or
repeats K/V per query head first. The repetitions recognised here (numbered like Inductor's
``fuse_attention.py``)::

    1. HF repeat_kv:  x[:, :, None, :, :].expand(B, Hkv, n, T, D).reshape(B, Hkv * n, T, D)
    2. interleave:    x.repeat_interleave(n, dim=1)   (method or torch.repeat_interleave)

``x`` is ``[B, Hkv, T, D]``; the repeated tensor ``[B, Hkv * n, T, D]`` puts query head ``h`` on
KV head ``h // n`` in both patterns, the mapping the vecinfer ops use. Each unwrap bumps
``counters["vecinfer"]["repeat_kv_unwrapped"]``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

_RESHAPE = ("reshape", "view")


def _is_full_slice(index) -> bool:
    return isinstance(index, slice) and index == slice(None, None, None)


def _is_insert_dim2(node: fx.Node) -> bool:
    """``x[:, :, None, ...]`` with only full slices / Ellipsis after the new axis."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) < 3:
        return False
    head, rest = index[:3], index[3:]
    return (
        _is_full_slice(head[0])
        and _is_full_slice(head[1])
        and head[2] is None
        and all(_is_full_slice(i) or i is Ellipsis for i in rest)
    )


def _is_method(node: fx.Node, names) -> bool:
    return node.op == "call_method" and node.target in names


def _pattern_1(node: fx.Node) -> fx.Node | None:
    """HF ``repeat_kv``: getitem(None at dim 2) -> expand -> reshape."""
    if not _is_method(node, _RESHAPE) and node.target is not torch.reshape:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or not _is_method(expand, ("expand",)):
        return None
    getitem = expand.args[0]
    if not isinstance(getitem, fx.Node) or not _is_insert_dim2(getitem):
        return None
    return getitem.args[0]


def _pattern_2(node: fx.Node) -> fx.Node | None:
    """``x.repeat_interleave(n, dim=1)`` with an int ``n``."""
    if _is_method(node, ("repeat_interleave",)) or node.target is torch.repeat_interleave:
        args = list(node.args) + [None] * 3
        dim = node.kwargs.get("dim", args[2])
        repeats = node.kwargs.get("repeats", args[1])
        if isinstance(repeats, int) and dim == 1:
            return node.args[0]
    return None


PATTERNS = (_pattern_1, _pattern_2)


def unwrap_repeat_kv(node: fx.Node) -> fx.Node:
    """The KV-head tensor behind ``node`` if ``node`` repeats heads (a pattern above), else
    ``node`` itself. The graph is not modified: see :func:`erase_dead_repetition`."""
    for pattern in PATTERNS:
        base = pattern(node)
        if base is not None and _repeats_dim1(node, base):
            counters["vecinfer"]["repeat_kv_unwrapped"] += 1
            return base
    return node


def _repeats_dim1(repeated: fx.Node, base: fx.Node) -> bool:
    """Shapes agree with a head repetition: ``[B, H, T, D] -> [B, H * n, T, D]``."""
    r, b = (n.meta.get("example_value") for n in (repeated, base))
    if not isinstance(r, torch.Tensor) or not isinstance(b, torch.Tensor) or r.dim() != 4 or b.dim() != 4:
        return False
    return r.shape[0] == b.shape[0] and r.shape[2:] == b.shape[2:] and r.shape[1] % b.shape[1] == 0


def erase_dead_repetition(repeated: fx.Node, base: fx.Node) -> None:
    """Erase the chain ``base -> ... -> repeated`` (found by :func:`unwrap_repeat_kv`) from its
    end while its nodes have no users left. Only this chain is touched: a graph-wide DCE would
    also drop unused in-place ``call_method`` nodes such as KV-cache writes."""
    node = repeated
    while node is not base and not node.users:
        parent = node.args[0]
        node.graph.erase_node(node)
        node = parent
