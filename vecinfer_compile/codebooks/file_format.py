"""The codebook file, format ``vecinfer-codebooks/8``: writing it, and the one strict reader of it
(:mod:`.load` opens a file and converts an older format first, :mod:`.convert`).

One safetensors file. Each side's codes, keys and values, in the section of its codec (metadata
``key_codec``, ``value_codec``: a registered codec's name, :mod:`vecinfer_compile.codecs`; the
default codebooks' section is ``layers.{i}.key_centroids [E_k, d_k]`` and
``layers.{i}.value_centroids [E_v, d_v]``, float32, each layer its own preset) for every layer ``i``
of ``attention_layers`` (metadata: the decoder layers that have attention; a hybrid model's
linear-attention, convolution or state-space layers hold no K/V and have no codes) and, stacked
over those ``A`` layers: when the method smooths, ``lam [A, H_kv, D]``; for the query-aware methods
``key_matrix [A, H_kv, D, D]`` and ``query_matrix [A, H_kv, D, D]`` (``A`` and ``A^(-T)``, see
:mod:`vecinfer_compile.quant.query_aware`) and the ``qaware_ridge`` and ``qaware_ridge_form`` they
were made with; for the centring methods ``key_mean [A, H_kv, D]`` (``mu``, subtracted from the
keys before the rest of the transform, :mod:`vecinfer_compile.quant.transform`), absent only when
the metadata says ``uncentred_keys: true`` (codebooks of a centring method fitted before centring
existed: ``mu = 0``); for the pre-RoPE methods ``rope_inv_freq [r/2]`` (the model's RoPE
frequencies, :mod:`vecinfer_compile.quant.rope`) and, when values are predicted from keys,
``value_matrix [A, H_kv, D, D]`` and ``value_bias [A, H_kv, D]``
(:mod:`vecinfer_compile.quant.value_prediction`); with error-weighted codes ``key_metric`` and
``value_metric [A, H_kv, D, D]`` (:mod:`vecinfer_compile.quant.weighted_codes`). The safetensors metadata key ``"vecinfer"`` holds a
JSON object: format, method, bits (the average over layers), ``layer_bits`` (one preset per
layer), ``attention_layers``, the model geometry and a hash of it (``fingerprint``), the package
version and the calibration's metadata (:mod:`vecinfer_compile.calibration.metadata`: the model's
name and ``weight_fingerprint``, the calibration text's hash, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..codecs import registry
from ..codecs.base import SIDES
from ..hf.weight_fingerprint import check_fingerprint
from ..methods import VQ_METHODS
from ..quant.transform import KeyTransform
from ..quant.value_prediction import ValuePredictor
from .model import LayerCodebooks, VecInferCodebooks, geometry_fingerprint

FORMAT = "vecinfer-codebooks/8"
MATRIX_TOLERANCE = 1e-3  # max |A^T B - I| of a stored pair (float32 inverses of a ridge-conditioned S)
FILE_FIELDS = (
    "format",
    "method",
    "bits",
    "layer_bits",
    "attention_layers",
    "geometry",
    "fingerprint",
    "key_codec",
    "value_codec",
)
READ_FIELDS = (
    "method",
    "bits",
    "geometry",
    "layer_bits",
    "attention_layers",
    "uncentred_keys",
    "key_codec",
    "value_codec",
)  # not kept as metadata


def save_codebooks(codebooks: VecInferCodebooks, path: str | Path) -> Path:
    """Write ``codebooks`` to ``path`` (its folder is created); returns the path."""
    from .. import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    present = codebooks.attention_layers()
    layers = [codebooks.layers[i] for i in present]
    codec_names = {}
    for side in SIDES:
        codes = [getattr(l, f"{side}s") for l in layers]
        codec = registry.of(codes[0])
        codec_names[f"{side}_codec"] = codec.name
        tensors.update(codec.write(side, codes, present))
    if layers[0].transform.lam is not None:
        tensors["lam"] = torch.stack([l.transform.lam.float().cpu() for l in layers])
    if layers[0].transform.key_matrix is not None:
        tensors["key_matrix"] = torch.stack([l.transform.key_matrix.float().cpu() for l in layers])
        tensors["query_matrix"] = torch.stack([l.transform.query_matrix.float().cpu() for l in layers])
    if layers[0].transform.mean is not None:
        tensors["key_mean"] = torch.stack([l.transform.mean.float().cpu() for l in layers])
    if layers[0].transform.rope_inv_freq is not None:
        tensors["rope_inv_freq"] = layers[0].transform.rope_inv_freq.float().cpu()
    if layers[0].key_metric is not None:
        tensors["key_metric"] = torch.stack([l.key_metric.float().cpu() for l in layers])
        tensors["value_metric"] = torch.stack([l.value_metric.float().cpu() for l in layers])
    if layers[0].value_predictor is not None:
        tensors["value_matrix"] = torch.stack([l.value_predictor.matrix.float().cpu() for l in layers])
        tensors["value_bias"] = torch.stack([l.value_predictor.bias.float().cpu() for l in layers])
    uncentred = VQ_METHODS[codebooks.method].center and layers[0].transform.mean is None
    meta = {
        **{k: v for k, v in codebooks.metadata.items() if k not in READ_FIELDS},
        "format": FORMAT,
        "method": codebooks.method,
        "bits": codebooks.bits,
        "layer_bits": codebooks.bits_per_layer(),
        "attention_layers": present,
        **({"uncentred_keys": True} if uncentred else {}),
        **codec_names,
        "rotate": layers[0].transform.rotate,
        "geometry": codebooks.geometry,
        "fingerprint": geometry_fingerprint(codebooks.geometry),
        "package_version": __version__,
    }
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(path),
        metadata={"vecinfer": json.dumps(meta, sort_keys=True)},
    )
    path.chmod(0o666 & ~_umask())  # safetensors creates the file 0600; honour the umask
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_codebooks(meta: dict, tensors: dict[str, torch.Tensor], path: str | Path) -> VecInferCodebooks:
    """The codebooks of a file of the current format: its metadata ``meta`` (the ``"vecinfer"``
    JSON object) and ``tensors``, checked strictly (a ValueError naming the file ``path`` and the fix for
    anything missing, misshapen or inconsistent)."""
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} has format {meta.get('format')!r}, not {FORMAT}: read it with load_codebooks, "
            "which converts older formats"
        )
    missing = [name for name in FILE_FIELDS if name not in meta]
    if missing:
        raise ValueError(
            f"{path}: its metadata lacks {', '.join(missing)} (corrupt file): recalibrate with `vecinfer calibrate`"
        )
    geometry = meta["geometry"]
    if "weight_fingerprint" in meta:
        check_fingerprint(meta["weight_fingerprint"], str(path))
    if meta["fingerprint"] != geometry_fingerprint(geometry):
        raise ValueError(f"{path}: metadata fingerprint does not match its geometry (corrupt file)")
    method, bits = meta["method"], float(meta["bits"])
    if method not in VQ_METHODS:
        raise ValueError(
            f"{path} is for method {method!r}, which this version does not know "
            f"({', '.join(VQ_METHODS)}): install the version that wrote it"
        )
    spec = VQ_METHODS[method]
    num_layers = geometry["num_layers"]

    present = _attention_layers(path, meta, num_layers)
    layer_bits = [float(b) for b in meta["layer_bits"]]
    if len(layer_bits) != num_layers:
        raise ValueError(
            f"{path}: layer_bits has {len(layer_bits)} entries, its geometry says {num_layers} layers (corrupt file)"
        )
    codes = {side: _side_codes(path, side, meta, tensors, present, layer_bits, geometry) for side in SIDES}
    lam = tensors.get("lam")
    if spec.smooth and lam is None:
        raise ValueError(f"{path}: method {method!r} needs smoothing factors but the file has none")
    if lam is not None and tuple(lam.shape) != (len(present), geometry["num_kv_heads"], geometry["head_dim"]):
        raise ValueError(
            f"{path}: lam has shape {tuple(lam.shape)}, its {len(present)} attention layers need "
            f"{(len(present), geometry['num_kv_heads'], geometry['head_dim'])} (corrupt file)"
        )
    uncentred = meta.get("uncentred_keys", False)
    if uncentred and (not spec.center or "key_mean" in tensors):
        raise ValueError(
            f"{path}: its metadata says uncentred_keys, which only a centring method's file without "
            "'key_mean' may say (corrupt file): recalibrate with `vecinfer calibrate`"
        )
    key_m, query_m = _query_aware_matrices(path, tensors, method, spec.query_aware, geometry, len(present))
    mean = _key_mean(path, tensors, method, spec.center and not uncentred, geometry, len(present))
    inv_freq, value_m, value_b = _pre_rope_state(path, tensors, method, spec, geometry, len(present))
    key_w, value_w = _error_metrics(path, tensors, geometry, len(present))
    layers: list[LayerCodebooks | None] = [None] * num_layers
    for n, i in enumerate(present):  # n: the layer's row in the stacked tensors
        layers[i] = LayerCodebooks(
            KeyTransform(
                geometry["head_dim"],
                lam[n] if lam is not None else None,
                spec.rotate,
                None if key_m is None else key_m[n],
                None if query_m is None else query_m[n],
                mean=None if mean is None else mean[n],
                rope_inv_freq=inv_freq,
            ),
            codes["key"][n],
            codes["value"][n],
            None if value_m is None else ValuePredictor(value_m[n], value_b[n]),
            None if key_w is None else key_w[n],
            None if value_w is None else value_w[n],
        )
    keep = {k: v for k, v in meta.items() if k not in READ_FIELDS}
    return VecInferCodebooks(method, bits, layers, geometry, keep, layer_bits)


def _side_codes(
    path: Path, side: str, meta: dict, tensors: dict, present: list[int], layer_bits: list[float], geometry: dict
) -> list:
    """The codes of ``side`` (``"key"`` or ``"value"``) of every attention layer, read by the codec the
    metadata names (checked strictly by it); a file holding another registered codec's section of
    ``side`` is refused as corrupt."""
    name = meta.get(f"{side}_codec")
    if name not in registry.names():
        raise ValueError(
            f"{path}: {side} codec {name!r} is unknown to this version (it knows "
            f"{', '.join(registry.names())}): install the version that wrote it"
        )
    codec = registry.get(name)
    for other in registry.all_codecs():
        stray = [] if other is codec else other.tensor_names(side, tensors)
        if stray:
            raise ValueError(
                f"{path}: it has {stray[:3]} of the {other.name} codec but its metadata names the "
                f"{name} codec for the {side}s (corrupt file): recalibrate with `vecinfer calibrate`"
            )
    return codec.read(side, tensors, path=path, present=present, layer_bits=layer_bits, geometry=geometry)


def _error_metrics(path: Path, tensors: dict, geometry: dict, layers: int):
    """``(key_metric, value_metric)`` ``[A, H_kv, D, D]`` of a file with error-weighted codes, or
    (None, None), checked: both or neither, shaped for the geometry."""
    present = [name for name in ("key_metric", "value_metric") if name in tensors]
    if not present:
        return None, None
    if len(present) != 2:
        raise ValueError(
            f"{path}: error-weighted codes need tensors 'key_metric' and 'value_metric' but the "
            f"file has only {present} (corrupt file): recalibrate with `vecinfer calibrate --weighted-codes`"
        )
    shape = (layers, geometry["num_kv_heads"], geometry["head_dim"], geometry["head_dim"])
    for name in present:
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(tensors[name].shape)}, its {layers} attention layers "
                f"need {shape} (corrupt file)"
            )
    return tensors["key_metric"], tensors["value_metric"]


def _attention_layers(path: Path, meta: dict, num_layers: int) -> list[int]:
    """The layers of a file that have codebooks, checked: format 5 lists them (a hybrid model's
    layers without attention have none); in older formats every layer has them."""
    present = meta.get("attention_layers", list(range(num_layers)))
    if (
        not present
        or present != sorted(set(present))
        or not all(isinstance(i, int) and 0 <= i < num_layers for i in present)
    ):
        raise ValueError(
            f"{path}: attention_layers {present} is not an increasing list of layers below {num_layers} (corrupt file)"
        )
    return present


def _query_aware_matrices(path: Path, tensors: dict, method: str, needed: bool, geometry: dict, layers: int):
    """``(key_matrix, query_matrix)`` ``[A, H_kv, D, D]`` of a query-aware file (None, None
    otherwise) for its ``A = layers`` attention layers, checked: present, shaped for the
    geometry, and inverse transposes of each other."""
    present = [name for name in ("key_matrix", "query_matrix") if name in tensors]
    if not needed:
        if present:
            raise ValueError(
                f"{path}: method {method!r} takes no query-aware matrices but the file has "
                f"{present} (corrupt file): recalibrate with `vecinfer calibrate`"
            )
        return None, None
    if len(present) != 2:
        raise ValueError(
            f"{path}: method {method!r} needs tensors 'key_matrix' and 'query_matrix' but "
            f"the file has {present or 'neither'}: recalibrate with `vecinfer calibrate "
            f"--method {method}`"
        )
    a, b = tensors["key_matrix"], tensors["query_matrix"]
    expect = (layers, geometry["num_kv_heads"], geometry["head_dim"], geometry["head_dim"])
    for name, t in (("key_matrix", a), ("query_matrix", b)):
        if tuple(t.shape) != expect:
            raise ValueError(
                f"{path}: {name} has shape {tuple(t.shape)}, its geometry needs {expect} "
                f"[layers, kv_heads, head_dim, head_dim]: recalibrate with `vecinfer "
                f"calibrate --method {method}`"
            )
    eye = torch.eye(expect[-1], dtype=torch.float64)
    err = (a.double().transpose(-1, -2) @ b.double() - eye).abs().amax().item()
    if not err <= MATRIX_TOLERANCE:
        raise ValueError(
            f"{path}: query_matrix is not the inverse transpose of key_matrix (max error "
            f"{err:.3g}; scores would change): recalibrate with `vecinfer calibrate --method {method}`"
        )
    return a.float(), b.float()


def _pre_rope_state(path: Path, tensors: dict, method: str, spec, geometry: dict, layers: int):
    """``(rope_inv_freq [r/2], value_matrix [A, H_kv, D, D], value_bias [A, H_kv, D])`` of a file,
    checked against its method (each None where the method has none) and geometry."""
    needed = {"rope_inv_freq": spec.pre_rope, "value_matrix": spec.predict_values, "value_bias": spec.predict_values}
    for name, wanted in needed.items():
        if wanted and name not in tensors:
            raise ValueError(
                f"{path}: method {method!r} needs tensor {name!r} but the file has none: "
                f"recalibrate with `vecinfer calibrate --method {method}`"
            )
        if not wanted and name in tensors:
            raise ValueError(
                f"{path}: method {method!r} takes no {name!r} but the file has it (corrupt file): "
                "recalibrate with `vecinfer calibrate`"
            )
    h, d = geometry["num_kv_heads"], geometry["head_dim"]
    inv_freq = tensors.get("rope_inv_freq")
    if inv_freq is not None and not (inv_freq.dim() == 1 and 0 < 2 * inv_freq.shape[0] <= d):
        raise ValueError(
            f"{path}: rope_inv_freq has shape {tuple(inv_freq.shape)}, head_dim {d} needs [r/2] with "
            f"r <= {d} (corrupt file)"
        )
    matrix, bias = tensors.get("value_matrix"), tensors.get("value_bias")
    if matrix is not None and (tuple(matrix.shape) != (layers, h, d, d) or tuple(bias.shape) != (layers, h, d)):
        raise ValueError(
            f"{path}: value_matrix / value_bias have shapes {tuple(matrix.shape)} / {tuple(bias.shape)}, "
            f"its geometry needs {(layers, h, d, d)} / {(layers, h, d)} (corrupt file)"
        )
    for name, t in (("rope_inv_freq", inv_freq), ("value_matrix", matrix), ("value_bias", bias)):
        if t is not None and not torch.isfinite(t).all():
            raise ValueError(
                f"{path}: {name} holds NaN or inf (corrupt file): recalibrate with "
                f"`vecinfer calibrate --method {method}`"
            )
    return (
        None if inv_freq is None else inv_freq.float(),
        None if matrix is None else matrix.float(),
        None if bias is None else bias.float(),
    )


def _key_mean(path: Path, tensors: dict, method: str, centred: bool, geometry: dict, layers: int):
    """``key_mean [A, H_kv, D]`` float32 of a file whose keys are ``centred`` (a centring method's,
    unless its metadata says ``uncentred_keys``) for its ``A = layers`` attention layers, checked
    (shape, finite); None for the others."""
    mean = tensors.get("key_mean")
    if not centred:
        if mean is not None:
            raise ValueError(
                f"{path}: method {method!r} does not centre keys but the file has 'key_mean' "
                "(corrupt file): recalibrate with `vecinfer calibrate`"
            )
        return None
    if mean is None:
        raise ValueError(
            f"{path}: method {method!r} needs tensor 'key_mean' but the file has none: "
            f"recalibrate with `vecinfer calibrate --method {method}`"
        )
    expect = (layers, geometry["num_kv_heads"], geometry["head_dim"])
    if tuple(mean.shape) != expect:
        raise ValueError(
            f"{path}: key_mean has shape {tuple(mean.shape)}, its geometry needs {expect} "
            f"[layers, kv_heads, head_dim]: recalibrate with `vecinfer calibrate --method {method}`"
        )
    if not torch.isfinite(mean).all():
        raise ValueError(
            f"{path}: key_mean holds NaN or inf (corrupt file): recalibrate with `vecinfer calibrate --method {method}`"
        )
    return mean.float()
