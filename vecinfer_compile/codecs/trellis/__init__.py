"""The trellis codec: a long-block code of a side's vectors (per-head KLT, whole bits per component,
a bitshift trellis of ``2^L`` states over them; :mod:`.code`), as the same bytes a token as the
codebooks' codes of the same bits.

Modules: :mod:`.code` (the fitted code, its encode and decode), :mod:`.walk` (the Viterbi walk and
table training, float32 oracles), :mod:`.packing` (a code string's bits), :mod:`.operands` (the
device operands, the dense read, the decode oracle and decode step), :mod:`.ops` (the registered
ops), :mod:`.prefix` (a chunk's prefix), :mod:`.viterbi` (the encoder's kernel choice),
:mod:`.file_section`, :mod:`.cuda` and :mod:`.triton_kernels` (its kernels).

In the cache everything goes through the registered ops and reads the counters on the device only,
so one form runs eagerly and inside a compiled step (CUDA graphs included): the prefill encodes
with ``trellis_encode`` (one Viterbi launch on CUDA), an append is ``trellis_append`` (one launch
for a decode step's token on CUDA), the read is ``trellis_cache_kv``, a decode step
``trellis_decode_attention`` and a chunk ``trellis_chunk_attention`` (:mod:`.rewrite`: the
compile pass's entry).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..base import CacheRewrite, Codec, FitContext
from . import file_section
from . import ops as _ops  # noqa: F401  (importing it registers the codec's vecinfer ops)
from .code import MAX_COMPONENT_BITS, TrellisCodec, random_code
from .operands import TrellisOperands
from .packing import packed_bytes
from .prefix import TrellisPrefix
from .rewrite import REWRITE

DEFAULT_STATES = 4096  # 2^12: the key codec study's best measured (docs/studies)


class TrellisLayerOperands(NamedTuple):
    """A layer's key and value codes on the cache's device."""

    keys: TrellisOperands
    values: TrellisOperands


class TrellisCodecPlugin(Codec):
    name = "trellis"
    code_type = TrellisCodec
    rewrite: CacheRewrite = REWRITE

    # -- calibration ------------------------------------------------------------------------------
    def check_plan(self, bits: list[float], head_dim: int, options: dict) -> None:
        states = options.get("states", DEFAULT_STATES)
        if states < 2 or states & (states - 1) or states > 1 << 16:
            raise ValueError(f"trellis states must be a power of two in 2..65536, got {states}")
        for b in bits:
            if b > states.bit_length() - 1:
                raise ValueError(
                    f"the trellis codec takes at most log2(states) bits a component: {b:g} bits need "
                    f"more than {states} trellis states: raise --trellis-states"
                )
            if head_dim is not None and abs(b * head_dim - round(b * head_dim)) > 1e-9:
                raise ValueError(
                    f"the trellis codec spends a whole number of bits a vector: {b:g} bits x head_dim "
                    f"{head_dim} is not one; choose other bits"
                )

    def fit(self, vectors: torch.Tensor, side: str, ctx: FitContext) -> TrellisCodec:
        states = (ctx.options or {}).get("states", DEFAULT_STATES)
        device = ctx.device or vectors.device
        return TrellisCodec.fit(vectors.to(device), ctx.bits, states.bit_length() - 1, metric=ctx.metric, seed=ctx.seed)

    # -- the file ---------------------------------------------------------------------------------
    def write(self, side: str, codes: list, present: list[int]) -> dict[str, torch.Tensor]:
        return file_section.write(side, codes)

    def read(self, side, tensors, *, path, present, layer_bits, geometry) -> list[TrellisCodec]:
        return file_section.read(side, tensors, path, geometry, [layer_bits[i] for i in present])

    def tensor_names(self, side: str, tensors) -> list[str]:
        return file_section.names(side, tensors)

    # -- simulate, bytes, heads, tests ------------------------------------------------------------------
    def quantize_dequantize(self, code, x, *, metric=None, parallel_weight: float = 1.0) -> torch.Tensor:
        return code.quantize_dequantize(x)

    def code_bytes(self, code, head_dim: int) -> int:
        return packed_bytes(code.bits)

    def state_tensors(self, code) -> list[torch.Tensor]:
        return list(code.to_tensors().values())

    def select_heads(self, code: TrellisCodec, heads: slice) -> TrellisCodec:
        return TrellisCodec.from_tensors({k: v[heads].contiguous() for k, v in code.to_tensors().items()})

    def random_code(self, gen, kv_heads: int, head_dim: int, bits: float, side: str) -> TrellisCodec:
        return random_code(gen, kv_heads, head_dim, bits, state_bits=min(MAX_COMPONENT_BITS, 6))

    # -- the cache ------------------------------------------------------------------------------------
    def operands(self, layer, device) -> TrellisLayerOperands:
        return TrellisLayerOperands(TrellisOperands.of(layer.keys, device), TrellisOperands.of(layer.values, device))

    def operand_tensors(self, operands) -> list[torch.Tensor]:
        return [*operands.keys, *operands.values]

    def fill(self, storage, kt, v, quantizer) -> None:
        ops = quantizer.operands

        def encoder(operands, width):
            return lambda x: torch.ops.vecinfer.trellis_encode(x, list(operands), width)

        storage.fill_by_window(
            kt, v, encoder(ops.keys, storage.k_codes.shape[-1]), encoder(ops.values, storage.v_codes.shape[-1])
        )

    def append(self, storage, k, v, quantizer) -> None:
        s, ops = storage, quantizer.operands
        torch.ops.vecinfer.trellis_append(
            quantizer.transform_keys(k, s.dtype),
            v,
            s.k_codes,
            s.v_codes,
            s.k_window,
            s.v_window,
            s.n_coded,
            s.n_window,
            s.append_arrivals,
            list(ops.keys),
            list(ops.values),
        )

    def read_kv(self, k_codes, v_codes, n_coded, k_window, v_window, n_window, quantizer):
        ops = quantizer.operands
        return torch.ops.vecinfer.trellis_cache_kv(
            k_codes,
            v_codes,
            n_coded,
            k_window,
            v_window,
            n_window,
            quantizer.lam,
            quantizer.rotation,
            list(ops.keys),
            list(ops.values),
        )

    def decode(self, storage, quantizer, q_t, kv_start, scale) -> torch.Tensor:
        s, ops = storage, quantizer.operands
        return torch.ops.vecinfer.trellis_decode_attention(
            q_t,
            s.k_codes,
            s.v_codes,
            s.n_coded,
            s.k_window,
            s.v_window,
            s.n_window,
            kv_start,
            scale,
            list(ops.keys),
            list(ops.values),
        )

    def prefix(self, quantizer) -> TrellisPrefix:
        return TrellisPrefix(*quantizer.operands)


CODEC = TrellisCodecPlugin()
