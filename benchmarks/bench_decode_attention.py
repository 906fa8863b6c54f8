"""Decode attention over VQ codes (CUDA kernel and Triton kernel) vs the fastest FP16 SDPA, side by side.

Llama-3.1-8B geometry (32 query heads, 8 KV heads, head_dim 128, bf16 or ``--dtype float16``), one new token per
sequence, residual window R=128. For every bit-width and (B, T) it times, in the same process on
the same GPU: our CUDA kernel (``vecinfer::decode_attention_cuda``, NVRTC), our Triton kernel
(default launch shape, in-register dequantization), and torch SDPA over 16-bit K/V with the flash
and cuDNN backends, each in its two GQA forms (``enable_gqa=True``, and the group's query heads
packed as query rows); the baseline is the fastest of those four.

Timing: each method is captured in a CUDA graph (as the compiled decode step runs it) over
enough independent copies of its inputs that together they exceed the 60 MB L2, and the replay
time is divided by the number of copies (median of several replays). So launch overhead is the
graph's and no method reads its inputs from a warm L2. Every method is timed in ``--passes``
rounds (2 by default), each round timing all of them in turn, and keeps its fastest: in one pass
the first kernel timed after a long FP16 case sometimes read ~20% slow (2-bit B=32/T=32k).
Prints a markdown table with the ratio FP16 / ours for each kernel; ``--no-triton`` skips the
Triton kernel. To time a kernel change, run this script from two checkouts in one GPU session
(the README's contributing notes).

    python benchmarks/bench_decode_attention.py [--bits 2,1.5] [--batches 1,8,32] [--lengths 4096,32768,131072]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

if (
    Path(__file__).resolve().parents[1] / "vecinfer_compile"
).is_dir():  # a checkout times its own package, even beside an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import copies_for, graph_time_ms  # a sibling: benchmarks/ is on sys.path

from vecinfer_compile.ops import reference
from vecinfer_compile.ops.coded_kv import CodedKV
from vecinfer_compile.ops.cuda import decode as cuda_decode
from vecinfer_compile.ops.triton.decode import decode_attention_triton
from vecinfer_compile.presets import get_preset
from vecinfer_compile.quant.byte_centroids import snap_centroids
from vecinfer_compile.quant.packing import pack_codes

HQ, HKV, D, R = 32, 8, 128, 128
CHECK_MAX_T = 32768  # the fp32 reference materialises K and V: checked on the smaller cases


def code_inputs(b: int, t: int, bits: float, g: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """Random inputs ``(q, CodedKV, kv_start, scale)`` of one decode call at ``bits``: codes stored
    as the cache stores them (12-bit codes packed, :mod:`vecinfer_compile.quant.packing`)."""
    preset = get_preset(bits)
    dev = "cuda"
    q = torch.randn(b, HQ, 1, D, device=dev, dtype=dtype, generator=g)
    # 4096-entry books hold 7-bit centroids, as every codebook does (LayerCodebooks snaps them)
    kc = snap_centroids(torch.randn(preset.key.entries, preset.key.dims, device=dev, generator=g))
    vc = snap_centroids(torch.randn(preset.value.entries, preset.value.dims, device=dev, generator=g))
    k_codes = pack_codes(
        torch.randint(0, preset.key.entries, (b, HKV, t, D // preset.key.dims), device=dev, generator=g),
        preset.key.entries,
    )
    v_codes = pack_codes(
        torch.randint(0, preset.value.entries, (b, HKV, t, D // preset.value.dims), device=dev, generator=g),
        preset.value.entries,
    )
    kw = torch.randn(b, HKV, R, D, device=dev, dtype=dtype, generator=g)
    vw = torch.randn(b, HKV, R, D, device=dev, dtype=dtype, generator=g)
    nc = torch.tensor(t - R, device=dev, dtype=torch.int32)
    nw = torch.tensor(R, device=dev, dtype=torch.int32)
    return q, CodedKV(k_codes, v_codes, kc, vc, nc, kw, vw, nw), None, D**-0.5


def sdpa_variants(q, k, v):
    b = q.shape[0]
    packed_q = q.view(b, HKV, HQ // HKV, D)  # GQA: the group's heads as query rows
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):

        def gqa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def packed(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(packed_q, k, v)

        yield f"{backend.name.lower()}-gqa", gqa
        yield f"{backend.name.lower()}-packed", packed


def run_case(
    b: int, t: int, bits: float, triton: bool = True, passes: int = 2, dtype: torch.dtype = torch.bfloat16
) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    row = {"B": b, "T": t, "bits": bits, "dtype": str(dtype).removeprefix("torch.")}
    first = code_inputs(b, t, bits, g, dtype)
    kv = first[1]
    code_bytes = kv.k_codes.nbytes + kv.v_codes.nbytes + kv.k_window.nbytes + kv.v_window.nbytes
    sets = [first] + [code_inputs(b, t, bits, g, dtype) for _ in range(copies_for(code_bytes) - 1)]
    row["code_copies"] = len(sets)
    kernels = {"cuda": cuda_decode.decode_attention_cuda}
    if triton:
        kernels["triton"] = decode_attention_triton
    for _ in range(passes):
        for name, fn in kernels.items():
            ms = graph_time_ms([lambda a=a, fn=fn: fn(*a) for a in sets])
            row[f"{name}_ms"] = min(ms, row.get(f"{name}_ms", ms))
    if t <= CHECK_MAX_T:
        want = reference.decode_attention(*first)
        for name, fn in kernels.items():
            row[f"{name}_max_err"] = (fn(*first).float() - want.float()).abs().max().item()
    del sets, first
    torch.cuda.empty_cache()
    kv_bytes = 2 * b * HKV * t * D * 2
    fp16_sets = []
    for _ in range(copies_for(kv_bytes)):
        fp16_sets.append(
            (
                torch.randn(b, HQ, 1, D, device="cuda", dtype=dtype, generator=g),
                torch.randn(b, HKV, t, D, device="cuda", dtype=dtype, generator=g),
                torch.randn(b, HKV, t, D, device="cuda", dtype=dtype, generator=g),
            )
        )
    best_name, best = None, float("inf")
    variants = [dict(sdpa_variants(*s)) for s in fp16_sets]  # {name: call} per input copy
    for _ in range(passes):
        for name in variants[0]:
            if f"{name}_error" in row:
                continue
            calls = [v[name] for v in variants]
            try:
                ms = graph_time_ms(calls)
            except RuntimeError as exc:  # a backend that does not take this shape
                row[f"{name}_error"] = str(exc).splitlines()[0][:80]
                torch.cuda.synchronize()
                continue
            row[f"{name}_ms"] = ms = min(ms, row.get(f"{name}_ms", ms))
            if ms < best:
                best_name, best = name, ms
    row.update(baseline=best_name, baseline_ms=best, fp16_copies=len(fp16_sets))
    row["fp16_kv_gbps"] = kv_bytes / (best * 1e-3) / 1e9
    for name in kernels:
        row[f"{name}_speedup"] = best / row[f"{name}_ms"]
    del fp16_sets
    torch.cuda.empty_cache()
    return row


def err_text(err: float | None) -> str:
    return "-" if err is None else f"{err:.1e}"


def kernel_resources(bits: float, dtype: torch.dtype = torch.bfloat16) -> str:
    preset = get_preset(bits)
    variant = cuda_decode.Variant(
        D,
        HQ // HKV,
        preset.key.entries,
        preset.key.dims,
        preset.value.entries,
        preset.value.dims,
        dtype == torch.float16,
    )
    device = torch.device("cuda", torch.cuda.current_device())
    builds = [(variant, cuda_decode.kernels_for(variant, device))]
    if cuda_decode.lean_may_gain(variant, builds[0][1]):  # the build long calls may take instead
        lean = dataclasses.replace(variant, lean=True)
        builds.append((lean, cuda_decode.kernels_for(lean, device)))
    return "; ".join(
        f"{'lean build (long calls)' if v.lean else 'kernel'}: {built.kernel.registers} registers, "
        f"{built.kernel.local_bytes} B local, {v.smem_bytes(built.nwarps) // 1024} KiB shared, "
        f"{built.ctas_per_sm} CTAs/SM of {built.nwarps} warps"
        for v, built in builds
    )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--bits", default="2", help="comma-separated presets, e.g. 4,3,2,1.5,1.25,1")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lengths", default="4096,32768,131072")
    ap.add_argument("--no-triton", action="store_true", help="do not time the Triton kernel")
    ap.add_argument(
        "--passes",
        type=int,
        default=2,
        help="time every kernel and FP16 backend this many times in turn and keep each one's fastest",
    )
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float16"),
        default="bfloat16",
        help="queries, windows and the FP16 baseline's K/V (the kernels' tensor-core type)",
    )
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    rows = []
    dtype = getattr(torch, args.dtype)
    print(
        f"# decode attention, {torch.cuda.get_device_name()}, Hq={HQ} Hkv={HKV} D={D} R={R}, {args.dtype}; "
        "ms per call, CUDA-graph replay over L2-defeating input copies, median"
    )
    names = ["cuda"] + (["triton"] if not args.no_triton else [])
    labels = {"cuda": "CUDA", "triton": "Triton"}
    for bits in map(float, args.bits.split(",")):
        print(f"\n{bits:g}-bit CUDA: {kernel_resources(bits, dtype)}")
        print(
            "| bits | B | T | "
            + " | ".join(f"ours {labels[n]} ms" for n in names)
            + " | best FP16 SDPA ms | FP16 backend | "
            + " | ".join(f"{labels[n]} vs FP16" for n in names)
            + " | "
            + " | ".join(f"{labels[n]} max err" for n in names)
            + " |"
        )
        print("|---|---|---|" + "---:|" * len(names) + "---:|---|" + "---:|" * (2 * len(names)))
        for b in map(int, args.batches.split(",")):
            for t in map(int, args.lengths.split(",")):
                r = run_case(b, t, bits, not args.no_triton, args.passes, dtype)
                rows.append(r)
                print(
                    f"| {bits:g} | {b} | {t} | "
                    + " | ".join(f"{r[n + '_ms']:.4f}" for n in names)
                    + f" | {r['baseline_ms']:.4f} | {r['baseline']} | "
                    + " | ".join(f"{r[n + '_speedup']:.2f}x" for n in names)
                    + " | "
                    + " | ".join(err_text(r.get(n + "_max_err")) for n in names)
                    + " |",
                    flush=True,
                )
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
