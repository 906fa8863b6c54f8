"""Per-layer bit allocation: the budget programme against brute force, the pinning rule, the
retrieval probe and a retrieval-allocated calibration of the embedded tiny model end to end."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.allocate import (
    MIN_RETRIEVAL_MASS,
    allocate_bits,
    allocation_choices,
    pinned_layers,
    retrieval_scores,
)
from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.evaluation.kv_bytes import kv_bytes


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 6), seed=st.integers(0, 2**16), data=st.data())
def test_allocate_bits_is_the_cheapest_allocation_at_the_budget(layers, seed, data):
    gen = torch.Generator().manual_seed(seed)
    cost = {b: torch.rand(layers, generator=gen).tolist() for b in (1.0, 2.0, 4.0)}
    pinned = sorted(data.draw(st.sets(st.integers(0, layers - 1), max_size=layers // 3)))
    got = allocate_bits(2.0, cost, pinned)
    assert sum(got) == 2.0 * layers and all(got[i] == 4.0 for i in pinned)
    feasible = [
        c
        for c in itertools.product((1.0, 2.0, 4.0), repeat=layers)
        if sum(c) == 2.0 * layers and all(c[i] == 4.0 for i in pinned)
    ]
    best = min(sum(cost[b][i] for i, b in enumerate(c)) for c in feasible)
    assert sum(cost[b][i] for i, b in enumerate(got)) == pytest.approx(best)


def test_allocate_bits_too_many_pins_is_a_clear_error():
    cost = {b: [0.0] * 3 for b in (1.0, 2.0, 4.0)}
    with pytest.raises(ValueError, match="cannot pin 2 of 3 layers at 4 bits"):
        allocate_bits(2.0, cost, [0, 1])


def test_allocation_choices():
    assert allocation_choices(2.0) == (1.0, 2.0, 4.0)
    with pytest.raises(ValueError, match="at 1.5 bits needs 8-bit-code presets.*bits=2"):
        allocation_choices(1.5)


def test_pinned_layers_rule():
    assert pinned_layers([0.01, 0.02, 0.01, 0.01, 0.01, 0.3]) == [5]
    assert pinned_layers([0.3, 0.2, 0.1, 0.0, 0.0, 0.25]) == [0, 5]  # best two, a third of 6
    assert pinned_layers([MIN_RETRIEVAL_MASS / 2] * 6) == []  # no layer retrieves
    assert pinned_layers([0.05, 0.4]) == []  # a third of 2 layers is 0


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from vecinfer_compile.models import load_model

    return load_model(tiny_dir, "float32", "cpu")


def test_retrieval_scores_are_attention_masses(tiny, sample_text_path):
    model, tokenizer = tiny
    text = sample_text_path.read_text()
    scores = retrieval_scores(model, tokenizer, text, probes=2, seq_len=128, progress=False)
    assert len(scores) == model.config.num_hidden_layers
    assert all(0.0 < s <= 1.0 for s in scores)
    assert scores == retrieval_scores(model, tokenizer, text, probes=2, seq_len=128, progress=False)
    with pytest.raises(ValueError, match="too short to build retrieval probes"):
        retrieval_scores(model, tokenizer, "only a few words here", probes=1, seq_len=64)


def test_calibrate_retrieval_allocation_end_to_end(tiny, sample_text_path, tmp_path):
    """The tiny model cannot retrieve, so no layer is pinned; the allocation still averages
    exactly 2 bits, costs the bytes of uniform 2-bit, and survives a save/load round trip."""
    from vecinfer_compile.calibration import calibrate

    model, tokenizer = tiny
    cb = calibrate(
        model,
        tokenizer,
        sample_text_path.read_text(),
        bits=2,
        allocate="retrieval",
        max_tokens=512,
        seq_len=256,
        iters=2,
        residual=16,
        progress=False,
    )
    alloc = cb.metadata["allocation"]
    assert cb.bits == 2.0 and sum(cb.bits_per_layer()) == 2.0 * model.config.num_hidden_layers
    assert alloc["pinned_layers"] == [] and len(alloc["retrieval_scores"]) == model.config.num_hidden_layers
    assert set(alloc["loss_increase"]) == {"1", "2", "4"}
    for i, b in enumerate(cb.bits_per_layer()):
        preset = cb.layer_preset(i)
        assert preset.bits == b and tuple(cb.layer(i).keys.shape) == (preset.key.entries, preset.key.dims)
    uniform = kv_bytes("vecinfer", 2.0, model.config)
    mixed = kv_bytes("vecinfer", 2.0, model.config, layer_bits=cb.layer_bits)
    assert mixed.bytes_per_token == uniform.bytes_per_token and mixed.physical_bits_per_element == 2.0
    back = load_codebooks(cb.save(tmp_path / "cb.safetensors"))
    assert back.bits_per_layer() == cb.bits_per_layer() and back.metadata["allocation"] == alloc


def test_calibrate_explicit_layer_bits(tiny, sample_text_path):
    from vecinfer_compile.calibration import calibrate

    model, tokenizer = tiny
    cb = calibrate(
        model,
        tokenizer,
        sample_text_path.read_text(),
        layer_bits=[4, 1, 1.5, 2],
        max_tokens=512,
        seq_len=256,
        iters=2,
        progress=False,
    )
    assert cb.layer_bits == [4.0, 1.0, 1.5, 2.0] and cb.bits == pytest.approx(8.5 / 4)
    assert [tuple(l.values.shape) for l in cb.layers] == [(256, 2), (256, 8), (4096, 8), (256, 4)]
    with pytest.raises(ValueError, match="layer_bits gives 3 presets for a model of 4 layers"):
        calibrate(model, tokenizer, "text", layer_bits=[2, 2, 2], progress=False)
    with pytest.raises(ValueError, match="either layer_bits or allocate"):
        calibrate(model, tokenizer, "text", layer_bits=[2] * 4, allocate="retrieval", progress=False)
