"""The serial (LLMCTL_NO_OPENMP=1) build: compiles, reports no OpenMP, and the model still matches
the float64 reference (llm.c's NO_OMP=1 CI job).

The kernels are built and loaded by tests/variant_build.py's helpers; a subprocess runs a tiny
forward/backward against tests/reference.py on that build.
"""
import subprocess
import sys
import textwrap

import pytest
from variant_build import REPO, build, env_for

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
    ext_dir = build(tmp_path, {"LLMCTL_NO_OPENMP": "1", "LLMCTL_FAIL_NO_OPENMP": "0"}, exts=EXTS)
    env = env_for(ext_dir)   # the serial build wins over the in-tree one
    r = subprocess.run([sys.executable, "-c", CHECK, str(ext_dir), str(REPO / "tests")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "serial ok" in r.stdout
