"""`llmctl plot`: training curves of one or more runs, as an image or in the terminal.

What it is: panels in the spirit of llm.c's dev/vislog.ipynb, one per series any run has: train
loss (raw, faint, plus an EMA-smoothed line), val loss, HellaSwag acc_norm; runs overlaid in one
colour each, the legend naming the run; x = step, or tokens seen (step x tokens per step);
optional log-scale loss axes and dashed baselines (vislog draws OpenAI GPT-2's checkpoint numbers).
`make_figure` returns a matplotlib Figure (Agg, no pyplot state); `save_plot` writes PNG, SVG or
PDF by the file's extension; `terminal_panels` draws the same curves with llmctl/termchart.py.
What it is not: log parsing (llmctl/runlog.py). matplotlib is an optional dependency
(`pip install 'llmctl[plot]'`), imported only to write a file.
"""
import io
import os
from dataclasses import dataclass

import numpy as np

from llmctl.atomic import atomic_write
from llmctl.errors import ConfigError, DataError
from llmctl.paths import PLOT_OUTPUT
from llmctl.runlog import EMA_ALPHA, SERIES, SERIES_TITLES, ema, finite

DEFAULT_OUTPUT = PLOT_OUTPUT
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
X_AXES = ("step", "tokens")
LOSS_PANELS = ("train", "val")
PANEL_SIZE = (5.0, 3.8)  # inches per panel
DPI = 100
TERM_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_white")
MIN_TERM_WIDTH = 20
RAW_ALPHA = 0.25  # the raw train loss under its EMA line


@dataclass
class Baseline:
    panel: tuple  # the panels it is drawn on
    name: str
    value: float


def parse_baseline(text):
    """`[PANEL:]NAME=VALUE` -> Baseline. PANEL is train, val or hellaswag; without it the line
    goes on both loss panels (train and val)."""
    name, sep, value = text.rpartition("=")
    panel = LOSS_PANELS
    head, colon, rest = name.partition(":")
    if colon and head in SERIES:
        panel, name = (head,), rest
    try:
        v = float(value)
    except ValueError:
        v = float("nan")
    if not sep or not name or not np.isfinite(v):
        raise ConfigError(f"--baseline {text!r}: expected [PANEL:]NAME=VALUE with a number",
                          hint="e.g. --baseline 'hellaswag:GPT-2 124M=0.2955' or "
                               "--baseline 'GPT-2 124M=3.2924' (PANEL: train, val or hellaswag)")
    return Baseline(panel, name, v)


def panels_of(runs):
    """The panels to draw: each series some run has points for, in SERIES order."""
    return [k for k in SERIES if any(len(r.series[k]) for r in runs)]


def _tokens_per_step(run, tokens_per_step):
    tps = run.tokens_per_step or tokens_per_step
    if not tps:
        raise ConfigError(f"{run.path}: --x tokens needs the tokens per step, which a "
                          f"{run.kind} does not record",
                          hint="pass --tokens-per-step N (llm.c's -d total batch size, "
                               "B x T x grad accumulation x processes)")
    return tps


def check_x(x):
    """ConfigError unless --x is one of X_AXES."""
    if x not in X_AXES:
        raise ConfigError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}",
                          hint="step, or tokens for tokens seen (step x tokens per step)")


def curves(runs, x="step", tokens_per_step=None, smooth=EMA_ALPHA):
    """Per panel, per run: (run, xs, ys, ys_ema or None) with non-finite points left out.

    x: "step" or "tokens" (tokens seen before the step's update: step x tokens per step; a
    metrics.jsonl records it, a main.log needs tokens_per_step)."""
    check_x(x)
    out = {}
    for k in panels_of(runs):
        out[k] = []
        for r in runs:
            s = r.series[k]
            if not len(s):
                continue
            steps, ys = finite(s.step, s.value)
            xs = steps.astype(np.float64)
            if x == "tokens":
                xs = xs * _tokens_per_step(r, tokens_per_step)
            out[k].append((r, xs, ys, ema(ys, smooth) if k == "train" and smooth > 0 else None))
    return out


def _xlabel(x):
    return "tokens seen" if x == "tokens" else "step"


