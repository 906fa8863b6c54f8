"""vecinfer inspect: key statistics on a synthetic outlier case, codebook usage, PNGs written."""

from __future__ import annotations

import json

import torch

from vecinfer_compile.cli import main
from vecinfer_compile.evaluation.inspect import key_absmax_stats
from vecinfer_compile.quant.transform import smoothing_factors


def test_smoothing_reduces_outlier_ratio_synthetic():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 512, 64, generator=gen)
    k[:, :, [3, 17, 40]] *= 20.0  # Llama-like outlier channels
    lam = smoothing_factors(k.abs().amax(dim=1))
    stats = key_absmax_stats({0: k}, {0: lam})[0]
    raw, sm, both = stats["raw"], stats["smoothed"], stats["smoothed+hadamard"]
    assert raw["max_over_median"] > 10
    assert sm["max_over_median"] < raw["max_over_median"] / 3
    assert both["max_over_median"] < raw["max_over_median"] / 3
    assert stats["hadamard"]["max_over_median"] < raw["max_over_median"]  # rotation spreads outliers
    assert raw["absmax"].shape == (128,)


def test_inspect_cli_writes_pngs_and_summary(tiny_dir, sample_text_path, tmp_path, capsys):
    abl = tmp_path / "abl.json"
    abl.write_text(
        json.dumps(
            {
                "rows": [  # the fields `vecinfer ablation --out` writes that the plot reads
                    {
                        "method": "fp16",
                        "label": "full precision",
                        "nominal_bits": 16,
                        "bits": 16,
                        "physical_bits_per_element": 16,
                        "ppl": 30.0,
                    },
                    {
                        "method": "vecinfer",
                        "label": "VecInfer",
                        "nominal_bits": 2,
                        "bits": 2,
                        "physical_bits_per_element": 2,
                        "ppl": 33.0,
                    },
                    {
                        "method": "kivi",
                        "label": "KIVI",
                        "nominal_bits": 2,
                        "bits": 2,
                        "physical_bits_per_element": 3,
                        "ppl": 31.0,
                    },
                ]
            }
        )
    )
    out = tmp_path / "inspect"
    rc = main(
        [
            "inspect",
            "--model",
            str(tiny_dir),
            "--text",
            str(sample_text_path),
            "--calib-text",
            str(sample_text_path),
            "--out",
            str(out),
            "--methods",
            "vq,vecinfer",
            "--tokens",
            "128",
            "--seq-len",
            "128",
            "--max-tokens",
            "512",
            "--iters",
            "2",
            "--fit-vectors",
            "2048",
            "--ablation-json",
            str(abl),
            "--json",
            "--no-progress",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    for name in ("key_absmax", "codebook_usage", "ppl_vs_bits"):
        png = out / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000
    assert (out / "summary.json").is_file()
    assert len(summary["key_absmax"]) == 4  # tiny model: 4 layers
    for m in ("vq", "vecinfer"):
        u = summary["codebook_usage"][m]
        assert 0 < u["used"] <= u["entries"] == 256 and 0 < u["entropy_bits"] <= 8
        assert u["key_rel_mse"] > 0 and u["score_rel_err"] > 0
    assert (out / "codebooks" / "vq-2bit.safetensors").is_file()  # reused next time


def test_inspect_cli_errors(tiny_dir, sample_text_path, tmp_path, capsys):
    assert (
        main(["inspect", "--model", str(tiny_dir), "--text", str(tmp_path / "nope.txt"), "--out", str(tmp_path)]) == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert (
        main(
            [
                "inspect",
                "--model",
                str(tiny_dir),
                "--text",
                str(sample_text_path),
                "--out",
                str(tmp_path),
                "--methods",
                "kivi",
            ]
        )
        == 2
    )
    assert "VQ methods" in capsys.readouterr().err
    assert (
        main(
            [
                "inspect",
                "--model",
                str(tiny_dir),
                "--text",
                str(sample_text_path),
                "--out",
                str(tmp_path / "o"),
                "--tokens",
                "64",
                "--seq-len",
                "64",
                "--no-ppl",
                "--methods",
                "vq",
            ]
        )
        == 2
    )
    assert "--calib-text" in capsys.readouterr().err


def test_codebook_usage_with_presets_that_differ_by_layer():
    """A per-layer allocation (256- and 4096-entry key books): usage is pooled from each layer's
    own fractions, and the table names the mix instead of one size."""
    from vecinfer_compile.evaluation.inspect import codebook_usage, format_summary
    from vecinfer_compile.testing import random_codebooks

    geometry = {
        "num_layers": 2,
        "num_query_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "hidden_size": 64,
        "model_type": "llama",
        "vocab_size": 128,
    }
    cb = random_codebooks(geometry, layer_bits=[2.0, 1.5])
    gen = torch.Generator().manual_seed(0)
    qkv = {l: (torch.randn(4, 64, 16, generator=gen), torch.randn(2, 64, 16, generator=gen), None) for l in (0, 1)}
    u = codebook_usage(qkv, cb)
    assert u["entries"] is None and [c.numel() for c in u["counts"]] == [256, 4096]
    fractions = [r["used"] / r["entries"] for r in u["per_layer"]]
    assert u["used_fraction"] == sum(fractions) / 2
    assert "presets differ by layer" in format_summary({"key_absmax": [], "codebook_usage": {"vq": u}})
    import matplotlib.pyplot as plt

    from vecinfer_compile.evaluation.inspect import codebook_usage_figure

    fig = codebook_usage_figure({"vq": u})
    assert fig.axes[0].get_ylabel() == "% of the codes of each layer"
    plt.close(fig)
