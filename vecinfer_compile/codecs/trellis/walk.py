"""Bitshift-trellis quantization: a long-block code of a sequence, found by the Viterbi algorithm.

The code under the trellis codec (:mod:`.trellis_codec`; studied in ``studies/key_codec_study.py``),
in the family QTIP uses for weights. A sequence ``x: [T]`` is coded as
the walk of an ``L``-bit state: step ``t`` shifts the state left by ``bits[t]`` (1..L) and takes
that many new bits, ``s_t = ((s_{t-1} << k_t) | c_t) mod 2^L``, and reconstructs
``x_t ~ luts[k_t][s_t]``. The stored code is the ``sum_t k_t`` new bits (the walk starts at state 0,
so nothing else is stored); the decoder is a shift register and one table lookup per element.
:func:`viterbi` finds the walk of least squared error exactly (dynamic programming over the
``2^L`` states); :func:`train_luts` fits the tables Lloyd-style (Viterbi codes, then each entry
the mean of what it reconstructs).
"""

from __future__ import annotations

import math

import torch


def viterbi(x: torch.Tensor, bits: list[int], luts: dict[int, torch.Tensor], chunk: int | None = None) -> torch.Tensor:
    """The least-squared-error walk for each row of ``x: [N, T]``: states ``[N, T]`` int64, with
    ``bits[t]`` new bits at step ``t`` and ``luts[k]: [2^L]`` the reconstruction table of a
    ``k``-bit step (every table the same length ``2^L``, ``1 <= k <= L``). Runs on ``x``'s device.

    The predecessors of state ``s`` under a ``k``-bit step are the ``2^k`` states whose low
    ``L - k`` bits are ``s >> k``: viewing the cost vector as ``[2^k, 2^(L-k)]`` (high bits, low
    bits), one min over the first axis gives every state's best predecessor, and only its high
    bits (``< 2^k``: a byte, two for a step of more than 8 bits) are kept for the trace back. Rows
    go ``chunk`` at a time (default: about 1 GiB of trace-back bytes)."""
    if x.dim() != 2 or x.shape[1] != len(bits):
        raise ValueError(f"x must be [N, T] with T = len(bits) = {len(bits)}, got {tuple(x.shape)}")
    states = next(iter(luts.values())).numel()
    lbits = states.bit_length() - 1
    if states != 1 << lbits or any(not 1 <= k <= lbits for k in bits):
        raise ValueError(f"tables of 2^L entries and 1 <= bits <= L, got {states} entries and bits {sorted(set(bits))}")
    if chunk is None:
        trace_bytes = sum((states >> k) * (1 if k <= 8 else 2) for k in bits)
        chunk = max(1, min(8192, (1 << 30) // max(1, trace_bytes)))
    tables = {k: luts[k].to(device=x.device, dtype=torch.float32) for k in set(bits)}
    out = []
    for part in x.float().split(chunk):
        n = part.shape[0]
        cost = torch.full((n, states), math.inf, device=x.device)
        cost[:, 0] = 0
        back = []
        for t, k in enumerate(bits):
            best, high = cost.view(n, 1 << k, states >> k).min(1)  # [n, 2^(L-k)] over the high bits
            err = (part[:, t, None] - tables[k][None, :]) ** 2
            cost = (best[:, :, None] + err.view(n, states >> k, 1 << k)).view(n, states)
            back.append(high.to(torch.uint8 if k <= 8 else torch.int16))
        s = cost.argmin(1)
        walk = torch.empty(n, len(bits), dtype=torch.long, device=x.device)
        for t in range(len(bits) - 1, -1, -1):
            walk[:, t] = s
            h = back[t].gather(1, (s >> bits[t])[:, None])[:, 0].long()
            s = (s >> bits[t]) | (h << (lbits - bits[t]))
        out.append(walk)
    return torch.cat(out)


def best_walks(x: torch.Tensor, bits: list[int], luts: dict[int, torch.Tensor]) -> torch.Tensor:
    """:func:`viterbi`'s walks ``[N, T]`` int64, by the Triton kernel on CUDA
    (:func:`vecinfer_compile.codecs.trellis.triton_kernels.viterbi_walks`, one launch) where the trellis fits it."""
    states = next(iter(luts.values())).numel()
    if x.is_cuda:
        from .triton_kernels import MAX_STATE_BITS, viterbi_walks  # imports triton: only where it runs

        if states <= 1 << MAX_STATE_BITS:
            tables = torch.zeros(1, max(bits), states, device=x.device)
            for k in set(bits):
                tables[0, k - 1] = luts[k]
            return viterbi_walks(x[:, None].float(), torch.tensor([bits]), tables)[:, 0].long()
    return viterbi(x, bits, luts)


def reconstruct(walk: torch.Tensor, bits: list[int], luts: dict[int, torch.Tensor]) -> torch.Tensor:
    """``walk: [N, T]`` states -> ``[N, T]`` float32: ``luts[bits[t]][walk[:, t]]``."""
    return torch.stack([luts[k].to(walk.device, torch.float32)[walk[:, t]] for t, k in enumerate(bits)], 1)


def initial_luts(lbits: int, ks, seed: int = 0) -> dict[int, torch.Tensor]:
    """``{k: [2^L]}`` float32: unit-Gaussian quantiles in a seeded random order (each table scaled
    by ``sqrt(1 - 4^-k)``, the reconstruction's standard deviation in the Gaussian test channel)."""
    states = 1 << lbits
    gen = torch.Generator().manual_seed(seed)
    u = (torch.arange(states, dtype=torch.float64) + 0.5) / states
    q = (math.sqrt(2) * torch.erfinv(2 * u - 1)).float()
    return {k: q[torch.randperm(states, generator=gen)] * math.sqrt(1 - 4.0**-k) for k in sorted(set(ks))}


def train_luts(x: torch.Tensor, bits: list[int], lbits: int, rounds: int = 4, seed: int = 0) -> dict[int, torch.Tensor]:
    """Tables for ``x: [N, T]`` (each column at ``bits[t]`` bits): :func:`initial_luts`, then
    ``rounds`` of Viterbi walks and each entry moved to the mean of the elements it reconstructs
    (an entry nothing reached keeps its value)."""
    luts = {k: t.to(x.device) for k, t in initial_luts(lbits, bits, seed).items()}
    states = 1 << lbits
    for _ in range(rounds):
        walk = best_walks(x, bits, luts)
        for k in luts:
            cols = [t for t, b in enumerate(bits) if b == k]
            idx = walk[:, cols].flatten()
            sums = torch.zeros(states, device=x.device).index_add_(0, idx, x[:, cols].float().flatten())
            counts = torch.bincount(idx, minlength=states).float()
            luts[k] = torch.where(counts > 0, sums / counts.clamp_min(1), luts[k])
    return luts
