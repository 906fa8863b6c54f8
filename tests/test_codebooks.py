"""Calibration artifact: round trip, metadata, and every mismatch error."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.testing import random_codebooks as make_codebooks


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
    meta = {**meta, "geometry": cb.geometry, "bits": 1.0}
    from vecinfer_compile.codebooks import geometry_fingerprint

    meta["fingerprint"] = geometry_fingerprint(cb.geometry)
    save_file(tensors, str(path), metadata={"vecinfer": json.dumps(meta)})
    with pytest.raises(ValueError, match="do not match the 1-bit preset"):
        load_codebooks(path)
