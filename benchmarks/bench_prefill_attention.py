"""Chunk attention over a compressed cache (a chunked prefill's attention) vs FP16 FlashAttention-2, side by side.

One layer's attention of a chunk of ``C`` new tokens entering a cache that holds ``T`` coded
positions and a full window of ``R = 128``, Llama-3.1-8B geometry (32 query heads, 8 KV heads,
head_dim 128, bf16), 2-bit codes by default:

- ours: what an eager chunk over a :class:`~vecinfer_compile.VecInferCache` runs on CUDA
  (:meth:`VecInferLayer.attend_chunk <vecinfer_compile.cache.VecInferLayer.attend_chunk>` after its
  mask check, no padding): the query-side transform (``lam``, Hadamard) and
  :func:`vecinfer_compile.ops.split_attention.chunk.split_flash`: the coded prefix dequantized a few rows
  at a time (the CUDA kernel, :mod:`vecinfer_compile.ops.cuda.dequant`) and read by cuDNN attention
  (non-causal, GQA in the kernel), the window and the chunk through FlashAttention-2 (causal),
  merged by log-sum-exp. With ``--codec trellis`` the codes are the trellis codec's (a random codec
  of ``2^L`` states, any string a valid code): the workspace holds their unit entries (the Triton
  kernel ``entries_into``) and the prefix attends in the components.
- FP16: FlashAttention-2 (``aten._flash_attention_forward``, GQA in the kernel) of the same
  queries over the same ``T + R + C`` keys in bf16, causal with the chunk's offset (bottom-right):
  what a full-precision cache's chunk attention runs (the ``fp16`` baseline of
  ``bench_generate.py`` calls the same kernel).

Timing: each method captured in a CUDA graph over input copies that together exceed the L2
(:func:`bench_common.graph_time_ms`), median replay ms per call. ``FP16 / ours`` > 1 means ours is
faster. Ours' two main stages are timed alone too, with the kernels ours runs (the dequantization
of every row's prefix, K and V; the prefix attention over a ready workspace); the rest of ours is
the window attention, the merge and the query transform. ``TFLOP/s`` is the FP16 kernel's rate on the chunk's causal FLOPs
(``4 B Hq C (T + R + C / 2) D``). On the smaller cases ours is checked against the float32 oracle
(:func:`~vecinfer_compile.ops.split_attention.chunk.reference`).

    python benchmarks/bench_prefill_attention.py [--chunks 512,2048,4096] [--lengths 8192,32768,131072]
        [--batches 1,8] [--bits 2] [--codec codebooks|trellis] [--trellis-states 1024]
        [--prefix-kernel auto|cudnn|flash] [--dequantize auto|cuda|triton] [--json OUT.json]
"""

from __future__ import annotations

import argparse

import torch
from bench_common import copies_for, graph_time_ms, trellis_states, write_json  # a sibling: benchmarks/ is on sys.path

from vecinfer_compile.codecs.trellis.code import random_code as random_trellis_codec
from vecinfer_compile.codecs.trellis.operands import TrellisOperands
from vecinfer_compile.codecs.trellis.packing import packed_bytes
from vecinfer_compile.codecs.trellis.prefix import TrellisPrefix
from vecinfer_compile.ops import reference
from vecinfer_compile.ops.cuda import dequant as cuda_dequant
from vecinfer_compile.ops.decode_inputs import transform_queries
from vecinfer_compile.ops.dequantize import dequantize_into
from vecinfer_compile.ops.split_attention import chunk as ca
from vecinfer_compile.ops.split_attention.prefix import CodebookPrefix
from vecinfer_compile.ops.triton.dequant import dequantize_triton
from vecinfer_compile.presets import get_preset
from vecinfer_compile.quant import hadamard_matrix
from vecinfer_compile.quant.packing import pack_codes

HQ, HKV, D, R = 32, 8, 128, 128
CHECK_MAX_SCORES = 2**28  # the float32 oracle materialises [B, Hq, C, L] scores: checked below this


class ChosenCodebookPrefix(CodebookPrefix):
    """The codebooks' prefix dequantized by the kernel ``--dequantize`` names."""

    def fill(self, k_codes, v_codes, length, k_out, v_out):
        dequantize = DEQUANTIZE[CHOICE["dequantize"]]
        dequantize(k_codes, self.key_centroids.to(k_out.dtype).contiguous(), length, k_out)
        dequantize(v_codes, self.value_centroids.to(v_out.dtype).contiguous(), length, v_out)


