"""``vecinfer inspect``: key outlier statistics, codebook usage per method and the
perplexity-vs-bits curve, as PNGs plus a summary."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..methods import VQ_METHODS, normalize_bits
from . import add_model_args, add_progress_arg, print_json
from .arguments import bits_arg, check_positions, count, input_file, output_dir, text_file

HELP = "key absmax before/after smoothing and Hadamard, codebook usage per method, ppl vs bits (PNGs)"
DEFAULT_METHODS = "vq,smooth,hadamard,vecinfer"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help=HELP,
        description=HELP + ". Writes key_absmax.png, codebook_usage.png, ppl_vs_bits.png and summary.json into --out.",
    )
    add_model_args(p)
    p.add_argument(
        "--text",
        required=True,
        metavar="FILE",
        type=text_file("text file"),
        help="held-out text the keys are measured on",
    )
    p.add_argument(
        "--out", required=True, metavar="DIR", type=output_dir, help="output folder for the PNGs and summary.json"
    )
    p.add_argument("--bits", type=bits_arg, default=2.0, help="VQ preset of the usage study (default 2)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"VQ methods compared (default {DEFAULT_METHODS})")
    p.add_argument(
        "--calib-text",
        metavar="FILE",
        default=None,
        type=text_file("calibration text"),
        help="calibrate missing codebooks on this text",
    )
    p.add_argument(
        "--codebooks-dir",
        metavar="DIR",
        default=None,
        type=output_dir,
        help="read <method>-<bits>bit.safetensors from DIR; codebooks calibrated now are saved "
        "there (default: OUT/codebooks)",
    )
    p.add_argument(
        "--tokens", type=count(16), default=2048, metavar="N", help="held-out tokens measured (default 2048)"
    )
    p.add_argument("--seq-len", type=count(2), default=1024, metavar="L", help="forward window (default 1024)")
    p.add_argument("--max-tokens", type=count(1), default=8192, metavar="N", help="calibration tokens (default 8192)")
    p.add_argument("--iters", type=count(1), default=10, help="k-means iterations when calibrating (default 10)")
    p.add_argument(
        "--fit-vectors",
        type=count(1),
        default=65536,
        metavar="N",
        help="k-means sub-vectors per codebook when calibrating (default 65536)",
    )
    p.add_argument("--seed", type=count(0), default=0, metavar="S")
    p.add_argument(
        "--ablation-json",
        metavar="FILE",
        default=None,
        type=input_file("ablation JSON"),
        help="plot perplexity vs bits from this `vecinfer ablation --out` JSON instead of computing it",
    )
    p.add_argument("--no-ppl", action="store_true", help="skip the perplexity-vs-bits figure")
    p.add_argument("--ppl-windows", type=count(1), default=4, metavar="N", help="windows per ppl row (default 4)")
    p.add_argument("--ppl-window-len", type=count(2), default=512, metavar="L", help="tokens per window (default 512)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_progress_arg(p)
    p.set_defaults(func=run)


def _codebooks_for(model, tokenizer, method, bits, cb_dir: Path, calib_text, args):
    from ..codebooks import load_codebooks
    from ..evaluation.ablation import codebook_filename

    path = cb_dir / codebook_filename(method, bits)
    if path.is_file():
        cb = load_codebooks(path)
        try:
            cb.check_model(model.config, bits=bits, method=method)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        cb.check_weights(model)
        return cb, str(path)
    if calib_text is None:
        raise ValueError(f"no codebooks {path} for method {method!r}: pass --calib-text FILE to calibrate them")
    from ..calibration import calibrate
    from ..evaluation.ablation import check_calibration_length

    check_calibration_length(tokenizer, calib_text, args.seq_len, args.max_tokens)
    cb = calibrate(
        model,
        tokenizer,
        calib_text,
        bits=bits,
        method=method,
        max_tokens=args.max_tokens,
        seq_len=args.seq_len,
        iters=args.iters,
        seed=args.seed,
        max_fit_vectors=args.fit_vectors,
        progress=args.progress,
    )
    cb_dir.mkdir(parents=True, exist_ok=True)
    cb.save(path)
    return cb, f"calibrated now, saved to {path}"


def check_args(args) -> tuple[list[str], list[dict] | None]:
    """The checks that need no model; returns the methods and the rows of --ablation-json."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in VQ_METHODS:
            raise ValueError(f"--methods takes VQ methods ({', '.join(VQ_METHODS)}), not {m!r}")
        normalize_bits(m, args.bits)
    if args.ablation_json is None:
        return methods, None
    try:
        rows = json.loads(Path(args.ablation_json).read_text(encoding="utf-8")).get("rows")
    except (ValueError, AttributeError):
        rows = None
    if not rows:
        raise ValueError(f"{args.ablation_json} has no 'rows': write it with `vecinfer ablation --out FILE`")
    return methods, rows


