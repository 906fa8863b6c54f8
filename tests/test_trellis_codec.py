"""The trellis codec of keys and values (codecs/trellis/code.py): exact bit budget, the KLT round
trip, an error near the study's on vectors with a skewed spectrum; calibration, the file, the
simulate path, the cache eager and compiled, and the needle diagnostic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vecinfer_compile.codecs.trellis.code import TrellisCodec
from vecinfer_compile.codecs.trellis.walk import reconstruct


def skewed_keys(h: int, n: int, d: int, seed: int = 0) -> torch.Tensor:
    """``[h, n, d]`` Gaussian keys with a decaying spectrum in a random basis and a nonzero mean."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -1.5, d)
    basis = torch.linalg.qr(torch.randn(h, d, d, generator=gen))[0]
    return (torch.randn(h, n, d, generator=gen) * scale) @ basis.transpose(1, 2) + torch.randn(h, 1, d, generator=gen)


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    centred = x - x.mean(-2, keepdim=True)
    return float(((x - x_hat) ** 2).sum() / (centred**2).sum())


@settings(max_examples=10, deadline=None)
@given(
    st.sampled_from([1, 2, 8]),
    st.sampled_from([16, 64, 128]),
    st.sampled_from([1.0, 2.0, 1.5]),
    st.integers(1, 3),
    st.integers(1, 9),
    st.integers(0, 99),
)
def test_property_every_head_spends_exactly_the_budget_and_decodes_its_walk(h, d, bits, batch, t, seed):
    """KV heads 1/2/8 (MQA to MHA-sized groups), head_dim 16/64/128, batch 1-3, odd lengths."""
    keys = skewed_keys(h, 200, d, seed)
    codec = TrellisCodec.fit(keys, bits, 4, train_vectors=64, rounds=1, seed=seed)
    assert codec.bits.sum(1).tolist() == [round(bits * d)] * h
    assert codec.bits_per_element() == bits and int(codec.bits.max()) <= 4
    x = keys[:, : batch * t].reshape(h, batch, t, d).transpose(0, 1)  # [B, H, T, D]
    walks = codec.encode(x)
    out = codec.decode(walks, x.shape, x.dtype)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert walks.shape == (batch * t, h, d) and walks.dtype == torch.int32
    for i in range(h):  # decode = the tables at the walk's states, through the inverse KLT
        cols = codec.bits[i].nonzero()[:, 0]
        steps = codec.bits[i, cols].tolist()
        y = torch.zeros(batch * t, d, dtype=torch.float64)
        luts = {k: codec.tables[i, k - 1] for k in steps}
        y[:, cols] = reconstruct(walks[:, i, cols].long(), steps, luts).double() * codec.variance[i, cols].sqrt()
        expected = codec.scale[i] * (y @ codec.synthesis[i]) + codec.mean[i]
        torch.testing.assert_close(out[:, i].reshape(batch * t, d), expected.float())


def test_two_bits_on_a_skewed_spectrum_beat_flat_two_bits():
    keys = skewed_keys(2, 3000, 32, seed=1)
    codec = TrellisCodec.fit(keys[:, :2000], 2.0, 8, train_vectors=1024, rounds=3)
    test = keys[:, 2000:]
    err = relative_error(test, codec.quantize_dequantize(test))
    # flat 2 bits a Gaussian element cannot beat 1/16 (its rate-distortion bound); the allocation
    # plus the trellis must, and by a margin on this spectrum
    assert err < 0.8 / 16, err
    assert int(codec.bits[:, 0].min()) >= 3 and int(codec.bits[:, -1].max()) <= 1


def test_bad_budgets_and_shapes_are_refused():
    keys = skewed_keys(1, 50, 8)
    with pytest.raises(ValueError, match="whole number of bits"):
        TrellisCodec.fit(keys, 1.3, 4)
    with pytest.raises(ValueError, match="3 bits an element need more than 2-bit trellis steps"):
        TrellisCodec.fit(keys, 3.0, 2)
    with pytest.raises(ValueError, match="state_bits"):
        TrellisCodec.fit(keys, 1.0, 0)
    codec = TrellisCodec.fit(keys, 1.0, 3, train_vectors=16, rounds=1)
    with pytest.raises(ValueError, match=r"\[\.\.\., 1, T, 8\]"):
        codec.encode(torch.zeros(1, 2, 3, 8))


