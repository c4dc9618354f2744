"""How `llmctl train` shows progress: a rich live panel, plain lines, JSON lines, or nothing.

What it is: four interchangeable sinks for the training loop's events (start, val, sample,
checkpoint, step, message, finish). `make_display()` picks one: `--json` -> JSON lines on stdout;
stderr is a terminal -> a rich live panel (progress bar with ETA, loss, val loss, lr, grad norm,
ms/step, tokens/s, MFU, and a braille chart of train loss (raw + EMA) and val loss that grows each
step, drawn by llmctl/termchart.py as `llmctl plot --terminal` draws it; samples printed above it
as text); otherwise plain lines in the spirit of
llm.c's `step %4d/%d | loss ...` prints. `Display` itself ignores everything (library callers).
What it is not: the log files (main.log and metrics.jsonl are written by llmctl/train.py whatever
the display) or any part of the training logic. A display never raises into the loop.
"""
import json
import math
import sys


def _fmt(x, spec, missing="-"):
    return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


class Display:
    """The do-nothing display; subclasses override what they show."""

    def start(self, info):
        """info: dict with at least num_steps, start_step, num_parameters, B, T, grad_accum_steps."""

    def val(self, step, val_loss):
        pass

    def sample(self, step, text):
        pass

    def checkpoint(self, step, path):
        pass

    def step(self, rec):
        """rec: step, num_steps, train_loss, lr, grad_norm, ms, tokens_per_s, mfu (+ val_loss;
        with -sl/-sg also loss_z, grad_z (None while the window fills) and skipped)."""

    def message(self, text):
        pass

    def finish(self, summary):
        pass


