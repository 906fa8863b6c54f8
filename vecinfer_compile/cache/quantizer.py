"""One coded layer's quantizer as the cache holds it: its codec's operands and the key transform,
float32, on the cache's device, frozen (built once from a
:class:`~vecinfer_compile.codebooks.LayerCodebooks`).

- ``codec``: the codec of the layer's keys and values (:mod:`vecinfer_compile.codecs`; both sides
  one codec); ``operands``: what its cache operations read, one bundle on the cache's device
  (:meth:`~vecinfer_compile.codecs.base.Codec.operands`); ``codes``: the keys' and values' side
  codes as the file holds them (their bytes a token, :meth:`LayerQuantizer.code_widths`).
- ``lam [H, D]`` smoothing factors, or None.
- ``rotation [D, D]`` the normalized Hadamard matrix, or None; one tensor shared by all layers of
  a cache (:meth:`LayerQuantizer.from_codebooks`'s ``rotations``).
- query-aware methods: ``key_matrix [H, D, D] = A @ H`` (keys into the code domain) and
  ``key_read [H, D, D] = (B @ H)^T`` (code domain back to keys; its transpose is the query side),
  the Hadamard folded in (``rotation`` is then None).
- centring methods: ``key_mean [H, D]``, ``mu``, subtracted before the rest of the transform.
- ``key_parallel_weight`` (score-aware key codes, 1: nearest centroid) and the error metrics
  ``key_metric``, ``value_metric [H, D, D]`` of error-weighted codes (both or neither).

The key transform: ``K~ = ((K - mu) / lam) @ H``, or ``(K - mu) @ key_matrix``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..codebooks import LayerCodebooks
from ..codecs.base import Codec
from ..ops.append import transform_keys
from ..quant.score_aware import check_parallel_weight
from ..quant.weighted_codes import check_metric


@dataclass(frozen=True, eq=False)
class LayerQuantizer:
    """What a coded layer encodes and reads with (the module docstring gives the shapes)."""

    codec: Codec
    operands: Any
    codes: tuple[Any, Any]
    lam: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    key_matrix: torch.Tensor | None = None
    key_read: torch.Tensor | None = None
    key_mean: torch.Tensor | None = None
    key_parallel_weight: float = 1.0
    key_metric: torch.Tensor | None = None
    value_metric: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_parallel_weight", check_parallel_weight(self.key_parallel_weight))
        if (self.key_metric is None) != (self.value_metric is None):
            raise ValueError("key_metric and value_metric go together (error-weighted codes of keys and values)")

    @classmethod
    def from_codebooks(
        cls, layer: LayerCodebooks, *, device, key_parallel_weight: float = 1.0, rotations: dict | None = None
    ) -> LayerQuantizer:
        """``layer``'s state in float32 on ``device``, with the Hadamard folded into the query-aware
        matrices. ``rotations``: a dict the layers of one cache share, so that they hold one
        rotation tensor."""
        t = layer.transform
        rotation = None
        if t.rotate:
            rotations = {} if rotations is None else rotations
            if t.head_dim not in rotations:
                rotations[t.head_dim] = t.rotation(torch.float32, device)
            rotation = rotations[t.head_dim]
        key_matrix = key_read = None
        if t.key_matrix is not None:  # A @ H and (B @ H)^T: one matmul each way, no separate rotation
            fold = (lambda m: m) if rotation is None else (lambda m: m @ rotation)
            key_matrix = fold(_on(t.key_matrix, device)).contiguous()
            key_read = fold(_on(t.query_matrix, device)).transpose(-1, -2).contiguous()
            rotation = None
        codec = layer.key_codec
        if layer.value_codec is not codec:
            raise ValueError(
                f"these codebooks code the keys with the {codec.name} codec and the values with the "
                f"{layer.value_codec.name} codec: a VecInferCache codes both sides with one codec (calibrate with "
                f"--key-codec {codec.name} --value-codec {codec.name}); such a file runs in the simulate path "
                "(eval-ppl, ablation)"
            )
        return cls(
            codec=codec,
            operands=codec.operands(layer, device),
            codes=(layer.keys, layer.values),
            lam=_on(t.lam, device),
            rotation=rotation,
            key_matrix=key_matrix,
            key_read=key_read,
            key_mean=_on(t.mean, device),
            key_parallel_weight=key_parallel_weight,
            key_metric=_on(layer.key_metric, device),
            value_metric=_on(layer.value_metric, device),
        )

    def check_fits(self, num_kv_heads: int, head_dim: int, layer_idx: int) -> None:
        """Raise a ValueError unless this quantizer codes ``[B, num_kv_heads, T, head_dim]`` K/V."""
        self.code_widths(head_dim)  # the codec's own check of head_dim
        # Calibration records the K/V attention receives: more heads there than the model caches
        # means its attention reads K/V built from the cache's after the update (JetMoE repeats
        # them per expert), whose per-head transform the cached heads cannot take.
        for name, t in (("lam", self.lam), ("key_matrix", self.key_matrix), ("key_mean", self.key_mean)):
            if t is not None and t.shape[0] != num_kv_heads:
                raise ValueError(
                    f"VecInferCache layer {layer_idx}: the codebooks' {name} is for {t.shape[0]} KV heads but the "
                    f"model caches {num_kv_heads} (its attention repeats K/V after the cache): calibrate "
                    "method='vq' or 'hadamard'"
                )
        for metric in (self.key_metric, self.value_metric):
            if metric is not None:
                check_metric(metric, num_kv_heads, head_dim)

    def code_widths(self, head_dim: int) -> tuple[int, int]:
        """Bytes per token and head of the stored key and value codes (the codec's)."""
        return self.codec.code_bytes(self.codes[0], head_dim), self.codec.code_bytes(self.codes[1], head_dim)

    @property
    def key_transform_matrix(self) -> torch.Tensor | None:
        """The one matrix of the key transform: ``key_matrix`` (Hadamard folded in) or the rotation."""
        return self.key_matrix if self.key_matrix is not None else self.rotation

    def transform_keys(self, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``K~`` of ``k: [B, H, T, D]``, computed in float32, returned in ``dtype``."""
        return transform_keys(k, self.key_mean, self.lam, self.key_transform_matrix).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        """The codec's operands and the key transform, as the layer's bytes count them (the error
        metrics are left out)."""
        ts = [
            *self.codec.operand_tensors(self.operands),
            self.lam,
            self.rotation,
            self.key_matrix,
            self.key_read,
            self.key_mean,
        ]
        return [t for t in ts if t is not None]

    def inverse_keys(self, kt: torch.Tensor) -> torch.Tensor:
        """``K~ [B, H, T, D]`` back to keys, float32: ``K~ @ key_read`` for the query-aware methods,
        else ``(K~ @ rotation^T) * lam``, then ``+ key_mean`` (each step where the method has it)."""
        work = kt.float()
        if self.key_read is not None:
            work = work @ self.key_read
        else:
            if self.rotation is not None:
                work = work @ self.rotation.T
            if self.lam is not None:
                work = work * self.lam[None, :, None, :]
        if self.key_mean is not None:
            work = work + self.key_mean[None, :, None, :]
        return work


def _on(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device, torch.float32).contiguous()
