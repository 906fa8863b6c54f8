"""Perplexity over non-overlapping windows, scored exactly as the model's own loss.

Protocol (the same for every method, so numbers are comparable):

- The text is tokenized with no special tokens (no BOS is prepended: the windows are cut from
  running text, so a BOS in the middle of a document would be out of distribution, and the
  same ids go to every method).
- The first ``windows * window_len`` tokens are cut into ``windows`` windows of ``window_len``
  tokens. Each window is scored independently (no cache, no context carried over).
- In each window, token ``t`` is predicted from tokens ``0..t-1``: labels are the inputs shifted
  by one, so a window scores ``window_len - 1`` tokens (its first token is context only).
  This is exactly ``model(input_ids, labels=input_ids).loss`` of Hugging Face causal LMs.
- ``nll`` is the mean negative log-likelihood per scored token (nats) over all windows, and
  ``ppl = exp(nll)``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PplResult:
    ppl: float
    nll: float
    tokens: int  # scored tokens: windows * (window_len - 1)


def make_windows(token_ids: torch.Tensor, windows: int, window_len: int) -> torch.Tensor:
    """``[windows, window_len]`` from the first ``windows * window_len`` ids of a 1-D (or
    ``[1, N]``) tensor; a clear error if there are not enough."""
    if windows < 1:
        raise ValueError(f"--windows must be at least 1, got {windows}")
    if window_len < 2:
        raise ValueError(f"--window-len must be at least 2 tokens, got {window_len}")
    ids = torch.as_tensor(token_ids).reshape(-1)
    need = windows * window_len
    if ids.numel() < need:
        raise ValueError(
            f"the text has {ids.numel()} tokens, fewer than the {windows} x {window_len} = {need} "
            f"needed: use a longer text or fewer/shorter windows "
            f"(at most {ids.numel() // window_len} windows of {window_len})"
        )
    return ids[:need].reshape(windows, window_len)


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return torch.device("cpu")


def warn_beyond_trained_length(model, window_len: int) -> None:
    """One warning when windows are longer than the model's ``max_position_embeddings``:
    positions past it are out of range for quality, so the perplexity says little."""
    config = getattr(getattr(model, "_orig_mod", model), "config", None)
    limit = getattr(config.get_text_config() if config is not None else None, "max_position_embeddings", None)
    if limit is not None and window_len > limit:
        log.warning(
            "vecinfer: windows of %d tokens exceed the model's max_position_embeddings (%d): "
            "positions beyond it are out of range; use --window-len %d or less",
            window_len,
            limit,
            limit,
        )


@torch.no_grad()
def perplexity(
    model,
    token_ids: torch.Tensor,
    *,
    windows: int = 8,
    window_len: int = 256,
    batch_size: int = 1,
    progress: bool = True,
) -> PplResult:
    """Perplexity of ``model`` (a HF causal LM, or a compiled one) on the first
    ``windows * window_len`` tokens of ``token_ids``; see the module docstring."""
    chunks = make_windows(token_ids, windows, window_len)
    warn_beyond_trained_length(model, window_len)
    device = _device_of(model)
    total_nll = 0.0  # float64 accumulation of summed nats
    total_tokens = 0
    batches = list(chunks.split(max(1, batch_size)))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=windows, desc="perplexity", unit="window", leave=False)
    try:
        for batch in batches:
            batch = batch.to(device)
            out = model(input_ids=batch, labels=batch, use_cache=False)
            loss = out.loss.double().item()
            if not math.isfinite(loss):
                raise FloatingPointError("the model's loss is NaN/inf on this text")
            n = batch.shape[0] * (window_len - 1)
            total_nll += loss * n
            total_tokens += n
            if bar is not None:
                bar.update(batch.shape[0])
    finally:
        if bar is not None:
            bar.close()
    nll = total_nll / total_tokens
    return PplResult(ppl=math.exp(nll), nll=nll, tokens=total_tokens)
