"""Files a run writes (main.log, metrics.jsonl, checkpoints in llm.c's layout, checked with
struct/NumPy, not llmctl.formats), bit-exact resume, and the rules for -o, -y and --overwrite.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import math
import os
import signal
import struct
from pathlib import Path

import numpy as np
import pytest

from errcheck import assert_cli_error
from trainkit import (TINY, n_params, write_llmc_checkpoint, tiny_params, cfg_for, metrics, no_timing,
    _StopAfter, run_cli, _base, _one_error)
from llmctl.errors import FormatError
from llmctl.train import TrainInterrupted, train


def test_run_writes_llmc_files(data, tmp_path):
    out = tmp_path / "run"
    s = train(cfg_for(data, out, max_steps=8, checkpoint_every=2, checkpoints_keep=2,
                      major_checkpoint_every=4, sample_every=4))
    assert s["steps_run"] == 8 and s["checkpoint"].endswith("model_00000008.bin")
    names = sorted(os.listdir(out))
    # -nk 2 keeps the last two (6, 8); -nm 4 keeps step 4 forever; step 2 is deleted
    assert [n for n in names if n.startswith("DONE_")] == ["DONE_00000004", "DONE_00000006", "DONE_00000008"]
    assert "model_00000002.bin" not in names and "state_00000002_00000.bin" not in names
    assert not [n for n in names if ".tmp" in n or n.startswith(".")]
    assert (out / "DONE_00000008").stat().st_size == 0

    # main.log: llm.c's exact line formats
    log = (out / "main.log").read_text().splitlines()
    assert log[0].startswith("s:0 tel:") and log[1].startswith("s:0 trl:")
    import re
    for line in log:
        assert re.fullmatch(r"s:\d+ (tel:\d+\.\d{4}|trl:\d+\.\d{4} lr:\d+\.\d{6} norm:\d+\.\d{2})", line), line
    assert log[-1].startswith("s:8 tel:")

    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(9))
    for r in recs[:8]:
        assert set(r) >= {"step", "train_loss", "lr", "grad_norm", "ms", "tokens_per_s", "mfu"}
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"]
    assert "val_loss" in recs[0] and "val_loss" in recs[4] and "val_loss" not in recs[1]
    assert set(recs[8]) == {"step", "val_loss"}
    # main.log rounds what metrics.jsonl holds at full precision
    assert log[1] == (f"s:0 trl:{recs[0]['train_loss']:.4f} lr:{recs[0]['lr']:.6f} "
                      f"norm:{recs[0]['grad_norm']:.2f}")

    # model_%08d.bin: llm.c header, exact size, loads back into llmctl with the trained params
    mp = out / "model_00000008.bin"
    hdr = np.frombuffer(mp.read_bytes()[:1024], dtype="<i4")
    N = n_params(**TINY)
    assert hdr[:8].tolist() == [20240326, 3, 32, 256, 2, 2, 32, 256] and not hdr[8:].any()
    assert mp.stat().st_size == 1024 + 4 * N
    from llmctl.model import GPT2

    m = GPT2.from_checkpoint(str(mp), n_threads=1)
    assert m.num_parameters == N and np.isfinite(m.params).all()
    assert not np.array_equal(m.params, tiny_params())  # it trained

    # state_%08d_%05d.bin: llm.c's save_state layout
    sp = out / "state_00000008_00000.bin"
    raw = sp.read_bytes()
    h = np.frombuffer(raw[:1024], dtype="<i4")
    assert h[:6].tolist() == [20240527, 1, 1, 0, 0, 1] and h[10] == 8
    shard_idx, sample_idx = struct.unpack_from("<QQ", raw, 120)
    assert shard_idx in (0, 1) and sample_idx > 0
    off = 1024 + 8 * N
    (nshards,) = struct.unpack_from("<Q", raw, off)
    assert nshards == 2
    shard_indices = np.frombuffer(raw, "<i4", 2, off + 8)
    assert sorted(shard_indices.tolist()) == [0, 1]
    (nsamp,) = struct.unpack_from("<Q", raw, off + 16)
    assert len(raw) == off + 8 + 8 + 8 + 4 * nsamp + 2520
    m_state = np.frombuffer(raw, "<f4", N, 1024)
    assert np.abs(m_state).sum() > 0  # AdamW m was saved


def test_llmc_checkpoints_load_fp32_and_bf16(data, tmp_path):
    # a checkpoint as llm.c's tools write it, fp32 (v3) and bf16 (v5: llm.c's default -e)
    p = tiny_params(seed=3)
    for version in (3, 5):
        ck = write_llmc_checkpoint(tmp_path / f"v{version}.bin", p, version=version)
        s = train(cfg_for(data, init=ck, max_steps=2, val_loss_every=0))
        assert s["steps_run"] == 2 and math.isfinite(s["train_loss"])
    from llmctl.model import load

    m = load(str(tmp_path / "v5.bin"), n_threads=1)
    assert np.array_equal(m.params.view(np.uint32), p.view(np.uint32) & np.uint32(0xFFFF0000))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bit_exact_resume(data, tmp_path, monkeypatch, precision):
    from llmctl._ext import matmul

    if precision == "bf16" and not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")  # the same numerics on fp32 GEMMs
    kw = dict(max_steps=12, checkpoint_every=12, lr_scheduler="cosine", warmup_iters=2,
              final_lr_frac=0.1, weight_decay=0.1, sample_every=6, gen_tokens=6,
              total_batch_size=2 * 4 * 32, precision=precision)  # gradient accumulation too
    a, b = tmp_path / "straight", tmp_path / "split"
    train(cfg_for(data, a, **kw))

    prev = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainInterrupted):
        train(cfg_for(data, b, **kw), display=_StopAfter(5))
    assert signal.getsignal(signal.SIGINT) is prev  # handler restored
    assert (b / "DONE_00000006").exists() and not (b / "DONE_00000012").exists()
    s = train(cfg_for(data, b, resume=1, **kw))
    assert s["start_step"] == 6 and s["steps_run"] == 6

    for name in ("model_00000012.bin", "state_00000012_00000.bin", "main.log"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert no_timing(metrics(a)) == no_timing(metrics(b))


def write_llmc_state(path, step, m, v, loader_state, master=None):
    """train_gpt2.cu save_state's layout, by hand: header, m, v, [master], shuffle state."""
    h = np.zeros(256, dtype="<i4")
    h[:6] = [20240527, 1, 1, 0, int(master is not None), 1]
    h[10] = step
    raw = bytearray(h.tobytes())
    struct.pack_into("<QQ", raw, 80, 13371337, 13371337)
    struct.pack_into("<QQ", raw, 120, loader_state["current_shard_idx"], loader_state["current_sample_idx"])
    parts = [bytes(raw), m.astype("<f4").tobytes(), v.astype("<f4").tobytes()]
    if master is not None:
        parts.append(master.astype("<f4").tobytes())
    si, ii = loader_state["shard_indices"], loader_state["intra_shard_indices"]
    parts += [struct.pack("<Q", si.size), si.astype("<i4").tobytes(),
              struct.pack("<Q", ii.size), ii.astype("<i4").tobytes(), loader_state["rng_state"]]
    Path(path).write_bytes(b"".join(parts))


