"""The conformance suite: every registered codec (:mod:`vecinfer_compile.codecs.registry`) runs these
checks by being registered, with no edit here. Each draws the shapes users have (MHA, GQA, MQA,
head_dim 64 and 128, odd lengths, left padding) and compares the codec's cache paths with their
float32 oracles: the simulate path's quantize-dequantize, SDPA over the layer's dequantized read.

- round trip: the cache's coded slots read back as the simulate path decodes them;
- append = fill: tokens appended one by one hold the codes and window of one prefill (the window rule);
- decode = oracle: one query token over codes and window, as SDPA over the read;
- chunk = oracle: a chunk over the coded prefix, the old window and its own keys, as SDPA over them;
- bytes: the codes take the codec's bytes a token and head, and the cache counts its operands;
- the file: a round trip keeps every code; a NaN, a missing or a misshapen tensor of the codec's
  section is refused naming the file; another codec's section under this codec's name is refused;
- the compiled pass: the rewritten decode graph of a layer holds the codec's decode op and no read.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import scalar_codec
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.cache import reads
from vecinfer_compile.codecs import registry
from vecinfer_compile.testing import cache_layer, random_layer_codebooks

CODECS = (*registry.names(), scalar_codec.NAME)  # the registered ones, and the minimal one of the tests


@pytest.fixture(autouse=True, scope="module")
def with_test_codecs():
    with scalar_codec.registered():
        yield


SHAPES = [(1, 4, 128), (2, 2, 64), (4, 1, 64)]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")],
    ),
]  # (KV heads, query heads a KV head, head_dim): MQA, GQA, MHA


def coded_layer(name: str, hkv: int, d: int, seed: int, bits: float = 2.0, **transform):
    """A random layer (a query-aware, centred transform unless ``transform`` says otherwise) whose
    keys and values the codec ``name`` codes with random codes."""
    codec = registry.get(name)
    gen = torch.Generator().manual_seed(seed)
    base = random_layer_codebooks(
        hkv, d, bits=bits, seed=seed, **(transform or dict(query_aware=True, smooth=False, center=True))
    )
    return dataclasses.replace(
        base, keys=codec.random_code(gen, hkv, d, bits, "key"), values=codec.random_code(gen, hkv, d, bits, "value")
    )


def oracle_kv(layer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The simulate path's dequantized ``k``, ``v`` (every token coded), float32."""
    kt = layer.transform.keys(k)
    k_hat = layer.transform.keys_inverse(layer.key_codec.quantize_dequantize(layer.keys, kt))
    return k_hat.float(), layer.value_codec.quantize_dequantize(layer.values, v).float()


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("hkv, group, d", SHAPES)
def test_the_cache_reads_back_what_the_simulate_path_decodes(name, hkv, group, d):
    layer = coded_layer(name, hkv, d, seed=d + hkv)
    cached = cache_layer(layer, num_kv_heads=hkv, head_dim=d, max_cache_len=24, residual=3, batch_size=2)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, hkv, 13, d, generator=gen) for _ in range(2))
    cached.update(k, v)
    k_read, v_read = cached.dequantized()
    want_k, want_v = oracle_kv(layer, k[:, :, :10], v[:, :, :10])
    torch.testing.assert_close(k_read[:, :, :10], want_k, atol=3e-4, rtol=3e-4)
    torch.testing.assert_close(v_read[:, :, :10], want_v, atol=3e-4, rtol=3e-4)
    torch.testing.assert_close(k_read[:, :, 10:13], k[:, :, 10:13], atol=2e-4, rtol=2e-4)  # the window
    torch.testing.assert_close(v_read[:, :, 10:13], v[:, :, 10:13])
    assert k_read[:, :, 13:].abs().max() <= 1e-4 + layer.transform.mean.abs().max()  # past the valid slots


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), shape=st.sampled_from(SHAPES), tokens=st.integers(1, 17), residual=st.integers(0, 5))
def test_appending_one_token_at_a_time_stores_what_one_prefill_stores(name, seed, shape, tokens, residual):
    hkv, _, d = shape
    layer = coded_layer(name, hkv, d, seed=seed % 97)
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, hkv, tokens + 1, d, generator=gen) for _ in range(2))
    whole, steps = (
        cache_layer(layer, num_kv_heads=hkv, head_dim=d, max_cache_len=24, residual=residual) for _ in range(2)
    )
    whole.update(k[:, :, :1], v[:, :, :1])
    whole.update(k[:, :, 1:], v[:, :, 1:]) if tokens > 1 else None
    for t in range(tokens + 1):
        steps.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    if tokens > 1:  # a chunk and single tokens end with the same slots coded and the same window
        a, b = whole.storage, steps.storage
        assert (int(a.n_coded), int(a.n_window)) == (int(b.n_coded), int(b.n_window))
        n = int(a.n_coded)
        assert torch.equal(a.k_codes[:, :, :n], b.k_codes[:, :, :n])
        assert torch.equal(a.v_codes[:, :, :n], b.v_codes[:, :, :n])
        torch.testing.assert_close(a.k_window[:, :, : int(a.n_window)], b.k_window[:, :, : int(b.n_window)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from(SHAPES),
    tokens=st.integers(1, 21),
    residual=st.integers(0, 6),
    left_pad=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_decode_step_attends_as_sdpa_over_the_read(name, device, seed, shape, tokens, residual, left_pad, dtype):
    """On CUDA the codec's kernels (bfloat16: its CUDA kernel where it has one; float32: Triton)."""
    hkv, group, d = shape
    layer = coded_layer(name, hkv, d, seed=seed % 89)
    gen = torch.Generator().manual_seed(seed)
    b, slots = 2, 24
    cached = cache_layer(
        layer,
        num_kv_heads=hkv,
        head_dim=d,
        max_cache_len=slots,
        residual=residual,
        batch_size=b,
        dtype=dtype,
        device=device,
    )
    k, v = (torch.randn(b, hkv, tokens, d, generator=gen).to(device, dtype) for _ in range(2))
    cached.update(k, v)
    k_read, v_read = (x.float() for x in cached.dequantized())
    q = torch.randn(b, hkv * group, 1, d, generator=gen).to(device, dtype)
    mask = torch.zeros(b, 1, 1, slots, dtype=torch.bool, device=device)
    mask[:, :, :, :tokens] = True
    if left_pad:
        mask[0, :, :, : int(torch.randint(0, tokens, (1,), generator=gen))] = False
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k_read.repeat_interleave(group, 1), v_read.repeat_interleave(group, 1), attn_mask=mask
    )
    got = cached.attend(q, mask, None)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 3e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("hkv, group, d", SHAPES)
def test_a_chunk_attends_over_the_codes_the_old_window_and_itself(name, device, hkv, group, d):
    """A chunk of C tokens into a layer holding codes and a window: the coded prefix as the read
    gives it, the old window and the chunk in full precision, causal within the chunk (on CUDA in
    bfloat16: the split attention's library kernels over the codec's workspace)."""
    layer = coded_layer(name, hkv, d, seed=7 * d + hkv)
    gen = torch.Generator().manual_seed(2)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    residual, held, c, slots = 3, 9, 5, 24
    cached = cache_layer(
        layer, num_kv_heads=hkv, head_dim=d, max_cache_len=slots, residual=residual, dtype=dtype, device=device
    )
    k, v = (torch.randn(1, hkv, held + c, d, generator=gen).to(device, dtype) for _ in range(2))
    cached.update(k[:, :, :held], v[:, :, :held])
    before_k, before_v = (x.float() for x in cached.dequantized())
    q = torch.randn(1, hkv * group, c, d, generator=gen).to(device, dtype)
    keys = torch.cat([before_k[:, :, :held], k[:, :, held:].float()], 2)
    values = torch.cat([before_v[:, :, :held], v[:, :, held:].float()], 2)
    causal = torch.ones(c, held + c, dtype=torch.bool, device=device).tril(held)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(),
        keys.float().repeat_interleave(group, 1),
        values.float().repeat_interleave(group, 1),
        attn_mask=causal,
    )
    mask = torch.zeros(1, 1, c, slots, dtype=torch.bool, device=device)
    mask[..., : held + c] = causal
    s = cached.storage
    chunk = reads.chunk_keys(
        s, cached.quantizer, cached.transform_keys(k[:, :, held:]), v[:, :, held:], int(s.n_coded), int(s.n_window)
    )  # taken before the append, as the model's step does
    cached.update(k[:, :, held:], v[:, :, held:])
    got = cached.attend_chunk(q, mask, None, chunk)
    tol = 3e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bits", [2.0, 1.25])
