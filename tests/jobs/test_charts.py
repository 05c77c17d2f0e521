"""The matplotlib charts draw what they are given, with labels, and refuse empty input."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from hf_fsdp2.jobs.charts import bar_chart, bar_chart_png, line_chart, line_chart_png  # noqa: E402


def test_line_chart_has_a_labelled_panel_per_series_and_writes_a_png(tmp_path):
    figure = line_chart({"loss": [(0, 3.0), (10, 1.0)], "eval": [(5, 2.0)], "empty": []})
    axes = figure.axes
    assert [ax.get_ylabel() for ax in axes] == ["loss", "eval"]
    assert axes[-1].get_xlabel() == "step"
    assert list(axes[0].lines[0].get_ydata()) == [3.0, 1.0]
    line_chart_png({"loss": [(0, 3.0), (10, 1.0)]}, str(tmp_path / "c.png"))
    pixels = imread(tmp_path / "c.png")
    assert pixels.shape[0] > 100 and pixels.shape[1] > 300 and pixels.min() < 0.5  # drawn, not blank


def test_bar_lengths_follow_the_values_and_each_name_keeps_its_colour(tmp_path):
    figure = bar_chart({"step time": {"a": 0.5, "b": 1.0}, "memory": {"b": 2.0}})
    first, second = figure.axes
    widths = [patch.get_width() for patch in first.patches]
    assert widths == [0.5, 1.0]
    assert first.patches[1].get_facecolor() == second.patches[0].get_facecolor(), "b keeps its colour"
    assert first.get_title(loc="left") == "step time"
    bar_chart_png({"x": {"a": 1.0}}, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_empty_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="every series is empty"):
        line_chart_png({"loss": []}, str(tmp_path / "d.png"))
    with pytest.raises(ValueError, match="every panel is empty"):
        bar_chart_png({"x": {}}, str(tmp_path / "e.png"))
