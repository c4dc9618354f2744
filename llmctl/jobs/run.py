"""`run_train`: the one entry point of `llmctl train`, in any process layout.

What it is: `run_train(cfg, nproc=..., nnodes=..., backend=..., ...)` picks the layout from the
flags and the environment, and every layout ends in `train_rank(cfg, comm, ...)`, which gives the
rank its thread count and its display and runs llmctl.train's `train` once:
- one process (no flags, no launcher variables): a SingleProcessComm, here;
- `--nproc N` on one host: llmctl's launcher (launcher.py) starts N workers; each worker builds
  its ShmComm (worker.py) and calls `train_entry`;
- `--nnodes K > 1`: the node launcher (multinode.py `launch_multinode`) starts N workers per host; each
  joins the cross-host ring, builds its HierComm and calls `train_entry`;
- one rank of an external launcher (torchrun, srun: RANK/WORLD_SIZE; mpiexec): this process
  builds its comm (one flat ring, or MpiComm) and trains here.
Only rank 0 renders progress; `run_train` returns rank 0's summary where it has it (None on the
launchers of nodes > 0 and on ranks > 0).

The launchers are told what a failed or stopped job means for a training run (the checkpoint
to resume from: llmctl.train's FAILED_JOB_HINT, STOP_NOTE and RING_FAILURE_HINT).

What it is not: a transport (llmctl/distributed/) or process management (launcher.py).
"""
import os
import sys
from dataclasses import asdict

from llmctl.errors import ConfigError, LlmctlError
from llmctl.interrupt import EXIT_CODE

TRAIN_TARGET = "llmctl.jobs.run:train_entry"


def _log(msg):
    sys.stderr.write(f"llmctl dist: {msg}\n")
    sys.stderr.flush()


def _check_params(check_params):
    """None -> the environment's LLMCTL_DIST_CHECK_PARAMS=1 (a debug/test mode)."""
    if check_params is None:
        return os.environ.get("LLMCTL_DIST_CHECK_PARAMS", "") not in ("", "0")
    return bool(check_params)


def train_rank(cfg, comm, *, json_out=False, check_params=False):
    """Run this rank's part of the job on `comm`: its thread count (comm.n_threads, set by the
    launcher, wins over cfg.threads), rank 0's display, then llmctl.train.train."""
    from llmctl.display import Display, make_display
    from llmctl.train import train

    if comm.n_threads is not None:
        cfg.threads = comm.n_threads
    display = make_display(json_out=json_out) if comm.rank == 0 else Display()
    return train(cfg, comm, display, check_params=check_params)


def train_entry(args, comm):
    """The worker target of `--nproc N` and `--nnodes K`: rebuild the TrainConfig, train.
    args: {"config": asdict(cfg), "json_out": bool, "check_params": bool}."""
    from llmctl.train_config import TrainConfig

    return train_rank(TrainConfig(**args["config"]), comm, json_out=args.get("json_out", False),
                      check_params=args.get("check_params", False))


def run_train(cfg, *, nproc=1, nnodes=None, node_rank=None, master_addr=None, master_port=0,
              bind_addr=None, backend="auto", threads=None, timeout=30.0, rdzv_timeout=300.0,
              json_out=False, check_params=None, environ=None):
    """Train `cfg` (a TrainConfig) in the layout the flags and environment ask for.

    nproc: ranks on this host (llm.c -pn); nnodes/node_rank/master_addr/master_port/bind_addr:
    the multi-host job (defaults from NNODES, NODE_RANK, MASTER_ADDR, ... or Slurm); backend:
    auto, shm, ring or mpi; threads: per rank (default: cores // nproc, or cfg.threads);
    timeout: seconds without a heartbeat before a rank counts as dead; rdzv_timeout: seconds to
    wait for every host; check_params (default: LLMCTL_DIST_CHECK_PARAMS=1): verify after every
    step that all ranks hold bit-identical parameters. -> rank 0's summary dict, or None here if
    rank 0 runs elsewhere."""
    from llmctl.distributed.env import resolve_env
    from llmctl.distributed.rendezvous import check_seconds, choose_backend, resolve_node

    env = os.environ if environ is None else environ
    check_params = _check_params(check_params)
    choose_backend(backend, 1, env)  # validates the name before anything else
    timeout = check_seconds("--dist-timeout", timeout)  # before anything is spawned or joined
    rdzv_timeout = check_seconds("--rdzv-timeout", rdzv_timeout)
    if int(nproc) < 1:
        raise ConfigError(f"--nproc {nproc} must be >= 1", hint="pass --nproc 1 (the default) or more")
    launcher_form = int(nproc) > 1 or (nnodes is not None and int(nnodes) > 1)
    if launcher_form and cfg is not None:  # what each rank checks, once here, before any is spawned
        # across hosts P is known only after the rendezvous; P=1 accepts every -d some P accepts
        cfg.validate(int(nproc) if nnodes is None or int(nnodes) == 1 else 1)
    if backend == "mpi" or (backend == "auto" and not launcher_form
                            and choose_backend("auto", 1, env) == "mpi"):
        if launcher_form:
            raise ConfigError("--transport mpi runs one process per rank under mpiexec; drop --nproc/"
                              "--nnodes and use `mpiexec -n N llmctl train --transport mpi`")
        return _train_per_rank(cfg, "mpi", None, json_out, check_params)
    if not launcher_form:
        ident = resolve_env(environ=env)
        if ident.world_size == 1:
            from llmctl.distributed.base import SingleProcessComm

            return train_rank(cfg, SingleProcessComm(), json_out=json_out)
        if backend == "shm":
            raise ConfigError(f"this process is rank {ident.rank} of {ident.world_size} started by "
                              f"{ident.source}, but --transport shm needs llmctl's own launcher",
                              hint="use --transport ring (or auto), or `llmctl train --nproc N`")
        return _train_per_rank(cfg, "ring", dict(master_addr=master_addr, master_port=master_port,
                                                 bind_addr=bind_addr, timeout=timeout,
                                                 rdzv_timeout=rdzv_timeout, environ=env),
                               json_out, check_params)
    node = resolve_node(nnodes, node_rank, master_addr, master_port, bind_addr, environ=env)
    return _launch_ranks(cfg, int(nproc), node, backend, threads or cfg.threads, timeout,
                         rdzv_timeout, master_port, json_out, check_params, env)