def make_figure(runs, x="step", logy=False, baselines=(), smooth=EMA_ALPHA, tokens_per_step=None,
                dpi=DPI):
    """A matplotlib Figure with one panel (Axes) per series present, labelled by series name
    (ax.get_label() is "train", "val" or "hellaswag"); size PANEL_SIZE per panel at `dpi`."""
    Figure = _matplotlib_figure()
    panels = curves(runs, x, tokens_per_step, smooth)
    if not panels:
        raise DataError("no run has any point to plot")
    w, h = PANEL_SIZE
    fig = Figure(figsize=(w * len(panels), h), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colors = {id(r): f"C{i % 10}" for i, r in enumerate(runs)}
    for ax, (k, items) in zip(axes, panels.items()):
        ax.set_label(k)
        for r, xs, ys, sm in items:
            c = colors[id(r)]
            if sm is not None:
                ax.plot(xs, ys, color=c, alpha=RAW_ALPHA, linewidth=0.8)
                ax.plot(xs, sm, color=c, linewidth=1.6, label=r.name)
            else:
                ax.plot(xs, ys, color=c, linewidth=1.6, marker="o" if len(xs) < 30 else None,
                        markersize=3, label=r.name)
        for i, b in enumerate(bl for bl in baselines if k in bl.panel):
            ax.axhline(b.value, color=("red", "green", "purple", "black")[i % 4], linestyle="--",
                       linewidth=1.0, label=f"{b.name} ({b.value:g})")
        if logy and k in LOSS_PANELS:
            from matplotlib.ticker import LogFormatter

            ax.set_yscale("log")  # plain numbers (3, 4) at the ticks, not 3x10^0
            ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        ax.set_title(SERIES_TITLES[k] + (" (EMA %g)" % smooth if k == "train" and smooth > 0 else ""))
        ax.set_xlabel(_xlabel(x))
        ax.set_ylabel("accuracy" if k == "hellaswag" else "loss")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def _matplotlib_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("writing an image needs matplotlib, which is not installed",
                          hint="`pip install matplotlib` (what the extra llmctl[plot] adds; it "
                               "rebuilds nothing), or draw in the terminal with "
                               "`llmctl plot --terminal`") from None
    return Figure


def output_format(path):
    """'png', 'svg' or 'pdf' from the file's extension (ConfigError otherwise)."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in FORMATS:
        raise ConfigError(f"{path}: unsupported image type {ext or '(no extension)'!r}",
                          hint="end the -o file name in .png, .svg or .pdf")
    return FORMATS[ext]


def save_plot(runs, out=DEFAULT_OUTPUT, **kw):
    """Draw make_figure(runs, **kw) into `out` (type from its extension), via a temp file and a
    rename; returns a JSON-ready summary (output, format, panels, runs)."""
    fmt = output_format(out)
    fig = make_figure(runs, **kw)
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    atomic_write(out, buf.getvalue())
    return {"output": os.fspath(out), "format": fmt, "panels": [ax.get_label() for ax in fig.axes],
            "runs": [r.summary() for r in runs]}


def terminal_panels(runs, width=80, height=14, x="step", logy=False, baselines=(),
                    smooth=EMA_ALPHA, tokens_per_step=None):
    """The same panels as make_figure drawn by llmctl/termchart.py: a list of rich Text blocks,
    each a chart of `height` x `width` cells followed by one legend line."""
    from rich.text import Text

    from llmctl.termchart import Curve, HLine, chart

    if width < MIN_TERM_WIDTH:
        raise ConfigError(f"--width {width}: a terminal chart needs at least {MIN_TERM_WIDTH} columns",
                          hint=f"pass --width {MIN_TERM_WIDTH} or more, or 0 for the terminal's width")
    panels = curves(runs, x, tokens_per_step, smooth)
    if not panels:
        raise DataError("no run has any point to plot")
    styles = {id(r): TERM_STYLES[i % len(TERM_STYLES)] for i, r in enumerate(runs)}
    xs_all = [xs for items in panels.values() for _, xs, _, _ in items if len(xs)]
    xrange = (min(a.min() for a in xs_all), max(a.max() for a in xs_all)) if xs_all else None
    blocks = []
    for k, items in panels.items():
        cs = []
        for r, xs, ys, sm in items:
            st = styles[id(r)]
            if sm is not None:
                cs.append(Curve(xs, ys, f"dim {st}", band=True))
                cs.append(Curve(xs, sm, f"bold {st}"))
            else:
                cs.append(Curve(xs, ys, f"bold {st}"))
        bls = [b for b in baselines if k in b.panel]
        title = (SERIES_TITLES[k] + (f" (EMA {smooth:g})" if k == "train" and smooth > 0 else "")
                 + f" vs {_xlabel(x)}" + (", log y" if logy and k in LOSS_PANELS else ""))
        t = chart(cs, width, height, logy=logy and k in LOSS_PANELS, title=title, xrange=xrange,
                  hlines=[HLine(b.value, "red") for b in bls])
        legend = Text(no_wrap=True, overflow="crop")
        for r, *_ in items:
            legend.append("■ ", style=f"bold {styles[id(r)]}")
            legend.append(f"{r.name}  ")
        for b in bls:
            legend.append("┄ ", style="red")
            legend.append(f"{b.name} ({b.value:g})  ")
        legend.rstrip()
        t.append("\n")
        t.append_text(legend)
        blocks.append(t)
    return blocks
