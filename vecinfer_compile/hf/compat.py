"""The transformers keywords that differ across the versions this package supports (5.17 to 5.x).

A model's forward takes its cache as ``past_key_values=`` on transformers 5.17 and as ``cache=``
on 5.25, where ``past_key_values=`` still works but warns (removal announced for 5.40). A keyword
the forward does not name would vanish into its ``**kwargs``: the model would run without the
cache. :func:`forward_cache_kwargs` gives the one that the model's own forward names, read from
its signature once per model class. (``generate()`` takes its cache through
:func:`vecinfer_compile.cache_kwargs`.)
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
