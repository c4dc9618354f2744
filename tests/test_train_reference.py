"""`llmctl train` end to end against tests/loop_reference.py, a float64 re-implementation of llm.c's loop.

Each test writes a tiny llm.c checkpoint and token shards with plain NumPy (loop_reference's own
writers), runs `python -m llmctl train` on them as a user would, and compares every step's loss,
lr and grad norm (metrics.jsonl at full precision, main.log at its printed digits), every val loss
and the final weights (the checkpoint of the last step) with the reference run on the same files.
The flag sets cover the lr schedules with warmup and decay (-k -u -q), gradient accumulation (-d),
the grad-norm clip (a high lr keeps the norm above 1.0), weight decay (-c), val-loss averaging
(-v -m, including -m -1), the shuffled multi-shard data order over several epochs (--seed, -x -1)
and two processes over the real shared-memory all-reduce (--nproc 2).

Tolerances (float32 engine vs float64 reference): the model is tiny (C = 16, sums over at most
4C = 64 terms in the forward, B*T*accum = 32 tokens in the loss), so each step's float32 rounding
is a few 1e-7 relative, and AdamW's normalised update keeps it from growing much over 12 steps
(we see <= 2e-7 on losses and norms). LOSS_RTOL = 1e-5 leaves ~50x margin, while every mutation
of the loop we tried (a schedule off by a factor, no clip, decay on 1-D tensors, another batch
order, another val count) moves some value by 1e-3 or more. The lr is compared to 1e-6: llmctl
computes the schedule in float32 like llm.c (a few ulps). Final weights must agree to
PARAM_ATOL = 1e-2 * lr: one AdamW step moves a weight by up to lr, we see <= 1e-3 * lr.
"""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import loop_reference as LR
import reference as R

CFG = dict(max_seq_len=16, vocab_size=64, padded_vocab_size=128, num_layers=2, num_heads=2,
           channels=16)
