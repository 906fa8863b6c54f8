"""Compiled decode over VecInferCache: the cache_decode rewrite, fullgraph generate, graph checks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_cache import left_padded, make_layer, random_codebooks, tiny_config  # noqa: E402
from torch._dynamo.utils import counters
from transformers import CompileConfig, LlamaForCausalLM

from vecinfer_compile.cache import VecInferCache
from vecinfer_compile.hf.compat import cache_kwargs
from vecinfer_compile.ops.append import append_reference
from vecinfer_compile.ops.decode_inputs import kv_start_from_mask, transform_queries
from vecinfer_compile.ops.registry import is_op
from vecinfer_compile.passes.cache_append import rewrite_cache_append
from vecinfer_compile.passes.cache_attention import rewrite_cache_attention

DECODE = torch.ops.vecinfer.decode_attention.default
DECODE_OPS = (
    DECODE,
    torch.ops.vecinfer.decode_attention_cuda.default,
    torch.ops.vecinfer.decode_attention_triton.default,
)


pytestmark = pytest.mark.usefixtures("one_thread")


class CaptureBackend:
    """Tiny local backend: the cache passes, then Inductor (or the graph itself when
    ``inductor=False``). Keeps every rewritten graph for inspection."""

    def __init__(self, inductor=True):
        self.graphs, self.inductor = [], inductor

    def __deepcopy__(self, memo):  # CompileConfig.to_dict() deep-copies the backend
        return self

    def __call__(self, gm, example_inputs, mode=None, options=None):
        rewrite_cache_append(gm)
        rewrite_cache_attention(gm)
        self.graphs.append(gm)
        if not self.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)


def _generate(model, ids, mask, cache, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, **cache_kwargs(cache), pad_token_id=0, do_sample=False, **kw)


def _full_length_float_nodes(gm, tmax, head_dim):
    """Nodes holding a float tensor [..., tmax, head_dim]: a dequantized full-length K or V."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2:
            if v.shape[-2] == tmax and v.shape[-1] == head_dim:
                out.append(n)
    return out


def _check_rewritten_graph(gm, layers, tmax, head_dim):
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(t in DECODE_OPS for t in targets) == layers
    assert not any(is_op(t, "cache_kv") for t in targets), "dequantized cache read left in the graph"
    assert F.scaled_dot_product_attention not in targets
    assert "decode_attention" in gm.code and "cache_kv" not in gm.code
    assert _full_length_float_nodes(gm, tmax, head_dim) == []


def _compiled_vs_eager(model, cb, ids, mask, *, tmax, residual, device="cpu", new_tokens=6):
    torch._dynamo.reset()
    counters.clear()
    eager_cache = VecInferCache(model, cb, batch_size=ids.shape[0], max_cache_len=tmax, residual=residual)
    eager = _generate(model, ids, mask, eager_cache, max_new_tokens=new_tokens)
    backend = CaptureBackend()
    config = CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True  # let generate() auto-compile decode on CPU too
    cache = VecInferCache(model, cb, batch_size=ids.shape[0], max_cache_len=tmax, residual=residual)
    compiled = _generate(model, ids, mask, cache, max_new_tokens=new_tokens, compile_config=config)
    return eager, compiled, backend, eager_cache, cache


@pytest.mark.parametrize("layer_bits", [None, [1.5, 4.0]])
def test_compiled_decode_matches_eager_and_holds_no_dequantized_kv(layer_bits):
    torch.manual_seed(0)
    cfg = tiny_config()
    model = LlamaForCausalLM(cfg).eval()
    cb = random_codebooks(cfg, layer_bits=layer_bits)
    ids, mask = left_padded(length=10, pad=3)
    tmax, residual = 20, 3
    eager, compiled, backend, eager_cache, cache = _compiled_vs_eager(
        model, cb, ids, mask, tmax=tmax, residual=residual
    )
    assert torch.equal(compiled, eager)
    assert len(backend.graphs) == 1, "decode recompiled"
    assert counters["vecinfer"]["cache_decode_rewrites"] == cfg.num_hidden_layers
    assert counters["vecinfer"]["cache_append_torch"] == cfg.num_hidden_layers  # CPU: the torch form
    assert sum(n.target is append_reference for n in backend.graphs[0].graph.nodes) == cfg.num_hidden_layers
    _check_rewritten_graph(backend.graphs[0], cfg.num_hidden_layers, tmax, cfg.head_dim)
    for a, b in zip(eager_cache.layers, cache.layers):  # same state after compiled updates
        assert int(a.storage.n_coded) == int(b.storage.n_coded) and int(a.storage.n_window) == int(b.storage.n_window)
        assert torch.equal(a.storage.k_codes, b.storage.k_codes) and torch.equal(a.storage.v_codes, b.storage.v_codes)
        torch.testing.assert_close(a.storage.k_window, b.storage.k_window)


