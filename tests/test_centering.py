"""Key centring (``K~ = (K - mu) A H``, queries unchanged): attention stays exact on every path
that mixes quantized and full-precision keys, the artifact stores ``mu`` (older files load as
``mu = 0``), tensor parallelism slices it, and calibration fits the rest of the transform to the
centred keys."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from vecinfer_compile.codebooks import FORMAT, LayerCodebooks, load_codebooks
from vecinfer_compile.codecs.codebooks import coded_kv
from vecinfer_compile.evaluation.kv_bytes import kv_bytes
from vecinfer_compile.hf.tensor_parallel import TPShard, local_layer
from vecinfer_compile.methods import SIMULATE_ONLY, VQ_METHODS
from vecinfer_compile.ops import reference
from vecinfer_compile.ops.decode_inputs import transform_queries
from vecinfer_compile.ops.split_attention.windowed import window_plan, windowed_attention
from vecinfer_compile.quant.codebook import quantize_dequantize
from vecinfer_compile.quant.query_aware import query_aware_matrices, second_moment
from vecinfer_compile.quant.transform import KeyTransform, centre_keys, smoothing_factors
from vecinfer_compile.simulate import simulated_attention
from vecinfer_compile.testing import random_codebooks, random_layer_codebooks, tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_cache import left_padded, tiny_config  # noqa: E402
from test_qaware import _rewrite  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

UNCENTRED = {"qaware": "qaware-nocenter", "vecinfer-center": "vecinfer"}  # the same methods without centring
CENTRED = list(UNCENTRED)


def _centred_transform(hkv: int, d: int, query_aware: bool, rotate: bool, seed: int) -> KeyTransform:
    gen = torch.Generator().manual_seed(seed)
    mean = 4 * torch.randn(hkv, d, generator=gen)
    if query_aware:
        q = torch.randn(hkv, 64, d, generator=gen) * (0.2 + 3 * torch.rand(d, generator=gen))
        k = torch.randn(hkv, 64, d, generator=gen) @ torch.randn(d, d, generator=gen)
        return KeyTransform(
            d, None, rotate, *query_aware_matrices(second_moment(q, hkv), second_moment(k, hkv)), mean=mean
        )
    return KeyTransform(d, 0.5 + 1.5 * torch.rand(hkv, d, generator=gen), rotate, mean=mean)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2]),
    tq=st.integers(1, 7),
    extra=st.integers(0, 6),
    residual=st.integers(0, 6),
    query_aware=st.booleans(),
    rotate=st.booleans(),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_centred_attention_is_exact_with_mixed_quantized_and_window_keys(
    b, hkv, group, tq, extra, residual, query_aware, rotate, causal, seed
):
    """``softmax(q~ K~^T) V == softmax(q K^T) V`` where each row mixes quantized keys and
    full-precision window keys: the eager simulate path (original domain, ``keys_inverse`` adds
    ``mu`` back) against the compile pass's windowed attention and the reference op (both in the
    shifted space: ``q~`` has no ``mu``). A negative control mixes shifted and unshifted keys."""
    d, tk = 16, tq + extra
    tr = _centred_transform(hkv, d, query_aware, rotate, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, hkv * group, tq, d, generator=gen)
    k = torch.randn(b, hkv, tk, d, generator=gen) + tr.mean[None, :, None, :]  # keys around mu
    v = torch.randn(b, hkv, tk, d, generator=gen)
    kc, vc = torch.randn(16, 4, generator=gen), torch.randn(16, 4, generator=gen)
    kt = tr.keys(k)
    kt_hat, v_hat = quantize_dequantize(kt, kc), quantize_dequantize(v, vc)
    scale = d**-0.5
    is_causal = causal and tq == tk  # SDPA's top-left causal mask, as the model uses it
    eager = simulated_attention(q, k, v, tr.keys_inverse(kt_hat), v_hat, None, is_causal, scale, residual)
    qt = tr.queries(q)
    if residual:
        plan = window_plan(qt, kt, None, is_causal, residual)
        compiled = windowed_attention(qt, kt_hat, kt, v_hat, v, plan, scale)
    else:
        compiled = torch.nn.functional.scaled_dot_product_attention(
            qt, kt_hat.repeat_interleave(group, 1), v_hat.repeat_interleave(group, 1), is_causal=is_causal, scale=scale
        )
    codes_k = reference.encode(kt, None, None, kc)
    codes_v = reference.encode(v, None, None, vc)
    ref = reference.attention(qt, codes_k, codes_v, kc, vc, kt, v, None, is_causal, scale, residual)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled, eager, **tol)
    torch.testing.assert_close(ref, eager, **tol)
    if 0 < residual < tk and not is_causal:  # rows mix both kinds: unshifted codes break exactness
        broken = simulated_attention(qt, kt, v, kt_hat + _shift(tr), v_hat, None, False, scale, residual)
        assert (broken - eager).abs().max() > 1e-3


def _shift(tr: KeyTransform) -> torch.Tensor:
    """``[1, H_kv, 1, D]``: what centring subtracts in the transformed space (``mu`` transformed)."""
    plain = KeyTransform(tr.head_dim, tr.lam, tr.rotate, tr.key_matrix, tr.query_matrix)
    return plain.keys(tr.mean[None, :, None, :])


# -- the artifact ----------------------------------------------------------------------------------
CONFIG = tiny_config()


@pytest.mark.parametrize("method", CENTRED)
def test_round_trip_keeps_the_mean(tmp_path, method):
    cb = random_codebooks(CONFIG, 2.0, method)
    back = load_codebooks(cb.save(tmp_path / "cb.safetensors"))
    assert back.method == method and back.metadata["format"] == FORMAT
    for a, b in zip(cb.layers, back.layers):
        assert b.transform.mean.shape == (2, 16) and torch.equal(a.transform.mean, b.transform.mean)
    uncentred = random_codebooks(CONFIG, 2.0, UNCENTRED[method])
    assert cb.nbytes() - uncentred.nbytes() == 4 * 2 * 2 * 16  # float32 [L, H_kv, D]


@pytest.mark.parametrize("method", sorted(VQ_METHODS))
def test_kv_bytes_fixed_cost_is_what_the_cache_holds(method):
    """The accounting's fixed bytes are the float32 state a real cache holds (the codebooks' own
    bytes plus the cache's rotation where it keeps one), for every method."""
    from vecinfer_compile.cache import VecInferCache
    from vecinfer_compile.evaluation.kv_bytes import cache_bytes

    cb = random_codebooks(CONFIG, 2.0, method)
    rotation = 4 * 16 * 16 if VQ_METHODS[method].rotate and not VQ_METHODS[method].query_aware else 0
    if method in SIMULATE_ONLY:  # no cache yet: the state it would hold
        assert kv_bytes(method, 2, CONFIG).fixed_bytes == cb.nbytes() + rotation
        return
    held = cache_bytes(VecInferCache(CONFIG, cb, batch_size=2, max_cache_len=8, residual=2))
    # random codebooks carry no error metrics, whatever the method's default
    assert kv_bytes(method, 2, CONFIG, weighted_codes=cb.weighted_codes).fixed_bytes == held.fixed
    assert held.fixed == cb.nbytes() + rotation


