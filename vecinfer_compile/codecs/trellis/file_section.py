"""The trellis codec's section of the codebook file: ``{side}_codec.*`` stacked over the attention
layers ``A``: ``analysis``, ``synthesis [A, H_kv, D, D]`` (inverses), ``scale [A, H_kv]``, ``mean``,
``variance``, ``bits [A, H_kv, D]`` (whole numbers, each head's summing to its layer's bits times
``D``) and ``tables [A, H_kv, W, 2^L]`` (padded to the widest layer's ``W``)."""

from __future__ import annotations

from pathlib import Path

import torch

from .code import PARTS, TrellisCodec

MATRIX_TOLERANCE = 1e-3  # max |analysis @ synthesis - I| of a stored pair (float32 inverses)


def write(side: str, codecs: list[TrellisCodec]) -> dict[str, torch.Tensor]:
    parts = [c.to_tensors() for c in codecs]
    width = max(p["tables"].shape[1] for p in parts)
    out = {f"{side}_codec.{name}": torch.stack([p[name] for p in parts]) for name in PARTS if name != "tables"}
    out[f"{side}_codec.tables"] = torch.stack(
        [torch.nn.functional.pad(p["tables"], (0, 0, 0, width - p["tables"].shape[1])) for p in parts]
    )
    return out


def names(side: str, tensors) -> list[str]:
    return [n for n in tensors if n.startswith(f"{side}_codec.")]


def read(side: str, tensors: dict, path: str | Path, geometry: dict, layer_bits: list[float]) -> list[TrellisCodec]:
    """One codec per attention layer (``layer_bits``: theirs), checked: every part present, shaped for
    the geometry, finite, analysis and synthesis inverses, each head's bits summing to its layer's."""
    label, fix = f"the {side} codec", f"`vecinfer calibrate --{side}-codec trellis`"
    missing = [f"{side}_codec.{p}" for p in PARTS if f"{side}_codec.{p}" not in tensors]
    if missing:
        raise ValueError(f"{path}: {label} needs {missing} (corrupt file): recalibrate with {fix}")
    a, h, d = len(layer_bits), geometry["num_kv_heads"], geometry["head_dim"]
    t = {p: tensors[f"{side}_codec.{p}"].float() for p in PARTS}
    tables = t["tables"]
    expect = {
        "analysis": (a, h, d, d),
        "synthesis": (a, h, d, d),
        "mean": (a, h, d),
        "variance": (a, h, d),
        "scale": (a, h),
        "bits": (a, h, d),
    }
    bad = [f"{p} {tuple(t[p].shape)} (needs {e})" for p, e in expect.items() if tuple(t[p].shape) != e]
    states = tables.shape[-1] if tables.dim() == 4 else 0
    if tables.dim() != 4 or tables.shape[:2] != (a, h) or states < 2 or states & (states - 1):
        bad.append(f"tables {tuple(tables.shape)} (needs [{a}, {h}, widths, 2^L])")
    if bad:
        raise ValueError(f"{path}: {side} codec tensors misshapen: {'; '.join(bad)} (corrupt file)")
    if not all(torch.isfinite(x).all() for x in t.values()):
        raise ValueError(f"{path}: {label} holds NaN or inf (corrupt file): recalibrate with {fix}")
    bits = t["bits"]
    budgets = [round(b * d) for b in layer_bits]
    ok = (
        (bits == bits.round()).all()
        and bits.min() >= 0
        and bits.max() <= tables.shape[2]
        and all((bits[n].sum(-1) == budgets[n]).all() for n in range(a))
    )
    if not ok:
        raise ValueError(
            f"{path}: {label}'s bits are not whole numbers in [0, {tables.shape[2]}] that sum to "
            f"each layer's bits times {d} (corrupt file)"
        )
    eye = torch.eye(d, dtype=torch.float64)
    err = (t["analysis"].double() @ t["synthesis"].double() - eye).abs().amax().item()
    if not err <= MATRIX_TOLERANCE:
        raise ValueError(
            f"{path}: {label}'s synthesis is not the inverse of its analysis (max error {err:.3g}; corrupt file)"
        )
    return [TrellisCodec.from_tensors({p: x[n] for p, x in t.items()}) for n in range(a)]
