"""`llmctl train` (llmctl/train.py, schedulers.py, display.py, the CLI command).

Runs use a tiny byte-level GPT-2 (L=2, C=32, NH=2, maxT=32, V=Vp=256) on the bytes of the real
Tiny Shakespeare text stored as an llm.c uint16 shard, and one thread: a step costs a few ms, so
whole training runs (resume, SIGINT, overfitting) fit the CI budget. Checkpoint bytes are checked
against llm.c's layout with struct/NumPy here, not through llmctl.formats.
"""
import glob
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import shared_file
from errcheck import assert_cli_error, assert_error, raises_error
from llmctl._ext import matmul as _matmul
from spikes import poisoned_trainer, unfused_update
from llmctl.display import Display, PlainDisplay
from llmctl.errors import ConfigError, FormatError
from llmctl.schedulers import get_learning_rate
from llmctl.train import TrainConfig, TrainingDiverged, TrainInterrupted, train

REPO = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    src = shared_file("tinyshakespeare/input.txt")
    d = tmp_path_factory.mktemp("bytes")
    b = np.frombuffer(src.read_bytes(), dtype=np.uint8).astype(np.uint16)
    # two train shards (exercises shard shuffling), one val shard
    write_shard(d / "ts_bytes_train_000001.bin", b[32768:400000])
    write_shard(d / "ts_bytes_train_000002.bin", b[400000:])
    write_shard(d / "ts_bytes_val_000000.bin", b[:32768])
    ckpt = write_llmc_checkpoint(d / "tiny.bin", tiny_params())
    return {"dir": d, "train": str(d / "ts_bytes_train_*.bin"),
            "val": str(d / "ts_bytes_val_*.bin"), "ckpt": ckpt}


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


# ---------------------------------------------------------------------------------------------
# learning-rate schedules (`llmc/schedulers.h`), against float64 formulas


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_schedules_match_formulas(kind):
    lr, W, N, q = 6e-4, 5, 50, 0.1
    lo = lr * q
    for step in range(N):
        got = get_learning_rate(kind, step, lr, W, N, q)
        if kind == "constant":
            want = lr
        elif step < W:
            want = lr * (step + 1) / W
        elif kind == "cosine":
            want = lo + 0.5 * (1 + math.cos(math.pi * (step - W) / (N - W))) * (lr - lo)
        elif kind == "linear":
            want = lr - (step - W) / (N - W) * (lr - lo)
        else:
            D = int(0.8 * N)
            want = lr if step < D else lo + (1 - math.sqrt((step - D) / (N - D))) * (lr - lo)
        # llm.c computes in float32: agree to float32 precision (a few ulps of lr)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12), (kind, step)


def test_default_cosine_is_constant_after_warmup():
    # llm.c's default final fraction 1.0 makes cosine flat
    assert {get_learning_rate("cosine", s, 3e-4, 0, 100, 1.0) for s in range(100)} == \
        {float(np.float32(3e-4))}


def test_unknown_schedule():
    with raises_error(ConfigError, names="'exp'"):
        get_learning_rate("exp", 0, 1e-3, 0, 10, 1.0)


def _out_of_range_cases():
    """(field, value, the flag the error must name) for every TrainConfig field with a range: each
    field checked by its metadata gets values just outside its range (and nan/inf for reals),
    then the ranges validate() checks with the other settings."""
    from dataclasses import fields

    from llmctl.info import usable_cores
    from llmctl.train_config import Range

    bad = {"positive": [0, -1], "nonnegative": [-1], "zscore": [-0.5, math.nan], "bool01": [2, -1]}
    cases = []
    for f in fields(TrainConfig):
        check = f.metadata["check"]
        if check is None:
            continue
        flag = f.metadata["flags"][0] if f.metadata["flags"] else f.metadata["long"]
        if isinstance(check, Range):
            values = [math.nan, -math.inf, check.lo if check.lo_open else check.lo - 0.5]
            values += [check.hi] if check.hi_open and math.isfinite(check.hi) else []
            values += [check.hi + 0.5] if not check.hi_open else []
        else:
            values = bad[check]
        cases += [(f.name, v, flag) for v in values]
    return cases + [("max_steps", -2, "-x"), ("val_max_steps", -2, "-m"), ("val_max_steps", 0, "-m"),
                    ("hellaswag_limit", 0, "--hellaswag-limit"), ("gen_tokens", 0, "-g"),
                    ("threads", 4 * usable_cores() + 1, "--threads"), ("total_batch_size", 5, "-d"),
                    ("resume", 1, "-o"), ("sampler", "random", "--sampler"), ("lr_scheduler", "exp", "-k")]


OUT_OF_RANGE = _out_of_range_cases()
OUT_OF_RANGE_CLI = [c for c in OUT_OF_RANGE if c[0] != "eps"]  # AdamW eps has no flag (as in llm.c)


@pytest.mark.parametrize("name, value, flag", OUT_OF_RANGE, ids=[f"{n}={v}" for n, v, _ in OUT_OF_RANGE])
def test_each_out_of_range_setting_is_an_error_with_a_hint_naming_the_flag(name, value, flag):
    from dataclasses import replace

    with pytest.raises(ConfigError) as e:
        replace(TrainConfig(), **{name: value}).validate(P=1)
    assert flag in e.value.message and e.value.exit_code == 2, e.value.message
    assert e.value.hint and flag in e.value.hint, (e.value.message, e.value.hint)


@pytest.mark.parametrize("name, value, flag", OUT_OF_RANGE_CLI, ids=[f"{n}={v}" for n, v, _ in OUT_OF_RANGE_CLI])
def test_each_out_of_range_flag_is_one_error_and_a_hint_from_llmctl_train(name, value, flag, tmp_path,
                                                                          monkeypatch, capsys):
    from dataclasses import fields

    from llmctl.cli import main

    f = {f.name: f for f in fields(TrainConfig)}[name]
    monkeypatch.chdir(tmp_path)  # nothing to train on here: only the check can answer
    with pytest.raises(SystemExit) as e:
        main(["train", f.metadata["flags"][0], str(value)])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 2, err
    assert err[0].startswith("Error: ") and flag in err[0] and err[1].startswith("Hint: "), err


def test_config_defaults_pass_and_every_range_check_names_its_flag():
    """TrainConfig's field metadata drive validate(): the defaults pass, and a value outside a
    field's range is a ConfigError (exit 2) naming that field's llm.c flag."""
    from dataclasses import fields, replace

    from llmctl.train_config import Range

    assert TrainConfig().validate(P=1) == (4 * 1024, 1)
    bad = {"positive": 0, "nonnegative": -1, "zscore": -0.5, "bool01": 2}
    checked = 0
    for f in fields(TrainConfig):
        check = f.metadata["check"]
        if check is None:
            continue
        v = math.nan if isinstance(check, Range) else bad[check]
        with pytest.raises(ConfigError) as e:
            replace(TrainConfig(), **{f.name: v}).validate(P=1)
        flag = f.metadata["flags"][0] if f.metadata["flags"] else f.metadata["long"]
        assert flag in e.value.message and e.value.exit_code == 2, (f.name, e.value.message)
        checked += 1
    assert checked == 20


def test_train_command_has_one_option_per_config_flag():
    """`llmctl train` is built from TrainConfig: each exposed field is an option with the
    field's flags (llm.c's short one first) and default, shown in --help."""
    from dataclasses import fields

    import typer

    from llmctl.cli import app

    cmd = typer.main.get_command(app).commands["train"]
    opts = {p.name: p for p in cmd.params}
    for f in fields(TrainConfig):
        m = f.metadata
        if not m["flags"]:
            assert f.name not in opts  # AdamW eps: hard-coded in llm.c, no flag
            continue
        o = opts[f.name]
        assert tuple(o.opts) == m["flags"] and o.help == m["help"], f.name
        assert o.default == m.get("cli_default", f.default), f.name


# ---------------------------------------------------------------------------------------------
# files: main.log, metrics.jsonl, checkpoints in llm.c's layout


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


# ---------------------------------------------------------------------------------------------
# bit-exact resume


class _StopAfter(Display):
    """Sends this process SIGINT while step `k` runs: exercises the real Ctrl-C path."""

    def __init__(self, k):
        self.k = k

    def step(self, rec):
        if rec["step"] == self.k:
            os.kill(os.getpid(), signal.SIGINT)


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


