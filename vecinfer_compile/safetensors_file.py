"""Checks of a safetensors file that need neither torch nor a model: its header, whether the file
holds every byte the header describes (a truncated copy or an interrupted write does not), and
whether its floating-point tensors hold NaN or inf.

The command line runs them on a codebook file while it parses its arguments (a fraction of a
second), and :func:`~vecinfer_compile.codebooks.load_codebooks` runs the first two before reading
the tensors, so a damaged file is refused by name before any model is loaded, not as a failure
of whatever later reads it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HEADER_LIMIT = 100_000_000  # safetensors' own bound on the JSON header
# The bits of the exponent, all set for inf and NaN, by dtype: (unsigned view, mask).
_EXPONENT = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
}


class DamagedFile(ValueError):
    """A file that is not a complete safetensors file (the message names it and why)."""


class TruncatedFile(DamagedFile):
    """A safetensors file that holds fewer bytes than its header describes."""


def read_header(path: str | Path) -> tuple[dict, int]:
    """``(header, data_start)``: the JSON header of the safetensors file ``path`` (tensor entries
    and ``__metadata__``) and the byte where its tensor data starts. DamagedFile when the file is
    not a safetensors file or holds fewer bytes than its header describes."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        raw = f.read(min(length, HEADER_LIMIT))
    if 0 < length <= HEADER_LIMIT and len(raw) < length and raw[:1] == b"{":
        raise TruncatedFile(
            f"{path} is truncated: its header alone is {8 + length:,} bytes, the file holds "
            f"{size:,} (an interrupted copy or write): copy it again, or recalibrate"
        )
    if not 0 < length <= min(HEADER_LIMIT, size - 8):
        raise DamagedFile(f"{path} is not a safetensors file (no header)")
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except ValueError:
        raise DamagedFile(f"{path} is not a safetensors file (its header is not JSON)") from None
    start = 8 + length
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise DamagedFile(
            f"{path} is not a safetensors file (a tensor entry of its header has no data_offsets)"
        ) from None
    if start + end > size:
        raise TruncatedFile(
            f"{path} is truncated: its header describes {start + end:,} bytes, the file holds "
            f"{size:,} (an interrupted copy or write): copy it again, or recalibrate"
        )
    return header, start


def nonfinite_tensors(
    path: str | Path, header: dict | None = None, start: int | None = None
) -> list[tuple[str, int, int]]:
    """``[(name, bad, total)]``: the floating-point tensors of ``path`` that hold NaN or inf, with
    how many of their values do, in the header's order. Reads the data with numpy, not torch."""
    import numpy as np

    if header is None or start is None:
        header, start = read_header(path)
    bad = []
    with open(path, "rb") as f:
        for name, entry in header.items():
            if name == "__metadata__" or entry.get("dtype") not in _EXPONENT:
                continue
            view, mask = _EXPONENT[entry["dtype"]]
            begin, end = (int(x) for x in entry["data_offsets"])
            f.seek(start + begin)
            bits = np.frombuffer(f.read(end - begin), dtype=view)
            count = int(np.count_nonzero((bits & np.array(mask, dtype=view)) == mask))
            if count:
                bad.append((name, count, bits.size))
    return bad


def describe_nonfinite(path: str | Path, bad: list[tuple[str, int, int]]) -> str:
    """One line naming the file and its tensors that hold NaN or inf, and the fix."""
    names = ", ".join(f"{name!r} ({count:,} of {total:,} values)" for name, count, total in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    one = len(bad) == 1
    return (
        f"{path}: tensor{'' if one else 's'} {names}{more} hold{'s' if one else ''} NaN or inf (a corrupt "
        "file, or a calibration that diverged): "
        "recalibrate with `vecinfer calibrate`"
    )
