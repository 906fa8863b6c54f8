"""The transformers keywords that differ across the versions this package supports (5.17 to 5.x).

A model's forward takes its cache as ``past_key_values=`` on transformers 5.17 and as ``cache=``
on 5.25, where ``past_key_values=`` still works but warns (removal announced for 5.40). A keyword
the forward does not name would vanish into its ``**kwargs``: the model would run without the
cache. :func:`forward_cache_kwargs` gives the one that the model's own forward names, read from
its signature once per model class. ``generate()`` takes its cache as ``cache=`` from 5.24 on
(``past_key_values=`` deprecated): :func:`cache_kwargs` gives the installed version's keyword.
"""

from __future__ import annotations

import functools
import inspect


def forward_cache_kwargs(model, cache) -> dict:
    """``{"cache": cache}`` when ``model``'s forward names ``cache``, else
    ``{"past_key_values": cache}``; ``model``: a transformers model, or one wrapped by
    ``torch.compile``. Use as ``model(ids, **forward_cache_kwargs(model, cache), use_cache=True)``."""
    return {_forward_cache_keyword(type(getattr(model, "_orig_mod", model))): cache}


@functools.cache
def _forward_cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@functools.cache
def _generate_cache_keyword() -> str:
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:
        return "past_key_values"
    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"


def cache_kwargs(cache) -> dict:
    """The ``generate()`` keyword for a cache on the installed transformers: ``cache=`` where it
    exists (5.24 deprecates ``past_key_values=``), ``past_key_values=`` before."""
    return {_generate_cache_keyword(): cache}
