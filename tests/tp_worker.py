"""Run by tests/test_tensor_parallel.py under ``torchrun --nproc-per-node 2``: on the tiny model
loaded with ``tp_plan="auto"`` (gloo), greedy tokens through VecInferCache with the decode step
eager, and the backend's simulate-path logits of one forward. Rank 0 saves both to ``OUT``.

    torchrun --nproc-per-node 2 tests/tp_worker.py MODEL_DIR CODEBOOKS PROMPT_IDS OUT
"""

import sys
import warnings

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

import vecinfer_compile as vc

RESIDUAL, NEW_TOKENS = 4, 8


def main(model_dir: str, codebooks_path: str, prompt: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, tp_plan="auto", attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    cb = vc.load_codebooks(codebooks_path)
    ids = torch.tensor([[int(t) for t in prompt.split(",")]])
    cache = vc.VecInferCache(model, cb, batch_size=1, max_cache_len=ids.shape[1] + NEW_TOKENS, residual=RESIDUAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokens = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **vc.cache_kwargs(cache),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    compiled = torch.compile(model, backend=vc.vecinfer_backend.configure(codebooks=cb), fullgraph=True)
    with torch.no_grad():
        logits = compiled(ids).logits
    if dist.get_rank() == 0:
        torch.save(
            {
                "tokens": tokens[0, ids.shape[1] :],
                "logits": logits,
                "sdpa_rewrites": counters["vecinfer"]["sdpa_rewrites"],
                "kv_heads": cache.layers[0].num_heads,
                "lam": cache.layers[0].quantizer.lam,
            },
            out,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
