"""The README's quickstart runs as written: its code block is examples/quickstart.py, and the
script runs offline on the shipped tiny model (slow: it calibrates, compiles and generates)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it on your own model") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_script_is_the_readme_block():
    script = (ROOT / "examples" / "quickstart.py").read_text()
    assert script.split('"""', 2)[2].lstrip("\n") == readme_quickstart()


@pytest.mark.slow
def test_quickstart_runs_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("It was a bright cold day in April, and")
    assert (tmp_path / "cb-2bit.safetensors").is_file()


def test_compile_and_eval_on_another_model_fits_codebooks(tmp_path):
    """examples/compile_and_eval.py MODEL without codebooks fits them from the first call (one
    warning) instead of taking the shipped tiny model's codebooks, which died in a dynamo traceback
    on a model of another geometry."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from vecinfer_compile.models import default_model_dir

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compile_and_eval.py"), str(tmp_path / "model")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VecInfer 2-bit (compiled)" in proc.stdout and "no codebooks given; fitted" in proc.stderr
