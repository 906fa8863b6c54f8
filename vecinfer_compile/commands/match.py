"""``vecinfer match``: greedy tokens through VecInferCache vs the eager simulate path."""

from __future__ import annotations

from . import add_model_args, add_progress_arg, print_json
from .arguments import check_codebooks_layers, check_positions, check_quantizes, codebook_file, count, text_file

HELP = "greedy generation through the real cache vs the eager simulate path, token for token"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "match",
        help=HELP,
        description=HELP + ". Prompts are evenly spaced slices of --text; both paths use the same "
        "codebooks, prefill in full precision and keep the last --residual tokens in full precision.",
    )
    add_model_args(p)
    p.add_argument(
        "--codebooks", required=True, metavar="FILE", type=codebook_file, help="codebooks from `vecinfer calibrate`"
    )
    p.add_argument(
        "--text", required=True, metavar="FILE", type=text_file("text file"), help="text the prompts are cut from"
    )
    p.add_argument("--prompts", type=count(1), default=5, metavar="N", help="number of prompts (default 5)")
    p.add_argument("--prompt-len", type=count(1), default=512, metavar="T", help="tokens per prompt (default 512)")
    p.add_argument("--new-tokens", type=count(1), default=64, metavar="N", help="tokens generated (default 64)")
    p.add_argument(
        "--residual", type=count(0), default=128, metavar="R", help="full-precision window of the cache (default 128)"
    )
    p.add_argument(
        "--prefill-chunk",
        type=count(0),
        default=0,
        metavar="N",
        help="the cache prefills the prompt in chunks of N tokens (generate()'s prefill_chunk_size); "
        "the simulate path then reads the prompt with the per-query window (default 0: "
        "one-shot prefill, both paths in full precision)",
    )
    p.add_argument(
        "--backend",
        choices=["eager", "compile"],
        default="eager",
        help="cache path: eager, or generate() compiled with vecinfer_backend (default eager)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_arg(p)
    p.set_defaults(func=run)


def farthest_quantized_read(args) -> int:
    """How far back (in tokens) the farthest key read over codes can lie with no window, or -1
    when no query reads codes: the prompt attends in full precision unless it is prefilled in
    chunks, and the decode queries are the new tokens but the last."""
    reach = args.prompt_len + args.new_tokens - 2 if args.new_tokens > 1 else -1
    if 0 < args.prefill_chunk < args.prompt_len:
        reach = max(reach, args.prompt_len - 1)
    return reach


def check_window(args) -> None:
    """The full-precision window must leave some key to read over codes: else the two paths agree
    whatever the codebooks."""
    reach = farthest_quantized_read(args)
    check_quantizes(
        args.residual,
        reach,
        f"a {args.prompt_len}-token prompt and {args.new_tokens} new tokens",
        None
        if reach >= 0
        else "generate --new-tokens 2 or more (or prefill in chunks, --prefill-chunk, shorter than the prompt)",
    )


def run(args) -> int:
    check_window(args)
    # from config.json, before the model loads
    check_positions(args.model, args.prompt_len + args.new_tokens, "--prompt-len plus --new-tokens")
    check_codebooks_layers(args.codebooks, args.model)
    from ..codebooks import load_codebooks
    from ..evaluation.token_match import prompts_from_ids, token_match
    from ..models import load_model, load_text, tokenize

    codebooks = load_codebooks(args.codebooks)
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    check_positions(model, args.prompt_len + args.new_tokens, "--prompt-len plus --new-tokens")
    codebooks.check_model(model.config)
    codebooks.check_weights(model)
    prompts = prompts_from_ids(tokenize(tokenizer, load_text(args.text)), args.prompts, args.prompt_len)
    results = token_match(
        model,
        prompts,
        codebooks,
        new_tokens=args.new_tokens,
        residual=args.residual,
        compiled=args.backend == "compile",
        prefill_chunk=args.prefill_chunk,
        progress=args.progress,
    )
    identical = sum(r.first_mismatch is None for r in results)
    dtype = next(model.parameters()).dtype
    tied = sum(r.parted_at_tie(dtype) for r in results)
    summary = {
        "model": args.model,
        "codebooks": args.codebooks,
        "method": codebooks.method,
        "bits": codebooks.bits,
        "backend": args.backend,
        "dtype": args.dtype,
        "device": str(next(model.parameters()).device),
        "residual": args.residual,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_chunk": args.prefill_chunk,
        "identical_prompts": identical,
        "tied_prompts": tied,
        "prompts": len(results),
        "results": [
            {
                "first_mismatch": r.first_mismatch,
                "matched": r.matched,
                "gaps_at_mismatch": r.gaps_at_mismatch(),
                "parted_at_tie": r.parted_at_tie(dtype),
                "cache": r.cache_tokens,
                "simulate": r.simulate_tokens,
            }
            for r in results
        ],
    }
    if args.json:
        print_json(summary)
        return 0
    chunked = (
        f", the cache's prompt in {args.prefill_chunk}-token chunks (simulate: per-query window)"
        if args.prefill_chunk
        else ""
    )
    print(
        f"{codebooks.method} {codebooks.bits:g}-bit, cache ({args.backend}) vs eager simulate, "
        f"R={args.residual}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens{chunked}"
    )
    print("| prompt | matched tokens | first mismatch | top-2 logit gap there: cache / simulate | tie |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(results):
        gaps = r.gaps_at_mismatch()
        where = "-" if r.first_mismatch is None else r.first_mismatch
        tie = "-" if r.first_mismatch is None else ("yes" if r.parted_at_tie(dtype) else "no")
        print(
            f"| {i} | {r.matched}/{len(r.cache_tokens)} | {where} | "
            f"{'-' if gaps is None else f'{gaps[0]:.4f} / {gaps[1]:.4f}'} | {tie} |"
        )
    print(
        f"{identical}/{len(results)} prompts identical; {tied} more parted at a tie (a top-2 logit gap of at "
        f"most one rounding step of {str(dtype).removeprefix('torch.')} in one path: bf16 rounds logits of "
        "magnitude ~10 to steps of 0.0625)"
    )
    return 0
