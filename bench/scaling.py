"""Benchmark: ring and MPI all-reduce and data-parallel training across 2-8 emulated hosts.

issue 21.

What it measures: this machine split into N "hosts" (Linux network namespaces, root only), each
with one veth link to a bridge that lives in a namespace of its own; every host's uplink is
shaped with `tc` (a tbf rate limit, plus a netem delay where the kernel has sch_netem). Across
them it runs
- the TCP ring all-reduce (llmctl/distributed/ring.py, the flat ring of the per-rank form:
  one rank per host, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LLMCTL_BIND_ADDR per process);
- MPI's Allreduce (llmctl/distributed/mpi.py) under MPICH's mpiexec, one rank per host, the
  proxies started in the hosts' namespaces (mpiexec's ssh launcher pointed at `ip netns exec`);
- a few training steps (`llmctl train --backend ring`, per-rank form) of a small model;
and prints each all-reduce and step time next to the bandwidth model

    wire   = 2(N-1)/N * bytes / bandwidth + 2(N-1) * latency
    model  = max(wire, t_cpu)

bandwidth is the payload rate (1448 of every 1514 bytes tbf counts, at MTU 1500); latency is
the configured delay plus one measured hop (an all-reduce of N floats on unlimited links divided
by its 2(N-1) hops); t_cpu is what the same all-reduce costs on unlimited links (a tbf far above
what the cores can push: the same qdisc work, no rate limit) in the same namespaces, measured in
the same run: the copies into and out of the kernel, the bridge, the additions, with N
processes on this machine's cores. On real hosts each rank has its own cores, so t_cpu is small
next to the wire time; here it is not, and leaving it out would blame the network for the CPU.
max, not a sum, because llmctl's ring is pipelined (a sender thread forwards each 1 MiB chunk
while the next one is received and added), so the link and the CPU work overlap; the sum
wire + t_cpu (no overlap) is printed beside it as an upper bound. MPI is held to the same model:
what a bandwidth-optimal all-reduce would take. The step model is the unlimited step's compute
time (step minus all-reduce) plus the model for the gradient buffer.

Traffic: every address lives on the veths inside the namespaces this bench made (SUBNET.1 ...
SUBNET.N, a /24 that is not routed anywhere); nothing is configured in the caller's namespace.
The namespaces (and with them the veths) are removed on exit, on Ctrl-C and on errors; ones left
by a bench that was SIGKILLed are removed by the next run (their creator's pid is in the name).

What it is not: a correctness test of the collectives (tests/test_ring.py, tests/test_mpi.py;
tests/test_scaling.py runs this bench's smallest point), or a real network: the links share
this machine's memory bandwidth and cores.

    sudo python bench/scaling.py                          # short sweep (about a minute)
    sudo python bench/scaling.py --full                   # 2/4/8 hosts x 1/10/25 Gbit/s, d6/d12 steps
    sudo python bench/scaling.py --hosts 2 --gbit 10 --mb 4 --no-mpi --no-train --json
"""
import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

PREFIX = "llmctl-scal"           # namespace names: PREFIX-<pid>-br, PREFIX-<pid>-h<i>
SUBNET = "10.213.0"              # host i has SUBNET.(i+1)/24 on its veth, inside its namespace
PORT = 29500
# tbf counts each frame from its Ethernet header on: a full 1500-byte-MTU TCP segment carries
# 1448 payload bytes (20 IP + 32 TCP with timestamps) in 1514 bytes. (A real NIC also sends a
# preamble, FCS and gap, 1538 bytes: 94 %; with 9000-byte jumbo frames 99 %.)
FRAME_EFFICIENCY = 1448 / 1514
UNLIMITED_GBIT = 1000
QUEUE_MS = 200   # tbf's queue; 5 ms measured the same
SECRET_TEXT = "bench-scaling-secret-0123456789abcdef"


class BenchError(Exception):
    pass


