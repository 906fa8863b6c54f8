"""The stored layout of trellis codes: each token and head's new bits as one bit string, and each
component's state read back from it without walking the trellis.

A walk of :mod:`.trellis` takes ``k_c`` new bits at component ``c`` (the head's allocation
``bits [H, D]``; 0: not coded) and its state is ``s_c = ((s_{c-1} << k_c) | new_c) mod 2^L`` from
``s = 0``. Written one after another, earliest first, the new bits form a string of
``budget = sum_c k_c`` bits (``bits_per_element * D``: exactly what the codebooks' codes of the
same preset take), stored most significant bit first in ``ceil(budget / 8)`` bytes. Then ``s_c``
is the string's ``L`` bits ending at ``end_c = k_1 + ... + k_c`` (fewer at the start, where the
walk's zeros stand before the string): each component decodes from a window at a fixed offset,
independently of the others (what a kernel needs: no sequential shift register).
"""

from __future__ import annotations

import torch


def bit_ends(bits: torch.Tensor) -> torch.Tensor:
    """``bits: [H, D]`` -> ``[H, D]`` int64, where each component's new bits end in its head's string
    (``end_c``; equal to the previous component's for a component of 0 bits)."""
    return bits.long().cumsum(-1)


def packed_bytes(bits: torch.Tensor) -> int:
    """Bytes of one token and head's string: the largest head's budget, rounded up to bytes."""
    return (int(bits.sum(-1).max()) + 7) // 8


def pack_walks(walks: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``walks: [..., H, D]`` trellis states (any integer dtype; a component of 0 bits is ignored)
    and ``bits: [H, D]`` -> ``[..., H, packed_bytes(bits)]`` uint8: each component's new bits (its
    state's low ``k_c`` bits), earliest first, most significant bit first."""
    h, d = bits.shape
    if walks.shape[-2:] != (h, d):
        raise ValueError(f"walks of shape {tuple(walks.shape)}: need [..., {h}, {d}] for bits of shape {(h, d)}")
    nbytes = packed_bytes(bits)
    bits = bits.to(walks.device).long()
    ends = bit_ends(bits)
    width = int(bits.max())
    j = torch.arange(width, device=walks.device)
    # bit j of component c's new bits (j = 0 the most significant) goes to string position end_c - k_c + j
    position = ends[..., None] - bits[..., None] + j  # [H, D, W]
    valid = j < bits[..., None]
    value = (walks.long()[..., None] >> (bits[..., None] - 1 - j).clamp_min(0)) & 1  # [..., H, D, W]
    value = torch.where(valid, value, 0)
    string = torch.zeros(*walks.shape[:-1], nbytes * 8, dtype=torch.long, device=walks.device)
    index = torch.where(valid, position, nbytes * 8).flatten(-2)  # invalid bits to a spill slot
    spill = torch.zeros(*walks.shape[:-1], 1, dtype=torch.long, device=walks.device)
    string = torch.cat([string, spill], -1).scatter_add(-1, index.expand(*walks.shape[:-1], -1), value.flatten(-2))[
        ..., :-1
    ]
    weights = 1 << torch.arange(7, -1, -1, device=walks.device)
    return (string.view(*string.shape[:-1], nbytes, 8) * weights).sum(-1).to(torch.uint8)


def state_windows(bits: torch.Tensor, state_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each component's state sits in its string: ``(first, shift, mask)``, each ``[H, D]``
    int32 for ``bits: [H, D]`` and ``L = state_bits``: the state is
    ``((byte[first] << 16 | byte[first + 1] << 8 | byte[first + 2]) >> shift) & mask`` (bytes past
    the string read as 0; ``mask`` 0 for a component of 0 bits)."""
    if not 1 <= state_bits <= 16:
        raise ValueError(f"state_bits must be in 1..16 (a window of at most 3 bytes), got {state_bits}")
    bits = bits.long()
    ends = bit_ends(bits)
    start = (ends - state_bits).clamp_min(0)
    width = ends - start
    mask = torch.where(bits > 0, (1 << width) - 1, 0)
    return (start // 8).int(), (24 - start % 8 - width).int(), mask.int()


def component_states(codes: torch.Tensor, bits: torch.Tensor, state_bits: int) -> torch.Tensor:
    """``codes: [..., H, nbytes]`` uint8 (:func:`pack_walks`' layout), ``bits: [H, D]``, ``L`` ->
    every component's state ``[..., H, D]`` int64 (0 for a component of 0 bits), read from its
    window (:func:`state_windows`)."""
    if codes.shape[-2] != bits.shape[0] or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 [..., {bits.shape[0]}, bytes], got {codes.dtype} {tuple(codes.shape)}")
    return read_states(codes, *state_windows(bits, state_bits))


def read_states(codes: torch.Tensor, first: torch.Tensor, shift: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``codes: [..., H, nbytes]`` uint8 and the windows ``[H, D]`` of :func:`state_windows` ->
    states ``[..., H, D]`` int64."""
    d = first.shape[-1]
    first, shift, mask = (t.to(codes.device).long() for t in (first, shift, mask))
    padded = torch.cat([codes.long(), codes.new_zeros(*codes.shape[:-1], 2).long()], -1)
    index = (first[..., None] + torch.arange(3, device=codes.device)).flatten(-2)  # [H, D*3]
    three = padded.gather(-1, index.expand(*codes.shape[:-1], -1)).view(*codes.shape[:-1], d, 3)
    word = (three[..., 0] << 16) | (three[..., 1] << 8) | three[..., 2]
    return (word >> shift) & mask
