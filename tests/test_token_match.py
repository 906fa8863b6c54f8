"""Greedy tokens through VecInferCache vs the eager simulate path (`vecinfer match`)."""

from __future__ import annotations

import json

import pytest
import torch

from vecinfer_compile.cli import main
from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.evaluation.token_match import MatchResult, prompts_from_ids, token_match
from vecinfer_compile.models import default_codebooks_dir, load_text, tokenize


def test_match_result_first_mismatch():
    assert MatchResult(4, [1, 2, 3], [1, 2, 3]).first_mismatch is None
    assert MatchResult(4, [1, 2, 3], [1, 2, 3]).matched == 3
    assert MatchResult(4, [1, 5, 3], [1, 2, 3]).first_mismatch == 1
    assert MatchResult(4, [7, 2, 3], [1, 2, 3]).matched == 0


def test_prompts_are_disjoint_slices_and_short_text_is_an_error():
    ids = torch.arange(100)
    prompts = prompts_from_ids(ids, 3, 20)
    assert [p.tolist()[:2] for p in prompts] == [[0, 1], [33, 34], [66, 67]]
    assert all(len(p) == 20 for p in prompts)
    with pytest.raises(ValueError, match="fewer than 6 prompts"):
        prompts_from_ids(ids, 6, 20)


@pytest.mark.parametrize("residual, key_weight", [(0, 1.0), (16, 1.0), (16, 8.0)])
def test_cache_matches_simulate_on_tiny_model(tiny_model, sample_text_path, residual, key_weight):
    """The cache reads codes for most of a 96-token prompt; same codebooks, same window -> same
    greedy tokens as simulate mode with full_precision_prefill (also with score-aware key codes)."""
    model, tok = tiny_model
    codebooks = load_codebooks(default_codebooks_dir() / "vecinfer-2bit.safetensors")
    codebooks.metadata["key_parallel_weight"] = key_weight
    prompts = prompts_from_ids(tokenize(tok, load_text(sample_text_path)), 2, 96)
    results = token_match(model, prompts, codebooks, new_tokens=12, residual=residual, progress=False)
    assert [r.first_mismatch for r in results] == [None, None]
    assert all(len(r.cache_tokens) == 12 for r in results)


def test_match_cli_json(capsys, tiny_dir, sample_text_path):
    cb = default_codebooks_dir() / "vecinfer-2bit.safetensors"
    code = main(
        [
            "match",
            "--model",
            str(tiny_dir),
            "--codebooks",
            str(cb),
            "--text",
            str(sample_text_path),
            "--prompts",
            "1",
            "--prompt-len",
            "48",
            "--new-tokens",
            "6",
            "--residual",
            "8",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert (result["prompts"], result["identical_prompts"], result["tied_prompts"], result["new_tokens"]) == (
        1,
        1,
        0,
        6,
    )
    assert result["results"][0]["parted_at_tie"] is False
    assert result["results"][0]["cache"] == result["results"][0]["simulate"]


def test_match_cli_missing_codebooks_is_one_line(capsys, tiny_dir, sample_text_path, tmp_path):
    code = main(
        [
            "match",
            "--model",
            str(tiny_dir),
            "--codebooks",
            str(tmp_path / "nope.safetensors"),
            "--text",
            str(sample_text_path),
        ]
    )
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nope.safetensors" in err


def test_match_cli_prefill_chunk(capsys, monkeypatch, tiny_dir, sample_text_path):
    """--prefill-chunk: the cache's prompt goes through generate(prefill_chunk_size=...) (three
    16-token chunks for a 48-token prompt, then the new tokens) and the simulate side reads the
    prompt with the per-query window; the summary says so."""
    from vecinfer_compile.evaluation import token_match as tm

    seen = []
    real = tm._generate
    monkeypatch.setattr(
        tm,
        "_generate",
        lambda model, ids, n, **kw: seen.append(kw.get("prefill_chunk_size")) or real(model, ids, n, **kw),
    )
    fp_prefill = []
    real_sim = tm._simulate_run
    monkeypatch.setattr(
        tm, "_simulate_run", lambda *a, **kw: fp_prefill.append(kw["full_precision_prefill"]) or real_sim(*a, **kw)
    )
    cb = default_codebooks_dir() / "vecinfer-2bit.safetensors"
    code = main(
        [
            "match",
            "--model",
            str(tiny_dir),
            "--codebooks",
            str(cb),
            "--text",
            str(sample_text_path),
            "--prompts",
            "1",
            "--prompt-len",
            "48",
            "--new-tokens",
            "6",
            "--residual",
            "8",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
            "--prefill-chunk",
            "16",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["prefill_chunk"] == 16 and len(result["results"][0]["cache"]) == 6
    assert seen == [16, None] and fp_prefill == [False]
    gaps = result["results"][0]["gaps_at_mismatch"]  # (cache, simulate) top-two gaps, where they part
    assert (gaps is None) == (result["results"][0]["first_mismatch"] is None)


def test_a_mismatch_reports_both_paths_top_two_gaps():
    """The gaps at the first mismatch are the two paths' own: top-1 minus top-2 of the logits they
    chose from at that step (so a tie is told apart from a wrong read)."""
    from vecinfer_compile.evaluation.token_match import MatchResult

    r = MatchResult(4, [5, 6, 7], [5, 6, 8], cache_gaps=[1.0, 2.0, 0.01], simulate_gaps=[1.1, 2.1, 0.02])
    assert r.first_mismatch == 2 and r.gaps_at_mismatch() == (0.01, 0.02)
    assert MatchResult(4, [5], [5], [1.0], [1.0]).gaps_at_mismatch() is None


def test_a_mismatch_within_one_rounding_step_is_a_tie():
    """Paths that part where one of them had its top two logits within one step of the logits'
    dtype (bf16 at ~10: 0.0625) parted at a tie; a wider gap in both, or float32's finer steps, is
    not one."""
    from vecinfer_compile.evaluation.token_match import MatchResult, logit_step

    assert logit_step(torch.bfloat16, 10.0) == 0.0625 and logit_step(torch.float16, 10.0) == 2.0**-7
    assert logit_step(torch.bfloat16, -12.0) == 0.0625 and logit_step(torch.float32, 1.5) == 2.0**-23

    def result(cache_gap, simulate_gap, top=10.0):
        return MatchResult(4, [5, 6], [5, 7], [1.0, cache_gap], [1.0, simulate_gap], [9.0, top], [9.0, top])

    assert result(0.0625, 0.0).parted_at_tie(torch.bfloat16)
    assert not result(0.125, 0.25).parted_at_tie(torch.bfloat16)
    assert not result(0.0625, 0.0625, top=3.0).parted_at_tie(torch.bfloat16)  # the step at 3 is 1/64
    assert not result(0.0625, 0.01).parted_at_tie(torch.float32)
    assert not MatchResult(4, [5, 6], [5, 6], [1.0, 0.0], [1.0, 0.0], [9.0, 9.0], [9.0, 9.0]).parted_at_tie(
        torch.bfloat16
    )
    assert not MatchResult(4, [5, 6], [5, 7]).parted_at_tie(torch.bfloat16)  # nothing recorded
