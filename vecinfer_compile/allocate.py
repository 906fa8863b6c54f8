"""Per-layer bit allocation at a fixed average, from calibration text only.

The method as published gives every layer the same preset. Retrieval (needle-in-a-haystack,
long-context QA) depends on a few layers whose queries single out a handful of distant tokens;
2-bit key error there changes which token is read (README, "Needle in a haystack"). The
``"retrieval"`` allocation keeps the average at exactly ``bits`` and moves bits to those layers:

1. **Retrieval layers** (:func:`retrieval_scores`): synthetic retrieval documents are built from
   the calibration text — filler, one fact sentence ``FACT`` at a random depth, the question
   ``QUESTION`` at the end; names and words are drawn from the text. A layer's score is the
   attention mass that its most retrieving query head puts on the fact from the question's last
   token, averaged over documents (the retrieval-head criterion of Wu et al., 2024). Layers
   scoring at least half the best score and at least ``MIN_RETRIEVAL_MASS`` are pinned at twice
   ``bits`` (at most a third of the layers: each is paid for by two layers at half ``bits``).
2. **The other layers** (:func:`loss_sensitivity`): the increase of the model's loss on
   calibration windows when that one layer is quantized at a candidate preset (keys and values
   beyond the residual window, as in the cache) and every other layer is exact.
   :func:`allocate_bits` picks the presets that minimise the summed increase with the average
   held at ``bits``.

With ``bits=2`` the choices are the 1-, 2- and 4-bit presets, all with 8-bit codes, so the
physical size equals a uniform 2-bit cache.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .codebooks import LayerCodebooks
from .hf.recording import collect_kv
from .presets import allocation_choices
from .simulate import LayerSimulator, attention_modules, disable_simulation, enable_simulation

FACT = " {name}'s secret word is {word}."
QUESTION = " What is {name}'s secret word? {name}'s secret word is"
MIN_RETRIEVAL_MASS = 0.1


@dataclass
class Allocation:
    """layer_bits: the chosen preset per layer; retrieval: per-layer score in [0, 1];
    sensitivity: ``{bits: [per-layer loss increase, nats/token]}``; pinned: layers held at the
    top choice for retrieval."""

    layer_bits: list[float]
    retrieval: list[float]
    sensitivity: dict[float, list[float]]
    pinned: list[int]

    def as_dict(self) -> dict:
        """The file's ``allocation`` metadata (the chosen presets are its ``layer_bits``)."""
        return {
            "rule": "retrieval",
            "retrieval_scores": [round(s, 4) for s in self.retrieval],
            "loss_increase": {f"{b:g}": [round(e, 5) for e in errs] for b, errs in self.sensitivity.items()},
            "pinned_layers": self.pinned,
        }


def allocate_bits(bits: float, cost: dict[float, list[float]], pinned: list[int]) -> list[float]:
    """Per-layer presets from ``allocation_choices(bits)`` averaging exactly ``bits`` that
    minimise the summed ``cost[b][layer]``, with ``pinned`` layers at ``2 * bits``.
    A dynamic programme over layers and the bit budget (in units of ``bits / 2``)."""
    choices = allocation_choices(bits)
    units = {c: round(c / (bits / 2)) for c in choices}  # 1, 2, 4
    layers = len(cost[bits])
    budget = 2 * layers
    if 4 * len(pinned) + (layers - len(pinned)) > budget:
        raise ValueError(
            f"cannot pin {len(pinned)} of {layers} layers at {2 * bits:g} bits within a {bits:g}-bit average"
        )
    best: dict[int, tuple[float, list[float]]] = {0: (0.0, [])}
    for layer in range(layers):
        options = [choices[2]] if layer in pinned else list(choices)
        step: dict[int, tuple[float, list[float]]] = {}
        for used, (total, picked) in best.items():
            for c in options:
                u = used + units[c]
                if u > budget:
                    continue
                cand = (total + cost[c][layer], picked + [c])
                if u not in step or cand[0] < step[u][0]:
                    step[u] = cand
        best = step
    return best[budget][1]


def _probe_vocabulary(text: str) -> tuple[list[str], list[str]]:
    """Names (capitalised words never seen in lower case) and plain lower-case words of ``text``."""
    lower = set(re.findall(r"\b[a-z]{4,9}\b", text))
    names = sorted({w for w in re.findall(r"\b[A-Z][a-z]{3,9}\b", text) if w.lower() not in lower})
    if len(names) < 8 or len(lower) < 8:
        raise ValueError("the calibration text is too short to build retrieval probes: give a few pages of prose")
    return names, sorted(lower)


