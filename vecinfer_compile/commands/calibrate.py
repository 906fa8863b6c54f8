"""``vecinfer calibrate``: fit smoothing factors and codebooks, write a safetensors file."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from ..codecs import registry
from ..methods import VQ_METHODS, normalize_bits
from ..presets import allocation_choices
from . import add_calib_args, add_model_args, add_progress_arg
from .arguments import (
    bits_arg,
    check_layer_count,
    check_positions,
    layer_bits_arg,
    new_file_in_folder,
    power_of_two,
    real,
    text_file,
)

TRELLIS_STATES = 4096  # the trellis codec's default (vecinfer_compile/codecs/trellis)
HELP = "fit VecInfer (or ablation) codebooks on a text and save them"
REFINED = [m for m, spec in VQ_METHODS.items() if spec.refine]
# Said in --help and when such a run starts: these methods refine their centroids against the
# attention-output error after k-means, one layer at a time.
QAWARE_COST = (
    f"{', '.join(REFINED)} refine their centroids layer by layer after k-means: about 5x the "
    "default method's time and more memory (a small model on 2 CPU cores: 42 min and 6.4 GB "
    "against 8 min), the progress bar moving once per layer; eval-ppl over their codebooks runs "
    "up to ~8x slower"
)


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help=HELP, description=HELP + ". Cost: " + QAWARE_COST + ".")
    add_model_args(p)
    p.add_argument(
        "--text", required=True, metavar="FILE", type=text_file("calibration text"), help="calibration text (UTF-8)"
    )
    p.add_argument(
        "--bits",
        type=bits_arg,
        help="preset: 4, 3, 2, 1.5, 1.25 or 1 (with --allocate retrieval: the average over layers)",
    )
    p.add_argument(
        "--allocate",
        choices=["uniform", "retrieval"],
        default="uniform",
        help="uniform: every layer at --bits (default); retrieval: more bits for the "
        "layers that retrieve distant tokens, fewer elsewhere, averaging exactly --bits "
        "(chosen for VecInferCache's 128-token full-precision window; with no window "
        "it costs perplexity)",
    )
    p.add_argument(
        "--layer-bits",
        type=layer_bits_arg,
        metavar="B0,B1,...",
        help="one preset per layer instead of --bits, e.g. 2,2,1,2,1,4",
    )
    p.add_argument(
        "--method",
        choices=list(VQ_METHODS),
        default="vecinfer",
        help="vecinfer (default), an ablation (vq, smooth, hadamard), the query-aware "
        "transform (qaware, whose k-means centroids are then refined against the attention-output "
        "error, and its codes chosen for the error the model reads; ablations qaware-nearest, qaware-scoreaware, "
        "qaware-norefine, qaware-nocenter, qaware-nohadamard, qaware-sqrt) "
        "VecInfer with centred keys (vecinfer-center), or keys quantized before RoPE with "
        "values predicted from them (prerope; ablation prerope-keys; simulate mode only); "
        "the refined qaware methods cost about 5x the default's time (see above)",
    )
    p.add_argument(
        "--ridge",
        type=real(0),
        default=None,
        metavar="R",
        help="qaware methods: the normalised query/key moments get R times their own diagonal "
        "added (default 0.1, chosen on held-out calibration text; examples/choose_qaware_ridge.py "
        "picks one on yours)",
    )
    p.add_argument(
        "--key-parallel-weight",
        type=real(1),
        default=None,
        metavar="W",
        help="how keys are encoded, stored in the file: 1 the nearest centroid; above 1, score-aware "
        "codes that weigh a key's error along its own direction W times (default: 8 for qaware, "
        "chosen on held-out calibration text, docs/results.md; 1 for the other methods)",
    )
    p.add_argument(
        "--weighted-codes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store each layer's error metrics (the calibration queries for keys, o_proj for values) "
        "and choose codes under them in every path, same bytes and decode kernels "
        "(docs/results.md; default: on for qaware, off for the other methods; with 4096-entry books "
        "(3, 1.5, 1.25 bits) it makes a decode step's append about 12x the nearest codes' at 1.5 bits)",
    )
    p.add_argument(
        "--key-codec",
        choices=registry.names(),
        default=None,
        help="the codec of the keys (docs/codecs.md; default codebooks): trellis is a long-block code "
        "(per-head KLT, whole bits a component, a bitshift trellis; docs/results/accuracy.md), same "
        "bits a key. VecInferCache (eager or compiled) needs one codec for keys and values; keys and "
        "values of two codecs run in simulate mode",
    )
    p.add_argument(
        "--value-codec",
        choices=registry.names(),
        default=None,
        help="the codec of the values (default codebooks); trellis codes them under o_proj's error metric "
        "with --weighted-codes, same bits a value",
    )
    p.add_argument(
        "--trellis-states",
        type=power_of_two,
        default=None,
        metavar="S",
        help=f"with --key-codec or --value-codec trellis: trellis states, a power of two (default "
        f"{TRELLIS_STATES}; more: closer to the bound, slower to encode)",
    )
    add_calib_args(p)
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        type=new_file_in_folder,
        help="output .safetensors file (a new path in an existing folder: an existing file is not overwritten)",
    )
    add_progress_arg(p)
    p.set_defaults(func=run)


def memory_summary(cb) -> str:
    """Two lines on what the codebooks cost: their float32 state by kind, and what a
    VecInferCache of the model then holds, fixed and per token, against full precision."""
    from ..evaluation.generation import DEFAULT_RESIDUAL
    from ..evaluation.kv_bytes import kv_bytes

    state = cb.state_bytes()
    parts = ", ".join(f"{kind} {n:,}" for kind, n in state.items())
    # the method's formula counts the codebooks' books: another codec's state in place of a side's
    codecs = state.get("key codec", 0) + state.get("value codec", 0) - _books_of_other_codecs(cb)
    acc, windowed = (
        dataclasses.replace(b, fixed_bytes=b.fixed_bytes + codecs)
        for b in (
            kv_bytes(cb.method, cb.bits, cb.geometry, layer_bits=cb.layer_bits, weighted_codes=cb.weighted_codes),
            kv_bytes(
                cb.method,
                cb.bits,
                cb.geometry,
                layer_bits=cb.layer_bits,
                residual=DEFAULT_RESIDUAL,
                weighted_codes=cb.weighted_codes,
            ),
        )
    )
    return (
        f"state: {cb.nbytes():,} bytes of float32, the precision the cache uses it in ({parts})\n"
        f"a VecInferCache of this model: {acc.fixed_bytes:,} bytes fixed, whatever its length, + "
        f"{acc.bytes_per_token:g} bytes per token (full precision: {acc.fp16_bytes_per_token:,}); fewer "
        f"bytes than full precision from {acc.break_even_tokens():,} tokens "
        f"({windowed.break_even_tokens():,} with the default {DEFAULT_RESIDUAL}-token full-precision window)"
        + _uncoded_note(cb)
        + _where_it_runs_note(cb)
    )


def _books_of_other_codecs(cb) -> int:
    """Float32 bytes of the books the method's formula counts for the sides another codec codes."""
    from ..codecs.registry import DEFAULT

    total = 0
    for side, name in zip(("key", "value"), cb.codecs):
        if name != DEFAULT:
            for i in cb.attention_layers():
                spec = getattr(cb.layer_preset(i), side)
                total += 4 * spec.entries * spec.dims
    return total


