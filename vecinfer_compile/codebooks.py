"""The calibration artifact: per-layer key transform and key/value codebooks, with metadata.

File format 4: one safetensors file. Tensors ``layers.{i}.key_centroids [E_k, d_k]`` and
``layers.{i}.value_centroids [E_v, d_v]`` (float32; each layer has its own preset) and, when the
method smooths, ``lam [L, H_kv, D]``; for the query-aware methods ``key_matrix [L, H_kv, D, D]``
and ``query_matrix [L, H_kv, D, D]`` (``A`` and ``A^(-T)``, see
:mod:`vecinfer_compile.quant.query_aware`) and the ``qaware_ridge`` they were made with; for the
centring methods ``key_mean [L, H_kv, D]`` (``mu``, subtracted from the keys before the rest of
the transform, :mod:`vecinfer_compile.quant.transform`). The safetensors metadata key
``"vecinfer"`` holds a JSON object: method, bits (the average over layers), ``layer_bits`` (one
preset per layer), the model fingerprint (geometry + a hash of it), calibration text hash and
token count, and the package version. Older formats still load, with ``mu = 0`` (no centring: the
codebooks were fitted to uncentred keys): format 3 (no ``key_mean``), format 2 (nor the
matrices; no query-aware methods) and format 1 (one preset for all layers, stacked
``key_centroids [L, E_k, d_k]`` and ``value_centroids [L, E_v, d_v]``). Loading checks the format;
:meth:`VecInferCodebooks.check_model` checks that the file fits a model.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .methods import VQ_METHODS
from .presets import Preset, get_preset
from .quant.transform import KeyTransform

FORMAT = "vecinfer-codebooks/4"
FORMAT_V3 = "vecinfer-codebooks/3"
FORMAT_V2 = "vecinfer-codebooks/2"
FORMAT_V1 = "vecinfer-codebooks/1"
READS = (FORMAT, FORMAT_V3, FORMAT_V2, FORMAT_V1)
MATRIX_TOLERANCE = 1e-3  # max |A^T B - I| of a stored pair (float32 inverses of a ridge-conditioned S)


def model_geometry(config) -> dict:
    """The attention geometry of a Hugging Face config (text config for multimodal models)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        "model_type": getattr(cfg, "model_type", "unknown"),
        "num_layers": cfg.num_hidden_layers,
        "num_query_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": getattr(cfg, "vocab_size", None),
    }


