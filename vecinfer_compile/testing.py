"""Test helpers for users and for this project's tests.

- :func:`attention_cases`: a hypothesis strategy of attention shapes (B, Hq, Hkv, Tq, Tk, D,
  dtype, mask kind); :func:`make_attention_inputs` turns one into tensors.
- :func:`check_model`: compile a model with the exact key transform (no quantization) and check
  that it matches eager and that every SDPA was rewritten.
- :func:`tiny_model`, :func:`random_layer_codebooks`: small random
  models and quantizers (no downloads) for fast CPU tests; :class:`FixedIds`: a tokenizer stand-in
  for :func:`calibrate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from .backend import vecinfer_backend
from .codebooks import LayerCodebooks, VecInferCodebooks, average_bits, model_geometry
from .hf.layer_kinds import NO_KV_KINDS, coded_layers, kv_producers, layer_kinds
from .methods import VQ_METHODS
from .presets import get_preset
from .quant.query_aware import query_aware_matrices, second_moment
from .quant.transform import KeyTransform
from .quant.value_prediction import ValuePredictor

MASK_KINDS = ("none", "causal", "bool", "float")


class FixedIds:
    """A tokenizer stand-in for ``calibrate(model, tokenizer, text, ...)`` with a random model:
    whatever the text, it tokenizes to ``ids`` (a list of ints or a 1-D integer tensor)."""

    def __init__(self, ids) -> None:
        self.ids = [int(i) for i in ids]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(self.ids)}


@dataclass(frozen=True)
class AttentionCase:
    """Shapes of one attention call: q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, Tk, D]`` (Tq <= Tk),
    mask kind one of :data:`MASK_KINDS` ("causal" = ``is_causal=True``)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype
    mask: str


