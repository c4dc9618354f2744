"""The training loop: learning-rate schedules (`llmc/schedulers.h`) against float64 formulas,
learning on Tiny Shakespeare, gradient accumulation, -a 1, and a diverging run's checkpoints.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import math
import os
import re

import numpy as np
import pytest

from errcheck import raises_error
from trainkit import cfg_for, metrics, _model_loss
from llmctl.errors import ConfigError
from llmctl.schedulers import get_learning_rate
from llmctl.train import TrainingDiverged, train


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


def test_bf16_training_makes_the_blocked_lm_heads_gradient_in_its_forward(data, tmp_path, monkeypatch):
    # `llmctl train` passes each micro-step's loss_scale to forward: where the bf16 lm head runs
    # in row blocks, every block's logits are then computed once (no recompute in backward), with
    # gradient accumulation too, and training matches the run that holds all its logits
    import llmctl.model.gpt2 as gpt2
    from llmctl._ext import matmul

    if not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")   # the same numerics on fp32 GEMMs
    kw = dict(max_steps=3, val_loss_every=0, total_batch_size=2 * 4 * 32, precision="bf16")
    train(cfg_for(data, tmp_path / "held", **kw))
    monkeypatch.setattr(gpt2, "LOGITS_KEEP_BYTES", 1024)
    monkeypatch.setattr(gpt2, "LMHEAD_ROWS", 32)
    monkeypatch.setattr(gpt2, "LMHEAD_GRAD_ROWS", 64)
    rows = []
    lmhead_forward = matmul.matmul_forward_bf16

    def counting(out, inp, weight, bias, BT, C, OC, *a, **k):
        if OC == 256:   # the tiny model's padded vocabulary: the lm head
            rows.append(BT)
        return lmhead_forward(out, inp, weight, bias, BT, C, OC, *a, **k)

    monkeypatch.setattr(matmul, "matmul_forward_bf16", counting)
    train(cfg_for(data, tmp_path / "blocked", **kw))
    # in blocks of the dlogits staging's 64 rows (not LMHEAD_ROWS: a training plan's lm head makes
    # its logits in the staging), each row once: steps x micro-steps x B x T
    assert max(rows) == 64 and sum(rows) == 3 * 2 * 4 * 32
    a = [r["train_loss"] for r in metrics(tmp_path / "held") if "train_loss" in r]
    b = [r["train_loss"] for r in metrics(tmp_path / "blocked") if "train_loss" in r]
    assert len(a) == len(b) == 3
    np.testing.assert_allclose(b, a, rtol=1e-4)
