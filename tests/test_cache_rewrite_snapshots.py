"""Snapshots of the cache-attention rewrite (:mod:`vecinfer_compile.passes.cache_attention`), one
decode and one chunk graph a registered codec: what the pass's table emits in place of SDPA over
the codec's read. Regenerate with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_cache_rewrite_snapshots.py``
after a deliberate change of an emitted op or its arguments."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx
from expecttest import TestCase

from vecinfer_compile.codecs import registry
from vecinfer_compile.passes.cache_attention import rewrite_cache_attention
from vecinfer_compile.testing import cache_layer, random_layer_codebooks


def rewritten_graph(name: str, query_tokens: int) -> str:
    """The body of the graph of one layer's attention over its cache read (``query_tokens`` queries: 1
    is a decode step, more a chunk), after the rewrite, as code (a codec's operand list shown as one
    name)."""
    codec = registry.get(name)
    hkv, group, d = 2, 2, 64
    gen = torch.Generator().manual_seed(0)
    base = random_layer_codebooks(hkv, d, seed=0)
    layer = dataclasses.replace(
        base, keys=codec.random_code(gen, hkv, d, 2.0, "key"), values=codec.random_code(gen, hkv, d, 2.0, "value")
    )
    cached = cache_layer(layer, num_kv_heads=hkv, head_dim=d, max_cache_len=16, residual=4)
    cached.update(*(torch.randn(1, hkv, 6, d, generator=gen) for _ in range(2)))
    s, qz = cached.storage, cached.quantizer

    def step(q, k_codes, v_codes, n_coded, k_window, v_window, n_window, mask):
        k, v = qz.codec.read_kv(k_codes, v_codes, n_coded, k_window, v_window, n_window, qz)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
        )

    code = []

    def backend(gm: fx.GraphModule, example_inputs):
        assert rewrite_cache_attention(gm) == 1
        code.append(gm.code.strip())
        return gm

    q = torch.randn(1, hkv * group, query_tokens, d, generator=gen)
    mask = torch.ones(1, 1, query_tokens, 16, dtype=torch.bool)
    torch._dynamo.reset()
    torch.compile(step, backend=backend, fullgraph=True)(
        q, s.k_codes, s.v_codes, s.n_coded, s.k_window, s.v_window, s.n_window, mask
    )
    lines = []
    for line in code[0].splitlines()[1:]:  # the body: the rewritten nodes, placeholders' copies left out
        line = line.split(";")[0].strip()
        if line and not re.fullmatch(r"l_\w+ = L_\w+", line):
            lines.append(re.sub(r"\[l_qz_operands_(keys|values)_first, [^\]]*\]", r"<\1 operands>", line))
    return "\n".join(lines)


class RewriteSnapshots(TestCase):
    def test_codebooks_decode(self):
        self.assertExpectedInline(
            rewritten_graph("codebooks", 1),
            """\
transform_queries = vecinfer_compile_ops_decode_inputs_transform_queries(l_q_, l_qz_lam, l_qz_rotation, None)
kv_start_from_mask = vecinfer_compile_ops_decode_inputs_kv_start_from_mask(l_mask_, l_q_)
decode_attention_default = torch.ops.vecinfer.decode_attention.default(transform_queries, l_k_codes_, l_v_codes_, l_qz_operands_key_centroids, l_qz_operands_value_centroids, l_n_coded_, l_k_window_, l_v_window_, l_n_window_, kv_start_from_mask, 0.125)
return (decode_attention_default,)""",
        )

    def test_codebooks_chunk(self):
        self.assertExpectedInline(
            rewritten_graph("codebooks", 3),
            """\
transform_queries = vecinfer_compile_ops_decode_inputs_transform_queries(l_q_, l_qz_lam, l_qz_rotation, None)
chunk_attention_default = torch.ops.vecinfer.chunk_attention.default(transform_queries, l_k_codes_, l_v_codes_, l_qz_operands_key_centroids, l_qz_operands_value_centroids, l_n_coded_, l_k_window_, l_v_window_, l_n_window_, l_mask_, 0.125)
return (chunk_attention_default,)""",
        )

    def test_trellis_decode(self):
        self.assertExpectedInline(
            rewritten_graph("trellis", 1),
            """\
transform_queries = vecinfer_compile_ops_decode_inputs_transform_queries(l_q_, l_qz_lam, l_qz_rotation, None)
kv_start_from_mask = vecinfer_compile_ops_decode_inputs_kv_start_from_mask(l_mask_, l_q_)
trellis_decode_attention_default = torch.ops.vecinfer.trellis_decode_attention.default(transform_queries, l_k_codes_, l_v_codes_, l_n_coded_, l_k_window_, l_v_window_, l_n_window_, kv_start_from_mask, 0.125, <keys operands>, <values operands>)
return (trellis_decode_attention_default,)""",
        )

    def test_trellis_chunk(self):
        self.assertExpectedInline(
            rewritten_graph("trellis", 3),
            """\
transform_queries = vecinfer_compile_ops_decode_inputs_transform_queries(l_q_, l_qz_lam, l_qz_rotation, None)
trellis_chunk_attention_default = torch.ops.vecinfer.trellis_chunk_attention.default(transform_queries, l_k_codes_, l_v_codes_, l_n_coded_, l_k_window_, l_v_window_, l_n_window_, l_mask_, 0.125, <keys operands>, <values operands>)
return (trellis_chunk_attention_default,)""",
        )
