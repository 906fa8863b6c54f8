"""Tensor parallelism: which KV heads a rank holds, and the per-head state sliced to them.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under
``torchrun``) the TP plan shards ``q_proj``/``k_proj``/``v_proj`` colwise, so rank ``r`` of an
``N``-rank TP mesh computes the contiguous KV heads ``[r * Hkv/N, (r + 1) * Hkv/N)`` (and their
query heads). Per-layer codebooks are shared by all heads and stay whole on every rank; the
per-KV-head state (smoothing factors ``lam [Hkv, D]``, query-aware ``key_matrix`` /
``query_matrix [Hkv, D, D]``, the key mean ``[Hkv, D]``) is sliced to the rank's heads.

Where the shard comes from (never guessed from tensor shapes):

- a model: ``model.tp_size`` and ``model._device_mesh`` (its ``"tp"`` dimension, or its only
  one), checked against ``model._tp_plan`` (attention must be sharded colwise, by heads);
- a Dynamo graph (the backend): the DTensor parameters / DeviceMesh among its example inputs.

Codebook files are the same with or without TP: calibrate once on one device, reuse the file on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..codebooks import LayerCodebooks

__all__ = ["TPShard", "graph_shard", "local_kv_heads", "local_layer", "model_shard", "total_kv_bytes", "tp_load_kwargs"]

_ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def tp_load_kwargs(plan="auto") -> dict:
    """``from_pretrained`` keywords for tensor parallelism with ``plan`` on the installed transformers:
    ``distributed_config=DistributedConfig(tp_plan=plan)`` where it takes one (5.24 deprecates
    ``tp_plan=``), else ``tp_plan=plan``."""
    import inspect

    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": plan}
    if "tp_plan" not in inspect.signature(DistributedConfig).parameters:
        return {"tp_plan": plan}
    return {"distributed_config": DistributedConfig(tp_plan=plan)}


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks."""

    rank: int
    size: int

    def kv_heads(self, total: int) -> slice:
        """The KV heads of ``total`` this rank holds; a ValueError naming the fix if ``size``
        does not divide ``total``."""
        if total % self.size:
            raise ValueError(
                f"tensor parallelism over {self.size} ranks splits attention by heads, but the model has "
                f"{total} KV heads, which {self.size} does not divide: run with a number of ranks that "
                f"divides {total} (torchrun --nproc-per-node N)"
            )
        per = total // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def local_kv_heads(shard: TPShard | None, total: int) -> tuple[slice, int]:
    """``(heads, count)``: the KV heads of ``total`` this process holds (all of them without TP,
    ``shard=None``) and how many they are."""
    heads = slice(0, total) if shard is None else shard.kv_heads(total)
    return heads, heads.stop - heads.start


def local_layer(layer: LayerCodebooks, heads: slice) -> LayerCodebooks:
    """``layer`` with its per-KV-head transform state (``lam [Hkv, D]``, ``key_matrix`` /
    ``query_matrix [Hkv, D, D]``, key ``mean [Hkv, D]``, error metrics ``[Hkv, D, D]``, float32) and
    each side's code (:meth:`~vecinfer_compile.codecs.base.Codec.select_heads`: the codebooks are
    shared, unchanged) cut to ``heads``."""
    t = layer.transform

    def cut(x):
        return None if x is None else x[heads].contiguous()

    transform = replace(
        t, lam=cut(t.lam), key_matrix=cut(t.key_matrix), query_matrix=cut(t.query_matrix), mean=cut(t.mean)
    )
    return LayerCodebooks(
        transform,
        layer.key_codec.select_heads(layer.keys, heads),
        layer.value_codec.select_heads(layer.values, heads),
        key_metric=cut(layer.key_metric),
        value_metric=cut(layer.value_metric),
    )


def _mesh_shard(mesh) -> TPShard:
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return TPShard(mesh.get_local_rank("tp"), mesh.size(names.index("tp")))
    if mesh.ndim != 1:
        raise ValueError(
            f"vecinfer: cannot tell the tensor-parallel dimension of device mesh {mesh} (no dimension "
            "named 'tp'): load the model with from_pretrained(..., tp_plan='auto')"
        )
    return TPShard(mesh.get_local_rank(), mesh.size())


def _check_plan(plan: dict) -> None:
    """Attention must be sharded colwise (by heads) for the rank's heads to be contiguous."""
    for key, style in plan.items():
        if key.rsplit(".", 1)[-1] in _ATTN_PROJECTIONS and "colwise" not in str(style):
            raise ValueError(
                f"vecinfer: the model's TP plan shards {key!r} as {style!r}; vecinfer needs the attention "
                "projections sharded colwise, by heads (transformers' tp_plan='auto' does this)"
            )


def model_shard(model) -> TPShard | None:
    """The TP shard of a transformers model loaded with ``tp_plan=...``, or None when it is not
    tensor parallel (or a config, not a model, is given). Raises a ValueError naming the fix when
    the plan does not shard attention by heads or the attention is not SDPA."""
    if not isinstance(model, torch.nn.Module):
        return None
    size = getattr(model, "tp_size", None) or getattr(model, "_tp_size", None)
    mesh = getattr(model, "_device_mesh", None)
    if not size or size == 1 or mesh is None:
        return None
    _check_plan(getattr(model, "_tp_plan", None) or {})
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in ("sdpa", "vecinfer", "vecinfer_sdpa"):
        raise ValueError(
            f"vecinfer under tensor parallelism needs SDPA attention, but this model runs {attn!r}: load it "
            "with from_pretrained(..., tp_plan='auto', attn_implementation='sdpa')"
        )
    shard = _mesh_shard(mesh)
    if shard.size != size:
        raise ValueError(f"vecinfer: the model says tp_size={size} but its device mesh has {shard.size} TP ranks")
    return shard


def graph_shard(example_inputs) -> TPShard | None:
    """The TP shard of a Dynamo graph from its DTensor parameters (or DeviceMesh) among
    ``example_inputs``; None when there are none (not tensor parallel)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    for x in example_inputs:
        if isinstance(x, DeviceMesh):
            return _mesh_shard(x)
        if isinstance(x, DTensor):
            return _mesh_shard(x.device_mesh)
    return None


def total_kv_bytes(cache, group=None) -> int:
    """:meth:`~vecinfer_compile.VecInferCache.kv_bytes` summed over the ranks of ``group`` (an
    all-reduce: every rank must call it); the cache's own bytes when torch.distributed is not
    initialised."""
    local = cache.kv_bytes()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    device = cache.device if torch.distributed.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([local], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, group=group)
    return int(t.item())
