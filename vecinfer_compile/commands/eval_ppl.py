"""``vecinfer eval-ppl``: perplexity of one method at one bit-width."""

from __future__ import annotations

import time

from . import add_calib_args, add_model_args, add_progress_arg, add_window_args, bits_arg, print_json

HELP = "perplexity of one method (fp16, vecinfer, kivi, vq, smooth, hadamard, qaware) on a text"


def register(subparsers) -> None:
    from ..methods import METHODS

    p = subparsers.add_parser("eval-ppl", help=HELP, description=HELP + ". Windows are scored "
                              "independently; no BOS is added (see evaluation/perplexity.py).")
    add_model_args(p)
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--bits", type=bits_arg, default=None,
                   help="bits per element: VQ presets 4, 3, 2, 1.5, 1.25, 1; KIVI 2 or 4 "
                        "(default: the codebooks' bits, else 2; ignored for fp16)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--codebooks", metavar="FILE", help="codebooks from `vecinfer calibrate`")
    src.add_argument("--calib-text", metavar="FILE", help="calibrate now on this text")
    p.add_argument("--save-codebooks", metavar="DIR", default=None,
                   help="with --calib-text: save the codebooks in DIR (and reuse them when present)")
    p.add_argument("--residual", type=int, default=0, metavar="R",
                   help="most recent R tokens stay full precision (default 0)")
    add_window_args(p, 16, 1024)
    p.add_argument("--backend", choices=["eager", "compile"], default="eager",
                   help="eager simulation, or torch.compile with the vecinfer backend")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default 1)")
    add_calib_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..evaluation.ablation import applied, get_codebooks, normalize_bits
    from ..evaluation.kv_bytes import kv_bytes
    from ..evaluation.perplexity import perplexity
    from ..methods import VQ_METHODS
    from ..models import check_file, check_model_dir, load_model, load_text, tokenize

    # Cheap checks first, before loading anything.
    bits = args.bits
    if bits is None and args.codebooks is not None and args.method in VQ_METHODS:
        from ..codebooks import load_codebooks

        bits = load_codebooks(check_file(args.codebooks, "codebook file")).bits  # the file's bits
    bits = normalize_bits(args.method, bits)
    if args.backend == "compile" and args.method == "kivi":
        raise ValueError("--backend compile runs fp16 and the VQ methods, not 'kivi': use --backend eager")
    if args.residual < 0:
        raise ValueError(f"--residual must be >= 0, got {args.residual}")
    check_model_dir(args.model)
    check_file(args.text)
    if args.method in VQ_METHODS:
        if args.codebooks is None and args.calib_text is None:
            raise ValueError(
                f"method {args.method!r} needs codebooks: pass --codebooks FILE (from `vecinfer "
                f"calibrate`) or --calib-text FILE to calibrate now"
            )
        if args.codebooks is not None:
            check_file(args.codebooks, "codebook file")
        else:
            check_file(args.calib_text, "calibration text")
    elif args.codebooks is not None or args.calib_text is not None:
        raise ValueError(f"method {args.method!r} takes no codebooks; drop --codebooks/--calib-text")
    if args.save_codebooks is not None and args.calib_text is None:
        raise ValueError("--save-codebooks saves what --calib-text calibrates: pass --calib-text FILE too")

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    ids = tokenize(tokenizer, load_text(args.text))
    cb = get_codebooks(
        model, tokenizer, args.method, bits, codebooks_path=args.codebooks,
        calib_text=None if args.calib_text is None else load_text(args.calib_text),
        cache_dir=args.save_codebooks, max_tokens=args.max_tokens, seq_len=args.seq_len, iters=args.iters, seed=args.seed,
        progress=args.progress,
    )
    if cb is not None:
        cb.check_context(args.window_len)
    acc = kv_bytes(args.method, None if args.method == "fp16" else bits, model.config, residual=args.residual,
                   layer_bits=None if cb is None else cb.layer_bits)
    with applied(model, args.method, bits, codebooks=cb, residual=args.residual, backend=args.backend) as m:
        res = perplexity(m, ids, windows=args.windows, window_len=args.window_len,
                         batch_size=args.batch_size, progress=args.progress)
    out = {
        "method": args.method,
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
            f"{args.method} {bits:g} bits: ppl {res.ppl:.4f} over {res.tokens} tokens "
            f"({args.windows} x {args.window_len}); KV {acc.bytes_per_token:,.0f} bytes/token "
            f"(fp16 {acc.fp16_bytes_per_token:,}), backend {args.backend}, residual {args.residual}"
        )
    return 0