def _sh(*argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise BenchError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def requirements():
    """None if this process can build namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{PREFIX}-{os.getpid()}-probe"
    r = _sh("ip", "netns", "add", name, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    try:
        r = _sh("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if r.returncode != 0:
            return f"cannot create a veth pair: {r.stderr.strip()}"
        r = _sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
                "rate", "1gbit", "burst", "256kb", "latency", "100ms", check=False)
        if r.returncode != 0:
            return f"cannot add a tbf qdisc: {r.stderr.strip()}"
    finally:
        _sh("ip", "netns", "del", name, check=False)
    return None


def has_netem():
    name = f"{PREFIX}-{os.getpid()}-netem"
    _sh("ip", "netns", "add", name)
    try:
        return _sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                   "delay", "1ms", check=False).returncode == 0
    finally:
        _sh("ip", "netns", "del", name, check=False)


def sweep_stale():
    """Remove namespaces of earlier runs whose process is gone (a SIGKILLed bench)."""
    for line in _sh("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX + "-"):
            continue
        try:
            pid = int(name.split("-")[2])
            os.kill(pid, 0)
            continue
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _sh("ip", "netns", "del", name, check=False)


class Cluster:
    """N namespaces ("hosts") joined by veths to a bridge in its own namespace."""

    def __init__(self, n):
        self.n = n
        self.tag = f"{PREFIX}-{os.getpid()}"
        self.bridge = f"{self.tag}-br"
        self.hosts = [f"{self.tag}-h{i}" for i in range(n)]
        self.procs = []
        self.made = []

    def addr(self, i):
        return f"{SUBNET}.{i + 1}"

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self):
        _sh("ip", "netns", "add", self.bridge)
        self.made.append(self.bridge)
        _sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
            # the pair is born inside the host namespace, then its peer moves to the bridge's:
            # no interface ever exists in the caller's namespace
            _sh("ip", "-n", ns, "link", "add", "eth0", "mtu", "1500", "type", "veth", "peer", "name", f"p{i}",
                "mtu", "1500")
            _sh("ip", "-n", ns, "link", "set", f"p{i}", "netns", self.bridge)
            _sh("ip", "-n", self.bridge, "link", "set", f"p{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # a ring keeps its connections busy; after a pause (a barrier, the forward pass)
            # Linux would restart each one from a small congestion window. Clusters turn this off.
            _sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0")

    def shape(self, gbit, delay_ms):
        """Every host's uplink: `gbit` Gbit/s and `delay_ms` one-way delay. gbit None: the
        baseline, a tbf at UNLIMITED_GBIT: the same qdisc work per packet, no rate limit that
        this machine's cores could reach."""
        gbit = gbit or UNLIMITED_GBIT
        for ns in self.hosts:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            parent = ["root"]
            if delay_ms:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root",
                    "handle", "1:", "netem", "delay", f"{delay_ms}ms", "limit", "100000")
                parent = ["parent", "1:1"]
            # burst: 1 ms at the line rate, at least a few 64 KiB GSO segments
            burst = max(256 * 1024, int(gbit * 1e9 / 8 * 1e-3))
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *parent,
                "tbf", "rate", f"{gbit}gbit", "burst", str(burst), "latency", f"{QUEUE_MS}ms")
        self.wait_links()

    def wait_links(self, timeout=10.0):
        """Until every host's eth0 is operationally up, twice, 1.1 s apart. Swapping a qdisc
        takes the link down for a moment and the kernel publishes the state again up to a second
        later; meanwhile MPICH's UCX sees no usable eth0 and fails to start."""
        deadline = time.monotonic() + timeout
        for settle in (True, False):
            while True:
                down = [ns for ns in self.hosts if " state UP " not in
                        _sh("ip", "-n", ns, "-o", "link", "show", "eth0").stdout]
                if not down:
                    break
                if time.monotonic() > deadline:
                    raise BenchError(f"the links of {down} did not come up within {timeout:.0f} s")
                time.sleep(0.05)
            if settle:
                time.sleep(1.1)

    def start(self, i, argv, env, output=None):
        """Run argv in host i's namespace (its own session); output: a file for its stdout and
        stderr, or None (inherit)."""
        with open(output, "w") if output else contextlib.nullcontext() as f:
            p = subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *argv], env=env,
                                 stdin=subprocess.DEVNULL, stdout=f, start_new_session=True,
                                 stderr=subprocess.STDOUT if f else None)
        self.procs.append(p)
        return p

    def wait(self, procs, timeout, what):
        deadline = time.monotonic() + timeout
        rcs = []
        for p in procs:
            try:
                rcs.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise BenchError(f"{what} did not finish within {timeout:.0f} s") from None
        if any(rcs):
            raise BenchError(f"{what} failed: exit codes {rcs}")

    def close(self):
        for p in self.procs:  # our own children only, each its own session
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []
        # what they started in our namespaces in sessions of its own (mpiexec's proxies)
        for ns in self.made:
            for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self.made):  # deleting a namespace deletes its veth ends and pairs
            _sh("ip", "netns", "del", ns, check=False)
        self.made = []

    def __exit__(self, *exc):
        self.close()


