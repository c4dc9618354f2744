"""`llmctl train -z 1` (ZeRO-1) and `-r` (recompute): llm.c's shard layout, the same training as
-z 0 over shm, ring, MPI and --nnodes x --nproc, per-rank state files that resume bit for bit,
and the errors.

With 2 ranks every backend's gradient mean is (g0 + g1) / 2 (one fp32 addition, commutative bit
for bit, and an exact halving), whether all-reduced (-z 0) or reduce-scattered (-z 1). The one
difference is the gradient norm: -z 0 sums the squares of the whole buffer, -z 1 each rank's
pieces and then the two partial sums (float64 both), so the norms agree to ~1e-15 relative. With
the clip inactive (norm < --grad-clip) the update does not read the norm, so losses and
parameters must agree bit for bit; with the clip active the scale clip/norm may differ in its
last bit, a ~1e-7 relative change of one step, hence the 1e-6 bounds there.
"""
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from llmctl.distributed.zero import shard_layout
from llmctl.errors import ConfigError, DistError
from llmctl.formats import read_state_file
from llmctl.model import GPT2, GPT2Config, param_offsets
from tinyrun import bf16_env, train_losses

B, T = 2, 16
CFG = GPT2Config(max_seq_len=64, vocab_size=50257, padded_vocab_size=50304, num_layers=2,
                 num_heads=2, channels=32)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 1.7M-parameter GPT-2 (C=32, L=2, GPT-2's vocabulary) and the first tokens of
    tinyshakespeare (the shared test data) as train and val shards."""
    from conftest import shared_file
    from llmctl.formats import write_datafile
    from llmctl.tokenizer import get_tokenizer

    d = tmp_path_factory.mktemp("zero")
    text = shared_file("tinyshakespeare/input.txt").read_text(encoding="utf-8")[:8000]
    toks = np.array(get_tokenizer().encode_ordinary(text), dtype=np.uint16)
    write_datafile(str(d / "val.bin"), toks[:300])
    write_datafile(str(d / "train.bin"), toks[300:])
    m = GPT2(CFG, n_threads=1)
    m.params[:] = (np.random.default_rng(0).standard_normal(m.num_parameters) * 0.02).astype(np.float32)
    m.p["ln1w"][...] = m.p["ln2w"][...] = m.p["lnfw"][...] = 1.0
    m.save_checkpoint(str(d / "init.bin"))
    return d


def _args(d, out, *extra):
    return ["train", "-i", str(d / "train.bin"), "-j", str(d / "val.bin"), "-e", str(d / "init.bin"),
            "-b", str(B), "-t", str(T), "-l", "1e-3", "-v", "0", "-s", "0", "--threads", "1",
            "-x", "4", "-n", "4", "-o", str(d / out), *extra]


def _cli(args, env=None):
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True,
                          text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def _params(path):
    return np.fromfile(path, dtype=np.float32)[256:]


def _norms(out):
    import json

    with open(out / "metrics.jsonl") as f:
        return [json.loads(ln)["grad_norm"] for ln in f if "train_loss" in ln]


def _check_shards(d, z0, z1, step=4, P=2):
    """Each -z 1 rank's state file holds its pieces of -z 0's m and v, back to back."""
    N = sum(n for _, n, _ in param_offsets(CFG).values())
    full = read_state_file(str(d / z0 / f"state_{step:08d}_00000.bin"), N)
    for r, pieces in enumerate(shard_layout(CFG, P)):
        st = read_state_file(str(d / z1 / f"state_{step:08d}_{r:05d}.bin"), N // P)
        assert (st.num_processes, st.process_rank) == (P, r)
        m = np.concatenate([full.m[lo:hi] for lo, hi, _, _ in pieces])
        v = np.concatenate([full.v[lo:hi] for lo, hi, _, _ in pieces])
        np.testing.assert_array_equal(st.m, m)
        np.testing.assert_array_equal(st.v, v)
        assert np.abs(m).max() > 0


# ---------------------------------------------------------------------------------------------
# the layout


def test_shard_layout_is_llmc_per_tensor_and_per_layer():
    """train_gpt2.cu gpt2_update: tensor i (per layer for i in 2..13) cut into P pieces of
    size/P; rank r's piece of layer l at offset_i + l*size + r*size/P, its moments at
    offset_i/P + l*size/P. Together the pieces cover the buffer once; each rank's moments fill
    [0, N/P) in order."""
    offs = param_offsets(CFG)
    N = sum(n for _, n, _ in offs.values())
    for P in (1, 2, 4):
        lay = shard_layout(CFG, P)
        cover = np.zeros(N, np.int32)
        for pieces in lay:
            mo = 0
            for lo, hi, m_off, _ in pieces:
                cover[lo:hi] += 1
                assert m_off == mo
                mo += hi - lo
            assert mo == N // P
        assert (cover == 1).all()
    lay = shard_layout(CFG, 2)
    C, Vp = CFG.channels, CFG.padded_vocab_size
    assert lay[1][0] == (Vp * C // 2, Vp * C, 0, "wte")            # wte: one tensor
    q = offs["qkvw"][0]
    qkv = [p for p in lay[1] if p[3] == "qkvw"]
    assert qkv == [(q + 3 * C * C // 2, q + 3 * C * C, q // 2, "qkvw"),      # layer 0
                   (q + 3 * C * C + 3 * C * C // 2, q + 6 * C * C, q // 2 + 3 * C * C // 2, "qkvw")]


def test_shard_layout_refuses_a_world_size_that_does_not_divide():
    with pytest.raises(ConfigError, match="tensor wpe has 2048 elements, not a multiple of 3"):
        shard_layout(CFG, 3)


# ---------------------------------------------------------------------------------------------
# training over the three transports


def test_zero1_over_a_backend_without_the_collectives_is_refused_naming_it():
    # every built-in transport has them; a Comm plugged in without them is one ConfigError
    # before any model is built, naming its class
    from types import SimpleNamespace

    from llmctl.distributed.base import Comm
    from llmctl.distributed.hier import HierComm
    from llmctl.train import Trainer

    assert HierComm.supports_zero and not Comm.supports_zero
    fake = SimpleNamespace(cfg=SimpleNamespace(zero_stage=1), P=4, comm=Comm())
    with pytest.raises(ConfigError) as e:
        Trainer._check_zero(fake, GPT2Config.from_descriptor("d6"))
    assert "Comm" in e.value.message and "-z 1" in e.value.message and "-z 0" in e.value.hint


def test_shm_zero1_equals_zero0_and_saves_llmc_shards(run_dir):
    """--nproc 2 -z 1 vs -z 0 (shm): the same losses and parameters to the bit (clip inactive),
    norms to 1e-12; every rank's state file is its llm.c shard of -z 0's m and v; parameters
    are compared across ranks after every step (CHECK_PARAMS). With the clip active (0.05 <
    norm) the clipped runs agree to 1e-6."""
    d = run_dir
    check = {"LLMCTL_DIST_CHECK_PARAMS": "1"}
    for out, extra in (("z0", ()), ("z1", ("-z", "1")), ("c0", ("--grad-clip", "0.05")),
                       ("c1", ("--grad-clip", "0.05", "-z", "1"))):
        r = _cli(_args(d, out, "--nproc", "2", *extra), env=check)
        assert r.returncode == 0, r.stderr
    assert train_losses(d / "z1") == train_losses(d / "z0")
    np.testing.assert_array_equal(_params(d / "z1/model_00000004.bin"), _params(d / "z0/model_00000004.bin"))
    np.testing.assert_allclose(_norms(d / "z1"), _norms(d / "z0"), rtol=1e-12)
    _check_shards(d, "z0", "z1")
    assert min(_norms(d / "c0")) > 0.05   # the clip was active at every step
    np.testing.assert_allclose(train_losses(d / "c1"), train_losses(d / "c0"), rtol=1e-6)
    np.testing.assert_allclose(_params(d / "c1/model_00000004.bin"), _params(d / "c0/model_00000004.bin"),
                               rtol=0, atol=1e-6)
    assert np.abs(_params(d / "c0/model_00000004.bin") - _params(d / "init.bin")).max() > 1e-3


def test_zero1_resumes_bit_exactly_and_refuses_another_stage_or_world_size(run_dir):
    """-y 1 from a -z 1 checkpoint continues bit for bit (model and both state files); a resume
    with -z 0 or with one process is one Error + Hint, exit 2, and writes nothing."""
    import shutil

    d = run_dir
    r = _cli(_args(d, "full", "--nproc", "2", "-z", "1", "-n", "2"))
    assert r.returncode == 0, r.stderr
    shutil.copytree(d / "full", d / "part")
    for name in os.listdir(d / "part"):
        if "00000004" in name:
            os.remove(d / "part" / name)
    before = sorted(os.listdir(d / "part"))
    for extra, what in ((("--nproc", "2"), "a -z 1 checkpoint, but this run has -z 0"),
                        (("-z", "1"), "written by 2 processes, but this run has 1")):
        bad = _cli(_args(d, "part", "-y", "1", "-n", "2", *extra))
        assert bad.returncode == 2, bad.stderr
        assert what in bad.stderr and "Hint: resume with" in bad.stderr and "Traceback" not in bad.stderr
        assert sorted(os.listdir(d / "part")) == before
    ok = _cli(_args(d, "part", "-y", "1", "-n", "2", "--nproc", "2", "-z", "1"))
    assert ok.returncode == 0, ok.stderr
    for name in ("model_00000004.bin", "state_00000004_00000.bin", "state_00000004_00001.bin"):
        assert (d / "part" / name).read_bytes() == (d / "full" / name).read_bytes(), name


def test_zero1_bad_input_is_one_error_before_anything_is_written(run_dir):
    """-z 1 over 3 ranks (C=32 does not cut into 3) and -z 2 are refused before any file is
    written; -z 1 with one process runs as -z 0, as llm.c's set_zero_configs does (its one
    shard is the whole model), and says so."""
    d = run_dir
    r = _cli(_args(d, "p3", "--nproc", "3", "-z", "1", "-b", "1", "-d", str(3 * T)))
    assert r.returncode == 2 and "not a multiple of 3" in r.stderr and "Hint:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (d / "p3").exists()
    r = _cli(_args(d, "z2", "-z", "2"))
    assert r.returncode == 2 and "zero stage (-z) must be 0 or 1" in r.stderr and "Hint:" in r.stderr
    assert not (d / "z2").exists()
    one = _cli(_args(d, "one1", "-z", "1"))
    assert one.returncode == 0 and "runs as -z 0 (as llm.c does)" in one.stderr + one.stdout
    ref = _cli(_args(d, "one0"))
    assert ref.returncode == 0, ref.stderr
    for name in ("model_00000004.bin", "state_00000004_00000.bin"):
        assert (d / "one1" / name).read_bytes() == (d / "one0" / name).read_bytes()


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.mark.parametrize("precision, recompute", [("fp32", "-1"), ("bf16", "-1"), ("bf16", "3")])
def test_ring_zero1_equals_shm_zero0(run_dir, precision, recompute):
    """Two ranks started per rank (torchrun's environment) form one TCP ring; -z 1 over it gives
    the bits of -z 0 over shm, and in bf16 every rank's bf16 copy of the weights is the same
    (CHECK_PARAMS compares fp32 parameters and the bf16 copy after every step). At -r 3 the
    ring's ranks keep only wte's bf16 copy (the layers cast theirs as they run): the same bits."""
    d, tag = run_dir, f"{precision}-r{recompute}"
    env = bf16_env() if precision == "bf16" else {}
    port = _port()
    ps = [subprocess.Popen([sys.executable, "-m", "llmctl.cli", *_args(
        d, f"ring-{tag}", "-z", "1", "--precision", precision, "--dist-timeout", "10",
        "--rdzv-timeout", "30", "-r", recompute)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", LLMCTL_SECRET="test-secret-0123456789abcdef",
                 RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LLMCTL_BIND_ADDR="127.0.0.1",
                 LLMCTL_DIST_CHECK_PARAMS="1", **env)) for r in range(2)]
    _all_exit_0(ps)
    r = _cli(_args(d, f"shm-{tag}", "--nproc", "2", "--precision", precision), env=env)
    assert r.returncode == 0, r.stderr
    assert train_losses(d / f"ring-{tag}") == train_losses(d / f"shm-{tag}")
    np.testing.assert_array_equal(_params(d / f"ring-{tag}/model_00000004.bin"),
                                  _params(d / f"shm-{tag}/model_00000004.bin"))
    _check_shards(d, f"shm-{tag}", f"ring-{tag}")


def test_mpi_zero1_equals_shm_zero0(run_dir):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'llmctl[mpi]'")
    from test_mpi import _run

    d = run_dir
    r = _run(2, [sys.executable, "-m", "llmctl.cli", *_args(d, "mpi", "-z", "1", "--backend", "mpi")],
             env={"LLMCTL_DIST_CHECK_PARAMS": "1"}, timeout=180)
    assert r.returncode == 0, r.stderr
    if not (d / "z0").exists():
        assert _cli(_args(d, "z0", "--nproc", "2")).returncode == 0
    assert train_losses(d / "mpi") == train_losses(d / "z0")
    np.testing.assert_array_equal(_params(d / "mpi/model_00000004.bin"), _params(d / "z0/model_00000004.bin"))
    _check_shards(d, "z0", "mpi")


def _all_exit_0(ps, timeout=180):
    """Wait for every process (killing the rest if one hangs); each must exit 0."""
    try:
        for p in ps:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()


def _hier(d, out, *extra):
    """`llmctl train --nnodes 2 --nproc 2` (4 ranks, 2 loopback "hosts" 127.0.0.2 and .3: shm
    inside each, a TCP ring of 2 per local rank across them), parameters compared across all
    ranks after every step; both node launchers must exit 0."""
    port = _port()
    env = dict(os.environ, OMP_NUM_THREADS="1", LLMCTL_SECRET="test-secret-0123456789abcdef",
               LLMCTL_DIST_CHECK_PARAMS="1")
    ps = [subprocess.Popen([sys.executable, "-m", "llmctl.cli", *_args(
        d, out, "--nnodes", "2", "--node-rank", str(i), "--nproc", "2", "--master-addr", "127.0.0.2",
        "--master-port", str(port), "--bind-addr", f"127.0.0.{2 + i}", "--dist-timeout", "10",
        "--rdzv-timeout", "30", *extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env) for i in range(2)]
    _all_exit_0(ps)


def test_hier_zero1_equals_zero0_and_resumes_bit_exactly(run_dir):
    """--nnodes 2 --nproc 2 -z 1 vs -z 0 over the same hierarchical transport: every element's
    mean is the mean of two node means either way (shm's fixed-order pair, then one ring
    addition), so losses and weights agree to the bit (clip inactive) and each of the 4 state
    files is its rank's llm.c shard of -z 0's m and v. -y 1 from the step-2 checkpoint
    continues bit for bit: the model and all four state files of step 4."""
    import shutil

    d = run_dir
    _hier(d, "h0", "-n", "2")
    _hier(d, "h1", "-z", "1", "-n", "2")
    assert train_losses(d / "h1") == train_losses(d / "h0")
    np.testing.assert_array_equal(_params(d / "h1/model_00000004.bin"), _params(d / "h0/model_00000004.bin"))
    assert np.abs(_params(d / "h1/model_00000004.bin") - _params(d / "init.bin")).max() > 1e-3
    np.testing.assert_allclose(_norms(d / "h1"), _norms(d / "h0"), rtol=1e-12)
    _check_shards(d, "h0", "h1", P=4)
    shutil.copytree(d / "h1", d / "hpart")
    for name in os.listdir(d / "hpart"):
        if "00000004" in name:
            os.remove(d / "hpart" / name)
    _hier(d, "hpart", "-z", "1", "-n", "2", "-y", "1")
    for name in ["model_00000004.bin"] + [f"state_00000004_{r:05d}.bin" for r in range(4)]:
        assert (d / "hpart" / name).read_bytes() == (d / "h1" / name).read_bytes(), name


def test_ring_reduce_scatter_with_a_lost_member_is_a_clear_error():
    """A member that dies (its sockets close) while its neighbour is in the reduce-scatter: the
    neighbour raises one DistError naming the collective, and its buffer is never half-used by
    the caller (the exception propagates before the update)."""
    from llmctl.distributed import rendezvous as rdzv
    from llmctl.distributed.ring import RingComm, ring_connect

    secret = rdzv.resolve_secret({"LLMCTL_SECRET": "test-secret-0123456789abcdef"})
    lis = [rdzv.bind_listener("127.0.0.1", 0) for _ in range(2)]
    members = [{"rank": i, "node": i, "ring": 0, "addr": "127.0.0.1",
                "port": lis[i].getsockname()[1], "host": f"h{i}"} for i in range(2)]
    socks = {}
    ts = [threading.Thread(target=lambda i=i: socks.__setitem__(i, ring_connect(members, i, lis[i], secret, 5, 10)))
          for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    [s.close() for s in lis]
    comms = [RingComm(members, i, *socks[i], timeout=5, collective_timeout=10) for i in range(2)]
    n = 1 << 16
    shards = [[(0, n // 4), (n // 2, 3 * n // 4)], [(n // 4, n // 2), (3 * n // 4, n)]]
    bufs = [np.full(n, float(i + 1), np.float32) for i in range(2)]
    res = {}

    def rs(i):
        try:
            comms[i].reduce_scatter_mean(bufs[i], shards)
            comms[i].all_gather(bufs[i], shards)
            res[i] = "ok"
        except DistError as e:
            res[i] = e.message

    ts = [threading.Thread(target=rs, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert res == {0: "ok", 1: "ok"} and (bufs[0] == 1.5).all() and (bufs[1] == 1.5).all()
    comms[1].close()   # rank 1 is gone
    with pytest.raises(DistError, match="reduce_scatter_mean"):
        comms[0].reduce_scatter_mean(bufs[0], shards)
    comms[0].close()


# ---------------------------------------------------------------------------------------------
# -r


def test_recompute_levels_train_the_same_bits(run_dir):
    """-r 2 (llm.c's GELU + layernorms) and -r 3 (llmctl's: also the attention residual) train
    the same losses and weights as -r 0 (and bf16 -r 3 as bf16 -r 2 with two ranks and two
    micro-steps) (every level and both precisions: tests/test_model.py's
    test_recompute_modes_agree); -r 4 is one error."""
    d = run_dir
    for lvl in ("0", "2", "3"):
        r = _cli(_args(d, f"r{lvl}", "-r", lvl, "-x", "3", "-n", "3"))
        assert r.returncode == 0, r.stderr
    for lvl in ("2", "3"):
        assert train_losses(d / f"r{lvl}") == train_losses(d / "r0")
        assert (d / f"r{lvl}/model_00000003.bin").read_bytes() == (d / "r0/model_00000003.bin").read_bytes()
    # bf16 -r 3 parks each layer's weights in spent gradient rows between its forward and backward
    # (GPT2.forward): two ranks over shm, two micro-steps a step (only the first parks)
    env = bf16_env()
    for lvl in ("2", "3"):
        r = _cli(_args(d, f"bf16-r{lvl}", "--precision", "bf16", "-r", lvl, "--nproc", "2",
                       "-d", str(2 * 2 * B * T)), env=env)
        assert r.returncode == 0, r.stderr
    assert train_losses(d / "bf16-r3") == train_losses(d / "bf16-r2")
    assert (d / "bf16-r3/model_00000004.bin").read_bytes() == (d / "bf16-r2/model_00000004.bin").read_bytes()
    bad = _cli(_args(d, "r4", "-r", "4"))
    assert bad.returncode == 2 and "recompute (-r) must be 0, 1, 2 or 3" in bad.stderr and "Hint:" in bad.stderr
