"""The interface between the training loop and a communication backend.

A backend owns process-group membership (rank, world_size), the threads each rank may use and
the collectives over flat float32 NumPy buffers; the defaults here fit the world of one.
`SingleProcessComm` is that world; shm (one host), ring (TCP across hosts), hier (shm + ring)
and mpi backends implement the same methods.
"""
import numpy as np


class Comm:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    # Set by the training loop each step; backends report it in heartbeats and error messages.
    step: int = -1
    # Becomes True on every rank at the same collective when the launcher asks the job to stop
    # (Ctrl-C): the loop checks it after the gradient all-reduce, checkpoints and returns.
    stop_requested: bool = False
    # Kernel threads each rank uses (the launcher splits the host's cores); None: the process's
    # default (--threads, else OMP_NUM_THREADS or all cores).
    n_threads = None
    # True when shared_buffer() hands out memory that all_reduce_mean reduces in place (shm):
    # the training loop then keeps its gradients there.
    shares_memory: bool = False

    def all_reduce_mean(self, buf: np.ndarray) -> None:
        """Replace buf (1-D, contiguous float32) on every rank with the element-wise mean over ranks."""
        raise NotImplementedError

    # True when the backend implements reduce_scatter_mean and all_gather (ZeRO-1, -z 1)
    supports_zero: bool = False

    def reduce_scatter_mean(self, buf: np.ndarray, shards) -> None:
        """shards[r]: the (lo, hi) ranges of buf that rank r owns (disjoint, together all of buf,
        the same list on every rank). Afterwards this rank's ranges of buf hold the element-wise
        mean over ranks; the rest of buf is unspecified (ZeRO-1's gradient reduce-scatter)."""
        raise NotImplementedError

    def all_gather(self, buf: np.ndarray, shards, scratch=None) -> None:
        """shards as in reduce_scatter_mean: every rank's ranges of buf are copied from the rank
        that owns them into buf on every rank (ZeRO-1's parameter all-gather). scratch: a buffer
        of the same size whose contents the caller no longer needs (the gradients after
        AdamW), which a backend may overwrite as staging; None: none."""
        raise NotImplementedError

    def all_reduce_sum_scalar(self, x: float) -> float:
        """Sum of one float over ranks (losses, correct counts)."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        """Copy root's buf into buf on every rank."""
        raise NotImplementedError

    def shared_buffer(self, n: int) -> np.ndarray:
        """n zeroed float32 for this rank's gradient buffer. A backend with shared memory returns
        its row of a shared segment (shares_memory = True); this default is private memory."""
        return np.zeros(n, dtype=np.float32)

    def is_shared(self, buf: np.ndarray) -> bool:
        """Whether buf is (the start of) this rank's shared_buffer row, which all_reduce_mean then
        reduces in place; private memory is never shared here."""
        return False

    def watch(self, buf: np.ndarray, what: str = "buffer") -> None:
        """Check buf with assert_identical before every scalar collective (a debug mode; each
        call adds a buffer); the world of one has nothing to compare."""

    def close(self) -> None:
        pass

    def assert_identical(self, buf: np.ndarray, what: str = "buffer") -> None:
        """Raise DistError unless buf has the same bytes on every rank (a debug check)."""
        raise NotImplementedError

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class SingleProcessComm(Comm):
    """The world of one process: every collective is the identity."""

    def all_reduce_mean(self, buf):
        pass

    supports_zero = True

    def reduce_scatter_mean(self, buf, shards):
        pass

    def all_gather(self, buf, shards, scratch=None):
        pass

    def all_reduce_sum_scalar(self, x):
        return float(x)

    def barrier(self):
        pass

    def assert_identical(self, buf, what="buffer"):
        pass

    def broadcast(self, buf, root=0):
        if root != 0:
            raise ValueError(f"root {root} does not exist in a world of size 1")