@pytest.fixture(scope="module")
def trellis_file(tiny_model, tmp_path_factory):
    """2-bit ``vecinfer`` codebooks of the embedded tiny model with the trellis codec (16 states) for
    keys and values."""
    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.models import default_text_path

    model, tokenizer = tiny_model
    cb = calibrate(
        model,
        tokenizer,
        default_text_path().read_text(),
        bits=2,
        max_tokens=512,
        seq_len=128,
        iters=1,
        key_codec="trellis",
        value_codec="trellis",
        codec_options={"states": 16},
        progress=False,
    )
    return cb, cb.save(tmp_path_factory.mktemp("trellis") / "tiny-trellis.safetensors")


def test_a_trellis_file_round_trips_and_names_its_codecs(trellis_file):
    from vecinfer_compile.codebooks import load_codebooks

    cb, path = trellis_file
    back = load_codebooks(path)
    assert back.codecs == cb.codecs == ("trellis", "trellis")
    assert {"key codec", "value codec"} <= set(back.state_bytes())
    for a, b in zip(cb.layers, back.layers):
        for kind in ("keys", "values"):
            ca, cb_ = getattr(a, kind), getattr(b, kind)
            assert cb_.state_bits == 4 and torch.equal(ca.bits, cb_.bits) and torch.equal(ca.tables, cb_.tables)
            assert cb_.bits.sum(1).tolist() == [2 * 64] * 2
        assert not torch.equal(b.keys.analysis, b.values.analysis)


def test_the_fixed_bytes_count_the_codecs_state(trellis_file, tiny_model):
    """What a trellis cache holds whatever its length includes every tensor of its codecs' operands
    and none of the codebooks' centroids (its reads use none), and calibrate's summary counts the codecs' float32 state in its fixed bytes."""
    from vecinfer_compile.cache import VecInferCache
    from vecinfer_compile.commands.calibrate import memory_summary
    from vecinfer_compile.evaluation.kv_bytes import cache_bytes, kv_bytes

    cb, _ = trellis_file
    model, _ = tiny_model
    cache = VecInferCache(model, cb, batch_size=1, max_cache_len=8, residual=2)
    operands = sum(
        t.numel() * t.element_size()
        for layer in cache.coded_layers()
        for t in layer.quantizer.codec.operand_tensors(layer.quantizer.operands)
    )
    state = cb.state_bytes()
    codecs = state["key codec"] + state["value codec"]
    rotation = 4 * 64 * 64  # vecinfer's Hadamard, which the cache holds
    assert "codebooks" not in state  # a trellis file stores no books, and its cache reads none
    assert cache_bytes(cache).fixed == cb.nbytes() - codecs + operands + rotation
    fixed = kv_bytes(cb.method, cb.bits, cb.geometry, weighted_codes=cb.weighted_codes).fixed_bytes
    books = 4 * 2 * 256 * 4 * len(cb.attention_layers())  # the 2-bit preset's two books, which the formula counts
    assert f"{fixed + codecs - books:,} bytes fixed" in memory_summary(cb)