def test_sigint_subprocess_then_resume(data, tmp_path):
    """Ctrl-C on the real CLI: finishes the step, checkpoints, exits 130; -y 1 continues exactly."""
    out = tmp_path / "c"
    N = 600  # a few ms a step: seconds of steps left when the signal is sent after step 3
    args = [sys.executable, "-m", "llmctl", "train", "-i", data["train"], "-j", data["val"],
            "-e", data["ckpt"], "-b", "4", "-t", "32", "-x", str(N), "-v", "0", "-s", "0",
            "-l", "1e-3", "--threads", "1", "-o", str(out), "-n", str(N)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=str(tmp_path))
    mfile = out / "metrics.jsonl"
    deadline = time.time() + 180
    # SIGINT only once 3 steps are logged (the guard is installed) and the run is far from done;
    # frozen first (SIGSTOP), so it cannot run on to its end between the check and the signal
    logged = 0
    while time.time() < deadline and proc.poll() is None and logged < 3:
        logged = mfile.read_text().count("\n") if mfile.exists() else 0
        time.sleep(0.01)
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    assert logged >= 3, f"only {logged} steps logged in 180 s"
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Traceback" not in err
    assert err.count("stopping after this step (Ctrl-C again to abort)...") == 1, err
    k = max(int(n[5:]) for n in os.listdir(out) if n.startswith("DONE_"))
    assert 3 <= k < N
    assert len(metrics(out)) == k  # steps 0..k-1 were logged, nothing after the checkpoint

    r = subprocess.run(args + ["-y", "1"], capture_output=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr.decode()
    ref = tmp_path / "ref"
    train(cfg_for(data, ref, max_steps=N, val_loss_every=0, learning_rate=1e-3,
                  checkpoint_every=N))
    final = f"model_{N:08d}.bin"
    assert (out / final).read_bytes() == (ref / final).read_bytes()
    assert no_timing(metrics(out)) == no_timing(metrics(ref))


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


def test_loop_sets_comm_step_and_honours_stop_requested(data, tmp_path):
    """The hooks llmctl.distributed relies on: comm.step is the loop's step from the top of each
    iteration (heartbeats and errors name it), and comm.stop_requested (a launcher's coordinated
    Ctrl-C) ends the run after the current step with a checkpoint, as TrainInterrupted."""
    from llmctl.distributed.base import SingleProcessComm

    class Recorder(SingleProcessComm):
        def __init__(self):
            self.seen = []

        def all_reduce_sum_scalar(self, x):  # the val loss at the top of every step (-v 1)
            self.seen.append(self.step)
            self.stop_requested = self.step == 2
            return float(x)

    comm, out = Recorder(), tmp_path / "stop"
    with pytest.raises(TrainInterrupted, match="after step 3/10"):
        train(cfg_for(data, out, max_steps=10, val_loss_every=1), comm=comm)
    assert comm.seen == [0, 1, 2]
    assert (out / "DONE_00000003").exists() and len(metrics(out)) == 3


def test_two_ranks_share_updates_and_resume(data, tmp_path):
    """Two processes: identical weights after every step (checked by the job), different sample
    orders (rank r's shuffle is seeded 42 + r), one state file per rank; both ranks resumed from
    step 2 end in the straight run's step-4 files byte for byte; one process cannot resume them."""
    from llmctl.formats import read_state_file

    a, b = tmp_path / "a", tmp_path / "b"
    flags = ["-x", "4", "-n", "2", "-v", "2", "-m", "2"]
    train_nproc2(data, a, *flags)
    names = set(os.listdir(a))
    assert {"state_00000004_00000.bin", "state_00000004_00001.bin", "DONE_00000004",
            "model_00000004.bin", "main.log", "metrics.jsonl"} <= names
    s0, s1 = (read_state_file(str(a / f"state_00000004_0000{r}.bin")) for r in (0, 1))
    assert (s0.num_processes, s0.process_rank, s1.num_processes, s1.process_rank) == (2, 0, 2, 1)
    assert list(s0.intra_shard_indices) != list(s1.intra_shard_indices)
    b.mkdir()
    for n in ("model_00000002.bin", "state_00000002_00000.bin", "state_00000002_00001.bin",
              "DONE_00000002", "metrics.jsonl", "main.log"):
        shutil.copy(a / n, b / n)
    train_nproc2(data, b, "-y", "1", *flags)
    for n in ("model_00000004.bin", "state_00000004_00000.bin", "state_00000004_00001.bin"):
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    assert len(metrics(a)) == 5 and no_timing(metrics(b)) == no_timing(metrics(a))
    with pytest.raises(ConfigError, match="rank 0 of 2"):
        train(cfg_for(data, b, resume=1, batch_size=2, max_steps=4, checkpoint_every=2))


# ---------------------------------------------------------------------------------------------
# learning


def test_loss_falls_on_tinyshakespeare(data):
    s = train(cfg_for(data, max_steps=40, val_loss_every=40, val_max_steps=4))
    # byte-level: starts at ~ln(256) = 5.55; 40 steps at lr 3e-3 reach ~3.3 (val) in practice
    assert s["val_loss"] < 4.0


def test_overfit_single_batch(data, tmp_path):
    out = tmp_path / "a"
    train(cfg_for(data, out, max_steps=60, overfit_single_batch=1, learning_rate=1e-2,
                  val_loss_every=0))
    losses = [r["train_loss"] for r in metrics(out)]
    assert losses[0] > 5.0 and losses[-1] < 0.1  # memorises one batch of 128 bytes


def test_grad_accumulation_is_a_mean(data, tmp_path):
    # -a 1 reads the val split unshuffled from its start every step (train_gpt2.cu), and the
    # micro-steps of a step read consecutive batches: B=4 with 2 micro-steps sees rows 0-3 then
    # rows 4-7 of the same 8*32+1 tokens that B=8 sees in one batch, so both runs must report the
    # same loss and gradient norm (a sum instead of a mean would double both). Not bit-identical:
    # the kernels accumulate dW += ... in a different order; 1e-5 relative is float32 rounding
    # over 5 steps.
    a, b = tmp_path / "one", tmp_path / "two"
    train(cfg_for(data, a, max_steps=5, overfit_single_batch=1, val_loss_every=0, batch_size=8))
    train(cfg_for(data, b, max_steps=5, overfit_single_batch=1, val_loss_every=0,
                  total_batch_size=2 * 4 * 32))
    ma, mb = metrics(a), metrics(b)
    assert len(ma) == len(mb) == 5
    for ra, rb in zip(ma, mb):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5)
        assert rb["tokens_per_s"] > 0


def test_overfit_reads_the_val_split_like_train_gpt2_cu(data, tmp_path):
    """-a 1: the first loss is the loss of the val split's first batch (not of a train batch),
    and every step starts over at that batch: the loss of step k is the loss after k updates on
    those same tokens (checked by re-scoring each step's checkpoint on them)."""
    from llmctl.loader import DataLoader
    from llmctl.model import load

    out = tmp_path / "a"
    train(cfg_for(data, out, max_steps=3, overfit_single_batch=1, val_loss_every=0,
                  checkpoint_every=1))
    x, y = DataLoader(data["val"], 4, 32, shuffle=False).next_batch()
    losses = [r["train_loss"] for r in metrics(out)]
    for step, loss in enumerate(losses):
        ckpt = data["ckpt"] if step == 0 else str(out / f"model_{step:08d}.bin")
        assert loss == pytest.approx(float(load(ckpt, n_threads=1).forward(x, y)), rel=1e-6)


def _model_loss(path, data):
    """Loss of checkpoint `path` on the first val batch (finite for a usable checkpoint)."""
    from llmctl.loader import DataLoader
    from llmctl.model import load

    x, y = DataLoader(data["val"], 4, 32, shuffle=False).next_batch()
    return float(load(str(path), n_threads=1).forward(x, y))


def test_nan_never_names_a_poisoned_checkpoint(data, tmp_path):
    """The weights that produce a NaN loss at step s are those of checkpoint s, written at the top
    of the same iteration: it must be removed (DONE, model, state) and the error must name the
    newest checkpoint that is really complete, or say there is none, and use the display's
    step numbering (s+1/N)."""
    kw = dict(learning_rate=1e30, grad_clip=0.0, checkpoint_every=1, val_loss_every=0)
    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged) as e:
        train(cfg_for(data, out, max_steps=10, **kw))
    msg = e.value.message
    assert "no complete checkpoint exists" in msg, msg
    assert not [n for n in os.listdir(out) if n.startswith(("DONE_", "model_", "state_"))]
    assert not [n for n in os.listdir(out) if ".tmp" in n]
    # the step named is the display's ("step 1/10" is the first): the NaN comes after one update
    m = re.search(r"at step (\d+)/10", msg)
    assert m and int(m.group(1)) >= 2, msg

    # good checkpoints 1..3, then a resumed run blows up: it must name model_00000003, which
    # gives a finite loss, and leave no DONE beyond it (before the fix: "no checkpoint was
    # written", and DONE_00000004 of a NaN-producing model)
    out = tmp_path / "resumed"
    train(cfg_for(data, out, max_steps=3, checkpoint_every=1, val_loss_every=0))
    with pytest.raises(TrainingDiverged) as e:
        train(cfg_for(data, out, max_steps=10, resume=1, **kw))
    msg = e.value.message
    assert f"last good checkpoint: {out / 'model_00000003.bin'}" in msg, msg
    dones = sorted(n for n in os.listdir(out) if n.startswith("DONE_"))
    assert dones == ["DONE_00000001", "DONE_00000002", "DONE_00000003"]
    assert not (out / "model_00000004.bin").exists()
    assert not (out / "state_00000004_00000.bin").exists()
    assert math.isfinite(_model_loss(out / "model_00000003.bin", data))


