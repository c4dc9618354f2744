"""One rank of a `--nproc N` job: `python -m llmctl.jobs.worker`, started only by launcher.py.

What it is: reads its identity and the job's connection details from LLMCTL_DIST_* variables
set by the launcher (the job secret comes through the environment, never argv, and is removed
from os.environ once read), connects and authenticates to the launcher's control hub, builds a
`ShmComm`, imports the target function named "package.module:function" and calls
`function(args, comm)` with the JSON arguments file the launcher wrote. Exit 0 on success;
on failure it reports a one-line message to the hub (the launcher prints it) and exits 1.

What it is not: it never reads a target or arguments from a socket; SIGINT is ignored here
because the launcher turns Ctrl-C into a coordinated stop (Comm.stop_requested).
"""
import importlib
import json
import os
import sys
import traceback

from llmctl.atomic import atomic_write
from llmctl.errors import DistError, LlmctlError
from llmctl.interrupt import EXIT_CODE, ignore_in_child, say

ENV_PREFIX = "LLMCTL_DIST_"


def import_target(spec):
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise DistError(f"bad worker target {spec!r} (expected package.module:function)")
    return getattr(importlib.import_module(mod), fn)


def _write_result(path, result):
    try:
        body = json.dumps(result, default=str)
    except (TypeError, ValueError):
        return
    atomic_write(path, body)


def _report(client, msg, step, hint=None):
    try:
        client.send({"t": "error", "msg": msg[:4000], "hint": (hint or "")[:4000], "step": int(step)})
    except Exception:
        pass


def main():
    ignore_in_child()
    env = os.environ
    try:
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"])
        secret = bytes.fromhex(env.pop(ENV_PREFIX + "SECRET"))
        addr = env[ENV_PREFIX + "ADDR"]
        port = int(env[ENV_PREFIX + "PORT"])
        job = env[ENV_PREFIX + "JOB"]
        launcher_pid = int(env[ENV_PREFIX + "LAUNCHER_PID"])
        timeout = float(env[ENV_PREFIX + "TIMEOUT"])
        coll_timeout = float(env[ENV_PREFIX + "COLLECTIVE_TIMEOUT"])
        threads = int(env[ENV_PREFIX + "THREADS"])
        target = env[ENV_PREFIX + "TARGET"]
        args_path = env[ENV_PREFIX + "ARGS"]
    except (KeyError, ValueError) as e:
        sys.stderr.write(f"llmctl.jobs.worker: missing or bad launcher variable {e}; this module is "
                         "started by `llmctl train --nproc N`, not by hand\n")
        return 2

    from llmctl.distributed.control import ControlClient
    from llmctl.distributed.shm import ShmComm

    try:
        client = ControlClient(addr, port, secret, rank, timeout)
    except LlmctlError as e:
        sys.stderr.write(f"Error: {e.message}\n")
        return 1
    comm = ShmComm(client, rank, world, job, launcher_pid, n_threads=threads, timeout=timeout,
                   collective_timeout=coll_timeout,
                   local_rank=int(env.get("LOCAL_RANK", rank)),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)))
    return _run_target(client, comm, rank, target, args_path)


def _run_target(client, comm, rank, target, args_path):
    """Call the target with the launcher's arguments; -> this rank's exit code (see the module doc)."""
    try:
        fn = import_target(target)
        with open(args_path) as f:
            args = json.load(f)
        result = fn(args, comm)
        if rank == 0 and result is not None:
            _write_result(os.path.join(os.path.dirname(args_path), "result.json"), result)
    except DistError as e:
        if "job aborted" not in e.message:  # an abort's cause is reported by the launcher
            _report(client, e.message, comm.step, e.hint)
        client.close(bye=False)
        return 1
    except LlmctlError as e:
        if e.exit_code == EXIT_CODE and comm.stop_requested:
            # a stop the launcher asked for (Ctrl-C), completed on every rank: not a failure
            if rank == 0:
                say(e.message)
            comm.close()
            return 0
        _report(client, e.message, comm.step, e.hint)
        client.close(bye=False)
        return 2 if e.exit_code == 2 else 1  # usage errors keep exit code 2 through the launcher
    except BaseException as e:  # a bug: keep the traceback for the user, report one line
        traceback.print_exc()
        _report(client, f"{type(e).__name__}: {e} (traceback above)", comm.step)
        client.close(bye=False)
        return 1
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
