"""One coded layer's static buffers and counters: allocation, writes, reset, beam reorder, row
views, the undo of the last step, and their bytes.

Buffers (``B`` batch, ``H`` KV heads, ``D`` head_dim, ``R`` residual), allocated once:

- ``k_codes [B, H, max_cache_len, Wk]``, ``v_codes [B, H, max_cache_len, Wv]`` uint8 stored
  codes, ``W = packed_width(D // d, entries)``: one byte per code for codebooks of <= 256
  entries, 12-bit codes packed two in three bytes above (:mod:`vecinfer_compile.quant.packing`),
  so physical bits equal nominal bits. Slot ``t < n_coded`` holds position ``t``.
- ``k_window`` (transformed keys ``K~``), ``v_window`` (raw values) ``[B, H, R, D]`` in the
  model dtype: slot ``s < n_window`` holds position ``n_coded + s``.
- ``n_coded``, ``n_window``: 0-d int64 tensors (never Python ints: no recompiles).
- ``append_arrivals``: int32 ``[1]``, zero between updates: the CUDA append's arrival counter.
- while the layer records its past (transformers' deferred stop check,
  :func:`vecinfer_compile.defer_stop_check`): ``undo_counts`` (int64 ``[2]``: ``n_coded``,
  ``n_window``) and ``undo_kv [2, B, H, D]`` (window slot 0 of K~ and V), the state before the
  last update, so that :meth:`LayerStorage.undo_last_token` can restore it.
- ``empty``: a Python flag, True until the first update (the prefill); Dynamo guards on it.

Every buffer has a static address (``torch._dynamo.mark_static_address``): updates write in place.
"""

from __future__ import annotations

import copy

import torch

from ..window import split_prefill
from .quantizer import LayerQuantizer


