"""Training logs -> series: llmctl's metrics.jsonl and llm.c's main.log, read for plotting.

What it is: `read_run(path)` turns a run (an `llmctl train -o DIR` directory, its metrics.jsonl,
or an llm.c main.log as llmc/logger.h writes it: `s:%d trl:%.4f lr:%.6f norm:%.2f`,
`s:%d tel:%.4f`, `s:%d eval:%.4f`, also read as `s:%d hsa:%f`) into a `RunLog` of three series against step: train loss,
val loss and HellaSwag acc_norm. A run still being written is read up to its last complete line.
A restarted run that re-logs older steps (llm.c appends to main.log on resume) is handled as
dev/vislog.ipynb's `parse_logfile` intends: later records replace earlier ones, here by rewinding
the series to the repeated step. Also `ema()`, the smoothing the plots and the live panel share.
`RunLogWriter` writes both files for `llmctl train -o`, with the same keys (FIELDS).
What it is not: drawing (llmctl/plot.py, llmctl/termchart.py) or the training loop (llmctl/train.py).
"""
import bisect
import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llmctl.errors import DataError

SERIES = ("train", "val", "hellaswag")
SERIES_TITLES = {"train": "train loss", "val": "val loss", "hellaswag": "HellaSwag acc_norm"}
MAIN_LOG, METRICS = "main.log", "metrics.jsonl"
# What a run logs, written and read by this one table: metrics.jsonl key -> (the series it is,
# its main.log key, the format llmc/logger.h prints it with). llm.c writes HellaSwag as `eval:`.
FIELDS = {"train_loss": ("train", "trl", ".4f"), "lr": (None, "lr", ".6f"),
          "grad_norm": (None, "norm", ".2f"), "val_loss": ("val", "tel", ".4f"),
          "hellaswag_acc_norm": ("hellaswag", "eval", ".4f")}
METRICS_KEYS = {k: series for k, (series, _, _) in FIELDS.items() if series}
# `hsa:` is the HellaSwag key of other llm.c-style loggers
MAINLOG_KEYS = {**{key: series for series, key, _ in FIELDS.values() if series}, "hsa": "hellaswag"}
EMA_ALPHA = 0.9  # weight of the past in the smoothed train loss (0 = no smoothing)

_HINT = ("pass an `llmctl train -o DIR` output directory, its metrics.jsonl, or an llm.c main.log "
         "(lines like `s:100 trl:3.2811`)")


@dataclass
class Series:
    """One curve: steps (int64, increasing) and values (float64)."""
    step: np.ndarray
    value: np.ndarray

    def __len__(self):
        return len(self.step)


@dataclass
class RunLog:
    name: str  # the legend name
    path: str  # the file read
    kind: str  # "metrics.jsonl" or "main.log"
    series: dict  # SERIES name -> Series (empty when the run never logged it)
    tokens_per_step: Optional[int] = None  # recorded in metrics.jsonl (tokens_per_s * ms)
    partial_line: bool = False  # an unfinished last line was left out

    def summary(self):
        """A JSON-ready dict: per series the number of points, first/last step, last/min/max."""
        out = {"name": self.name, "path": self.path, "kind": self.kind,
               "tokens_per_step": self.tokens_per_step, "partial_line": self.partial_line}
        for k in SERIES:
            s = self.series[k]
            v = s.value[np.isfinite(s.value)]
            out[k] = None if not len(s) else {
                "points": len(s), "first_step": int(s.step[0]), "last_step": int(s.step[-1]),
                "last": float(s.value[-1]) if np.isfinite(s.value[-1]) else None,
                "min": float(v.min()) if len(v) else None, "max": float(v.max()) if len(v) else None}
        return out


class _Stream:
    """(step, value) pairs in step order; a step at or before the last one rewinds (a restart)."""

    def __init__(self):
        self.steps, self.values = [], []

    def add(self, step, value):
        if self.steps and step <= self.steps[-1]:
            i = bisect.bisect_left(self.steps, step)
            del self.steps[i:], self.values[i:]
        self.steps.append(step)
        self.values.append(value)

    def series(self):
        return Series(np.array(self.steps, dtype=np.int64), np.array(self.values, dtype=np.float64))


