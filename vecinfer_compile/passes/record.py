"""Run a Dynamo graph once on real inputs and keep the values of chosen nodes.

Used by the zero-config backend to fit smoothing factors and codebooks from the keys and values
that the first compiled call really produces.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.fx as fx

from .sdpa import concrete_int


class _AllRecorded(Exception):
    """Raised to stop interpreting once every wanted node has its value."""


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: set[fx.Node]):
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[fx.Node, torch.Tensor] = {}

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n in self.wanted:
            self.values[n] = result.detach()
            if len(self.values) == len(self.wanted):
                raise _AllRecorded
        return result


def _is_fake(x) -> bool:
    return isinstance(x, torch.Tensor) and (isinstance(x, torch._subclasses.FakeTensor) or x.device.type == "meta")


def record_nodes(gm: fx.GraphModule, example_inputs: Sequence, nodes: Iterable[fx.Node]) -> dict[fx.Node, torch.Tensor]:
    """Interpret ``gm`` on ``example_inputs`` (SymInts replaced by their concrete sizes) under
    ``no_grad`` up to the last of ``nodes`` and return ``{node: value}`` for them. In-place ops
    before that point run too (a KV-cache write is repeated by the real call; it is idempotent).
    Raises ValueError when the inputs are
    fake or meta tensors (nothing real to record)."""
    if any(_is_fake(x) for x in example_inputs):
        raise ValueError(
            "vecinfer: the example inputs are fake/meta tensors, so no codebooks can be fitted "
            "from them: pass codebooks, e.g. "
            "vecinfer_backend.configure(codebooks='codebooks.safetensors') (make them with "
            "`vecinfer calibrate`)"
        )
    inputs = [concrete_int(x) if isinstance(x, torch.SymInt) else x for x in example_inputs]
    recorder = _Recorder(gm, set(nodes))
    with torch.no_grad():
        try:
            recorder.run(*inputs)
        except _AllRecorded:
            pass
    return recorder.values
