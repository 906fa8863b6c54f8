"""The trellis key codec through the model, before any kernel: key error, the needle, perplexity.

Keys through :class:`~vecinfer_compile.codecs.trellis.code.TrellisCodec` (per-head KLT, integer
bits per component, a bitshift trellis of ``2^L`` states), fitted per layer in the coded domain of
a codebook file (its transform: for ``qaware``, centring, the query-aware matrix, Hadamard) on
calibration keys; values through the file's own codes. Rows, side by side in one run:

- ``fp``: no quantization;
- ``codes``: the file's own codes for keys and values (the product today);
- ``trellis@L``: the trellis keys with ``2^L`` states under the file's key error metric (the one its
  error-weighted codes lower: :mod:`vecinfer_compile.quant.weighted_codes`; squared error when it
  has none), the file's values: the codec as ``vecinfer calibrate --key-codec trellis`` fits it;
- ``trellis-unscaled@L``: the same without the codec's norm-matching scale (decoded keys shrunk
  toward the mean, as the Lloyd tables decode them);
- ``trellis-mse@L``: ``trellis-unscaled@L`` under squared error in the coded domain;
- ``exact-keys`` / ``exact-values``: the file's codes for the values / keys alone, the other in full
  precision (where the perplexity goes);
- ``trellis-values@L``: the file's codes for the keys, the same codec for the values (fitted on
  the recorded values under the file's value metric, ``o_proj``'s Gram matrix, when it has one);
  ``trellis-kv@L``: ``trellis@L`` keys and those values.

For each row: the held-out key error per layer (squared error over the squared deviation from the
mean, per KV head, in the coded domain: the measure of docs/studies/key-codec-study.md; fitted on
calibration tokens ``[0, --calib-tokens)``, scored on the next ``--heldout-tokens``), the needle
(``vecinfer needle``'s protocol through the simulate path with the cache's window semantics, each
token encoded once, as ``studies/needle_ideal_quantizer.py`` runs it), and the perplexity with
every token quantized (``--ppl-text``; ``--ppl-residual`` R, default 0, as ``vecinfer eval-ppl --residual``).

    python studies/key_codec_trial.py --model evalmodel --haystack text/haystack \\
        --calib-text calibration.txt --codebooks cb-qw-2.safetensors --ppl-text wikitext2_test.raw \\
        --rows fp,codes,trellis@12 --device cuda

A research script: each row fits its codecs here on the recorded calibration keys and values
(``vecinfer calibrate --key-codec trellis --value-codec trellis`` fits the same codecs into a file)
and attaches them to a copy of the file's layers, so the simulate path codes them as it codes such a
file (no cache kernels yet).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from needle_ideal_quantizer import CODES_QUANTIZE, encoded_once, quantizer  # noqa: E402

import vecinfer_compile.evaluation.generation as generation  # noqa: E402
from vecinfer_compile.codebooks import load_codebooks  # noqa: E402
from vecinfer_compile.codecs.trellis.code import TrellisCodec  # noqa: E402
from vecinfer_compile.evaluation.needle import format_grid, load_haystack, run_needle  # noqa: E402
from vecinfer_compile.evaluation.perplexity import perplexity  # noqa: E402
from vecinfer_compile.hf.recording import collect_kv  # noqa: E402
from vecinfer_compile.models import load_model, load_text, tokenize  # noqa: E402
from vecinfer_compile.quant.codebook import quantize_dequantize  # noqa: E402
from vecinfer_compile.simulate import simulation  # noqa: E402

WINDOW = 1024  # calibration windows of 1,024 tokens after BOS, as `vecinfer calibrate` records them


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``x, x_hat: [H, N, D]``: squared error over squared deviation from the mean, per head, averaged."""
    x, x_hat = x.double(), x_hat.double()
    err = ((x - x_hat) ** 2).sum((1, 2)) / ((x - x.mean(1, keepdim=True)) ** 2).sum((1, 2))
    return err.mean().item()