def _complete_lines(path):
    """The file's complete lines (1-based numbers) and whether an unfinished last line was left."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file", hint=_HINT) from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory without metrics.jsonl or main.log", hint=_HINT) from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a text log (binary data)", hint=_HINT) from None
    lines = text.split("\n")
    partial = lines[-1] != ""  # the writer is mid-line (or died there): wait for the rest
    return list(enumerate(lines[:-1], 1)), partial


def _parse_mainlog(path, lines, streams):
    for n, line in lines:
        parts = line.split()
        if not parts:
            continue
        try:
            key0, step = parts[0].split(":")
            key, value = parts[1].split(":")
            if key0 != "s":
                raise ValueError
            step, value = int(step), float(value)
        except (ValueError, IndexError):
            raise DataError(f"{path}:{n}: not a main.log line: {line[:60]!r}", hint=_HINT) from None
        if key in MAINLOG_KEYS:  # other streams are not plotted
            streams[MAINLOG_KEYS[key]].add(step, value)


def _parse_metrics(path, lines, streams):
    tokens_per_step = None
    for n, line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = rec["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}:{n}: not a metrics.jsonl record (a JSON object with an "
                            f"integer step): {line[:60]!r}", hint=_HINT) from None
        for k, name in METRICS_KEYS.items():
            v = rec.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                streams[name].add(step, float(v))
        if tokens_per_step is None:
            tps, ms = rec.get("tokens_per_s"), rec.get("ms")
            if isinstance(tps, (int, float)) and isinstance(ms, (int, float)) and tps > 0 and ms > 0:
                tokens_per_step = round(tps * ms / 1000.0)  # train.py: tokens / (ms / 1000)
    return tokens_per_step


def _resolve(path):
    """A directory -> its metrics.jsonl (full precision) else its main.log; a file -> itself."""
    if os.path.isdir(path):
        for name in (METRICS, MAIN_LOG):
            p = os.path.join(path, name)
            if os.path.isfile(p):
                return p
        raise DataError(f"{path}: no metrics.jsonl or main.log in this directory", hint=_HINT)
    return path


def _default_name(arg, file):
    d = arg if os.path.isdir(arg) else (os.path.dirname(file) if os.path.basename(file) in
                                        ("metrics.jsonl", "main.log") else None)
    if d is None:
        return os.path.splitext(os.path.basename(file))[0]
    return os.path.basename(os.path.abspath(d))


def read_run(path, name=None):
    """Read one run: a directory (metrics.jsonl, else main.log), a metrics.jsonl or a main.log.

    A file is metrics.jsonl if its name ends in .jsonl or its first character is `{`. Raises
    DataError naming the file when it is missing, empty, binary or has a malformed complete line.
    """
    path = os.fspath(path)
    file = _resolve(path)
    lines, partial = _complete_lines(file)
    first = next((ln for _, ln in lines if ln.strip()), "")
    is_metrics = file.endswith(".jsonl") or first.lstrip().startswith("{")
    streams = {k: _Stream() for k in SERIES}
    tokens_per_step = None
    if is_metrics:
        tokens_per_step = _parse_metrics(file, lines, streams)
    else:
        _parse_mainlog(file, lines, streams)
    series = {k: s.series() for k, s in streams.items()}
    if not any(len(s) for s in series.values()):
        what = "no complete line yet" if partial else "empty" if not first else "no loss records"
        raise DataError(f"{file}: {what}: nothing to plot",
                        hint="wait until the run has logged a step, or " + _HINT)
    return RunLog(name or _default_name(path, file), file,
                  "metrics.jsonl" if is_metrics else "main.log", series, tokens_per_step, partial)


def read_runs(args):
    """read_run for each argument; `NAME=PATH` (when the whole argument is not a path) names the
    run. Runs that would share a legend name are named by the path given instead."""
    runs = []
    for a in args:
        a = os.fspath(a)
        name = None
        if "=" in a and not os.path.exists(a):
            name, a = a.split("=", 1)
        runs.append(read_run(a, name=name or None))
    names = [r.name for r in runs]
    for r, a in zip(runs, args):
        if names.count(r.name) > 1:
            r.name = os.fspath(a)
    return runs


def ema(values, alpha=EMA_ALPHA):
    """Bias-corrected exponential moving average: m_t = alpha m_{t-1} + (1 - alpha) x_t, m_0 = 0,
    divided by 1 - alpha^t (so the first point is x_1, not (1 - alpha) x_1). alpha 0 = no smoothing."""
    x = np.asarray(values, dtype=np.float64)
    if alpha <= 0 or len(x) == 0:
        return x.copy()
    from scipy.signal import lfilter

    m = lfilter([1.0 - alpha], [1.0, -alpha], x)
    return m / (1.0 - alpha ** np.arange(1, len(x) + 1))


def finite(step, value):
    """The points with a finite value (a NaN loss leaves a gap, never a line to infinity)."""
    ok = np.isfinite(value)
    return step[ok], value[ok]



class RunLogWriter:
    """main.log and metrics.jsonl of an `llmctl train -o DIR` run (nothing without a directory).

    main.log: llm.c's lines (`s:%d trl:%.4f lr:%.6f norm:%.2f`, `s:%d tel:%.4f`, `s:%d eval:%.4f`),
    truncated unless resuming, as llm.c does. metrics.jsonl: one JSON record per step; on a
    resume the entries at or after `start_step` are dropped, so a resumed run's file equals an
    uninterrupted one."""

    def __init__(self, out_dir=None, resume=False, start_step=0):
        self.main_log = self.metrics = None
        if not out_dir:
            return
        from llmctl.checkpoints import os_error

        log_path = os.path.join(out_dir, MAIN_LOG)
        try:
            self.main_log = open(log_path, "a" if resume else "w")
        except OSError as e:
            raise os_error(log_path, e) from None
        try:
            self._open_metrics(os.path.join(out_dir, METRICS), start_step)
        except BaseException:
            self.main_log.close()
            raise

    def _open_metrics(self, mpath, start_step):
        from llmctl.atomic import atomic_write
        from llmctl.checkpoints import OUTPUT_HINT, os_error

        keep = []
        if start_step > 0 and os.path.isfile(mpath):
            with open(mpath) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] < start_step:
                            keep.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        continue
        atomic_write(mpath, "".join(keep), hint=OUTPUT_HINT)
        try:
            self.metrics = open(mpath, "a")
        except OSError as e:
            raise os_error(mpath, e) from None

    def log(self, step, **values):
        """One main.log line of `values` (FIELDS keys, in the order given)."""
        if self.main_log is not None:
            items = " ".join(f"{FIELDS[k][1]}:{v:{FIELDS[k][2]}}" for k, v in values.items())
            self.main_log.write(f"s:{step} {items}\n")
            self.main_log.flush()

    def record(self, rec):
        """One metrics.jsonl record."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()

    def close(self):
        for f in (self.main_log, self.metrics):
            if f is not None:
                f.close()