def test_the_codes_take_the_codecs_bytes_and_the_cache_counts_its_operands(name, bits):
    from vecinfer_compile.evaluation.kv_bytes import cache_bytes

    codec, hkv, d, slots = registry.get(name), 2, 64, 16
    try:
        layer = coded_layer(name, hkv, d, seed=3, bits=bits)
    except ValueError as e:  # a codec may refuse bits it cannot code, by name
        pytest.skip(str(e))
    cached = cache_layer(layer, num_kv_heads=hkv, head_dim=d, max_cache_len=slots, residual=2, batch_size=3)
    cached.update(*(torch.randn(3, hkv, 7, d) for _ in range(2)))
    s = cached.storage
    assert s.k_codes.shape == (3, hkv, slots, codec.code_bytes(layer.keys, d))
    assert s.v_codes.shape == (3, hkv, slots, codec.code_bytes(layer.values, d))
    assert codec.code_bytes(layer.keys, d) * 8 >= bits * d  # never fewer bits than nominal

    class OneLayer:  # what cache_bytes reads of a VecInferCache
        layers = [cached]

        def coded_layers(self):
            return [cached]

    counted = cache_bytes(OneLayer())
    operands = sum(t.numel() * t.element_size() for t in codec.operand_tensors(cached.quantizer.operands))
    assert counted.fixed >= operands > 0
    assert counted.codes == s.k_codes.numel() + s.v_codes.numel()


