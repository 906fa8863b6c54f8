"""Key statistics and codebook usage: why VecInfer smooths and rotates keys before VQ.

- :func:`record_qkv`: post-RoPE queries, keys and values of every layer on a text.
- :func:`key_absmax_stats`: per-channel key absmax before smoothing, after smoothing and after
  smoothing + Hadamard (and Hadamard only), with the outlier ratio ``max / median`` per layer.
- :func:`codebook_usage`: for each method's key codebooks, how many centroids held-out keys
  actually use (the rest are dead codes: bits paid for nothing), the entropy ``H`` of that usage
  (bits; ``log2(entries)`` is the ideal) and the effective codebook size ``2^H`` (the number of
  equally used codes with the same entropy), the relative key error ``|K - K^|^2 / |K|^2`` and
  the score error ``q . (K - K^)`` (relative, and RMS in softmax-logit units ``/ sqrt(D)``). The
  paper's argument: outlier channels stretch the key distribution so most centroids sit idle;
  smoothing + rotation spread usage out.
- :func:`plot_key_absmax`, :func:`plot_codebook_usage`: the figures of ``vecinfer inspect``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..hf.recording import collect_kv

STAGES = ("raw", "smoothed", "smoothed+hadamard", "hadamard")
STAGE_LABELS = {
    "raw": "before smoothing",
    "smoothed": "after smoothing",
    "smoothed+hadamard": "after smoothing + Hadamard",
    "hadamard": "Hadamard only",
}


def record_qkv(model, token_ids: torch.Tensor, seq_len: int = 1024) -> dict[int, tuple[torch.Tensor, ...]]:
    """``{layer: (q [H_q, N, D], k [H_kv, N, D], v [H_kv, N, D])}`` float32 CPU, from windows of
    ``seq_len`` tokens (each led by BOS when the model has one, as in calibration)."""
    keys, values, queries = collect_kv(model, token_ids.reshape(-1), seq_len, progress=False, with_queries=True)
    return {l: (queries[l], keys[l], values[l]) for l in keys}


def transformed_keys(k: torch.Tensor, stage: str, lam: torch.Tensor | None) -> torch.Tensor:
    """``k [H_kv, N, D]`` at ``stage`` (one of :data:`STAGES`)."""
    from ..quant.transform import KeyTransform

    if stage == "raw":
        return k
    smooth = stage.startswith("smoothed")
    if smooth and lam is None:
        raise ValueError("smoothing factors are needed for the smoothed stages")
    tr = KeyTransform(k.shape[-1], lam if smooth else None, rotate=stage in ("smoothed+hadamard", "hadamard"))
    return tr.keys(k[None])[0]


def key_absmax_stats(keys: dict[int, torch.Tensor], lams: dict[int, torch.Tensor]) -> dict:
    """Per layer and stage: per-channel absmax ``[H_kv * D]`` and the ratio ``max / median`` of
    the per-(head, channel) absmax. ``keys[l]: [H_kv, N, D]``, ``lams[l]: [H_kv, D]``."""
    out = {}
    for layer, k in keys.items():
        per = {}
        for stage in STAGES:
            a = transformed_keys(k, stage, lams.get(layer)).abs().amax(dim=1).reshape(-1)  # [H*D]
            med = float(a.median())
            per[stage] = {
                "absmax": a,
                "max": float(a.max()),
                "median": med,
                "max_over_median": float(a.max()) / max(med, 1e-30),
            }
        out[layer] = per
    return out


def _entropy_bits(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum()
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


@torch.no_grad()
def codebook_usage(qkv: dict[int, tuple[torch.Tensor, ...]], codebooks, score_tokens: int = 512) -> dict:
    """Key-codebook usage and error of ``codebooks`` (one method) on recorded ``qkv``.

    Returns ``{"per_layer": [...], "used", "entries", "used_fraction", "dead_fraction",
    "entropy_bits", "effective_entries", "effective_fraction", "key_rel_mse", "score_rel_err",
    "score_rms", "counts"}``; the pooled numbers are means over layers (``counts``: per layer, its
    usage counts ``[E_l]``; ``entries`` is None when layers' presets differ in size, the fractions
    are then means of each layer's own; ``effective_entries`` is ``2^entropy_bits``). Score error uses the first
    ``score_tokens`` queries and keys of the text, causal pairs only, GQA as in the model."""
    from ..quant.codebook import decode, encode
    from ..quant.transform import expand_to_query_heads

    per_layer, all_counts = [], []
    for layer, (q, k, _) in qkv.items():
        lc = codebooks.layer(layer)
        if not isinstance(lc.keys, torch.Tensor):
            raise ValueError(
                f"codebook usage reads key codebooks; these keys are coded by the {lc.key_codec.name} "
                "codec, which has none: inspect a file calibrated with the default codec"
            )
        cent = lc.keys.float()
        kt = lc.transform.keys(k[None])  # [1, H, N, D]
        codes = encode(kt, cent)
        counts = torch.bincount(codes.reshape(-1).long(), minlength=cent.shape[0])
        k_hat = lc.transform.keys_inverse(decode(codes, cent))[0]
        rel_mse = float(((k - k_hat) ** 2).sum() / (k**2).sum().clamp_min(1e-30))
        n = min(score_tokens, k.shape[1])
        dk = expand_to_query_heads((k - k_hat)[:, :n], q.shape[0])
        kk = expand_to_query_heads(k[:, :n], q.shape[0])
        qq = q[:, :n]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        err = (qq @ dk.transpose(-1, -2))[:, causal]
        ref = (qq @ kk.transpose(-1, -2))[:, causal]
        d = q.shape[-1]
        used, entropy = int((counts > 0).sum()), _entropy_bits(counts)
        per_layer.append(
            {
                "layer": layer,
                "used": used,
                "entries": int(cent.shape[0]),
                "dead_fraction": 1.0 - used / cent.shape[0],
                "entropy_bits": entropy,
                "effective_entries": 2.0**entropy,
                "key_rel_mse": rel_mse,
                "score_rel_err": float(err.norm() / ref.norm().clamp_min(1e-30)),
                "score_rms": float(err.pow(2).mean().sqrt() / math.sqrt(d)),
            }
        )
        all_counts.append(counts)

    def mean(value) -> float:
        return sum(value(r) for r in per_layer) / len(per_layer)

    sizes = {r["entries"] for r in per_layer}
    return {
        "method": codebooks.method,
        "bits": codebooks.bits,
        "entries": sizes.pop() if len(sizes) == 1 else None,
        "used": mean(lambda r: r["used"]),
        "used_fraction": mean(lambda r: r["used"] / r["entries"]),
        "dead_fraction": mean(lambda r: r["dead_fraction"]),
        "entropy_bits": mean(lambda r: r["entropy_bits"]),
        "max_entropy_bits": mean(lambda r: math.log2(r["entries"])),
        "effective_entries": mean(lambda r: r["effective_entries"]),
        "effective_fraction": mean(lambda r: r["effective_entries"] / r["entries"]),
        "key_rel_mse": mean(lambda r: r["key_rel_mse"]),
        "score_rel_err": mean(lambda r: r["score_rel_err"]),
        "score_rms": mean(lambda r: r["score_rms"]),
        "per_layer": per_layer,
        "counts": all_counts,
    }


# -- plots -----------------------------------------------------------------------------------------
def _grid(n: int) -> tuple[int, int]:
    cols = min(3, n)
    return math.ceil(n / cols), cols


STAGE_COLORS = {"raw": "tab:red", "smoothed": "tab:blue", "smoothed+hadamard": "tab:green"}


def key_absmax_figure(stats: dict, *, num_kv_heads: int, title: str = ""):
    """The figure of :func:`plot_key_absmax` (not saved; the caller owns it)."""
    from .plots import _plain_log_labels, _pyplot, wrap

    plt = _pyplot()
    layers = sorted(stats)
    rows, cols = _grid(len(layers))
    width = max(6.0, 4.8 * cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(width, 3.0 * rows + 1.1), squeeze=False, sharey=True, layout="constrained"
    )
    shown = ("raw", "smoothed", "smoothed+hadamard")
    for ax, layer in zip(axes.flat, layers):
        for stage in shown:
            ax.plot(
                stats[layer][stage]["absmax"].numpy(),
                color=STAGE_COLORS[stage],
                linewidth=0.8,
                label=STAGE_LABELS[stage],
            )
        width_h = stats[layer]["raw"]["absmax"].numel() // num_kv_heads
        for h in range(1, num_kv_heads):
            ax.axvline(h * width_h, color="0.35", linewidth=0.8, linestyle=":")
        ratios = " → ".join(f"{stats[layer][s]['max_over_median']:.1f}" for s in shown)
        ax.set_title(f"layer {layer}: max/median {ratios}", fontsize=9.5)
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
        ax.set_xlabel(f"channel ({num_kv_heads} KV heads side by side)", fontsize=8)
        ax.grid(True, which="both", alpha=0.2)
    for ax in list(axes.flat)[len(layers) :]:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel("per-channel key |max| (log)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=9)
    head = title or "key absmax per channel"
    fig.suptitle(
        wrap(
            f"{head}\nmax/median per layer: before smoothing → after smoothing → after smoothing + "
            f"Hadamard; lower means flatter channels, which one shared codebook fits better",
            width - 0.4,
            10.5,
        ),
        fontsize=10.5,
    )
    return fig


def plot_key_absmax(stats: dict, path: str | Path, *, num_kv_heads: int, title: str = "") -> Path:
    """One panel per layer: per-channel key absmax (log scale) before smoothing, after
    smoothing, after smoothing + Hadamard, KV heads side by side on the x axis; each panel's
    title gives the three outlier ratios (max / median), one legend for the figure."""
    from .plots import save_figure

    return save_figure(key_absmax_figure(stats, num_kv_heads=num_kv_heads, title=title), path, dpi=110)


USAGE_GOOD = (
    "good: bars near 100% and no dead codes (every code used about equally often, so each pays its "
    "bits), usage bunched at 1x. Then compare methods and layers by score error: a layer far above "
    "the rest is the one to give more bits (vecinfer calibrate --layer-bits or --allocate "
    "retrieval). Dead codes on text like the calibration text: recalibrate on more of it "
    "(--max-tokens)."
)


def codebook_usage_figure(usage: dict[str, dict], *, title: str = ""):
    """The figure of :func:`plot_codebook_usage` (not saved; the caller owns it)."""
    from .plots import MARKERS, _plain_log_labels, _pyplot, wrap

    plt = _pyplot()
    methods = list(usage)
    sizes = {u["entries"] for u in usage.values()}
    entries = f"{sizes.pop()} codes" if len(sizes) == 1 and None not in sizes else "codes of each layer"
    layers = [r["layer"] for r in usage[methods[0]]["per_layer"]]
    width_in = 15.0
    fig, axes = plt.subplots(1, 3, figsize=(width_in, 6.0), layout="constrained")
    bar_w = 0.8 / max(1, len(methods))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    edges = [2.0 ** (e / 4) for e in range(-28, 21)]  # 1/128x .. 32x the uniform share, quarter octaves
    for i, m in enumerate(methods):
        u, color = usage[m], colors[i % len(colors)]
        xs = [x + (i - (len(methods) - 1) / 2) * bar_w for x in range(len(layers))]
        eff = [100.0 * r["effective_entries"] / r["entries"] for r in u["per_layer"]]
        used = [100.0 * (1.0 - r["dead_fraction"]) for r in u["per_layer"]]
        axes[0].bar(
            xs,
            eff,
            width=bar_w,
            color=color,
            label=f"{m}: {100 * u['effective_fraction']:.0f}% effective, {100 * u['dead_fraction']:.1f}% dead",
        )
        axes[0].scatter(
            xs,
            used,
            marker="_",
            s=160,
            color="black",
            linewidths=1.6,
            zorder=3,
            label="codes used at all (100% = no dead code)" if i == 0 else None,
        )
        # per code: its share of the key sub-vectors over the uniform share 1/entries, every layer's codes
        rel = torch.cat([c.double() * c.numel() / c.sum() for c in u["counts"]])
        live = rel[rel > 0].clamp(edges[0], edges[-1]).numpy()
        axes[1].hist(
            live,
            bins=edges,
            histtype="step",
            linewidth=1.5,
            color=color,
            label=f"{m} ({int((rel == 0).sum())} dead of {rel.numel()})",
        )
        axes[2].bar(
            xs,
            [100.0 * r["score_rel_err"] for r in u["per_layer"]],
            width=bar_w,
            color=color,
            label=f"{m}: mean {100 * u['score_rel_err']:.1f}%",
        )
        axes[2].plot(
            xs,
            [100.0 * r["key_rel_mse"] for r in u["per_layer"]],
            linestyle="none",
            marker=MARKERS[i % len(MARKERS)],
            markersize=5,
            color="black",
            markerfacecolor=color,
            label=f"{m}: key rel. MSE (mean {100 * u['key_rel_mse']:.1f}%)",
        )
    ax = axes[0]
    ax.axhline(100, color="black", linestyle="--", linewidth=1)
    ax.set_ylim(0, 118)
    ax.set_xticks(range(len(layers)), [str(l) for l in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel(f"% of the {entries}")
    ax.set_title(
        wrap(
            "effective codebook size 2^H / entries (bars; H = usage entropy) and codes used at all (ticks)",
            width_in / 3 - 0.6,
            10,
        ),
        fontsize=10,
    )
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)
    ax = axes[1]
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("a code's share of key sub-vectors / uniform share (1/entries)")
    ax.set_ylabel(f"codes (all {len(layers)} layers)")
    ax.set_title(
        wrap(
            "how often each code is used, relative to uniform (dashed: every code equally often)",
            width_in / 3 - 0.6,
            10,
        ),
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="upper left")
    ax = axes[2]
    ax.set_xticks(range(len(layers)), [str(l) for l in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel("% (lower is better)")
    ax.set_title(
        wrap(
            "what it costs: relative score error |q·ΔK| / |q·K| per layer (bars), key rel. MSE (markers)",
            width_in / 3 - 0.6,
            10,
        ),
        fontsize=10,
    )
    top = max(
        max(100.0 * r[k] for r in u["per_layer"] for k in ("score_rel_err", "key_rel_mse")) for u in usage.values()
    )
    ax.set_ylim(0, top * 1.1)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2)
    head = title or "key codebook usage on held-out text"
    fig.suptitle(wrap(f"{head}\n{USAGE_GOOD}", width_in - 0.5, 10.5), fontsize=10.5)
    return fig


def plot_codebook_usage(usage: dict[str, dict], path: str | Path, *, title: str = "") -> Path:
    """Three panels, one colour per method: effective codebook size ``2^H / entries`` per layer with
    the share of codes used at all (dead codes), the histogram of each code's usage relative to
    the uniform share, and what the codebook costs per layer (relative score error, key MSE); the
    title says what good looks like and what to do otherwise."""
    from .plots import save_figure

    return save_figure(codebook_usage_figure(usage, title=title), path, dpi=110)


def summary_dict(stats: dict, usage: dict[str, dict]) -> dict:
    """JSON-able summary (no tensors)."""
    layers = []
    for layer in sorted(stats):
        layers.append(
            {
                "layer": layer,
                **{
                    stage: {k: round(v, 4) for k, v in stats[layer][stage].items() if k != "absmax"} for stage in STAGES
                },
            }
        )
    methods = {
        m: {k: (round(v, 6) if isinstance(v, float) else v) for k, v in u.items() if k != "counts"}
        for m, u in usage.items()
    }
    return {"key_absmax": layers, "codebook_usage": methods}


def format_summary(summary: dict) -> str:
    lines = [
        "key absmax max/median per layer (max over (head, channel) / median):",
        "",
        "| layer | before smoothing | after smoothing | smoothing + Hadamard | Hadamard only |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in summary["key_absmax"]:
        cells = [f"{r[s]['max_over_median']:.2f} ({r[s]['max']:.2f}/{r[s]['median']:.2f})" for s in STAGES]
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + " |")
    if summary["codebook_usage"]:
        lines += [
            "",
            "key codebook usage on the text (means over layers):",
            "",
            "| method | bits | centroids used | usage entropy H (bits) | effective size 2^H | key rel. MSE "
            "| score rel. err | score RMS (logits) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m, u in summary["codebook_usage"].items():
            used = (
                f"{u['used']:.1f}/{u['entries']}"
                if u["entries"] is not None
                else f"{100 * u['used_fraction']:.0f}% (presets differ by layer)"
            )
            lines.append(
                f"| {m} | {u['bits']:g} | {used} | {u['entropy_bits']:.2f}/"
                f"{u['max_entropy_bits']:.1f} | {u['effective_entries']:.0f} "
                f"({100 * u['effective_fraction']:.0f}%) | {u['key_rel_mse']:.4f} "
                f"| {u['score_rel_err']:.4f} | {u['score_rms']:.4f} |"
            )
    return "\n".join(lines)
