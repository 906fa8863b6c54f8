"""Needle-in-a-haystack mechanics on the embedded tiny model (which cannot retrieve): prompt
construction and depth placement, the exact-match scorer, grid shape, JSON schema, plot, errors."""

from __future__ import annotations

import json
import random

import pytest

from vecinfer_compile.cli import main
from vecinfer_compile.evaluation.needle import build_prompt, is_correct, load_haystack, make_needle, sentence_boundaries

SENTENCES = [
    "The river ran quietly past the old mill.",
    "Children played near the wooden bridge.",
    "A farmer counted his sheep before the storm.",
    "The library opened its doors at nine.",
    "Snow covered the northern hills for weeks.",
    "She wrote a long letter to her brother.",
]


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    d = tmp_path_factory.mktemp("haystack")
    rng = random.Random(0)
    for i in range(2):
        (d / f"essay{i}.txt").write_text(" ".join(rng.choice(SENTENCES) for _ in range(120)) + "\n")
    (d / "ignored.md").write_text("not a txt file")
    return d


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def test_scorer_exact_match():
    assert is_correct(" 1234567. Remember", "1234567")
    assert not is_correct(" 12345678.", "1234567")  # a longer number is not the key
    assert not is_correct(" 123456", "1234567")
    assert is_correct(" lantern.", "lantern") and not is_correct(" lanterns", "lantern")


@pytest.mark.parametrize("template", ["passkey", "magic", "word"])
def test_templates_are_the_trained_ones(template):
    n = make_needle(template, random.Random(1))
    assert n.key in n.text
    ends = {"passkey": " The pass key is", "magic": " The special magic number for", "word": "'s secret word is"}
    assert ends[template] in n.question and n.question.startswith(" What is")
    assert make_needle(template, random.Random(1)) == n  # seeded


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_depth_and_length(haystack, tokenizer, depth):
    text = load_haystack(haystack)
    filler = tokenizer(text, add_special_tokens=False)["input_ids"]
    bounds = sentence_boundaries(tokenizer, filler)
    assert bounds and all(tokenizer.decode(filler[b - 1 : b]).rstrip().endswith(".") for b in bounds[:20])
    needle = make_needle("passkey", random.Random(3))
    p = build_prompt(tokenizer, filler, bounds, 300, depth, needle, random.Random(4), bos_id=1)
    assert len(p.ids) == 300 and p.ids[0] == 1
    needle_ids = tokenizer(needle.text, add_special_tokens=False)["input_ids"]
    assert p.ids[p.needle_start : p.needle_start + len(needle_ids)] == needle_ids
    # placed at the requested fraction of the filler, snapped to a sentence (<= ~12 tokens here)
    assert abs(p.depth_actual - depth) * p.filler_tokens <= 12
    if depth == 0.0:
        assert p.needle_start == 1
    if depth == 1.0:  # right before the question
        q = tokenizer(needle.question, add_special_tokens=False)["input_ids"]
        assert p.ids[-len(q) - len(needle_ids) : -len(q)] == needle_ids
    else:  # snapped: the token before the needle ends a sentence
        assert p.needle_start == 1 or tokenizer.decode(p.ids[p.needle_start - 1 : p.needle_start]).rstrip().endswith(
            "."
        )


