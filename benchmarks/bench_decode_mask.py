"""Host time of the attention mask generate() builds for each decode step over a VecInferCache:
transformers' ``sdpa_mask`` (what ``"vecinfer_sdpa"`` registered before) against
:func:`vecinfer_compile.hf.decode_mask.decode_sdpa_mask`, side by side in one process.

Each case calls transformers' ``create_masks_for_generate`` for a one-token step of a random
Llama-geometry model (4 layers; the mask does not depend on the weights) over a
``VecInferCache`` of ``--lengths`` slots, with one left-padded row when ``B > 1``, ``--calls``
times per repetition, synchronising the device once per repetition; the median over repetitions is
reported in microseconds per call, and the two masks are checked equal first.

    python benchmarks/bench_decode_mask.py                 # CUDA when available
    python benchmarks/bench_decode_mask.py --smoke         # CPU, tiny: checks the script
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _setup(batch: int, length: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from vecinfer_compile import VecInferCache
    from vecinfer_compile.hf.compat import forward_cache_kwargs
    from vecinfer_compile.testing import random_codebooks

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(device).eval()
    cache = VecInferCache(
        model, random_codebooks(cfg, bits=2), batch_size=batch, max_cache_len=length, residual=8, device=device
    )
    prompt = 16
    ids = torch.randint(0, 128, (batch, prompt), device=device)
    mask = torch.ones(batch, prompt, dtype=torch.long, device=device)
    mask[batch - 1, :3] = 0 if batch > 1 else 1
    with torch.no_grad():
        model(ids, attention_mask=mask, **forward_cache_kwargs(model, cache), use_cache=True)
    step_mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long, device=device)], 1)
    embeds = model.get_input_embeddings()(ids[:, -1:])
    position = torch.tensor([prompt], device=device)
    return model, cache, step_mask, embeds, position


def _make_call(model, cache, step_mask, embeds, position):
    from transformers.masking_utils import create_masks_for_generate

    def call():  # positional: transformers 5.17 names the cache past_key_values, 5.24 cache
        return create_masks_for_generate(model.config, embeds, step_mask, cache, position[None])

    return call


def time_us(call, calls: int, reps: int, sync) -> float:
    samples = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        samples.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(samples)


def main(argv=None) -> list[dict]:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from vecinfer_compile.hf.attention_over_codes import ATTN_NAME
    from vecinfer_compile.hf.decode_mask import decode_sdpa_mask

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    ap.add_argument("--lengths", default="4096,131072", help="comma-separated cache slots (default 4096,131072)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed repetition (default 200)")
    ap.add_argument("--reps", type=int, default=9, help="repetitions; the median is kept (default 9)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--smoke", action="store_true", help="CPU, small: checks the script, not speed")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.lengths, args.calls, args.reps, args.device = "2", "64", 5, 2, "cpu"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    print(
        f"# create_masks_for_generate per one-token step over a VecInferCache, {device}, "
        f"{args.calls} calls x {args.reps} repetitions (median), us per call"
    )
    print("| B | slots | sdpa_mask us | decode_sdpa_mask us | sdpa_mask / ours |")
    print("|---|---|---:|---:|---:|")
    mapping = AttentionMaskInterface._global_mapping
    previous = mapping[ATTN_NAME]
    try:
        for b in (int(x) for x in args.batches.split(",")):
            for length in (int(x) for x in args.lengths.split(",")):
                call = _make_call(*_setup(b, length, device))
                times, masks = {}, {}
                for name, fn in (("sdpa_mask", sdpa_mask), ("ours", decode_sdpa_mask)):
                    mapping[ATTN_NAME] = fn
                    masks[name] = call()
                    time_us(call, args.calls, 1, sync)  # warm-up
                for _ in range(2):  # alternate, so drift hits both
                    for name, fn in (("sdpa_mask", sdpa_mask), ("ours", decode_sdpa_mask)):
                        mapping[ATTN_NAME] = fn
                        times.setdefault(name, []).append(time_us(call, args.calls, args.reps, sync))
                if not torch.equal(masks["sdpa_mask"], masks["ours"]):
                    raise RuntimeError(f"masks differ at B={b}, {length} slots")
                base, ours = min(times["sdpa_mask"]), min(times["ours"])
                rows.append({"B": b, "slots": length, "sdpa_mask_us": base, "ours_us": ours})
                print(f"| {b} | {length} | {base:.1f} | {ours:.1f} | {base / ours:.2f}x |", flush=True)
    finally:
        mapping[ATTN_NAME] = previous
    return rows


if __name__ == "__main__":
    main()
