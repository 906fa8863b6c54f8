"""``vecinfer gsm8k``: few-shot GSM8K exact match through each method's KV cache."""

from __future__ import annotations

import time

from ..methods import METHODS, normalize_bits
from . import (
    add_cache_backend_arg,
    add_calib_args,
    add_codebook_source_args,
    add_model_args,
    add_progress_arg,
    save_and_print_json,
)
from .arguments import (
    bits_arg,
    check_codebooks_layers,
    check_positions,
    check_vq_sources,
    count,
    method_with_codebooks,
    new_file,
    text_file,
)

HELP = "few-shot GSM8K exact match (greedy generate through each method's KV cache)"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gsm8k",
        help=HELP,
        description=HELP + ". The first --shots problems of the file are the examples (not scored); "
        "the final number (after '####', else the last number) is compared with the reference.",
    )
    add_model_args(p)
    p.add_argument(
        "--data", required=True, metavar="FILE", type=text_file("GSM8K file"), help="GSM8K JSONL (question, answer)"
    )
    p.add_argument(
        "--methods",
        default=None,
        metavar="M,...",
        help=f"comma-separated, of: {', '.join(METHODS)} (default fp16,vecinfer,kivi; with --codebooks "
        "the file's method in place of vecinfer)",
    )
    p.add_argument("--bits", type=bits_arg, default=2.0, help="bits of the quantized methods (default 2)")
    add_codebook_source_args(
        p,
        "codebooks from `vecinfer calibrate` (one VQ method)",
        "calibrate the VQ methods now on this text",
        "save (and reuse when present) calibrated codebooks in DIR",
    )
    p.add_argument("--limit", type=count(1), default=20, metavar="N", help="problems scored (default 20)")
    p.add_argument("--shots", type=count(0), default=4, metavar="K", help="few-shot examples (default 4)")
    add_cache_backend_arg(p)
    p.add_argument(
        "--residual",
        type=count(0),
        default=128,
        metavar="R",
        help="most recent R tokens stay full precision (default 128)",
    )
    p.add_argument("--max-new-tokens", type=count(1), default=256, metavar="N", help="default 256")
    p.add_argument("--batch-size", type=count(1), default=1, metavar="B", help="problems per generate() (default 1)")
    add_calib_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--out", metavar="FILE", default=None, type=new_file, help="also write the JSON result here (a new file)"
    )
    add_progress_arg(p)
    p.set_defaults(func=run)


def methods_of(args) -> list[str]:
    """--methods, checked; by default fp16, the codebooks' method (else vecinfer) and kivi."""
    if args.methods is None:
        return ["fp16", method_with_codebooks(None, args.codebooks, "vecinfer"), "kivi"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from: {', '.join(METHODS)}")
        if args.codebooks is not None and m not in ("fp16", "kivi"):
            method_with_codebooks(m, args.codebooks)
    return methods


def run(args) -> int:
    methods = methods_of(args)
    for m in methods:
        normalize_bits(m, args.bits)
    check_vq_sources(methods, args.codebooks, args.calib_text, args.save_codebooks)
    check_positions(args.model, args.max_new_tokens, "--max-new-tokens")  # from config.json, before the model loads
    check_codebooks_layers(args.codebooks, args.model)
    from ..evaluation.generation import prepare_method
    from ..evaluation.gsm8k import build_prompts, load_gsm8k, run_gsm8k
    from ..models import load_model

    rows = load_gsm8k(args.data)
    prompts, refs, _ = build_prompts(rows, args.shots, args.limit)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    check_positions(model, args.max_new_tokens, "--max-new-tokens")
    results = []
    for m in methods:
        gm = prepare_method(
            model,
            tokenizer,
            m,
            args.bits,
            codebooks_path=args.codebooks if m not in ("fp16", "kivi") else None,
            calib_text_path=args.calib_text,
            cache_dir=args.save_codebooks,
            residual=args.residual,
            max_tokens=args.max_tokens,
            seq_len=args.seq_len,
            iters=args.iters,
            seed=args.seed,
            progress=args.progress,
            backend=args.backend,
        )
        results.append(
            run_gsm8k(
                model,
                tokenizer,
                prompts,
                refs,
                gm,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                progress=args.progress,
            )
        )
    out = {
        "model": str(args.model),
        "data": str(args.data),
        "shots": args.shots,
        "limit": len(prompts),
        "bits": args.bits,
        "residual": args.residual,
        "backend": args.backend,
        "max_new_tokens": args.max_new_tokens,
        "accuracy": {r.method: r.accuracy for r in results},
        "methods": [r.as_dict() for r in results],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if not save_and_print_json(args, out):
        print(
            f"{args.model} on {args.data}: {args.shots}-shot, {len(prompts)} problems scored, greedy, "
            f"up to {args.max_new_tokens} new tokens"
        )
        for r in results:
            print(f"  {r.note}")
        print("\n| method | bits | correct | accuracy |\n|---|---:|---:|---:|")
        for r in results:
            method, bits = (f"full precision ({args.dtype})", "-") if r.method == "fp16" else (r.method, f"{r.bits:g}")
            print(f"| {method} | {bits} | {r.correct}/{r.total} | {r.accuracy:.3f} |")
        print(f"\n({out['seconds']:.0f} s)")
    return 0