class LayerStorage:
    """The buffers of one coded layer (the module docstring gives the shapes); ``batch_size`` is
    None until :meth:`allocate`."""

    def __init__(
        self,
        *,
        num_kv_heads: int,
        head_dim: int,
        max_cache_len: int,
        residual: int,
        dtype: torch.dtype,
        device: torch.device,
        code_widths: tuple[int, int],
        layer_idx: int = 0,
    ):
        if residual < 0:
            raise ValueError(f"residual must be >= 0, got {residual}")
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        self.num_heads, self.head_dim = num_kv_heads, head_dim
        self.max_cache_len, self.residual = max_cache_len, residual
        self.dtype, self.device, self.code_widths, self.layer_idx = dtype, device, code_widths, layer_idx
        self.batch_size: int | None = None
        self.empty = True
        self.k_codes = self.v_codes = self.k_window = self.v_window = self.n_coded = self.n_window = None
        self.append_arrivals = self.undo_counts = self.undo_kv = None

    def allocate(self, batch_size: int) -> None:
        """The static buffers for ``batch_size`` rows (eagerly, never while compiling)."""
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "VecInferCache allocates its buffers at its first update, which ran inside compiled "
                "code: pass batch_size= when building the cache, or run the prefill eagerly (as generate() does)"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        b, h, d, dev = batch_size, self.num_heads, self.head_dim, self.device
        wk, wv = self.code_widths
        self.batch_size = batch_size
        self.k_codes = torch.zeros(b, h, self.max_cache_len, wk, dtype=torch.uint8, device=dev)
        self.v_codes = torch.zeros(b, h, self.max_cache_len, wv, dtype=torch.uint8, device=dev)
        self.k_window = torch.zeros(b, h, self.residual, d, dtype=self.dtype, device=dev)
        self.v_window = torch.zeros(b, h, self.residual, d, dtype=self.dtype, device=dev)
        self.n_coded = torch.zeros((), dtype=torch.int64, device=dev)
        self.n_window = torch.zeros((), dtype=torch.int64, device=dev)
        self.append_arrivals = torch.zeros(1, dtype=torch.int32, device=dev)  # CUDA append scratch, zero between calls
        for t in [*self.tensors(), self.append_arrivals]:
            torch._dynamo.mark_static_address(t)

    def tensors(self) -> list[torch.Tensor]:
        """The buffers whose bytes the layer counts (all but the append's scratch counter)."""
        ts = [
            self.k_codes,
            self.v_codes,
            self.k_window,
            self.v_window,
            self.n_coded,
            self.n_window,
            self.undo_counts,
            self.undo_kv,
        ]
        return [t for t in ts if t is not None]

    # -- checks --------------------------------------------------------------------------------
    def check_states(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise a clear error unless ``k``, ``v`` are ``[batch_size, H, T, D]`` in the cache dtype, on its device."""
        if k.dim() == v.dim() == 4 and k.shape[-1] != v.shape[-1]:
            raise NotImplementedError(
                f"VecInferCache layer {self.layer_idx} gets keys of head dim {k.shape[-1]} and values of "
                f"{v.shape[-1]}; VecInfer attention needs one head_dim (multi-head latent attention is not "
                "supported)"
            )
        for t, name in ((k, "key_states"), (v, "value_states")):
            if t.dim() != 4:
                raise ValueError(f"{name} must be [B, H_kv, T, D], got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(
                    f"VecInferCache layer {self.layer_idx} holds {self.dtype} but the model gives {name} in "
                    f"{t.dtype}: build the cache with dtype={t.dtype} (or load the model in {self.dtype})"
                )
            if t.shape[-1] != self.head_dim:
                raise ValueError(
                    f"{name} have head_dim {t.shape[-1]} but the cache was built for {self.head_dim}: "
                    "build the cache from this model's config"
                )
            if t.shape[1] != self.num_heads:
                raise ValueError(
                    f"{name} have {t.shape[1]} KV heads but the cache was built for {self.num_heads}: "
                    "build the cache from this model (under tensor parallelism pass the model itself, "
                    "VecInferCache(model, ...), not its config: each rank holds only its own KV heads)"
                )
            if t.shape[0] != self.batch_size:
                raise ValueError(
                    f"{name} have batch size {t.shape[0]} but the cache was built for batch_size="
                    f"{self.batch_size}: build a VecInferCache with batch_size={t.shape[0]} (or none: it "
                    "then takes the first update's)"
                )
            if t.device != self.device:
                raise ValueError(f"{name} are on {t.device} but the cache is on {self.device}: pass device=")

    def overflow(self, total) -> ValueError:
        return ValueError(
            f"VecInferCache layer {self.layer_idx}: {total} tokens do not fit max_cache_len="
            f"{self.max_cache_len}: increase max_cache_len (prompt length + max_new_tokens)"
        )

    # -- writes --------------------------------------------------------------------------------
    def fill(self, kt: torch.Tensor, v: torch.Tensor, quantizer: LayerQuantizer) -> None:
        """The first update of an empty layer: ``kt`` (``K~``), ``v``: ``[B, H, T, D]`` in the cache
        dtype, ``T <= max_cache_len``, coded by the layer's codec (:meth:`fill_by_window`)."""
        quantizer.codec.fill(self, kt, v, quantizer)

    def fill_by_window(self, kt: torch.Tensor, v: torch.Tensor, encode_keys, encode_values) -> None:
        """:meth:`fill` with a codec's encoders (``[B, H, n, D] -> [B, H, n, W]`` uint8): all but the
        last ``R`` tokens become codes, those ``R`` the window (:mod:`vecinfer_compile.window`'s rule
        at the prefill)."""
        t = kt.shape[2]
        n_code, n_win = split_prefill(t, self.residual)
        if n_code > 0:
            self.k_codes[:, :, :n_code].copy_(encode_keys(kt[:, :, :n_code]))
            self.v_codes[:, :, :n_code].copy_(encode_values(v[:, :, :n_code]))
        if n_win > 0:
            self.k_window[:, :, :n_win].copy_(kt[:, :, n_code:])
            self.v_window[:, :, :n_win].copy_(v[:, :, n_code:])
        self.n_coded.fill_(n_code)
        self.n_window.fill_(n_win)
        self.empty = False

    def append(self, k: torch.Tensor, v: torch.Tensor, quantizer: LayerQuantizer) -> None:
        """Append ``k``, ``v``: ``[B, H, T, D]`` by the layer's codec's one registered op (no
        data-dependent Python, so it compiles with fullgraph=True; one CUDA launch per decode step
        where the kernel runs), by the window rule."""
        quantizer.codec.append(self, k, v, quantizer)

    def reset(self) -> None:
        if self.batch_size is not None:
            for t in (
                self.k_codes,
                self.v_codes,
                self.k_window,
                self.v_window,
                self.n_coded,
                self.n_window,
                self.append_arrivals,
            ):
                t.zero_()
        self.empty = True

    def reorder(self, beam_idx: torch.LongTensor) -> None:
        """Rows in the order of ``beam_idx`` (beam search)."""
        idx = beam_idx.to(self.device)
        for t in (self.k_codes, self.v_codes, self.k_window, self.v_window):
            t.copy_(t.index_select(0, idx))

    # -- the undo of the last step ---------------------------------------------------------------
    def allocate_undo(self) -> None:
        if self.undo_kv is None or self.undo_kv.shape[1] != self.batch_size:
            self.undo_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
            self.undo_kv = torch.zeros(
                2, self.batch_size, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device
            )
            for t in (self.undo_counts, self.undo_kv):
                torch._dynamo.mark_static_address(t)

    def record_undo(self) -> None:
        """Before an update: the counters and window slot 0 (the token a full window moves into the codes)."""
        torch.ops.vecinfer.record_undo(
            self.undo_counts, self.undo_kv, self.n_coded, self.n_window, self.k_window, self.v_window
        )

    def undo_last_token(self) -> None:
        """Undo the last update, recorded by :meth:`record_undo`, when it appended one token: the
        counters go back and, when that token pushed the window's oldest one into the codes, the
        window shifts back and gets it again in full precision (the code it left behind sits
        beyond ``n_coded``, unread, and is overwritten by the next step)."""
        was_coded, was_window = self.undo_counts.tolist()
        was = was_coded + was_window
        if int(self.n_coded) + int(self.n_window) != was + 1:
            raise NotImplementedError(
                f"VecInferCache layer {self.layer_idx}: the last update appended "
                f"{int(self.n_coded) + int(self.n_window) - was} tokens; only a one-token step can be undone"
            )
        if self.residual and int(self.n_coded) > was_coded:  # the window's oldest left it
            for window, oldest in ((self.k_window, self.undo_kv[0]), (self.v_window, self.undo_kv[1])):
                window[:, :, 1:].copy_(window[:, :, :-1].clone())
                window[:, :, 0].copy_(oldest)
        self.n_coded.fill_(was_coded)
        self.n_window.fill_(was_window)

    # -- row views (filling a batch a few rows at a time) ----------------------------------------
    def row_view(self, start: int, stop: int) -> LayerStorage:
        """Empty storage over rows ``[start, stop)`` of these buffers (views: what it stores lands
        here) with counters of its own."""
        part = copy.copy(self)
        part.batch_size = stop - start
        for name in ("k_codes", "v_codes", "k_window", "v_window"):
            setattr(part, name, getattr(self, name)[start:stop])
        part.n_coded, part.n_window = torch.zeros_like(self.n_coded), torch.zeros_like(self.n_window)
        part.append_arrivals = torch.zeros_like(self.append_arrivals)
        part.empty = True
        return part

    def take_length(self, part: LayerStorage, rows: str) -> None:
        """Adopt the counters of ``part`` (a filled :meth:`row_view`): the first group filled sets
        them, every later one must end at the same length."""
        got = (int(part.n_coded), int(part.n_window))
        if self.empty:
            self.n_coded.copy_(part.n_coded)
            self.n_window.copy_(part.n_window)
            self.empty = part.empty
        elif got != (int(self.n_coded), int(self.n_window)):
            raise ValueError(
                f"VecInferCache layer {self.layer_idx}: rows {rows} hold {sum(got)} tokens but the rows filled "
                f"before hold {int(self.n_coded) + int(self.n_window)}: fill every row group to the same length "
                "(one length per cache; left-pad shorter prompts)"
            )


def count_bytes(tensors) -> int:
    """Bytes of ``tensors``, each storage range counted once (a tensor shared by layers, the rotation)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def indexed_device(device) -> torch.device:
    """``device`` with its index: ``"cuda"`` is the current CUDA device (``cuda:0``), so that states
    on it pass the device check."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
