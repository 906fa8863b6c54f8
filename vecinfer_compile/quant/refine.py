"""Codebook refinement: k-means centroids moved to lower a layer's attention-output error.

K-Means places each centroid to minimise its sub-vectors' own squared error. The model reads
attention's output through ``o_proj``: a key's error matters as much as the probability its
queries give it, a value's error as much as the probability it is read with. After k-means,
:func:`refine_codebooks` moves the key and value centroids by Adam on that loss, over the
calibration windows' own post-RoPE queries, keys and values::

    L = mean over tokens || (attn(q, K_hat, V_hat) - attn(q, K, V)) W_o^T ||^2

``K_hat = keys_inverse(Ck[codes_k])`` (the transform's exact inverse, so the query side is
untouched), ``V_hat = Cv[codes_v]``, with the layer's causal (and sliding-window) mask and
scaling. Codes are held fixed within a round and re-encoded between rounds by the nearest-centroid
rule the cache and the simulate path use, so the last round trains the centroids on the codes
inference will produce. The result has the same tensors as before: the cache, the kernels and the
file format do not change, nor does the decode's work (measurements: docs/results/accuracy.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..heartbeat import beat
from .codebook import decode, encode
from .transform import KeyTransform


@dataclass(frozen=True)
class RefineConfig:
    """rounds x steps Adam steps, codes re-encoded after each round; ``windows`` calibration
    windows per step; ``lr`` relative to each codebook's RMS (so the step does not depend on the
    layer's scale)."""

    rounds: int = 2
    steps: int = 40
    windows: int = 4
    lr: float = 3e-3

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayerAttention:
    """What the loss needs of one attention module: ``out_weight`` ``[hidden, Hq * D]`` (its
    output projection; None for the identity), ``scaling`` and ``sliding_window`` (None: full causal)."""

    out_weight: torch.Tensor | None
    scaling: float
    sliding_window: int | None = None

    @classmethod
    def of(cls, module, out_weight: torch.Tensor | None, head_dim: int) -> LayerAttention:
        """From a transformers attention module: ``out_weight`` (its output projection, found by
        :func:`~vecinfer_compile.hf.output_projection.output_projection_weight`; None for the
        identity), its ``scaling`` (default ``D ** -0.5``) and ``sliding_window``."""
        scaling = getattr(module, "scaling", None)
        window = getattr(module, "sliding_window", None)
        return cls(
            None if out_weight is None else out_weight.detach().float(),
            float(scaling) if scaling is not None else head_dim**-0.5,
            int(window) if isinstance(window, int) and window > 0 else None,
        )


def _mask(length: int, window: int | None, device) -> torch.Tensor | None:
    if window is None or window >= length:
        return None
    i = torch.arange(length, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _attend(q, k, v, attn: LayerAttention) -> torch.Tensor:
    """``q: [Hq, L, D]``, ``k, v: [Hkv, L, D]`` -> ``[L, Hq * D]``."""
    rep = q.shape[0] // k.shape[0]
    mask = _mask(q.shape[1], attn.sliding_window, q.device)
    out = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(rep, 0),
        v.repeat_interleave(rep, 0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=attn.scaling,
    )
    return out.transpose(0, 1).reshape(q.shape[1], -1)


def refine_codebooks(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: list[int],
    transform: KeyTransform,
    key_centroids: torch.Tensor,
    value_centroids: torch.Tensor,
    attn: LayerAttention,
    config: RefineConfig = RefineConfig(),
    *,
    seed: int = 0,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Refined ``(key_centroids, value_centroids, loss_before, loss_after)``.

    ``queries: [Hq, N, D]``, ``keys``/``values``: ``[Hkv, N, D]`` float32, the N recorded tokens
    of consecutive calibration windows of ``lengths`` (summing to N); ``transform``: the layer's
    key transform (no pre-RoPE rotation, no value prediction); centroids ``[E, d]`` float32.
    The losses are the mean over the first ``config.windows`` windows with the k-means centroids
    and with the returned ones; when refinement did not lower it, the k-means centroids come back
    unchanged. Returned centroids are float32 on the CPU. Deterministic for a given ``seed`` and
    device."""
    if transform.rope_inv_freq is not None:
        raise ValueError("refinement takes keys quantized after RoPE (their transform needs no positions)")
    if sum(lengths) != keys.shape[1]:
        raise ValueError(f"window lengths sum to {sum(lengths)}, but {keys.shape[1]} tokens were recorded")
    device = torch.device(device) if device is not None else keys.device
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    spans = [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]
    out_w = None if attn.out_weight is None else attn.out_weight.to(device)
    queries, keys, values = (t.float().to(device) for t in (queries, keys, values))
    kt = transform.keys(keys[None])[0]  # [Hkv, N, D] in the code domain
    with torch.no_grad():
        exact = [_attend(queries[:, s], keys[:, s], values[:, s], attn) for s in spans]

    ck0, cv0 = key_centroids.float().to(device), value_centroids.float().to(device)
    ck, cv = ck0.clone().requires_grad_(True), cv0.clone().requires_grad_(True)

    def codes():
        with torch.no_grad():
            return encode(kt, ck.detach()), encode(values, cv.detach())

    def loss(windows: list[int], codes_k, codes_v) -> torch.Tensor:
        total = 0.0
        for w in windows:
            s = spans[w]
            k_hat = transform.keys_inverse(decode(codes_k[None, :, s], ck))[0]
            err = _attend(queries[:, s], k_hat, decode(codes_v[:, s], cv), attn) - exact[w]
            if out_w is not None:
                err = err @ out_w.T
            total = total + err.pow(2).mean()
        return total / len(windows)

    probe = list(range(min(config.windows, len(spans))))
    codes_k, codes_v = codes()
    with torch.no_grad():
        before = loss(probe, codes_k, codes_v).item()
    lr_k = config.lr * ck0.pow(2).mean().sqrt().clamp_min(1e-8).item()
    lr_v = config.lr * cv0.pow(2).mean().sqrt().clamp_min(1e-8).item()
    opt = torch.optim.Adam([{"params": [ck], "lr": lr_k}, {"params": [cv], "lr": lr_v}])
    gen = torch.Generator().manual_seed(seed)
    for r in range(config.rounds):
        if r:
            codes_k, codes_v = codes()
        for step in range(config.steps):
            beat(f"refining centroids, round {r + 1}/{config.rounds}, step {step + 1}/{config.steps}")
            batch = torch.randperm(len(spans), generator=gen)[: config.windows].tolist()
            opt.zero_grad(set_to_none=True)
            loss(batch, codes_k, codes_v).backward()
            opt.step()
    codes_k, codes_v = codes()
    with torch.no_grad():
        after = loss(probe, codes_k, codes_v).item()
    if not after < before:
        return key_centroids.float().cpu(), value_centroids.float().cpu(), before, before
    return ck.detach().cpu(), cv.detach().cpu(), before, after
