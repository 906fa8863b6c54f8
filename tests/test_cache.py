"""VecInferCache: bookkeeping (property test), eager generate, kv_bytes, errors, cache_kv op."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from vecinfer_compile.cache import VecInferCache
from vecinfer_compile.codecs.codebooks import coded_kv
from vecinfer_compile.evaluation.kv_bytes import kv_bytes
from vecinfer_compile.hf.compat import cache_kwargs, forward_cache_kwargs
from vecinfer_compile.ops import dequantize as cache_ops
from vecinfer_compile.presets import get_preset
from vecinfer_compile.quant.packing import unpack_codes
from vecinfer_compile.quant.transform import KeyTransform
from vecinfer_compile.testing import cache_layer, random_codebooks

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw) -> LlamaConfig:
    args = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    args.update(kw)
    return LlamaConfig(**args)


def left_padded(batch=2, length=10, pad=3, vocab=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :pad] = 0
    mask[0, :pad] = 0
    return ids, mask


def generate(model, ids, mask, cache=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = {} if cache is None else cache_kwargs(cache)
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **extra, **kw)


def make_layer(b, h, d, r, tmax, bits=2.0, seed=0, dtype=torch.float32):
    cfg = tiny_config(num_hidden_layers=1, num_attention_heads=h, num_key_value_heads=h, head_dim=d, hidden_size=h * d)
    cb = random_codebooks(cfg, bits=bits, seed=seed)
    return cache_layer(
        cb.layer(0), num_kv_heads=h, head_dim=d, max_cache_len=tmax, residual=r, batch_size=b, dtype=dtype
    )


def assert_nearest(codes, x, centroids, what):
    """Each code is a nearest centroid of its sub-vector (ties / last-ulp rounding allowed):
    catches any lost, duplicated or reordered token since the data are random."""
    dims = centroids.shape[1]
    sub = x.double().reshape(*x.shape[:-1], x.shape[-1] // dims, dims)
    dist = ((sub[..., None, :] - centroids.double()) ** 2).sum(-1)  # [..., n, E]
    chosen = dist.gather(-1, unpack_codes(codes, centroids.shape[0])[..., None]).squeeze(-1)
    best = dist.min(-1).values
    assert torch.all(chosen <= best + 1e-5 * (1 + best)), f"{what}: codes are not the nearest centroids"


# -- the window / flush bookkeeping ------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 2),
    r=st.integers(0, 6),
    prefill=st.integers(1, 12),
    chunks=st.lists(st.integers(1, 3), min_size=0, max_size=12),
    seed=st.integers(0, 2**16),
    bits=st.sampled_from([2.0, 1.5, 1.25]),
)
def test_property_no_token_lost_duplicated_or_reordered(b, h, r, prefill, chunks, seed, bits):
    d = 16
    sizes = [prefill] + chunks
    tmax = sum(sizes)
    layer = make_layer(b, h, d, r, tmax, bits=bits, seed=seed % 7)
    s, qz = layer.storage, layer.quantizer
    gen = torch.Generator().manual_seed(seed)
    ks, kts, vs = [], [], []
    for i, t in enumerate(sizes):
        k = torch.randn(b, h, t, d, generator=gen)
        v = torch.randn(b, h, t, d, generator=gen)
        ks.append(k), vs.append(v), kts.append(layer.transform_keys(k))
        coded_before = int(s.n_coded)
        rk, rv = layer.update(k, v)
        total = sum(sizes[: i + 1])
        n_coded, n_window = int(s.n_coded), int(s.n_window)
        assert n_coded + n_window == total
        assert n_window == min(r, total)
        assert layer.get_seq_length() == total
        kt_all, v_all, k_all = torch.cat(kts, 2), torch.cat(vs, 2), torch.cat(ks, 2)
        # full precision window == the last n_window tokens exactly
        assert torch.equal(s.k_window[:, :, :n_window], kt_all[:, :, n_coded:])
        assert torch.equal(s.v_window[:, :, :n_window], v_all[:, :, n_coded:])
        # codes == encode(all tokens but the last R), in order
        assert_nearest(s.k_codes[:, :, :n_coded], kt_all[:, :, :n_coded], qz.operands.key_centroids, "keys")
        assert_nearest(s.v_codes[:, :, :n_coded], v_all[:, :, :n_coded], qz.operands.value_centroids, "values")
        if i == 0:  # prefill returns the full-precision inputs
            assert rk is k and rv is v
            assert layer.get_mask_sizes(1) == (tmax, 0)
        else:  # decode returns dequantized K/V in the original domain, every slot (HF's mask is as
            # long: get_mask_sizes). One token reads the layer after the append; a chunk the coded
            # slots before it, then the old window and itself in full precision (the chunk rule of vecinfer_compile.window)
            assert rk.shape == (b, h, tmax, d)
            assert layer.get_mask_sizes(1) == (tmax, 0) and layer.get_mask_sizes(2) == (tmax, 0)
            coded = n_coded if t == 1 else coded_before
            torch.testing.assert_close(rk[:, :, coded:total], k_all[:, :, coded:], rtol=1e-5, atol=1e-5)
            assert torch.equal(rv[:, :, coded:total], v_all[:, :, coded:])
            v_idx = unpack_codes(s.v_codes[:, :, :n_coded], qz.operands.value_centroids.shape[0])
            dec_v = qz.operands.value_centroids[v_idx].reshape(b, h, n_coded, d)
            assert torch.equal(rv[:, :, :coded], dec_v[:, :, :coded])
            full_k, full_v = layer.dequantized()  # the static read: every slot, zeros past the valid ones
            assert full_k.shape == (b, h, tmax, d) and torch.equal(full_v[:, :, :n_coded], dec_v)
            assert torch.equal(full_v[:, :, n_coded:total], v_all[:, :, n_coded:])
            assert not full_k[:, :, total:].any() and not full_v[:, :, total:].any()
            assert not rk[:, :, total:].any() and not rv[:, :, total:].any()


def test_prefill_longer_than_window_and_reset():
    layer = make_layer(1, 2, 16, 4, 32)
    assert layer.get_mask_sizes(7) == (7, 0) and layer.get_seq_length() == 0
    k, v = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    layer.update(k, v)
    assert (int(layer.storage.n_coded), int(layer.storage.n_window)) == (6, 4)
    layer.reset()
    assert layer.get_seq_length() == 0 and int(layer.storage.n_coded) == 0 and not layer.storage.k_codes.any()
    layer.update(k[:, :, :3], v[:, :, :3])
    assert (int(layer.storage.n_coded), int(layer.storage.n_window)) == (0, 3)


# -- eager generate ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).eval()


def test_generate_large_window_equals_full_precision(tiny_model):
    ids, mask = left_padded()
    cb = random_codebooks(tiny_model.config)
    ref = generate(tiny_model, ids, mask, max_new_tokens=8, do_sample=False)
    cache = VecInferCache(tiny_model, cb, batch_size=2, max_cache_len=18, residual=18)
    out = generate(tiny_model, ids, mask, cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)


def test_generate_small_window_reads_codes(tiny_model):
    ids, mask = left_padded()
    cb = random_codebooks(tiny_model.config)
    cache = VecInferCache(tiny_model, cb, batch_size=2, max_cache_len=24, residual=3)
    out = generate(tiny_model, ids, mask, cache, max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 18)
    layer = cache.layers[0]
    assert (int(layer.storage.n_coded), int(layer.storage.n_window)) == (14, 3)  # 10 + 8 - 1 tokens went through
    # the decoded logits differ from full precision (codes are read) but stay finite
    full = tiny_model(out, attention_mask=torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], 1)).logits
    assert torch.isfinite(full).all()


def test_generate_sampling_and_eos(tiny_model):
    ids, mask = left_padded(seed=3)
    cb = random_codebooks(tiny_model.config)
    cache = VecInferCache(tiny_model, cb, batch_size=2, max_cache_len=30, residual=4)
    torch.manual_seed(0)
    out = generate(
        tiny_model, ids, mask, cache, max_new_tokens=6, do_sample=True, top_k=20, eos_token_id=int(ids[1, -1])
    )
    assert out.shape[0] == 2 and 11 <= out.shape[1] <= 16


def test_generate_tiny_checkpoint(shared_tiny_dir):
    model = LlamaForCausalLM.from_pretrained(shared_tiny_dir, dtype=torch.float32).eval()
    cb = random_codebooks(model.config, bits=2.0)
    ids, mask = left_padded(vocab=model.config.vocab_size, length=12, pad=4)
    ref = generate(model, ids, mask, max_new_tokens=6, do_sample=False)
    cache = VecInferCache(model, cb, batch_size=2, max_cache_len=17, residual=17)
    assert torch.equal(generate(model, ids, mask, cache, max_new_tokens=6, do_sample=False), ref)
    cache = VecInferCache(model, cb, batch_size=2, max_cache_len=17, residual=4)
    out = generate(model, ids, mask, cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (2, 18) and int(cache.layers[0].storage.n_coded) == 13


@pytest.mark.parametrize(
    "method,heads,kv_heads,head_dim",
    [
        ("vecinfer", 4, 2, 16),  # GQA
        ("qaware", 4, 2, 16),  # the read's key matrix and key mean on the shorter read
        ("vecinfer", 4, 1, 64),  # MQA
        ("vecinfer", 2, 2, 128),  # MHA
    ],
)
def test_eager_valid_slot_read_equals_the_static_read(monkeypatch, method, heads, kv_heads, head_dim):
    """An eager chunk attends over the codes by the chunk rule (``vecinfer_sdpa``: the coded prefix
    and the full-precision window and chunk) and an eager 1-token step reads the codes (decode
    attention over codes and window); the logits equal those of the static full-length dequantized
    read that compiled code sees (forced here by making the cache believe it is being compiled),
    batch 2 with left padding, for a prompt, a 5-token chunk and a 1-token step. HF's mask is
    ``max_cache_len`` long either way (``get_mask_sizes``)."""
    from vecinfer_compile.cache import layer as layer_module

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        tiny_config(
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=heads * head_dim
        )
    ).eval()
    cb = random_codebooks(model.config, 2.0, method)
    ids, mask = left_padded(length=16, pad=3, seed=5)
    chunks = [(0, 10), (10, 15), (15, 16)]

    def logits(static: bool):
        cache = VecInferCache(model, cb, batch_size=2, max_cache_len=40, residual=3)
        out = []
        with monkeypatch.context() as m:
            if static:
                m.setattr(layer_module, "_is_compiling", lambda: True)
            for a, b in chunks:
                pos = torch.arange(a, b)
                if a:  # the mask length HF will build for this update
                    assert cache.layers[0].get_mask_sizes(b - a) == (40, 0)
                with torch.no_grad():
                    out.append(
                        model(
                            input_ids=ids[:, a:b],
                            attention_mask=mask[:, :b],
                            **forward_cache_kwargs(model, cache),
                            use_cache=True,
                            cache_position=pos,
                        ).logits
                    )
        layer = cache.layers[0]
        assert (int(layer.storage.n_coded), int(layer.storage.n_window)) == (13, 3)
        return out

    for got, want in zip(logits(False), logits(True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- bytes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_bits", [[2.0, 2.0], [1.25, 1.25], [3.0, 3.0], [4.0, 1.0], [1.5, 2.0]])
def test_kv_bytes_arithmetic(layer_bits):
    cfg = tiny_config()
    cb = random_codebooks(cfg, layer_bits=layer_bits)
    b, tmax, r, hkv, d = 3, 50, 8, 2, 16
    cache = VecInferCache(cfg, cb, batch_size=b, max_cache_len=tmax, residual=r, dtype=torch.bfloat16)
    code_bytes = lambda spec: d * math.log2(spec.entries) / spec.dims / 8  # noqa: E731  nominal = physical
    total = 4 * d * d  # one shared rotation
    for bits in layer_bits:
        p = get_preset(bits)
        total += (
            b * hkv * tmax * code_bytes(p.key)
            + b * hkv * tmax * code_bytes(p.value)
            + 2 * b * hkv * r * d * 2  # bf16 windows
            + 2 * 8  # two int64 counters
            + 4 * (p.key.entries * p.key.dims + p.value.entries * p.value.dims)  # f32 codebooks
            + 4 * hkv * d  # f32 lam
        )
    assert cache.kv_bytes() == total
    accounting = kv_bytes("vecinfer", cb.bits, cfg, layer_bits=cb.layer_bits)  # the evaluation's model
    windows_and_fixed = sum(2 * b * hkv * r * d * 2 + 2 * 8 for _ in layer_bits) + 4 * d * d
    codebooks_f32 = sum(
        4 * hkv * d
        + 4
        * (get_preset(x).key.entries * get_preset(x).key.dims + get_preset(x).value.entries * get_preset(x).value.dims)
        for x in layer_bits
    )
    assert b * tmax * accounting.bytes_per_token == total - windows_and_fixed - codebooks_f32
    assert cache.fp_kv_bytes() == len(layer_bits) * 2 * b * hkv * tmax * d * 2


# -- errors --------------------------------------------------------------------------------------
def test_error_wrong_dtype(tiny_model):
    cb = random_codebooks(tiny_model.config)
    cache = VecInferCache(tiny_model.config, cb, batch_size=2, max_cache_len=20, dtype=torch.bfloat16)
    ids, mask = left_padded()
    with pytest.raises(TypeError, match="dtype"):
        generate(tiny_model, ids, mask, cache, max_new_tokens=2)


def test_error_codebooks_for_another_model(tiny_model):
    other = random_codebooks(tiny_config(head_dim=32, hidden_size=128))
    with pytest.raises(ValueError, match="another model"):
        VecInferCache(tiny_model, other, batch_size=1, max_cache_len=8)
    with pytest.raises(TypeError, match="VecInferCodebooks"):
        VecInferCache(tiny_model, {"not": "codebooks"}, batch_size=1, max_cache_len=8)


def test_error_head_dim_mismatch():
    layer = make_layer(1, 2, 16, 4, 16)
    with pytest.raises(ValueError, match="head_dim"):
        layer.update(torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32))
    with pytest.raises(ValueError, match="batch_size"):
        layer.update(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16))


def test_error_beyond_max_cache_len(tiny_model):
    layer = make_layer(1, 2, 16, 4, 8)
    with pytest.raises(ValueError, match="increase max_cache_len"):
        layer.update(torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16))
    layer.update(torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16))
    layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    with pytest.raises(ValueError, match="increase max_cache_len"):
        layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    cb = random_codebooks(tiny_model.config)
    cache = VecInferCache(tiny_model, cb, batch_size=2, max_cache_len=12, residual=4)
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="increase max_cache_len"):
        generate(tiny_model, ids, mask, cache, max_new_tokens=8, do_sample=False)


def _valid_state(layer) -> list[torch.Tensor]:
    """What a layer's reads depend on: the counters, the filled code slots and window slots."""
    s = layer.storage
    c, w = int(s.n_coded), int(s.n_window)
    return [s.n_coded, s.n_window, s.k_codes[:, :, :c], s.v_codes[:, :, :c], s.k_window[:, :, :w], s.v_window[:, :, :w]]


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    d=st.sampled_from([16, 64]),
    r=st.integers(0, 5),
    prefill=st.integers(1, 9),
    steps=st.integers(1, 10),
    bits=st.sampled_from([2.0, 1.5]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    data=st.data(),
)
def test_crop_undoes_the_last_one_token_step(b, h, d, r, prefill, steps, bits, dtype, data):
    """transformers' deferred stop check runs one decode step too many and undoes it with
    ``crop(-1)``: a layer that took an extra token and cropped it holds exactly what a layer
    that never took it holds, at once and after the steps that follow (window full or not, a
    token pushed into the codes or not, R = 0)."""
    undone_at = data.draw(st.integers(0, steps - 1))
    undo, plain = (make_layer(b, h, d, r, prefill + steps + 1, bits=bits, seed=3, dtype=dtype) for _ in range(2))
    gen = torch.Generator().manual_seed(prefill * 100 + steps)
    tokens = [
        (torch.randn(b, h, t, d, generator=gen).to(dtype), torch.randn(b, h, t, d, generator=gen).to(dtype))
        for t in [prefill] + [1] * steps
    ]
    extra = (torch.randn(b, h, 1, d, generator=gen).to(dtype), torch.randn(b, h, 1, d, generator=gen).to(dtype))
    for layer in (undo, plain):
        layer.update(*tokens[0])
    undo.activate_past_recording()
    for i, step in enumerate(tokens[1:]):
        if i == undone_at:
            undo.update(*extra)
            undo.crop(-1)
            assert all(torch.equal(x, y) for x, y in zip(_valid_state(undo), _valid_state(plain)))
        undo.update(*step)
        plain.update(*step)
        assert all(torch.equal(x, y) for x, y in zip(_valid_state(undo), _valid_state(plain)))
        assert torch.equal(undo.dequantized()[0], plain.dequantized()[0])


