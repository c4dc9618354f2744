"""Tests for the MPI backend (issue 6): `mpiexec -n 2` runs of the Comm collectives
and of `llmctl train --backend auto` (which must pick mpi under mpiexec), compared with the
float64 mean and with one process accumulating gradients over the same tokens.

Needs mpi4py and an mpiexec (`pip install 'llmctl[mpi]'` installs both: mpi4py + the MPICH
wheel, which runs as root). Skipped, with that reason, only when mpi4py is not importable.
"""
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install 'llmctl[mpi]'")

from llmctl.distributed.selftest import rank_data  # noqa: E402
from tinyrun import (OVERFIT_TOKENS, assert_bf16_backend_matches_shm_and_one_process,
                     assert_overfit_losses_match, bf16_env, overfit_args, tiny_train_args,
                     write_tiny_run)

U32 = 2.0 ** -24


def _mpiexec():
    # the MPICH wheel puts mpiexec next to this interpreter's scripts
    for d in (os.path.dirname(sys.executable), sysconfig.get_path("scripts")):
        p = shutil.which("mpiexec", path=d)
        if p:
            return p
    p = shutil.which("mpiexec")
    if p is None:
        pytest.fail("mpi4py is installed but no mpiexec was found (pip install mpich)")
    return p


def _unused_mpich_segments():
    """/dev/shm/mpich_shm_* files no live process maps: left behind (a concurrently running MPI
    job's own segment is mapped by its ranks and so is not counted)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(ln.split(None, 5)[5].strip() for ln in f if ln.count(" ") >= 5
                              and "/dev/shm/mpich_shm_" in ln)
        except (OSError, IndexError):
            continue  # the process ended
    return set(glob.glob("/dev/shm/mpich_shm_*")) - mapped


@pytest.fixture(autouse=True)
def no_mpich_shm_leak():
    """Every test: no new MPICH shared-memory file may remain in /dev/shm afterwards. A test
    that aborts its job on purpose sets ["deliberate_abort"]."""
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    state = {"deliberate_abort": False}
    yield state
    leaked = sorted(_unused_mpich_segments() - before)
    if state["deliberate_abort"]:
        # Only on this path: MPI_Abort skips MPI_Finalize, where MPICH unlinks its segment, and
        # mpiexec kills the other ranks. MpiComm.abort() removes it first (asserted below); if
        # that ever fails, remove what MPICH left here rather than fill /dev/shm run after run.
        for path in leaked:
            with contextlib.suppress(OSError):
                os.unlink(path)
    assert not leaked, f"MPICH shared memory left in /dev/shm: {leaked}"


def _run(n, argv, timeout=120, env=None):
    return subprocess.run([_mpiexec(), "-n", str(n), *argv], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                          stdin=subprocess.DEVNULL)


_COLL = """
import json, sys
from llmctl.distributed.mpi import MpiComm
from llmctl.distributed.hier import check_collectives
a = json.loads(sys.argv[1])
comm = MpiComm()
check_collectives(a, comm)
"""


def test_mpi_collectives_mean_and_identical_bits(tmp_path):
    sizes = [0, 1, 3, 10007, 1_000_003]
    r = _run(2, [sys.executable, "-c", _COLL, json.dumps({"dir": str(tmp_path), "sizes": sizes,
                                                          "iters": 2})])
    assert r.returncode == 0, r.stderr
    for it in range(2):
        for n in sizes:
            a, b = (np.load(tmp_path / f"{k}_{it}_{n}.npy") for k in range(2))
            assert a.tobytes() == b.tobytes()  # every rank must hold the same bits
            xs = np.stack([rank_data(k, it, n) for k in range(2)]).astype(np.float64)
            ref = xs.mean(0)
            # two float32 terms: one rounding in the sum, one in the division (exact for /2)
            np.testing.assert_array_less(np.abs(a - ref), 2 * U32 * np.abs(xs).sum(0) + 1e-30)
    assert (tmp_path / "result_1.txt").read_text().split() == ["1", "2", "1", "2"]


B, T = 2, 8


def test_mpiexec_train_equals_gradient_accumulation(tmp_path):
    """`mpiexec -n 2 llmctl train --backend auto` (-> mpi) vs 1 process with -d 2*B*T on a
    one-sample shard (same tokens; see tests/test_dist.py). Same tolerance argument as there:
    only fp32 summation order differs, ~1e-7 relative, so losses to 1e-6 relative and
    parameters to 1e-6 absolute (1/1000 of one lr=1e-3 step), with training moving them ~1000x
    more; parameters are compared across ranks bit-for-bit every step (CHECK_PARAMS)."""
    d = write_tiny_run(tmp_path, 2 * B * T + 6)

    def args(out, *extra):
        return tiny_train_args(d, out, B, T, "-x", "6", "-n", "6", *extra)

    r1 = subprocess.run([sys.executable, "-m", "llmctl.cli", *args("p1", "-d", str(2 * B * T))],
                        capture_output=True, text=True, timeout=120)
    assert r1.returncode == 0, r1.stderr
    r2 = _run(2, [sys.executable, "-m", "llmctl.cli", *args("p2", "--backend", "auto")],
              env={"LLMCTL_DIST_CHECK_PARAMS": "1"})
    assert r2.returncode == 0, r2.stderr

    def losses(out):
        with open(d / out / "metrics.jsonl") as f:
            return [json.loads(ln)["train_loss"] for ln in f if "train_loss" in ln]

    def params(path):
        return np.fromfile(path, dtype=np.float32)[256:]

    l1, l2 = losses("p1"), losses("p2")
    assert len(l1) == len(l2) == 6
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    p0, p1, p2 = params(d / "init.bin"), params(d / "p1/model_00000006.bin"), params(d / "p2/model_00000006.bin")
    np.testing.assert_allclose(p2, p1, rtol=0, atol=1e-6)
    assert np.abs(p1 - p0).max() > 1e-3
    assert sorted(os.listdir(d / "p2")) == ["DONE_00000006", "main.log", "metrics.jsonl",
                                            "model_00000006.bin", "state_00000006_00000.bin",
                                            "state_00000006_00001.bin"]


def test_mpiexec_bf16_equals_shm_and_gradient_accumulation(tmp_path):
    """`mpiexec -n 2 llmctl train --backend mpi --precision bf16` vs the same 2 ranks over shared
    memory (--nproc 2) and vs 1 process with -d 2*B*T, on the one-sample shard (same tokens).
    MPI vs shm: with 2 ranks MPI_SUM is one fp32 addition (commutative bit for bit) and the
    halving is exact, so both runs must agree to the bit. vs 1 process: only the fp32 summation
    order of the gradients differs, as in fp32 (the bf16 roundings are per element and the
    1-process loss scale 1/2 is exact); tests/test_ring.py's bf16 test argues the 1e-6 bounds.
    Every rank's fp32 parameters and bf16 copy are compared bit-for-bit every step."""
    d = write_tiny_run(tmp_path, 2 * B * T + 6)
    env = bf16_env()

    def args(out, *extra):
        return tiny_train_args(d, out, B, T, "-x", "6", "-n", "6", "--precision", "bf16", *extra)

    r = _run(2, [sys.executable, "-m", "llmctl.cli", *args("mpi", "--backend", "mpi")],
             env=dict(env, LLMCTL_DIST_CHECK_PARAMS="1"))
    assert r.returncode == 0, r.stderr
    for out, extra, e in (("shm", ("--nproc", "2", "--backend", "shm"), dict(env, LLMCTL_DIST_CHECK_PARAMS="1")),
                          ("one", ("-d", str(2 * B * T)), env)):
        r = subprocess.run([sys.executable, "-m", "llmctl.cli", *args(out, *extra)], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, **e))
        assert r.returncode == 0, r.stderr

    assert_bf16_backend_matches_shm_and_one_process(d, "mpi")


