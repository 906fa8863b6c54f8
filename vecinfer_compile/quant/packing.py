"""Storage layout of VQ codes: physical bits equal nominal bits.

A head vector at one position is ``S`` sub-vector codes. How they are stored, as ``uint8``:

- codebooks of up to 256 entries (8-bit codes): ``[..., S]``, one byte per code.
- codebooks of 257..4096 entries (12-bit codes): ``[..., S + ceil(S / 2)]``. Bytes ``[0, S)`` hold
  the low 8 bits of code ``s``; bytes ``[S, S + ceil(S / 2))`` hold the high 4 bits, code ``2i``
  in the LOW nibble of byte ``S + i`` and code ``2i + 1`` in its HIGH nibble (for odd ``S`` the
  last high nibble is 0). Two codes in three bytes.

Every kernel (pure-torch reference, Triton, CUDA) reads and writes this layout; the CUDA decode
kernel depends on it byte for byte. The functions here are pure torch with no ``.item()`` and no
data-dependent Python, so they trace with symbolic shapes. Codes are runtime state (the
codebook file format holds centroids, not codes), so nothing stored needs migrating.
"""

from __future__ import annotations

import torch

BYTE_ENTRIES = 256  # codebooks up to this size have 8-bit codes
PACKED_ENTRIES = 4096  # 12-bit codes: the largest codebook the layout stores


def code_bits(entries: int) -> int:
    """Stored bits per code: 8 for ``entries <= 256``, 12 up to 4096."""
    if entries < 1:
        raise ValueError(f"a codebook needs at least one entry, got {entries}")
    if entries <= BYTE_ENTRIES:
        return 8
    if entries <= PACKED_ENTRIES:
        return 12
    raise ValueError(
        f"codebooks of {entries} entries are not supported: codes are stored in 8 or 12 bits "
        f"(at most {PACKED_ENTRIES} entries); use a preset codebook (256 or 4096 entries)"
    )


def is_packed(entries: int) -> bool:
    """Whether codes of a codebook of ``entries`` centroids are 12-bit (packed)."""
    return code_bits(entries) == 12


def packed_width(subvectors: int, entries: int) -> int:
    """Bytes per head vector for ``subvectors`` codes: ``S`` (8-bit) or ``S + ceil(S / 2)``."""
    if is_packed(entries):
        return subvectors + (subvectors + 1) // 2
    return subvectors


def subvector_count(width: int, entries: int) -> int:
    """Inverse of :func:`packed_width`: ``S`` from the stored width (``2 * W // 3`` when packed)."""
    return 2 * width // 3 if is_packed(entries) else width


def pack_codes(codes: torch.Tensor, entries: int) -> torch.Tensor:
    """Codes ``[..., S]`` of any integer dtype, values in ``[0, entries)`` -> stored codes
    ``[..., packed_width(S, entries)]`` uint8 (values are not range-checked: that would be
    data-dependent)."""
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if not is_packed(entries):
        return codes.to(torch.uint8)
    c = codes.to(torch.int32)
    low = (c & 0xFF).to(torch.uint8)
    high = c >> 8
    if codes.shape[-1] % 2:
        high = torch.cat([high, torch.zeros_like(high[..., :1])], dim=-1)
    pairs = high.unflatten(-1, (-1, 2))
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return torch.cat([low, nibbles], dim=-1)


def unpack_codes(stored: torch.Tensor, entries: int) -> torch.Tensor:
    """Stored codes ``[..., W]`` uint8 (as :func:`pack_codes` writes) -> codes ``[..., S]`` int64,
    ``S = subvector_count(W, entries)``."""
    if stored.dtype != torch.uint8:
        raise TypeError(
            f"stored codes must be uint8 (as vecinfer::encode and pack_codes write them), got {stored.dtype}; "
            "pack index codes with vecinfer_compile.quant.packing.pack_codes(codes, entries)"
        )
    if not is_packed(entries):
        return stored.long()
    s = subvector_count(stored.shape[-1], entries)
    low = stored[..., :s].long()
    nibbles = stored[..., s:].long()
    high = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).flatten(-2)[..., :s]
    return low | (high << 8)
