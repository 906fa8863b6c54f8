"""What a codec provides: the one interface between a code of the cache and the rest of the product.

A codec codes one *side* of an attention layer's cache, keys (in the key transform's domain,
``K~``) or values, as fixed-width byte strings a token and KV head. Its fitted state for one side
of one layer is its *side code* (``code``: an object of the codec's :attr:`Codec.code_type`, float32
or float64 tensors on the CPU as a file holds it). Keys and values of one layer may be coded by
different codecs in the simulate path; a :class:`~vecinfer_compile.cache.VecInferCache` layer needs
both sides coded by one codec, whose cache operations read them together.

A codec provides, by topic:

- calibration: :meth:`Codec.fit` from recorded vectors (and the layer's error metric);
- its section of the codebook file: :meth:`Codec.write` and the strict :meth:`Codec.read`;
- the simulate path: :meth:`Codec.quantize_dequantize`;
- bytes: :meth:`Codec.code_bytes` (a token and head), :meth:`Codec.state_tensors` (what the file and
  the cache hold besides the codes);
- tensor parallelism: :meth:`Codec.select_heads`;
- the cache: :meth:`Codec.operands` (one bundle of device tensors), :meth:`Codec.fill`,
  :meth:`Codec.append`, :meth:`Codec.read_kv` (the dequantized read, a registered op that the
  compile pass recognises), :meth:`Codec.decode` (one query token over codes and window),
  :meth:`Codec.prefix` (how a chunk's attention reads the coded prefix) and :attr:`Codec.rewrite`
  (the compile pass's table entry: :class:`CacheRewrite`);
- tests: :meth:`Codec.random_code` (a random side code without fitting, for the conformance suite).

The registry (:mod:`.registry`) maps a codec's :attr:`Codec.name`, as files store it, to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

SIDES = ("key", "value")


@dataclass(frozen=True)
class FitContext:
    """What a side's fit may use beyond the vectors: ``bits`` a number, the layer's ``metric``
    ``[H, D, D]`` (error-weighted codes; None: squared error), ``seed``, the k-means ``iters``
    and ``max_vectors`` (codebooks), the ``device`` to fit on, and the codec's own ``options``
    (e.g. a state count), as the calibration plan gives them."""

    bits: float
    metric: torch.Tensor | None = None
    seed: int = 0
    iters: int = 25
    max_vectors: int | None = None
    device: torch.device | str | None = None
    options: dict | None = None


@dataclass(frozen=True)
class CacheRewrite:
    """A codec's entry in the compile pass's table (:mod:`vecinfer_compile.passes.cache_attention`):
    the read op it recognises, where that read's query-side transform sits, and how the decode and
    chunk ops are emitted from the read's arguments.

    - ``read_op``: the name of the ``vecinfer`` op whose output ``(K, V)`` attention reads;
    - ``transform``: ``read args -> (lam, rotation)``, the query transform's operands;
    - ``decode``: ``(q example, read args, kv_start, scale, kernel request) -> (op, args)``;
    - ``chunk``: ``(read args, attn_mask, scale) -> (op, args)``;
    - ``write_ops``: the names of the ops that store into a layer (a graph holding one updates a cache).
    The emitters bump their own counters (``counters["vecinfer"]``)."""

    read_op: str
    transform: Callable[[tuple], tuple[Any, Any]]
    decode: Callable[..., tuple[Any, tuple]]
    chunk: Callable[..., tuple[Any, tuple]]
    write_ops: tuple[str, ...] = ()


class Codec(ABC):
    """One codec (module docstring). Subclasses set :attr:`name` and :attr:`code_type`."""

    name: ClassVar[str]
    code_type: ClassVar[type]
    rewrite: ClassVar[CacheRewrite]

    # -- calibration ----------------------------------------------------------------------------
    @abstractmethod
    def fit(self, vectors: torch.Tensor, side: str, ctx: FitContext) -> Any:
        """The side code of ``vectors [H, N, D]`` float32 (``K~`` or ``V`` of one layer's calibration
        tokens) at ``ctx.bits`` bits a number."""

    def normalize(self, code):
        """``code`` as every path reads it (a layer's codes pass through this when it is built); itself
        by default."""
        return code

    def check_plan(self, bits: list[float], head_dim: int | None, options: dict) -> None:
        """Raise a ValueError naming the fix if this codec cannot code ``bits`` (each layer's) at
        ``head_dim`` (None: not known yet) with ``options`` (called before any model runs); the
        default accepts everything."""
        return None

    def refine(
        self, queries, keys, values, lengths, transform, key_code, value_code, attention, config, *, seed: int, device
    ):
        """Both sides' codes of a layer moved to lower its attention-output error, as
        ``(key_code, value_code, loss before, loss after)``; None where this codec's codes are not
        refined (the refining methods then keep its fit)."""
        return None

    # -- the codebook file ----------------------------------------------------------------------
    @abstractmethod
    def write(self, side: str, codes: list, present: list[int]) -> dict[str, torch.Tensor]:
        """The file's tensors of ``side``'s codes (one a layer of ``present``, the attention layers)."""

    @abstractmethod
    def read(
        self,
        side: str,
        tensors: dict[str, torch.Tensor],
        *,
        path: str | Path,
        present: list[int],
        layer_bits: list[float],
        geometry: dict,
    ) -> list:
        """The side codes of ``present``'s layers from a file's ``tensors``, checked strictly: a
        ValueError naming ``path`` and the fix for anything missing, misshapen or not finite."""

    @abstractmethod
    def tensor_names(self, side: str, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The names among ``tensors`` that this codec's section of ``side`` would hold (so that a
        file naming another codec for ``side`` but holding them is refused as corrupt)."""

    # -- the simulate path ------------------------------------------------------------------------
    @abstractmethod
    def quantize_dequantize(
        self, code, x: torch.Tensor, *, metric: torch.Tensor | None = None, parallel_weight: float = 1.0
    ) -> torch.Tensor:
        """``x [B, H, T, D]`` coded and decoded, in ``x``'s dtype (``parallel_weight``: score-aware
        key codes, where the codec has them)."""

    # -- bytes ------------------------------------------------------------------------------------
    @abstractmethod
    def code_bytes(self, code, head_dim: int) -> int:
        """Bytes a token and KV head of the stored codes."""

    @abstractmethod
    def state_tensors(self, code) -> list[torch.Tensor]:
        """The tensors of ``code`` (as the file stores them; their bytes count as fixed state)."""

    # -- tensor parallelism -------------------------------------------------------------------------
    def select_heads(self, code, heads: slice):
        """``code`` for the KV heads ``heads`` only (a rank's); a code shared by every head is itself."""
        return code

    # -- tests ------------------------------------------------------------------------------------
    @abstractmethod
    def random_code(self, gen: torch.Generator, kv_heads: int, head_dim: int, bits: float, side: str):
        """A random side code without fitting (conformance tests, speed benchmarks)."""

    # -- the cache ----------------------------------------------------------------------------------
    @abstractmethod
    def operands(self, layer, device) -> Any:
        """One bundle of what the cache's operations read for ``layer``
        (:class:`~vecinfer_compile.codebooks.LayerCodebooks`, both sides this codec's), on ``device``."""

    @abstractmethod
    def operand_tensors(self, operands) -> list[torch.Tensor]:
        """The tensors of ``operands`` (their bytes count as the cache's fixed state)."""

    @abstractmethod
    def fill(self, storage, kt: torch.Tensor, v: torch.Tensor, quantizer) -> None:
        """The first update of an empty layer (``kt = K~``, ``v``: ``[B, H, T, D]``, the cache dtype):
        by :mod:`vecinfer_compile.window`'s rule all but the last ``R`` tokens coded, those the window."""

    @abstractmethod
    def append(self, storage, k: torch.Tensor, v: torch.Tensor, quantizer) -> None:
        """Append ``k`` (keys as the model gives them), ``v``: ``[B, H, T, D]`` in place, by the window
        rule, with no host sync (one registered op: it compiles with ``fullgraph=True``)."""

    @abstractmethod
    def read_kv(self, k_codes, v_codes, n_coded, k_window, v_window, n_window, quantizer):
        """The registered read op (:attr:`CacheRewrite.read_op`): every slot's K (original domain, the
        query-aware matrix and mean left to the caller) and V ``[B, H, S, D]``."""

    @abstractmethod
    def decode(
        self, storage, quantizer, q_t: torch.Tensor, kv_start: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """One query token ``q_t: [B, Hq, 1, D]`` (in ``K~``'s domain) over the codes and window ->
        ``[B, Hq, 1, D]`` in ``q_t``'s dtype; slots before ``kv_start [B]`` hidden."""

    @abstractmethod
    def prefix(self, quantizer):
        """How a chunk's split attention reads the coded prefix
        (:mod:`vecinfer_compile.ops.split_attention.prefix`'s protocol)."""
