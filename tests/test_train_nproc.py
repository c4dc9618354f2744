"""Training with more than one process: the loop's hooks for llmctl.distributed and a real
`--nproc 2` job over the shared-memory all-reduce that resumes byte for byte.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import os
import shutil

import pytest

from trainkit import cfg_for, metrics, no_timing, train_nproc2
from llmctl.errors import ConfigError
from llmctl.train import TrainInterrupted, train


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
