"""Error-weighted codes (:mod:`vecinfer_compile.quant.weighted_codes`): the descent, the metrics,
calibration and the file, the simulate path (eager and compiled), the cache (prefill, chunks,
one-token appends and generate() against simulate, across attention kinds), the CUDA encoder's
append."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from vecinfer_compile.cache import LayerQuantizer, VecInferLayer
from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.ops.append import encode_flush
from vecinfer_compile.quant import codebook, weighted_codes
from vecinfer_compile.quant.packing import unpack_codes
from vecinfer_compile.quant.weighted_codes import key_metric, value_metric, weighted_indices, weighted_loss
from vecinfer_compile.testing import cache_layer, random_codebooks

pytestmark = pytest.mark.usefixtures("one_thread")


def spd(heads: int, dim: int, gen: torch.Generator, spread: float = 1.0) -> torch.Tensor:
    """Random symmetric positive definite ``[heads, dim, dim]``."""
    a = torch.randn(heads, dim, dim, generator=gen) * spread
    return a @ a.transpose(-1, -2) / dim + 0.1 * torch.eye(dim)


class CharIds:
    """A tokenizer stand-in for calibrate(): any text is its characters' ids (mod 128)."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) % 128 for ch in text]}


def dequant(idx, centroids):
    return centroids[idx].reshape(*idx.shape[:-1], idx.shape[-1] * centroids.shape[1])


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 12),
    subs=st.integers(1, 6),
    dims=st.sampled_from([1, 2, 4, 8]),
    entries=st.sampled_from([2, 16, 256]),
    weight=st.sampled_from([1.0, 8.0]),
    sweeps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_property_the_descent_never_raises_the_loss(b, h, t, subs, dims, entries, weight, sweeps, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, subs * dims, generator=gen) * 2
    c = torch.randn(entries, dims, generator=gen)
    m = spd(h, subs * dims, gen)
    start = codebook.encode(x, c, weight).long()
    idx = weighted_indices(x, start, c, m, weight, sweeps)
    assert idx.shape == start.shape and idx.dtype == torch.int64
    assert int(idx.min()) >= 0 and int(idx.max()) < entries
    before = weighted_loss(x, dequant(start, c), m, weight)
    after = weighted_loss(x, dequant(idx, c), m, weight)
    assert torch.all(after <= before * (1 + 1e-5) + 1e-5)


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 30), dims=st.sampled_from([2, 4]), weight=st.sampled_from([1.0, 8.0]), seed=st.integers(0, 2**16)
)
def test_property_one_subvector_takes_the_exact_optimum(t, dims, weight, seed):
    """With one sub-vector per head vector a sweep is an exhaustive search: it must find the
    centroid of the lowest loss (brute force over every centroid)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, t, dims, generator=gen)
    c = torch.randn(64, dims, generator=gen)
    m = spd(2, dims, gen, spread=3.0)
    idx = weighted_indices(x, codebook.encode(x, c).long(), c, m, weight, sweeps=1)
    every = c[None, None, None].expand(1, 2, t, 64, dims)
    losses = weighted_loss(
        x[:, :, :, None].expand_as(every).reshape(1, 2, t * 64, dims), every.reshape(1, 2, t * 64, dims), m, weight
    ).reshape(1, 2, t, 64)
    chosen = losses.gather(-1, idx)
    torch.testing.assert_close(chosen[..., 0], losses.min(-1).values, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(2, 40),
    entries=st.sampled_from([16, 256]),
    weight=st.sampled_from([1.0, 8.0]),
    seed=st.integers(0, 2**16),
)
def test_property_the_codes_do_not_depend_on_the_chunking(b, t, entries, weight, seed):
    """The descent runs over chunks of tokens (:data:`CHUNK_ELEMENTS` losses at a time); one token
    a chunk gives the codes of one chunk for all."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 2, t, 16, generator=gen) * 2
    c = torch.randn(entries, 4, generator=gen)
    m = spd(2, 16, gen)
    start = codebook.encode(x, c, weight).long()
    whole = weighted_indices(x, start, c, m, weight)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weighted_codes, "CHUNK_ELEMENTS", 1)
        assert torch.equal(weighted_indices(x, start, c, m, weight), whole)


