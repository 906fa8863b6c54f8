"""Greedy generation through each method's KV cache, shared by ``vecinfer needle`` and
``vecinfer gsm8k``.

How each method runs during ``generate()``:

- ``fp16``: Hugging Face's default ``DynamicCache`` in full precision (plain SDPA).
- ``vecinfer`` / ``vq`` / ``smooth`` / ``hadamard``: the real compressed
  :class:`~vecinfer_compile.cache.VecInferCache` (codes + a full-precision window of the last
  ``residual`` tokens), sized automatically to ``prompt + max_new_tokens``.
- ``kivi`` and the pre-RoPE methods (``prerope``, ``prerope-keys``): they have no cache yet; they
  run in **simulate mode** (quantize->dequantize inside attention) with
  ``full_precision_prefill=True``, which gives them the cache's window semantics: the prefill
  attends in full precision, and each decode step reads keys/values outside the last
  ``residual`` tokens quantized. :func:`method_note` says so in every report.

In every method the prompt (prefill) attends in full precision, as with a real quantized cache:
quantization error enters from the first decode step on (the second generated token).

Decoding is eager by default on every device (``backend="eager"``): ``generate()`` would
otherwise compile a static cache's decode step with plain Inductor on CUDA, which on torch 2.11
fails once prompt shapes vary (``NameError: name 's95' is not defined`` in a CUDA-graph
partition). ``backend="compile"`` compiles decode with
:data:`~vecinfer_compile.vecinfer_backend` instead (the fused kernel over codes).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..methods import SIMULATE_ONLY, VQ_METHODS, check_method

DEFAULT_RESIDUAL = 128
SIMULATED = ("kivi", *SIMULATE_ONLY)  # the methods generate() runs in simulate mode (no cache of their own)


BACKENDS = ("eager", "compile")


@dataclass
class GenerationMethod:
    """A method ready to generate with: name, bits, codebooks (VQ methods), window size and how
    a VecInferCache's decode step runs (``backend``: eager, or compiled with vecinfer_backend;
    fp16 and the :data:`SIMULATED` methods have no such cache and always run eagerly)."""

    method: str
    bits: float
    codebooks: object = None
    residual: int = DEFAULT_RESIDUAL
    backend: str = "eager"
    _compile_config: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    def generate_kwargs(self, cache, device: torch.device) -> dict:
        """``generate()`` keyword arguments for ``cache`` (None: HF's DynamicCache): eager decode,
        or one CompileConfig with vecinfer_backend reused across calls (no recompiles)."""
        if cache is None:
            return {}
        from ..hf.compat import cache_kwargs

        if self.backend == "eager":
            return {**cache_kwargs(cache), "disable_compile": True}
        if self._compile_config is None:
            from transformers import CompileConfig

            from ..backend import vecinfer_backend

            config = CompileConfig(
                backend=vecinfer_backend.configure(codebooks=self.codebooks, residual=self.residual), fullgraph=True
            )
            config._compile_all_devices = device.type != "cuda"  # generate() compiles on CUDA only otherwise
            self._compile_config = config
        return {**cache_kwargs(cache), "compile_config": self._compile_config}

    @property
    def label(self) -> str:
        return "fp16" if self.method == "fp16" else f"{self.method}-{self.bits:g}bit"

    def note(self) -> str:
        note = method_note(self.method, self.bits, self.residual)
        return note if self.layer_bits_text is None else f"{note}; bits per layer {self.layer_bits_text}"

    @property
    def layer_bits_text(self) -> str | None:
        """``"2/1/1/2/2/4"`` for codebooks with a per-layer allocation, else None."""
        layer_bits = getattr(self.codebooks, "layer_bits", None)
        return None if not layer_bits else "/".join(f"{b:g}" for b in layer_bits)


def method_note(method: str, bits: float | None, residual: int) -> str:
    """One line saying how ``method`` runs during generation."""
    if method == "fp16":
        return "fp16: full-precision DynamicCache (plain SDPA)"
    if method in SIMULATED:
        return (
            f"{method} {bits:g}-bit: runs in SIMULATE mode (quantize->dequantize attention, "
            f"full_precision_prefill=True) with the cache's window semantics: prefill in full "
            f"precision, decode reads K/V outside the last {residual} tokens quantized"
        )
    return (
        f"{method} {bits:g}-bit: real VecInferCache (codes + full-precision window of the last "
        f"{residual} tokens; prefill attends in full precision)"
    )


def prepare_method(
    model,
    tokenizer,
    method: str,
    bits: float | None,
    *,
    codebooks_path: str | Path | None = None,
    calib_text_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    residual: int = DEFAULT_RESIDUAL,
    max_tokens: int = 32768,
    seq_len: int = 1024,
    iters: int = 20,
    seed: int = 0,
    progress: bool = True,
    backend: str = "eager",
) -> GenerationMethod:
    """Validate ``method``/``bits`` and load or calibrate its codebooks (VQ methods: from
    ``codebooks_path``, else ``cache_dir/<method>-<bits>bit.safetensors`` if present, else
    calibrated on ``calib_text_path`` and saved to ``cache_dir``). ``backend``: how the cache's
    decode step runs (module docstring)."""
    from ..models import load_text
    from .ablation import get_codebooks, normalize_bits

    bits = normalize_bits(method, bits)
    GenerationMethod(method, bits, backend=backend)  # a clear error for a bad backend, before loading
    if residual < 0:
        raise ValueError(f"--residual must be >= 0, got {residual}")
    cb = None
    if method in VQ_METHODS:
        cb = get_codebooks(
            model,
            tokenizer,
            method,
            bits,
            codebooks_path=codebooks_path,
            calib_text=None if calib_text_path is None else load_text(calib_text_path),
            cache_dir=cache_dir,
            max_tokens=max_tokens,
            seq_len=seq_len,
            iters=iters,
            seed=seed,
            progress=progress,
        )
    elif codebooks_path is not None:
        raise ValueError(f"method {method!r} takes no codebooks; drop --codebooks")
    return GenerationMethod(method, bits, cb, residual, backend)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, T_max]`` with the prompts left-padded."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p) :] = 1
    return ids, mask


@contextlib.contextmanager
def _attention_for(model, gm: GenerationMethod):
    """Switch the model's attention for ``gm`` (the :data:`SIMULATED` methods: simulation) and
    restore it afterwards."""
    from ..simulate import disable_simulation, enable_simulation, is_simulating

    if gm.method in SIMULATED:
        enable_simulation(
            model, gm.method, bits=gm.bits, codebooks=gm.codebooks, residual=gm.residual, full_precision_prefill=True
        )
        try:
            yield
        finally:
            disable_simulation(model)
        return
    if is_simulating(model):
        disable_simulation(model)
    yield


def make_cache(model, gm: GenerationMethod, batch_size: int, max_cache_len: int):
    """The ``past_key_values`` for ``gm``: None (HF's default DynamicCache) for fp16/KIVI, a
    :class:`VecInferCache` of ``max_cache_len`` slots for the VQ methods that have one."""
    if gm.method not in VQ_METHODS or gm.method in SIMULATED:
        return None
    from ..cache import VecInferCache

    return VecInferCache(
        model,
        gm.codebooks,
        batch_size=batch_size,
        max_cache_len=max_cache_len,
        residual=gm.residual,
        device=_device_of(model),
    )


@torch.no_grad()
def greedy_generate(
    model,
    prompts: list[list[int]],
    gm: GenerationMethod,
    *,
    max_new_tokens: int = 8,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> list[list[int]]:
    """Greedy ``model.generate()`` of up to ``max_new_tokens`` for each prompt (token id lists,
    batched with left padding) through ``gm``'s cache. Returns the new tokens of each prompt,
    cut at the first EOS."""
    check_method(gm.method, None if gm.method == "fp16" else gm.bits)
    config = model.config
    if pad_token_id is None:
        pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    if eos_token_id is None:
        eos_token_id = config.eos_token_id
    ids, mask = left_pad(prompts, pad_token_id)
    dev = _device_of(model)
    ids, mask = ids.to(dev), mask.to(dev)
    cache = make_cache(model, gm, ids.shape[0], ids.shape[1] + max_new_tokens)
    extra = gm.generate_kwargs(cache, dev)
    with _attention_for(model, gm), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            **extra,
        )
    new = out[:, ids.shape[1] :].tolist()
    eos = set(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])
    result = []
    for row in new:
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        result.append(row[:cut])
    return result


def max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)
