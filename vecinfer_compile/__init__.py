"""vecinfer_compile: a low-bit vector-quantized KV cache (VecInfer) for any Hugging Face model.

Public API (everything else is internal):

- :func:`calibrate`, :func:`load_codebooks`, :class:`VecInferCodebooks` — fit and store codebooks.
- :func:`enable_simulation` / :func:`disable_simulation`, or the context manager :func:`simulation`
  — eager quantize->dequantize attention (``attn_implementation="vecinfer"``).
- :data:`vecinfer_backend` — the torch.compile backend (``backend=vecinfer_backend``).
- :class:`VecInferCache` — the compressed cache for ``generate()``; :func:`cache_kwargs` — its
  ``generate()`` keyword on the installed transformers (``cache=`` or ``past_key_values=``).
- :func:`defer_stop_check` — a context manager: ``generate()`` on CUDA queues the next step
  while the GPU runs this one (transformers' deferred stop check, switched on for CUDA).
- :func:`tp_load_kwargs` — ``from_pretrained`` keywords for tensor parallelism on the installed
  transformers (``distributed_config=`` or ``tp_plan=``).
- :mod:`vecinfer_compile.testing` — fuzz helpers and ``check_model`` for your own models.

Every name loads on first use (the backend, the cache and the testing helpers import Inductor
and Triton), so ``import vecinfer_compile`` and the command line's argument checks do not load torch.
"""

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "VecInferCache",
    "VecInferCodebooks",
    "__version__",
    "cache_kwargs",
    "calibrate",
    "defer_stop_check",
    "disable_simulation",
    "enable_simulation",
    "get_preset",
    "load_codebooks",
    "simulation",
    "testing",
    "tp_load_kwargs",
    "vecinfer_backend",
]

_LAZY = {
    "VecInferCodebooks": ("codebooks", "VecInferCodebooks"),
    "load_codebooks": ("codebooks", "load_codebooks"),
    "PRESETS": ("presets", "PRESETS"),
    "get_preset": ("presets", "get_preset"),
    "calibrate": ("calibration", "calibrate"),
    "enable_simulation": ("simulate", "enable_simulation"),
    "disable_simulation": ("simulate", "disable_simulation"),
    "simulation": ("simulate", "simulation"),
    "vecinfer_backend": ("backend", "vecinfer_backend"),
    "VecInferCache": ("cache", "VecInferCache"),
    "cache_kwargs": ("hf.compat", "cache_kwargs"),
    "defer_stop_check": ("hf.deferred_stop", "defer_stop_check"),
    "testing": ("testing", None),
    "tp_load_kwargs": ("hf.tensor_parallel", "tp_load_kwargs"),
}


def __dir__():
    """Lists the lazily imported names too, so ``help(vecinfer_compile)`` documents them."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'vecinfer_compile' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(f".{module_name}", __name__)
    return module if attr is None else getattr(module, attr)
