"""Line charts drawn with Unicode braille characters, for terminals (no matplotlib).

What it is: `chart(curves, width, height)` returns a rich `Text` of exactly `height` lines of
exactly `width` cells: an optional title line, the plot rows with y labels on the left, an axis
line and a line of x labels. Each character cell holds a 2x4 grid of braille dots, so a 60x10
chart has 116x32 dot resolution; a cell takes the style of the last curve drawn through it.
Curves are binned to one point per dot column first, so drawing costs O(points + width) and a
live chart can be redrawn every step. `band=True` draws each column's min..max span (raw, noisy
train loss) instead of its mean. Used by `llmctl plot --terminal` and the live train panel.
What it is not: a general plotting library (linear x, linear or log y, one chart at a time).
"""
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from rich.text import Text

# bit of the dot at (row 0..3, column 0..1) in a braille cell (U+2800 + bits)
_DOT = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))
_BLANK = 0x2800


@dataclass
class Curve:
    x: Sequence[float]
    y: Sequence[float]
    style: str = ""
    band: bool = False  # draw each dot column's min..max (noisy raw data), not the mean line


@dataclass
class HLine:
    y: float
    style: str = "red"


class _Canvas:
    def __init__(self, cols, rows):
        self.W, self.H = 2 * cols, 4 * rows
        self.bits = np.zeros((rows, cols), dtype=np.int64)
        self.style = [[None] * cols for _ in range(rows)]

    def dot(self, x, y, style):
        if 0 <= x < self.W and 0 <= y < self.H:
            r, c = y // 4, x // 2
            self.bits[r, c] |= _DOT[y % 4][x % 2]
            self.style[r][c] = style

    def vline(self, x, y0, y1, style):
        for y in range(min(y0, y1), max(y0, y1) + 1):
            self.dot(x, y, style)

    def line(self, x0, y0, x1, y1, style):
        # Bresenham: every dot column and row between the ends gets a dot
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, style)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy


def _bins(px, py):
    """Per distinct dot column (px sorted): the column, mean, min and max of py."""
    cols, start = np.unique(px, return_index=True)
    counts = np.diff(np.append(start, len(px)))
    mean = np.add.reduceat(py, start) / counts
    return cols, mean, np.minimum.reduceat(py, start), np.maximum.reduceat(py, start)


def fmt_num(v):
    """A short axis label: 4 significant digits; k/M/B/T from 10,000 up."""
    a = abs(v)
    if a >= 1e4:
        for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
            if a >= div:
                return f"{v / div:.3g}{suf}"
    if a >= 100 or (a >= 1 and v == int(v)):
        return f"{v:.0f}"
    return f"{v:.4g}" if a >= 0.01 or a == 0 else f"{v:.1e}"


def _range(lo, hi):
    if not np.isfinite(lo):
        return 0.0, 1.0
    if hi > lo:
        return lo, hi
    pad = abs(lo) * 0.05 or 1.0
    return lo - pad, hi + pad


def chart(curves, width=60, height=10, logy=False, hlines=(), title: Optional[str] = None,
          xrange=None):
    """Draw `curves` (Curve) and `hlines` (HLine) into a Text of `height` x `width` cells.

    logy: log10 y axis (non-positive values are left out). xrange: (lo, hi) to fix the x axis
    (default: the data's extent). Non-finite points are left out. Needs width >= 12, height >= 4
    (5 with a title).
    """
    rows = height - 2 - (title is not None)
    if width < 12 or rows < 2:
        raise ValueError(f"chart of {width}x{height} cells is too small")
    pts, hl = _finite_points(curves, hlines, logy)
    box = _extent(pts, hl, xrange)
    ylabels = _y_labels(box[2], box[3], rows, logy)
    gutter = max(len(s) for s in ylabels.values()) + 1
    cv = _Canvas(width - gutter - 1, rows)
    _draw(cv, pts, hl, box)
    return _render(cv, ylabels, gutter, width, title, box[0], box[1])


def _to_y(y, logy):
    """y as plotted: log10 y on a log axis (NaN where y <= 0)."""
    y = np.asarray(y, dtype=np.float64)
    if logy:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan)
    return y


