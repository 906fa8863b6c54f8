"""examples/lm_eval_harness.py: lm-evaluation-harness scores a local task on the shipped tiny
model in full precision, with eager simulation and compiled, offline (lm-eval is a dev extra)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extras: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lm_eval_harness_example(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec = importlib.util.spec_from_file_location("lm_eval_harness", ROOT / "examples" / "lm_eval_harness.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--docs", "2", "--doc-chars", "1500"])
    full, eager, compiled = (
        results[k][0] for k in ("full precision", "VecInfer, eager simulate", "VecInfer, torch.compile")
    )
    assert 1 < full < eager  # 2-bit K/V cost perplexity
    assert abs(compiled - eager) / eager < 0.02  # the compiled model computes what simulation does
    assert "| VecInfer, torch.compile |" in capsys.readouterr().out


def _example():
    spec = importlib.util.spec_from_file_location("lm_eval_harness", ROOT / "examples" / "lm_eval_harness.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_wikitext_paragraphs_split(tmp_path):
    """WikiText ends its paragraphs in "\\n \\n": they split into documents (it found none, and the
    script died in a traceback)."""
    text = "".join(f" = Section {i} = \n \n Paragraph {i} " + "word " * 60 + "\n \n" for i in range(8))
    path = _example().write_docs(text, 3, 300, tmp_path / "docs.jsonl")
    assert len(path.read_text().splitlines()) == 3


def test_text_without_blank_lines_splits_at_line_ends(tmp_path):
    """A WikiText file with its blank lines dropped (one paragraph per line) splits too (it was
    refused as one paragraph)."""
    text = "".join(f" = Section {i} = \n Paragraph {i} " + "word " * 60 + "\n" for i in range(8))
    path = _example().write_docs(text, 3, 300, tmp_path / "docs.jsonl")
    assert len(path.read_text().splitlines()) == 3


def test_another_model_without_codebooks_is_one_line(tmp_path, capsys):
    """A model other than the shipped one with no --codebooks: one usage line naming the fix (the
    tiny model's codebooks were used and the run died deep inside)."""
    with pytest.raises(SystemExit) as exit_info:
        _example().main(["--model", str(tmp_path)])
    assert exit_info.value.code == 2 and "--codebooks FILE is needed" in capsys.readouterr().err
