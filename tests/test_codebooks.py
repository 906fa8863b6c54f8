"""Calibration artifact: round trip, metadata, and every mismatch error."""

import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from vecinfer_compile.codebooks import VecInferCodebooks, load_codebooks
from vecinfer_compile.testing import random_codebooks as make_codebooks
from vecinfer_compile.testing import random_layer_codebooks


CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_hidden_layers=2, intermediate_size=64, vocab_size=128)


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
        assert torch.equal(a.key_centroids, b.key_centroids)
        assert torch.equal(a.value_centroids, b.value_centroids)
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
        cb.preset
    back = load_codebooks(cb.save(tmp_path / "cb.safetensors"))
    assert back.layer_bits == [4.0, 1.0] and back.bits == 2.5
    assert [back.layer_preset(i).key.dims for i in range(2)] == [2, 8]
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.key_centroids, b.key_centroids)
        assert torch.equal(a.value_centroids, b.value_centroids)
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
    tensors = {"key_centroids": torch.stack([l.key_centroids for l in cb.layers]),
               "value_centroids": torch.stack([l.value_centroids for l in cb.layers]), "lam": lam}
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={"vecinfer": json.dumps(meta)})
    back = load_codebooks(tmp_path / "v1.safetensors")
    assert back.metadata["format"] == "vecinfer-codebooks/1" and back.layer_bits is None and back.bits == 2.0
    for a, b in zip(cb.layers, back.layers):
        assert torch.equal(a.key_centroids, b.key_centroids) and torch.equal(a.value_centroids, b.value_centroids)


def test_saved_file_honours_the_umask_and_repr_is_one_line(tmp_path):
    cb = VecInferCodebooks("vecinfer", 2.0, [random_layer_codebooks(2, 16, seed=i) for i in range(3)],
                           {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16})
    old = os.umask(0o022)
    try:
        path = cb.save(tmp_path / "cb.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    text = repr(cb)
    assert "\n" not in text and len(text) < 200
    assert text.startswith("VecInferCodebooks(method='vecinfer', bits=2, layers=3, kv_heads=2, head_dim=16")
