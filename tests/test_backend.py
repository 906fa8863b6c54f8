"""vecinfer_backend end to end through Inductor on CPU: model families, transform exactness,
compiled simulate vs eager simulate, zero-config, dynamic shapes, mode=, registration, errors."""

from __future__ import annotations

import copy
import importlib
import logging
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import vecinfer_compile.backend as backend_module
from vecinfer_compile.backend import vecinfer_backend
from vecinfer_compile.codebooks import VecInferCodebooks, model_geometry
from vecinfer_compile.testing import TINY_FAMILIES, check_model, random_layer_codebooks, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_zero_config_dynamic_reduce_overhead(caplog, tmp_path, monkeypatch):
    """No codebooks: fits from the first call and logs one warning (visible by default: it decides
    the accuracy; it used to be an info line), once per backend, whose advice is a `vecinfer
    calibrate` command line the CLI accepts (given the files it names); dynamic=True serves
    several lengths from one graph; mode="reduce-overhead" is accepted (just runs on CPU)."""
    from test_cli import _inputs_for

    from vecinfer_compile.cli import build_parser

    model = tiny_model("qwen3")
    backend = vecinfer_backend.configure(bits=2)
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True, mode="reduce-overhead")
    counters.clear()
    with caplog.at_level(logging.INFO, logger="vecinfer_compile.backend"), torch.no_grad():
        outs = [compiled(input_ids=ids(t, seed=t), use_cache=False).logits for t in (9, 13, 17)]
    records = [r for r in caplog.records if r.name == "vecinfer_compile.backend"]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1 and records[0].levelno == logging.WARNING, lines
    assert "fitted 2-bit vecinfer codebooks for 2 layer(s) from this call's 9 token(s)" in lines[0]
    assert "vecinfer calibrate" in lines[0]
    assert all(torch.isfinite(o).all() for o in outs)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for three lengths
    # Dynamo turns the float attribute `scaling` into a SymFloat under dynamic=True; the op cannot
    # take one, so Dynamo restarts the first compile once with it specialized (2 rewrites each).
    assert counters["vecinfer"]["sdpa_rewrites"] in (2, 4)
    assert sorted(backend.fitted) == [0, 1]
    command = lines[0].split("`")[1].split()
    assert command[:2] == ["vecinfer", "calibrate"]
    _inputs_for(command[1:], tmp_path)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(command[1:])
    assert args.bits == 2.0 and args.out == "cb.safetensors"


def test_transform_only_fit_persists_across_recompiles_without_calibration_advice(caplog):
    model = tiny_model("llama")
    backend = vecinfer_backend.configure(quantize=False)
    with caplog.at_level(logging.INFO, logger="vecinfer_compile.backend"), torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids(8), use_cache=False)
    messages = [r.getMessage() for r in caplog.records if r.name == "vecinfer_compile.backend"]
    assert messages and not any("calibrate" in m for m in messages)
    fitted = dict(backend.fitted)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids(8, seed=3), use_cache=False)
    assert all(backend.fitted[i] is fitted[i] for i in fitted)


def test_one_backend_object_across_models_of_other_geometry(caplog):
    """The global zero-config backend, used on an MQA model and then an MHA model: the MHA model's
    layers are fitted again (they used to be rejected as "calibrated for another model")."""
    backend = vecinfer_backend.configure(bits=2)
    fits = {}
    for kv_heads in (1, 4):
        model = tiny_model("qwen2", num_key_value_heads=kv_heads).requires_grad_(False)
        torch._dynamo.reset()
        with caplog.at_level(logging.INFO, logger="vecinfer_compile.backend"):
            out = torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids(9, batch=2), use_cache=False)
        assert torch.isfinite(out.logits).all()
        fits[kv_heads] = backend.fitted[0].transform.lam.shape
    assert fits == {1: (1, 16), 4: (4, 16)}
    assert any("another geometry" in r.getMessage() for r in caplog.records)