class PlainDisplay(Display):
    """Plain lines on a stream (stderr by default): what you see in a log file or CI."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.mfu_roof = "fp32"   # the precision of the GEMM roof MFU is over (start's info)

    def _print(self, s):
        try:
            self.stream.write(s + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def start(self, info):
        self.mfu_roof = info.get("mfu_roof", "fp32")
        for k, v in info.items():
            self._print(f"| {k:<22} | {v!s:<50} |")

    def val(self, step, val_loss):
        self._print(f"val loss {val_loss:.6f}")

    def sample(self, step, text):
        self._print(f"generating:\n---\n{text}\n---")

    def checkpoint(self, step, path):
        self._print(f"Writing checkpoint at step {step}: {path}")

    def step(self, rec):
        # with -sl/-sg, llm.c's `loss %7.6f (%+.2fz)| norm %6.4f (%+.2fz)|` (nan while filling)
        zl = f" ({_z(rec['loss_z'])}z)" if "loss_z" in rec else ""
        zg = f" ({_z(rec['grad_z'])}z)" if "grad_z" in rec else ""
        self._print(
            f"step {rec['step'] + 1:4d}/{rec['num_steps']} | loss {rec['train_loss']:.6f}{zl} | "
            f"norm {rec['grad_norm']:6.4f}{zg} | lr {rec['lr']:.2e} | {rec['ms']:.2f} ms | "
            f"{100 * _nz(rec.get('mfu')):.1f}% {self.mfu_roof} MFU | {rec['tokens_per_s']:.0f} tok/s"
            + (" | update skipped" if rec.get("skipped") else ""))

    def message(self, text):
        self._print(text)

    def finish(self, summary):
        if summary.get("avg_ms") is not None:
            self._print(f"total average iteration time: {summary['avg_ms']:.3f} ms")


def _nz(x):
    return 0.0 if x is None else x


def _z(x):
    return "+nan" if x is None else f"{x:+.2f}"


class JsonDisplay(Display):
    """One JSON object per event on stdout (machine output only; nothing else goes there)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def _emit(self, obj):
        try:
            self.stream.write(json.dumps(obj) + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def start(self, info):
        self._emit({"event": "start", **info})

    def val(self, step, val_loss):
        self._emit({"event": "val", "step": step, "val_loss": val_loss})

    def sample(self, step, text):
        self._emit({"event": "sample", "step": step, "text": text})

    def checkpoint(self, step, path):
        self._emit({"event": "checkpoint", "step": step, "path": path})

    def step(self, rec):
        self._emit({"event": "step", **rec})

    def message(self, text):
        self._emit({"event": "message", "text": text})

    def finish(self, summary):
        self._emit({"event": "summary", **summary})


class LossChart:
    """The live panel's chart: train loss (faint raw + EMA line) and val loss against step.

    A rich renderable, drawn at the Live refresh rate (not per step) at the console's width; the
    curves are binned to the chart's columns, so a long run costs one NumPy pass per redraw."""

    def __init__(self, height=8, xrange=None):
        self.height = height
        self.xrange = xrange  # (first, last step): the curves grow across a fixed axis
        self.train = []  # (step, loss): one list append is atomic for the refresh thread
        self.val = []

    def render(self, width):
        """The chart (height x width cells) and its legend line, as one rich Text."""
        import numpy as np
        from rich.text import Text

        from llmctl.runlog import EMA_ALPHA, ema
        from llmctl.termchart import Curve, chart

        curves = []
        if self.train:
            x, y = np.array(self.train[:], dtype=np.float64).T
            ok = np.isfinite(y)
            x, y = x[ok], y[ok]
            curves += [Curve(x, y, "dim cyan", band=True), Curve(x, ema(y), "bold cyan")]
        if self.val:
            x, y = np.array(self.val[:], dtype=np.float64).T
            curves.append(Curve(x, y, "bold magenta"))
        t = chart(curves, width, self.height, xrange=self.xrange)
        legend = Text("\n")
        legend.append("■ ", style="bold cyan")
        legend.append(f"train loss (EMA {EMA_ALPHA:g})  ", style="dim")
        legend.append("■ ", style="bold magenta")
        legend.append("val loss", style="dim")
        return t + legend

    def __rich_console__(self, console, options):
        if self.train or self.val:
            try:
                yield self.render(max(12, min(options.max_width, 100)))
            except Exception:  # a display never raises into the loop (or rich's refresh thread)
                return


class RichDisplay(Display):
    """A live panel on a terminal: progress bar + latest metrics + loss chart; samples and notes
    scroll above."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console(stderr=True, highlight=False)
        self.live = None
        self.progress = None
        self.task = None
        self.last = {}
        self.val_loss = None
        self.t_start = None
        self.skipped = 0
        self.chart = LossChart()

    def _render(self):
        from rich.console import Group
        from rich.table import Table

        t = Table.grid(padding=(0, 2))
        for _ in range(8):
            t.add_column(justify="right")
        r = self.last
        t.add_row("[dim]loss", "[dim]val loss", "[dim]lr", "[dim]norm", "[dim]ms/step",
                  "[dim]tok/s", "[dim]MFU", "[dim]step")
        t.add_row(
            _fmt(r.get("train_loss"), ".4f"), _fmt(self.val_loss, ".4f"), _fmt(r.get("lr"), ".2e"),
            _fmt(r.get("grad_norm"), ".3f"), _fmt(r.get("ms"), ".1f"),
            _fmt(r.get("tokens_per_s"), ",.0f"),
            "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
            "-" if not r else f"{r['step'] + 1}")
        if "skipped" in r:  # -sl/-sg on
            t.add_row("[dim]loss z", "[dim]norm z", "[dim]skipped", "", "", "", "", "")
            t.add_row(_fmt(r.get("loss_z"), "+.2f"), _fmt(r.get("grad_z"), "+.2f"),
                      str(self.skipped), "", "", "", "", "")
        return Group(self.progress, t, self.chart)

    def start(self, info):
        from rich.live import Live
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        from rich.table import Table

        tbl = Table(show_header=False, box=None, padding=(0, 1))
        for k, v in info.items():
            tbl.add_row(f"[dim]{k}", str(v))
        self.console.print(tbl)
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=self.console)
        self.task = self.progress.add_task("train", total=info.get("num_steps") or None,
                                           completed=info.get("start_step", 0))
        if info.get("num_steps"):
            self.chart.xrange = (info.get("start_step", 0), info["num_steps"])
        self.live = Live(self._render(), console=self.console, refresh_per_second=4,
                         transient=False)
        self.live.start()

    def _refresh(self):
        if self.live is not None:
            self.live.update(self._render())

    def val(self, step, val_loss):
        self.val_loss = val_loss
        self.chart.val.append((step, val_loss))
        self._refresh()

    def sample(self, step, text):
        from rich.panel import Panel
        from rich.text import Text

        self.console.print(Panel(Text(text), title=f"sample at step {step}", expand=False))

    def checkpoint(self, step, path):
        self.console.print(f"[green]checkpoint[/] step {step}: {path}")

    def step(self, rec):
        self.last = rec
        self.chart.train.append((rec["step"], rec["train_loss"]))
        self.skipped += bool(rec.get("skipped"))
        if self.progress is not None:
            self.progress.update(self.task, completed=rec["step"] + 1)
        self._refresh()

    def message(self, text):
        self.console.print(text, soft_wrap=True)

    def finish(self, summary):
        if self.live is not None:
            self._refresh()
            self.live.stop()
            self.live = None
        if summary.get("avg_ms") is not None:
            self.console.print(f"average step time {summary['avg_ms']:.1f} ms")


def make_display(json_out=False, quiet=False):
    """The display for the CLI: JSON lines, a rich panel on a terminal, plain lines otherwise."""
    if json_out:
        return JsonDisplay()
    if quiet:
        return Display()
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return RichDisplay() if tty else PlainDisplay()
