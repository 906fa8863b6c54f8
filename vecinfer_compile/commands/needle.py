"""``vecinfer needle``: offline needle-in-a-haystack accuracy grid through a method's KV cache."""

from __future__ import annotations

import time

from ..methods import METHODS
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
    bits_with_codebooks,
    check_codebooks_layers,
    check_positions,
    check_quantizes,
    check_vq_sources,
    count,
    input_dir,
    method_with_codebooks,
    new_file,
    number_list,
)

HELP = "needle-in-a-haystack accuracy (lengths x depths) through a method's KV cache"
# The templates of evaluation.needle, named here so that parsing the arguments loads no torch.
TEMPLATES = ("passkey", "magic", "word")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "needle",
        help=HELP,
        description=HELP + ". Filler is read at run time from the haystack directory (sorted *.txt); "
        "a needle with a seeded random key is inserted at each depth (snapped to a sentence "
        "boundary), the question appended, and greedy generate() scored by exact match of the key.",
    )
    add_model_args(p)
    p.add_argument(
        "--haystack",
        required=True,
        metavar="DIR",
        type=input_dir("haystack folder"),
        help="folder of .txt filler files",
    )
    p.add_argument(
        "--lengths",
        default=[512, 1024, 2048],
        type=number_list(int, "token counts", 32),
        metavar="N,...",
        help="prompt lengths in tokens (default 512,1024,2048)",
    )
    p.add_argument(
        "--depths",
        default=[0.0, 25.0, 50.0, 75.0, 100.0],
        metavar="P,...",
        type=number_list(float, "percentages", 0, 100),
        help="needle depths in percent (default 0,25,50,75,100)",
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        default=None,
        metavar="METHOD",
        help=f"one of {', '.join(METHODS)} (default: the method --codebooks was calibrated for, else fp16)",
    )
    p.add_argument(
        "--bits",
        type=bits_arg,
        default=None,
        help="bits: VQ presets 4, 3, 2, 1.5, 1.25, 1; KIVI 2 or 4 (default: codebooks' bits, else 2)",
    )
    add_codebook_source_args(
        p,
        "codebooks from `vecinfer calibrate`",
        "calibrate now on this text",
        "with --calib-text: save (and reuse when present) codebooks in DIR",
    )
    add_cache_backend_arg(p)
    p.add_argument(
        "--residual",
        type=count(0),
        default=128,
        metavar="R",
        help="most recent R tokens stay full precision (default 128, as VecInferCache)",
    )
    p.add_argument("--trials", type=count(1), default=2, metavar="N", help="prompts per cell (default 2)")
    p.add_argument(
        "--template",
        choices=TEMPLATES,
        default="passkey",
        help="needle template the evaluation models were trained on (default passkey)",
    )
    p.add_argument("--max-new-tokens", type=count(1), default=8, metavar="N", help="tokens generated (default 8)")
    p.add_argument(
        "--batch-size",
        type=count(1),
        default=4,
        metavar="B",
        help="trials per generate() call, left-padded (default 4)",
    )
    add_calib_args(p)  # its --seed also seeds the filler offsets and keys
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", default=None, type=new_file, help="write an accuracy heatmap (a new file)")
    p.add_argument(
        "--out", metavar="FILE", default=None, type=new_file, help="also write the JSON result here (a new file)"
    )
    add_progress_arg(p)
    p.set_defaults(func=run)


def check_args(args) -> tuple[str, float]:
    """The checks that need no model; returns ``(method, bits)``."""
    method = method_with_codebooks(args.method, args.codebooks, "fp16")
    bits = bits_with_codebooks(method, args.bits, args.codebooks)
    check_vq_sources([method], args.codebooks, args.calib_text, args.save_codebooks)
    if method != "fp16":  # the prompt attends in full precision; the decode steps read codes
        longest = max(args.lengths)
        check_quantizes(
            args.residual,
            longest + args.max_new_tokens - 2,
            f"a {longest}-token prompt and {args.max_new_tokens} new tokens",
        )
    return method, bits


def run(args) -> int:
    method, bits = check_args(args)
    # from config.json, before the model loads
    check_positions(args.model, max(args.lengths) + args.max_new_tokens, "--lengths plus --max-new-tokens")
    check_codebooks_layers(args.codebooks, args.model)
    from ..evaluation.generation import prepare_method
    from ..evaluation.needle import format_grid, load_haystack, plot_grid, run_needle
    from ..models import load_model

    haystack = load_haystack(args.haystack)
    if args.plot:
        from ..evaluation.plots import _pyplot

        _pyplot()
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    check_positions(model, max(args.lengths) + args.max_new_tokens, "--lengths plus --max-new-tokens")
    gm = prepare_method(
        model,
        tokenizer,
        method,
        bits,
        codebooks_path=args.codebooks,
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
    result = run_needle(
        model,
        tokenizer,
        haystack,
        gm,
        lengths=args.lengths,
        depths=args.depths,
        trials=args.trials,
        template=args.template,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=args.progress,
    )
    out = result.as_dict()
    out["backend"] = args.backend
    out["layer_bits"] = None if gm.codebooks is None else gm.codebooks.bits_per_layer()
    out.update(
        {"model": str(args.model), "haystack": str(args.haystack), "seconds": round(time.perf_counter() - t0, 2)}
    )
    if args.plot:
        title = None
        if gm.layer_bits_text is not None:
            title = (
                f"needle ({result.template}): {result.method} {result.bits:g}-bit average "
                f"({gm.layer_bits_text} per layer)\nmean accuracy {result.accuracy:.2f}, {result.trials} trials/cell"
            )
        plot_grid(result, args.plot, title)
        out["plot"] = str(args.plot)
    if not save_and_print_json(args, out):
        print(
            f"{args.model}: needle ({args.template}), {args.trials} trials/cell, "
            f"{args.max_new_tokens} new tokens, greedy"
        )
        print(result.note)
        print()
        print(format_grid(result))
        print(f"\nmean accuracy {result.accuracy:.3f}")
        if args.plot:
            print(f"plot: {args.plot}")
        print(f"({out['seconds']:.0f} s)")
    return 0
