"""``vecinfer calibrate``: fit smoothing factors and codebooks, write a safetensors file."""

from __future__ import annotations

import time

from . import add_calib_args, add_model_args, add_progress_arg, bits_arg

HELP = "fit VecInfer (or ablation) codebooks on a text and save them"


def register(subparsers) -> None:
    from ..methods import VQ_METHODS

    p = subparsers.add_parser("calibrate", help=HELP, description=HELP + ".")
    add_model_args(p)
    p.add_argument("--text", required=True, metavar="FILE", help="calibration text (UTF-8)")
    p.add_argument("--bits", type=bits_arg, required=True, help="preset: 4, 3, 2, 1.5, 1.25 or 1")
    p.add_argument("--method", choices=list(VQ_METHODS), default="vecinfer",
                   help="vecinfer (default) or an ablation: vq, smooth, hadamard")
    add_calib_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="output .safetensors file")
    add_progress_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..evaluation.ablation import normalize_bits
    from ..models import check_file, check_model_dir, load_model, load_text

    bits = normalize_bits(args.method, args.bits)
    check_model_dir(args.model)
    check_file(args.text)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    from ..calibrate import calibrate

    cb = calibrate(model, tokenizer, load_text(args.text), bits=bits, method=args.method,
                   max_tokens=args.max_tokens, seq_len=args.seq_len, iters=args.iters,
                   seed=args.seed, progress=args.progress)
    path = cb.save(args.out)
    print(f"wrote {path}: {args.method} {bits:g}-bit codebooks for {cb.geometry['num_layers']} layers "
          f"({cb.nbytes():,} bytes as fp16) in {time.perf_counter() - t0:.1f} s")
    return 0
