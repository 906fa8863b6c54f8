"""Decode attention over trellis codes vs the codebooks' CUDA kernel vs the fastest FP16 SDPA, side by side.

Llama-3.1-8B geometry (32 query heads, 8 KV heads, head_dim 128, bf16), one new token per sequence,
2 bits an element. Rows, each timed as ``bench_decode_attention.py`` times (a CUDA graph over input
copies that exceed the L2, median replay, the best of ``--passes`` rounds):

- ``trellis``: :func:`vecinfer_compile.codecs.trellis.operands.decode_attention` over ``T`` coded tokens (the
  query into the components, the CUDA kernel where it builds, the split merge and the values'
  synthesis; ``trellis Triton``: the same with the Triton kernel forced) with
  random codecs of ``2^L`` states (``--states``) and random codes (any string is a valid code);
  the full-precision window is not merged in (the codebooks' kernel below merges its 128 slots);
- ``codes``: the codebooks' CUDA decode kernel at 2 bits over ``T - 128`` codes and a 128-slot window;
- ``fp16``: the fastest of torch SDPA's flash and cuDNN backends in their two GQA forms over ``T``
  16-bit keys and values.

Prints a markdown table with FP16 / ours for both; ``--check`` also compares the trellis kernel with
its reference (T <= 32k).

    python benchmarks/bench_trellis_decode.py [--batches 1,8] [--lengths 4096,131072] [--states 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode_attention as dec  # noqa: E402  (a sibling: its inputs, SDPA variants and timer)
from bench_common import copies_for, graph_time_ms  # noqa: E402

from vecinfer_compile.codecs.trellis.code import random_code as random_trellis_codec  # noqa: E402
from vecinfer_compile.codecs.trellis.operands import TrellisOperands, decode_attention, query_components  # noqa: E402
from vecinfer_compile.codecs.trellis.reference import decode_reference  # noqa: E402
from vecinfer_compile.codecs.trellis.triton_kernels import decode_components  # noqa: E402
from vecinfer_compile.ops.cuda import decode as cuda_decode  # noqa: E402
from vecinfer_compile.ops.kernel_request import use_decode_kernel  # noqa: E402

HQ, HKV, D = dec.HQ, dec.HKV, dec.D


def trellis_operands(states: int) -> tuple[TrellisOperands, TrellisOperands]:
    """Random key and value codecs of ``states`` states, 2 bits an element, on the GPU."""
    gen = torch.Generator().manual_seed(states)
    return tuple(
        TrellisOperands.of(random_trellis_codec(gen, HKV, D, 2.0, states.bit_length() - 1), "cuda") for _ in range(2)
    )


def trellis_inputs(b: int, t: int, operands: tuple, g: torch.Generator):
    """``(q, k_codes, v_codes, keys, values, n_coded, kv_start, scale)`` of one decode call."""
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k_codes, v_codes = (
        torch.randint(0, 256, (b, HKV, t, D // 4), device="cuda", dtype=torch.uint8, generator=g) for _ in range(2)
    )
    return q, k_codes, v_codes, *operands, t, None, D**-0.5


def fp16_ms(b: int, t: int, passes: int, g: torch.Generator) -> tuple[str, float]:
    """The fastest FP16 SDPA variant's ms per call over ``t`` keys."""
    sets = [
        (
            torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(b, HKV, t, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(b, HKV, t, D, device="cuda", dtype=torch.bfloat16, generator=g),
        )
        for _ in range(copies_for(2 * b * HKV * t * D * 2))
    ]
    variants = [dict(dec.sdpa_variants(*s)) for s in sets]
    best = ("none", float("inf"))
    for _ in range(passes):
        for name in variants[0]:
            try:
                ms = graph_time_ms([v[name] for v in variants])
            except RuntimeError:  # a backend that does not take this shape
                torch.cuda.synchronize()
                continue
            best = min(best, (name, ms), key=lambda x: x[1])
    return best


def tile_ms(b: int, t: int, states: int, tiles: list[tuple[int, int]], passes: int) -> dict[str, float]:
    """ms per call of the trellis kernel's launch alone (the query already in the components) for
    each ``(BLOCK_T, num_warps)`` of ``tiles``."""
    g = torch.Generator(device="cuda").manual_seed(1)
    operands = trellis_operands(states)
    q, k_codes, v_codes, keys, values, n, start, scale = trellis_inputs(b, t, operands, g)
    qc, bias = query_components(q, keys)
    out = {}
    for block_t, warps in tiles:

        def fn(block_t=block_t, warps=warps):
            return decode_components(
                qc, bias, k_codes, v_codes, keys, values, n, start, scale, block_t=block_t, num_warps=warps
            )

        out[f"{block_t}x{warps}"] = min(graph_time_ms([fn]) for _ in range(passes))
    return out


def run_case(b: int, t: int, states: int, passes: int, check: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    row = {"B": b, "T": t, "states": states}
    operands = trellis_operands(states)
    first = trellis_inputs(b, t, operands, g)
    sets = [first] + [trellis_inputs(b, t, operands, g) for _ in range(copies_for(2 * first[1].nbytes) - 1)]
    codes = [dec.code_inputs(b, t, 2.0, g) for _ in range(copies_for(2 * b * HKV * t * D // 4))]
    for _ in range(passes):
        ms = graph_time_ms([lambda a=a: decode_attention(*a) for a in sets])
        row["trellis_ms"] = min(ms, row.get("trellis_ms", ms))
        with use_decode_kernel("triton"):
            ms = graph_time_ms([lambda a=a: decode_attention(*a) for a in sets])
        row["trellis_triton_ms"] = min(ms, row.get("trellis_triton_ms", ms))
        ms = graph_time_ms([lambda a=a: cuda_decode.decode_attention_cuda(*a) for a in codes])
        row["codes_ms"] = min(ms, row.get("codes_ms", ms))
    if check and t <= dec.CHECK_MAX_T:
        want, _ = decode_reference(*first)
        row["trellis_max_err"] = (decode_attention(*first)[0] - want).abs().max().item()
    del sets, codes, first
    torch.cuda.empty_cache()
    row["baseline"], row["baseline_ms"] = fp16_ms(b, t, passes, g)
    row["trellis_speedup"] = row["baseline_ms"] / row["trellis_ms"]
    row["codes_speedup"] = row["baseline_ms"] / row["codes_ms"]
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--lengths", default="4096,131072")
    ap.add_argument("--states", default="1024", help="trellis sizes, comma-separated powers of two")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="compare the trellis kernel with its reference")
    ap.add_argument(
        "--tiles",
        default="",
        help="also time the kernel alone at these BLOCK_T x num_warps, e.g. "
        "16x4,32x8 (its inputs stay in the L2: a tuning aid, not a headline)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    print(
        f"# decode attention, {torch.cuda.get_device_name()}: {HQ} query / {HKV} KV heads, head_dim {D}, bf16, "
        f"2 bits an element; ms per call, device-timed (CUDA graph over L2-defeating copies)"
    )
    print(
        "| B | T | states | trellis ms | trellis Triton ms | codes (CUDA) ms | best FP16 ms | FP16 / trellis | "
        "FP16 / trellis Triton | FP16 / codes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for states in (int(x) for x in args.states.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            for t in (int(x) for x in args.lengths.split(",")):
                r = run_case(b, t, states, args.passes, args.check)
                rows.append(r)
                err = f" (max err {r['trellis_max_err']:.1e})" if "trellis_max_err" in r else ""
                print(
                    f"| {b} | {t} | {states} | {r['trellis_ms']:.3f}{err} | {r['trellis_triton_ms']:.3f} | "
                    f"{r['codes_ms']:.3f} | {r['baseline_ms']:.3f} ({r['baseline']}) | "
                    f"{r['trellis_speedup']:.2f}x | {r['baseline_ms'] / r['trellis_triton_ms']:.2f}x | "
                    f"{r['codes_speedup']:.2f}x |",
                    flush=True,
                )
                if args.tiles:
                    tiles = [tuple(int(v) for v in x.split("x")) for x in args.tiles.split(",")]
                    times = tile_ms(b, t, states, tiles, args.passes)
                    print(
                        "  kernel alone, ms by BLOCK_T x warps: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()),
                        flush=True,
                    )
    return rows


if __name__ == "__main__":
    main()
