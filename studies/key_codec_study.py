"""Key codec study: where does the 2-bit key error go, and what codec would near the bound?

Per layer, keys in ``qaware``'s coded domain (its transform fitted here on calibration tokens
0-32k: centring, the query-aware matrix, Hadamard; squared error there is ``qaware``'s proxy for
score error). Every row is the held-out relative key error at 2 bits a key element (256 bits a
128-dim head vector, per-token side information counted): squared error over the squared
deviation from the held-out mean, per KV head, averaged over the heads, on calibration tokens
32k-40k (never fitted on). Codecs are fitted on tokens 0-32k (the documented ideal channel on
0-16k, as ``studies/needle_ideal_quantizer.py`` fits it).

Rows (docs/studies/key-codec-study.md reads them):

- ``bound_wf_klt``: Gaussian rate-distortion bound, reverse water-filling over the per-head KLT
  spectrum (the ideal channel's expected error; ``_heldout``: that channel applied to held-out keys).
- ``bound_flat``: every Hadamard channel (or every KLT component) gets exactly 2 bits: 1/16.
- ``bound_sub4``: water-filling within each 4-dim Hadamard sub-vector at 8 bits (infinite block
  length over tokens, but no bits moved between sub-vectors).
- ``kmeans_256x4``: today's layout (one 256 x 4 book shared by the 32 positions and the heads,
  k-means 20 iterations: ``qaware-norefine``'s books), nearest codes.
- ``qaware_refined_256x4``: ``qaware``'s own 2-bit key books (k-means, then refinement against the
  layer's attention-output error, as ``vecinfer calibrate --method qaware`` fits them; ~10 min a
  layer on two CPU cores), nearest codes: the documented 0.105 at layer 5 (opt-in row ``refined``).
- ``klt_gauss_int``: KLT with integer rates (greedy under the Gaussian Lloyd-Max curve), each
  component at the Gaussian bound of its rate (``l 4^-b``): the cost of integer rates alone.
- ``klt_lloyd``: KLT, greedy integer bits per component, a Lloyd-Max scalar quantizer per
  component (fitted per head and component).
- ``klt_kmeans{g}``: KLT, components in blocks of ``g`` by decreasing variance, greedy integer
  bits per block (under a k-means curve measured on Gaussian samples), a k-means book of
  ``2^b x g`` per head and block.
- ``klt_trellis{L}``: KLT, the same integer bits per component as ``klt_lloyd``, each coded
  component divided by its standard deviation and the 128-long sequence coded by a bitshift trellis
  of ``2^L`` states (:mod:`vecinfer_compile.codecs.trellis.walk`: Viterbi, tables of ``2^L`` entries per
  bit width and head trained on 4,096 calibration vectors), no side information
  (``--trellis-vectors N``: scored on a seeded subset of N held-out tokens, trained on N).
- ``..._gain8``: the same with each token's norm (per head) stored apart in 8 bits (Lloyd-Max on
  its log) and the components quantized after dividing by it, with 248 bits left for them.

    python studies/key_codec_study.py --model evalmodel --calib-text calibration.txt \\
        --json key_codec_study.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vecinfer_compile.calibration.fit import FitSettings, LayerSamples, fit_key_transform  # noqa: E402
from vecinfer_compile.codecs.trellis.walk import reconstruct, train_luts, viterbi  # noqa: E402
from vecinfer_compile.hf.recording import collect_kv  # noqa: E402
from vecinfer_compile.methods import VQ_METHODS  # noqa: E402
from vecinfer_compile.models import load_model, load_text  # noqa: E402
from vecinfer_compile.quant.klt import KLT, gaussian_lloyd_max_distortion, greedy_allocation, lloyd_max, scalar_quantize  # noqa: E402
from vecinfer_compile.quant.kmeans import kmeans, nearest_centroid  # noqa: E402
from vecinfer_compile.quant.rate_distortion import IdealChannel, water_fill  # noqa: E402

WINDOW = 1024
BITS = 2  # a key element
GAIN_BITS = 8


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``x, x_hat: [H, N, D]`` -> mean over heads of ``sum |x - x_hat|^2 / sum |x - mean(x)|^2``."""
    x, x_hat = x.double(), x_hat.double()
    err = ((x - x_hat) ** 2).sum((1, 2))
    dev = ((x - x.mean(1, keepdim=True)) ** 2).sum((1, 2))
    return (err / dev).mean().item()


