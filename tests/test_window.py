"""The window rule (:mod:`vecinfer_compile.window`): its masks, and the claims the docs make of it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.window import cache_mask, chunk_full_start, in_window, simulate_mask


def test_cache_mask_cases():
    m = cache_mask(1, 10, 4)  # a decode step: the 4 newest slots, itself included
    assert m.tolist() == [[False] * 6 + [True] * 4]
    assert cache_mask(3, 5, 2, prefill=True).all()
    m = cache_mask(2, 6, 3)  # a chunk of 2 after 4 tokens: the old window (slots 1-3) and itself
    assert m.tolist() == [[False, True, True, True, True, True]] * 2
    assert cache_mask(3, 4, 5).all()  # the cache held 1 token, all in the window


def test_simulate_mask_is_the_definition():
    m = simulate_mask(3, 5, 2)  # queries at positions 2, 3, 4
    assert m.tolist() == [
        [False, True, True, False, False],
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]
    assert not simulate_mask(4, 4, 0).any()


@settings(max_examples=200, deadline=None)
@given(tq=st.integers(1, 12), held=st.integers(0, 40), residual=st.integers(0, 16))
def test_a_chunk_reads_at_least_the_simulate_window(tq, held, residual):
    """Every query of a cache forward (decode step or chunk) reads in full precision at least the
    keys the simulate rule gives it, and a decode step exactly those."""
    tk = held + tq
    cache = cache_mask(tq, tk, residual, prefill=held == 0)
    simulate = simulate_mask(tq, tk, residual)
    assert not (simulate & ~cache).any()
    if tq == 1 and held > 0:
        assert torch.equal(cache, simulate)


@given(i=st.integers(-5, 50), j=st.integers(-5, 50), residual=st.integers(0, 20))
def test_in_window_scalar_and_tensor_agree(i, j, residual):
    assert bool(in_window(i, j, residual)) == (0 <= i - j < residual)
    assert bool(in_window(torch.tensor(i), torch.tensor(j), residual)) == (0 <= i - j < residual)


def test_chunk_full_start():
    assert chunk_full_start(10, 2, 3) == 5
    assert chunk_full_start(4, 2, 8) == 0
