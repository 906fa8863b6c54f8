"""Perplexity protocol and KV-bytes accounting."""

from __future__ import annotations

import math

import pytest
import torch

from vecinfer_compile.evaluation.kv_bytes import kv_bytes, kv_bytes_per_token
from vecinfer_compile.evaluation.perplexity import make_windows, perplexity
from vecinfer_compile.models import load_text, split_text, tokenize


def test_perplexity_equals_model_loss(tiny_model, sample_text_path):
    model, tok = tiny_model
    ids = tokenize(tok, load_text(sample_text_path))
    windows, length = 3, 48
    res = perplexity(model, ids, windows=windows, window_len=length, progress=False)
    losses = []
    with torch.no_grad():
        for w in range(windows):
            x = ids[w * length : (w + 1) * length][None]
            losses.append(model(input_ids=x, labels=x).loss.item())
    assert res.tokens == windows * (length - 1)
    expect = math.exp(sum(losses) / len(losses))  # equal token counts per window
    assert res.ppl == pytest.approx(expect, rel=1e-5)
    assert res.nll == pytest.approx(math.log(expect), rel=1e-5)


def test_perplexity_batching_is_the_same(tiny_model, sample_text_path):
    model, tok = tiny_model
    ids = tokenize(tok, load_text(sample_text_path))
    a = perplexity(model, ids, windows=4, window_len=32, batch_size=1, progress=False)
    b = perplexity(model, ids, windows=4, window_len=32, batch_size=4, progress=False)
    assert a.tokens == b.tokens == 4 * 31
    assert a.ppl == pytest.approx(b.ppl, rel=1e-4)


def test_windows_too_short_names_token_count():
    with pytest.raises(ValueError, match=r"the text has 100 tokens.*4 x 64 = 256"):
        make_windows(torch.arange(100), 4, 64)
    assert make_windows(torch.arange(100), 3, 33).shape == (3, 33)
    with pytest.raises(ValueError, match="at least 1"):
        make_windows(torch.arange(100), 0, 10)


def test_split_text_does_not_overlap():
    text = "".join(f"line {i}\n" for i in range(100))
    head, tail = split_text(text)
    assert head + tail == text and head.endswith("\n") and tail


TINY = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64}
LLAMA8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}


def test_kv_bytes_fp16_and_kivi():
    fp = kv_bytes("fp16", None, LLAMA8B)
    assert fp.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert fp.total(1000) == 131072 * 1000
    k2 = kv_bytes("kivi", 2, LLAMA8B)
    # 2 bits + fp16 scale and zero per 32 elements = 3 bits physical
    assert k2.physical_bits_per_element == 3.0
    assert k2.bytes_per_token == 2 * 32 * 8 * 128 * 3 / 8 == 24576
    assert kv_bytes("kivi", 4, TINY).bytes_per_token == 2 * 4 * 2 * 64 * 5 / 8 == 640
    assert kv_bytes_per_token("fp16", None, TINY) == 2048


def test_kv_bytes_vq_presets_tiny_geometry():
    elems = 4 * 2 * 64  # keys per token, all layers
    # 2-bit 256x4: uint8 per 4 channels
    b2 = kv_bytes("vecinfer", 2, TINY)
    assert (b2.nominal_bits, b2.physical_bits_per_element) == (2.0, 2.0)
    assert b2.bytes_per_token == 2 * elems / 4 == 256
    # float32, as the cache holds them: codebooks 4 layers x 256 x 4 for K and V, lam 4 x 2 x 64,
    # one 64 x 64 rotation
    assert b2.fixed_bytes == 4 * (2 * 4 * 256 * 4 + 4 * 2 * 64 + 64 * 64) == 51200
    # plain VQ: no smoothing factors, no rotation
    assert kv_bytes("vq", 2, TINY).fixed_bytes == 4 * 2 * 4 * 256 * 4 == 32768
    # 3-bit 4096x4: 16 12-bit codes per head vector packed in 24 bytes -> 3 physical bits,
    # 1.5x the 2-bit preset's bytes
    b3 = kv_bytes("vecinfer", 3, TINY)
    assert (b3.nominal_bits, b3.physical_bits_per_element, b3.bytes_per_token) == (3.0, 3.0, 384)
    assert b3.bytes_per_token == 1.5 * b2.bytes_per_token
    # 1.5-bit 4096x8: 8 codes in 12 bytes -> 1.5 physical bits, 0.75x the 2-bit preset's bytes
    b15 = kv_bytes("hadamard", 1.5, TINY)
    assert (b15.physical_bits_per_element, b15.bytes_per_token) == (1.5, 192)
    assert b15.bytes_per_token == 0.75 * b2.bytes_per_token
    assert b15.fixed_bytes == 4 * (2 * 4 * 4096 * 8 + 64 * 64) == 1064960
    # 1.25-bit: 12-bit keys / 8 channels (12 bytes per head), 8-bit values / 8 (8 bytes)
    b125 = kv_bytes("vecinfer", 1.25, TINY)
    assert (b125.physical_bits_per_element, b125.bytes_per_token) == (1.25, 160)
    assert kv_bytes("vecinfer", 4, TINY).bytes_per_token == 512
    assert kv_bytes("vecinfer", 1, TINY).bytes_per_token == 128


