"""Tests for training across hosts (issue 6): the TCP ring all-reduce, rendezvous,
the hierarchical shm + ring backend, their fault handling, and `llmctl train --nnodes 2`.

"Hosts" are processes bound to distinct loopback addresses 127.0.0.2, 127.0.0.3, ... (Linux
routes all of 127/8 to lo). Timeouts are small (3-5 s) so every fault test ends in seconds, and
every process a test starts is killed by the test even when an assertion fails.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from errcheck import assert_error, raises_error

from llmctl.distributed import rendezvous as rdzv
from llmctl.distributed.ring import RingComm, init_ring, ring_connect
from llmctl.distributed.selftest import rank_data
from llmctl.errors import ConfigError, DistError
from tinyrun import (OVERFIT_TOKENS, assert_bf16_backend_matches_shm_and_one_process,
                     assert_checkpoints_whole, assert_overfit_losses_match, bf16_env, overfit_args,
                     tiny_train_args, train_losses, write_tiny_run)

SECRET_TEXT = "test-secret-0123456789abcdef"
SECRET = rdzv.resolve_secret({"LLMCTL_SECRET": SECRET_TEXT})
U32 = 2.0 ** -24  # float32 unit roundoff


def _host(i):
    return f"127.0.0.{2 + i}"


def _free_port(addr="127.0.0.2"):
    s = socket.socket()
    s.bind((addr, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _listening(host, port):
    """Whether a socket listens on host:port, read from /proc/net/tcp (connecting to find out
    would itself be a peer the rendezvous logs and refuses)."""
    want = "%08X:%04X" % (int.from_bytes(socket.inet_aton(host), "little"), port)
    with open("/proc/net/tcp") as f:
        return any(ln.split()[1] == want and ln.split()[3] == "0A" for ln in f.readlines()[1:])


def _wait_until(cond, what, timeout=120):
    """Poll cond() until true; a generous deadline, so a loaded machine is slow, never flaky."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _env(**kw):
    return dict(os.environ, LLMCTL_SECRET=SECRET_TEXT, OMP_NUM_THREADS="1", **kw)


class Procs:
    """Started subprocesses; all killed (with their process groups) at exit, even on failure."""

    def __init__(self):
        self.ps = []

    def start(self, argv, **kw):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, **kw)
        self.ps.append(p)
        return p

    def kill_all(self):
        for p in self.ps:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


@pytest.fixture
def procs(tmp_path):
    ps = Procs()
    yield ps
    ps.kill_all()
    # ranks started by a node launcher die with it (PR_SET_PDEATHSIG); check no pid survives
    # (the kernel delivers the signal at once; the rank takes a moment to exit: wait for it)
    pids = [json.loads((tmp_path / n).read_text())["pid"] for n in os.listdir(tmp_path) if n.endswith(".pid")]
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"orphaned rank process {pid}")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


def _mean_bound(xs, nsum):
    """Error bound of a float32 mean of the rows xs (float32 values, exact float64 reference):
    recursive float32 summation of n terms errs by at most (n-1)*u*sum|x| (first order), each of
    `nsum` divisions/extra stages adds at most u*|result|; we allow 2x that for second-order terms."""
    n = xs.shape[0]
    ref = xs.astype(np.float64).mean(0)
    bound = 2 * ((n - 1) * U32 * np.abs(xs.astype(np.float64)).sum(0) / 1.0 + nsum * U32 * np.abs(ref))
    return ref, bound


def _check_results(d, world, sizes, iters=1, nsum=1):
    for it in range(iters):
        for n in sizes:
            got = [np.load(d / f"{r}_{it}_{n}.npy") for r in range(world)]
            for r in range(1, world):  # the all-gather copies one owner's bits to everyone
                assert got[r].tobytes() == got[0].tobytes(), f"rank {r} differs from rank 0 (n={n})"
            xs = np.stack([rank_data(r, it, n) for r in range(world)]) if n else np.zeros((world, 0))
            ref, bound = _mean_bound(xs, nsum)
            assert got[0].shape == (n,) and got[0].dtype == np.float32
            err = np.abs(got[0].astype(np.float64) - ref)
            assert np.all(err <= bound), f"n={n}: max err {err.max()} > bound"
    for r in range(world):
        assert (d / f"result_{r}.txt").read_text().split()[:2] == [str(r), str(world)]


