"""Bad command lines: each is refused with exit code 2 and one line on stderr naming the fix, and
writes nothing. Those that need no model are refused before torch is imported (a fresh process
checks that), so that they answer in well under a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vecinfer_compile.cli import main
from vecinfer_compile.models import default_codebooks_dir, default_model_dir, default_text_path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The fresh processes import this checkout's package, whatever folder they run in.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
TINY = str(default_model_dir())
TEXT = str(default_text_path())
CODEBOOKS = str(default_codebooks_dir() / "vecinfer-2bit.safetensors")

CALIBRATE = ["calibrate", "--model", TINY, "--text", TEXT, "--bits", "2", "--out", "{ws}/new.safetensors"]
EVAL = ["eval-ppl", "--model", TINY, "--text", TEXT, "--method", "fp16"]
MATCH = ["match", "--model", TINY, "--text", TEXT, "--codebooks", CODEBOOKS]
NEEDLE = ["needle", "--model", TINY, "--haystack", "{ws}/dir"]
GSM8K = ["gsm8k", "--model", TINY, "--data", TEXT]
INSPECT = ["inspect", "--model", TINY, "--text", TEXT, "--out", "{ws}/inspect"]
ABLATION = ["ablation", "--model", TINY, "--text", TEXT, "--calib-text", TEXT]

# (command line, a piece of the one-line error); {ws} is a folder holding dir/, existing.txt,
# empty.txt, latin1.txt, gsm8k.jsonl (two problems), no-bits.safetensors (a safetensors file whose
# vecinfer metadata lacks the bits), nan.safetensors (the shipped 2-bit codebooks with a NaN in
# layer 1's key centroids), truncated.safetensors (them less their last 100 bytes), model folders
# made from the tiny model (no-tokenizer/, six-layers/, no-weights/, bad-config/: see
# _write_model_dirs) and nothing else.
NO_MODEL_NEEDED = [
    (CALIBRATE + ["--device", "gpu0"], "unknown device 'gpu0'"),
    (CALIBRATE + ["--out", "{ws}/dir"], "is a directory: give a file path"),
    (CALIBRATE + ["--out", "{ws}/existing.txt"], "exists: give a new path"),
    (CALIBRATE + ["--out", "{ws}/existing.txt/cb.safetensors"], "is a file, not a directory"),
    (CALIBRATE + ["--seq-len", "0"], "--seq-len: must be at least 2, got 0"),
    (CALIBRATE + ["--max-tokens", "0"], "--max-tokens: must be at least 1, got 0"),
    (CALIBRATE + ["--max-tokens", "-5"], "--max-tokens: must be at least 1"),
    (CALIBRATE + ["--max-tokens", "1e3"], "expected a whole number"),
    (CALIBRATE + ["--iters", "0"], "--iters: must be at least 1"),
    (CALIBRATE + ["--seed", "-1"], "--seed: must be at least 0"),
    (CALIBRATE + ["--bits", "0"], "bits must be positive"),
    (CALIBRATE + ["--bits", "nan"], "bits must be positive"),
    (CALIBRATE + ["--bits", "7"], "no VecInfer preset for 7"),
    (CALIBRATE + ["--method", "kivi"], "invalid choice: 'kivi'"),
    (CALIBRATE + ["--method", "qaware", "--ridge", "-1"], "--ridge: must be a finite number at least 0"),
    (CALIBRATE + ["--ridge", "0.1"], "--ridge is for the query-aware methods"),
    (CALIBRATE + ["--key-parallel-weight", "0.5"], "--key-parallel-weight: must be a finite number at least 1"),
    (CALIBRATE + ["--allocate", "retrieval", "--bits", "1.5"], "needs 8-bit-code presets"),
    (CALIBRATE + ["--layer-bits", "2,x"], "bits must be a number"),
    (CALIBRATE + ["--key-codec", "trellis", "--trellis-states", "1000"], "must be a power of two from 2 to 65536"),
    (CALIBRATE + ["--trellis-states", "1024"], "--trellis-states is for --key-codec / --value-codec trellis"),
    (CALIBRATE + ["--value-codec", "trellis", "--trellis-states", "2"], "2 bits need more than 2 trellis states"),
    (CALIBRATE + ["--text", "{ws}/missing.txt"], "calibration text {ws}/missing.txt does not exist"),
    (CALIBRATE + ["--text", "{ws}/dir"], "is a directory, not a file"),
    (CALIBRATE + ["--text", "{ws}/empty.txt"], "is empty"),
    (CALIBRATE + ["--text", "{ws}/latin1.txt"], "is not UTF-8"),
    (CALIBRATE + ["--model", "{ws}/missing"], "model directory {ws}/missing does not exist"),
    (CALIBRATE + ["--model", "{ws}/dir"], "has no config.json"),
    (CALIBRATE + ["--model", TEXT], "is not a directory"),
    (EVAL + ["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    (EVAL + ["--windows", "0"], "--windows: must be at least 1"),
    (EVAL + ["--window-len", "1"], "--window-len: must be at least 2"),
    (EVAL + ["--window-len", "abc"], "expected a whole number, got 'abc'"),
    (EVAL + ["--residual", "-1"], "--residual: must be at least 0"),
    (EVAL + ["--device", "cuda:x"], "unknown device"),
    (EVAL[:-2], "give --method (one of: fp16, vecinfer"),
    (EVAL[:-2] + ["--codebooks", CODEBOOKS, "--method", "qaware"], "disagrees with"),
    (EVAL[:-2] + ["--codebooks", "{ws}/existing.txt"], "not a codebook file"),
    (EVAL[:-2] + ["--method", "vecinfer"], "needs codebooks: pass --codebooks FILE"),
    (EVAL[:-2] + ["--method", "kivi", "--bits", "3"], "KIVI runs at 2 or 4 bits"),
    (EVAL[:-2] + ["--method", "kivi", "--backend", "compile"], "use --backend eager"),
    (EVAL + ["--calib-text", TEXT], "takes no codebooks"),
    (EVAL[:-2] + ["--codebooks", CODEBOOKS, "--window-len", "256", "--residual", "256"], "nothing would be quantized"),
    (EVAL[:-2] + ["--codebooks", "{ws}/no-bits.safetensors"], "not a codebook file"),
    (EVAL + ["--text", "/dev/null"], "is not a regular file"),
    (
        EVAL[:-2] + ["--method", "vecinfer", "--calib-text", TEXT, "--save-codebooks", "{ws}/existing.txt"],
        "is a file, not a directory",
    ),
    (INSPECT[:-1] + ["{ws}/existing.txt"], "is a file, not a directory: give a folder"),
    (INSPECT + ["--tokens", "0"], "--tokens: must be at least 16"),
    (INSPECT + ["--methods", "kivi"], "--methods takes VQ methods"),
    (INSPECT + ["--ablation-json", "{ws}/missing.json"], "does not exist"),
    (INSPECT + ["--ablation-json", "{ws}/existing.txt"], "has no 'rows'"),
    (MATCH + ["--prompt-len", "64", "--new-tokens", "8"], "nothing would be quantized"),
    (MATCH + ["--new-tokens", "1", "--residual", "0"], "nothing would be quantized"),
    (MATCH + ["--prompts", "0"], "--prompts: must be at least 1"),
    (MATCH + ["--prefill-chunk", "-1"], "--prefill-chunk: must be at least 0"),
    (NEEDLE[:-1] + [TEXT], "is not a directory"),
    (NEEDLE + ["--lengths", "10"], "must be at least 32, got 10"),
    (NEEDLE + ["--lengths", "a,b"], "expected comma-separated token counts"),
    (NEEDLE + ["--depths", "120"], "must be in [0, 100], got 120"),
    (NEEDLE + ["--trials", "0"], "--trials: must be at least 1"),
    (NEEDLE[:-1] + [""], "expected a path, got an empty string"),
    (NEEDLE + ["--save-codebooks", " "], "expected a path, got an empty string"),
    (INSPECT[:-1] + [""], "expected a path, got an empty string"),
    (CALIBRATE[:-1] + [""], "expected a path, got an empty string"),
    (NEEDLE + ["--codebooks", CODEBOOKS, "--method", "fp16"], "disagrees with"),
    (NEEDLE + ["--plot", "{ws}/existing.txt"], "exists: give a new path"),
    (NEEDLE + ["--codebooks", CODEBOOKS, "--lengths", "64", "--residual", "100"], "nothing would be quantized"),
    (GSM8K + ["--methods", "fp16,bogus"], "unknown method 'bogus'"),
    (GSM8K + ["--methods", ","], "--methods is empty"),
    (GSM8K + ["--limit", "0"], "--limit: must be at least 1"),
    (GSM8K + ["--shots", "-1"], "--shots: must be at least 0"),
    (GSM8K + ["--methods", "fp16,kivi", "--codebooks", CODEBOOKS], "takes no codebooks"),
    (GSM8K + ["--out", "{ws}/existing.txt"], "exists: give a new path"),
    (["sweep", "--timeout", "0"], "--timeout: must be a finite number greater than 0"),
    (["sweep", "--out", "{ws}/dir"], "is a directory"),
    (["demo", "--window-len", "0"], "--window-len: must be at least 2"),
    (["demo", "--calib-tokens", "0"], "--calib-tokens: must be at least 1"),
    (["demo", "--device", "gpu0"], "unknown device"),
    (["demo", "--save-codebooks", "{ws}/existing.txt"], "is a file, not a directory"),
    (ABLATION + ["--rows", "vecinfer:9"], "no VecInfer preset for 9"),
    (ABLATION + ["--rows", "vecinfer:x"], "bad --rows item"),
    (ABLATION + ["--plot", "{ws}/dir"], "is a directory"),
    (ABLATION + ["--out", "{ws}/existing.txt"], "exists: give a new path"),
    (ABLATION + ["--residual", "-1"], "--residual: must be at least 0"),
    (ABLATION + ["--window-len", "64", "--residual", "64"], "nothing would be quantized"),
    # Decided by a file header or config.json: refused before the model loads.
    (
        EVAL[:-2] + ["--codebooks", "{ws}/nan.safetensors"],
        "{ws}/nan.safetensors: tensor 'layers.1.key_centroids' (1 of 1,024 values) holds NaN or inf",
    ),
    (MATCH[:-1] + ["{ws}/nan.safetensors"], "holds NaN or inf"),
    (
        EVAL[:-2] + ["--codebooks", "{ws}/truncated.safetensors"],
        "{ws}/truncated.safetensors is truncated: its header describes 36,328 bytes, the file holds 36,228",
    ),
    (CALIBRATE + ["--model", "{ws}/no-tokenizer"], "model directory {ws}/no-tokenizer has no tokenizer"),
    (EVAL + ["--model", "{ws}/no-tokenizer"], "has no tokenizer (no tokenizer.json"),
    (CALIBRATE[:-1] + ["{ws}/missing/cb.safetensors"], "its folder {ws}/missing does not exist: create it first"),
    (
        CALIBRATE[:5] + ["--layer-bits", "2,2,2"] + CALIBRATE[7:],
        "--layer-bits gives 3 presets, but the model in " + TINY + " has 4 layers",
    ),
    (
        EVAL + ["--window-len", "5000"],
        "--window-len needs 5000 positions, past the model's max_position_embeddings (4096)",
    ),
    (CALIBRATE + ["--seq-len", "5000"], "--seq-len needs 5000 positions"),
    (MATCH + ["--prompt-len", "4090", "--new-tokens", "16"], "--prompt-len plus --new-tokens needs 4106 positions"),
    (
        GSM8K[:-1] + ["{ws}/gsm8k.jsonl", "--max-new-tokens", "5000", "--methods", "fp16", "--shots", "1"],
        "--max-new-tokens needs 5000 positions",
    ),
    (NEEDLE + ["--method", "fp16", "--lengths", "4096", "--max-new-tokens", "8"], "needs 4104 positions"),
    (ABLATION + ["--window-len", "4097"], "--window-len needs 4097 positions"),
    (INSPECT + ["--seq-len", "8192"], "--seq-len needs 8192 positions"),
    (
        ["eval-ppl", "--model", "{ws}/six-layers", "--text", TEXT, "--codebooks", CODEBOOKS],
        "these codebooks were calibrated for another model (num_layers: codebooks 4 vs model 6",
    ),
    (["demo", "--model", "{ws}/six-layers", "--window-len", "5000"], "--window-len needs 5000 positions"),
    (EVAL + ["--model", "{ws}/no-weights"], "model directory {ws}/no-weights has no weights"),
    (EVAL + ["--model", "{ws}/bad-config"], "{ws}/bad-config/config.json is not valid JSON"),
]

# Runs main(argv) in a fresh interpreter and reports its exit code, stderr and whether torch was
# imported.
PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from vecinfer_compile.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(json.loads(sys.argv[1]))
    print(json.dumps({"code": code, "err": err.getvalue(), "torch": "torch" in sys.modules}))
""")