@pytest.mark.parametrize("method", CENTRED)
def test_older_files_load_as_mean_zero_and_broken_means_name_the_fix(tmp_path, method):
    path = random_codebooks(CONFIG, 2.0, method).save(tmp_path / "cb.safetensors")
    old = load_codebooks(_rewrite(path, tmp_path, meta={"format": "vecinfer-codebooks/3"}, drop=("key_mean",)))
    assert old.metadata["converted_from"] == "vecinfer-codebooks/3"
    assert all(layer.transform.mean is None for layer in old.layers)
    again = load_codebooks(old.save(tmp_path / "resaved.safetensors"))  # the current format says uncentred
    assert again.metadata["format"] == FORMAT and all(l.transform.mean is None for l in again.layers)
    with pytest.raises(ValueError, match=rf"needs tensor 'key_mean'.*--method {method}"):
        load_codebooks(_rewrite(path, tmp_path, drop=("key_mean",)))
    with pytest.raises(ValueError, match=r"key_mean has shape \(2, 2, 8\).*\(2, 2, 16\)"):
        load_codebooks(_rewrite(path, tmp_path, replace={"key_mean": torch.zeros(2, 2, 8)}))
    with pytest.raises(ValueError, match="NaN or inf"):
        load_codebooks(_rewrite(path, tmp_path, replace={"key_mean": torch.full((2, 2, 16), float("nan"))}))
    with pytest.raises(ValueError, match="does not centre keys"):
        load_codebooks(_rewrite(path, tmp_path, meta={"method": UNCENTRED[method]}))