def run(args) -> int:
    methods, rows = check_args(args)
    check_positions(args.model, args.seq_len, "--seq-len")  # from config.json, before the model loads
    if not (args.no_ppl or args.ablation_json):
        check_positions(args.model, args.ppl_window_len, "--ppl-window-len")
    from ..evaluation.inspect import (
        codebook_usage,
        format_summary,
        key_absmax_stats,
        plot_codebook_usage,
        plot_key_absmax,
        record_qkv,
        summary_dict,
    )
    from ..evaluation.plots import _pyplot, plot_ppl_vs_bits
    from ..models import load_model, load_text, tokenize
    from ..quant.transform import smoothing_factors

    calib_text = None if args.calib_text is None else load_text(args.calib_text)
    _pyplot()
    out_dir = Path(args.out)
    cb_dir = Path(args.codebooks_dir) if args.codebooks_dir else out_dir / "codebooks"
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    check_positions(model, args.seq_len, "--seq-len")
    if not (args.no_ppl or args.ablation_json):
        check_positions(model, args.ppl_window_len, "--ppl-window-len")
    ids = tokenize(tokenizer, load_text(args.text))
    if ids.numel() < args.tokens:
        raise ValueError(f"{args.text} has {ids.numel()} tokens, fewer than --tokens {args.tokens}")
    out_dir.mkdir(parents=True, exist_ok=True)
    qkv = record_qkv(model, ids[: args.tokens], seq_len=args.seq_len)
    keys = {l: k for l, (_, k, _) in qkv.items()}

    codebooks, sources = {}, {}
    for m in methods:
        codebooks[m], sources[m] = _codebooks_for(model, tokenizer, m, args.bits, cb_dir, calib_text, args)
    smoothing = next((m for m in methods if VQ_METHODS[m].smooth), None)
    if smoothing is not None:
        lams = {l: codebooks[smoothing].layer(l).transform.lam for l in keys}
        lam_source = f"calibration ({smoothing} codebooks: {sources[smoothing]})"
    else:
        lams = {l: smoothing_factors(k.abs().amax(dim=1)) for l, k in keys.items()}
        lam_source = "the measured text itself (no smoothing method among --methods)"
    stats = key_absmax_stats(keys, lams)
    usage = {m: codebook_usage(qkv, codebooks[m]) for m in methods}
    name = Path(args.model).name
    files = {
        "key_absmax": str(
            plot_key_absmax(
                stats,
                out_dir / "key_absmax.png",
                num_kv_heads=next(iter(keys.values())).shape[0],
                title=f"{name}: per-channel key |max| on {Path(args.text).name} ({args.tokens} tokens)",
            )
        ),
    }
    if usage:
        files["codebook_usage"] = str(
            plot_codebook_usage(
                usage,
                out_dir / "codebook_usage.png",
                title=f"{name}: {args.bits:g}-bit key codebook usage on {Path(args.text).name} ({args.tokens} tokens)",
            )
        )
    ppl_rows, ppl_source = None, None
    if args.ablation_json is not None:
        ppl_rows, ppl_source = rows, args.ablation_json
    elif not args.no_ppl:
        from ..evaluation.ablation import run_rows

        spec = [("fp16", 16.0)] + [(m, args.bits) for m in methods]
        if args.bits in (2.0, 4.0):
            spec.append(("kivi", args.bits))
        results = run_rows(
            model,
            tokenizer,
            ids,
            spec,
            calib_text=calib_text,
            windows=args.ppl_windows,
            window_len=args.ppl_window_len,
            search_dirs=(cb_dir,),
            progress=args.progress,
        )
        ppl_rows = [r.as_dict() for r in results]
        ppl_source = (
            f"computed now: {args.ppl_windows} x {args.ppl_window_len} tokens of {args.text}, "
            f"residual 0, codebooks from {cb_dir}"
        )
    if ppl_rows is not None:
        files["ppl_vs_bits"] = str(
            plot_ppl_vs_bits(ppl_rows, out_dir / "ppl_vs_bits.png", title=f"{name}: perplexity vs physical KV bits")
        )
    summary = summary_dict(stats, usage)
    summary.update(
        {
            "model": str(args.model),
            "text": str(args.text),
            "tokens": args.tokens,
            "bits": args.bits,
            "lam_source": lam_source,
            "codebooks": sources,
            "files": files,
            "ppl_source": ppl_source,
            "ppl": None
            if ppl_rows is None
            else [{k: r[k] for k in ("method", "bits", "ppl") if k in r} for r in ppl_rows],
            "seconds": round(time.perf_counter() - t0, 2),
        }
    )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print_json(summary)
    else:
        print(f"{args.model} on {args.text} ({args.tokens} tokens); smoothing factors from {lam_source}\n")
        print(format_summary(summary))
        if ppl_rows is not None:
            print(f"\nperplexity ({ppl_source}):")
            for r in ppl_rows:
                print(f"  {r['method']:>9} {r['bits']:>4g} bits: {r['ppl']:.3f}")
        print("\nwrote " + ", ".join(files.values()) + f", {out_dir / 'summary.json'}")
        print(f"({summary['seconds']:.0f} s)")
    return 0
