"""A long-block code of a layer's keys or values: per-head KLT, integer bits per component, a
bitshift trellis over them.

One layer's vectors ``x`` (keys in a method's coded domain, after
:class:`~.transform.KeyTransform`; or values as the model makes them) are coded per KV head as

1. ``y = (x - mean) @ analysis``: the KLT (:class:`~.klt.KLT`) of the vectors measured in the error
   metric ``M`` the codes should lower (``analysis = M^(1/2) U``; without a metric ``M = I`` and
   ``analysis = U``, orthonormal), components by decreasing variance, so that squared error on
   ``y`` is the error ``r^T M r`` of the vector (:mod:`.weighted_codes`: ``qaware``'s key metric
   is the expected score error plus the squared error, its value metric ``o_proj``'s Gram matrix);
2. ``bits[h, t]`` integer bits for component ``t`` (:func:`~.klt.greedy_allocation` under the unit
   Gaussian's Lloyd-Max curve: the top components get several bits, the tail none), summing to
   ``bits_per_element * D``, so a token and head costs exactly what the codebooks' codes cost, with
   no side information per token;
3. the coded components, each divided by its standard deviation, as one sequence through a
   bitshift trellis of ``2^L`` states (:mod:`.trellis`: Viterbi encode, one table lookup per
   component to decode), with tables trained per head and bit width on calibration vectors;
4. back: ``x_hat = mean + scale * (y_hat @ synthesis)`` (``synthesis = analysis^-1``; components
   at 0 bits decode to the mean), where ``scale`` (one number a head, fitted on calibration
   vectors) gives the decoded vectors the calibration vectors' mean squared deviation: the Lloyd
   tables decode to conditional means, which shrink every vector toward the mean by a few percent
   (every score with it, for keys), and that costs more perplexity than the squared error the scale
   adds (docs/results/accuracy.md). The scale is free at run time (it folds into the query side or
   the output).

The simulate path runs it, and VecInferCache, eager or compiled, with keys and values both coded
(:mod:`vecinfer_compile.codecs.trellis.cache_layer`; docs/results/accuracy.md, "A long-block key codec").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quant.klt import KLT, gaussian_lloyd_max_distortion, greedy_allocation
from .packing import pack_walks
from .walk import train_luts, viterbi

MAX_COMPONENT_BITS = 12  # the allocation's curve reaches this far; it never gives a component more than L
PARTS = ("mean", "analysis", "synthesis", "variance", "scale", "bits", "tables")  # to_tensors' names
SCALE_SAMPLE = 4096  # calibration vectors a head that the norm-matching scale is fitted on


def metric_sqrt(metric: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M^(1/2), M^(-1/2))`` float64 of symmetric positive definite ``metric: [H, D, D]``."""
    lam, vec = torch.linalg.eigh(metric.double())
    if not bool((lam > 0).all()):
        raise ValueError("the trellis codec's error metric must be positive definite")
    return (vec * lam.sqrt()[:, None]) @ vec.transpose(1, 2), (vec / lam.sqrt()[:, None]) @ vec.transpose(1, 2)


