"""Tests for llmctl/cli.py's shared behaviour: Ctrl-C in any command (other than train, which
llmctl/train.py handles) prints one "Interrupted" line saying what was kept and exits 130; usage
errors (bad flag values, unknown options, missing arguments) are one Error line and a Hint, exit 2.

The commands run as real subprocesses and get a real SIGINT once they are visibly busy (text on
stdout, a first shard on disk, the input mapped), since typer's own KeyboardInterrupt handling is
what hid the message. The signal is sent to the frozen process (SIGSTOP, SIGINT, SIGCONT), so no
test depends on a command being slow enough to still run when the signal arrives."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from errcheck import assert_cli_error


def _start(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "llmctl"] + args, cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _maps(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def _interrupt(p):
    """Ctrl-C for a command the test has just seen busy. It is frozen first (SIGSTOP), so it
    cannot run to its end between that moment and the signal, however fast the machine; the
    SIGINT stays pending until SIGCONT resumes it."""
    p.send_signal(signal.SIGSTOP)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGCONT)
    out, err = p.communicate(timeout=120)
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def test_ctrl_c_during_sample_says_interrupted(tmp_path):
    # d6 is a seeded random init and the sampler seed is fixed, so this output is deterministic;
    # the first token on stdout says it is generating, 999 more are still to come
    p = _start(["sample", "-e", "d6", "-n", "1000", "--threads", "1"], tmp_path)
    try:
        assert p.stdout.read(1)  # generating
    except BaseException:
        p.kill()
        raise
    code, out, err = _interrupt(p)
    assert code == 130, err
    assert "Interrupted" in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if "Interrupted" in ln]) == 1


def test_ctrl_c_during_sample_json_says_the_lines_printed_are_whole_samples(tmp_path):
    p = _start(["sample", "-e", "d6", "-n", "2", "--num-samples", "1000", "--threads", "1", "--json"], tmp_path)
    try:
        first = p.stdout.readline()  # one sample done, 999 to come
    except BaseException:
        p.kill()
        raise
    code, out, err = _interrupt(p)
    assert code == 130, err
    lines = [first.decode()] + out.splitlines()
    assert out == "" or out.endswith("\n")   # every line ends where a reader of lines sees it
    assert all(len(json.loads(ln)["tokens"]) <= 2 for ln in lines if ln.strip())
    assert "Interrupted: each JSON line above is a complete sample" in err and "Traceback" not in err
    assert "the text above" not in err


def test_ctrl_c_during_prepro_text_names_the_kept_shards(tmp_path):
    from conftest import shared_file

    text = shared_file("tinyshakespeare/input.txt").read_text(encoding="utf-8")
    src = tmp_path / "big.txt"
    src.write_text(text * 8, encoding="utf-8")  # ~2.7M tokens, 27 shards: busy long after the first
    out_dir = tmp_path / "o"
    p = _start(["prepro", "text", str(src), "--out-dir", str(out_dir), "--shard-size", "100000",
                "-w", "2", "--json"], tmp_path)
    try:
        t0 = time.monotonic()
        while not (out_dir.is_dir() and any(n.endswith(".bin") for n in os.listdir(out_dir))):
            assert p.poll() is None and time.monotonic() - t0 < 300, "no shard appeared"
            time.sleep(0.02)
    except BaseException:
        p.kill()
        raise
    code, out, err = _interrupt(p)
    assert code == 130, err
    assert "Traceback" not in err and out == ""
    line = [ln for ln in err.splitlines() if "Interrupted" in ln]
    assert len(line) == 1 and "complete shard(s): big_val_000000.bin" in line[0], err
    shards = sorted(n for n in os.listdir(out_dir) if n.endswith(".bin"))
    n_kept = int(line[0].split("kept ")[1].split(" ")[0])
    assert len(shards) == n_kept and not [n for n in os.listdir(out_dir) if not n.endswith(".bin")]


@pytest.mark.parametrize("cmd", [["eval", "loss", "-e", "d6", "-j", "v.bin", "-b", "1", "-t", "1024"]])
def test_ctrl_c_during_eval_says_interrupted(tmp_path, cmd):
    import numpy as np

    from llmctl import formats

    formats.write_datafile(str(tmp_path / "v.bin"), np.arange(1024 * 200 + 1) % 50000)
    p = _start(cmd + ["--threads", "1"], tmp_path)
    try:  # scoring has begun once the shard is mapped (200 forwards of 1024 tokens take far longer)
        t0 = time.monotonic()
        while "v.bin" not in _maps(p.pid):
            assert p.poll() is None and time.monotonic() - t0 < 300, "never started scoring"
            time.sleep(0.02)
    except BaseException:
        p.kill()
        raise
    code, out, err = _interrupt(p)
    assert code == 130 and "Interrupted: no result." in err and "Traceback" not in err, err


_CTRL_C_ON_IMPORT = """
import runpy, sys

