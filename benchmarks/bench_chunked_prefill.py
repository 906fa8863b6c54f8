"""A chunked prefill through a VecInferCache, compiled vs eager, side by side.

``model.generate(ids, max_new_tokens=1, prefill_chunk_size=C)`` over a
:class:`~vecinfer_compile.VecInferCache` (random 2-bit codebooks, window ``R = 128``), timed two ways
in one run on one random-weight model (Llama-3.1-8B geometry, ``--layers`` of its layers, bf16):

- ``eager``: ``disable_compile=True``. The model attends through ``"vecinfer_sdpa"``, so every chunk
  after the first reads the coded prefix by the chunk attention of
  :mod:`vecinfer_compile.ops.split_attention.chunk` (its CUDA path: the prefix dequantized into a
  workspace and read by cuDNN / FlashAttention-2, the window and chunk by FlashAttention-2).
- ``compiled``: ``compile_config=CompileConfig(backend=vecinfer_backend.configure(codebooks=...),
  fullgraph=True)``, what ``generate`` runs on CUDA with a compileable cache (HF's default mode,
  ``reduce-overhead``). Each chunk is one compiled graph; the backend rewrites each chunk's
  attention to ``vecinfer::chunk_attention`` over the codes.

Both prefill the same prompt (the first chunk in full precision, the rule of
:mod:`vecinfer_compile.window` after it) and must give the same first token. Timing: the whole
``generate`` call between two CUDA events (the prompt's chunks and the one new token), after
``--warmup`` calls (compilation, autotuning), the median of ``--repeats``; ``compiled / eager``
is the ratio of the medians.

    python benchmarks/bench_chunked_prefill.py [--batch 1] [--length 32768] [--chunk 4096]
        [--layers 8] [--repeats 5] [--json OUT.json]
    python benchmarks/bench_chunked_prefill.py --smoke        (tiny model on the CPU: checks the script)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package first

from bench_common import bench_setup, build_model, sync, write_json  # noqa: E402  (a sibling module)
from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from vecinfer_compile import VecInferCache, vecinfer_backend  # noqa: E402
from vecinfer_compile.commands.arguments import count  # noqa: E402
from vecinfer_compile.hf.compat import cache_kwargs  # noqa: E402
from vecinfer_compile.presets import PRESETS  # noqa: E402
from vecinfer_compile.testing import random_codebooks  # noqa: E402

RESIDUAL = 128


def prefill_once(model, ids: torch.Tensor, cache: VecInferCache, chunk: int, compile_config) -> tuple[float, int]:
    """``(seconds, first new token of row 0)`` of one chunked prefill into an emptied ``cache``."""
    cache.reset()
    kwargs = {"disable_compile": True} if compile_config is None else {"compile_config": compile_config}
    device = ids.device
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=1,
            do_sample=False,
            prefill_chunk_size=chunk,
            **cache_kwargs(cache),
            **kwargs,
        )
    if device.type == "cuda":
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        seconds = time.perf_counter() - t0
    return seconds, int(out[0, -1])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=count(1), default=1)
    ap.add_argument("--length", type=count(2), default=32768, help="prompt tokens")
    ap.add_argument("--chunk", type=count(1), default=4096, help="generate()'s prefill_chunk_size")
    ap.add_argument("--layers", type=count(1), default=8, help="decoder layers of the 8B geometry")
    ap.add_argument("--bits", type=float, default=2.0, choices=sorted(PRESETS), help="a preset's bits")
    ap.add_argument("--warmup", type=count(0), default=2)
    ap.add_argument("--repeats", type=count(1), default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, not speed")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.length, args.chunk, args.warmup, args.repeats = 40, 16, 1, 1
    setup = bench_setup(args.smoke, layers=None if args.smoke else args.layers)
    torch.manual_seed(0)  # the random weights
    model = build_model(setup)
    codebooks = random_codebooks(model.config, args.bits)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length), generator=g).to(setup.device)
    residual = 8 if args.smoke else RESIDUAL
    cache = VecInferCache(
        model, codebooks, batch_size=args.batch, max_cache_len=args.length + 1, residual=residual, device=setup.device
    )
    compiled = CompileConfig(backend=vecinfer_backend.configure(codebooks=codebooks), fullgraph=True)
    if not setup.cuda:
        compiled._compile_all_devices = True  # generate() compiles on CUDA only otherwise
    print(f"{setup.label}; B={args.batch}, T={args.length}, chunks of {args.chunk}, {args.bits:g}-bit, R={residual}")
    rows, tokens = [], {}
    for name, config in (("eager", None), ("compiled", compiled)):
        for _ in range(args.warmup):
            prefill_once(model, ids, cache, args.chunk, config)
        times = []
        for _ in range(args.repeats):
            seconds, tokens[name] = prefill_once(model, ids, cache, args.chunk, config)
            times.append(seconds)
        rows.append(
            {
                "path": name,
                "batch": args.batch,
                "length": args.length,
                "chunk": args.chunk,
                "layers": model.config.num_hidden_layers,
                "median_s": statistics.median(times),
                "times_s": times,
                "first_token": tokens[name],
                "device": setup.label,
                "chunk_rewrites": counters["vecinfer"]["cache_chunk_rewrites"],
                "unfused": counters["vecinfer"]["cache_decode_unfused"],
            }
        )
    eager, comp = rows[0]["median_s"], rows[1]["median_s"]
    print("| path | median s | runs (s) |\n|---|---:|---|")
    for r in rows:
        print(f"| {r['path']} | {r['median_s']:.4f} | {', '.join(f'{t:.4f}' for t in r['times_s'])} |")
    print(
        f"compiled / eager: {comp / eager:.3f}x; first token: eager {tokens['eager']}, compiled {tokens['compiled']}; "
        f"attentions the backend rewrote to the chunk op: {rows[1]['chunk_rewrites']}, "
        f"left over a dequantized read: {rows[1]['unfused']}"
    )
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