def test_resume_llmc_state_with_master_weights(data, tmp_path):
    """llm.c's bf16 runs keep fp32 master weights in the state file: they are the parameters."""
    from llmctl.loader import DataLoader

    dl = DataLoader(data["train"], 4, 32)
    for _ in range(3):
        dl.next_batch()
    st = dl.state()
    N = n_params(**TINY)
    rs = np.random.default_rng(1)
    m = (rs.standard_normal(N) * 1e-3).astype(np.float32)
    v = (rs.random(N) * 1e-6).astype(np.float32)
    master = tiny_params(seed=7)
    a, b = tmp_path / "with_master", tmp_path / "plain"
    for d, model_params, mw in ((a, tiny_params(seed=5), master), (b, master, None)):
        d.mkdir()
        write_llmc_checkpoint(d / "model_00000003.bin", model_params)
        write_llmc_state(d / "state_00000003_00000.bin", 3, m, v, st, master=mw)
        (d / "DONE_00000003").write_bytes(b"")
        s = train(cfg_for(data, d, resume=1, max_steps=5, checkpoint_every=5))
        assert s["start_step"] == 3 and s["steps_run"] == 2
    assert (a / "model_00000005.bin").read_bytes() == (b / "model_00000005.bin").read_bytes()


def test_corrupt_state_file_on_resume(data, tmp_path, capsys):
    out = tmp_path / "r"
    train(cfg_for(data, out, max_steps=2, checkpoint_every=2, val_loss_every=0))
    sp = out / "state_00000002_00000.bin"
    sp.write_bytes(sp.read_bytes()[:-100])
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-y": "1"}), capsys)
    assert_cli_error(err, 1, rc, names=str(sp))


