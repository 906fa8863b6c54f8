"""The calibration artifact: per-layer key transform and key/value codebooks, with metadata.

File format 5: one safetensors file. Tensors ``layers.{i}.key_centroids [E_k, d_k]`` and
``layers.{i}.value_centroids [E_v, d_v]`` (float32; each layer has its own preset) for every
layer ``i`` of ``attention_layers`` (metadata: the decoder layers that have attention; a
hybrid model's linear-attention, convolution or state-space layers hold no K/V and have no
codebooks) and, stacked over those ``A`` layers: when the method smooths, ``lam [A, H_kv, D]``;
for the query-aware methods ``key_matrix [A, H_kv, D, D]``
and ``query_matrix [A, H_kv, D, D]`` (``A`` and ``A^(-T)``, see
:mod:`vecinfer_compile.quant.query_aware`) and the ``qaware_ridge`` and ``qaware_ridge_form`` they
were made with; for the centring methods ``key_mean [A, H_kv, D]`` (``mu``, subtracted from the keys before the rest of
the transform, :mod:`vecinfer_compile.quant.transform`); for the pre-RoPE methods
``rope_inv_freq [r/2]`` (the model's RoPE frequencies, :mod:`vecinfer_compile.quant.rope`) and,
when values are predicted from keys, ``value_matrix [A, H_kv, D, D]`` and ``value_bias
[A, H_kv, D]`` (:mod:`vecinfer_compile.quant.value_prediction`); with error-weighted codes
``key_metric`` and ``value_metric [A, H_kv, D, D]`` (:mod:`vecinfer_compile.quant.weighted_codes`). The safetensors metadata key
``"vecinfer"`` holds a JSON object: method, bits (the average over layers), ``layer_bits`` (one
preset per layer), the model fingerprint (geometry + a hash of it), the model name and, from
:func:`vecinfer_compile.calibrate.calibrate`, the ``weight_fingerprint`` of the weights it was
calibrated on (:mod:`vecinfer_compile.hf.weight_fingerprint`; files written before it have none),
calibration text hash and token count, and the package version. Older formats still load:
format 4 (every layer has attention and codebooks), with
``mu = 0`` (no centring: the codebooks were fitted to uncentred keys): format 3 (no
``key_mean``), format 2 (nor the matrices; no query-aware methods) and format 1 (one preset for
all layers, stacked ``key_centroids [L, E_k, d_k]`` and ``value_centroids [L, E_v, d_v]``).
Loading checks the format;
:meth:`VecInferCodebooks.check_model` checks that the file fits a model's shape (an error),
:meth:`VecInferCodebooks.check_weights` that it was calibrated on that model's weights (a warning).
Every tensor is float32, the precision the cache and the kernels hold and use them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .methods import VQ_METHODS
from .presets import Preset, get_preset
from .quant.byte_centroids import snap_centroids
from .quant.score_aware import check_parallel_weight
from .quant.transform import KeyTransform
from .quant.value_prediction import ValuePredictor
from .hf.weight_fingerprint import TOLERANCE, check_fingerprint, fingerprint_distance, graph_weights, weight_fingerprint

log = logging.getLogger(__name__)

FORMAT = "vecinfer-codebooks/5"
FORMAT_V4 = "vecinfer-codebooks/4"
FORMAT_V3 = "vecinfer-codebooks/3"
FORMAT_V2 = "vecinfer-codebooks/2"
FORMAT_V1 = "vecinfer-codebooks/1"
READS = (FORMAT, FORMAT_V4, FORMAT_V3, FORMAT_V2, FORMAT_V1)
STATE_BYTES = 4  # float32: every tensor of the file, as stored and as the cache holds it
MATRIX_TOLERANCE = 1e-3  # max |A^T B - I| of a stored pair (float32 inverses of a ridge-conditioned S)


def model_geometry(config) -> dict:
    """The attention geometry of a Hugging Face config (text config for multimodal models): that of
    the layers VecInfer codes (:func:`~vecinfer_compile.hf.layer_kinds.coded_layers`; every layer's
    when none is), so that Gemma 4's sliding layers, which keep transformers' own cache, may have
    another head_dim than its full ones. A ValueError naming why for a model without one geometry
    VecInfer can code (no attention layers, several attention stacks, coded layers of different
    head dims: :mod:`.hf.attention_support`)."""
    from .hf.attention_support import attention_config, uniform_attribute
    from .hf.layer_kinds import coded_layers

    cfg = attention_config(config)
    coded = coded_layers(cfg)
    coded = coded if any(coded) else None
    heads = uniform_attribute(cfg, "num_attention_heads", coded)
    head_dim = uniform_attribute(cfg, "head_dim", coded) or cfg.hidden_size // heads
    return {
        "model_type": getattr(cfg, "model_type", "unknown"),
        "num_layers": cfg.num_hidden_layers,
        "num_query_heads": heads,
        "num_kv_heads": uniform_attribute(cfg, "num_key_value_heads", coded) or heads,
        "head_dim": head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": getattr(cfg, "vocab_size", None),
    }


def geometry_fingerprint(geometry: dict) -> str:
    blob = json.dumps(geometry, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class LayerCodebooks:
    """One attention layer's quantizer. key_centroids: ``[E_k, d_k]``; value_centroids: ``[E_v, d_v]``
    (float32); transform: smoothing factors ``[H_kv, D]`` or query-aware matrices
    ``[H_kv, D, D]``, and/or rotation, after an optional key mean ``[H_kv, D]`` (and RoPE undone
    first for the pre-RoPE methods); value_predictor: the methods that code values as the residual
    of a prediction from the dequantized key, None otherwise (value_centroids then quantize that
    residual). Books of more than 256 entries hold 7-bit centroids, snapped here (the CUDA decode
    kernel's byte books: :mod:`vecinfer_compile.quant.byte_centroids`), so that every path reads
    the same values. key_metric / value_metric: ``[H_kv, D, D]`` float32, the error metrics that
    error-weighted codes are chosen under (:mod:`vecinfer_compile.quant.weighted_codes`), or both
    None (nearest-centroid or score-aware codes)."""

    transform: KeyTransform
    key_centroids: torch.Tensor
    value_centroids: torch.Tensor
    value_predictor: ValuePredictor | None = None
    key_metric: torch.Tensor | None = None
    value_metric: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.key_centroids = snap_centroids(self.key_centroids)
        self.value_centroids = snap_centroids(self.value_centroids)
        if (self.key_metric is None) != (self.value_metric is None):
            raise ValueError("key_metric and value_metric go together (error-weighted codes of keys and values)")


def average_bits(layer_bits: list[float]) -> float:
    """Nominal bits per element of a per-layer allocation (every layer stores as many elements)."""
    return sum(layer_bits) / len(layer_bits)


@dataclass
class VecInferCodebooks:
    """Codebooks and transforms for every layer of one model.

    ``layers`` has one entry per decoder layer: None for a layer without attention (a hybrid
    model's linear-attention, convolution or state-space layer, which holds no K/V).
    ``bits`` is the nominal bits per element over the whole cache; ``layer_bits`` gives each
    layer's preset when the layers differ (a per-layer allocation, see
    :mod:`vecinfer_compile.allocate`) and is None when every layer uses the preset of ``bits``."""

    method: str
    bits: float
    layers: list[LayerCodebooks | None]
    geometry: dict
    metadata: dict = field(default_factory=dict)
    layer_bits: list[float] | None = None
    _reported: set = field(default_factory=set, init=False, repr=False, compare=False)  # once-only log lines

    def __post_init__(self) -> None:
        check_parallel_weight(self.key_parallel_weight)
        if not self.attention_layers():
            raise ValueError("codebooks need at least one attention layer; every entry of layers is None")
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

    @property
    def weighted_codes(self) -> bool:
        """Whether codes are chosen under the file's error metrics (:mod:`.quant.weighted_codes`)."""
        return self.layer(self.attention_layers()[0]).key_metric is not None

    @property
    def key_parallel_weight(self) -> float:
        """How every path encodes keys (:mod:`vecinfer_compile.quant.score_aware`): the weight of
        a key's error along its own direction, 1 for nearest-centroid codes (files without it)."""
        return float(self.metadata.get("key_parallel_weight", 1.0))

    def bits_per_layer(self) -> list[float]:
        return [self.layer_preset(i).bits for i in range(len(self.layers))]

    @property
    def head_dim(self) -> int:
        return self.geometry["head_dim"]

    def attention_layers(self) -> list[int]:
        """The decoder layers that have attention, hence codebooks (all of them but a hybrid
        model's linear-attention, convolution or state-space layers)."""
        return [i for i, layer in enumerate(self.layers) if layer is not None]

    def layer(self, index: int) -> LayerCodebooks:
        if not 0 <= index < len(self.layers):
            raise IndexError(f"codebooks cover {len(self.layers)} layers, asked for layer {index}")
        if self.layers[index] is None:
            raise ValueError(f"layer {index} has no attention in the calibrated model (a linear-attention, "
                             f"convolution or state-space layer), so it has no codebooks; its attention "
                             f"layers are {self.attention_layers()}")
        return self.layers[index]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of each kind of state, float32 as the file stores it and a
        :class:`~vecinfer_compile.cache.VecInferCache` holds it, whatever the cache's length:
        ``{"codebooks", "smoothing factors", "query-aware matrices", "key means", "value predictors",
        "error metrics", "RoPE frequencies"}`` (kinds the method has not are absent; the frequencies are one vector
        for the model). The cache adds its Hadamard matrix (``D * D``) for the methods that rotate
        and are not query-aware (:func:`~vecinfer_compile.evaluation.kv_bytes.kv_bytes`)."""
        counts: dict[str, int] = {}
        for layer in filter(None, self.layers):
            t = layer.transform
            parts = (("codebooks", layer.key_centroids), ("codebooks", layer.value_centroids),
                     ("smoothing factors", t.lam), ("query-aware matrices", t.key_matrix),
                     ("query-aware matrices", t.query_matrix), ("key means", t.mean),
                     ("error metrics", layer.key_metric), ("error metrics", layer.value_metric))
            if layer.value_predictor is not None:
                parts += (("value predictors", layer.value_predictor.matrix),
                          ("value predictors", layer.value_predictor.bias))
            for kind, tensor in parts:
                if tensor is not None:
                    counts[kind] = counts.get(kind, 0) + STATE_BYTES * tensor.numel()
        inv_freq = self.layer(self.attention_layers()[0]).transform.rope_inv_freq
        if inv_freq is not None:
            counts["RoPE frequencies"] = STATE_BYTES * inv_freq.numel()
        return counts

    def nbytes(self) -> int:
        """Bytes of all the state of :meth:`state_bytes` (float32)."""
        return sum(self.state_bytes().values())

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

    def check_weights(self, model: torch.nn.Module) -> bool | None:
        """Whether ``model`` (a torch module: a HF model, compiled or PEFT/DDP-wrapped too) has the
        weights these codebooks were calibrated on, by the fingerprint of its attention projections
        (:mod:`vecinfer_compile.hf.weight_fingerprint`; a bf16 or fp16 load of the same checkpoint
        matches). True: the same weights. False: another model's, and a warning naming both models
        and how to recalibrate is logged, once per codebooks object (a warning, not an error:
        codebooks of one model still run on another, e.g. its fine-tune, only less accurately).
        None: cannot tell (the file has no fingerprint: written before fingerprints, or not
        calibrated on a model; or the model has no recognisable q/k/v projection), with a one-time
        info line."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"check_weights needs the model itself (a torch.nn.Module), not a "
                            f"{type(model).__name__}: a config holds no weights")
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or None
        return self._compare_weights(weight_fingerprint(model.named_parameters()), name)

    def check_graph_weights(self, gm: torch.fx.GraphModule, example_inputs) -> bool | None:
        """:meth:`check_weights` for a torch.compile backend, which sees a Dynamo graph and its
        inputs rather than the model: the weights among ``example_inputs`` named by the graph's
        placeholder sources (:func:`~vecinfer_compile.hf.weight_fingerprint.graph_weights`). A graph
        that holds none of the fingerprinted weights (a graph break cut them off) gives None."""
        return self._compare_weights(weight_fingerprint(graph_weights(gm, example_inputs)), None)

    def _compare_weights(self, current: dict | None, model_name: str | None) -> bool | None:
        """The verdict of :meth:`check_weights` for the fingerprint ``current`` of a model named
        ``model_name`` (None: unknown)."""
        stored = self.metadata.get("weight_fingerprint")
        if stored is None:
            self._note("no-fingerprint", "these codebooks record no weight fingerprint (written before "
                       "vecinfer_compile recorded one, or not calibrated on a model): whether they were "
                       "calibrated for this model is not checked; recalibrate to have it checked")
            return None
        found = None if current is None else fingerprint_distance(stored, current)
        if found is None:
            self._note("not-comparable", f"cannot check these codebooks against the weights of "
                       f"{model_name or 'the compiled model'} (none of the calibrated model's attention "
                       "projections found in it)")
            return None
        distance, weight = found
        if distance <= TOLERANCE:
            return True
        if "mismatch" not in self._reported:
            self._reported.add("mismatch")
            log.warning(self._mismatch_message(model_name, weight, distance))
        return False

    def check_context(self, length: int) -> bool:
        """Whether sequences of ``length`` tokens stay within the positions these codebooks were
        calibrated on (their ``seq_len`` metadata; True when it was not recorded); warns once if
        not. Post-RoPE keys and queries of later positions differ from those calibration saw, and
        codes fitted on the shorter sequences serve them worse (docs/results.md: evalmodel, 2 bits,
        every token quantized, 2048-token windows: 1.20x full precision's perplexity with codebooks
        calibrated on 1024-token sequences, 1.09x with 2048)."""
        calibrated = self.metadata.get("seq_len")
        if not isinstance(calibrated, int) or length <= calibrated:
            return True
        if "context" not in self._reported:
            self._reported.add("context")
            log.warning("vecinfer: these codebooks were calibrated on %d-token sequences; positions past %d "
                        "(up to %d here) are quantized worse than the ones calibration saw: recalibrate with "
                        "`vecinfer calibrate --seq-len %d` (or longer) for contexts this long", calibrated,
                        calibrated, length, length)
        return False

    def _note(self, kind: str, message: str) -> None:
        """Log ``message`` at info level, once per codebooks object and ``kind``."""
        if kind not in self._reported:
            self._reported.add(kind)
            log.info("vecinfer: %s", message)

    def _mismatch_message(self, model_name: str | None, weight: str, distance: float) -> str:
        """The warning of :meth:`check_weights` for another model's weights (``model_name``:
        its path or hub name; None when unknown)."""
        calibrated = self.metadata.get("model_name") or "a model whose name was not recorded"
        used = "the compiled model" if model_name is None else repr(model_name)
        if self.layer_bits is not None:
            bits = "--layer-bits " + ",".join(f"{b:g}" for b in self.layer_bits)
        else:
            bits = f"--bits {self.bits:g}"
        return (
            f"vecinfer: these codebooks were calibrated for {calibrated!r} but are used with {used}, whose "
            f"attention weights differ ({weight}: relative distance {distance:.2f}; a bf16 or fp16 copy of "
            f"one checkpoint is within {TOLERANCE:g}), so they quantize it much less accurately. Calibrate "
            f"on this model: `vecinfer calibrate --model {model_name or 'MODEL_DIR'} --text CALIBRATION.txt "
            f"{bits} --method {self.method} --out codebooks.safetensors` (or "
            "vecinfer_compile.calibrate(model, tokenizer, text, ...) in Python)"
        )

    # -- file format ------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the safetensors artifact; returns the path."""
        from . import __version__

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        present = self.attention_layers()
        layers = [self.layers[i] for i in present]
        for i, layer in zip(present, layers):
            tensors[f"layers.{i}.key_centroids"] = layer.key_centroids.float().cpu()
            tensors[f"layers.{i}.value_centroids"] = layer.value_centroids.float().cpu()
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
        meta = {
            **{k: v for k, v in self.metadata.items() if k not in ("key_preset", "value_preset")},
            "format": FORMAT,
            "method": self.method,
            "bits": self.bits,
            "layer_bits": self.bits_per_layer(),
            "attention_layers": present,
            "rotate": layers[0].transform.rotate,
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
    if "weight_fingerprint" in meta:
        check_fingerprint(meta["weight_fingerprint"], str(path))
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

    present = _attention_layers(path, meta, num_layers)
    if meta.get("format") == FORMAT_V1:
        layer_bits = [bits] * num_layers
        key_c, value_c = list(tensor("key_centroids")), list(tensor("value_centroids"))
    else:
        layer_bits = [float(b) for b in meta["layer_bits"]]
        key_c = [tensor(f"layers.{i}.key_centroids") for i in present]
        value_c = [tensor(f"layers.{i}.value_centroids") for i in present]
    if len(layer_bits) != num_layers or len(key_c) != len(present):
        raise ValueError(f"{path}: holds {len(key_c)} layers, its geometry says {num_layers} (corrupt file)")
    for i, kc, vc in zip(present, key_c, value_c):
        b = layer_bits[i]
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
    if lam is not None and tuple(lam.shape) != (len(present), geometry["num_kv_heads"], geometry["head_dim"]):
        raise ValueError(f"{path}: lam has shape {tuple(lam.shape)}, its {len(present)} attention layers need "
                         f"{(len(present), geometry['num_kv_heads'], geometry['head_dim'])} (corrupt file)")
    key_m, query_m = _query_aware_matrices(path, tensors, method, spec.query_aware, geometry, len(present))
    mean = _key_mean(path, tensors, method, spec.center, meta.get("format") in (FORMAT, FORMAT_V4), geometry,
                     len(present))
    inv_freq, value_m, value_b = _pre_rope_state(path, tensors, method, spec, geometry, len(present))
    key_w, value_w = _error_metrics(path, tensors, geometry, len(present))
    layers: list[LayerCodebooks | None] = [None] * num_layers
    for n, i in enumerate(present):  # n: the layer's row in the stacked tensors
        layers[i] = LayerCodebooks(
            KeyTransform(geometry["head_dim"], lam[n] if lam is not None else None, spec.rotate,
                         None if key_m is None else key_m[n], None if query_m is None else query_m[n],
                         mean=None if mean is None else mean[n], rope_inv_freq=inv_freq),
            key_c[n],
            value_c[n],
            None if value_m is None else ValuePredictor(value_m[n], value_b[n]),
            None if key_w is None else key_w[n],
            None if value_w is None else value_w[n],
        )
    keep = {k: v for k, v in meta.items() if k not in ("method", "bits", "geometry", "layer_bits", "attention_layers")}
    return VecInferCodebooks(method, bits, layers, geometry, keep, layer_bits)


def _error_metrics(path: Path, tensors: dict, geometry: dict, layers: int):
    """``(key_metric, value_metric)`` ``[A, H_kv, D, D]`` of a file with error-weighted codes, or
    (None, None), checked: both or neither, shaped for the geometry."""
    present = [name for name in ("key_metric", "value_metric") if name in tensors]
    if not present:
        return None, None
    if len(present) != 2:
        raise ValueError(f"{path}: error-weighted codes need tensors 'key_metric' and 'value_metric' but the "
                         f"file has only {present} (corrupt file): recalibrate with `vecinfer calibrate --weighted-codes`")
    shape = (layers, geometry["num_kv_heads"], geometry["head_dim"], geometry["head_dim"])
    for name in present:
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, its {layers} attention layers "
                             f"need {shape} (corrupt file)")
    return tensors["key_metric"], tensors["value_metric"]