@settings(max_examples=8, deadline=None)
@example(family="qwen2", heads=(4, 2), head_dim=16, batch=1, pad=0, codebooks="transform-only")
@example(family="qwen3", heads=(4, 1), head_dim=64, batch=2, pad=3, codebooks="transform-only")
@given(
    family=st.sampled_from(TINY_FAMILIES),
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (8, 2)]),  # (query, KV): MHA, GQA, MQA
    head_dim=st.sampled_from([16, 64, 128]),
    batch=st.integers(1, 3),
    pad=st.integers(0, 4),
    codebooks=st.sampled_from(["zero-config", "given", "transform-only"]),
)
def test_architectures_compile_and_rewrite_every_layer(family, heads, head_dim, batch, pad, codebooks):
    """Any family, MHA/GQA/MQA, head_dim, batch and left padding (of the first row): every SDPA is
    rewritten and the output is finite; with the transform alone the compiled model equals eager
    on every real token."""
    q_heads, kv_heads = heads
    model = tiny_model(
        family, num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim
    ).requires_grad_(False)
    torch._dynamo.reset()  # each example: conftest's fresh_dynamo runs once a test
    counters.clear()
    if codebooks == "given":
        layers = [random_layer_codebooks(kv_heads, head_dim, seed=i) for i in range(2)]
        backend = vecinfer_backend.configure(VecInferCodebooks("vecinfer", 2.0, layers, model_geometry(model.config)))
    else:
        backend = vecinfer_backend.configure(bits=2, quantize=codebooks != "transform-only")
    x = ids(11, seed=head_dim, batch=batch)
    mask = torch.ones_like(x)
    mask[0, :pad] = 0
    out = torch.compile(model, backend=backend, fullgraph=True)(
        input_ids=x, attention_mask=mask, use_cache=False
    ).logits
    assert counters["vecinfer"]["sdpa_rewrites"] == 2
    real = mask.bool()
    assert torch.isfinite(out[real]).all()
    if codebooks == "transform-only":
        want = model(input_ids=x, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(out[real], want[real], atol=1e-4, rtol=1e-4)


def test_check_model_in_bfloat16_uses_dtype_tolerances():
    from vecinfer_compile.models import default_model_dir, load_model

    model = load_model(default_model_dir(), "float32", "cpu")[0].to(torch.bfloat16)
    report = check_model(model)  # the shipped tiny model, as from_pretrained(dtype=bfloat16) loads it
    assert report.sdpa_rewrites == report.num_layers
    with pytest.raises(AssertionError, match="in torch.bfloat16.*check in float32"):
        check_model(model, atol=0.0, rtol=0.0)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 3 * 16)

    def forward(self, x):  # x: [B, T, 16] -> one head of dim 16
        q, k, v = self.proj(x)[:, None].chunk(3, dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(), Attention()])

    def forward(self, x):
        x = x + self.layers[0](x)
        torch._dynamo.graph_break()
        return x + self.layers[1](x)


def test_graph_break_rewrites_each_subgraph_by_layer():
    torch.manual_seed(0)
    model = TwoLayers().eval()
    backend = vecinfer_backend.configure(quantize=False)
    counters.clear()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert counters["vecinfer"]["sdpa_rewrites"] == 2
    assert sorted(backend.fitted) == [0, 1]  # layer ids from the module path, per subgraph


