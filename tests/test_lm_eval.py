"""examples/lm_eval_harness.py: lm-evaluation-harness scores a local task on the shipped tiny
model in full precision, with eager simulation and compiled, offline (lm-eval is a dev extra)."""

from __future__ import annotations

import importlib.util
import os
import sys
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
    full, eager, compiled = (results[k][0] for k in ("full precision", "VecInfer, eager simulate",
                                                      "VecInfer, torch.compile"))
    assert 1 < full < eager  # 2-bit K/V cost perplexity
    assert abs(compiled - eager) / eager < 0.02  # the compiled model computes what simulation does
    assert "| VecInfer, torch.compile |" in capsys.readouterr().out