def record(model_dir: str, text: str, tokens: int, cache: str | None):
    """``(keys, values, queries)``, each ``{layer: [H, N, D]}`` over ``tokens`` tokens of ``text`` in windows
    of 1,024 (each after BOS), cached in ``cache`` when given."""
    if cache and Path(cache).exists():
        rec = torch.load(cache)
        return rec["keys"], rec["values"], rec["queries"]
    model, tok = load_model(model_dir, device="cpu")
    ids = tok(load_text(text), add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise ValueError(
            f"{text} gives {len(ids)} tokens: the study needs {tokens} (fit on the first 32 windows "
            "of 1,024, held out the last 8)"
        )
    keys, values, queries = collect_kv(model, torch.tensor(ids), WINDOW, False, with_queries=True)
    if cache:
        torch.save({"keys": keys, "values": values, "queries": queries, "tokens": len(ids)}, cache)
    return keys, values, queries


def kmeans_curve(g: int, max_bits: int, samples: int = 32768, seed: int = 0) -> torch.Tensor:
    """``[max_bits + 1]``: the held-out mean squared error an element of a ``2^b x g`` k-means book
    fitted to ``samples`` unit Gaussian vectors (and scored on as many others), b = 0..max_bits."""
    gen = torch.Generator().manual_seed(seed)
    fit, test = torch.randn(samples, g, generator=gen), torch.randn(samples, g, generator=gen)
    out = [1.0]
    for b in range(1, max_bits + 1):
        c = kmeans(fit, 2**b, iters=20, seed=seed).centroids
        out.append(nearest_centroid(test, c)[1].mean().item() / g)
    return torch.tensor(out, dtype=torch.float64)


class BlockCodec:
    """KLT coefficients ``[H, N, D]`` in blocks of ``g`` components (by decreasing variance), block
    ``j`` of head ``h`` at ``bits[h, j]`` bits: a Lloyd-Max scalar (``g = 1``) or a k-means book of
    ``2^b x g`` (``g > 1``); zero bits send the block's mean."""

    def __init__(self, y: torch.Tensor, g: int, budget: int, curve: torch.Tensor, seed: int):
        h, _, d = y.shape
        self.g = g
        var = y.var(1).reshape(h, d // g, g).sum(-1)  # [H, D / g]
        self.bits = torch.stack([greedy_allocation(var[i], budget, curve) for i in range(h)])
        self.books = [
            [self._fit(y[i, :, j * g : (j + 1) * g], int(self.bits[i, j]), seed + j) for j in range(d // g)]
            for i in range(h)
        ]

    def _fit(self, block: torch.Tensor, b: int, seed: int) -> torch.Tensor:
        if b == 0:
            return block.double().mean(0, keepdim=True)
        if self.g == 1:
            return lloyd_max(block[:, 0], 2**b)[:, None]
        return kmeans(block.float(), 2**b, iters=20, seed=seed).centroids.double()

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(y, dtype=torch.float64)
        for i, books in enumerate(self.books):
            for j, c in enumerate(books):
                block = y[i, :, j * self.g : (j + 1) * self.g].double()
                if self.g == 1 and c.shape[0] > 1:
                    out[i, :, j] = scalar_quantize(block[:, 0], c[:, 0])
                else:
                    out[i, :, j * self.g : (j + 1) * self.g] = c[nearest_centroid(block.float(), c.float())[0]]
        return out

    def side_bytes(self) -> int:
        """Per-layer constants: the books (float16), not per token."""
        return 2 * sum(c.numel() for books in self.books for c in books)


class GainShape:
    """Each token's coefficient norm (per head) in ``GAIN_BITS`` (Lloyd-Max on its log), the
    coefficients divided by the quantized norm and coded by ``BlockCodec`` at the bits left."""

    def __init__(self, y: torch.Tensor, g: int, budget: int, curve: torch.Tensor, seed: int):
        log_norm = y.double().norm(dim=-1).clamp_min(1e-12).log()  # [H, N]
        self.levels = [lloyd_max(log_norm[i], 2**GAIN_BITS) for i in range(y.shape[0])]
        self.shape = BlockCodec(y / self._gain(y), g, budget - GAIN_BITS, curve, seed)

    def _gain(self, y: torch.Tensor) -> torch.Tensor:
        log_norm = y.double().norm(dim=-1).clamp_min(1e-12).log()
        return torch.stack([scalar_quantize(log_norm[i], c) for i, c in enumerate(self.levels)]).exp()[..., None]

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        gain = self._gain(y)
        return self.shape(y / gain) * gain


def heldout_channel_error(channel: IdealChannel, x: torch.Tensor) -> float:
    """The held-out error of the ideal test channel (expected over its noise): per component
    ``(1 - a)^2 E[y^2] + a d`` (``a d`` = noise_scale^2), over the held-out deviation."""
    errs = []
    for h in range(x.shape[0]):
        y = (x[h].double() - channel.mean[h].double()) @ channel.basis[h].double()
        a, s = channel.gain[h].double(), channel.noise_scale[h].double()
        err = ((1 - a) ** 2 * (y**2).mean(0) + s**2).sum()
        dev = ((x[h].double() - x[h].double().mean(0)) ** 2).sum(-1).mean()
        errs.append((err / dev).item())
    return sum(errs) / len(errs)


def refined_books(
    model_dir: str, layer: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, n_fit: int
) -> torch.Tensor:
    """``qaware``'s refined 2-bit key books ``[256, 4]`` of ``layer``, fitted on the first ``n_fit``
    recorded tokens (whole windows) as calibration fits them (k-means, then refinement)."""
    from vecinfer_compile.calibration.fit import fit_layer
    from vecinfer_compile.quant.refine import RefineConfig
    from vecinfer_compile.simulate import attention_modules

    model, _ = load_model(model_dir, device="cpu")
    samples = LayerSamples(
        keys[:, :n_fit], values[:, :n_fit], queries[:, :n_fit], None, [WINDOW + 1] * (n_fit // (WINDOW + 1))
    )
    module = {m.layer_idx: m for m in attention_modules(model)}[layer]
    settings = FitSettings(iters=20, max_vectors=262144, device="cpu", refine=RefineConfig())
    fit = fit_layer(
        samples,
        VQ_METHODS["qaware"],
        [float(BITS)],
        settings,
        key_seed=1000 * layer,
        value_seed=1000 * layer + 1,
        module=module,
    )
    return fit.codebooks[float(BITS)].keys


def study_layer(
    layer: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    windows: tuple[int, int, int],
    curves: dict,
    rows: set[str],
    seed: int,
    model_dir: str = "",
    trellis_bits: int = 10,
    trellis_vectors: int = 0,
) -> dict:
    """One layer's rows; ``keys, values: [H, N, D]``, ``queries: [H_q, N, D]`` over the recorded windows;
    ``windows``: (fit, ideal-fit, held-out start) in windows of 1,025 recorded tokens."""
    per = WINDOW + 1
    n_fit, n_ideal, held = (w * per for w in windows)
    samples = LayerSamples(keys[:, :n_fit], keys[:, :n_fit], queries[:, :n_fit])
    transform = fit_key_transform(samples, VQ_METHODS["qaware"], FitSettings(iters=20))
    coded = transform.keys(keys[None])[0]  # [H, N, D]
    fit, test = coded[:, :n_fit], coded[:, held:]
    h, _, d = coded.shape
    budget = BITS * d
    out: dict[str, float] = {}
    t0 = time.time()

    ideal16 = IdealChannel.fit(coded[:, :n_ideal].permute(1, 0, 2), BITS)
    out["bound_wf_klt"] = ideal16.relative_error.mean().item()
    ideal32 = IdealChannel.fit(fit.permute(1, 0, 2), BITS)
    out["bound_wf_klt_0-32k"] = ideal32.relative_error.mean().item()
    out["bound_wf_klt_heldout"] = heldout_channel_error(ideal32, test)
    out["bound_flat"] = 4.0**-BITS
    sub = []
    for i in range(h):
        xs = fit[i].double().reshape(-1, d // 4, 4)
        tot, lam_sum = 0.0, 0.0
        for j in range(d // 4):
            lam = torch.linalg.eigvalsh(torch.cov(xs[:, j].T)).clamp_min(0)
            tot += water_fill(lam, 4 * BITS).sum().item()
            lam_sum += lam.sum().item()
        sub.append(tot / lam_sum)
    out["bound_sub4"] = sum(sub) / h

    if "kmeans" in rows:
        vecs = fit.reshape(-1, 4)
        gen = torch.Generator().manual_seed(1000 * layer)
        if vecs.shape[0] > 262144:
            vecs = vecs[torch.randperm(vecs.shape[0], generator=gen)[:262144]]
        book = kmeans(vecs, 256, iters=20, seed=1000 * layer).centroids
        x_hat = book[nearest_centroid(test.reshape(-1, 4), book)[0]].reshape(test.shape)
        out["kmeans_256x4"] = relative_error(test, x_hat)
    if "refined" in rows:
        book = refined_books(model_dir, layer, keys, values, queries, n_fit)
        x_hat = book[nearest_centroid(test.reshape(-1, 4), book)[0]].reshape(test.shape)
        out["qaware_refined_256x4"] = relative_error(test, x_hat)

    klt = KLT.fit(fit)
    y_fit, y_test = klt.forward(fit), klt.forward(test)
    lm = curves[1]
    bits = torch.stack([greedy_allocation(klt.variance[i], budget, lm) for i in range(h)])
    gauss = (klt.variance * 4.0 ** -bits.double()).sum(1) / klt.variance.sum(1)
    out["klt_gauss_int"] = gauss.mean().item()
    out["klt_bits_max"] = int(bits.max())
    out["klt_components_coded"] = float((bits > 0).sum(1).double().mean())
    for g in (1, 2, 4):
        if f"g{g}" not in rows:
            continue
        name = "klt_lloyd" if g == 1 else f"klt_kmeans{g}"
        codec = BlockCodec(y_fit, g, budget, curves[g], seed)
        out[name] = relative_error(test, klt.inverse(codec(y_test)))
        out[name + "_book_kib"] = codec.side_bytes() / 1024
        out[name + "_max_entries"] = 2 ** int(codec.bits.max())
        if "gain" in rows:
            gs = GainShape(y_fit, g, budget, curves[g], seed)
            out[name + f"_gain{GAIN_BITS}"] = relative_error(test, klt.inverse(gs(y_test)))
    if "trellis" in rows:
        t1 = time.time()
        rows_t = torch.arange(y_test.shape[1])
        if trellis_vectors:  # a seeded subset of the held-out tokens (Viterbi is slow on a CPU)
            rows_t = torch.randperm(y_test.shape[1], generator=torch.Generator().manual_seed(seed))[:trellis_vectors]
        y_sub = y_test[:, rows_t]
        y_hat = torch.zeros_like(y_sub)
        for i in range(h):
            cols = bits[i].nonzero()[:, 0]
            steps = bits[i, cols].tolist()
            sd = klt.variance[i, cols].sqrt()
            gen = torch.Generator().manual_seed(seed + i)
            sample = y_fit[i][torch.randperm(y_fit.shape[1], generator=gen)[: trellis_vectors or 4096]][:, cols] / sd
            luts = train_luts(sample, steps, trellis_bits, rounds=3, seed=seed + i)
            walk = viterbi(y_sub[i][:, cols] / sd, steps, luts)
            y_hat[i][:, cols] = reconstruct(walk, steps, luts).double() * sd
        out[f"klt_trellis{trellis_bits}"] = relative_error(test[:, rows_t], klt.inverse(y_hat))
        out["trellis_seconds"] = time.time() - t1
    out["seconds"] = time.time() - t0
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (the study used evalmodel)")
    ap.add_argument("--calib-text", required=True, help="calibration text (the study used calibration.txt)")
    ap.add_argument("--layers", default="all")
    ap.add_argument(
        "--rows", default="kmeans,g1,g2,g4,gain", help="kmeans, refined (slow), g1 (Lloyd-Max), g2, g4, gain, trellis"
    )
    ap.add_argument("--trellis-bits", type=int, default=10, help="L: the trellis has 2^L states")
    ap.add_argument(
        "--trellis-vectors",
        type=int,
        default=0,
        help="the trellis row on this many held-out tokens (and trains on as many; 0: all, 4,096)",
    )
    ap.add_argument("--record-cache", help="a .pt file holding (or to hold) the recorded keys and queries")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    rows = set(args.rows.split(","))
    keys, values, queries = record(args.model, args.calib_text, 40 * WINDOW, args.record_cache)
    layers = sorted(keys) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    t0 = time.time()
    curves = {1: gaussian_lloyd_max_distortion(12)}
    curves.update({g: kmeans_curve(g, 12) for g in (2, 4) if f"g{g}" in rows})
    print(
        "unit-Gaussian curves (error an element at b bits a block):",
        {g: [round(v, 4) for v in c.tolist()] for g, c in curves.items()},
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    results = {}
    for layer in layers:
        results[layer] = study_layer(
            layer,
            keys[layer],
            values[layer],
            queries[layer],
            (32, 16, 32),
            curves,
            rows,
            args.seed,
            args.model,
            args.trellis_bits,
            args.trellis_vectors,
        )
        print(
            f"layer {layer}: "
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in results[layer].items()),
            flush=True,
        )
    names = [
        k
        for k in results[layers[0]]
        if not k.endswith(("_kib", "_entries", "seconds"))
        and not k.startswith("klt_bits")
        and k != "klt_components_coded"
    ]
    print("\n| held-out key error, 2 bits | " + " | ".join(f"layer {i}" for i in layers) + " | mean |")
    print("|---|" + "---:|" * (len(layers) + 1))
    for k in names:
        vals = [results[i][k] for i in layers]
        print(f"| {k} | " + " | ".join(f"{v:.4f}" for v in vals) + f" | {sum(vals) / len(vals):.4f} |")
    print(f"\n{time.time() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"curves": {g: c.tolist() for g, c in curves.items()}, "layers": results}, indent=1)
        )


if __name__ == "__main__":
    main()
