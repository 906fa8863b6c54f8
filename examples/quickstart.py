"""The README's quickstart ("Use it on your own model"), as a script; a test keeps the two identical."""

import torch
from importlib.resources import files
from transformers import AutoModelForCausalLM, AutoTokenizer
import vecinfer_compile as vc

path = str(files("vecinfer_compile") / "data" / "tiny")  # any local HF model directory
text = (files("vecinfer_compile") / "data" / "sample_public_domain.txt").read_text()
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(path)
ids = tok("It was a bright cold day in April, and", return_tensors="pt").input_ids

# 1. calibrate once: smoothing factors and codebooks from your model's post-RoPE keys/values
#    (in sequences of seq_len=1024 tokens: calibrate at the longest context you will run, since
#    positions past it are quantized worse)
cb = vc.calibrate(model, tok, text, bits=2, max_tokens=8192)
cb.save("cb-2bit.safetensors", overwrite=True)

# 2a. simulate (perplexity, any forward-pass task): compiled ...
compiled = torch.compile(model, backend=vc.vecinfer_backend.configure(codebooks="cb-2bit.safetensors"))
with torch.no_grad():
    logits = compiled(ids).logits
# ... or eager, inside a block (the model's own attention again after it); the same numbers as the
#     compiled call (float32: within ~1e-5), every token quantized. With residual=R the last R keys
#     of each query stay in full precision (a prompt shorter than R is then not quantized at all)
with vc.simulation(model, "vecinfer", bits=2, codebooks=cb), torch.no_grad():
    logits = model(ids).logits

# 2b. generate with the compressed cache: codes + the last 128 tokens in full precision. The
#     batch size comes from the prompt; on a GPU the decode step compiles with the backend
#     (the fused kernel over the codes).
from transformers import CompileConfig

cache = vc.VecInferCache(model, cb, max_cache_len=ids.shape[1] + 64)
out = model.generate(
    ids,
    **vc.cache_kwargs(cache),
    max_new_tokens=64,
    do_sample=False,
    compile_config=CompileConfig(backend=vc.vecinfer_backend.configure(codebooks=cb)),
)
print(tok.decode(out[0]))
