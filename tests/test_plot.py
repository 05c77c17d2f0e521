"""The dependency-free PNG charts decode as PNG, draw what they are given, and refuse empty input."""

from __future__ import annotations

import struct
import zlib

import pytest

from hf_fsdp2.pixel_font import GLYPHS, draw_text, text_width
from hf_fsdp2.plot import COLORS, bar_chart_png, line_chart_png


def decode(path) -> list[bytes]:
    """RGB rows of a PNG written by hf_fsdp2.plot (8-bit RGB, filter 0, one IDAT)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    start = data.index(b"IDAT") + 4
    raw = zlib.decompress(data[start : start + struct.unpack(">I", data[start - 8 : start - 4])[0]])
    return [raw[r * (3 * width + 1) + 1 : (r + 1) * (3 * width + 1)] for r in range(height)]


def count(rows: list[bytes], color: tuple[int, int, int]) -> int:
    return sum(row[i : i + 3] == bytes(color) for row in rows for i in range(0, len(row), 3))


def test_bar_lengths_follow_the_values_and_each_name_keeps_its_colour(tmp_path):
    path = tmp_path / "bars.png"
    bar_chart_png({"step time": {"a": 0.5, "b": 1.0}, "memory": {"b": 2.0}}, str(path))
    rows = decode(path)
    a, b = count(rows, COLORS[0]), count(rows, COLORS[1])
    # Same row height; in the first panel b's bar is twice a's (both panels share b's colour).
    assert a > 0 and b > 2 * a


def test_text_is_drawn_and_unknown_characters_are_boxes():
    pixels = [bytearray(b"\xff" * 3 * 40) for _ in range(8)]
    draw_text(pixels, 0, 0, "A~", (0, 0, 0))
    ink = sum(row[i : i + 3] == b"\x00\x00\x00" for row in pixels for i in range(0, len(row), 3))
    assert ink == sum(bin(bits).count("1") for bits in GLYPHS["A"]) + 20  # "~" has no glyph: a 5×7 outline box
    assert text_width("abc", scale=2) == 36


def test_line_chart_has_a_panel_per_series_and_empty_input_is_refused(tmp_path):
    line_chart_png({"loss": [(0, 3.0), (10, 1.0)], "eval": [(5, 2.0)], "empty": []}, str(tmp_path / "c.png"))
    assert len(decode(tmp_path / "c.png")) == 2 * 180
    with pytest.raises(ValueError, match="every series is empty"):
        line_chart_png({"loss": []}, str(tmp_path / "d.png"))
    with pytest.raises(ValueError, match="every panel is empty"):
        bar_chart_png({"x": {}}, str(tmp_path / "e.png"))