def test_poisoned_weights_are_never_checkpointed(data, tmp_path):
    """Parameters that are already NaN/Inf (after a finite loss and an overflowing update) are
    refused at checkpoint time, before any file of that step is written."""
    from llmctl.train import Trainer

    out = tmp_path / "p"
    tr = Trainer(cfg_for(data, out, max_steps=4, checkpoint_every=2, val_loss_every=0))
    real_update = tr.model.update

    def update(*a, **k):
        real_update(*a, **k)
        if a[-1] == 2:  # the update of step 1 (AdamW t = step + 1)
            tr.model.params[5] = np.inf
    tr.model.update = update
    with pytest.raises(TrainingDiverged) as e:
        tr.run()
    assert "NaN/Inf" in e.value.message and "no complete checkpoint exists" in e.value.message
    assert not [n for n in os.listdir(out) if n.startswith(("DONE_", "model_", "state_"))]


# ---------------------------------------------------------------------------------------------
# HellaSwag during training (-h 1)


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


def test_hellaswag_during_training_logs_llmc_lines(data, tmp_path):
    """-h 1 -v 2 -x 4: HellaSwag at steps 2 and 4 (not 0), after val loss and before the step;
    each accuracy equals a direct eval_hellaswag call on that step's checkpoint."""
    import io

    from llmctl.evaluate import eval_hellaswag
    from llmctl.model import GPT2

    hs = write_hellaswag(tmp_path / "hs.bin")
    out = tmp_path / "run"
    buf = io.StringIO()
    s = train(cfg_for(data, out, max_steps=4, val_loss_every=2, checkpoint_every=2, hellaswag=1,
                      hellaswag_path=hs), display=PlainDisplay(buf))
    log = (out / "main.log").read_text().splitlines()
    evals = [(i, l) for i, l in enumerate(log) if " eval:" in l]
    assert [l.split()[0] for _, l in evals] == ["s:2", "s:4"]
    for i, line in evals:  # llm.c's order: tel, eval, then the step's trl (none after the last)
        assert log[i - 1].startswith(line.split()[0] + " tel:")
        assert i == len(log) - 1 or log[i + 1].startswith(line.split()[0] + " trl:")
    recs = metrics(out)
    assert [r["step"] for r in recs if "hellaswag_acc_norm" in r] == [2, 4]
    shown = [l for l in buf.getvalue().splitlines() if l.startswith("HellaSwag:")]
    assert len(shown) == 2
    for step, (_, line), msg in zip((2, 4), evals, shown):
        m = GPT2.from_checkpoint(str(out / f"model_{step:08d}.bin"), n_threads=1)
        want = eval_hellaswag(m, hs)
        assert recs[step]["hellaswag_acc_norm"] == want["acc_norm"]
        assert line == f"s:{step} eval:{want['acc_norm']:.4f}"
        # llm.c's printf0("HellaSwag: %d/%d = %f\n", ...)
        assert msg == f"HellaSwag: {want['correct_norm']}/7 = {want['acc_norm']:f}"
    assert s["hellaswag_acc_norm"] == recs[4]["hellaswag_acc_norm"]


def test_hellaswag_two_ranks_split_examples_and_limit(data, tmp_path):
    """Two processes (3 + 2 of the first 5 examples with --hellaswag-limit 5, counts summed) give
    the one-process accuracy of the same weights; with -v 0 HellaSwag runs only at the last step."""
    from llmctl.evaluate import eval_hellaswag
    from llmctl.model import GPT2

    hs = write_hellaswag(tmp_path / "hs.bin", n=9, seed=1)
    out = tmp_path / "r2"
    train_nproc2(data, out, "-x", "2", "-v", "0", "-n", "2", "-h", "1", "--hellaswag", hs,
                 "--hellaswag-limit", "5")
    recs = metrics(out)
    assert [r["step"] for r in recs if "hellaswag_acc_norm" in r] == [2]
    # no update follows the last step's eval: the final checkpoint holds the weights it scored
    model = GPT2.from_checkpoint(str(out / "model_00000002.bin"), n_threads=1)
    want = eval_hellaswag(model, hs, limit=5)
    assert want["num_examples"] == 5 and want["correct_norm"] > 0  # else a double count hides
    assert recs[2]["hellaswag_acc_norm"] == want["acc_norm"]
    assert (out / "main.log").read_text().splitlines()[-1] == f"s:2 eval:{want['acc_norm']:.4f}"


# ---------------------------------------------------------------------------------------------
# bad input through the CLI: one line, exit 1 or 2, nothing written


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


@pytest.mark.parametrize("case", ["no_match", "too_small", "T_gt_maxT", "d_not_multiple",
                                  "unwritable", "corrupt_ckpt", "bad_schedule", "resume_no_o",
                                  "hellaswag_missing", "hellaswag_too_long"])
def test_bad_input_one_line_error(data, tmp_path, capsys, case):
    out = tmp_path / "out"
    over = {"-o": str(out)}
    want = "no file matches"
    code = 1
    if case == "no_match":
        over["-i"] = str(tmp_path / "nothing_*.bin")
    elif case == "too_small":
        over["-i"] = write_shard(tmp_path / "small.bin", np.arange(100))
        want = "has 100 tokens but needs at least"
    elif case == "T_gt_maxT":
        over["-t"] = "64"
        want, code = "exceeds the model's maxT 32", 2
    elif case == "d_not_multiple":
        over["-d"] = "200"
        want, code = "not a positive multiple of B*T*P", 2
    elif case == "unwritable":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "sub"
        over["-o"] = str(out)
        want = f"{tmp_path / 'afile'} is a file, and -o must be a directory"
    elif case == "corrupt_ckpt":
        bad = tmp_path / "bad.bin"
        bad.write_bytes(Path(data["ckpt"]).read_bytes()[:5000])
        over["-e"] = str(bad)
        want = "bad.bin"
    elif case == "bad_schedule":
        over["-k"] = "exponential"
        want, code = "unknown learning-rate schedule", 2
    elif case == "resume_no_o":
        del over["-o"]
        over["-y"] = "1"
        want, code = "no -o was given", 2
    elif case == "hellaswag_missing":  # llm.c would skip HellaSwag silently
        over.update({"-h": "1", "--hellaswag": str(tmp_path / "hellaswag_val.bin")})
        want, code = "-h 1 needs the HellaSwag eval file", 2
    elif case == "hellaswag_too_long":
        over.update({"-h": "1", "--hellaswag": write_hellaswag(tmp_path / "hs.bin", ctx_len=30)})
        want, code = "but the model's maxT is 32", 2
    rc, stdout, err = run_cli(_base(data, **over), capsys)
    assert rc == code, err
    lines = [l for l in err.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("Error:")]
    assert len(errors) == 1 and want in errors[0], err
    assert "Traceback" not in err and stdout == ""
    assert not out.exists()  # checked before anything is created
    if case == "hellaswag_missing":
        assert f"Hint: create it with `llmctl prepro hellaswag --out-dir {tmp_path}`" in err


def test_corrupt_state_file_on_resume(data, tmp_path, capsys):
    out = tmp_path / "r"
    train(cfg_for(data, out, max_steps=2, checkpoint_every=2, val_loss_every=0))
    sp = out / "state_00000002_00000.bin"
    sp.write_bytes(sp.read_bytes()[:-100])
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-y": "1"}), capsys)
    assert_cli_error(err, 1, rc, names=str(sp))