def test_kv_bytes_residual_window_and_llama():
    acc = kv_bytes("vecinfer", 1.5, LLAMA8B, residual=128)
    assert acc.bytes_per_token == 2 * 32 * 8 * 128 * 1.5 / 8 == 12288
    fixed = 4 * (2 * 32 * 4096 * 8 + 32 * 8 * 128 + 128 * 128)  # float32 codebooks, lam, rotation
    assert acc.fixed_bytes == fixed
    assert acc.total(100) == 100 * 131072 + fixed
    assert acc.total(1128) == 128 * 131072 + 1000 * 12288 + fixed
    assert acc.per_token_at(1128) == acc.total(1128) / 1128


def test_kv_bytes_accepts_hf_config_and_rejects_bad_input(tiny_model):
    model, _ = tiny_model
    assert kv_bytes("vecinfer", 2, model.config).bytes_per_token == 256
    with pytest.raises(ValueError, match="unknown method"):
        kv_bytes("int8", 8, TINY)
    with pytest.raises(ValueError, match="no VecInfer preset"):
        kv_bytes("vecinfer", 5, TINY)
    with pytest.raises(ValueError, match="KIVI"):
        kv_bytes("kivi", 3, TINY)


def test_kv_bytes_matches_codebook_nbytes(tiny_model, sample_text_path):
    from vecinfer_compile.codebooks import LayerCodebooks, VecInferCodebooks, model_geometry
    from vecinfer_compile.quant.transform import KeyTransform

    model, _ = tiny_model
    g = model_geometry(model.config)
    layers = [
        LayerCodebooks(KeyTransform(64, torch.ones(2, 64), True), torch.zeros(256, 4), torch.zeros(256, 4))
        for _ in range(4)
    ]
    cb = VecInferCodebooks("vecinfer", 2.0, layers, g)
    assert kv_bytes("vecinfer", 2, g).fixed_bytes == cb.nbytes() + 4 * 64 * 64  # + the cache's rotation


def test_ablation_row_counts_a_per_layer_allocation_bytes(tiny_model, sample_text_path):
    """An ablation row of codebooks with one preset per layer counts each layer's own code bytes,
    not ``bits`` (their average) for every layer."""
    from vecinfer_compile.evaluation.ablation import evaluate_row
    from vecinfer_compile.testing import random_codebooks

    model, tok = tiny_model
    ids = tokenize(tok, load_text(sample_text_path))
    layers = model.config.num_hidden_layers
    assert layers % 2 == 0
    layer_bits = [1.0, 3.0] * (layers // 2)  # 2 bits on average
    cb = random_codebooks(model.config, layer_bits=layer_bits)
    row = evaluate_row(model, tok, ids, "vecinfer", cb.bits, codebooks=cb, windows=1, window_len=32, progress=False)
    want = kv_bytes("vecinfer", cb.bits, model.config, layer_bits=layer_bits)
    assert row.kv_bytes_per_token == want.bytes_per_token and row.fixed_bytes == want.fixed_bytes
    uniform = kv_bytes("vecinfer", 2.0, model.config)
    assert (row.kv_bytes_per_token, row.fixed_bytes) != (uniform.bytes_per_token, uniform.fixed_bytes)