def test_simulate_codes_keys_and_values_by_the_codecs_and_the_compiled_simulate_path_refuses_them(
    trellis_file, tiny_model
):
    from vecinfer_compile import vecinfer_backend
    from vecinfer_compile.simulate import LayerSimulator

    cb, _ = trellis_file
    model, _ = tiny_model
    k = torch.randn(1, 2, 9, 64)
    v = torch.randn(1, 2, 9, 64)
    sim = LayerSimulator("vecinfer", 2.0, codebooks=cb, layer_idx=1)
    k_hat, v_hat = sim.quantize_kv(k, v)
    layer = cb.layer(1)
    expected = layer.transform.keys_inverse(layer.keys.quantize_dequantize(layer.transform.keys(k)))
    torch.testing.assert_close(k_hat, expected)
    torch.testing.assert_close(v_hat, layer.values.quantize_dequantize(v))
    compiled = torch.compile(model, backend=vecinfer_backend.configure(codebooks=cb), fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(
        Exception,
        match="code keys with the trellis codec and values with the trellis codec, which "
        "vecinfer_backend runs over a VecInferCache only.*run it uncompiled",
    ):
        compiled(torch.arange(3, 12)[None])


def test_an_eager_cache_holds_trellis_codes_and_reads_what_the_codec_decodes(trellis_file, tiny_model):
    """Prefill 9 tokens with a 4-token window, then append 3 one at a time: the coded slots read
    back as the codec decodes them (keys through the inverse transform), the window's exactly; the
    codes take ``bits * D / 8`` bytes a token and head; a decode step attends as SDPA over that read."""
    from vecinfer_compile.cache import VecInferCache

    cb, _ = trellis_file
    model, _ = tiny_model
    cache = VecInferCache(model, cb, batch_size=2, max_cache_len=16, residual=4)
    layer, codebooks = cache.layers[1], cb.layer(1)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 12, 64, generator=gen) for _ in range(2))
    layer.update(k[:, :, :9], v[:, :, :9])
    for t in range(9, 12):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert layer.storage.k_codes.shape[-1] == layer.storage.v_codes.shape[-1] == 2 * 64 // 8
    assert int(layer.storage.n_coded) == 8 and int(layer.storage.n_window) == 4
    k_read, v_read = layer.dequantized()
    kt = codebooks.transform.keys(k[:, :, :8])
    want_k = codebooks.transform.keys_inverse(codebooks.keys.quantize_dequantize(kt))
    torch.testing.assert_close(k_read[:, :, :8], want_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        v_read[:, :, :8], codebooks.values.quantize_dequantize(v[:, :, :8]), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(k_read[:, :, 8:12], k[:, :, 8:12], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v_read[:, :, 8:12], v[:, :, 8:12])
    # a decode step's attention over the codes (in the components) and the window = SDPA over that read,
    # row 1 left-padded by 3 slots
    q = torch.randn(2, 4, 1, 64, generator=gen)
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[:, :, :, 12:] = False
    mask[1, :, :, :3] = False
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k_read.repeat_interleave(2, 1), v_read.repeat_interleave(2, 1), attn_mask=mask
    )
    torch.testing.assert_close(layer.attend(q, mask, None), want, atol=1e-4, rtol=1e-4)


def test_greedy_tokens_through_the_trellis_cache_match_the_simulate_path(trellis_file, tiny_model):
    """``vecinfer match``'s check on the tiny model: 24 new tokens after a 40-token prompt, a window
    of 8, eager cache vs simulate path vs the compiled cache (the backend's trellis decode op in
    every decode step), token for token; a chunked prefill, compiled vs eager."""
    from torch._dynamo.utils import counters

    from vecinfer_compile.evaluation.token_match import cache_tokens, simulate_tokens

    cb, _ = trellis_file
    model, tokenizer = tiny_model
    ids = torch.arange(3, 43) % model.config.vocab_size
    cached = cache_tokens(model, ids, cb, new_tokens=24, residual=8, compiled=False)
    assert cached == simulate_tokens(model, ids, cb, new_tokens=24, residual=8)
    counters.clear()
    assert cache_tokens(model, ids, cb, new_tokens=24, residual=8, compiled=True) == cached
    assert counters["vecinfer"]["cache_decode_trellis"] >= model.config.num_hidden_layers
    # a chunked prefill (16-token chunks over a window of 8): compiled = eager, the chunks through
    # vecinfer::trellis_chunk_attention
    chunked = cache_tokens(model, ids, cb, new_tokens=6, residual=8, compiled=False, prefill_chunk=16)
    assert cache_tokens(model, ids, cb, new_tokens=6, residual=8, compiled=True, prefill_chunk=16) == chunked
    assert counters["vecinfer"]["cache_chunk_trellis"] >= model.config.num_hidden_layers