def _where_it_runs_note(cb) -> str:
    """For codebooks that do not run everywhere (simulate-only methods, sides of two codecs): where they run."""
    from ..methods import SIMULATE_ONLY

    key_codec, value_codec = cb.codecs
    if key_codec != value_codec:
        return (
            f"\n(keys coded by the {key_codec} codec, values by the {value_codec} codec: these codebooks run in "
            "simulate mode (vecinfer eval-ppl, ablation); VecInferCache needs one codec for both "
            "(--key-codec and --value-codec alike))"
        )
    if cb.method not in SIMULATE_ONLY:
        return ""
    return (
        f"\n({cb.method} has no VecInferCache yet: the figures above are what one would hold; its codebooks "
        "run in simulate mode: vecinfer eval-ppl, ablation, needle, gsm8k)"
    )


def _uncoded_note(cb) -> str:
    """For a model of mixed attention kinds: the layers the cache keeps in full precision, which
    the figures above count as coded."""
    coded = cb.metadata.get("coded_layers") or []
    if all(coded):
        return ""
    return (
        f"\n(this model's cache codes {sum(coded)} of its {len(coded)} layers: the others are sliding or "
        "chunked windows kept in full precision, bounded by their window; the figures above count every "
        "layer as coded)"
    )


def codec_options(args) -> dict:
    """The codecs' options from the command line (:meth:`vecinfer_compile.codecs.base.Codec.check_plan`)."""
    return {} if args.trellis_states is None else {"states": args.trellis_states}


