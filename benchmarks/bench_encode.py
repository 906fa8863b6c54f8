"""Encode (nearest centroid of every sub-vector) and quantize: ours vs compiled PyTorch, side by side.

Ours is ``torch.ops.vecinfer.encode`` / ``quantize`` (the Triton scan kernel for codebooks of
<= 256 entries, the tensor-core tile kernel above). The baseline is the pure-torch reference
(``|x|^2 - 2 x.c + |c|^2`` through a matmul, then argmin) compiled by Inductor. Shapes are the
keys of one evalmodel-geometry layer (2 KV heads, head_dim 128, already transformed); every row
checks that ours picks centroids no farther than the baseline's.

    python benchmarks/bench_encode.py [--cases 1x8192,8x2048] [--bits 2,1.5,1] [--sweep] [--key-parallel-weight 8]

``--sweep`` also times the encode kernel alone at other launch shapes (``EncodeConfig``);
``--key-parallel-weight W`` adds our score-aware encode (:mod:`vecinfer_compile.quant.score_aware`:
one launch per scale, the selection in torch) and its time over our nearest-centroid encode.
"""

from __future__ import annotations

import argparse

import bench_common as C  # a sibling: benchmarks/ is on sys.path (script dir, or `vecinfer bench`)
import torch
import triton

import vecinfer_compile.ops  # noqa: F401  (registers torch.ops.vecinfer)
from vecinfer_compile.ops import reference
from vecinfer_compile.ops.triton.encode import SCAN_MAX_ENTRIES, EncodeConfig, encode_triton
from vecinfer_compile.presets import get_preset
from vecinfer_compile.quant.packing import unpack_codes
from vecinfer_compile.quant.score_aware import check_parallel_weight

HKV, D = 2, 128
SCAN_SWEEP = [
    EncodeConfig(scan_block_n=n, scan_unroll=u, scan_warps=w)
    for n, u, w in ((512, 4, 4), (1024, 8, 4), (4096, 4, 8), (2048, 8, 8), (4096, 8, 16))
]
DOT_SWEEP = [
    EncodeConfig(dot_block_n=n, dot_block_e=e, dot_warps=w)
    for n, e, w in ((64, 64, 4), (128, 128, 8), (256, 64, 8), (128, 32, 4))
]


def nearest_excess(x: torch.Tensor, cent: torch.Tensor, ours: torch.Tensor, base: torch.Tensor) -> float:
    """Largest (distance to our centroid - distance to the baseline's) over all sub-vectors;
    ``ours``/``base`` are stored (packed) codes."""
    sub = x.float().reshape(-1, cent.shape[1])
    dist = lambda codes: ((sub - cent[unpack_codes(codes, cent.shape[0]).reshape(-1)]) ** 2).sum(-1)  # noqa: E731
    return (dist(ours) - dist(base)).max().item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--cases", default="1x8192,8x2048", help="BxT, comma-separated")
    ap.add_argument("--bits", default="2,1.5,1", help="presets, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel at other launch shapes")
    ap.add_argument(
        "--key-parallel-weight",
        type=float,
        default=1.0,
        metavar="W",
        help="also time the score-aware encode of weight W (> 1)",
    )
    args = ap.parse_args(argv)
    weight = check_parallel_weight(args.key_parallel_weight)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
    baseline = torch.compile(reference.encode, fullgraph=True)
    print(f"# encode, {torch.cuda.get_device_name()}, x: [B, {HKV}, T, {D}] bf16; median ms")
    aware = weight != 1.0
    print(
        "| bits | codebook | B | T | sub-vectors | ours encode | ours quantize | compiled torch | torch / ours | max distance excess |"
        + (f" ours score-aware (w={weight:g}) | score-aware / nearest |" if aware else "")
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if aware else ""))
    for bits in map(float, args.bits.split(",")):
        spec = get_preset(bits).key
        for b, t in C.parse_cases(args.cases):
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(b, HKV, t, D, device="cuda", dtype=torch.bfloat16, generator=g)
            cent = torch.randn(spec.entries, spec.dims, device="cuda", generator=g)
            ours_codes = torch.ops.vecinfer.encode(x, None, None, cent)
            excess = nearest_excess(x, cent, ours_codes, baseline(x, None, None, cent))
            ours = bench(lambda: torch.ops.vecinfer.encode(x, None, None, cent))
            quant = bench(lambda: torch.ops.vecinfer.quantize(x, None, None, cent))
            base = bench(lambda: baseline(x, None, None, cent))
            extra = ""
            if aware:
                scored = bench(lambda: torch.ops.vecinfer.encode(x, None, None, cent, weight))
                extra = f" {scored:.3f} | {scored / ours:.1f}x |"
            print(
                f"| {bits:g} | {spec.entries}x{spec.dims} | {b} | {t} | {x.numel() // spec.dims} | {ours:.3f} | "
                f"{quant:.3f} | {base:.3f} | {base / ours:.2f}x | {excess:.1e} |{extra}",
                flush=True,
            )
            if args.sweep:
                sweep(x, cent, ours_codes, bench)


def sweep(x: torch.Tensor, cent: torch.Tensor, default_codes: torch.Tensor, bench) -> None:
    """The encode kernel in use for this codebook at each of its other launch shapes."""
    for cfg in SCAN_SWEEP if cent.shape[0] <= SCAN_MAX_ENTRIES else DOT_SWEEP:
        try:
            excess = nearest_excess(x, cent, encode_triton(x, None, None, cent, config=cfg), default_codes)
            ms = bench(lambda: encode_triton(x, None, None, cent, config=cfg))
        except Exception as exc:  # a shape this GPU cannot fit
            print(f"  {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            continue
        print(f"  {cfg}: {ms:.3f} ms, max distance excess vs the default shape {excess:.1e}", flush=True)


if __name__ == "__main__":
    main()
