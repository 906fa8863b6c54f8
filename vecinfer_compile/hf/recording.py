"""Record what attention receives: post-RoPE queries, keys and values of every layer.

A temporary attention implementation (registered with transformers' ``AttentionInterface``)
records its inputs (after RoPE, before any GQA repetition) and then runs SDPA, so any model whose
attention goes through that interface can be recorded; a call that needs more than SDPA (attention
sinks, logit softcapping, sparse indices, different query/key/value head dims) is refused first
(:func:`~vecinfer_compile.hf.attention_support.check_attention_call`). Calibration
(:mod:`~vecinfer_compile.calibrate`), the per-layer allocation (:mod:`~vecinfer_compile.allocate`)
and ``vecinfer inspect`` all read from here.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm

from .attention_support import check_attention_call, needs_unskipped_masks, unskipped_sdpa_mask

RECORDER = "vecinfer_calibration_recorder"


class _Recorder:
    """Per-layer lists of ``[B, H, T, D]`` float32 CPU tensors: keys, values and (optionally)
    queries, as attention receives them (post-RoPE, before any GQA repetition)."""

    def __init__(self, with_queries: bool) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}
        self.queries: dict[int, list[torch.Tensor]] | None = {} if with_queries else None

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(
                f"{type(module).__name__} has no layer_idx: recording attention inputs needs a "
                "transformers model whose attention modules carry their layer index"
            )
        check_attention_call(module, query, key, value, kwargs)
        self.keys.setdefault(layer, []).append(key.detach().float().cpu())
        self.values.setdefault(layer, []).append(value.detach().float().cpu())
        if self.queries is not None:
            self.queries.setdefault(layer, []).append(query.detach().float().cpu())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def recording(model, with_queries: bool):
    """Within the block, ``model``'s attention layers record what they receive (the yielded
    recorder's ``keys``, ``values``, and ``queries`` with ``with_queries``: per layer, lists of
    float32 CPU tensors, post-RoPE), attending as SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    recorder = _Recorder(with_queries)
    AttentionInterface.register(RECORDER, recorder)
    AttentionMaskInterface.register(RECORDER, unskipped_sdpa_mask if needs_unskipped_masks(model) else sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDER)
    try:
        yield recorder
    finally:
        model.set_attn_implementation(previous)


def bos_token_id(model) -> int | None:
    """The model's BOS token id: its text config's, its config's or its generation config's,
    None when none has one (transformers 5 configs without the attribute raise on reading it)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for source in (text, config, getattr(model, "generation_config", None)):
        bos = getattr(source, "bos_token_id", None)
        if bos is not None:
            return bos
    return None


def _windows(model, token_ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """The ``[T]`` id windows :func:`collect_kv` runs: ``seq_len`` tokens each, after BOS when the
    model has one."""
    bos = bos_token_id(model)
    return [w if bos is None else torch.cat([torch.tensor([bos]), w]) for w in token_ids.split(seq_len)]


def window_lengths(model, token_ids: torch.Tensor, seq_len: int) -> list[int]:
    """The token count of each window :func:`collect_kv` runs, in order (they sum to the recorded
    token axis)."""
    return [w.numel() for w in _windows(model, token_ids, seq_len)]


def recorded_positions(model, token_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[N_tokens]`` int64: the position of each token :func:`collect_kv` records (its index in
    its window), aligned with the recorded keys' token axis."""
    return torch.cat([torch.arange(w.numel()) for w in _windows(model, token_ids, seq_len)])


@torch.no_grad()
def collect_kv(model, token_ids: torch.Tensor, seq_len: int, progress: bool = True, *, with_queries: bool = False):
    """Run ``model`` over ``token_ids: [N]`` in windows of ``seq_len`` tokens (each starting
    with BOS when the tokenizer has one) and return per-layer ``(keys, values)``, each
    ``{layer: [H_kv, N_tokens, D]}`` float32 on the CPU; with ``with_queries`` also
    ``{layer: [H_q, N_tokens, D]}`` queries as a third element."""
    device = next(model.parameters()).device
    windows = _windows(model, token_ids, seq_len)
    with recording(model, with_queries) as rec:
        for ids in tqdm(
            windows, total=len(windows), desc="recording attention inputs", unit="window", disable=not progress
        ):
            model(input_ids=ids[None].to(device), use_cache=False)
    if not rec.keys:
        raise ValueError(
            "recorded no attention calls: the model does not dispatch attention "
            "through transformers' AttentionInterface"
        )

    def join(store):
        return {l: torch.cat([t[0] for t in ts], dim=1) for l, ts in sorted(store.items())}

    out = (join(rec.keys), join(rec.values))
    return out + (join(rec.queries),) if with_queries else out
