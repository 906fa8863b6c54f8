"""``vecinfer demo``: full precision vs VecInfer 4 / 2 / 1.5 bits vs KIVI-2 on the embedded tiny model,
offline, in about a minute on a laptop CPU."""

from __future__ import annotations

import time

from . import add_progress_arg, add_window_args, print_json
from .arguments import check_positions, count, device_arg, model_dir, output_dir, text_file

HELP = "full precision vs VecInfer vs KIVI perplexity on the embedded tiny model (offline, ~1 min)"


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help=HELP, description=HELP + ".")
    p.add_argument(
        "--model", metavar="DIR", default=None, type=model_dir, help="model directory (default: embedded tiny model)"
    )
    p.add_argument(
        "--text",
        metavar="FILE",
        default=None,
        type=text_file("text file"),
        help="text (default: embedded public-domain sample); its second half calibrates, its first half is scored",
    )
    add_window_args(p, 8, 256)
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="calibrate now instead of using the codebooks shipped for the embedded model "
        "(k-means on the CPU: several minutes)",
    )
    p.add_argument(
        "--calib-tokens",
        type=count(1),
        default=8192,
        metavar="N",
        help="calibration tokens when calibrating (default 8192)",
    )
    p.add_argument(
        "--iters", type=count(1), default=10, metavar="N", help="k-means iterations when calibrating (default 10)"
    )
    p.add_argument(
        "--save-codebooks",
        metavar="DIR",
        default=None,
        type=output_dir,
        help="save the codebooks calibrated here (implies --recalibrate)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="auto", type=device_arg)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    check_positions(args.model, args.window_len, "--window-len")  # a given model: from config.json, before it loads
    from ..evaluation.ablation import DEMO_ROWS, format_table, run_rows
    from ..evaluation.perplexity import make_windows
    from ..models import (
        check_file,
        check_model_dir,
        default_codebooks_dir,
        default_model_dir,
        default_text_path,
        load_model,
        load_text,
        load_tokenizer,
        split_text,
        tokenize,
    )

    model_path = check_model_dir(args.model or default_model_dir())
    text_path = check_file(args.text or default_text_path())
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(model_path)
    eval_text, calib_text = split_text(load_text(text_path))
    ids = tokenize(tokenizer, eval_text)
    make_windows(ids, args.windows, args.window_len)  # too-short text: fail before the model loads
    model, tokenizer = load_model(model_path, args.dtype, args.device, tokenizer=tokenizer)
    check_positions(model, args.window_len, "--window-len")
    # The shipped codebooks were made by `vecinfer demo --save-codebooks DIR` with the default
    # settings: they are valid only for the embedded model and text.
    shipped = args.model is None and args.text is None and not (args.recalibrate or args.save_codebooks)
    search = (default_codebooks_dir(),) if shipped else ()
    rows = run_rows(
        model,
        tokenizer,
        ids,
        DEMO_ROWS,
        calib_text=calib_text,
        windows=args.windows,
        window_len=args.window_len,
        cache_dir=args.save_codebooks,
        search_dirs=search,
        max_tokens=args.calib_tokens,
        seq_len=min(1024, args.calib_tokens),
        iters=args.iters,
        progress=args.progress,
    )
    seconds = time.perf_counter() - t0
    embedded_text = args.text is None
    note = (
        f"Model: {'embedded tiny model' if args.model is None else model_path}. "
        f"Text: {'embedded public-domain sample (Project Gutenberg; part of the model training corpus, NOT held out)' if embedded_text else text_path}.\n"
        f"Codebooks were calibrated on the second half of the text ({args.calib_tokens} tokens at most"
        f"{'; shipped with the package, made by `vecinfer demo --save-codebooks DIR`' if shipped else ''}); "
        f"perplexity is measured on {args.windows} windows x {args.window_len} tokens of the first half, "
        f"so calibration and evaluation text do not overlap. No residual window (every token quantized).\n"
        f"KV bytes/token: all layers, keys and values, codes + scales; fixed bytes (float32 codebooks and "
        f"key-transform state) are paid once per model, whatever the length."
    )
    if args.json:
        print_json(
            {
                "model": str(model_path),
                "text": str(text_path),
                "embedded_text_in_training": embedded_text,
                "windows": args.windows,
                "window_len": args.window_len,
                "calib_tokens": args.calib_tokens,
                "calibration": "second half of the text; evaluation: first half",
                "shipped_codebooks": shipped,
                "rows": [r.as_dict() for r in rows],
                "seconds": round(seconds, 2),
            }
        )
    else:
        print(note)
        print()
        print(format_table(rows))
        print(f"\n({seconds:.0f} s)")
    return 0
