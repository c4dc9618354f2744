"""A tiny training setup shared by the distributed tests (dist, ring, mpi).

A 30k-parameter llm.c checkpoint `init.bin` plus `train.bin` / `val.bin` shards in a directory,
and the `llmctl train` arguments that run on them, so every backend's equivalence test trains the
same model on the same tokens.
"""
import json

import numpy as np

OVERFIT_TOKENS = 512  # -d of the -a 1 equivalence tests


def write_tiny_run(d, train_tokens, seed=0, val_tokens=200):
    """Write init.bin (L=2, C=32, V=64), train.bin (train_tokens ids) and val.bin (val_tokens
    ids) into d."""
    from llmctl.formats import write_datafile
    from llmctl.model import GPT2, GPT2Config

    cfg = GPT2Config(max_seq_len=16, vocab_size=64, padded_vocab_size=128, num_layers=2,
                     num_heads=2, channels=32)
    m = GPT2(cfg, n_threads=1)
    rng = np.random.default_rng(seed)
    m.params[:] = (rng.standard_normal(m.num_parameters) * 0.05).astype(np.float32)
    m.save_checkpoint(str(d / "init.bin"))
    write_datafile(str(d / "train.bin"), rng.integers(0, 64, train_tokens).astype(np.uint16))
    write_datafile(str(d / "val.bin"), rng.integers(0, 64, val_tokens).astype(np.uint16))
    return d


def bf16_env():
    """The environment that runs `--precision bf16` here: nothing on a CPU that multiplies bf16
    natively, else LLMCTL_BF16_EMULATE=1 (the same bf16 numerics on fp32 GEMMs), which the ranks
    a launcher starts inherit."""
    from llmctl._ext import matmul

    return {} if matmul.bf16_native() else {"LLMCTL_BF16_EMULATE": "1"}


def tiny_train_args(d, out, B, T, *extra):
    """`llmctl train` arguments for the tiny run in d, writing to d/out, 1 thread, no val/samples."""
    return ["train", "-i", str(d / "train.bin"), "-j", str(d / "val.bin"), "-e", str(d / "init.bin"),
            "-b", str(B), "-t", str(T), "-l", "1e-3", "-v", "0", "-s", "0", "--threads", "1",
            "-o", str(d / out), *extra]


def check_adopted_grads(args, comm):
    """Launcher target: on this rank's real shared-memory comm, the worker's adopt_grads moves
    model.grads (and the views model.g) into the comm's row; zero_grad, backward, grad_norm,
    the zero-copy all-reduce and update must then give exactly the steps of an untouched model
    whose private gradients are all-reduced by copy. Raises AssertionError (failing the job)."""
    from llmctl.train import adopt_grads
    from llmctl.model import GPT2

    ref = GPT2.from_checkpoint(args["init"], n_threads=1)
    m = GPT2.from_checkpoint(args["init"], n_threads=1)
    adopt_grads(comm, m)
    assert comm.is_shared(m.grads) and not comm.is_shared(ref.grads)
    for name, v in m.g.items():
        assert np.shares_memory(v, m.grads) and v.shape == ref.g[name].shape, name
    rng = np.random.default_rng(3 + comm.rank)  # each rank its own batch: the mean matters
    B, T = args["B"], args["T"]
    for step in (1, 2):  # a second step catches a zero_grad or update bound to the old buffer
        x = rng.integers(0, 64, (B, T)).astype(np.int32)
        for model in (ref, m):
            model.zero_grad()
            model.forward(x, np.roll(x, -1, axis=1))
            model.backward()
        assert np.array_equal(m.grads, ref.grads) and np.abs(m.grads).max() > 0
        for model in (ref, m):
            comm.all_reduce_mean(model.grads)
        assert np.array_equal(m.grads, ref.grads)
        assert m.grad_norm() == ref.grad_norm()
        for model in (ref, m):
            model.update(1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0, step)
        assert np.array_equal(m.params, ref.params)
    return {"rank": comm.rank, "steps": 2}


