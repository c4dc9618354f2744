"""What a run reads: token ids against V, the user's `-i 'data/*.bin'`, the default -e,
--sampler windows, and -i and -j naming one file.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import glob
import os
import shutil

import numpy as np
import pytest

from conftest import shared_file
from errcheck import assert_cli_error, assert_error
from trainkit import write_shard, cfg_for, metrics, no_timing, _StopAfter, run_cli, _base, _one_error
from llmctl.errors import ConfigError
from llmctl.train import TrainInterrupted, train


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
