"""``vecinfer::record_undo``: keep what undoing a decode step's append needs, before the append.

Schema::

    vecinfer::record_undo(Tensor(a!) undo_counts, Tensor(b!) undo_kv, Tensor n_coded,
        Tensor n_window, Tensor k_window, Tensor v_window) -> ()

Copies window slot 0 (the token a full window moves into the codes) and the
two counters into the undo buffers of a :class:`~vecinfer_compile.cache.VecInferLayer` that
records its past (transformers' deferred stop check). An opaque op, not ``copy_`` in the layer:
compiled, Inductor computes a plain copy of a window slice lazily, and when the append that
follows is the opaque, re-inplaced CUDA kernel the copy then read the window *after* the append
(torch 2.11 on the H200, and 2.13 on the CPU with any opaque mutating op; a clone does not help).
Extern kernels run in graph order, so this one reads the window before the append writes it.
"""

from __future__ import annotations

import torch

NAMESPACE = "vecinfer"
MUTATES = ("undo_counts", "undo_kv")


def record_undo(undo_counts: torch.Tensor, undo_kv: torch.Tensor, n_coded: torch.Tensor,
                n_window: torch.Tensor, k_window: torch.Tensor, v_window: torch.Tensor) -> None:
    """``undo_counts`` (int64 ``[2]``) <- ``(n_coded, n_window)`` (0-d int64); ``undo_kv [2, B, H,
    D]`` <- slot 0 of ``k_window``/``v_window [B, H, R, D]`` (nothing when ``R == 0``). Two
    kernels (``stack`` into the buffers), not four copies: inside a decode step's CUDA graph every
    launch of every layer counts."""
    torch.stack((n_coded, n_window), out=undo_counts)
    if k_window.shape[2]:
        torch.stack((k_window[:, :, 0], v_window[:, :, 0]), out=undo_kv)


def register() -> None:
    """Register the op (a no-op when this process already has it)."""
    if not hasattr(getattr(torch.ops, NAMESPACE), "record_undo"):
        op = torch.library.custom_op(f"{NAMESPACE}::record_undo", record_undo, mutates_args=MUTATES)
        op.register_fake(lambda *args: None)


register()
