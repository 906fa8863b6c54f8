"""``vecinfer::record_undo``: keep what undoing a decode step's append needs, before the append.

Schema::

    vecinfer::record_undo(Tensor(a!) undo_k, Tensor(b!) undo_v, Tensor(c!) undo_n_coded,
        Tensor(d!) undo_n_window, Tensor k_window, Tensor v_window, Tensor n_coded,
        Tensor n_window) -> ()

Copies window slot 0 (``[B, H, 1, D]``, the token a full window moves into the codes) and the
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
MUTATES = ("undo_k", "undo_v", "undo_n_coded", "undo_n_window")


def record_undo(undo_k: torch.Tensor, undo_v: torch.Tensor, undo_n_coded: torch.Tensor,
                undo_n_window: torch.Tensor, k_window: torch.Tensor, v_window: torch.Tensor,
                n_coded: torch.Tensor, n_window: torch.Tensor) -> None:
    """``undo_k``/``undo_v [B, H, 1, D] <- k_window/v_window [B, H, R, D]`` slot 0 (nothing to copy
    when ``R == 0``); ``undo_n_coded``/``undo_n_window`` (0-d int64) <- the counters."""
    undo_n_coded.copy_(n_coded)
    undo_n_window.copy_(n_window)
    if k_window.shape[2]:
        undo_k.copy_(k_window[:, :, :1])
        undo_v.copy_(v_window[:, :, :1])


def register() -> None:
    """Register the op (a no-op when this process already has it)."""
    if not hasattr(getattr(torch.ops, NAMESPACE), "record_undo"):
        op = torch.library.custom_op(f"{NAMESPACE}::record_undo", record_undo, mutates_args=MUTATES)
        op.register_fake(lambda *args: None)


register()