@pytest.mark.parametrize("kind", ["key", "value"])
def test_a_corrupt_codec_is_refused_on_loading(trellis_file, tmp_path, kind):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from vecinfer_compile.codebooks import load_codebooks

    _, path = trellis_file
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    bad = dict(tensors)
    bad[f"{kind}_codec.bits"] = bad[f"{kind}_codec.bits"].clone()
    bad[f"{kind}_codec.bits"][0, 0, 0] += 1  # one bit more than the layer's budget
    save_file(bad, str(tmp_path / "bits.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=f"the {kind} codec's bits are not whole numbers .* that sum to each layer's"):
        load_codebooks(tmp_path / "bits.safetensors")
    stripped = {k: t for k, t in tensors.items() if k != f"{kind}_codec.tables"}
    save_file(stripped, str(tmp_path / "tables.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match=rf"needs \['{kind}_codec.tables'\].*--{kind}-codec trellis"):
        load_codebooks(tmp_path / "tables.safetensors")
    unnamed = json.loads(meta["vecinfer"])
    del unnamed[f"{kind}_codec"]
    save_file(tensors, str(tmp_path / "unnamed.safetensors"), metadata={"vecinfer": json.dumps(unnamed)})
    with pytest.raises(ValueError, match=f"metadata lacks {kind}_codec"):
        load_codebooks(tmp_path / "unnamed.safetensors")


def test_a_metric_codec_lowers_the_metric_error_below_the_squared_error_codec():
    """Under an error metric that weighs a few directions heavily (as query moments do), the codec
    fitted to the metric spends its bits there: its metric error is lower than the squared-error
    codec's, and analysis / synthesis stay inverses."""
    keys = skewed_keys(1, 3000, 16, seed=2)
    gen = torch.Generator().manual_seed(3)
    q = torch.linalg.qr(torch.randn(16, 16, generator=gen))[0]
    metric = (q * torch.logspace(2, 0, 16)) @ q.T  # eigenvalues 100 .. 1 along random directions
    fit, test = keys[:, :2000], keys[:, 2000:]
    weighted = TrellisCodec.fit(fit, 2.0, 6, metric=metric[None], train_vectors=1024, rounds=2)
    plain = TrellisCodec.fit(fit, 2.0, 6, train_vectors=1024, rounds=2)
    torch.testing.assert_close(weighted.analysis[0] @ weighted.synthesis[0], torch.eye(16, dtype=torch.float64))

    def metric_error(codec):
        r = (test - codec.quantize_dequantize(test))[0].double()
        return float(torch.einsum("nd,de,ne->", r, metric.double(), r))

    assert metric_error(weighted) < 0.8 * metric_error(plain), (metric_error(weighted), metric_error(plain))


def test_decoded_keys_keep_the_calibration_keys_spread():
    """The Lloyd tables decode to conditional means, which shrink keys toward the mean; the codec's
    per-head scale gives the decoded deviations the keys' mean squared norm again."""
    keys = skewed_keys(2, 1500, 32, seed=4)
    codec = TrellisCodec.fit(keys, 2.0, 6, train_vectors=1024, rounds=2)
    assert bool((codec.scale > 1.01).all()), codec.scale
    mean = codec.mean[:, None].float()
    spread = ((keys - mean) ** 2).sum((1, 2))
    decoded = ((codec.quantize_dequantize(keys) - mean) ** 2).sum((1, 2))
    torch.testing.assert_close(decoded, spread, rtol=0.03, atol=0)


def test_the_trial_script_runs_its_rows_on_the_tiny_model(tmp_path, tiny_dir, sample_text_path, capsys):
    """``studies/key_codec_trial.py`` end to end on the embedded model and text: every row's key
    error and perplexity, the scale on in ``trellis@L`` and off in ``trellis-unscaled@L``."""
    import json

    from vecinfer_compile.models import default_codebooks_dir

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
    import key_codec_trial

    out = tmp_path / "trial.json"
    key_codec_trial.main(
        [
            "--model",
            str(tiny_dir),
            "--calib-text",
            str(sample_text_path),
            "--codebooks",
            str(default_codebooks_dir() / "vecinfer-2bit.safetensors"),
            "--ppl-text",
            str(sample_text_path),
            "--rows",
            "codes,trellis@4,trellis-unscaled@4",
            "--calib-tokens",
            "1025",
            "--heldout-tokens",
            "512",
            "--train-vectors",
            "256",
            "--rounds",
            "1",
            "--ppl-windows",
            "1",
            "--ppl-window-len",
            "128",
            "--json",
            str(out),
            "--save-dir",
            str(tmp_path),
        ]
    )
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"codes", "trellis@4", "trellis-unscaled@4"}
    for r in rows.values():
        assert len(r["key_error"]) == 4 and all(0 < e < 1 for e in r["key_error"]) and r["ppl"] > 1
    assert all(s != 1.0 for layer in rows["trellis@4"]["scale"] for s in layer)
    from vecinfer_compile.codebooks import load_codebooks

    saved = load_codebooks(tmp_path / "trellis-4.safetensors")  # the row's codecs, as calibrate writes them
    assert saved.codecs == ("trellis", "codebooks")
    assert all(s == 1.0 for layer in rows["trellis-unscaled@4"]["scale"] for s in layer)
    assert "trellis@4 |" in capsys.readouterr().out


@pytest.mark.cuda
def test_cuda_codec_codes_as_well_as_the_reference():
    """On CUDA the codec encodes by the Triton Viterbi (one launch): its decoded vectors are as close
    to the input as the CPU reference's (ties may pick other states), for 8 KV heads at 2^10 states."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vecinfer_compile.codecs.trellis.packing import pack_walks

    keys = skewed_keys(8, 1200, 128, seed=5)
    codec = TrellisCodec.fit(keys[:, :1000], 2.0, 10, train_vectors=512, rounds=1)
    test = keys[:, 1000:].reshape(8, 2, 100, 128).transpose(0, 1)  # [B, H, T, D]
    errors = [((codec.quantize_dequantize(x).cpu() - test) ** 2).sum((0, 2, 3)) for x in (test, test.cuda())]
    torch.testing.assert_close(errors[1], errors[0], rtol=1e-4, atol=0)
    cuda_walks = codec.encode(test.cuda())  # the packed launch stores exactly the walks the other finds
    torch.testing.assert_close(codec.encode_packed(test.cuda()), pack_walks(cuda_walks, codec.bits))


@pytest.mark.cuda
def test_cuda_compiled_trellis_cache_gives_the_eager_cache_tokens(trellis_file, tiny_dir):
    """On CUDA (where generate() compiles the step into CUDA graphs) the compiled cache runs the
    fused trellis decode op in every decode step and gives the eager cache's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._dynamo.utils import counters

    from vecinfer_compile.evaluation.token_match import cache_tokens
    from vecinfer_compile.models import load_model

    cb, _ = trellis_file
    model, _ = load_model(tiny_dir, "float32", "cuda")
    ids = torch.arange(3, 43) % model.config.vocab_size
    eager = cache_tokens(model, ids, cb, new_tokens=24, residual=8, compiled=False)
    counters.clear()
    assert cache_tokens(model, ids, cb, new_tokens=24, residual=8, compiled=True) == eager
    assert counters["vecinfer"]["cache_decode_trellis"] >= model.config.num_hidden_layers


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from([1, 2, 8]),
    st.sampled_from([16, 64, 128]),
    st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0]),
    st.sampled_from([2, 5, 8, 12]),
    st.integers(1, 7),
    st.integers(0, 99),
)
def test_property_packed_codes_take_the_budget_and_give_back_every_state(h, d, bits, lbits, n, seed):
    """The stored string is exactly ``bits * D`` bits a token and head, and every component's state
    read from its window equals the Viterbi walk's (KV heads 1/2/8, head_dim 16/64/128, 1-3 bits)."""
    from vecinfer_compile.codecs.trellis.packing import component_states, pack_walks, packed_bytes

    assume(bits <= lbits)
    keys = skewed_keys(h, 150, d, seed)
    codec = TrellisCodec.fit(keys, bits, lbits, train_vectors=64, rounds=1, seed=seed)
    walks = codec.encode(keys[:, :n].reshape(1, h, n, d))  # [n, H, D]
    assert packed_bytes(codec.bits) == -(-round(bits * d) // 8)
    codes = pack_walks(walks, codec.bits)
    assert torch.equal(codec.encode_packed(keys[:, :n].reshape(1, h, n, d)), codes)
    assert codes.shape == (n, h, packed_bytes(codec.bits)) and codes.dtype == torch.uint8
    states = component_states(codes, codec.bits, codec.state_bits)
    torch.testing.assert_close(states, torch.where(codec.bits > 0, walks.long(), 0))


def test_packed_codes_refuse_misshapen_input():
    from vecinfer_compile.codecs.trellis.packing import component_states, pack_walks

    bits = torch.tensor([[2, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"need \[\.\.\., 1, 4\]"):
        pack_walks(torch.zeros(3, 2, 4, dtype=torch.int32), bits)
    with pytest.raises(ValueError, match="uint8"):
        component_states(torch.zeros(3, 1, 1, dtype=torch.int32), bits, 4)
    with pytest.raises(ValueError, match="state_bits"):
        component_states(torch.zeros(3, 1, 1, dtype=torch.uint8), bits, 17)


def test_calibration_refuses_a_trellis_too_small_for_the_bits(tiny_model):
    from vecinfer_compile.calibration import calibrate

    model, tokenizer = tiny_model
    with pytest.raises(ValueError, match="2 bits need more than 2 trellis states: raise --trellis-states"):
        calibrate(
            model, tokenizer, "text " * 50, bits=2, value_codec="trellis", codec_options={"states": 2}, progress=False
        )


def test_the_kernels_operands_decode_stored_codes_as_the_codec_decodes_its_walks():
    """The stored string read through :class:`TrellisOperands` (windows, tables, the scale folded
    into the synthesis) gives the codec's own decoding of the walk, for keys of a fitted codec."""
    from vecinfer_compile.codecs.trellis.operands import TrellisOperands
    from vecinfer_compile.codecs.trellis.packing import pack_walks

    keys = skewed_keys(2, 400, 64, seed=6)
    codec = TrellisCodec.fit(keys[:, :300], 2.0, 8, train_vectors=256, rounds=1)
    x = keys[:, 300:].reshape(2, 4, 25, 64).transpose(0, 1)  # [B, H, T, D]
    walks = codec.encode(x)  # [B*T, H, D]
    codes = pack_walks(walks, codec.bits).view(4, 25, 2, -1).transpose(1, 2)  # [B, H, T, bytes]
    decoded = TrellisOperands.of(codec, "cpu").vectors(codes)
    torch.testing.assert_close(decoded, codec.decode(walks, x.shape, torch.float32), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hkv, d, group", [(1, 128, 4), (4, 64, 1), (2, 64, 2)])
def test_a_centred_query_aware_cache_layer_reads_and_attends_through_the_codecs(hkv, d, group):
    """``qaware``-style transforms (query-aware matrices with the Hadamard folded in, a key mean) under
    the codecs, MQA / MHA / GQA, head_dim 64 and 128: the layer reads back what the codecs decode
    (keys through the inverse transform) and a decode step attends as SDPA over it. A file with a
    codec on one side only is refused by name."""
    import dataclasses

    from vecinfer_compile.codecs.trellis.code import random_code as random_trellis_codec
    from vecinfer_compile.testing import cache_layer, random_layer_codebooks

    gen = torch.Generator().manual_seed(d + hkv)
    base = random_layer_codebooks(hkv, d, query_aware=True, smooth=False, center=True, seed=hkv)
    codecs = {side: random_trellis_codec(gen, hkv, d, 2.0, 8) for side in ("keys", "values")}
    with pytest.raises(
        ValueError, match="keys with the trellis codec and the values with the codebooks codec.*one codec"
    ):
        cache_layer(
            dataclasses.replace(base, keys=codecs["keys"]),
            num_kv_heads=hkv,
            head_dim=d,
            max_cache_len=20,
            residual=3,
            batch_size=2,
        )
    layer = dataclasses.replace(base, **codecs)
    cached = cache_layer(layer, num_kv_heads=hkv, head_dim=d, max_cache_len=20, residual=3, batch_size=2)
    k, v = (torch.randn(2, hkv, 13, d, generator=gen) for _ in range(2))
    cached.update(k[:, :, :11], v[:, :, :11])
    for t in (11, 12):
        cached.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    k_read, v_read = cached.dequantized()
    kt = layer.transform.keys(k[:, :, :10])
    want_k = layer.transform.keys_inverse(layer.keys.quantize_dequantize(kt))
    torch.testing.assert_close(k_read[:, :, :10], want_k, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(v_read[:, :, :10], layer.values.quantize_dequantize(v[:, :, :10]), atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(k_read[:, :, 10:13], k[:, :, 10:13], atol=2e-4, rtol=2e-4)
    q = torch.randn(2, hkv * group, 1, d, generator=gen)
    mask = torch.zeros(2, 1, 1, 20, dtype=torch.bool)
    mask[:, :, :, :13] = True
    mask[0, :, :, :4] = False
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k_read.repeat_interleave(group, 1), v_read.repeat_interleave(group, 1), attn_mask=mask
    )
    torch.testing.assert_close(cached.attend(q, mask, None), want, atol=2e-4, rtol=2e-4)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4, 16]),
    d=st.sampled_from([64, 128]),
    n_coded=st.integers(0, 37),
    residual=st.integers(1, 9),
    fill=st.sampled_from(["empty", "partial", "full"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    left_pad=st.booleans(),
)
def test_property_a_decode_step_attends_as_sdpa_over_the_read(
    seed, b, hkv, group, d, n_coded, residual, fill, dtype, left_pad
):
    """``decode_step`` (the codes in the components, the window exactly, merged by log-sum-exp) = SDPA
    over what ``read`` gives for the same slots: GQA 1-16, head_dim 64/128, float32/bf16/fp16, odd
    lengths, the window empty, partial or full, left padding (a padded row still attends something)."""
    from vecinfer_compile.codecs.trellis.code import random_code as random_trellis_codec
    from vecinfer_compile.codecs.trellis.operands import TrellisOperands, decode_step
    from vecinfer_compile.codecs.trellis.reference import read

    gen = torch.Generator().manual_seed(seed)
    n_window = {"empty": 0, "partial": (residual + 1) // 2, "full": residual}[fill]
    assume(n_coded + n_window > 0)
    keys, values = (TrellisOperands.of(random_trellis_codec(gen, hkv, d, 2.0, 6), "cpu") for _ in range(2))
    slots = n_coded + residual + 3
    k_codes, v_codes = (
        torch.randint(0, 256, (b, hkv, slots, d // 4), generator=gen, dtype=torch.uint8) for _ in range(2)
    )
    k_window, v_window = (torch.randn(b, hkv, residual, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(b, hkv * group, 1, d, generator=gen).to(dtype)
    start = torch.randint(0, n_coded + n_window, (b,), generator=gen) if left_pad else None
    got = decode_step(
        q,
        k_codes,
        v_codes,
        torch.tensor(n_coded),
        k_window,
        v_window,
        torch.tensor(n_window),
        start,
        d**-0.5,
        keys,
        values,
    )
    k, v = read(k_codes, v_codes, n_coded, k_window, v_window, n_window, keys, values)
    slot = torch.arange(slots)
    mask = (slot < n_coded + n_window)[None].expand(b, slots)
    if start is not None:
        mask = mask & (slot[None] >= start[:, None])
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(),
        k.repeat_interleave(group, 1),
        v.repeat_interleave(group, 1),
        attn_mask=mask[:, None, None],
        scale=d**-0.5,
    )
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_the_needle_attention_diagnostic_runs_on_the_tiny_model(trellis_file, tiny_dir, tmp_path):
    """``studies/needle_attention_mass.py`` on the tiny model: the shipped 2-bit file and a
    trellis file, every layer; with every token coded the outputs move, with a window longer than
    the prompt nothing is coded and nothing moves."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
    import needle_attention_mass

    from vecinfer_compile.models import default_text_path

    _, trellis_path = trellis_file
    haystack = tmp_path / "haystack"
    haystack.mkdir()
    (haystack / "filler.txt").write_text(default_text_path().read_text())
    books = f"{tiny_dir.parent / 'tiny_codebooks' / 'vecinfer-2bit.safetensors'},{trellis_path}"
    common = [
        "--model",
        str(tiny_dir),
        "--haystack",
        str(haystack),
        "--codebooks",
        books,
        "--lengths",
        "96",
        "--depths",
        "0,50",
        "--trials",
        "1",
    ]
    coded = needle_attention_mass.main(common + ["--residual", "0"])
    kept = needle_attention_mass.main(common + ["--residual", "1000"])
    assert len(coded) == len(kept) == 2 * 4  # two files, the tiny model's 4 layers
    for row in kept.values():
        assert row["keys"] == row["values"] == row["both"] == row["mass abs change"] == 0.0 and row["same token"] == 1.0
    for row in coded.values():
        assert 0.0 <= row["exact mass"] <= 1.0 and row["both"] > 0.0 and row["values"] > 0.0


def test_a_qaware_trellis_file_compiles_on_an_mqa_model_with_the_eager_tokens(tiny_model):
    """``qaware``'s centred query-aware transform (the chain the decode rewrite moves to the query
    side) under the codecs, on a model of another geometry (Qwen2, one KV head, head_dim 32, random
    weights): the compiled cache's greedy tokens equal the eager cache's and the simulate path's;
    a chunked prefill's too (its chunks through ``trellis_chunk_attention``)."""
    import transformers
    from torch._dynamo.utils import counters

    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.evaluation.token_match import cache_tokens, simulate_tokens
    from vecinfer_compile.models import default_text_path

    _, tokenizer = tiny_model
    config = transformers.Qwen2Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    cb = calibrate(
        model,
        tokenizer,
        default_text_path().read_text(),
        bits=2,
        method="qaware",
        max_tokens=512,
        seq_len=128,
        iters=1,
        key_codec="trellis",
        value_codec="trellis",
        codec_options={"states": 16},
        progress=False,
    )
    ids = torch.arange(3, 43) % config.vocab_size
    eager = cache_tokens(model, ids, cb, new_tokens=12, residual=8, compiled=False)
    assert eager == simulate_tokens(model, ids, cb, new_tokens=12, residual=8)
    counters.clear()
    assert cache_tokens(model, ids, cb, new_tokens=12, residual=8, compiled=True) == eager
    assert counters["vecinfer"]["cache_decode_trellis"] >= config.num_hidden_layers
    chunked = cache_tokens(model, ids, cb, new_tokens=4, residual=8, compiled=False, prefill_chunk=16)
    assert cache_tokens(model, ids, cb, new_tokens=4, residual=8, compiled=True, prefill_chunk=16) == chunked
    assert counters["vecinfer"]["cache_chunk_trellis"] >= config.num_hidden_layers


def test_needle_refuses_a_keys_only_file_in_one_line(tiny_model, tiny_dir, tmp_path, capsys):
    """A file whose keys alone the codec codes runs in the simulate path only: ``vecinfer needle``
    (through the cache) exits 2 with one line naming the fix."""
    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.cli import main
    from vecinfer_compile.models import default_text_path

    model, tokenizer = tiny_model
    path = calibrate(
        model,
        tokenizer,
        default_text_path().read_text(),
        bits=2,
        max_tokens=256,
        seq_len=128,
        iters=1,
        key_codec="trellis",
        codec_options={"states": 16},
        progress=False,
    ).save(tmp_path / "keys-only.safetensors")
    haystack = tmp_path / "haystack"
    haystack.mkdir()
    (haystack / "filler.txt").write_text(default_text_path().read_text())
    rc = main(
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--haystack",
            str(haystack),
            "--codebooks",
            str(path),
            "--method",
            "vecinfer",
            "--bits",
            "2",
            "--lengths",
            "96",
            "--depths",
            "50",
            "--trials",
            "1",
            "--residual",
            "8",
            "--device",
            "cpu",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "keys with the trellis codec and the values with the codebooks codec" in err[0]
    assert "--value-codec trellis" in err[0]


def test_a_format_7_trellis_file_loads_without_its_unread_books(trellis_file, tmp_path):
    """Format 7 stored both sides' codebooks also where the trellis codec coded them: such a file
    converts to the same codecs, its books dropped."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from vecinfer_compile.codebooks import load_codebooks

    cb, path = trellis_file
    with safe_open(str(path), "pt") as f:
        meta, tensors = json.loads(f.metadata()["vecinfer"]), {k: f.get_tensor(k) for k in f.keys()}
    meta["format"] = "vecinfer-codebooks/7"
    for i in cb.attention_layers():
        for side in ("key", "value"):
            tensors[f"layers.{i}.{side}_centroids"] = torch.randn(256, 4)
    save_file(tensors, str(tmp_path / "v7.safetensors"), metadata={"vecinfer": json.dumps(meta)})
    back = load_codebooks(tmp_path / "v7.safetensors")
    assert back.codecs == ("trellis", "trellis") and back.metadata["converted_from"] == "vecinfer-codebooks/7"
    assert "codebooks" not in back.state_bytes()
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.keys.tables, b.keys.tables) and torch.equal(a.values.bits, b.values.bits)
