"""A long-block key code: per-head KLT, integer bits per component, a bitshift trellis over them.

One layer's keys, in a method's coded domain (after :class:`~.transform.KeyTransform`), are coded
per KV head as

1. ``y = (k~ - mean) @ analysis``: the KLT (:class:`~.klt.KLT`) of the keys measured in the error
   metric ``M`` the codes should lower (``analysis = M^(1/2) U``; without a metric ``M = I`` and
   ``analysis = U``, orthonormal), components by decreasing variance, so that squared error on
   ``y`` is the error ``r^T M r`` of the key (with ``qaware``'s key metric, :mod:`.weighted_codes`,
   the expected score error plus the squared error);
2. ``bits[h, t]`` integer bits for component ``t`` (:func:`~.klt.greedy_allocation` under the unit
   Gaussian's Lloyd-Max curve: the top components get several bits, the tail none), summing to
   ``bits_per_element * D``, so a token and head costs exactly what today's codes cost, with no
   side information per token;
3. the coded components, each divided by its standard deviation, as one sequence through a
   bitshift trellis of ``2^L`` states (:mod:`.trellis`: Viterbi encode, one table lookup per
   component to decode), with tables trained per head and bit width on calibration keys;
4. back: ``k~_hat = mean + scale * (y_hat @ synthesis)`` (``synthesis = analysis^-1``; components
   at 0 bits decode to the mean), where ``scale`` (one number a head, fitted on calibration keys)
   gives the decoded keys the calibration keys' mean squared deviation: the Lloyd tables decode to
   conditional means, which shrink every key toward the mean by a few percent and every score with
   it, and that costs more perplexity than the squared error the scale adds
   (docs/results/accuracy.md). The scale is free at run time (it folds into the query side).

Only the simulate path runs it so far (docs/results/accuracy.md, "A long-block key codec").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .klt import KLT, gaussian_lloyd_max_distortion, greedy_allocation
from .trellis import reconstruct, train_luts, viterbi

MAX_COMPONENT_BITS = 12  # the allocation's curve reaches this far; it never gives a component more than L
PARTS = ("mean", "analysis", "synthesis", "variance", "scale", "bits", "tables")  # to_tensors' names
SCALE_SAMPLE = 4096  # calibration keys a head that the norm-matching scale is fitted on


def metric_sqrt(metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M^(1/2), M^(-1/2))`` float64 of symmetric positive definite ``metric: [H, D, D]``."""
    lam, vec = torch.linalg.eigh(metric.double())
    if not bool((lam > 0).all()):
        raise ValueError("the key codec's error metric must be positive definite")
    return (vec * lam.sqrt()[:, None]) @ vec.transpose(1, 2), (vec / lam.sqrt()[:, None]) @ vec.transpose(1, 2)