@pytest.fixture
def workspace(tmp_path) -> Path:
    (tmp_path / "dir").mkdir()
    (tmp_path / "existing.txt").write_text("already here\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    problem = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"})
    (tmp_path / "gsm8k.jsonl").write_text(f"{problem}\n{problem}\n")
    header = json.dumps({"__metadata__": {"vecinfer": json.dumps({"method": "vecinfer"})}}).encode()
    (tmp_path / "no-bits.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    _write_broken_codebooks(tmp_path)
    _write_model_dirs(tmp_path)
    return tmp_path


def _write_broken_codebooks(folder: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(CODEBOOKS, "pt") as f:
        meta = f.metadata()
    tensors = load_file(CODEBOOKS)
    tensors["layers.1.key_centroids"][3, 1] = float("nan")
    save_file(tensors, str(folder / "nan.safetensors"), metadata=meta)
    data = Path(CODEBOOKS).read_bytes()
    assert len(data) == 36328  # the messages above count its bytes
    (folder / "truncated.safetensors").write_bytes(data[:-100])
    from vecinfer_compile.testing import random_codebooks

    geometry = {**json.loads(meta["vecinfer"])["geometry"], "num_kv_heads": 4}
    random_codebooks(geometry, 2).save(folder / "other-heads.safetensors")


def _write_model_dirs(folder: Path) -> None:
    """no-tokenizer/: the tiny model without its tokenizer files; six-layers/: its config saying 6
    layers (never loaded: the header check refuses first); no-weights/: without its weights;
    bad-config/: a config.json cut short."""
    (folder / "no-tokenizer").mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / "no-tokenizer" / name).symlink_to(Path(TINY) / name)
    config = json.loads((Path(TINY) / "config.json").read_text())
    for name, text, files in (
        ("six-layers", json.dumps({**config, "num_hidden_layers": 6}), ("model.safetensors",)),
        ("no-weights", json.dumps(config), ()),
        ("bad-config", '{"model_type": "llama",', ("model.safetensors",)),
    ):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(text)
        for file in ("tokenizer.json", "tokenizer_config.json", *files):
            (folder / name / file).symlink_to(Path(TINY) / file)


def files_in(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("vecinfer: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, match", NO_MODEL_NEEDED, ids=[" ".join(a[:1] + a[-2:]) for a, _ in NO_MODEL_NEEDED])
def test_refused_before_torch_loads(workspace, argv, match):
    argv = [a.format(ws=workspace) for a in argv]
    before = files_in(workspace)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        cwd=workspace,
        env=ENV,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 2, result
    assert match.format(ws=workspace) in one_line_error(result["err"])
    assert not result["torch"], "the arguments were checked after torch was imported"
    assert files_in(workspace) == before


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            EVAL[:-2] + ["--method", "vecinfer", "--calib-text", "{ws}/existing.txt"],
            "tokens, fewer than one calibration sequence (1024: the smaller of --seq-len and --max-tokens): give a "
            "longer --calib-text",
        ),
        (
            ["eval-ppl", "--model", TINY, "--text", TEXT, "--codebooks", "{ws}/other-heads.safetensors"],
            "calibrated for another model (num_kv_heads: codebooks 4 vs model 2",
        ),
    ],
)
def test_refused_once_the_model_is_loaded(capsys, workspace, argv, match):
    """Known once the model is loaded: refused before any work (a few-token text was calibrated
    on, silently; codebooks of another geometry with as many layers: the rest of the geometry is the
    loaded model's)."""
    before = files_in(workspace)
    assert main([a.format(ws=workspace) for a in argv] + ["--device", "cpu"]) == 2
    assert match in one_line_error(capsys.readouterr().err)
    assert files_in(workspace) == before


