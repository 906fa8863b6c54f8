"""How fast can decode over 2-bit VQ codes get in Triton? A ceiling probe, side by side with FP16.

Two probe kernels stream the same code tensors the decode kernel reads (``[B, Hkv, T, 32]``
uint8, once for K and once for V) and do no attention math at all:

- ``codes-only``: read the codes (the HBM floor of any kernel over them);
- ``gather-only``: read the codes and gather every code's 4-channel bf16 centroid (8 bytes, from
  a 2 KiB codebook served by L1), summing them so nothing is optimised away.

Any decode kernel must at least gather, so ``FP16 SDPA / gather-only`` bounds the speed-up that
in-register dequantization or lookup tables can reach in Triton (which offers no shared-memory
gather; ``tl.gather`` fails to compile for these shapes on Triton 3.6). Also times our decode op
(default launch shape) and cuDNN SDPA over bf16 K/V at Llama-3.1-8B geometry.

    python benchmarks/bench_gather_ceiling.py [--cases 1x131072,8x131072,32x32768]
"""

from __future__ import annotations

import argparse

import bench_common as C  # a sibling: benchmarks/ is on sys.path (script dir, or `vecinfer bench`)
import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from vecinfer_compile.ops.coded_kv import CodedKV
from vecinfer_compile.ops.triton.decode import SplitConfig, decode_attention_triton, num_splits

HQ, HKV, D, NSUB, DSUB, R = 32, 8, 128, 32, 4, 128
SHAPES = ((64, 4, 4), (128, 4, 4), (64, 8, 8), (32, 4, 8), (128, 8, 4))  # block_n, warps, waves


@triton.jit
def gather_only_kernel(
    codes_ptr, cent_ptr, out_ptr, T, CHUNK, NSUB: tl.constexpr, DSUB: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Sum of the centroid rows of codes ``[BH, T, NSUB]`` rows ``[pid * CHUNK, +CHUNK)``."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    hi = tl.minimum(pid * CHUNK + CHUNK, T)
    sub = tl.arange(0, NSUB)
    acc = tl.zeros([BLOCK_N, NSUB, DSUB], tl.float32)
    base = codes_ptr + bh.to(tl.int64) * T * NSUB
    for j0 in range(pid * CHUNK, hi, BLOCK_N):
        offs = j0 + tl.arange(0, BLOCK_N)
        ok = (offs < hi)[:, None]
        code = tl.load(base + offs[:, None] * NSUB + sub[None, :], mask=ok, other=0).to(tl.int32)
        rows = tl.load(
            cent_ptr + (code * DSUB)[:, :, None] + tl.arange(0, DSUB)[None, None, :], mask=ok[:, :, None], other=0.0
        )
        acc += rows.to(tl.float32)
    tl.store(out_ptr + bh * tl.num_programs(0) + pid, tl.sum(tl.sum(tl.sum(acc, 2), 1), 0))


@triton.jit
def codes_only_kernel(codes_ptr, out_ptr, T, CHUNK, NSUB: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of codes ``[BH, T, NSUB]`` rows ``[pid * CHUNK, +CHUNK)``."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    hi = tl.minimum(pid * CHUNK + CHUNK, T)
    sub = tl.arange(0, NSUB)
    acc = tl.zeros([BLOCK_N, NSUB], tl.int32)
    base = codes_ptr + bh.to(tl.int64) * T * NSUB
    for j0 in range(pid * CHUNK, hi, BLOCK_N):
        offs = j0 + tl.arange(0, BLOCK_N)
        acc += tl.load(base + offs[:, None] * NSUB + sub[None, :], mask=(offs < hi)[:, None], other=0).to(tl.int32)
    tl.store(out_ptr + bh * tl.num_programs(0) + pid, tl.sum(tl.sum(acc, 1), 0).to(tl.float32))


def probe(codes: torch.Tensor, cent: torch.Tensor, bench) -> tuple[float, float]:
    """Best ``(gather-only, codes-only)`` ms over SHAPES, for K and V (twice one code tensor);
    the split over positions is the decode kernel's (:func:`num_splits`)."""
    bh, t = codes.shape[0] * codes.shape[1], codes.shape[2]
    best_gather = best_codes = float("inf")
    for block_n, warps, waves in SHAPES:
        splits, chunk = num_splits(bh, t, codes.device, SplitConfig(block_n=block_n, waves=waves))
        out = torch.empty(bh * splits, device=codes.device)
        best_gather = min(
            best_gather,
            2
            * bench(
                lambda: gather_only_kernel[(splits, bh)](
                    codes, cent, out, t, chunk, NSUB=NSUB, DSUB=DSUB, BLOCK_N=block_n, num_warps=warps
                )
            ),
        )
        best_codes = min(
            best_codes,
            2
            * bench(
                lambda: codes_only_kernel[(splits, bh)](
                    codes, out, t, chunk, NSUB=NSUB, BLOCK_N=block_n, num_warps=warps
                )
            ),
        )
    return best_gather, best_codes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--cases", default="1x131072,8x131072,32x32768")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731
    print(
        f"# decode ceiling probe, {torch.cuda.get_device_name()}, Hq={HQ} Hkv={HKV} D={D}, 2-bit codes "
        "(256 x 4 bf16 codebook); median ms; K and V both counted"
    )
    print(
        "| B | T | cuDNN FP16 SDPA | ours (default) | gather-only | codes-only | FP16 / gather-only (ceiling) | FP16 / ours |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for b, t in C.parse_cases(args.cases):
        g = torch.Generator(device="cuda").manual_seed(0)
        codes = torch.randint(0, 256, (b, HKV, t, NSUB), device="cuda", generator=g).to(torch.uint8)
        cent = torch.randn(256, DSUB, device="cuda", generator=g)
        gather, codes_ms = probe(codes, cent.to(torch.bfloat16), bench)
        q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        kw = torch.randn(b, HKV, R, D, device="cuda", dtype=torch.bfloat16, generator=g)
        n_coded = torch.tensor(t - R, device="cuda", dtype=torch.int32)
        n_window = torch.tensor(R, device="cuda", dtype=torch.int32)
        kv = CodedKV(codes, codes, cent, cent, n_coded, kw, kw, n_window)
        ours = bench(lambda: decode_attention_triton(q, kv, None, D**-0.5))
        k = torch.randn(b, HKV, t, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fp16 = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        print(
            f"| {b} | {t} | {fp16:.3f} | {ours:.3f} | {gather:.3f} | {codes_ms:.3f} | {fp16 / gather:.2f}x | "
            f"{fp16 / ours:.2f}x |",
            flush=True,
        )
        codes = k = v = None  # freed before the next case allocates (the lambdas above read these names)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
