"""The stored code layout (``quant.packing``): exact round trip, the byte layout the kernels
read, traceability and errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.presets import PRESETS
from vecinfer_compile.quant.packing import code_bits, pack_codes, packed_width, subvector_count, unpack_codes

PRESET_ENTRIES = sorted({s.entries for p in PRESETS.values() for s in (p.key, p.value)})


def layout_by_hand(codes: list[int], entries: int) -> list[int]:
    """The layout as specified, one byte at a time: low bytes, then high nibbles in pairs."""
    if entries <= 256:
        return list(codes)
    s = len(codes)
    out = [c & 0xFF for c in codes] + [0] * math.ceil(s / 2)
    for i, c in enumerate(codes):
        out[s + i // 2] |= (c >> 8) << (4 * (i % 2))
    return out


@settings(max_examples=200, deadline=None)
@given(
    entries=st.sampled_from(PRESET_ENTRIES + [257, 1000]),
    s=st.integers(1, 70),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16]),
)
def test_round_trip_is_exact(entries, s, lead, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, entries, (*lead, s), generator=gen)
    codes[..., 0] = entries - 1  # the largest code is always present
    stored = pack_codes(codes.to(dtype), entries)
    assert stored.dtype == torch.uint8
    assert stored.shape == (*lead, packed_width(s, entries))
    assert subvector_count(stored.shape[-1], entries) == s
    back = unpack_codes(stored, entries)
    assert back.dtype == torch.int64 and torch.equal(back, codes)


@pytest.mark.parametrize("entries", PRESET_ENTRIES)
@pytest.mark.parametrize("s", [1, 2, 3, 4, 5, 16, 31, 32])
def test_bytes_follow_the_specified_layout(entries, s):
    """Byte for byte what the CUDA decode kernel reads (checked against a loop over the spec)."""
    gen = torch.Generator().manual_seed(entries + s)
    codes = torch.randint(0, entries, (3, s), generator=gen)
    stored = pack_codes(codes, entries)
    for row, got in zip(codes.tolist(), stored.tolist()):
        assert got == layout_by_hand(row, entries)


def test_physical_bits_equal_nominal_bits():
    for preset in PRESETS.values():
        for spec in (preset.key, preset.value):
            s = 128 // spec.dims
            assert code_bits(spec.entries) == math.ceil(math.log2(spec.entries))
            assert 8 * packed_width(s, spec.entries) / 128 == pytest.approx(math.log2(spec.entries) / spec.dims)
    assert packed_width(3, 4096) == 5 and packed_width(32, 4096) == 48 and packed_width(32, 256) == 32


def test_pack_and_unpack_trace_without_graph_breaks():
    """No .item(), no data-dependent Python: fullgraph with dynamic leading shapes."""
    pack = torch.compile(pack_codes, backend="eager", fullgraph=True, dynamic=True)
    unpack = torch.compile(unpack_codes, backend="eager", fullgraph=True, dynamic=True)
    for t in (5, 9):
        codes = torch.randint(0, 4096, (2, t, 7))
        stored = pack(codes, 4096)
        assert torch.equal(stored, pack_codes(codes, 4096))
        assert torch.equal(unpack(stored, 4096), codes)


def test_errors_name_the_fix():
    with pytest.raises(TypeError, match="integer tensor"):
        pack_codes(torch.zeros(2, 4), 4096)
    with pytest.raises(TypeError, match="must be uint8.*pack_codes"):
        unpack_codes(torch.zeros(2, 4, dtype=torch.int16), 4096)
    with pytest.raises(ValueError, match="at most 4096 entries"):
        packed_width(4, 8192)
