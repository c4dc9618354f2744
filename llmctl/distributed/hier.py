"""Across hosts: shm inside each host + TCP rings across hosts, as one Comm.

What it is:
- `HierComm`: the Comm of one rank of a K-node x N-process job. all_reduce_mean(buf):
    1. local reduce-scatter over shared memory (ShmComm's segment and kernels): local rank i
       ends with the node's mean of slice i of buf;
    2. ring across hosts: local rank i all-reduces its slice with local rank i of every other node
       (N rings in parallel, ring.py), so each host sends ~2(K-1)/K of the buffer in total,
       spread over N connections;
    3. local all-gather over shared memory: everyone copies the other slices.
  A mean of equal-sized node means is the global mean. Scalars: local sum, then a ring sum that
  also carries each node's "stop requested" flag, so a Ctrl-C on one node stops every node at
  the same step. Broadcast: ring from the root's node, then the local shm broadcast.
  ZeRO-1 (-z 1): reduce_scatter_mean is the first half of that, shard by shard: the shm
  reduce-scatter leaves local rank i with the node's mean of the shards of every global rank
  with local rank i (one per node), then the ring of local rank i reduce-scatters those K shards
  across the nodes, so each rank ends with the global mean of its own shard: each host sends
  ~(K-1)/K of the buffer. all_gather is the reverse: the ring all-gather of local rank i's K
  shards, then the shm all-gather of the node's N groups. The mean is the all-reduce's (node
  means, then a ring mean of them); with 2 nodes the same bits, since the ring then adds one
  pair, whichever member owns it.
- `check_collectives`: a toy target for tests and bench/ that checks the collectives of any Comm.
Starting the ranks of each host and joining them into rings is job control
(llmctl/jobs/multinode.py).

What it is not: no new transport (ring.py, shm.py) and no process management (llmctl/jobs/).
It plays the role of NCCL's hierarchical (intra-node + inter-node ring) all-reduce in llm.c.
"""
import os

import numpy as np

from llmctl.distributed.base import Comm
from llmctl.errors import DistError


class HierComm(Comm):
    """One rank of nnodes x shm.world_size: `shm` is this node's ShmComm, `ring` this local
    rank's ring across nodes (members: the ranks with the same local rank, by node)."""

    def __init__(self, shm, ring, node_rank, nnodes):
        self.shm = shm
        self.ring = ring
        lw = shm.world_size
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.rank = node_rank * lw + shm.rank
        self.world_size = nnodes * lw
        self.local_rank = shm.rank
        self.local_world_size = lw
        self.n_threads = shm.n_threads
        self.stop_requested = False
        self._watch = []
        self.allreduce_calls = 0
        self.allreduce_seconds = 0.0

    @property
    def step(self):
        return self.shm.step

    @step.setter
    def step(self, value):
        self.shm.step = value
        self.ring.step = int(value)

    def all_reduce_mean(self, buf):
        import time

        if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.ndim != 1 \
                or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError("all_reduce_mean needs a writeable 1-D contiguous float32 array, got "
                             f"{getattr(buf, 'dtype', type(buf))} {getattr(buf, 'shape', '')}")
        t0 = time.perf_counter()
        shm = self.shm
        if shm.world_size == 1:
            self.ring.all_reduce_mean(buf)
        else:
            # shm reduce-scatter inside the host, the ring across hosts on this rank's slice,
            # then the shm all-gather
            shm.all_reduce_copy(buf, between=self.ring.all_reduce_mean)
        self.allreduce_calls += 1
        self.allreduce_seconds += time.perf_counter() - t0

    supports_zero = True

    def _node_shards(self, shards):
        """shards (per global rank) -> per local rank: the ranges of that local rank on every
        node, in buffer order (what the shm reduce-scatter leaves with it)."""
        lw = self.local_world_size
        return [sorted(r for k in range(self.nnodes) for r in shards[k * lw + i]) for i in range(lw)]

    def reduce_scatter_mean(self, buf, shards):
        """The node's mean of local rank i's shards over shm, then their mean across nodes over
        local rank i's ring (whose members own exactly those shards): this rank's ranges of buf
        hold the global mean."""
        import time

        t0 = time.perf_counter()
        self.shm.reduce_scatter_mean(buf, self._node_shards(shards))
        self.ring.reduce_scatter_mean(buf, shards)
        self.allreduce_calls += 1
        self.allreduce_seconds += time.perf_counter() - t0

    def all_gather(self, buf, shards, scratch=None):
        """The ring all-gather of local rank i's shards across nodes, then the shm all-gather
        of every local rank's group of them."""
        self.ring.all_gather(buf, shards)
        self.shm.all_gather(buf, self._node_shards(shards), scratch=scratch)

    def all_reduce_sum_scalar(self, x):
        for watched in self._watch:
            self.assert_identical(*watched)
        local = self.shm.all_reduce_sum_scalar(float(x))
        # every local rank saw the same hub release, so the flag agrees within the node
        total, stops = self.ring.all_reduce_sum_vec([local, 1.0 if self.shm.stop_requested else 0.0])
        if stops > 0:
            self.stop_requested = True
        return float(total)

    def barrier(self):
        self.shm.barrier()
        self.ring.barrier()  # completes only after every node's local barrier

    def broadcast(self, buf, root=0):
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast root {root} is not a rank of a world of {self.world_size}")
        root_local = root % self.local_world_size
        if self.local_rank == root_local:
            self.ring.broadcast(buf, root=root)
        self.shm.broadcast(buf, root=root_local)

    def watch(self, buf, what="buffer"):
        self._watch.append((buf, what))

    def assert_identical(self, buf, what="buffer"):
        self.shm.assert_identical(buf, what)
        self.ring.assert_identical(buf, what)

    def close(self):
        self.ring.close()  # the worker closes the ShmComm itself


