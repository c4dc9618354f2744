"""Start N ranks on this host, run their control hub, and make sure none outlives a failure.

What it is: `launch(target, args, nproc, ...)` spawns N `llmctl.jobs.worker`
processes (rank 0..N-1, threads per rank = cores // N unless given), serves their
authenticated control hub (llmctl/distributed/control.py) from its own single-threaded select loop,
and watches them. The first failure -- a rank that exits non-zero or is killed by a signal,
sends no heartbeat for `timeout` s (hung or SIGSTOPped), does not reach a collective within
`collective_timeout` s, reports an error, or misbehaves on the control channel -- aborts the
job: the others are told, then SIGTERM'd and SIGKILL'd (each rank is its own process group,
and dies with the launcher through PR_SET_PDEATHSIG), the job's shared memory is swept, and
DistError names the rank and what happened. Ctrl-C (SIGINT) asks every rank to stop at the
same collective (Comm.stop_requested) so the target can finish cleanly; a second Ctrl-C
or no progress within the grace period kills them. Returns normally only if every rank
exited 0; raises KeyboardInterrupt after a requested stop (the CLI exits 130).

What it is not: no multi-host rendezvous (llmctl/distributed/rendezvous.py) and no training
logic: what a failed or stopped job means for the work (a checkpoint to resume from) is the
caller's `failure_hint` / `stop_note`. It is the role
torchrun / mpirun play for llm.c, for one host.
"""
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from llmctl.distributed.control import Hub, bind_listener
from llmctl.distributed.env import threads_per_rank
from llmctl.distributed.shm import SHM_DIR, sweep_segments
from llmctl.errors import ConfigError, DistError
from llmctl.interrupt import StopRequest

_PR_SET_PDEATHSIG = 1
STOPPED_HINT = "every rank was stopped"
try:  # loaded before any fork so the child's preexec_fn does no dlopen
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _child_setup(parent_pid):
    def setup():
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)
    return setup


def _describe_exit(rc):
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def stderr_log(msg):
    sys.stderr.write(f"llmctl dist: {msg}\n")
    sys.stderr.flush()


def _worker_command():
    """argv for one rank, importing the same llmctl this launcher runs.

    `python -m llmctl.jobs.worker` would put the working directory first on sys.path, so a run
    started from a source checkout (next to an installed llmctl) would import the unbuilt tree.
    """
    import llmctl

    root = os.path.dirname(os.path.dirname(os.path.abspath(llmctl.__file__)))
    code = ("import sys; sys.path[0] = %r; from llmctl.jobs.worker import main; sys.exit(main())" % root)
    return [sys.executable, "-c", code]


