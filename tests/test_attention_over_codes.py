"""The eager one-token step over codes (``"vecinfer_sdpa"``, :mod:`vecinfer_compile.hf.attention_over_codes`):
the codes read, the layer's ``attend`` against SDPA over the dequantized cache (property test),
generate() through it, and the models it leaves alone."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cache import generate, left_padded, tiny_config  # noqa: E402
from transformers import LlamaForCausalLM

from vecinfer_compile.cache import VecInferCache, VecInferLayer
from vecinfer_compile.cache import reads as cache_reads
from vecinfer_compile.hf import attention_over_codes
from vecinfer_compile.testing import cache_layer, random_codebooks

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(b, hkv, d, r, tmax, method, bits, seed, device="cpu", dtype=torch.float32) -> VecInferLayer:
    cfg = tiny_config(
        num_hidden_layers=1, num_attention_heads=hkv, num_key_value_heads=hkv, head_dim=d, hidden_size=hkv * d
    )
    lc = random_codebooks(cfg, bits, method, seed=seed).layer(0)
    return cache_layer(
        lc, num_kv_heads=hkv, head_dim=d, max_cache_len=tmax, residual=r, batch_size=b, dtype=dtype, device=device
    )


def _padding_mask(pad: list[int], length: int, tmax: int, device, additive: bool) -> torch.Tensor:
    """HF's decode mask ``[B, 1, 1, tmax]``: row b attends slots ``pad[b] <= s < length``."""
    slots = torch.arange(tmax, device=device)
    attend = ((slots[None] >= torch.tensor(pad, device=device)[:, None]) & (slots[None] < length))[:, None, None]
    if not additive:
        return attend
    return torch.zeros(attend.shape, device=device).masked_fill(~attend, torch.finfo(torch.float32).min)


def _sdpa_over_read(layer: VecInferLayer, q, mask, scale) -> torch.Tensor:
    k, v = layer.dequantized()
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=scale
    )


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(["vecinfer", "vq", "qaware", "vecinfer-center"]),
    bits=st.sampled_from([2.0, 1.25, 4.0]),
    group=st.sampled_from([1, 2, 4]),
    hkv=st.sampled_from([1, 2]),
    d=st.sampled_from([16, 64, 128]),
    batch=st.integers(1, 3),
    residual=st.sampled_from([0, 3, 8]),
    prompt=st.integers(1, 13),
    steps=st.integers(0, 5),
    additive=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attend_equals_sdpa_over_the_dequantized_cache(
    method, bits, group, hkv, d, batch, residual, prompt, steps, additive, seed
):
    """``layer.attend`` (decode_attention over codes + window, the query-side transform, kv_start
    from the mask) == SDPA over the layer's dequantized K/V with the same mask: every transform
    family, MHA / GQA 2, 4 / MQA, head_dim 16, 64, 128, the window empty, partial or full, left
    padding, bool and additive masks."""
    torch.manual_seed(seed)
    tmax = 24
    layer = _layer(batch, hkv, d, residual, tmax, method, bits, seed)
    layer.update(torch.randn(batch, hkv, prompt, d), torch.randn(batch, hkv, prompt, d))
    for _ in range(steps):
        layer.update(torch.randn(batch, hkv, 1, d), torch.randn(batch, hkv, 1, d))
    length = prompt + steps
    pad = [min(i * 2, length - 1) for i in range(batch)]
    mask = _padding_mask(pad, length, tmax, "cpu", additive)
    q = torch.randn(batch, hkv * group, 1, d)
    scale = 1 / math.sqrt(d)
    torch.testing.assert_close(
        layer.attend(q, mask, scale), _sdpa_over_read(layer, q, mask, scale), rtol=1e-4, atol=1e-5
    )


def _chunk_case(method, group, hkv, d, batch, residual, prompt, chunk, seed):
    """A layer holding ``prompt`` tokens, its read before a chunk, the chunk's update and queries;
    returns ``(layer, keys, before_k, before_v, k, v, q)``."""
    torch.manual_seed(seed)
    layer = _layer(batch, hkv, d, residual, 24, method, 2.0, seed)
    layer.model_config = mock.Mock(_attn_implementation=attention_over_codes.ATTN_NAME)
    layer.update(torch.randn(batch, hkv, prompt, d), torch.randn(batch, hkv, prompt, d))
    before_k, before_v = (x[:, :, :prompt] for x in layer.dequantized())
    k, v = torch.randn(batch, hkv, chunk, d), torch.randn(batch, hkv, chunk, d)
    read_k, _ = layer.update(k, v)
    keys = getattr(read_k, attention_over_codes._CHUNK)
    return layer, keys, before_k, before_v, k, v, torch.randn(batch, hkv * group, chunk, d)


