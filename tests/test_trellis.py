"""Bitshift-trellis quantization (codecs/trellis/walk.py): Viterbi against brute force, exact walks,
table training."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.codecs.trellis.walk import initial_luts, reconstruct, train_luts, viterbi


def _walk_of(codes: list[int], bits: list[int], lbits: int) -> list[int]:
    s, walk = 0, []
    for c, k in zip(codes, bits):
        s = ((s << k) | c) & ((1 << lbits) - 1)
        walk.append(s)
    return walk


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.lists(st.integers(1, 2), min_size=1, max_size=4), st.integers(0, 2**16))
def test_property_viterbi_finds_the_best_walk(lbits, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    luts = {k: torch.randn(1 << lbits, generator=gen) for k in set(bits)}
    x = torch.randn(3, len(bits), generator=gen)
    walk = viterbi(x, bits, luts)
    err = ((reconstruct(walk, bits, luts) - x) ** 2).sum(1)
    for n in range(x.shape[0]):  # every code sequence, by brute force
        best = min(
            sum(
                (x[n, t].item() - luts[k][s].item()) ** 2
                for t, (k, s) in enumerate(zip(bits, _walk_of(list(codes), bits, lbits)))
            )
            for codes in itertools.product(*[range(2**k) for k in bits])
        )
        assert err[n].item() == pytest.approx(best, rel=1e-5, abs=1e-6)
        walk_n = walk[n].tolist()  # and the walk is one the shift register can take
        prev = 0
        for s, k in zip(walk_n, bits):
            assert s >> k == prev & ((1 << (lbits - k)) - 1)
            prev = s


def _least_cost(x: torch.Tensor, bits: list[int], luts: dict[int, torch.Tensor], lbits: int) -> torch.Tensor:
    """The trellis's least total squared error of each row of ``x: [N, T]``, by the recursion over
    costs alone (no trace back to get wrong)."""
    cost = torch.full((x.shape[0], 1 << lbits), float("inf"))
    cost[:, 0] = 0
    for t, k in enumerate(bits):
        best = cost.view(x.shape[0], 1 << k, -1).min(1).values
        cost = best.repeat_interleave(1 << k, 1) + (x[:, t, None] - luts[k][None]) ** 2
    return cost.min(1).values


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 10), st.lists(st.integers(1, 10), min_size=1, max_size=8), st.integers(0, 2**16))
def test_property_the_walk_costs_the_least_cost_whatever_the_widths(lbits, widths, seed):
    """Any widths up to L (steps of more than 8 bits keep their whole high bits in the trace): the
    walk's squared error is the least cost."""
    bits = [min(k, lbits) for k in widths]
    gen = torch.Generator().manual_seed(seed)
    luts = {k: torch.randn(1 << lbits, generator=gen) for k in set(bits)}
    x = torch.randn(8, len(bits), generator=gen)
    err = ((reconstruct(viterbi(x, bits, luts), bits, luts) - x) ** 2).sum(1)
    torch.testing.assert_close(err, _least_cost(x, bits, luts, lbits), atol=1e-5, rtol=1e-5)


def test_steps_wider_than_a_byte_keep_their_whole_trace():
    """A step of more than 8 bits has up to 2^k predecessors a state: the walk back keeps all k high
    bits, so the walk costs the least cost (the case the one-byte trace got wrong)."""
    lbits, bits = 10, [2, 1, 3, 3, 2, 10, 9, 1]
    gen = torch.Generator().manual_seed(0)
    luts = {k: torch.randn(1 << lbits, generator=gen) for k in set(bits)}
    x = torch.randn(16, len(bits), generator=gen)
    err = ((reconstruct(viterbi(x, bits, luts), bits, luts) - x) ** 2).sum(1)
    torch.testing.assert_close(err, _least_cost(x, bits, luts, lbits), atol=1e-5, rtol=1e-5)


def test_a_sequence_on_the_trellis_is_reconstructed_exactly():
    bits, lbits = [2, 1, 3, 2, 2, 1], 4
    luts = initial_luts(lbits, bits)
    walk = torch.tensor([_walk_of([3, 0, 5, 1, 2, 1], bits, lbits)])
    x = reconstruct(walk, bits, luts)
    assert torch.equal(viterbi(x, bits, luts), walk)


def test_trained_tables_beat_scalar_lloyd_max_at_two_bits():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=gen)
    bits = [2] * 64
    before = ((reconstruct(viterbi(x, bits, initial_luts(6, bits)), bits, initial_luts(6, bits)) - x) ** 2).mean()
    luts = train_luts(x, bits, 6, rounds=3)
    after = ((reconstruct(viterbi(x, bits, luts), bits, luts) - x) ** 2).mean()
    assert after <= before and after < 0.1175  # Lloyd-Max's 2-bit error of a unit Gaussian


def test_bad_shapes_are_refused():
    luts = initial_luts(3, [1])
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        viterbi(torch.zeros(2, 3), [1, 1], luts)
    with pytest.raises(ValueError, match="1 <= bits <= L"):
        viterbi(torch.zeros(2, 1), [4], {4: torch.zeros(8)})