def test_compiled_decode_tiny_checkpoint_dynamic(shared_tiny_dir):
    """The shipped tiny model (4 layers, GQA, head_dim 64) with dynamic=True: every compiled
    decode graph is rewritten (no unfused cache read) and tokens match eager."""
    model = LlamaForCausalLM.from_pretrained(shared_tiny_dir, dtype=torch.float32).eval()
    cb = random_codebooks(model.config, bits=1.5)
    ids, mask = left_padded(length=12, pad=5, vocab=model.config.vocab_size, seed=4)
    eager = _generate(
        model, ids, mask, VecInferCache(model, cb, batch_size=2, max_cache_len=24, residual=4), max_new_tokens=5
    )
    backend = CaptureBackend()
    config = CompileConfig(backend=backend, fullgraph=True, dynamic=True)
    config._compile_all_devices = True
    cache = VecInferCache(model, cb, batch_size=2, max_cache_len=24, residual=4)
    compiled = _generate(model, ids, mask, cache, max_new_tokens=5, compile_config=config)
    assert torch.equal(compiled, eager)
    assert counters["vecinfer"]["cache_decode_unfused"] == 0
    assert counters["vecinfer"]["cache_decode_rewrites"] >= model.config.num_hidden_layers
    # (a graph Dynamo replaced by a dynamic recompile may come back emptied: skip those)
    for gm in [g for g in backend.graphs if len(g.graph.nodes)]:
        _check_rewritten_graph(gm, model.config.num_hidden_layers, 24, model.config.head_dim)