# -- one rank --------------------------------------------------------------------------------------

def rank_data(rank, n):
    return np.random.default_rng(1000 + rank).standard_normal(n, dtype=np.float32)


def _worker(a):
    """One rank: a warm-up all_reduce_mean checked against the float64 mean, then `repeat` timed
    calls; writes the times and a hash of the result."""
    n = a["floats"]
    if a["kind"] == "ring":
        from llmctl.distributed.rendezvous import resolve_secret
        from llmctl.distributed.ring import init_ring

        comm = init_ring(a["rank"], a["world"], master_addr=a["master"], master_port=PORT,
                         bind_addr=a["bind"], secret=resolve_secret({"LLMCTL_SECRET": SECRET_TEXT}),
                         timeout=60, rdzv_timeout=120)
    else:
        from llmctl.distributed.mpi import MpiComm

        comm = MpiComm()
        if a["kind"] == "sendrecv":
            return _sendrecv_worker(comm, a)
    P = comm.world_size
    buf = rank_data(comm.rank, n)
    comm.all_reduce_mean(buf)
    if a["check"]:  # every rank's data regenerated here: only for small buffers
        ref = np.zeros(n, np.float64)
        for r in range(P):
            ref += rank_data(r, n)
        ref /= P
        err = float(np.abs(buf - ref).max()) if n else 0.0
        if err > 1e-5:
            raise SystemExit(f"rank {comm.rank}: all-reduce result off by {err:g}")
    digest = hashlib.blake2b(buf.tobytes(), digest_size=16).hexdigest()
    times = []
    for _ in range(a["repeat"]):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce_mean(buf)
        times.append(time.perf_counter() - t0)
    comm.barrier()
    with open(os.path.join(a["dir"], f"{a['kind']}_{comm.rank}.json"), "w") as f:
        json.dump({"times": times, "digest": digest, "world": P}, f)
    comm.close()


def _sendrecv_worker(comm, a):
    """Ranks 2i and 2i+1 swap a["floats"] floats with one Sendrecv, a["repeat"] times after a
    warm-up: on a full-duplex link a swap takes the one-way time."""
    C = comm.comm
    r = C.Get_rank()
    send = rank_data(r, a["floats"])
    recv = np.empty_like(send)
    times = []
    for i in range(a["repeat"] + 1):
        C.Barrier()
        t0 = time.perf_counter()
        C.Sendrecv(send, dest=r ^ 1, recvbuf=recv, source=r ^ 1)
        if i:
            times.append(time.perf_counter() - t0)
    C.Barrier()
    if not np.array_equal(recv, rank_data(r ^ 1, a["floats"])):
        raise SystemExit(f"rank {r}: Sendrecv delivered other data")
    with open(os.path.join(a["dir"], f"sendrecv_{r}.json"), "w") as f:
        json.dump({"times": times, "digest": "", "world": C.Get_size()}, f)
    comm.close()


