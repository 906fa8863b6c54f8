"""The trellis codec's Viterbi walk on the GPU: the CUDA encoder (one CTA a vector while
that puts at most two CTAs on an SM, one warp a vector from there: ``kernel_for``) against the Triton kernel, side by side
in one run.

One launch codes ``N`` vectors of each of 8 KV heads (head_dim 128) with tables of ``2^L`` states
and a decreasing allocation of 7/5/4/.../1 bits (2 bits an element, 10 components uncoded), as a
layer's keys at ``N`` tokens. Each kernel is captured in a CUDA graph of 20 launches, timed by
CUDA events (the median replay, ``bench_common.graph_time_ms``); both write the stored codes,
compared row by row (equal but for ties of equal cost).

    python benchmarks/bench_viterbi.py [--vectors 1,8,16,256,2048] [--states 1024] [--kernel auto|block|warp]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import graph_time_ms  # noqa: E402

from vecinfer_compile.codecs.trellis.cuda.viterbi import kernel_for, viterbi_codes_cuda  # noqa: E402
from vecinfer_compile.codecs.trellis.packing import packed_bytes  # noqa: E402
from vecinfer_compile.codecs.trellis.triton_kernels import viterbi_codes  # noqa: E402
from vecinfer_compile.codecs.trellis.walk import initial_luts  # noqa: E402

HKV, D = 8, 128
LAUNCHES = 20  # a CUDA graph's launches (the same inputs: a decode step's encode reads one token)
ALLOCATION = [7, 5, 4, 4, 4] + [3] * 40 + [2] * 40 + [1] * 33 + [0] * 10


def operands(states: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``bits [H, D]`` and ``tables [H, 7, 2^L]`` on the GPU (each head its own tables)."""
    lbits = states.bit_length() - 1
    tables = torch.zeros(HKV, max(ALLOCATION), states)
    for h in range(HKV):
        for k, t in initial_luts(lbits, [k for k in ALLOCATION if k], seed=h).items():
            tables[h, k - 1] = t
    return torch.tensor([ALLOCATION] * HKV).cuda(), tables.cuda()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--vectors", default="1,8,16,256,2048", help="vectors a head, comma-separated")
    ap.add_argument("--states", default="1024", help="trellis sizes, comma-separated powers of two (up to 2048)")
    ap.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "block", "warp"],
        help="the CUDA kernel (auto: the one the ops run at that count)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    print(
        f"# trellis Viterbi walk, {torch.cuda.get_device_name()}: {HKV} heads, head_dim {D}; us per launch "
        "(median replay of a CUDA graph of 20)"
    )
    print("| states | N | Triton us | CUDA kernel | CUDA us | Triton / CUDA | same codes |")
    print("|---|---|---|---|---|---|---|")
    for states in (int(s) for s in args.states.split(",")):
        bits, tables = operands(states)
        nbytes = packed_bytes(bits)
        for n in (int(v) for v in args.vectors.split(",")):
            x = torch.randn(n, HKV, D, device="cuda")
            kernel = kernel_for(x, tables) if args.kernel == "auto" else args.kernel
            same = viterbi_codes(x, bits, tables, nbytes=nbytes) == viterbi_codes_cuda(x, bits, tables, nbytes, kernel)
            t_triton = 1e3 * graph_time_ms([lambda: viterbi_codes(x, bits, tables, nbytes=nbytes)] * LAUNCHES)
            t_cuda = 1e3 * graph_time_ms([lambda: viterbi_codes_cuda(x, bits, tables, nbytes, kernel)] * LAUNCHES)
            print(
                f"| {states} | {n} | {t_triton:.1f} | {kernel} | {t_cuda:.1f} | {t_triton / t_cuda:.2f}x | "
                f"{same.all(-1).float().mean().item():.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
