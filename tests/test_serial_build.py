"""The serial (LLMCTL_NO_OPENMP=1) build: compiles, reports no OpenMP, and the model still matches
the float64 reference (llm.c's NO_OMP=1 CI job).

The kernels are built from a copy of setup.py + _ext/ in a temp dir (so the shared tree's
generated .c files and .so files are never touched), then a subprocess loads that build
(LLMCTL_EXT_DIR) and runs a tiny forward/backward against tests/reference.py.
"""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXTS = "buildinfo,matmul,layers,attention,adamw"

CHECK = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])                # tests/, for reference.py
    from llmctl._ext import buildinfo, matmul
    assert buildinfo.openmp_enabled() is False, "serial build reports OpenMP"
    assert matmul.__file__.startswith(sys.argv[1]), matmul.__file__
    import reference as R
    from llmctl.model import GPT2, GPT2Config, PARAM_NAMES
    cfg = GPT2Config(16, 100, 128, 2, 4, 32)
    for nt in (1, 2):   # n_threads > 1 must still work (and be serial) without OpenMP
        m = GPT2(cfg, n_threads=nt)
        m.params[:] = R.params_to_flat(R.random_params(cfg, 0, 0.1), cfg)
        pr = R.params_from_flat(m.params, cfg)
        rng = np.random.default_rng(0)
        ids, tg = rng.integers(0, 100, (2, 9)), rng.integers(0, 100, (2, 9))
        m.zero_grad()
        loss = m.forward(ids, tg)
        m.backward()
        rl, _, cache = R.gpt2_forward(pr, ids, tg, cfg)
        g = R.gpt2_backward(pr, cache, cfg)
        assert abs(loss - rl) < 2e-5 * rl, (loss, rl)
        for name in PARAM_NAMES:  # same 2e-5-of-scale tolerance as test_model.py
            err = np.abs(m.g[name] - g[name]).max()
            assert err <= 2e-5 * np.abs(g[name]).max() + 1e-12, (name, err)
    print("serial ok")
""")


@pytest.mark.slow
def test_serial_build_matches_reference(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy2(REPO / "setup.py", src / "setup.py")
    shutil.copytree(REPO / "_ext", src / "_ext", ignore=shutil.ignore_patterns("*.so", "build"))
    build, tmp = tmp_path / "build", tmp_path / "tmp"
    env = dict(os.environ, LLMCTL_NO_OPENMP="1", LLMCTL_EXTS=EXTS, LLMCTL_FAIL_NO_OPENMP="0")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-j", "2", "-b", str(build), "-t", str(tmp)],
                       cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ext_dir = build / "llmctl" / "_ext"
    assert len(list(ext_dir.glob("*.so"))) == len(EXTS.split(",")), list(ext_dir.iterdir())
    env = {k: v for k, v in os.environ.items() if k != "LLMCTL_EXTS"}
    env["LLMCTL_EXT_DIR"] = str(ext_dir)   # the serial build wins over the in-tree one
    r = subprocess.run([sys.executable, "-c", CHECK, str(ext_dir), str(REPO / "tests")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "serial ok" in r.stdout