def _finite_points(curves, hlines, logy):
    """Per curve (x, y as plotted, curve) without non-finite points; [(y, hline)] likewise."""
    pts = []
    for c in curves:
        x, y = np.asarray(c.x, dtype=np.float64), _to_y(c.y, logy)
        ok = np.isfinite(x) & np.isfinite(y)
        pts.append((x[ok], y[ok], c))
    hl = [(float(_to_y([h.y], logy)[0]), h) for h in hlines]
    return pts, [(y, h) for y, h in hl if np.isfinite(y)]


def _extent(pts, hl, xrange):
    """(x0, x1, y0, y1): the axes' ranges over every point and line (x: xrange if given)."""
    allx = np.concatenate([p[0] for p in pts] + [np.zeros(0)])
    ally = np.concatenate([p[1] for p in pts] + [np.array([y for y, _ in hl])])
    x0, x1 = _range(*(xrange or ((allx.min(), allx.max()) if len(allx) else (np.nan, np.nan))))
    y0, y1 = _range(*((ally.min(), ally.max()) if len(ally) else (np.nan, np.nan)))
    return x0, x1, y0, y1


def _y_labels(y0, y1, rows, logy):
    """{row: label}: the top and bottom rows, and the middle one from 5 rows up."""
    def label(v):
        return fmt_num(10 ** v if logy else v)

    ylabels = {0: label(y1), rows - 1: label(y0)}
    if rows >= 5:
        ylabels[(rows - 1) // 2] = label(y1 - (y1 - y0) * ((rows - 1) // 2) / (rows - 1))
    return ylabels


def _draw(cv, pts, hl, box):
    """The dotted horizontal lines, then each curve (band and mean line per dot column)."""
    x0, x1, y0, y1 = box

    def to_py(y):
        return (y1 - y) / (y1 - y0) * (cv.H - 1)

    for y, h in hl:
        py = int(round(to_py(y)))
        for x in range(0, cv.W, 3):
            cv.dot(x, py, h.style)
    for x, y, c in pts:
        if not len(x):
            continue
        order = np.argsort(x, kind="stable")
        px = np.rint((x[order] - x0) / (x1 - x0) * (cv.W - 1)).astype(np.int64)
        py = to_py(y[order])
        keep = (px >= 0) & (px < cv.W)
        if keep.any():
            _draw_curve(cv, *_bins(px[keep], py[keep]), c)


def _draw_curve(cv, bx, mean, lo, hi, c):
    """One binned curve: its min..max span per column if c.band, then the line through the means."""
    mean = np.rint(mean).astype(np.int64)
    if c.band:
        for i, xx in enumerate(bx):
            cv.vline(int(xx), int(round(lo[i])), int(round(hi[i])), c.style)
    for i in range(len(bx)):
        if i == 0:
            cv.dot(int(bx[0]), int(mean[0]), c.style)
        else:
            cv.line(int(bx[i - 1]), int(mean[i - 1]), int(bx[i]), int(mean[i]), c.style)


def _render(cv, ylabels, gutter, width, title, x0, x1):
    """The canvas as Text: title, rows with their y labels, the axis, the x labels."""
    rows, cols = cv.bits.shape
    out = Text(no_wrap=True, overflow="crop")
    if title is not None:
        out.append(title[:width].ljust(width), style="bold")
        out.append("\n")
    for r in range(rows):
        out.append(ylabels.get(r, "").rjust(gutter - 1) + " ", style="dim")
        out.append("┤" if r in ylabels else "│", style="dim")
        _append_row(out, cv, r)
        out.append("\n")
    out.append(" " * gutter + "└" + "─" * cols, style="dim")
    out.append("\n")
    xl, xr = fmt_num(x0), fmt_num(x1)
    out.append((" " * (gutter + 1) + xl + xr.rjust(cols - len(xl))).ljust(width)[:width], style="dim")
    return out


def _append_row(out, cv, r):
    """Canvas row r's braille characters, one append per run of one style."""
    run, run_style = [], None
    for c in range(cv.bits.shape[1]):
        ch, st = chr(_BLANK + int(cv.bits[r, c])), cv.style[r][c]
        if st != run_style and run:
            out.append("".join(run), style=run_style or "")
            run = []
        run.append(ch)
        run_style = st
    out.append("".join(run), style=run_style or "")
