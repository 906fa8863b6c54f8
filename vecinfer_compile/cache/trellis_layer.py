"""The writes and reads of a coded layer whose keys or values the trellis codec codes
(:mod:`vecinfer_compile.quant.trellis_codec`), eager only.

The buffers are the storage's (:mod:`.storage`): a code slot holds a token and head's string of
``bits * D`` bits (:mod:`vecinfer_compile.quant.trellis_packing`; as many bytes as the codebooks'
codes of the same preset), the window its full-precision ``K~`` and ``V``. A side without a codec
(a file with ``--key-codec`` only) keeps the codebooks' codes. Encoding is the codec's
(``encode_packed``: one Viterbi launch on CUDA). A decode step with ``"vecinfer_sdpa"`` attends over
the codes in the components (:func:`attend`: :func:`vecinfer_compile.ops.trellis.decode_attention`,
the Triton kernel on CUDA) and over the window, merged by log-sum-exp; every other read decodes the
codes to ``K~`` / ``V`` with the kernels' operands (:class:`~vecinfer_compile.ops.trellis.TrellisOperands`)
and attends densely. No registered op covers them yet, so a compiled step is refused
(:func:`check_eager`).
"""

from __future__ import annotations

import torch

from ..ops import reference
from ..ops.append import weigh_codes
from ..ops.split_attention.lse_merge import merge_by_lse
from ..ops.trellis import decode_attention
from .quantizer import LayerQuantizer