def test_tensor_parallel_cuts_the_mean_to_the_rank():
    layer = random_layer_codebooks(4, 16, smooth=False, query_aware=True, center=True)
    for rank in range(2):
        heads = TPShard(rank, 2).kv_heads(4)
        cut = local_layer(layer, heads)
        assert torch.equal(cut.transform.mean, layer.transform.mean[heads])
        assert torch.equal(cut.transform.key_matrix, layer.transform.key_matrix[heads])
    plain = LayerCodebooks(KeyTransform(4, torch.ones(2, 4)), torch.zeros(256, 4), torch.zeros(256, 4))
    assert local_layer(plain, slice(1, 2)).transform.mean is None


# -- calibration -----------------------------------------------------------------------------------
def test_centre_keys_fits_the_rest_to_centred_keys():
    keys = torch.randn(2, 50, 8) + torch.arange(8.0)
    mean, centred = centre_keys(keys, True)
    torch.testing.assert_close(mean, keys.mean(1))
    torch.testing.assert_close(centred.mean(1), torch.zeros(2, 8), atol=1e-5, rtol=0)
    assert centre_keys(keys, False) == (None, keys)
    with pytest.raises(ValueError, match="NaN or inf"):
        centre_keys(torch.full((1, 3, 4), float("inf")), True)


