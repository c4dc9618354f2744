"""Ctrl-C during training: the real CLI's SIGINT, the checkpoint it writes and its rotation
by -nk/-nm, Ctrl-C during validation, and a second Ctrl-C.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from trainkit import cfg_for, metrics, no_timing, _StopAfter, _model_loss
from llmctl.train import TrainInterrupted, train


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