def test_cli_subprocess_error_exit_code(data, tmp_path):
    r = subprocess.run([sys.executable, "-m", "llmctl", "train", "-i", str(tmp_path / "x*.bin"),
                        "-j", data["val"], "-e", data["ckpt"], "-t", "32"],
                       capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.startswith("Error: ")
    assert_cli_error(r.stderr, 1, r.returncode, names=str(tmp_path / "x*.bin"))


# ---------------------------------------------------------------------------------------------
# displays


def test_json_output_is_machine_readable(data, capsys):
    rc, out, err = run_cli(_base(data, **{"-x": "3", "-v": "2", "-m": "1", "-s": "3", "-g": "4"})
                           + ["--json"], capsys)
    assert rc == 0, err
    events = [json.loads(l) for l in out.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "summary"
    assert kinds.count("step") == 3 and kinds.count("val") == 3 and kinds.count("sample") == 1
    assert events[-1]["steps_run"] == 3  # val at 0, 2 and the last step (3)


def test_plain_display_lines():
    import io

    buf = io.StringIO()
    d = PlainDisplay(buf)
    d.step({"step": 0, "num_steps": 10, "train_loss": 5.5, "lr": 3e-4, "grad_norm": 1.25,
            "ms": 12.5, "tokens_per_s": 10240.0, "mfu": 0.05})
    d.val(0, 5.25)
    assert buf.getvalue().splitlines() == [
        "step    1/10 | loss 5.500000 | norm 1.2500 | lr 3.00e-04 | 12.50 ms | 5.0% fp32 MFU | 10240 tok/s",
        "val loss 5.250000"]


# ---------------------------------------------------------------------------------------------
# MFU: over the GEMM roof of the precision the run's matmuls multiply in

_NATIVE_BF16 = _matmul.bf16_native()


def _spy_bf16_matmul(monkeypatch):
    """Record the calls of the real matmul_forward_bf16 (it still runs)."""
    from llmctl._ext import matmul

    calls, real = [], matmul.matmul_forward_bf16

    def spy(*a, **k):
        calls.append(a[4:] + tuple(k.values()))
        return real(*a, **k)
    monkeypatch.setattr(matmul, "matmul_forward_bf16", spy)
    return calls


@pytest.mark.skipif(_NATIVE_BF16, reason="this CPU multiplies bf16 natively: bf16 is not emulated")
def test_peak_flops_of_emulated_bf16_is_the_fp32_roof(monkeypatch):
    # emulated bf16 multiplies widened operands in fp32 sgemm: the fp32 roof is its denominator
    import llmctl.mfu as tr

    monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    monkeypatch.setattr(tr, "_PEAK_CACHE", {})
    calls = _spy_bf16_matmul(monkeypatch)
    assert tr.mfu_roof_precision("bf16") == "fp32" == tr.mfu_roof_precision("fp32")
    bf16 = tr.measure_peak_flops(1, "bf16")
    assert bf16 > 0 and calls == []                   # no bf16 GEMM was timed
    assert tr.measure_peak_flops(1, "fp32") == bf16   # one fp32 measurement serves both
    assert list(tr._PEAK_CACHE) == [(1, "fp32")]


@pytest.mark.skipif(not _NATIVE_BF16, reason="no native bf16 on this CPU (AVX512_BF16/AMX): "
                                             "oneDNN's bf16 GEMM cannot run, so there is no bf16 roof")
def test_peak_flops_of_native_bf16_times_llmctls_bf16_matmul(monkeypatch):
    import llmctl.mfu as tr

    monkeypatch.setattr(tr, "_PEAK_CACHE", {})
    calls = _spy_bf16_matmul(monkeypatch)
    assert tr.mfu_roof_precision("bf16") == "bf16"
    peak = tr.measure_peak_flops(2, "bf16")
    # a warm-up and best of 3, each one 1024^3 bf16 GEMM on the native engine
    assert calls == [(1024, 1024, 1024, 2, "dnnl")] * 4 and peak > 0
    assert tr.measure_peak_flops(2, "fp32") > 0 and set(tr._PEAK_CACHE) == {(2, "bf16"), (2, "fp32")}
    assert len(calls) == 4   # the fp32 roof is NumPy's sgemm, not the bf16 kernel


def test_a_step_faster_than_the_peak_measures_the_peak_again_and_keeps_the_best(data, tmp_path, monkeypatch):
    """The peak is timed once at start-up in ~0.1 s; taken while other processes held the cores
    it reads low and MFU shows over 100 %. A step that beats it measures again (keeping the best
    of all measurements), at most PEAK_RECHECKS times a run."""
    import llmctl.train as tr

    asked = []

    def peak(n_threads, precision="fp32", again=False):
        asked.append(again)
        return 1.0 if not again else 1.0 + sum(asked)   # far below any real step's FLOP/s
    monkeypatch.setattr(tr, "measure_peak_flops", peak)
    train(cfg_for(data, tmp_path / "o", max_steps=6, val_loss_every=0))
    assert asked == [False] + [True] * tr.PEAK_RECHECKS
    recs = [r for r in metrics(tmp_path / "o") if "train_loss" in r]
    # tokens_per_s / mfu = peak * tokens / flops: the peak each step was divided by, up to a constant
    used = [r["tokens_per_s"] / r["mfu"] for r in recs]
    # step 0 beat 1.0 and measured 2.0, steps 1 and 2 measured 3.0 and 4.0, then no more re-checks
    assert [2.0 * u / used[0] for u in used] == pytest.approx([2.0, 3.0, 4.0, 4.0, 4.0, 4.0])

    # a real peak is not re-measured by ordinary steps (the tiny model runs far below it)
    asked.clear()
    monkeypatch.setattr(tr, "measure_peak_flops", lambda n, p="fp32", again=False: asked.append(again) or 1e15)
    train(cfg_for(data, tmp_path / "p", max_steps=3, val_loss_every=0))
    assert asked == [False]


def test_measure_peak_flops_again_keeps_the_best_measurement(monkeypatch):
    import llmctl.mfu as tr

    monkeypatch.setattr(tr, "_PEAK_CACHE", {(1, "fp32"): 1e18})   # an earlier, better reading
    assert tr.measure_peak_flops(1, "fp32") == 1e18                # cached
    assert tr.measure_peak_flops(1, "fp32", again=True) == 1e18    # measured anew, lower: kept
    tr._PEAK_CACHE[(1, "fp32")] = 1.0
    assert tr.measure_peak_flops(1, "fp32", again=True) > 1e6      # measured anew, higher: taken


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mfu_in_metrics_is_flops_over_time_over_the_peak_of_the_precision(data, tmp_path, monkeypatch,
                                                                          precision):
    import llmctl.train as tr

    if precision == "bf16" and not _NATIVE_BF16:
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    peaks, asked = {"fp32": 3.0e15, "bf16": 7.0e15}, []   # above any step's FLOP/s: never re-measured

    def peak(n_threads, precision="fp32", again=False):
        asked.append((n_threads, precision))
        return peaks[precision]
    monkeypatch.setattr(tr, "measure_peak_flops", peak)
    import io

    shown = io.StringIO()
    train(cfg_for(data, tmp_path / "o", max_steps=3, val_loss_every=0, total_batch_size=2 * 4 * 32,
                  precision=precision), display=PlainDisplay(shown))
    assert asked == [(1, precision)]
    # the step lines name the roof: bf16's only where bf16 multiplies natively
    roof = "bf16" if precision == "bf16" and _NATIVE_BF16 else "fp32"
    assert shown.getvalue().count(f"% {roof} MFU |") == 3, shown.getvalue()
    c = TINY
    N = n_params(**c)
    flops_per_step = (6 * N + 6 * c["L"] * c["C"] * 32) * 4 * 32 * 2   # llm.c's count, B=4 T=32, 2 micro-steps
    recs = [r for r in metrics(tmp_path / "o") if "train_loss" in r]
    assert len(recs) == 3
    for r in recs:
        assert r["mfu"] == pytest.approx(flops_per_step / (r["ms"] / 1000.0) / peaks[precision], rel=1e-12)


def test_mfu_is_over_the_best_roof_cached_for_this_cpu_and_the_header_says_so(data, tmp_path, monkeypatch):
    """A start-up measurement below the best one cached for this CPU (other processes held the
    cores) does not lower the roof: MFU stays comparable between runs, and the header names it."""
    import io

    import llmctl.train as tr
    from llmctl import roof

    roof.best_roof(5.0e15, 1, "fp32")  # an earlier run's better measurement, this CPU and engine
    monkeypatch.setattr(tr, "measure_peak_flops", lambda n, p="fp32", again=False: 3.0e15)
    shown = io.StringIO()
    train(cfg_for(data, tmp_path / "o", max_steps=2, val_loss_every=0), display=PlainDisplay(shown))
    recs = [r for r in metrics(tmp_path / "o") if "train_loss" in r]
    flops_per_step = (6 * n_params(**TINY) + 6 * TINY["L"] * TINY["C"] * 32) * 4 * 32
    for r in recs:
        assert r["mfu"] == pytest.approx(flops_per_step / (r["ms"] / 1000.0) / 5.0e15, rel=1e-12)
    path = roof.roof_path()
    header = [ln for ln in shown.getvalue().splitlines() if ln.startswith("| peak_flops")]
    assert len(header) == 1 and "5000000.0 GFLOP/s (fp32 GEMM 1024^3: best of 2 measurements on " \
        f"this CPU at 1 thread, cached in {path})" in header[0], header
    assert [e["measurements"] for e in roof.cached_roofs()] == [2]


def test_rich_display_renders():
    import io

    from rich.console import Console

    from llmctl.display import RichDisplay

    buf = io.StringIO()
    d = RichDisplay(Console(file=buf, force_terminal=True, width=100))
    d.start({"num_steps": 4, "start_step": 0})
    d.val(0, 5.0)
    d.step({"step": 0, "num_steps": 4, "train_loss": 5.5, "lr": 3e-4, "grad_norm": 1.0,
            "ms": 10.0, "tokens_per_s": 1000.0, "mfu": 0.01})
    d.sample(0, "hello")
    d.finish({"avg_ms": 10.0})
    text = buf.getvalue()
    assert "5.5000" in text and "hello" in text and "1/4" in text


# ---------------------------------------------------------------------------------------------
# -sl / -sg: llm.c's OutlierDetector (llmc/outlier_detector.h) and update skipping


def test_outlier_detector_matches_numpy_window():
    from llmctl.outlier import OutlierDetector

    rs = np.random.default_rng(7)
    xs = 3.0 + 0.3 * rs.standard_normal(600)
    xs[[200, 333, 334, 500]] += [4.0, -3.0, 6.0, 50.0]  # spikes enter the window too
    for W in (128, 5):
        det = OutlierDetector(W)
        for i, x in enumerate(xs):
            z = det.update(x)
            if i < W:
                assert math.isnan(z), (W, i)  # NaN until the window is full
                continue
            # llm.c: the new value replaces the oldest FIRST, z is against the window holding it,
            # population std. Running double sums vs NumPy's two-pass float64: the cancellation
            # in sum_sq/W - mean^2 (values ~3, var >= ~0.05) costs < 4 digits of 16, so 1e-9.
            win = xs[i - W + 1:i + 1]
            want = (x - win.mean()) / win.std(ddof=0)
            assert z == pytest.approx(want, rel=1e-9, abs=1e-9), (W, i)
            assert abs(z) <= math.sqrt(W - 1) + 1e-9  # a member's z is bounded: not "before adding"
    const = OutlierDetector(4)
    assert [const.update(2.5) for _ in range(6)][4:] == [0.0, 0.0]  # std exactly 0 -> 0.0


def test_outlier_detector_state_round_trips_bit_exactly():
    from llmctl.outlier import OutlierDetector

    rs = np.random.default_rng(1)
    xs = rs.standard_normal(300) * 0.1 + 1.0
    a, b = OutlierDetector(), OutlierDetector()
    for x in xs[:150]:
        a.update(x)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    za = [a.update(x) for x in xs[150:]]
    zb = [b.update(x) for x in xs[150:]]
    assert np.array_equal(np.array(za).view(np.uint64), np.array(zb).view(np.uint64))
    with pytest.raises(ValueError):
        OutlierDetector(64).load_state_dict(a.state_dict())


def test_skip_update_rule_is_llmcs_float32_test():
    from llmctl.outlier import skip_update

    assert skip_update(3.5, 3.0) and not skip_update(2.5, 3.0)
    assert not skip_update(float("nan"), 3.0)  # window still filling: never skip
    assert not skip_update(50.0, 0.0)  # 0 = off
    assert not skip_update(3.0000001, 3.0)  # both are float32 in llm.c: 3.0000001f == 3.0f


class _Recorder(Display):
    """Copies the trainer's params and AdamW state after every step; keeps the messages."""

    def __init__(self, trainer=None):
        self.t, self.after, self.messages, self.recs = trainer, {}, [], []

    def step(self, rec):
        self.recs.append(rec)
        if self.t is not None:
            m = self.t.model
            self.after[rec["step"]] = (m.params.copy(), m.m.copy(), m.v.copy())

    def message(self, text):
        self.messages.append(text)


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_spike_skips_the_update(data, tmp_path, kind):
    out = tmp_path / kind
    flag = {"skip_update_lossz": 3.0} if kind == "loss" else {"skip_update_gradz": 3.0}
    cfg = cfg_for(data, out, max_steps=140, val_loss_every=0, **flag)
    # step 50: the window (128) is not full yet, z is NaN -> updated anyway (as llm.c)
    t = poisoned_trainer(cfg, {50: kind, 135: kind})
    rec = t.display = _Recorder(t)
    t.run()
    recs = metrics(out)
    assert [r["step"] for r in recs] == list(range(140))
    zkey = "loss_z" if kind == "loss" else "grad_z"
    assert all(r[zkey] is None for r in recs[:128]) and recs[128][zkey] is not None
    assert [r["step"] for r in recs if r["skipped"]] == [135]
    assert recs[135][zkey] > 3.0 and not recs[50]["skipped"]
    # no AdamW update at step 135: params, m, v bit-identical to after step 134; 136 moves them
    for a, b in zip(rec.after[134], rec.after[135]):
        assert np.array_equal(a, b)
    assert not np.array_equal(rec.after[135][0], rec.after[136][0])
    assert not np.array_equal(rec.after[49][0], rec.after[50][0])
    # llm.c's message; main.log still has the step's line (llm.c logs every step)
    want = "loss z-score" if kind == "loss" else "grad z-score"
    skips = [m for m in rec.messages if m.startswith("skipping update due to")]
    assert len(skips) == 1 and want in skips[0]
    assert f"{recs[135][zkey]:f}" in skips[0]
    log = (out / "main.log").read_text().splitlines()
    assert log[135] == (f"s:135 trl:{recs[135]['train_loss']:.4f} lr:{recs[135]['lr']:.6f} "
                        f"norm:{recs[135]['grad_norm']:.2f}")


@pytest.fixture(scope="module")
def spiky_data(tmp_path_factory):
    """Tiny Shakespeare bytes (ASCII: tokens < 128) with two whole batches (B=4, T=32) of random
    tokens 128..255, which the model never sees otherwise: a real loss and gradient spike wherever
    the shuffled order puts them. Returns the shard and the steps whose inputs are them."""
    from llmctl.loader import DataLoader

    src = shared_file("tinyshakespeare/input.txt")
    d = tmp_path_factory.mktemp("spiky")
    BT, n = 4 * 32, 100  # 100 batches a shard: each spike 3 times in 300 steps, once early
    b = np.frombuffer(src.read_bytes(), dtype=np.uint8)[:n * BT + 1].astype(np.uint16)
    assert b.max() < 128
    rng = np.random.default_rng(7)
    for k in (23, 71):
        b[k * BT:(k + 1) * BT] = rng.integers(128, 256, BT)
    shard = write_shard(d / "spiky_train_000001.bin", b)
    loader = DataLoader([shard], 4, 32, shuffle=True, seed=TrainConfig().seed)
    steps = 300
    spikes = [s for s in range(steps) if (loader.next_batch()[0] >= 128).any()]
    return {"train": shard, "steps": steps, "spikes": spikes}


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_a_real_spike_in_the_data_skips_its_update(spiky_data, data, tmp_path, kind):
    """No patched forward/backward: the batches of unseen tokens spike the loss and the gradient
    norm by themselves. Once the window (128 steps) is full, -sl skips exactly their updates; -sg
    skips the steps whose gradient norm spikes, most of them among those batches."""
    from llmctl.train import Trainer

    flag = {"skip_update_lossz": 3.0} if kind == "loss" else {"skip_update_gradz": 3.0}
    cfg = cfg_for(data, tmp_path / kind, train_data=spiky_data["train"], max_steps=spiky_data["steps"],
                  val_loss_every=0, **flag)
    t = Trainer(cfg, display=Display())
    rec = t.display = _Recorder(t)
    t.run()
    recs = metrics(tmp_path / kind)
    spikes = spiky_data["spikes"]
    late = [s for s in spikes if s >= 128]
    assert len(late) >= 3 and any(s < 128 for s in spikes), spikes
    zkey = "loss_z" if kind == "loss" else "grad_z"
    skipped = [r["step"] for r in recs if r["skipped"]]
    assert skipped == [r["step"] for r in recs[128:] if r[zkey] > 3.0]
    if kind == "loss":  # every batch of unseen tokens, and nothing else
        assert skipped == late
    else:  # gradient norms are noisier: a clean batch may spike too, and not every bad one does
        assert len(set(skipped) & set(late)) >= 2, (skipped, late)
    for s in skipped:  # no AdamW update: params, m, v as after the step before
        for a, b in zip(rec.after[s - 1], rec.after[s]):
            assert np.array_equal(a, b)
    assert not any(recs[s]["skipped"] for s in spikes if s < 128)  # the window was not full yet


def test_bit_exact_resume_keeps_outlier_windows(data, tmp_path):
    kw = dict(max_steps=140, checkpoint_every=140, val_loss_every=0, skip_update_lossz=3.0)
    poison = {135: "loss"}
    a, b = tmp_path / "straight", tmp_path / "split"
    poisoned_trainer(cfg_for(data, a, **kw), poison).run()
    with pytest.raises(TrainInterrupted):  # Ctrl-C during step 129: checkpoint at 130, window full
        poisoned_trainer(cfg_for(data, b, **kw), poison, display=_StopAfter(129)).run()
    assert (b / "DONE_00000130").exists() and (b / "state_00000130_00000.outlier.json").exists()
    c = tmp_path / "no_sidecar"
    shutil.copytree(b, c)
    s = poisoned_trainer(cfg_for(data, b, resume=1, **kw), poison).run()
    assert s["start_step"] == 130
    for name in ("model_00000140.bin", "state_00000140_00000.bin", "main.log",
                 "state_00000140_00000.outlier.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert no_timing(metrics(a)) == no_timing(metrics(b))
    assert metrics(a)[135]["skipped"]

    # without the sidecar (llm.c's behaviour) the windows restart empty: step 135 is not skipped
    (c / "state_00000130_00000.outlier.json").unlink()
    rec = _Recorder()
    poisoned_trainer(cfg_for(data, c, resume=1, **kw), poison, display=rec).run()
    assert any("outlier windows start empty" in m for m in rec.messages)
    assert not metrics(c)[135]["skipped"] and metrics(c)[135]["loss_z"] is None
    assert (a / "model_00000140.bin").read_bytes() != (c / "model_00000140.bin").read_bytes()


def test_outlier_sidecar_deleted_with_checkpoint_and_corrupt_is_an_error(data, tmp_path, capsys):
    out = tmp_path / "k"
    train(cfg_for(data, out, max_steps=4, checkpoint_every=1, checkpoints_keep=1,
                  val_loss_every=0, skip_update_gradz=2.5))
    names = sorted(os.listdir(out))
    sidecars = [n for n in names if n.endswith(".outlier.json")]
    assert sidecars == ["state_00000004_00000.outlier.json"]
    side = json.loads((out / "state_00000004_00000.outlier.json").read_text())
    assert side["step"] == 4 and side["loss"]["count"] == side["grad_norm"]["count"] == 4
    (out / "state_00000004_00000.outlier.json").write_text("{not json")
    rc, _, err = run_cli(_base(data, **{"-o": str(out), "-y": "1", "-x": "4", "-sg": "2.5"}),
                         capsys)
    assert_cli_error(err, 1, rc, names=str(out / "state_00000004_00000.outlier.json"))
    # without -sl/-sg no sidecar is written (llm.c's file set is unchanged)
    plain = tmp_path / "plain"
    train(cfg_for(data, plain, max_steps=2, checkpoint_every=2, val_loss_every=0))
    assert not [n for n in os.listdir(plain) if "outlier" in n]
    assert "skipped" not in metrics(plain)[0]


@pytest.mark.parametrize("flag,value", [("-sl", "-1"), ("-sg", "-0.5"), ("-sl", "nan")])
def test_negative_skip_threshold_is_a_usage_error(data, tmp_path, capsys, flag, value):
    out = tmp_path / "o"
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out), flag: value}), capsys)
    assert rc == 2, err
    errors = [l for l in err.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1 and flag in errors[0] and ">= 0" in errors[0]
    assert not out.exists() and stdout == ""


def test_plain_display_shows_z_scores_and_skips():
    import io

    buf = io.StringIO()
    d = PlainDisplay(buf)
    base = {"num_steps": 200, "train_loss": 5.5, "lr": 3e-4, "grad_norm": 1.25, "ms": 12.5,
            "tokens_per_s": 10240.0, "mfu": 0.05}
    d.step({**base, "step": 3, "loss_z": None, "grad_z": None, "skipped": False})
    d.step({**base, "step": 150, "loss_z": 4.5, "grad_z": -0.25, "skipped": True})
    assert buf.getvalue().splitlines() == [
        "step    4/200 | loss 5.500000 (+nanz) | norm 1.2500 (+nanz) | lr 3.00e-04 | 12.50 ms | "
        "5.0% fp32 MFU | 10240 tok/s",
        "step  151/200 | loss 5.500000 (+4.50z) | norm 1.2500 (-0.25z) | lr 3.00e-04 | 12.50 ms | "
        "5.0% fp32 MFU | 10240 tok/s | update skipped"]


def test_two_ranks_skip_the_same_step(data, tmp_path):
    """Only rank 1's gradients spike (a real two-process job over the shm all-reduce; the spike
    is injected by tests/spikes.py); after the all-reduce both ranks see the same norm, make the
    same decision and stay identical (checked after every step); each rank writes its sidecar."""
    from dataclasses import asdict

    from llmctl.jobs.launcher import launch

    out = tmp_path / "p2"
    cfg = cfg_for(data, out, batch_size=2, max_steps=132, checkpoint_every=132,
                  val_loss_every=0, skip_update_gradz=3.0)
    path = [str(Path(__file__).resolve().parent)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    launch("spikes:train_entry", {"config": asdict(cfg), "poison": {"1": {"130": "grad"}}}, 2,
           threads=1, timeout=60, extra_env={"PYTHONPATH": os.pathsep.join(path)})
    assert [r["step"] for r in metrics(out) if r["skipped"]] == [130]
    s0, s1 = (json.loads((out / f"state_00000132_0000{r}.outlier.json").read_text())
              for r in (0, 1))
    assert s0 == s1 and s0["grad_norm"]["count"] == 128


# ---------------------------------------------------------------------------------------------
# the gradients are cleared by AdamW's pass (update(zero_grads=True)), not by a fill in zero_grad


def _run_files(out):
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out)) if n != "metrics.jsonl"}


