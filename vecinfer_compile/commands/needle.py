"""``vecinfer needle``: offline needle-in-a-haystack accuracy grid through a method's KV cache."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from . import add_calib_args, add_model_args, add_progress_arg, bits_arg, print_json

HELP = "needle-in-a-haystack accuracy (lengths x depths) through a method's KV cache"


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise ValueError(f"expected at least one value, got {text!r}")
    return out


def float_list(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not out:
        raise ValueError(f"expected at least one value, got {text!r}")
    return out


def register(subparsers) -> None:
    from ..evaluation.needle import TEMPLATES
    from ..methods import METHODS

    p = subparsers.add_parser(
        "needle", help=HELP,
        description=HELP + ". Filler is read at run time from the haystack directory (sorted *.txt); "
        "a needle with a seeded random key is inserted at each depth (snapped to a sentence "
        "boundary), the question appended, and greedy generate() scored by exact match of the key.",
    )
    add_model_args(p)
    p.add_argument("--haystack", required=True, metavar="DIR", help="folder of .txt filler files")
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens (default 512,1024,2048)")
    p.add_argument("--depths", default="0,25,50,75,100", help="needle depths in percent (default 0,25,50,75,100)")
    p.add_argument("--method", choices=METHODS, default="fp16")
    p.add_argument("--bits", type=bits_arg, default=None,
                   help="bits: VQ presets 4, 3, 2, 1.5, 1.25, 1; KIVI 2 or 4 (default: codebooks' bits, else 2)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--codebooks", metavar="FILE", help="codebooks from `vecinfer calibrate`")
    src.add_argument("--calib-text", metavar="FILE", help="calibrate now on this text")
    p.add_argument("--save-codebooks", metavar="DIR", default=None,
                   help="with --calib-text: save (and reuse when present) codebooks in DIR")
    p.add_argument("--backend", choices=["eager", "compile"], default="eager",
                   help="the cache's decode step: eager (default), or compiled with vecinfer_backend "
                        "(the fused kernel over codes)")
    p.add_argument("--residual", type=int, default=128, metavar="R",
                   help="most recent R tokens stay full precision (default 128, as VecInferCache)")
    p.add_argument("--trials", type=int, default=2, metavar="N", help="prompts per cell (default 2)")
    p.add_argument("--template", choices=TEMPLATES, default="passkey",
                   help="needle template the evaluation models were trained on (default passkey)")
    p.add_argument("--max-new-tokens", type=int, default=8, metavar="N", help="tokens generated (default 8)")
    p.add_argument("--batch-size", type=int, default=4, metavar="B",
                   help="trials per generate() call, left-padded (default 4)")
    add_calib_args(p)  # its --seed also seeds the filler offsets and keys
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", default=None, help="write an accuracy heatmap")
    p.add_argument("--out", metavar="FILE", default=None, help="also write the JSON result here")
    add_progress_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..evaluation.ablation import normalize_bits
    from ..evaluation.generation import check_vq_sources, prepare_method
    from ..evaluation.needle import format_grid, load_haystack, plot_grid, run_needle
    from ..methods import VQ_METHODS
    from ..models import check_model_dir, load_model

    lengths = int_list(args.lengths)
    depths = float_list(args.depths)
    for d in depths:
        if not 0 <= d <= 100:
            raise ValueError(f"--depths are percentages in [0, 100], got {d:g}")
    for n in lengths:
        if n < 32:
            raise ValueError(f"--lengths must be at least 32 tokens (needle + question), got {n}")
    if args.trials < 1 or args.max_new_tokens < 1 or args.batch_size < 1:
        raise ValueError("--trials, --max-new-tokens and --batch-size must be at least 1")
    bits = args.bits
    if bits is None and args.codebooks is not None and args.method in VQ_METHODS:
        from ..codebooks import load_codebooks
        from ..models import check_file

        bits = load_codebooks(check_file(args.codebooks, "codebook file")).bits
    bits = normalize_bits(args.method, bits)
    if args.method not in VQ_METHODS and (args.codebooks or args.calib_text):
        raise ValueError(f"method {args.method!r} takes no codebooks; drop --codebooks/--calib-text")
    check_vq_sources([args.method], args.codebooks, args.calib_text, args.save_codebooks)
    check_model_dir(args.model)
    haystack = load_haystack(args.haystack)
    if args.plot:
        from ..evaluation.plots import _pyplot

        _pyplot()
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(lengths) + args.max_new_tokens > limit:
        print(f"vecinfer: warning: length {max(lengths)} + {args.max_new_tokens} new tokens exceeds "
              f"max_position_embeddings={limit} of {args.model}: results beyond it are out of range",
              file=__import__("sys").stderr)
    gm = prepare_method(
        model, tokenizer, args.method, bits, codebooks_path=args.codebooks,
        calib_text_path=args.calib_text, cache_dir=args.save_codebooks, residual=args.residual,
        max_tokens=args.max_tokens, seq_len=args.seq_len, iters=args.iters, seed=args.seed,
        progress=args.progress, backend=args.backend,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the length warning is printed once above
        result = run_needle(
            model, tokenizer, haystack, gm, lengths=lengths, depths=depths, trials=args.trials,
            template=args.template, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
            seed=args.seed, progress=args.progress,
        )
    out = result.as_dict()
    out["backend"] = args.backend
    out["layer_bits"] = None if gm.codebooks is None else gm.codebooks.bits_per_layer()
    out.update({"model": str(args.model), "haystack": str(args.haystack),
                "seconds": round(time.perf_counter() - t0, 2)})
    if args.plot:
        title = None
        if gm.layer_bits_text is not None:
            title = (f"needle ({result.template}): {result.method} {result.bits:g}-bit average "
                     f"({gm.layer_bits_text} per layer)\nmean accuracy {result.accuracy:.2f}, {result.trials} trials/cell")
        plot_grid(result, args.plot, title)
        out["plot"] = str(args.plot)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print_json(out)
    else:
        print(f"{args.model}: needle ({args.template}), {args.trials} trials/cell, "
              f"{args.max_new_tokens} new tokens, greedy")
        print(result.note)
        print()
        print(format_grid(result))
        print(f"\nmean accuracy {result.accuracy:.3f}")
        if args.plot:
            print(f"plot: {args.plot}")
        print(f"({out['seconds']:.0f} s)")
    return 0
