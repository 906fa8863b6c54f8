"""Generate with the compressed VecInfer cache (2-bit codes + a full-precision window).

Runs offline on the tiny model shipped in the package; pass a model directory and a codebook
file (from `vecinfer calibrate`) to use your own:

    python examples/generate_with_cache.py [MODEL_DIR CODEBOOKS]
"""

import sys
from importlib.resources import files

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import vecinfer_compile as vc
from vecinfer_compile.evaluation.kv_bytes import cache_bytes

data = files("vecinfer_compile") / "data"
model_dir = sys.argv[1] if len(sys.argv) > 1 else str(data / "tiny")
codebooks = sys.argv[2] if len(sys.argv) > 2 else str(data / "tiny_codebooks" / "vecinfer-2bit.safetensors")

tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
cb = vc.load_codebooks(codebooks)

ids = tok("It was a bright cold day in April, and", return_tensors="pt").input_ids
cache = vc.VecInferCache(model, cb, max_cache_len=ids.shape[1] + 48, residual=16)
# cache= on transformers >= 5.24 (past_key_values= before): cache_kwargs picks the keyword.
# defer_stop_check: on CUDA, generate() queues the next step while the GPU runs this one instead
# of syncing every step (the same tokens); on the CPU transformers keeps its loop as it is.
with vc.defer_stop_check():
    out = model.generate(ids, **vc.cache_kwargs(cache), max_new_tokens=48, do_sample=False)
print(tok.decode(out[0]))
held = cache_bytes(cache)  # fixed state apart from what grows with tokens
print(
    f"cache holds {cache.kv_bytes():,} bytes: {held.fixed:,} fixed (float32 codebooks and key transform, "
    f"the same at any length) + {held.codes + held.window:,} of codes and window; a full-precision "
    f"cache would hold {cache.fp_kv_bytes():,}"
)
