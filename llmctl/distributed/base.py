"""The interface between the training loop and a communication backend.

A backend owns process-group membership (rank, world_size) and three collectives over flat
float32 NumPy buffers. `SingleProcessComm` is the world of one; shm (one host), ring (TCP across
hosts) and mpi backends implement the same methods.
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

    def all_reduce_mean(self, buf: np.ndarray) -> None:
        """Replace buf (1-D, contiguous float32) on every rank with the element-wise mean over ranks."""
        raise NotImplementedError

    def all_reduce_sum_scalar(self, x: float) -> float:
        """Sum of one float over ranks (losses, correct counts)."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        """Copy root's buf into buf on every rank."""
        raise NotImplementedError

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

    def all_reduce_sum_scalar(self, x):
        return float(x)

    def barrier(self):
        pass

    def assert_identical(self, buf, what="buffer"):
        pass

    def broadcast(self, buf, root=0):
        if root != 0:
            raise ValueError(f"root {root} does not exist in a world of size 1")