def _launch_ranks(cfg, nproc, node, backend, threads, timeout, rdzv_timeout, master_port,
                  json_out, check_params, env):
    """The launcher form: this host's `nproc` ranks, by llmctl's launcher (one host) or its node
    launcher (`node.nnodes` hosts); -> rank 0's summary, or None on the hosts without it."""
    from llmctl.distributed.rendezvous import choose_backend, resolve_secret
    from llmctl.train import FAILED_JOB_HINT, RING_FAILURE_HINT, STOP_NOTE

    args = {"config": asdict(cfg), "json_out": bool(json_out), "check_params": check_params}
    hints = {"failure_hint": FAILED_JOB_HINT, "stop_note": STOP_NOTE}
    if choose_backend(backend, node.nnodes, env) == "shm" or node.nnodes == 1:
        from llmctl.jobs.launcher import launch  # one host

        return launch(TRAIN_TARGET, args, nproc, threads=threads, timeout=timeout,
                      master_port=master_port, **hints)["result"]
    from llmctl.jobs.multinode import launch_multinode

    secret = resolve_secret(env)
    _log(f"node {node.node_rank} of {node.nnodes}: {nproc} rank(s), ring on {node.bind_addr}, "
         f"rendezvous at {node.master_addr}:{node.master_port}")
    return launch_multinode(TRAIN_TARGET, args, nproc, node, secret, threads=threads,
                            timeout=timeout, rdzv_timeout=rdzv_timeout, ring_hint=RING_FAILURE_HINT,
                            **hints)["result"]


def _train_per_rank(cfg, backend, ring_kw, json_out, check_params):
    """This process is one rank (torchrun/srun/mpiexec started it): build the comm, train."""
    from llmctl.distributed.env import threads_per_rank

    if backend == "mpi":
        from llmctl.distributed.mpi import MpiComm

        comm = MpiComm()
    else:
        comm = _flat_ring(**ring_kw)
    if not cfg.threads:  # ranks on one host share its cores, as with --nproc
        cfg.threads = threads_per_rank(comm.local_world_size)
    comm.n_threads = cfg.threads
    try:
        return train_rank(cfg, comm, json_out=json_out, check_params=check_params)
    except BaseException as e:
        stop = isinstance(e, KeyboardInterrupt) or getattr(e, "exit_code", 1) == EXIT_CODE
        if backend == "mpi" and not stop and comm.world_size > 1:
            # the other ranks would wait in the next Allreduce forever: end the MPI job
            if not isinstance(e, LlmctlError):
                import traceback

                traceback.print_exc()
            msg = e.message if isinstance(e, LlmctlError) else f"{type(e).__name__}: {e}"
            sys.stderr.write(f"Error: rank {comm.rank}: {msg}\n")
            sys.stderr.flush()
            comm.abort(getattr(e, "exit_code", 1))
        raise
    finally:
        comm.close()


def _flat_ring(master_addr, master_port, bind_addr, timeout, rdzv_timeout, environ):
    """One ring of every rank (each process its own member), addresses from flags or env."""
    from llmctl.distributed.env import resolve_env
    from llmctl.distributed.rendezvous import (DEFAULT_PORT, local_addr_for, resolve_addr,
                                               resolve_secret)
    from llmctl.distributed.ring import init_ring
    from llmctl.train import RING_FAILURE_HINT

    ident = resolve_env(environ=environ)
    addr = master_addr or environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(master_port or environ.get("MASTER_PORT", DEFAULT_PORT))
    bind = bind_addr or environ.get("LLMCTL_BIND_ADDR") or (
        resolve_addr(addr) if ident.rank == 0 else local_addr_for(addr))
    return init_ring(ident.rank, ident.world_size, master_addr=addr, master_port=port,
                     bind_addr=resolve_addr(bind), secret=resolve_secret(environ), timeout=timeout,
                     rdzv_timeout=rdzv_timeout, local_rank=ident.local_rank,
                     local_world_size=ident.local_world_size, log=_log, failure_hint=RING_FAILURE_HINT)