class HalfCoded:
    """The simulate path's quantizer for the ``exact-keys`` / ``exact-values`` rows: the file's codes
    for one of keys and values, the other exact."""

    def __init__(self, exact_keys: bool):
        self.exact_keys = exact_keys

    def __call__(self, sim, k: torch.Tensor, v: torch.Tensor, position_ids=None):
        k_hat, v_hat = CODES_QUANTIZE(sim, k, v, position_ids)
        return (k, v_hat) if self.exact_keys else (k_hat, v)


def with_codecs(codebooks, key_codecs: dict | None, value_codecs: dict | None = None):
    """A copy of ``codebooks`` whose layers code keys and/or values by the given codecs (one a layer;
    None: the file's codes), as ``vecinfer calibrate --key-codec / --value-codec trellis`` writes
    them: the simulate path then runs them as it runs such a file."""
    layers = [
        None
        if layer is None
        else dataclasses.replace(
            layer,
            keys=layer.keys if key_codecs is None else key_codecs[i],
            values=layer.values if value_codecs is None else value_codecs[i],
        )
        for i, layer in enumerate(codebooks.layers)
    ]
    return dataclasses.replace(codebooks, layers=layers)


def codes_keys(codebooks, layer: int, coded: torch.Tensor, nearest: bool = False) -> torch.Tensor:
    """The file's own key codes of ``coded: [H, N, D]``, dequantized: as every path encodes them
    (score-aware or error-weighted codes, which lower another error than squared error), or the
    ``nearest`` centroid's."""
    lc = codebooks.layer(layer)
    weight, metric = (1.0, None) if nearest else (codebooks.key_parallel_weight, lc.key_metric)
    return quantize_dequantize(coded[None], lc.keys.to(coded.device), weight, metric)[0]


def codes_key_error(codebooks, layer: int, coded: torch.Tensor, nearest: bool = False) -> float:
    return relative_error(coded, codes_keys(codebooks, layer, coded, nearest))


