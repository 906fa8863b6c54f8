"""Calibration artifact: round trip, metadata, and every mismatch error."""

import copy
import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from vecinfer_compile.codebooks import VecInferCodebooks, load_codebooks
from vecinfer_compile.testing import random_codebooks as make_codebooks
from vecinfer_compile.testing import random_layer_codebooks

CONFIG = LlamaConfig(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=128,
)


@pytest.mark.parametrize("method", ["vecinfer", "vq", "smooth", "hadamard"])
@pytest.mark.parametrize("bits", [2.0, 1.5])
def test_round_trip(tmp_path, method, bits):
    cb = make_codebooks(CONFIG, bits, method)
    cb.metadata["calibration_text_hash"] = "abc"
    path = cb.save(tmp_path / "cb.safetensors")
    back = load_codebooks(path)
    assert (back.method, back.bits, back.geometry) == (method, bits, cb.geometry)
    assert back.metadata["calibration_text_hash"] == "abc"
    assert back.metadata["package_version"]
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.keys, b.keys)
        assert torch.equal(a.values, b.values)
        assert a.transform.rotate == b.transform.rotate
        assert (a.transform.lam is None) == (b.transform.lam is None)
        if a.transform.lam is not None:
            assert torch.equal(a.transform.lam, b.transform.lam)
    back.check_model(CONFIG, bits=bits, method=method)


def test_other_model_is_a_clear_error(tmp_path):
    back = load_codebooks(make_codebooks(CONFIG).save(tmp_path / "cb.safetensors"))
    other = LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="another model.*num_layers: codebooks 2 vs model 3.*vecinfer calibrate"):
        back.check_model(other)
    other = LlamaConfig(**{**CONFIG.to_dict(), "head_dim": 32})
    with pytest.raises(ValueError, match="head_dim"):
        back.check_model(other)


def test_other_bits_or_method_is_a_clear_error(tmp_path):
    back = load_codebooks(make_codebooks(CONFIG).save(tmp_path / "cb.safetensors"))
    with pytest.raises(ValueError, match="for 2 bits, not 1.5"):
        back.check_model(CONFIG, bits=1.5)
    with pytest.raises(ValueError, match="method 'vecinfer', not 'vq'"):
        back.check_model(CONFIG, method="vq")


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="vecinfer calibrate"):
        load_codebooks(tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_codebooks(tmp_path / "junk.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="no vecinfer metadata"):
        load_codebooks(tmp_path / "plain.safetensors")


def test_corrupt_metadata_is_detected(tmp_path):
    cb = make_codebooks(CONFIG)
    path = cb.save(tmp_path / "cb.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["vecinfer"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["geometry"]["num_layers"] = 5
    save_file(tensors, str(path), metadata={"vecinfer": json.dumps(meta)})
    with pytest.raises(ValueError, match="fingerprint"):
        load_codebooks(path)
    meta = {**meta, "geometry": cb.geometry, "bits": 1.0, "layer_bits": [1.0, 1.0]}
    from vecinfer_compile.codebooks import geometry_fingerprint

    meta["fingerprint"] = geometry_fingerprint(cb.geometry)
    save_file(tensors, str(path), metadata={"vecinfer": json.dumps(meta)})
    with pytest.raises(ValueError, match="layer 0 codebook shapes .* do not match its 1-bit preset"):
        load_codebooks(path)
    meta = {**meta, "bits": 2.0, "layer_bits": [2.0, 2.0]}
    del tensors["layers.1.value_centroids"]
    save_file(tensors, str(path), metadata={"vecinfer": json.dumps(meta)})
    with pytest.raises(ValueError, match="'layers.1.value_centroids' is missing"):
        load_codebooks(path)


def test_per_layer_bits_round_trip(tmp_path):
    cb = make_codebooks(CONFIG, layer_bits=[4.0, 1.0])
    assert cb.bits == 2.5 and cb.layer_bits == [4.0, 1.0]
    with pytest.raises(ValueError, match="allocate bits per layer"):
        _ = cb.preset
    back = load_codebooks(cb.save(tmp_path / "cb.safetensors"))
    assert back.layer_bits == [4.0, 1.0] and back.bits == 2.5
    assert [back.layer_preset(i).key.dims for i in range(2)] == [2, 8]
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.keys, b.keys)
        assert torch.equal(a.values, b.values)
    back.check_model(CONFIG, bits=2.5)
    with pytest.raises(ValueError, match=r"for 2.5 bits \(per layer: \[4.0, 1.0\]\), not 2"):
        back.check_model(CONFIG, bits=2)
    with pytest.raises(ValueError, match="average 2.5 bits, not 2"):
        VecInferCodebooks("vecinfer", 2.0, cb.layers, cb.geometry, layer_bits=[4.0, 1.0])
    assert make_codebooks(CONFIG, layer_bits=[2.0, 2.0]).layer_bits is None  # uniform


def test_format_1_files_still_load(tmp_path):
    """Format 1 (one preset, stacked [L, E, d] tensors), as the codebooks shipped with the
    package and those of earlier versions were written."""
    from safetensors import safe_open

    cb = make_codebooks(CONFIG, 2.0)
    path = cb.save(tmp_path / "v2.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["vecinfer"])
        lam = f.get_tensor("lam")
    del meta["layer_bits"]
    meta.update(format="vecinfer-codebooks/1", key_preset=[256, 4], value_preset=[256, 4])
    tensors = {
        "key_centroids": torch.stack([l.keys for l in cb.layers]),
        "value_centroids": torch.stack([l.values for l in cb.layers]),
        "lam": lam,
    }
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={"vecinfer": json.dumps(meta)})
    back = load_codebooks(tmp_path / "v1.safetensors")
    assert back.metadata["converted_from"] == "vecinfer-codebooks/1" and back.layer_bits is None and back.bits == 2.0
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("version", [2, 3, 4, 5])
def test_older_formats_convert_to_the_same_codebooks(tmp_path, version):
    """Formats 2-5: per-layer centroids; 2-4 with every layer with attention (no ``attention_layers``)."""
    cb = make_codebooks(CONFIG, layer_bits=[4.0, 1.0])
    meta, tensors = _read(cb.save(tmp_path / "cb.safetensors"))
    if version < 5:
        del meta["attention_layers"]
    meta["format"] = f"vecinfer-codebooks/{version}"
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"vecinfer": json.dumps(meta)})
    back = load_codebooks(tmp_path / "old.safetensors")
    assert back.metadata["converted_from"] == meta["format"] and back.layer_bits == [4.0, 1.0]
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.transform.lam, b.transform.lam)