@pytest.mark.parametrize("victim", ["model_00000004.bin", "state_00000004_00000.bin"])
def test_resume_from_a_damaged_checkpoint_hints_deleting_its_done(data, tmp_path, victim):
    out = tmp_path / "r"
    kw = dict(max_steps=4, checkpoint_every=2, val_loss_every=0)
    train(cfg_for(data, out, **kw))
    with open(out / victim, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(FormatError, match=victim) as e:
        train(cfg_for(data, out, resume=1, max_steps=6, checkpoint_every=2, val_loss_every=0))
    assert "DONE_00000004" in e.value.hint
    os.remove(out / "DONE_00000004")  # what the hint says: resume from step 2 instead
    s = train(cfg_for(data, out, resume=1, max_steps=6, checkpoint_every=2, val_loss_every=0))
    assert s["start_step"] == 2 and s["steps_run"] == 4


@pytest.mark.parametrize("blocker", ["main.log", "metrics.jsonl"])
def test_output_path_oserror_is_a_one_line_error(data, tmp_path, capsys, blocker):
    """A directory where llmctl writes a file (main.log: open(); metrics.jsonl: the atomic
    write's os.replace) is a DataError naming the path, not an IsADirectoryError traceback."""
    out = tmp_path / "mlog"
    (out / blocker).mkdir(parents=True)
    rc, _, err = run_cli(_base(data, **{"-o": str(out)}), capsys)
    assert rc == 1, err
    assert str(out / blocker) in _one_error(err) and "Hint:" in err
    assert not [n for n in os.listdir(out) if ".tmp" in n]


def test_atomic_write_oserror_names_the_path(tmp_path):
    from llmctl.errors import DataError
    from llmctl.atomic import atomic_write

    p = tmp_path / "missing_dir" / "DONE_00000002"
    with pytest.raises(DataError) as e:
        atomic_write(str(p), b"")
    assert str(p) in e.value.message


def test_claim_sweeps_the_temp_files_of_dead_writers_of_its_own_files(tmp_path):
    """A rank killed mid-write leaves atomic.py's .NAME.tmp-PID: the next run's claim of -o
    removes those of its own checkpoint files (rank 0: model, DONE_ and its state files; rank 1:
    its state files) whose pid is dead, and nothing else."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from llmctl.checkpoints import Checkpoints

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    names = {f".model_00000004.bin.tmp-{dead.pid}": 0, f".DONE_00000004.tmp-{dead.pid}": 0,
             f".state_00000004_00000.bin.tmp-{dead.pid}": 0,
             f".state_00000004_00001.outlier.json.tmp-{dead.pid}": 1,
             f".state_00000004_00001.bin.tmp-{dead.pid}": 1,
             f".state_00000004_00002.bin.tmp-{dead.pid}": None,    # another rank's
             f".state_00000004_00000.bin.tmp-{live}": None,         # a live writer's
             f".notes.txt.tmp-{dead.pid}": None, "model_00000002.bin": None}
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    for rank in (1, 0):
        Checkpoints(str(tmp_path), SimpleNamespace(rank=rank, world_size=3)).claim(resume=1)
        assert sorted(os.listdir(tmp_path)) == sorted(n for n, r in names.items() if r is None or r < rank)


def test_y0_refuses_an_output_dir_with_checkpoints(data, tmp_path, capsys):
    """llm.c overwrites silently and leaves the old run's later checkpoints for a later -y 1;
    llmctl refuses -y 0 into a directory holding DONE_* (usage error, nothing touched)."""
    out = tmp_path / "o"
    train(cfg_for(data, out, max_steps=4, checkpoint_every=2, val_loss_every=0))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-n": "1"}), capsys)
    assert rc == 2, err
    line = _one_error(err)
    assert str(out) in line and "DONE_00000004" in line
    assert_cli_error(err, names=["-y 1", "-o"])
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    # -y 1 still resumes (at step 4 of 4: nothing left to train, the files stay as they were)
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-y": "1", "-x": "4"}), capsys)
    assert rc == 0, err
    assert "resuming from the checkpoint at step 4" in err
    assert {n: (out / n).read_bytes() for n in os.listdir(out) if n != "main.log"} == \
        {n: b for n, b in before.items() if n != "main.log"}
    # --overwrite starts over there: the earlier run's checkpoints go, its logs are replaced
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-x": "1", "--overwrite": None}), capsys)
    assert rc == 0, err
    assert sorted(n for n in os.listdir(out) if n not in ("main.log", "metrics.jsonl")) == \
        ["DONE_00000001", "model_00000001.bin", "state_00000001_00000.bin"]
    assert [r["step"] for r in metrics(out)] == [0]  # -x 1 -v 0: one step, nothing at step 1
    assert len((out / "main.log").read_text().splitlines()) == 1


def test_y0_refuses_an_output_dir_with_an_earlier_run_s_logs(data, tmp_path, capsys):
    """main.log and metrics.jsonl without a checkpoint (a run that failed, or llm.c's): -y 0
    refuses to overwrite them, naming -y 1 and --overwrite; --overwrite replaces them."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "main.log").write_text("s:0 trl:5.5000 lr:0.000300 norm:1.00\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "train_loss": 5.5}\n')
    (out / "notes.txt").write_text("mine")
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out)}), capsys)
    assert rc == 2 and stdout == "", err
    assert _one_error(err) == (f"Error: output directory {out} already holds main.log and "
                               "metrics.jsonl of an earlier run, which -y 0 would overwrite")
    assert err.splitlines()[-1] == ("Hint: pass -y 1 to resume that run, --overwrite to replace it, "
                                    "or use a new or empty -o")
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    (out / "main.log").unlink()  # either log alone is an earlier run too
    rc, _, err = run_cli(_base(data, **{"-o": str(out)}), capsys)
    assert_cli_error(err, 2, rc, names=[str(out), "metrics.jsonl"])
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "--overwrite": None}), capsys)
    assert rc == 0, err
    assert [r["step"] for r in metrics(out)] == [0, 1] and (out / "notes.txt").read_text() == "mine"
    assert (out / "main.log").read_text().startswith("s:0 trl:") and (out / "DONE_00000002").is_file()


