"""The Python API refuses what the command line refuses, with a TypeError or ValueError naming the
fix before any work: damaged codebook files, an existing or folderless output, a missing or empty
tokenizer, counts below their minimum, a bad ``$VECINFER_KERNEL``; and the calibration's progress
bar counts layers."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import vecinfer_compile as vc
from vecinfer_compile import kernel_env
from vecinfer_compile.atomic_file import write_new
from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.models import default_codebooks_dir, load_text

CODEBOOKS = default_codebooks_dir() / "vecinfer-2bit.safetensors"


def _broken(tmp_path: Path, name: str, value: float) -> Path:
    with safe_open(str(CODEBOOKS), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(CODEBOOKS))
    tensors[name].view(-1)[5] = value
    path = tmp_path / "broken.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("name, value", [("layers.2.value_centroids", float("nan")), ("lam", float("inf"))])
def test_load_codebooks_checks_every_tensor(tmp_path, name, value):
    """A NaN or inf in any tensor used to load, then fail 45 s later in a traceback blaming the text."""
    path = _broken(tmp_path, name, value)
    with pytest.raises(ValueError, match=rf"{path}: tensor '{name}' \(1 of [\d,]+ values\) holds NaN or inf"):
        load_codebooks(path)


def test_load_codebooks_names_a_truncated_file(tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(CODEBOOKS.read_bytes()[:-1])
    with pytest.raises(ValueError, match=f"{path} is truncated: its header describes"):
        load_codebooks(path)


def test_save_refuses_an_existing_file_unless_asked(tmp_path):
    cb = load_codebooks(CODEBOOKS)
    path = tmp_path / "cb.safetensors"
    path.write_bytes(b"kept")
    with pytest.raises(FileExistsError, match="exists: give a new path, or pass overwrite=True"):
        cb.save(path)
    assert path.read_bytes() == b"kept"
    assert cb.save(path, overwrite=True) == path
    assert load_codebooks(path).bits == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cb.safetensors"]


def test_save_refuses_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"its folder {tmp_path / 'nope'} does not exist: create it first"):
        load_codebooks(CODEBOOKS).save(tmp_path / "nope" / "cb.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_a_file_created_while_writing_is_kept(tmp_path):
    """Two writers of one path: the one that ends second moves nothing in and says so."""
    path = tmp_path / "cb.safetensors"

    def write(tmp: Path) -> None:
        tmp.write_bytes(b"mine")
        path.write_bytes(b"the other writer's")

    with pytest.raises(FileExistsError, match="was created by something else while this was being written"):
        write_new(path, write)
    assert path.read_bytes() == b"the other writer's"
    assert [p.name for p in tmp_path.iterdir()] == ["cb.safetensors"]  # the temporary file is gone


def test_an_interrupted_save_leaves_nothing(tmp_path):
    def write(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_new(tmp_path / "cb.safetensors", write)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def text(sample_text_path) -> str:
    return load_text(sample_text_path)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be at least 1, got 0"),
        ({"seq_len": 1}, ValueError, "seq_len must be at least 2"),
        ({"iters": 0}, ValueError, "iters must be at least 1"),
        ({"seed": -1}, ValueError, "seed must be at least 0"),
        ({"residual": -3}, ValueError, "residual must be at least 0"),
        ({"max_tokens": 1e3}, TypeError, "max_tokens must be a whole number, got 1000.0"),
    ],
)
def test_calibrate_counts(tiny_model, text, kwargs, error, match):
    model, tokenizer = tiny_model
    with pytest.raises(error, match=match):
        vc.calibrate(model, tokenizer, text, **kwargs)


def test_calibrate_names_a_missing_tokenizer(tiny_model, text):
    with pytest.raises(TypeError, match="calibrate needs the model's tokenizer, got None: pass transformers"):
        vc.calibrate(tiny_model[0], None, text)


def test_calibrate_names_an_empty_tokenizer(tiny_model, text, tmp_path):
    """AutoTokenizer on a folder without tokenizer files builds a tokenizer with no vocabulary for
    some model types (here Qwen2's): the text was then reported as having 0 tokens."""
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.for_model("qwen2").save_pretrained(tmp_path)
    empty = AutoTokenizer.from_pretrained(str(tmp_path))
    match = f"the tokenizer of {tmp_path} turns 2,000 characters of text into no tokens"
    with pytest.raises(ValueError, match=match):
        vc.calibrate(tiny_model[0], empty, text)


def test_calibrate_names_a_model_given_by_path(tiny_model, text, tiny_dir):
    with pytest.raises(TypeError, match="calibrate needs a loaded model, got the path"):
        vc.calibrate(str(tiny_dir), tiny_model[1], text)


def test_simulation_takes_a_path_and_refuses_a_negative_window(tiny_model):
    model = tiny_model[0]
    with pytest.raises(ValueError, match="residual must be at least 0, got -3"):
        with vc.simulation(model, "vecinfer", bits=2, codebooks=load_codebooks(CODEBOOKS), residual=-3):
            pass
    ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
    with vc.simulation(model, "vecinfer", bits=2, codebooks=str(CODEBOOKS)):  # was an AttributeError
        by_path = model(ids).logits
    with vc.simulation(model, "vecinfer", bits=2, codebooks=load_codebooks(CODEBOOKS)):
        loaded = model(ids).logits
    torch.testing.assert_close(by_path, loaded)
    with pytest.raises(TypeError, match="codebooks must be a path, a VecInferCodebooks"):
        vc.enable_simulation(model, "vecinfer", bits=2, codebooks=2)


@pytest.fixture
def kernel_variables(monkeypatch):
    for name in (kernel_env.ENV, kernel_env.OLD_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernel_env, "_warned", set())
    return monkeypatch


def test_a_bad_kernel_variable_is_refused_when_configured(kernel_variables, tiny_model):
    kernel_variables.setenv("VECINFER_KERNEL", "bogus")
    match = "VECINFER_KERNEL='bogus' is not a kernel choice: use one of auto, cuda, triton"
    with pytest.raises(ValueError, match=match):
        vc.vecinfer_backend.configure(CODEBOOKS)
    with pytest.raises(ValueError, match=match):
        vc.VecInferCache(tiny_model[0], load_codebooks(CODEBOOKS), max_cache_len=32)
    # An explicit decode_kernel wins over the variable, as before.
    assert vc.vecinfer_backend.configure(CODEBOOKS, decode_kernel="triton").config.decode_kernel == "triton"


def test_the_old_kernel_variable_warns_once(kernel_variables):
    from vecinfer_compile.ops import kernel_request

    kernel_variables.setenv("VECINFER_DECODE_KERNEL", "Triton")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernel_request.requested() == "triton"
        assert kernel_request.requested() == "triton"
    assert [(w.category, str(w.message).split(":")[0]) for w in caught] == [
        (
            FutureWarning,
            "VECINFER_DECODE_KERNEL is renamed VECINFER_KERNEL (it chooses the append, encode and "
            "Viterbi kernels too, not only decode)",
        )
    ]
    kernel_variables.setenv("VECINFER_KERNEL", "cuda")  # the new name wins
    assert kernel_request.requested() == "cuda"


def test_heartbeats_leave_the_count_to_the_bar():
    """Beats within an iterated bar used to go through update(0), which moved tqdm's bookkeeping:
    the calibration bar counted past its layers ("7" of 6) and timed a layer from the last beat."""
    from tqdm import tqdm

    from vecinfer_compile.heartbeat import beat, reporting

    now = [0.0]
    bar = tqdm(range(6), file=io.StringIO(), mininterval=10, unit="layer")
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = 0.0
    seen = []
    with reporting(bar):
        for _ in bar:
            for step in (9, 0.05, 2):  # a beat at each step of a layer's fit
                now[0] += step
                beat("k-means")
                seen.append(bar.n)
    assert max(seen) <= 6 and bar.n == 6
    assert "k-means" in bar.fp.getvalue()


def test_the_calibration_bar_counts_layers(tiny_model, text, monkeypatch):
    from vecinfer_compile.calibration import pipeline

    bars = []

    class Recorded(pipeline.tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = io.StringIO()
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(pipeline, "tqdm", Recorded)
    model, tokenizer = tiny_model
    vc.calibrate(model, tokenizer, text, bits=2, max_tokens=256, seq_len=128, iters=1, progress=True)
    (bar,) = bars
    layers = model.config.num_hidden_layers
    assert (bar.total, bar.n, bar.unit) == (layers, layers, "layer")
    assert f"{layers}/{layers} [" in bar.fp.getvalue()


def test_load_model_names_a_folder_without_its_tokenizer(tmp_path, tiny_dir):
    """Some model types build an empty tokenizer from such a folder: refused by name."""
    import json

    from vecinfer_compile.models import load_model

    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    )
    with pytest.raises(ValueError, match=f"the tokenizer of {tmp_path} turns .* into no tokens: it has no vocabulary"):
        load_model(tmp_path, "float32", "cpu")
    assert os.listdir(tmp_path) == ["config.json"]
