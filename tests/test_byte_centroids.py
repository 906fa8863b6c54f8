"""7-bit centroids of the 4096-entry codebooks (``quant/byte_centroids.py``): what the CUDA
kernel's byte books hold, exactly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.quant.byte_centroids import (
    BYTE_BOOK_ENTRIES,
    K_MAX,
    K_MIN,
    centroid_step,
    packed_byte_book,
    snap_centroids,
)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dims=st.sampled_from([4, 8]), log_scale=st.floats(-12, 8))
def test_snapped_centroids_are_small_multiples_of_a_power_of_two(seed, dims, log_scale):
    gen = torch.Generator().manual_seed(seed)
    cent = torch.randn(4096, dims, generator=gen) * 2.0**log_scale
    snapped = snap_centroids(cent)
    step = float(centroid_step(cent))
    assert step == 2.0 ** round(torch.log2(torch.tensor(step)).item())
    k = snapped / step
    assert torch.equal(k, k.round()) and int(k.min()) >= K_MIN and int(k.max()) <= K_MAX
    assert (snapped - cent).abs().max() <= step / 2  # the nearest multiple: nothing clamped
    assert cent.abs().max() > K_MAX * step / 2  # the finest step that holds the largest magnitude
    assert snap_centroids(snapped) is snapped  # idempotent, the same tensor: a saved file loads the same


def test_small_books_are_left_alone_and_zero_books_survive():
    cent = torch.randn(BYTE_BOOK_ENTRIES - 1, 4)
    assert snap_centroids(cent) is cent
    zeros = torch.zeros(4096, 8)
    assert torch.equal(snap_centroids(zeros), zeros) and float(centroid_step(zeros)) == 1.0


def test_packed_book_holds_the_biased_bytes_then_the_step():
    cent = snap_centroids(torch.randn(4096, 4, generator=torch.Generator().manual_seed(3)))
    packed = packed_byte_book(cent)
    assert packed.dtype == torch.uint8 and packed.numel() == 4096 * 4 + 16
    step = packed[4096 * 4 : 4096 * 4 + 4].view(torch.float32)
    assert float(step) == float(centroid_step(cent))
    rebuilt = (packed[: 4096 * 4].to(torch.int16) + K_MIN).float().reshape(4096, 4) * step
    assert torch.equal(rebuilt, cent)


def test_layer_codebooks_hold_snapped_centroids_through_save_and_load(tmp_path):
    """Every path reads a codebook's centroids from LayerCodebooks: books of more than 256 entries
    are snapped when made, and a saved file loads the same values; 256-entry books are untouched."""
    from vecinfer_compile.codebooks import load_codebooks
    from vecinfer_compile.testing import random_codebooks, random_layer_codebooks

    layer = random_layer_codebooks(2, 64, bits=1.25, seed=4)  # keys 4096x8, values 256x8
    assert torch.equal(layer.keys, snap_centroids(layer.keys))
    k = layer.keys / centroid_step(layer.keys)
    assert torch.equal(k, k.round())
    values = random_layer_codebooks(2, 64, bits=1.25, seed=4).values
    assert not torch.equal(values / centroid_step(values), (values / centroid_step(values)).round())

    geometry = dict(num_layers=2, num_kv_heads=2, num_heads=4, head_dim=64)
    books = random_codebooks(geometry, bits=3.0, seed=1)
    loaded = load_codebooks(books.save(tmp_path / "cb.safetensors"))
    for a, b in zip(books.layers, loaded.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
