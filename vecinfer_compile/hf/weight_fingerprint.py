"""Which weights codebooks were calibrated on: a fingerprint of a model's attention projections.

Codebooks fit one model's keys, values and queries. Another model of the same shape runs with
them without complaint (the geometry check cannot tell them apart) and quantizes much worse
(perplexity 534, against 339 with codebooks of its own).
So :func:`vecinfer_compile.calibrate` stores this fingerprint in the file's metadata and
:meth:`vecinfer_compile.codebooks.VecInferCodebooks.check_weights` compares it with the model's.

What is fingerprinted: the query, key and value projection weights (``q_proj``, ``k_proj``,
``v_proj``, or a fused ``qkv_proj`` / ``query_key_value`` / ``c_attn`` / ``Wqkv``) of the first and
the last layer of each stack of numbered layers (``model.layers.0`` and ``model.layers.{L-1}``): the
weights the keys, values and queries come from. Embeddings and other layers are not read (cheap;
a checkpoint that differs only there is not detected).

What one weight ``W [rows, cols]`` (``n`` elements, any float dtype, any device) becomes: a count
sketch of ``SKETCH`` floats, ``s_j = sqrt(SKETCH / n) * sum_{r = j mod SKETCH} sigma_r (W_r . tau)``
(the product in float32 on the weight's device, the buckets summed in float64 on the CPU), with
signs ``sigma_r, tau_c = +-1`` from an integer hash of the row and column indices, exact on every
device; one matrix-vector product, a few milliseconds for a 4096 x 4096 weight on a CPU. Each
``s_j`` is about ``rms(W)`` in size and the sketch is linear, so the relative distance of two sketches
``||s_a - s_b|| / max(||s_a||, ||s_b||)`` estimates the relative Frobenius distance of the weights
(roughly: 16 buckets). Measured on the tiny model: a bf16 copy of float32 weights is 0.0025 away
(rounding; fp16 0.0003); a model of the same shape with other random weights 1.3; the same model
with two RoPE channel pairs of ``k_proj`` per head scaled 8x (as ``evalmodel-outliers`` is built)
0.8. Weights further apart than ``TOLERANCE`` are another model. Under tensor parallelism a
DTensor weight is gathered whole (``full_tensor()``: a collective, so every rank must check, as
every rank builds its cache); weights that are not floating point (int8/4-bit quantized) or on the
meta device are skipped.

Stored as ``{"version": 1, "sketches": {name: [SKETCH floats]}}`` under the metadata key
``weight_fingerprint``, ``name`` being the parameter's name in the calibrated model
(``model.layers.0.self_attn.k_proj.weight``). Names are matched by suffix, so a model wrapped by
``torch.compile`` (``_orig_mod.``), PEFT (``base_model.model.``, ``.base_layer``) or DDP
(``module.``), or its inner decoder, still compares.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch

VERSION = 1
SKETCH = 16
TOLERANCE = 0.02  # relative distance: dtype rounding is ~0.002, another model ~1
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")
_WEIGHT = re.compile(
    r"^(?P<stack>.*?)\.(?P<layer>\d+)\.(?:.+\.)?(?:" + "|".join(PROJECTIONS) + r")(?P<lora>\.base_layer)?\.weight$"
)
_PRIME = 2_147_483_647  # 2^31 - 1: products of two residues fit in int64
_SOURCE_PART = re.compile(r"\._(?:modules|parameters)\['([^']+)'\]")


def attention_weights(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The q/k/v projection weights of the first and last layer of each numbered stack in
    ``named`` (``(name, tensor)`` pairs, as ``model.named_parameters()`` gives), by name with
    PEFT's ``.base_layer`` dropped."""
    found = []
    for name, tensor in named:
        match = _WEIGHT.match(name)
        if match:
            plain = name.replace(".base_layer.weight", ".weight") if match["lora"] else name
            found.append((plain, match["stack"], int(match["layer"]), tensor))
    ends: dict[str, tuple[int, int]] = {}
    for _, stack, layer, _ in found:
        low, high = ends.get(stack, (layer, layer))
        ends[stack] = (min(low, layer), max(high, layer))
    return {name: tensor for name, stack, layer, tensor in found if layer in ends[stack]}