def _zero_grad_spy(monkeypatch):
    """Record, at every zero_grad, whether it skips the fill (the grads are known zero)."""
    from llmctl.model import GPT2

    seen, zero_grad = [], GPT2.zero_grad

    def spy(self):
        seen.append(self.grads_known_zero)
        zero_grad(self)
        assert not self.grads.any()
    monkeypatch.setattr(GPT2, "zero_grad", spy)
    return seen


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_zero_grad_same_run_as_the_fill(data, tmp_path, monkeypatch, precision):
    """-d 2*B*T (two micro-batches per step): the run whose AdamW clears the gradients writes the
    same checkpoints, logs and metrics as the one whose zero_grad fills every step, and it does
    skip the fill after every update."""
    from llmctl.model import GPT2

    if precision == "bf16" and not _matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    kw = dict(max_steps=6, checkpoint_every=3, total_batch_size=2 * 4 * 32, precision=precision)
    seen = _zero_grad_spy(monkeypatch)
    train(cfg_for(data, tmp_path / "fused", **kw))
    assert seen == [False] + [True] * 5
    monkeypatch.setattr(GPT2, "update", unfused_update(GPT2.update))
    train(cfg_for(data, tmp_path / "fill", **kw))
    assert seen[6:] == [False] * 6
    assert _run_files(tmp_path / "fused") == _run_files(tmp_path / "fill")
    assert no_timing(metrics(tmp_path / "fused")) == no_timing(metrics(tmp_path / "fill"))


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_fused_zero_grad_fills_after_a_skipped_update(data, tmp_path, monkeypatch, kind):
    """-sl/-sg skip the update of step 135 (a spike, tests/spikes.py): no AdamW pass cleared that
    step's gradients, so the next zero_grad fills; the run equals the always-fill one."""
    from llmctl.model import GPT2

    flag = {"skip_update_lossz": 3.0} if kind == "loss" else {"skip_update_gradz": 3.0}
    kw = dict(max_steps=137, checkpoint_every=137, val_loss_every=0, total_batch_size=2 * 4 * 32, **flag)
    seen = _zero_grad_spy(monkeypatch)
    poisoned_trainer(cfg_for(data, tmp_path / "fused", **kw), {135: kind}).run()
    assert [r["step"] for r in metrics(tmp_path / "fused") if r["skipped"]] == [135]
    assert [s for s, fused in enumerate(seen) if not fused] == [0, 136]
    monkeypatch.setattr(GPT2, "update", unfused_update(GPT2.update))
    poisoned_trainer(cfg_for(data, tmp_path / "fill", **kw), {135: kind}).run()
    assert _run_files(tmp_path / "fused") == _run_files(tmp_path / "fill")
    assert no_timing(metrics(tmp_path / "fused")) == no_timing(metrics(tmp_path / "fill"))


