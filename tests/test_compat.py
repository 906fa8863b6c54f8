"""The cache keyword of a model's forward on the installed transformers
(:mod:`vecinfer_compile.hf.compat`): ``past_key_values=`` on 5.17, ``cache=`` on 5.25."""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from vecinfer_compile.hf.compat import forward_cache_kwargs


class _OldForward(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, **kwargs):
        return input_ids


class _NewForward(torch.nn.Module):
    def forward(self, input_ids, cache=None, **kwargs):
        return input_ids


def test_the_keyword_the_forward_names():
    cache = object()
    assert forward_cache_kwargs(_OldForward(), cache) == {"past_key_values": cache}
    assert forward_cache_kwargs(_NewForward(), cache) == {"cache": cache}
    compiled = torch.compile(_NewForward())  # read through torch.compile's wrapper
    assert forward_cache_kwargs(compiled, cache) == {"cache": cache}


def test_forward_fills_the_cache_without_a_deprecation_warning():
    """On the installed transformers the keyword reaches the model (not its ``**kwargs``): the
    cache holds the prompt, and nothing warns."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        model(torch.randint(0, 64, (1, 5)), **forward_cache_kwargs(model, cache), use_cache=True)
    assert cache.get_seq_length() == 5
