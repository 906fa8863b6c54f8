"""Choose the query-aware transform's ridge, centring and Hadamard variant on calibration text only.

The calibration text is split: its first ``--fit-tokens`` tokens fit the transform and codebooks
(what ``vecinfer calibrate`` uses by default), the next ``--windows x --window-len`` tokens are
scored (every token quantized, eager simulation). Evaluation text is never read. Each row
calibrates anew (the refined qaware methods take minutes per row on a CPU): the row being fitted
and the progress bars go to stderr, each result to stdout as one JSON line.

    python examples/choose_qaware_ridge.py --model evalmodel --text calibration.txt --bits 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import vecinfer_compile as vc
from vecinfer_compile.evaluation.perplexity import perplexity
from vecinfer_compile.models import load_model, load_text, tokenize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True, help="calibration text (never evaluation text)")
    p.add_argument("--bits", type=float, default=2)
    p.add_argument("--ridges", default="0.01,0.1,1")
    p.add_argument(
        "--methods",
        default="qaware,qaware-nocenter",
        help="comma-separated query-aware methods, each run at every ridge",
    )
    p.add_argument(
        "--baselines",
        default="vecinfer,hadamard",
        help="rows to compare against, no ridge (e.g. vecinfer-center); empty for none",
    )
    p.add_argument("--fit-tokens", type=int, default=32768)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=1024)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    args = p.parse_args()

    model, tok = load_model(args.model, "float32", "cpu")
    text = load_text(args.text)
    ids = tokenize(tok, text)
    held_out = ids[args.fit_tokens : args.fit_tokens + args.windows * args.window_len]
    if held_out.numel() < args.windows * args.window_len:
        raise SystemExit(f"{args.text} is too short to hold out {args.windows} x {args.window_len} tokens")
    # calibrate() tokenizes texts without special tokens and keeps the first fit_tokens: the
    # held-out tokens come after them in the same tokenization.
    with torch.no_grad():
        base = perplexity(model, held_out, windows=args.windows, window_len=args.window_len, progress=False).ppl
    print(json.dumps({"method": "fp16", "ppl": base}), flush=True)
    rows = [(m, None) for m in args.baselines.split(",") if m]
    rows += [(m, float(r)) for m in args.methods.split(",") if m for r in args.ridges.split(",")]
    t0 = time.perf_counter()
    for i, (method, ridge) in enumerate(rows, 1):
        print(
            f"[{time.perf_counter() - t0:.0f} s] row {i} of {len(rows)}: {method}"
            f"{'' if ridge is None else f', ridge {ridge:g}'}",
            file=sys.stderr,
            flush=True,
        )
        extra = {} if ridge is None else {"ridge": ridge}
        cb = vc.calibrate(
            model, tok, text, bits=args.bits, method=method, max_tokens=args.fit_tokens, progress=args.progress, **extra
        )
        with vc.simulation(model, method, bits=args.bits, codebooks=cb), torch.no_grad():
            ppl = perplexity(
                model, held_out, windows=args.windows, window_len=args.window_len, progress=args.progress
            ).ppl
        print(json.dumps({"method": method, "ridge": ridge, "ppl": ppl, "ratio": ppl / base}), flush=True)


if __name__ == "__main__":
    main()