def test_fused_zero_grad_fills_after_a_diverged_step(data, tmp_path):
    """TrainingDiverged stops before the update: that step's (non-finite) gradients were not
    cleared by AdamW, so the model's next zero_grad must fill them."""
    from llmctl.train import Trainer

    tr = Trainer(cfg_for(data, None, max_steps=10, learning_rate=1e30, grad_clip=0.0, val_loss_every=0))
    with pytest.raises(TrainingDiverged):
        tr.run()
    assert not np.isfinite(tr.model.grads).all()
    tr.model.zero_grad()
    assert not tr.model.grads.any()


def test_fused_zero_grad_two_ranks_over_shm(data, tmp_path):
    """--nproc 2 over the shm backend, gradients in the shared segment: each rank's AdamW clears
    its own row after the all-reduce. Rank 1's gradients spike at step 130 (skipped update, then
    a fill on both ranks); the parameters are checked identical across ranks after every step,
    and the run equals the always-fill one byte for byte."""
    from dataclasses import asdict

    from llmctl.jobs.launcher import launch

    path = [str(Path(__file__).resolve().parent)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for name, unfused in (("fused", False), ("fill", True)):
        cfg = cfg_for(data, tmp_path / name, batch_size=2, max_steps=132, checkpoint_every=132,
                      val_loss_every=0, total_batch_size=2 * 2 * 2 * 32, skip_update_gradz=3.0)
        res = launch("spikes:train_entry", {"config": asdict(cfg), "poison": {"1": {"130": "grad"}},
                                            "shared_grads": True, "unfused": unfused},
                     2, threads=1, timeout=60, extra_env={"PYTHONPATH": os.pathsep.join(path)})
        # rank 0: every zero_grad but step 0's and step 131's (after the skip) was free
        assert res["result"]["grads_shared"] and res["result"]["fills_skipped"] == (0 if unfused else 130)
    assert [r["step"] for r in metrics(tmp_path / "fused") if r["skipped"]] == [130]
    assert _run_files(tmp_path / "fused") == _run_files(tmp_path / "fill")
    assert no_timing(metrics(tmp_path / "fused")) == no_timing(metrics(tmp_path / "fill"))


# ---------------------------------------------------------------------------------------------
# review fixes: output-path errors, token ids, -y 0 into old checkpoints, absurd flags,
# rotation of Ctrl-C checkpoints, Ctrl-C during validation


def _one_error(err):
    assert "Traceback" not in err, err
    errors = [l for l in err.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1, err
    return errors[0]


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


@pytest.mark.parametrize("split", ["-i", "-j"])
def test_out_of_vocab_token_fails_before_training(data, tmp_path, capsys, split):
    """One id >= V in a shard: exit 1 before anything is written, naming the shard, id and V
    (before the fix: an exit-2 error from the model mid-run, shard unnamed)."""
    b = np.frombuffer(shared_file("tinyshakespeare/input.txt").read_bytes()[:40000],
                      dtype=np.uint8).astype(np.uint16)
    b[30000] = 300  # the tiny model's V is 256
    bad = write_shard(tmp_path / "bad_000.bin", b)
    out = tmp_path / "o"
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out), split: bad, "-v": "1"}), capsys)
    assert rc == 1, err
    line = _one_error(err)
    assert bad in line and "300" in line and "V is 256" in line, line
    assert not out.exists() and stdout == ""


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


