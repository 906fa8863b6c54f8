"""The `vecinfer` command line: JSON schema, clear errors, demo, calibrate -> eval, ablation."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from vecinfer_compile.cli import COMMANDS, main
from vecinfer_compile.testing import random_codebooks


def run_json(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1, out  # exactly one JSON object on stdout
    return json.loads(lines[0])


def run_error(capsys, argv) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert "Traceback" not in err
    return lines[0]


def test_commands_registered():
    assert COMMANDS[:4] == ["demo", "calibrate", "eval_ppl", "ablation"]
    from vecinfer_compile.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"demo", "calibrate", "eval-ppl", "ablation"} <= set(sub.choices)


def test_eval_ppl_fp16_json_equals_model_loss(capsys, tiny_model, tiny_dir, sample_text_path):
    out = run_json(
        capsys,
        [
            "eval-ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--method",
            "fp16",
            "--windows",
            "2",
            "--window-len",
            "64",
            "--json",
            "--no-progress",
        ],
    )
    for key in ("method", "bits", "ppl", "tokens", "kv_bytes_per_token", "backend", "residual"):
        assert key in out
    assert (out["method"], out["bits"], out["tokens"], out["backend"], out["residual"]) == (
        "fp16",
        16.0,
        126,
        "eager",
        0,
    )
    assert out["kv_bytes_per_token"] == 2048
    model, tok = tiny_model
    from vecinfer_compile.models import load_text, tokenize

    ids = tokenize(tok, load_text(sample_text_path))[:128].reshape(2, 64)
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in ids]
    assert out["ppl"] == pytest.approx(math.exp(sum(losses) / 2), rel=1e-5)


def test_eval_ppl_kivi_json(capsys, tiny_dir, sample_text_path):
    out = run_json(
        capsys,
        [
            "eval-ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--method",
            "kivi",
            "--bits",
            "2",
            "--windows",
            "2",
            "--window-len",
            "64",
            "--json",
            "--no-progress",
        ],
    )
    assert out["method"] == "kivi" and out["bits"] == 2.0 and out["kv_bytes_per_token"] == 384
    assert math.isfinite(out["ppl"]) and out["ppl"] > 1


def test_eval_ppl_with_codebooks_file(capsys, tmp_path, tiny_model, tiny_dir, sample_text_path):
    from vecinfer_compile.codebooks import model_geometry

    path = random_codebooks(model_geometry(tiny_model[0].config), 2).save(tmp_path / "cb.safetensors")
    out = run_json(
        capsys,
        [
            "eval-ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--method",
            "vecinfer",
            "--bits",
            "2",
            "--codebooks",
            str(path),
            "--windows",
            "1",
            "--window-len",
            "64",
            "--json",
            "--no-progress",
            "--residual",
            "16",
        ],
    )
    assert out["method"] == "vecinfer" and out["residual"] == 16 and out["kv_bytes_per_token"] == 256
    assert math.isfinite(out["ppl"])


@pytest.mark.parametrize("calibrated, warned", [(32, True), (64, False)])
def test_eval_ppl_warns_when_windows_pass_the_calibrated_length(
    capsys, caplog, tmp_path, tiny_model, tiny_dir, sample_text_path, calibrated, warned
):
    """64-token windows scored with codebooks calibrated on 32-token sequences: one warning naming
    `--seq-len 64`; calibrated on 64, none."""
    from vecinfer_compile.codebooks import model_geometry

    cb = random_codebooks(model_geometry(tiny_model[0].config), 2)
    cb.metadata["seq_len"] = calibrated
    path = cb.save(tmp_path / "cb.safetensors")
    with caplog.at_level("WARNING", logger="vecinfer_compile.codebooks"):
        run_json(
            capsys,
            [
                "eval-ppl",
                "--model",
                str(tiny_dir),
                "--text",
                str(sample_text_path),
                "--method",
                "vecinfer",
                "--bits",
                "2",
                "--codebooks",
                str(path),
                "--windows",
                "1",
                "--window-len",
                "64",
                "--json",
                "--no-progress",
            ],
        )
    messages = [r.getMessage() for r in caplog.records if "calibrated on" in r.getMessage()]
    assert messages == (
        [
            "vecinfer: these codebooks were calibrated on 32-token sequences; positions past 32 (up to "
            "64 here) are quantized worse than the ones calibration saw: recalibrate with `vecinfer "
            "calibrate --seq-len 64` (or longer) for contexts this long"
        ]
        if warned
        else []
    )


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["eval-ppl", "--model", "/nonexistent/model", "--text", "{text}", "--method", "fp16"],
            "model directory /nonexistent/model does not exist",
        ),
        (
            ["eval-ppl", "--model", "{tiny}", "--text", "/nonexistent.txt", "--method", "fp16"],
            "text file /nonexistent.txt does not exist",
        ),
        (
            ["eval-ppl", "--model", "{tiny}", "--text", "{text}", "--method", "vecinfer", "--bits", "2"],
            "needs codebooks: pass --codebooks FILE",
        ),
        (["eval-ppl", "--model", "{tiny}", "--text", "{text}", "--method", "int8"], "invalid choice: 'int8'"),
        (
            [
                "eval-ppl",
                "--model",
                "{tiny}",
                "--text",
                "{text}",
                "--method",
                "vecinfer",
                "--bits",
                "5",
                "--calib-text",
                "{text}",
            ],
            "no VecInfer preset for 5",
        ),
        (
            ["eval-ppl", "--model", "{tiny}", "--text", "{text}", "--method", "kivi", "--bits", "3"],
            "KIVI runs at 2 or 4 bits",
        ),
        (
            ["eval-ppl", "--model", "{tiny}", "--text", "{text}", "--method", "kivi", "--bits", "two"],
            "bits must be a number",
        ),
        (
            [
                "eval-ppl",
                "--model",
                "{tiny}",
                "--text",
                "{text}",
                "--method",
                "vecinfer",
                "--bits",
                "2",
                "--codebooks",
                "/nonexistent.safetensors",
            ],
            "codebook file /nonexistent.safetensors does not exist",
        ),
        (
            [
                "eval-ppl",
                "--model",
                "{tiny}",
                "--text",
                "{text}",
                "--method",
                "fp16",
                "--windows",
                "1000",
                "--no-progress",
            ],
            "the text has",
        ),
        (
            ["calibrate", "--model", "{tiny}", "--text", "{text}", "--bits", "2", "--method", "kivi", "--out", "x"],
            "invalid choice: 'kivi'",
        ),
        (
            ["calibrate", "--model", "{tiny}", "--text", "{text}", "--out", "x"],
            "give --bits B (one preset for all layers",
        ),
        (
            ["calibrate", "--model", "{tiny}", "--text", "{text}", "--bits", "2", "--layer-bits", "2,2", "--out", "x"],
            "give --bits B (one preset for all layers",
        ),
        (
            [
                "calibrate",
                "--model",
                "{tiny}",
                "--text",
                "{text}",
                "--bits",
                "1.5",
                "--allocate",
                "retrieval",
                "--out",
                "x",
            ],
            "needs 8-bit-code presets at 0.75, 1.5 and 3 bits; available for bits=2",
        ),
        (
            ["calibrate", "--model", "{tiny}", "--text", "{text}", "--layer-bits", "2,7,2,2", "--out", "x"],
            "no VecInfer preset for 7",
        ),
        (
            ["calibrate", "--model", "{tiny}", "--text", "{text}", "--layer-bits", "2,x", "--out", "x"],
            "bits must be a number",
        ),
        (["demo", "--model", "/nonexistent/model"], "model directory /nonexistent/model does not exist"),
        (
            ["ablation", "--model", "{tiny}", "--text", "{text}", "--calib-text", "/nope.txt"],
            "calibration text /nope.txt does not exist",
        ),
        ([], "required"),
    ],
)
def test_clear_errors(capsys, tiny_dir, sample_text_path, argv, match):
    argv = [a.format(tiny=tiny_dir, text=sample_text_path) for a in argv]
    assert match in run_error(capsys, argv)


def test_codebooks_for_another_model(capsys, tmp_path, tiny_dir, sample_text_path):
    other = {
        "model_type": "llama",
        "num_layers": 6,
        "num_query_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 128,
        "hidden_size": 512,
        "vocab_size": 8192,
    }
    path = random_codebooks(other, 2).save(tmp_path / "other.safetensors")
    msg = run_error(
        capsys,
        [
            "eval-ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--method",
            "vecinfer",
            "--bits",
            "2",
            "--codebooks",
            str(path),
            "--windows",
            "1",
            "--window-len",
            "32",
        ],
    )
    assert "calibrated for another model" in msg and "num_layers" in msg


def test_codebooks_for_another_bit_width(capsys, tmp_path, tiny_model, tiny_dir, sample_text_path):
    from vecinfer_compile.codebooks import model_geometry

    path = random_codebooks(model_geometry(tiny_model[0].config), 4).save(tmp_path / "cb4.safetensors")
    msg = run_error(
        capsys,
        [
            "eval-ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--method",
            "vecinfer",
            "--bits",
            "2",
            "--codebooks",
            str(path),
        ],
    )
    assert "for 4 bits, not 2" in msg


def test_demo_end_to_end(capsys):
    out = run_json(capsys, ["demo", "--windows", "2", "--window-len", "64", "--json", "--no-progress"])
    rows = {(r["method"], r["bits"]): r for r in out["rows"]}
    assert set(rows) == {("fp16", 16.0), ("vecinfer", 4.0), ("vecinfer", 2.0), ("vecinfer", 1.5), ("kivi", 2.0)}
    assert out["embedded_text_in_training"] is True
    assert rows[("fp16", 16.0)]["ppl_ratio"] == 1.0
    for r in out["rows"]:
        assert math.isfinite(r["ppl"]) and r["tokens"] == 126
    # 4-bit VQ is close to fp16 on the tiny model
    assert rows[("vecinfer", 4.0)]["ppl_ratio"] < 1.5
    # physical bits as stored: 12-bit codes packed, KIVI's scales counted
    physical = {key: r["physical_bits_per_element"] for key, r in rows.items()}
    assert physical == {
        ("fp16", 16.0): 16.0,
        ("vecinfer", 4.0): 4.0,
        ("vecinfer", 2.0): 2.0,
        ("vecinfer", 1.5): 1.5,
        ("kivi", 2.0): 3.0,
    }
    assert rows[("vecinfer", 1.5)]["kv_bytes_per_token"] == 0.75 * rows[("vecinfer", 2.0)]["kv_bytes_per_token"]


def test_demo_table_says_how_it_was_calibrated(capsys):
    assert main(["demo", "--windows", "1", "--window-len", "32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "calibrated on the second half" in out and "NOT held out" in out
    assert "| VecInfer | 1.5 |" in out and "| KIVI | 2 |" in out


@pytest.mark.slow  # k-means on the CPU: ~20-50 s
def test_calibrate_then_eval_and_ablation(capsys, tmp_path, tiny_dir, sample_text_path):
    cb = tmp_path / "cb2.safetensors"
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(tiny_dir),
                "--text",
                str(sample_text_path),
                "--bits",
                "2",
                "--max-tokens",
                "512",
                "--seq-len",
                "256",
                "--iters",
                "3",
                "--out",
                str(cb),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out and cb.is_file()
    out = run_json(
        capsys,
        [
            "eval-ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--method",
            "vecinfer",
            "--bits",
            "2",
            "--codebooks",
            str(cb),
            "--windows",
            "1",
            "--window-len",
            "64",
            "--json",
            "--no-progress",
        ],
    )
    assert math.isfinite(out["ppl"])
    mixed = tmp_path / "cb-mixed.safetensors"
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(tiny_dir),
                "--text",
                str(sample_text_path),
                "--layer-bits",
                "4,1,2,1",
                "--max-tokens",
                "512",
                "--seq-len",
                "256",
                "--iters",
                "3",
                "--out",
                str(mixed),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "per layer 4/1/2/1" in capsys.readouterr().out
    out = run_json(
        capsys,
        [
            "eval-ppl",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--method",
            "vecinfer",
            "--codebooks",
            str(mixed),
            "--windows",
            "1",
            "--window-len",
            "64",
            "--json",
            "--no-progress",
        ],
    )
    assert out["bits"] == 2.0 and out["layer_bits"] == [4.0, 1.0, 2.0, 1.0]
    assert out["physical_bits_per_element"] == 2.0 and math.isfinite(out["ppl"])
    pytest.importorskip("matplotlib")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "vecinfer-2bit.safetensors").write_bytes(cb.read_bytes())  # reused, not recalibrated
    plot = tmp_path / "plot.png"
    res = run_json(
        capsys,
        [
            "ablation",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--calib-text",
            str(sample_text_path),
            "--rows",
            "fp16:16,vecinfer:2,kivi:2,prerope:2",
            "--windows",
            "1",
            "--window-len",
            "64",
            "--max-tokens",
            "512",
            "--seq-len",
            "256",
            "--iters",
            "3",
            "--out-codebooks",
            str(cache),
            "--plot",
            str(plot),
            "--json",
            "--no-progress",
        ],
    )
    assert [r["method"] for r in res["rows"]] == ["fp16", "vecinfer", "kivi", "prerope"]
    assert (cache / "vecinfer-2bit.safetensors").is_file() and plot.stat().st_size > 1000
    assert (cache / "prerope-2bit.safetensors").is_file() and math.isfinite(res["rows"][3]["ppl"])


def test_python_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "vecinfer_compile", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "eval-ppl" in proc.stdout


@pytest.mark.parametrize("damage", ["truncated", "empty", "no-tokenizer"])
def test_damaged_model_directory_is_one_line(capsys, tmp_path, tiny_dir, sample_text_path, damage):
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "empty":
        weights.write_bytes(b"")
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (broken / name).unlink()
    msg = run_error(capsys, ["eval-ppl", "--model", str(broken), "--text", str(sample_text_path), "--method", "fp16"])
    assert "\n" not in msg.strip()
    assert ("tokenizer" if damage == "no-tokenizer" else "truncated or damaged") in msg


@pytest.mark.parametrize("content", [b"caf\xe9 au lait, " * 200, bytes(range(256)) * 8])
def test_text_that_is_not_utf8_is_one_line(capsys, tmp_path, tiny_dir, content):
    """A Latin-1 or binary file is refused with one line naming the fix (it used to be scored with
    its bad bytes replaced, silently)."""
    path = tmp_path / "latin1.txt"
    path.write_bytes(content)
    msg = run_error(capsys, ["eval-ppl", "--model", str(tiny_dir), "--text", str(path), "--method", "fp16"])
    assert "\n" not in msg.strip() and "not UTF-8" in msg and "iconv" in msg


def test_line_ends_do_not_change_the_text(tmp_path, sample_text_path):
    """A text saved with Windows (or old Mac) line ends reads as the same text, so it scores the same
    tokens: the shipped WikiText file has CRLF line ends, and reading them as bytes once put a
    carriage-return token on every line and moved every perplexity on it."""
    from vecinfer_compile.models import load_text

    text = load_text(sample_text_path)
    assert "\r" not in text
    for ending in ("\r\n", "\r"):
        path = tmp_path / "crlf.txt"
        path.write_bytes(text.replace("\n", ending).encode("utf-8"))
        assert load_text(path) == text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(capsys, tiny_dir, sample_text_path):
    msg = run_error(
        capsys,
        ["eval-ppl", "--model", str(tiny_dir), "--text", str(sample_text_path), "--method", "fp16", "--device", "cuda"],
    )
    assert "--device cpu" in msg


def test_eval_ppl_saves_and_reuses_codebooks(capsys, tmp_path, tiny_dir, sample_text_path):
    argv = [
        "eval-ppl",
        "--model",
        str(tiny_dir),
        "--text",
        str(sample_text_path),
        "--method",
        "vecinfer",
        "--bits",
        "2",
        "--calib-text",
        str(sample_text_path),
        "--save-codebooks",
        str(tmp_path),
        "--max-tokens",
        "512",
        "--seq-len",
        "128",
        "--iters",
        "2",
        "--windows",
        "1",
        "--window-len",
        "64",
        "--json",
        "--no-progress",
    ]
    first = run_json(capsys, argv)
    saved = tmp_path / "vecinfer-2bit.safetensors"
    assert saved.is_file()
    stamp = saved.stat().st_mtime_ns
    assert run_json(capsys, argv)["ppl"] == first["ppl"]  # the saved file, not a new calibration
    assert saved.stat().st_mtime_ns == stamp


def _inputs_for(argv: list[str], folder) -> None:
    """Create in ``folder`` the inputs that ``argv`` names (a model folder, texts, a haystack, a
    codebook file), so that parsing it checks them as for a user who has them."""
    import shutil

    from vecinfer_compile.models import default_codebooks_dir

    given = dict(zip(argv, argv[1:]))
    if "--model" in given:
        (folder / given["--model"]).mkdir()
        for name in ("config.json", "tokenizer.json", "model.safetensors"):  # what a model folder holds
            (folder / given["--model"] / name).write_text("{}")
    for option in ("--text", "--calib-text", "--data"):
        if option in given:
            (folder / given[option]).write_text("some text\n")
    if "--haystack" in given:
        (folder / given["--haystack"]).mkdir()
    if "--codebooks" in given:
        shutil.copy(default_codebooks_dir() / "vecinfer-2bit.safetensors", folder / given["--codebooks"])


def test_readme_command_table_parses(tmp_path, monkeypatch):
    """Every example in the README's command table is a command line the CLI accepts, given the
    files it names."""
    import re
    import shlex
    from pathlib import Path

    from vecinfer_compile.cli import build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## Command line") : readme.index("## Results in brief")]
    examples = re.findall(r"\| `(vecinfer [^`]*)` \|", table)
    assert len(examples) == len(COMMANDS)
    parser = build_parser()
    for i, example in enumerate(examples):
        argv = shlex.split(example)[1:]
        folder = tmp_path / str(i)
        folder.mkdir()
        _inputs_for(argv, folder)
        monkeypatch.chdir(folder)
        args = parser.parse_args(argv)
        assert callable(args.func), example