def _readable(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` as one plain local tensor (a DTensor gathered whole), or None when its values
    cannot be read (meta device, not floating point)."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
    if tensor.device.type == "meta" or not tensor.is_floating_point():
        return None
    return tensor.detach()


def _signs(count: int, salt: int, device) -> torch.Tensor:
    """``[count]`` float32 of +-1 hashed from the indices ``0 .. count - 1`` and ``salt`` (two
    rounds of squaring modulo a prime: integer arithmetic, so equal on every device)."""
    h = (torch.arange(count, dtype=torch.int64, device=device) + 1_234_567 * salt) % _PRIME
    h = (h * h + 7_654_321) % _PRIME
    h = (h * h) % _PRIME
    return 1.0 - 2.0 * ((h >> 13) & 1).to(torch.float32)


def weight_sketch(tensor: torch.Tensor) -> list[float]:
    """The ``SKETCH`` floats of one weight (module docstring), rounded to 6 significant digits.
    ``tensor``: any float dtype and device, viewed as ``[rows, cols]``."""
    w = tensor.reshape(tensor.shape[0], -1).float()
    rows, cols = w.shape
    projected = (w @ _signs(cols, 1, w.device)) * _signs(rows, 2, w.device)  # [rows]
    padded = torch.nn.functional.pad(projected, (0, (-rows) % SKETCH))
    sums = padded.cpu().double().reshape(-1, SKETCH).sum(0)  # bucket j: the rows r = j mod SKETCH
    scale = math.sqrt(SKETCH / max(w.numel(), 1))
    return [float(f"{v * scale:.6g}") for v in sums.tolist()]


def weight_fingerprint(named: Iterable[tuple[str, torch.Tensor]]) -> dict | None:
    """``{"version": 1, "sketches": {name: [SKETCH floats]}}`` of the attention weights in
    ``named`` (:func:`attention_weights`); None when none of them can be read."""
    sketches = {}
    for name, tensor in attention_weights(named).items():
        readable = _readable(tensor)
        if readable is not None:
            sketches[name] = weight_sketch(readable)
    return {"version": VERSION, "sketches": sketches} if sketches else None


def check_fingerprint(fingerprint, where: str) -> None:
    """Raise a ValueError naming the fix if a stored fingerprint is malformed (a corrupt file).
    A fingerprint of a later version is left alone (:func:`fingerprint_distance` skips it)."""
    ok = isinstance(fingerprint, dict) and isinstance(fingerprint.get("version"), int)
    if ok and fingerprint["version"] == VERSION:
        sketches = fingerprint.get("sketches")
        ok = isinstance(sketches, dict) and all(
            isinstance(s, list) and len(s) == SKETCH and all(isinstance(v, (int, float)) for v in s)
            for s in sketches.values()
        )
    if not ok:
        raise ValueError(
            f"{where}: its weight_fingerprint is malformed (corrupt file): recalibrate with `vecinfer calibrate`"
        )


def _same_weight(a: str, b: str) -> bool:
    """Whether two parameter names are one weight, up to a wrapper's prefix."""
    return a == b or a.endswith("." + b) or b.endswith("." + a)


def _relative_distance(a: list[float], b: list[float]) -> float:
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    size = max(math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b)))
    return diff / size if size > 0 else 0.0


def fingerprint_distance(stored: dict, current: dict) -> tuple[float, str] | None:
    """``(distance, name)``: the largest relative sketch distance over the weights both
    fingerprints hold, and that weight's name (as stored); None when they share no weight or
    ``stored`` is of another version."""
    if stored.get("version") != VERSION or current.get("version") != VERSION:
        return None
    pairs = [
        (name, s, c)
        for name, s in stored["sketches"].items()
        for other, c in current["sketches"].items()
        if _same_weight(name, other)
    ]
    if not pairs:
        return None
    return max((_relative_distance(s, c), name) for name, s, c in pairs)


def graph_weights(gm: torch.fx.GraphModule, example_inputs) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the parameters among a Dynamo graph's inputs, named as in the model
    (``model.layers.0.self_attn.k_proj.weight``) from each placeholder's source
    (``L['self']._modules['model']..._parameters['weight']``); for a backend, which never sees
    the model object. Placeholders without a source are left out."""
    named = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        if not isinstance(value, torch.Tensor) or source is None:
            continue
        text = source.name() if callable(source.name) else source.name
        parts = _SOURCE_PART.findall(text)
        if parts and "._parameters[" in text:
            named.append((".".join(parts), value))
    return named