def test_overfit_mpiexec_2_trains_on_the_tokens_of_1_process(tmp_path):
    """-a 1 as train_gpt2.cu: `mpiexec -n 2 llmctl train --backend mpi -a 1 -d 512` trains on
    exactly the tokens of one process with the same -d."""
    d = write_tiny_run(tmp_path, 2 * B * T + 6, val_tokens=OVERFIT_TOKENS + 1)
    r1 = subprocess.run([sys.executable, "-m", "llmctl.cli", *overfit_args(d, "p1", B, T)],
                        capture_output=True, text=True, timeout=120)
    assert r1.returncode == 0, r1.stderr
    r2 = _run(2, [sys.executable, "-m", "llmctl.cli", *overfit_args(d, "p2", B, T, "--backend", "mpi")])
    assert r2.returncode == 0, r2.stderr
    assert_overfit_losses_match(d / "p1", d / "p2")


def test_mpi_rank_error_aborts_the_whole_job(tmp_path, no_mpich_shm_leak):
    """Rank 1 fails alone while rank 0 waits in a collective: resuming a 2-rank checkpoint whose
    rank-1 state file is gone, rank 1's FormatError comes before its first collective and rank 0
    resumes and trains into the first Allreduce. Rank 1 prints one line and calls MPI_Abort, so
    mpiexec ends the whole job (exit != 0) instead of leaving rank 0 hanging (the 300 s ceiling
    is only there to end a hang), and MPICH's /dev/shm segment is gone (checked by the fixture)."""
    no_mpich_shm_leak["deliberate_abort"] = True
    d = write_tiny_run(tmp_path, 4 * B * T + 6)
    r = _run(2, [sys.executable, "-m", "llmctl.cli",
                 *tiny_train_args(d, "run", B, T, "-x", "2", "-n", "2", "--backend", "mpi")])
    assert r.returncode == 0, r.stderr
    (d / "run" / "state_00000002_00001.bin").unlink()
    r = _run(2, [sys.executable, "-m", "llmctl.cli",
                 *tiny_train_args(d, "run", B, T, "-x", "4", "-n", "2", "-y", "1", "--backend", "mpi")],
             timeout=300)
    assert r.returncode != 0
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: rank 1: ")]
    assert len(line) == 1 and "state_00000002_00001.bin" in line[0], r.stderr
    assert "Error: rank 0" not in r.stderr  # rank 0 had nothing wrong: it was waiting