def attention_cases(
    *,
    head_dims=(16, 32, 64),
    dtypes=(torch.float32,),
    masks=MASK_KINDS,
    max_batch: int = 2,
    max_kv_heads: int = 4,
    max_group: int = 4,
    max_len: int = 24,
):
    """A hypothesis strategy of :class:`AttentionCase`. Head dims default to multiples of 16
    (the Hadamard sizes)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        kv_heads = draw(st.integers(1, max_kv_heads))
        kv_len = draw(st.integers(1, max_len))
        return AttentionCase(
            batch=draw(st.integers(1, max_batch)),
            q_heads=kv_heads * draw(st.integers(1, max_group)),
            kv_heads=kv_heads,
            q_len=draw(st.integers(1, kv_len)),
            kv_len=kv_len,
            head_dim=draw(st.sampled_from(head_dims)),
            dtype=draw(st.sampled_from(dtypes)),
            mask=draw(st.sampled_from(masks)),
        )

    return cases()


def make_attention_inputs(case: AttentionCase, seed: int = 0) -> dict:
    """Random ``query``/``key``/``value`` and the mask of ``case`` as SDPA keyword arguments
    (``attn_mask`` bool True = attend, or additive float; ``is_causal``). Every query row attends
    to at least its diagonal key, so no row is fully masked."""
    gen = torch.Generator().manual_seed(seed)
    c = case

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(c.dtype)

    out = {
        "query": rand(c.batch, c.q_heads, c.q_len, c.head_dim),
        "key": rand(c.batch, c.kv_heads, c.kv_len, c.head_dim),
        "value": rand(c.batch, c.kv_heads, c.kv_len, c.head_dim),
        "attn_mask": None,
        "is_causal": c.mask == "causal",
    }
    if c.mask in ("bool", "float"):
        keep = torch.rand(c.batch, 1, c.q_len, c.kv_len, generator=gen) > 0.3
        keep |= torch.eye(c.q_len, c.kv_len, dtype=torch.bool)[None, None]
        out["attn_mask"] = keep if c.mask == "bool" else torch.where(keep, 0.0, float("-inf")).to(c.dtype)
    return out


TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_model(
    family: str = "llama", *, layers: int = 2, attn_implementation: str = "sdpa", seed: int = 0, **overrides
):
    """A random causal LM of ``family`` with hidden 64, 4 query heads, 2 KV heads, head_dim 16,
    vocab 128 (``overrides`` replace any config field), in eval mode and float32."""
    import transformers

    names = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    if family not in names:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(names)}")
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        num_hidden_layers=layers,
        max_position_embeddings=256,
    )
    config = getattr(transformers, names[family])(**{**fields, **overrides})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def random_layer_codebooks(
    kv_heads: int,
    head_dim: int,
    *,
    bits: float = 2.0,
    seed: int = 0,
    smooth: bool = True,
    rotate: bool = True,
    query_aware: bool = False,
    center: bool = False,
    pre_rope: bool = False,
    predict_values: bool = False,
) -> LayerCodebooks:
    """Random smoothing factors in [0.5, 2) (or, ``query_aware``, the matrices of a random SPD
    query moment), with ``center`` a Gaussian key mean of scale 3, with ``pre_rope`` Llama's
    default RoPE frequencies (base 10000), with ``predict_values`` a random value predictor
    (``W`` of scale 0.3, Gaussian ``c``), and Gaussian centroids for one layer."""
    gen = torch.Generator().manual_seed(seed)
    preset = get_preset(bits)
    lam = 0.5 + 1.5 * torch.rand(kv_heads, head_dim, generator=gen) if smooth else None
    matrices = (None, None)
    if query_aware:
        queries = torch.randn(kv_heads, 4 * head_dim, head_dim, generator=gen)
        queries = queries * (0.2 + 3 * torch.rand(head_dim, generator=gen))  # anisotropic
        keys = torch.randn(kv_heads, 4 * head_dim, head_dim, generator=gen) @ torch.randn(
            head_dim, head_dim, generator=gen
        )
        matrices = query_aware_matrices(second_moment(queries, kv_heads), second_moment(keys, kv_heads))
    mean = 3 * torch.randn(kv_heads, head_dim, generator=gen) if center else None
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim) if pre_rope else None
    predictor = None
    if predict_values:
        predictor = ValuePredictor(
            0.3 * torch.randn(kv_heads, head_dim, head_dim, generator=gen),
            torch.randn(kv_heads, head_dim, generator=gen),
        )
    return LayerCodebooks(
        KeyTransform(head_dim, lam, rotate, *matrices, mean=mean, rope_inv_freq=inv_freq),
        torch.randn(preset.key.entries, preset.key.dims, generator=gen),
        torch.randn(preset.value.entries, preset.value.dims, generator=gen),
        predictor,
    )


def random_codebooks(
    config_or_geometry,
    bits: float = 2.0,
    method: str = "vecinfer",
    seed: int = 0,
    *,
    layer_bits: list[float] | None = None,
) -> VecInferCodebooks:
    """Random codebooks for every layer of a model (a HF config or a
    :func:`~vecinfer_compile.codebooks.model_geometry` dict): for tests and speed benchmarks,
    never for accuracy. Layer ``i`` uses seed ``seed + i`` and the preset ``layer_bits[i]``
    (default: ``bits`` for every layer; given, ``bits`` is their average). From a config they
    record which layers a VecInferCache codes, have none for layers without attention
    (linear-attention, convolution, state-space) and give a layer that reads another's K/V
    (:func:`~vecinfer_compile.hf.layer_kinds.kv_producers`) that layer's, as calibrated ones do."""
    geo = config_or_geometry if isinstance(config_or_geometry, dict) else model_geometry(config_or_geometry)
    spec = VQ_METHODS[method]
    per_layer = [float(bits)] * geo["num_layers"] if layer_bits is None else list(layer_bits)
    no_kv = (
        [False] * len(per_layer)
        if isinstance(config_or_geometry, dict)
        else [kind in NO_KV_KINDS for kind in layer_kinds(config_or_geometry)]
    )
    layers = [
        None
        if no_kv[i]
        else random_layer_codebooks(
            geo["num_kv_heads"],
            geo["head_dim"],
            bits=b,
            seed=seed + i,
            smooth=spec.smooth,
            rotate=spec.rotate,
            query_aware=bool(spec.query_aware),
            center=spec.center,
            pre_rope=spec.pre_rope,
            predict_values=spec.predict_values,
        )
        for i, b in enumerate(per_layer)
    ]
    if not isinstance(config_or_geometry, dict):
        layers = [layers[p] for p in kv_producers(config_or_geometry)]
    metadata = {} if isinstance(config_or_geometry, dict) else {"coded_layers": coded_layers(config_or_geometry)}
    return VecInferCodebooks(method, average_bits(per_layer), layers, geo, metadata, layer_bits=per_layer)