def _collect_times(d, kind, world):
    """Each timed call's time, as slow as its slowest rank."""
    res = [json.load(open(os.path.join(d, f"{kind}_{r}.json"))) for r in range(world)]
    if len({r["digest"] for r in res}) != 1:
        raise BenchError(f"{kind}: ranks ended the all-reduce with different bits")
    return [max(r["times"][i] for r in res) for i in range(len(res[0]["times"]))]


def _collect(d, kind, world):
    return statistics.median(_collect_times(d, kind, world))


def _env(threads=1):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")


def _job_timeout(floats, repeat):
    """Start-up plus every all-reduce at 20 MB/s: far beyond any point of the sweep, short
    enough that a rank that died at start (MPI leaves its peers waiting) fails the run."""
    return 60 + (repeat + 1) * 4 * floats / 20e6


def ring_allreduce(cl, floats, repeat, check):
    with tempfile.TemporaryDirectory() as d:
        ps = [cl.start(r, [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(
            {"kind": "ring", "rank": r, "world": cl.n, "master": cl.addr(0), "bind": cl.addr(r),
             "floats": floats, "repeat": repeat, "dir": d, "check": check})], _env())
            for r in range(cl.n)]
        cl.wait(ps, _job_timeout(floats, repeat), f"ring all-reduce on {cl.n} hosts")
        return _collect(d, "ring", cl.n)


def _mpiexec():
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def mpi_available():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'llmctl[mpi]')"
    return None if _mpiexec() else "no mpiexec found (pip install mpich)"


def mpi_allreduce(cl, floats, repeat, check, algorithm="auto", netmod="ofi", kind="mpi"):
    """mpiexec runs in host 0's namespace; its ssh launcher is this script's --netns-launch, which
    starts each host's proxy in that host's namespace (hosts are named by their addresses).
    netmod: MPICH's network module, "ofi" (libfabric's tcp provider) or "ucx" (UCX over TCP).
    kind "sendrecv": instead of the all-reduce, ranks 2i and 2i+1 swap `floats` floats with one
    Sendrecv (both directions at once, every pair at once): -> the median time of one swap."""
    with tempfile.TemporaryDirectory() as d:
        hosts = ",".join(f"{cl.addr(i)}:1" for i in range(cl.n))
        launcher = os.path.join(d, "netns-launch")
        with open(launcher, "w") as f:
            f.write(f"#!/bin/sh\nexec {sys.executable} {os.path.abspath(__file__)} --netns-launch "
                    f"{cl.tag} \"$@\"\n")
        os.chmod(launcher, 0o700)
        env = _env()
        # every rank talks over its veth (its network path), never MPICH's shared memory
        env.update(MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=algorithm, HYDRA_IFACE="eth0", FI_PROVIDER="tcp",
                   FI_TCP_IFACE="eth0", UCX_NET_DEVICES="eth0", UCX_TLS="tcp", MPIR_CVAR_CH4_NETMOD=netmod)
        p = cl.start(0, [_mpiexec(), "-launcher", "ssh", "-launcher-exec", launcher, "-hosts", hosts,
                         "-n", str(cl.n), sys.executable, os.path.abspath(__file__), "--worker",
                         json.dumps({"kind": kind, "floats": floats, "repeat": repeat, "dir": d,
                                     "check": check})], env)
        cl.wait([p], _job_timeout(floats, repeat), f"MPI ({netmod}) {kind} on {cl.n} hosts")
        return (_collect_times if kind == "sendrecv" else _collect)(d, kind, cl.n)


def netns_launch(tag, argv):
    """mpiexec's "ssh": argv is [ssh options..., host, command words...]; run the command in the
    namespace of the host that has that address."""
    i = next(k for k, w in enumerate(argv) if w.startswith(SUBNET + "."))
    host = int(argv[i].rsplit(".", 1)[1]) - 1
    cmd = " ".join(argv[i + 1:])
    os.execvp("ip", ["ip", "netns", "exec", f"{tag}-h{host}", "sh", "-c", cmd])


