"""Dependency-free PNG charts for the benchmarks: a 3x5 pixel font, lines, a PNG encoder, a bar chart,
the width benchmark's cost curves.

No plotting library is needed (the benchmarks run on bare CI machines); images are numpy RGB arrays.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

# 3x5 pixel font: a character, then its 5 rows as octal digits (4 = left pixel, 1 = right pixel).
_FONT_SRC = ("075557126227271747371317455711574717674757771122875757975717A25755B65656C34443D65556E74647"
             "F74644G34553H55755I72227J11152K55655L44447M57755N65555O25552P65644Q25563R65655S34216T72222"
             "U55557V55552W55775X55255Y55222Z71247 00000.00002-00700=07070:02020(12221)42224/11244,00024")
_FONT = {_FONT_SRC[i]: [int(c, 8) for c in _FONT_SRC[i + 1:i + 6]] for i in range(0, len(_FONT_SRC), 6)}
_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _text(img, x: int, y: int, s: str, color, scale: int = 2) -> None:
    for ch in s.upper():
        for r, bits in enumerate(_FONT.get(ch, [0] * 5)):
            for c in range(3):
                if bits & (4 >> c):
                    img[y + r * scale:y + (r + 1) * scale, x + c * scale:x + (c + 1) * scale] = color
        x += 4 * scale


def _line(img, x0, y0, x1, y1, color, thick: int = 1, dash: int = 0) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for i, (x, y) in enumerate(zip(np.linspace(x0, x1, n), np.linspace(y0, y1, n))):
        if dash and (i // dash) % 2:
            continue
        xi, yi = int(round(x)), int(round(y))
        img[max(yi - thick // 2, 0):yi + thick - thick // 2, max(xi - thick // 2, 0):xi + thick - thick // 2] = color


def png_bytes(img: np.ndarray) -> bytes:
    """An RGB uint8 image (H, W, 3) as PNG file bytes."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _nice_step(top: float, ticks: int = 6) -> float:
    top = top if top > 0 else 1.0
    return next(m * 10 ** e for e in range(-6, 12) for m in (1, 2, 5) if top / (m * 10 ** e) <= ticks)


def bar_chart_png(labels: list, series: dict, title: str = "", reference: float | None = None,
                  value_format: str = "{:.2f}", width: int = 860) -> bytes:
    """Horizontal grouped bars: one row per label, one bar per series ({name: [value or None per label]}).

    A dashed vertical line marks `reference` (e.g. 1.0 for a ratio); each bar carries its value.
    """
    names = list(series)[:len(_COLORS)]
    bar, gap = 12, 10
    row = bar * len(names) + gap
    L = 16 + 8 * max([len(str(s)) for s in labels] + [1])
    R, T, B = 70, 34 + 16 * len(names), 30
    H = T + row * len(labels) + B
    img = np.full((H, width, 3), 255, np.uint8)
    values = [v for n in names for v in series[n] if v is not None and math.isfinite(v)]
    top = max(values + [reference or 0.0, 1e-12])
    step = _nice_step(top)
    xmax = step * math.ceil(top / step)
    px = lambda v: L + max(v, 0.0) / xmax * (width - L - R)  # noqa: E731
    for k in range(int(round(xmax / step)) + 1):
        x = px(k * step)
        _line(img, x, T - 4, x, H - B, (225, 225, 225))
        label = f"{k * step:.4g}"
        _text(img, int(x) - 4 * len(label), H - B + 8, label, (0, 0, 0))
    for i, lab in enumerate(labels):
        y0 = T + i * row
        _text(img, 8, y0 + (row - gap) // 2 - 5, str(lab), (0, 0, 0))
        for j, n in enumerate(names):
            v = series[n][i] if i < len(series[n]) else None
            if v is None or not math.isfinite(v):
                continue
            y = y0 + j * bar
            img[y + 1:y + bar - 1, L:int(px(v)) + 1] = _COLORS[j]
            _text(img, int(px(v)) + 4, y + 1, value_format.format(v), (0, 0, 0), scale=2)
    if reference is not None:
        _line(img, px(reference), T - 4, px(reference), H - B, (0, 0, 0), thick=1, dash=4)
    _line(img, L, T - 4, L, H - B, (0, 0, 0))
    _line(img, L, H - B, width - R, H - B, (0, 0, 0))
    _text(img, 4, 4, title[:(width - 8) // 8], (0, 0, 0))
    for j, n in enumerate(names):
        img[22 + 16 * j:30 + 16 * j, L:L + 12] = _COLORS[j]
        _text(img, L + 18, 21 + 16 * j, str(n), _COLORS[j])
    return png_bytes(img)


def widths_chart_png(results: dict, size=(760, 460)) -> bytes:
    """Median ms per width of the verify and summed-matmul series; a dashed line before each cliff."""
    cols = [s for s in results["series"] if s["kind"] in ("verify", "matmul_total")][:len(_COLORS)]
    W, H = size
    L, R, T, B = 70, 20, 40, 50
    img = np.full((H, W, 3), 255, np.uint8)
    widths = results["settings"]["widths"]
    top = max(max(s["median_seconds"]) for s in cols) * 1e3
    step = _nice_step(top)
    ymax = step * math.ceil(top / step)
    px = lambda w: L + (w - widths[0]) / max(widths[-1] - widths[0], 1) * (W - L - R)  # noqa: E731
    py = lambda ms: H - B - ms / ymax * (H - T - B)  # noqa: E731
    for k in range(int(round(ymax / step)) + 1):
        y = py(k * step)
        _line(img, L, y, W - R, y, (225, 225, 225))
        label = f"{k * step:.4g}"
        _text(img, L - 8 - 8 * len(label), int(y) - 5, label, (0, 0, 0))
    for w in widths:
        _line(img, px(w), H - B, px(w), H - B + 4, (0, 0, 0))
        _text(img, int(px(w)) - 4 * len(str(w)), H - B + 8, str(w), (0, 0, 0))
    _line(img, L, T, L, H - B, (0, 0, 0))
    _line(img, L, H - B, W - R, H - B, (0, 0, 0))
    _text(img, W // 2 - 60, H - 18, "WIDTH (ROWS)", (0, 0, 0))
    title = f"MS ({results['settings']['clock']} TIME) PER VERIFY / SUM OF MATMULS - {results['machine'].get('chip')}"
    _text(img, 4, 4, title[:88], (0, 0, 0))
    for j, s in enumerate(cols):
        color = _COLORS[j]
        pts = [(px(w), py(t * 1e3)) for w, t in zip(s["widths"], s["median_seconds"])]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            _line(img, x0, y0, x1, y1, color, thick=2)
        for x, y in pts:
            img[int(y) - 2:int(y) + 3, int(x) - 2:int(x) + 3] = color
        if s["cliff_width"] is not None:
            i = s["widths"].index(s["cliff_width"])
            xc = (pts[i][0] + pts[i - 1][0]) / 2
            _line(img, xc, T, xc, H - B, color, thick=1, dash=4)
        label = s["name"].replace("matmul total", "qmm sum") + (
            f": CLIFF AT {s['cliff_width']}" if s["cliff_width"] else ": NO CLIFF")
        img[T + 6 + 16 * j:T + 14 + 16 * j, L + 10:L + 22] = color
        _text(img, L + 28, T + 5 + 16 * j, label, color)
    return png_bytes(img)
