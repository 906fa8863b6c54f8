"""FX passes on Dynamo graphs: the SDPA -> VecInfer attention rewrite and its helpers."""

from .record import record_nodes
from .repeat_kv import unwrap_repeat_kv
from .sdpa import SdpaSite, find_sdpa_sites, rewrite_sdpa

__all__ = ["SdpaSite", "find_sdpa_sites", "record_nodes", "rewrite_sdpa", "unwrap_repeat_kv"]