# -- training --------------------------------------------------------------------------------------

def _shard(d, tokens):
    from llmctl.formats import write_datafile

    path = os.path.join(d, "train.bin")
    write_datafile(path, np.random.default_rng(0).integers(0, 50257, tokens).astype(np.uint16))
    return path


def train_steps(cl, model, B, T, steps, shard, out):
    """`steps` steps on every host (per-rank form, one flat ring); -> (median step s, median
    all-reduce s) over the steps after the first, from rank 0's metrics.jsonl."""
    os.makedirs(out, exist_ok=True)
    ps = []
    for r in range(cl.n):
        env = _env(1)
        env.update(RANK=str(r), WORLD_SIZE=str(cl.n), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=cl.addr(0), MASTER_PORT=str(PORT), LLMCTL_BIND_ADDR=cl.addr(r),
                   LLMCTL_SECRET=SECRET_TEXT)
        ps.append(cl.start(r, [sys.executable, "-m", "llmctl.cli", "train", "--backend", "ring",
                               "-e", model, "-i", shard, "-j", shard, "-b", str(B), "-t", str(T),
                               "-x", str(steps), "-v", "0", "-s", "0", "-l", "1e-4", "--threads", "1",
                               "-o", out, "--dist-timeout", "60"], env,
                               output=os.path.join(out, f"output_{r}.txt")))
    try:
        cl.wait(ps, 1800, f"training on {cl.n} hosts")
    except BenchError as e:
        with open(os.path.join(out, "output_0.txt"), errors="replace") as f:
            raise BenchError(f"{e}; rank 0's last output:\n{f.read()[-2000:]}") from None
    recs = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    recs = [x for x in recs if "ms" in x][1:]  # the first step warms up
    return (statistics.median(x["ms"] for x in recs) / 1000,
            statistics.median(x["allreduce_ms"] for x in recs) / 1000)


# -- the model -------------------------------------------------------------------------------------

def wire_seconds(n, nbytes, gbit, delay_ms, efficiency=1.0):
    """The ring's network time: 2(N-1)/N * bytes / bandwidth + 2(N-1) * latency, where the
    bandwidth that carries payload is the link rate times `efficiency` (the payload share of
    each frame on the wire)."""
    return 2 * (n - 1) / n * nbytes / (efficiency * gbit * 1e9 / 8) + 2 * (n - 1) * delay_ms / 1000


def memory_rates(mb=64):
    """Single-thread memcpy and float32 add (GB/s of buffer), to put t_cpu in context."""
    n = mb * 250_000
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    tc, ta = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        tc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        ta.append(time.perf_counter() - t0)
    return 4 * n / min(tc) / 1e9, 4 * n / min(ta) / 1e9


def ring_model(wire, cpu):
    """A bandwidth-optimal all-reduce whose transfers overlap its CPU work (llmctl's ring is
    pipelined: a sender thread forwards each 1 MiB chunk while the next one is received and
    added): the slower of the link and the CPU sets the time."""
    return max(wire, cpu)


