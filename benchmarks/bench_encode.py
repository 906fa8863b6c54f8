"""Encode (nearest centroid of every sub-vector) and quantize: ours vs compiled PyTorch, side by side.

Ours is ``torch.ops.vecinfer.encode`` / ``quantize`` (the Triton scan kernel for codebooks of
<= 256 entries, the tensor-core tile kernel above). The baseline is the pure-torch reference
(``|x|^2 - 2 x.c + |c|^2`` through a matmul, then argmin) compiled by Inductor. Shapes are the
keys of one evalmodel-geometry layer (2 KV heads, head_dim 128, already transformed); every row
checks that ours picks centroids no farther than the baseline's.

    python benchmarks/bench_encode.py [--cases 1x8192,8x2048] [--bits 2,1.5]
"""

from __future__ import annotations

import argparse

import torch
import triton

import vecinfer_compile.ops  # noqa: F401  (registers torch.ops.vecinfer)
from vecinfer_compile.ops import reference
from vecinfer_compile.presets import get_preset

HKV, D = 2, 128


def nearest_excess(x: torch.Tensor, cent: torch.Tensor, ours: torch.Tensor, base: torch.Tensor) -> float:
    """Largest (distance to our centroid - distance to the baseline's) over all sub-vectors."""
    sub = x.float().reshape(-1, cent.shape[1])
    dist = lambda codes: ((sub - cent[codes.long().reshape(-1)]) ** 2).sum(-1)  # noqa: E731
    return (dist(ours) - dist(base)).max().item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x8192,8x2048", help="BxT, comma-separated")
    ap.add_argument("--bits", default="2,1.5", help="presets, comma-separated")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
    baseline = torch.compile(reference.encode, fullgraph=True)
    print(f"# encode, {torch.cuda.get_device_name()}, x: [B, {HKV}, T, {D}] bf16; median ms")
    print("| bits | codebook | B | T | sub-vectors | ours encode | ours quantize | compiled torch | torch / ours | max distance excess |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for bits in map(float, args.bits.split(",")):
        spec = get_preset(bits).key
        for case in args.cases.split(","):
            b, t = map(int, case.split("x"))
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(b, HKV, t, D, device="cuda", dtype=torch.bfloat16, generator=g)
            cent = torch.randn(spec.entries, spec.dims, device="cuda", generator=g)
            ours_codes = torch.ops.vecinfer.encode(x, None, None, cent)
            excess = nearest_excess(x, cent, ours_codes, baseline(x, None, None, cent))
            ours = bench(lambda: torch.ops.vecinfer.encode(x, None, None, cent))
            quant = bench(lambda: torch.ops.vecinfer.quantize(x, None, None, cent))
            base = bench(lambda: baseline(x, None, None, cent))
            print(f"| {bits:g} | {spec.entries}x{spec.dims} | {b} | {t} | {x.numel() // spec.dims} | {ours:.3f} | "
                  f"{quant:.3f} | {base:.3f} | {base / ours:.2f}x | {excess:.1e} |", flush=True)


if __name__ == "__main__":
    main()