MODULE = sys.argv[1]


class CtrlC:  # the SIGINT arriving while MODULE is first imported
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["llmctl"] + sys.argv[2:]
runpy.run_module("llmctl", run_name="__main__")
"""


@pytest.mark.parametrize("module", [
    "typer",     # `from llmctl.cli import main`: the CLI's modules are still loading
    "pydantic",  # typer imports it while it parses the root's options, outside any command's body
])
def test_ctrl_c_before_a_command_runs_is_one_line_and_exit_130(tmp_path, module):
    r = subprocess.run([sys.executable, "-c", _CTRL_C_ON_IMPORT, module, "info"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert r.stderr == "Interrupted: nothing was written.\n" and r.stdout == ""


# ---------------------------------------------------------------------------------------------
# usage errors: llmctl's Error/Hint lines and exit 2, not typer's boxed usage panel

def _run(args, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="80")
    r = subprocess.run([sys.executable, "-m", "llmctl", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=120)
    return r.returncode, r.stdout, r.stderr


def _run_tty(args, cwd=None):
    """As _run, with stderr a terminal (a pty), so rich renders for a terminal; escape codes and
    the pty's carriage returns are stripped from what it shows."""
    import pty
    import re

    master, slave = pty.openpty()
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="80", TERM="xterm-256color")
    p = subprocess.Popen([sys.executable, "-m", "llmctl", *args], cwd=cwd, env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the command closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = p.stdout.read().decode()
    p.wait(timeout=120)
    p.stdout.close()
    err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode()).replace("\r", "")
    return p.returncode, out, err


# (argv, the subcommand the hint names, what the Error line must name)
USAGE_ERRORS = [
    (["train", "-b", "abc"], "llmctl train", ["-b/--batch-size: 'abc' is not an integer"]),
    (["eval", "loss", "-t", "x"], "llmctl eval loss", ["-t/--seq-len: 'x' is not an integer"]),
    (["train", "-l", "x"], "llmctl train", ["-l/--learning-rate: 'x' is not a number"]),
    (["sample", "--top-p", "2"], "llmctl sample", ["--top-p: 2 is above the maximum 1"]),
    (["sample", "-n", "0"], "llmctl sample", ["-n/--max-new-tokens: 0 is below the minimum 1"]),
    # -h is llm.c's HellaSwag flag: alone it lacks its value, found before train's context exists
    (["train", "-h"], "llmctl train", ["'-h' requires an argument", "HellaSwag", "--help"]),
    (["sample", "-n"], "llmctl sample", ["'-n' requires an argument"]),
    (["train", "--nope"], "llmctl train", ["--nope"]),
    (["prepro", "text"], "llmctl prepro text", ["Missing argument", "files"]),
    (["prepro"], "llmctl prepro", ["needs a command", "tinyshakespeare", "gpt2"]),
    (["eval"], "llmctl eval", ["needs a command", "hellaswag", "loss"]),
    (["nosuch"], "llmctl", ["nosuch"]),
]


@pytest.mark.parametrize("tty", [False, True], ids=["plain", "terminal"])
@pytest.mark.parametrize("argv, command, named", USAGE_ERRORS, ids=[" ".join(a) for a, _, _ in USAGE_ERRORS])
def test_usage_error_is_one_error_line_and_a_hint_exit_2(tmp_path, argv, command, named, tty):
    code, out, err = (_run_tty if tty else _run)(argv, cwd=tmp_path)
    assert code == 2, err
    assert out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 2, err
    assert lines[0].startswith("Error: ") and all(n in lines[0] for n in named), err
    assert lines[1] == f"Hint: run '{command} --help'", err
    assert not any(c in err for c in "╭╮╰╯│─") and "Usage:" not in err and "Traceback" not in err


def test_bad_choice_is_one_error_and_a_hint_exit_2(tmp_path):
    code, out, err = _run(["train", "--precision", "fp8"], cwd=tmp_path)
    assert code == 2 and out == ""
    assert err.splitlines() == ["Error: unknown precision 'fp8'", "Hint: choose one of fp32, bf16"]


