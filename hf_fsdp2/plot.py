"""A dependency-free PNG line chart of training curves (matplotlib is not a dependency).

Each series is drawn in its own panel, stacked vertically, scaled to its own range; the caller prints
the legend (series names, ranges) beside the file.
"""

from __future__ import annotations

import struct
import zlib

Point = tuple[float, float]
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
WIDTH, PANEL, MARGIN = 640, 180, 24


def _png(pixels: list[bytearray], width: int) -> bytes:
    """Encode RGB rows as a PNG file."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, len(pixels), 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _line(pixels: list[bytearray], a: tuple[int, int], b: tuple[int, int], color: tuple[int, int, int]) -> None:
    """Draw a 2-pixel-wide line between two points (simple DDA)."""
    steps = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
    for i in range(steps + 1):
        x = round(a[0] + (b[0] - a[0]) * i / steps)
        y = round(a[1] + (b[1] - a[1]) * i / steps)
        for dy in (0, 1):
            if 0 <= y + dy < len(pixels) and 0 <= x < WIDTH:
                pixels[y + dy][3 * x : 3 * x + 3] = bytes(color)


def line_chart_png(series: dict[str, list[Point]], path: str) -> None:
    """Write one panel per non-empty series (x shared across panels) to `path`."""
    panels = [(name, points) for name, points in series.items() if points]
    if not panels:
        raise ValueError("nothing to plot: every series is empty.")
    xs = [x for _, points in panels for x, _ in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pixels = [bytearray(b"\xff" * 3 * WIDTH) for _ in range(PANEL * len(panels))]
    for index, (_, points) in enumerate(panels):
        top, bottom = index * PANEL + MARGIN // 2, (index + 1) * PANEL - MARGIN // 2
        ys = [y for _, y in points]
        y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
        grey = (200, 200, 200)
        _line(pixels, (MARGIN, bottom), (WIDTH - MARGIN, bottom), grey)
        _line(pixels, (MARGIN, top), (MARGIN, bottom), grey)

        def at(point: Point) -> tuple[int, int]:
            x = MARGIN + (point[0] - x0) / (x1 - x0) * (WIDTH - 2 * MARGIN)
            y = bottom - (point[1] - y0) / (y1 - y0) * (bottom - top)
            return round(x), round(y)

        color = COLORS[index % len(COLORS)]
        for a, b in zip(points, points[1:] or points):
            _line(pixels, at(a), at(b), color)
    with open(path, "wb") as f:
        f.write(_png(pixels, WIDTH))
