"""GSM8K few-shot exact match through each method's KV cache.

Protocol: the first ``shots`` problems of the file are the few-shot examples (never scored);
the next ``limit`` problems are scored. Prompt::

    Question: {q}\\nAnswer: {full worked answer ending in "#### N"}\\n\\n   (x shots)
    Question: {q}\\nAnswer:

Greedy generation (stops at EOS, or when the model starts a new ``Question:``); the prediction is
the number after the first ``####`` in the output, or, if there is none, the last number in it.
It is correct when it equals the reference number (commas and a trailing ``.0`` ignored).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str | None) -> str | None:
    """``"1,234.50"`` -> ``"1234.5"``; ``"$18"`` -> ``"18"``; ``"7.0"`` -> ``"7"``; None if no number."""
    if text is None:
        return None
    m = _NUMBER.search(text)
    if m is None:
        return None
    s = m.group(0).replace(",", "").replace("$", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s in ("-0", ""):
        s = "0"
    return s


def reference_answer(answer: str) -> str:
    """The number after ``####`` of a GSM8K reference answer; a clear error if there is none."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '#### N' line: {answer[-80:]!r}")
    value = normalize_number(answer.rsplit("####", 1)[1])
    if value is None:
        raise ValueError(f"GSM8K answer has no number after '####': {answer[-80:]!r}")
    return value


def extract_prediction(generated: str) -> str | None:
    """The model's final number: after the first ``####`` if present, else the last number of
    the text before any new ``Question:``."""
    text = generated.split("Question:", 1)[0]
    if "####" in text:
        return normalize_number(text.split("####", 1)[1])
    nums = _NUMBER.findall(text)
    return normalize_number(nums[-1]) if nums else None


def load_gsm8k(path: str | Path) -> list[dict]:
    """Records ``{"question", "answer"}`` of a JSONL file; clear errors for missing/bad files."""
    from ..models import check_file

    path = check_file(path, "GSM8K file")
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or "question" not in obj or "answer" not in obj:
            raise ValueError(f"{path}:{i}: expected an object with 'question' and 'answer'")
        rows.append(obj)
    if not rows:
        raise ValueError(f"GSM8K file {path} is empty")
    return rows


def format_example(q: str, a: str | None = None) -> str:
    a = "" if a is None else " " + a.strip() + "\n\n"
    return f"Question: {q.strip()}\nAnswer:{a}"


def build_prompts(rows: list[dict], shots: int, limit: int | None) -> tuple[list[str], list[str], list[dict]]:
    """``(prompts, references, scored_rows)``: the first ``shots`` rows are examples."""
    if shots < 0:
        raise ValueError(f"--shots must be >= 0, got {shots}")
    if shots >= len(rows):
        raise ValueError(f"the file has {len(rows)} problems: --shots {shots} leaves none to score")
    prefix = "".join(format_example(r["question"], r["answer"]) for r in rows[:shots])
    scored = rows[shots:] if limit is None else rows[shots : shots + limit]
    prompts = [prefix + format_example(r["question"]) for r in scored]
    return prompts, [reference_answer(r["answer"]) for r in scored], scored


@dataclass
class Gsm8kResult:
    method: str
    bits: float
    correct: int
    total: int
    note: str
    samples: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "bits": self.bits,
            "accuracy": self.accuracy,
            "correct": self.correct,
            "total": self.total,
            "note": self.note,
            "samples": self.samples,
            "seconds": round(self.seconds, 2),
        }


def run_gsm8k(
    model,
    tokenizer,
    prompts: list[str],
    refs: list[str],
    gm,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 1,
    progress: bool = True,
    max_samples: int = 20,
) -> Gsm8kResult:
    """Greedy few-shot GSM8K of method ``gm`` (:class:`~.generation.GenerationMethod`)."""
    from .generation import greedy_generate

    t0 = time.perf_counter()
    bos = getattr(tokenizer, "bos_token_id", None)
    encoded = [([] if bos is None else [bos]) + tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    correct, samples = 0, []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc=f"gsm8k {gm.label}", unit="problem")
    try:
        for b in range(0, len(encoded), max(1, batch_size)):
            outs = greedy_generate(model, encoded[b : b + batch_size], gm, max_new_tokens=max_new_tokens)
            for ref, o in zip(refs[b : b + batch_size], outs):
                text = tokenizer.decode(o, skip_special_tokens=True)
                pred = extract_prediction(text)
                ok = pred is not None and pred == ref
                correct += ok
                if len(samples) < max_samples:
                    samples.append(
                        {
                            "reference": ref,
                            "prediction": pred,
                            "correct": ok,
                            "output": text.split("Question:", 1)[0].strip()[:400],
                        }
                    )
            if bar is not None:
                bar.update(len(outs))
    finally:
        if bar is not None:
            bar.close()
    return Gsm8kResult(gm.method, gm.bits, correct, len(prompts), gm.note(), samples, time.perf_counter() - t0)