def metric_error(codebooks, layer: int, x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """:func:`relative_error` under the file's key metric ``M``: ``r^T M r`` over ``d^T M d``
    (``d``: deviation from the mean), per head, averaged."""
    m = codebooks.layer(layer).key_metric.to(x.device).double()
    r, dev = (x - x_hat).double(), (x - x.mean(1, keepdim=True)).double()
    err = torch.einsum("hnd,hde,hne->h", r, m, r) / torch.einsum("hnd,hde,hne->h", dev, m, dev)
    return err.mean().item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--haystack", help="the needle's filler (no needle without it)")
    ap.add_argument("--calib-text", required=True, help="fits the codecs and scores the key error (never the haystack)")
    ap.add_argument("--codebooks", required=True, help="a qaware or vecinfer file: its transform and value codes")
    ap.add_argument("--ppl-text", help="perplexity on this text (none without it)")
    ap.add_argument(
        "--rows",
        default="fp,codes,trellis@12",
        help="fp, codes, exact-keys, exact-values, trellis@L, trellis-unscaled@L, trellis-mse@L, "
        "trellis-values@L, trellis-kv@L (2^L states)",
    )
    ap.add_argument("--calib-tokens", type=int, default=32 * (WINDOW + 1))
    ap.add_argument("--heldout-tokens", type=int, default=8 * (WINDOW + 1))
    ap.add_argument("--train-vectors", type=int, default=4096, help="tokens a head the trellis tables train on")
    ap.add_argument("--rounds", type=int, default=3, help="table-training rounds (Viterbi, then means)")
    ap.add_argument("--codec-seed", type=int, default=0, help="seeds the codecs' table training and samples")
    ap.add_argument(
        "--codec-bits",
        type=float,
        help="the codecs' bits an element (default: the file's); a "
        "trellis-kv row then uses the file for its transform and error metrics only",
    )
    ap.add_argument("--ppl-residual", type=int, default=0, help="the perplexity's full-precision window R")
    ap.add_argument(
        "--save-dir",
        help="write each trellis row's codebooks here as ROW.safetensors (the file with "
        "the row's codecs: `vecinfer needle --codebooks` runs it through the cache)",
    )
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--residual", type=int, default=generation.DEFAULT_RESIDUAL, help="the needle's window")
    ap.add_argument("--ppl-windows", type=int, default=16)
    ap.add_argument("--ppl-window-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    model, tok = load_model(args.model, args.dtype, args.device)
    cb = load_codebooks(args.codebooks)
    cb.check_model(model.config, bits=cb.bits, method=cb.method)
    if cb.layer_bits is not None or any(
        layer is not None and layer.transform.rope_inv_freq is not None for layer in cb.layers
    ):
        raise ValueError(
            f"{args.codebooks}: use a uniform-bits qaware or vecinfer file (not per-layer bits, not pre-RoPE keys)"
        )
    device = torch.device(args.device)
    bits = cb.bits if args.codec_bits is None else args.codec_bits
    t0 = time.time()
    ids = tokenize(tok, load_text(args.calib_text))[: args.calib_tokens + args.heldout_tokens]
    keys, values = collect_kv(model, ids, WINDOW)
    layers = cb.attention_layers()
    coded = {i: cb.layer(i).transform.keys(keys[i][None].to(device))[0] for i in layers}  # [H, N, D]
    n_fit = args.calib_tokens
    print(f"recorded {ids.numel()} calibration tokens ({time.time() - t0:.0f} s)", flush=True)

    rows = []
    for row in args.rows.split(","):
        entry: dict = {"row": row}
        if row == "fp":
            gm, quantize = generation.GenerationMethod("fp16", 16.0), None
        elif row == "codes":
            gm, quantize = generation.GenerationMethod(cb.method, cb.bits, cb, args.residual), CODES_QUANTIZE
            entry["key_error"] = [codes_key_error(cb, i, coded[i][:, n_fit:]) for i in layers]
            entry["key_error_nearest"] = [codes_key_error(cb, i, coded[i][:, n_fit:], nearest=True) for i in layers]
            print(
                f"codes: held-out key error per layer, nearest centroid "
                f"{[round(e, 4) for e in entry['key_error_nearest']]}",
                flush=True,
            )
            if cb.weighted_codes:
                entry["key_metric_error"] = [
                    metric_error(cb, i, coded[i][:, n_fit:], codes_keys(cb, i, coded[i][:, n_fit:])) for i in layers
                ]
        elif row in ("exact-keys", "exact-values"):
            gm, quantize = (
                generation.GenerationMethod(cb.method, cb.bits, cb, args.residual),
                HalfCoded(row == "exact-keys"),
            )
        elif row.startswith(("trellis-values@", "trellis-kv@")):
            lbits = int(row.split("@")[1])
            fit_args = dict(train_vectors=args.train_vectors, rounds=args.rounds)
            value_codecs = {
                i: TrellisCodec.fit(
                    values[i][:, :n_fit].to(device),
                    bits,
                    lbits,
                    metric=cb.layer(i).value_metric,
                    seed=1000 * i + 10 * args.codec_seed + 1,
                    **fit_args,
                )
                for i in layers
            }
            key_codecs = None
            if row.startswith("trellis-kv"):
                key_codecs = {
                    i: TrellisCodec.fit(
                        coded[i][:, :n_fit],
                        bits,
                        lbits,
                        metric=cb.layer(i).key_metric,
                        seed=1000 * i + 10 * args.codec_seed,
                        **fit_args,
                    )
                    for i in layers
                }
            entry["value_error"] = [
                relative_error(
                    values[i][:, n_fit:].to(device),
                    value_codecs[i].quantize_dequantize(values[i][:, n_fit:].to(device)),
                )
                for i in layers
            ]
            print(f"{row}: held-out value error per layer {[round(e, 4) for e in entry['value_error']]}", flush=True)
            row_cb = with_codecs(cb, key_codecs, value_codecs)
            gm, quantize = generation.GenerationMethod(cb.method, cb.bits, row_cb, args.residual), CODES_QUANTIZE
        elif row.startswith(("trellis@", "trellis-unscaled@", "trellis-mse@")):
            lbits = int(row.split("@")[1])
            t1 = time.time()
            metric = {i: None if row.startswith("trellis-mse") else cb.layer(i).key_metric for i in layers}
            codecs = {
                i: TrellisCodec.fit(
                    coded[i][:, :n_fit],
                    bits,
                    lbits,
                    metric=metric[i],
                    train_vectors=args.train_vectors,
                    rounds=args.rounds,
                    seed=1000 * i + 10 * args.codec_seed,
                )
                for i in layers
            }
            if not row.startswith("trellis@"):
                for c in codecs.values():
                    c.scale = torch.ones_like(c.scale)
            entry["fit_seconds"] = time.time() - t1
            held_out = {i: (coded[i][:, n_fit:], codecs[i].quantize_dequantize(coded[i][:, n_fit:])) for i in layers}
            entry["key_error"] = [relative_error(*held_out[i]) for i in layers]
            entry["component_bits_max"] = max(int(c.bits.max()) for c in codecs.values())
            entry["scale"] = [c.scale.tolist() for c in codecs.values()]
            if cb.weighted_codes:
                entry["key_metric_error"] = [metric_error(cb, i, *held_out[i]) for i in layers]
            row_cb = with_codecs(cb, codecs)
            gm, quantize = generation.GenerationMethod(cb.method, cb.bits, row_cb, args.residual), CODES_QUANTIZE
        else:
            raise ValueError(
                f"unknown row {row!r}: fp, codes, exact-keys, exact-values, trellis@L, "
                "trellis-unscaled@L, trellis-mse@L, trellis-values@L or trellis-kv@L"
            )
        if args.save_dir and row.startswith("trellis"):
            Path(args.save_dir).mkdir(parents=True, exist_ok=True)
            path = gm.codebooks.save(Path(args.save_dir) / f"{row.replace('@', '-')}.safetensors", overwrite=True)
            print(f"{row}: wrote {path}", flush=True)
        if "key_error" in entry:
            print(f"{row}: held-out key error per layer {[round(e, 4) for e in entry['key_error']]}", flush=True)
        if "key_metric_error" in entry:
            print(
                f"{row}: held-out key error under the file's key metric, per layer "
                f"{[round(e, 4) for e in entry['key_metric_error']]}",
                flush=True,
            )
        if args.haystack:
            ctx = (
                contextlib.nullcontext()
                if quantize is None
                else quantizer(cb.method, functools.partial(encoded_once, quantize=quantize))
            )
            with ctx:
                result = run_needle(
                    model,
                    tok,
                    load_haystack(args.haystack),
                    gm,
                    lengths=_ints(args.lengths),
                    depths=[float(x) for x in args.depths.split(",")],
                    trials=args.trials,
                )
            entry.update(needle=result.accuracy, grid=result.grid, needle_seconds=result.seconds)
            print(f"{row}: needle {result.accuracy:.4f} ({result.seconds:.0f} s)\n{format_grid(result)}", flush=True)
        if args.ppl_text:
            text_ids = tokenize(tok, load_text(args.ppl_text))
            ppl_args = dict(windows=args.ppl_windows, window_len=args.ppl_window_len, progress=False)
            if quantize is None:
                res = perplexity(model, text_ids, **ppl_args)
            else:
                with (
                    quantizer(cb.method, quantize),
                    simulation(model, cb.method, bits=cb.bits, codebooks=gm.codebooks, residual=args.ppl_residual),
                ):
                    res = perplexity(model, text_ids, **ppl_args)
            entry["ppl"] = res.ppl
            print(
                f"{row}: perplexity {res.ppl:.3f}" + ("" if quantize is None else f" (R={args.ppl_residual})"),
                flush=True,
            )
        rows.append(entry)
    fp = next((r.get("ppl") for r in rows if r["row"] == "fp"), None)
    print("\nrow | key error, every layer (mean) | needle | perplexity")
    for r in rows:
        ke = r.get("key_error")
        ke_text = "-" if ke is None else " ".join(f"{e:.4f}" for e in ke) + f" ({sum(ke) / len(ke):.4f})"
        ppl = r.get("ppl")
        ppl_text = "-" if ppl is None else f"{ppl:.3f}" + (f" ({ppl / fp:.4f}x)" if fp else "")
        print(f"{r['row']} | {ke_text} | {r.get('needle', '-')} | {ppl_text}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    main()
