"""The user's command lines, exactly as written, from an empty directory, offline.

    llmctl prepro tinyshakespeare
    llmctl train -i 'data/*.bin' -b 4 -t 64
    llmctl inspect-bin
    llmctl eval hellaswag

What a fresh machine would download is put where llmctl looks first: the Tiny Shakespeare text at
data/tiny_shakespeare.txt (the first part of the real file, so the epoch the train line runs is
short), the first HellaSwag examples at data/hellaswag_val.jsonl, and instead of GPT-2 124M a
tiny GPT-2 written as gpt2_124M.bin in the working directory (llm.c's train_gpt2.c starts from
that file). The commands are real subprocesses; nothing is faked.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import shared_file

VAL_TOKENS = 32768  # tinyshakespeare.py's val split


def llmctl(*args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "llmctl", *args], capture_output=True, text=True,
                       env=env, timeout=600)
    if check:
        assert r.returncode == 0, f"llmctl {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r


def write_tiny_gpt2(path, maxT=64, seed=0):
    """A 1-layer GPT-2 with GPT-2's vocabulary, as an llm.c v3 checkpoint."""
    from llmctl.model import GPT2, GPT2Config

    cfg = GPT2Config(max_seq_len=maxT, vocab_size=50257, padded_vocab_size=50304, num_layers=1,
                     num_heads=2, channels=16)
    m = GPT2(cfg, n_threads=1)
    rng = np.random.default_rng(seed)
    m.params[:] = (rng.standard_normal(m.num_parameters) * 0.02).astype(np.float32)
    m.save_checkpoint(str(path))


@pytest.fixture
def fresh_directory(tmp_path, monkeypatch):
    """An empty working directory with the caches a first run (with network) would have filled."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # never the machine's own caches
    monkeypatch.setenv("LLMCTL_CACHE", str(tmp_path / "llmctl_cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    os.mkdir("data")
    text = shared_file("tinyshakespeare/input.txt").read_text(encoding="utf-8")
    with open("data/tiny_shakespeare.txt", "w", encoding="utf-8") as f:
        f.write(text[:120_000])  # ~36k tokens: the 32,768-token val split and ~13 steps of -b 4 -t 64
    with open(shared_file("hellaswag/hellaswag_val.jsonl"), encoding="utf-8") as f:
        lines = [next(f) for _ in range(20)]
    with open("data/hellaswag_val.jsonl", "w", encoding="utf-8") as f:
        f.writelines(lines)
    write_tiny_gpt2("gpt2_124M.bin")
    return work


@pytest.mark.slow
def test_the_four_lines_as_written(fresh_directory):
    r = llmctl("prepro", "tinyshakespeare")
    assert sorted(os.listdir("data")) == ["hellaswag_val.jsonl", "tiny_shakespeare.txt",
                                          "tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin"]
    assert "data/tiny_shakespeare.txt (from cache)" in r.stderr

    r = llmctl("train", "-i", "data/*.bin", "-b", "4", "-t", "64")
    header = {ln.split("|")[1].strip(): ln.split("|")[2].strip() for ln in r.stderr.splitlines()
              if ln.startswith("| ")}
    # the header says which files went where, and where the model came from
    assert header["train_data"] == "data/tiny_shakespeare_train.bin"
    assert header["val_data"] == "data/tiny_shakespeare_val.bin"
    assert header["init"] == "gpt2_124M.bin (no -e: gpt2_124M.bin in the working directory)"
    n_train = (os.path.getsize("data/tiny_shakespeare_train.bin") - 1024) // 2
    steps = (n_train - 1) // (4 * 64)  # -x -1: one epoch of the train shard
    assert header["num_steps"] == str(steps) and f"step {steps:4d}/{steps} |" in r.stderr
    assert r.stderr.count("val loss ") == 2  # -v 20: at step 0 and at the last step

    r = llmctl("inspect-bin")
    assert "checking the 2 .bin file(s) under data/" in r.stderr
    assert r.stdout.count(": shard ok:") == 2

    r = llmctl("eval", "hellaswag")
    assert "data/hellaswag_val.bin is missing: writing it first" in r.stderr
    assert "model: gpt2_124M.bin (no -e: gpt2_124M.bin in the working directory)" in r.stderr
    assert os.path.isfile("data/hellaswag_val.bin")
    m = re.match(r"acc_norm: (\d+)/20 = (0\.\d{4})  \(norm: tokens\)\nacc:      (\d+)/20 = ", r.stdout)
    assert m and int(m[1]) / 20 == pytest.approx(float(m[2])), r.stdout

    # now the glob also matches the eval file: it is left out with a one-line note
    r = llmctl("train", "-i", "data/*.bin", "-b", "4", "-t", "64", "-x", "1", "-v", "0", "-s", "0")
    notes = [ln for ln in r.stderr.splitlines() if "hellaswag_val.bin" in ln]
    assert len(notes) == 1 and "left out" in notes[0] and "an eval file" in notes[0], r.stderr[-2000:]
