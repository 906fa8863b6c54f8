"""``vecinfer eval-ppl``: perplexity of one method at one bit-width."""

from __future__ import annotations

import time

from ..methods import METHODS
from . import add_calib_args, add_codebook_source_args, add_model_args, add_progress_arg, add_window_args, print_json
from .arguments import (
    bits_arg,
    bits_with_codebooks,
    check_codebooks_layers,
    check_positions,
    check_quantizes,
    check_vq_sources,
    count,
    method_with_codebooks,
    text_file,
)

HELP = "perplexity of one method on a text"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval-ppl",
        help=HELP,
        description=HELP + ". Windows are scored independently; no BOS is added (see evaluation/perplexity.py).",
    )
    add_model_args(p)
    p.add_argument("--text", required=True, metavar="FILE", type=text_file("text file"), help="UTF-8 text to score")
    p.add_argument(
        "--method",
        choices=METHODS,
        default=None,
        metavar="METHOD",
        help=f"one of {', '.join(METHODS)} (default: the method --codebooks was calibrated for; "
        "fp16 is the model unquantized, in --dtype)",
    )
    p.add_argument(
        "--bits",
        type=bits_arg,
        default=None,
        help="bits per element: VQ presets 4, 3, 2, 1.5, 1.25, 1; KIVI 2 or 4 "
        "(default: the codebooks' bits, else 2; ignored for fp16)",
    )
    add_codebook_source_args(
        p,
        "codebooks from `vecinfer calibrate`",
        "calibrate now on this text",
        "with --calib-text: save the codebooks in DIR (and reuse them when present)",
    )
    p.add_argument(
        "--residual", type=count(0), default=0, metavar="R", help="most recent R tokens stay full precision (default 0)"
    )
    add_window_args(p, 16, 1024)
    p.add_argument(
        "--backend",
        choices=["eager", "compile"],
        default="eager",
        help="eager simulation, or torch.compile with the vecinfer backend",
    )
    p.add_argument("--batch-size", type=count(1), default=1, metavar="B", help="windows per forward pass (default 1)")
    add_calib_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_arg(p)
    p.set_defaults(func=run)


def check_args(args) -> tuple[str, float]:
    """The checks that need no model; returns ``(method, bits)``."""
    method = method_with_codebooks(args.method, args.codebooks)
    bits = bits_with_codebooks(method, args.bits, args.codebooks)
    if args.backend == "compile" and method == "kivi":
        raise ValueError("--backend compile runs fp16 and the VQ methods, not 'kivi': use --backend eager")
    check_vq_sources([method], args.codebooks, args.calib_text)
    if args.save_codebooks is not None and args.calib_text is None:
        raise ValueError("--save-codebooks saves what --calib-text calibrates: pass --calib-text FILE too")
    if method != "fp16":
        check_quantizes(args.residual, args.window_len - 1, f"a {args.window_len}-token window")
    return method, bits


def label(method: str, bits: float, dtype: str) -> str:
    """How a result line names the run: ``vecinfer 2 bits``, or ``full precision (float32)``."""
    return f"full precision ({dtype})" if method == "fp16" else f"{method} {bits:g} bits"


def run(args) -> int:
    method, bits = check_args(args)
    check_positions(args.model, args.window_len, "--window-len")  # from config.json, before the model loads
    check_codebooks_layers(args.codebooks, args.model)
    from ..evaluation.ablation import applied, get_codebooks
    from ..evaluation.kv_bytes import kv_bytes
    from ..evaluation.perplexity import make_windows, perplexity
    from ..models import load_model, load_text, load_tokenizer, tokenize

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model)  # the text's length checked before the model loads
    ids = tokenize(tokenizer, load_text(args.text))
    make_windows(ids, args.windows, args.window_len)
    model, tokenizer = load_model(args.model, args.dtype, args.device, tokenizer=tokenizer)
    check_positions(model, args.window_len, "--window-len")
    cb = get_codebooks(
        model,
        tokenizer,
        method,
        bits,
        codebooks_path=args.codebooks,
        calib_text=None if args.calib_text is None else load_text(args.calib_text),
        cache_dir=args.save_codebooks,
        max_tokens=args.max_tokens,
        seq_len=args.seq_len,
        iters=args.iters,
        seed=args.seed,
        progress=args.progress,
    )
    if cb is not None:
        cb.check_context(args.window_len)
    acc = kv_bytes(
        method,
        None if method == "fp16" else bits,
        model.config,
        residual=args.residual,
        layer_bits=None if cb is None else cb.layer_bits,
    )
    with applied(model, method, bits, codebooks=cb, residual=args.residual, backend=args.backend) as m:
        res = perplexity(
            m, ids, windows=args.windows, window_len=args.window_len, batch_size=args.batch_size, progress=args.progress
        )
    out = {
        "method": method,
        "bits": bits,
        "layer_bits": None if cb is None else cb.bits_per_layer(),
        "ppl": res.ppl,
        "nll": res.nll,
        "tokens": res.tokens,
        "windows": args.windows,
        "window_len": args.window_len,
        "kv_bytes_per_token": acc.bytes_per_token,
        "physical_bits_per_element": acc.physical_bits_per_element,
        "codebook_bytes": acc.fixed_bytes,
        "kv_bytes_per_token_at_window": acc.per_token_at(args.window_len),
        "backend": args.backend,
        "residual": args.residual,
        "dtype": args.dtype,
        "model": str(args.model),
        "text": str(args.text),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if args.json:
        print_json(out)
    else:
        print(
            f"{label(method, bits, args.dtype)}: ppl {res.ppl:.4f} over {res.tokens} tokens "
            f"({args.windows} x {args.window_len}); KV {acc.bytes_per_token:,.0f} bytes/token "
            f"(a 16-bit cache: {acc.fp16_bytes_per_token:,}), backend {args.backend}, residual {args.residual}"
        )
    return 0