def test_recording_switched_on_before_the_buffers_exist():
    """A layer without a batch size yet (buffers made at its first update) can be told to record:
    the undo buffers come with the others."""
    cfg = tiny_config(num_hidden_layers=1)
    layer = VecInferCache(cfg, random_codebooks(cfg), max_cache_len=12, residual=2).layers[0]
    assert not layer.is_initialized
    layer.activate_past_recording()
    k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    layer.update(k, v)
    state = [t.clone() for t in _valid_state(layer)]
    layer.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    layer.crop(-1)
    assert all(torch.equal(x, y) for x, y in zip(_valid_state(layer), state))


def test_error_crop_and_sliding():
    layer = make_layer(1, 2, 16, 4, 8)
    layer.crop(0)
    with pytest.raises(NotImplementedError, match="records its past"):  # not recording
        layer.crop(-1)
    layer.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))
    layer.activate_past_recording()
    layer.update(torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16))
    with pytest.raises(NotImplementedError, match="appended 2 tokens"):
        layer.crop(-1)
    with pytest.raises(NotImplementedError, match="drop only the last token"):
        layer.crop(-2)
    cfg = tiny_config(layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="sets no sliding_window"):  # (with a window it is a hybrid model)
        VecInferCache(cfg, random_codebooks(cfg), batch_size=1, max_cache_len=8)


