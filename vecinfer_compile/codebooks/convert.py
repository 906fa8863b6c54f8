"""Older codebook files brought to the current format (:mod:`.file_format`), so that files written
by earlier versions still load: :func:`upgrade` takes a file's metadata and tensors as read and
returns them as the current format lays them out, each older format one step from the next.
``load_codebooks(old).save(new)`` rewrites a file in the current format.

- format 1: one preset for every layer, stacked ``key_centroids [L, E_k, d_k]`` and
  ``value_centroids [L, E_v, d_v]`` (and the presets in ``key_preset``/``value_preset``);
- format 2: per-layer centroids ``layers.{i}.*`` and ``layer_bits``; no query-aware methods;
- format 3: query-aware matrices; no key means (centring did not exist: a centring method's
  codebooks were fitted to uncentred keys, ``mu = 0``);
- format 4: key means; every layer has attention (no ``attention_layers``);
- format 5: no key codec (keys coded by the key codebooks);
- format 6: no value codec (values coded by the value codebooks);
- format 7: the codebooks' centroids of both sides in every file, also where a codec codes that
  side in their place; metadata names a side's codec only when it is not the codebooks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..codecs.registry import DEFAULT as DEFAULT_CODEC
from ..methods import VQ_METHODS
from .file_format import FORMAT

FORMAT_V1, FORMAT_V2, FORMAT_V3, FORMAT_V4, FORMAT_V5, FORMAT_V6, FORMAT_V7 = (
    f"vecinfer-codebooks/{n}" for n in range(1, 8)
)
OLDER_FORMATS = (FORMAT_V7, FORMAT_V6, FORMAT_V5, FORMAT_V4, FORMAT_V3, FORMAT_V2, FORMAT_V1)


def upgrade(meta: dict, tensors: dict[str, torch.Tensor], source: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(meta, tensors)`` of a file of an older format (its ``"vecinfer"`` metadata object and
    its tensors, left unchanged) in the current format's layout, with ``converted_from`` naming the
    format it had; a ValueError naming ``source`` and the fix for an unknown format or a file its
    format does not describe."""
    old = meta.get("format")
    if old not in OLDER_FORMATS:
        raise ValueError(
            f"{source} has format {old!r}; this version reads {', '.join((FORMAT, *OLDER_FORMATS))} (the older "
            "ones converted): recalibrate with this version (`vecinfer calibrate`) or install the version that wrote it"
        )
    meta, tensors = dict(meta), dict(tensors)
    steps = {
        FORMAT_V1: _v1_to_v2,
        FORMAT_V2: _v2_to_v3,
        FORMAT_V3: _v3_to_v4,
        FORMAT_V4: _v4_to_v5,
        FORMAT_V5: _v5_to_v6,
        FORMAT_V6: _v6_to_v7,
        FORMAT_V7: _v7_to_v8,
    }
    for fmt in reversed(OLDER_FORMATS[: OLDER_FORMATS.index(old) + 1]):
        steps[fmt](meta, tensors, source)
    meta.update(format=FORMAT, converted_from=old)
    return meta, tensors


def _num_layers(meta: dict, source) -> int:
    try:
        return int(meta["geometry"]["num_layers"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{source}: its metadata has no geometry with num_layers (corrupt file): recalibrate "
            "with `vecinfer calibrate`"
        ) from None


def _v1_to_v2(meta: dict, tensors: dict, source) -> None:
    """Stacked centroids of one preset -> per-layer centroids and ``layer_bits``."""
    num_layers = _num_layers(meta, source)
    for kind in ("key", "value"):
        stacked = tensors.pop(f"{kind}_centroids", None)
        if stacked is None:
            raise ValueError(f"{source}: tensor '{kind}_centroids' is missing (corrupt file)")
        if stacked.dim() != 3 or stacked.shape[0] != num_layers:
            raise ValueError(
                f"{source}: {kind}_centroids has shape {tuple(stacked.shape)}, its geometry says "
                f"[{num_layers}, entries, dims] (corrupt file)"
            )
        tensors.update({f"layers.{i}.{kind}_centroids": c for i, c in enumerate(stacked)})
    if "bits" in meta:  # else the reader names the missing field
        meta["layer_bits"] = [float(meta["bits"])] * num_layers
    meta.pop("key_preset", None)
    meta.pop("value_preset", None)


def _v2_to_v3(meta: dict, tensors: dict, source) -> None:
    """Nothing to change: format 3 added the query-aware matrices, which a format 2 file cannot have."""


def _v3_to_v4(meta: dict, tensors: dict, source) -> None:
    """A centring method's file without key means: fitted to uncentred keys, as the current format
    says with ``uncentred_keys``."""
    spec = VQ_METHODS.get(meta.get("method"))
    if spec is not None and spec.center and "key_mean" not in tensors:
        meta["uncentred_keys"] = True


def _v4_to_v5(meta: dict, tensors: dict, source) -> None:
    """Every layer of a format 4 file has attention."""
    meta.setdefault("attention_layers", list(range(_num_layers(meta, source))))


def _v5_to_v6(meta: dict, tensors: dict, source) -> None:
    """Nothing to change: format 6 added the key codec, which a format 5 file cannot have."""


def _v6_to_v7(meta: dict, tensors: dict, source) -> None:
    """Nothing to change: format 7 added the value codec, which a format 6 file cannot have."""


def _v7_to_v8(meta: dict, tensors: dict, source) -> None:
    """Every side names its codec (the codebooks where format 7 named none), and a side another
    codec codes keeps no centroids (format 7 stored them unread)."""
    for side in ("key", "value"):
        meta.setdefault(f"{side}_codec", DEFAULT_CODEC)
        if meta[f"{side}_codec"] != DEFAULT_CODEC:
            for name in [n for n in tensors if n.startswith("layers.") and n.endswith(f".{side}_centroids")]:
                del tensors[name]