def test_usage_errors_render_the_same_through_clirunner():
    """The rendering lives in the app's root command, so calling the app directly (as a test or
    a script does) shows the same two lines as `llmctl` itself."""
    from typer.testing import CliRunner

    from llmctl.cli import app

    r = CliRunner().invoke(app, ["train", "-b", "abc"])
    assert r.exit_code == 2
    error, hint = r.output.splitlines()[-2:]
    assert error == "Error: -b/--batch-size: 'abc' is not an integer"
    assert hint == "Hint: run 'llmctl train --help'"


@pytest.mark.parametrize("argv", [[], ["train"], ["sample"], ["export"], ["eval", "loss"]],
                         ids=["llmctl", "train", "sample", "export", "eval loss"])
def test_help_names_a_value_only_after_options_that_take_one(tmp_path, argv):
    """typer labels every option with its type; a flag (--help, --json, --version) takes none."""
    code, out, err = _run([*argv, "--help"], cwd=tmp_path)
    assert code == 0, err
    rows = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("│ --")}
    assert "--help" in rows and "<" not in rows["--help"]
    assert not any("<bool>" in row for row in rows.values()), out
    if argv == ["train"]:
        assert "<int>" in rows["--batch-size"] and "<str>" in rows["--output-dir"]
        assert "<" not in rows["--json"]


def test_help_and_a_bare_llmctl_still_show_the_help(tmp_path):
    code, out, err = _run(["train", "--help"], cwd=tmp_path)
    assert code == 0 and "--batch-size" in out and err == ""
    code, out, err = _run([], cwd=tmp_path)
    assert code == 2 and "Usage: llmctl" in out + err and "Error" not in out + err


# ---------------------------------------------------------------------------------------------
# every error a user can meet carries a Hint

def _eval_file_truncated(d):
    from llmctl import formats

    path = d / "hs.bin"
    formats.write_evalfile(path, [dict(label=0, ctx_tokens=[5], ending_tokens=[[1], [2], [3], [4]])] * 3)
    path.write_bytes(path.read_bytes()[:-40])
    return ["eval", "hellaswag", "-e", "d6", "-i", str(path)]


@pytest.mark.parametrize("make_argv", [
    lambda d: ["eval", "hellaswag", "-e", "d6", "--norm", "foo"],
    lambda d: ["eval", "hellaswag", "-e", "d6", "--per-example", "--nproc", "2", "--threads", "1"],
    lambda d: ["train", "-e", "d6", "--nproc", "0"],
    _eval_file_truncated,
    lambda d: (d / "l.jsonl").write_text("[1, 2, 3]\n") and ["prepro", "hellaswag", "--source", str(d / "l.jsonl"),
                                                              "--out-dir", str(d / "o")],
    lambda d: (d / "b.jsonl").write_text('{"ctx": "a", "label": 9, "endings": ["x"]}\n') and
    ["prepro", "hellaswag", "--source", str(d / "b.jsonl"), "--out-dir", str(d / "o")],
    lambda d: (d / "m.jsonl").write_text('{"step": 0, "train_loss": 3.5}\n') and
    ["plot", str(d / "m.jsonl"), "--x", "foo", "-o", str(d / "p.png")],
    lambda d: (d / "m.jsonl").write_text('{"step": 0, "train_loss": 3.5}\n') and
    ["plot", str(d / "m.jsonl"), "--terminal", "--width", "5"],
    lambda d: (d / "t.txt").write_text("hello\n") and ["prepro", "text", str(d / "t.txt"), "--val-tokens", "0",
                                                         "--out-dir", str(d / "o")],
    lambda d: (d / "t.txt").write_text("hello\n") and ["prepro", "text", str(d / "t.txt"), "-s", str(2**40),
                                                         "--out-dir", str(d / "o")],
    lambda d: (d / "t.txt").write_text("hello\n") and ["prepro", "text", str(d / "t.txt"), "--name", "../x",
                                                         "--out-dir", str(d / "o")],
    lambda d: (d / "t.txt").write_text("hello\n") and ["prepro", "text", str(d / "t.txt"), "--backend", "foo",
                                                         "--out-dir", str(d / "o")],
    lambda d: (d / "t.jsonl").write_text("[1]\n") and ["prepro", "text", str(d / "t.jsonl"), "--out-dir", str(d / "o")],
], ids=["norm", "per-example-nproc", "train-nproc-0", "eval-file-truncated", "jsonl-list", "jsonl-1-ending",
        "plot-x", "plot-width", "text-val-0", "text-shard-2^40", "text-name-path", "text-backend", "text-jsonl-list"])
