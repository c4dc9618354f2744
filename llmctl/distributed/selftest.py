"""Toy worker targets for the launcher: collective checks, fault injection, all-reduce timing.

What it is: functions with the worker signature `fn(args, comm)` used by tests/test_dist.py and
bench/allreduce.py (and handy for checking a machine: they need no model or data). They write
their results as JSON files into args["dir"]; each rank also writes "<rank>.pid" there at start
so a test can signal a specific rank.

What it is not: part of training. Nothing here runs unless named as a launcher target.
"""
import json
import os
import signal
import time

import numpy as np

from llmctl.atomic import atomic_write
from llmctl.errors import DataError


def _write(args, name, obj):
    atomic_write(os.path.join(args["dir"], name), json.dumps(obj))


def rank_data(rank, it, n):
    """The float32 vector rank `rank` contributes at iteration `it` (reproducible anywhere)."""
    return np.random.default_rng(1000 * it + rank).standard_normal(n).astype(np.float32)


def collectives(args, comm):
    """Run `iters` rounds of all_reduce_mean/sum/broadcast/assert_identical and check the bits.

    {"zero": true} also checks ZeRO-1's reduce_scatter_mean and all_gather on each size (the
    buffer cut into 2P interleaved ranges, range j owned by rank j % P): the owner's ranges hold
    the fixed-order mean, and after the all-gather every rank holds all of it.
    Optional fault injection: {"fail_rank": r, "fail_at": i, "fail": "error"|"kill"|"stop"|
    "exit0"|"mismatch"} makes rank r misbehave at iteration i ({"fail_in": "reduce_scatter"}:
    right before its reduce-scatter, while the others wait in it). {"loop": true} keeps
    iterating (with `sleep` s between rounds) until comm.stop_requested, for signal tests.
    """
    _write(args, f"{comm.rank}.pid", {"pid": os.getpid()})
    sizes = args.get("sizes", [0, 1, 17, 4099, 100003])
    iters = args.get("iters", 2)
    sleep = args.get("sleep", 0.0)
    checked = 0
    it = 0
    shared = None
    if args.get("shared") and hasattr(comm, "shared_buffer"):
        shared = comm.shared_buffer(max(sizes))
    while True:
        comm.step = it
        if (args.get("fail_rank") == comm.rank and args.get("fail_at") == it
                and not args.get("fail_in")):
            _fail(args, comm)
        for n in sizes:
            buf = rank_data(comm.rank, it, n)
            if shared is not None and n == shared.shape[0]:
                shared[:] = buf  # the zero-copy path: data already in this rank's shared row
                buf = shared
            comm.all_reduce_mean(buf)
            want = _reference_mean(comm, it, n)
            if not np.array_equal(buf, want):
                raise DataError(f"rank {comm.rank}: all_reduce_mean(n={n}) differs from the reference "
                                f"(max |diff| {np.max(np.abs(buf - want)):.3g})")
            checked += 1
            if args.get("zero"):
                _check_zero(args, comm, it, n, shared, want)
        _check_small_collectives(args, comm)
        it += 1
        if comm.stop_requested:
            break
        if not args.get("loop") and it >= iters:
            break
        if sleep:
            time.sleep(sleep)
    _write(args, f"result_{comm.rank}.json",
           {"rank": comm.rank, "world_size": comm.world_size, "iters": it, "checked": checked,
            "stopped": bool(comm.stop_requested), "threads": os.environ.get("OMP_NUM_THREADS")})


def _reference_mean(comm, it, n):
    """The all-reduce's expected bits: float32 sums in rank order 0..N-1, as the kernel adds."""
    want = rank_data(0, it, n)
    for r in range(1, comm.world_size):
        want = want + rank_data(r, it, n)
    return want / np.float32(comm.world_size)