# -- the cache_kv op -----------------------------------------------------------------------------
def _cache_kv_args(lam=True, rot=True, bits=2.0):
    layer = make_layer(2, 2, 16, 4, 12, bits=bits)
    layer.update(torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16))
    layer.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    s, qz = layer.storage, layer.quantizer
    return (*coded_kv(s, qz), qz.lam if lam else None, qz.rotation if rot else None)


@pytest.mark.parametrize("lam,rot,bits", [(True, True, 2.0), (False, False, 1.25), (True, False, 3.0)])
def test_cache_kv_opcheck(lam, rot, bits):
    torch.library.opcheck(torch.ops.vecinfer.cache_kv.default, _cache_kv_args(lam, rot, bits))


def test_cache_kv_row_chunks_equal_one_pass(monkeypatch):
    """The read computed one batch row at a time (as at large batches) equals the one-pass read."""
    args = _cache_kv_args()
    whole = torch.ops.vecinfer.cache_kv(*args)
    monkeypatch.setattr(cache_ops, "ROW_CHUNK_ELEMENTS", 1)
    for got, want in zip(torch.ops.vecinfer.cache_kv(*args), whole):
        assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [2.0, 1.5])
def test_cache_kv_matches_keys_inverse(bits):
    args = _cache_kv_args(bits=bits)
    k, v = torch.ops.vecinfer.cache_kv(*args)
    k_codes, _, kc, _, n_coded, k_window, _, n_window, lam, rot = args
    c, w = int(n_coded), int(n_window)
    tr = KeyTransform(16, lam, True)
    dec = kc[unpack_codes(k_codes[:, :, :c], kc.shape[0])].reshape(2, 2, c, 16)
    torch.testing.assert_close(k[:, :, :c], tr.keys_inverse(dec))
    torch.testing.assert_close(k[:, :, c : c + w], tr.keys_inverse(k_window[:, :, :w]))
    assert not k[:, :, c + w :].any() and math.prod(v.shape) == 2 * 2 * 12 * 16


