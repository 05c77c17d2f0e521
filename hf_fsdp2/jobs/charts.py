"""Charts of jobs and benchmarks with matplotlib (extra `hf_fsdp2[recipes]`): training curves, one panel per
series, and horizontal bar charts of ratios against a reference.

Figures are built with matplotlib's object API (no pyplot state), so charting from a training process
never opens a window or touches a global figure.
"""

from __future__ import annotations

from typing import Any

Point = tuple[float, float]


def _figure(rows: int, height_per_row: float, width: float = 7.0) -> Any:
    """An empty figure with `rows` stacked axes (matplotlib imported here: it is an optional extra)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("charts need matplotlib, an optional extra: pip install 'hf_fsdp2[recipes]'") from error
    figure = Figure(figsize=(width, height_per_row * rows), layout="constrained")
    return figure, figure.subplots(rows, 1, squeeze=False)[:, 0]


def line_chart(series: dict[str, list[Point]], x_label: str = "step") -> Any:
    """One panel per non-empty series, x shared; raise ValueError when every series is empty."""
    panels = [(name, points) for name, points in series.items() if points]
    if not panels:
        raise ValueError("nothing to plot: every series is empty.")
    figure, axes = _figure(len(panels), 2.4)
    for index, (ax, (name, points)) in enumerate(zip(axes, panels, strict=True)):
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="." if len(points) < 30 else None, color=f"C{index}", label=name)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    axes[-1].set_xlabel(x_label)
    return figure


def bar_chart(panels: dict[str, dict[str, float]], reference: float = 1.0) -> Any:
    """One panel of horizontal bars per title (bar name → value) with a dashed line at `reference`."""
    panels = {title: bars for title, bars in panels.items() if bars}
    if not panels:
        raise ValueError("nothing to plot: every panel is empty.")
    names = list(dict.fromkeys(name for bars in panels.values() for name in bars))  # one colour per name
    figure, axes = _figure(len(panels), 0.5 + 0.35 * max(len(b) for b in panels.values()), width=9.0)
    for ax, (title, bars) in zip(axes, panels.items(), strict=True):
        labels, values = list(bars), list(bars.values())
        ax.barh(labels, values, color=[f"C{names.index(n) % 10}" for n in labels])
        ax.axvline(reference, color="grey", linestyle="--", linewidth=1)
        for y, value in enumerate(values):
            ax.annotate(f"{value:.2f}×", (value, y), xytext=(4, 0), textcoords="offset points", va="center")
        ax.set_title(title, loc="left", fontsize="medium")
        ax.invert_yaxis()
        ax.set_xlim(0, max(max(values), reference) * 1.25)
    return figure


def line_chart_png(series: dict[str, list[Point]], path: str) -> None:
    """Write `line_chart(series)` as a PNG."""
    line_chart(series).savefig(path, dpi=100)


def bar_chart_png(panels: dict[str, dict[str, float]], path: str, reference: float = 1.0) -> None:
    """Write `bar_chart(panels, reference)` as a PNG."""
    bar_chart(panels, reference).savefig(path, dpi=100)
