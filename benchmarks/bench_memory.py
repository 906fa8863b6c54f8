"""KV-cache memory: VecInferCache (2-bit codes + R=128 window) vs HF DynamicCache and StaticCache.

Llama-3.1-8B geometry (32 layers, 8 KV heads, head_dim 128), bf16, batch B (default 1). For every
context length T each cache is filled with T tokens of random K/V through its own ``update()``,
layer by layer, in prefill-sized chunks (default 8192 tokens): for VecInferCache the first chunk is
its prefill (encoded at once), later chunks are appended. No model is loaded: the numbers are the
cache alone. Measured per cache, in one process:

- KV bytes: what the cache holds (ours: ``kv_bytes()`` = codes + windows + codebooks + smoothing
  + rotation + counters; HF: its K/V tensors); FP16 bytes = 2 x B x H x T x D x 2 B x layers.
  Ours is also split (:func:`vecinfer_compile.evaluation.kv_bytes.cache_bytes`) into its fixed
  state (float32 codebooks, smoothing factors, rotation, query-aware matrices, key means: the same
  at every length; ``ours_fixed_bytes``) and what grows with tokens and batch (codes, window,
  counters; ``ours_token_bytes``). ``--method qaware`` shows the query-aware matrices' cost (two
  ``[D, D]`` per KV head and layer: 32 MiB at 8B geometry).
- peak: ``torch.cuda.max_memory_allocated`` during construction + fill, minus what was allocated
  before (the random K/V chunk); it includes the transient tensors of the fill path (ours: the
  dequantized cache view that an eager ``update()`` returns, one layer at a time; dynamic: the
  ``torch.cat`` copy of one layer).
- resident: ``torch.cuda.memory_allocated`` after the fill, minus the same base.

    python benchmarks/bench_memory.py [--lengths 4096,32768,131072] [--batch 1] [--chunk 8192] [--method qaware]
    python benchmarks/bench_memory.py --smoke     # tiny config on the CPU (bytes only)

Target (the issue): ours <= 0.14x FP16 for T >= 32k.
"""

from __future__ import annotations

import argparse

import bench_common as C  # a sibling: benchmarks/ is on sys.path (script dir, or `vecinfer bench`)
import torch
from transformers import DynamicCache, StaticCache

from vecinfer_compile.evaluation.kv_bytes import cache_bytes
from vecinfer_compile.methods import VQ_METHODS

TARGET_RATIO = 0.14
METHODS = ("ours", "dynamic", "static")


def make_cache(method: str, setup, codebooks, batch: int, length: int, residual: int):
    if method == "ours":
        from vecinfer_compile.cache import VecInferCache

        return VecInferCache(
            setup.config,
            codebooks,
            batch_size=batch,
            max_cache_len=length,
            residual=residual,
            dtype=setup.dtype,
            device=setup.device,
        )
    if method == "dynamic":
        return DynamicCache(config=setup.config)
    if method == "static":
        return StaticCache(config=setup.config, max_cache_len=length)
    raise ValueError(method)


def fill(cache, keys: torch.Tensor, values: torch.Tensor, length: int, num_layers: int) -> None:
    """Append ``length`` tokens per layer in chunks of ``keys.shape[2]`` (chunk-major, as a
    chunked prefill does). The tensors ``update()`` returns are dropped at once."""
    chunk = keys.shape[2]
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        k, v = (keys, values) if n == chunk else (keys[:, :, :n].contiguous(), values[:, :, :n].contiguous())
        for layer in range(num_layers):
            out = cache.update(k, v, layer)
            del out


def hf_kv_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def measure(method: str, setup, codebooks, keys, values, batch: int, length: int, residual: int) -> dict:
    dev = setup.device
    C.free_memory(dev)
    base = C.allocated(dev)
    C.reset_peak(dev)
    cache = make_cache(method, setup, codebooks, batch, length, residual)
    fill(cache, keys, values, length, setup.config.num_hidden_layers)
    C.sync(dev)
    row = {"method": method}
    row["kv_bytes"] = cache.kv_bytes() if method == "ours" else hf_kv_bytes(cache)
    if method == "ours":
        split = cache_bytes(cache)
        row["fixed_bytes"], row["token_bytes"] = split.fixed, split.codes + split.window
    seq = cache.get_seq_length(0)
    row["tokens"] = int(seq)
    if base is not None:
        row["peak_bytes"] = C.peak(dev) - base
        row["resident_bytes"] = C.allocated(dev) - base
    del cache
    C.free_memory(dev)
    return row