def run(a, log):
    rows, trains, probes = [], [], []
    mpi_why = None if a.mpi else "--no-mpi"
    if mpi_why is None:
        mpi_why = mpi_available()
    floats = a.mb * 250_000
    nbytes = 4 * floats
    for n in a.hosts:
        with Cluster(n) as cl:
            cl.shape(None, 0.0)
            # one float per segment: 2(N-1) hops that carry (almost) nothing
            hop = ring_allreduce(cl, n, 2 * a.repeat + 1, False) / (2 * (n - 1))
            log(f"N={n}: one ring hop (TCP over veth, Python, unlimited link) takes {hop * 1e6:.0f} us")
            base = {}
            for gbit, delay in [(None, 0.0)] + [(g, dl) for g in a.gbit for dl in a.delay_ms]:
                cl.shape(gbit, delay)
                row = {"hosts": n, "mb": a.mb, "gbit": gbit, "delay_ms": delay, "hop_s": hop}
                rep = a.repeat if gbit else 2 * a.repeat + 1  # the baseline: more repeats
                row["ring_s"] = ring_allreduce(cl, floats, rep, a.check)
                if mpi_why is None:
                    row["mpi"] = {nm: {"s": mpi_allreduce(cl, floats, rep, a.check, a.mpi_algorithm, nm)}
                                  for nm in a.mpi_netmod}
                if gbit is None:
                    base = row
                else:
                    _add_models(row, base, n, nbytes, gbit, delay, hop)
                rows.append(row)
                log(_fmt_row(row))
            if mpi_why is None and a.gbit and n % 2 == 0:
                probes.append(sendrecv_probe(cl, a, n, hop, log))
            for model in [m for m, h in a.train_runs if h == n] if a.train else []:
                trains += train_sweep(cl, a, model, hop, log)
    return {"allreduce": rows, "train": trains, "sendrecv": probes, "mpi": mpi_why or "ran"}


def _add_models(row, base, n, nbytes, gbit, delay, hop):
    wire = wire_seconds(n, nbytes, gbit, delay + hop * 1000, FRAME_EFFICIENCY)
    row.update(wire_s=wire, cpu_s=base["ring_s"], ring_model_s=ring_model(wire, base["ring_s"]),
               ring_serial_s=wire + base["ring_s"])
    for nm, m in row.get("mpi", {}).items():
        m.update(cpu_s=base["mpi"][nm]["s"], model_s=ring_model(wire, base["mpi"][nm]["s"]))


def sendrecv_probe(cl, a, n, hop, log):
    """At the first --gbit rate: every pair of hosts swaps --mb/2 MB with one MPI Sendrecv, per
    netmod. A full-duplex swap takes the one-way wire time; one whose two directions take turns
    takes twice that. Each swap's time is kept: the two kinds show as two clusters."""
    gbit = a.gbit[0]
    cl.shape(gbit, a.delay_ms[0])
    floats = a.mb * 125_000
    one_way = 4 * floats / (gbit * 1e9 / 8 * FRAME_EFFICIENCY) + a.delay_ms[0] / 1e3 + hop
    probe = {"hosts": n, "gbit": gbit, "mb": a.mb / 2, "one_way_s": one_way, "netmods": {}}
    for nm in a.mpi_netmod:
        times = mpi_allreduce(cl, floats, max(8, 2 * a.repeat), False, netmod=nm, kind="sendrecv")
        probe["netmods"][nm] = {"times_s": times, "median_s": statistics.median(times),
                                "at_twice_one_way": sum(t > 1.5 * one_way for t in times)}
    log(_fmt_probe(probe))
    return probe


def train_sweep(cl, a, model, hop, log):
    """Steps on unlimited links (compute and the all-reduce's CPU time), then on each shaped
    rate; model: compute + ring_model(wire, unlimited all-reduce)."""
    out = []
    grad_bytes = _param_bytes(model)
    with tempfile.TemporaryDirectory() as d:
        shard = _shard(d, cl.n * a.batch * a.seq * 4 + 1)
        base = None
        for gbit in [None] + a.train_gbit:
            cl.shape(gbit, 0.0)
            step, ar = train_steps(cl, model, a.batch, a.seq, a.steps, shard,
                                   os.path.join(d, f"out{gbit}"))
            tr = {"hosts": cl.n, "model": model, "gbit": gbit, "step_s": step, "allreduce_s": ar,
                  "grad_bytes": grad_bytes, "B": a.batch, "T": a.seq}
            if gbit is None:
                base = tr
            else:
                wire = wire_seconds(cl.n, grad_bytes, gbit, hop * 1000, FRAME_EFFICIENCY)
                ar_model = ring_model(wire, base["allreduce_s"])
                tr.update(allreduce_model_s=ar_model,
                          step_model_s=base["step_s"] - base["allreduce_s"] + ar_model)
            out.append(tr)
            log(_fmt_train(tr))
    return out


