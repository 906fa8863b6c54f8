"""Decode attention: VecInfer over 2-bit codes vs the fastest FP16 SDPA backend, side by side.

Llama-3.1-8B geometry (32 query heads, 8 KV heads, head_dim 128, bf16), one new token per
sequence, residual window R=128. For every (B, T) it times, in the same process and on the same
GPU: ours with both key-scoring variants (in-register dequantization and the per-query lookup
table), and torch SDPA over bf16 K/V with the flash and the cuDNN backends, each in its two
GQA forms (``enable_gqa=True``, and the group's query heads packed as query rows); the baseline
is the fastest of those. Prints a markdown table with the ratio baseline / ours.

    python benchmarks/bench_decode_attention.py [--batches 1,8,32] [--lengths 4096,32768,131072]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from vecinfer_compile.ops import reference
from vecinfer_compile.ops.triton_decode import DEFAULT_SPLIT, SplitConfig, decode_attention_triton
from vecinfer_compile.presets import get_preset

HQ, HKV, D, R = 32, 8, 128, 128
CHECK_MAX_T = 32768
SWEEP = [SplitConfig(block_n=n, num_warps=w, num_stages=st, waves=wv)
         for n, w, st, wv in ((64, 4, 2, 3), (128, 4, 2, 3), (128, 8, 2, 3), (64, 4, 3, 6),
                              # num_stages=1: plain vector loads for the centroid gathers; with
                              # pipelining Triton turns them into 8-byte cp.async copies
                              (64, 4, 1, 3), (32, 4, 1, 6), (128, 8, 1, 3), (64, 8, 1, 6))]


def bench(fn) -> float:
    """Median milliseconds (triton.testing.do_bench: warm-up, L2 flushed between runs)."""
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


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


def run_case(b: int, t: int, bits: float, sweep: bool = False) -> dict:
    preset = get_preset(bits)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    kc = torch.randn(preset.key.entries, preset.key.dims, device=dev, generator=g)
    vc = torch.randn(preset.value.entries, preset.value.dims, device=dev, generator=g)
    code = torch.uint8 if preset.key.entries <= 256 else torch.int16
    n_coded = t - R
    k_codes = torch.randint(0, preset.key.entries, (b, HKV, t, D // preset.key.dims), device=dev, generator=g).to(code)
    v_codes = torch.randint(0, preset.value.entries, (b, HKV, t, D // preset.value.dims), device=dev, generator=g).to(code)
    kw = torch.randn(b, HKV, R, D, device=dev, dtype=torch.bfloat16, generator=g)
    vw = torch.randn(b, HKV, R, D, device=dev, dtype=torch.bfloat16, generator=g)
    nc = torch.tensor(n_coded, device=dev, dtype=torch.int32)
    nw = torch.tensor(R, device=dev, dtype=torch.int32)
    row = {"B": b, "T": t, "bits": bits}
    for score in ("dequant", "lut"):
        times = {}
        for cfg in (SWEEP if sweep else [DEFAULT_SPLIT]):
            times[cfg] = bench(lambda: decode_attention_triton(
                q, k_codes, v_codes, kc, vc, nc, kw, vw, nw, None, D**-0.5, score=score, config=cfg))
        best_cfg = min(times, key=times.get)
        row[f"ours_{score}_ms"] = times[best_cfg]
        row[f"ours_{score}_config"] = f"n{best_cfg.block_n}w{best_cfg.num_warps}s{best_cfg.num_stages}x{best_cfg.waves}"
        row[f"ours_{score}_default_ms"] = times.get(DEFAULT_SPLIT)
        if t <= CHECK_MAX_T:  # the fp32 reference materialises K and V: checked on the smaller cases
            got = decode_attention_triton(q, k_codes, v_codes, kc, vc, nc, kw, vw, nw, None, D**-0.5,
                                          score=score, config=best_cfg)
            want = reference.decode_attention(q, k_codes, v_codes, kc, vc, nc, kw, vw, nw, None, D**-0.5)
            row[f"ours_{score}_max_err"] = (got.float() - want.float()).abs().max().item()
    del k_codes, v_codes
    k = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
    best_name, best = None, float("inf")
    for name, fn in sdpa_variants(q, k, v):
        try:
            ms = bench(fn)
        except RuntimeError as exc:  # a backend that does not take this shape
            row[f"{name}_error"] = str(exc).splitlines()[0][:80]
            continue
        row[f"{name}_ms"] = ms
        if ms < best:
            best_name, best = name, ms
    row["baseline"] = best_name
    row["baseline_ms"] = best
    row["fp16_kv_gbps"] = 2 * b * HKV * t * D * 2 / (best * 1e-3) / 1e9
    ours = min(row["ours_dequant_ms"], row["ours_lut_ms"])
    row["ours_ms"] = ours
    row["speedup"] = best / ours
    del k, v
    torch.cuda.empty_cache()
    return row


def err_text(err: float | None) -> str:
    return "-" if err is None else f"{err:.1e}"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lengths", default="4096,32768,131072")
    ap.add_argument("--bits", type=float, default=2.0)
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--sweep", action="store_true", help="time several launch shapes of ours, keep the best")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    rows = []
    print(f"# decode attention, {torch.cuda.get_device_name()}, Hq={HQ} Hkv={HKV} D={D} R={R}, "
          f"bf16, {args.bits:g}-bit codes; times are medians in ms")
    print("| B | T | ours dequant | ours LUT | best FP16 SDPA | backend | FP16 GB/s | speedup | config | max err vs reference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b in map(int, args.batches.split(",")):
        for t in map(int, args.lengths.split(",")):
            r = run_case(b, t, args.bits, args.sweep)
            rows.append(r)
            print(f"| {b} | {t} | {r['ours_dequant_ms']:.3f} | {r['ours_lut_ms']:.3f} | "
                  f"{r['baseline_ms']:.3f} | {r['baseline']} | {r['fp16_kv_gbps']:.0f} | "
                  f"{r['speedup']:.2f}x | {r['ours_dequant_config']} | {err_text(r.get('ours_dequant_max_err'))} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
