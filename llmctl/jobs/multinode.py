"""One host's part of a job across hosts: its launcher, and each rank's join of the cross-host ring.

What it is: `launch_multinode(...)`, the node launcher: `launch` (llmctl/jobs/launcher.py) starts
the N local ranks with their control hub; each rank then runs `run_entry`, which joins the
cross-host rendezvous (llmctl/distributed/rendezvous.py), builds its HierComm
(llmctl/distributed/hier.py) and calls the real target. `llmctl train --nnodes K` gets here
through llmctl/jobs/run.py's `run_train`.

Faults: a ring error on any rank is reported to its node's hub, the launcher kills that node's
ranks, their ring sockets close, and every other node's ranks fail within a few hops, each
launcher exiting 1 with a message naming the peer's rank, host and address.

What it is not: the hierarchical all-reduce itself (HierComm) or a transport.
"""
import os

from llmctl.distributed.hier import HierComm
from llmctl.errors import DistError, LlmctlError
from llmctl.interrupt import EXIT_CODE

_SECRET_VAR = "LLMCTL_RING_KEY"


def run_entry(args, shm):
    """Launcher target on each node: join the cross-host ring, then call args["target"]."""
    from llmctl.distributed.ring import init_ring
    from llmctl.jobs.launcher import stderr_log
    from llmctl.jobs.worker import import_target

    node = args["node"]
    key = os.environ.pop(_SECRET_VAR, None)
    if not key:
        raise DistError(f"{_SECRET_VAR} is missing: this target is started by launch_multinode")
    lw = shm.world_size
    rank = node["node_rank"] * lw + shm.rank
    ring = init_ring(rank, node["nnodes"] * lw, master_addr=node["master_addr"],
                     master_port=node["master_port"], bind_addr=node["bind_addr"],
                     secret=bytes.fromhex(key), timeout=shm.timeout,
                     collective_timeout=shm.collective_timeout, rdzv_timeout=node["rdzv_timeout"],
                     ring_key=shm.rank, node=node["node_rank"], local_rank=shm.rank,
                     local_world_size=lw, label=f"rank {rank} (node {node['node_rank']})", log=stderr_log,
                     failure_hint=args.get("ring_hint"))
    comm = HierComm(shm, ring, node["node_rank"], node["nnodes"])
    try:
        return import_target(args["target"])(args["args"], comm)
    except LlmctlError as e:
        if e.exit_code == EXIT_CODE and comm.stop_requested:
            shm.stop_requested = True  # a stop agreed by every node: not a failure (worker.py)
        raise
    finally:
        comm.close()


def launch_multinode(target, args, nproc, node, secret, *, threads=None, timeout=30.0,
                     collective_timeout=None, rdzv_timeout=300.0, log=None, grace=3.0,
                     failure_hint=None, stop_note=None, ring_hint=None):
    """Run `target(args, comm)` in `nproc` ranks on this node of a `node.nnodes`-node job.

    node: a rendezvous.NodeEnv; secret: 32 key bytes (rendezvous.resolve_secret()), handed to
    the ranks through their environment; failure_hint, stop_note: as for launch(); ring_hint:
    the hint of a failed collective on the cross-host ring (RingComm's failure_hint). Returns
    launch()'s info (rank 0's result on node 0).
    """
    from llmctl.distributed.rendezvous import check_seconds
    from llmctl.jobs.launcher import launch

    rdzv_timeout = check_seconds("--rdzv-timeout", rdzv_timeout)
    check_seconds("--dist-timeout", timeout)
    wrapped = {"node": {"nnodes": node.nnodes, "node_rank": node.node_rank,
                        "master_addr": node.master_addr, "master_port": node.master_port,
                        "bind_addr": node.bind_addr, "rdzv_timeout": float(rdzv_timeout)},
               "target": target, "args": args, "ring_hint": ring_hint}
    return launch("llmctl.jobs.multinode:run_entry", wrapped, nproc, threads=threads, timeout=timeout,
                  collective_timeout=collective_timeout, log=log, grace=grace,
                  extra_env={_SECRET_VAR: secret.hex()}, failure_hint=failure_hint,
                  stop_note=stop_note)