def test_haystack_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_haystack(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no \\*.txt"):
        load_haystack(tmp_path)
    (tmp_path / "a.txt").write_text("   \n")
    with pytest.raises(ValueError, match="empty"):
        load_haystack(tmp_path)


def test_needle_cli_json_grid_plot(haystack, tiny_dir, tmp_path, capsys):
    png = tmp_path / "grid.png"
    rc = main(
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--haystack",
            str(haystack),
            "--lengths",
            "64,96",
            "--depths",
            "0,50,100",
            "--method",
            "fp16",
            "--trials",
            "2",
            "--max-new-tokens",
            "3",
            "--json",
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lengths"] == [64, 96] and out["depths"] == [0, 50, 100]
    assert len(out["grid"]) == 2 and all(len(r) == 3 for r in out["grid"])
    assert all(0.0 <= c <= 1.0 for r in out["grid"] for c in r)
    assert out["accuracy"] == pytest.approx(sum(map(sum, out["grid"])) / 6)
    for key in ("method", "bits", "trials", "template", "residual", "note", "samples"):
        assert key in out
    assert png.is_file() and png.stat().st_size > 1000


def test_needle_cli_vecinfer_cache_and_table(haystack, tiny_dir, capsys):
    from vecinfer_compile.models import default_codebooks_dir

    cb = default_codebooks_dir() / "vecinfer-2bit.safetensors"
    rc = main(
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--haystack",
            str(haystack),
            "--lengths",
            "64",
            "--depths",
            "50",
            "--method",
            "vecinfer",
            "--codebooks",
            str(cb),
            "--residual",
            "8",
            "--trials",
            "1",
            "--max-new-tokens",
            "3",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "| length \\ depth | 50% | mean |" in out and "VecInferCache" in out


def test_needle_cli_kivi_says_simulate(haystack, tiny_dir, capsys):
    rc = main(
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--haystack",
            str(haystack),
            "--lengths",
            "64",
            "--depths",
            "0",
            "--method",
            "kivi",
            "--bits",
            "2",
            "--residual",
            "8",
            "--trials",
            "1",
            "--max-new-tokens",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0 and "SIMULATE" in capsys.readouterr().out


def test_needle_cli_prerope_runs_in_simulate_mode(haystack, tiny_dir, sample_text_path, tmp_path, capsys):
    """A method without a cache yet (keys before RoPE) generates in simulate mode, with its
    codebooks, and says so."""
    from vecinfer_compile.calibration import calibrate
    from vecinfer_compile.models import load_model

    model, tok = load_model(tiny_dir, "float32", "cpu")
    cb = calibrate(
        model,
        tok,
        sample_text_path.read_text(),
        bits=2,
        method="prerope",
        max_tokens=512,
        seq_len=128,
        iters=2,
        progress=False,
    ).save(tmp_path / "cb.safetensors")
    rc = main(
        [
            "needle",
            "--model",
            str(tiny_dir),
            "--haystack",
            str(haystack),
            "--lengths",
            "64",
            "--depths",
            "0",
            "--method",
            "prerope",
            "--codebooks",
            str(cb),
            "--residual",
            "8",
            "--trials",
            "1",
            "--max-new-tokens",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0 and "prerope 2-bit: runs in SIMULATE mode" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--haystack", "/nonexistent/hay"], "does not exist"),
        (["--lengths", "abc"], "comma-separated token counts"),
        (["--depths", "150"], "[0, 100]"),
        (["--method", "vecinfer"], "needs codebooks"),
    ],
)
def test_needle_cli_errors(haystack, tiny_dir, capsys, argv, msg):
    base = {"--haystack": str(haystack), "--lengths": "64", "--depths": "0"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    args = ["needle", "--model", str(tiny_dir), "--no-progress"] + [x for kv in base.items() for x in kv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_needle_too_long_for_haystack(haystack, tiny_dir, capsys):
    assert (
        main(
            [
                "needle",
                "--model",
                str(tiny_dir),
                "--haystack",
                str(haystack),
                "--lengths",
                "4000",
                "--depths",
                "0",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "haystack" in err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_greedy_generate_compile_backend_matches_eager(tiny_dir, device):
    """Decode compiled with vecinfer_backend gives eager's tokens, over two batches of
    different prompt lengths through one GenerationMethod (the shape change that breaks plain
    Inductor's CUDA-graph decode on torch 2.11); eager decode never auto-compiles."""
    import torch

    from vecinfer_compile.evaluation.generation import GenerationMethod, greedy_generate
    from vecinfer_compile.models import load_model
    from vecinfer_compile.testing import random_codebooks

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, _ = load_model(tiny_dir, "float32", device)
    cb = random_codebooks(model.config, layer_bits=[4.0, 1.0, 2.0, 1.0])
    eager = GenerationMethod("vecinfer", cb.bits, cb, residual=8)
    compiled = GenerationMethod("vecinfer", cb.bits, cb, residual=8, backend="compile")
    gen = random.Random(0)
    for lengths in ([40, 33], [57, 61, 50]):
        prompts = [[gen.randrange(3, model.config.vocab_size) for _ in range(n)] for n in lengths]
        want = greedy_generate(model, prompts, eager, max_new_tokens=6)
        assert greedy_generate(model, prompts, compiled, max_new_tokens=6) == want
    assert eager.generate_kwargs(object(), torch.device(device))["disable_compile"] is True
    with pytest.raises(ValueError, match="backend must be one of eager, compile"):
        GenerationMethod("vecinfer", 2.0, cb, backend="inductor")
