"""Tests for llmctl.distributed: the shm all-reduce kernel, the control protocol, the launcher's fault
handling, and `llmctl train --nproc N` equivalence with gradient accumulation.

Every test that launches ranks checks that no llmctl segment is left in /dev/shm and no rank
process survives (fixture `dist_clean`). Timeouts are short (2-3 s) so fault tests stay quick.
"""
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error

from llmctl._ext import reduce  # part of the build: a missing extension fails, never skips
from llmctl.distributed import control
from llmctl.distributed.env import parse_int, resolve_env, threads_per_rank
from llmctl.jobs.launcher import launch
from llmctl.distributed.shm import PREFIX, SHM_DIR, sweep_segments
from llmctl.errors import ConfigError, DistError
from tinyrun import (OVERFIT_TOKENS, assert_checkpoints_whole, assert_overfit_losses_match, bf16_env,
                     overfit_args, tiny_train_args, write_tiny_run)

TOY = "llmctl.distributed.selftest:collectives"


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _ours(name):
    """A segment this test run may own: its launcher pid (llmctl-PID-JOB-GEN) is this process, a
    descendant of it, or dead. A live launcher elsewhere is another run sharing /dev/shm."""
    head = name[len(PREFIX):].split("-")[0]
    if not head.isdigit():
        return True
    pid = int(head)
    if not _alive(pid):
        return True
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = _ppid(pid)
    return False


def _segments():
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and _ours(n)}
    except FileNotFoundError:
        return set()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            state = [ln for ln in f if ln.startswith("State:")][0]
        return "zombie" not in state and "(dead)" not in state
    except (FileNotFoundError, IndexError):
        return False


def _pids(d):
    out = {}
    for name in os.listdir(d):
        if name.endswith(".pid"):
            with open(os.path.join(d, name)) as f:
                out[int(name.split(".")[0])] = json.load(f)["pid"]
    return out


def _wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def dist_clean(tmp_path):
    """Yields a work dir; afterwards: no new /dev/shm segment and no rank process alive."""
    before = _segments()
    yield tmp_path
    pids = _pids(tmp_path) if tmp_path.exists() else {}
    leftover = [p for p in pids.values() if _alive(p)]
    for p in leftover:  # never leave them running, even when the assertion below fails
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    new = _segments() - before
    for n in new:
        os.unlink(os.path.join(SHM_DIR, n))
    assert not leftover, f"orphaned rank processes: {leftover}"
    assert not new, f"leaked shared-memory segments: {new}"


# ---------------------------------------------------------------------------------------------
# the Cython reduction

