"""``vecinfer_backend``: a torch.compile backend that runs attention over VecInfer codes.

    model = torch.compile(model, backend=vecinfer_backend)                      # zero-config
    model = torch.compile(model, backend=vecinfer_backend.configure(codebooks="cb.safetensors"))
    model = torch.compile(model, backend="vecinfer")                            # same, by name

Each Dynamo graph goes through the choice of each VecInferCache append's implementation
(:func:`vecinfer_compile.passes.cache_append.rewrite_cache_append`), the attention over an empty
VecInferCache's prefill kept in full precision
(:func:`vecinfer_compile.passes.cache_attention.keep_prefill_in_full_precision`: transformers compiles
a chunked prefill's forwards), the decode rewrite over a VecInferCache
(:func:`vecinfer_compile.passes.cache_attention.rewrite_cache_attention`), then
:func:`vecinfer_compile.passes.rewrite_sdpa` for every other SDPA, then Inductor's ``compile_fx``
(``mode``/``options`` become Inductor config patches, per call).

Zero-config: without codebooks, the first graph that reaches a layer fits that layer's smoothing
factors and codebooks from the keys/values of the call being compiled (the graph is interpreted
once on the real example inputs), logs one warning (once per backend: it decides the accuracy),
and keeps them on the backend object, so
recompiles (new shapes, graph breaks) reuse them.

Tensor parallelism (transformers' ``tp_plan="auto"``): the rank and TP size come from the graph's
DTensor parameters (:func:`vecinfer_compile.hf.tensor_parallel.graph_shard`); given codebooks are
checked against the whole model's geometry and their per-KV-head state is cut to the rank's
heads. Zero-config fitting under TP fits each rank from its own heads (so ranks differ from
one process): pass a calibrated file for results equal to one process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor
import torch._inductor.compile_fx
import torch.fx as fx
from torch._dynamo.utils import counters

from . import ops  # noqa: F401  (registers torch.ops.vecinfer.*)
from .calibration.fit import FitSettings, LayerSamples, fit_layer
from .codebooks import LayerCodebooks, VecInferCodebooks, load_codebooks
from .hf.tensor_parallel import TPShard, graph_shard, local_kv_heads, local_layer
from .kernel_env import env_kernel
from .methods import VQ_METHODS, check_runs_over_codes
from .ops.kernel_request import check_kernel_name
from .passes import SdpaSite, find_sdpa_sites, record_nodes, rewrite_sdpa
from .passes.cache_append import rewrite_cache_append
from .passes.cache_attention import (
    CACHE_READ_META,
    keep_prefill_in_full_precision,
    rewrite_cache_attention,
    updates_a_cache,
)
from .presets import get_preset

log = logging.getLogger(__name__)

DEFAULT_BITS = 2.0
FIT_ITERS = 8
BACKEND_NAME = "vecinfer"


@dataclass(frozen=True)
class BackendConfig:
    """codebooks: None = fit from the first call; bits/method: of the fitted codebooks (checked
    against given ones); residual: most recent keys kept in full precision; quantize: False =
    transform only (q~, K~ through plain SDPA); decode_kernel: the CUDA decode-attention kernel
    over a VecInferCache, "cuda" (NVRTC), "triton" or "auto" (None: ``$VECINFER_KERNEL``,
    else auto)."""

    codebooks: VecInferCodebooks | None = None
    bits: float = DEFAULT_BITS
    method: str = "vecinfer"
    residual: int = 0
    quantize: bool = True
    decode_kernel: str | None = None


def _resolve(
    codebooks, bits: float | None, method: str | None, residual: int, quantize: bool, decode_kernel: str | None = None
) -> BackendConfig:
    if isinstance(codebooks, (str, Path)):
        codebooks = load_codebooks(codebooks)
    if method is None:  # a codebook file says its method; a zero-config fit is VecInfer's
        method = codebooks.method if isinstance(codebooks, VecInferCodebooks) else "vecinfer"
    if method not in VQ_METHODS:
        raise ValueError(f"vecinfer_backend runs the VQ methods {', '.join(VQ_METHODS)}; got method {method!r}")
    check_runs_over_codes(method)
    if residual < 0:
        raise ValueError(f"residual must be >= 0, got {residual}")
    if decode_kernel is not None:
        check_kernel_name(decode_kernel)
    else:
        env_kernel()  # a bad $VECINFER_KERNEL refused now, not when a CUDA op first asks
    if codebooks is not None and not isinstance(codebooks, VecInferCodebooks):
        raise TypeError(f"codebooks must be a path, a VecInferCodebooks or None, got {type(codebooks).__name__}")
    if codebooks is None and VQ_METHODS[method].query_aware:
        raise ValueError(
            f"method {method!r} needs calibrated codebooks (its key transform is fitted to the model's "
            f"queries, which a compile-time fit does not see): pass codebooks=vecinfer_compile.calibrate("
            f"model, tokenizer, text, method={method!r}) or a file from `vecinfer calibrate --method {method}`"
        )
    if codebooks is None:
        bits = DEFAULT_BITS if bits is None else float(bits)
        get_preset(bits)  # a clear error for an unknown bit-width, now rather than at compile
        return BackendConfig(None, bits, method, residual, quantize, decode_kernel)
    if bits is not None and float(bits) != float(codebooks.bits):
        raise ValueError(
            f"the codebooks are for {codebooks.bits:g} bits, not {bits:g}: calibrate at {bits:g} "
            f"bits or pass bits={codebooks.bits:g}"
        )
    if method != codebooks.method:
        raise ValueError(
            f"the codebooks are for method {codebooks.method!r}, not {method!r}: leave method unset (the "
            f"backend takes the codebooks' method) or calibrate with method={method!r} (--method {method} "
            "on the command line)"
        )
    return BackendConfig(codebooks, float(codebooks.bits), method, residual, quantize, decode_kernel)


def _config_patches(mode: str | None, options: dict | None) -> dict:
    """Inductor config patches for torch.compile's ``mode``/``options``. With CUDA graphs on,
    graph partitioning is off unless asked for: on torch 2.11 a partitioned decode graph that
    recompiles with dynamic shapes (generate() with a new prompt length) fails at run time with
    ``NameError: name 's95' is not defined`` (a size symbol missing from a partition)."""
    patches = dict(torch._inductor.list_mode_options(mode)) if mode not in (None, "default") else {}
    patches.update(options or {})
    if patches.get("triton.cudagraphs"):
        patches.setdefault("graph_partition", False)
    return patches


def _fit_layer(
    keys: list[torch.Tensor], values: list[torch.Tensor], config: BackendConfig, layer: int
) -> LayerCodebooks:
    """Smoothing factors and codebooks from recorded ``[B, Hkv, T, D]`` keys/values
    (:func:`~vecinfer_compile.calibration.fit.fit_layer`, seeded by the layer index)."""
    head_dim = keys[0].shape[-1]
    k = torch.cat([x.float().transpose(0, 1).reshape(x.shape[1], -1, head_dim) for x in keys], 1)
    v = torch.cat([x.float().reshape(-1, head_dim) for x in values], 0)
    fit = fit_layer(
        LayerSamples(k, v),
        VQ_METHODS[config.method],
        [config.bits],
        FitSettings(FIT_ITERS),
        key_seed=layer,
        value_seed=layer,
    )
    return fit.codebooks[config.bits]


def _fits(layer: LayerCodebooks, site: SdpaSite) -> bool:
    """Whether fitted codebooks match the geometry of an attention call."""
    lam = layer.transform.lam
    return layer.transform.head_dim == site.head_dim and (lam is None or lam.shape[0] == site.kv_heads)


class VecInferBackend:
    """A torch.compile backend ``(gm, example_inputs, *, mode=None, options=None)``.

    Make variants with :meth:`configure`; each object keeps the codebooks it fitted (zero-config)
    by layer index across recompiles. A fitted layer whose geometry (KV heads, head_dim) does not
    match the attention being compiled, e.g. after compiling another model with the same object,
    is fitted again; two models of one geometry would share fits, so give each model its own
    ``vecinfer_backend.configure()``."""

    __name__ = BACKEND_NAME

    def __init__(self, config: BackendConfig | None = None):
        self.config = config or BackendConfig()
        self.fitted: dict[int, LayerCodebooks] = {}
        self._warned_no_sdpa = self._warned_fit = False

    def configure(
        self,
        codebooks: str | Path | VecInferCodebooks | None = None,
        *,
        bits: float | None = None,
        method: str | None = None,
        residual: int = 0,
        quantize: bool = True,
        decode_kernel: str | None = None,
    ) -> VecInferBackend:
        """A new backend. codebooks: a file from ``vecinfer calibrate``, loaded codebooks, or None
        to fit them from the first call; bits: bit-width (default 2, or the codebooks'); method:
        one of :data:`vecinfer_compile.methods.VQ_METHODS` (default: the codebooks' own, or
        vecinfer for a zero-config fit; one that contradicts the codebooks is an error); residual:
        most recent keys kept in full precision;
        quantize=False: apply the exact key transform only (for checks); decode_kernel: "cuda",
        "triton" or "auto" for decode attention over a VecInferCache on CUDA (default: the
        environment variable VECINFER_KERNEL, else auto)."""
        return VecInferBackend(_resolve(codebooks, bits, method, residual, quantize, decode_kernel))

    def __deepcopy__(self, memo) -> VecInferBackend:
        # HF's CompileConfig deep-copies its backend; keep one object so fitted codebooks persist.
        return self

    def __repr__(self) -> str:
        c = self.config
        source = "fit-on-first-call" if c.codebooks is None else "given"
        return (
            f"VecInferBackend(bits={c.bits:g}, method={c.method!r}, codebooks={source}, "
            f"residual={c.residual}, quantize={c.quantize}, decode_kernel={c.decode_kernel!r})"
        )

    def __call__(self, gm: fx.GraphModule, example_inputs, *, mode: str | None = None, options: dict | None = None):
        if self.config.decode_kernel is None:
            env_kernel()  # the default backend is not configured: a bad $VECINFER_KERNEL refused here
        with_cache = updates_a_cache(gm)  # then no attention of it is simulate-quantized
        rewrite_cache_append(gm, self.config.decode_kernel)
        keep_prefill_in_full_precision(gm)
        cache_reads = rewrite_cache_attention(gm, self.config.decode_kernel)
        cache_reads += sum(bool(n.meta.get(CACHE_READ_META)) for n in gm.graph.nodes)  # left over the cache
        all_sites = [] if with_cache else find_sdpa_sites(gm)
        sites = self._coded(all_sites)
        if sites:
            given = self.config.codebooks
            if given is not None:
                given.check_compiled_simulate()
            layers = self._layers(gm, example_inputs, sites)
            rewrite_sdpa(
                gm,
                sites,
                layers,
                quantize=self.config.quantize,
                residual=self.config.residual,
                key_parallel_weight=1.0 if given is None else given.key_parallel_weight,
            )
        elif not (with_cache or all_sites or cache_reads or self.fitted or self._warned_no_sdpa):
            self._warned_no_sdpa = True
            log.warning(
                "vecinfer: this graph has no F.scaled_dot_product_attention call, so nothing is "
                "quantized in it. If the model has attention, load it with "
                'attn_implementation="sdpa" (or call model.set_attn_implementation("sdpa")) '
                "and compile with fullgraph=True to find graph breaks"
            )
        return torch._inductor.compile_fx.compile_fx(gm, example_inputs, config_patches=_config_patches(mode, options))

    def _coded(self, sites: list[SdpaSite]) -> list[SdpaSite]:
        """The sites of layers a VecInferCache codes, as the codebooks record them (a model of
        mixed attention kinds: :mod:`vecinfer_compile.hf.layer_kinds`); the others stay full
        precision, as in the cache and the eager simulate path. Zero-config (no record): every site."""
        codebooks = self.config.codebooks
        coded = None if codebooks is None else codebooks.metadata.get("coded_layers")
        if coded is None:
            return sites
        kept = [s for s in sites if s.layer < len(coded) and coded[s.layer]]
        counters["vecinfer"]["sdpa_uncoded_layer"] += len(sites) - len(kept)
        return kept

    # -- codebooks per layer ------------------------------------------------------------------
    def _layers(self, gm, example_inputs, sites: list[SdpaSite]) -> dict[int, LayerCodebooks]:
        codebooks = self.config.codebooks
        if codebooks is not None:
            shard = graph_shard(example_inputs)
            if shard is None:  # under TP the cache checks (gathering weights here would be a collective)
                codebooks.check_graph_weights(gm, example_inputs)
            return {s.layer: self._given_layer(codebooks, s, shard) for s in sites}
        stale = [s for s in sites if s.layer in self.fitted and not _fits(self.fitted[s.layer], s)]
        if stale:
            log.info(
                "vecinfer: layer(s) %s were fitted for attention of another geometry (another "
                "model?); fitting them again from this call",
                sorted({s.layer for s in stale}),
            )
            for s in stale:
                del self.fitted[s.layer]
        missing = [s for s in sites if s.layer not in self.fitted]
        if missing:
            self._fit(gm, example_inputs, missing)
        return {s.layer: self.fitted[s.layer] for s in sites}

    @staticmethod
    def _given_layer(codebooks: VecInferCodebooks, site: SdpaSite, shard: TPShard | None = None) -> LayerCodebooks:
        """Layer ``site.layer`` of ``codebooks``, cut to the rank's KV heads under ``shard``."""
        geometry = codebooks.geometry
        total = geometry["num_kv_heads"]
        heads, local = local_kv_heads(shard, total)
        if site.layer >= geometry["num_layers"] or site.head_dim != geometry["head_dim"] or site.kv_heads != local:
            where = (
                ""
                if shard is None
                else (f" (tensor parallel rank {shard.rank} of {shard.size}: {local} of their KV heads per rank)")
            )
            raise ValueError(
                f"vecinfer: attention layer {site.layer} ({site.kv_heads} KV heads, head_dim "
                f"{site.head_dim}) does not fit codebooks calibrated for {geometry['num_layers']} "
                f"layers, {total} KV heads, head_dim {geometry['head_dim']}{where}: "
                "run `vecinfer calibrate` on this model"
            )
        layer = codebooks.layer(site.layer)
        return layer if shard is None else local_layer(layer, heads)

    def _fit(self, gm, example_inputs, sites: list[SdpaSite]) -> None:
        recorded = record_nodes(gm, example_inputs, [n for s in sites for n in (s.key, s.value)])
        by_layer: dict[int, list[SdpaSite]] = {}
        for site in sites:
            by_layer.setdefault(site.layer, []).append(site)
        for layer, group in by_layer.items():
            self.fitted[layer] = _fit_layer(
                [recorded[s.key] for s in group], [recorded[s.value] for s in group], self.config, layer
            )
        first = recorded[sites[0].key]
        tokens = first.shape[0] * first.shape[2]
        if not self.config.quantize:  # transform-only check: the fit is smoothing factors, no advice
            log.info(
                "vecinfer: fitted smoothing factors for %d layer(s) from this call's %d token(s)", len(by_layer), tokens
            )
            return
        if self._warned_fit:  # once per backend: a warning, since it decides the accuracy
            return
        self._warned_fit = True
        log.warning(
            "vecinfer: no codebooks given; fitted %g-bit %s codebooks for %d layer(s) from this "
            "call's %d token(s) — calibrate for better accuracy: `vecinfer calibrate --model "
            "MODEL_DIR --text CALIBRATION.txt --bits %g --out cb.safetensors`, then "
            'vecinfer_backend.configure(codebooks="cb.safetensors")',
            self.config.bits,
            self.config.method,
            len(by_layer),
            tokens,
            self.config.bits,
        )


vecinfer_backend = VecInferBackend()


def _register() -> None:
    if BACKEND_NAME not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=vecinfer_backend, name=BACKEND_NAME)


_register()