FORMAT_1_FIXTURE = Path(__file__).parent / "data" / "tiny-vecinfer-2bit-format1.safetensors"


def _read(path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["vecinfer"]), {k: f.get_tensor(k) for k in f.keys()}


def test_shipped_codebooks_are_the_current_format_and_equal_their_format_1_originals():
    """The shipped files pass the strict reader as they are; the format 1 file the 2-bit one was
    re-saved from converts to the same tensors."""
    from vecinfer_compile.codebooks.file_format import FORMAT, read_codebooks
    from vecinfer_compile.models import default_codebooks_dir

    for path in sorted(default_codebooks_dir().glob("*.safetensors")):
        meta, tensors = _read(path)
        assert meta["format"] == FORMAT and meta["converted_from"] == "vecinfer-codebooks/1"
        read_codebooks(meta, tensors, path)
    assert _read(FORMAT_1_FIXTURE)[0]["format"] == "vecinfer-codebooks/1"
    old, new = load_codebooks(FORMAT_1_FIXTURE), load_codebooks(default_codebooks_dir() / "vecinfer-2bit.safetensors")
    assert (old.method, old.bits, old.layer_bits, old.geometry) == (new.method, new.bits, new.layer_bits, new.geometry)
    for a, b in zip(old.layers, new.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.transform.lam, b.transform.lam) and a.transform.rotate == b.transform.rotate


def test_the_strict_reader_takes_only_the_current_format_and_old_files_name_their_corruption(tmp_path):
    from vecinfer_compile.codebooks.file_format import read_codebooks

    meta, tensors = _read(FORMAT_1_FIXTURE)
    with pytest.raises(
        ValueError, match="format 'vecinfer-codebooks/1', not vecinfer-codebooks/8: read it with load_codebooks"
    ):
        read_codebooks(meta, tensors, FORMAT_1_FIXTURE)
    tensors["key_centroids"] = tensors["key_centroids"][:3]  # three layers stacked, the geometry says four
    save_file(tensors, str(tmp_path / "short.safetensors"), metadata={"vecinfer": json.dumps(meta)})
    with pytest.raises(ValueError, match=r"key_centroids has shape \(3, 256, 4\), its geometry says \[4, .*corrupt"):
        load_codebooks(tmp_path / "short.safetensors")
    save_file(tensors, str(tmp_path / "junk.safetensors"), metadata={"vecinfer": "{not json"})
    with pytest.raises(ValueError, match="not JSON.*corrupt file"):
        load_codebooks(tmp_path / "junk.safetensors")


