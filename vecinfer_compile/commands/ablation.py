"""``vecinfer ablation``: the full table (full precision; VecInfer 4/3/2/1.5/1; KIVI 4/2; plain VQ,
smoothing only, Hadamard only at 2 and 1.5 bits) and an optional plot."""

from __future__ import annotations

import time
from pathlib import Path

from ..methods import normalize_bits
from . import add_calib_args, add_model_args, add_progress_arg, add_window_args, save_and_print_json
from .arguments import check_positions, check_quantizes, count, new_file, output_dir, text_file

HELP = "perplexity table of every method and bit-width (and a plot)"


def register(subparsers) -> None:
    p = subparsers.add_parser("ablation", help=HELP, description=HELP + ".")
    add_model_args(p)
    p.add_argument("--text", required=True, metavar="FILE", type=text_file("text file"), help="evaluation text")
    p.add_argument(
        "--calib-text", required=True, metavar="FILE", type=text_file("calibration text"), help="calibration text"
    )
    add_window_args(p, 16, 1024)
    p.add_argument("--residual", type=count(0), default=0, metavar="R", help="full-precision window (default 0)")
    p.add_argument("--backend", choices=["eager", "compile"], default="eager")
    p.add_argument(
        "--rows",
        default=None,
        metavar="M:B,...",
        help="only these rows, e.g. fp16:16,vecinfer:2,kivi:2 (default: the full ablation)",
    )
    add_calib_args(p)
    p.add_argument(
        "--out-codebooks",
        metavar="DIR",
        default=None,
        type=output_dir,
        help="cache codebooks here (reused when present)",
    )
    p.add_argument(
        "--plot", metavar="PNG", default=None, type=new_file, help="write perplexity vs bits plot (a new file)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--out", metavar="FILE", default=None, type=new_file, help="also write the JSON result here (a new file)"
    )
    add_progress_arg(p)
    p.set_defaults(func=run)


def parse_rows(spec: str) -> list[tuple[str, float]]:
    rows = []
    for item in spec.split(","):
        method, _, bits = item.strip().partition(":")
        try:
            rows.append((method, float(bits) if bits else None))
        except ValueError:
            raise ValueError(f"bad --rows item {item!r}: write METHOD:BITS, e.g. vecinfer:2") from None
    return rows


def check_args(args) -> list[tuple[str, float]] | None:
    """The checks that need no model; returns the rows of --rows (None: the full ablation)."""
    rows = None if args.rows is None else parse_rows(args.rows)
    for method, bits in rows or ():
        normalize_bits(method, bits)
    check_quantizes(args.residual, args.window_len - 1, f"a {args.window_len}-token window")
    return rows


def run(args) -> int:
    rows = check_args(args)
    check_positions(args.model, args.window_len, "--window-len")  # from config.json, before the model loads
    from ..evaluation.ablation import ABLATION_ROWS, format_table, run_rows
    from ..models import load_model, load_text, load_tokenizer, tokenize

    if args.plot:
        from ..evaluation.plots import _pyplot

        _pyplot()  # fail before the long run if matplotlib is missing
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    ids = tokenize(tokenizer, load_text(args.text))
    from ..evaluation.perplexity import make_windows

    make_windows(ids, args.windows, args.window_len)  # too-short text: fail before the model loads
    model, tokenizer = load_model(args.model, args.dtype, args.device, tokenizer=tokenizer)
    check_positions(model, args.window_len, "--window-len")
    results = run_rows(
        model,
        tokenizer,
        ids,
        rows or ABLATION_ROWS,
        calib_text=load_text(args.calib_text),
        windows=args.windows,
        window_len=args.window_len,
        cache_dir=args.out_codebooks,
        max_tokens=args.max_tokens,
        seq_len=args.seq_len,
        iters=args.iters,
        seed=args.seed,
        residual=args.residual,
        backend=args.backend,
        progress=args.progress,
    )
    seconds = time.perf_counter() - t0
    result = {
        "model": str(args.model),
        "text": str(args.text),
        "calib_text": str(args.calib_text),
        "windows": args.windows,
        "window_len": args.window_len,
        "residual": args.residual,
        "backend": args.backend,
        "max_tokens": args.max_tokens,
        "iters": args.iters,
        "rows": [r.as_dict() for r in results],
        "seconds": round(seconds, 2),
    }
    if args.plot:
        from ..evaluation.plots import plot_ppl_vs_bits

        plot_ppl_vs_bits(results, args.plot, title=f"{Path(args.model).name}: perplexity vs physical KV bits")
        result["plot"] = str(args.plot)
    if not save_and_print_json(args, result):
        print(
            f"{args.model} on {args.text}: {args.windows} windows x {args.window_len} tokens, "
            f"calibrated on {args.calib_text} (<= {args.max_tokens} tokens), residual {args.residual}, "
            f"backend {args.backend}\n"
        )
        print(format_table(results))
        if args.plot:
            print(f"\nplot: {args.plot}")
        print(f"\n({seconds:.0f} s)")
    return 0
