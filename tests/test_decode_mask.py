"""The decode-step mask of "vecinfer_sdpa" (vecinfer_compile.hf.decode_mask) against transformers' sdpa_mask."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

from vecinfer_compile.hf import decode_mask
from vecinfer_compile.hf.compat import forward_cache_kwargs
from vecinfer_compile.hf.decode_mask import decode_sdpa_mask


@st.composite
def decode_calls(draw):
    """One decode step's mask arguments: a static cache of ``kv_length`` slots from ``kv_offset``,
    the query at ``q_offset``, a 2D mask (None, left padding, holes, or longer than the slots) in
    bool or int64."""
    b = draw(st.integers(1, 4))
    kv_length = draw(st.integers(1, 300))
    kv_offset = draw(st.integers(0, 5))
    q_offset = draw(st.integers(0, kv_length + kv_offset + 2))
    kind = draw(st.sampled_from(["none", "left", "holes", "long"]))
    mask = None
    if kind != "none":
        seen = q_offset + 1 if kind != "long" else kv_length + kv_offset + draw(st.integers(1, 5))
        seed = draw(st.integers(0, 2**16))
        gen = torch.Generator().manual_seed(seed)
        if kind == "holes":
            mask = torch.rand(b, seen, generator=gen) < 0.7
        else:
            pads = torch.randint(0, max(seen // 2, 1), (b,), generator=gen)
            mask = torch.arange(seen)[None, :] >= pads[:, None]
        mask = mask if draw(st.booleans()) else mask.long()
    return dict(
        batch_size=b, q_length=1, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset, attention_mask=mask
    )


@settings(max_examples=150, deadline=None)
@given(decode_calls())
def test_decode_step_mask_equals_sdpa_mask(call):
    expected = sdpa_mask(**call, allow_is_causal_skip=False)
    got = decode_sdpa_mask(**call, allow_is_causal_skip=False)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "change",
    [
        dict(q_length=3),  # a chunk
        dict(allow_is_causal_skip=True),  # may be None
        dict(mask_function=sliding_window_causal_mask_function(4)),
        dict(use_vmap=True),
    ],
)
def test_other_calls_are_sdpa_mask_itself(change, monkeypatch):
    call = dict(
        batch_size=2,
        q_length=1,
        kv_length=16,
        q_offset=5,
        kv_offset=0,
        attention_mask=torch.ones(2, 6, dtype=torch.bool),
        allow_is_causal_skip=False,
    )
    call.update(change)
    calls = []
    monkeypatch.setattr(decode_mask, "sdpa_mask", lambda *a, **k: calls.append(k) or sdpa_mask(*a, **k))
    got = decode_sdpa_mask(**call)
    expected = sdpa_mask(**call)
    assert len(calls) == 1
    assert (got is None and expected is None) or torch.equal(got, expected)


def _prefilled(model, cb, ids, am):
    from vecinfer_compile import VecInferCache

    cache = VecInferCache(model, cb, batch_size=2, max_cache_len=64, residual=4)
    with torch.no_grad():
        model(ids, attention_mask=am, **forward_cache_kwargs(model, cache), use_cache=True)
    return cache


def test_model_decode_step_takes_the_fast_path(monkeypatch):
    """A one-token forward over a VecInferCache (left-padded rows) builds its mask without
    sdpa_mask and gives the logits it gives with sdpa_mask registered; a chunk goes to sdpa_mask."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface

    from vecinfer_compile.hf.attention_over_codes import ATTN_NAME
    from vecinfer_compile.testing import random_codebooks

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="sdpa",
        )
    ).eval()
    cb = random_codebooks(model.config, bits=2)
    ids = torch.randint(0, 96, (2, 12))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :3] = 0
    step = dict(attention_mask=torch.cat([am, torch.ones(2, 1, dtype=torch.long)], 1), use_cache=True)
    new = torch.randint(0, 96, (2, 1))
    assert AttentionMaskInterface._global_mapping[ATTN_NAME] is decode_sdpa_mask
    calls = []
    monkeypatch.setattr(decode_mask, "sdpa_mask", lambda *a, **k: calls.append(k) or sdpa_mask(*a, **k))
    cache = _prefilled(model, cb, ids, am)
    calls.clear()
    with torch.no_grad():
        fast = model(new, **forward_cache_kwargs(model, cache), **step).logits
    assert calls == [], "the decode step's mask went to sdpa_mask"
    with torch.no_grad():
        model(
            torch.randint(0, 96, (2, 3)),
            **forward_cache_kwargs(model, cache),
            use_cache=True,
            attention_mask=torch.cat([step["attention_mask"], torch.ones(2, 3, dtype=torch.long)], 1),
        )
    assert len(calls) == 1  # a chunk of 3: sdpa_mask's own
    cache = _prefilled(model, cb, ids, am)
    calls.clear()
    monkeypatch.setitem(
        AttentionMaskInterface._global_mapping, ATTN_NAME, lambda *a, **k: calls.append(k) or sdpa_mask(*a, **k)
    )
    with torch.no_grad():
        slow = model(new, **forward_cache_kwargs(model, cache), **step).logits
    assert len(calls) == 1  # this step's mask came from sdpa_mask
    assert torch.equal(fast, slow)