def overfit_args(d, out, B, T, *extra):
    """train_gpt2.cu's -a 1 over -d 512 tokens for 4 steps: every step starts over at the top of
    val.bin (which needs 512 + 1 tokens), the micro-steps of all ranks reading consecutive
    batches, so any number of processes trains on exactly the same tokens."""
    return tiny_train_args(d, out, B, T, "-a", "1", "-d", str(OVERFIT_TOKENS), "-x", "4", *extra)


def train_losses(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(ln)["train_loss"] for ln in f if "train_loss" in ln]


def assert_overfit_losses_match(ref, run):
    """The -a 1 losses of a multi-process run against one process: same tokens, so only fp32
    summation order differs (per-rank means then a mean of means vs one accumulation over all
    micro-steps, ~1e-7 relative per step; AdamW keeps it far below the 1e-4 asked for)."""
    l1, l2 = train_losses(ref), train_losses(run)
    assert len(l1) == len(l2) == 4
    np.testing.assert_allclose(l2, l1, rtol=1e-4)
    assert l1[-1] < l1[0] - 1e-3  # the steps trained (the comparison is not vacuous)


def assert_bf16_backend_matches_shm_and_one_process(d, name):
    """The 6-step bf16 job of run `name` (2 ranks over some backend) against run "shm" (the same 2
    ranks over shared memory: one fp32 addition and an exact halving, so bit for bit) and run
    "one" (1 process with -d 2*B*T: only the gradients' fp32 summation order differs).

    Against "one" the gradients differ by ~1e-9 absolute, but AdamW divides each by its own
    running scale: where a gradient is near zero (a unit the GELU has switched off), a relative
    change of a percent, or a weight of the bf16 copy rounded the other way, moves that update by
    a percent of lr. So nearly every parameter agrees within 1e-6 (1/1000 of one lr=1e-3 step)
    and a few (at most 1 in 1000) within 1e-4; a wrong accumulation moves most of them by ~lr.
    (Seen on the emulated bf16 path over scipy's BLAS: 3 of 30080 weights, up to 4.6e-6.)"""
    def params(out):
        return np.fromfile(d / out / "model_00000006.bin", dtype=np.float32)[256:]  # skip the header

    assert len(train_losses(d / name)) == 6
    assert train_losses(d / name) == train_losses(d / "shm")
    np.testing.assert_array_equal(params(name), params("shm"))
    np.testing.assert_allclose(train_losses(d / name), train_losses(d / "one"), rtol=1e-6)
    diff = np.abs(params(name) - params("one"))
    assert (diff > 1e-6).mean() <= 1e-3 and diff.max() <= 1e-4, (int((diff > 1e-6).sum()), diff.max())
    assert np.abs(params("one") - np.fromfile(d / "init.bin", dtype=np.float32)[256:]).max() > 1e-3


def assert_checkpoints_whole(out, P, shard, killed_pid):
    """After a rank was killed mid-run: every model_/state_ file in `out` is complete (its size
    and header check out: the model's tensors, P state files of `shard` floats of m and v each,
    rank r's naming rank r), DONE_ marks only checkpoints with all of them, and the only hidden
    file left is a temp file of the killed process (it had no chance to remove it; nothing reads
    it, and the next run's claim of -o removes it). -> the newest DONE step."""
    import os
    import re

    from llmctl.checkpoints import find_max_step
    from llmctl.formats import read_checkpoint, read_state_file

    names = set(os.listdir(out))
    for name in names:
        if name.startswith("model_"):
            read_checkpoint(str(out / name))
        elif name.startswith("state_"):
            st = read_state_file(str(out / name), shard)
            assert (st.num_processes, st.process_rank) == (P, int(name[15:20])), name
        elif name.startswith("."):
            assert re.fullmatch(rf"\.(model|state)_\d{{8}}(_\d{{5}})?\.bin\.tmp-{killed_pid}", name), name
    S = find_max_step(str(out))
    for step in (int(n[5:]) for n in names if n.startswith("DONE_")):
        want = {f"model_{step:08d}.bin"} | {f"state_{step:08d}_{r:05d}.bin" for r in range(P)}
        assert want <= names, (step, sorted(want - names))
    return S
