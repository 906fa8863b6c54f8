"""Sliding-window models with trained weights, built from a Llama checkpoint, to check the cache on
models that mix attention kinds, without a hub download:

- ``hybrid-qwen2``: Qwen2 (Llama plus q/k/v biases, here zero) with ``use_sliding_window`` and
  ``max_window_layers = L / 2``: the first half of the layers full attention, the rest a sliding
  window (the hybrid case: only the full layers hold codes);
- ``sliding-mistral``: Mistral (Llama's layers) with ``sliding_window`` on every layer (the case
  where every layer is coded and the sliding mask decides what a query reads).

The weights are the checkpoint's own, so the text the models produce is plausible, though they
were not trained with a window. Then, for example::

    python examples/hybrid_models.py path/to/llama-model out/ --window 256
    vecinfer calibrate --model out/hybrid-qwen2 --text calibration.txt --bits 2 --out cb.safetensors
    vecinfer match --model out/hybrid-qwen2 --codebooks cb.safetensors --text test.txt --backend compile
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def shared_fields(config) -> dict:
    """The fields a Llama config shares with Qwen2's and Mistral's."""
    names = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "rope_parameters",
    )
    return {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}


def build(source: Path, out: Path, window: int) -> list[Path]:
    """Write both models under ``out`` (bf16 safetensors plus the source's tokenizer); their paths."""
    llama = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if llama.config.model_type != "llama":
        raise SystemExit(f"{source} is a {llama.config.model_type!r} checkpoint: this needs a Llama one")
    fields = shared_fields(llama.config)
    layers = llama.config.num_hidden_layers
    models = {
        "hybrid-qwen2": (
            Qwen2ForCausalLM,
            Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=layers // 2, **fields),
        ),
        "sliding-mistral": (
            MistralForCausalLM,
            MistralConfig(sliding_window=window, head_dim=llama.config.head_dim, **fields),
        ),
    }
    written = []
    for name, (cls, config) in models.items():
        model = cls(config)
        missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
        if unexpected or any(not n.endswith(".bias") for n in missing):
            raise SystemExit(f"{name}: the checkpoint's weights do not map ({unexpected or missing})")
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name in missing:  # Qwen2's q/k/v biases: zero, so the layer is Llama's
                    param.zero_()
        path = out / name
        model.to(torch.bfloat16).save_pretrained(path)
        for file in COPIED:
            if (source / file).exists():
                shutil.copy(source / file, path)
        written.append(path)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a local Llama checkpoint directory (a Hugging Face model folder)")
    ap.add_argument("out", type=Path, help="directory to write hybrid-qwen2/ and sliding-mistral/ into")
    ap.add_argument("--window", type=int, default=256, help="sliding window in tokens (default 256)")
    args = ap.parse_args(argv)
    for path in build(args.source, args.out, args.window):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
