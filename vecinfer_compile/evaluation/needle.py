"""Offline needle-in-a-haystack through each method's KV cache.

Protocol (one cell = one context length x one depth, ``trials`` prompts per cell):

- Filler: the ``*.txt`` files of a haystack directory, sorted by name and concatenated, read at
  run time (never copied into the project) and tokenized once with no special tokens.
- Prompt of exactly ``length`` tokens: ``[BOS] filler[:p] needle filler[p:F] question``. The
  filler span of ``F`` tokens starts at a sentence boundary at a seeded random offset of the
  haystack (a different span per trial); the needle goes in at the sentence boundary nearest to
  ``depth% * F`` (depth 0: before all filler, 100: right before the question).
- Needle / question: the retrieval templates the evaluation models were trained on
  (``passkey``, ``magic`` number, secret ``word``), with a seeded random key per trial. Numbers
  have 7 digits: with shorter keys ``evalmodel`` retrieves the key but keeps going with one
  more digit (``28706`` -> ``287066``; measured at 3-5 digits, none at 6-7), i.e. it was trained
  on keys of about 7 digits.
- Greedy ``generate()`` of ``max_new_tokens`` through the method's cache
  (:mod:`.generation`); a trial is correct when the key occurs in the generated text as a whole
  word (exact match, case-sensitive).
"""

from __future__ import annotations

import random
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = ("passkey", "magic", "word")

_ADJECTIVES = [
    "quiet",
    "golden",
    "hidden",
    "ancient",
    "silver",
    "bright",
    "frozen",
    "gentle",
    "crimson",
    "hollow",
    "distant",
    "restless",
    "wooden",
    "northern",
    "broken",
    "sleepy",
]
_NOUNS = [
    "garden",
    "river",
    "lantern",
    "mountain",
    "harbor",
    "forest",
    "castle",
    "meadow",
    "bridge",
    "valley",
    "island",
    "window",
    "tower",
    "orchard",
    "village",
    "compass",
]
_NAMES = [
    "Alice",
    "Thomas",
    "Maria",
    "Henry",
    "Clara",
    "Samuel",
    "Emma",
    "George",
    "Lucy",
    "Arthur",
    "Helen",
    "Walter",
    "Rose",
    "Edward",
    "Anna",
    "Daniel",
]
_WORDS = [
    "lantern",
    "meadow",
    "thunder",
    "violet",
    "harbor",
    "crystal",
    "falcon",
    "marble",
    "cedar",
    "ember",
    "willow",
    "copper",
    "saffron",
    "glacier",
    "pepper",
    "canyon",
]


@dataclass(frozen=True)
class Needle:
    """``text``: the sentence inserted; ``question``: appended after the filler (ends where the
    answer starts); ``key``: what must appear in the output."""

    template: str
    text: str
    question: str
    key: str


def make_needle(template: str, rng: random.Random) -> Needle:
    """A needle of ``template`` with a random key drawn from ``rng``."""
    if template == "passkey":
        key = str(rng.randint(1_000_000, 9_999_999))
        return Needle(
            template,
            f" The pass key is {key}. Remember it. {key} is the pass key.",
            " What is the pass key? The pass key is",
            key,
        )
    if template == "magic":
        thing = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
        key = str(rng.randint(1_000_000, 9_999_999))
        return Needle(
            template,
            f" The special magic number for {thing} is {key}.",
            f" What is the special magic number for {thing}? The special magic number for {thing} is",
            key,
        )
    if template == "word":
        name, word = rng.choice(_NAMES), rng.choice(_WORDS)
        return Needle(
            template,
            f" {name}'s secret word is {word}.",
            f" What is {name}'s secret word? {name}'s secret word is",
            word,
        )
    raise ValueError(f"unknown needle template {template!r}; choose one of: {', '.join(TEMPLATES)}")


def is_correct(generated: str, key: str) -> bool:
    """Exact match: ``key`` occurs in ``generated`` as a whole word (``12345`` does not match
    ``123456``; ``ember`` does not match ``embers``)."""
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(key)}(?![0-9A-Za-z])", generated) is not None


def load_haystack(directory: str | Path) -> str:
    """The sorted ``*.txt`` files of ``directory`` concatenated (blank line between files)."""
    d = Path(directory)
    if not d.exists():
        raise FileNotFoundError(f"haystack directory {d} does not exist")
    if not d.is_dir():
        raise NotADirectoryError(f"haystack path {d} is not a directory (expected a folder of .txt files)")
    files = sorted(p for p in d.glob("*.txt") if p.is_file())
    if not files:
        raise FileNotFoundError(f"haystack directory {d} has no *.txt files")
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in files)
    if not text.strip():
        raise ValueError(f"haystack directory {d}: its .txt files are empty")
    return text