def test_the_identity_metric_keeps_the_nearest_centroid():
    """Under ``M = I`` (and no parallel term) the nearest centroid of each sub-vector is already
    optimal: the descent keeps every code."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 16, generator=gen)
    c = torch.randn(256, 4, generator=gen)
    start = codebook.encode(x, c).long()
    assert torch.equal(weighted_indices(x, start, c, torch.eye(16).expand(3, 16, 16), 1.0), start)


def test_an_anisotropic_metric_lowers_its_error_against_the_nearest_centroid():
    """What the codes are for: under a metric with a strong direction the weighted codes have
    clearly less error in that metric than the nearest centroid, for more squared error."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 2000, 16, generator=gen)
    c = torch.randn(256, 4, generator=gen)
    u = torch.randn(16, generator=gen)
    m = (torch.eye(16) + 10 * torch.outer(u, u) / u.dot(u))[None]
    start = codebook.encode(x, c).long()
    idx = weighted_indices(x, start, c, m)
    plain, weighted = dequant(start, c), dequant(idx, c)
    assert weighted_loss(x, weighted, m).mean() < 0.8 * weighted_loss(x, plain, m).mean()
    assert ((x - weighted) ** 2).sum(-1).mean() > ((x - plain) ** 2).sum(-1).mean()


def test_value_metric_is_o_proj_gram_per_kv_head():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 4 * 8, generator=gen)  # hidden 24, 4 query heads of 8, 2 KV heads
    got = value_metric(w, num_kv_heads=2, head_dim=8)
    for h in range(2):
        blocks = [w[:, g * 8 : (g + 1) * 8] for g in (2 * h, 2 * h + 1)]
        gram = sum(b.T @ b for b in blocks)
        torch.testing.assert_close(got[h], gram / gram.diagonal().mean())
    with pytest.raises(ValueError, match="not H_q \\* head_dim"):
        value_metric(torch.randn(24, 30), num_kv_heads=2, head_dim=8)


def test_key_metric_adds_the_normalised_query_moment_to_the_identity():
    s = torch.diag(torch.tensor([4.0, 2.0, 0.0]))[None]
    torch.testing.assert_close(key_metric(s)[0], torch.diag(torch.tensor([3.0, 2.0, 1.0])))
    with pytest.raises(ValueError, match="positive diagonal"):
        key_metric(torch.zeros(1, 3, 3))


def tiny_config(layers: int = 1):
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )


def with_metrics(cb, seed: int = 0):
    """``cb`` with random error metrics on every layer (what --weighted-codes stores)."""
    gen = torch.Generator().manual_seed(seed)
    h, d = cb.geometry["num_kv_heads"], cb.geometry["head_dim"]
    for i in cb.attention_layers():
        layer = cb.layer(i)
        layer.key_metric, layer.value_metric = spd(h, d, gen, 2.0), spd(h, d, gen, 2.0)
    return cb