@pytest.mark.parametrize("layer_bits, key_weight", [([2.0, 2.0], 1.0), ([4.0, 1.0], 1.0), ([2.0, 2.0], 8.0)])
def test_compiled_simulate_matches_eager_simulate(layer_bits, key_weight):
    """Given codebooks and a residual window: the compiled model over codes matches the eager
    simulate attention (quantize -> dequantize K/V) with the same codebooks, also when the
    layers use different presets, and with score-aware key codes (key_parallel_weight)."""
    from vecinfer_compile.simulate import enable_simulation

    model = tiny_model("llama")
    layers = [random_layer_codebooks(2, 16, bits=b, seed=i) for i, b in enumerate(layer_bits)]
    bits = sum(layer_bits) / 2
    codebooks = VecInferCodebooks(
        "vecinfer",
        bits,
        layers,
        model_geometry(model.config),
        {"key_parallel_weight": key_weight},
        layer_bits=layer_bits,
    )
    backend = vecinfer_backend.configure(codebooks, bits=bits, residual=4)
    text = ids(16, seed=6)
    with torch.no_grad():
        full = model(input_ids=text, use_cache=False).logits
        compiled = torch.compile(model, backend=backend, fullgraph=True)(input_ids=text, use_cache=False).logits
        sim_model = enable_simulation(copy.deepcopy(model), "vecinfer", bits=bits, codebooks=codebooks, residual=4)
        simulated = sim_model(input_ids=text, use_cache=False).logits
    torch.testing.assert_close(compiled, simulated, atol=1e-4, rtol=1e-4)
    assert (compiled - full).abs().max() > 1e-3  # really quantized
    if key_weight != 1.0:  # and the weight changed the codes
        codebooks.metadata["key_parallel_weight"] = 1.0
        with torch.no_grad():
            assert (sim_model(input_ids=text, use_cache=False).logits - simulated).abs().max() > 1e-4


def test_tiny_trained_model_transform_is_exact(shared_tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(shared_tiny_dir, attn_implementation="sdpa", dtype=torch.float32)
    report = check_model(model.eval(), ids(20), atol=1e-4, rtol=1e-4)
    assert report.sdpa_rewrites == report.num_layers


def test_configure_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        vecinfer_backend.configure(bits=2.5)
    with pytest.raises(ValueError, match="VQ methods"):
        vecinfer_backend.configure(method="kivi")
    with pytest.raises(FileNotFoundError, match="vecinfer calibrate"):
        vecinfer_backend.configure(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("method", ["qaware", "vecinfer-center", "vq"])
def test_configure_takes_the_method_from_the_codebooks(tmp_path, method):
    """A codebook file says its method: ``configure(codebooks=...)`` runs it (qaware codebooks
    used to fail every compiled path that configured the backend without a method: `match`,
    `needle`, `gsm8k --backend compile`, the examples); an explicit method that contradicts the
    file is still an error that names the fix."""
    from vecinfer_compile.testing import random_codebooks

    cb = random_codebooks(dict(num_layers=2, num_kv_heads=2, head_dim=16), 2.0, method)
    cb.save(tmp_path / "cb.safetensors")
    for source in (cb, tmp_path / "cb.safetensors", str(tmp_path / "cb.safetensors")):
        assert vecinfer_backend.configure(codebooks=source).config.method == method
    assert vecinfer_backend.configure(codebooks=cb, method=method).config.method == method
    with pytest.raises(ValueError, match=f"for method '{method}', not 'vecinfer': leave method unset"):
        vecinfer_backend.configure(codebooks=cb, method="vecinfer")
    assert vecinfer_backend.configure().config.method == "vecinfer"  # zero-config fit


def test_registered_by_name_and_reimport_is_safe():
    importlib.reload(backend_module)
    assert "vecinfer" in torch._dynamo.list_backends(exclude_tags=())
    configured = backend_module.vecinfer_backend.configure(residual=4)
    assert configured.config.residual == 4 and callable(configured.configure)
    assert copy.deepcopy(configured) is configured  # HF's CompileConfig deep-copies backends
    assert backend_module._config_patches("reduce-overhead", {"max_autotune": False}) == {
        "triton.cudagraphs": True,
        "max_autotune": False,
        "graph_partition": False,
    }
    assert backend_module._config_patches(None, {"triton.cudagraphs": True, "graph_partition": True}) == {
        "triton.cudagraphs": True,
        "graph_partition": True,
    }
    assert backend_module._config_patches(None, None) == {}