B, T, STEPS = 2, 8, 12
TRAIN_SHARDS = (150, 120, 100)  # 9 + 7 + 6 samples of B*T: 12 steps of -d 2*B*T cross an epoch
VAL_TOKENS = 96  # a multiple of B*T: -m -1 asks for 6 batches, the shard serves 5 (llm.c wraps)
LOSS_RTOL = 1e-5
LR_RTOL = 1e-6
PARAM_ATOL = 1e-2  # times the peak lr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """init.bin (random weights, std 0.1: grad norms ~2, so the clip at 1.0 acts), three train
    shards and one val shard of random ids, all written without llmctl."""
    d = tmp_path_factory.mktemp("loop")
    LR.write_checkpoint(d / "init.bin", CFG, R.random_params(CFG, seed=1, std=0.1))
    rng = np.random.default_rng(0)
    for i, n in enumerate(TRAIN_SHARDS):
        LR.write_shard(d / f"train_{i:02d}.bin", rng.integers(0, CFG["vocab_size"], n))
    LR.write_shard(d / "val.bin", rng.integers(0, CFG["vocab_size"], VAL_TOKENS))
    return d


def _flag(flags, name, default):
    return type(default)(flags[flags.index(name) + 1]) if name in flags else default


def train_cli(d, out, flags, nproc=1):
    """Run `llmctl train --json` on the files in d with `flags` (llm.c's short flags; -s 0 unless
    given); -> (metrics by step, main.log lines, final params, peak lr, number of steps, the
    JSON events printed on stdout)."""
    steps = _flag(flags, "-x", -1)
    if steps == -1:  # one epoch (llm.c's -x -1): the test computes it from the shard sizes
        steps = sum(TRAIN_SHARDS) // _flag(flags, "-d", B * T * nproc)
    args = ["train", "-i", str(d / "train_*.bin"), "-j", str(d / "val.bin"),
            "-e", str(d / "init.bin"), "-o", str(d / out), "-b", str(B), "-t", str(T),
            "-n", str(steps), "--threads", "1", "--json", *flags]
    if "-s" not in flags:
        args += ["-s", "0"]
    if nproc > 1:  # the shared-memory all-reduce, named so that auto cannot pick another
        args += ["--nproc", str(nproc), "--backend", "shm"]
    r = subprocess.run([sys.executable, "-m", "llmctl", *args], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    o = d / out
    recs = [json.loads(line) for line in (o / "metrics.jsonl").read_text().splitlines()]
    _, params = LR.read_checkpoint(o / f"model_{steps:08d}.bin")
    events = [json.loads(line) for line in r.stdout.splitlines()]
    return ({rec["step"]: rec for rec in recs}, (o / "main.log").read_text().splitlines(), params,
            _flag(flags, "-l", 3e-4), steps, events)


def reference(d, flags, nproc=1, steps=None):
    return LR.run(d / "init.bin", str(d / "train_*.bin"), str(d / "val.bin"), B, T,
                  steps, P=nproc, total_batch=_flag(flags, "-d", -1), lr=_flag(flags, "-l", 3e-4),
                  schedule=_flag(flags, "-k", "cosine"), warmup=_flag(flags, "-u", 0),
                  final_frac=_flag(flags, "-q", 1.0), weight_decay=_flag(flags, "-c", 0.0),
                  val_every=_flag(flags, "-v", 20), val_max_steps=_flag(flags, "-m", 20),
                  sample_every=_flag(flags, "-s", 0), gen_tokens=_flag(flags, "-g", 64),
                  seed=_flag(flags, "--seed", 42))


def _close(a, b, rtol):
    return abs(a - b) <= rtol * abs(b)


def assert_matches_reference(run, ref):
    metrics, log, params, peak_lr, steps, _ = run
    # every step's loss, lr and grad norm at full precision
    assert [s for s in metrics if "train_loss" in metrics[s]] == list(range(steps))
    for want in ref["steps"]:
        got = metrics[want["step"]]
        for key, rtol in (("train_loss", LOSS_RTOL), ("grad_norm", LOSS_RTOL), ("lr", LR_RTOL)):
            assert _close(got[key], want[key], rtol), (want["step"], key, got[key], want[key])
    # val loss at exactly the reference's steps
    assert {s for s in metrics if "val_loss" in metrics[s]} == set(ref["val"])
    for s, want in ref["val"].items():
        assert _close(metrics[s]["val_loss"], want, LOSS_RTOL), (s, metrics[s]["val_loss"], want)
    # main.log: llm.c's lines, their printed digits within half a unit of the reference
    trl = re.compile(r"s:(\d+) trl:(\S+) lr:(\S+) norm:(\S+)$")
    tel = re.compile(r"s:(\d+) tel:(\S+)$")
    seen_train, seen_val = [], []
    for line in log:
        if m := trl.match(line):
            s = int(m.group(1))
            want = ref["steps"][s]
            for text, key, half in ((m.group(2), "train_loss", 5e-5), (m.group(3), "lr", 5e-7),
                                    (m.group(4), "grad_norm", 5e-3)):
                assert abs(float(text) - want[key]) <= half * 1.001 + 1e-5 * want[key], line
            seen_train.append(s)
        elif m := tel.match(line):
            s = int(m.group(1))
            assert abs(float(m.group(2)) - ref["val"][s]) <= 5e-5 * 1.001 + 1e-5, line
            seen_val.append(s)
    assert seen_train == list(range(steps)) and seen_val == sorted(ref["val"])
    # the final weights. The key bias (qkvb[:, C:2C]) is left out: softmax over the keys is
    # invariant to it, so its exact gradient is 0 and AdamW's update there is m/sqrt(v) of
    # float32 rounding noise in the engine (up to ~0.1 lr) against ~1e-9 lr in float64
    C = CFG["channels"]
    for name in R.PARAM_NAMES:
        got, want = params[name], ref["params"][name]
        if name == "qkvb":
            got, want = np.delete(got, np.s_[C:2 * C], axis=1), np.delete(want, np.s_[C:2 * C], axis=1)
        err = float(np.abs(got - want).max())
        assert err <= PARAM_ATOL * peak_lr, (name, err / peak_lr)


# flag sets, each >= 10 steps; every one also shuffles over 3 shards and crosses an epoch
CASES = {
    "cosine_warmup_decay_accumulation": ["-x", "12", "-k", "cosine", "-u", "3", "-q", "0.1",
                                         "-l", "1e-3", "-d", str(2 * B * T), "-v", "4", "-m", "3"],
    "linear_decay_to_zero_high_lr_clipped": ["-x", "12", "-k", "linear", "-u", "2", "-q", "0.0",
                                             "-l", "1e-2", "-v", "6", "-m", "2"],
    "wsd_weight_decay_val_whole_split": ["-x", "15", "-k", "wsd", "-u", "2", "-q", "0.2",
                                         "-l", "3e-3", "-c", "0.5", "-v", "5", "-m", "-1"],
    "constant_ignores_warmup_one_epoch_seed": ["-k", "constant", "-u", "4", "-l", "2e-3",
                                               "-c", "0.1", "--seed", "7", "-v", "8", "-m", "4"],
}


@pytest.mark.parametrize("case", CASES)
def test_train_matches_the_loop_reference(files, case):
    flags = CASES[case]
    run = train_cli(files, case, flags)
    ref = reference(files, flags, steps=run[4])
    assert_matches_reference(run, ref)


def test_flag_sets_exercise_what_they_are_named_for(files):
    """The reference runs of CASES really warm up, decay, accumulate, clip and average val."""
    refs = {c: reference(files, f, steps=_flag(f, "-x", -1) if "-x" in f else
                         sum(TRAIN_SHARDS) // (B * T)) for c, f in CASES.items()}
    lrs = [s["lr"] for s in refs["cosine_warmup_decay_accumulation"]["steps"]]
    assert lrs[0] == pytest.approx(1e-3 / 3) and max(lrs) == pytest.approx(1e-3)
    assert lrs[-1] < 0.2e-3 and refs["cosine_warmup_decay_accumulation"]["grad_accum_steps"] == 2
    clipped = refs["linear_decay_to_zero_high_lr_clipped"]["steps"]
    assert sum(s["grad_norm"] > 1.0 for s in clipped) >= len(clipped) // 2
    assert sorted(refs["wsd_weight_decay_val_whole_split"]["val"]) == [0, 5, 10, 15]
    const = refs["constant_ignores_warmup_one_epoch_seed"]
    assert len(const["steps"]) == sum(TRAIN_SHARDS) // (B * T) == 23
    assert {s["lr"] for s in const["steps"]} == {2e-3}


def test_nproc2_over_shm_matches_the_loop_reference(files):
    """Two processes, the real shared-memory all-reduce: each rank reads its own B*T+1 slice
    of every 2*B*T sample in its own shuffle (seed 42 + rank); gradients and losses are the
    means over both ranks, the val loss the mean of the ranks' means."""
    flags = ["-x", "12", "-k", "cosine", "-u", "2", "-q", "0.1", "-l", "3e-3",
             "-d", str(4 * B * T), "-c", "0.1", "-v", "4", "-m", "2"]
    run = train_cli(files, "nproc2", flags, nproc=2)
    ref = reference(files, flags, nproc=2, steps=12)
    assert ref["grad_accum_steps"] == 2
    start = next(e for e in run[5] if e["event"] == "start")
    assert start["P"] == 2 and all(run[0][s]["allreduce_ms"] > 0 for s in range(12))
    assert_matches_reference(run, ref)