def test_the_file_keeps_the_metrics_and_refuses_half_of_them(tmp_path):
    cb = random_codebooks(tiny_config(2), bits=2.0, method="qaware")
    assert not cb.weighted_codes
    assert not load_codebooks(cb.save(tmp_path / "plain.safetensors")).weighted_codes
    with_metrics(cb)
    back = load_codebooks(cb.save(tmp_path / "cb.safetensors"))
    assert back.weighted_codes
    assert back.state_bytes()["error metrics"] == 4 * 2 * 2 * (2 * 32 * 32)  # float32, 2 layers, K and V
    for i in (0, 1):
        torch.testing.assert_close(back.layer(i).key_metric, cb.layer(i).key_metric)
        torch.testing.assert_close(back.layer(i).value_metric, cb.layer(i).value_metric)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(tmp_path / "cb.safetensors"), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(tmp_path / "cb.safetensors"))
    del tensors["value_metric"]
    save_file(tensors, str(tmp_path / "half.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="need tensors 'key_metric' and 'value_metric'"):
        load_codebooks(tmp_path / "half.safetensors")


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 20), weight=st.sampled_from([1.0, 8.0]), seed=st.integers(0, 2**16))
def test_property_the_flush_and_codebook_encoders_agree(b, t, weight, seed):
    """The cache's flush form and quant.codebook.encode (simulate) reach codes of the same loss."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 2, t, 16, generator=gen)
    c = torch.randn(16, 4, generator=gen)
    m = spd(2, 16, gen, 2.0)
    ways = {
        "codebook": codebook.encode(x, c, weight, m).long(),
        "flush": unpack_codes(encode_flush(x, c, weight, m), 16),
    }
    losses = {k: weighted_loss(x, dequant(v, c), m, weight) for k, v in ways.items()}
    torch.testing.assert_close(losses["flush"], losses["codebook"], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    r=st.integers(0, 5),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_the_cache_stores_the_codebooks_codes(r, sizes, weighted, seed):
    """Prefill, chunks and one-token appends all encode as the codebooks say: score-aware keys
    (weight 8) and nearest-centroid values, then, with metrics, both lowered under them."""
    cb = random_codebooks(tiny_config(), bits=2.0, method="qaware", seed=seed % 5)
    lc = (with_metrics(cb, seed) if weighted else cb).layer(0)
    layer = cache_layer(lc, num_kv_heads=2, head_dim=32, max_cache_len=sum(sizes), residual=r, key_parallel_weight=8.0)
    gen = torch.Generator().manual_seed(seed)
    kts, vs = [], []
    for t in sizes:
        k, v = torch.randn(1, 2, t, 32, generator=gen) * 3, torch.randn(1, 2, t, 32, generator=gen)
        kts.append(layer.transform_keys(k)), vs.append(v)
        layer.update(k, v)
    n = int(layer.storage.n_coded)
    identity = torch.eye(32).expand(2, 32, 32)
    s, qz = layer.storage, layer.quantizer
    for x, stored, c, m, w in (
        (torch.cat(kts, 2)[:, :, :n], s.k_codes, qz.operands.key_centroids, lc.key_metric, 8.0),
        (torch.cat(vs, 2)[:, :, :n], s.v_codes, qz.operands.value_centroids, lc.value_metric, 1.0),
    ):
        got = dequant(unpack_codes(stored[:, :, :n], c.shape[0]), c)
        expected = dequant(codebook.encode(x, c, w, m).long(), c)
        loss_metric = identity if m is None else m
        torch.testing.assert_close(
            weighted_loss(x, got, loss_metric, w), weighted_loss(x, expected, loss_metric, w), rtol=1e-5, atol=1e-5
        )


def test_the_cache_refuses_a_metric_of_the_wrong_shape():
    lc = random_codebooks(tiny_config(), bits=2.0, method="qaware").layer(0)
    with pytest.raises(ValueError, match="error metric must be a float"):
        quantizer = LayerQuantizer.from_codebooks(
            dataclasses.replace(lc, key_metric=torch.eye(32)[None], value_metric=torch.eye(32)[None]), device="cpu"
        )
        VecInferLayer(
            quantizer,
            batch_size=1,
            num_kv_heads=2,
            head_dim=32,
            max_cache_len=8,
            residual=2,
            dtype=torch.float32,
            device="cpu",
        )


def test_calibration_stores_the_metrics_the_model_gives(tmp_path):
    """calibrate(weighted_codes=True): the value metric is the layer's o_proj Gram, the key metric
    ``I + S / mean diag S`` of the calibration queries (symmetric, positive definite); the
    methods whose keys are quantized before RoPE refuse it."""
    from vecinfer_compile.calibration import calibrate

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(2)).eval()
    text = "the quick brown fox jumps over the lazy dog. " * 40
    cb = calibrate(
        model,
        CharIds(),
        text,
        bits=2,
        method="qaware",
        max_tokens=1024,
        seq_len=256,
        iters=2,
        refine=None,
        weighted_codes=True,
        progress=False,
    )
    assert cb.weighted_codes
    for i in (0, 1):
        layer = cb.layer(i)
        expected = value_metric(model.model.layers[i].self_attn.o_proj.weight, 2, 32)
        torch.testing.assert_close(layer.value_metric, expected)
        km = layer.key_metric
        torch.testing.assert_close(km, km.transpose(-1, -2))
        torch.testing.assert_close(km.diagonal(dim1=-2, dim2=-1).mean(-1), torch.full((2,), 2.0))
        assert torch.linalg.eigvalsh(km).min() >= 1 - 1e-4
    with pytest.raises(ValueError, match="use --method qaware"):
        calibrate(
            model,
            CharIds(),
            text,
            bits=2,
            method="prerope",
            max_tokens=1024,
            seq_len=256,
            iters=2,
            weighted_codes=True,
            progress=False,
        )


@pytest.mark.parametrize("compiled", [False, True])
def test_cache_matches_simulate_on_tiny_model(tiny_model, sample_text_path, compiled):
    """Greedy tokens through VecInferCache (eager, and compiled with vecinfer_backend: the
    append pass keeps the metrics) equal the simulate path's with the same weighted codebooks,
    and the metrics change what the model reads."""
    from vecinfer_compile.evaluation.token_match import prompts_from_ids, token_match
    from vecinfer_compile.models import default_codebooks_dir, load_text, tokenize

    model, tok = tiny_model
    codebooks = with_metrics(load_codebooks(default_codebooks_dir() / "vecinfer-2bit.safetensors"))
    prompts = prompts_from_ids(tokenize(tok, load_text(sample_text_path)), 1, 96)
    results = token_match(model, prompts, codebooks, new_tokens=8, residual=16, compiled=compiled, progress=False)
    assert [r.first_mismatch for r in results] == [None]
    assert len(results[0].cache_tokens) == 8


KINDS = {  # attention kinds beside the tiny Llama's GQA: (model class, config class, config overrides)
    "sliding window (Mistral)": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8)),
    "sliding and full layers (Gemma 3)": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    ),
    "MHA (Qwen2)": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=4)),
    "MQA (Llama)": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=1)),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_cache_follows_simulate_with_qaware_defaults_across_attention_kinds(kind):
    """qaware's default calibration (score-aware keys, error-weighted codes) of a random model of
    each attention kind, then greedy generation through VecInferCache gives the simulate path's
    tokens and logits (within 1e-4; without the metrics the cache is off by 2e-2 or more) with the
    prompt in full precision, as the cache prefills it (window 4: older tokens read codes)."""
    import transformers

    from vecinfer_compile.cache import VecInferCache
    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.hf.compat import cache_kwargs
    from vecinfer_compile.simulate import simulation

    model_cls, config_cls, overrides = KINDS[kind]
    config = getattr(transformers, config_cls)(
        **{
            **dict(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_hidden_layers=2,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=0,
            ),
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    text = "the quick brown fox jumps over the lazy dog. " * 8
    cb = calibrate(model, CharIds(), text, bits=2, method="qaware", max_tokens=256, seq_len=64, iters=2, progress=False)
    assert cb.weighted_codes and cb.key_parallel_weight == 8.0
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))

    def generate(**kwargs):
        out = model.generate(
            ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
        )
        return out.sequences, torch.stack(out.logits, 1)

    with simulation(model, "qaware", bits=2, codebooks=cb, residual=4, full_precision_prefill=True):
        tokens, logits = generate()
    got_tokens, got_logits = generate(**cache_kwargs(VecInferCache(model.config, cb, residual=4, max_cache_len=64)))
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got_logits, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("residual", [0, 4])
def test_the_compiled_simulate_pass_matches_eager_simulate(residual):
    """The backend's simulate graph (encode, weigh_codes, centroid values) gives the eager simulate
    path's logits with error-weighted score-aware codes, and not the logits without the metrics."""
    from vecinfer_compile import vecinfer_backend
    from vecinfer_compile.simulate import simulation

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    plain = random_codebooks(tiny_config(), bits=2.0, method="qaware")
    cb = with_metrics(random_codebooks(tiny_config(), bits=2.0, method="qaware"))
    for c in (plain, cb):
        c.metadata["key_parallel_weight"] = 8.0
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, c in (("plain", plain), ("weighted", cb)):
        with simulation(model, "qaware", bits=2, codebooks=c, residual=residual), torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    compiled = torch.compile(model, backend=vecinfer_backend.configure(codebooks=cb, residual=residual), fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=ids).logits
    torch.testing.assert_close(got, logits["weighted"], rtol=1e-4, atol=1e-4)
    assert (got - logits["plain"]).abs().max() > 1e-3


