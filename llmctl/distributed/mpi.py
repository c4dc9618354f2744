"""The MPI backend: the Comm interface on mpi4py, for clusters that already run MPI.

issue 6.

What it is: `MpiComm`, launched as `mpiexec -n N llmctl train --transport mpi ...` (every process
is one rank; MPI's launcher, not llmctl's, starts and places them). all_reduce_mean is one
in-place `Allreduce(MPI.IN_PLACE, buf, MPI.SUM)` on the flat float32 gradient buffer followed by a
float32 division by N; scalars, broadcasts and barriers are `allreduce` / `Bcast` / `Barrier`.
Faults are MPI's: by default MPI_ERRORS_ARE_FATAL, so mpiexec tears the whole job down when a
rank dies. A rank that fails on its own calls `abort()` (MPI_Abort), which first unlinks MPICH's
/dev/shm segment (MPI_Finalize, where MPICH removes it, never runs in an aborted job); a rank
killed from outside (SIGKILL, OOM) leaves that file behind, as any MPICH job does.
Install with `pip install 'llmctl[mpi]'` (mpi4py + the MPICH wheel; MPICH runs as root, Open
MPI's wheel refuses unless OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set).

Determinism: MPICH's reduction order for a fixed N and message size is fixed, so runs repeat.
Its algorithms combine partial sums pairwise and float addition is commutative bit for bit, so
every rank gets the same bits (tests/test_mpi.py asserts it); `exact=True` additionally
broadcasts rank 0's result, for MPI libraries that do not guarantee this (doubles the traffic).

What it is not: no process spawning and no rendezvous of its own. It mirrors llm.c's
`-pi mpi` path (multi_gpu_config_init with MPI_Allgather of the NCCL id, then ncclAllReduce).
"""
import contextlib
import hashlib
import os
import time

import numpy as np

from llmctl.distributed.base import Comm
from llmctl.errors import ConfigError, DistError


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ConfigError(f"--transport mpi needs mpi4py, which is not importable ({e})",
                          hint="pip install 'llmctl[mpi]' (mpi4py + the mpich wheel), then run "
                               "under `mpiexec -n N llmctl train --transport mpi ...`") from None
    return MPI