def test_error_is_one_error_line_and_a_hint(tmp_path, capsys, make_argv):
    from llmctl.cli import main

    argv = make_argv(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code in (1, 2) and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("Hint: "), err
    assert "Traceback" not in err and "list indices" not in err


def test_eval_hellaswag_that_cannot_write_its_default_input_hints_at_eval_s_own_flags(tmp_path, monkeypatch, capsys):
    # no -i: data/hellaswag_val.bin is written first from the cached jsonl, here a broken one
    from llmctl.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "hellaswag_val.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit) as e:
        main(["eval", "hellaswag", "-e", "d6", "--json"])
    out, err = capsys.readouterr()
    assert out == ""
    assert_cli_error(err, 1, e.value.code, names=["data/hellaswag_val.jsonl:1", "llmctl prepro hellaswag --source PATH",
                                                  "-i EVAL_FILE"])


# what the Error line names: the flag and the value (for -d, B*T*P spelled out)
@pytest.mark.parametrize("bad, names", [
    (["-b", "0"], ["-b", "0"]),
    (["-d", "64"], ["-d 64", "4*16*2 = 128"]),
    (["--precision", "fp8"], ["'fp8'"]),
])
def test_train_nproc_2_rejects_bad_settings_before_spawning_a_rank(tmp_path, capsys, bad, names):
    from llmctl import formats
    from llmctl.cli import main

    formats.write_datafile(tmp_path / "t.bin", list(range(1000)))
    with pytest.raises(SystemExit) as e:
        main(["train", "-i", str(tmp_path / "t.bin"), "-j", str(tmp_path / "t.bin"), "-e", "d6", "-t", "16",
              "--nproc", "2", "--threads", "1", *bad])
    out, err = capsys.readouterr()
    assert out == ""
    error, _ = assert_cli_error(err, 2, e.value.code, names=names)
    assert err.splitlines()[0] == error and all(n in error for n in names) and "rank 0" not in err


_MODEL_SHARED = {"checkpoint", "threads", "precision", "json_out"}


@pytest.mark.parametrize("path, config, shared", [
    (("sample",), "sample_config.SampleConfig", _MODEL_SHARED),
    (("eval", "hellaswag"), "eval_config.HellaswagConfig", _MODEL_SHARED),
    (("eval", "loss"), "eval_config.EvalLossConfig", _MODEL_SHARED),
    (("prepro", "tinyshakespeare"), "prepro_config.TinyShakespeareConfig", {"json_out"}),
    (("prepro", "hellaswag"), "prepro_config.HellaswagPreproConfig", {"json_out"}),
    (("prepro", "text"), "prepro_config.TextConfig", {"json_out"}),
    (("prepro", "tinystories"), "prepro_config.TinyStoriesConfig", {"json_out"}),
    (("prepro", "fineweb"), "prepro_config.FinewebConfig", {"json_out"}),
    (("prepro", "fineweb-edu"), "prepro_config.FinewebEduConfig", {"json_out"}),
    (("prepro", "tokenizer"), "prepro_config.TokenizerConfig", {"json_out"}),
    (("prepro", "gpt2"), "prepro_config.Gpt2Config", {"json_out"}),
    (("export",), "export_config.ExportConfig", {"json_out"}),
    (("inspect-bin",), "inspect_bin_config.InspectBinConfig", {"json_out"}),
    (("plot",), "plot_config.PlotConfig", {"json_out"}),  # and its click context (not a parameter)
])
def test_commands_are_generated_from_their_config_plus_the_shared_options(path, config, shared):
    """Each command is generated from a config dataclass as train is from TrainConfig: each
    field's flags (or, for an `arg` field, its argument), default and help are its parameter's;
    the rest are the shared options (model commands: -e, --threads, --precision, --json)."""
    import importlib
    from dataclasses import MISSING, fields

    import typer.main

    from llmctl.cli import app

    module, name = config.split(".")
    cls = getattr(importlib.import_module(f"llmctl.{module}"), name)
    cmd = typer.main.get_command(app)
    for word in path:
        cmd = cmd.commands[word]
    params = {p.name: p for p in cmd.params}
    for f in fields(cls):
        p = params.pop(f.name)
        if f.metadata.get("argument"):
            assert p.param_type_name == "argument" and p.required == (f.default is MISSING), f.name
        else:
            assert sorted(p.opts + p.secondary_opts) == sorted(f.metadata["flags"]), f.name
        assert p.help == f.metadata["help"], f.name
        assert f.default is MISSING or p.default == f.default, f.name
    assert set(params) == shared
