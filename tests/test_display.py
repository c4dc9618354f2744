"""What `llmctl train` shows: a rich live panel when stderr is a terminal, plain lines otherwise.

The terminal is a real pseudo-terminal (pty) the test opens; the plain case is a pipe. Both runs
train the same tiny model, and what they show is checked against the run's metrics.jsonl.
"""
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import numpy as np
import pytest

import loop_reference as LR
import reference as R

CFG = dict(max_seq_len=16, vocab_size=64, padded_vocab_size=128, num_layers=1, num_heads=2,
           channels=16)
STEPS = 3


@pytest.fixture
def run_args(tmp_path):
    LR.write_checkpoint(tmp_path / "init.bin", CFG, R.random_params(CFG, seed=0))
    rng = np.random.default_rng(0)
    LR.write_shard(tmp_path / "train.bin", rng.integers(0, 64, 200))
    LR.write_shard(tmp_path / "val.bin", rng.integers(0, 64, 100))

    def args(out):
        return [sys.executable, "-m", "llmctl", "train", "-i", str(tmp_path / "train.bin"),
                "-j", str(tmp_path / "val.bin"), "-e", str(tmp_path / "init.bin"), "-b", "2",
                "-t", "8", "-x", str(STEPS), "-v", "3", "-m", "2", "-s", "3", "-g", "5",
                "--threads", "1", "-o", str(tmp_path / out)]
    return args


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _run_on_a_terminal(cmd):
    """Run cmd with stderr on a fresh 40x120 pty; -> (returncode, stdout, terminal bytes)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="120")
    env.pop("NO_COLOR", None)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL,
                         env=env)
    os.close(slave)
    chunks = []
    while True:  # until the child closes the terminal (EIO on Linux) or it ends (b"")
        try:
            b = os.read(master, 65536)
        except OSError:
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    out = p.stdout.read()
    p.stdout.close()
    return p.wait(timeout=300), out, b"".join(chunks).decode("utf-8", "replace")


def test_a_pipe_gets_plain_lines_with_the_runs_numbers(run_args, tmp_path):
    r = subprocess.run(run_args("plain"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stderr  # no terminal control sequences in a log file
    recs = [x for x in _metrics(tmp_path / "plain") if "train_loss" in x]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("step ")]
    assert len(lines) == STEPS
    for ln, rec in zip(lines, recs):
        assert ln.startswith(f"step {rec['step'] + 1:4d}/{STEPS} | loss {rec['train_loss']:.6f} | "
                             f"norm {rec['grad_norm']:6.4f} | lr {rec['lr']:.2e} | ")
    val = [x["val_loss"] for x in _metrics(tmp_path / "plain") if "val_loss" in x]
    assert re.findall(r"^val loss (\S+)$", r.stderr, re.M) == [f"{v:.6f}" for v in val]
    assert re.search(r"^generating:\n---\n(\d+ ){3}\d+\n---$", r.stderr, re.M)
    assert "total average iteration time:" in r.stderr


def test_a_terminal_gets_the_rich_panel(run_args, tmp_path):
    code, out, screen = _run_on_a_terminal(run_args("rich"))
    assert code == 0, screen
    assert "\x1b[" in screen  # rich drew on the terminal (colours, cursor moves of the live panel)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert not re.search(r"^step +\d+/\d+ \|", text, re.M)  # not the plain lines
    assert "sample at step 3" in text and f"{STEPS}/{STEPS}" in text
    last = [x for x in _metrics(tmp_path / "rich") if "train_loss" in x][-1]
    assert f"{last['train_loss']:.4f}" in text and "average step time" in text
    assert out == b""  # results only on stdout; the panel is on stderr