def test_samples_printed_during_training_match_the_reference(files):
    """-s 1 -g 12: after each step a sample from the start token (0 here: V = 64 has no GPT-2
    EOT) with coins from xorshift64* seeded 1337 afresh each time, as train_gpt2.cu prints it.
    A coin lands within 1e-6 of a CDF boundary with probability ~1e-6 per token, so float32
    logits pick the same ids as float64 ones."""
    flags = ["-x", "3", "-k", "constant", "-l", "1e-2", "-v", "0", "-s", "1", "-g", "12"]
    run = train_cli(files, "samples", flags)
    ref = reference(files, flags, steps=3)
    got = {e["step"]: [int(t) for t in e["text"].split()] for e in run[5] if e["event"] == "sample"}
    assert got == ref["samples"] and sorted(got) == [1, 2, 3]
    assert all(len(ids) == 11 for ids in got.values())
    assert len({tuple(ids) for ids in got.values()}) == 3  # the weights moved between samples


def test_mfu_is_llmcs_formula_over_the_measured_peak(files, tmp_path):
    """llm.c gpt2_estimate_mfu: (6*N + 6*L*C*T) FLOPs per token times B*T*accum tokens per step,
    over the step's seconds, as a fraction of the peak (llmctl: this machine's fp32 sgemm rate
    at the run's thread count); tokens/s is B*T*accum over the same seconds."""
    from llmctl.train import Trainer, TrainConfig, measure_peak_flops

    cfg = TrainConfig(train_data=str(files / "train_*.bin"), val_data=str(files / "val.bin"),
                      init=str(files / "init.bin"), output_dir=str(tmp_path / "o"), batch_size=B,
                      seq_len=T, total_batch_size=2 * B * T, max_steps=3, val_loss_every=0,
                      sample_every=0, threads=1)
    trainer = Trainer(cfg)
    trainer.run()
    assert trainer.peak_flops == measure_peak_flops(1) > 0
    N, L, C = R.num_parameters(CFG), CFG["num_layers"], CFG["channels"]
    flops_per_step = (6 * N + 6 * L * C * T) * B * T * 2
    recs = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 3
    for rec in recs:
        seconds = rec["ms"] / 1000.0
        assert rec["mfu"] == pytest.approx(flops_per_step / seconds / trainer.peak_flops, rel=1e-12)
        assert rec["tokens_per_s"] == pytest.approx(2 * B * T / seconds, rel=1e-12)