def our_inputs(b: int, t: int, c: int, bits: float, g: torch.Generator):
    """One layer's state and a chunk: ``(q, keys, lam, rotation)`` with random codes and their codec
    (``CHOICE["codec"]``: centroids, or random trellis codecs of ``CHOICE["states"]`` states)."""
    dev = "cuda"
    if CHOICE["codec"] == "trellis":
        cpu = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), device=dev, generator=g)))
        codecs = [random_trellis_codec(cpu, HKV, D, bits, CHOICE["states"].bit_length() - 1) for _ in range(2)]
        nbytes = packed_bytes(codecs[0].bits)
        k_codes, v_codes = (
            torch.randint(0, 256, (b, HKV, t, nbytes), device=dev, generator=g, dtype=torch.uint8) for _ in range(2)
        )
        prefix = TrellisPrefix(*(TrellisOperands.of(codec, dev) for codec in codecs))
    else:
        preset = get_preset(bits)

        def codes(book):
            return pack_codes(
                torch.randint(0, book.entries, (b, HKV, t, D // book.dims), device=dev, generator=g), book.entries
            )

        k_codes, v_codes = codes(preset.key), codes(preset.value)
        prefix = ChosenCodebookPrefix(
            torch.randn(preset.key.entries, preset.key.dims, device=dev, generator=g),
            torch.randn(preset.value.entries, preset.value.dims, device=dev, generator=g),
        )
    keys = ca.ChunkKeys(
        k_codes,
        v_codes,
        prefix,
        t,
        torch.randn(b, R + c, HKV, D, device=dev, dtype=torch.bfloat16, generator=g),
        torch.randn(b, R + c, HKV, D, device=dev, dtype=torch.bfloat16, generator=g),
    )
    q = torch.randn(b, HQ, c, D, device=dev, dtype=torch.bfloat16, generator=g)
    lam = torch.rand(HKV, D, device=dev, generator=g) + 0.5
    return q, keys, lam, hadamard_matrix(D, torch.float32, dev)


DEQUANTIZE = {"auto": dequantize_into, "cuda": cuda_dequant.dequantize_cuda, "triton": dequantize_triton}
PREFIX = {"auto": None, "cudnn": "cudnn", "flash": "flash"}
CHOICE = {"dequantize": "auto", "prefix": "auto", "codec": "codebooks", "states": 1024}  # the options


def ours(q, keys, lam, rotation):
    return ca.split_flash(
        transform_queries(q, lam, rotation), keys, None, D**-0.5, prefix_kernel=PREFIX[CHOICE["prefix"]]
    )


def fp16_inputs(b: int, t: int, c: int, g: torch.Generator):
    """Queries ``[B, C, Hq, D]`` and K/V ``[B, T + R + C, Hkv, D]`` in bf16 (the layout the kernel reads)."""
    n = t + R + c
    return (
        torch.randn(b, c, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g),
        torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g),
        torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g),
    )


def fp16(q, k, v):
    return torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False, scale=D**-0.5
    )[0]


def parts(q, keys):
    """Ours' two main stages alone, with the kernels ours picks: (decode every row's prefix into the
    workspace, the prefix attention over a ready workspace), as calls for the timer, and that
    kernel's name."""
    b, t, c, dt = q.shape[0], keys.n_coded, q.shape[2], q.dtype
    work_k = torch.empty(b, t, HKV, D, dtype=dt, device="cuda")
    work_v = torch.empty_like(work_k)
    kernel = PREFIX[CHOICE["prefix"]] or ("cudnn" if ca.cudnn_prefix_serves(q) else "flash")
    qv = q.transpose(1, 2).reshape(-1, HQ, D).contiguous()
    cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32) * c
    cu_k = torch.arange(b + 1, device="cuda", dtype=torch.int32) * t
    used = torch.full((b,), t, device="cuda", dtype=torch.int32)

    def dequant():
        keys.prefix.fill(keys.k_codes, keys.v_codes, t, work_k, work_v)

    def prefix():
        if kernel == "cudnn":
            ca.cudnn_prefix(
                qv.view(b, c, HQ, D).transpose(1, 2), work_k.transpose(1, 2), work_v.transpose(1, 2), D**-0.5
            )
        else:
            ca.flash_varlen(
                qv, work_k.view(b * t, HKV, D), work_v.view(b * t, HKV, D), cu_q, cu_k, used, c, t, False, D**-0.5
            )

    return dequant, prefix, kernel


