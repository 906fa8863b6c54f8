"""How a chunk's attention reads a layer's coded prefix: the protocol each codec's prefix
implements (:meth:`vecinfer_compile.codecs.base.Codec.prefix`), and the codebooks'.

The split attention of :mod:`.chunk` attends over the coded prefix with a library kernel (cuDNN or
FlashAttention-2) reading a position-major workspace a few batch rows at a time. What it puts
there, and how its queries and outputs relate to the cache's domain, is the codec's:

- ``dense(k_codes, v_codes)``: the oracle's ``(K~, V)`` of the codes, float32;
- ``queries(q, scale)``: the prefix's queries and the offset its log-sum-exp needs (or None);
- ``fill(k_codes, v_codes, length, k_out, v_out)``: the workspace of the first ``length`` positions;
- ``outputs(o)``: the prefix's attention output back in the cache's domain.

:class:`CodebookPrefix` (the codebooks' codes): the workspace holds ``K~`` and ``V`` themselves
(:func:`..dequantize.dequantize_into`); queries and outputs pass as they are. Each prefix gives the
same attention as its ``dense`` keys and values up to rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dequantize import dequantize_into
from ..reference import dequantize


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

    def fill(
        self, k_codes: torch.Tensor, v_codes: torch.Tensor, length: int, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        """The workspace of the first ``length`` positions of ``k_codes, v_codes [R, H, Tmax, W]``:
        ``k_out, v_out [R, length, H, D]`` (position-major)."""
        dtype = k_out.dtype
        dequantize_into(k_codes, self.key_centroids.to(dtype).contiguous(), length, k_out)
        dequantize_into(v_codes, self.value_centroids.to(dtype).contiguous(), length, v_out)

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        """The prefix's attention output ``[N, Hq, D]`` -> the same in the cache's domain."""
        return o