def geometry_fingerprint(geometry: dict) -> str:
    blob = json.dumps(geometry, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class LayerCodebooks:
    """One layer's quantizer. key_centroids: ``[E_k, d_k]``; value_centroids: ``[E_v, d_v]``
    (float32); transform: smoothing factors ``[H_kv, D]`` or query-aware matrices
    ``[H_kv, D, D]``, and/or rotation, after an optional key mean ``[H_kv, D]``."""

    transform: KeyTransform
    key_centroids: torch.Tensor
    value_centroids: torch.Tensor


def average_bits(layer_bits: list[float]) -> float:
    """Nominal bits per element of a per-layer allocation (every layer stores as many elements)."""
    return sum(layer_bits) / len(layer_bits)


@dataclass
class VecInferCodebooks:
    """Codebooks and transforms for every layer of one model.

    ``bits`` is the nominal bits per element over the whole cache; ``layer_bits`` gives each
    layer's preset when the layers differ (a per-layer allocation, see
    :mod:`vecinfer_compile.allocate`) and is None when every layer uses the preset of ``bits``."""

    method: str
    bits: float
    layers: list[LayerCodebooks]
    geometry: dict
    metadata: dict = field(default_factory=dict)
    layer_bits: list[float] | None = None

    def __post_init__(self) -> None:
        if self.layer_bits is None:
            return
        self.layer_bits = [float(b) for b in self.layer_bits]
        if len(self.layer_bits) != len(self.layers):
            raise ValueError(f"layer_bits has {len(self.layer_bits)} entries for {len(self.layers)} layers")
        if abs(average_bits(self.layer_bits) - float(self.bits)) > 1e-9:
            raise ValueError(
                f"layer_bits {self.layer_bits} average {average_bits(self.layer_bits):g} bits, not {self.bits:g}"
            )
        if len(set(self.layer_bits)) == 1:
            self.layer_bits = None

    def __repr__(self) -> str:
        g = self.geometry
        per_layer = "" if self.layer_bits is None else f", layer_bits={self.layer_bits}"
        return (f"VecInferCodebooks(method={self.method!r}, bits={self.bits:g}{per_layer}, "
                f"layers={len(self.layers)}, kv_heads={g.get('num_kv_heads')}, head_dim={g.get('head_dim')}, "
                f"{self.nbytes():,} bytes)")

    @property
    def preset(self) -> Preset:
        """The preset of every layer; an error for a per-layer allocation (use layer_preset)."""
        if self.layer_bits is not None:
            raise ValueError(f"these codebooks allocate bits per layer ({self.layer_bits}): use layer_preset(i)")
        return get_preset(self.bits)

    def layer_preset(self, index: int) -> Preset:
        """The preset of layer ``index``."""
        return get_preset(self.bits if self.layer_bits is None else self.layer_bits[index])

    def bits_per_layer(self) -> list[float]:
        return [self.layer_preset(i).bits for i in range(len(self.layers))]

    @property
    def head_dim(self) -> int:
        return self.geometry["head_dim"]

    def layer(self, index: int) -> LayerCodebooks:
        if not 0 <= index < len(self.layers):
            raise IndexError(f"codebooks cover {len(self.layers)} layers, asked for layer {index}")
        return self.layers[index]

    def nbytes(self) -> int:
        """Bytes of the codebooks, smoothing factors, query-aware matrices and key means themselves
        (fp16)."""
        total = 0
        for layer in self.layers:
            t = layer.transform
            total += 2 * (layer.key_centroids.numel() + layer.value_centroids.numel())
            for extra in (t.lam, t.key_matrix, t.query_matrix, t.mean):
                if extra is not None:
                    total += 2 * extra.numel()
        return total

    # -- checks -----------------------------------------------------------------------------
    def check_model(self, config, *, bits: float | None = None, method: str | None = None) -> None:
        """Raise a ValueError naming the fix if these codebooks do not fit ``config`` (a HF
        config), or were made for another bit-width or method than asked for."""
        mine, theirs = self.geometry, model_geometry(config)
        diffs = [
            f"{k}: codebooks {mine.get(k)} vs model {theirs[k]}"
            for k in ("num_layers", "num_kv_heads", "head_dim")
            if mine.get(k) != theirs[k]
        ]
        if diffs:
            raise ValueError(
                "these codebooks were calibrated for another model ("
                + "; ".join(diffs)
                + "): run `vecinfer calibrate` on this model"
            )
        if bits is not None and float(bits) != float(self.bits):
            per_layer = "" if self.layer_bits is None else f" (per layer: {self.layer_bits})"
            raise ValueError(
                f"these codebooks are for {self.bits:g} bits{per_layer}, not {bits:g}: calibrate "
                f"at {bits:g} bits or ask for bits={self.bits:g} (--bits {self.bits:g} on the command line)"
            )
        if method is not None and method != self.method:
            raise ValueError(
                f"these codebooks are for method {self.method!r}, not {method!r}: calibrate with "
                f"method={method!r} (--method {method} on the command line)"
            )

    # -- file format ------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the safetensors artifact; returns the path."""
        from . import __version__

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, layer in enumerate(self.layers):
            tensors[f"layers.{i}.key_centroids"] = layer.key_centroids.float().cpu()
            tensors[f"layers.{i}.value_centroids"] = layer.value_centroids.float().cpu()
        if self.layers[0].transform.lam is not None:
            tensors["lam"] = torch.stack([l.transform.lam.float().cpu() for l in self.layers])
        if self.layers[0].transform.key_matrix is not None:
            tensors["key_matrix"] = torch.stack([l.transform.key_matrix.float().cpu() for l in self.layers])
            tensors["query_matrix"] = torch.stack([l.transform.query_matrix.float().cpu() for l in self.layers])
        if self.layers[0].transform.mean is not None:
            tensors["key_mean"] = torch.stack([l.transform.mean.float().cpu() for l in self.layers])
        meta = {
            **{k: v for k, v in self.metadata.items() if k not in ("key_preset", "value_preset")},
            "format": FORMAT,
            "method": self.method,
            "bits": self.bits,
            "layer_bits": self.bits_per_layer(),
            "rotate": self.layers[0].transform.rotate,
            "geometry": self.geometry,
            "fingerprint": geometry_fingerprint(self.geometry),
            "package_version": __version__,
        }
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
                  metadata={"vecinfer": json.dumps(meta, sort_keys=True)})
        path.chmod(0o666 & ~_umask())  # safetensors creates the file 0600; honour the umask
        return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_codebooks(path: str | Path) -> VecInferCodebooks:
    """Read an artifact written by :meth:`VecInferCodebooks.save` (clear errors for a missing
    file or a file that is not a vecinfer artifact)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"codebook file {path} does not exist: create it with `vecinfer calibrate ... --out {path}`"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("vecinfer")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a safetensors file: {exc}") from exc
    if raw is None:
        raise ValueError(f"{path} has no vecinfer metadata: it was not written by vecinfer calibrate")
    meta = json.loads(raw)
    if meta.get("format") not in READS:
        raise ValueError(
            f"{path} has format {meta.get('format')!r}; this version reads {', '.join(READS)}: "
            "recalibrate with this version (`vecinfer calibrate`) or install the version that wrote it"
        )
    geometry = meta["geometry"]
    if meta["fingerprint"] != geometry_fingerprint(geometry):
        raise ValueError(f"{path}: metadata fingerprint does not match its geometry (corrupt file)")
    method, bits = meta["method"], float(meta["bits"])
    if method not in VQ_METHODS:
        raise ValueError(f"{path} is for method {method!r}, which this version does not know "
                         f"({', '.join(VQ_METHODS)}): install the version that wrote it")
    spec = VQ_METHODS[method]
    num_layers = geometry["num_layers"]

    def tensor(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} is missing (corrupt file)")
        return tensors[name]

    if meta.get("format") == FORMAT_V1:
        layer_bits = [bits] * num_layers
        key_c, value_c = list(tensor("key_centroids")), list(tensor("value_centroids"))
    else:
        layer_bits = [float(b) for b in meta["layer_bits"]]
        key_c = [tensor(f"layers.{i}.key_centroids") for i in range(num_layers)]
        value_c = [tensor(f"layers.{i}.value_centroids") for i in range(num_layers)]
    if len(layer_bits) != num_layers or len(key_c) != num_layers:
        raise ValueError(f"{path}: holds {len(key_c)} layers, its geometry says {num_layers} (corrupt file)")
    for i, (b, kc, vc) in enumerate(zip(layer_bits, key_c, value_c)):
        preset = get_preset(b)
        expect_k = (preset.key.entries, preset.key.dims)
        expect_v = (preset.value.entries, preset.value.dims)
        if tuple(kc.shape) != expect_k or tuple(vc.shape) != expect_v:
            raise ValueError(
                f"{path}: layer {i} codebook shapes {tuple(kc.shape)}/{tuple(vc.shape)} do not match "
                f"its {b:g}-bit preset {expect_k}/{expect_v} (corrupt file)"
            )
    lam = tensors.get("lam")
    if spec.smooth and lam is None:
        raise ValueError(f"{path}: method {method!r} needs smoothing factors but the file has none")
    key_m, query_m = _query_aware_matrices(path, tensors, method, spec.query_aware, geometry)
    mean = _key_mean(path, tensors, method, spec.center, meta.get("format") == FORMAT, geometry)
    layers = [
        LayerCodebooks(
            KeyTransform(geometry["head_dim"], lam[i] if lam is not None else None, spec.rotate,
                         None if key_m is None else key_m[i], None if query_m is None else query_m[i],
                         mean=None if mean is None else mean[i]),
            key_c[i],
            value_c[i],
        )
        for i in range(num_layers)
    ]
    keep = {k: v for k, v in meta.items() if k not in ("method", "bits", "geometry", "layer_bits")}
    return VecInferCodebooks(method, bits, layers, geometry, keep, layer_bits)


def _query_aware_matrices(path: Path, tensors: dict, method: str, needed: bool, geometry: dict):
    """``(key_matrix, query_matrix)`` ``[L, H_kv, D, D]`` of a query-aware file (None, None
    otherwise), checked: present, shaped for the geometry, and inverse transposes of each other."""
    present = [name for name in ("key_matrix", "query_matrix") if name in tensors]
    if not needed:
        if present:
            raise ValueError(f"{path}: method {method!r} takes no query-aware matrices but the file has "
                             f"{present} (corrupt file): recalibrate with `vecinfer calibrate`")
        return None, None
    if len(present) != 2:
        raise ValueError(f"{path}: method {method!r} needs tensors 'key_matrix' and 'query_matrix' but "
                         f"the file has {present or 'neither'}: recalibrate with `vecinfer calibrate "
                         f"--method {method}`")
    a, b = tensors["key_matrix"], tensors["query_matrix"]
    expect = (geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"], geometry["head_dim"])
    for name, t in (("key_matrix", a), ("query_matrix", b)):
        if tuple(t.shape) != expect:
            raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, its geometry needs {expect} "
                             f"[layers, kv_heads, head_dim, head_dim]: recalibrate with `vecinfer "
                             f"calibrate --method {method}`")
    eye = torch.eye(expect[-1], dtype=torch.float64)
    err = (a.double().transpose(-1, -2) @ b.double() - eye).abs().amax().item()
    if not err <= MATRIX_TOLERANCE:
        raise ValueError(f"{path}: query_matrix is not the inverse transpose of key_matrix (max error "
                         f"{err:.3g}; scores would change): recalibrate with `vecinfer calibrate --method {method}`")
    return a.float(), b.float()



def _key_mean(path: Path, tensors: dict, method: str, centred: bool, current: bool, geometry: dict):
    """``key_mean [L, H_kv, D]`` float32 of a centring method's file, checked (shape, finite);
    None for the other methods, and for files of older formats (written before centring
    existed: their codebooks were fitted to uncentred keys, so ``mu = 0`` is what they mean)."""
    mean = tensors.get("key_mean")
    if not centred:
        if mean is not None:
            raise ValueError(f"{path}: method {method!r} does not centre keys but the file has 'key_mean' "
                             "(corrupt file): recalibrate with `vecinfer calibrate`")
        return None
    if mean is None:
        if current:
            raise ValueError(f"{path}: method {method!r} needs tensor 'key_mean' but the file has none: "
                             f"recalibrate with `vecinfer calibrate --method {method}`")
        return None
    expect = (geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"])
    if tuple(mean.shape) != expect:
        raise ValueError(f"{path}: key_mean has shape {tuple(mean.shape)}, its geometry needs {expect} "
                         f"[layers, kv_heads, head_dim]: recalibrate with `vecinfer calibrate --method {method}`")
    if not torch.isfinite(mean).all():
        raise ValueError(f"{path}: key_mean holds NaN or inf (corrupt file): recalibrate with "
                         f"`vecinfer calibrate --method {method}`")
    return mean.float()