def _mpich_segments(maps="/proc/self/maps"):
    """The MPICH shared-memory files (/dev/shm/mpich_shm_*) this process has mapped; [] where
    /proc is missing. One per host, created by its first rank and mapped by all of them."""
    try:
        with open(maps) as f:
            paths = {p[5].strip() for p in (line.split(None, 5) for line in f) if len(p) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/dev/shm/mpich_shm_"))


class MpiComm(Comm):
    """One MPI rank. `comm` defaults to MPI.COMM_WORLD."""

    def __init__(self, comm=None, n_threads=1, exact=False):
        MPI = _import_mpi()
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = node.Get_rank()
        self.local_world_size = node.Get_size()
        node.Free()
        self.n_threads = max(1, int(n_threads))
        self.exact = bool(exact)
        self.step = -1
        self.stop_requested = False
        self._watch = []
        self._ztmp = [None, None]   # -z 1's packing buffers (N/P floats each), kept between steps
        self.allreduce_calls = 0
        self.allreduce_seconds = 0.0

    def all_reduce_mean(self, buf):
        if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.ndim != 1 \
                or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError("all_reduce_mean needs a writeable 1-D contiguous float32 array, got "
                             f"{getattr(buf, 'dtype', type(buf))} {getattr(buf, 'shape', '')}")
        if self.world_size == 1 or buf.shape[0] == 0:
            return
        t0 = time.perf_counter()
        MPI = self.MPI
        self.comm.Allreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], op=MPI.SUM)
        np.divide(buf, np.float32(self.world_size), out=buf)
        if self.exact:
            self.comm.Bcast([buf, MPI.FLOAT], root=0)
        self.allreduce_calls += 1
        self.allreduce_seconds += time.perf_counter() - t0

    supports_zero = True

    def _zero_tmp(self, i, n):
        """Packing buffer i (0 or 1) of >= n floats, kept between steps."""
        tmps = self._ztmp
        if tmps[i] is None or tmps[i].shape[0] < n:
            tmps[i] = np.empty(n, np.float32)
        return tmps[i][:n]

    def _pack(self, buf, ranges, out):
        k = 0
        for lo, hi in ranges:
            out[k:k + hi - lo] = buf[lo:hi]
            k += hi - lo
        return out[:k]

    def _unpack(self, buf, ranges, src):
        k = 0
        for lo, hi in ranges:
            buf[lo:hi] = src[k:k + hi - lo]
            k += hi - lo

    def reduce_scatter_mean(self, buf, shards):
        """One MPI_Reduce per rank's shard, packed contiguously (1/P of buf at a time), to
        that rank; the owner divides by P and unpacks into its ranges."""
        if self.world_size == 1 or buf.shape[0] == 0:
            return
        t0 = time.perf_counter()
        MPI = self.MPI
        n = max(sum(hi - lo for lo, hi in ranges) for ranges in shards)
        send, recv = self._zero_tmp(0, n), self._zero_tmp(1, n)
        for root, ranges in enumerate(shards):
            sb = self._pack(buf, ranges, send)
            self.comm.Reduce([sb, MPI.FLOAT], [recv[:sb.shape[0]], MPI.FLOAT] if root == self.rank
                             else None, op=MPI.SUM, root=root)
            if root == self.rank:
                rb = recv[:sb.shape[0]]
                np.divide(rb, np.float32(self.world_size), out=rb)
                self._unpack(buf, ranges, rb)
        self.allreduce_calls += 1
        self.allreduce_seconds += time.perf_counter() - t0

    def all_gather(self, buf, shards, scratch=None):
        """One MPI_Bcast per rank's shard, packed contiguously, from that rank (scratch unused)."""
        if self.world_size == 1 or buf.shape[0] == 0:
            return
        MPI = self.MPI
        n = max(sum(hi - lo for lo, hi in ranges) for ranges in shards)
        tmp = self._zero_tmp(0, n)
        for root, ranges in enumerate(shards):
            t = self._pack(buf, ranges, tmp) if root == self.rank else \
                tmp[:sum(hi - lo for lo, hi in ranges)]
            self.comm.Bcast([t, MPI.FLOAT], root=root)
            if root != self.rank:
                self._unpack(buf, ranges, t)

    def all_reduce_sum_scalar(self, x):
        for watched in self._watch:
            self.assert_identical(*watched)
        # gather all values and sum them in rank order: the same bits on every rank
        vals = self.comm.allgather(float(x))
        total = 0.0
        for v in vals:
            total += v
        return total

    def barrier(self):
        self.comm.Barrier()

    def broadcast(self, buf, root=0):
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast root {root} is not a rank of a world of {self.world_size}")
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
            raise ValueError("broadcast needs a contiguous NumPy array")
        if self.world_size > 1 and buf.nbytes:
            self.comm.Bcast([buf.reshape(-1).view(np.uint8), self.MPI.BYTE], root=root)

    def watch(self, buf, what="buffer"):
        self._watch.append((buf, what))

    def assert_identical(self, buf, what="buffer"):
        if self.world_size == 1:
            return
        arr = np.ascontiguousarray(buf)
        d = hashlib.blake2b(memoryview(arr).cast("B"), digest_size=16).hexdigest()
        ds = self.comm.allgather(d)
        if len(set(ds)) != 1:
            detail = ", ".join(f"rank {r}: {x[:16]}" for r, x in enumerate(ds))
            raise DistError(f"rank {self.rank}: ranks disagree on {what} at step {self.step}: {detail}")

    def close(self):
        pass

    def abort(self, code=1):
        """End every rank of the job (MPI_Abort): used when this rank fails on its own.

        MPICH unlinks its host's shared-memory segment in MPI_Finalize, which an abort skips on
        every rank (mpiexec kills the others), so the file would stay in /dev/shm for good. This
        rank maps it too: unlink it first; ranks still using it keep their mappings until they
        exit. Segments on other hosts of a multi-host job are not visible from here."""
        for path in _mpich_segments():
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.comm.Abort(code)