def check_eager(layer_idx: int) -> None:
    """Raise while compiling: the trellis codec's cache paths are eager."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            f"VecInferCache layer {layer_idx} is coded by the trellis codec, which the cache runs eagerly only "
            "(no compiled ops yet): generate without a compile config (disable_compile=True), or calibrate "
            "without --key-codec / --value-codec")


def encode(kind: str, x: torch.Tensor, q: LayerQuantizer) -> torch.Tensor:
    """``x [B, H, T, D]`` (``K~`` for ``kind="key"``, ``V`` for ``"value"``) -> stored codes
    ``[B, H, T, W]`` uint8: the codec's string, or the codebooks' codes on a side without a codec."""
    codec = q.key_codec if kind == "key" else q.value_codec
    if codec is not None:
        b, h, t, _ = x.shape
        return codec.encode_packed(x.float()).view(b, t, h, -1).transpose(1, 2)
    centroids = q.key_centroids if kind == "key" else q.value_centroids
    weight = q.key_parallel_weight if kind == "key" else 1.0
    stored = torch.ops.vecinfer.encode(x, None, None, centroids, weight)
    return weigh_codes(x, stored, centroids, q.key_metric if kind == "key" else q.value_metric, weight)


def decode(kind: str, codes: torch.Tensor, q: LayerQuantizer) -> torch.Tensor:
    """Stored codes ``[B, H, T, W]`` -> ``[B, H, T, D]`` float32 (``K~`` or ``V``)."""
    operands = q.key_trellis if kind == "key" else q.value_trellis
    if operands is not None:
        return operands.vectors(codes)
    return reference.dequantize(codes, q.key_centroids if kind == "key" else q.value_centroids)


def fill(storage, kt: torch.Tensor, v: torch.Tensor, q: LayerQuantizer) -> None:
    """The prefill (:meth:`.LayerStorage.fill`'s contract): all but the last ``R`` tokens coded."""
    t = kt.shape[2]
    n_code = max(t - storage.residual, 0)
    if n_code > 0:
        storage.k_codes[:, :, :n_code].copy_(encode("key", kt[:, :, :n_code], q))
        storage.v_codes[:, :, :n_code].copy_(encode("value", v[:, :, :n_code], q))
    storage.k_window[:, :, :t - n_code].copy_(kt[:, :, n_code:])
    storage.v_window[:, :, :t - n_code].copy_(v[:, :, n_code:])
    storage.n_coded.fill_(n_code)
    storage.n_window.fill_(t - n_code)
    storage.empty = False


def append(storage, k: torch.Tensor, v: torch.Tensor, q: LayerQuantizer) -> None:
    """``vecinfer::cache_append``'s contract (:mod:`vecinfer_compile.ops.append`), eagerly: the
    window's tokens then the new ones keep their last ``min(w + T, R)`` in the window; those
    before are coded into slots ``n_coded ..``."""
    n_coded, w, r = int(storage.n_coded), int(storage.n_window), storage.residual
    kt = q.transform_keys(k, storage.dtype)
    seq_k = torch.cat([storage.k_window[:, :, :w], kt], 2)
    seq_v = torch.cat([storage.v_window[:, :, :w], v], 2)
    keep = min(seq_k.shape[2], r)
    out = seq_k.shape[2] - keep
    if out:
        storage.k_codes[:, :, n_coded:n_coded + out].copy_(encode("key", seq_k[:, :, :out], q))
        storage.v_codes[:, :, n_coded:n_coded + out].copy_(encode("value", seq_v[:, :, :out], q))
    storage.k_window[:, :, :keep].copy_(seq_k[:, :, out:])
    storage.v_window[:, :, :keep].copy_(seq_v[:, :, out:])
    storage.n_coded.fill_(n_coded + out)
    storage.n_window.fill_(keep)


def read(storage, q: LayerQuantizer, length: int | None = None, rows: slice = slice(None),
         window: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.reads.read`'s contract: K (original domain) and V ``[B, H, length, D]`` in the cache
    dtype, the coded slots decoded, the window's after them, zeros beyond (the mask hides them)."""
    length = storage.max_cache_len if length is None else length
    n_coded, k_window, v_window, n_window = window or (storage.n_coded, storage.k_window, storage.v_window,
                                                        storage.n_window)
    n_coded, n_window = int(n_coded), int(n_window)
    coded = min(n_coded, length)
    k_codes, v_codes = storage.k_codes[rows][:, :, :coded], storage.v_codes[rows][:, :, :coded]
    b, h = k_codes.shape[:2]
    kt = torch.zeros(b, h, length, storage.head_dim, dtype=torch.float32, device=storage.device)
    v = torch.zeros_like(kt)
    kt[:, :, :coded] = decode("key", k_codes, q)
    v[:, :, :coded] = decode("value", v_codes, q)
    win = max(0, min(n_window, length - n_coded))
    kt[:, :, coded:coded + win] = k_window[rows][:, :, :win].float()
    v[:, :, coded:coded + win] = v_window[rows][:, :, :win].float()
    k = q.inverse_keys(kt)
    valid = (torch.arange(length, device=storage.device) < coded + win)[:, None]
    return torch.where(valid, k, 0.0).to(storage.dtype), v.to(storage.dtype)


def attend(storage, q: LayerQuantizer, q_t: torch.Tensor, kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One query token ``q_t: [B, Hq, 1, D]`` (in ``K~``'s domain) over a layer whose keys and values
    the codec codes: the coded slots by :func:`~vecinfer_compile.ops.trellis.decode_attention`, the
    window's ``n_window`` slots exactly, merged by log-sum-exp; slots before ``kv_start [B]`` (left
    padding) hidden. Returns ``[B, Hq, 1, D]`` in ``q_t``'s dtype."""
    n_coded, n_window = int(storage.n_coded), int(storage.n_window)
    b, hq, _, d = q_t.shape
    hkv = storage.num_heads
    qf = q_t[:, :, 0].float()
    out_c, lse_c = decode_attention(qf, storage.k_codes, storage.v_codes, q.key_trellis, q.value_trellis, n_coded,
                                    kv_start, scale)
    kw, vw = storage.k_window[:, :, :n_window].float(), storage.v_window[:, :, :n_window].float()
    scores = torch.einsum("bhgd,bhtd->bhgt", qf.view(b, hkv, hq // hkv, d), kw) * scale
    if kv_start is not None:
        slot = n_coded + torch.arange(n_window, device=q_t.device)
        scores = scores.masked_fill(slot < kv_start.to(q_t.device)[:, None, None, None], float("-inf"))
    lse_w = torch.logsumexp(scores, -1)
    p = torch.where(torch.isfinite(lse_w)[..., None], torch.exp(scores - lse_w[..., None]), 0.0)
    out_w = torch.einsum("bhgt,bhtd->bhgd", p, vw).reshape(b, hq, d)
    return merge_by_lse(out_c, lse_c, out_w, lse_w.reshape(b, hq), q_t.dtype)[:, :, None]
