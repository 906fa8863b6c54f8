"""The writes and the decode step of a coded layer whose keys and values the trellis codec codes
(:mod:`vecinfer_compile.quant.trellis_codec`), eager and compiled alike.

The buffers are the storage's (:mod:`.storage`): a code slot holds a token and head's string of
``bits * D`` bits (:mod:`vecinfer_compile.quant.trellis_packing`; as many bytes as the codebooks'
codes of the same preset), the window its full-precision ``K~`` and ``V``. Everything goes through
the registered ops of :mod:`vecinfer_compile.ops.trellis_ops` and reads the counters on the device
only, so one form runs eagerly and inside a compiled step (CUDA graphs included): the prefill
encodes with ``trellis_encode`` (one Viterbi launch on CUDA), an append is
``trellis_append`` (one launch for a decode step's token on CUDA), the reads are
``trellis_cache_kv`` (:func:`.reads.read`), and a decode step attends over codes and window with
``trellis_decode_attention`` (eagerly under ``"vecinfer_sdpa"``, :func:`attend`; compiled, the
backend's pass puts it in place of SDPA over the read), a chunk with the codebooks' chunk
attention over the codec's prefix (:class:`~vecinfer_compile.ops.split_attention.prefix.TrellisPrefix`;
compiled, ``trellis_chunk_attention``).
"""

from __future__ import annotations

import torch

from .quantizer import LayerQuantizer


def _encoder(operands, width: int):
    return lambda x: torch.ops.vecinfer.trellis_encode(x, list(operands), width)


def fill(storage, kt: torch.Tensor, v: torch.Tensor, q: LayerQuantizer) -> None:
    """The prefill (:meth:`.LayerStorage.fill`'s contract): all but the last ``R`` tokens coded."""
    t = kt.shape[2]
    n_code = max(t - storage.residual, 0)
    if n_code > 0:
        storage.k_codes[:, :, :n_code].copy_(_encoder(q.key_trellis, storage.k_codes.shape[-1])(kt[:, :, :n_code]))
        storage.v_codes[:, :, :n_code].copy_(_encoder(q.value_trellis, storage.v_codes.shape[-1])(v[:, :, :n_code]))
    storage.k_window[:, :, :t - n_code].copy_(kt[:, :, n_code:])
    storage.v_window[:, :, :t - n_code].copy_(v[:, :, n_code:])
    storage.n_coded.fill_(n_code)
    storage.n_window.fill_(t - n_code)
    storage.empty = False


def append(storage, k: torch.Tensor, v: torch.Tensor, q: LayerQuantizer) -> None:
    """``vecinfer::cache_append``'s contract with the codec's codes (``vecinfer::trellis_append``):
    the window's tokens then the new ones keep their last ``min(w + T, R)`` in the window; those
    before are coded into slots ``n_coded ..``."""
    s = storage
    torch.ops.vecinfer.trellis_append(q.transform_keys(k, s.dtype), v, s.k_codes, s.v_codes, s.k_window, s.v_window,
                                      s.n_coded, s.n_window, s.append_arrivals, list(q.key_trellis),
                                      list(q.value_trellis))


def cache_kv(k_codes: torch.Tensor, v_codes: torch.Tensor, n_coded: torch.Tensor, k_window: torch.Tensor,
             v_window: torch.Tensor, n_window: torch.Tensor, q: LayerQuantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """``vecinfer::trellis_cache_kv`` of these buffers with ``q``'s codecs and transform."""
    return torch.ops.vecinfer.trellis_cache_kv(k_codes, v_codes, n_coded, k_window, v_window, n_window, q.lam,
                                               q.rotation, list(q.key_trellis), list(q.value_trellis))


def attend(storage, q: LayerQuantizer, q_t: torch.Tensor, kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One query token ``q_t: [B, Hq, 1, D]`` (in ``K~``'s domain) over the layer's codes and window
    (``vecinfer::trellis_decode_attention``); slots before ``kv_start [B]`` (left padding) hidden.
    Returns ``[B, Hq, 1, D]`` in ``q_t``'s dtype."""
    s = storage
    return torch.ops.vecinfer.trellis_decode_attention(q_t, s.k_codes, s.v_codes, s.n_coded, s.k_window, s.v_window,
                                                       s.n_window, kv_start, scale, list(q.key_trellis),
                                                       list(q.value_trellis))
