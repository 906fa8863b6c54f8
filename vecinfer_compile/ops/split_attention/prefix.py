"""How a chunk's attention reads a layer's coded prefix: one class per codec.

The split attention of :mod:`.chunk` attends over the coded prefix with a library kernel (cuDNN or
FlashAttention-2) reading a position-major workspace a few batch rows at a time. What it puts
there, and how its queries and outputs relate to the cache's domain, is the codec's:

- :class:`CodebookPrefix` (the codebooks' codes): the workspace holds ``K~`` and ``V`` themselves
  (:func:`..dequantize.dequantize_into`); queries and outputs pass as they are.
- :class:`TrellisPrefix` (the trellis codec, :mod:`..trellis`): a coded key is
  ``k~ = mean + (e * sd) @ synthesis`` with ``e`` its unit table entries, so the workspace holds
  the entries (:func:`..triton.trellis.entries_into`: a table read a component, no matrix), the
  queries go to the components once (``q'' = sd * (synthesis @ q~)``, scores ``q~ . mean + q'' . e``),
  the prefix's log-sum-exp gets the constant ``scale * q~ . mean`` back, and the output over the
  values' entries goes back once (``mean + (o * sd) @ synthesis``), as the trellis decode does.

Each gives the same attention as :meth:`dense` (the oracle's keys and values) up to rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dequantize import dequantize_into
from ..reference import dequantize
from ..trellis import TrellisOperands, query_components


class CodebookPrefix(NamedTuple):
    """The codebooks' codes: ``key_centroids``, ``value_centroids`` ``[E, d]`` float32."""

    key_centroids: torch.Tensor
    value_centroids: torch.Tensor

    def dense(self, k_codes: torch.Tensor, v_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k_codes, v_codes [B, H, n, W]`` -> ``(K~, V)`` ``[B, H, n, D]`` float32."""
        return dequantize(k_codes, self.key_centroids), dequantize(v_codes, self.value_centroids)

    def queries(self, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``q [N, Hq, D]`` (``q~``, a row a query position) -> (the prefix's queries ``[N, Hq, D]``
        in q.dtype, the offset its log-sum-exp needs ``[N, Hq]`` float32, or None)."""
        return q, None

    def fill(self, k_codes: torch.Tensor, v_codes: torch.Tensor, length: int, k_out: torch.Tensor,
             v_out: torch.Tensor) -> None:
        """The workspace of the first ``length`` positions of ``k_codes, v_codes [R, H, Tmax, W]``:
        ``k_out, v_out [R, length, H, D]`` (position-major)."""
        dtype = k_out.dtype
        dequantize_into(k_codes, self.key_centroids.to(dtype).contiguous(), length, k_out)
        dequantize_into(v_codes, self.value_centroids.to(dtype).contiguous(), length, v_out)

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        """The prefix's attention output ``[N, Hq, D]`` -> the same in the cache's domain."""
        return o


class TrellisPrefix(NamedTuple):
    """The trellis codec's codes: its key and value operands."""

    keys: TrellisOperands
    values: TrellisOperands

    def dense(self, k_codes: torch.Tensor, v_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.vectors(k_codes), self.values.vectors(v_codes)

    def queries(self, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        qc, bias = query_components(q, self.keys)
        return qc.to(q.dtype), bias * scale

    def fill(self, k_codes: torch.Tensor, v_codes: torch.Tensor, length: int, k_out: torch.Tensor,
             v_out: torch.Tensor) -> None:
        from ..triton.trellis import entries_into  # imports triton: only where it runs

        entries_into(k_codes, self.keys, length, k_out)
        entries_into(v_codes, self.values, length, v_out)

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        n, hq, d = o.shape
        hkv = self.values.mean.shape[0]
        og = o.float().view(n, hkv, hq // hkv, d) * self.values.sd[:, None]
        out = torch.einsum("nhgc,hcd->nhgd", og, self.values.synthesis) + self.values.mean[:, None]
        return out.reshape(n, hq, d)

