"""`llmctl plot` (llmctl/runlog.py, plot.py, termchart.py) and the live loss chart (display.py).

The runs are real: a 24-step `llmctl train` of the 30k-parameter tiny model (tests/tinyrun.py) on
Tiny Shakespeare's bytes, and an llm.c main.log written here in llmc/logger.h's exact formats
(`s:%d trl:%.4f lr:%.6f norm:%.2f`, `s:%d tel:%.4f`, `s:%d eval:%.4f`). Images are checked by
their pixels: the run colours must appear inside each panel's axes box, and only where the run
has points.
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error

from conftest import shared_file
from llmctl.errors import ConfigError, DataError
from llmctl.runlog import EMA_ALPHA, ema, read_run, read_runs

B, T, STEPS, VAL_EVERY = 4, 16, 24, 8
BRAILLE = {chr(c) for c in range(0x2801, 0x2900)}  # a cell with at least one dot


def _llmctl(args, cwd, code=None):
    p = subprocess.run([sys.executable, "-m", "llmctl", *args] if code is None else
                       [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="100"),
                       timeout=300)
    return p


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real llmctl output directory: metrics.jsonl + main.log of a 24-step run with val loss."""
    from llmctl.formats import write_datafile
    from tinyrun import tiny_train_args, write_tiny_run

    text = shared_file("tinyshakespeare/input.txt").read_bytes()
    d = write_tiny_run(tmp_path_factory.mktemp("plotrun"), 1000)
    b = np.frombuffer(text, dtype=np.uint8) % 64  # the tiny model's 64-token vocabulary
    write_datafile(str(d / "train.bin"), b[20000:].astype(np.uint16))
    write_datafile(str(d / "val.bin"), b[:20000].astype(np.uint16))
    args = tiny_train_args(d, "run", B, T, "-x", str(STEPS), "-l", "1e-2")
    args[args.index("-v") + 1] = str(VAL_EVERY)
    p = _llmctl(args + ["-m", "2"], d)
    assert p.returncode == 0, p.stderr
    return d / "run"