def run_case(b: int, t: int, c: int, bits: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    row = {"B": b, "T": t, "C": c, "bits": bits}
    first = our_inputs(b, t, c, bits, g)
    code_bytes = first[1].k_codes.nbytes * 2 + first[1].k_full.nbytes * 2
    sets = [first] + [our_inputs(b, t, c, bits, g) for _ in range(copies_for(code_bytes) - 1)]
    row["ours_ms"] = graph_time_ms([lambda s=s: ours(*s) for s in sets])
    dequant, prefix, row["prefix_kernel"] = parts(first[0], first[1])
    row["dequant_ms"] = graph_time_ms([dequant])
    row["prefix_ms"] = graph_time_ms([prefix])
    if b * HQ * c * (t + R + c) <= CHECK_MAX_SCORES:
        q, keys, lam, rot = first
        q_t = transform_queries(q, lam, rot)
        want = reference.chunk_attention(q_t.float(), keys, None, D**-0.5)
        row["max_err"] = (ours(*first).float() - want).abs().max().item()
    del sets, first, dequant, prefix
    torch.cuda.empty_cache()
    first = fp16_inputs(b, t, c, g)
    sets = [first] + [fp16_inputs(b, t, c, g) for _ in range(copies_for(first[1].nbytes * 2) - 1)]
    row["fp16_ms"] = graph_time_ms([lambda s=s: fp16(*s) for s in sets])
    del sets, first
    torch.cuda.empty_cache()
    flops = 4 * b * HQ * c * (t + R + c / 2) * D
    row["fp16_tflops"] = flops / (row["fp16_ms"] * 1e-3) / 1e12
    row["speedup"] = row["fp16_ms"] / row["ours_ms"]
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--chunks", default="512,2048,4096", help="chunk lengths C")
    ap.add_argument("--lengths", default="8192,32768,131072", help="coded prefix lengths T")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--bits", type=float, default=2.0)
    ap.add_argument(
        "--codec",
        choices=["codebooks", "trellis"],
        default="codebooks",
        help="the codes' codec: the codebooks' (the preset's books) or the trellis codec's",
    )
    ap.add_argument(
        "--trellis-states", type=trellis_states, default=1024, help="the trellis codec's states (a power of two)"
    )
    ap.add_argument(
        "--prefix-kernel",
        choices=sorted(PREFIX),
        default="auto",
        help="ours' prefix attention: cuDNN, FlashAttention-2 varlen, or the product's choice (auto)",
    )
    ap.add_argument(
        "--dequantize",
        choices=sorted(DEQUANTIZE),
        default="auto",
        help="ours' prefix dequantization kernel (auto: the product's choice, CUDA where it builds)",
    )
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    CHOICE.update(dequantize=args.dequantize, prefix=args.prefix_kernel, codec=args.codec, states=args.trellis_states)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    codec = (
        f"trellis codec, {args.trellis_states} states"
        if args.codec == "trellis"
        else f"codebooks, dequantize {args.dequantize}"
    )
    print(
        f"# chunk attention over a compressed cache, {torch.cuda.get_device_name()}, Hq={HQ} Hkv={HKV} D={D} "
        f"R={R}, bf16, {args.bits:g}-bit codes ({codec}); ours: prefix kernel {args.prefix_kernel}; ms per "
        f"call (one layer), CUDA-graph replay, median"
    )
    print(
        "| B | T | C | FP16 flash ms | ours ms | FP16 / ours | ours: dequantize ms | ours: prefix attention ms "
        "(kernel) | FP16 TFLOP/s | max err |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for b in map(int, args.batches.split(",")):
        for t in map(int, args.lengths.split(",")):
            for c in map(int, args.chunks.split(",")):
                r = run_case(b, t, c, args.bits)
                rows.append(r)
                err = f"{r['max_err']:.1e}" if "max_err" in r else "-"
                print(
                    f"| {b} | {t} | {c} | {r['fp16_ms']:.3f} | {r['ours_ms']:.3f} | {r['speedup']:.2f}x | "
                    f"{r['dequant_ms']:.3f} | {r['prefix_ms']:.3f} ({r['prefix_kernel']}) | {r['fp16_tflops']:.0f} | "
                    f"{err} |",
                    flush=True,
                )
                if args.json:
                    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