@dataclass
class TrellisCodec:
    """One layer's codec of keys or values, per KV head. ``mean: [H, D]``; ``analysis, synthesis:
    [H, D, D]`` (inverses: vectors to components and back); ``variance: [H, D]`` of the components, decreasing;
    ``scale: [H]``, the decoded deviations' norm-matching factor (float64); ``bits: [H, D]`` int64,
    bits of each component; ``tables: [H, W, 2^L]`` float32, row ``k - 1`` head ``h``'s table for a
    ``k``-bit step (unit scale: a component decodes to ``tables[h, k - 1, state] * sqrt(variance)``;
    zeros for a width the head does not use; ``W``: the widest, ``L``: :attr:`state_bits`)."""

    mean: torch.Tensor
    analysis: torch.Tensor
    synthesis: torch.Tensor
    variance: torch.Tensor
    scale: torch.Tensor
    bits: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def fit(
        cls,
        vectors: torch.Tensor,
        bits_per_element: float,
        state_bits: int,
        *,
        metric: torch.Tensor | None = None,
        train_vectors: int = 4096,
        rounds: int = 3,
        seed: int = 0,
    ) -> TrellisCodec:
        """From calibration vectors (keys in the coded domain, or values) ``vectors: [H, N, D]`` (any
        float dtype and device; the tables are trained there) and the error ``metric: [H, D, D]`` to
        lower (None: squared error): the KLT on all ``N``, the allocation of ``round(bits_per_element * D)``
        bits a head, tables on a seeded sample of ``train_vectors``."""
        h, n, d = vectors.shape
        budget = round(bits_per_element * d)
        if budget <= 0 or abs(budget - bits_per_element * d) > 1e-9:
            raise ValueError(
                f"bits_per_element * head_dim must be a positive whole number of bits, got {bits_per_element:g} * {d}"
            )
        if not 1 <= state_bits <= 24:
            raise ValueError(f"state_bits (L: 2^L trellis states) must be in 1..24, got {state_bits}")
        if budget > d * min(MAX_COMPONENT_BITS, state_bits):
            raise ValueError(
                f"{bits_per_element:g} bits an element need more than {state_bits}-bit trellis steps "
                f"(a component takes at most min(L, {MAX_COMPONENT_BITS}) bits): use more states"
            )
        x = vectors.detach().double().cpu()
        if metric is None:
            root = inverse_root = torch.eye(d, dtype=torch.float64).expand(h, d, d)
        else:
            root, inverse_root = metric_sqrt(metric.detach().cpu())
        klt = KLT.fit(x @ root)
        analysis = root @ klt.basis
        synthesis = klt.basis.transpose(1, 2) @ inverse_root
        mean = klt.mean[:, None] @ inverse_root  # the vectors' mean, back in their domain
        curve = gaussian_lloyd_max_distortion(min(MAX_COMPONENT_BITS, state_bits))
        bits = torch.stack([greedy_allocation(klt.variance[i], budget, curve) for i in range(h)])
        y = (x - mean) @ analysis
        tables = torch.zeros(h, int(bits.max()), 1 << state_bits)
        for i in range(h):
            cols = bits[i].nonzero()[:, 0]
            gen = torch.Generator().manual_seed(seed + i)
            pick = torch.randperm(n, generator=gen)[:train_vectors]
            sample = (y[i][pick][:, cols] / klt.variance[i, cols].sqrt().clamp_min(1e-30)).float()
            luts = train_luts(
                sample.to(vectors.device), bits[i, cols].tolist(), state_bits, rounds=rounds, seed=seed + i
            )
            for k, table in luts.items():
                tables[i, k - 1] = table.cpu()
        codec = cls(mean[:, 0], analysis, synthesis, klt.variance, torch.ones(h, dtype=torch.float64), bits, tables)
        gen = torch.Generator().manual_seed(seed)
        sample = vectors.detach()[:, torch.randperm(n, generator=gen)[:SCALE_SAMPLE]].double()
        deviation = sample - codec.mean.to(sample.device)[:, None]
        decoded = codec.quantize_dequantize(sample) - codec.mean.to(sample.device)[:, None]
        codec.scale = ((deviation**2).sum((1, 2)) / (decoded**2).sum((1, 2)).clamp_min(1e-30)).sqrt().cpu()
        return codec

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The codec as float32 tensors (the codebook file's, named :data:`PARTS`): ``mean [H, D]``,
        ``analysis``, ``synthesis [H, D, D]``, ``variance [H, D]``, ``scale [H]``, ``bits [H, D]``
        (whole numbers) and ``tables [H, W, 2^L]``."""
        return {
            "mean": self.mean.float(),
            "analysis": self.analysis.float(),
            "synthesis": self.synthesis.float(),
            "variance": self.variance.float(),
            "scale": self.scale.float(),
            "bits": self.bits.float(),
            "tables": self.tables.float(),
        }

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> TrellisCodec:
        """:meth:`to_tensors`' inverse (shapes checked by the file's reader)."""
        return cls(
            t["mean"].double(),
            t["analysis"].double(),
            t["synthesis"].double(),
            t["variance"].double(),
            t["scale"].double(),
            t["bits"].round().long(),
            t["tables"].float(),
        )

    @property
    def num_heads(self) -> int:
        return self.bits.shape[0]

    @property
    def state_bits(self) -> int:
        """``L``: the trellis has ``2^L`` states."""
        return self.tables.shape[-1].bit_length() - 1

    def bits_per_element(self) -> float:
        return float(self.bits.sum(1).double().mean()) / self.bits.shape[1]

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self.__dict__.pop("_operands", None)  # a changed part (the trial's unscaled rows set scale) drops the copies

    def on_device(self, device) -> dict[str, torch.Tensor]:
        """What encode and decode read, on ``device``, made once a device: ``mean, analysis`` float64;
        ``synthesis`` float64 times the scale; ``sd`` float64 ``[H, D]`` (0 where a component has 0
        bits), ``inverse_sd`` (1 there); ``bits`` int32; ``rows [H, D]`` int64, each component's
        table's offset in ``tables`` (float32 ``[H, W, 2^L]``) flattened."""
        device = torch.device(device)
        cache = self.__dict__.setdefault("_operands", {})
        if device not in cache:
            coded = self.bits > 0
            sd = torch.where(coded, self.variance.sqrt(), 0.0)
            width, states = self.tables.shape[1:]
            rows = (torch.arange(self.num_heads)[:, None] * width + (self.bits - 1).clamp_min(0)) * states
            parts = {
                "mean": self.mean,
                "analysis": self.analysis,
                "sd": sd,
                "synthesis": self.synthesis * self.scale[:, None, None],
                "inverse_sd": torch.where(coded, 1 / sd.clamp_min(1e-30), 1.0),
                "bits": self.bits.int(),
                "rows": rows,
                "tables": self.tables.float().contiguous(),
            }
            cache[device] = {name: t.to(device) for name, t in parts.items()}
        return cache[device]

    def encode_packed(self, vectors: torch.Tensor) -> torch.Tensor:
        """``vectors: [..., H, T, D]`` -> the stored codes ``[N, H, nbytes]`` uint8 (``bits_per_element
        * D`` bits a token and head: :mod:`.trellis_packing`); on CUDA the Viterbi launch writes them."""
        on = self.on_device(vectors.device)
        return packed_codes(self._unit(vectors), on["bits"], on["tables"])

    def encode(self, vectors: torch.Tensor) -> torch.Tensor:
        """``vectors: [..., H, T, D]`` -> trellis states ``[N, H, D]`` int32 (``N``: the product of
        the leading dims and ``T``; component ``c`` of head ``h`` decodes from state ``[n, h, c]``,
        0 where it has 0 bits), on the vectors' device (:func:`walks`)."""
        on = self.on_device(vectors.device)
        return walks(self._unit(vectors), on["bits"], on["tables"])

    def _unit(self, vectors: torch.Tensor) -> torch.Tensor:
        """``[..., H, T, D]`` -> the components at unit scale ``[N, H, D]`` float32 (:func:`components`)."""
        if vectors.shape[-3] != self.num_heads or vectors.shape[-1] != self.bits.shape[1]:
            raise ValueError(
                f"vectors of shape {tuple(vectors.shape)}: this codec codes [..., {self.num_heads}, T, "
                f"{self.bits.shape[1]}] (KV heads, tokens, head_dim)"
            )
        on = self.on_device(vectors.device)
        return components(vectors, on["mean"], on["analysis"], on["inverse_sd"])

    def decode(self, states: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`encode`'s states ``[N, H, D]`` back to vectors of ``shape`` ``[..., H, T, D]`` and
        ``dtype``: each component its table entry times its standard deviation (0 bits: 0), then
        ``mean + scale * (y @ synthesis)``."""
        h, t, d = shape[-3:]
        on = self.on_device(states.device)
        y = on["tables"].flatten()[on["rows"] + states.long()].double() * on["sd"]
        x = torch.einsum("nhc,hcd->nhd", y, on["synthesis"]) + on["mean"]
        return x.reshape(*shape[:-3], t, h, d).movedim(-2, -3).to(dtype)

    def quantize_dequantize(self, vectors: torch.Tensor) -> torch.Tensor:
        """``vectors: [..., H, T, D]`` through the code and back, same shape, dtype and device."""
        return self.decode(self.encode(vectors), vectors.shape, vectors.dtype)


def random_code(gen: torch.Generator, kv_heads: int, head_dim: int, bits: float, state_bits: int) -> TrellisCodec:
    """A random :class:`TrellisCodec` without fitting (tests, speed benchmarks): a
    Gaussian mean, a random well-conditioned analysis (its inverse the synthesis), decreasing
    variances, a scale near 1, each head's ``bits * head_dim`` bits at random over its components
    (at most ``min(4, L)`` a component; sorted, larger first) and Gaussian tables."""
    h, d = kv_heads, head_dim
    budget, widest = round(bits * d), min(4, state_bits)
    if budget > widest * d:
        raise ValueError(f"{bits:g} bits an element do not fit components of at most {widest} bits")
    alloc = torch.zeros(h, d, dtype=torch.long)
    for i in range(h):
        for _ in range(budget):  # one bit at a time to a random component with room
            room = (alloc[i] < widest).nonzero()[:, 0]
            alloc[i, room[int(torch.randint(len(room), (1,), generator=gen))]] += 1
    alloc = alloc.sort(1, descending=True).values
    analysis = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0] * (
        0.5 + torch.rand(h, 1, d, generator=gen, dtype=torch.float64)
    )
    return TrellisCodec(
        torch.randn(h, d, generator=gen, dtype=torch.float64),
        analysis,
        torch.linalg.inv(analysis),
        torch.logspace(0, -1, d, dtype=torch.float64).expand(h, d).clone(),
        1 + 0.05 * torch.rand(h, generator=gen, dtype=torch.float64),
        alloc,
        torch.randn(h, int(alloc.max()), 1 << state_bits, generator=gen),
    )


def components(
    vectors: torch.Tensor, mean: torch.Tensor, analysis: torch.Tensor, inverse_sd: torch.Tensor
) -> torch.Tensor:
    """What the trellis codes: ``vectors [..., H, T, D]`` -> ``((x - mean) @ analysis) * inverse_sd``
    as ``[N, H, D]`` float32 (``N``: the leading dims and ``T``, token-major), computed in float64
    (``mean, inverse_sd [H, D]``, ``analysis [H, D, D]``: :meth:`TrellisCodec.on_device`'s)."""
    h, d = vectors.shape[-3], vectors.shape[-1]
    x = vectors.movedim(-3, -2).reshape(-1, h, d).double()
    return (torch.einsum("nhd,hdc->nhc", x - mean, analysis) * inverse_sd).float()


def walks(unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Least-squared-error trellis walks of the components ``unit [N, H, D]`` (``bits [H, D]``
    int32, ``tables [H, W, 2^L]`` float32 on their device) -> states ``[N, H, D]`` int32 (0 where a
    component has 0 bits). On CUDA (up to 2^13 states) one Triton launch
    (:mod:`vecinfer_compile.codecs.trellis.triton_kernels`), elsewhere the torch reference per head."""
    if unit.is_cuda:
        from .triton_kernels import MAX_STATE_BITS, viterbi_walks  # imports triton: only where it runs

        if tables.shape[-1].bit_length() - 1 <= MAX_STATE_BITS:
            return viterbi_walks(unit, bits, tables)
    out = torch.zeros(unit.shape, dtype=torch.int32, device=unit.device)
    for i in range(unit.shape[1]):
        coded = bits[i] > 0
        steps = bits[i][coded].tolist()
        luts = {k: tables[i, k - 1] for k in set(steps)}
        cols = coded.nonzero()[:, 0]
        out[:, i, cols] = viterbi(unit[:, i, cols], steps, luts).int()
    return out


def packed_codes(
    unit: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor, nbytes: int | None = None
) -> torch.Tensor:
    """:func:`walks` in the stored layout, ``[N, H, nbytes]`` uint8 (:mod:`.trellis_packing`); on
    CUDA the Viterbi launch writes them (:mod:`vecinfer_compile.codecs.trellis.viterbi`: the CUDA kernel, else
    Triton's; ``nbytes`` given: no host sync there)."""
    if unit.is_cuda:
        from .triton_kernels import MAX_STATE_BITS  # imports triton: only where it runs
        from .viterbi import viterbi_codes_gpu

        if tables.shape[-1].bit_length() - 1 <= MAX_STATE_BITS:
            return viterbi_codes_gpu(unit, bits, tables, nbytes)
    return pack_walks(walks(unit, bits, tables), bits)