def check_args(args) -> float | None:
    """The checks that need no model; returns the preset bits (None with --layer-bits)."""
    if (args.bits is None) == (args.layer_bits is None):
        raise ValueError(
            "give --bits B (one preset for all layers, or the average with --allocate "
            "retrieval) or --layer-bits B0,B1,... (one preset per layer)"
        )
    if args.layer_bits is not None and args.allocate != "uniform":
        raise ValueError("--layer-bits sets every layer's preset: drop --allocate")
    bits = None if args.bits is None else normalize_bits(args.method, args.bits)
    if args.allocate == "retrieval":
        allocation_choices(bits)
    for b in args.layer_bits or ():
        normalize_bits(args.method, b)
    if args.trellis_states is not None and "trellis" not in (args.key_codec, args.value_codec):
        raise ValueError(
            "--trellis-states is for --key-codec / --value-codec trellis: add one, or drop --trellis-states"
        )
    if "trellis" in (args.key_codec, args.value_codec):  # the codec's own check_plan loads torch: this one does not
        states = args.trellis_states or TRELLIS_STATES
        for b in args.layer_bits or [bits]:
            if b > states.bit_length() - 1:
                raise ValueError(
                    f"the trellis codec takes at most log2(states) bits a component: {b:g} bits need more than "
                    f"{states} trellis states: raise --trellis-states"
                )
    if args.ridge is not None and not VQ_METHODS[args.method].query_aware:
        raise ValueError(
            f"--ridge is for the query-aware methods "
            f"({', '.join(m for m, spec in VQ_METHODS.items() if spec.query_aware)}), not {args.method!r}"
        )
    return bits


def check_text_length(tokens: int, args) -> None:
    """ValueError unless the text fills one calibration sequence (or --max-tokens, if fewer): a
    few tokens would fit codebooks to almost nothing, silently."""
    needed = min(args.seq_len, args.max_tokens)
    if tokens < needed:
        raise ValueError(
            f"{args.text} holds {tokens} tokens, fewer than one calibration sequence ({needed}: the "
            f"smaller of --seq-len and --max-tokens): give a longer text, or lower --seq-len"
        )


def run(args) -> int:
    bits = check_args(args)
    check_positions(args.model, args.seq_len, "--seq-len")  # from config.json, before the model loads
    check_layer_count(args.model, args.layer_bits)
    from ..models import load_model, load_text, load_tokenizer, tokenize

    if VQ_METHODS[args.method].refine:
        print(f"vecinfer: calibrate --method {args.method}: {QAWARE_COST}", file=sys.stderr)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model)  # the text's length checked before the model loads
    text = load_text(args.text)
    check_text_length(len(tokenize(tokenizer, text)), args)
    model, tokenizer = load_model(args.model, args.dtype, args.device, tokenizer=tokenizer)
    check_positions(model, args.seq_len, "--seq-len")
    from ..calibration import calibrate

    cb = calibrate(
        model,
        tokenizer,
        text,
        bits=bits,
        method=args.method,
        layer_bits=args.layer_bits,
        allocate=None if args.allocate == "uniform" else args.allocate,
        max_tokens=args.max_tokens,
        seq_len=args.seq_len,
        iters=args.iters,
        seed=args.seed,
        progress=args.progress,
        key_parallel_weight=args.key_parallel_weight,
        weighted_codes=args.weighted_codes,
        key_codec=args.key_codec,
        value_codec=args.value_codec,
        codec_options=codec_options(args),
        **({} if args.ridge is None else {"ridge": args.ridge}),
    )
    try:
        path = cb.save(args.out)
    except FileExistsError:  # new when the arguments were checked: another run wrote it meanwhile
        raise FileExistsError(
            f"{args.out} was created by something else while this calibration ran (another "
            f"`vecinfer calibrate --out {args.out}`?): it is kept as it is and nothing was "
            "written; run again with a new --out"
        ) from None
    per_layer = "" if cb.layer_bits is None else f", per layer {'/'.join(f'{b:g}' for b in cb.layer_bits)}"
    print(
        f"wrote {path}: {args.method} {cb.bits:g}-bit codebooks for {cb.geometry['num_layers']} layers"
        f"{per_layer} in {time.perf_counter() - t0:.1f} s"
    )
    print(memory_summary(cb))
    allocation = cb.metadata.get("allocation")
    if allocation is not None:
        scores = " ".join(f"{s:.3f}" for s in allocation["retrieval_scores"])
        print(
            f"retrieval scores per layer: {scores}; pinned at {2 * cb.bits:g} bits: "
            f"{allocation['pinned_layers'] or 'none'}"
        )
    return 0