def _chunk_mask(batch, prompt, chunk, pad):
    n = prompt + chunk
    slots = torch.arange(n)
    causal = slots[None, :] <= slots[n - chunk :, None]
    return (causal[None] & (slots[None, None, :] >= torch.tensor(pad)[:, None, None]))[:, None]


@settings(max_examples=30, deadline=None)
@given(
    method=st.sampled_from(["vecinfer", "qaware", "vq", "vecinfer-center"]),
    group=st.sampled_from([1, 2, 4]),
    hkv=st.sampled_from([1, 2]),
    d=st.sampled_from([16, 64, 128]),
    batch=st.integers(1, 4),
    residual=st.sampled_from([0, 3, 8]),
    prompt=st.integers(1, 9),
    chunk=st.integers(2, 11),
    explicit_mask=st.booleans(),
    one_row_at_a_time=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attend_chunk_reads_the_old_cache_and_itself_in_full_precision(
    method, group, hkv, d, batch, residual, prompt, chunk, explicit_mask, one_row_at_a_time, seed
):
    """An eager chunk (a codes read) attends by the chunk rule of ``vecinfer_compile.window``: it equals one
    SDPA over the layer's dequantized read *before* the chunk (codes and window, original key
    domain) followed by the chunk's own K/V as given, with HF's causal + left-padding mask or,
    without a mask, bottom-right causal; chunks shorter and longer than the window, every
    transform family, MHA / GQA / MQA, rows forced down to one at a time."""
    layer, keys, bk, bv, k, v, q = _chunk_case(method, group, hkv, d, batch, residual, prompt, chunk, seed)
    assert keys.length == prompt + chunk and keys.n_coded == max(prompt - residual, 0)
    mask = _chunk_mask(batch, prompt, chunk, [min(i, prompt - 1) for i in range(batch)])
    if not explicit_mask:
        mask = mask[:1].clone()
        mask[:] = _chunk_mask(1, prompt, chunk, [0])
    kk, vv = (torch.cat([a, b], 2).repeat_interleave(group, 1) for a, b in ((bk, k), (bv, v)))
    want = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    with mock.patch("vecinfer_compile.ops.split_attention.chunk.WORKSPACE_BYTES", 1 if one_row_at_a_time else 1 << 30):
        got = layer.attend_chunk(q, mask if explicit_mask else None, None, keys)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change", ["none", "hole", "per head", "bias"])
def test_attend_chunk_applies_a_mask_it_cannot_reduce_to_left_padding(change):
    """A chunk mask with more than causality and left padding in it (a hole, heads that differ, a
    bias) is applied as it is, by the dense path; plain causal + left padding never takes it."""
    layer, keys, bk, bv, k, v, q = _chunk_case("vecinfer", 2, 2, 16, 2, 4, 9, 6, 0)
    mask = _chunk_mask(2, 9, 6, [0, 3]).expand(2, 4, 6, 15)
    mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    if change == "hole":
        mask[1, :, :, 6] = torch.finfo(torch.float32).min
    elif change == "per head":
        mask[0, 1, :, 2] = torch.finfo(torch.float32).min
    elif change == "bias":
        mask[0, :, :, :9] = -0.5 * torch.arange(9.0)
    kk, vv = (torch.cat([a, b], 2).repeat_interleave(2, 1) for a, b in ((bk, k), (bv, v)))
    from vecinfer_compile.ops.split_attention import chunk as chunk_attention

    with mock.patch.object(
        chunk_attention, "reference_by_rows", side_effect=chunk_attention.reference_by_rows
    ) as dense:
        got = layer.attend_chunk(q, mask, None, keys)
    given = dense.call_args.args[4]
    assert given is None if change == "none" else torch.equal(given, mask)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change", ["none", "hole", "valid slot hidden", "per head", "bias"])
def test_attend_checks_what_the_decode_op_can_read_of_a_mask(change):
    """The decode op reads a mask's left padding only; a mask with more in it (a hole after the
    first attended slot, a valid slot hidden, heads that differ, an additive bias) gets SDPA over
    the dequantized cache instead, so the answer is exact either way, and plain left padding
    never takes that path."""
    torch.manual_seed(0)
    b, hkv, group, d, tmax = 2, 2, 2, 16, 24
    layer = _layer(b, hkv, d, 4, tmax, "vecinfer", 2.0, 0)
    layer.update(torch.randn(b, hkv, 9, d), torch.randn(b, hkv, 9, d))
    layer.update(torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d))
    mask = _padding_mask([0, 3], 10, tmax, "cpu", additive=True).expand(b, hkv * group, 1, tmax).clone()
    if change == "hole":
        mask[1, :, :, 6] = torch.finfo(torch.float32).min
    elif change == "valid slot hidden":
        mask[0, :, :, 9] = torch.finfo(torch.float32).min
    elif change == "per head":
        mask[0, 1, :, 2] = torch.finfo(torch.float32).min
    elif change == "bias":
        mask[0, :, :, :10] = -0.5 * torch.arange(10.0)
    q = torch.randn(b, hkv * group, 1, d)
    with mock.patch.object(cache_reads, "sdpa_by_rows", autospec=True, side_effect=cache_reads.sdpa_by_rows) as by_rows:
        got = layer.attend(q, mask, None)
    assert by_rows.called == (change != "none")
    torch.testing.assert_close(got, _sdpa_over_read(layer, q, mask, None), rtol=1e-4, atol=1e-5)