_RANK = """
import json, sys
from llmctl.distributed.ring import init_ring
from llmctl.distributed.hier import check_collectives
from llmctl.distributed.rendezvous import resolve_secret
from llmctl.errors import DistError
a = json.loads(sys.argv[1])
try:
    comm = init_ring(a["rank"], a["world"], master_addr=a["master"], master_port=a["port"],
                     bind_addr=a["bind"], secret=resolve_secret(), timeout=a["timeout"],
                     rdzv_timeout=a["rdzv"], chunk_bytes=a.get("chunk", 1 << 20))
    check_collectives(a, comm)
    comm.close()
except DistError as e:
    print("Error:", e.message, file=sys.stderr)
    sys.exit(1)
"""


def _start_flat(procs, d, world, port, sizes, iters=1, timeout=5, rdzv_timeout=20, chunk=None):
    out = []
    for r in range(world):
        a = {"rank": r, "world": world, "master": _host(0), "port": port, "bind": _host(r),
             "dir": str(d), "sizes": sizes, "iters": iters, "timeout": timeout, "rdzv": rdzv_timeout}
        if chunk:
            a["chunk"] = chunk
        out.append(procs.start([sys.executable, "-c", _RANK, json.dumps(a)], env=_env()))
    return out


# ---------------------------------------------------------------------------------------------
# the ring all-reduce, n = 2..5 processes on distinct loopback "hosts"

@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_ring_allreduce_exact_mean_identical_bits(procs, tmp_path, world):
    """Sizes: empty, one element, n-1 (some ranks own empty segments), not divisible by n, and
    ~4 MB; two iterations (the second reuses the connections). A small chunk size for the 4 MB
    buffer so the pipelined path runs through many chunks per segment."""
    sizes = [0, 1, world - 1, 10007, 1_000_003]
    ps = _start_flat(procs, tmp_path, world, _free_port(), sizes, iters=2, chunk=65536 + 4)
    for p in ps:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    _check_results(tmp_path, world, sizes, iters=2)