def cache_layer(
    layer: LayerCodebooks,
    *,
    num_kv_heads: int,
    head_dim: int,
    max_cache_len: int,
    residual: int,
    key_parallel_weight: float = 1.0,
    batch_size: int = 1,
    dtype=torch.float32,
    device="cpu",
):
    """A :class:`~vecinfer_compile.cache.VecInferLayer` holding ``layer``'s codebooks, transform
    and error metrics, as :class:`~vecinfer_compile.VecInferCache` builds one (tests of one layer)."""
    from .cache import LayerQuantizer, VecInferLayer

    quantizer = LayerQuantizer.from_codebooks(layer, device=device, key_parallel_weight=key_parallel_weight)
    return VecInferLayer(
        quantizer,
        batch_size=batch_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_cache_len=max_cache_len,
        residual=residual,
        dtype=dtype,
        device=device,
    )


@dataclass
class CheckReport:
    """What :func:`check_model` measured."""

    num_layers: int
    sdpa_rewrites: int
    max_abs_err: float
    max_ref_abs: float


def _num_attention_layers(model) -> int:
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return config.num_hidden_layers


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


LOW_PRECISION_RTOL = 2e-2  # 16-bit models: the transform rounds q~ and K~ once more than eager


def check_model(
    model, inputs=None, *, atol: float | None = None, rtol: float | None = None, backend=None
) -> CheckReport:
    """Compile ``model`` (a HF causal LM in eval mode) with the key transform but no quantization
    and assert that (1) its logits match eager within ``atol + rtol * |eager|`` and (2) every
    attention layer's SDPA was rewritten (``counters["vecinfer"]["sdpa_rewrites"]`` grows by the
    number of layers). ``inputs``: a dict of model kwargs or an ids tensor; default 16 random
    tokens. ``backend``: a configured backend (default ``vecinfer_backend.configure(quantize=False)``).
    Default tolerances follow the logits' dtype: 1e-4 for float32; for float16/bfloat16 ``rtol``
    2e-2 and ``atol`` 2e-2 of the largest eager logit (the compiled transform rounds q~ and K~ to
    16 bits, so a few ulps per layer are expected; a wrong transform is off by O(1)).
    Resets Dynamo first so the rewrite count covers exactly this compile."""
    if inputs is None:
        gen = torch.Generator().manual_seed(0)
        inputs = torch.randint(0, model.config.get_text_config().vocab_size, (1, 16), generator=gen)
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs.to(model.device)}
    inputs = {"use_cache": False, **inputs}
    backend = backend or vecinfer_backend.configure(quantize=False)
    torch._dynamo.reset()
    before = counters["vecinfer"]["sdpa_rewrites"]
    with torch.no_grad():
        expected = _logits(model(**inputs))
        actual = _logits(torch.compile(model, backend=backend, fullgraph=True)(**inputs))
    layers = _num_attention_layers(model)
    rewrites = counters["vecinfer"]["sdpa_rewrites"] - before
    if rewrites != layers:
        raise AssertionError(
            f"vecinfer rewrote {rewrites} SDPA call(s) for {layers} attention layers: load the model "
            'with attn_implementation="sdpa" and make sure it compiles with fullgraph=True'
        )
    scale = expected.abs().max().item()
    low_precision = expected.dtype in (torch.float16, torch.bfloat16)
    if rtol is None:
        rtol = LOW_PRECISION_RTOL if low_precision else 1e-4
    if atol is None:
        atol = LOW_PRECISION_RTOL * scale if low_precision else 1e-4
    err = (actual.float() - expected.float()).abs()
    if not bool((err <= atol + rtol * expected.float().abs()).all()):
        raise AssertionError(
            f"vecinfer: compiled logits differ from eager by up to {err.max().item():.3g} (largest "
            f"|logit| {scale:.3g}) in {expected.dtype}, beyond atol={atol:.3g}, rtol={rtol:.3g}. "
            "In a 16-bit dtype, check in float32 (model.float()) or pass atol=/rtol=; in float32 "
            "the transform is not exact somewhere: report it with the model's config"
        )
    return CheckReport(
        num_layers=layers,
        sdpa_rewrites=rewrites,
        max_abs_err=err.max().item(),
        max_ref_abs=scale,
    )