def test_codes_read_holds_no_memory_and_is_dequantized_for_other_consumers():
    layer = _layer(2, 2, 16, 4, 24, "vecinfer", 2.0, 0)
    k, v = attention_over_codes.codes_read(layer, (2, 2, 24, 16), torch.float32, torch.device("cpu"))
    assert k.stride() == (0, 0, 0, 0) and k.untyped_storage().nbytes() == 4
    assert getattr(k, attention_over_codes._LAYER) is layer and getattr(v, attention_over_codes._LAYER) is layer
    q = torch.randn(2, 2, 1, 16)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, *layer.dequantized())
    )


@pytest.mark.parametrize("method", ["vecinfer", "qaware"])
def test_generate_steps_read_codes(monkeypatch, method):
    """An eager generate() with a VecInferCache switches the model to ``vecinfer_sdpa``; every
    one-token step of every layer then runs ``attend`` (never the dequantized read), and tokens
    and logits equal those of the dequantized read under plain ``sdpa``."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    cb = random_codebooks(model.config, 2.0, method)
    ids, mask = left_padded(batch=3, length=12, pad=4)
    attends, reads = [], []
    real_attend, real_read = VecInferLayer.attend, cache_reads.read
    monkeypatch.setattr(VecInferLayer, "attend", lambda self, *a: attends.append(1) or real_attend(self, *a))
    monkeypatch.setattr(cache_reads, "read", lambda *a, **kw: reads.append(a[2:]) or real_read(*a, **kw))
    outs = {}
    for impl in ("vecinfer_sdpa", "sdpa"):
        attends.clear(), reads.clear()
        cache = VecInferCache(model, cb, max_cache_len=40, residual=4)
        assert model.config._attn_implementation == "vecinfer_sdpa"
        model.set_attn_implementation(impl)
        outs[impl] = generate(
            model,
            ids,
            mask,
            cache,
            max_new_tokens=10,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        steps = 9 * model.config.num_hidden_layers  # the first forward is the prefill
        assert (len(attends), len(reads)) == ((steps, 0) if impl == "vecinfer_sdpa" else (0, steps))
    got, want = outs["vecinfer_sdpa"], outs["sdpa"]
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_other_attention_implementations_are_left_alone():
    model = LlamaForCausalLM(tiny_config(attn_implementation="eager")).eval()
    cache = VecInferCache(model, random_codebooks(model.config, 2.0), max_cache_len=40, residual=4)
    assert model.config._attn_implementation == "eager"
    ids, mask = left_padded(batch=2, length=8, pad=2)
    out = generate(model, ids, mask, cache, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 11)


def test_codes_read_refuses_what_the_decode_op_cannot_do():
    layer = _layer(1, 2, 16, 4, 24, "vecinfer", 2.0, 0)
    layer.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16))
    k, v = attention_over_codes.codes_read(layer, (1, 2, 24, 16), torch.float32, torch.device("cpu"))
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match="model.eval"):
        attention_over_codes.codes_attention_forward(None, q, k, v, None, dropout=0.1)
    for name, value in (
        ("softcap", 30.0),
        ("s_aux", torch.zeros(4)),
        ("sinks", torch.zeros(4)),
        ("indices", torch.zeros(1, 4, 1, 2, dtype=torch.long)),
        ("block_indices", torch.zeros(1, 1)),
    ):
        with pytest.raises(NotImplementedError, match=f"\\({name}\\).*run this model without VecInfer"):
            attention_over_codes.codes_attention_forward(None, q, k, v, None, **{name: value})
    with pytest.raises(ValueError, match="4-d"):
        attention_over_codes.codes_attention_forward(None, q, k, v, torch.ones(1, 24, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="one-token codes read"):
        attention_over_codes.codes_attention_forward(None, torch.randn(1, 4, 3, 16), k, v, None)
    layer.model_config = mock.Mock(_attn_implementation=attention_over_codes.ATTN_NAME)
    k, v = layer.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))  # a chunk's read: 9 valid slots of 24
    with pytest.raises(ValueError, match="cache's slots"):
        attention_over_codes.codes_attention_forward(
            None, torch.randn(1, 4, 3, 16), k, v, torch.ones(1, 1, 3, 23, dtype=torch.bool)
        )


@pytest.mark.cuda
@pytest.mark.parametrize("group", [1, 4])
def test_attend_on_cuda_equals_the_reference(group):
    """On the GPU ``attend`` runs the decode kernel the request picks (CUDA or Triton) in bf16;
    it matches SDPA over the dequantized read in float32, with left padding and a partial window."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    b, hkv, d, tmax = 3, 2, 128, 300
    layer = _layer(b, hkv, d, 16, tmax, "vecinfer", 2.0, 0, device="cuda", dtype=torch.bfloat16)
    layer.update(
        torch.randn(b, hkv, 201, d, device="cuda", dtype=torch.bfloat16),
        torch.randn(b, hkv, 201, d, device="cuda", dtype=torch.bfloat16),
    )
    for _ in range(7):
        layer.update(
            torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16),
            torch.randn(b, hkv, 1, d, device="cuda", dtype=torch.bfloat16),
        )
    mask = _padding_mask([0, 5, 77], 208, tmax, "cuda", additive=False)
    q = torch.randn(b, hkv * group, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (t.float() for t in layer.dequantized())
    want = F.scaled_dot_product_attention(
        q.float(), k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=d**-0.5
    )
    got = layer.attend(q, mask, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["vecinfer", "qaware"])
def test_attend_chunk_on_cuda_takes_the_fast_path(method):
    """On the GPU in bf16 a chunk after a left-padded prompt runs the chunk attention's fast path
    (no dense read) and equals the float32 oracle; then an eager generate(prefill_chunk_size=...)
    on a small model runs through it end to end (with a compile config, transformers compiles the
    chunked prefill on CUDA: that path is the compiled one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vecinfer_compile.ops import reference
    from vecinfer_compile.ops.split_attention import chunk as chunk_attention

    torch.manual_seed(0)
    b, hkv, group, d, prompt, chunk = 3, 2, 4, 128, 301, 77
    layer = _layer(b, hkv, d, 16, 512, method, 2.0, 0, device="cuda", dtype=torch.bfloat16)
    layer.model_config = mock.Mock(_attn_implementation=attention_over_codes.ATTN_NAME)
    layer.update(*(torch.randn(b, hkv, prompt, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
    k, _ = layer.update(*(torch.randn(b, hkv, chunk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
    keys = getattr(k, attention_over_codes._CHUNK)
    start = torch.tensor([0, 5, 200], device="cuda")
    mask = reference.chunk_mask(b, chunk, prompt + chunk, start, "cuda")
    q = torch.randn(b, hkv * group, chunk, d, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(chunk_attention, "reference_by_rows", side_effect=AssertionError("dense path")):
        got = layer.attend_chunk(q, mask, None, keys)
    from vecinfer_compile.ops.decode_inputs import transform_queries

    qz = layer.quantizer
    want = reference.chunk_attention(
        transform_queries(q, qz.lam, qz.rotation, qz.key_read).float(), keys, start, d**-0.5
    )
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)

    model = LlamaForCausalLM(tiny_config(head_dim=64, hidden_size=128)).eval().to("cuda", torch.bfloat16)
    cache = VecInferCache(model, random_codebooks(model.config, 2.0, method), max_cache_len=80, residual=8)
    ids, pad = left_padded(batch=2, length=40, pad=5)
    fast = mock.patch.object(chunk_attention, "split_flash", side_effect=chunk_attention.split_flash)
    with fast as split, mock.patch.object(chunk_attention, "reference_by_rows", side_effect=AssertionError("dense")):
        out = generate(
            model,
            ids.cuda(),
            pad.cuda(),
            cache,
            max_new_tokens=5,
            do_sample=False,
            prefill_chunk_size=16,
            disable_compile=True,
        )
    assert out.shape == (2, 45) and split.call_count == 2 * model.config.num_hidden_layers  # chunks 2 and 3
