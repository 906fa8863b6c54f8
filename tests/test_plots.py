"""Every figure the package writes: nothing drawn off the canvas (titles, axis labels, legends,
annotations), points that must stay tellable apart do, and the codebook-usage figure reports
dead codes. Synthetic inputs shaped like the real ones; each figure is drawn, not saved."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("matplotlib")

from vecinfer_compile.evaluation.inspect import STAGES, codebook_usage_figure, key_absmax_figure  # noqa: E402
from vecinfer_compile.evaluation.needle import NeedleResult, grid_figure, plot_grid  # noqa: E402
from vecinfer_compile.evaluation.plots import clipped_texts, plot_ppl_vs_bits, ppl_vs_bits_figure  # noqa: E402

# docs/results.md's H200 ablation: plain VQ and smoothing-only are 275.200 vs 275.205 at 2 bits,
# which drew one on top of the other; KIVI's points carry nominal-bit labels, one at the right edge.
ABLATION = """fp16 full-precision 16 16 238.105
vecinfer VecInfer 4 4 239.744
vecinfer VecInfer 3 3 243.528
vecinfer VecInfer 2 2 269.617
vecinfer VecInfer 1.5 1.5 306.336
vecinfer VecInfer 1 1 517.186
kivi KIVI 4 5 238.853
kivi KIVI 2 3 251.717
vq VQ-(plain) 2 2 275.200
vq VQ-(plain) 1.5 1.5 298.749
smooth VQ-+-smoothing 2 2 275.205
smooth VQ-+-smoothing 1.5 1.5 299.195
hadamard VQ-+-Hadamard 2 2 268.872
hadamard VQ-+-Hadamard 1.5 1.5 304.846"""


def ablation_rows():
    rows = []
    for line in ABLATION.splitlines():
        method, label, nominal, physical, ppl = line.split()
        rows.append(
            {
                "method": method,
                "label": label.replace("-", " "),
                "nominal_bits": float(nominal),
                "bits": float(nominal),
                "physical_bits_per_element": float(physical),
                "ppl": float(ppl),
            }
        )
    return rows


def close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_ppl_vs_bits_text_inside_and_points_apart():
    fig = ppl_vs_bits_figure(ablation_rows(), title="evalmodel: perplexity vs physical KV bits")
    try:
        assert clipped_texts(fig) == []
        ax = fig.axes[0]
        lines = {l.get_gid()[len("method:") :]: l for l in ax.get_lines() if (l.get_gid() or "").startswith("method:")}
        assert set(lines) == {"vecinfer", "kivi", "vq", "smooth", "hadamard"}
        assert len({l.get_marker() for l in lines.values()}) == len(lines)  # a marker per method
        points = {m: ax.transData.transform(l.get_xydata()) for m, l in lines.items()}
        for (m1, p1), (m2, p2) in itertools.combinations(points.items(), 2):
            for a in p1:
                for b in p2:
                    assert math.dist(a, b) >= 6.0, f"{m1} and {m2} points drawn {math.dist(a, b):.1f} px apart"
        # every point is still read at its own physical bits: the sideways spread stays within a group
        for r in ablation_rows()[1:]:
            x = lines[r["method"]].get_xdata()[[y == r["ppl"] for y in lines[r["method"]].get_ydata()].index(True)]
            assert abs(x - r["physical_bits_per_element"]) <= 0.2
        labels = [t.get_text() for t in ax.texts]
        assert sorted(labels) == ["2-bit nominal", "4-bit nominal"]  # KIVI's scales: nominal != physical
    finally:
        close(fig)


def test_ppl_vs_bits_full_ablation_and_one_row(tmp_path):
    rows = ablation_rows() + [
        {
            "method": m,
            "label": m,
            "nominal_bits": 2.0,
            "bits": 2.0,
            "physical_bits_per_element": 2.0,
            "ppl": 270.0 + i * 0.001,
        }  # five more methods at the same point
        for i, m in enumerate(["qaware", "qaware-nocenter", "qaware-nohadamard", "qaware-sqrt", "vecinfer-center"])
    ]
    fig = ppl_vs_bits_figure(rows, title="a title long enough to need wrapping " * 4)
    try:
        assert clipped_texts(fig) == []
        xs = sorted(x for l in fig.axes[0].get_lines() if l.get_gid() for x, y in l.get_xydata() if y >= 268)
        assert len(set(xs)) == len(xs)  # ten methods at 2 bits: ten distinct x positions
    finally:
        close(fig)
    path = plot_ppl_vs_bits(rows[:2], tmp_path / "sub" / "ppl.png")  # one method, one point: still a figure
    assert path.is_file() and path.stat().st_size > 1000


@pytest.mark.parametrize(
    "lengths,depths,title",
    [
        ([64], [50.0], None),
        (
            [64],
            [50.0],
            "needle (passkey): qaware-nohadamard 1.25-bit average (4/1/1/1/1/4/1/1/1/1/1/1 per layer)\n"
            "mean accuracy 1.00, 1 trials/cell",
        ),
        ([512, 1024, 2048], [0, 25, 50, 75, 100], None),
    ],
)
def test_needle_grid_text_inside(lengths, depths, title, tmp_path):
    grid = [[(i + j) % 3 / 2 for j in range(len(depths))] for i in range(len(lengths))]
    result = NeedleResult("vecinfer", 2.0, "magic_number", lengths, depths, 16, grid, 128, "")
    fig = grid_figure(result, title)
    try:
        assert clipped_texts(fig) == []
        ax = fig.axes[0]
        assert ax.get_xlabel() and ax.get_ylabel()
        cells = [t for t in ax.texts]
        assert len(cells) == len(lengths) * len(depths)
        # cell labels readable: white on the dark ends of the colour map, black in the light middle
        ink = {t.get_text(): t.get_color() for t in cells}
        assert ink.get("0.00", "white") == "white" and ink.get("0.50", "black") == "black"
    finally:
        close(fig)
    assert plot_grid(result, tmp_path / "g.png", title).stat().st_size > 1000


def fake_stats(layers: int, channels: int = 128):
    gen = torch.Generator().manual_seed(0)
    out = {}
    for l in range(layers):
        out[l] = {}
        for s in STAGES:
            a = torch.rand(channels, generator=gen) + 0.5
            out[l][s] = {
                "absmax": a,
                "max": float(a.max()),
                "median": float(a.median()),
                "max_over_median": float(a.max() / a.median()),
            }
    return out


@pytest.mark.parametrize("layers", [1, 4])
def test_key_absmax_text_inside(layers):
    fig = key_absmax_figure(fake_stats(layers), num_kv_heads=2, title="model: per-channel key |max| on text.txt")
    try:
        assert clipped_texts(fig) == []
        assert len(fig.legends) == 1  # one legend for the figure, not one covering each panel
        assert all("max/median" in ax.get_title() for ax in fig.axes if ax.get_visible() and ax.lines)
    finally:
        close(fig)


def fake_usage(dead: int, entries: int = 256, layers: int = 3):
    gen = torch.Generator().manual_seed(1)
    counts = torch.randint(1, 50, (layers, entries), generator=gen)
    counts[:, :dead] = 0
    per_layer = []
    for l in range(layers):
        p = counts[l].double() / counts[l].sum()
        h = float(-(p[p > 0] * p[p > 0].log2()).sum())
        per_layer.append(
            {
                "layer": l,
                "used": entries - dead,
                "entries": entries,
                "dead_fraction": dead / entries,
                "entropy_bits": h,
                "effective_entries": 2**h,
                "key_rel_mse": 0.1,
                "score_rel_err": 0.2 + 0.01 * l,
                "score_rms": 0.5,
            }
        )
    mean = lambda k: sum(r[k] for r in per_layer) / layers  # noqa: E731
    return {
        "method": "vq",
        "bits": 2.0,
        "entries": entries,
        "used": mean("used"),
        "used_fraction": mean("used") / entries,
        "dead_fraction": mean("dead_fraction"),
        "entropy_bits": mean("entropy_bits"),
        "max_entropy_bits": math.log2(entries),
        "effective_entries": mean("effective_entries"),
        "effective_fraction": mean("effective_entries") / entries,
        "key_rel_mse": 0.1,
        "score_rel_err": mean("score_rel_err"),
        "score_rms": 0.5,
        "per_layer": per_layer,
        "counts": list(counts),
    }


def test_codebook_usage_says_what_is_wrong():
    fig = codebook_usage_figure(
        {"vq": fake_usage(dead=128), "vecinfer": fake_usage(dead=0)},
        title="model: 2-bit key codebook usage on text.txt (2048 tokens)",
    )
    try:
        assert clipped_texts(fig) == []
        assert "good:" in fig.get_suptitle()  # the figure says what to look for
        legend_texts = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert any(t.startswith("vq:") and "50.0% dead" in t for t in legend_texts)
        assert any(t.startswith("vecinfer:") and "0.0% dead" in t for t in legend_texts)
        assert any("384 dead of 768" in t for t in legend_texts)  # the histogram counts dead codes
        # the 'used at all' ticks sit at 50% for the half-dead codebook and 100% for the other
        used = sorted({round(float(y)) for c in fig.axes[0].collections for _, y in c.get_offsets()})
        assert used == [50, 100]
    finally:
        close(fig)
