"""ZeRO stage 1 (`llmctl train -z 1`): each rank keeps and updates the AdamW state of 1/P of the
parameters, as llm.c's train_gpt2.cu does with `-z 1`.

What it is: `shard_layout(config, P)`, llm.c's shard boundaries (llmc/zero.cuh
`multi_gpu_get_shard_offset` as `gpt2_update` calls it): every parameter tensor, and every layer's
slice of a per-layer tensor, is cut into P equal pieces and rank r owns piece r of each. Its m/v
shard holds those pieces back to back in checkpoint order (tensor, then layer): m/v offset of
tensor i = offset_i / P, layer l at + l * piece, so `state_%08d_%05d.bin` holds N/P floats of m and
of v per rank exactly as llm.c writes them. There is no padding: llm.c exits when a tensor's
(per-layer) size is not a multiple of P, and silently runs ZeRO-0 when the total is not; llmctl
refuses both with one error. `Zero1` runs one step's communication and update:
reduce-scatter of the gradients (Comm.reduce_scatter_mean: this rank's pieces hold the mean),
the gradient norm as the sum over ranks of each rank's squared norm of its pieces (exact: every
piece of the buffer is counted once), AdamW on the pieces (GPT2.update_shard, which also writes
their bf16 copy), and the all-gather of the updated parameters (Comm.all_gather) after which
the bf16 copy of the other ranks' pieces is re-cast here, so every rank holds the same bits.
What it is not: a transport (the backends implement the two collectives), ZeRO-2/3 (the
gradients stay whole on every rank, as in llm.c's stage 1).
"""
import math

import numpy as np

from llmctl.errors import ConfigError
from llmctl.model.config import param_shapes

LAYERED = slice(2, 14)   # llm.c gpt2_update: tensors 2..13 have one slice per layer


def shard_layout(config, P):
    """[[(lo, hi, m_off, name)] per rank]: rank r's pieces of the flat parameter buffer, in the
    order of its m/v shard (m_off: where the piece starts in that shard). ConfigError when a
    tensor's per-layer size is not a multiple of P (llm.c: "Number of elements %zu must be a
    multiple of the number of processes %d")."""
    shapes = param_shapes(config)
    layered = {name for name, _ in shapes[LAYERED]}
    layout = [[] for _ in range(P)]
    off = 0
    for name, shape in shapes:
        n = math.prod(shape)
        nl = shape[0] if name in layered else 1
        size = n // nl
        if size % P:
            raise ConfigError(f"-z 1 with {P} processes: tensor {name} has {size} elements"
                              f"{' per layer' if nl > 1 else ''}, not a multiple of {P}; ZeRO-1 "
                              "cuts every tensor into equal shards (llm.c: \"Number of elements "
                              "must be a multiple of the number of processes\")",
                              hint=f"use a number of processes that divides {size}, or -z 0")
        piece = size // P
        for r in range(P):
            for l in range(nl):
                lo = off + l * size + r * piece
                layout[r].append((lo, lo + piece, off // P + l * piece, name))
        off += n
    return layout


class Zero1:
    """One rank's ZeRO-1 optimizer state (m, v: N/P floats each) and its step."""

    def __init__(self, model, comm):
        self.model, self.comm = model, comm
        self.P, self.rank = comm.world_size, comm.rank
        self.layout = shard_layout(model.config, self.P)
        self.mine = self.layout[self.rank]
        self.ranges = [[(lo, hi) for lo, hi, _, _ in pieces] for pieces in self.layout]
        self.shard_size = model.num_parameters // self.P
        self.m = None
        self.v = None
        self.comm_ms = 0.0
        self.adamw_ms = 0.0

    def state(self):
        """(m, v) of this rank's shard, zeros before the first update (for checkpoints)."""
        n = self.shard_size
        return (self.m if self.m is not None else np.zeros(n, np.float32),
                self.v if self.v is not None else np.zeros(n, np.float32))

    def load_state(self, m, v):
        self.m = np.array(m, dtype=np.float32)
        self.v = np.array(v, dtype=np.float32)

    def reduce_grads(self):
        """Reduce-scatter: this rank's pieces of model.grads become the mean over ranks (the
        other pieces are left as they are and must not be read)."""
        self.comm.reduce_scatter_mean(self.model.grads, self.ranges)

    def grad_norm(self):
        """The global L2 norm of the mean gradients: each rank's squared norm of its pieces
        (float64), summed over ranks in a fixed order (the same value on every rank)."""
        from llmctl._ext import adamw

        g, nt = self.model.grads, self.model.n_threads
        mine = sum(adamw.global_norm_sq(g[lo:hi], nt) for lo, hi, _, _ in self.mine)
        return math.sqrt(max(self.comm.all_reduce_sum_scalar(mine), 0.0))

    def update(self, lr, beta1, beta2, eps, weight_decay, grad_scale, step):
        """AdamW on this rank's pieces, then the all-gather of the parameters (and the bf16
        copy of the other ranks' pieces re-cast from them)."""
        import time

        model = self.model
        if self.m is None:
            self.m = np.zeros(self.shard_size, np.float32)
            self.v = np.zeros(self.shard_size, np.float32)
        t0 = time.perf_counter()
        model.update_shard(self.mine, self.m, self.v, lr, beta1, beta2, eps, weight_decay,
                           grad_scale, step)
        t1 = time.perf_counter()
        # the gradients are spent once AdamW has read them: the all-gather may stage in them
        # (zero_grad clears them before the next backward, or in bf16 marks them for it to overwrite)
        self.comm.all_gather(model.params, self.ranges, scratch=model.grads)
        others = [(lo, hi) for r, rr in enumerate(self.ranges) if r != self.rank for lo, hi in rr]
        model.params_gathered(others)
        self.adamw_ms = (t1 - t0) * 1000.0
        self.comm_ms = (time.perf_counter() - t1) * 1000.0