@dataclass
class TrellisKeyCodec:
    """One layer's key codec, per KV head. ``mean: [H, D]``; ``analysis, synthesis: [H, D, D]``
    (inverses: keys to components and back); ``variance: [H, D]`` of the components, decreasing;
    ``scale: [H]``, the decoded deviations' norm-matching factor (float64); ``bits: [H, D]`` int64, bits of each component; ``luts[h][k]: [2^L]`` float32, head
    ``h``'s table for a ``k``-bit step (unit scale: a component decodes to
    ``luts[h][k][state] * sqrt(variance)``); ``state_bits``: ``L``."""

    mean: torch.Tensor
    analysis: torch.Tensor
    synthesis: torch.Tensor
    variance: torch.Tensor
    scale: torch.Tensor
    bits: torch.Tensor
    luts: list[dict[int, torch.Tensor]]
    state_bits: int

    @classmethod
    def fit(cls, coded_keys: torch.Tensor, bits_per_element: float, state_bits: int, *,
            metric: torch.Tensor | None = None, train_vectors: int = 4096, rounds: int = 3,
            seed: int = 0) -> TrellisKeyCodec:
        """From calibration keys in the coded domain ``coded_keys: [H, N, D]`` (any float dtype and
        device; the tables are trained there) and the error ``metric: [H, D, D]`` to lower (None:
        squared error): the KLT on all ``N``, the allocation of ``round(bits_per_element * D)``
        bits a head, tables on a seeded sample of ``train_vectors``."""
        h, n, d = coded_keys.shape
        budget = round(bits_per_element * d)
        if budget <= 0 or abs(budget - bits_per_element * d) > 1e-9:
            raise ValueError(f"bits_per_element * head_dim must be a positive whole number of bits, "
                             f"got {bits_per_element:g} * {d}")
        if not 1 <= state_bits <= 24:
            raise ValueError(f"state_bits (L: 2^L trellis states) must be in 1..24, got {state_bits}")
        x = coded_keys.detach().double().cpu()
        if metric is None:
            root = inverse_root = torch.eye(d, dtype=torch.float64).expand(h, d, d)
        else:
            root, inverse_root = metric_sqrt(metric.detach().cpu())
        klt = KLT.fit(x @ root)
        analysis = root @ klt.basis
        synthesis = klt.basis.transpose(1, 2) @ inverse_root
        mean = klt.mean[:, None] @ inverse_root  # the keys' mean, back in the coded domain
        curve = gaussian_lloyd_max_distortion(min(MAX_COMPONENT_BITS, state_bits))
        bits = torch.stack([greedy_allocation(klt.variance[i], budget, curve) for i in range(h)])
        y = (x - mean) @ analysis
        luts = []
        for i in range(h):
            cols = bits[i].nonzero()[:, 0]
            gen = torch.Generator().manual_seed(seed + i)
            pick = torch.randperm(n, generator=gen)[:train_vectors]
            sample = (y[i][pick][:, cols] / klt.variance[i, cols].sqrt().clamp_min(1e-30)).float()
            luts.append(train_luts(sample.to(coded_keys.device), bits[i, cols].tolist(), state_bits,
                                   rounds=rounds, seed=seed + i))
        codec = cls(mean[:, 0], analysis, synthesis, klt.variance, torch.ones(h, dtype=torch.float64), bits, luts,
                    state_bits)
        gen = torch.Generator().manual_seed(seed)
        sample = coded_keys.detach()[:, torch.randperm(n, generator=gen)[:SCALE_SAMPLE]].double()
        deviation = sample - codec.mean.to(sample.device)[:, None]
        decoded = codec.quantize_dequantize(sample) - codec.mean.to(sample.device)[:, None]
        codec.scale = ((deviation ** 2).sum((1, 2)) / (decoded ** 2).sum((1, 2)).clamp_min(1e-30)).sqrt().cpu()
        return codec

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The codec as float32 tensors (the codebook file's, named :data:`PARTS`): ``mean [H, D]``,
        ``analysis``, ``synthesis [H, D, D]``, ``variance [H, D]``, ``scale [H]``, ``bits [H, D]`` (whole numbers)
        and ``tables [H, W, 2^L]`` (row ``k - 1``: the ``k``-bit table, zeros for a width the head
        does not use; ``W``: the widest)."""
        tables = torch.zeros(self.num_heads, int(self.bits.max()), 1 << self.state_bits)
        for i, luts in enumerate(self.luts):
            for k, t in luts.items():
                tables[i, k - 1] = t.float().cpu()
        return {"mean": self.mean.float(), "analysis": self.analysis.float(), "synthesis": self.synthesis.float(),
                "variance": self.variance.float(), "scale": self.scale.float(), "bits": self.bits.float(),
                "tables": tables}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> TrellisKeyCodec:
        """:meth:`to_tensors`' inverse (shapes checked by the file's reader)."""
        bits = t["bits"].round().long()
        state_bits = t["tables"].shape[-1].bit_length() - 1
        luts = [{k: t["tables"][i, k - 1].float() for k in sorted(set(bits[i].tolist())) if k > 0}
                for i in range(bits.shape[0])]
        return cls(t["mean"].double(), t["analysis"].double(), t["synthesis"].double(), t["variance"].double(),
                   t["scale"].double(), bits, luts, state_bits)

    @property
    def num_heads(self) -> int:
        return self.bits.shape[0]

    def bits_per_element(self) -> float:
        return float(self.bits.sum(1).double().mean()) / self.bits.shape[1]

    def encode(self, coded_keys: torch.Tensor) -> list[torch.Tensor]:
        """``coded_keys: [..., H, T, D]`` -> per head the trellis walk ``[N, C_h]`` int64 (``N``:
        the product of the leading dims and ``T``; ``C_h``: head ``h``'s coded components), on
        the keys' device."""
        y = self._components(coded_keys)
        walks = []
        for i in range(self.num_heads):
            cols, steps, sd = self._head(i, y.device)
            walks.append(viterbi(y[:, i][:, cols] / sd, steps, self.luts[i]))
        return walks

    def decode(self, walks: list[torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`encode`'s walks back to coded keys of ``shape`` ``[..., H, T, D]`` and ``dtype``."""
        h, t, d = shape[-3:]
        device = walks[0].device
        y = torch.zeros(walks[0].shape[0], h, d, dtype=torch.float64, device=device)
        for i, walk in enumerate(walks):
            cols, steps, sd = self._head(i, device)
            y[:, i, cols] = reconstruct(walk, steps, self.luts[i]).double() * sd
        synthesis = self.synthesis.to(device) * self.scale.to(device)[:, None, None]
        x = torch.einsum("nhc,hcd->nhd", y, synthesis) + self.mean.to(device)
        return x.reshape(*shape[:-3], t, h, d).movedim(-2, -3).to(dtype)

    def quantize_dequantize(self, coded_keys: torch.Tensor) -> torch.Tensor:
        """``coded_keys: [..., H, T, D]`` through the code and back, same shape, dtype and device."""
        return self.decode(self.encode(coded_keys), coded_keys.shape, coded_keys.dtype)

    def _components(self, coded_keys: torch.Tensor) -> torch.Tensor:
        """``[..., H, T, D]`` -> components ``[N, H, D]`` float64 (``N`` = leading dims x T)."""
        if coded_keys.shape[-3] != self.num_heads or coded_keys.shape[-1] != self.bits.shape[1]:
            raise ValueError(f"keys of shape {tuple(coded_keys.shape)}: this codec codes [..., {self.num_heads}, T, "
                             f"{self.bits.shape[1]}] (KV heads, tokens, head_dim)")
        x = coded_keys.movedim(-3, -2).reshape(-1, self.num_heads, coded_keys.shape[-1]).double()
        return torch.einsum("nhd,hdc->nhc", x - self.mean.to(x.device), self.analysis.to(x.device))

    def _head(self, i: int, device) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Head ``i``'s coded components (indices), their bits, their standard deviations."""
        cols = self.bits[i].nonzero()[:, 0]
        sd = self.variance[i, cols].sqrt().clamp_min(1e-30)
        return cols.to(device), self.bits[i, cols].tolist(), sd.to(device)