def _attention_layers(path: Path, meta: dict, num_layers: int) -> list[int]:
    """The layers of a file that have codebooks, checked: format 5 lists them (a hybrid model's
    layers without attention have none); in older formats every layer has them."""
    present = meta.get("attention_layers", list(range(num_layers)))
    if (not present or present != sorted(set(present))
            or not all(isinstance(i, int) and 0 <= i < num_layers for i in present)):
        raise ValueError(f"{path}: attention_layers {present} is not an increasing list of layers below "
                         f"{num_layers} (corrupt file)")
    return present


def _query_aware_matrices(path: Path, tensors: dict, method: str, needed: bool, geometry: dict, layers: int):
    """``(key_matrix, query_matrix)`` ``[A, H_kv, D, D]`` of a query-aware file (None, None
    otherwise) for its ``A = layers`` attention layers, checked: present, shaped for the
    geometry, and inverse transposes of each other."""
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
    expect = (layers, geometry["num_kv_heads"], geometry["head_dim"], geometry["head_dim"])
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



def _pre_rope_state(path: Path, tensors: dict, method: str, spec, geometry: dict, layers: int):
    """``(rope_inv_freq [r/2], value_matrix [A, H_kv, D, D], value_bias [A, H_kv, D])`` of a file,
    checked against its method (each None where the method has none) and geometry."""
    needed = {"rope_inv_freq": spec.pre_rope, "value_matrix": spec.predict_values, "value_bias": spec.predict_values}
    for name, wanted in needed.items():
        if wanted and name not in tensors:
            raise ValueError(f"{path}: method {method!r} needs tensor {name!r} but the file has none: "
                             f"recalibrate with `vecinfer calibrate --method {method}`")
        if not wanted and name in tensors:
            raise ValueError(f"{path}: method {method!r} takes no {name!r} but the file has it (corrupt file): "
                             "recalibrate with `vecinfer calibrate`")
    h, d = geometry["num_kv_heads"], geometry["head_dim"]
    inv_freq = tensors.get("rope_inv_freq")
    if inv_freq is not None and not (inv_freq.dim() == 1 and 0 < 2 * inv_freq.shape[0] <= d):
        raise ValueError(f"{path}: rope_inv_freq has shape {tuple(inv_freq.shape)}, head_dim {d} needs [r/2] with "
                         f"r <= {d} (corrupt file)")
    matrix, bias = tensors.get("value_matrix"), tensors.get("value_bias")
    if matrix is not None and (tuple(matrix.shape) != (layers, h, d, d) or tuple(bias.shape) != (layers, h, d)):
        raise ValueError(f"{path}: value_matrix / value_bias have shapes {tuple(matrix.shape)} / {tuple(bias.shape)}, "
                         f"its geometry needs {(layers, h, d, d)} / {(layers, h, d)} (corrupt file)")
    for name, t in (("rope_inv_freq", inv_freq), ("value_matrix", matrix), ("value_bias", bias)):
        if t is not None and not torch.isfinite(t).all():
            raise ValueError(f"{path}: {name} holds NaN or inf (corrupt file): recalibrate with "
                             f"`vecinfer calibrate --method {method}`")
    return (None if inv_freq is None else inv_freq.float(), None if matrix is None else matrix.float(),
            None if bias is None else bias.float())


def _key_mean(path: Path, tensors: dict, method: str, centred: bool, current: bool, geometry: dict,
              layers: int):
    """``key_mean [A, H_kv, D]`` float32 of a centring method's file for its ``A = layers``
    attention layers, checked (shape, finite);
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
    expect = (layers, geometry["num_kv_heads"], geometry["head_dim"])
    if tuple(mean.shape) != expect:
        raise ValueError(f"{path}: key_mean has shape {tuple(mean.shape)}, its geometry needs {expect} "
                         f"[layers, kv_heads, head_dim]: recalibrate with `vecinfer calibrate --method {method}`")
    if not torch.isfinite(mean).all():
        raise ValueError(f"{path}: key_mean holds NaN or inf (corrupt file): recalibrate with "
                         f"`vecinfer calibrate --method {method}`")
    return mean.float()
