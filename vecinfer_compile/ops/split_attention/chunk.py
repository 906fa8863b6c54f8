"""Attention of a chunk of new tokens entering a non-empty compressed cache layer.

**The rule** is the chunk case of :mod:`vecinfer_compile.window`. A chunk of ``C >= 2`` tokens
appended to a layer that holds ``n_coded`` coded slots and ``w`` window slots attends over::

    [ the n_coded coded slots, dequantized ; the w window slots ; the chunk's own C keys ]

the last ``w + C`` in full precision (the cache dtype), causal within the chunk and with left
padding (slots before ``kv_start[b]``) masked; only then is the chunk appended.

Everything here is in the cache's *code domain*: queries ``q~`` (the query-side transform of
:mod:`..decode_inputs`), keys ``K~`` as the window and the codebooks hold them. For the centring
methods every score of a query is then shifted by the same ``-q . mu`` in both parts, which the
softmax (and the merge by log-sum-exp) ignores.

**How it runs.** The keys split into two disjoint sets, each an attention that returns its
log-sum-exp, merged by :func:`.lse_merge.merge_by_lse`:

- the coded prefix: every query sees all of it (only left padding masks it), so it is a
  non-causal attention. On CUDA (fp16/bf16, FlashAttention-2 available, power-of-two head dims)
  a few batch rows at a time (:data:`WORKSPACE_BYTES`) are decoded into a position-major
  workspace by the codec (:mod:`.prefix`: the codebooks' ``K~`` and ``V`` by
  :func:`..dequantize.dequantize_into`, the CUDA kernel of :mod:`..cuda.dequant` or the Triton one
  of :mod:`..triton.dequant` where it cannot run; another codec's own workspace, with its
  queries and outputs taken to and from it) and read by cuDNN attention
  (``aten._scaled_dot_product_cudnn_attention``, GQA in the kernel) when no row is padded, else
  by torch's FlashAttention-2 in varlen mode (``aten._flash_attention_forward``: each row's keys
  start at its ``kv_start`` through the ``cum_seq_k`` offset and ``seqused_k``; no mask tensor).
- the full-precision window and chunk, ``[B, w + C, H, D]`` built before the append:
  FlashAttention-2 varlen, causal, bottom-right aligned per row (query ``i`` sees relative keys
  ``<= w + i``).

Why a workspace and library kernels rather than a kernel that gathers codes inside the attention
loop (docs/studies/chunk-attention.md has the measurements): the prefix attention of a chunk is
compute-bound (``4 * G * C * T * D`` FLOPs per KV head against ``T`` positions of codes), and the
Triton kernel that gathers K/V tiles from the codebook inside its loop (``vecinfer::attention``)
ran at a quarter of cuDNN's rate (``bench_simulate_attention.py``): the gathers, not the matrix
units, bound it. cuDNN ran this non-causal shape well above FlashAttention-2's rate. The workspace
costs one write of the prefix in the cache
dtype per chunk and layer (``benchmarks/bench_prefill_attention.py`` times ours against FP16
flash, and the alternatives with ``--prefix-kernel`` / ``--dequantize``).

Elsewhere (CPU, float32, other head dims, or a mask that is not causal + left padding)
:func:`reference_by_rows` computes the same rule densely, a few rows at a time;
:func:`..reference.chunk_attention` is the oracle the tests compare both with.

**The op.** ``vecinfer::chunk_attention`` is the same attention as one graph node, what a compiled
chunked prefill runs (:mod:`vecinfer_compile.passes.cache_attention` emits it)::

    vecinfer::chunk_attention(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_centroids,
        Tensor v_centroids, Tensor n_coded, Tensor k_window, Tensor v_window, Tensor n_window,
        Tensor? attn_mask, float scale) -> Tensor

(another codec's chunk op takes its own operands in place of the centroids), the decode
op's arguments with ``q: [B, Hq, C, D]`` and a window ``[B, H, W, D]`` whose ``n_window`` filled
slots end with the chunk's own ``C`` keys (``K~``) and values. It reads the two counters on the
host (one sync), so it is opaque and tagged ``cudagraph_unsafe``: Inductor runs a chunk's graph
without CUDA graphs (a chunk of thousands of tokens gains nothing from them), while the decode
step's graph keeps them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...log_once import log_once
from ..coded_kv import CodedKV, flat_op
from ..decode_inputs import chunk_mask_layout, kv_start_from_mask
from ..reference import chunk_kv_dense, chunk_mask
from ..registry import define
from .flash import cudnn_serves, flash_serves
from .lse_merge import flash_lse, merge_by_lse
from .prefix import CodebookPrefix

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 1 << 30  # dequantized prefix K + V of one row group (fast path) / SDPA inputs (dense path)


@dataclass
class ChunkKeys:
    """What a chunk attends besides its queries, taken from the layer before the append.

    - ``k_codes``, ``v_codes``: the layer's code buffers ``[B, H, Tmax, W]`` uint8; slots below
      ``n_coded`` are the prefix (the append writes only slots at or after it, so they stay valid).
    - ``prefix``: their codec (:mod:`.prefix`).
    - ``n_coded``: coded slots before the append (an int, read on the host).
    - ``k_full``, ``v_full``: ``[B, w + C, H, D]`` position-major, the cache dtype: the window's
      ``w`` slots then the chunk's ``C`` tokens, keys transformed (``K~``), values as they are.
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    prefix: object  # a codec's prefix (:mod:`.prefix`'s protocol)
    n_coded: int
    k_full: torch.Tensor
    v_full: torch.Tensor

    @property
    def length(self) -> int:
        """Slots a query of the chunk can see: ``n_coded + w + C``."""
        return self.n_coded + self.k_full.shape[1]


