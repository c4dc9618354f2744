"""The tiny training setup the tests/test_train_*.py files share.

A byte-level GPT-2 (L=2, C=32, NH=2, maxT=32, V=Vp=256) written in llm.c's checkpoint layout
independently of llmctl.formats, its uint16 shards, the TrainConfig and `llmctl train`
arguments of a run on them, ways to run it (the CLI in this process, a `--nproc 2` job), the
files a run leaves, a HellaSwag eval file of Shakespeare bytes, and a display that sends Ctrl-C.
The `data` fixture (tests/conftest.py) builds the shards and checkpoint from the real Tiny
Shakespeare text. It holds no tests.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import shared_file
from llmctl.display import Display
from llmctl.train import TrainConfig

TINY = dict(maxT=32, V=256, Vp=256, L=2, NH=2, C=32)


def n_params(maxT, V, Vp, L, NH, C):
    return Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C


def write_llmc_checkpoint(path, params, version=3, **cfg):
    """train_gpt2.py's write_model layout, written independently of llmctl.formats."""
    c = {**TINY, **cfg}
    header = np.zeros(256, dtype="<i4")
    header[:8] = [20240326, version, c["maxT"], c["V"], c["L"], c["NH"], c["C"], c["Vp"]]
    p = np.asarray(params, dtype=np.float32)
    payload = p.astype("<f4").tobytes() if version == 3 else \
        (p.view(np.uint32) >> 16).astype("<u2").tobytes()  # bf16 by truncation is still valid bf16
    Path(path).write_bytes(header.tobytes() + payload)
    return str(path)


def tiny_params(seed=0, **cfg):
    """GPT-2-like init: N(0, 0.02) weights, unit LayerNorm weights, zero biases."""
    c = {**TINY, **cfg}
    maxT, Vp, L, C = c["maxT"], c["Vp"], c["L"], c["C"]
    rs = np.random.default_rng(seed)
    sizes = [("wte", Vp * C), ("wpe", maxT * C), ("ln1w", L * C), ("ln1b", L * C),
             ("qkvw", L * 3 * C * C), ("qkvb", L * 3 * C), ("attprojw", L * C * C), ("attprojb", L * C),
             ("ln2w", L * C), ("ln2b", L * C), ("fcw", L * 4 * C * C), ("fcb", L * 4 * C),
             ("fcprojw", L * 4 * C * C), ("fcprojb", L * C), ("lnfw", C), ("lnfb", C)]
    parts = []
    for name, n in sizes:
        if name in ("ln1w", "ln2w", "lnfw"):
            parts.append(np.ones(n, np.float32))
        elif name.endswith("b"):
            parts.append(np.zeros(n, np.float32))
        else:
            parts.append((rs.standard_normal(n) * 0.02).astype(np.float32))
    return np.concatenate(parts)


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(tokens)]
    Path(path).write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())
    return str(path)


def cfg_for(data, out=None, **kw):
    base = dict(train_data=data["train"], val_data=data["val"], init=data["ckpt"],
                output_dir=None if out is None else str(out), batch_size=4, seq_len=32,
                max_steps=12, val_loss_every=4, val_max_steps=2, sample_every=0, gen_tokens=8,
                learning_rate=3e-3, threads=1)
    base.update(kw)
    return TrainConfig(**base)


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def no_timing(recs):
    return [{k: v for k, v in r.items() if k not in ("ms", "tokens_per_s", "mfu", "allreduce_ms", "adamw_ms")} for r in recs]


class _StopAfter(Display):
    """Sends this process SIGINT while step `k` runs: exercises the real Ctrl-C path."""

    def __init__(self, k):
        self.k = k

    def step(self, rec):
        if rec["step"] == self.k:
            os.kill(os.getpid(), signal.SIGINT)


def _model_loss(path, data):
    """Loss of checkpoint `path` on the first val batch (finite for a usable checkpoint)."""
    from llmctl.loader import DataLoader
    from llmctl.model import load

    x, y = DataLoader(data["val"], 4, 32, shuffle=False).next_batch()
    return float(load(str(path), n_threads=1).forward(x, y))


def train_nproc2(data, out, *flags):
    """`llmctl train --nproc 2` over the real shared-memory all-reduce, 1 thread per rank, on the
    byte-level data. LLMCTL_DIST_CHECK_PARAMS=1: after every step the job checks that both ranks
    hold bit-identical parameters and fails if not."""
    r = subprocess.run([sys.executable, "-m", "llmctl", "train", "-i", data["train"],
                        "-j", data["val"], "-e", data["ckpt"], "-b", "2", "-t", "32", "-l", "3e-3",
                        "-s", "0", "--threads", "1", "--nproc", "2", "--backend", "shm",
                        "-o", str(out), *flags], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LLMCTL_DIST_CHECK_PARAMS="1"))
    assert r.returncode == 0, r.stderr
    return r


def write_hellaswag(path, n=7, seed=0, ctx_len=None):
    """n multiple-choice examples of Shakespeare bytes (V = 256) in llm.c's eval file format:
    a context, its true continuation at a varying label, and 3 continuations from elsewhere."""
    from llmctl.formats import write_evalfile

    text = np.frombuffer(shared_file("tinyshakespeare/input.txt").read_bytes()[:20000], np.uint8)
    rs = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        nc = ctx_len or int(rs.integers(8, 15))
        at = int(rs.integers(0, len(text) - 64))
        ends = [text[o:o + int(rs.integers(2, 7))].tolist()
                for o in rs.integers(0, len(text) - 8, 4)]
        label = i % 4
        ends[label] = text[at + nc:at + nc + len(ends[label])].tolist()
        examples.append({"label": label, "ctx_tokens": text[at:at + nc].tolist(),
                         "ending_tokens": ends})
    write_evalfile(str(path), examples)
    return str(path)


def run_cli(args, capsys):
    from llmctl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train"] + args)
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def _base(data, **over):
    """`llmctl train` arguments for the tiny run; a flag mapped to None is given without a value."""
    a = {"-i": data["train"], "-j": data["val"], "-e": data["ckpt"], "-b": "4", "-t": "32",
         "-x": "2", "-v": "0", "-s": "0", "--threads": "1"}
    a.update(over)
    return [x for kv in a.items() for x in kv if x is not None]


def _one_error(err):
    assert "Traceback" not in err, err
    errors = [l for l in err.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1, err
    return errors[0]