def test_ring_in_process_threads_and_validation():
    """Three members as threads of one process (no rendezvous): sum_vec, broadcast of a non-float
    buffer from each root, all_gather_bytes, assert_identical catching a difference, and the
    argument checks."""
    lis = [rdzv.bind_listener(_host(i), 0) for i in range(3)]
    members = [{"rank": i, "node": i, "ring": 0, "addr": _host(i), "port": lis[i].getsockname()[1],
                "host": f"h{i}"} for i in range(3)]
    socks, errs = {}, []

    def conn(i):
        try:
            socks[i] = ring_connect(members, i, lis[i], SECRET, 5, 10)
        except Exception as e:  # pragma: no cover - reported below
            errs.append(e)

    ts = [threading.Thread(target=conn, args=(i,)) for i in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    [s.close() for s in lis]
    assert not errs, errs
    comms = [RingComm(members, i, *socks[i], timeout=5, collective_timeout=10) for i in range(3)]
    res = {}

    def run(i):
        c = comms[i]
        try:
            out = {"sum": c.all_reduce_sum_vec([i + 0.25, 2.0 * i])}
            for root in range(3):
                b = np.full((2, 3), 10 * i + 1, dtype=np.int16)
                c.broadcast(b, root=root)
                out[f"b{root}"] = b
            out["gather"] = c.all_gather_bytes(bytes([i]) * 4)
            c.assert_identical(np.arange(5.0), "same")
            try:
                c.assert_identical(np.arange(5.0) + (i == 2), "params")
            except DistError as e:
                out["err"] = e.message
            res[i] = out
        except Exception as e:  # pragma: no cover
            res[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    for i in range(3):
        o = res[i]
        assert not isinstance(o, Exception), o
        np.testing.assert_array_equal(o["sum"], [0.25 + 1.25 + 2.25, 0.0 + 2.0 + 4.0])
        for root in range(3):
            assert np.all(o[f"b{root}"] == 10 * root + 1)
        assert o["gather"] == [bytes([0]) * 4, bytes([1]) * 4, bytes([2]) * 4]
        assert "ranks disagree on params" in o["err"] and "rank 2:" in o["err"]
    c = comms[0]
    with pytest.raises(ValueError):
        c.all_reduce_mean(np.zeros(3, np.float64))
    with pytest.raises(ValueError):
        c.all_reduce_mean(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError):
        c.broadcast(np.zeros(3), root=7)
    for c in comms:
        c.close()


# ---------------------------------------------------------------------------------------------
# rendezvous and settings

def test_resolve_node_secret_and_backend():
    e = rdzv.resolve_node(environ={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.2",
                                   "MASTER_PORT": "29400", "LLMCTL_BIND_ADDR": "127.0.0.3"})
    assert (e.nnodes, e.node_rank, e.master_addr, e.master_port, e.bind_addr) == \
        (2, 1, "127.0.0.2", 29400, "127.0.0.3")
    # flags override the environment; node 0 binds the master address itself, never 0.0.0.0
    e = rdzv.resolve_node(nnodes=3, node_rank=0, master_addr="127.0.0.5", master_port=1234,
                          environ={"NNODES": "2", "NODE_RANK": "1"})
    assert (e.nnodes, e.node_rank, e.bind_addr, e.source) == (3, 0, "127.0.0.5", "flags")
    # other nodes: the local interface that routes to the master (a loopback address here)
    assert rdzv.resolve_node(2, 1, "127.0.0.2", 1234, environ={}).bind_addr.startswith("127.")
    # Slurm: only inside an srun step with one task per node
    slurm = {"SLURM_PROCID": "1", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1"}
    assert (rdzv.resolve_node(environ=dict(slurm, MASTER_ADDR="127.0.0.2")).nnodes, "slurm") == (2, "slurm")
    assert rdzv.resolve_node(environ={"SLURM_NNODES": "2", "SLURM_NTASKS": "2"}).nnodes == 1  # salloc shell
    assert rdzv.resolve_node(environ=dict(slurm, SLURM_NTASKS="8")).nnodes == 1  # srun -n 8: per-rank form
    assert rdzv.resolve_node(environ={"GROUP_RANK": "1", "NNODES": "2"}).node_rank == 1
    for kw in ({"nnodes": 2, "node_rank": 2}, {"nnodes": 0}, {"master_port": 70000}):
        with pytest.raises(ConfigError):
            rdzv.resolve_node(environ={}, **kw)
    with raises_error(ConfigError, names="LLMCTL_SECRET"):
        rdzv.resolve_secret({})
    with raises_error(ConfigError, names=["LLMCTL_SECRET", "16"]):
        rdzv.resolve_secret({"LLMCTL_SECRET": "short"})
    assert rdzv.resolve_secret({"LLMCTL_SECRET": SECRET_TEXT}) == SECRET and len(SECRET) == 32
    assert rdzv.resolve_secret({"LLMCTL_SECRET": SECRET_TEXT + "x"}) != SECRET
    assert rdzv.choose_backend("auto", 1, {}) == "shm"
    assert rdzv.choose_backend("auto", 2, {}) == "ring"
    import importlib.util

    mpi = "mpi" if importlib.util.find_spec("mpi4py") else "shm"  # auto needs mpi4py to pick mpi
    assert rdzv.choose_backend("auto", 1, {"PMI_RANK": "0", "PMI_SIZE": "2"}) == mpi
    assert rdzv.choose_backend("auto", 1, {"OMPI_COMM_WORLD_RANK": "0"}) == mpi
    with pytest.raises(ConfigError):
        rdzv.choose_backend("nccl", 1, {})
    with raises_error(ConfigError, names="shm"):
        rdzv.choose_backend("shm", 2, {})
    with raises_error(DistError, names="192.0.2.1"):
        rdzv.bind_listener("192.0.2.1", 0)  # TEST-NET address: not ours, nothing is sent


def _rank_thread(fn, *a, **kw):
    box = {}

    def run():
        try:
            box["ok"] = fn(*a, **kw)
        except Exception as e:
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_peer_that_never_connects(tmp_path):
    """World 3, rank 2 never starts: rank 0 (the rendezvous) and rank 1 both fail within the
    timeout, naming rank 2; rank 1 learns the cause from rank 0."""
    port = _free_port()
    kw = dict(master_addr=_host(0), master_port=port, secret=SECRET, timeout=3, rdzv_timeout=2)
    t_0, b0 = _rank_thread(init_ring, 0, 3, bind_addr=_host(0), **kw)
    t_1, b1 = _rank_thread(init_ring, 1, 3, bind_addr=_host(1), **kw)
    t_0.join(120)  # generous ceilings: both end once the 2 s rendezvous timeout has passed
    t_1.join(120)
    assert not t_0.is_alive() and not t_1.is_alive()
    assert_error(b0.get("err"), DistError, names=["ranks [2]", f"127.0.0.2:{port}"])
    assert_error(b1.get("err"), DistError, names="ranks [2]")  # rank 1 learns the cause from rank 0
    # and a rank whose rendezvous host is not there at all
    with raises_error(DistError, names="127.0.0.2:"):
        init_ring(1, 2, bind_addr=_host(1), **dict(kw, master_port=_free_port(), rdzv_timeout=1))


def test_wrong_secret_and_garbage_at_the_rendezvous():
    """Garbage bytes and a wrong-secret peer at the rendezvous port are refused and logged as they
    happen, by address and reason; the wrong-secret rank itself gets a clear error; the job does
    not hang: rank 0 fails within its timeout naming the missing rank and the refused peers."""
    port = _free_port()
    logs = []
    kw = dict(master_addr=_host(0), master_port=port, timeout=3, rdzv_timeout=6)
    t_0, b0 = _rank_thread(init_ring, 0, 2, bind_addr=_host(0), secret=SECRET, log=logs.append, **kw)
    _wait_until(lambda: _listening(_host(0), port), "rank 0's rendezvous to listen")
    g = socket.create_connection((_host(0), port), timeout=5)
    g.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(200))
    garbage_from = "%s:%d" % g.getsockname()
    with raises_error(DistError, names="credentials"):
        init_ring(1, 2, bind_addr=_host(1), secret=rdzv.resolve_secret(
            {"LLMCTL_SECRET": "a-different-secret-value"}), **kw)
    g.close()
    # logged as it happened: the line is there while rank 0 still waits for rank 1
    _wait_until(lambda: any("wrong job secret" in m for m in logs) or not t_0.is_alive(), "the refusal's log line")
    assert t_0.is_alive() and any("wrong job secret" in m for m in logs), logs
    t_0.join(120)  # a generous ceiling: rank 0 ends once its 6 s rendezvous timeout has passed
    assert not t_0.is_alive()
    # the missing rank, how many peers were refused, and each refused peer's address and reason
    assert_error(b0.get("err"), DistError, names=["ranks [1]", "2 peer(s)", f"{garbage_from} (not an llmctl peer (bad greeting))"])
    wrong = [m for m in logs if "wrong job secret" in m]
    assert [m for m in logs if "bad greeting" in m] == [
        f"rank 0: refused a peer at the rendezvous at {_host(0)}:{port} from {garbage_from}: "
        "not an llmctl peer (bad greeting)"], logs
    assert len(wrong) == 1 and re.search(r"from 127\.0\.0\.\d+:\d+: wrong job secret \(HMAC mismatch\)$",
                                         wrong[0]), logs


def test_train_launcher_reports_a_wrong_secret_node_as_it_is_refused(procs, tmp_path):
    """`llmctl train --nnodes 2` on two loopback hosts, node 1 with a different LLMCTL_SECRET:
    node 0 prints the refused peer (address and reason) at once, not only when its rendezvous
    times out, and its final error names the refused peer; node 1 fails at once."""
    d = write_tiny_run(tmp_path, 4 * B * T + 6)
    port = _free_port()

    def node(i, secret, t):
        return procs.start([sys.executable, "-m", "llmctl.cli", *tiny_train_args(
            d, "out", B, T, "-x", "2", "--nnodes", "2", "--node-rank", str(i), "--nproc", "1",
            "--master-addr", _host(0), "--master-port", str(port), "--bind-addr", _host(i),
            "--rdzv-timeout", str(t))], env=dict(_env(), LLMCTL_SECRET=secret))

    n0 = node(0, SECRET_TEXT, 10)
    _wait_until(lambda: _listening(_host(0), port) or n0.poll() is not None, "node 0's rendezvous to listen")
    n1 = node(1, "a-different-secret-of-this-node", 6)
    _, err1 = n1.communicate(timeout=60)
    assert n1.returncode == 1 and "Error:" in err1 and "credentials" in err1 and "Traceback" not in err1, err1
    # node 0's line about the refused peer is on its stderr before its own (10 s) timeout ends
    line = ""
    while "refused" not in line:
        line = n0.stderr.readline()
        assert line, "node 0 ended without reporting the refused peer"
    assert re.search(r"^llmctl dist: rank 0: refused a peer at the rendezvous at 127\.0\.0\.2:\d+ from "
                     r"127\.0\.0\.\d+:\d+: wrong job secret \(HMAC mismatch\)$", line.strip()), line
    assert n0.poll() is None  # said while node 0 still waits, not only when it gives up
    rest = n0.communicate(timeout=60)[1]
    assert n0.returncode == 1
    assert "ranks [1]" in rest and "1 peer(s): 127.0.0." in rest and "Traceback" not in rest, rest


def test_peer_sending_garbage_after_authenticating():
    """An authenticated member that then sends garbage (not a ring header): the real rank fails at
    once naming the peer's rank, host and address; a member that closes mid-collective likewise."""
    for mode in ("garbage", "close"):
        port = _free_port()
        kw = dict(master_addr=_host(0), master_port=port, secret=SECRET, timeout=3, rdzv_timeout=10)
        t_0, b0 = _rank_thread(init_ring, 0, 2, bind_addr=_host(0), host="hostA", **kw)
        fake = init_ring(1, 2, bind_addr=_host(1), host="hostB", **kw)
        t_0.join(10)
        real = b0["ok"]
        t_r, br = _rank_thread(real.all_reduce_mean, np.ones(1 << 20, np.float32))
        if mode == "garbage":
            fake._out.sendall(os.urandom(4096))
        else:
            fake._out.sendall(b"LLMRING1")  # half a header, then the process "dies"
            fake._out.close()
            fake._in.close()
        t_r.join(10)
        assert not t_r.is_alive()
        # the peer by rank, host and address, and what it did (garbage or a closed connection)
        assert_error(br.get("err"), DistError, names=[f"rank 1 (hostB 127.0.0.3:{real.members[1]['port']})",
                                                      "header" if mode == "garbage" else "closed"], hint=None)
        with raises_error(DistError, names="broken", hint=None):
            real.barrier()
        real.close()
        fake.close()


# ---------------------------------------------------------------------------------------------
# hierarchical: 2 hosts x 2 processes through the launcher

_NODE = """
import json, sys
from llmctl.jobs.multinode import launch_multinode
from llmctl.distributed.rendezvous import NodeEnv, resolve_secret
from llmctl.errors import DistError
a = json.loads(sys.argv[1])
node = NodeEnv(a["nnodes"], a["node_rank"], a["master"], a["port"], a["bind"])
try:
    launch_multinode("llmctl.distributed.hier:check_collectives", a["args"], a["nproc"], node,
                     resolve_secret(), threads=1, timeout=a["timeout"], rdzv_timeout=20, grace=1)
except DistError as e:
    print("Error:", e.message, file=sys.stderr)
    sys.exit(1)
"""


def _start_nodes(procs, nnodes, nproc, port, args, timeout=5):
    return [procs.start([sys.executable, "-c", _NODE, json.dumps(
        {"nnodes": nnodes, "node_rank": i, "master": _host(0), "port": port, "bind": _host(i),
         "nproc": nproc, "args": args, "timeout": timeout})], env=_env()) for i in range(nnodes)]


def test_hier_2_hosts_x_2_procs_collectives(procs, tmp_path):
    """The all-reduce, scalars and broadcasts of 2 hosts x 2 ranks; and ZeRO-1's reduce-scatter +
    all-gather (interleaved shards), which with 2 hosts gives every rank the all-reduce's bits
    (node means, then one pairwise ring addition, whichever member owns the element)."""
    sizes = [0, 1, 3, 4, 7, 300_001]
    ps = _start_nodes(procs, 2, 2, _free_port(), {"dir": str(tmp_path), "sizes": sizes, "iters": 2,
                                                  "zero": True})
    for p in ps:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    # local mean (one division) then mean over nodes (a second one): nsum = 2
    _check_results(tmp_path, 4, sizes, iters=2, nsum=2)
    assert [(tmp_path / f"result_{r}.txt").read_text().split() for r in range(4)] == \
        [["0", "4", "0", "2"], ["1", "4", "1", "2"], ["2", "4", "0", "2"], ["3", "4", "1", "2"]]
    for it in range(2):
        for n in sizes:
            want = np.load(tmp_path / f"0_{it}_{n}.npy")
            for r in range(4):
                assert np.load(tmp_path / f"z{r}_{it}_{n}.npy").tobytes() == want.tobytes(), (r, it, n)


def test_hier_3_hosts_zero1_collectives(procs, tmp_path):
    """3 hosts x 2 ranks: the ring's reduce-scatter adds its 3 node means in an order that
    depends on which member owns the shard, so ZeRO-1's result is the mean within the float32
    bound of the all-reduce's, the same bits on every rank."""
    sizes = [7, 100_003]
    ps = _start_nodes(procs, 3, 2, _free_port(), {"dir": str(tmp_path), "sizes": sizes, "zero": True})
    for p in ps:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    for n in sizes:
        got = [np.load(tmp_path / f"z{r}_0_{n}.npy") for r in range(6)]
        assert all(g.tobytes() == got[0].tobytes() for g in got), n
        ref, bound = _mean_bound(np.stack([rank_data(r, 0, n) for r in range(6)]), nsum=2)
        assert np.all(np.abs(got[0].astype(np.float64) - ref) <= bound), n


def test_host_killed_mid_step_ends_the_job_everywhere(procs, tmp_path):
    """SIGKILL node 1's launcher (its ranks die with it) while the ranks loop over all-reduces:
    node 0's launcher exits 1 within the timeout, naming the lost peer's rank, host and address."""
    args = {"dir": str(tmp_path), "sizes": [200_003], "iters": 100000}
    ps = _start_nodes(procs, 2, 2, _free_port(), args, timeout=3)
    deadline = time.monotonic() + 300
    while not (tmp_path / "3_2_200003.npy").exists():  # a few iterations done on every host
        assert time.monotonic() < deadline and ps[0].poll() is None and ps[1].poll() is None
        time.sleep(0.05)
    os.killpg(ps[1].pid, signal.SIGKILL)
    out, err = ps[0].communicate(timeout=120)  # a generous ceiling: it would otherwise hang
    assert ps[0].returncode == 1, err
    assert "Traceback" not in err
    import re
    # EOF (FIN), a reset (RST: the dead process had unread data) or a failed send: all name the
    # lost member by rank, host name and address
    peer = r"ring member rank [23] \(\S+ 127\.0\.0\.3:\d+\)"
    assert re.search(rf"(the previous {peer} closed the connection|lost the connection "
                     rf"(from the previous|to the next) {peer})", err), err


# ---------------------------------------------------------------------------------------------
# `llmctl train --nnodes 2 --nproc 2` == 1 process with gradient accumulation

B, T = 2, 8


def _cli(args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "llmctl.cli", *args], capture_output=True,
                          text=True, env=_env(**(env or {})), timeout=120, **kw)


def test_2_hosts_x_2_procs_train_equals_gradient_accumulation(procs, tmp_path):
    """4 ranks on 2 loopback hosts (launcher form, hierarchical shm + ring; and the per-rank
    torchrun form, one flat ring) vs 1 process with -d 4*B*T over the same tokens.

    The train shard holds 4*B*T + 6 tokens: one P*B*T sample for P = 4, i.e. each rank's B*T
    slice is one of the four samples the 1-process run accumulates per step (the same argument
    as tests/test_dist.py's 2-process test; each step of the P = 1 run is a whole epoch, so its
    reshuffles only change the order of micro-steps). Differences come only from fp32 summation
    order (accumulation inside the backward kernels vs node means then a mean of node means):
    ~1e-7 relative on the gradients, far below an AdamW step. We require losses to 1e-6 relative
    and parameters to 1e-6 absolute (1/1000 of one step at lr 1e-3), and check training moved
    them ~1000x more. Every rank's parameters are compared bit-for-bit after every step
    (LLMCTL_DIST_CHECK_PARAMS=1: the job would fail with "ranks disagree on parameters")."""
    d = write_tiny_run(tmp_path, 4 * B * T + 6)

    def args(out, *extra):
        return tiny_train_args(d, out, B, T, "-x", "6", "-n", "6", *extra)

    port = _free_port()
    nodes = [procs.start([sys.executable, "-m", "llmctl.cli", *args(
        "p4", "--nnodes", "2", "--node-rank", str(i), "--nproc", "2", "--master-addr", _host(0),
        "--master-port", str(port), "--bind-addr", _host(i), "--dist-timeout", "10",
        "--rdzv-timeout", "30")], env=_env(LLMCTL_DIST_CHECK_PARAMS="1")) for i in range(2)]
    r1 = _cli(args("p1", "-d", str(4 * B * T)))
    assert r1.returncode == 0, r1.stderr
    for p in nodes:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    # the per-rank form: 4 processes started "by torchrun" (RANK/WORLD_SIZE/MASTER_* in the
    # environment), ranks 0,1 on host 127.0.0.2 and 2,3 on 127.0.0.3: one flat ring
    port = _free_port()
    ranks = [procs.start([sys.executable, "-m", "llmctl.cli", *args("pe", "--dist-timeout", "10",
                                                                    "--rdzv-timeout", "30")],
                         env=_env(RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r % 2),
                                  LOCAL_WORLD_SIZE="2", MASTER_ADDR=_host(0), MASTER_PORT=str(port),
                                  LLMCTL_BIND_ADDR=_host(r // 2), LLMCTL_DIST_CHECK_PARAMS="1"))
             for r in range(4)]
    for p in ranks:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err

    def losses(out):
        with open(d / out / "metrics.jsonl") as f:
            return [json.loads(ln)["train_loss"] for ln in f if "train_loss" in ln]

    def params(path):
        return np.fromfile(path, dtype=np.float32)[256:]  # skip the 1024-byte header

    l1 = losses("p1")
    p0, p1 = params(d / "init.bin"), params(d / "p1/model_00000006.bin")
    assert len(l1) == 6 and np.abs(p1 - p0).max() > 1e-3
    for run in ("p4", "pe"):
        np.testing.assert_allclose(losses(run), l1, rtol=1e-6)
        np.testing.assert_allclose(params(d / run / "model_00000006.bin"), p1, rtol=0, atol=1e-6)
        assert sorted(os.listdir(d / run)) == ["DONE_00000006", "main.log", "metrics.jsonl",
                                               "model_00000006.bin"] + [
            f"state_00000006_{r:05d}.bin" for r in range(4)]


def test_ring_member_killed_in_zero1_training_ends_the_job_with_whole_checkpoints(procs, tmp_path):
    """-z 1 on one flat TCP ring of 2 ranks (started per rank, as torchrun would), a checkpoint
    every step: rank 1 is frozen (SIGSTOP, so rank 0 waits for it in a collective) then
    SIGKILLed. With no launcher to see the signal, rank 0 exits 1 with one Error line naming the
    lost ring member rank 1, no traceback; every checkpoint file left is whole, and -y 1 from the
    newest DONE_ (here over shm: with 2 ranks the same bits) continues like an uninterrupted run."""
    d = write_tiny_run(tmp_path, 2 * B * T + 6)
    port = _free_port()
    ranks = [procs.start([sys.executable, "-m", "llmctl.cli", *tiny_train_args(
        d, "run", B, T, "-z", "1", "-x", "100000", "-n", "1", "--dist-timeout", "10",
        "--rdzv-timeout", "30")], env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0",
                                           LOCAL_WORLD_SIZE="1", MASTER_ADDR=_host(0),
                                           MASTER_PORT=str(port), LLMCTL_BIND_ADDR=_host(r)))
             for r in range(2)]
    _wait_until(lambda: (d / "run" / "DONE_00000004").exists() or ranks[0].poll() is not None,
                "the step-4 checkpoint")
    os.kill(ranks[1].pid, signal.SIGSTOP)
    time.sleep(0.5)
    os.kill(ranks[1].pid, signal.SIGKILL)
    out, err = ranks[0].communicate(timeout=120)
    assert ranks[0].returncode == 1, err
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and re.search(r"rank 0: .*ring member rank 1 \(\S+ 127\.0\.0\.3:\d+\)",
                                          errors[0]), err
    assert "Traceback" not in err
    S = assert_checkpoints_whole(d / "run", 2, 30080 // 2, ranks[1].pid)
    assert S >= 4
    end = ("-x", str(S + 2), "-n", "1", "--nproc", "2", "-z", "1")
    for out_dir, extra in (("run", ("-y", "1")), ("ref", ())):
        r = _cli(tiny_train_args(d, out_dir, B, T, *end, *extra))
        assert r.returncode == 0, r.stderr
    for name in [f"model_{S + 2:08d}.bin"] + [f"state_{S + 2:08d}_{r:05d}.bin" for r in range(2)]:
        assert (d / "run" / name).read_bytes() == (d / "ref" / name).read_bytes(), name


def test_overfit_ring_of_2_trains_on_the_tokens_of_1_process(procs, tmp_path):
    """-a 1 as train_gpt2.cu: 2 ranks on one flat TCP ring (started per rank, as torchrun would,
    on two loopback hosts) train on exactly the tokens of 1 process with the same -d 512."""
    d = write_tiny_run(tmp_path, 4 * B * T + 6, val_tokens=OVERFIT_TOKENS + 1)
    port = _free_port()
    ranks = [procs.start([sys.executable, "-m", "llmctl.cli", *overfit_args(
        d, "p2", B, T, "--dist-timeout", "10", "--rdzv-timeout", "30")],
        env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR=_host(0), MASTER_PORT=str(port), LLMCTL_BIND_ADDR=_host(r)))
        for r in range(2)]
    r1 = _cli(overfit_args(d, "p1", B, T))
    assert r1.returncode == 0, r1.stderr
    for p in ranks:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert_overfit_losses_match(d / "p1", d / "p2")


def test_ring_of_2_bf16_equals_shm_and_gradient_accumulation(procs, tmp_path):
    """--precision bf16 over one flat TCP ring of 2 ranks (started per rank, as torchrun would,
    on two loopback hosts) vs the same 2 ranks over shared memory (--nproc 2) and vs 1 process
    with -d 2*B*T, on the one-sample shard of tests/test_dist.py (same tokens per rank).

    Ring vs shm: with 2 ranks every backend's mean is (g0 + g1) / 2, one fp32 addition
    (commutative bit for bit) and an exact halving, and each rank's bf16 roundings see the same
    weights and tokens, so the two runs must agree to the bit: losses and final parameters.
    Ring vs 1 process: the bf16 roundings are per element of the matmul inputs, and the
    1-process run's loss scale of 1/2 is exact in bf16, so only the fp32 summation order of the
    gradients differs, as in fp32 (~1e-7 relative). A weight that sits within that distance of
    a bf16 rounding boundary could round the other way in the next step's bf16 copy; that
    changes one matmul term by one bf16 ulp of one weight, far below the losses' 1e-6 relative.
    The parameters agree within 1e-6 absolute (1/1000 of one lr=1e-3 step), but for the few
    whose gradient is near zero, where AdamW's normalisation turns such a change into a
    fraction of lr (tinyrun.assert_bf16_backend_matches_shm_and_one_process); training moves
    the parameters ~1000x more. Every rank's fp32 parameters and bf16 copy are
    compared bit-for-bit at every step (LLMCTL_DIST_CHECK_PARAMS=1)."""
    d = write_tiny_run(tmp_path, 2 * B * T + 6)
    env = bf16_env()

    def args(out, *extra):
        return tiny_train_args(d, out, B, T, "-x", "6", "-n", "6", "--precision", "bf16", *extra)

    port = _free_port()
    ranks = [procs.start([sys.executable, "-m", "llmctl.cli", *args("ring", "--dist-timeout", "10",
                                                                    "--rdzv-timeout", "30")],
                         env=_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                  MASTER_ADDR=_host(0), MASTER_PORT=str(port), LLMCTL_BIND_ADDR=_host(r),
                                  LLMCTL_DIST_CHECK_PARAMS="1", **env))
             for r in range(2)]
    for p in ranks:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    r = _cli(args("shm", "--nproc", "2", "--backend", "shm"), env=dict(env, LLMCTL_DIST_CHECK_PARAMS="1"))
    assert r.returncode == 0, r.stderr
    r = _cli(args("one", "-d", str(2 * B * T)), env=env)
    assert r.returncode == 0, r.stderr

    assert_bf16_backend_matches_shm_and_one_process(d, "ring")
    # and bf16 was in use: fp32 on the same job gives other losses
    r = _cli(tiny_train_args(d, "fp32", B, T, "-x", "6", "-n", "6", "-d", str(2 * B * T)))
    assert r.returncode == 0, r.stderr
    assert np.abs(np.array(train_losses(d / "fp32")) - train_losses(d / "one")).max() > 1e-6


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ctrl_c_on_one_host_stops_every_host_at_the_same_step(procs, tmp_path, precision):
    """SIGINT to node 0's launcher only: the stop flag rides on the next scalar all-reduce, so
    all 4 ranks stop after the same step and write one complete checkpoint (model, 4 state
    files, DONE); node 0 exits 130, node 1 exits 0 (its part finished as asked). The same in
    bf16 (emulated where the CPU has no native bf16)."""
    from llmctl.formats import write_datafile
    from llmctl.model import GPT2, GPT2Config
    from llmctl.checkpoints import find_max_step

    d = tmp_path
    cfg = GPT2Config(max_seq_len=16, vocab_size=64, padded_vocab_size=128, num_layers=1,
                     num_heads=2, channels=16)
    m = GPT2(cfg, n_threads=1)
    m.params[:] = (np.random.default_rng(1).standard_normal(m.num_parameters) * 0.05).astype(np.float32)
    m.save_checkpoint(str(d / "init.bin"))
    write_datafile(str(d / "train.bin"), np.arange(4 * B * T * 3 + 6, dtype=np.uint16) % 64)
    port = _free_port()
    nodes = [procs.start([sys.executable, "-m", "llmctl.cli", "train", "-i", str(d / "train.bin"),
                          "-j", str(d / "train.bin"), "-e", str(d / "init.bin"), "-b", str(B),
                          "-t", str(T), "-v", "0", "-s", "0", "--threads", "1", "-x", "100000",
                          "-o", str(d / "run"), "--nnodes", "2", "--node-rank", str(i), "--nproc", "2",
                          "--master-addr", _host(0), "--master-port", str(port), "--bind-addr",
                          _host(i), "--dist-timeout", "10", "--rdzv-timeout", "30", "--precision", precision],
                         env=_env(**(bf16_env() if precision == "bf16" else {})))
             for i in range(2)]
    deadline = time.monotonic() + 60
    while not ((d / "run" / "metrics.jsonl").exists()
               and (d / "run" / "metrics.jsonl").read_text().count("train_loss") >= 3):
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes)
        time.sleep(0.05)
    nodes[0].send_signal(signal.SIGINT)
    outs = [p.communicate(timeout=60) for p in nodes]
    assert nodes[0].returncode == 130, outs[0][1]
    assert nodes[1].returncode == 0, outs[1][1]
    S = find_max_step(str(d / "run"))
    assert S >= 3
    for f in [f"model_{S:08d}.bin"] + [f"state_{S:08d}_{r:05d}.bin" for r in range(4)]:
        assert (d / "run" / f).exists(), f
    assert (d / "run" / "metrics.jsonl").read_text().count("train_loss") == S
