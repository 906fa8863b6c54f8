"""The SDPA rewrite on Dynamo graphs, run eagerly (no Inductor): graph snapshot, argument forms,
GQA unwrapping, exactness of the transform, codes vs an eager dequantize reference, errors."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from torch._dynamo.utils import counters

import vecinfer_compile.ops  # noqa: F401  (registers torch.ops.vecinfer.*)
from vecinfer_compile.backend import vecinfer_backend
from vecinfer_compile.passes import find_sdpa_sites, rewrite_sdpa
from vecinfer_compile.passes.sdpa import layer_from_module_path
from vecinfer_compile.quant.codebook import decode, encode
from vecinfer_compile.testing import (
    attention_cases,
    make_attention_inputs,
    random_layer_codebooks,
    tiny_model,
)

try:
    from expecttest import TestCase
except ImportError:  # not installed on the GPU box: the snapshot test skips there
    TestCase = None

OPS = {torch.ops.vecinfer.encode.default, torch.ops.vecinfer.quantize.default, torch.ops.vecinfer.attention.default}


class Capture:
    """A Dynamo backend that rewrites with given codebooks and runs the graph eagerly."""

    def __init__(self, quantize=True, residual=0, bits=2.0):
        self.quantize, self.residual, self.bits = quantize, residual, bits
        self.graphs: list[torch.fx.GraphModule] = []
        self.new_nodes: list[list[torch.fx.Node]] = []
        self.layers = {}

    def __call__(self, gm, example_inputs):
        before = set(gm.graph.nodes)
        sites = find_sdpa_sites(gm)
        for s in sites:
            self.layers.setdefault(
                s.layer, random_layer_codebooks(s.kv_heads, s.head_dim, bits=self.bits, seed=s.layer)
            )
        rewrite_sdpa(gm, sites, self.layers, quantize=self.quantize, residual=self.residual)
        self.graphs.append(gm)
        self.new_nodes.append([n for n in gm.graph.nodes if n not in before])
        return gm.forward


def normalized(nodes) -> str:
    """One line per node: ``name = target(args)`` with node args by name."""

    def fmt(a):
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return "(" + ", ".join(fmt(x) for x in a) + ")"
        return repr(a)

    lines = []
    for n in nodes:
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if isinstance(n.target, torch._ops.OpOverload):
            target = str(n.target)
        args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items()]
        lines.append(f"{n.name} = {n.op}:{target}({', '.join(args)})")
    return "\n".join(lines)


def repeats_heads(op: torch.fx.Node) -> bool:
    """Whether a per-query-head expansion (repeat_kv's 5-D expand) feeds op's q/k/v inputs."""
    return any(n.target == "expand" and n.meta["example_value"].dim() == 5 for n in kv_ancestors(op))


def kv_ancestors(op: torch.fx.Node) -> set[torch.fx.Node]:
    """Every node that the query/key/value inputs of a vecinfer op depend on (not the mask)."""
    seen, todo = set(), [a for a in op.args[:3] if isinstance(a, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


@pytest.mark.skipif(TestCase is None, reason="needs expecttest")
class TestSnapshot(TestCase or object):
    def test_llama_two_layers(self):
        model = tiny_model("llama")
        capture = Capture()
        ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.compile(model, backend=capture, fullgraph=True)(ids, use_cache=False)
        self.assertEqual(counters["vecinfer"]["sdpa_rewrites"], 2)
        self.assertExpectedInline(
            normalized(capture.new_nodes[0]),
            """\
float_2 = call_method:float(q_embed)
vecinfer_layer0_lam_q = get_attr:vecinfer_layer0_lam_q()
mul_23 = call_function:mul(float_2, vecinfer_layer0_lam_q)
vecinfer_layer0_rotation = get_attr:vecinfer_layer0_rotation()
matmul = call_function:matmul(mul_23, vecinfer_layer0_rotation)
to_15 = call_method:to(matmul, torch.float32)
float_3 = call_method:float(k_embed)
vecinfer_layer0_lam = get_attr:vecinfer_layer0_lam()
div = call_function:div(float_3, vecinfer_layer0_lam)
vecinfer_layer0_rotation_1 = get_attr:vecinfer_layer0_rotation()
matmul_1 = call_function:matmul(div, vecinfer_layer0_rotation_1)
to_16 = call_method:to(matmul_1, torch.float32)
vecinfer_layer0_key_centroids = get_attr:vecinfer_layer0_key_centroids()
vecinfer_layer0_value_centroids = get_attr:vecinfer_layer0_value_centroids()
quantize_default = call_function:vecinfer.quantize.default(to_16, None, None, vecinfer_layer0_key_centroids)
quantize_default_1 = call_function:vecinfer.quantize.default(value_states, None, None, vecinfer_layer0_value_centroids)
scaled_dot_product_attention_2 = call_function:scaled_dot_product_attention(to_15, quantize_default, quantize_default_1, attn_mask=attention_mask, dropout_p=0.0, is_causal=False, scale=0.25, enable_gqa=True)
float_4 = call_method:float(q_embed_1)
vecinfer_layer1_lam_q = get_attr:vecinfer_layer1_lam_q()
mul_24 = call_function:mul(float_4, vecinfer_layer1_lam_q)
vecinfer_layer1_rotation = get_attr:vecinfer_layer1_rotation()
matmul_2 = call_function:matmul(mul_24, vecinfer_layer1_rotation)
to_17 = call_method:to(matmul_2, torch.float32)
float_5 = call_method:float(k_embed_1)
vecinfer_layer1_lam = get_attr:vecinfer_layer1_lam()
div_1 = call_function:div(float_5, vecinfer_layer1_lam)
vecinfer_layer1_rotation_1 = get_attr:vecinfer_layer1_rotation()
matmul_3 = call_function:matmul(div_1, vecinfer_layer1_rotation_1)
to_18 = call_method:to(matmul_3, torch.float32)
vecinfer_layer1_key_centroids = get_attr:vecinfer_layer1_key_centroids()
vecinfer_layer1_value_centroids = get_attr:vecinfer_layer1_value_centroids()
quantize_default_2 = call_function:vecinfer.quantize.default(to_18, None, None, vecinfer_layer1_key_centroids)
quantize_default_3 = call_function:vecinfer.quantize.default(value_states_1, None, None, vecinfer_layer1_value_centroids)
scaled_dot_product_attention_3 = call_function:scaled_dot_product_attention(to_17, quantize_default_2, quantize_default_3, attn_mask=attention_mask, dropout_p=0.0, is_causal=False, scale=0.25, enable_gqa=True)""",
        )
        # HF's repeat_kv (getitem -> expand -> reshape) is gone: K/V stay at 2 KV heads.
        gm = capture.graphs[0]
        # Every SDPA left attends over quantize-dequantized K and V, never the originals.
        left = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
        assert len(left) == 2
        for n in left:
            assert [a.target for a in n.args[1:3]] == [torch.ops.vecinfer.quantize.default] * 2
        for op in [n for n in gm.graph.nodes if n.target in OPS]:
            assert not repeats_heads(op)


@pytest.mark.parametrize(
    "path,layer",
    [
        ("L['self'].model.layers.3.self_attn", 3),
        ("L['args'][0].model.layers.11.self_attn", 11),
        ("L['self']._modules['model']._modules['layers']._modules['5']._modules['self_attn']", 5),
        ("L['self'].encoder.block.2.layer.0.SelfAttention", 2),
        ("L['self'].attn", None),
    ],
)
def test_layer_from_module_path(path, layer):
    assert layer_from_module_path(path) == layer


def sdpa_kw(q, k, v, attn_mask, is_causal):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)


def sdpa_positional_repeat(q, k, v, attn_mask, is_causal):
    """HF's repeat_kv in front of SDPA, positional args, explicit scale."""
    n = q.shape[1] // k.shape[1]
    b, h, t, d = k.shape
    k = k[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)
    v = v[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=0.3)


def eager_dequantized(q, k, v, attn_mask, is_causal, layer, scale=None):
    """SDPA over K/V quantized with quant.codebook encode/decode in the transformed domain."""
    t = layer.transform
    k_hat = t.keys_inverse(decode(encode(t.keys(k), layer.keys), layer.keys.float()))
    v_hat = decode(encode(v, layer.values), layer.values.float())
    return F.scaled_dot_product_attention(
        q, k_hat.to(q.dtype), v_hat.to(q.dtype), attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True
    )


FUNCS = [(sdpa_kw, None), (sdpa_positional_repeat, 0.3)]


@pytest.mark.parametrize("fn,scale", FUNCS, ids=["kw-gqa", "positional-repeat_kv"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=attention_cases(masks=("none", "causal", "bool", "float"), max_len=12))
def test_transform_only_is_exact(fn, scale, case):
    torch._dynamo.reset()
    x = make_attention_inputs(case)
    args = (x["query"], x["key"], x["value"], x["attn_mask"], x["is_causal"])
    capture = Capture(quantize=False)
    out = torch.compile(fn, backend=capture, fullgraph=True)(*args)
    torch.testing.assert_close(out, fn(*args), atol=1e-5, rtol=1e-5)
    assert counters["vecinfer"]["sdpa_rewrites"] >= 1


@pytest.mark.parametrize("fn,scale", FUNCS, ids=["kw-gqa", "positional-repeat_kv"])
@pytest.mark.parametrize("mask", ["bool", "float", "causal"])
def test_codes_match_eager_dequantize(fn, scale, mask):
    from vecinfer_compile.testing import AttentionCase

    case = AttentionCase(2, 4, 2, 9, 9, 32, torch.float32, mask)
    x = make_attention_inputs(case, seed=1)
    args = (x["query"], x["key"], x["value"], x["attn_mask"], x["is_causal"])
    capture = Capture(quantize=True)
    out = torch.compile(fn, backend=capture, fullgraph=True)(*args)
    expected = eager_dequantized(*args, capture.layers[0], scale=scale)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # K/V reach the ops at 2 KV heads: no expand/reshape feeds the ops.
    for op in [n for n in capture.graphs[0].graph.nodes if n.target in OPS]:
        assert not repeats_heads(op)


def test_residual_window_uses_full_precision_keys():
    from vecinfer_compile.testing import AttentionCase

    x = make_attention_inputs(AttentionCase(1, 4, 2, 6, 6, 16, torch.float32, "none"), seed=2)
    args = (x["query"], x["key"], x["value"], None, True)
    capture = Capture(quantize=True, residual=6)  # window covers every causal key: exact
    out = torch.compile(sdpa_kw, backend=capture, fullgraph=True)(*args)
    torch.testing.assert_close(out, sdpa_kw(*args), atol=1e-5, rtol=1e-5)


def test_dropout_is_a_clear_error():
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(Exception, match="dropout_p=0.1.*model.eval"):
        torch.compile(f, backend=Capture(), fullgraph=True)(q, q, q)


def test_fake_example_inputs_ask_for_codebooks():
    captured = []

    def grab(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    q = torch.randn(1, 2, 4, 16)
    torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend=grab)(q, q, q)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(q)] * 3
    with pytest.raises(ValueError, match="fake/meta.*configure\\(codebooks="):
        vecinfer_backend.configure()(captured[0], fake)


def test_graph_without_sdpa_warns_once(caplog):
    backend = vecinfer_backend.configure()
    with caplog.at_level(logging.WARNING, logger="vecinfer_compile.backend"):
        f = torch.compile(lambda x: x.relu() + 1, backend=backend)
        f(torch.randn(3))
        f(torch.randn(3, 4))
    messages = [r.getMessage() for r in caplog.records if "scaled_dot_product_attention" in r.getMessage()]
    assert len(messages) == 1 and 'attn_implementation="sdpa"' in messages[0]


def test_sdpa_left_over_a_cache_read_is_not_rewritten():
    """cache_decode tags the SDPA calls over VecInferCache reads it cannot fuse: their K/V are
    already dequantized codes, so the generic rewrite must skip them."""
    from vecinfer_compile.passes.cache_attention import CACHE_READ_META

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q = torch.randn(1, 2, 4, 16)
    torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend=grab)(q, q, q)
    (node,) = [n for n in graphs[0].graph.nodes if n.target is F.scaled_dot_product_attention]
    assert len(find_sdpa_sites(graphs[0])) == 1
    node.meta[CACHE_READ_META] = True
    assert find_sdpa_sites(graphs[0]) == []
