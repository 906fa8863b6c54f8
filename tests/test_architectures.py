"""The architecture sweep (`vecinfer sweep`) on a CI-sized subset of transformers' causal LMs:
exact statuses per path and exact SDPA rewrite counts, the tiny configs, how failures are
classified, the table and the command.

EXPECTED is what the current code gives. The rows and entries marked HYBRID are sliding-window,
chunked and hybrid-linear models, whose support is being built (vecinfer_compile/hf/layer_kinds.py):
update them when it changes.
"""

from __future__ import annotations

import time

import pytest

from vecinfer_compile.cli import main
from vecinfer_compile.evaluation import architecture_table as table
from vecinfer_compile.evaluation.architectures import ArchitectureResult, check_architecture
from vecinfer_compile.evaluation.outcomes import CRASHED, REFUSED, SKIPPED, WORKS, Outcome, outcome_of, run_step
from vecinfer_compile.evaluation.tiny_configs import HEAD_DIM, WINDOW, attention_kinds, tiny_config

# architecture: (compiled, simulate, cache+generate), SDPA calls of one eager forward (= rewrites)
EXPECTED = {
    "llama": ((WORKS, WORKS, WORKS), 2),  # GQA
    "gpt_bigcode": ((WORKS, WORKS, WORKS), 2),  # MQA
    "gpt2": ((WORKS, WORKS, WORKS), 2),  # MHA
    "phi": ((WORKS, WORKS, WORKS), 2),  # partial rotary
    "mixtral": ((WORKS, WORKS, WORKS), 2),  # MoE
    # --- HYBRID: today's statuses; update when hybrid support changes ---
    "mistral": ((WORKS, WORKS, WORKS), 2),  # sliding_window on every layer (all coded)
    "cohere2": ((WORKS, WORKS, WORKS), 4),  # 3 sliding + 1 full (the full one coded)
    "gemma4_text": ((WORKS, WORKS, WORKS), 6),  # 5 sliding (head_dim 16) + 1 full (32, the coded one)
    "llama4_text": ((WORKS, WORKS, WORKS), 2),  # 1 chunked + 1 full (the full one coded)
    "lfm2": ((WORKS, WORKS, WORKS), 1),  # 1 short convolution (no codebooks) + 1 full attention
    # 2 recurrent + 1 sliding (coded, the model's only attention): transformers 5.25 takes the
    # sliding mask's query offset from the first sliding cache layer, so the coded one must say it is
    "recurrent_gemma": ((WORKS, WORKS, WORKS), 1),
    "gpt_oss": ((REFUSED, REFUSED, REFUSED), 0),  # attention sinks, eager attention only
}
# --- HYBRID: today's reasons (a substring of each refused path's note) and notes ---
REFUSED_BECAUSE = {
    "gpt_oss": {"simulate": "attention sinks (s_aux) are not supported", "cache": "attention sinks (s_aux)"},
}
NOTES = {
    "cohere2": ["simulate quantizes 1 of 4 attention calls"],
    "gemma4_text": ["simulate quantizes 1 of 6 attention calls"],
    "llama4_text": ["simulate quantizes 1 of 2 attention calls"],
    "gpt_oss": ["no SDPA attention in transformers (eager attention)"],
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_architecture_statuses(name):
    result = check_architecture(name)
    paths, sdpa_calls = EXPECTED[name]
    assert result.skip_reason == ""
    assert tuple(result.paths[p].status for p in ("compiled", "simulate", "cache")) == paths, result
    assert result.status == (REFUSED if REFUSED in paths else WORKS)
    assert result.sdpa_calls == result.rewrites == sdpa_calls
    for path, reason in REFUSED_BECAUSE.get(name, {}).items():
        assert reason in result.paths[path].reason, result.paths[path]
    assert all(o.reason == "" for o in result.paths.values() if o.status == WORKS)
    assert result.notes == NOTES.get(name, [])


def test_tiny_configs_keep_one_layer_of_each_kind():
    gemma = tiny_config("gemma3_text")  # 5 sliding + 1 full by default: the 6-layer prefix
    assert gemma.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (gemma.num_hidden_layers, gemma.head_dim, gemma.sliding_window) == (6, HEAD_DIM, WINDOW)
    assert attention_kinds(gemma) == ["sliding", "full"]
    llama4 = tiny_config("llama4_text")
    assert (attention_kinds(llama4), llama4.attention_chunk_size) == (["chunked", "full"], WINDOW)
    assert attention_kinds(tiny_config("lfm2")) == ["conv", "full"]
    assert attention_kinds(tiny_config("mistral")) == ["sliding"]
    qwen2 = tiny_config("qwen2")  # the default is MHA: kept; a GQA default gets 2 KV heads
    assert (qwen2.num_attention_heads, qwen2.num_key_value_heads, qwen2.hidden_size) == (4, 4, 64)
    assert tiny_config("mixtral").num_key_value_heads == 2
    assert tiny_config("mixtral").num_local_experts == 4


def test_an_architecture_without_a_tiny_config_is_skipped_with_why():
    result = check_architecture("gemma4_assistant")  # its default config fails its own validation
    assert result.status == SKIPPED and result.paths == {}
    assert result.skip_reason.startswith("its default config does not build (StrictDataclassClassValidationError")


def _raise(exc_type, message):
    raise exc_type(message)


def test_outcomes_refused_only_for_the_packages_own_clear_errors():
    from vecinfer_compile.presets import get_preset

    with pytest.raises(ValueError) as refused:
        get_preset(7)
    assert outcome_of(refused.value) == Outcome(REFUSED, str(refused.value))
    with pytest.raises(ValueError) as foreign:  # a ValueError, but not raised by the package
        _raise(ValueError, "bad\nvalue")
    crashed = outcome_of(foreign.value)
    assert crashed.status == CRASHED
    assert crashed.reason.startswith("ValueError: bad value at tests/test_architectures.py:")
    try:  # wrapped (as Dynamo wraps a backend's error): the original decides
        try:
            get_preset(7)
        except ValueError as inner:
            raise RuntimeError("backend failed") from inner
    except RuntimeError as outer:
        assert outcome_of(outer).status == REFUSED


def test_a_path_past_its_time_limit_crashes_saying_where():
    outcome = run_step(lambda: time.sleep(2), seconds=0.05)
    assert outcome.status == CRASHED
    assert outcome.reason.startswith("PathTimeout: took longer than 0.05 s at tests/test_architectures.py:")
    assert run_step(lambda: None, seconds=0.05) == Outcome(WORKS)


def test_table_counts_and_summary():
    rows = [
        ArchitectureResult(
            "a", "AForCausalLM", "AConfig", ["full"], {p: Outcome(WORKS) for p in ("compiled", "simulate", "cache")}
        ),
        ArchitectureResult(
            "b",
            "BForCausalLM",
            "BConfig",
            ["sliding", "full"],
            {
                "compiled": Outcome(WORKS),
                "simulate": Outcome(REFUSED, "no | pipes"),
                "cache": Outcome(REFUSED, "no | pipes"),
            },
            notes=["a near tie"],
        ),
        ArchitectureResult(
            "c",
            "CForCausalLM",
            "CConfig",
            ["full"],
            {
                "compiled": Outcome(CRASHED, "KeyError: 'x' at m.py:1"),
                "simulate": Outcome(WORKS),
                "cache": Outcome(REFUSED, "no"),
            },
        ),
        ArchitectureResult("d", "DForCausalLM", skip_reason="needs timm"),
    ]
    assert [r.status for r in rows] == [WORKS, REFUSED, CRASHED, SKIPPED]
    assert table.counts_line(rows) == "1 works / 1 refused / 1 crashed / 1 skipped (of 4)"
    lines = table.table(rows).splitlines()
    assert lines[0] == "| architecture | config class | attention kinds | compiled | simulate | cache+generate | note |"
    assert lines[3] == (
        "| b | BConfig | sliding, full | works | refused | refused | "
        "simulate, cache refused: no \\| pipes; a near tie |"
    )
    assert lines[4] == (
        "| c | CConfig | full | crashed | works | refused | "
        "compiled crashed: KeyError: 'x' at m.py:1; cache refused: no |"
    )
    assert lines[5] == "| d | - | - | - | - | - | skipped: needs timm |"
    summary = table.summary(rows, "transformers X, torch Y")
    assert summary.startswith(
        "Of the 4 causal-LM architectures of transformers X, torch Y, tiny random models "
        "of 1 work through all three paths"
    )
    assert "Most frequent refusals: no | pipes (2 paths); no (1 path). Working: a." in summary


def test_sweep_command_writes_the_document(tmp_path, capsys):
    out = tmp_path / "architectures.md"
    assert main(["sweep", "--only", "gemma4_assistant", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| gemma4_assistant | - | - | - | - | - | skipped: its default config" in printed
    assert "0 works / 0 refused / 0 crashed / 1 skipped (of 1); transformers " in printed
    doc = out.read_text()
    assert doc.startswith("# Architecture sweep\n\nGenerated by `vecinfer sweep --only gemma4_assistant --out ")
    assert "Counts: 0 works / 0 refused / 0 crashed / 1 skipped (of 1)." in doc


def test_sweep_command_names_a_close_architecture(capsys):
    assert main(["sweep", "--only", "lama"]) == 2
    assert (
        "'lama' is not an architecture of transformers' causal-LM mapping; did you mean llama"
        in capsys.readouterr().err
    )


def test_readme_states_the_sweep_it_was_generated_from():
    """README's support paragraph gives docs/architectures.md's counts (working, refused, not built,
    of how many) and the transformers version swept, and links the page."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    summary = next(
        line for line in (root / "docs" / "architectures.md").read_text().splitlines() if line.startswith("Of the ")
    )
    readme = " ".join((root / "README.md").read_text().split())
    total, version, working = re.match(
        r"Of the (\d+) causal-LM architectures of transformers ([\d.]+),.* of (\d+) work", summary
    ).groups()
    refused, unbuilt = re.search(r"(\d+) are refused.*?(\d+) could not be built", summary).groups()
    assert f"transformers {version}" in readme and f"{working} of {total}" in readme
    assert f"{refused} are refused" in readme and f"{unbuilt} could not be built" in readme
    assert "(docs/architectures.md)" in readme
