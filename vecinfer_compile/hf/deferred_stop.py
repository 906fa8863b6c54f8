"""Let ``generate()`` queue the next decode step while the GPU runs this one.

transformers' decoding loop asks the host, after every step, whether every row has finished
(``unfinished_sequences.max() == 0``): a device sync. The host then builds the next step's
inputs and mask and replays the compiled CUDA graph (about 2 ms on an H200 host) while the GPU
idles, so a step costs the host's time plus the GPU's. transformers ships the remedy,
``DeferredStopCheck`` (it copies that flag asynchronously and reads it one step late, at the cost
of one forward pass it undoes when a criterion computed on the device, such as EOS, stops the
loop: the token is dropped and the cache cropped by one), but switches it on for Apple's ``mps``
devices only. :func:`defer_stop_check` switches it on for CUDA too, inside a ``with`` block,
under transformers' own conditions otherwise (no assistant model; a cache handed back to the
caller must be croppable: :class:`~vecinfer_compile.cache.VecInferCache` undoes its last
one-token step). The tokens are the same. Nothing changes outside the block.
"""

from __future__ import annotations

import contextlib

import torch


def _deferred_stop_check_class():
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:  # 5.17-5.25 have it, the range pyproject allows; a later one may move it
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} has no transformers.generation.utils.DeferredStopCheck: "
            "defer_stop_check() needs a transformers of the range vecinfer_compile supports (5.17 to 5.x), "
            "or leave it out (generate() then syncs every step)"
        ) from None
    return DeferredStopCheck


@contextlib.contextmanager
def defer_stop_check():
    """Inside the block, ``generate()`` on CUDA defers its per-step stop check by one step (see
    the module docstring); the previous behaviour returns on exit. Not re-entrant across
    threads (it patches ``DeferredStopCheck.is_supported`` for the process)::

        with vecinfer_compile.defer_stop_check():
            out = model.generate(ids, **vecinfer_compile.cache_kwargs(cache), max_new_tokens=256,
                                 compile_config=...)
    """
    cls = _deferred_stop_check_class()
    original = cls.__dict__["is_supported"]
    decide = original.__func__

    def is_supported(device: torch.device, cache, cache_is_returned: bool, is_assistant: bool) -> bool:
        if torch.device(device).type == "cuda":  # transformers' conditions, its device check lifted
            device = torch.device("mps")
        return decide(device, cache, cache_is_returned, is_assistant)

    cls.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        cls.is_supported = original