def test_e_d6_starts_from_llmcs_random_init(tmp_path):
    """-e d6: llm.c's d6 shape (L=6, C=384, NH=6, maxT=1024, V=50257, Vp=50304) and init: one
    mt19937 seeded 42, wte's first V rows ~ N(0, 0.02) (its first 16 values are the first
    Box-Muller block), padded rows 0, the residual projections at 0.02/sqrt(2L), biases 0,
    LayerNorm weights 1. -x 0 -n 1 checkpoints the untouched init."""
    rng = np.random.default_rng(0)
    LR.write_shard(tmp_path / "gpt2.bin", rng.integers(0, 50257, 64))
    r = subprocess.run([sys.executable, "-m", "llmctl", "train", "-i", str(tmp_path / "gpt2.bin"),
                        "-j", str(tmp_path / "gpt2.bin"), "-e", "d6", "-b", "1", "-t", "8", "-x", "0",
                        "-n", "1", "-v", "0", "-s", "0", "--threads", "1", "-o", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    cfg, p = LR.read_checkpoint(tmp_path / "o" / "model_00000000.bin")
    assert cfg == dict(max_seq_len=1024, vocab_size=50257, num_layers=6, num_heads=6, channels=384,
                       padded_vocab_size=50304)
    first = LR.normal16(LR.MT19937(42), std=0.02)
    np.testing.assert_allclose(p["wte"].reshape(-1)[:16], first, rtol=1e-5, atol=1e-9)
    assert not p["wte"][50257:].any()
    for name, std in (("wte", 0.02), ("wpe", 0.02), ("qkvw", 0.02), ("fcw", 0.02),
                      ("attprojw", 0.02 / math.sqrt(12)), ("fcprojw", 0.02 / math.sqrt(12))):
        a = p[name][:50257] if name == "wte" else p[name]
        assert abs(a.mean()) < 1e-4 and a.std() == pytest.approx(std, rel=0.01), name
    for name in ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfb"):
        assert not p[name].any(), name
    for name in ("ln1w", "ln2w", "lnfw"):
        assert (p[name] == 1.0).all(), name
    del p


# ----------------------------------------------------------------------------------------------
# the reference itself, against llm.c's published vectors (so it cannot share a bug with llmctl)

def test_reference_mt19937_matches_rand_h_vectors():
    rng = LR.MT19937(137)  # llmc/rand.h's header comment (PyTorch's generator)
    assert [rng.randint32() for _ in range(5)] == [4053805790, 2173880614, 380293709,
                                                   1237255315, 2986595568]
    for _ in range(16):  # what normal_(8) consumes there (8 randfloat64 of 2 words each)
        rng.randint32()
    assert rng.randint32() == 2186503452
    n16 = LR.normal16(rng)  # then normal_(16) begins -1.28139, -2.64640 and ends 0.39620
    assert [round(n16[i], 5) for i in (0, 1, 15)] == [-1.28139, -2.6464, 0.3962]
    assert rng.randint32() == 2756748748


def test_reference_loader_matches_llmc_shuffle_vectors(tmp_path):
    """llm.c's DataLoader on Tiny Shakespeare's train split (305,260 tokens, B=4, T=64): the
    sample order of rank 0 begins 408, 791, 914, 1057, 81, 450 and, after one epoch, 820, 64, 871,
    704; rank 1 of 2 begins 251, 260, 93. Only the shard's size matters for the order."""
    LR.write_shard(tmp_path / "ts.bin", np.zeros(305_260, dtype=np.uint16))
    ld = LR.Loader(str(tmp_path / "ts.bin"), 4, 64)
    assert ld.num_samples == 1192 and ld.sample_order[:6] == [408, 791, 914, 1057, 81, 450]
    for _ in range(1193):  # the 1193rd batch starts the second epoch
        ld.next_batch()
    assert ld.sample_order[:4] == [820, 64, 871, 704]
    assert LR.Loader(str(tmp_path / "ts.bin"), 4, 64, rank=1, P=2).sample_order[:3] == [251, 260, 93]


def test_reference_schedules_at_their_corners():
    lr = 1e-3
    assert LR.learning_rate("cosine", 0, lr, 4, 20, 0.1) == pytest.approx(lr / 4)
    assert LR.learning_rate("cosine", 4, lr, 4, 20, 0.1) == pytest.approx(lr)
    assert LR.learning_rate("cosine", 12, lr, 4, 20, 0.1) == pytest.approx(0.55 * lr)
    assert LR.learning_rate("cosine", 20, lr, 4, 20, 0.1) == pytest.approx(0.1 * lr)
    assert LR.learning_rate("linear", 12, lr, 4, 20, 0.0) == pytest.approx(0.5 * lr)
    assert LR.learning_rate("constant", 0, lr, 4, 20, 0.0) == lr
    assert LR.learning_rate("wsd", 15, lr, 4, 20, 0.0) == lr  # stable until int(0.8 * 20) = 16
    assert LR.learning_rate("wsd", 18, lr, 4, 20, 0.0) == pytest.approx((1 - math.sqrt(0.5)) * lr)


def test_reference_decays_exactly_the_matrices():
    shapes = dict(R.param_shapes(CFG))
    assert {n for n in R.PARAM_NAMES if LR.decays(n, shapes[n])} == {
        "wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}


def test_reference_files_round_trip(tmp_path):
    p = R.random_params(CFG, seed=3)
    LR.write_checkpoint(tmp_path / "m.bin", CFG, p)
    assert os.path.getsize(tmp_path / "m.bin") == 1024 + 4 * R.num_parameters(CFG)
    cfg, q = LR.read_checkpoint(tmp_path / "m.bin")
    assert cfg == CFG
    for n in R.PARAM_NAMES:
        np.testing.assert_array_equal(q[n], p[n].astype(np.float32))
    LR.write_shard(tmp_path / "s.bin", np.arange(7))
    assert LR.read_shard(tmp_path / "s.bin").tolist() == list(range(7))