def test_batch_size_from_the_first_update(tiny_model):
    """Without batch_size the cache allocates at generate()'s prefill, like HF's static layers,
    and generates exactly what a cache sized up front does."""
    ids, mask = left_padded()
    cb = random_codebooks(tiny_model.config)
    sized = VecInferCache(tiny_model, cb, batch_size=2, max_cache_len=24, residual=3)
    lazy = VecInferCache(tiny_model, cb, max_cache_len=24, residual=3)
    assert not lazy.layers[0].is_initialized and lazy.get_seq_length() == 0
    with pytest.raises(RuntimeError, match="no batch size yet"):
        lazy.fp_kv_bytes()
    want = generate(tiny_model, ids, mask, sized, max_new_tokens=6, do_sample=False)
    got = generate(tiny_model, ids, mask, lazy, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert lazy.layers[0].batch_size == 2 and lazy.kv_bytes() == sized.kv_bytes()


def test_cache_refuses_a_simulating_model(tiny_model):
    from vecinfer_compile import disable_simulation, enable_simulation, simulation

    cb = random_codebooks(tiny_model.config)
    before = tiny_model.config._attn_implementation  # sdpa, or vecinfer_sdpa once a cache switched it
    enable_simulation(tiny_model, "vecinfer", bits=2, codebooks=cb)
    try:
        with pytest.raises(ValueError, match="disable_simulation"):
            VecInferCache(tiny_model, cb, max_cache_len=24)
    finally:
        disable_simulation(tiny_model)
    with simulation(tiny_model, "vecinfer", bits=2, codebooks=cb):
        assert tiny_model.config._attn_implementation == "vecinfer"
    assert tiny_model.config._attn_implementation == before
    VecInferCache(tiny_model, cb, max_cache_len=24)  # simulation is off again


def test_generate_keyword_is_not_deprecated(tiny_model):
    """cache_kwargs uses the keyword the installed transformers wants: no deprecation warning."""
    ids, mask = left_padded()
    cache = VecInferCache(tiny_model, random_codebooks(tiny_model.config), max_cache_len=24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.filterwarnings("error", message=".*past_key_values.*deprecated.*")
        tiny_model.generate(
            ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=2, do_sample=False, pad_token_id=0
        )


def _prefill(model, ids, cache, chunk):
    """All of ``ids`` into ``cache`` in chunks of ``chunk`` tokens (positions from 0)."""
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            end = min(start + chunk, ids.shape[1])
            pos = torch.arange(start, end)
            model(
                input_ids=ids[:, start:end],
                attention_mask=torch.ones_like(ids[:, :end]),
                **forward_cache_kwargs(model, cache),
                position_ids=pos[None].expand(ids.shape[0], -1),
                cache_position=pos,
            )


def test_filling_rows_equals_filling_the_batch(tiny_model):
    """Rows prefilled a group at a time (filling_rows) leave the same codes, window and counters
    as the whole batch prefilled at once, and generate() then gives the same tokens."""
    ids = torch.randint(3, 128, (5, 13), generator=torch.Generator().manual_seed(4))
    cb = random_codebooks(tiny_model.config)
    whole = VecInferCache(tiny_model, cb, batch_size=5, max_cache_len=24, residual=3)
    grouped = VecInferCache(tiny_model, cb, batch_size=5, max_cache_len=24, residual=3)
    _prefill(tiny_model, ids[:, :-1], whole, chunk=5)
    for start, stop in ((0, 2), (2, 4), (4, 5)):
        with grouped.filling_rows(start, stop) as part:
            _prefill(tiny_model, ids[start:stop, :-1], part, chunk=5)
    for a, b in zip(whole.layers, grouped.layers):  # (a batch of 2 rows rounds its matmuls unlike 5)
        for name in ("k_codes", "v_codes", "n_coded", "n_window"):
            assert torch.equal(getattr(a.storage, name), getattr(b.storage, name)), name
        for name in ("k_window", "v_window"):
            torch.testing.assert_close(getattr(a.storage, name), getattr(b.storage, name), atol=1e-5, rtol=1e-5)
    assert (int(grouped.layers[0].storage.n_coded), int(grouped.layers[0].storage.n_window)) == (9, 3)
    mask = torch.ones_like(ids)
    out_whole = generate(tiny_model, ids, mask, whole, max_new_tokens=4, do_sample=False)
    out_grouped = generate(tiny_model, ids, mask, grouped, max_new_tokens=4, do_sample=False)
    assert torch.equal(out_whole, out_grouped)


def test_filling_rows_refuses_groups_of_different_lengths(tiny_model):
    ids = torch.randint(3, 128, (4, 9), generator=torch.Generator().manual_seed(5))
    cache = VecInferCache(tiny_model, random_codebooks(tiny_model.config), batch_size=4, max_cache_len=16, residual=3)
    with cache.filling_rows(0, 2) as part:
        _prefill(tiny_model, ids[:2], part, chunk=4)
    with pytest.raises(ValueError, match="fill every row group to the same length"):
        with cache.filling_rows(2, 4) as part:
            _prefill(tiny_model, ids[2:, :7], part, chunk=4)
    with pytest.raises(ValueError, match="not inside the cache's 4 rows"):
        with cache.filling_rows(3, 5):
            pass
    lazy = VecInferCache(tiny_model, random_codebooks(tiny_model.config), max_cache_len=16)
    with pytest.raises(RuntimeError, match="build it with batch_size="):
        with lazy.filling_rows(0, 1):
            pass
