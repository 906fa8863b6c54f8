"""Key statistics and codebook usage: why VecInfer smooths and rotates keys before VQ.

- :func:`record_qkv`: post-RoPE queries, keys and values of every layer on a text.
- :func:`key_absmax_stats`: per-channel key absmax before smoothing, after smoothing and after
  smoothing + Hadamard (and Hadamard only), with the outlier ratio ``max / median`` per layer.
- :func:`codebook_usage`: for each method's key codebooks, how many centroids held-out keys
  actually use, the entropy of that usage (bits; ``log2(entries)`` is the ideal), the relative
  key error ``|K - K^|^2 / |K|^2`` and the score error ``q . (K - K^)`` (relative, and RMS in
  softmax-logit units ``/ sqrt(D)``). The paper's argument: outlier channels stretch the key
  distribution so most centroids sit idle; smoothing + rotation spread usage out.
- :func:`plot_key_absmax`, :func:`plot_codebook_usage`: the figures of ``vecinfer inspect``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..recording import collect_kv

STAGES = ("raw", "smoothed", "smoothed+hadamard", "hadamard")
STAGE_LABELS = {"raw": "before smoothing", "smoothed": "after smoothing",
                "smoothed+hadamard": "after smoothing + Hadamard", "hadamard": "Hadamard only"}


def record_qkv(model, token_ids: torch.Tensor, seq_len: int = 1024) -> dict[int, tuple[torch.Tensor, ...]]:
    """``{layer: (q [H_q, N, D], k [H_kv, N, D], v [H_kv, N, D])}`` float32 CPU, from windows of
    ``seq_len`` tokens (each led by BOS when the model has one, as in calibration)."""
    keys, values, queries = collect_kv(model, token_ids.reshape(-1), seq_len, progress=False,
                                       with_queries=True)
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
            per[stage] = {"absmax": a, "max": float(a.max()), "median": med,
                          "max_over_median": float(a.max()) / max(med, 1e-30)}
        out[layer] = per
    return out


def _entropy_bits(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum()
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


@torch.no_grad()
def codebook_usage(qkv: dict[int, tuple[torch.Tensor, ...]], codebooks, score_tokens: int = 512) -> dict:
    """Key-codebook usage and error of ``codebooks`` (one method) on recorded ``qkv``.

    Returns ``{"per_layer": [...], "used", "entries", "used_fraction", "entropy_bits",
    "key_rel_mse", "score_rel_err", "score_rms", "counts"}``; the pooled numbers are means over
    layers (``counts``: per-layer usage counts ``[L, E]``). Score error uses the first
    ``score_tokens`` queries and keys of the text, causal pairs only, GQA as in the model."""
    from ..quant.codebook import decode, encode
    from ..quant.transform import expand_to_query_heads

    per_layer, all_counts = [], []
    for layer, (q, k, _) in qkv.items():
        lc = codebooks.layer(layer)
        cent = lc.key_centroids.float()
        kt = lc.transform.keys(k[None])  # [1, H, N, D]
        codes = encode(kt, cent)
        counts = torch.bincount(codes.reshape(-1).long(), minlength=cent.shape[0])
        k_hat = lc.transform.keys_inverse(decode(codes, cent))[0]
        rel_mse = float(((k - k_hat) ** 2).sum() / (k ** 2).sum().clamp_min(1e-30))
        n = min(score_tokens, k.shape[1])
        dk = expand_to_query_heads((k - k_hat)[:, :n], q.shape[0])
        kk = expand_to_query_heads(k[:, :n], q.shape[0])
        qq = q[:, :n]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        err = (qq @ dk.transpose(-1, -2))[:, causal]
        ref = (qq @ kk.transpose(-1, -2))[:, causal]
        d = q.shape[-1]
        per_layer.append({
            "layer": layer, "used": int((counts > 0).sum()), "entries": int(cent.shape[0]),
            "entropy_bits": _entropy_bits(counts), "key_rel_mse": rel_mse,
            "score_rel_err": float(err.norm() / ref.norm().clamp_min(1e-30)),
            "score_rms": float(err.pow(2).mean().sqrt() / math.sqrt(d)),
        })
        all_counts.append(counts)
    mean = lambda key: sum(r[key] for r in per_layer) / len(per_layer)  # noqa: E731
    entries = per_layer[0]["entries"]
    return {
        "method": codebooks.method, "bits": codebooks.bits, "entries": entries,
        "used": mean("used"), "used_fraction": mean("used") / entries,
        "entropy_bits": mean("entropy_bits"), "max_entropy_bits": math.log2(entries),
        "key_rel_mse": mean("key_rel_mse"), "score_rel_err": mean("score_rel_err"),
        "score_rms": mean("score_rms"), "per_layer": per_layer,
        "counts": torch.stack(all_counts),
    }


# -- plots -----------------------------------------------------------------------------------------
def _grid(n: int) -> tuple[int, int]:
    cols = min(3, n)
    return math.ceil(n / cols), cols


def plot_key_absmax(stats: dict, path: str | Path, *, num_kv_heads: int, title: str = "") -> Path:
    """One panel per layer: per-channel key absmax (log scale) before smoothing, after
    smoothing, after smoothing + Hadamard; KV heads side by side on the x axis."""
    from .plots import _pyplot

    plt = _pyplot()
    layers = sorted(stats)
    rows, cols = _grid(len(layers))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.0 * rows), squeeze=False, sharey=True)
    colors = {"raw": "tab:red", "smoothed": "tab:blue", "smoothed+hadamard": "tab:green"}
    for ax, layer in zip(axes.flat, layers):
        for stage in ("raw", "smoothed", "smoothed+hadamard"):
            s = stats[layer][stage]
            ax.plot(s["absmax"].numpy(), color=colors[stage], linewidth=0.8,
                    label=f"{STAGE_LABELS[stage]} (max/med {s['max_over_median']:.1f})")
        width = stats[layer]["raw"]["absmax"].numel() // num_kv_heads
        for h in range(1, num_kv_heads):
            ax.axvline(h * width, color="grey", linewidth=0.5, linestyle=":")
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}", fontsize=10)
        ax.set_xlabel("KV head x channel", fontsize=8)
        ax.legend(fontsize=6.5, loc="upper right")
        ax.grid(True, which="both", alpha=0.2)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    axes[0][0].set_ylabel("per-channel key |max| (log)")
    fig.suptitle(title or "key absmax per channel", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_codebook_usage(usage: dict[str, dict], path: str | Path, *, title: str = "") -> Path:
    """Three panels: rank-frequency of centroid usage (pooled over layers, log y), centroids used
    per layer, usage entropy per layer (dashed: log2(entries))."""
    from .plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    methods = list(usage)
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        u = usage[m]
        pooled = u["counts"].sum(0).double()
        freq = (pooled / pooled.sum()).sort(descending=True).values
        axes[0].plot(range(1, freq.numel() + 1), freq.numpy(), label=f"{m} ({u['used']:.0f}/{u['entries']} used, "
                     f"H={u['entropy_bits']:.2f} b)")
        layers = [r["layer"] for r in u["per_layer"]]
        xs = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(layers))]
        axes[1].bar(xs, [r["used"] for r in u["per_layer"]], width=width, label=m)
        axes[2].bar(xs, [r["entropy_bits"] for r in u["per_layer"]], width=width, label=m)
    entries = usage[methods[0]]["entries"]
    axes[0].set_yscale("log")
    axes[0].set_xlabel("centroid rank")
    axes[0].set_ylabel("share of key sub-vectors (log)")
    axes[0].set_title("centroid usage, pooled over layers", fontsize=10)
    axes[0].legend(fontsize=7)
    n_layers = len(usage[methods[0]]["per_layer"])
    for ax, what in ((axes[1], "centroids used"), (axes[2], "usage entropy (bits)")):
        ax.set_xticks(range(n_layers), [str(r["layer"]) for r in usage[methods[0]]["per_layer"]])
        ax.set_xlabel("layer")
        ax.set_title(what, fontsize=10)
        ax.legend(fontsize=7)
    axes[1].axhline(entries, color="black", linestyle="--", linewidth=1)
    axes[2].axhline(math.log2(entries), color="black", linestyle="--", linewidth=1)
    axes[1].set_ylim(0, entries * 1.08)
    axes[2].set_ylim(0, math.log2(entries) * 1.08)
    fig.suptitle(title or "key codebook usage on held-out text", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_dict(stats: dict, usage: dict[str, dict]) -> dict:
    """JSON-able summary (no tensors)."""
    layers = []
    for layer in sorted(stats):
        layers.append({"layer": layer, **{
            stage: {k: round(v, 4) for k, v in stats[layer][stage].items() if k != "absmax"}
            for stage in STAGES}})
    methods = {m: {k: (round(v, 6) if isinstance(v, float) else v) for k, v in u.items() if k != "counts"}
               for m, u in usage.items()}
    return {"key_absmax": layers, "codebook_usage": methods}


def format_summary(summary: dict) -> str:
    lines = ["key absmax max/median per layer (max over (head, channel) / median):", "",
             "| layer | before smoothing | after smoothing | smoothing + Hadamard | Hadamard only |",
             "|---:|---:|---:|---:|---:|"]
    for r in summary["key_absmax"]:
        cells = [f"{r[s]['max_over_median']:.2f} ({r[s]['max']:.2f}/{r[s]['median']:.2f})" for s in STAGES]
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + " |")
    if summary["codebook_usage"]:
        lines += ["", "key codebook usage on the text (means over layers):", "",
                  "| method | bits | centroids used | usage entropy (bits) | key rel. MSE | score rel. err "
                  "| score RMS (logits) |", "|---|---:|---:|---:|---:|---:|---:|"]
        for m, u in summary["codebook_usage"].items():
            lines.append(f"| {m} | {u['bits']:g} | {u['used']:.1f}/{u['entries']} | {u['entropy_bits']:.2f}/"
                         f"{u['max_entropy_bits']:.0f} | {u['key_rel_mse']:.4f} | {u['score_rel_err']:.4f} "
                         f"| {u['score_rms']:.4f} |")
    return "\n".join(lines)