def _param_bytes(model):
    """Bytes of the fp32 gradient buffer the training all-reduce moves."""
    from llmctl.model.config import GPT2Config, num_parameters

    return 4 * num_parameters(GPT2Config.from_descriptor(model))


def _pct(meas, model):
    return f"{100 * (meas / model - 1):+.0f}%"


def _fmt_row(r):
    link = "unlimited" if r["gbit"] is None else f"{r['gbit']:g} Gbit/s {r['delay_ms']:g} ms"
    s = f"N={r['hosts']} {r['mb']} MB {link:>18}: ring {r['ring_s'] * 1000:8.1f} ms"
    if "ring_model_s" in r:
        s += (f" (model {r['ring_model_s'] * 1000:.1f} = max(wire {r['wire_s'] * 1000:.1f}, cpu "
              f"{r['cpu_s'] * 1000:.1f}) {_pct(r['ring_s'], r['ring_model_s'])}; no overlap "
              f"{r['ring_serial_s'] * 1000:.1f} {_pct(r['ring_s'], r['ring_serial_s'])})")
    for nm, m in r.get("mpi", {}).items():
        s += f" | mpi/{nm} {m['s'] * 1000:8.1f} ms"
        if "model_s" in m:
            s += f" (model {m['model_s'] * 1000:.1f} = max(wire, cpu {m['cpu_s'] * 1000:.1f}) {_pct(m['s'], m['model_s'])})"
    return s


def _fmt_probe(p):
    each = [f"{nm} median {m['median_s'] * 1000:.0f} ms, {m['at_twice_one_way']} of {len(m['times_s'])} "
            f"over 1.5x one way (slowest {max(m['times_s']) * 1000:.0f} ms)" for nm, m in p["netmods"].items()]
    return (f"N={p['hosts']} {p['gbit']:g} Gbit/s: MPI Sendrecv swaps of {p['mb']:g} MB per pair "
            f"(one way on the wire {p['one_way_s'] * 1000:.0f} ms): " + "; ".join(each))