@torch.no_grad()
def retrieval_scores(
    model, tokenizer, text: str, *, probes: int = 16, seq_len: int = 1024, seed: int = 0, progress: bool = True
) -> list[float]:
    """Per-layer retrieval score in [0, 1] (module docstring, step 1) from ``probes`` synthetic
    documents of ``seq_len`` tokens built from ``text``."""

    names, words = _probe_vocabulary(text)
    filler = tokenizer(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    totals: list[float] | None = None
    for _ in tqdm(range(probes), desc="retrieval probes", disable=not progress):
        name, word = rng.choice(names), rng.choice(words)
        fact = tokenizer(FACT.format(name=name, word=word), add_special_tokens=False)["input_ids"]
        question = tokenizer(QUESTION.format(name=name), add_special_tokens=False)["input_ids"]
        n_fill = seq_len - len(fact) - len(question)
        if n_fill < 16 or len(filler) <= n_fill:
            raise ValueError(
                f"retrieval probes of {seq_len} tokens need more calibration text than {len(filler)} tokens"
            )
        start = rng.randrange(len(filler) - n_fill)
        depth = rng.randrange(n_fill)
        doc = filler[start : start + depth] + fact + filler[start + depth : start + n_fill] + question
        keys, _, queries = collect_kv(model, torch.tensor(doc), len(doc), progress=False, with_queries=True)
        offset = keys[0].shape[1] - len(doc)  # 1 when a BOS token was prepended
        lo = offset + depth
        scores = []
        for layer in sorted(queries):
            q = queries[layer][:, -1]  # [Hq, D]
            k = keys[layer].repeat_interleave(q.shape[0] // keys[layer].shape[0], 0)  # [Hq, T, D]
            probs = (torch.einsum("hd,htd->ht", q, k) / math.sqrt(q.shape[-1])).softmax(-1)
            scores.append(probs[:, lo : lo + len(fact)].sum(-1).max().item())
        totals = scores if totals is None else [a + b for a, b in zip(totals, scores)]
    return [t / probes for t in totals]


def pinned_layers(scores: list[float]) -> list[int]:
    """Layers scoring at least half the best and ``MIN_RETRIEVAL_MASS``, best first, at most a
    third of the layers."""
    top = max(scores)
    keep = [
        i for i in sorted(range(len(scores)), key=lambda i: -scores[i]) if scores[i] >= max(top / 2, MIN_RETRIEVAL_MASS)
    ]
    return sorted(keep[: len(scores) // 3])


class _ExactLayer(LayerSimulator):
    """A layer left in full precision while another layer's sensitivity is measured."""

    def quantize_kv(self, k, v, position_ids=None):
        return k, v


@torch.no_grad()
def loss_sensitivity(
    model,
    token_ids: torch.Tensor,
    fitted: dict[int, dict[float, LayerCodebooks]],
    method: str,
    *,
    residual: int,
    windows: int,
    window_len: int,
    progress: bool = True,
) -> dict[float, list[float]]:
    """``{b: [loss increase in nats/token per layer]}`` for every preset ``b`` in ``fitted[0]``:
    layer ``i`` quantized with ``fitted[i][b]`` (residual window ``residual``), the others exact,
    on the first ``windows`` windows of ``window_len`` tokens of ``token_ids: [N]``."""
    from .codebooks import VecInferCodebooks, model_geometry
    from .evaluation.perplexity import perplexity

    def nll() -> float:
        return perplexity(model, token_ids, windows=windows, window_len=window_len, progress=False).nll

    base = nll()
    choices = sorted(fitted[0])
    layers = sorted(fitted)
    out: dict[float, list[float]] = {c: [] for c in choices}
    steps = tqdm(total=len(choices) * len(layers), desc="loss per layer and preset", disable=not progress)
    geometry = model_geometry(model.config)
    for c in choices:
        codebooks = VecInferCodebooks(method, c, [fitted[i][c] for i in layers], geometry)
        for layer in layers:
            enable_simulation(model, method, bits=c, codebooks=codebooks, residual=residual)
            try:
                for module in attention_modules(model):
                    if module.layer_idx != layer:
                        module.vecinfer_simulator = _ExactLayer(method, c, residual, codebooks, module.layer_idx)
                out[c].append(nll() - base)
            finally:
                disable_simulation(model)
            steps.update()
    steps.close()
    return out


def retrieval_allocation(
    model,
    tokenizer,
    text: str,
    token_ids: torch.Tensor,
    fitted: dict[int, dict[float, LayerCodebooks]],
    bits: float,
    method: str,
    *,
    seq_len: int,
    residual: int,
    seed: int = 0,
    windows: int = 4,
    progress: bool = True,
) -> Allocation:
    """The ``"retrieval"`` allocation (module docstring). ``fitted[layer][b]``: that layer's
    codebooks at every preset of :func:`allocation_choices`; ``token_ids: [N]`` calibration
    tokens, whose first ``windows`` windows of ``seq_len`` measure the loss increases;
    ``residual``: the cache's full-precision window."""
    windows = max(1, min(windows, token_ids.numel() // seq_len))
    sensitivity = loss_sensitivity(
        model,
        token_ids,
        fitted,
        method,
        residual=residual,
        windows=windows,
        window_len=min(seq_len, token_ids.numel()),
        progress=progress,
    )
    scores = retrieval_scores(model, tokenizer, text, seq_len=seq_len, seed=seed, progress=progress)
    pinned = pinned_layers(scores)
    return Allocation(allocate_bits(bits, sensitivity, pinned), scores, sensitivity, pinned)
