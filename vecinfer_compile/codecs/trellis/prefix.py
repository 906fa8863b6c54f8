"""How a chunk's split attention reads trellis codes (the protocol of
:mod:`vecinfer_compile.ops.split_attention.prefix`).

A coded key is ``k~ = mean + (e * sd) @ synthesis`` with ``e`` its unit table entries, so the
workspace holds the entries (:func:`.triton_kernels.entries_into`: a table read a component, no
matrix), the queries go to the components once (``q'' = sd * (synthesis @ q~)``, scores
``q~ . mean + q'' . e``), the prefix's log-sum-exp gets the constant ``scale * q~ . mean`` back, and
the output over the values' entries goes back once (``mean + (o * sd) @ synthesis``), as the
trellis decode does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .operands import TrellisOperands, query_components


class TrellisPrefix(NamedTuple):
    """The trellis codec's codes: its key and value operands."""

    keys: TrellisOperands
    values: TrellisOperands

    def dense(self, k_codes: torch.Tensor, v_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.vectors(k_codes), self.values.vectors(v_codes)

    def queries(self, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        qc, bias = query_components(q, self.keys)
        return qc.to(q.dtype), bias * scale

    def fill(
        self, k_codes: torch.Tensor, v_codes: torch.Tensor, length: int, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        from .triton_kernels import entries_into  # imports triton: only where it runs

        entries_into(k_codes, self.keys, length, k_out)
        entries_into(v_codes, self.values, length, v_out)

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        n, hq, d = o.shape
        hkv = self.values.mean.shape[0]
        og = o.float().view(n, hkv, hq // hkv, d) * self.values.sd[:, None]
        out = torch.einsum("nhgc,hcd->nhgd", og, self.values.synthesis) + self.values.mean[:, None]
        return out.reshape(n, hq, d)