def reference_by_rows(
    q: torch.Tensor, keys: ChunkKeys, kv_start: torch.Tensor | None, scale: float, attn_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The rule by torch SDPA over the ``L`` slots, a few batch rows at a time (K/V of a row group
    near :data:`WORKSPACE_BYTES`, whatever the batch): the path off the fast kernels, and the one
    for a mask that is more than causal + left padding (``attn_mask`` then replaces
    :func:`..reference.chunk_mask`). Arguments and result as :func:`..reference.chunk_attention`
    (a query that sees no key gets zeros)."""
    b, hq, c, d = q.shape
    h, length = keys.k_full.shape[2], keys.length
    per_row = 2 * h * length * d * q.element_size()
    rows = max(1, WORKSPACE_BYTES // max(per_row, 1))
    out = q.new_empty((b, hq, c, d))
    for i in range(0, b, rows):
        j = min(i + rows, b)
        k, v = chunk_kv_dense(keys, slice(i, j), q.dtype)
        if attn_mask is None:
            mask = chunk_mask(j - i, c, length, None if kv_start is None else kv_start[i:j], q.device)
        else:
            mask = attn_mask if attn_mask.shape[0] == 1 else attn_mask[i:j]
        rows_out = F.scaled_dot_product_attention(q[i:j], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        sees = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        out[i:j] = torch.where(sees.any(-1, keepdim=True), rows_out, 0)  # CUDA's SDPA leaves such rows unspecified
        del k, v
    return out


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    used_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
):
    """torch's FlashAttention-2 in varlen mode: sequence ``s`` has queries ``q[cu_q[s]:cu_q[s + 1]]``
    and keys ``k[cu_k[s]:cu_k[s] + used_k[s]]``; with ``causal`` its query ``i`` of ``n_q`` sees its
    keys ``<= used_k[s] - n_q + i`` (bottom-right). ``q: [Nq, Hq, D]``, ``k``, ``v``: ``[Nk, H, D]``
    (GQA in the kernel), ``cu_q``/``cu_k``: int32 ``[S + 1]``, ``used_k``: int32 ``[S]``. Returns
    (out ``[Nq, Hq, D]`` q.dtype, lse ``[Hq, Nq]`` float32, ``+inf`` for a query that saw no key)."""
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=used_k
    )[:2]
    return out, lse


def cudnn_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Non-causal cuDNN attention of ``q: [R, Hq, C, D]`` over ``k``, ``v``: ``[R, H, T, D]`` (views;
    GQA in the kernel). Returns (out ``[R, Hq, C, D]`` q.dtype, lse ``[R, Hq, C]`` float32)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)[
        :2
    ]
    return out, lse.reshape(q.shape[:3])


def cudnn_prefix_serves(q: torch.Tensor) -> bool:
    """cuDNN runs the prefix (rows without padding): sm90+, cuDNN on, fp16/bf16, head dim <= 128.
    It runs this non-causal shape faster than FlashAttention-2, GQA read in the kernel
    (docs/studies/chunk-attention.md)."""
    d = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 128 and cudnn_serves(q.device)


def fast_path_serves(q: torch.Tensor) -> bool:
    """Whether :func:`attend` runs :func:`split_flash` for queries like ``q``: CUDA, fp16/bf16, a
    power-of-two head dim of 16 to 256 (the dequantize kernels' and FlashAttention-2's),
    FlashAttention-2 available and switched on (it runs the window + chunk, and the prefix of
    padded rows)."""
    d = q.shape[-1]
    return (
        q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and 16 <= d <= 256
        and d & (d - 1) == 0
        and flash_serves(q.device)
    )


def _offsets(count: int, stride: int, start: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """varlen ``(cu_k, used_k)`` for ``count`` sequences stored ``stride`` rows apart, whose keys
    start ``start`` rows in (clamped to ``[0, length]``) and end at ``length``."""
    start = start.clamp(0, length).to(torch.int32)
    base = torch.arange(count + 1, device=start.device, dtype=torch.int32) * stride
    cu = torch.cat([base[:-1] + start, base[-1:]])
    return cu, (length - start).to(torch.int32)


def split_flash(
    q: torch.Tensor, keys: ChunkKeys, kv_start: torch.Tensor | None, scale: float, prefix_kernel: str | None = None
) -> torch.Tensor:
    """The fast path (see the module docstring). ``q: [B, Hq, C, D]`` (``q~``), ``kv_start``
    ``[B]`` int or None (no padding). Returns ``[B, Hq, C, D]`` in q.dtype (a transposed view of
    a ``[B, C, Hq, D]`` tensor, the layout attention functions return). ``prefix_kernel``:
    ``"cudnn"`` or ``"flash"`` for the prefix (default: cuDNN without padding where
    :func:`cudnn_prefix_serves`, else FlashAttention-2 varlen, which takes each row's start)."""
    if prefix_kernel is None:
        prefix_kernel = "cudnn" if kv_start is None and cudnn_prefix_serves(q) else "flash"
    b, hq, c, d = q.shape
    h, wc = keys.k_full.shape[2], keys.k_full.shape[1]
    n = keys.n_coded
    dev = q.device
    start = torch.zeros(b, dtype=torch.int32, device=dev) if kv_start is None else kv_start.to(dev)
    qv = q.transpose(1, 2).reshape(b * c, hq, d)
    cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32) * c
    # the window and the chunk: row b's keys start where its padding ends (relative to the prefix)
    cu_k, used = _offsets(b, wc, start - n, wc)
    o2, l2 = flash_varlen(
        qv, keys.k_full.reshape(b * wc, h, d), keys.v_full.reshape(b * wc, h, d), cu_q, cu_k, used, c, wc, True, scale
    )
    l2 = flash_lse(l2)
    if n == 0:  # nothing coded yet: the full-precision part is all (a query with no key is zeros)
        return o2.view(b, c, hq, d).transpose(1, 2)
    qp, lse_offset = keys.prefix.queries(qv, scale)
    o1 = torch.empty_like(qp)
    l1 = torch.empty((hq, b * c), dtype=torch.float32, device=dev)
    rows = max(1, WORKSPACE_BYTES // (2 * n * h * d * q.element_size()))
    rows = min(rows, b)
    k_work = torch.empty((rows, n, h, d), dtype=q.dtype, device=dev)
    v_work = torch.empty_like(k_work)
    for i in range(0, b, rows):
        j = min(i + rows, b)
        r = j - i
        keys.prefix.fill(keys.k_codes[i:j], keys.v_codes[i:j], n, k_work[:r], v_work[:r])
        if prefix_kernel == "cudnn":
            o, lse = cudnn_prefix(
                qp[i * c : j * c].view(r, c, hq, d).transpose(1, 2),
                k_work[:r].transpose(1, 2),
                v_work[:r].transpose(1, 2),
                scale,
            )
            o1[i * c : j * c] = o.transpose(1, 2).reshape(r * c, hq, d)
            l1[:, i * c : j * c] = lse.permute(1, 0, 2).reshape(hq, r * c)
        else:
            cu_k, used = _offsets(r, n, start[i:j], n)
            o1[i * c : j * c], l1[:, i * c : j * c] = flash_varlen(
                qp[i * c : j * c],
                k_work[:r].view(r * n, h, d),
                v_work[:r].view(r * n, h, d),
                cu_q[: r + 1],
                cu_k,
                used,
                c,
                n,
                False,
                scale,
            )
    del k_work, v_work
    l1 = flash_lse(l1).t()
    if lse_offset is not None:
        l1 = l1 + lse_offset
    out = merge_by_lse(keys.prefix.outputs(o1), l1, o2, l2.t(), q.dtype)
    return out.view(b, c, hq, d).transpose(1, 2)


def attend(
    q: torch.Tensor, keys: ChunkKeys, kv_start: torch.Tensor | None, scale: float, attn_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The chunk's attention: :func:`split_flash` where :func:`fast_path_serves` and there is no
    ``attn_mask`` (the caller passes one only when it is more than causal + left padding), else
    :func:`reference_by_rows`. ``q: [B, Hq, C, D]`` (``q~``), ``kv_start: [B]`` int or None;
    returns ``[B, Hq, C, D]`` in q.dtype."""
    if attn_mask is None and fast_path_serves(q):
        return split_flash(q, keys, kv_start, scale)
    return reference_by_rows(q, keys, kv_start, scale, attn_mask)


def attend_masked(
    q: torch.Tensor, keys: ChunkKeys, attn_mask: torch.Tensor | None, scale: float, slots: int
) -> torch.Tensor:
    """:func:`attend` with HF's mask: ``attn_mask`` ``[B|1, 1|Hq, C, S]`` over the layer's ``S =
    slots`` (or the ``L = keys.length`` valid ones; bool True = attend, or additive float), or
    None for bottom-right causal over the ``L`` valid slots. Left padding is read from the mask;
    a mask that is more than causal + left padding over the valid slots (checked once per mask,
    one host sync) is applied as it is by the dense path. ``q: [B, Hq, C, D]`` (``q~``)."""
    c, length = q.shape[2], keys.length
    kv_start = explicit = None
    if attn_mask is not None:
        if attn_mask.dim() != 4 or attn_mask.shape[-1] not in (length, slots) or attn_mask.shape[-2] != c:
            raise ValueError(
                f"attn_mask must be [B, H, {c}, {slots}] (the chunk over the cache's "
                f"slots), got {tuple(attn_mask.shape)}"
            )
        kv_start = kv_start_from_mask(attn_mask, q)
        standard, padded = chunk_mask_layout(attn_mask, kv_start, length)
        attn_mask = attn_mask[..., :length]
        if not padded:
            kv_start = None  # the fast path's prefix then runs cuDNN (no per-row key start)
        if not standard:
            explicit = attn_mask
            log_once(
                log,
                logging.INFO,
                "mask",
                "vecinfer: a chunk's mask is more than causal + left padding: that chunk attends by the "
                "dense path (SDPA over its slots dequantized, a few rows at a time)",
            )
    return attend(q, keys, kv_start, scale, explicit)


def chunk_attention(q: torch.Tensor, kv: CodedKV, attn_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``vecinfer::chunk_attention`` (the module docstring): ``q: [B, Hq, C, D]`` (``q~``) over the
    ``n_coded`` coded slots and the ``n_window`` filled window slots ``[B, H, W, D]`` of ``kv``,
    the chunk's own keys last. Returns ``[B, Hq, C, D]`` in q.dtype, laid out as a
    ``[B, C, Hq, D]`` tensor."""
    return attend_over_buffers(
        q,
        kv.k_codes,
        kv.v_codes,
        CodebookPrefix(kv.k_centroids, kv.v_centroids),
        kv.n_coded,
        kv.k_window,
        kv.v_window,
        kv.n_window,
        attn_mask,
        scale,
    )


def attend_over_buffers(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    prefix,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The chunk ops' body for either codec: ``q: [B, Hq, C, D]`` (``q~``) over a layer's buffers
    (codes ``[B, H, Tmax, W]``, windows ``[B, H, R, D]`` whose ``n_window`` filled slots end with
    the chunk's keys, 0-d counters read on the host). Returns ``[B, Hq, C, D]`` in q.dtype, laid
    out as a ``[B, C, Hq, D]`` tensor."""
    n, w = torch.stack([n_coded.long(), n_window.long()]).tolist()  # the one host sync
    keys = ChunkKeys(
        k_codes, v_codes, prefix, n, k_window[:, :, :w].transpose(1, 2), v_window[:, :, :w].transpose(1, 2)
    )
    out = attend_masked(q, keys, attn_mask, scale, k_codes.shape[2])
    b, hq, c, d = q.shape
    if out.stride() == (c * hq * d, d, hq * d, 1):  # the fast path's layout
        return out
    return _output_like(q).copy_(out)


def _output_like(q: torch.Tensor, *unused) -> torch.Tensor:
    """An empty ``[B, Hq, C, D]`` output for ``q``, a transposed ``[B, C, Hq, D]`` buffer (also
    the op's fake, which ignores the other arguments)."""
    b, hq, c, d = q.shape
    return q.new_empty((b, c, hq, d)).transpose(1, 2)


_ARGS = ({"q": torch.Tensor}, {"attn_mask": torch.Tensor | None, "scale": float}, torch.Tensor)
define(
    "chunk_attention",
    flat_op(chunk_attention, *_ARGS),
    kind="opaque",
    fake=flat_op(_output_like, *_ARGS),
    tags=(torch.Tag.cudagraph_unsafe,),
)
