"""Benchmark: the TCP ring all-reduce across loopback "hosts" vs MPI's Allreduce, same buffer, one run.

issue 6.

What it measures: all_reduce_mean of an --mb MB float32 buffer (default 500 MB) by
- the ring backend (llmctl/distributed/ring.py) in P = 2 and 4 processes, each bound to its own
  loopback address 127.0.0.2, 127.0.0.3, ... (a "host");
- the MPI backend (llmctl/distributed/mpi.py: in-place Allreduce + divide) under `mpiexec -n P` on the
  same buffer size, twice: MPICH as it runs by default (it sees one machine and uses shared
  memory) and with MPIR_CVAR_NOLOCAL=1 (every rank treated as remote: its network path, the
  fair comparison for a TCP ring);
median of --repeat timed runs after one warm-up, reported as time, algorithm bandwidth
(buffer bytes / time) and the ring/MPI time ratio (target: ring within 1.5x of MPI).

It is not a correctness test (tests/test_ring.py, tests/test_mpi.py are). All ranks share
this machine's cores and memory bandwidth, so absolute numbers are a lower bound for real hosts.

    python bench/allreduce_multi.py                  # 500 MB, P = 2 and 4
    python bench/allreduce_multi.py --mb 100 --procs 2 --repeat 3 --json
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SECRET_TEXT = "bench-allreduce-multi-secret-0123"


def _worker(a):
    """One rank: time `repeat` all_reduce_mean calls (after a warm-up) and write the times."""
    n = a["mb"] * 1_000_000 // 4
    if a["kind"] == "ring":
        from llmctl.distributed.rendezvous import resolve_secret
        from llmctl.distributed.ring import init_ring

        comm = init_ring(a["rank"], a["world"], master_addr="127.0.0.2", master_port=a["port"],
                         bind_addr=f"127.0.0.{2 + a['rank']}",
                         secret=resolve_secret({"LLMCTL_SECRET": SECRET_TEXT}), timeout=60,
                         rdzv_timeout=120, chunk_bytes=a["chunk"])
    else:
        from llmctl.distributed.mpi import MpiComm

        comm = MpiComm()
    buf = np.full(n, comm.rank + 1.0, dtype=np.float32)
    comm.all_reduce_mean(buf)  # warm-up: connections, page faults
    expect = np.float32((comm.world_size + 1) / 2.0)
    if buf[0] != expect or buf[-1] != expect:
        raise SystemExit(f"rank {comm.rank}: wrong all-reduce result {buf[0]} (want {expect})")
    times = []
    for _ in range(a["repeat"]):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce_mean(buf)
        times.append(time.perf_counter() - t0)
    comm.barrier()
    with open(os.path.join(a["dir"], f"{a['kind']}_{comm.rank}.json"), "w") as f:
        json.dump(times, f)
    comm.close()


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _collect(d, kind, world, repeat):
    res = [json.load(open(os.path.join(d, f"{kind}_{r}.json"))) for r in range(world)]
    per = [max(r[i] for r in res) for i in range(repeat)]  # a collective is as slow as its slowest rank
    return statistics.median(per)


def _mpiexec():
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def run(mb, procs, repeat, chunk, threads):
    out = []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    nbytes = mb * 1_000_000 // 4 * 4
    for P in procs:
        row = {"procs": P, "mb": mb, "bytes": nbytes}
        with tempfile.TemporaryDirectory() as d:
            port = _free_port()
            base = {"mb": mb, "repeat": repeat, "dir": d, "chunk": chunk, "world": P, "port": port}
            ps = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(
                dict(base, kind="ring", rank=r))], env=env) for r in range(P)]
            rcs = [p.wait() for p in ps]
            if any(rcs):
                raise SystemExit(f"ring run failed: exit codes {rcs}")
            row["ring_s"] = _collect(d, "ring", P, repeat)
            mpiexec = _mpiexec()
            for label, extra in (("mpi", {}), ("mpi_nolocal", {"MPIR_CVAR_NOLOCAL": "1"})):
                if mpiexec is None:
                    break
                try:
                    import mpi4py  # noqa: F401
                except ImportError:
                    break
                r = subprocess.run([mpiexec, "-n", str(P), sys.executable, __file__, "--worker",
                                    json.dumps(dict(base, kind="mpi", rank=-1))],
                                   env=dict(env, **extra), stdin=subprocess.DEVNULL)
                if r.returncode != 0:
                    row[f"{label}_error"] = f"exit {r.returncode}"
                    continue
                row[f"{label}_s"] = _collect(d, "mpi", P, repeat)
        for k in ("ring", "mpi", "mpi_nolocal"):
            if f"{k}_s" in row:
                row[f"{k}_GBps"] = nbytes / row[f"{k}_s"] / 1e9
        for k in ("mpi", "mpi_nolocal"):
            if f"{k}_s" in row:
                row[f"ring_over_{k}"] = row["ring_s"] / row[f"{k}_s"]
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=500, help="buffer size in MB (default 500)")
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="ranks / loopback hosts")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per backend (median)")
    ap.add_argument("--chunk", type=int, default=1 << 20, help="ring chunk bytes (default 1 MiB)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(json.loads(a.worker))
        return
    rows = run(a.mb, a.procs, a.repeat, a.chunk, a.threads)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        line = f"P={r['procs']} {r['mb']} MB: ring {r['ring_s']:.3f} s ({r['ring_GBps']:.2f} GB/s)"
        for k in ("mpi", "mpi_nolocal"):
            if f"{k}_s" in r:
                line += (f" | {k} {r[f'{k}_s']:.3f} s ({r[f'{k}_GBps']:.2f} GB/s), "
                         f"ring/{k} = {r[f'ring_over_{k}']:.2f}x")
            elif f"{k}_error" in r:
                line += f" | {k}: {r[f'{k}_error']}"
        print(line)


if __name__ == "__main__":
    main()
