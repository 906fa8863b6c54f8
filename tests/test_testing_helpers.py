"""vecinfer_compile.testing: the hypothesis strategy, input maker, tiny models and check_model's
error for a model without SDPA."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from vecinfer_compile.testing import (
    MASK_KINDS,
    TINY_FAMILIES,
    attention_cases,
    check_model,
    make_attention_inputs,
    random_layer_codebooks,
    tiny_model,
)


@settings(max_examples=40, deadline=None)
@given(case=attention_cases(dtypes=(torch.float32, torch.bfloat16)))
def test_attention_cases_are_valid_sdpa_inputs(case):
    assert case.q_heads % case.kv_heads == 0 and 1 <= case.q_len <= case.kv_len
    assert case.head_dim % 16 == 0 and case.mask in MASK_KINDS
    x = make_attention_inputs(case, seed=1)
    assert x["query"].shape == (case.batch, case.q_heads, case.q_len, case.head_dim)
    assert x["key"].shape == x["value"].shape == (case.batch, case.kv_heads, case.kv_len, case.head_dim)
    assert x["query"].dtype == case.dtype
    out = F.scaled_dot_product_attention(**x, enable_gqa=True)
    assert torch.isfinite(out).all()  # no fully masked row


@settings(max_examples=5, deadline=None)
@given(case=attention_cases())
def test_make_attention_inputs_is_seeded(case):
    a, b = make_attention_inputs(case, seed=3), make_attention_inputs(case, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in ("query", "key", "value"))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_models_have_the_documented_geometry(family):
    model = tiny_model(family)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg._attn_implementation == "sdpa" and not model.training


def test_random_layer_codebooks_follow_the_preset():
    layer = random_layer_codebooks(2, 16, bits=1.25, seed=0)
    assert layer.keys.shape == (4096, 8) and layer.values.shape == (256, 8)
    assert layer.transform.lam.shape == (2, 16) and (layer.transform.lam > 0).all()
    assert random_layer_codebooks(2, 16, smooth=False).transform.lam is None


def test_check_model_reports_a_model_without_sdpa(caplog):
    model = tiny_model("llama", attn_implementation="eager")
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="vecinfer_compile.backend"):
        with pytest.raises(AssertionError, match='rewrote 0 SDPA call.*attn_implementation="sdpa"'):
            check_model(model, ids)
    assert any('attn_implementation="sdpa"' in r.getMessage() for r in caplog.records)
