"""The needle under an ideal quantizer: how far is a retrieval bar from *any* code of R bits?

Runs ``vecinfer needle``'s protocol (:func:`~vecinfer_compile.evaluation.needle.run_needle`: the
same prompts, greedy, exact match) through the simulate path with the cache's window semantics
(prefill in full precision, decode steps read keys and values older than the last ``--residual``
tokens quantized), for these rows:

- ``fp``: no quantization (the real cache's full-precision row).
- ``codes``: the codebook file's own codes (each token encoded once, as the cache does; the grid
  equals ``vecinfer needle --method <its method>``'s through the real cache).
- ``ideal@R``: every layer's keys (in the file's coded domain, where squared error is its proxy for
  score error) and values through the Gaussian rate-distortion test channel at ``R`` bits an
  element (:mod:`vecinfer_compile.quant.rate_distortion`), fitted per layer and KV head on
  calibration text. Each token keeps one noise draw across decode steps, as it keeps its codes.

    python studies/needle_ideal_quantizer.py --model evalmodel --haystack text/haystack \\
        --calib-text calibration.txt --codebooks cb.safetensors --rows fp,codes,ideal@2,ideal@1.5

A research script: it swaps the simulate path's quantizer (``LayerSimulator.quantize_kv``) and
lets the file's method generate in simulate mode, both only inside :func:`quantizer`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vecinfer_compile.evaluation.generation as generation  # noqa: E402
from vecinfer_compile.codebooks import load_codebooks  # noqa: E402
from vecinfer_compile.evaluation.needle import format_grid, load_haystack, run_needle  # noqa: E402
from vecinfer_compile.hf.recording import collect_kv  # noqa: E402
from vecinfer_compile.models import load_model, load_text  # noqa: E402
from vecinfer_compile.quant.rate_distortion import IdealChannel  # noqa: E402
from vecinfer_compile.simulate import LayerSimulator  # noqa: E402

CODES_QUANTIZE = LayerSimulator.quantize_kv


def encoded_once(sim: LayerSimulator, k: torch.Tensor, v: torch.Tensor, position_ids=None, quantize=CODES_QUANTIZE):
    """``quantize(sim, k, v, position_ids)`` (default: the codebooks' quantize-dequantize) with each
    cache slot encoded once: a decode step's call extends the previous call's keys by new slots,
    and only those are encoded (codes are per token, so this is exact and spares re-encoding the
    prompt at every step)."""
    memo = getattr(sim, "_encoded", None)
    if (
        memo is not None
        and memo[0].shape[2] < k.shape[2]
        and memo[0].shape[:2] == k.shape[:2]
        and torch.equal(memo[0], k[:, :, : memo[0].shape[2]])
        and torch.equal(memo[1], v[:, :, : memo[1].shape[2]])
    ):
        n = memo[0].shape[2]
        k_new, v_new = quantize(sim, k[:, :, n:], v[:, :, n:], None)
        k_hat, v_hat = torch.cat([memo[2], k_new], 2), torch.cat([memo[3], v_new], 2)
    else:
        k_hat, v_hat = quantize(sim, k, v, position_ids)
    sim._encoded = (k, v, k_hat, v_hat)
    return k_hat, v_hat


class IdealQuantizer:
    """Keys (coded domain of ``codebooks``) and values through per-layer :class:`IdealChannel` s,
    for the layers the codebooks code (a hybrid model's others attend in full precision)."""

    def __init__(self, codebooks, keys: dict, values: dict, bits: float, noise_seed: int):
        self.codebooks = codebooks
        coded = [i for i in keys if codebooks.layers[i] is not None]
        self.keys = {i: IdealChannel.fit(self._coded(i, keys[i]).permute(1, 0, 2), bits) for i in coded}
        self.values = {i: IdealChannel.fit(values[i].permute(1, 0, 2), bits) for i in coded}
        self.noise_seed = noise_seed
        self._noise: dict[tuple[int, int], torch.Tensor] = {}

    def _coded(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """``k: [H, N, D]`` recorded keys -> the coded domain (the quantizer's input)."""
        return self.codebooks.layer(layer).transform.keys(k[None])[0]

    def noise(self, layer: int, kind: int, t: int, h: int, d: int) -> torch.Tensor:
        """``[t, h, d]`` standard normal, fixed per (layer, keys/values, slot)."""
        key = (layer, kind)
        if key not in self._noise or self._noise[key].shape[0] < t:
            g = torch.Generator().manual_seed(1000 * layer + kind + 7919 * self.noise_seed)
            self._noise[key] = torch.randn(max(t, 4096), h, d, generator=g)
        return self._noise[key][:t]

    def __call__(self, sim: LayerSimulator, k: torch.Tensor, v: torch.Tensor, position_ids=None):
        i, (_, h, t, d) = sim.layer_idx, k.shape
        transform = self.codebooks.layer(i).transform
        k_hat = transform.keys_inverse(self.keys[i](transform.keys(k.float()), self.noise(i, 0, t, h, d)))
        v_hat = self.values[i](v, self.noise(i, 1, t, h, d))
        return k_hat.to(k.dtype), v_hat.to(v.dtype)


@contextlib.contextmanager
def quantizer(method: str, quantize):
    """Inside: ``method`` generates in simulate mode and its simulators call ``quantize(sim, k, v,
    position_ids)``."""

    def quantize_kv(sim, k, v, position_ids=None):
        return quantize(sim, k, v, position_ids)

    with (
        mock.patch.object(generation, "SIMULATED", (*generation.SIMULATED, method)),
        mock.patch.object(LayerSimulator, "quantize_kv", quantize_kv),
    ):
        yield


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--haystack", required=True)
    ap.add_argument("--calib-text", required=True, help="fits the ideal channels (never the haystack)")
    ap.add_argument("--codebooks", required=True, help="its transform gives the keys' coded domain")
    ap.add_argument("--rows", default="fp,codes,ideal@2", help="fp, codes, ideal@R (bits an element)")
    ap.add_argument("--noise-seeds", default="0", help="one ideal row per seed")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--residual", type=int, default=generation.DEFAULT_RESIDUAL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    model, tok = load_model(args.model, device=args.device)
    cb = load_codebooks(args.codebooks)
    cb.check_model(model.config, bits=cb.bits, method=cb.method)
    if any(layer is not None and layer.transform.rope_inv_freq is not None for layer in cb.layers):
        raise ValueError(
            f"{args.codebooks}: pre-RoPE keys ({cb.method}) are not supported; use a qaware or vecinfer file"
        )
    haystack = load_haystack(args.haystack)
    grid_args = dict(
        lengths=[int(x) for x in args.lengths.split(",")],
        depths=[float(x) for x in args.depths.split(",")],
        trials=args.trials,
    )
    recorded = None
    rows = []
    for row in args.rows.split(","):
        if row == "fp":
            runs = [(row, generation.GenerationMethod("fp16", 16.0), contextlib.nullcontext(), None)]
        elif row == "codes":
            gm = generation.GenerationMethod(cb.method, cb.bits, cb, args.residual)
            runs = [(row, gm, quantizer(cb.method, encoded_once), None)]
        elif row.startswith("ideal@"):
            bits = float(row.split("@")[1])
            if recorded is None:
                ids = tok(load_text(args.calib_text), add_special_tokens=False)["input_ids"][: args.calib_tokens]
                recorded = collect_kv(model, torch.tensor(ids), 1024)
            gm = generation.GenerationMethod(cb.method, cb.bits, cb, args.residual)
            runs = []
            for seed in (int(s) for s in args.noise_seeds.split(",")):
                ideal = IdealQuantizer(cb, *recorded, bits, seed)
                errors = {
                    kind: [round(c.relative_error.mean().item(), 4) for c in channels.values()]
                    for kind, channels in (("keys", ideal.keys), ("values", ideal.values))
                }
                print(f"{row}: expected relative error per layer, keys {errors['keys']}, values {errors['values']}")
                runs.append((f"{row} (noise seed {seed})", gm, quantizer(cb.method, ideal), errors))
        else:
            raise ValueError(f"unknown row {row!r}: fp, codes or ideal@BITS")
        for label, gm, ctx, errors in runs:
            with ctx:
                result = run_needle(model, tok, haystack, gm, **grid_args)
            print(
                f"\n{label}: mean accuracy {result.accuracy:.4f} ({result.seconds:.0f} s)\n{format_grid(result)}",
                flush=True,
            )
            rows.append({"row": label, "accuracy": result.accuracy, "grid": result.grid, "relative_error": errors})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