def check_collectives(args, comm):
    """Toy target for tests/bench: all-reduce known vectors, save what every rank got.

    args: dir, sizes, iters, zero (optional). Writes <dir>/<rank>_<it>_<n>.npy and
    <dir>/result_<rank>.txt with the scalar sum and broadcast checks; raises on a wrong scalar or
    broadcast. With zero: also <dir>/z<rank>_<it>_<n>.npy, what ZeRO-1's reduce_scatter_mean then
    all_gather made of the same vectors (_zero_round)."""
    from llmctl.distributed.selftest import rank_data

    d = args["dir"]
    with open(os.path.join(d, f"{comm.rank}.pid"), "w") as f:
        f.write('{"pid": %d}' % os.getpid())
    for it in range(int(args.get("iters", 1))):
        comm.step = it
        for n in args["sizes"]:
            buf = rank_data(comm.rank, it, n)
            comm.all_reduce_mean(buf)
            np.save(os.path.join(d, f"{comm.rank}_{it}_{n}.npy"), buf)
            if args.get("zero"):
                np.save(os.path.join(d, f"z{comm.rank}_{it}_{n}.npy"), _zero_round(comm, it, n))
        s = comm.all_reduce_sum_scalar(comm.rank + 0.5)
        if s != sum(r + 0.5 for r in range(comm.world_size)):
            raise DistError(f"rank {comm.rank}: all_reduce_sum_scalar gave {s}")
        for root in sorted({0, comm.world_size - 1}):
            b = np.full(5, comm.rank, dtype=np.int64)
            comm.broadcast(b, root=root)
            if not np.all(b == root):
                raise DistError(f"rank {comm.rank}: broadcast from {root} gave {b}")
        comm.assert_identical(np.arange(10, dtype=np.float32), "constants")
        comm.barrier()
    with open(os.path.join(d, f"result_{comm.rank}.txt"), "w") as f:
        f.write(f"{comm.rank} {comm.world_size} {comm.local_rank} {comm.local_world_size}\n")


def _zero_round(comm, it, n):
    """reduce_scatter_mean then all_gather of rank_data(rank, it, n), the buffer cut into 2P
    interleaved ranges (range j owned by rank j % P, as selftest.py's check); outside its own
    ranges each rank's buffer holds -rank-1 before the all-gather, so a range it missed shows."""
    from llmctl.distributed.selftest import rank_data

    P, r = comm.world_size, comm.rank
    cuts = [j * n // (2 * P) for j in range(2 * P + 1)]
    shards = [[(cuts[j], cuts[j + 1]) for j in range(2 * P) if j % P == q] for q in range(P)]
    buf = rank_data(r, it, n)
    comm.reduce_scatter_mean(buf, shards)
    params = np.full(n, np.float32(-r - 1))
    for lo, hi in shards[r]:
        params[lo:hi] = buf[lo:hi]
    comm.all_gather(params, shards, scratch=buf)
    return params