def _check_small_collectives(args, comm):
    """The scalar sum, a broadcast, assert_identical ({"fail": "mismatch"}: made to differ), a barrier."""
    s = comm.all_reduce_sum_scalar(comm.rank + 0.5)
    if s != sum(r + 0.5 for r in range(comm.world_size)):
        raise DataError(f"rank {comm.rank}: all_reduce_sum_scalar gave {s}")
    b = np.full(7, comm.rank, dtype=np.int64)
    comm.broadcast(b, root=comm.world_size - 1)
    if not np.all(b == comm.world_size - 1):
        raise DataError(f"rank {comm.rank}: broadcast gave {b}")
    same = np.arange(10, dtype=np.float32)
    if args.get("fail") == "mismatch" and args.get("fail_rank") == comm.rank:
        same[3] += 1
    comm.assert_identical(same, "parameters")
    comm.barrier()


def _fail(args, comm):
    kind = args.get("fail", "error")
    if kind == "error":
        raise DataError(f"synthetic failure on rank {comm.rank}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "exit0":
        os._exit(0)
    if kind == "raise":
        raise RuntimeError("synthetic bug")


def _check_zero(args, comm, it, n, shared, want):
    """reduce_scatter_mean then all_gather of one size against the all-reduce's mean `want`."""
    P, r = comm.world_size, comm.rank
    cuts = [j * n // (2 * P) for j in range(2 * P + 1)]
    shards = [[(cuts[j], cuts[j + 1]) for j in range(2 * P) if j % P == q] for q in range(P)]
    buf = rank_data(r, it, n)
    if shared is not None and n == shared.shape[0]:
        shared[:] = buf
        buf = shared
    if (args.get("fail_in") == "reduce_scatter" and args.get("fail_rank") == r
            and args.get("fail_at") == it):
        _fail(args, comm)
    comm.reduce_scatter_mean(buf, shards)
    for lo, hi in shards[r]:
        if not np.array_equal(buf[lo:hi], want[lo:hi]):
            raise DataError(f"rank {r}: reduce_scatter_mean(n={n}) differs from the reference "
                            f"on [{lo}, {hi})")
    params = np.full(n, np.float32(-r - 1))   # another value on every rank outside its ranges
    for lo, hi in shards[r]:
        params[lo:hi] = buf[lo:hi]
    comm.all_gather(params, shards, scratch=buf if buf is shared else None)
    if not np.array_equal(params, want):
        raise DataError(f"rank {r}: all_gather(n={n}) differs from the reference")


def bench_allreduce(args, comm):
    """Time all_reduce_mean on an n-float buffer; rank 0 also times a memcpy of the same buffer."""
    from llmctl._ext import reduce as _reduce  # copy_floats

    n = int(args["n"])
    iters = int(args.get("iters", 5))
    if args.get("shared"):
        buf = comm.shared_buffer(n)
        buf.fill(comm.rank + 1.0)
    else:
        buf = np.full(n, comm.rank + 1.0, dtype=np.float32)
    comm.all_reduce_mean(buf)  # warm-up: creates and faults in the segment
    expect = (comm.world_size + 1) / 2.0
    if buf[0] != expect or buf[-1] != expect:
        raise DataError(f"rank {comm.rank}: wrong all-reduce result {buf[0]} (want {expect})")
    times = []
    for _ in range(iters):
        buf.fill(comm.rank + 1.0)  # fresh gradients each round (outside the timed region)
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce_mean(buf)
        comm.barrier()
        times.append(time.perf_counter() - t0)
    res = {"rank": comm.rank, "allreduce_s": times}
    comm.barrier()
    if comm.rank == 0:
        # memcpy baseline in the same run while the other ranks sit in a barrier (not computing)
        dst = np.empty_like(buf)
        _reduce.copy_floats(dst, buf, 1)
        mt = []
        for _ in range(iters):
            t0 = time.perf_counter()
            _reduce.copy_floats(dst, buf, 1)
            mt.append(time.perf_counter() - t0)
        res["memcpy_s"] = mt
    comm.barrier()
    _write(args, f"bench_{comm.rank}.json", res)