def launch(target, args, nproc, *, threads=None, timeout=30.0, collective_timeout=None,
           master_addr="127.0.0.1", master_port=0, grace=3.0, log=None, extra_env=None,
           shm_dir=SHM_DIR, failure_hint=None, stop_note=None):
    """Run `target(args, comm)` ("package.module:function") in `nproc` ranks; see the module doc.

    args must be JSON-serialisable. failure_hint: the hint of a crash, hang or protocol failure
    (default: every rank was stopped); stop_note: what the ranks do when a Ctrl-C asks them to
    stop, said in the log line (e.g. "checkpointing if -o is set"). Returns {"nproc", "threads",
    "seconds", "result"}, where result is rank 0's return value if JSON-serialisable (else None).
    Raises DistError naming the failed rank, ConfigError for bad arguments, KeyboardInterrupt
    after a Ctrl-C stop.
    """
    nproc, timeout, collective_timeout = _check_arguments(nproc, timeout, collective_timeout)
    log = log or stderr_log
    threads = threads_per_rank(nproc, threads)
    body = _as_json(args)
    _sweep_stale(shm_dir, log)

    listener = bind_listener(master_addr, int(master_port))
    secret = secrets.token_bytes(32)
    job = secrets.token_hex(6)
    me = os.getpid()
    tmpdir = tempfile.mkdtemp(prefix=f"llmctl-job-{job}-")
    procs, pidfds, hub = [], [], None
    state = {}
    signals = StopRequest(second_raises=False, catch_sigterm=True)  # counted; _run decides
    t_start = time.monotonic()
    try:
        args_path = _write_private(os.path.join(tmpdir, "args.json"), body)
        signals.install()
        env = _job_env(extra_env, nproc=nproc, addr=master_addr, port=listener.getsockname()[1],
                       secret=secret, job=job, me=me, timeout=timeout,
                       collective_timeout=collective_timeout, threads=threads, target=target,
                       args_path=args_path)
        _spawn(procs, nproc, env, me)
        names = {r: f"rank {r} (pid {p.pid})" for r, p in enumerate(procs)}
        hub = Hub(listener, secret, nproc, timeout, collective_timeout, max(60.0, 2 * timeout),
                  log, names)
        listener = None  # the hub owns and closes it
        pidfds = _watch_exits(hub, procs)

        failure = _run(hub, procs, state, signals, log, timeout, stop_note)
        if failure is not None:
            _shutdown(hub, procs, failure, grace)
            raise _failure_error(failure, hub, state, failure_hint)
        if signals.requested:
            raise KeyboardInterrupt
        return {"nproc": nproc, "threads": threads, "seconds": time.monotonic() - t_start,
                "result": _read_result(os.path.join(tmpdir, "result.json"))}
    finally:
        _reap(procs)
        for closable in (hub, listener):  # the hub closes the listener it took over
            if closable is not None:
                closable.close()
        for fd in pidfds:
            os.close(fd)
        sweep_segments(shm_dir, job=job, launcher_pid=me)
        shutil.rmtree(tmpdir, ignore_errors=True)
        signals.restore()  # last: a Ctrl-C during the clean-up only counts


def _check_arguments(nproc, timeout, collective_timeout):
    """-> (nproc, timeout, collective_timeout), or ConfigError before anything starts."""
    if int(nproc) < 1:
        raise ConfigError(f"--nproc {nproc} must be >= 1", hint="pass --nproc 1 (the default) or more")
    from llmctl.distributed.rendezvous import check_seconds

    timeout = check_seconds("--dist-timeout", timeout)
    collective_timeout = (check_seconds("collective timeout", collective_timeout) if collective_timeout
                          else max(300.0, 10 * timeout))
    return int(nproc), timeout, collective_timeout


def _as_json(args):
    try:
        return json.dumps(args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"worker arguments are not JSON-serialisable: {e}") from None


def _sweep_stale(shm_dir, log):
    """Remove the segments of launchers that died without cleaning up."""
    stale = sweep_segments(shm_dir)
    if stale:
        log(f"removed {len(stale)} stale shared-memory segment(s) of crashed runs: {', '.join(stale)}")


def _write_private(path, body):
    """Write a new file only this user can read (the job's arguments); -> path."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(body)
    return path


def _job_env(extra_env, *, nproc, addr, port, secret, job, me, timeout, collective_timeout,
             threads, target, args_path):
    """The environment every rank starts with (worker.py reads the LLMCTL_DIST_* variables)."""
    env = dict(os.environ)
    env.update(extra_env or {})
    env.update({
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "LLMCTL_DIST_ADDR": addr, "LLMCTL_DIST_PORT": str(port),
        "LLMCTL_DIST_SECRET": secret.hex(), "LLMCTL_DIST_JOB": job,
        "LLMCTL_DIST_LAUNCHER_PID": str(me), "LLMCTL_DIST_TIMEOUT": str(timeout),
        "LLMCTL_DIST_COLLECTIVE_TIMEOUT": str(collective_timeout),
        "LLMCTL_DIST_THREADS": str(threads), "LLMCTL_DIST_TARGET": target,
        "LLMCTL_DIST_ARGS": args_path,
        "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    })
    _no_spin_when_oversubscribed(env, nproc, threads)
    return env


def _no_spin_when_oversubscribed(env, nproc, threads):
    """Ranks that share cores must not busy-wait for each other's cores: llmctl's spinning
    default (llmctl/__init__.py) becomes libgomp's passive wait; a user's own setting stays."""
    import llmctl
    from llmctl.info import usable_cores

    if llmctl.OPENMP_WAIT == "spin" and nproc * threads > usable_cores():
        env.pop("GOMP_SPINCOUNT", None)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env[llmctl.OPENMP_WAIT_MARK] = "passive"


def _spawn(procs, nproc, env, me):
    """Start ranks 0..nproc-1 into `procs` (so that a failed start still kills the ones started),
    each in its own session, dying with this process."""
    for r in range(nproc):
        procs.append(subprocess.Popen(
            _worker_command(), env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_child_setup(me), close_fds=True))


def _failure_error(failure, hub, state, failure_hint):
    """The exception a failed job ends with: KeyboardInterrupt for a Ctrl-C kill, else DistError
    with the failed rank's own hint (bad input, a bug) or the caller's (a crash, hang or protocol
    failure); a rank's usage error keeps exit code 2."""
    if failure == "interrupted":
        return KeyboardInterrupt()
    if hub.failed_rank is not None:
        err = DistError(failure, hint=hub.failed_hint)
    else:
        err = DistError(failure, hint=failure_hint or STOPPED_HINT)
    if state.get("usage_error"):
        err.exit_code = 2
    return err