def test_saved_file_honours_the_umask_and_repr_is_one_line(tmp_path):
    cb = VecInferCodebooks(
        "vecinfer",
        2.0,
        [random_layer_codebooks(2, 16, seed=i) for i in range(3)],
        {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16},
    )
    old = os.umask(0o022)
    try:
        path = cb.save(tmp_path / "cb.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    text = repr(cb)
    assert "\n" not in text and len(text) < 200
    assert text.startswith("VecInferCodebooks(method='vecinfer', bits=2, layers=3, kv_heads=2, head_dim=16")


# -- the weights they were calibrated on ----------------------------------------------------------------
CODEBOOKS_LOG = "vecinfer_compile.codebooks"


@pytest.fixture(scope="module")
def calibrated(shared_tiny_dir, tmp_path_factory):
    """``(model, path)``: the shared tiny model (float32) and 2-bit codebooks calibrated on it."""
    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.models import default_text_path, load_model

    model, tokenizer = load_model(shared_tiny_dir, "float32", "cpu")
    cb = calibrate(
        model, tokenizer, default_text_path().read_text(), bits=2, max_tokens=256, seq_len=128, iters=1, progress=False
    )
    return model, cb.save(tmp_path_factory.mktemp("calibrated") / "tiny-2bit.safetensors")


@pytest.fixture(scope="module")
def other_tiny(shared_tiny_dir, tmp_path_factory) -> str:
    """A model directory of the tiny model's geometry with other (random) weights and its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("other") / "other-tiny"
    LlamaForCausalLM(AutoConfig.from_pretrained(shared_tiny_dir)).save_pretrained(path)
    AutoTokenizer.from_pretrained(shared_tiny_dir).save_pretrained(path)
    return str(path)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CODEBOOKS_LOG and r.levelno >= logging.WARNING]


def test_calibration_records_a_weight_fingerprint_its_model_matches_in_any_dtype(calibrated, shared_tiny_dir, caplog):
    from vecinfer_compile.models import load_model

    model, path = calibrated
    cb = load_codebooks(path)
    fingerprint = cb.metadata["weight_fingerprint"]
    assert fingerprint["version"] == 1 and sorted(fingerprint["sketches"]) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 3) for p in "qkv"
    )
    assert cb.metadata["model_name"] == str(shared_tiny_dir)
    assert cb.check_weights(model) is True
    assert cb.check_weights(load_model(shared_tiny_dir, "bfloat16", "cpu")[0]) is True
    assert cb.check_weights(torch.compile(model)) is True  # parameters named "_orig_mod.model.layers..."
    assert not _warnings(caplog)


def test_codebooks_of_another_model_of_the_same_shape_warn_once(calibrated, other_tiny, shared_tiny_dir, caplog):
    """The trap: the shape check passes, so they were used silently (perplexity 534 instead of 339)."""
    from vecinfer_compile.models import load_model

    cb = load_codebooks(calibrated[1])
    other = load_model(other_tiny, "float32", "cpu")[0]
    cb.check_model(other.config)  # same geometry: the shape check cannot tell
    assert cb.check_weights(other) is False
    assert cb.check_weights(other) is False
    (message,) = _warnings(caplog)  # once per codebooks object
    assert f"calibrated for '{shared_tiny_dir}' but are used with '{other_tiny}'" in message
    assert f"vecinfer calibrate --model {other_tiny} --text CALIBRATION.txt --bits 2 --method vecinfer" in message


def test_rescaled_key_channels_are_another_model(calibrated):
    """``evalmodel-outliers``' construction (key channels scaled, queries divided back: the same
    function, other keys to quantize) is caught too."""
    model, path = calibrated
    outliers = copy.deepcopy(model)
    with torch.no_grad():
        for layer in outliers.model.layers:
            for proj, factor in ((layer.self_attn.k_proj, 8.0), (layer.self_attn.q_proj, 1 / 8.0)):
                rows = proj.weight.view(-1, 64, proj.weight.shape[-1])  # [heads, head_dim, hidden]
                rows[:, [3, 35, 10, 42]] *= factor  # two RoPE channel pairs per head
    assert load_codebooks(path).check_weights(outliers) is False


def test_files_without_a_fingerprint_still_work_without_a_warning(tiny_model, caplog):
    """The shipped codebooks (and every file written before the fingerprint) load and pass, with
    one info line."""
    from vecinfer_compile.models import default_model_dir

    caplog.set_level(logging.INFO, logger=CODEBOOKS_LOG)
    cb = load_codebooks(default_model_dir().parent / "tiny_codebooks" / "vecinfer-2bit.safetensors")
    assert "weight_fingerprint" not in cb.metadata
    assert cb.check_weights(tiny_model[0]) is None and cb.check_weights(tiny_model[0]) is None
    notes = [r for r in caplog.records if r.name == CODEBOOKS_LOG]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and "no weight fingerprint" in notes[0].getMessage()


def test_a_backend_checks_the_weights_among_its_graph_inputs(calibrated, other_tiny, caplog):
    """What a torch.compile backend can call: it sees graphs, not the model."""
    from vecinfer_compile.models import load_model

    model, path = calibrated
    verdicts = []
    cb = load_codebooks(path)

    def backend(gm, example_inputs, **_):
        verdicts.append(cb.check_graph_weights(gm, example_inputs))
        return gm

    ids = torch.tensor([[1, 2, 3]])
    for m in (model, load_model(other_tiny, "float32", "cpu")[0]):
        torch._dynamo.reset()
        torch.compile(m, backend=backend, fullgraph=True)(ids)
    assert verdicts == [True, False]
    (message,) = _warnings(caplog)
    assert "used with the compiled model" in message and "--model MODEL_DIR" in message


def test_fingerprinted_weights_are_the_first_and_last_layers_under_any_wrapper():
    from vecinfer_compile.hf.weight_fingerprint import attention_weights

    w = torch.zeros(2, 2)
    names = [
        f"base_model.model.model.layers.{i}.self_attn.{p}.base_layer.weight"
        for i in range(3)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    names += [
        "model.vision.blocks.0.attn.qkv_proj.weight",
        "model.vision.blocks.5.attn.qkv_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.embed_tokens.weight",
    ]
    picked = attention_weights((n, w) for n in names)
    assert sorted(picked) == sorted(
        [f"base_model.model.model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 2) for p in "qkv"]
        + ["model.vision.blocks.0.attn.qkv_proj.weight", "model.vision.blocks.5.attn.qkv_proj.weight"]
    )


def test_malformed_weight_fingerprint_is_a_corrupt_file(tmp_path):
    from safetensors import safe_open

    path = make_codebooks(CONFIG).save(tmp_path / "cb.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["vecinfer"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["weight_fingerprint"] = {"version": 1, "sketches": {"model.layers.0.self_attn.k_proj.weight": [1.0]}}
    save_file(tensors, str(path), metadata={"vecinfer": json.dumps(meta)})
    with pytest.raises(ValueError, match="weight_fingerprint is malformed.*vecinfer calibrate"):
        load_codebooks(path)


def test_check_weights_needs_the_model_not_its_config():
    with pytest.raises(TypeError, match="needs the model itself.*not a LlamaConfig"):
        make_codebooks(CONFIG).check_weights(CONFIG)


def test_the_command_line_warns_when_codebooks_belong_to_another_model(calibrated, other_tiny, caplog):
    from vecinfer_compile.cli import main
    from vecinfer_compile.models import default_text_path

    assert (
        main(
            [
                "eval-ppl",
                "--model",
                other_tiny,
                "--text",
                str(default_text_path()),
                "--method",
                "vecinfer",
                "--codebooks",
                str(calibrated[1]),
                "--windows",
                "1",
                "--window-len",
                "32",
                "--no-progress",
            ]
        )
        == 0
    )
    (message,) = _warnings(caplog)
    assert f"used with '{other_tiny}'" in message


@pytest.mark.parametrize("entry", ["cache", "simulation", "backend"])
def test_every_entry_point_warns_about_another_models_codebooks(calibrated, other_tiny, caplog, entry):
    """VecInferCache(model, ...), simulation and the compiled backend check the weights they are
    given codebooks for (the cache/simulate/backend half of the trap)."""
    import vecinfer_compile as vc
    from vecinfer_compile.cache import VecInferCache
    from vecinfer_compile.models import load_model

    other = load_model(other_tiny, "float32", "cpu")[0]
    cb = load_codebooks(calibrated[1])
    if entry == "cache":
        VecInferCache(other, cb, max_cache_len=8)
    elif entry == "simulation":
        with vc.simulation(other, method="vecinfer", bits=cb.bits, codebooks=cb):
            pass
    else:
        with torch.no_grad():
            torch.compile(other, backend=vc.vecinfer_backend.configure(codebooks=cb), fullgraph=True)(
                torch.tensor([[1, 2, 3]])
            )
    (message,) = _warnings(caplog)
    assert "vecinfer calibrate" in message
