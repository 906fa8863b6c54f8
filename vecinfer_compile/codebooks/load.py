"""Loading a codebook file: read it, bring an older format to the current one (:mod:`.convert`),
then read that strictly (:mod:`.file_format`)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from ..safetensors_file import describe_nonfinite, read_header
from .convert import upgrade
from .file_format import FORMAT, read_codebooks
from .model import VecInferCodebooks


def load_codebooks(path: str | Path) -> VecInferCodebooks:
    """Read a file written by :meth:`VecInferCodebooks.save`, of this version or an earlier one
    (clear errors naming the fix for a missing file, a file that is not a vecinfer artifact, an
    unknown format or a corrupt file: truncated, or a tensor holding NaN or inf)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"codebook file {path} does not exist: create it with `vecinfer calibrate ... --out {path}`"
        )
    read_header(path)  # a truncated file is said to be, before safetensors' own message
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("vecinfer")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a safetensors file: {exc}") from exc
    bad = [
        (name, int((~t.isfinite()).sum()), t.numel())
        for name, t in tensors.items()
        if t.is_floating_point() and not bool(t.isfinite().all())
    ]
    if bad:
        raise ValueError(describe_nonfinite(path, bad))
    if raw is None:
        raise ValueError(f"{path} has no vecinfer metadata: it was not written by vecinfer calibrate")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: its vecinfer metadata is not JSON ({exc}; corrupt file): recalibrate with `vecinfer calibrate`"
        ) from exc
    if not isinstance(meta, dict):
        raise ValueError(
            f"{path}: its vecinfer metadata is not a JSON object (corrupt file): recalibrate with `vecinfer calibrate`"
        )
    if meta.get("format") != FORMAT:
        meta, tensors = upgrade(meta, tensors, path)
    return read_codebooks(meta, tensors, path)
