"""The attention mask of ``"vecinfer_sdpa"``: transformers' ``sdpa_mask``, in three tensor ops for a decode step.

A :class:`~vecinfer_compile.cache.VecInferCache` is static: its layers answer ``max_cache_len``
slots to ``get_mask_sizes``, and transformers (5.17 and 5.24 alike) materialises the mask of a
one-token step over a compileable cache (``allow_is_causal_skip`` is off there). ``sdpa_mask``
builds it from composed index functions: four ``arange`` s, a gather of the padding mask and
logical ops, a dozen small launches and Python closures on the host every decode step, outside
the compiled graph (``bench_generate.py --profile`` on the H200 put ``create_masks_for_generate``
at 0.48 ms a step for ours against 0.09 ms for an attention with no mask function).

For exactly that case, a one-token query, the plain causal mask function, no skip allowed, no
vmap, :func:`decode_sdpa_mask` computes the same boolean tensor directly: slot ``j`` (at position
``j + kv_offset``) is visible when it is at or before the query's position ``q_offset`` and the
2D padding mask keeps it. Every other call is ``sdpa_mask``'s own.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask


def decode_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> torch.Tensor | None:
    """``sdpa_mask``'s signature and result: ``[batch_size, 1, q_length, kv_length]`` bool (True =
    attend) or None. ``attention_mask``: the 2D padding mask ``[batch_size, seen + q_length]`` or
    None; ``q_offset``, ``kv_offset``: positions of the first query and the first slot."""
    if (
        q_length != 1
        or mask_function is not causal_mask_function
        or allow_is_causal_skip
        or allow_is_bidirectional_skip
        or use_vmap
    ):
        return sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=allow_is_causal_skip,
            allow_is_bidirectional_skip=allow_is_bidirectional_skip,
            use_vmap=use_vmap,
            device=device,
            **kwargs,
        )
    positions = torch.arange(kv_length, device=device) + kv_offset
    mask = positions <= q_offset  # causal_mask_function at the one query
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:  # and_masks' order and promotion: causal & padding[b, position]
        mask = mask & padding.index_select(1, positions).to(mask.device)
    return mask.view(-1, 1, 1, kv_length).expand(batch_size, -1, 1, kv_length)