def test_simulate_reads_the_metrics(tiny_model, sample_text_path):
    """The eager simulate path encodes under the metrics: its logits move when they are set."""
    from vecinfer_compile.models import default_codebooks_dir
    from vecinfer_compile.simulate import simulation

    model, _ = tiny_model
    ids = torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(0))
    plain = load_codebooks(default_codebooks_dir() / "vecinfer-2bit.safetensors")
    logits = {}
    for name, cb in (
        ("plain", plain),
        ("weighted", with_metrics(load_codebooks(default_codebooks_dir() / "vecinfer-2bit.safetensors"))),
    ):
        with simulation(model, "vecinfer", bits=2, codebooks=cb), torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    assert (logits["plain"] - logits["weighted"]).abs().max() > 1e-3


def test_the_weigh_codes_op_passes_opcheck():
    gen = torch.Generator().manual_seed(0)
    x, c = torch.randn(1, 2, 5, 16, generator=gen), torch.randn(16, 4, generator=gen)
    stored = encode_flush(x, c)
    torch.library.opcheck(torch.ops.vecinfer.weigh_codes.default, (x, stored, c, spd(2, 16, gen), 8.0))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_cache_stores_weighted_codes(dtype):
    """On CUDA: a 300-token prefill (Triton encode, then the descent's kernel) and one-token
    appends (float32: the torch append; bfloat16: the CUDA encoder and append) store codes of the
    loss quant.codebook.encode reaches on the keys and values the cache holds (on average: the
    kernels' arithmetic order resolves near-ties their own way, tests/test_ops_cuda_weigh.py)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cb = with_metrics(random_codebooks(tiny_config(), bits=2.0, method="qaware", seed=3), 3)
    lc = cb.layer(0)
    layer = cache_layer(
        lc,
        num_kv_heads=2,
        head_dim=32,
        max_cache_len=320,
        residual=8,
        key_parallel_weight=8.0,
        dtype=dtype,
        device="cuda",
    )
    gen = torch.Generator().manual_seed(0)
    kts, vs = [], []
    for t in (300, 1, 1, 1, 1):
        k = (torch.randn(1, 2, t, 32, generator=gen) * 3).to("cuda", dtype)
        v = torch.randn(1, 2, t, 32, generator=gen).to("cuda", dtype)
        kts.append(layer.transform_keys(k)), vs.append(v)
        layer.update(k, v)
    n = int(layer.storage.n_coded)
    assert n == 304 - 8
    s, qz = layer.storage, layer.quantizer
    for x, stored, c, m, w in (
        (torch.cat(kts, 2)[:, :, :n], s.k_codes, qz.operands.key_centroids, lc.key_metric, 8.0),
        (torch.cat(vs, 2)[:, :, :n], s.v_codes, qz.operands.value_centroids, lc.value_metric, 1.0),
    ):
        m = m.cuda()
        got = dequant(unpack_codes(stored[:, :, :n], c.shape[0]), c)
        expected = dequant(codebook.encode(x.float(), c, w, m).long(), c)
        got_loss, want_loss = weighted_loss(x, got, m, w).double(), weighted_loss(x, expected, m, w).double()
        assert abs(float(got_loss.mean() - want_loss.mean())) <= 1e-3 * float(want_loss.mean())
