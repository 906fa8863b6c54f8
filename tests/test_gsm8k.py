"""GSM8K: answer extraction, prompt building, and a 2-problem run through the real caches."""

from __future__ import annotations

import json

import pytest

from vecinfer_compile.cli import main
from vecinfer_compile.evaluation.gsm8k import build_prompts, extract_prediction, normalize_number, reference_answer

ROWS = [
    {"question": "Tom has 3 apples and buys 2 more. How many apples?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "A box holds 1,200 pens; 200 are sold. How many are left?", "answer": "1200-200=1000\n#### 1,000"},
    {"question": "Sam earns $4 an hour for 3 hours. How much?", "answer": "4*3=12\n#### 12"},
    {"question": "What is 10 minus 3?", "answer": "10-3=7\n#### 7"},
]


def test_reference_and_prediction():
    assert reference_answer(ROWS[1]["answer"]) == "1000"
    assert normalize_number("$1,234.50") == "1234.5" and normalize_number("7.0") == "7"
    assert extract_prediction(" She has 4 + 5 = 9 eggs.\n#### 9\n\nQuestion: x 12") == "9"
    assert extract_prediction(" 2 and then 3 and finally 42.") == "42"
    assert extract_prediction(" 5 apples.\n\nQuestion: 99 balloons") == "5"
    assert extract_prediction(" no number here") is None
    with pytest.raises(ValueError, match="####"):
        reference_answer("no final answer")


def test_build_prompts_excludes_shots():
    prompts, refs, scored = build_prompts(ROWS, shots=2, limit=None)
    assert refs == ["12", "7"] and len(prompts) == 2
    assert prompts[0].count("Question:") == 3 and prompts[0].endswith("How much?\nAnswer:")
    assert "#### 5" in prompts[0] and "#### 1,000" in prompts[0]
    with pytest.raises(ValueError, match="leaves none"):
        build_prompts(ROWS, shots=4, limit=None)


def test_gsm8k_cli_two_problems(tiny_dir, tmp_path, capsys):
    from vecinfer_compile.models import default_codebooks_dir

    data = tmp_path / "gsm.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    cb = default_codebooks_dir() / "vecinfer-2bit.safetensors"
    rc = main(
        [
            "gsm8k",
            "--model",
            str(tiny_dir),
            "--data",
            str(data),
            "--methods",
            "fp16,vecinfer,kivi",
            "--bits",
            "2",
            "--codebooks",
            str(cb),
            "--shots",
            "2",
            "--limit",
            "2",
            "--residual",
            "16",
            "--max-new-tokens",
            "12",
            "--json",
            "--no-progress",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["accuracy"]) == {"fp16", "vecinfer", "kivi"} and out["limit"] == 2
    for m in out["methods"]:
        assert m["total"] == 2 and 0 <= m["accuracy"] <= 1 and len(m["samples"]) == 2
    assert "SIMULATE" in out["methods"][2]["note"]


def test_gsm8k_cli_errors(tiny_dir, tmp_path, capsys):
    assert (
        main(["gsm8k", "--model", str(tiny_dir), "--data", str(tmp_path / "missing.jsonl"), "--methods", "fp16"]) == 2
    )
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["gsm8k", "--model", str(tiny_dir), "--data", str(bad), "--methods", "fp16"]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["gsm8k", "--model", str(tiny_dir), "--data", str(bad), "--methods", "fp16,nope"]) == 2
    assert "unknown method" in capsys.readouterr().err