def _read_result(path):
    """Rank 0's return value as its worker wrote it, or None."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _reap(procs):
    """Kill the ranks still running and wait for all of them."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _watch_exits(hub, procs):
    """Wake the hub's select when a rank exits (pidfd), so exits are noticed at once."""
    fds = []
    if not hasattr(os, "pidfd_open"):
        return fds
    for p in procs:
        try:
            fd = os.pidfd_open(p.pid)
        except OSError:
            continue
        fds.append(fd)
        hub.sel.register(fd, 1, lambda fd=fd: hub.sel.unregister(fd))  # 1 = EVENT_READ, once
    return fds


def _run(hub, procs, state, signals, log, timeout, stop_note=None):
    """The watch loop: returns None when every rank exited 0, else the failure message.
    signals: the launcher's StopRequest (Ctrl-Cs counted, SIGTERM noted)."""
    exited = {}
    stop_at = None
    while True:
        hub.poll(0.25)
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r in exited:
                continue
            rc = p.poll()
            if rc is None:
                continue
            exited[r] = rc
            if rc == 0:
                hub.finished.add(r)
                continue
            if r not in hub.errors:
                hub.poll(0.05)  # its last words may still be in the socket buffer
            if r in hub.errors:  # prefer the rank's own one-line error over its exit code
                state["usage_error"] = rc == 2
                return hub.failure or f"{hub.name(r)} failed: {hub.errors[r]}"
            return f"{hub.name(r)} {_describe_exit(rc)}{hub.at_step(r, True)}"
        if hub.failure is not None:
            r = hub.failed_rank
            if r is not None:  # it reported an error and is exiting: its exit code says which kind
                try:
                    state["usage_error"] = procs[r].wait(timeout=2.0) == 2
                except subprocess.TimeoutExpired:
                    pass
            return hub.failure
        for r, t_lost in hub.lost.items():
            if r not in exited and now - t_lost > 2.0:
                return f"{hub.name(r)} closed its control connection{hub.at_step(r, True)}"
        if len(exited) == len(procs):
            return None
        if signals.sigterm:
            return "the launcher received SIGTERM"
        if signals.count >= 2:
            log("second interrupt: killing all ranks")
            return "interrupted"
        if signals.count == 1 and stop_at is None:
            stop_at = now
            hub.stop = True
            note = f" ({stop_note})" if stop_note else ""
            log(f"interrupt: asking every rank to stop after its current step{note}; "
                "press Ctrl-C again to kill them")
        if stop_at is not None and now - stop_at > max(60.0, 2 * timeout):
            log("the ranks did not stop in time: killing them")
            return "interrupted"


def _signal_group(p, sig):
    try:
        os.killpg(p.pid, sig)  # each rank leads its own session/process group
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def _shutdown(hub, procs, failure, grace):
    """Tell the ranks, give them `grace` s, then SIGTERM (+SIGCONT for stopped ones), then SIGKILL."""
    hub.abort(failure)
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for p in procs:
                if p.poll() is None:
                    _signal_group(p, sig)
                    if sig == signal.SIGTERM:
                        _signal_group(p, signal.SIGCONT)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        if all(p.poll() is not None for p in procs):
            return