def test_overwrite_refuses_y1_and_an_init_it_would_delete(data, tmp_path, capsys):
    out = tmp_path / "o"
    train(cfg_for(data, out, max_steps=2, val_loss_every=0))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-y": "1", "--overwrite": None}), capsys)
    assert rc == 2 and "-y 1 resumes the run in -o, --overwrite replaces it" in _one_error(err)
    ckpt = str(out / "model_00000002.bin")
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-e": ckpt, "--overwrite": None}), capsys)
    assert rc == 2 and _one_error(err) == (f"Error: -e {ckpt} is a checkpoint in -o {out}, which "
                                           "--overwrite would delete before reading it")
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_checkpoint_every_without_output_dir_writes_nothing_and_says_so(data, tmp_path, monkeypatch, capsys):
    """llm.c writes no checkpoint for -n N without -o, silently; llmctl writes none either and
    prints one note saying -n needs -o."""
    work = tmp_path / "work"  # tmp_path also holds the test's $LLMCTL_CACHE (the MFU roofs)
    work.mkdir()
    monkeypatch.chdir(work)
    rc, out, err = run_cli(_base(data, **{"-n": "1"}), capsys)
    assert rc == 0, err
    notes = [ln for ln in err.splitlines() if "-n 1" in ln]
    assert notes == ["Note: -n 1 writes no checkpoint without -o DIR (checkpoints go into the output directory)"]
    assert os.listdir(work) == []  # nothing written where it runs
    rc, out, err = run_cli(_base(data, **{"-n": "1", "-o": str(tmp_path / "o")}), capsys)
    assert rc == 0 and "Note: -n" not in err and (tmp_path / "o" / "DONE_00000002").is_file()


@pytest.mark.parametrize("under", ["", "sub"])
def test_output_dir_that_is_a_file_is_one_error_naming_it(data, tmp_path, capsys, under):
    f = tmp_path / "run.txt"
    f.write_text("not a directory")
    out = f / under if under else f
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out)}), capsys)
    assert rc == 1 and stdout == "", err
    line = _one_error(err)
    assert line == (f"Error: output path {out} is a file, and -o must be a directory" if not under else
                    f"Error: output path {out}: {f} is a file, and -o must be a directory")
    assert err.splitlines()[-1].startswith("Hint: -o names the directory")
    assert f.read_text() == "not a directory" and os.listdir(tmp_path) == ["run.txt"]


def test_output_dir_without_n_keeps_the_final_model_and_state(data, tmp_path, capsys):
    """llm.c writes no checkpoint without -n; llmctl's -o always keeps the last step's (model,
    state, DONE), says where, and -y 1 resumes from it."""
    out = tmp_path / "o"
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out), "-x": "3"}), capsys)
    assert rc == 0, err
    assert sorted(n for n in os.listdir(out) if n not in ("main.log", "metrics.jsonl")) == \
        ["DONE_00000003", "model_00000003.bin", "state_00000003_00000.bin"]
    assert f"Writing checkpoint at step 3: {out / 'model_00000003.bin'}" in err.splitlines()
    from llmctl.model import GPT2

    m = GPT2.from_checkpoint(str(out / "model_00000003.bin"), n_threads=1)
    init = np.fromfile(data["ckpt"], dtype=np.float32)[256:]
    assert np.isfinite(m.params).all() and not np.array_equal(m.params, init)  # the trained weights
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out), "-x": "4", "-y": "1"}), capsys)
    assert rc == 0 and "resuming from the checkpoint at step 3" in err, err
    assert (out / "DONE_00000004").is_file()
