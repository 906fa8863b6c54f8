"""Greedy generation through VecInferCache under transformers' tensor parallelism.

    torchrun --nproc-per-node N examples/tensor_parallel.py --model DIR --codebooks FILE \
        [--device cpu|cuda] [--max-new-tokens K] [--json]

Each rank loads the model with ``tp_plan="auto"`` (needs ``pip install vecinfer_compile[tp]``),
holds its own KV heads in the compressed cache, and runs the decode step compiled by
``vecinfer_backend``. N must divide the model's KV-head count. The codebook file is the one
``vecinfer calibrate`` wrote on one device: it is the same with or without TP. Rank 0 prints the
generated token ids and the cache bytes (this rank's and, by an all-reduce, all ranks'); with
``--json`` one JSON object: ``tokens``, ``kv_bytes_rank``, ``kv_fixed_bytes_rank`` (its codebooks
and key-transform state: the same at any length), ``kv_bytes_total``, ``world_size``,
``decode_rewrites`` (attention calls the backend moved onto the codes).
"""

import argparse
import json
import os
import warnings

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

import vecinfer_compile as vc
from vecinfer_compile.evaluation.kv_bytes import cache_bytes

PROMPT = "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith,"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--codebooks", required=True, help="codebook file from `vecinfer calibrate`")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--residual", type=int, default=128, help="most recent tokens kept in full precision")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="weights and activations (default: bfloat16 on cuda, float32 on cpu)",
    )
    p.add_argument("--eager", action="store_true", help="run the decode step eagerly (no torch.compile)")
    p.add_argument("--json", action="store_true", help="print one JSON object on rank 0")
    args = p.parse_args()

    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    # tp_plan="auto" starts the process group (gloo on CPU, NCCL on CUDA) and shards by heads; with
    # one process it sets nothing up and would load on the CPU, so place the model there ourselves
    one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        **vc.tp_load_kwargs("auto"),
        attn_implementation="sdpa",
        dtype=dtype,
        **({"device_map": args.device} if one_process else {}),
    ).eval()
    codebooks = vc.load_codebooks(args.codebooks)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok(args.prompt, return_tensors="pt").input_ids.to(model.device)

    cache = vc.VecInferCache(
        model, codebooks, batch_size=1, residual=args.residual, max_cache_len=ids.shape[1] + args.max_new_tokens
    )
    kwargs = {}
    if not args.eager:
        config = CompileConfig(backend=vc.vecinfer_backend.configure(codebooks=codebooks), fullgraph=True)
        config._compile_all_devices = True  # generate() compiles the decode step on CUDA only otherwise
        kwargs["compile_config"] = config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes, once per rank
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **vc.cache_kwargs(cache),
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    tokens = out[0, ids.shape[1] :].tolist()
    total = cache.total_kv_bytes()  # a collective: every rank calls it
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        report = {
            "tokens": tokens,
            "kv_bytes_rank": cache.kv_bytes(),
            "kv_fixed_bytes_rank": cache_bytes(cache).fixed,
            "kv_bytes_total": total,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "decode_rewrites": counters["vecinfer"]["cache_decode_rewrites"],
        }
        if args.json:
            print(json.dumps(report))
        else:
            print("tokens:", tokens)
            print(
                f"cache: {report['kv_bytes_rank']:,} bytes on rank 0 ({report['kv_fixed_bytes_rank']:,} of "
                f"them fixed: codebooks and key transform, float32), {total:,} on all {report['world_size']} ranks"
            )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