def run_length(setup, codebooks, batch: int, length: int, chunk: int, residual: int) -> dict:
    cfg = setup.config
    heads, head_dim, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    gen = torch.Generator(device=setup.device).manual_seed(length)
    chunk = min(chunk, length)
    keys = torch.randn(batch, heads, chunk, head_dim, device=setup.device, dtype=setup.dtype, generator=gen)
    values = torch.randn(batch, heads, chunk, head_dim, device=setup.device, dtype=setup.dtype, generator=gen)
    elem = torch.empty((), dtype=torch.float16).element_size()
    row = {
        "B": batch,
        "T": length,
        "chunk": chunk,
        "residual": residual,
        "fp16_bytes": 2 * batch * heads * length * head_dim * elem * layers,
    }
    for method in METHODS:
        try:
            r = measure(method, setup, codebooks, keys, values, batch, length, residual)
        except Exception as exc:  # e.g. OOM: report it and go on with the others
            row[f"{method}_error"] = C.short_error(exc)
            del exc
            C.free_memory(setup.device)
            continue
        if r["tokens"] != length:
            row[f"{method}_error"] = f"holds {r['tokens']} tokens, expected {length}"
        for key in ("kv_bytes", "fixed_bytes", "token_bytes", "peak_bytes", "resident_bytes"):
            if key in r:
                row[f"{method}_{key}"] = r[key]
    del keys, values
    C.free_memory(setup.device)
    if "ours_kv_bytes" in row:
        row["ratio"] = row["ours_kv_bytes"] / row["fp16_bytes"]
    return row


def _cell(row: dict, method: str, key: str) -> str:
    if f"{method}_error" in row and f"{method}_{key}" not in row:
        return f"error: {row[f'{method}_error']}"
    return C.gib(row.get(f"{method}_{key}"))


def format_row(row: dict) -> str:
    ratio = row.get("ratio")
    ok = "" if ratio is None or row["T"] < 32768 else (" ok" if ratio <= TARGET_RATIO else " MISS")
    peaks = [_cell(row, m, "peak_bytes") for m in METHODS]
    rel = ""
    if "ours_peak_bytes" in row and row.get("static_peak_bytes"):
        rel = f"{row['ours_peak_bytes'] / row['static_peak_bytes']:.3f}x"
    return (
        f"| {row['T']} | {row['B']} | {C.human_bytes(row.get('ours_kv_bytes'))} | "
        f"{C.human_bytes(row.get('ours_fixed_bytes'))} | {C.human_bytes(row.get('ours_token_bytes'))} | "
        f"{C.human_bytes(row['fp16_bytes'])} | "
        f"{'n/a' if ratio is None else f'{ratio:.4f}x'}{ok} | "
        f"{' | '.join(peaks)} | {rel} | {_cell(row, 'ours', 'resident_bytes')} |"
    )


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--lengths", default=None, help="context lengths T (default 4096,32768,131072; smoke 64,200)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per update() (default 8192; smoke 48)")
    ap.add_argument("--bits", type=float, default=2.0)
    ap.add_argument(
        "--method",
        choices=list(VQ_METHODS),
        default="vecinfer",
        help="the codebooks' method (random codebooks: memory only); qaware adds two "
        "[D, D] matrices per KV head and layer to the fixed state",
    )
    ap.add_argument("--residual", type=int, default=None, help="full-precision window R (default 128; smoke 16)")
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU: checks the script, not memory")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", help="also write the rows to this JSON file (after every row)")
    args = ap.parse_args(argv)
    setup = C.bench_setup(args.smoke, args.device)
    lengths = C.parse_ints(args.lengths or ("64,200" if args.smoke else "4096,32768,131072"))
    chunk = args.chunk or (48 if args.smoke else 8192)
    residual = args.residual if args.residual is not None else (16 if args.smoke else 128)
    codebooks = C.random_codebooks(setup.config, args.bits, args.method)
    print(
        f"# KV cache memory, {setup.label}; ours = VecInferCache {args.method} {args.bits:g}-bit, R={residual}; "
        f"filled through update() in chunks of {chunk} tokens; peak/resident = cache alone "
        f"(max_memory_allocated / memory_allocated minus the base), no model weights; ours KV = "
        f"fixed (float32 codebooks and key-transform state, the same at every length) + codes and window"
    )
    print(
        "| T | B | ours KV | ours fixed | ours codes+window | FP16 KV | ours/FP16 | peak ours | peak dynamic | "
        "peak static | peak ours/static | resident ours |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for length in lengths:
        row = run_length(setup, codebooks, args.batch, length, chunk, residual)
        rows.append(row)
        print(format_row(row), flush=True)
        if args.json:  # rewritten after every row: partial results survive a kill
            C.write_json(args.json, rows)
    long_rows = [r for r in rows if r["T"] >= 32768 and "ratio" in r]
    if long_rows:
        worst = max(r["ratio"] for r in long_rows)
        verdict = "met" if worst <= TARGET_RATIO else "NOT met"
        print(f"\ntarget ours <= {TARGET_RATIO}x FP16 for T >= 32k: {verdict} (worst {worst:.4f}x)", flush=True)
    return rows


if __name__ == "__main__":
    main()
