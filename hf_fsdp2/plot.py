"""Dependency-free PNG charts (matplotlib is not a dependency): training curves, one panel per series, and
horizontal bar charts of benchmark ratios. Titles, names and values are drawn with `pixel_font`.
"""

from __future__ import annotations

import struct
import zlib

from .pixel_font import HEIGHT, draw_text, text_width

Point = tuple[float, float]
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75))
WIDTH, PANEL, MARGIN = 640, 180, 24
INK, GREY = (40, 40, 40), (200, 200, 200)


def _png(pixels: list[bytearray], width: int) -> bytes:
    """Encode RGB rows as a PNG file."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, len(pixels), 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _line(pixels: list[bytearray], a: tuple[int, int], b: tuple[int, int], color: tuple[int, int, int]) -> None:
    """Draw a 2-pixel-wide line between two points (simple DDA)."""
    width = len(pixels[0]) // 3
    steps = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
    for i in range(steps + 1):
        x = round(a[0] + (b[0] - a[0]) * i / steps)
        y = round(a[1] + (b[1] - a[1]) * i / steps)
        for dy in (0, 1):
            if 0 <= y + dy < len(pixels) and 0 <= x < width:
                pixels[y + dy][3 * x : 3 * x + 3] = bytes(color)


def _fill(pixels: list[bytearray], left: int, top: int, right: int, bottom: int, color: tuple[int, int, int]) -> None:
    """Fill a rectangle (right and bottom exclusive)."""
    for y in range(max(top, 0), min(bottom, len(pixels))):
        pixels[y][3 * left : 3 * right] = bytes(color) * (right - left)


def _number(value: float) -> str:
    """A short label for an axis or bar value."""
    return f"{value:.3g}"


def line_chart_png(series: dict[str, list[Point]], path: str) -> None:
    """Write one panel per non-empty series (x shared across panels) to `path`."""
    panels = [(name, points) for name, points in series.items() if points]
    if not panels:
        raise ValueError("nothing to plot: every series is empty.")
    xs = [x for _, points in panels for x, _ in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pixels = [bytearray(b"\xff" * 3 * WIDTH) for _ in range(PANEL * len(panels))]
    for index, (name, points) in enumerate(panels):
        top, bottom = index * PANEL + MARGIN // 2, (index + 1) * PANEL - MARGIN // 2
        ys = [y for _, y in points]
        y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
        _line(pixels, (MARGIN, bottom), (WIDTH - MARGIN, bottom), GREY)
        _line(pixels, (MARGIN, top), (MARGIN, bottom), GREY)
        draw_text(pixels, MARGIN + 6, top, f"{name}: {_number(y0)} to {_number(y1)}", INK)
        x_range = f"x {_number(x0)} to {_number(x1)}"
        draw_text(pixels, WIDTH - MARGIN - text_width(x_range), bottom - HEIGHT - 4, x_range, INK)

        def at(point: Point) -> tuple[int, int]:
            x = MARGIN + (point[0] - x0) / (x1 - x0) * (WIDTH - 2 * MARGIN)
            y = bottom - (point[1] - y0) / (y1 - y0) * (bottom - top)
            return round(x), round(y)

        color = COLORS[index % len(COLORS)]
        for a, b in zip(points, points[1:] or points):
            _line(pixels, at(a), at(b), color)
    with open(path, "wb") as f:
        f.write(_png(pixels, WIDTH))


def bar_chart_png(panels: dict[str, dict[str, float]], path: str, reference: float = 1.0) -> None:
    """Write one panel of horizontal bars per title (bar name → value), with a marker line at `reference`."""
    panels = {title: bars for title, bars in panels.items() if bars}
    if not panels:
        raise ValueError("nothing to plot: every panel is empty.")
    scale, row = 2, 22
    names = list(dict.fromkeys(name for bars in panels.values() for name in bars))  # one colour per name
    label_w = max(text_width(name, scale) for bars in panels.values() for name in bars) + 16
    width = 900
    heights = [2 * row + row * len(bars) for bars in panels.values()]
    pixels = [bytearray(b"\xff" * 3 * width) for _ in range(sum(heights))]
    top = 0
    for (title, bars), height in zip(panels.items(), heights):
        draw_text(pixels, 8, top + 8, title, INK, scale)
        span = max(max(bars.values()), reference) * 1.25
        bar_w = width - label_w - 16

        def x_of(value: float) -> int:
            return label_w + round(max(value, 0.0) / span * bar_w)

        _line(pixels, (x_of(reference), top + 2 * row - 4), (x_of(reference), top + height - 4), GREY)
        for index, (name, value) in enumerate(bars.items()):
            y = top + 2 * row + index * row
            draw_text(pixels, 8, y + 2, name, INK, scale)
            _fill(pixels, label_w, y, max(x_of(value), label_w + 1), y + row - 4, COLORS[names.index(name) % len(COLORS)])
            draw_text(pixels, x_of(value) + 6, y + 2, f"{_number(value)}×", INK, scale)
        top += height
    with open(path, "wb") as f:
        f.write(_png(pixels, width))
