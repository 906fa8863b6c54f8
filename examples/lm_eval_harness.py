"""VecInfer inside lm-evaluation-harness: the same task, full precision vs compressed K/V.

lm-eval's ``HFLM`` takes a model object, so a compiled model (``torch.compile`` with
``vecinfer_backend``) or a model with simulation on is evaluated like any other. This script
builds a local rolling-perplexity task from a text file (no hub download), then scores it three
ways: full precision, the eager simulate path, and the compiled model.

    pip install -e ".[lm-eval]"
    python examples/lm_eval_harness.py [--model DIR] [--codebooks FILE] [--text FILE] [--docs N]

Defaults: the tiny model, its shipped 2-bit codebooks and the public-domain sample text that ship
in the package (that text is in the tiny model's training data: not a held-out score).

Compile with ``dynamic=True`` (as below): every document has another length, and a compile that
starts static recompiles on the second length.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import vecinfer_compile as vc

DATA = files("vecinfer_compile") / "data"


def rolling_ppl_task(docs_path: Path, name: str = "vecinfer_local_rolling_ppl") -> dict:
    """An lm-eval task config: rolling log-likelihood over the ``text`` field of a JSONL file."""
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(docs_path)}},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}],
    }


def write_docs(text: str, n: int, chars: int, path: Path) -> Path:
    """``n`` documents of about ``chars`` characters cut from ``text`` at paragraph breaks: blank
    lines (WikiText's are "\n \n"), or line ends in a text without blank lines."""
    paragraphs = [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    if len(paragraphs) < n:
        paragraphs = [line.strip() for line in text.splitlines() if line.strip()]
    docs, current = [], ""
    for p in paragraphs:
        current = f"{current}\n\n{p}" if current else p
        if len(current) >= chars:
            docs.append(current)
            current = ""
        if len(docs) == n:
            break
    if len(docs) < n:
        raise ValueError(f"the text gives only {len(docs)} documents of {chars} characters, not {n}")
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def word_perplexity(model, tokenizer, task: dict) -> tuple[float, float]:
    """(word perplexity, seconds) of ``model`` on ``task`` through lm-eval's HFLM."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device=str(next(model.parameters()).device))
    t0 = time.perf_counter()
    out = simple_evaluate(lm, tasks=[task], verbosity="ERROR")
    seconds = time.perf_counter() - t0
    return out["results"][task["task"]]["word_perplexity,none"], seconds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DATA / "tiny"))
    ap.add_argument(
        "--codebooks",
        default=None,
        help="codebooks of --model from `vecinfer calibrate` (default: the shipped tiny model's, "
        "for the shipped tiny model only)",
    )
    ap.add_argument("--text", default=str(DATA / "sample_public_domain.txt"))
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--doc-chars", type=int, default=3000)
    args = ap.parse_args(argv)
    if args.codebooks is None:
        if args.model != str(DATA / "tiny"):
            ap.error(
                f"--codebooks FILE is needed for {args.model} (the shipped codebooks are the tiny "
                f"model's): make it with `vecinfer calibrate --model {args.model} --text CALIB.txt --out cb.safetensors`"
            )
        args.codebooks = str(DATA / "tiny_codebooks" / "vecinfer-2bit.safetensors")
    docs_text = Path(args.text).read_text(encoding="utf-8")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    codebooks = vc.load_codebooks(args.codebooks)
    codebooks.check_weights(model)  # one warning if they were calibrated for another model
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            docs = write_docs(docs_text, args.docs, args.doc_chars, Path(tmp) / "docs.jsonl")
        except ValueError as exc:
            ap.error(str(exc))
        task = rolling_ppl_task(docs)
        results["full precision"] = word_perplexity(model, tokenizer, task)
        with vc.simulation(model, codebooks.method, bits=codebooks.bits, codebooks=codebooks):
            results["VecInfer, eager simulate"] = word_perplexity(model, tokenizer, task)
        compiled = torch.compile(model, backend=vc.vecinfer_backend.configure(codebooks=codebooks), dynamic=True)
        results["VecInfer, torch.compile"] = word_perplexity(compiled, tokenizer, task)
    print(f"| {args.docs} documents of ~{args.doc_chars} characters | word perplexity | seconds |")
    print("|---|---:|---:|")
    for name, (ppl, seconds) in results.items():
        print(f"| {name} | {ppl:.3f} | {seconds:.1f} |")
    return results


if __name__ == "__main__":
    main()
