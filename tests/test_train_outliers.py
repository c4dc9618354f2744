"""-sl / -sg: llm.c's OutlierDetector (llmc/outlier_detector.h) and update skipping, in one
process and two, across a resume.

Runs use a tiny byte-level GPT-2 (tests/trainkit.py: L=2, C=32, NH=2, maxT=32, V=Vp=256) on the
bytes of the real Tiny Shakespeare text (the `data` fixture, tests/conftest.py) and one thread.
"""
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import shared_file
from errcheck import assert_cli_error
from spikes import poisoned_trainer
from trainkit import write_shard, cfg_for, metrics, no_timing, _StopAfter, run_cli, _base
from llmctl.display import Display, PlainDisplay
from llmctl.train import TrainConfig, TrainInterrupted, train


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