def _saved(name: str, tmp_path):
    from vecinfer_compile.codebooks import VecInferCodebooks

    geometry = {
        "model_type": "llama",
        "num_layers": 2,
        "num_query_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "hidden_size": 256,
        "vocab_size": 128,
    }
    layers = [coded_layer(name, 2, 64, seed=i, query_aware=False, smooth=True, rotate=True) for i in range(2)]
    cb = VecInferCodebooks("vecinfer", 2.0, layers, geometry, {})
    return cb, cb.save(tmp_path / "cb.safetensors")


@pytest.mark.parametrize("name", CODECS)
def test_a_file_round_trip_keeps_every_code_and_corruption_is_refused(name, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vecinfer_compile.codebooks import load_codebooks

    codec = registry.get(name)
    cb, path = _saved(name, tmp_path)
    back = load_codebooks(path)
    assert back.codecs == (name, name)
    for a, b in zip(cb.layers, back.layers):
        for side in ("keys", "values"):
            for x, y in zip(codec.state_tensors(getattr(a, side)), codec.state_tensors(getattr(b, side))):
                torch.testing.assert_close(x.float(), y.float(), atol=0, rtol=0)
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    section = codec.tensor_names("key", tensors)
    assert section, "the codec's section names its tensors"

    def refused(changed: dict, match: str, metadata=meta):
        bad = tmp_path / "bad.safetensors"
        bad.unlink(missing_ok=True)
        save_file(changed, str(bad), metadata=metadata)
        with pytest.raises(ValueError, match=match):
            load_codebooks(bad)

    poisoned = dict(tensors)
    poisoned[section[0]] = poisoned[section[0]].clone().float().fill_(float("nan"))
    refused(poisoned, r"bad\.safetensors.*(NaN|corrupt)")
    refused({k: t for k, t in tensors.items() if k != section[-1]}, r"bad\.safetensors.*(missing|needs|corrupt)")
    misshapen = dict(tensors)
    misshapen[section[0]] = misshapen[section[0]][..., :1].contiguous()
    refused(misshapen, r"bad\.safetensors.*(shape|misshapen|corrupt)")
    for other in registry.names():
        if other != name:  # this codec's tensors under another codec's name
            renamed = json.loads(meta["vecinfer"])
            renamed["key_codec"] = other
            refused(tensors, r"bad\.safetensors", metadata={"vecinfer": json.dumps(renamed)})


@pytest.mark.parametrize("name", CODECS)
def test_the_compiled_decode_graph_holds_the_codecs_decode_op_and_no_read(name):
    """One layer's decode step traced as Dynamo sees it (the read, then SDPA over it), rewritten by
    the pass's table: the codec's decode op in place of SDPA, the read erased."""
    import torch.fx as fx

    from vecinfer_compile.passes.cache_attention import rewrite_cache_attention

    hkv, group, d = 2, 2, 64
    layer = coded_layer(name, hkv, d, seed=5, query_aware=False, smooth=True, rotate=True)
    cached = cache_layer(layer, num_kv_heads=hkv, head_dim=d, max_cache_len=16, residual=2)
    cached.update(*(torch.randn(1, hkv, 6, d) for _ in range(2)))
    s, qz = cached.storage, cached.quantizer

    def step(q, k_codes, v_codes, n_coded, k_window, v_window, n_window, mask):
        k, v = qz.codec.read_kv(k_codes, v_codes, n_coded, k_window, v_window, n_window, qz)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
        )

    q = torch.randn(1, hkv * group, 1, d)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    mask[..., 6:] = False
    args = (q, s.k_codes, s.v_codes, s.n_coded, s.k_window, s.v_window, s.n_window, mask)
    graphs = []

    def backend(gm: fx.GraphModule, example_inputs):
        graphs.append(rewrite_cache_attention(gm))
        text = str(gm.graph)
        graphs.append(text)
        return gm

    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(*args)
    assert graphs[0] == 1, graphs
    read_op, decode_op = qz.codec.rewrite.read_op, qz.codec.rewrite.decode(q, (None,) * 10, None, 1.0, None)[0]
    assert str(decode_op).split(".")[-2] in graphs[1] and f"vecinfer.{read_op}" not in graphs[1]
    torch.testing.assert_close(got, step(*args), atol=3e-4, rtol=3e-4)


@pytest.mark.parametrize("name", [n for n in registry.names() if n != registry.DEFAULT])
def test_no_core_module_names_a_codec(name):
    """The core asks the registry: outside its own package a codec's name appears only in the
    registry and in the command line's options for it."""
    import pathlib

    import vecinfer_compile

    root = pathlib.Path(vecinfer_compile.__file__).parent
    allowed = {root / "codecs" / "registry.py", root / "commands" / "calibrate.py"}
    naming = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if name in path.read_text().lower() and path not in allowed and (root / "codecs" / name) not in path.parents
    ]
    assert naming == []
