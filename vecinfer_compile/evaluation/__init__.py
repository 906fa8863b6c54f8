"""Evaluation helpers: perplexity, KV-cache memory accounting, ablation tables and plots."""

from .kv_bytes import KVBytes, kv_bytes, kv_bytes_per_token
from .perplexity import PplResult, make_windows, perplexity

__all__ = ["KVBytes", "PplResult", "kv_bytes", "kv_bytes_per_token", "make_windows", "perplexity"]