def _fmt_train(t):
    link = "unlimited" if t["gbit"] is None else f"{t['gbit']:g} Gbit/s"
    s = f"train {t['model']} N={t['hosts']} {link:>12}: step {t['step_s'] * 1000:.0f} ms, all-reduce {t['allreduce_s'] * 1000:.0f} ms"
    if "step_model_s" in t:
        s += (f" (model: step {t['step_model_s'] * 1000:.0f} ms {_pct(t['step_s'], t['step_model_s'])}, "
              f"all-reduce {t['allreduce_model_s'] * 1000:.0f} ms {_pct(t['allreduce_s'], t['allreduce_model_s'])})")
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4], help="namespaces per run (2..8; default 2 4)")
    ap.add_argument("--gbit", type=float, nargs="+", default=[1, 10], help="link rates, Gbit/s (default 1 10)")
    ap.add_argument("--delay-ms", type=float, nargs="+", default=[0.0],
                    help="one-way delays in ms (needs sch_netem in the kernel; default 0)")
    ap.add_argument("--mb", type=int, default=50, help="all-reduce buffer, MB (default 50)")
    ap.add_argument("--repeat", type=int, default=3, help="timed all-reduces per point (median; default 3)")
    ap.add_argument("--no-mpi", dest="mpi", action="store_false", help="skip MPI")
    ap.add_argument("--mpi-algorithm", default="auto",
                    help="MPICH's MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM: auto, ring, "
                         "reduce_scatter_allgather, recursive_doubling, ... (default auto)")
    ap.add_argument("--mpi-netmod", nargs="+", default=["ofi", "ucx"], choices=["ofi", "ucx"],
                    help="MPICH network modules to run MPI on (MPIR_CVAR_CH4_NETMOD): ofi is "
                         "libfabric's tcp provider, ucx UCX over TCP (default: both)")
    ap.add_argument("--no-train", dest="train", action="store_false", help="skip the training steps")
    ap.add_argument("--train-runs", nargs="+", default=["d6:2"],
                    help="MODEL:HOSTS training runs, MODEL a -e descriptor (default d6:2)")
    ap.add_argument("--train-gbit", type=float, nargs="+", default=[1], help="link rates for training (default 1)")
    ap.add_argument("--batch", type=int, default=2, help="-b per rank (default 2)")
    ap.add_argument("--seq", type=int, default=64, help="-t (default 64)")
    ap.add_argument("--steps", type=int, default=4, help="-x, at least 2 (default 4; the first is not timed)")
    ap.add_argument("--full", action="store_true",
                    help="the documented sweep: hosts 2 4 8, 1 10 25 Gbit/s, 100 MB, d6 and d12 training")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument("--save", help="also write the JSON results to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--netns-launch", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return _worker(json.loads(a.worker))
    if a.netns_launch:
        return netns_launch(a.netns_launch[0], a.netns_launch[1:])
    if a.full:
        a.hosts, a.gbit, a.mb, a.train_gbit = [2, 4, 8], [1, 10, 25], 100, [1, 10]
        a.train_runs = ["d6:2", "d6:4", "d12:2"]
    a.check = a.mb <= 16
    try:
        a.train_runs = [(m, int(h)) for m, h in (r.rsplit(":", 1) for r in a.train_runs)]
    except ValueError:
        sys.exit(f"Error: --train-runs takes MODEL:HOSTS, got {a.train_runs}\nHint: e.g. --train-runs d6:2 d12:2")
    from llmctl.errors import LlmctlError
    for m, _ in a.train_runs if a.train else []:
        try:
            _param_bytes(m)
        except LlmctlError as e:
            sys.exit(f"Error: --train-runs {m}: {e}\nHint: a descriptor such as d6 or d12")
    a.hosts = sorted(set(a.hosts) | ({h for _, h in a.train_runs} if a.train else set()))
    if any(not 2 <= n <= 8 for n in a.hosts):
        sys.exit("Error: --hosts must be between 2 and 8\nHint: e.g. --hosts 2 4 8")
    for flag, vals, ok in (("--gbit", a.gbit, lambda v: 0 < v < UNLIMITED_GBIT),
                           ("--delay-ms", a.delay_ms, lambda v: v >= 0),
                           ("--mb", [a.mb], lambda v: v >= 1), ("--repeat", [a.repeat], lambda v: v >= 1),
                           ("--steps", [a.steps], lambda v: v >= 2)):
        if not all(ok(v) for v in vals):
            sys.exit(f"Error: {flag} {' '.join(map(str, vals))} is out of range\n"
                     f"Hint: see --help for {flag} (rates below {UNLIMITED_GBIT} Gbit/s, >= 2 steps)")
    why = requirements()
    if why:
        sys.exit(f"Error: cannot build the emulated hosts: {why}\nHint: run as root on Linux with iproute2")
    if any(a.delay_ms) and not has_netem():
        sys.exit("Error: --delay-ms needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM)\n"
                 "Hint: leave --delay-ms at 0 (rate shaping only) or use a kernel with sch_netem")
    sweep_stale()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally-blocks clean up
    log = (lambda s: None) if a.json else (lambda s: print(s, flush=True))
    cp, add = memory_rates()
    log(f"this machine: {os.cpu_count()} cores; one thread copies {cp:.1f} GB/s, adds float32 {add:.1f} GB/s")
    try:
        res = run(a, log)
    except BenchError as e:
        sys.exit(f"Error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    res.update(mpi_algorithm=a.mpi_algorithm, mpi_netmods=a.mpi_netmod, memcpy_GBps=cp, add_GBps=add, cores=os.cpu_count(), argv=sys.argv[1:])
    if a.save:
        with open(a.save, "w") as f:
            json.dump(res, f, indent=1)
    if a.json:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
