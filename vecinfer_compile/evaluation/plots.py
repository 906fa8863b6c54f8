"""Perplexity vs physical bits plot for the ablation (matplotlib is optional: ``pip install
vecinfer_compile[plot]``)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'vecinfer_compile[plot]')"
        ) from None
    return plt


def plot_ppl_vs_bits(rows, path: str | Path, *, title: str | None = None) -> Path:
    """One line per method of perplexity (log scale) against PHYSICAL bits per element (codes plus
    KIVI's scales, as stored), so methods at matched memory line up vertically; a point whose
    nominal bits differ (KIVI's scales) is labelled with them; fp16 as a dashed horizontal
    reference. ``rows``:
    :class:`~.ablation.Row` objects or dicts."""
    plt = _pyplot()
    rows = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    for method, rs in by_method.items():
        if method == "fp16":
            ax.axhline(rs[0]["ppl"], color="black", linestyle="--", linewidth=1, label=f"{rs[0]['label']}")
            continue
        rs = sorted(rs, key=lambda r: r["physical_bits_per_element"])
        xs, ys = [r["physical_bits_per_element"] for r in rs], [r["ppl"] for r in rs]
        (line,) = ax.plot(xs, ys, marker="o", label=rs[0]["label"])
        for x, y, r in zip(xs, ys, rs):
            if r["nominal_bits"] != x:
                ax.annotate(f"{r['nominal_bits']:g}-bit", (x, y), textcoords="offset points", xytext=(4, 5),
                            fontsize=8, color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("physical bits per element, as stored (labels: nominal bits where they differ)")
    ax.set_ylabel("perplexity (log scale)")
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
