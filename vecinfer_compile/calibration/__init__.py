"""Calibration: fit the key transform and the key/value codebooks of every attention layer of a
Hugging Face causal LM from its post-RoPE queries, keys and values over a text.

:mod:`.plan` (what to fit, checked first), :mod:`.record` (the recorded attention inputs),
:mod:`.fit` (one layer's fit, which the backend's zero-config path shares), :mod:`.metadata`
(what the file records of its calibration), :mod:`.pipeline` (:func:`calibrate`: the steps in
order)."""

from .metadata import recipe_mismatch, text_hash
from .pipeline import calibrate
from .record import calibration_token_ids

__all__ = ["calibrate", "calibration_token_ids", "recipe_mismatch", "text_hash"]
