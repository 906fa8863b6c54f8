"""Greedy generation through the real cache against the eager simulate path, token for token.

Both paths use the same codebooks and the same window semantics:

- cache: :class:`~vecinfer_compile.VecInferCache` (the prompt attends in full precision, is then
  encoded; decode steps read codes plus a full-precision window of the last ``residual``
  tokens), in eager or compiled with :data:`~vecinfer_compile.vecinfer_backend` (on CUDA the
  compiled decode runs the fused Triton decode-attention kernel);
- simulate: HF's DynamicCache with the ``"vecinfer"`` attention in simulate mode,
  ``full_precision_prefill=True`` and the same ``residual``.

With ``prefill_chunk`` the cache's prompt goes through ``generate(prefill_chunk_size=...)``: its
first chunk attends in full precision, every later one over the codes of the tokens before it,
the old window and itself in full precision (:mod:`vecinfer_compile.ops.split_attention.chunk`). The
simulate side then reads the prompt with the per-query window (key ``j`` in full precision for
query ``i`` iff ``i - j < R``), which no chunk sees less of: the two differ in how many prompt keys
are read in full precision, so a late flip at a near-tie is possible and is reported as it is.

Every prompt generates exactly ``new_tokens`` tokens (``min_new_tokens``: no early EOS in one
path only). A result records the first position where the two disagree, if any, and each path's
top-two logit gap there: a gap of a rounding step or less (bf16: 1/128 to 1/64 of the logits'
magnitude) is a tie that either path may break, not a wrong read (:meth:`MatchResult.parted_at_tie`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch


@dataclass
class MatchResult:
    """One prompt: the new tokens of both paths and the first index where they differ."""

    prompt_len: int
    cache_tokens: list[int]
    simulate_tokens: list[int]
    cache_gaps: list[float] | None = None  # per new token: top-1 minus top-2 logit (float32)
    simulate_gaps: list[float] | None = None
    cache_tops: list[float] | None = None  # per new token: the top-1 logit
    simulate_tops: list[float] | None = None

    @property
    def first_mismatch(self) -> int | None:
        return next((i for i, (a, b) in enumerate(zip(self.cache_tokens, self.simulate_tokens)) if a != b), None)

    def gaps_at_mismatch(self) -> tuple[float, float] | None:
        """``(cache, simulate)`` top-two logit gaps at the first mismatch (None without one, or
        without recorded gaps)."""
        m = self.first_mismatch
        if m is None or self.cache_gaps is None or self.simulate_gaps is None:
            return None
        return self.cache_gaps[m], self.simulate_gaps[m]

    def parted_at_tie(self, dtype: torch.dtype) -> bool:
        """Whether the paths part where one of them was within one rounding step of the logits'
        ``dtype`` (at the larger top-1 logit's magnitude) of choosing the other's token. False
        without a mismatch or without recorded gaps and tops."""
        gaps = self.gaps_at_mismatch()
        if gaps is None or self.cache_tops is None or self.simulate_tops is None:
            return False
        m = self.first_mismatch
        return min(gaps) <= logit_step(dtype, max(abs(self.cache_tops[m]), abs(self.simulate_tops[m])))

    @property
    def matched(self) -> int:
        """Tokens equal before the first mismatch (all of them when none)."""
        m = self.first_mismatch
        return len(self.cache_tokens) if m is None else m


def logit_step(dtype: torch.dtype, magnitude: float) -> float:
    """Spacing of ``dtype``'s values at ``magnitude``, either sign (bf16 at ~10: 0.0625)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(magnitude), torch.finfo(dtype).tiny)))


def prompts_from_ids(ids: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    """``count`` non-overlapping, evenly spaced slices of ``length`` tokens from ``ids [N]``."""
    if count < 1 or length < 1:
        raise ValueError(f"need at least one prompt of at least one token, got {count} x {length}")
    if count * length > ids.numel():
        raise ValueError(
            f"the text has {ids.numel()} tokens, fewer than {count} prompts x {length} tokens; "
            "pass a longer --text or fewer/shorter prompts"
        )
    stride = ids.numel() // count
    return [ids[i * stride : i * stride + length] for i in range(count)]


def _generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> tuple[list[int], list[float], list[float]]:
    """Greedy new tokens of ``ids [1, T]`` and, per token, its top-1 minus top-2 logit and its top-1 logit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=model.config.pad_token_id or 0,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
    top2 = [logits[0].float().topk(2).values for logits in out.logits]
    return (
        out.sequences[0, ids.shape[1] :].tolist(),
        [(v[0] - v[1]).item() for v in top2],
        [v[0].item() for v in top2],
    )


def cache_tokens(
    model, ids: torch.Tensor, codebooks, *, new_tokens: int, residual: int, compiled: bool, prefill_chunk: int = 0
) -> list[int]:
    """Greedy new tokens of ``ids [T]`` through a fresh VecInferCache (eager or compiled), the prompt
    prefilled at once or, with ``prefill_chunk``, in chunks of that many tokens."""
    return _cache_run(
        model, ids, codebooks, new_tokens=new_tokens, residual=residual, compiled=compiled, prefill_chunk=prefill_chunk
    )[0]


def simulate_tokens(
    model, ids: torch.Tensor, codebooks, *, new_tokens: int, residual: int, full_precision_prefill: bool = True
) -> list[int]:
    """Greedy new tokens of ``ids [T]`` in eager simulate mode: the prompt in full precision (the
    cache's one-shot prefill) or, without ``full_precision_prefill``, with the per-query window."""
    return _simulate_run(
        model, ids, codebooks, new_tokens=new_tokens, residual=residual, full_precision_prefill=full_precision_prefill
    )[0]


@torch.no_grad()
def _cache_run(
    model, ids: torch.Tensor, codebooks, *, new_tokens: int, residual: int, compiled: bool, prefill_chunk: int
) -> tuple[list[int], list[float], list[float]]:
    """:func:`cache_tokens` and each token's top-two logit gap and top-1 logit."""
    from transformers import CompileConfig

    from ..backend import vecinfer_backend
    from ..cache import VecInferCache
    from ..hf.compat import cache_kwargs

    dev = next(model.parameters()).device
    ids = ids[None].to(dev)
    cache = VecInferCache(
        model, codebooks, batch_size=1, max_cache_len=ids.shape[1] + new_tokens, residual=residual, device=dev
    )
    kwargs = cache_kwargs(cache)
    if compiled:
        config = CompileConfig(
            backend=vecinfer_backend.configure(codebooks=codebooks, residual=residual), fullgraph=True
        )
        config._compile_all_devices = dev.type != "cuda"  # generate() compiles on CUDA only otherwise
        kwargs["compile_config"] = config
    if prefill_chunk:
        kwargs["prefill_chunk_size"] = prefill_chunk
    return _generate(model, ids, new_tokens, **kwargs)


@torch.no_grad()
def _simulate_run(
    model, ids: torch.Tensor, codebooks, *, new_tokens: int, residual: int, full_precision_prefill: bool
) -> tuple[list[int], list[float], list[float]]:
    """:func:`simulate_tokens` and each token's top-two logit gap and top-1 logit."""
    from ..simulate import disable_simulation, enable_simulation

    dev = next(model.parameters()).device
    enable_simulation(
        model,
        codebooks.method,
        bits=codebooks.bits,
        codebooks=codebooks,
        residual=residual,
        full_precision_prefill=full_precision_prefill,
    )
    try:
        return _generate(model, ids[None].to(dev), new_tokens)
    finally:
        disable_simulation(model)


def token_match(
    model,
    prompts: list[torch.Tensor],
    codebooks,
    *,
    new_tokens: int = 64,
    residual: int = 128,
    compiled: bool = False,
    prefill_chunk: int = 0,
    progress: bool = True,
) -> list[MatchResult]:
    """Run both paths on every prompt (``[T]`` int64 token ids); one :class:`MatchResult` each.
    ``prefill_chunk``: the cache prefills in chunks of that many tokens (see the module docstring)."""
    from tqdm.auto import tqdm

    results = []
    for ids in tqdm(prompts, desc="prompts", disable=not progress):
        cached, cache_gaps, cache_tops = _cache_run(
            model,
            ids,
            codebooks,
            new_tokens=new_tokens,
            residual=residual,
            compiled=compiled,
            prefill_chunk=prefill_chunk,
        )
        simulated, simulate_gaps, simulate_tops = _simulate_run(
            model, ids, codebooks, new_tokens=new_tokens, residual=residual, full_precision_prefill=not prefill_chunk
        )
        results.append(MatchResult(len(ids), cached, simulated, cache_gaps, simulate_gaps, cache_tops, simulate_tops))
    return results
