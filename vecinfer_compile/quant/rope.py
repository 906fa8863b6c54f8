"""Rotary position embedding as a rotation per position, for keys quantized before RoPE.

Attention receives keys after RoPE. The ``prerope`` methods (:mod:`vecinfer_compile.methods`)
undo the rotation of each key, quantize it, and rotate the dequantized key again, so the only
change to the scores is the quantization error. That holds for *any* rotation per position
(it is undone exactly); the quantizer gains only when the rotation is the model's, which makes
the keys of every position share one distribution.

Convention: Hugging Face's ``rotate_half`` layout. With ``inv_freq: [r/2]`` the model's rotary
frequencies, channels ``i`` and ``i + r/2`` (``i < r/2``) form a pair rotated by the angle
``position * inv_freq[i]``; channels from ``r`` on (partial rotary) are not rotated. A model's
``attention_scaling`` (YaRN, LongRoPE) multiplies every key by one constant, which the
quantizer's statistics absorb, so it is left out.

Positions: where the model says (its ``position_ids``), else a key's index in its sequence.
"""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[..., T, r/2]`` float32 angles ``positions[..., t] * inv_freq[i]`` (``positions: [..., T]``
    int, the product taken in float32 as transformers' rotary embeddings take it)."""
    return positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float32)


def rotate(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """RoPE (or its inverse) of ``x: [B, H, T, D]`` (or ``[H, T, D]``) at ``positions``: ``[T]``,
    or ``[B, T]`` one row per batch row, with frequencies ``inv_freq: [r/2]`` (``r <= D``);
    computed in float32 (float64 kept), returned in that dtype."""
    half = inv_freq.shape[0]
    if x.shape[-2] != positions.shape[-1] or positions.dim() > 2 or (positions.dim() == 2 and x.dim() != 4):
        raise ValueError(f"positions {tuple(positions.shape)} do not fit keys {tuple(x.shape)}: give [T] or [B, T]")
    if 2 * half > x.shape[-1]:
        raise ValueError(f"{half} rotary frequencies need head_dim >= {2 * half}, got {x.shape[-1]}")
    work = x.double() if x.dtype == torch.float64 else x.float()
    angles = rope_angles(positions, inv_freq).to(work)
    if angles.dim() == 3:  # [B, T, r/2] -> [B, 1, T, r/2]: every head of a row
        angles = angles[:, None]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    x1, x2, rest = work[..., :half], work[..., half : 2 * half], work[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def model_rope_frequencies(model: torch.nn.Module, head_dim: int) -> torch.Tensor:
    """The ``inv_freq: [r/2]`` float32 (CPU) of ``model``'s rotary embedding (the buffer
    transformers' rotary embedding modules hold). A ValueError naming why for a model without one
    (no RoPE: nothing to undo), with several different ones (e.g. local and global layers with
    other bases), or with more frequencies than ``head_dim`` has pairs."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        freq = getattr(module, "inv_freq", None)
        if isinstance(freq, torch.Tensor) and freq.dim() == 1:
            if not any(f.shape == freq.shape and torch.equal(f, freq.detach().float().cpu()) for f in found):
                found.append(freq.detach().float().cpu())
    name = type(model).__name__
    if not found:
        raise ValueError(
            f"{name} has no rotary embedding (no module with an inv_freq buffer): keys quantized "
            "before RoPE need a RoPE model; use --method qaware"
        )
    if len(found) > 1:
        raise ValueError(
            f"{name} has {len(found)} different rotary embeddings ({[f.shape[0] for f in found]} "
            "frequencies): the pre-RoPE methods undo one; use --method qaware"
        )
    if 2 * found[0].shape[0] > head_dim:
        raise ValueError(
            f"{name}'s rotary embedding has {found[0].shape[0]} frequencies, more than its head_dim "
            f"{head_dim} has pairs: use --method qaware"
        )
    return found[0]
