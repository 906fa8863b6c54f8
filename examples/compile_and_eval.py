"""The one-line use: compile a Hugging Face model with the VecInfer backend and score a text.

    python examples/compile_and_eval.py [MODEL_DIR CODEBOOKS]

Offline by default (the tiny model and codebooks shipped in the package). Without codebooks
the backend fits them from the first call and logs one line saying so.
"""

import logging
import math
import sys
from importlib.resources import files

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vecinfer_compile import load_codebooks, vecinfer_backend

logging.basicConfig(level=logging.INFO, format="%(message)s")
data = files("vecinfer_compile") / "data"
tiny = str(data / "tiny")
model_dir = sys.argv[1] if len(sys.argv) > 1 else tiny
if len(sys.argv) > 2:
    codebooks = sys.argv[2]
elif model_dir == tiny:
    codebooks = str(data / "tiny_codebooks" / "vecinfer-2bit.safetensors")
else:  # the shipped codebooks are the tiny model's: fit from the first call instead (one warning)
    codebooks = None

tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
ids = tok((data / "sample_public_domain.txt").read_text()[:4000], return_tensors="pt").input_ids[:, :512]
if codebooks is not None:  # the backend sees graphs, not the model: check the file against it here
    codebooks = load_codebooks(codebooks)
    codebooks.check_weights(model)  # one warning if they were calibrated for another model

with torch.no_grad():
    fp = model(input_ids=ids, labels=ids).loss.item()
    compiled = torch.compile(model, backend=vecinfer_backend.configure(codebooks=codebooks))
    q = compiled(input_ids=ids, labels=ids).loss.item()
print(f"perplexity FP: {math.exp(fp):.2f}   VecInfer 2-bit (compiled): {math.exp(q):.2f}")