def write_mainlog(path, steps=60, val_every=20, eval_every=30, restart_at=None):
    """An llm.c main.log: the lines of train_gpt2.cu's loop via llmc/logger.h's formats. With
    restart_at, the run is logged to the end, then resumed from restart_at (lines appended, as
    llm.c's -y 1 does) with losses shifted by +1, so the replaced values are recognisable."""
    lines = []

    def loop(start, shift):
        for s in range(start, steps + 1):
            if s % val_every == 0 or s == steps:
                lines.append("s:%d tel:%.4f" % (s, 3.5 - s / 40 + shift))
            if (s > 0 and s % eval_every == 0) or s == steps:
                lines.append("s:%d eval:%.4f" % (s, 0.25 + s / 1000))
            if s < steps:
                lines.append("s:%d trl:%.4f lr:%.6f norm:%.2f"
                             % (s, 4.0 - s / 30 + 0.1 * math.sin(s) + shift, 6e-4, 1.0))
    loop(0, 0.0)
    if restart_at is not None:
        loop(restart_at, 1.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _metrics(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# reading logs


def test_read_llmctl_run_directory(run_dir):
    recs = _metrics(run_dir)
    r = read_run(run_dir)
    assert r.kind == "metrics.jsonl" and r.name == "run" and not r.partial_line
    assert r.series["train"].step.tolist() == list(range(STEPS))
    assert r.series["train"].value.tolist() == [x["train_loss"] for x in recs if "train_loss" in x]
    assert r.series["val"].step.tolist() == [0, 8, 16, 24]
    assert r.series["val"].value.tolist() == [x["val_loss"] for x in recs if "val_loss" in x]
    assert len(r.series["hellaswag"]) == 0
    assert r.tokens_per_step == B * T
    # the same run through llmctl's own main.log (4 decimals, as llm.c prints)
    m = read_run(run_dir / "main.log")
    assert m.kind == "main.log" and m.name == "run" and m.tokens_per_step is None
    assert m.series["train"].step.tolist() == list(range(STEPS))
    np.testing.assert_allclose(m.series["train"].value, r.series["train"].value, atol=5e-5)
    np.testing.assert_allclose(m.series["val"].value, r.series["val"].value, atol=5e-5)


def test_read_llmc_mainlog(tmp_path):
    r = read_run(write_mainlog(tmp_path / "main.log"))
    assert r.kind == "main.log" and r.name == tmp_path.name
    assert r.series["train"].step.tolist() == list(range(60))
    assert r.series["train"].value[7] == float("%.4f" % (4.0 - 7 / 30 + 0.1 * math.sin(7)))
    assert r.series["val"].step.tolist() == [0, 20, 40, 60]
    assert r.series["hellaswag"].step.tolist() == [30, 60]
    assert r.series["hellaswag"].value.tolist() == [0.28, 0.31]


def test_read_mainlog_with_hsa_lines(tmp_path):
    p = tmp_path / "main.log"
    p.write_text("s:0 tel:4.0000\ns:0 trl:4.1000 lr:0.000300 norm:1.00\ns:10 hsa:0.2955\n")
    r = read_run(p)
    assert r.series["hellaswag"].step.tolist() == [10]
    assert r.series["hellaswag"].value.tolist() == [0.2955]


def test_restarted_mainlog_rewinds_to_the_repeated_step(tmp_path):
    r = read_run(write_mainlog(tmp_path / "main.log", restart_at=40))
    tr = r.series["train"]
    assert tr.step.tolist() == list(range(60))
    assert tr.value[39] == float("%.4f" % (4.0 - 39 / 30 + 0.1 * math.sin(39)))  # before
    assert tr.value[45] == float("%.4f" % (4.0 - 45 / 30 + 0.1 * math.sin(45) + 1.0))  # re-logged
    assert r.series["val"].step.tolist() == [0, 20, 40, 60]
    assert r.series["val"].value[2] == float("%.4f" % (3.5 - 1.0 + 1.0))


def test_half_written_last_line_is_left_out(tmp_path, run_dir):
    log = write_mainlog(tmp_path / "main.log")
    with open(log, "a") as f:
        f.write("s:60 trl:1.23")  # the writer is mid-line
    r = read_run(log)
    assert r.partial_line and r.series["train"].step.tolist() == list(range(60))
    text = (run_dir / "metrics.jsonl").read_text()
    cut = text.rindex('"train_loss"', 0, len(text) - 200)  # inside the last train record
    part = tmp_path / "growing" / "metrics.jsonl"
    part.parent.mkdir()
    part.write_text(text[:cut])
    r = read_run(part.parent)
    assert r.partial_line and r.name == "growing"
    complete = text[:cut].count("\n")  # one train record per line (the last line, step 24, has none)
    assert r.series["train"].step.tolist() == list(range(complete))


@pytest.mark.parametrize("case", ["missing", "empty", "dir", "garbled", "binary", "json_list",
                                  "partial_only", "no_step"])
def test_bad_inputs_name_the_file(tmp_path, case):
    p = tmp_path / "main.log"
    if case == "missing":
        want = "no such file"
    elif case == "empty":
        p.write_text("")
        want = "empty"
    elif case == "dir":
        p = tmp_path / "somedir"
        p.mkdir()
        want = "no metrics.jsonl or main.log"
    elif case == "garbled":
        p.write_text("s:0 trl:4.0 lr:0.1 norm:1.0\nstep 1 loss 3.9\n")
        want = ":2: not a main.log line"
    elif case == "binary":
        p.write_bytes(b"\x00\xff\xfe" * 100 + b"\n")
        want = "not a text log"
    elif case == "json_list":
        p = tmp_path / "metrics.jsonl"
        p.write_text('{"step": 0, "train_loss": 4.0}\n[1, 2]\n')
        want = ":2: not a metrics.jsonl record"
    elif case == "partial_only":
        p.write_text("s:0 trl:4.0")
        want = "no complete line yet"
    else:
        p = tmp_path / "metrics.jsonl"
        p.write_text('{"train_loss": 4.0}\n')
        want = ":1: not a metrics.jsonl record"
    with raises_error(DataError, names=[str(p), want]):
        read_run(p)


def test_nan_loss_leaves_a_gap(tmp_path):
    from llmctl.plot import curves

    log = tmp_path / "main.log"
    log.write_text("s:0 trl:4.0000 lr:0.000600 norm:1.00\ns:1 trl:3.5000 lr:0.000600 norm:1.00\n"
                   "s:2 trl:nan lr:0.000600 norm:nan\n")  # llm.c prints a NaN loss as nan
    r = read_run(log)
    assert r.series["train"].step.tolist() == [0, 1, 2] and math.isnan(r.series["train"].value[2])
    s = r.summary()["train"]
    assert (s["points"], s["last"], s["min"], s["max"]) == (3, None, 3.5, 4.0)
    ((_, xs, ys, sm),) = curves([r])["train"]
    assert xs.tolist() == [0, 1] and ys.tolist() == [4.0, 3.5] and np.isfinite(sm).all()


def test_names_from_arguments(tmp_path, run_dir):
    log = write_mainlog(tmp_path / "llmc" / "main.log")
    runs = read_runs([f"baseline={log}", str(run_dir), str(run_dir / "main.log")])
    # the directory and its main.log would both be "run": each is named by its path instead
    assert [r.name for r in runs] == ["baseline", str(run_dir), str(run_dir / "main.log")]


def test_ema_is_the_bias_corrected_recurrence():
    x = np.array([4.0, 3.0, 3.5, 2.0, 2.5, 1.0])
    m, want = 0.0, []
    for t, v in enumerate(x, 1):
        m = EMA_ALPHA * m + (1 - EMA_ALPHA) * v
        want.append(m / (1 - EMA_ALPHA ** t))
    np.testing.assert_allclose(ema(x), want, rtol=1e-12)
    assert ema(x)[0] == x[0]
    np.testing.assert_array_equal(ema(x, 0.0), x)


# ---------------------------------------------------------------------------------------------
# images

C0, C1 = (31, 119, 180), (255, 127, 14)  # matplotlib's first two cycle colours: the two runs


def _pixels_near(img, box, rgb, tol=40):
    """Pixels within `tol` (max channel difference) of rgb inside box (x0, y0, x1, y1, top-left
    origin), 3 pixels in from the frame."""
    x0, y0, x1, y1 = box
    a = img[y0 + 3:y1 - 3, x0 + 3:x1 - 3, :3].astype(int)
    return int((np.abs(a - np.array(rgb)).max(axis=2) < tol).sum())


def _axes_boxes(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    H = fig.bbox.height
    boxes = {}
    for ax in fig.axes:
        bb = ax.get_window_extent()
        boxes[ax.get_label()] = (int(bb.x0), int(H - bb.y1), int(bb.x1), int(H - bb.y0))
    return boxes


def test_png_from_a_real_run_and_an_llmc_log(tmp_path, run_dir):
    from PIL import Image

    from llmctl.plot import DPI, PANEL_SIZE, make_figure, save_plot

    log = write_mainlog(tmp_path / "llmc" / "main.log")
    runs = read_runs([run_dir, log])
    out = tmp_path / "runs.png"
    res = save_plot(runs, out)
    assert res["panels"] == ["train", "val", "hellaswag"] and res["format"] == "png"
    img = np.asarray(Image.open(out).convert("RGB"))
    assert img.shape[:2] == (PANEL_SIZE[1] * DPI, 3 * PANEL_SIZE[0] * DPI)
    boxes = _axes_boxes(make_figure(runs))
    assert list(boxes) == ["train", "val", "hellaswag"]
    for panel in ("train", "val"):
        assert _pixels_near(img, boxes[panel], C0) > 100, panel  # the llmctl run
        assert _pixels_near(img, boxes[panel], C1) > 100, panel  # the llm.c log
    assert _pixels_near(img, boxes["hellaswag"], C1) > 100
    assert _pixels_near(img, boxes["hellaswag"], C0) == 0  # the llmctl run has no HellaSwag
    fig = make_figure(runs)
    for ax in fig.axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "llmc"
    # the faint raw train loss is drawn under the EMA line, which ends at the EMA's last value
    tr = fig.axes[0].get_lines()
    assert tr[0].get_alpha() < 0.5 and tr[1].get_alpha() is None
    np.testing.assert_allclose(tr[1].get_ydata(), ema(runs[0].series["train"].value))


def test_panels_without_points_are_left_out(tmp_path, run_dir):
    from PIL import Image

    from llmctl.plot import DPI, PANEL_SIZE, save_plot

    only_train = tmp_path / "t" / "main.log"
    only_train.parent.mkdir()
    only_train.write_text("".join("s:%d trl:%.4f lr:0.000600 norm:1.00\n" % (s, 4 - s / 10)
                                  for s in range(10)))
    res = save_plot(read_runs([only_train]), tmp_path / "a.png")
    assert res["panels"] == ["train"]
    assert Image.open(tmp_path / "a.png").size == (PANEL_SIZE[0] * DPI, PANEL_SIZE[1] * DPI)
    res = save_plot(read_runs([run_dir]), tmp_path / "b.png")
    assert res["panels"] == ["train", "val"]
    assert Image.open(tmp_path / "b.png").size == (2 * PANEL_SIZE[0] * DPI, PANEL_SIZE[1] * DPI)


def test_svg_and_pdf_by_extension(tmp_path, run_dir):
    from llmctl.plot import save_plot

    runs = read_runs([run_dir])
    save_plot(runs, tmp_path / "r.svg")
    svg = (tmp_path / "r.svg").read_text()
    assert svg.startswith("<?xml") and "<svg" in svg and "val loss" in svg
    save_plot(runs, tmp_path / "r.PDF")
    assert (tmp_path / "r.PDF").read_bytes().startswith(b"%PDF-")
    with raises_error(ConfigError, names=".jpg"):
        save_plot(runs, tmp_path / "r.jpg")
    assert not (tmp_path / "r.jpg").exists()


def test_failed_plot_keeps_the_existing_image(tmp_path):
    from llmctl.plot import save_plot

    out = tmp_path / "runs.png"
    out.write_bytes(b"previous image")
    runs = read_runs([write_mainlog(tmp_path / "main.log")])
    with raises_error(ConfigError, names="--tokens-per-step"):
        save_plot(runs, out, x="tokens")
    assert out.read_bytes() == b"previous image"
    assert sorted(os.listdir(tmp_path)) == ["main.log", "runs.png"]


def test_x_tokens_logy_and_baselines(tmp_path, run_dir):
    from llmctl.plot import make_figure, parse_baseline

    runs = read_runs([run_dir, write_mainlog(tmp_path / "main.log")])
    bl = [parse_baseline("hellaswag:GPT-2 124M=0.2955"), parse_baseline("target=2.5")]
    fig = make_figure(runs, x="tokens", tokens_per_step=1024, logy=True, baselines=bl)
    train, val, hs = fig.axes
    # tokens seen = step x tokens per step: recorded (B*T) for the llmctl run, given for llm.c's
    np.testing.assert_array_equal(train.get_lines()[0].get_xdata(), np.arange(STEPS) * B * T)
    np.testing.assert_array_equal(val.get_lines()[1].get_xdata(), np.array([0, 20, 40, 60]) * 1024)
    assert train.get_xlabel() == "tokens seen"
    assert (train.get_yscale(), val.get_yscale(), hs.get_yscale()) == ("log", "log", "linear")
    hlines = {ax.get_label(): [(ln.get_label(), ln.get_ydata()[0]) for ln in ax.get_lines()
                               if ln.get_linestyle() == "--"] for ax in fig.axes}
    assert hlines == {"train": [("target (2.5)", 2.5)], "val": [("target (2.5)", 2.5)],
                      "hellaswag": [("GPT-2 124M (0.2955)", 0.2955)]}


@pytest.mark.parametrize("text", ["0.2955", "name=", "=3", "x=abc", "hellaswag:=0.3", "x=nan"])
def test_bad_baselines(text):
    from llmctl.plot import parse_baseline

    with raises_error(ConfigError, names=repr(text)):
        parse_baseline(text)


# ---------------------------------------------------------------------------------------------
# terminal


def _rows(text):
    return text.plain.split("\n")


def test_terminal_chart_geometry_and_marks():
    from llmctl.termchart import Curve, HLine, chart

    x = np.arange(100)
    t = chart([Curve(x, 10.0 - x / 10)], width=50, height=12, title="falling",
              hlines=[HLine(5.0)])
    rows = _rows(t)
    assert len(rows) == 12 and all(len(r) == 50 for r in rows)
    assert rows[0].startswith("falling")
    plot = rows[1:-2]
    gutter = plot[0].index("┤") + 1
    cells = [r[gutter:] for r in plot]
    # a falling line: marks in the top row at the left, in the bottom row at the right
    assert cells[0][0] in BRAILLE and cells[0][-1] not in BRAILLE
    assert cells[-1][-1] in BRAILLE and cells[-1][0] not in BRAILLE
    assert all(any(c in BRAILLE for c in row) for row in cells)  # continuous: every row is hit
    assert plot[0].lstrip().startswith("10") and plot[-1].lstrip().startswith("0.1")
    assert rows[-2].strip().startswith("└") and rows[-1].split() == ["0", "99"]
    # the baseline (y = 5, the middle) marks the middle row across the whole width
    mid = cells[(len(cells) - 1) // 2] + cells[len(cells) // 2]
    assert sum(c in BRAILLE for c in mid) > 0.6 * len(cells[0])


def test_terminal_log_axis_and_empty_curve():
    from llmctl.termchart import Curve, chart

    x = np.arange(1001)
    y = 10.0 ** (3 - 3 * x / 1000)  # a straight line on a log axis, from 1000 down to 1
    rows = _rows(chart([Curve(x, y)], width=40, height=8, logy=True))
    assert all(len(r) == 40 for r in rows) and len(rows) == 8
    assert rows[0].lstrip().startswith("1000") and rows[-3].lstrip().startswith("1 ")
    plot = rows[:-2]
    gutter = plot[0].index("┤") + 1
    cols = len(plot[0]) - gutter
    for r, row in enumerate(plot):  # row r is hit by the r-th sixth of the x range only
        hit = [c for c, ch in enumerate(row[gutter:]) if ch in BRAILLE]
        assert hit and r * cols / 6 - 2 <= min(hit) and max(hit) <= (r + 1) * cols / 6 + 2, r
    rows = _rows(chart([Curve([], [])], width=30, height=6))
    assert len(rows) == 6 and not any(c in BRAILLE for r in rows for c in r)


def test_terminal_panels_of_two_runs(tmp_path, run_dir):
    from llmctl.plot import parse_baseline, terminal_panels

    runs = read_runs([run_dir, write_mainlog(tmp_path / "llmc.log")])
    blocks = terminal_panels(runs, width=70, height=12,
                             baselines=[parse_baseline("hellaswag:GPT-2=0.2955")])
    assert len(blocks) == 3
    for b, title in zip(blocks, ("train loss (EMA 0.9) vs step", "val loss vs step",
                                 "HellaSwag acc_norm vs step")):
        rows = _rows(b)
        assert len(rows) == 13 and all(len(r) == 70 for r in rows[:12])
        assert rows[0].startswith(title)
        assert sum(c in BRAILLE for r in rows[1:10] for c in r) > 20
        assert rows[-1].startswith("■ run") or rows[-1].startswith("■ llmc")
    assert _rows(blocks[0])[-1].split() == ["■", "run", "■", "llmc"]
    with raises_error(ConfigError, names="10"):  # the --width given
        terminal_panels(runs, width=10)
    assert _rows(blocks[2])[-1].split() == ["■", "llmc", "┄", "GPT-2", "(0.2955)"]


_NO_MPL = ("import sys; sys.modules['matplotlib'] = None; from llmctl.cli import main; "
           "main(sys.argv[1:])")  # matplotlib absent: its import raises ImportError


def test_cli_terminal_works_without_matplotlib(tmp_path, run_dir):
    p = _llmctl(["plot", str(run_dir), "--terminal", "--width", "60", "--height", "10"],
                tmp_path, code=_NO_MPL)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2 * 11 and all(len(ln) <= 60 for ln in lines)
    assert sum(c in BRAILLE for c in p.stdout) > 40
    assert not list(tmp_path.iterdir())  # --terminal alone writes no file
    p = _llmctl(["plot", str(run_dir)], tmp_path, code=_NO_MPL)
    _, hint = assert_cli_error(p.stderr, 2, p.returncode, names="matplotlib")
    assert "`pip install matplotlib`" in hint  # the command: no reinstall of llmctl (no rebuild)
    assert not list(tmp_path.iterdir())


def test_cli_png_and_json(tmp_path, run_dir):
    from PIL import Image

    log = write_mainlog(tmp_path / "main.log")
    p = _llmctl(["plot", str(run_dir), f"llm.c={log}", "--json", "--logy",
                 "--baseline", "hellaswag:GPT-2 124M=0.2955"], tmp_path)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)  # stdout is the JSON object only
    assert res["output"] == "runs.png" and res["format"] == "png"  # the default -o
    assert res["panels"] == ["train", "val", "hellaswag"]
    assert [r["name"] for r in res["runs"]] == ["run", "llm.c"]
    assert res["runs"][0]["val"]["points"] == 4 and res["runs"][0]["tokens_per_step"] == B * T
    assert res["runs"][1]["hellaswag"]["last"] == 0.31 and res["runs"][0]["hellaswag"] is None
    assert Image.open(tmp_path / "runs.png").format == "PNG"


def test_cli_bad_log_is_one_error_line(tmp_path):
    (tmp_path / "main.log").write_text("")
    p = _llmctl(["plot", "main.log"], tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    err = p.stderr.splitlines()
    assert err[0].startswith("Error: main.log: empty") and err[1].startswith("Hint:")


def test_cli_help_names_the_defaults_plainly():
    """--help shows -o's and --smooth's defaults as every other default, `[default: runs.png]`
    (not typer's `[default: (runs.png...)]` for a text in their place), and they are the library's."""
    import typer
    from typer.testing import CliRunner

    from llmctl.cli import app
    from llmctl.plot import DEFAULT_OUTPUT

    out = CliRunner().invoke(app, ["plot", "--help"], env={"COLUMNS": "400"}).output
    assert f"[default: {DEFAULT_OUTPUT}]" in out and f"[default: {EMA_ALPHA:g}]" in out
    assert "[default: (" not in out
    params = {p.name: p for p in typer.main.get_command(app).commands["plot"].params}
    assert (params["output"].default, params["smooth"].default) == (DEFAULT_OUTPUT, EMA_ALPHA)


def test_cli_terminal_writes_an_image_only_with_o(tmp_path, run_dir):
    p = _llmctl(["plot", str(run_dir), "--terminal", "--width", "60", "-o", "curves.svg"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert sum(c in BRAILLE for c in p.stdout) > 40 and os.listdir(tmp_path) == ["curves.svg"]
    p = _llmctl(["plot", str(run_dir), "--terminal", "--width", "60", "-o", "runs.png"], tmp_path)
    assert p.returncode == 0 and sorted(os.listdir(tmp_path)) == ["curves.svg", "runs.png"]


# ---------------------------------------------------------------------------------------------
# the live chart in the train panel


def test_live_loss_chart_grows_each_step():
    import io

    from rich.console import Console

    from llmctl.display import LossChart, RichDisplay

    buf = io.StringIO()
    d = RichDisplay(Console(file=buf, force_terminal=True, width=80))
    d.start({"num_steps": 40, "start_step": 0})
    marks = []
    for s in range(40):
        if s % 10 == 0:
            d.val(s, 4.0 - s / 20)
        d.step({"step": s, "num_steps": 40, "train_loss": 4.2 - s / 20 + 0.05 * math.sin(s),
                "lr": 3e-4, "grad_norm": 1.0, "ms": 10.0, "tokens_per_s": 1000.0, "mfu": 0.01})
        rows = _rows(d.chart.render(80))[:-3]
        marks.append(max(c for r in rows for c, ch in enumerate(r) if ch in BRAILLE))
    d.finish({"avg_ms": 10.0})
    # the x axis is the whole run (0..40) from the start, so the curve's right end moves right
    assert marks == sorted(marks) and marks[-1] - marks[0] > 50 and marks[-1] >= 75
    rows = _rows(d.chart.render(80))
    assert len(rows) == d.chart.height + 1 and all(len(r) == 80 for r in rows[:-1])
    assert rows[-1].split() == ["■", "train", "loss", "(EMA", f"{EMA_ALPHA:g})", "■", "val", "loss"]
    assert rows[-2].split() == ["0", "40"]  # the x axis spans the whole run from the start
    assert sum(c in BRAILLE for c in buf.getvalue()) > 50  # drawn in the live panel
    assert d.chart.train[-1] == (39, 4.2 - 39 / 20 + 0.05 * math.sin(39))
    assert [s for s, _ in d.chart.val] == [0, 10, 20, 30]
    assert list(LossChart().__rich_console__(None, None)) == []  # nothing before the first step


def test_run_log_writer_writes_llm_c_lines_and_records_that_read_run_reads_back(tmp_path):
    """The writer of `train -o` and the reader share one key table: main.log lines are llm.c's
    logger.h format byte for byte (printf, independent of llmctl), and a resume drops the
    metrics at or after the resumed step."""
    from llmctl.runlog import RunLogWriter

    w = RunLogWriter(tmp_path)
    w.log(0, val_loss=4.25)
    w.log(0, train_loss=4.123456, lr=3e-4, grad_norm=1.234)
    w.log(1, hellaswag_acc_norm=0.25)
    for s in range(3):
        w.record({"step": s, "train_loss": 4.0 - s, "val_loss": 5.0 - s})
    w.close()
    want = ["s:%d tel:%.4f" % (0, 4.25), "s:%d trl:%.4f lr:%.6f norm:%.2f" % (0, 4.123456, 3e-4, 1.234),
            "s:%d eval:%.4f" % (1, 0.25)]
    assert (tmp_path / "main.log").read_text() == "\n".join(want) + "\n"
    def points(run, name):
        return run.series[name].step.tolist(), run.series[name].value.tolist()

    main = read_run(str(tmp_path / "main.log"))
    assert points(main, "train") == ([0], [4.1235]) and points(main, "val") == ([0], [4.25])
    assert points(main, "hellaswag") == ([1], [0.25])
    w = RunLogWriter(tmp_path, resume=True, start_step=2)
    w.record({"step": 2, "train_loss": 9.0})
    w.close()
    assert points(read_run(str(tmp_path)), "train") == ([0, 1, 2], [4.0, 3.0, 9.0])
    assert (tmp_path / "main.log").read_text().count("\n") == 3  # a resume appends to main.log


@pytest.mark.parametrize("bad, flag", [(["--x", "time"], "--x"), (["--baseline", "GPT-2"], "--baseline"),
                                       (["--terminal", "--json"], "--terminal")])
def test_cli_bad_setting_is_a_usage_error_before_any_run_is_read(tmp_path, bad, flag):
    p = _llmctl(["plot", "no_such_run", *bad], tmp_path)  # the run is missing: the setting is named first
    assert_cli_error(p.stderr, 2, p.returncode, names=[flag])
    assert "no_such_run" not in p.stderr and not list(tmp_path.iterdir())
