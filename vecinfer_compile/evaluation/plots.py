"""Perplexity vs physical bits plot for the ablation, and what every figure of the package shares
(matplotlib is optional: ``pip install vecinfer_compile[plot]``).

Every figure is laid out by matplotlib's constrained layout (titles, axis labels, legends and
colorbars are fitted inside the canvas) and saved at the figure's own size; :func:`clipped_texts`
is the check the tests run on each one after drawing.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

# Distinct markers, one per method, so points that still sit close apart stay tellable without colour.
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h", "<", ">", "p")


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


def save_figure(fig, path: str | Path, *, dpi: int = 120) -> Path:
    """Save ``fig`` to ``path`` (parent folders created) and close it."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def wrap(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped (each of its lines) to about ``width_in`` inches at ``fontsize`` points
    (average glyph width ~0.55 em), so a long title breaks instead of running off the canvas."""
    chars = max(20, int(width_in * 72 / (0.55 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) if line else line for line in text.split("\n"))


def clipped_texts(fig, *, tol_px: float = 1.0) -> list[str]:
    """Visible, non-empty text artists of ``fig`` (titles, labels, tick labels, legend entries,
    annotations) whose drawn extent leaves the canvas, as ``"'text' at bbox"`` strings; draws the
    figure first. Empty when nothing is clipped."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    undrawn = set()  # tick labels of ticks outside the view limits: matplotlib keeps but never draws them
    axes = list(fig.axes)
    for ax in axes:  # secondary axes too: children of their parent, not in fig.axes
        axes.extend(getattr(ax, "child_axes", []))
    for ax in axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            eps = 1e-9 * (hi - lo) + 1e-12
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                loc = tick.get_loc()
                if loc is None or not lo - eps <= loc <= hi + eps:
                    undrawn.update((id(tick.label1), id(tick.label2)))
    out = []
    for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent")):
        if id(t) in undrawn or not t.get_visible() or not t.get_text().strip():
            continue
        try:
            e = t.get_window_extent(renderer)
        except Exception:  # an artist not drawn at all (e.g. an annotation clipped away)
            continue
        if e.width == 0 and e.height == 0:
            continue
        if e.x0 < box.x0 - tol_px or e.y0 < box.y0 - tol_px or e.x1 > box.x1 + tol_px or e.y1 > box.y1 + tol_px:
            out.append(
                f"{t.get_text()!r} at {tuple(round(v) for v in e.extents)} "
                f"(canvas {tuple(round(v) for v in box.extents)})"
            )
    return out


def _plain_log_labels(axis) -> None:
    """Tick labels of a log axis as plain numbers (``300``, ``1.5``, ``0.01``), not ``3x10^2`` or
    ``1e-02``; matplotlib still picks which minor ticks get a label."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):  # LogFormatter's number printer (1e-02 below 1)
            return f"{x:.6g}"

    axis.set_major_formatter(Plain(labelOnlyBase=False))
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _dodge(by_method: dict[str, list[dict]], methods: list[str]) -> dict[tuple[str, float], float]:
    """x offset per (method, physical bits): methods that share a physical-bits value are spread
    side by side around it (in method order), so equal or near-equal perplexities do not hide one
    another. The group is at most 0.7 of the smallest gap between distinct x values wide."""
    at: dict[float, list[str]] = {}
    for m in methods:
        for r in by_method[m]:
            at.setdefault(float(r["physical_bits_per_element"]), []).append(m)
    xs = sorted(at)
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    width = 0.7 * min(gaps) if gaps else 0.5
    out = {}
    for x, ms in at.items():
        n = len(ms)
        step = min(0.09, width / max(n - 1, 1))
        for i, m in enumerate(ms):
            out[(m, x)] = (i - (n - 1) / 2) * step
    return out


def ppl_vs_bits_figure(rows, *, title: str | None = None):
    """The figure of :func:`plot_ppl_vs_bits` (not saved; the caller owns it)."""
    plt = _pyplot()
    rows = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    methods = [m for m in by_method if m != "fp16"]
    fig, ax = plt.subplots(figsize=(10.0, 5.0), layout="constrained")
    ref = by_method["fp16"][0]["ppl"] if "fp16" in by_method else None
    if ref is not None:
        ax.axhline(
            ref, color="black", linestyle="--", linewidth=1, label=f"{by_method['fp16'][0]['label']} ({ref:.4g})"
        )
    offsets = _dodge(by_method, methods)
    for i, method in enumerate(methods):
        rs = sorted(by_method[method], key=lambda r: r["physical_bits_per_element"])
        xs = [r["physical_bits_per_element"] + offsets[(method, float(r["physical_bits_per_element"]))] for r in rs]
        ys = [r["ppl"] for r in rs]
        (line,) = ax.plot(
            xs,
            ys,
            marker=MARKERS[i % len(MARKERS)],
            markersize=6,
            linewidth=1.3,
            markeredgecolor="white",
            markeredgewidth=0.6,
            label=rs[0]["label"],
        )
        line.set_gid(f"method:{method}")  # the tests find each method's points by this id
        for x, y, r in zip(xs, ys, rs):
            if r["nominal_bits"] != r["physical_bits_per_element"]:
                ax.annotate(
                    f"{r['nominal_bits']:g}-bit nominal",
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 7),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color=line.get_color(),
                )
    ax.set_yscale("log")
    _plain_log_labels(ax.yaxis)
    ax.margins(x=0.06, y=0.08)
    ax.set_xlabel(
        "physical bits per element, as stored (labels: nominal bits where they differ;\n"
        "points at the same bits are spread sideways to stay visible)"
    )
    ax.set_ylabel("perplexity (log scale, lower is better)")
    if ref is not None:
        from matplotlib.ticker import FixedLocator, NullLocator

        sec = ax.secondary_yaxis("right", functions=(lambda y: y / ref, lambda r: r * ref))
        top = max([ref] + [r["ppl"] for r in rows]) / ref
        ratios = (
            (0.8, 0.9, 0.95, 0.98, 1, 1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5)
            if top <= 1.5
            else (0.5, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100, 1000)
        )
        sec.yaxis.set_major_locator(FixedLocator(ratios))
        sec.yaxis.set_minor_locator(NullLocator())
        _plain_log_labels(sec.yaxis)
        sec.set_ylabel("x full precision")
    if title:
        fig.suptitle(wrap(title, 9.5, 12), fontsize=12)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.12, 1.0), borderaxespad=0, fontsize=9)
    return fig


def plot_ppl_vs_bits(rows, path: str | Path, *, title: str | None = None) -> Path:
    """One line per method of perplexity (log scale) against PHYSICAL bits per element (codes plus
    KIVI's scales, as stored), so methods at matched memory line up vertically (spread a little
    sideways, with a marker per method, so that equal perplexities stay visible); a point whose
    nominal bits differ (KIVI's scales) is labelled with them; full precision as a dashed horizontal
    reference and the right axis as the ratio to it; the legend outside the plot. ``rows``:
    :class:`~.ablation.Row` objects or dicts."""
    return save_figure(ppl_vs_bits_figure(rows, title=title), path, dpi=120)
