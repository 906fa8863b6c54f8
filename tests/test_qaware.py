"""The query-aware key transform (method ``qaware``): the exactness and score-error claims
(symbolic and sampled), the artifact, calibration, and every path that runs it: eager simulate,
the compile backend, VecInferCache (eager and compiled decode) and the retrieval allocation."""

from __future__ import annotations

import copy
import json
import math

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from vecinfer_compile.codebooks import FORMAT, VecInferCodebooks, load_codebooks, model_geometry
from vecinfer_compile.quant.query_aware import RIDGE_FLOOR, query_aware_matrices, second_moment
from vecinfer_compile.quant.transform import KeyTransform
from vecinfer_compile.testing import random_codebooks, random_layer_codebooks, tiny_model

CONFIG = LlamaConfig(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=128,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def anisotropic_queries(hq: int, n: int, d: int, seed: int) -> torch.Tensor:
    """``[hq, n, d]`` float64 queries with a few large directions, as real queries have."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.ones(d, dtype=torch.float64)
    scale[torch.randperm(d, generator=gen)[:3]] = 12.0
    mix = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
    return (torch.randn(hq, n, d, generator=gen, dtype=torch.float64) * scale) @ mix


# -- the claims ----------------------------------------------------------------------------------
def test_scores_are_exact_symbolically():
    """``(q A^-T)(K A)^T == q K^T`` for a generic invertible A (and so for A = S^(1/2) H)."""
    d = 3
    a = sympy.Matrix(d, d, sympy.symbols(f"a0:{d * d}"))
    q = sympy.Matrix(1, d, sympy.symbols(f"q0:{d}"))
    k = sympy.Matrix(2, d, sympy.symbols(f"k0:{2 * d}"))
    b = a.inv().T
    assert sympy.simplify((q * b) * (k * a).T - q * k.T) == sympy.zeros(1, 2)


def test_score_error_is_euclidean_error_symbolically():
    """``mean_q (q e^T)^2 = e S e^T`` for S the second moment of three symbolic queries, and
    ``|e A|^2 = e S e^T`` for a symbolic SPD S and its square root ``A`` (Cholesky form here; any
    ``A`` with ``A A^T = S`` gives the same norm, the symmetric root included)."""
    d = 2
    qs = [sympy.Matrix(1, d, sympy.symbols(f"q{i}_0:{d}", real=True)) for i in range(3)]
    e = sympy.Matrix(1, d, sympy.symbols(f"e0:{d}", real=True))
    s = sum((qi.T * qi for qi in qs), sympy.zeros(d, d)) / 3
    mean_sq = sum(((qi * e.T)[0]) ** 2 for qi in qs) / 3
    assert sympy.expand(mean_sq - (e * s * e.T)[0]) == 0
    s00, p = sympy.symbols("s00 p", positive=True)
    s01 = sympy.symbols("s01", real=True)
    spd = sympy.Matrix([[s00, s01], [s01, p + s01**2 / s00]])  # SPD: s00 > 0, Schur complement p > 0
    root = sympy.Matrix([[sympy.sqrt(s00), 0], [s01 / sympy.sqrt(s00), sympy.sqrt(p)]])
    assert sympy.simplify(((e * root) * (e * root).T)[0] - (e * spd * e.T)[0]) == 0


@settings(max_examples=25, deadline=None)
@given(
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([16, 32]),
    ridge=st.sampled_from([1e-3, 1e-2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_expected_score_error_equals_transformed_euclidean_error(hkv, group, d, ridge, seed):
    """Over the calibration queries themselves: ``mean_q (q e^T)^2 = s (|e A|^2 - e R e^T)`` with
    ``s = trace(S) / D`` (the normalisation of :func:`query_aware_matrices`) and ``R`` the ridge
    (``ridge`` times the normalised moment's diagonal, plus the floor), per KV head, with and
    without the Hadamard after A."""
    queries = anisotropic_queries(hkv * group, 64, d, seed)
    s = second_moment(queries, hkv)
    a, b = query_aware_matrices(s, None, ridge)  # the sqrt kind
    e = torch.randn(hkv, 5, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    grouped = queries.reshape(hkv, group * 64, d)
    expected = ((grouped @ e.transpose(1, 2)) ** 2).mean(1)  # [hkv, 5]
    mean_eig = torch.diagonal(s, dim1=1, dim2=2).sum(-1) / d
    for rotate in (False, True):
        t = KeyTransform(d, rotate=rotate, key_matrix=a, query_matrix=b)
        et = t.keys(e[None])[0]  # the transform is linear: the error maps like a key
        ridged = ridge * torch.diagonal(s, dim1=1, dim2=2) / mean_eig[:, None] + RIDGE_FLOOR  # [hkv, d]
        got = mean_eig[:, None] * ((et**2).sum(-1) - (e**2 * ridged[:, None]).sum(-1))
        torch.testing.assert_close(got, expected, rtol=2e-4, atol=1e-6 * expected.abs().max().item())


def _equal_error_cost(a: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``trace(A^T C A) * trace(A^-1 S A^-T)``: the expected score error when every channel of
    ``K~ = K A`` gets the same quantization error (module docstring of quant.query_aware)."""
    a_inv = torch.linalg.inv(a)
    return torch.einsum("hii->h", a.transpose(1, 2) @ c @ a) * torch.einsum("hii->h", a_inv @ s @ a_inv.transpose(1, 2))


@settings(max_examples=20, deadline=None)
@given(
    hkv=st.integers(1, 2), d=st.sampled_from([8, 16]), ridge=st.sampled_from([1e-3, 1e-1]), seed=st.integers(0, 2**16)
)
def test_geomean_minimises_the_equal_error_score_cost(hkv, d, ridge, seed):
    """The ``geomean`` matrix reaches the Cauchy-Schwarz bound ``trace((C^1/2 S C^1/2)^1/2)^2``
    of the equal-error cost and beats the identity, ``S^(1/2)`` and random SPD matrices."""
    from vecinfer_compile.quant.query_aware import _power, _ridged

    s_raw = second_moment(anisotropic_queries(hkv, 64, d, seed), hkv)
    c_raw = second_moment(anisotropic_queries(hkv, 64, d, seed + 7), hkv)
    s, c = _ridged(s_raw, ridge, "queries"), _ridged(c_raw, ridge, "keys")
    a, b = query_aware_matrices(s_raw, c_raw, ridge)
    best = _equal_error_cost(a.double(), c, s)
    c_half = _power(c, 0.5)
    bound = torch.einsum("hii->h", _power(c_half @ s @ c_half, 0.5)) ** 2
    torch.testing.assert_close(best, bound, rtol=1e-4, atol=0)
    gen = torch.Generator().manual_seed(seed)
    rivals = [torch.eye(d, dtype=torch.float64).expand(hkv, d, d), query_aware_matrices(s_raw, None, ridge)[0].double()]
    for _ in range(3):
        r = torch.randn(hkv, d, d, generator=gen, dtype=torch.float64)
        rivals.append(a.double() @ torch.linalg.matrix_exp(0.1 * (r + r.transpose(1, 2))))
    for rival in rivals:
        assert (best <= _equal_error_cost(rival, c, s) * (1 + 1e-6)).all()


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    t=st.integers(1, 9),
    d=st.sampled_from([16, 32, 48]),
    rotate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_transform_preserves_scores_and_inverts(b, hkv, group, t, d, rotate, seed):
    """``q~ K~^T == q K^T`` (GQA, odd lengths, block Hadamard for 48) and ``keys_inverse`` undoes ``keys``."""
    gen = torch.Generator().manual_seed(seed)
    a, bm = query_aware_matrices(
        second_moment(anisotropic_queries(hkv, 128, d, seed), hkv),
        second_moment(anisotropic_queries(hkv, 128, d, seed + 1), hkv),
    )
    tr = KeyTransform(d, rotate=rotate, key_matrix=a, query_matrix=bm)
    q = torch.randn(b, hkv * group, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, t + 2, d, generator=gen, dtype=torch.float64)
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2)
    scores_t = tr.queries(q) @ tr.keys(k).repeat_interleave(group, 1).transpose(-1, -2)
    torch.testing.assert_close(scores_t, scores, rtol=1e-4, atol=1e-4 * scores.abs().max().item())
    torch.testing.assert_close(tr.keys_inverse(tr.keys(k)), k, rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(
    hkv=st.integers(1, 2),
    d=st.sampled_from([8, 16]),
    ridge=st.sampled_from([1e-2, 1e-1, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_the_transform_follows_a_rescaling_of_key_channels(hkv, d, ridge, seed):
    """Keys ``K G`` and queries ``q G^(-1)`` (``G`` diagonal, a few channels 6-16x: the scores do
    not change) give ``P' = G^(-1) P G^(-1)`` (``P = A A``), so ``K~`` only turns by an orthogonal
    matrix (P up to a scalar, the moments' normalisations; and up to the ridge's floor)."""
    gen = torch.Generator().manual_seed(seed)
    s = second_moment(anisotropic_queries(hkv, 64, d, seed), hkv)
    c = second_moment(anisotropic_queries(hkv, 64, d, seed + 7), hkv)
    g = torch.ones(hkv, d, dtype=torch.float64)
    g[:, torch.randperm(d, generator=gen)[:2]] = 6 + 10 * torch.rand(hkv, 2, generator=gen, dtype=torch.float64)
    a, _ = query_aware_matrices(s, c, ridge)
    a2, _ = query_aware_matrices(s / g[:, :, None] / g[:, None, :], g[:, :, None] * c * g[:, None, :], ridge)
    a, a2 = a.double(), a2.double()
    p, p2 = a @ a, g[:, :, None] * (a2 @ a2) * g[:, None, :]
    p2 = p2 * (torch.einsum("hii->h", p) / torch.einsum("hii->h", p2))[:, None, None]  # the normalisations' scalar
    torch.testing.assert_close(p2, p, rtol=2e-3, atol=2e-3 * p.abs().max().item())


def test_matrices_are_the_ridged_square_root():
    q = anisotropic_queries(4, 200, 16, 3)
    s = second_moment(q, 2)
    torch.testing.assert_close(s[1], q[2:].reshape(-1, 16).T @ q[2:].reshape(-1, 16) / 400)
    a, b = query_aware_matrices(s, None, 0.05)
    s_n = s / (torch.diagonal(s, dim1=1, dim2=2).sum(-1) / 16)[:, None, None]
    s_r = s_n + torch.diag_embed(0.05 * torch.diagonal(s_n, dim1=1, dim2=2) + RIDGE_FLOOR)
    torch.testing.assert_close((a.double() @ a.double()), s_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        a.double().transpose(1, 2) @ b.double(),
        torch.eye(16, dtype=torch.float64).expand(2, 16, 16),
        rtol=1e-4,
        atol=1e-4,
    )


def test_query_aware_inputs_are_checked():
    with pytest.raises(ValueError, match="ridge must be > 0"):
        query_aware_matrices(torch.eye(4)[None], None, 0.0)
    with pytest.raises(ValueError, match="keys are all zero"):
        query_aware_matrices(torch.eye(4)[None], torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="key moment must be"):
        query_aware_matrices(torch.eye(4)[None], torch.eye(3)[None])
    with pytest.raises(ValueError, match="queries are all zero"):
        query_aware_matrices(torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="NaN or inf"):
        second_moment(torch.full((2, 3, 4), float("nan")), 1)
    with pytest.raises(ValueError, match="not a multiple"):
        second_moment(torch.randn(3, 5, 4), 2)
    with pytest.raises(ValueError, match="must be \\[H, N, D\\]"):
        second_moment(torch.randn(3, 4), 1)
    with pytest.raises(ValueError, match="not both"):
        KeyTransform(4, torch.ones(1, 4), False, torch.eye(4)[None], torch.eye(4)[None])
    with pytest.raises(ValueError, match="go together"):
        KeyTransform(4, None, False, torch.eye(4)[None], None)


# -- the artifact --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["qaware", "qaware-nohadamard"])
def test_round_trip(tmp_path, method):
    cb = random_codebooks(CONFIG, 2.0, method)
    back = load_codebooks(cb.save(tmp_path / "cb.safetensors"))
    assert back.method == method and back.metadata["format"] == FORMAT
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.transform.key_matrix, b.transform.key_matrix)
        assert torch.equal(a.transform.query_matrix, b.transform.query_matrix)
        assert b.transform.lam is None and b.transform.rotate == (method == "qaware")
    assert cb.nbytes() == back.nbytes() > random_codebooks(CONFIG, 2.0, "hadamard").nbytes()


def _rewrite(path, tmp_path, *, meta=None, drop=(), replace=None):
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        m = json.loads(f.metadata()["vecinfer"])
    m.update(meta or {})
    tensors.update(replace or {})
    out = tmp_path / "edited.safetensors"
    save_file(tensors, str(out), metadata={"vecinfer": json.dumps(m)})
    return out


def test_format_2_files_still_load(tmp_path):
    cb = random_codebooks(CONFIG, 2.0, "vecinfer")
    old = _rewrite(cb.save(tmp_path / "cb.safetensors"), tmp_path, meta={"format": "vecinfer-codebooks/2"})
    back = load_codebooks(old)
    assert back.metadata["converted_from"] == "vecinfer-codebooks/2"
    assert torch.equal(back.layers[1].transform.lam, cb.layers[1].transform.lam)


def test_broken_query_aware_files_name_the_fix(tmp_path):
    path = random_codebooks(CONFIG, 2.0, "qaware").save(tmp_path / "cb.safetensors")
    with pytest.raises(ValueError, match=r"needs tensors 'key_matrix' and 'query_matrix'.*--method qaware"):
        load_codebooks(_rewrite(path, tmp_path, drop=("query_matrix",)))
    with pytest.raises(ValueError, match=r"key_matrix has shape \(2, 2, 16, 8\).*\(2, 2, 16, 16\)"):
        load_codebooks(_rewrite(path, tmp_path, replace={"key_matrix": torch.ones(2, 2, 16, 8)}))
    with pytest.raises(ValueError, match="not the inverse transpose"):
        load_codebooks(_rewrite(path, tmp_path, replace={"query_matrix": torch.eye(16).expand(2, 2, 16, 16).clone()}))
    with pytest.raises(ValueError, match="does not know"):
        load_codebooks(_rewrite(path, tmp_path, meta={"method": "qaware2"}))
    with pytest.raises(ValueError, match="takes no query-aware matrices"):
        load_codebooks(_rewrite(path, tmp_path, meta={"method": "hadamard"}))
    with pytest.raises(
        ValueError,
        match="reads vecinfer-codebooks/8, vecinfer-codebooks/7, vecinfer-codebooks/6, vecinfer-codebooks/5, vecinfer-codebooks/4",
    ):
        load_codebooks(_rewrite(path, tmp_path, meta={"format": "vecinfer-codebooks/9"}))


# -- calibration -----------------------------------------------------------------------------------
def test_calibrate_collects_queries_and_stores_the_matrices(tiny, sample_text_path, tmp_path):
    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.hf.recording import collect_kv

    model, tokenizer = tiny
    text = sample_text_path.read_text()
    cb = calibrate(
        model, tokenizer, text, bits=2, method="qaware", ridge=0.1, max_tokens=512, seq_len=256, iters=2, progress=False
    )
    assert cb.metadata["qaware_ridge"] == 0.1
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:512]
    keys, _, queries = collect_kv(model, torch.tensor(ids), 256, False, with_queries=True)
    hkv = model.config.num_key_value_heads
    for i, layer in enumerate(cb.layers):
        centred = keys[i] - keys[i].mean(1, keepdim=True)  # qaware centres keys (qaware-nocenter does not)
        expected, _ = query_aware_matrices(second_moment(queries[i], hkv), second_moment(centred, hkv), 0.1)
        torch.testing.assert_close(layer.transform.key_matrix, expected, rtol=1e-4, atol=1e-5)
    back = load_codebooks(cb.save(tmp_path / "qa.safetensors"))
    back.check_model(model.config, bits=2, method="qaware")
    with pytest.raises(ValueError, match="ridge must be > 0"):
        calibrate(model, tokenizer, text, bits=2, method="qaware", ridge=0, progress=False)


def test_calibrate_retrieval_allocation(tiny, sample_text_path):
    """``--allocate retrieval`` fits the query-aware transform once per layer and keeps it for
    every candidate preset."""
    from vecinfer_compile.calibration import calibrate

    model, tokenizer = tiny
    cb = calibrate(
        model,
        tokenizer,
        sample_text_path.read_text(),
        bits=2,
        method="qaware",
        allocate="retrieval",
        max_tokens=512,
        seq_len=256,
        iters=2,
        progress=False,
    )
    assert cb.bits == 2.0 and all(l.transform.key_matrix is not None for l in cb.layers)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_dir)


# -- every path that runs it -----------------------------------------------------------------------
def _qaware_codebooks(model, rotate=True, seed=0):
    """Random codebooks of ``qaware`` (centred) or ``qaware-nohadamard`` (uncentred)."""
    geo = model_geometry(model.config)
    layers = [
        random_layer_codebooks(
            geo["num_kv_heads"],
            geo["head_dim"],
            seed=seed + i,
            smooth=False,
            rotate=rotate,
            query_aware=True,
            center=rotate,
        )
        for i in range(geo["num_layers"])
    ]
    return VecInferCodebooks("qaware" if rotate else "qaware-nohadamard", 2.0, layers, geo)


def test_backend_transform_only_is_exact():
    from vecinfer_compile.backend import vecinfer_backend

    model = tiny_model("llama")
    cb = _qaware_codebooks(model)
    x = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    backend = vecinfer_backend.configure(cb, method="qaware", quantize=False)
    with torch.no_grad():
        ref = model(input_ids=x, use_cache=False).logits
        out = torch.compile(model, backend=backend, fullgraph=True)(input_ids=x, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rotate,residual", [(True, 0), (True, 4), (False, 4)])
def test_compiled_simulate_matches_eager_simulate(rotate, residual):
    from vecinfer_compile.backend import vecinfer_backend
    from vecinfer_compile.simulate import enable_simulation

    model = tiny_model("llama")
    cb = _qaware_codebooks(model, rotate)
    x = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    backend = vecinfer_backend.configure(cb, method=cb.method, residual=residual)
    with torch.no_grad():
        full = model(input_ids=x, use_cache=False).logits
        compiled = torch.compile(model, backend=backend, fullgraph=True)(input_ids=x, use_cache=False).logits
        sim = enable_simulation(copy.deepcopy(model), cb.method, bits=2, codebooks=cb, residual=residual)
        simulated = sim(input_ids=x, use_cache=False).logits
    torch.testing.assert_close(compiled, simulated, atol=1e-4, rtol=1e-4)
    assert (compiled - full).abs().max() > 1e-3  # really quantized


def test_zero_config_backend_refuses_qaware():
    from vecinfer_compile.backend import vecinfer_backend

    with pytest.raises(ValueError, match="needs calibrated codebooks.*--method qaware"):
        vecinfer_backend.configure(method="qaware")


def test_cache_window_is_exact_and_codes_are_read():
    """The cache stores K~ = K A H; its eager read returns K (original domain) for the window and
    the dequantized codes beyond; a window covering everything generates as full precision."""
    import warnings

    from vecinfer_compile.cache import VecInferCache
    from vecinfer_compile.hf.compat import cache_kwargs

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=128,
    )
    model = LlamaForCausalLM(cfg).eval()
    cb = _qaware_codebooks(model)
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        cache = VecInferCache(model, cb, batch_size=2, max_cache_len=16, residual=16)
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    layer = cache.layers[0]
    assert layer.quantizer.rotation is None and layer.quantizer.key_matrix.shape == (2, 16, 16)
    k = torch.randn(2, 2, 5, 16)
    torch.testing.assert_close(layer.transform_keys(k), cb.layer(0).transform.keys(k))


def test_compiled_decode_matches_eager_and_moves_the_read_to_queries():
    import sys
    from pathlib import Path

    from torch._dynamo.utils import counters

    sys.path.insert(0, str(Path(__file__).parent))
    from test_cache import left_padded, tiny_config
    from test_cache_compile import _check_rewritten_graph, _compiled_vs_eager

    torch.manual_seed(0)
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg).eval()
    cb = _qaware_codebooks(model)
    ids, mask = left_padded(length=10, pad=3)
    eager, compiled, backend, eager_cache, cache = _compiled_vs_eager(model, cb, ids, mask, tmax=20, residual=3)
    assert torch.equal(compiled, eager)
    assert counters["vecinfer"]["cache_decode_rewrites"] == cfg.num_hidden_layers
    assert counters["vecinfer"]["cache_decode_unfused"] == 0
    _check_rewritten_graph(backend.graphs[0], cfg.num_hidden_layers, 20, cfg.head_dim)
    code = backend.graphs[0].code
    assert "key_read" in code and "transform_queries" in code


# -- the command line ------------------------------------------------------------------------------
def test_cli_calibrate_then_eval_ppl_and_ridge_errors(capsys, tmp_path, tiny_dir, sample_text_path):
    from vecinfer_compile.cli import main

    out = tmp_path / "qa.safetensors"
    base = ["--model", str(tiny_dir), "--text", str(sample_text_path)]
    assert (
        main(
            [
                "calibrate",
                *base,
                "--bits",
                "2",
                "--method",
                "qaware",
                "--ridge",
                "0.5",
                "--out",
                str(out),
                "--max-tokens",
                "512",
                "--seq-len",
                "256",
                "--iters",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert load_codebooks(out).metadata["qaware_ridge"] == 0.5
    capsys.readouterr()
    assert (
        main(
            [
                "eval-ppl",
                *base,
                "--method",
                "qaware",
                "--codebooks",
                str(out),
                "--windows",
                "1",
                "--window-len",
                "64",
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "qaware" and math.isfinite(result["ppl"])
    assert main(["calibrate", *base, "--bits", "2", "--method", "vecinfer", "--ridge", "0.5", "--out", "x"]) == 2
    assert "--ridge is for the query-aware methods" in capsys.readouterr().err


def test_calibrate_states_the_real_precision_and_the_fixed_and_per_token_bytes(
    capsys, tmp_path, tiny_dir, sample_text_path
):
    """It said "bytes as fp16" of a float32 file, and nothing of what a cache then holds."""
    from vecinfer_compile.cli import main

    out = tmp_path / "qa.safetensors"
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(tiny_dir),
                "--text",
                str(sample_text_path),
                "--bits",
                "2",
                "--method",
                "qaware",
                "--out",
                str(out),
                "--max-tokens",
                "512",
                "--seq-len",
                "256",
                "--iters",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "fp16" not in printed
    # tiny: 4 layers, 2 KV heads, head_dim 64; float32
    matrices, codebooks, means = 4 * 2 * 2 * 64 * 64 * 4, 4 * 2 * 256 * 4 * 4, 4 * 2 * 64 * 4
    metrics = matrices  # qaware's error-weighted codes: a key and a value metric per layer and KV head
    total = matrices + codebooks + means + metrics
    assert (
        f"state: {total:,} bytes of float32, the precision the cache uses it in (codebooks {codebooks:,}, "
        f"query-aware matrices {matrices:,}, key means {means:,}, error metrics {metrics:,})"
    ) in printed
    assert (
        f"a VecInferCache of this model: {total:,} bytes fixed, whatever its length, "
        "+ 256 bytes per token (full precision: 2,048)"
    ) in printed


def test_the_file_stores_the_state_in_the_precision_the_cache_uses(tmp_path):
    from vecinfer_compile.cache import VecInferCache

    cb = random_codebooks(CONFIG, 2.0, "qaware")
    path = cb.save(tmp_path / "qa.safetensors")
    layer = VecInferCache(CONFIG, cb, batch_size=1, max_cache_len=8, residual=2, dtype=torch.bfloat16).layers[0]
    with safe_open(str(path), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in stored.values()} == {torch.float32}
    qz = layer.quantizer
    assert qz.key_matrix.dtype == qz.key_read.dtype == qz.operands.key_centroids.dtype == torch.float32
    assert cb.nbytes() == sum(t.numel() * t.element_size() for t in stored.values())


def test_cache_bytes_report_the_fixed_state_apart_from_the_tokens(tiny_dir):
    """A small qaware cache holds more than full precision: its fixed state (the per-head
    matrices) is reported apart, and the accounting says from how many tokens it pays off."""
    from transformers import AutoConfig

    from vecinfer_compile.cache import VecInferCache
    from vecinfer_compile.evaluation.kv_bytes import cache_bytes, kv_bytes

    config = AutoConfig.from_pretrained(tiny_dir)
    cb = random_codebooks(config, 2.0, "qaware")
    short, long = (
        cache_bytes(VecInferCache(config, cb, batch_size=b, max_cache_len=n, residual=16, dtype=torch.bfloat16))
        for b, n in ((1, 64), (3, 640))
    )
    acc = kv_bytes("qaware", 2, config, residual=16, weighted_codes=False)  # random codebooks have no metrics
    assert short.fixed == long.fixed == acc.fixed_bytes == cb.nbytes() == 296_960
    assert short.bytes_per_token == long.bytes_per_token == acc.bytes_per_token == 256
    assert long.codes == 3 * 640 * 256
    assert long.window == 3 * 4 * 2 * 2 * 16 * 64 * 2 + 4 * 2 * 8  # bf16 windows [B, H, R, D], K and V; counters
    cache = VecInferCache(config, cb, batch_size=1, max_cache_len=64, residual=16, dtype=torch.bfloat16)
    assert cache_bytes(cache).total == cache.kv_bytes() > cache.fp_kv_bytes()  # more than full precision
    metrics = 2 * 4 * 2 * 64 * 64 * 4  # key and value metrics [H, D, D] per layer, float32
    assert kv_bytes("qaware", 2, config).fixed_bytes == 296_960 + metrics  # the method's default: weighted codes
    weighted = random_codebooks(config, 2.0, "qaware")
    for i in weighted.attention_layers():
        layer = weighted.layer(i)
        layer.key_metric, layer.value_metric = (torch.eye(64).expand(2, 64, 64).clone() for _ in range(2))
    held = cache_bytes(
        VecInferCache(config, weighted, batch_size=1, max_cache_len=64, residual=16, dtype=torch.bfloat16)
    )
    assert held.fixed == weighted.nbytes() == 296_960 + metrics
    n = acc.break_even_tokens()
    assert acc.total(n) < n * acc.fp16_bytes_per_token <= acc.total(n - 1) + acc.fp16_bytes_per_token


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_decode(dtype):
    """On the GPU the query-aware cache decodes with the same kernels (they see q~ and codes):
    fp32 matches eager token for token; bf16 mostly agrees (kernel vs eager rounding)."""
    import sys
    from pathlib import Path

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cache import left_padded, tiny_config
    from test_cache_compile import _check_rewritten_graph, _compiled_vs_eager

    torch.manual_seed(0)
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=512)
    model = LlamaForCausalLM(cfg).eval().to("cuda", dtype)
    cb = random_codebooks(cfg, 2.0, "qaware")
    ids, mask = left_padded(length=40, pad=7)
    eager, compiled, backend, _, _ = _compiled_vs_eager(
        model, cb, ids.cuda(), mask.cuda(), tmax=80, residual=8, new_tokens=8
    )
    _check_rewritten_graph(backend.graphs[0], cfg.num_hidden_layers, 80, cfg.head_dim)
    if dtype == torch.float32:
        assert torch.equal(compiled, eager)
    else:
        assert (compiled[:, 40:] == eager[:, 40:]).float().mean().item() >= 0.5


def test_needle_runs_through_the_query_aware_cache(tmp_path, tiny_dir, capsys):
    """``vecinfer needle --method qaware``: generation through VecInferCache with codes read
    (window 8 < prompt), one JSON object out."""
    from transformers import AutoConfig

    from vecinfer_compile.cli import main

    haystack = tmp_path / "hay"
    haystack.mkdir()
    (haystack / "a.txt").write_text("The sea was calm and the ship sailed on through the night. " * 60)
    cb = random_codebooks(AutoConfig.from_pretrained(tiny_dir), 2.0, "qaware").save(tmp_path / "qa.safetensors")
    rc = main(
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--haystack",
            str(haystack),
            "--lengths",
            "64",
            "--depths",
            "50",
            "--method",
            "qaware",
            "--codebooks",
            str(cb),
            "--residual",
            "8",
            "--trials",
            "1",
            "--max-new-tokens",
            "3",
            "--json",
            "--no-progress",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["method"] == "qaware" and "VecInferCache" in out["note"]