@pytest.mark.parametrize("flag,value", [
    ("-l", "nan"), ("-l", "-1"), ("-l", "inf"), ("--beta1", "1.5"), ("--beta1", "-0.1"),
    ("--beta2", "1"), ("--beta2", "-1"), ("-q", "5"), ("-q", "-0.5"), ("--grad-clip", "-1"),
    ("--grad-clip", "nan"), ("-u", "-1"), ("-b", "0"), ("-t", "0"), ("-c", "nan"),
    ("-c", "-1"), ("--threads", "100000")])
def test_absurd_values_are_usage_errors(data, tmp_path, capsys, flag, value):
    out = tmp_path / "o"
    rc, stdout, err = run_cli(_base(data, **{"-o": str(out), flag: value}), capsys)
    assert rc == 2, err
    line = _one_error(err)
    assert flag in line, line
    assert not out.exists() and stdout == ""


def test_transport_and_its_alias_backend_are_one_option(capsys):
    """--backend is an alias of --transport: either spelling's value reaches the transport
    check, before any data is read."""
    for spelling in ("--transport", "--backend"):
        rc, out, err = run_cli([spelling, "carrier-pigeon"], capsys)
        assert rc == 2 and out == "", err
        assert _one_error(err) == "Error: --transport 'carrier-pigeon' is not one of auto, shm, ring, mpi"


def test_validation_accepts_the_edges(data, tmp_path):
    """The closed ends of every range run: lr 0 (and betas 0, no clip, no decay) trains a step
    that leaves the weights exactly as they were; betas just below 1 train a normal step."""
    still = tmp_path / "still"
    s = train(cfg_for(data, still, max_steps=1, val_loss_every=0, learning_rate=0.0,
                      final_lr_frac=0.0, beta1=0.0, beta2=0.0, grad_clip=0.0, weight_decay=0.0,
                      checkpoint_every=1))
    assert s["steps_run"] == 1 and metrics(still)[0]["lr"] == 0.0
    init = np.fromfile(data["ckpt"], dtype=np.float32)[256:]
    assert np.array_equal(np.fromfile(still / "model_00000001.bin", dtype=np.float32)[256:], init)
    moved = tmp_path / "moved"
    s = train(cfg_for(data, moved, max_steps=1, val_loss_every=0, final_lr_frac=1.0, beta1=0.99,
                      beta2=0.999, checkpoint_every=1))
    assert s["steps_run"] == 1 and math.isfinite(s["train_loss"])
    after = np.fromfile(moved / "model_00000001.bin", dtype=np.float32)[256:]
    assert np.isfinite(after).all() and not np.array_equal(after, init)


@pytest.mark.parametrize("major,want", [(0, {12}), (3, {6, 12})])
def test_ctrl_c_checkpoint_is_rotated_by_nk(data, tmp_path, major, want):
    """-n 4 -nk 1: Ctrl-C after step 6 writes the off-grid checkpoint 6; after -y 1, the regular
    checkpoint 8 rotates it away with 4 (llm.c never deletes it); -nm keeps it if major."""
    out = tmp_path / "r"
    kw = dict(max_steps=12, checkpoint_every=4, checkpoints_keep=1,
              major_checkpoint_every=major, val_loss_every=0)
    with pytest.raises(TrainInterrupted):
        train(cfg_for(data, out, **kw), display=_StopAfter(5))
    assert (out / "DONE_00000006").exists()
    train(cfg_for(data, out, resume=1, **kw))
    steps = lambda prefix: {int(n.split("_")[1][:8]) for n in os.listdir(out)
                            if n.startswith(prefix)}
    assert steps("DONE_") == want
    assert steps("model_") == want and steps("state_") == want


def test_ctrl_c_checkpoint_on_the_grid_rotates_like_a_regular_one(data, tmp_path):
    """-n 2 -nk 1: Ctrl-C during step 4 writes checkpoint 4, which is on the -n grid, so 2 goes
    (left behind, no later rotation would delete it: 2 is on the grid and older than 4 - nk*n)."""
    out = tmp_path / "r"
    with pytest.raises(TrainInterrupted, match="after step 4/12"):
        train(cfg_for(data, out, max_steps=12, checkpoint_every=2, checkpoints_keep=1,
                      val_loss_every=0), display=_StopAfter(3))
    assert sorted(n for n in os.listdir(out) if n.startswith(("DONE_", "model_", "state_"))) == \
        ["DONE_00000004", "model_00000004.bin", "state_00000004_00000.bin"]


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


class _ValSigint:
    """Wraps the val loader's next_batch: sends this process `n` SIGINTs on val batch `at` of
    step `step` and counts the batches read."""

    def __init__(self, trainer, step, at, n=1):
        self.tr, self.step, self.at, self.n = trainer, step, at, n
        self.calls = 0
        self.real = trainer.val_loader.next_batch
        trainer.val_loader.next_batch = self

    def __call__(self):
        if self.tr.comm.step == self.step:
            self.calls += 1
            if self.calls == self.at:
                for _ in range(self.n):
                    os.kill(os.getpid(), signal.SIGINT)
        return self.real()