_BOUNDARY_END = re.compile(r"[.!?][\"')\]]*\s*$|\n\s*$")


def sentence_boundaries(tokenizer, filler_ids: list[int]) -> list[int]:
    """Positions ``p`` (0 < p < len) such that token ``p-1`` ends a sentence (``.!?``, optionally
    followed by a closing quote/bracket) or a line; a needle inserted before token ``p`` starts
    a new sentence."""
    ends = {t: bool(_BOUNDARY_END.search(tokenizer.decode([t]))) for t in set(filler_ids)}
    return [p for p in range(1, len(filler_ids)) if ends[filler_ids[p - 1]]]


@dataclass
class Prompt:
    ids: list[int]
    needle: Needle
    needle_start: int  # index of the needle's first token in ids
    filler_tokens: int
    depth_actual: float  # needle position as a fraction of the filler tokens


def build_prompt(
    tokenizer,
    filler_ids: list[int],
    boundaries: list[int],
    length: int,
    depth: float,
    needle: Needle,
    rng: random.Random,
    bos_id: int | None,
) -> Prompt:
    """A prompt of exactly ``length`` tokens (see the module docstring). ``depth`` in [0, 1]."""
    import bisect

    needle_ids = tokenizer(needle.text, add_special_tokens=False)["input_ids"]
    question_ids = tokenizer(needle.question, add_special_tokens=False)["input_ids"]
    head = [] if bos_id is None else [bos_id]
    n_fill = length - len(head) - len(needle_ids) - len(question_ids)
    if n_fill < 1:
        raise ValueError(
            f"context length {length} is too short for the needle and question "
            f"({len(needle_ids) + len(question_ids) + len(head)} tokens)"
        )
    if n_fill > len(filler_ids):
        raise ValueError(
            f"the haystack has {len(filler_ids)} tokens, fewer than the {n_fill} filler tokens a "
            f"{length}-token prompt needs: add text to the haystack directory or use shorter --lengths"
        )
    # start at a sentence boundary (or 0) that leaves n_fill tokens
    starts = [0] + [b for b in boundaries if b + n_fill <= len(filler_ids)]
    start = rng.choice(starts)
    span = filler_ids[start : start + n_fill]
    # boundaries inside the span, relative to it; 0 and n_fill are always boundaries
    lo = bisect.bisect_right(boundaries, start)
    hi = bisect.bisect_left(boundaries, start + n_fill)
    inner = [0] + [b - start for b in boundaries[lo:hi]] + [n_fill]
    target = depth * n_fill
    p = min(inner, key=lambda b: (abs(b - target), b))
    ids = head + span[:p] + needle_ids + span[p:] + question_ids
    assert len(ids) == length
    return Prompt(ids, needle, len(head) + p, n_fill, p / n_fill)


@dataclass
class NeedleResult:
    method: str
    bits: float
    template: str
    lengths: list[int]
    depths: list[float]  # percent
    trials: int
    grid: list[list[float]]  # [length][depth] accuracy in [0, 1]
    residual: int
    note: str
    samples: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        cells = [c for row in self.grid for c in row]
        return sum(cells) / len(cells)

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "bits": self.bits,
            "template": self.template,
            "accuracy": self.accuracy,
            "grid": self.grid,
            "lengths": self.lengths,
            "depths": self.depths,
            "trials": self.trials,
            "residual": self.residual,
            "note": self.note,
            "samples": self.samples,
            "seconds": round(self.seconds, 2),
        }


def cell_prompts(
    tokenizer,
    filler_ids: list[int],
    boundaries: list[int],
    length: int,
    depth: float,
    trials: int,
    seed: int,
    template: str,
) -> list[Prompt]:
    """The ``trials`` prompts of one (length, depth) cell (``depth`` in percent), seeded by (seed, length,
    depth, template): the same prompts for every method and every script that asks for them."""
    rng = random.Random(f"{seed}-{length}-{depth:g}-{template}")
    bos = getattr(tokenizer, "bos_token_id", None)
    return [
        build_prompt(tokenizer, filler_ids, boundaries, length, depth / 100.0, make_needle(template, rng), rng, bos)
        for _ in range(trials)
    ]


