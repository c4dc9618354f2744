"""The gradients are cleared by AdamW's pass (update(zero_grads=True)), not by a fill in
zero_grad: the fused run equals the always-fill one, after skipped and diverged steps too. In
bf16 nothing clears them: the trainer's zero_grad(lazy=True) marks them spent and the next
backward overwrites them (beta-0 GEMMs, a fill of the small tensors), again the fill run's bits.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import os
from pathlib import Path

import numpy as np
import pytest

from llmctl._ext import matmul as _matmul
from spikes import poisoned_trainer, unfused_update
from trainkit import cfg_for, metrics, no_timing
from llmctl.train import TrainingDiverged, train


def _run_files(out):
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out)) if n != "metrics.jsonl"}


def _zero_grad_spy(monkeypatch):
    """Record, at every zero_grad, whether it skips the fill (the grads are known zero, or a lazy
    zero_grad leaves them spent for a backward that overwrites them)."""
    from llmctl.model import GPT2

    seen, zero_grad = [], GPT2.zero_grad

    def spy(self, lazy=False):
        seen.append(self.grads_known_zero or (lazy and self.ops.first_write))
        zero_grad(self, lazy=lazy)
        assert self.grads_spent or not self.grads.any()
    monkeypatch.setattr(GPT2, "zero_grad", spy)
    return seen


def _always_fill(monkeypatch):
    """The reference runs: AdamW clears nothing and every zero_grad fills."""
    from llmctl.model import GPT2

    zero_grad = GPT2.zero_grad
    monkeypatch.setattr(GPT2, "update", unfused_update(GPT2.update))
    monkeypatch.setattr(GPT2, "zero_grad", lambda self, lazy=False: zero_grad(self))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_zero_grad_same_run_as_the_fill(data, tmp_path, monkeypatch, precision):
    """-d 2*B*T (two micro-batches per step): the run whose AdamW clears the gradients writes the
    same checkpoints, logs and metrics as the one whose zero_grad fills every step, and it does
    skip the fill after every update (bf16: every time, the first step's too)."""
    if precision == "bf16" and not _matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    kw = dict(max_steps=6, checkpoint_every=3, total_batch_size=2 * 4 * 32, precision=precision)
    seen = _zero_grad_spy(monkeypatch)
    train(cfg_for(data, tmp_path / "fused", **kw))
    assert seen == [precision == "bf16"] + [True] * 5
    _always_fill(monkeypatch)
    train(cfg_for(data, tmp_path / "fill", **kw))
    assert seen[6:] == [False] * 6
    assert _run_files(tmp_path / "fused") == _run_files(tmp_path / "fill")
    assert no_timing(metrics(tmp_path / "fused")) == no_timing(metrics(tmp_path / "fill"))


@pytest.mark.parametrize("kind, precision", [("loss", "fp32"), ("grad", "fp32"), ("grad", "bf16")])
def test_fused_zero_grad_fills_after_a_skipped_update(data, tmp_path, monkeypatch, kind, precision):
    """-sl/-sg skip the update of step 135 (a spike, tests/spikes.py): no AdamW pass cleared that
    step's gradients, so the next zero_grad fills (bf16: marks them spent, and the backward
    overwrites the spiked values); the run equals the always-fill one."""
    if precision == "bf16" and not _matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    flag = {"skip_update_lossz": 3.0} if kind == "loss" else {"skip_update_gradz": 3.0}
    kw = dict(max_steps=137, checkpoint_every=137, val_loss_every=0, total_batch_size=2 * 4 * 32,
              precision=precision, **flag)
    seen = _zero_grad_spy(monkeypatch)
    poisoned_trainer(cfg_for(data, tmp_path / "fused", **kw), {135: kind}).run()
    assert [r["step"] for r in metrics(tmp_path / "fused") if r["skipped"]] == [135]
    assert [s for s, fused in enumerate(seen) if not fused] == ([] if precision == "bf16" else [0, 136])
    _always_fill(monkeypatch)
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