@pytest.mark.parametrize(
    "argv, match",
    [
        (CALIBRATE[:4] + ["{ws}/existing.txt"] + CALIBRATE[5:], "tokens, fewer than one calibration sequence (1024"),
        (EVAL + ["--text", "{ws}/existing.txt"], "tokens, fewer than the 16 x 1024 = 16384 needed"),
        (["demo", "--text", "{ws}/existing.txt"], "tokens, fewer than the 8 x 256 = 2048 needed"),
        (ABLATION + ["--text", "{ws}/existing.txt"], "tokens, fewer than the 16 x 1024"),
    ],
)
def test_refused_once_the_tokenizer_is_loaded(capsys, workspace, argv, match, monkeypatch):
    """A text too short for the run needs its tokens, not the model: refused before the model
    loads (it used to load first; the demo printed its progress bar, then the error)."""
    import transformers

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    before = files_in(workspace)
    assert main([a.format(ws=workspace) for a in argv] + ["--device", "cpu"]) == 2
    assert match in one_line_error(capsys.readouterr().err)
    assert files_in(workspace) == before


def test_python_m_prints_one_line(workspace):
    proc = subprocess.run(
        [sys.executable, "-m", "vecinfer_compile", *EVAL, "--device", "gpu0"],
        capture_output=True,
        text=True,
        cwd=workspace,
        env=ENV,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "unknown device 'gpu0'" in one_line_error(proc.stderr)


def test_benchmark_argument_error_is_one_line(capsys):
    assert main(["bench", "memory", "--no-such-option"]) == 2
    assert "bench memory: unrecognized arguments: --no-such-option" in one_line_error(capsys.readouterr().err)


def test_method_comes_from_the_codebooks(capsys):
    assert (
        main(
            [
                "eval-ppl",
                "--model",
                TINY,
                "--text",
                TEXT,
                "--codebooks",
                CODEBOOKS,
                "--windows",
                "1",
                "--window-len",
                "32",
                "--no-progress",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("vecinfer 2 bits: ppl ")


def test_full_precision_is_labelled_by_its_dtype(capsys):
    assert main(EVAL + ["--windows", "1", "--window-len", "32", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("full precision (float32): ppl ")


def test_help_names_every_method(capsys, monkeypatch):
    from vecinfer_compile.methods import METHODS

    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside hyphenated names
    with pytest.raises(SystemExit):
        main(["eval-ppl", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"{m}," in text or f"{m} (" in text for m in METHODS)


def test_needle_templates_are_the_evaluations():
    from vecinfer_compile.commands.needle import TEMPLATES
    from vecinfer_compile.evaluation.needle import TEMPLATES as EVALUATION_TEMPLATES

    assert TEMPLATES == EVALUATION_TEMPLATES


def test_progress_bars_for_logs(monkeypatch):
    """Off a terminal, bars stay on one line (no cursor-moving escape codes) and redraw rarely."""
    from vecinfer_compile.cli import log_friendly_progress

    monkeypatch.setattr(os, "environ", {"TQDM_MININTERVAL": "60"})  # a value the user set stays
    log_friendly_progress()
    assert os.environ == {"TQDM_POSITION": "0", "TQDM_MININTERVAL": "60"}


def _probe(argv: list[str], cwd: Path, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**ENV, **env},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "env, match",
    [
        ({"VECINFER_KERNEL": "bogus"}, "VECINFER_KERNEL='bogus' is not a kernel choice: use one of auto, cuda, triton"),
        ({"VECINFER_DECODE_KERNEL": "fast"}, "VECINFER_DECODE_KERNEL='fast' is not a kernel choice"),
        ({"VECINFER_KERNEL": "Bogus", "VECINFER_DECODE_KERNEL": "triton"}, "VECINFER_KERNEL='Bogus'"),
    ],
)
def test_a_bad_kernel_variable_is_refused_at_start(workspace, env, match):
    """It was read only when a CUDA op asked (never on a CPU run): now the command line refuses it
    before torch is imported, whatever the command."""
    result = _probe(EVAL + ["--windows", "1"], workspace, **env)
    assert result["code"] == 2, result
    assert match in one_line_error(result["err"])
    assert not result["torch"]


def test_the_old_kernel_variable_still_works_with_a_one_line_warning(workspace):
    env = {k: v for k, v in ENV.items() if k != "VECINFER_KERNEL"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vecinfer_compile",
            *EVAL,
            "--windows",
            "1",
            "--window-len",
            "16",
            "--no-progress",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=workspace,
        env={**env, "VECINFER_DECODE_KERNEL": "triton"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "vecinfer: warning: VECINFER_DECODE_KERNEL is renamed VECINFER_KERNEL (it chooses the append, encode and "
        "Viterbi kernels too, not only decode): set VECINFER_KERNEL=triton"
    ]


def test_a_codebook_file_written_meanwhile_is_kept(capsys, workspace, monkeypatch):
    """Two `calibrate --out X` at once: the one that ends second used to replace the first's file
    and report success too; now it keeps that file, writes nothing and says so."""
    import importlib

    from vecinfer_compile.codebooks import load_codebooks

    pipeline = importlib.import_module("vecinfer_compile.calibration")
    out = workspace / "race.safetensors"

    def the_other_run_ends_first(*args, **kwargs):
        out.write_bytes(b"the other run's codebooks")
        return load_codebooks(CODEBOOKS)

    monkeypatch.setattr(pipeline, "calibrate", the_other_run_ends_first)
    argv = CALIBRATE[:-1] + [str(out), "--device", "cpu", "--seq-len", "64", "--no-progress"]
    before = files_in(workspace)
    assert main([a.format(ws=workspace) for a in argv]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert f"{out} was created by something else while this calibration ran" in err
    assert out.read_bytes() == b"the other run's codebooks"
    assert set(files_in(workspace)) == set(before) | {"race.safetensors"}  # no temporary file left


# More bad inputs a new user gives, each one line and exit code 2 before anything loads.
@pytest.mark.parametrize(
    "argv, match",
    [
        (EVAL[:-2] + ["--codebooks", "{ws}/dir"], "is a directory, not a file"),
        (EVAL[:-2] + ["--codebooks", "{ws}/missing.safetensors"], "does not exist"),
        (EVAL[:-2] + ["--codebooks", "{ws}/empty.txt"], "is empty"),
        (EVAL[:-2] + ["--codebooks", CODEBOOKS, "--bits", "4"], "these codebooks are for 2 bits, not 4: drop --bits"),
        (NEEDLE + ["--codebooks", CODEBOOKS, "--bits", "1.5"], "these codebooks are for 2 bits, not 1.5"),
        (EVAL[:-2] + ["--method", "vecinfer", "--bits", "2.5", "--calib-text", TEXT], "no VecInfer preset for 2.5"),
        (CALIBRATE[:-1] + ["{ws}/new.safetensors", "--bits", "-2"], "bits must be positive"),
        (EVAL + ["--text", "{ws}/empty.txt"], "is empty"),
        (EVAL + ["--model", TINY + "/model.safetensors"], "is not a directory"),
        (EVAL + ["--dtype", "float16"], "invalid choice: 'float16'"),
        (["eval-ppl", "--model", TINY, "--text", CODEBOOKS, "--method", "fp16"], "is not UTF-8"),
        (CALIBRATE[:-1] + [CODEBOOKS], "exists: give a new path"),
    ],
)
def test_more_new_user_mistakes(workspace, argv, match):
    before = files_in(workspace)
    result = _probe([a.format(ws=workspace) for a in argv], workspace)
    assert result["code"] == 2, result
    assert match.format(ws=workspace) in one_line_error(result["err"])
    assert not result["torch"]
    assert files_in(workspace) == before