def run_needle(
    model,
    tokenizer,
    haystack_text: str,
    gm,
    *,
    lengths: list[int],
    depths: list[float],
    trials: int = 2,
    template: str = "passkey",
    max_new_tokens: int = 8,
    batch_size: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> NeedleResult:
    """Accuracy grid ``[len(lengths)][len(depths)]`` of method ``gm``
    (:class:`~.generation.GenerationMethod`); ``depths`` in percent."""
    from .generation import greedy_generate, max_positions

    if template not in TEMPLATES:
        raise ValueError(f"unknown needle template {template!r}; choose one of: {', '.join(TEMPLATES)}")
    if trials < 1:
        raise ValueError(f"--trials must be at least 1, got {trials}")
    for d in depths:
        if not 0 <= d <= 100:
            raise ValueError(f"depths are percentages in [0, 100], got {d:g}")
    limit = max_positions(model)
    for n in lengths:
        if n < 1:
            raise ValueError(f"lengths must be positive, got {n}")
        if limit is not None and n + max_new_tokens > limit:
            warnings.warn(
                f"length {n} (+{max_new_tokens} new tokens) exceeds the model's "
                f"max_position_embeddings={limit}: results are out of range",
                stacklevel=2,
            )
    t0 = time.perf_counter()
    filler_ids = tokenizer(haystack_text, add_special_tokens=False)["input_ids"]
    boundaries = sentence_boundaries(tokenizer, filler_ids)
    grid = [[0.0] * len(depths) for _ in lengths]
    samples = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(lengths) * len(depths) * trials, desc=f"needle {gm.label}", unit="trial")
    try:
        for li, n in enumerate(lengths):
            for di, d in enumerate(depths):
                prompts = cell_prompts(tokenizer, filler_ids, boundaries, n, d, trials, seed, template)
                correct = 0
                for b in range(0, trials, max(1, batch_size)):
                    chunk = prompts[b : b + batch_size]
                    outs = greedy_generate(model, [p.ids for p in chunk], gm, max_new_tokens=max_new_tokens)
                    for p, o in zip(chunk, outs):
                        text = tokenizer.decode(o, skip_special_tokens=True)
                        ok = is_correct(text, p.needle.key)
                        correct += ok
                        if len(samples) < 50:
                            samples.append(
                                {
                                    "length": n,
                                    "depth": d,
                                    "depth_actual": round(100 * p.depth_actual, 2),
                                    "key": p.needle.key,
                                    "output": text,
                                    "correct": ok,
                                }
                            )
                    if bar is not None:
                        bar.update(len(chunk))
                grid[li][di] = correct / trials
    finally:
        if bar is not None:
            bar.close()
    return NeedleResult(
        gm.method,
        gm.bits,
        template,
        list(lengths),
        list(depths),
        trials,
        grid,
        gm.residual,
        gm.note(),
        samples,
        time.perf_counter() - t0,
    )


def format_grid(result: NeedleResult) -> str:
    """Markdown table: one row per length, one column per depth, plus the row mean."""
    head = "| length \\ depth | " + " | ".join(f"{d:g}%" for d in result.depths) + " | mean |"
    sep = "|---:|" + "---:|" * (len(result.depths) + 1)
    lines = [head, sep]
    for n, row in zip(result.lengths, result.grid):
        lines.append(f"| {n} | " + " | ".join(f"{c:.2f}" for c in row) + f" | {sum(row) / len(row):.2f} |")
    return "\n".join(lines)


def grid_figure(result: NeedleResult, title: str | None = None):
    """The figure of :func:`plot_grid` (not saved; the caller owns it)."""
    from matplotlib.colors import Normalize

    from .plots import _pyplot, wrap

    plt = _pyplot()
    nd, nl = len(result.depths), len(result.lengths)
    # at least ~5.6 x 3 inches: a 1x1 grid still has room for its title, axis labels and colorbar
    width, height = max(5.6, 2.4 + 0.9 * nd), max(3.0, 1.9 + 0.6 * nl)
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    cmap, norm = plt.get_cmap("RdYlGn"), Normalize(0, 1)
    im = ax.imshow(result.grid, norm=norm, cmap=cmap, aspect="auto")
    ax.set_xticks(range(nd), [f"{d:g}%" for d in result.depths])
    ax.set_yticks(range(nl), [str(n) for n in result.lengths])
    ax.set_xlabel("needle depth (% of the filler before it)")
    ax.set_ylabel("context length (tokens)")
    for i, row in enumerate(result.grid):
        for j, c in enumerate(row):
            r, g, b, _ = cmap(norm(c))  # white on the dark ends of the map, black on the light middle
            ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
            ax.text(j, i, f"{c:.2f}", ha="center", va="center", fontsize=9, color=ink)
    bits = "" if result.method == "fp16" else f" {result.bits:g}-bit"
    title = title or (
        f"needle ({result.template}): {result.method}{bits}\n"
        f"mean accuracy {result.accuracy:.2f}, {result.trials} trials/cell"
    )
    ax.set_title(wrap(title, width - 1.2, 10), fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.05, pad=0.03, label="share of trials with the key")
    return fig


def plot_grid(result: NeedleResult, path: str | Path, title: str | None = None) -> Path:
    """Heatmap PNG of the accuracy grid (lengths x depths), each cell labelled."""
    from .plots import save_figure

    return save_figure(grid_figure(result, title), path, dpi=120)
