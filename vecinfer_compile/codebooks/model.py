"""The codebooks of one model, apart from any file: per attention layer, the key transform and
the key/value k-means codebooks (:class:`LayerCodebooks`); for the model, those layers with the
method, bits and geometry they were fitted for and the calibration's metadata
(:class:`VecInferCodebooks`), and the checks that they fit a model: its shape
(:meth:`VecInferCodebooks.check_model`, an error), its weights
(:meth:`VecInferCodebooks.check_weights`, a warning) and its context length
(:meth:`VecInferCodebooks.check_context`, a warning). Every tensor is float32, the precision the
cache and the kernels hold and use them in. The file format is :mod:`.file_format`."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..codecs.base import Codec
from ..codecs.registry import DEFAULT as DEFAULT_CODEC
from ..codecs.registry import of as codec_of
from ..hf.weight_fingerprint import TOLERANCE, fingerprint_distance, graph_weights, weight_fingerprint
from ..presets import Preset, get_preset
from ..quant.score_aware import check_parallel_weight
from ..quant.transform import KeyTransform
from ..quant.value_prediction import ValuePredictor

log = logging.getLogger(__package__)  # vecinfer_compile.codebooks, whichever module logs

STATE_BYTES = 4  # float32: every tensor of the file, as stored and as the cache holds it


def model_geometry(config) -> dict:
    """The attention geometry of a Hugging Face config (text config for multimodal models): that of
    the layers VecInfer codes (:func:`~vecinfer_compile.hf.layer_kinds.coded_layers`; every layer's
    when none is), so that Gemma 4's sliding layers, which keep transformers' own cache, may have
    another head_dim than its full ones. A ValueError naming why for a model without one geometry
    VecInfer can code (no attention layers, several attention stacks, coded layers of different
    head dims: :mod:`vecinfer_compile.hf.attention_support`)."""
    from ..hf.attention_support import attention_config, uniform_attribute
    from ..hf.layer_kinds import coded_layers

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
    """16 hex digits of the SHA-256 of ``geometry`` (:func:`model_geometry`) as sorted JSON: a file
    stores it beside the geometry, so that edited or corrupt metadata is caught on loading."""
    blob = json.dumps(geometry, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class LayerCodebooks:
    """One attention layer's quantizer. ``transform``: the key transform (smoothing factors
    ``[H_kv, D]`` or query-aware matrices ``[H_kv, D, D]``, and/or rotation, after an optional key
    mean ``[H_kv, D]``, RoPE undone first for the pre-RoPE methods); ``keys``, ``values``: each
    side's code, keys in the transform's domain, of a registered codec
    (:mod:`vecinfer_compile.codecs`: the codebooks' centroids ``[E, d]`` float32 by default);
    ``value_predictor``: the methods that code values as the residual of a prediction from the
    dequantized key, None otherwise (``values`` then code that residual); ``key_metric`` /
    ``value_metric``: ``[H_kv, D, D]`` float32, the error metrics that error-weighted codes are
    chosen under (:mod:`vecinfer_compile.quant.weighted_codes`), or both None."""

    transform: KeyTransform
    keys: Any
    values: Any
    value_predictor: ValuePredictor | None = None
    key_metric: torch.Tensor | None = None
    value_metric: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.keys = self.key_codec.normalize(self.keys)
        self.values = self.value_codec.normalize(self.values)
        if (self.key_metric is None) != (self.value_metric is None):
            raise ValueError("key_metric and value_metric go together (error-weighted codes of keys and values)")

    @property
    def key_codec(self) -> Codec:
        """The codec of the keys' code (:mod:`vecinfer_compile.codecs.registry`)."""
        return codec_of(self.keys)

    @property
    def value_codec(self) -> Codec:
        return codec_of(self.values)


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
        return (
            f"VecInferCodebooks(method={self.method!r}, bits={self.bits:g}{per_layer}, "
            f"layers={len(self.layers)}, kv_heads={g.get('num_kv_heads')}, head_dim={g.get('head_dim')}, "
            f"{self.nbytes():,} bytes)"
        )

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
    def codecs(self) -> tuple[str, str]:
        """The names of the codecs of the keys and of the values (every layer's)."""
        layer = self.layer(self.attention_layers()[0])
        return layer.key_codec.name, layer.value_codec.name

    def check_compiled_simulate(self) -> None:
        """Raise a ValueError naming the fix if these codebooks code keys or values with a codec other
        than the default: the compiled backend's rewrite of attention without a VecInferCache (the
        compiled simulate path) codes with the codebooks; the others run compiled over a
        VecInferCache, and in the eager simulate path."""
        coded = [
            f"{kind} with the {name} codec"
            for kind, name in zip(("keys", "values"), self.codecs)
            if name != DEFAULT_CODEC
        ]
        if coded:
            raise ValueError(
                f"these codebooks code {' and '.join(coded)}, which vecinfer_backend runs over a VecInferCache "
                "only (generate with cache=VecInferCache(...)); this graph attends without one: run it uncompiled "
                "(the simulate path: vecinfer eval-ppl), or calibrate with the default codec"
            )

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
            raise ValueError(
                f"layer {index} has no attention in the calibrated model (a linear-attention, "
                f"convolution or state-space layer), so it has no codebooks; its attention "
                f"layers are {self.attention_layers()}"
            )
        return self.layers[index]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of each kind of state, float32 as the file stores it and a
        :class:`~vecinfer_compile.cache.VecInferCache` holds it, whatever the cache's length:
        ``{"codebooks", "smoothing factors", "query-aware matrices", "key means", "value predictors",
        "error metrics", "key codec", "value codec", "RoPE frequencies"}`` (kinds the method has not
        are absent; the frequencies are one vector for the model). The cache adds its Hadamard matrix (``D * D``) for the methods that rotate
        and are not query-aware (:func:`~vecinfer_compile.evaluation.kv_bytes.kv_bytes`)."""
        counts: dict[str, int] = {}
        for layer in filter(None, self.layers):
            t = layer.transform
            books, codecs = (), ()  # the default codec's books lead, as the method's formula lists them
            for side, code in (("key", layer.keys), ("value", layer.values)):
                codec = codec_of(code)
                if codec.name == DEFAULT_CODEC:
                    books += tuple(("codebooks", x) for x in codec.state_tensors(code))
                else:
                    codecs += tuple((f"{side} codec", x) for x in codec.state_tensors(code))
            parts = (
                *books,
                ("smoothing factors", t.lam),
                ("query-aware matrices", t.key_matrix),
                ("query-aware matrices", t.query_matrix),
                ("key means", t.mean),
                ("error metrics", layer.key_metric),
                ("error metrics", layer.value_metric),
                *codecs,
            )
            if layer.value_predictor is not None:
                parts += (
                    ("value predictors", layer.value_predictor.matrix),
                    ("value predictors", layer.value_predictor.bias),
                )
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
            raise TypeError(
                f"check_weights needs the model itself (a torch.nn.Module), not a "
                f"{type(model).__name__}: a config holds no weights"
            )
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
            self._note(
                "no-fingerprint",
                "these codebooks record no weight fingerprint (written before "
                "vecinfer_compile recorded one, or not calibrated on a model): whether they were "
                "calibrated for this model is not checked; recalibrate to have it checked",
            )
            return None
        found = None if current is None else fingerprint_distance(stored, current)
        if found is None:
            self._note(
                "not-comparable",
                f"cannot check these codebooks against the weights of "
                f"{model_name or 'the compiled model'} (none of the calibrated model's attention "
                "projections found in it)",
            )
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
            log.warning(
                "vecinfer: these codebooks were calibrated on %d-token sequences; positions past %d "
                "(up to %d here) are quantized worse than the ones calibration saw: recalibrate with "
                "`vecinfer calibrate --seq-len %d` (or longer) for contexts this long",
                calibrated,
                calibrated,
                length,
                length,
            )
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

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write these codebooks to ``path`` in the current file format
        (:func:`~vecinfer_compile.codebooks.file_format.save_codebooks`); returns the path. The
        folder must exist; an existing file is an error unless ``overwrite``. The file is written
        beside it under a temporary name and moved in only while ``path`` is still new
        (:func:`~vecinfer_compile.atomic_file.write_new`)."""
        from ..atomic_file import write_new
        from .file_format import save_codebooks

        return write_new(path, lambda tmp: save_codebooks(self, tmp), overwrite=overwrite)