def test_decode_attention_equals_sdpa_over_cache_kv():
    """The rewrite's maths, eagerly: decode_attention(q~, codes, kv_start) == SDPA(q, cache_kv, mask)."""
    torch.manual_seed(1)
    b, hkv, hq, d, r, tmax = 3, 2, 4, 16, 4, 24
    layer = make_layer(b, hkv, d, r, tmax)
    layer.update(torch.randn(b, hkv, 11, d), torch.randn(b, hkv, 11, d))
    for _ in range(3):
        k, v = layer.update(torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d))
    length = int(layer.storage.n_coded) + int(layer.storage.n_window)
    pad = torch.tensor([0, 2, 5])
    slots = torch.arange(tmax)
    mask = ((slots[None] >= pad[:, None]) & (slots[None] < length))[:, None, None, :]
    q = torch.randn(b, hq, 1, d)
    scale = 1 / math.sqrt(d)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=scale
    )
    kv_start = kv_start_from_mask(mask, q)
    assert kv_start.tolist() == pad.tolist() and kv_start.dtype == torch.int32
    s, qz = layer.storage, layer.quantizer
    out = torch.ops.vecinfer.decode_attention(
        transform_queries(q, qz.lam, qz.rotation),
        s.k_codes,
        s.v_codes,
        qz.operands.key_centroids,
        qz.operands.value_centroids,
        s.n_coded,
        s.k_window,
        s.v_window,
        s.n_window,
        kv_start,
        scale,
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    float_mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert torch.equal(kv_start_from_mask(float_mask, q), kv_start)
    # a row that attends nothing starts past the last slot: the kernels then return zeros
    assert kv_start_from_mask(torch.zeros_like(mask), q).tolist() == [tmax] * b


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_kv_start_compiles_for_a_dynamic_mask_length(device):
    """Compiled with the mask's length dynamic (generate() recompiles so when one process generates
    to several lengths), the first attended slot still matches eager. Inductor on torch 2.11 gave a
    Triton min-reduction an int32 start and an int64 loop value when the masked slots' fill was
    the symbolic length (a compile error on the H200), so the fill goes through the slots' dtype."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fn = torch.compile(kv_start_from_mask, dynamic=True, fullgraph=True)
    q = torch.zeros(3, 4, 1, 8, device=device)
    for length in (37, 70, 300):
        pad = torch.tensor([0, 5, length], device=device)  # the last row attends nothing
        slots = torch.arange(length, device=device)
        mask = (slots[None] >= pad[:, None])[:, None, None, :]
        float_mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
        for m in (mask, float_mask):
            got = fn(m, q)
            assert got.dtype == torch.int32 and torch.equal(got, kv_start_from_mask(m, q)), (length, m.dtype)
            assert got.tolist() == pad.tolist()


def _attention_fn(q, layer, mask):
    s, qz = layer.storage, layer.quantizer
    k, v = torch.ops.vecinfer.cache_kv(
        s.k_codes,
        s.v_codes,
        qz.operands.key_centroids,
        qz.operands.value_centroids,
        s.n_coded,
        s.k_window,
        s.v_window,
        s.n_window,
        qz.lam,
        qz.rotation,
    )
    k = (
        k[:, :, None, :, :]
        .expand(k.shape[0], k.shape[1], 2, k.shape[2], k.shape[3])
        .reshape(k.shape[0], -1, k.shape[2], k.shape[3])
    )
    v = (
        v[:, :, None, :, :]
        .expand(v.shape[0], v.shape[1], 2, v.shape[2], v.shape[3])
        .reshape(v.shape[0], -1, v.shape[2], v.shape[3])
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


@pytest.mark.parametrize("tq", [1, 2])
def test_pass_on_a_plain_graph(tq):
    """One query token: the decode op; two: the chunk op, which applies this mask (not causal) as
    it is over the valid slots. Both equal SDPA over the dequantized read, which leaves the graph."""
    torch.manual_seed(2)
    layer = make_layer(2, 2, 16, 4, 12)
    layer.update(torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16))
    layer.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    mask = torch.ones(2, 1, tq, 12, dtype=torch.bool)
    mask[..., 8:] = False
    mask[1, ..., :3] = False
    q = torch.randn(2, 4, tq, 16)
    backend = CaptureBackend(inductor=False)
    out = torch.compile(_attention_fn, backend=backend, fullgraph=True)(q, layer, mask)
    torch.testing.assert_close(out, _attention_fn(q, layer, mask), rtol=1e-4, atol=1e-5)
    gm = backend.graphs[0]
    if tq == 1:
        assert counters["vecinfer"]["cache_decode_rewrites"] == 1
        _check_rewritten_graph(gm, 1, 12, 16)
    else:
        assert counters["vecinfer"]["cache_chunk_rewrites"] == 1
        targets = [n.target for n in gm.graph.nodes]
        assert torch.ops.vecinfer.chunk_attention.default in targets
        assert F.scaled_dot_product_attention not in targets and torch.ops.vecinfer.cache_kv.default not in targets


def test_pass_ignores_sdpa_without_cache():
    backend = CaptureBackend(inductor=False)
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend=backend, fullgraph=True)
    x = torch.randn(1, 2, 3, 8)
    fn(x, x, x)
    assert any(n.target is F.scaled_dot_product_attention for n in backend.graphs[0].graph.nodes)


@pytest.mark.cuda
def test_cuda_graph_trees_decode_from_fresh_codebooks():
    """The product's path: ``vecinfer_backend`` under generate()'s default compile mode
    (reduce-overhead: CUDA-graph trees), bf16, with codebooks the CUDA kernel has never seen, so its
    16-bit copies are made during the graph's warm-up. Those copies must live outside the graph's
    memory pool: one left there failed the capture ("tensor(s) in the cudagraph pool not tracked as
    outputs"). Tokens must agree with the eager cache, and the copies are made once."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vecinfer_compile.backend import vecinfer_backend

    torch.manual_seed(0)
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=512)
    model = LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    cb = random_codebooks(cfg)
    ids, mask = left_padded(length=40, pad=0)
    ids, mask = ids.cuda(), mask.cuda()
    eager = _generate(
        model,
        ids,
        mask,
        VecInferCache(model, cb, batch_size=ids.shape[0], max_cache_len=80, residual=8),
        max_new_tokens=8,
    )
    counters.clear()
    config = CompileConfig(backend=vecinfer_backend.configure(codebooks=cb), fullgraph=True, mode="reduce-overhead")
    cache = VecInferCache(model, cb, batch_size=ids.shape[0], max_cache_len=80, residual=8)
    compiled = _generate(model, ids, mask, cache, max_new_tokens=8, compile_config=config)
    assert 0 < counters["vecinfer"]["decode_book_conversions"] <= 2 * cfg.num_hidden_layers  # once per book
    agree = (compiled[:, 40:] == eager[:, 40:]).float().mean().item()
    assert agree >= 0.5, agree


@pytest.mark.cuda
@pytest.mark.parametrize("layer_bits", [None, [1.5, 4.0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_decode(dtype, layer_bits):
    """On the GPU the compiled decode runs the CUDA decode kernel and the CUDA append for bf16, the
    Triton kernel and the torch append for fp32 (one per layer's preset); fp32 must match eager.
    Inductor re-inplaces the CUDA append: no copy of a cache buffer."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._dynamo.utils import ReinplaceCounters

    ReinplaceCounters.clear()
    torch.manual_seed(0)
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=512)
    model = LlamaForCausalLM(cfg).eval().to("cuda", dtype)
    cb = random_codebooks(cfg, layer_bits=layer_bits)  # CPU tensors: the cache and the backend move them
    ids, mask = left_padded(length=40, pad=7)
    ids, mask = ids.cuda(), mask.cuda()
    eager, compiled, backend, _, _ = _compiled_vs_eager(model, cb, ids, mask, tmax=80, residual=8, new_tokens=8)
    _check_rewritten_graph(backend.graphs[0], cfg.num_hidden_layers, 80, cfg.head_dim)
    kernel = (
        torch.ops.vecinfer.decode_attention_triton
        if dtype == torch.float32
        else torch.ops.vecinfer.decode_attention_cuda
    ).default
    assert sum(n.target is kernel for n in backend.graphs[0].graph.nodes) == cfg.num_hidden_layers
    append = append_reference if dtype == torch.float32 else torch.ops.vecinfer.cache_append_cuda.default
    assert sum(n.target is append for n in backend.graphs[0].graph.nodes) == cfg.num_hidden_layers
    assert ReinplaceCounters.get_total_missed() == 0, dict(ReinplaceCounters._values)
    # the CUDA kernel's 16-bit codebooks: made once per codebook tensor (2 caches x K and V x
    # layers), not once per decode step (7 steps each)
    assert counters["vecinfer"]["decode_book_conversions"] <= (
        0 if dtype == torch.float32 else 4 * cfg.num_hidden_layers
    )
    if dtype == torch.float32:
        assert torch.equal(compiled, eager)
    else:  # bf16 rounding differs between kernel and eager dequantize+SDPA: most tokens agree
        agree = (compiled[:, 40:] == eager[:, 40:]).float().mean().item()
        assert agree >= 0.5, agree


def test_compiled_chunked_prefill_equals_eager(method="qaware"):
    """generate(prefill_chunk_size=...) with a compile config: transformers builds each chunk's mask
    eagerly and runs the chunk compiled (as it does on CUDA). Every chunk's logits and the tokens
    equal the eager run's: the first chunk's attention stays in full precision (the backend keeps
    it so, as the eager prefill does), the later chunks follow the chunk rule of vecinfer_compile.window, and the
    mask is as long as the compiled read (it used to be the valid slots: a shape error). The chunks
    after the first run ``vecinfer::chunk_attention`` over the codes."""
    from vecinfer_compile.backend import vecinfer_backend

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    cb = random_codebooks(model.config, 2.0, method)
    ids, mask = left_padded(batch=2, length=20, pad=3)
    outs = {}
    for compiled in (False, True):
        cache = VecInferCache(model, cb, max_cache_len=40, residual=4, batch_size=2)
        kw = {}
        if compiled:
            config = CompileConfig(backend=vecinfer_backend.configure(codebooks=cb, method=method), fullgraph=True)
            config._compile_all_devices = True  # transformers compiles on CUDA only otherwise
            kw["compile_config"] = config
        counters.clear()
        outs[compiled] = _generate(
            model,
            ids,
            mask,
            cache,
            max_new_tokens=3,
            prefill_chunk_size=8,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    layers = model.config.num_hidden_layers
    assert counters["vecinfer"]["cache_prefill_full_precision"] == layers
    # the later chunks (8 and 4 tokens) attend over the codes, none over a dequantized read
    assert counters["vecinfer"]["cache_chunk_rewrites"] >= layers, dict(counters["vecinfer"])
    assert counters["vecinfer"]["cache_decode_unfused"] == 0, dict(counters["vecinfer"])
    assert torch.equal(outs[False].sequences, outs[True].sequences)
    for a, b in zip(outs[False].logits, outs[True].logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