def test_ctrl_c_during_validation_stops_it_early(data, tmp_path, capsys):
    """First Ctrl-C: one acknowledgement line at once, the val loop stops between batches, the
    step checkpoints and TrainInterrupted (exit 130); the partial val loss is not logged."""
    from llmctl.train import Trainer

    out = tmp_path / "v"
    tr = Trainer(cfg_for(data, out, max_steps=12, val_loss_every=4, val_max_steps=20,
                         checkpoint_every=4))
    spy = _ValSigint(tr, step=8, at=2)
    with pytest.raises(TrainInterrupted) as e:
        tr.run()
    assert spy.calls == 2  # of 20: stopped right after the signal
    assert e.value.exit_code == 130 and "after step 8/12" in e.value.message
    assert (out / "DONE_00000008").exists() and not (out / "DONE_00000012").exists()
    assert [r["step"] for r in metrics(out) if "val_loss" in r] == [0, 4]
    err = capsys.readouterr().err
    assert err.count("stopping after this step (Ctrl-C again to abort)...") == 1


def test_second_ctrl_c_aborts_at_once(data, tmp_path, capsys):
    """A second Ctrl-C (during validation, before checkpoint 8) aborts with exit 130 and a
    one-line message naming the last complete checkpoint, which stays intact."""
    from llmctl.train import Trainer

    out = tmp_path / "v2"
    tr = Trainer(cfg_for(data, out, max_steps=12, val_loss_every=4, val_max_steps=20,
                         checkpoint_every=4))
    spy = _ValSigint(tr, step=8, at=3, n=2)
    prev = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainInterrupted) as e:
        try:
            tr.run()
        except KeyboardInterrupt:  # would end the pytest session: report it as a failure
            pytest.fail("a raw KeyboardInterrupt escaped train()")
    assert signal.getsignal(signal.SIGINT) is prev
    assert spy.calls == 3
    msg = e.value.message
    assert "second Ctrl-C" in msg and str(out / "model_00000004.bin") in msg and "\n" not in msg
    assert sorted(n for n in os.listdir(out) if n.startswith("DONE_")) == ["DONE_00000004"]
    assert math.isfinite(_model_loss(out / "model_00000004.bin", data))


# ---------------------------------------------------------------------------------------------
# the user's `-i 'data/*.bin'`, the default -e, --sampler windows


def _data_dir(data, tmp_path):
    """A data/ as prepro leaves it: train + val shards, an eval file, and a checkpoint."""
    d = tmp_path / "data"
    d.mkdir()
    for f in ("ts_bytes_train_000001.bin", "ts_bytes_train_000002.bin", "ts_bytes_val_000000.bin"):
        shutil.copy(data["dir"] / f, d / f)
    header = np.zeros(256, dtype="<i4")
    header[:2] = [20240522, 1]  # an eval file: recognised by its magic alone
    (d / "hellaswag_val.bin").write_bytes(header.tobytes())
    shutil.copy(data["ckpt"], d / "tiny.bin")
    return d


def test_a_data_glob_trains_on_train_shards_and_validates_on_its_val_shards(data, tmp_path, capsys):
    d = _data_dir(data, tmp_path)
    base = _base(data, **{"-i": str(d / "*.bin"), "-x": "4", "-v": "2", "-m": "2"})
    del base[base.index("-j"):base.index("-j") + 2]  # no -j
    rc, out, err = run_cli(base + ["-o", str(tmp_path / "glob")], capsys)
    assert rc == 0, err
    lines = err.splitlines()
    train_line = next(ln for ln in lines if ln.startswith("| train_data"))
    val_line = next(ln for ln in lines if ln.startswith("| val_data"))
    assert "ts_bytes_train_000001.bin" in train_line and "ts_bytes_train_000002.bin" in train_line
    assert "ts_bytes_val_000000.bin" not in train_line and "ts_bytes_val_000000.bin" in val_line
    notes = [ln for ln in lines if "left out" in ln]
    assert len(notes) == 1 and "hellaswag_val.bin (an eval file" in notes[0] and "tiny.bin (a model checkpoint)" in notes[0]
    # the same run with the files named explicitly: identical losses
    rc, out, err = run_cli(_base(data, **{"-i": str(d / "ts_bytes_train_*.bin"), "-j": str(d / "*_val_*.bin"),
                                          "-x": "4", "-v": "2", "-m": "2"}) + ["-o", str(tmp_path / "named")],
                           capsys)
    assert rc == 0, err
    got, want = no_timing(metrics(tmp_path / "glob")), no_timing(metrics(tmp_path / "named"))
    assert got == want and sum("val_loss" in r for r in got) == 3


def test_no_e_starts_from_gpt2_124M_bin_in_the_working_directory(data, tmp_path, capsys):
    shutil.copy(data["ckpt"], "gpt2_124M.bin")  # the tests run in an empty directory
    base = _base(data)
    del base[base.index("-e"):base.index("-e") + 2]
    rc, out, err = run_cli(base + ["-o", str(tmp_path / "a")], capsys)
    assert rc == 0, err
    assert "gpt2_124M.bin (no -e: gpt2_124M.bin in the working directory)" in err
    rc, out, err = run_cli(_base(data) + ["-o", str(tmp_path / "b")], capsys)
    assert no_timing(metrics(tmp_path / "a")) == no_timing(metrics(tmp_path / "b"))


def test_no_e_without_weights_is_one_error_naming_d12(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))  # offline (conftest), nothing cached
    monkeypatch.setenv("LLMCTL_CACHE", str(tmp_path / "empty_llmctl_cache"))
    base = _base(data)
    del base[base.index("-e"):base.index("-e") + 2]
    rc, out, err = run_cli(base, capsys)
    assert_cli_error(err, 1, rc, names=["-e", "gpt2_124M.bin", "-e d12"])


def test_sampler_windows_trains_on_shuffled_windows_and_resumes(data, tmp_path):
    from llmctl.model import load
    from llmctl.windows import TokenWindows, WindowBatches

    kw = dict(max_steps=8, checkpoint_every=8, sampler="windows", val_loss_every=4,
              total_batch_size=2 * 4 * 32, seed=5)
    a, b = tmp_path / "straight", tmp_path / "split"
    train(cfg_for(data, a, **kw))
    # step 0's loss is the mean over the first two batches the window sampler draws
    import glob as _glob

    wb = WindowBatches(TokenWindows(sorted(_glob.glob(data["train"])), 32), 4, seed=5)
    m = load(data["ckpt"], n_threads=1)
    first = np.mean([float(m.forward(*wb.next_batch())) for _ in range(2)])
    assert metrics(a)[0]["train_loss"] == pytest.approx(first, rel=1e-6)
    with pytest.raises(TrainInterrupted):
        train(cfg_for(data, b, **kw), display=_StopAfter(3))
    assert (b / "DONE_00000004").exists()
    train(cfg_for(data, b, resume=1, **kw))
    for name in ("model_00000008.bin", "state_00000008_00000.bin", "main.log"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert no_timing(metrics(a)) == no_timing(metrics(b))
    # and it is not llm.c's order
    train(cfg_for(data, tmp_path / "llmc", **dict(kw, sampler="llmc")))
    assert metrics(tmp_path / "llmc")[0]["train_loss"] != metrics(a)[0]["train_loss"]


@pytest.mark.parametrize("first,then", [("windows", "llmc"), ("llmc", "windows")])
def test_resume_with_the_other_sampler_is_one_error_naming_both(data, tmp_path, first, then):
    out = tmp_path / "run"
    kw = dict(max_steps=2, checkpoint_every=2, val_loss_every=0, total_batch_size=4 * 32)
    train(cfg_for(data, out, sampler=first, **kw))
    with pytest.raises(ConfigError) as e:
        train(cfg_for(data, out, sampler=then, resume=1, **dict(kw, max_steps=4)))
    assert_error(e, ConfigError, names=[f"--sampler {first}", f"--sampler {then}", "state_00000002_00000.bin"])
    assert f"--sampler {first}" in e.value.hint  # the setting that resumes it
    assert not (out / "DONE_00000004").exists()
    train(cfg_for(data, out, sampler=first, resume=1, **dict(kw, max_steps=4)))  # the same sampler resumes
    assert (out / "DONE_00000004").exists()


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


def test_train_and_val_on_the_same_file_warns(data, tmp_path, capsys):
    """-i and -j naming one shard (here through a second path to it) validate on training tokens:
    one warning naming it; disjoint splits and -a 1 (the val split by design) say nothing."""
    val = sorted(glob.glob(data["val"]))[0]
    alias = tmp_path / "alias.bin"
    os.symlink(val, alias)
    rc, out, err = run_cli(_base(data, **{"-i": val, "-j": str(alias), "-v": "1"}), capsys)
    assert rc == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("Warning:")]
    assert warnings == [f"Warning: -i and -j both name {val}: the val loss is measured on tokens "
                        "the model trains on"], err
    rc, out, err = run_cli(_base(data, **{"-v": "1"}), capsys)
    assert rc == 0 and "Warning:" not in err, err
    rc, out, err = run_cli(_base(data, **{"-a": "1", "-v": "1", "-d": "128"}), capsys)
    assert rc == 0 and "Warning:" not in err, err


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
