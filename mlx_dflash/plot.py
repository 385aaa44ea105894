"""The benchmarks' charts, drawn with matplotlib (the optional `bench` extra): the width benchmark's cost
curves with each cliff marked, grouped bar charts (end-to-end ratios, acceptance per draft position) and line
charts (training curves).

matplotlib is imported when a chart is drawn, never at module import, so the benchmarks still write their
JSON (and the cost table) where it is not installed; `charts_available()` says whether charts can be drawn.
"""

from __future__ import annotations

import io
import math

from .errors import DFlashError


def charts_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    if not charts_available():
        raise DFlashError("charts need matplotlib: pip install 'mlx-dflash[bench]'")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    # No software tag in the file: the same data gives the same bytes.
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def bar_chart_png(labels: list, series: dict, **kwargs) -> bytes:
    return _png(_pyplot(), bar_chart_figure(labels, series, **kwargs))


def line_chart_png(curves: dict, xlabel: str, ylabel: str) -> bytes:
    return _png(_pyplot(), line_chart_figure(curves, xlabel, ylabel))


def line_chart_figure(curves: dict, xlabel: str, ylabel: str):
    """One line with markers per curve, {label: (xs, ys)}: training runs' held-out tau against CPU-hours."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def widths_chart_png(results: dict) -> bytes:
    return _png(_pyplot(), widths_figure(results))


def bar_chart_figure(labels: list, series: dict, title: str = "", reference: float | None = None,
                     value_format: str = "{:.2f}", xlabel: str = ""):
    """Horizontal grouped bars: one row per label, one bar per series ({name: [value or None per label]}).
    A dashed vertical line marks `reference` (e.g. 1.0 for a ratio); each bar carries its value."""
    plt = _pyplot()
    names = list(series)
    height = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) * max(1, len(names) * 0.6) + 1.5))
    for j, name in enumerate(names):
        ys = [i + (j - (len(names) - 1) / 2) * height for i in range(len(labels))]
        vals = [v if v is not None and math.isfinite(v) else math.nan for v in series[name]]
        vals += [math.nan] * (len(labels) - len(vals))
        bars = ax.barh(ys, vals, height=height * 0.95, label=name)
        ax.bar_label(bars, labels=["" if math.isnan(v) else value_format.format(v) for v in vals],
                     padding=3, fontsize=8)
    if reference is not None:
        ax.axvline(reference, color="black", linestyle="--", linewidth=1, label=f"{reference:g} (reference)")
    ax.set_yticks(range(len(labels)), [str(x) for x in labels])
    ax.invert_yaxis()  # first label on top
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.margins(x=0.12)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def widths_figure(results: dict):
    """Median milliseconds per verify width for the verify and summed-matmul series of a width benchmark,
    a dotted line where each series' cliff starts; with two context lengths or more, beside it the best
    width against the context (widths.best_widths)."""
    plt = _pyplot()
    cols = [s for s in results["series"] if s["kind"] in ("verify", "matmul_total")]
    best = {a: row for a, row in (results.get("best_width_by_context") or {}).items() if len(row) > 1}
    if best:
        fig, (ax, side) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [9, 5]})
        for a, row in best.items():
            side.plot([int(c) for c in row], list(row.values()), marker="o", label=f"each draft kept at {a}")
        side.set_xscale("log", base=2)
        side.set_xlabel("context length (tokens in the KV cache)")
        side.set_ylabel("best verify width (most tokens per verify second)")
        side.set_title("Best width against context, from the verify costs", fontsize=10)
        side.grid(alpha=0.3)
        side.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(9, 5.2))
    for s in cols:
        ms = [t * 1e3 for t in s["median_seconds"]]
        label = s["name"].replace("matmul total", "quantized matmuls, summed").replace("verify ", "verify forward, ")
        label += f" (cliff at {s['cliff_width']})" if s["cliff_width"] else " (no cliff)"
        (line,) = ax.plot(s["widths"], ms, marker="o", markersize=4, label=label)
        if s["cliff_width"] is not None:
            ax.axvline(s["cliff_width"] - 0.5, color=line.get_color(), linestyle=":", linewidth=1.5)
            i = s["widths"].index(s["cliff_width"])
            ax.annotate(f"cliff: {s['widths'][i - 1]} -> {s['cliff_width']} rows", (s["cliff_width"], ms[i]),
                        textcoords="offset points", xytext=(6, -12), fontsize=8, color=line.get_color())
    widths = results["settings"]["widths"]
    ax.set_xticks(widths)
    ax.set_xlabel("verify width (rows: the anchor + drafted tokens)")
    ax.set_ylabel(f"median {results['settings']['clock']} time per call (ms)")
    ax.set_ylim(bottom=0)
    m = results["machine"]
    ax.set_title(f"Verify cost per width - {m.get('chip')} ({m['device']}), mlx {results['versions']['mlx']}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return fig
