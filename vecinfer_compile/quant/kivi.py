"""KIVI-style asymmetric scalar quantization, the baseline reviewers ask for.

Keys are quantized per channel (min/max over groups of ``group`` consecutive tokens), values per
token (min/max over groups of ``group`` consecutive channels). A last partial group of tokens
gets its own min/max. Error is at most half a quantization step per element.
"""

from __future__ import annotations

import torch


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x: [..., N] -> [..., ceil(N / group), group]`` float32; a last partial group is padded
    with its own last element so that padding never changes its min/max."""
    pad = (-x.shape[-1]) % group
    xf = x.float()
    if pad:
        xf = torch.cat([xf, xf[..., -1:].expand(*xf.shape[:-1], pad)], -1)
    return xf.reshape(*xf.shape[:-1], -1, group)


def _step(g: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo = g.amin(-1, keepdim=True)
    return lo, (g.amax(-1, keepdim=True) - lo).clamp_min(1e-8) / levels


def _fake_quant_lastdim_groups(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric min/max quantization of ``x: [..., N]`` in groups of ``group`` along the last
    dim. Returns the dequantized tensor in float32."""
    levels = (1 << bits) - 1
    g = _groups(x, group)
    lo, scale = _step(g, levels)
    q = ((g - lo) / scale).round().clamp(0, levels)
    return (q * scale + lo).flatten(-2)[..., : x.shape[-1]]


def kivi_keys(k: torch.Tensor, bits: int, group: int = 32) -> torch.Tensor:
    """``k: [B, H, T, D]``: per-channel quantization over token groups; returns k's dtype."""
    out = _fake_quant_lastdim_groups(k.transpose(-1, -2), bits, group).transpose(-1, -2)
    return out.to(k.dtype)


def kivi_values(v: torch.Tensor, bits: int, group: int = 32) -> torch.Tensor:
    """``v: [B, H, T, D]``: per-token quantization over channel groups; returns v's dtype."""
    return _fake_quant_lastdim_groups(v, bits, group).to(v.dtype)


def kivi_step(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> torch.Tensor:
    """The quantization step of every element of ``x: [B, H, T, D]`` (for tests)."""
    xt = x.transpose(-1, -2) if per_channel else x
    g = _groups(xt, group)
    _, scale = _step(g, (1 << bits) - 1)
    step = scale.expand_as(g).flatten(-2)[..., : xt.shape[-1]]
    return step.transpose(-1, -2) if per_channel else step