@pytest.mark.parametrize("method", CENTRED)
def test_calibrate_stores_the_key_mean(tiny_model_and_tokenizer, sample_text_path, method):
    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.hf.recording import collect_kv

    model, tokenizer = tiny_model_and_tokenizer
    text = sample_text_path.read_text()
    cb = calibrate(model, tokenizer, text, bits=2, method=method, max_tokens=512, seq_len=256, iters=2, progress=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:512]
    keys, _ = collect_kv(model, torch.tensor(ids), 256, False)
    for i, layer in enumerate(cb.layers):
        torch.testing.assert_close(layer.transform.mean, keys[i].mean(1), rtol=1e-4, atol=1e-5)
        if layer.transform.lam is not None:  # smoothing of the centred keys
            expected = smoothing_factors((keys[i] - keys[i].mean(1, keepdim=True)).abs().amax(1))
            torch.testing.assert_close(layer.transform.lam, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_model_and_tokenizer(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_dir)


# -- every path that runs it -----------------------------------------------------------------------
@pytest.mark.parametrize("method", CENTRED)
def test_backend_transform_only_is_exact_and_compiled_simulate_matches_eager(method):
    from vecinfer_compile.backend import vecinfer_backend
    from vecinfer_compile.simulate import enable_simulation

    model = tiny_model("llama")
    cb = random_codebooks(model.config, 2.0, method)
    x = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(input_ids=x, use_cache=False).logits
        exact = torch.compile(
            model, backend=vecinfer_backend.configure(cb, method=method, quantize=False), fullgraph=True
        )(input_ids=x, use_cache=False).logits
        torch.testing.assert_close(exact, full, atol=1e-4, rtol=1e-4)
        torch._dynamo.reset()
        compiled = torch.compile(
            model, backend=vecinfer_backend.configure(cb, method=method, residual=4), fullgraph=True
        )(input_ids=x, use_cache=False).logits
        sim = enable_simulation(copy.deepcopy(model), method, bits=2, codebooks=cb, residual=4)
        simulated = sim(input_ids=x, use_cache=False).logits
    torch.testing.assert_close(compiled, simulated, atol=1e-4, rtol=1e-4)
    assert (compiled - full).abs().max() > 1e-3  # really quantized


@pytest.mark.parametrize("method", CENTRED)
def test_cache_decode_over_codes_and_window_is_exact(method):
    """After a prefill and appends, the reference decode op over the stored codes and the
    (centred) window with ``q~`` (no ``mu``) equals SDPA with the original ``q`` over the cache's
    eager read (original domain, ``mu`` added back); the whole window equals full precision."""
    from vecinfer_compile.cache import VecInferCache

    cfg = tiny_config(num_hidden_layers=1)
    cb = random_codebooks(cfg, 2.0, method, seed=3)
    gen = torch.Generator().manual_seed(4)
    cache = VecInferCache(cfg, cb, batch_size=2, max_cache_len=20, residual=4)
    layer = cache.layers[0]
    mean = cb.layer(0).transform.mean[None, :, None, :]
    k = torch.randn(2, 2, 9, 16, generator=gen) + mean
    v = torch.randn(2, 2, 9, 16, generator=gen)
    layer.update(k[:, :, :6], v[:, :, :6])
    for t in (6, 7, 8):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert (int(layer.storage.n_coded), int(layer.storage.n_window)) == (5, 4)
    k_read, v_read = layer.dequantized()
    torch.testing.assert_close(k_read[:, :, 5:9], k[:, :, 5:9], atol=1e-5, rtol=1e-5)  # the window
    assert (k_read[:, :, :5] - k[:, :, :5]).abs().max() > 1e-2  # the codes
    q = torch.randn(2, 4, 1, 16, generator=gen)
    valid = (torch.arange(20) < 9)[None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k_read.repeat_interleave(2, 1), v_read.repeat_interleave(2, 1), attn_mask=valid
    )
    s, qz = layer.storage, layer.quantizer
    q_t = transform_queries(q, qz.lam, qz.rotation, qz.key_read)
    out = reference.decode_attention(q_t, coded_kv(s, qz), None, 16**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", CENTRED)
def test_generate_through_the_cache_eager_and_compiled(method):
    """A window covering everything generates as full precision; with a small window the
    compiled decode (mean dropped, matrix moved to the queries) matches eager token for token."""
    from test_cache import generate
    from test_cache_compile import _check_rewritten_graph, _compiled_vs_eager
    from torch._dynamo.utils import counters

    from vecinfer_compile.cache import VecInferCache

    torch.manual_seed(0)
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg).eval()
    cb = random_codebooks(cfg, 2.0, method)
    ids, mask = left_padded(length=10, pad=3)
    ref = generate(model, ids, mask, max_new_tokens=6, do_sample=False)
    wide = VecInferCache(model, cb, batch_size=2, max_cache_len=16, residual=16)
    assert torch.equal(generate(model, ids, mask, wide, max_new_tokens=6, do_sample=False), ref)
    eager, compiled, backend, _, _ = _compiled_vs_eager(model, cb, ids, mask, tmax=20, residual=3)
    assert torch.equal(compiled, eager)
    assert counters["vecinfer"]["cache_decode_rewrites"] == cfg.num_hidden_layers
    assert counters["vecinfer"]["cache_decode_unfused"] == 0
    _check_rewritten_graph(backend.graphs[0], cfg.num_hidden_layers, 20, cfg.head_dim)
    means = [n for n in backend.graphs[0].graph.nodes if n.op == "placeholder" and n.name.endswith("key_mean")]
    assert len(means) == cfg.num_hidden_layers and all(len(n.users) == 1 for n in means)  # the new key's shift only


def test_zero_config_backend_centres_when_asked():
    from vecinfer_compile.backend import vecinfer_backend

    model = tiny_model("llama")
    backend = vecinfer_backend.configure(method="vecinfer-center")
    x = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(input_ids=x, use_cache=False)
    assert all(layer.transform.mean is not None for layer in backend.fitted.values())