@pytest.mark.parametrize("nslots", [1, 2, 3, 5])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_reduce_mean_slice_matches_fixed_order_float32(nslots, n_threads):
    rng = np.random.default_rng(nslots)
    n = 3 * 4096 + 17  # several blocks plus a ragged tail
    slots = rng.standard_normal((nslots, n)).astype(np.float32)
    want = slots[0].copy()
    for r in range(1, nslots):
        want = want + slots[r]  # float32, ranks in order: the kernel must give these exact bits
    want = want / np.float32(nslots)
    out = np.full(n, 7.0, dtype=np.float32)
    lo, hi = 5, n - 3
    reduce.reduce_mean_slice(out, slots, lo, hi, n_threads)
    np.testing.assert_array_equal(out[lo:hi], want[lo:hi])
    assert np.all(out[:lo] == 7.0) and np.all(out[hi:] == 7.0)  # outside the slice untouched
    # and the float64 mean agrees to float32 rounding (a sanity check on the reference itself)
    np.testing.assert_allclose(out[lo:hi], slots.astype(np.float64).mean(0)[lo:hi], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nslots", [1, 2, 3, 4])
def test_reduce_mean_inplace_writes_the_same_bits_into_every_row(nslots):
    rng = np.random.default_rng(10 + nslots)
    n = 2 * 4096 + 33
    slots = rng.standard_normal((nslots, n)).astype(np.float32)
    before = slots.copy()
    want = before[0].copy()
    for r in range(1, nslots):
        want = want + before[r]
    want = want / np.float32(nslots)
    lo, hi = 7, n - 5
    reduce.reduce_mean_inplace(slots, lo, hi, 2)
    for r in range(nslots):
        np.testing.assert_array_equal(slots[r, lo:hi], want[lo:hi])
        np.testing.assert_array_equal(slots[r, :lo], before[r, :lo])
        np.testing.assert_array_equal(slots[r, hi:], before[r, hi:])
    # identical to the copy path's kernel (the two all-reduce paths agree bit for bit)
    out = np.zeros(n, np.float32)
    reduce.reduce_mean_slice(out, before, lo, hi, 1)
    np.testing.assert_array_equal(out[lo:hi], slots[0, lo:hi])
    with pytest.raises(ValueError):
        reduce.reduce_mean_inplace(slots, 0, n + 1, 1)


def test_reduce_mean_slice_reads_own_row_from_a_private_buffer():
    """own/own_row: the rank's own contribution comes from its private buffer (never copied to
    shared memory) and the result lands both in out and in own[lo:hi]; the rest of own is kept."""
    rng = np.random.default_rng(7)
    n = 9000
    slots = rng.standard_normal((3, n)).astype(np.float32)
    own = rng.standard_normal(n).astype(np.float32)
    slots[1] = 1e30  # row 1 in shared memory is garbage: it must not be read
    want = ((slots[0] + own) + slots[2]) / np.float32(3)
    keep = own.copy()
    out = np.zeros(n, np.float32)
    reduce.reduce_mean_slice(out, slots, 100, 5000, 2, own, 1)
    np.testing.assert_array_equal(out[100:5000], want[100:5000])
    np.testing.assert_array_equal(own[100:5000], want[100:5000])
    np.testing.assert_array_equal(own[:100], keep[:100])
    np.testing.assert_array_equal(own[5000:], keep[5000:])


def test_reduce_mean_slice_in_place_into_a_slot_and_validation():
    slots = np.arange(2 * 10, dtype=np.float32).reshape(2, 10)
    want = (slots[0] + slots[1]) / np.float32(2)
    reduce.reduce_mean_slice(slots[0], slots, 0, 10, 1)  # out aliases row 0
    np.testing.assert_array_equal(slots[0], want)
    out = np.zeros(10, np.float32)
    with pytest.raises(ValueError):
        reduce.reduce_mean_slice(out, slots, 3, 11, 1)
    with pytest.raises(ValueError):
        reduce.reduce_mean_slice(np.zeros(4, np.float32), slots, 0, 5, 1)  # out ends before hi
    with pytest.raises(ValueError, match="overlaps row 1"):
        reduce.reduce_mean_slice(slots[1], slots, 0, 5, 1)
    with pytest.raises(ValueError):
        reduce.reduce_mean_slice(out, slots, 0, 5, 1, np.zeros(10, np.float32), 2)  # no row 2
    with pytest.raises(ValueError):
        reduce.reduce_mean_slice(out, slots, 0, 5, 0)
    with pytest.raises(ValueError):
        reduce.copy_floats(np.zeros(3, np.float32), np.zeros(4, np.float32), 1)
    src = np.random.default_rng(0).standard_normal(2 * (1 << 18) + 3).astype(np.float32)
    dst = np.zeros_like(src)
    reduce.copy_floats(dst, src, 2)
    np.testing.assert_array_equal(dst, src)


# ---------------------------------------------------------------------------------------------
# control protocol and environment

def test_message_schema_is_strict():
    ok = {"t": "coll", "seq": 0, "op": "allreduce", "n": 5, "digest": "", "step": 1}
    assert control.decode(json.dumps(ok).encode(), control.TO_HUB) == ok
    bad = [
        b"\xff\xfe",                                           # not UTF-8
        b"[1, 2]",                                             # not an object
        json.dumps({"t": "go", "seq": 1, "stop": False}).encode(),   # hub->worker type sent to hub
        json.dumps(dict(ok, extra=1)).encode(),                # unknown field
        json.dumps({k: v for k, v in ok.items() if k != "n"}).encode(),  # missing field
        json.dumps(dict(ok, seq=True)).encode(),               # bool is not an int here
        json.dumps(dict(ok, n="5")).encode(),                  # wrong type
        json.dumps(dict(ok, n=2**70)).encode(),                # out of range
        b'{"t": "hb", "step": NaN}',                           # non-finite constant
        json.dumps({"t": "__import__", "step": 0}).encode(),   # unknown type
    ]
    for b in bad:
        with pytest.raises(control.ProtocolError):
            control.decode(b, control.TO_HUB)
    with pytest.raises(control.ProtocolError):
        control.FrameReader().feed(struct.pack(">I", control.MAX_MSG + 1) + b"x")
    r = control.FrameReader()
    frame = control.encode({"t": "hb", "step": 3})
    assert r.feed(frame[:3]) == [] and r.feed(frame[3:] + frame) == [frame[4:], frame[4:]]


def test_resolve_env_precedence_and_validation():
    e = resolve_env(environ={"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                             "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.source) == (1, 4, 1, 2, "torchrun")
    assert (e.master_addr, e.master_port) == ("10.0.0.1", 29500)
    e = resolve_env(environ={"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.source) == (3, 8, 1, 2, "openmpi")
    e = resolve_env(environ={"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
                             "SLURM_NTASKS_PER_NODE": "2(x2)"})
    assert (e.rank, e.world_size, e.local_world_size, e.source) == (2, 4, 2, "slurm")
    e = resolve_env(rank=0, world_size=2, environ={"RANK": "1", "WORLD_SIZE": "4"})
    assert (e.rank, e.world_size, e.source) == (0, 2, "flags")
    assert resolve_env(environ={}).world_size == 1
    for env in ({"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "x", "WORLD_SIZE": "2"},
                {"RANK": "0", "WORLD_SIZE": "0"}, {"MASTER_PORT": "70000"}):
        with pytest.raises(ConfigError):
            resolve_env(environ=env)
    assert threads_per_rank(2, 3) == 3 and threads_per_rank(1000) == 1
    with pytest.raises(ConfigError):
        threads_per_rank(2, 0)


def test_env_integers_read_slurm_compressed_counts():
    """Slurm writes per-node counts compressed ("2(x3)": 2 on each of 3 nodes); the rank-level
    and the node-level resolution read them alike, as the first count."""
    from llmctl.distributed.rendezvous import resolve_node

    assert parse_int("SLURM_NTASKS_PER_NODE", "2(x3)") == 2
    assert parse_int("SLURM_NTASKS_PER_NODE", " 4 ") == 4
    for bad in ("x", "(x3)", "-1"):
        with raises_error(ConfigError, names=["SLURM_NTASKS_PER_NODE", bad]):
            parse_int("SLURM_NTASKS_PER_NODE", bad)
    node = resolve_node(environ={"NNODES": "2(x3)", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": "29500", "LLMCTL_BIND_ADDR": "127.0.0.1"})
    assert (node.nnodes, node.node_rank) == (2, 1)


# ---------------------------------------------------------------------------------------------
# the launcher with toy workers

@pytest.mark.parametrize("nproc,shared", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_collectives_exact_across_ranks(dist_clean, nproc, shared):
    """all_reduce_mean gives the fixed-order float32 mean bit-exactly on every rank (sizes 0, 1,
    odd, larger than one slot; shared: the largest buffer lives in shared memory, zero-copy
    path), plus sum_scalar, broadcast and assert_identical."""
    info = launch(TOY, {"dir": str(dist_clean), "iters": 2, "shared": shared}, nproc, threads=1,
                  timeout=10)
    assert info["nproc"] == nproc and info["threads"] == 1
    for r in range(nproc):
        res = json.loads((dist_clean / f"result_{r}.json").read_text())
        assert res["iters"] == 2 and res["checked"] == 10 and res["threads"] == "1"


@pytest.mark.parametrize("nproc,shared", [(2, False), (3, True)])
def test_zero_collectives_exact_across_ranks(dist_clean, nproc, shared):
    """reduce_scatter_mean leaves each rank's ranges holding the fixed-order float32 mean (the
    all-reduce's bits), all_gather gives every rank all of it: the copy path, and the shared
    gradient row (zero-copy reduce, in-place staging of the all-gather)."""
    launch(TOY, {"dir": str(dist_clean), "iters": 2, "shared": shared, "zero": True}, nproc,
           threads=1, timeout=10)
    for r in range(nproc):
        assert json.loads((dist_clean / f"result_{r}.json").read_text())["checked"] == 10


def test_rank_killed_during_the_reduce_scatter_ends_the_job(dist_clean):
    """Rank 1 dies while rank 0 waits in ZeRO-1's reduce-scatter: one error naming it, within
    the heartbeat timeout rather than the collective timeout."""
    t0 = time.monotonic()
    with pytest.raises(DistError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        launch(TOY, {"dir": str(dist_clean), "iters": 3, "zero": True, "fail_rank": 1,
                     "fail_at": 1, "fail": "kill", "fail_in": "reduce_scatter"},
               2, threads=1, timeout=3, grace=1, collective_timeout=300)
    assert time.monotonic() - t0 < 120
    assert not (dist_clean / "result_0.json").exists()


# what the error names: the rank and its pid, the step, the rank's own error; for a mismatch,
# the two ranks' differing digests (the regex)
@pytest.mark.parametrize("fail,names,expect", [
    ("error", ["rank 1 (pid ", "step 1", "synthetic failure on rank 1"], None),
    ("raise", ["rank 1 (pid ", "step 1", "RuntimeError: synthetic bug"], None),
    ("kill", ["rank 1 (pid ", "SIGKILL"], None),
    ("mismatch", ["parameters"], r"rank 0: (\w+), rank 1: (?!\1)"),
])
def test_rank_failure_ends_the_job_naming_the_rank(dist_clean, fail, names, expect):
    # the surviving rank waits in a collective: without the launcher's handling the job would
    # end only at the collective timeout (300 s); 120 s is a generous ceiling on a loaded machine
    t0 = time.monotonic()
    with raises_error(DistError, names=names, hint=None) as e:
        launch(TOY, {"dir": str(dist_clean), "iters": 3, "fail_rank": 1, "fail_at": 1, "fail": fail},
               2, threads=1, timeout=3, grace=1, collective_timeout=300)
    assert expect is None or re.search(expect, e.value.message), e.value.message
    assert time.monotonic() - t0 < 120


def test_hung_rank_is_detected_within_the_timeout(dist_clean):
    """SIGSTOP (a hang) on rank 1: no heartbeat for `timeout` s ends the job, even though rank 0
    is blocked in a collective; the stopped process is killed, not orphaned."""
    # detected by the heartbeat timeout (2 s), not the collective timeout (300 s): the silence
    # it reports is at least the timeout, and the job ends far below the collective timeout
    t0 = time.monotonic()
    with raises_error(DistError, names=["rank 1 (pid ", "heartbeat"], hint=None) as e:
        launch(TOY, {"dir": str(dist_clean), "iters": 3, "fail_rank": 1, "fail_at": 1, "fail": "stop"},
               2, threads=1, timeout=2, grace=1, collective_timeout=300)
    assert time.monotonic() - t0 < 120
    assert float(re.search(r"no heartbeat for ([\d.]+) s", e.value.message).group(1)) >= 2


def test_rank_exiting_early_is_reported(dist_clean):
    with raises_error(DistError, names=["rank 0 (pid ", "code 0", "ranks [1]"], hint=None):
        launch(TOY, {"dir": str(dist_clean), "iters": 3, "fail_rank": 0, "fail_at": 1, "fail": "exit0"},
               2, threads=1, timeout=3, grace=1)


def test_port_in_use_and_bad_arguments(dist_clean):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        with raises_error(DistError, names=[str(port), "127.0.0.1"]):
            launch(TOY, {"dir": str(dist_clean)}, 2, master_port=port)
    finally:
        s.close()
    with raises_error(DistError, names="0.0.0.0"):
        launch(TOY, {"dir": str(dist_clean)}, 2, master_addr="0.0.0.0")
    with pytest.raises(ConfigError):
        launch(TOY, {"dir": str(dist_clean)}, 0)


def test_stale_segment_of_a_dead_launcher_is_swept(dist_clean):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that is certainly dead now
    stale = os.path.join(SHM_DIR, f"{PREFIX}{p.pid}-deadbeef-0")
    live = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-cafe-0")  # our own pid: alive, kept
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    try:
        logs = []
        launch(TOY, {"dir": str(dist_clean), "iters": 1}, 2, threads=1, log=logs.append)
        assert not os.path.exists(stale) and os.path.exists(live)
        assert any("stale shared-memory" in m for m in logs)
        assert sweep_segments(job="cafe") == [os.path.basename(live)]
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


_LAUNCH_SCRIPT = """
import json, sys
from llmctl.jobs.launcher import launch
from llmctl.errors import DistError
args = json.loads(sys.argv[1]); kw = json.loads(sys.argv[2])
try:
    launch("llmctl.distributed.selftest:collectives", args, 2, threads=1, **kw)
except KeyboardInterrupt:
    sys.exit(130)
except DistError as e:
    print("Error:", e.message, file=sys.stderr); sys.exit(1)
"""


def _start_launcher(d, args, **kw):
    args = dict({"dir": str(d), "loop": True, "sleep": 0.05}, **args)
    return subprocess.Popen([sys.executable, "-c", _LAUNCH_SCRIPT, json.dumps(args), json.dumps(kw)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigint_stops_all_ranks_at_the_same_collective(dist_clean):
    p = _start_launcher(dist_clean, {}, timeout=5)
    try:
        _wait_for(lambda: len(_pids(dist_clean)) == 2, 30, "ranks to start")
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    res = [json.loads((dist_clean / f"result_{r}.json").read_text()) for r in range(2)]
    assert all(r["stopped"] for r in res)
    assert res[0]["iters"] == res[1]["iters"] >= 1  # both saw the stop at the same iteration


def test_killing_the_launcher_kills_the_ranks(dist_clean):
    """SIGKILL the launcher: PR_SET_PDEATHSIG takes its ranks down. If that happened inside the
    segment-creation window (before every rank mapped it and rank 0 unlinked it), the segment is
    left under the dead launcher's pid -- and the next launcher sweeps it."""
    p = _start_launcher(dist_clean, {}, timeout=5)
    try:
        _wait_for(lambda: len(_pids(dist_clean)) == 2, 30, "ranks to start")
        p.kill()  # SIGKILL: no cleanup code runs in the launcher
        p.wait()
        pids = _pids(dist_clean)
        _wait_for(lambda: not any(_alive(x) for x in pids.values()), 10, "ranks to die")
    finally:
        if p.poll() is None:
            p.kill()
    launch(TOY, {"dir": str(dist_clean), "iters": 1}, 2, threads=1, log=lambda m: None)
    assert not [n for n in _segments() if n.startswith(f"{PREFIX}{p.pid}-")]


def test_foreign_and_garbage_connections_are_rejected(dist_clean):
    """A silent connection, garbage bytes, a wrong secret and an unauthenticated JSON message are
    logged and dropped (never parsed); the job goes on and completes correctly."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    p = _start_launcher(dist_clean, {"sleep": 0.05},  # loops until the SIGINT below
                        timeout=5, master_port=port)
    try:
        _wait_for(lambda: len(_pids(dist_clean)) == 2, 30, "ranks to start")
        # 0. a connection that never says anything: dropped after the handshake timeout
        silent = socket.create_connection(("127.0.0.1", port), timeout=control.HANDSHAKE_TIMEOUT + 5)
        t_silent = time.monotonic()
        # 1. garbage
        g = socket.create_connection(("127.0.0.1", port), timeout=5)
        g.recv(control.HELLO_HUB)
        g.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(100))
        assert g.recv(10) == b""  # the hub closed it
        g.close()
        # 2. correct framing, wrong secret
        with raises_error(DistError, names="control hub"):  # the peer it could not authenticate with
            control.ControlClient("127.0.0.1", port, os.urandom(32), 0, timeout=5)
        # 3. a JSON message without authenticating: never parsed, dropped
        j = socket.create_connection(("127.0.0.1", port), timeout=5)
        j.recv(control.HELLO_HUB)
        j.sendall(control.MAGIC + control.encode({"t": "error", "msg": "pwned", "hint": "", "step": 0}) * 4)
        assert j.recv(10) == b""
        j.close()
        assert silent.recv(100)[:len(control.MAGIC)] == control.MAGIC  # the greeting, then EOF
        assert silent.recv(100) == b""
        assert time.monotonic() - t_silent >= control.HANDSHAKE_TIMEOUT - 0.5
        silent.close()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err  # a clean, requested stop: nothing failed
    assert err.count("rejected a control connection") >= 4, err
    assert "wrong job secret" in err and "did not authenticate" in err and "pwned" not in err
    res = [json.loads((dist_clean / f"result_{r}.json").read_text()) for r in range(2)]
    assert res[0]["iters"] == res[1]["iters"] > 10  # every round's results were checked exactly


# ---------------------------------------------------------------------------------------------
# `llmctl train --nproc N`

B, T = 2, 8


@pytest.fixture
def tiny_run(dist_clean):
    """A 30k-parameter llm.c checkpoint and shards written by the test.

    The train shard holds 2*B*T + 6 tokens: exactly ONE sample of P*B*T tokens for P = 2, and two
    B*T samples for P = 1. That is the configuration in which `--nproc 2 -b B` and
    `--nproc 1 -b B -d 2*B*T` train on the same tokens: llm.c's loader gives rank r the r-th B*T+1
    slice of each P*B*T sample, which for sample 0 is exactly the 1-process loader's sample r. With
    more samples the shuffles would differ (rank r's RNG is seeded 42 + r, and P changes the number
    of samples per shard), so the token sets would not match; with one sample per epoch the P = 2
    permutation is empty and the P = 1 permutation only swaps the two micro-steps (same tokens).
    """
    return write_tiny_run(dist_clean, 2 * B * T + 6)


def _train_args(d, out, *extra):
    return tiny_train_args(d, out, B, T, *extra)


def _cli(args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120, **kw)


def _params(path):
    return np.fromfile(path, dtype=np.float32)[256:]  # skip the 1024-byte header


def _losses(out):
    with open(out / "metrics.jsonl") as f:  # polled while training appends: skip a partial last line
        return [json.loads(ln)["train_loss"] for ln in f if "train_loss" in ln and ln.endswith("\n")]


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return {}
    ranks = {}
    for k in kids:
        try:
            with open(f"/proc/{k}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            ranks[int(env[b"RANK"])] = k
        except (FileNotFoundError, KeyError, ValueError):
            pass
    return ranks


def test_nproc2_bf16_equals_gradient_accumulation(tiny_run):
    """The same equivalence in bf16 (on CPUs without native bf16: its emulation, inherited by
    the ranks): the bf16 roundings are per element, so only the fp32 sums differ, as in fp32."""
    d = tiny_run
    env = bf16_env()
    r1 = _cli(_train_args(d, "b1", "-d", str(2 * B * T), "-x", "3", "--precision", "bf16"), env=env)
    assert r1.returncode == 0, r1.stderr
    r2 = _cli(_train_args(d, "b2", "--nproc", "2", "-x", "3", "-n", "3", "--precision", "bf16"),
              env=dict(env, LLMCTL_DIST_CHECK_PARAMS="1"))
    assert r2.returncode == 0, r2.stderr
    np.testing.assert_allclose(_losses(d / "b2"), _losses(d / "b1"), rtol=1e-6)
    assert len(_losses(d / "b2")) == 3
    # the checkpoint stays llm.c's fp32 v3
    assert np.fromfile(d / "b2/model_00000003.bin", dtype="<i4", count=2).tolist() == [20240326, 3]


def test_nproc2_equals_gradient_accumulation(tiny_run):
    """--nproc 2 -b B == --nproc 1 -b B -d 2*B*T: same losses and final parameters.

    Tolerance: the two runs differ only in fp32 summation order of the gradients (P = 1 adds the
    second micro-step's contributions into the first's inside the backward kernels; P = 2 adds two
    finished gradients in the all-reduce, then halves exactly). Those are ~1e-7 relative errors;
    AdamW turns them into parameter differences far below one step's movement. We require
    |dp| <= 1e-6 (one thousandth of the lr of one step, lr = 1e-3) and losses to 1e-6 relative,
    and check that training moved the parameters ~1000x more than that. Every rank's parameters
    are also compared bit-for-bit after every step (LLMCTL_DIST_CHECK_PARAMS=1: the job would
    fail with "ranks disagree on parameters").
    """
    d = tiny_run
    r1 = _cli(_train_args(d, "p1", "-d", str(2 * B * T), "-x", "6", "-n", "6"))
    assert r1.returncode == 0, r1.stderr
    r2 = _cli(_train_args(d, "p2", "--nproc", "2", "-x", "6", "-n", "6"),
              env={"LLMCTL_DIST_CHECK_PARAMS": "1"})
    assert r2.returncode == 0, r2.stderr
    l1, l2 = _losses(d / "p1"), _losses(d / "p2")
    assert len(l1) == len(l2) == 6
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    p0, p1, p2 = _params(d / "init.bin"), _params(d / "p1/model_00000006.bin"), _params(d / "p2/model_00000006.bin")
    np.testing.assert_allclose(p2, p1, rtol=0, atol=1e-6)
    assert np.abs(p1 - p0).max() > 1e-3  # the comparison is not vacuous
    # rank 0 alone wrote the model and logs; every rank its state file; DONE last
    names = sorted(os.listdir(d / "p2"))
    assert names == ["DONE_00000006", "main.log", "metrics.jsonl", "model_00000006.bin",
                     "state_00000006_00000.bin", "state_00000006_00001.bin"]


def test_overfit_nproc2_trains_on_the_tokens_of_nproc1(dist_clean):
    """-a 1 as train_gpt2.cu (val split, no shuffle, reset every step, consecutive micro-batches):
    --nproc 2 -d 512 trains on exactly the tokens of --nproc 1 -d 512, over the shm backend."""
    d = write_tiny_run(dist_clean, 2 * B * T + 6, val_tokens=OVERFIT_TOKENS + 1)
    r1 = _cli(overfit_args(d, "p1", B, T))
    assert r1.returncode == 0, r1.stderr
    r2 = _cli(overfit_args(d, "p2", B, T, "--nproc", "2", "--backend", "shm"))
    assert r2.returncode == 0, r2.stderr
    assert_overfit_losses_match(d / "p1", d / "p2")


def _popen_train(d, *args):
    """`llmctl train --nproc 2` into d/run in the background, pipes for its output."""
    return subprocess.Popen([sys.executable, "-m", "llmctl.cli",
                             *_train_args(d, "run", "--nproc", "2", "--dist-timeout", "5", *args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks_after(p, done):
    """Once `done` exists: {rank: pid} of p's two ranks, each written to d/<rank>.pid so that
    dist_clean checks they are gone afterwards."""
    _wait_for(done.exists, 60, f"the checkpoint {done.name}")
    kids = _children(p.pid)
    assert set(kids) == {0, 1}
    for r, pid in kids.items():
        with open(done.parent.parent / f"{r}.pid", "w") as f:
            json.dump({"pid": pid}, f)
    return kids


def test_killed_rank_stops_the_job_and_the_checkpoint_resumes(tiny_run):
    """SIGKILL rank 1 mid-run: the launcher exits 1 naming rank 1 and SIGKILL within the timeout,
    no rank survives, no segment leaks; the newest DONE checkpoint resumes with the same N and
    continues exactly like an uninterrupted run (and refuses a different N)."""
    d = tiny_run
    p = _popen_train(d, "-x", "100000", "-n", "3")
    try:
        kids = _ranks_after(p, d / "run" / "DONE_00000006")
        os.kill(kids[1], signal.SIGKILL)
        out, err = p.communicate(timeout=120)  # a generous ceiling: the job would otherwise hang
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1
    assert f"rank 1 (pid {kids[1]}) was killed by SIGKILL" in err, err
    assert "Traceback" not in err
    from llmctl.checkpoints import find_max_step
    S = find_max_step(str(d / "run"))
    assert S >= 6 and S % 3 == 0
    # a different N is refused with a clear message (usage error)
    bad = _cli(_train_args(d, "run", "-y", "1", "-x", str(S + 2)))
    assert bad.returncode == 2 and "same number of processes" in bad.stderr, bad.stderr
    ok = _cli(_train_args(d, "run", "--nproc", "2", "-y", "1", "-x", str(S + 2), "-n", "3"))
    assert ok.returncode == 0, ok.stderr
    ref = _cli(_train_args(d, "ref", "--nproc", "2", "-x", str(S + 2), "-n", "3", "-nk", "1"))
    assert ref.returncode == 0, ref.stderr
    # same thread count and ranks: a resumed run continues bit for bit
    np.testing.assert_array_equal(_params(d / f"run/model_{S + 2:08d}.bin"),
                                  _params(d / f"ref/model_{S + 2:08d}.bin"))


def test_rank_killed_in_zero1_training_ends_the_job_with_whole_checkpoints(tiny_run):
    """--nproc 2 -z 1, a checkpoint every step: rank 1 is frozen (SIGSTOP) so that rank 0 waits
    for it in one of -z 1's collectives or the checkpoint's barrier, then SIGKILLed. The launcher
    exits 1 with one Error line naming rank 1 and SIGKILL, no traceback; every checkpoint file
    left is whole (a step whose DONE_ is missing may have rank 0's files, never a partial one);
    -y 1 from the newest DONE_ continues bit for bit like an uninterrupted -z 1 run (the model
    and both ranks' shards of m and v) and leaves no temp file of the killed rank behind."""
    d = tiny_run
    p = _popen_train(d, "-z", "1", "-x", "100000", "-n", "1")
    try:
        kids = _ranks_after(p, d / "run" / "DONE_00000004")
        os.kill(kids[1], signal.SIGSTOP)
        time.sleep(0.5)  # rank 0 reaches its next collective in milliseconds and waits there
        os.kill(kids[1], signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and f"rank 1 (pid {kids[1]}) was killed by SIGKILL" in errors[0], err
    assert "Traceback" not in err
    S = assert_checkpoints_whole(d / "run", 2, 30080 // 2, kids[1])
    assert S >= 4
    end = ("-x", str(S + 2), "-n", "1")
    ok = _cli(_train_args(d, "run", "--nproc", "2", "-z", "1", "-y", "1", *end))
    assert ok.returncode == 0, ok.stderr
    ref = _cli(_train_args(d, "ref", "--nproc", "2", "-z", "1", *end))
    assert ref.returncode == 0, ref.stderr
    for name in [f"model_{S + 2:08d}.bin"] + [f"state_{S + 2:08d}_{r:05d}.bin" for r in range(2)]:
        assert (d / "run" / name).read_bytes() == (d / "ref" / name).read_bytes(), name
    assert not [n for n in os.listdir(d / "run") if n.startswith(".")]  # the resume swept them


def _interrupt_nproc2(d, *extra, env=None):
    """Ctrl-C to `llmctl train --nproc 2` once it has logged three steps -> the checkpoint step.
    The launcher is frozen (SIGSTOP) when the signal is sent, as tests/test_cli.py does, so the
    SIGINT lands while it runs. Asserts exit 130, no traceback and a complete checkpoint (model,
    both state files) taken after the last completed step."""
    from llmctl.checkpoints import find_max_step

    p = subprocess.Popen([sys.executable, "-m", "llmctl.cli",
                          *_train_args(d, "run", "--nproc", "2", "-x", "100000", "-n", "0", *extra)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(lambda: (d / "run" / "metrics.jsonl").exists()
                  and len(_losses(d / "run")) >= 3, 60, "three training steps")
        for r, pid in _children(p.pid).items():
            with open(d / f"{r}.pid", "w") as f:
                json.dump({"pid": pid}, f)
        p.send_signal(signal.SIGSTOP)
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGCONT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err
    S = find_max_step(str(d / "run"))
    assert S >= 3, err
    for f in (f"model_{S:08d}.bin", f"state_{S:08d}_00000.bin", f"state_{S:08d}_00001.bin"):
        assert (d / "run" / f).exists(), f
    assert len(_losses(d / "run")) == S  # the checkpoint is taken after the last completed step
    return S


def test_sigint_checkpoints_every_rank_and_exits_130(tiny_run):
    _interrupt_nproc2(tiny_run)


def test_sigint_in_bf16_checkpoints_every_rank_and_resumes_bit_exactly(tiny_run):
    """Ctrl-C during `--nproc 2 --precision bf16`: exit 130 with a complete checkpoint; `-y 1`
    from it continues bit for bit like an uninterrupted bf16 run: each rank rebuilds its bf16
    weight copy from the fp32 checkpoint (a stale or missing copy on either rank would change its
    gradients, hence the all-reduced mean and every later step). Both runs compare the ranks' fp32
    parameters and bf16 copies bit-for-bit at every step (LLMCTL_DIST_CHECK_PARAMS=1)."""
    d = tiny_run
    env = dict(os.environ, LLMCTL_DIST_CHECK_PARAMS="1", **bf16_env())
    bf16 = ("--precision", "bf16")
    S = _interrupt_nproc2(d, *bf16, env=env)
    ok = _cli(_train_args(d, "run", "--nproc", "2", "-y", "1", "-x", str(S + 3), "-n", "1000", *bf16),
              env=env)
    assert ok.returncode == 0, ok.stderr
    assert f"resuming from the checkpoint at step {S}" in ok.stdout + ok.stderr
    ref = _cli(_train_args(d, "ref", "--nproc", "2", "-x", str(S + 3), "-n", "1000", *bf16), env=env)
    assert ref.returncode == 0, ref.stderr
    assert _losses(d / "run") == _losses(d / "ref") and len(_losses(d / "ref")) == S + 3
    np.testing.assert_array_equal(_params(d / f"run/model_{S + 3:08d}.bin"),
                                  _params(d / f"ref/model_{S + 3:08d}.bin"))


def test_adopted_gradient_buffer_is_what_backward_writes(tiny_run):
    """The worker moves model.grads (and the named views model.g) into the real comm's shared
    row; zero_grad, backward, the zero-copy all-reduce, grad_norm and update must then all use
    it, giving exactly the steps of an untouched model (checked in both ranks of a real job by
    tests/tinyrun.py's check_adopted_grads)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([tests_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    info = launch("tinyrun:check_adopted_grads", {"init": str(tiny_run / "init.bin"), "B": B, "T": T},
                  2, threads=1, timeout=30, extra_env={"PYTHONPATH": path})
    assert info["result"] == {"rank": 0, "steps": 2}


def test_bad_input_under_nproc_is_one_line_with_the_ranks_hint(tiny_run):
    d = tiny_run
    r = _cli(_train_args(d, "o", "--nproc", "2", "-d", str(2 * B * T + 1), "-x", "2"))
    # a usage error, found before any rank is spawned: the -d given, B*T*P spelled out, a -d that works
    assert_cli_error(r.stderr, 2, r.returncode, names=["-d 33", "2*8*2 = 32", "-d 32"])
    assert r.stderr.startswith("Error: ")  # nothing from a rank before it
    r = _cli(["train", "-i", str(d / "missing_*.bin"), "-j", str(d / "val.bin"), "-e", str(d / "init.bin"),
              "-b", str(B), "-t", str(T), "-x", "2", "-v", "0", "-s", "0", "--nproc", "2"])
    assert_cli_error(r.stderr, 1, r.returncode, names=str(d / "missing_*.bin"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_non_finite_or_non_positive_timeouts_are_config_errors(bad):
    # NaN passes a plain `<= 0` check; each entry point must reject it before spawning/joining.
    from llmctl.jobs.multinode import launch_multinode
    from llmctl.jobs.run import run_train
    from llmctl.distributed.rendezvous import NodeEnv, rendezvous

    with raises_error(ConfigError, names=["--dist-timeout", str(bad)]):
        launch(TOY, {}, 2, timeout=bad)
    env = {"LLMCTL_SECRET": "x" * 32}
    with raises_error(ConfigError, names=["--rdzv-timeout", str(bad)]):
        run_train(None, nproc=1, nnodes=2, node_rank=0, rdzv_timeout=bad, environ=env)
    with raises_error(ConfigError, names=["--dist-timeout", str(bad)]):
        run_train(None, nproc=2, timeout=bad, environ=env)
    with raises_error(ConfigError, names=["--rdzv-timeout", str(bad)]):
        rendezvous(0, 2, "127.0.0.1", 1, b"k" * 32, {}, bad)
    node = NodeEnv(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=1, bind_addr="127.0.0.1")
    with raises_error(ConfigError, names=["--rdzv-timeout", str(bad)]):
        launch_multinode(TOY, {}, 1, node, b"k" * 32, rdzv_timeout=bad)


def test_cli_rejects_nan_rdzv_timeout_fast(tmp_path):
    # used to hang forever in the rendezvous; now a usage error (exit 2) before anything starts
    # (a hang would end in subprocess.TimeoutExpired at the generous ceiling)
    env = dict(os.environ, LLMCTL_SECRET="x" * 32)
    r = subprocess.run([sys.executable, "-m", "llmctl", "train", "--nnodes", "2", "--node-rank", "0",
                        "--rdzv-timeout", "nan", "-e", "d6"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=tmp_path)
    assert_cli_error(r.stderr, 2, r.returncode, names=["--rdzv-timeout", "nan"])
