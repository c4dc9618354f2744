"""The user's command lines, exactly as written, from an empty directory, offline.

    llmctl prepro tinyshakespeare
    llmctl train -i 'data/*.bin' -b 4 -t 64
    llmctl inspect-bin
    llmctl eval hellaswag

What a fresh machine would download is put where llmctl looks first: the Tiny Shakespeare text at
data/tiny_shakespeare.txt (the first part of the real file, so the epoch the train line runs is
short), the first HellaSwag examples at data/hellaswag_val.jsonl, and instead of GPT-2 124M a
tiny GPT-2 in a real Hugging Face hub cache as openai-community/gpt2 (written with safetensors;
the real huggingface_hub reads it with HF_HUB_OFFLINE=1). No gpt2_124M.bin is in the directory,
so both train and eval take pretrained `gpt2`, as on a fresh machine. The commands are real
subprocesses; nothing is faked.
"""
import os
import re
import subprocess
import sys

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


def tiny_pretrained_gpt2(hf_home, work):
    """A 1-layer GPT-2 with GPT-2's vocabulary in HF's layout, cached as openai-community/gpt2."""
    from hfmodels import hub_cache, random_hf_tensors, save_hf_model, tiny_config

    cfg = tiny_config(L=1, C=16, NH=2, maxT=64, V=50257)
    d = save_hf_model(work / "hf_model", cfg, random_hf_tensors(cfg, std=0.02))
    hub_cache(hf_home, "openai-community/gpt2", {"config.json": d / "config.json",
                                                 "model.safetensors": d / "model.safetensors"})


@pytest.fixture
def fresh_directory(tmp_path, monkeypatch):
    """An empty working directory with the caches a first run (with network) would have filled."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # never the machine's own caches
    tiny_pretrained_gpt2(tmp_path / "hf_home", tmp_path)
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
    assert re.fullmatch(r"\S+/openai-community--gpt2/\S+/gpt2_808K\.bin \(no -e: pretrained gpt2 \(GPT-2 124M\)\)",
                        header["init"]), header["init"]  # 808K: the tiny model stands in for 124M
    n_train = (os.path.getsize("data/tiny_shakespeare_train.bin") - 1024) // 2
    steps = (n_train - 1) // (4 * 64)  # -x -1: one epoch of the train shard
    assert header["num_steps"] == str(steps) and f"step {steps:4d}/{steps} |" in r.stderr
    assert r.stderr.count("val loss ") == 2  # -v 20: at step 0 and at the last step

    r = llmctl("inspect-bin")
    assert "checking the 2 .bin file(s) under data/" in r.stderr
    assert r.stdout.count(": shard ok:") == 2

    r = llmctl("eval", "hellaswag")
    assert "data/hellaswag_val.bin is missing: writing it first" in r.stderr
    assert re.search(r"model: \S+/gpt2_808K\.bin \(no -e: pretrained gpt2 \(GPT-2 124M\)\)", r.stderr), r.stderr
    assert os.path.isfile("data/hellaswag_val.bin")
    m = re.match(r"acc_norm: (\d+)/20 = (0\.\d{4})  \(norm: tokens\)\nacc:      (\d+)/20 = ", r.stdout)
    assert m and int(m[1]) / 20 == pytest.approx(float(m[2])), r.stdout

    # now the glob also matches the eval file: it is left out with a one-line note
    r = llmctl("train", "-i", "data/*.bin", "-b", "4", "-t", "64", "-x", "1", "-v", "0", "-s", "0")
    notes = [ln for ln in r.stderr.splitlines() if "hellaswag_val.bin" in ln]
    assert len(notes) == 1 and "left out" in notes[0] and "an eval file" in notes[0], r.stderr[-2000:]
