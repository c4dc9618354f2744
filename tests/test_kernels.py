"""Kernel tests: matmul (dnnl where built, blas, tiled), encoder, layernorm, GELU, residual, softmax/CE, AdamW.

Every kernel is compared with tests/reference.py (NumPy float64) on shapes that are and are not
multiples of the tiles/lanes/chunks (matmul tile 8x16, K block 256; 16-lane row reductions;
64-channel column chunks), with 1 and 2 threads; backward kernels are also checked against
central finite differences of the kernels' own forward, and determinism is checked bit for bit.

Tolerances. Dot products/sums in float32 obey the classical bound (Higham, "Accuracy and
Stability of Numerical Algorithms", eq. 3.5): |fl(sum) - sum| <= gamma_K * sum|terms| with
gamma_K = K*u/(1-K*u), u = 2^-24, for ANY summation order. `_assert_dot_close` checks exactly
that (times 2 for the final bias/accumulate rounding), so it holds for BLAS and tiled alike but
a wrong or missing term (error ~ one |term|) fails it. Element-wise kernels use a few-ulp
relative bound stated at each test.
"""
import contextlib
import os
import platform
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from errcheck import raises_error

import reference as ref
from llmctl._ext import adamw, convert, layers, matmul

U32 = 2.0 ** -24  # unit roundoff of float32
HERE = os.path.dirname(os.path.abspath(__file__))
THREADS = [1, 2]
# every fp32 engine this build has: "blas" (scipy's BLAS, the fallback) is always tested
# explicitly, whatever the default engine is
ENGINES = list(matmul.get_engines())


@pytest.fixture(autouse=True)
def _all_threads():
    """Kernels run small inputs on fewer threads than asked (results are identical); switch that
    off so that n_threads=2 really runs two threads on these small test shapes."""
    old = [mod.set_parallel_grain(0) for mod in (layers, matmul, adamw)]
    yield
    for mod, g in zip((layers, matmul, adamw), old):
        mod.set_parallel_grain(g)


def _f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _assert_dot_close(got, want, abs_terms, K, what):
    """|got - want| <= 2*gamma_K * abs_terms + tiny, elementwise (abs_terms = sum of |products|)."""
    gamma = (K + 2) * U32 / (1 - (K + 2) * U32)
    bound = 2 * gamma * abs_terms + 1e-30
    err = np.abs(got.astype(np.float64) - want)
    worst = np.max(err / bound)
    assert worst <= 1.0, f"{what}: error {err.max():.3e} exceeds the float32 dot bound ({worst:.2f}x)"


# ---------------------------------------------------------------------------------------------
# matmul

MM_SHAPES = [  # (BT, C, OC): tiny/odd, exact tile multiples, K blocks > 256 on every product
    (1, 1, 1),
    (7, 13, 33),
    (16, 32, 48),
    (9, 300, 17),      # forward K = C = 300 > 256 (two K blocks), odd everything
    (24, 40, 270),     # dinp K = OC = 270 > 256
    (261, 24, 20),     # dweight K = BT = 261 > 256
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape", MM_SHAPES)
@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_forward_matches_reference(engine, shape, n_threads, with_bias):
    BT, C, OC = shape
    rng = np.random.default_rng(BT * 1000 + C + OC)
    inp, w, b = _f32(rng, BT, C), _f32(rng, OC, C), _f32(rng, OC)
    out = np.full(BT * OC, np.nan, dtype=np.float32)  # forward overwrites: NaNs must vanish
    matmul.matmul_forward(out, inp.ravel(), w.ravel(), b if with_bias else None, BT, C, OC,
                          n_threads=n_threads, engine=engine)
    want = ref.matmul_forward(inp.astype(np.float64), w.astype(np.float64),
                              b.astype(np.float64) if with_bias else None)
    terms = np.abs(inp.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    if with_bias:
        terms += np.abs(b)
    _assert_dot_close(out.reshape(BT, OC), want, terms, C, f"matmul_forward[{engine}]")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("shape", MM_SHAPES)
@pytest.mark.parametrize("n_threads", THREADS)
def test_matmul_backward_accumulates_reference(engine, shape, n_threads):
    BT, C, OC = shape
    rng = np.random.default_rng(BT + 7 * C + 13 * OC)
    inp, w, dout = _f32(rng, BT, C), _f32(rng, OC, C), _f32(rng, BT, OC)
    dinp0, dw0, db0 = _f32(rng, BT, C), _f32(rng, OC, C), _f32(rng, OC)  # prior gradients
    dinp, dw, db = dinp0.ravel().copy(), dw0.ravel().copy(), db0.copy()
    matmul.matmul_backward(dinp, dw, db, dout.ravel(), inp.ravel(), w.ravel(), BT, C, OC,
                           n_threads=n_threads, engine=engine)
    d64, x64, w64 = dout.astype(np.float64), inp.astype(np.float64), w.astype(np.float64)
    rdx, rdw, rdb = ref.matmul_backward(d64, x64, w64)
    _assert_dot_close(dinp.reshape(BT, C), dinp0 + rdx, np.abs(dinp0) + np.abs(d64) @ np.abs(w64),
                      OC, f"dinp[{engine}]")
    _assert_dot_close(dw.reshape(OC, C), dw0 + rdw, np.abs(dw0) + np.abs(d64).T @ np.abs(x64),
                      BT, f"dweight[{engine}]")
    _assert_dot_close(db, db0 + rdb, np.abs(db0) + np.abs(d64).sum(0), BT, f"dbias[{engine}]")


@pytest.mark.parametrize("engine", ENGINES)
def test_matmul_backward_skips_none(engine):
    BT, C, OC = 10, 20, 30
    rng = np.random.default_rng(3)
    inp, w, dout = _f32(rng, BT * C), _f32(rng, OC * C), _f32(rng, BT * OC)
    dw = np.zeros(OC * C, np.float32)
    matmul.matmul_backward(None, dw, None, dout, inp, w, BT, C, OC, engine=engine)
    want = dout.reshape(BT, OC).astype(np.float64).T @ inp.reshape(BT, C)
    np.testing.assert_allclose(dw.reshape(OC, C), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n_threads", THREADS)
def test_matmul_backward_split_in_two_calls_gives_the_same_bits(engine, n_threads):
    # the model's fp32 backward that recomputes the GELU asks for d(inp) and d(bias) first and
    # d(weight) after the GELU pass: each product alone, the bits of the call that makes all three
    BT, C, OC = 37, 70, 90
    rng = np.random.default_rng(12)
    inp, w, dout = _f32(rng, BT * C), _f32(rng, OC * C), _f32(rng, BT * OC)
    dinp0, dw0, db0 = _f32(rng, BT * C), _f32(rng, OC * C), _f32(rng, OC)
    one = [dinp0.copy(), dw0.copy(), db0.copy()]
    matmul.matmul_backward(*one, dout, inp, w, BT, C, OC, n_threads=n_threads, engine=engine)
    two = [dinp0.copy(), dw0.copy(), db0.copy()]
    matmul.matmul_backward(two[0], None, two[2], dout, inp, w, BT, C, OC, n_threads=n_threads, engine=engine)
    assert two[1].tobytes() == dw0.tobytes()   # no d(weight) asked, none written
    matmul.matmul_backward(None, two[1], None, dout, inp, w, BT, C, OC, n_threads=n_threads, engine=engine)
    for a, b, name in zip(one, two, ("dinp", "dweight", "dbias")):
        assert a.tobytes() == b.tobytes(), name
    with pytest.raises(ValueError, match="dweight has 5 elements"):
        matmul.matmul_backward(None, np.zeros(5, np.float32), None, dout, inp, w, BT, C, OC, engine=engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n_threads", THREADS)
def test_matmul_bit_identical_when_repeated(engine, n_threads):
    BT, C, OC = 37, 70, 90
    rng = np.random.default_rng(11)
    inp, w, b, dout = _f32(rng, BT * C), _f32(rng, OC * C), _f32(rng, OC), _f32(rng, BT * OC)
    runs = []
    for _ in range(2):
        out = np.empty(BT * OC, np.float32)
        matmul.matmul_forward(out, inp, w, b, BT, C, OC, n_threads=n_threads, engine=engine)
        dinp, dw, db = np.zeros(BT * C, np.float32), np.zeros(OC * C, np.float32), np.zeros(OC, np.float32)
        matmul.matmul_backward(dinp, dw, db, dout, inp, w, BT, C, OC, n_threads=n_threads, engine=engine)
        runs.append((out, dinp, dw, db))
    for a, b2 in zip(*runs):
        assert np.array_equal(a, b2)


@pytest.mark.skipif("dnnl" not in matmul.get_engines(), reason="built without oneDNN")
@pytest.mark.parametrize("shape", [(128, 300, 70), (261, 96, 33), (200, 3072, 40), (130, 24, 20)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_dnnl_forward_split_rows_gives_the_bits_of_one_call(shape, with_bias):
    # the fp32 forward cuts its rows into a block a thread (64 rows or more each), each block a
    # single-threaded sgemm: every output row must be the bits of one single-threaded call over
    # all the rows, whatever the thread count and however the rows fall into blocks. Where
    # oneDNN's sgemm is not AVX-512 (a row's bits there depend on the call's row count) the
    # forward must not split at all: the bits of oneDNN's own threaded call
    BT, C, OC = shape
    rng = np.random.default_rng(BT + C + OC)
    inp, w, b = _f32(rng, BT * C), _f32(rng, OC * C), _f32(rng, OC)
    bias = b if with_bias else None

    def forward(n):
        out = np.full(BT * OC, np.nan, np.float32)
        matmul.matmul_forward(out, inp, w, bias, BT, C, OC, n_threads=n, engine="dnnl")
        return out.tobytes()

    old = matmul.set_forward_split_rows(0)   # never split: oneDNN's own threading
    try:
        whole = {n: forward(n) for n in (1, 2, 3)}
        matmul.set_forward_split_rows(1 << 20)
        for n in (2, 3):
            want = whole[1] if matmul.forward_split_available() else whole[n]
            assert forward(n) == want, f"{n} threads"
    finally:
        matmul.set_forward_split_rows(old)
    assert old == 1024
    with pytest.raises(ValueError, match="rows must be >= 0"):
        matmul.set_forward_split_rows(-1)


@pytest.mark.skipif("dnnl" not in matmul.get_engines(), reason="built without oneDNN")
def test_matmul_dnnl_forward_split_rows_off_with_onednn_avx2_kernels():
    # oneDNN's AVX2 sgemm gives a row bits that depend on the call's row count: with its ISA
    # capped at AVX2 (as on an AVX2-only CPU) the forward must not split, whatever the CPU
    code = ("import numpy as np; from llmctl._ext import matmul as m; "
            "print(m.forward_split_available())")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_matmul_tiled_is_thread_count_independent():
    # each output element is summed over K in order by one thread, whatever the team size
    BT, C, OC = 19, 300, 45
    rng = np.random.default_rng(5)
    inp, w, b, dout = _f32(rng, BT * C), _f32(rng, OC * C), _f32(rng, OC), _f32(rng, BT * OC)
    res = []
    for n in (1, 2):
        out = np.empty(BT * OC, np.float32)
        matmul.matmul_forward(out, inp, w, b, BT, C, OC, n_threads=n, engine="tiled")
        dinp, dw, db = np.zeros(BT * C, np.float32), np.zeros(OC * C, np.float32), np.zeros(OC, np.float32)
        matmul.matmul_backward(dinp, dw, db, dout, inp, w, BT, C, OC, n_threads=n, engine="tiled")
        res.append((out, dinp, dw, db))
    for a, b2 in zip(*res):
        assert np.array_equal(a, b2)


def test_matmul_rejects_bad_arguments():
    z = lambda n: np.zeros(n, np.float32)
    with raises_error(ValueError, names=["out", "5", "6"], hint=None):
        matmul.matmul_forward(z(5), z(6), z(9), None, 2, 3, 3)
    with raises_error(ValueError, names="bias", hint=None):
        matmul.matmul_forward(z(6), z(6), z(9), z(2), 2, 3, 3)
    with raises_error(ValueError, names="'cuda'", hint=None):
        matmul.matmul_forward(z(6), z(6), z(9), None, 2, 3, 3, engine="cuda")
    with raises_error(ValueError, names=["n_threads", "0"], hint=None):
        matmul.matmul_forward(z(6), z(6), z(9), None, 2, 3, 3, n_threads=0)
    with raises_error(ValueError, names="dinp", hint=None):
        matmul.matmul_backward(z(5), z(9), None, z(6), z(6), z(9), 2, 3, 3)
    with raises_error(ValueError, names=["BT", "0"], hint=None):
        matmul.matmul_forward(z(0), z(0), z(9), None, 0, 3, 3)
    with raises_error(ValueError, names="'cuda'", hint=None):
        matmul.matmul_backward(None, z(9), None, z(6), z(6), z(9), 2, 3, 3, engine="cuda")
    assert "blas" in matmul.get_engines() and "tiled" in matmul.get_engines()


def test_matmul_default_engine_is_dnnl_where_built(monkeypatch):
    # oneDNN is the default wherever it was linked; scipy's BLAS otherwise (unless switched off:
    # a run of the suite with LLMCTL_NO_DNNL set, which the next test covers)
    monkeypatch.delenv("LLMCTL_NO_DNNL", raising=False)
    want = "dnnl" if matmul.dnnl_built() else "blas"
    assert matmul.default_engine() == want == matmul.get_engines()[0]


def test_matmul_blas_fallback_when_dnnl_disabled(monkeypatch):
    # LLMCTL_NO_DNNL=1 at run time: the default engine is scipy's BLAS and "dnnl" is refused
    monkeypatch.setenv("LLMCTL_NO_DNNL", "1")
    assert matmul.get_engines() == ("blas", "tiled")
    z = lambda n: np.zeros(n, np.float32)
    with raises_error(ValueError, names="'dnnl'", hint=None):
        matmul.matmul_forward(z(6), z(6), z(9), None, 2, 3, 3, engine="dnnl")
    rng = np.random.default_rng(2)
    BT, C, OC = 5, 7, 3
    inp, w = _f32(rng, BT, C), _f32(rng, OC, C)
    out = np.empty(BT * OC, np.float32)
    matmul.matmul_forward(out, inp.ravel(), w.ravel(), None, BT, C, OC)   # default = blas here
    want = inp.astype(np.float64) @ w.astype(np.float64).T
    _assert_dot_close(out.reshape(BT, OC), want, np.abs(inp) @ np.abs(w).T, C, "default without dnnl")


def test_matmul_honours_blas_thread_count():
    from llmctl import threads

    threads.configure_threads(2)
    if not matmul.blas_threads_controlled():
        pytest.skip("scipy's BLAS does not expose openblas_set_num_threads")
    BT, C, OC = 8, 8, 8
    x = np.ones(BT * C, np.float32)
    out = np.empty(BT * OC, np.float32)
    matmul.matmul_forward(out, x, x, None, BT, C, OC, n_threads=1, engine="blas")
    scipy_pool = [n for path, n in threads.blas_thread_info() if "scipy.libs" in path]
    if scipy_pool:
        assert scipy_pool == [1]
    matmul.matmul_forward(out, x, x, None, BT, C, OC, n_threads=2, engine="blas")
    if scipy_pool:
        assert [n for path, n in threads.blas_thread_info() if "scipy.libs" in path] == [2]


@pytest.mark.skipif("dnnl" not in matmul.get_engines(), reason="built without oneDNN")
def test_matmul_dnnl_runs_on_n_threads():
    # oneDNN's OpenMP build sizes each GEMM by omp_get_max_threads(); matmul sets it per call
    from llmctl._ext import buildinfo

    if not buildinfo.openmp_enabled():
        pytest.skip("serial build")
    C = OC = 8
    x = np.ones(256 * C, np.float32)
    out = np.empty(256 * OC, np.float32)
    for BT in (8, 256):   # 256 rows on 2 threads: the forward's single-threaded call a block of rows
        for n in (1, 2, 1, 2):
            matmul.matmul_forward(out[:BT * OC], x[:BT * C], x[:OC * C], None, BT, C, OC, n_threads=n,
                                  engine="dnnl")
            assert buildinfo.openmp_max_threads() == n


@pytest.mark.skipif("dnnl" not in matmul.get_engines(), reason="built without oneDNN")
@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_matmul_dnnl_survives_signals():
    # oneDNN's nocopy sgemm runs with the stack pointer on a heap workspace when K > 84; a signal
    # handled on that thread wrote its frame over the heap (a Ctrl-C during training aborted the
    # process or put NaNs in the weights). Thousands of signals during GEMMs must change nothing.
    threads = [1, 2]
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "signalled_gemms.py"), "3"]
                             + [str(n) for n in threads],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n", child.stderr.read()
        sent = 0
        while child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGUSR1)
                sent += 1
            time.sleep(0.0002)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, f"exit {child.returncode} after {sent} signals: {out} {err}"
    calls, handled, wrong = (int(v) for v in out.split())
    assert wrong == 0
    assert calls >= 30 and handled >= 200, (calls, handled)  # the signals did land mid-GEMM


# ---------------------------------------------------------------------------------------------
# encoder

@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("B,T,C", [(2, 5, 7), (3, 4, 130)])  # C=130: 3 channel chunks, ragged
def test_encoder_forward_backward(n_threads, B, T, C):
    rng = np.random.default_rng(C)
    Vp, maxT = 11, T + 3
    ids = rng.integers(0, 4, size=(B, T)).astype(np.int32)  # few ids -> many repeats in backward
    wte, wpe = _f32(rng, Vp, C), _f32(rng, maxT, C)
    out = np.empty(B * T * C, np.float32)
    layers.encoder_forward(out, ids.ravel(), wte.ravel(), wpe.ravel(), B, T, C, n_threads)
    # one float32 addition of two float32 numbers: correctly rounded
    np.testing.assert_array_equal(out.reshape(B, T, C),
                                  (wte[ids] + wpe[None, :T]).astype(np.float32))
    dout = _f32(rng, B, T, C)
    dwte0, dwpe0 = _f32(rng, Vp, C), _f32(rng, maxT, C)
    dwte, dwpe = dwte0.ravel().copy(), dwpe0.ravel().copy()
    layers.encoder_backward(dwte, dwpe, dout.ravel(), ids.ravel(), B, T, C, n_threads)
    rdwte, rdwpe = ref.encoder_backward(dout.astype(np.float64), ids, Vp, maxT)
    K = B * T + 1  # at most B*T + 1 terms per element
    counts = np.bincount(ids.ravel(), minlength=Vp)[:, None]
    _assert_dot_close(dwte.reshape(Vp, C), dwte0 + rdwte,
                      np.abs(dwte0) + ref.encoder_backward(np.abs(dout.astype(np.float64)), ids, Vp, maxT)[0],
                      K, "dwte")
    _assert_dot_close(dwpe.reshape(maxT, C), dwpe0 + rdwpe,
                      np.abs(dwpe0) + ref.encoder_backward(np.abs(dout.astype(np.float64)), ids, Vp, maxT)[1],
                      K, "dwpe")
    assert counts[4:].sum() == 0 and np.array_equal(dwte.reshape(Vp, C)[4:], dwte0[4:])


def test_encoder_backward_same_bits_any_thread_count():
    B, T, C = 4, 16, 200
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 3, size=B * T).astype(np.int32)
    dout = _f32(rng, B * T * C)
    res = []
    for n in (1, 2):
        dwte, dwpe = np.zeros(5 * C, np.float32), np.zeros(T * C, np.float32)
        layers.encoder_backward(dwte, dwpe, dout, ids, B, T, C, n)
        res.append((dwte, dwpe))
    assert all(np.array_equal(a, b) for a, b in zip(*res))


def test_encoder_rejects_bad_ids_and_sizes():
    C = 4
    wte, wpe = np.zeros(3 * C, np.float32), np.zeros(2 * C, np.float32)
    out = np.zeros(2 * C, np.float32)
    with raises_error(ValueError, names=["inp[1] = 3", "[0, 3)"], hint=None):
        layers.encoder_forward(out, np.array([0, 3], np.int32), wte, wpe, 1, 2, C)
    with raises_error(ValueError, names=["-1", "[0, 3)"], hint=None):
        layers.encoder_backward(wte.copy(), wpe.copy(), out, np.array([-1, 0], np.int32), 1, 2, C)
    with raises_error(ValueError, names="wpe", hint=None):
        layers.encoder_forward(out, np.array([0, 1], np.int32), wte, wpe[:C], 1, 2, C)


# ---------------------------------------------------------------------------------------------
# layernorm

LN_SHAPES = [(1, 1), (5, 7), (6, 64), (9, 200)]  # C: below/at/above the 16-lane and 64-chunk sizes


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("N,C", LN_SHAPES)
def test_layernorm_forward_matches_reference(n_threads, N, C):
    rng = np.random.default_rng(N * C)
    x = _f32(rng, N, C, scale=3.0) + 1.5  # non-zero mean
    w, b = _f32(rng, C) + 1.0, _f32(rng, C)
    out, mean, rstd = (np.empty(N * C, np.float32), np.empty(N, np.float32), np.empty(N, np.float32))
    layers.layernorm_forward(out, mean, rstd, x.ravel(), w, b, N, C, n_threads)
    rout, rmean, rrstd = ref.layernorm_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    # mean/var accumulate in double, so mean and rstd are within a couple of float32 roundings;
    # out = (x-m)*r*w+b is 4 float32 ops on O(1..10) values -> 1e-5 relative to the row scale.
    np.testing.assert_allclose(mean, rmean, rtol=4 * U32, atol=4 * U32 * np.abs(x).max())
    np.testing.assert_allclose(rstd, rrstd, rtol=8 * U32)
    scale = np.abs(x - rmean[:, None]).max() * rrstd.max() * np.abs(w).max() + np.abs(b).max()
    np.testing.assert_allclose(out.reshape(N, C), rout, rtol=0, atol=16 * U32 * scale)


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("N,C", LN_SHAPES[1:])
def test_layernorm_backward_matches_reference(n_threads, N, C):
    rng = np.random.default_rng(N + C)
    x = _f32(rng, N, C, scale=2.0) - 0.5
    w, b, dout = _f32(rng, C) + 1.0, _f32(rng, C), _f32(rng, N, C)
    out, mean, rstd = (np.empty(N * C, np.float32), np.empty(N, np.float32), np.empty(N, np.float32))
    layers.layernorm_forward(out, mean, rstd, x.ravel(), w, b, N, C, n_threads)
    dx0, dw0, db0 = _f32(rng, N, C), _f32(rng, C), _f32(rng, C)
    dx, dw, db = dx0.ravel().copy(), dw0.copy(), db0.copy()
    layers.layernorm_backward(dx, dw, db, dout.ravel(), x.ravel(), w, mean, rstd, N, C, n_threads)
    x64 = x.astype(np.float64)
    _, m64, r64 = ref.layernorm_forward(x64, w.astype(np.float64), b.astype(np.float64))
    rdx, rdw, rdb = ref.layernorm_backward(dout.astype(np.float64), x64, w.astype(np.float64), m64, r64)
    # dx: C-term means of O(|w dout|) values, scaled by rstd -> float32 dot bound over C terms
    dnorm = np.abs(dout * w).astype(np.float64)
    _assert_dot_close(dx.reshape(N, C), dx0 + rdx,
                      np.abs(dx0) + r64[:, None] * (dnorm + 2 * dnorm.mean(1, keepdims=True) * (1 + np.abs(x64 - m64[:, None]) * r64[:, None] * 2)),
                      C + 8, "ln dinp")
    norm = np.abs((x64 - m64[:, None]) * r64[:, None])
    _assert_dot_close(dw, dw0 + rdw, np.abs(dw0) + (np.abs(dout) * norm).sum(0), N + 8, "ln dweight")
    _assert_dot_close(db, db0 + rdb, np.abs(db0) + np.abs(dout).sum(0), N, "ln dbias")


def test_layernorm_backward_finite_differences():
    # independent of reference.py: central differences of the float32 kernel forward.
    # loss = sum(out * R); step h = 1e-2 keeps float32 cancellation noise (~1e-7*|loss|/h ~ 1e-4)
    # and the O(h^2) truncation both far below the 2e-3 relative tolerance.
    N, C = 3, 5
    rng = np.random.default_rng(0)
    x, w, b, R = _f32(rng, N, C), _f32(rng, C) + 1, _f32(rng, C), _f32(rng, N, C)

    def loss(x_, w_, b_):
        out = np.empty(N * C, np.float32)
        layers.layernorm_forward(out, np.empty(N, np.float32), np.empty(N, np.float32),
                                 x_.ravel(), w_, b_, N, C)
        return float(np.dot(out.astype(np.float64), R.ravel()))

    out, mean, rstd = np.empty(N * C, np.float32), np.empty(N, np.float32), np.empty(N, np.float32)
    layers.layernorm_forward(out, mean, rstd, x.ravel(), w, b, N, C)
    dx, dw, db = np.zeros(N * C, np.float32), np.zeros(C, np.float32), np.zeros(C, np.float32)
    layers.layernorm_backward(dx, dw, db, R.ravel(), x.ravel(), w, mean, rstd, N, C)
    h = 1e-2
    for arr, grad in ((x, dx.reshape(N, C)), (w, dw), (b, db)):
        flat, g = arr.reshape(-1), grad.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + h; fp = loss(x, w, b)
            flat[i] = old - h; fm = loss(x, w, b)
            flat[i] = old
            fd = (fp - fm) / (2 * h)
            assert abs(fd - g[i]) <= 2e-3 * (1 + abs(fd)), (i, fd, g[i])


# ---------------------------------------------------------------------------------------------
# GELU and residual

GELU_X = np.concatenate([np.linspace(-12, 12, 1001), [0.0, -0.0, 1e-8, -1e-8, 30.0, -30.0, 300.0, -300.0]])


@pytest.mark.parametrize("n_threads", THREADS)
def test_gelu_forward_backward_match_reference(n_threads):
    rng = np.random.default_rng(2)
    x = np.concatenate([GELU_X, rng.standard_normal(40000) * 3]).astype(np.float32)  # > 2 chunks
    N = x.size
    out = np.empty(N, np.float32)
    layers.gelu_forward(out, x, N, n_threads)
    x64 = x.astype(np.float64)
    # our exp is within 2 ulp, tanh=(1-t)/(1+t) adds a few roundings (absolute, since |tanh|<=1):
    # |err| <= 16u*|x| covers 0.5*x*(1+tanh) with margin; a wrong formula is off by >> 1e-6*|x|.
    assert np.all(np.abs(out - ref.gelu_forward(x64)) <= 16 * U32 * np.abs(x64) + 1e-30)
    dout = _f32(rng, N)
    d0 = _f32(rng, N)
    d = d0.copy()
    layers.gelu_backward(d, x, dout, N, n_threads)
    want = d0 + ref.gelu_backward(dout.astype(np.float64), x64)
    # gelu' is O(1) but its second term grows like x^3*sech^2(u); bound the rounding by 32u times
    # the size of each term times |dout|, plus the accumulate's rounding.
    u = ref.GELU_SCALE * (x64 + 0.044715 * x64 ** 3)
    term2 = np.abs(x64 * 0.5 * (1 - np.tanh(u) ** 2) * ref.GELU_SCALE * (1 + 3 * 0.044715 * x64 ** 2))
    bound = 32 * U32 * ((1 + term2) * np.abs(dout) + np.abs(d0)) + 1e-30
    assert np.all(np.abs(d - want) <= bound)
    assert np.isfinite(out).all() and np.isfinite(d).all()


@pytest.mark.parametrize("n_threads", THREADS)
def test_gelu_forward_backward_is_gelu_then_its_gradient(n_threads):
    # the fp32 backward's recomputing pass: GELU(x) and gelu'(x) dy from one evaluation of tanh,
    # the bits of gelu_forward and of a zero fill + gelu_backward, specials and chunk tails included
    rng = np.random.default_rng(21)
    x = np.concatenate([GELU_X, rng.standard_normal(40000) * 3, [np.nan, np.inf, -np.inf, 3e38, -3e38]])
    x = x.astype(np.float32)
    N = x.size
    dy = _f32(rng, N)
    dy[7] = -0.0
    y, d = np.empty(N, np.float32), dy.copy()
    layers.gelu_forward_backward(y, d, x, N, n_threads)
    y1, d1 = np.empty(N, np.float32), np.zeros(N, np.float32)
    layers.gelu_forward(y1, x, N, n_threads)
    layers.gelu_backward(d1, x, dy, N, n_threads)
    assert y.tobytes() == y1.tobytes() and d.tobytes() == d1.tobytes()
    # and against the float64 reference (the bounds of the separate kernels' test above)
    fin = np.isfinite(x) & (np.abs(x) < 1e3)
    x64 = x[fin].astype(np.float64)
    assert np.all(np.abs(y[fin] - ref.gelu_forward(x64)) <= 16 * U32 * np.abs(x64) + 1e-30)
    u = ref.GELU_SCALE * (x64 + 0.044715 * x64 ** 3)
    term2 = np.abs(x64 * 0.5 * (1 - np.tanh(u) ** 2) * ref.GELU_SCALE * (1 + 3 * 0.044715 * x64 ** 2))
    want = ref.gelu_backward(dy[fin].astype(np.float64), x64)
    assert np.all(np.abs(d[fin] - want) <= 32 * U32 * (1 + term2) * np.abs(dy[fin]) + 1e-30)


def test_gelu_forward_backward_checks_its_buffers():
    N = 100
    x, y, d = np.ones(N, np.float32), np.empty(N, np.float32), np.ones(N, np.float32)
    with pytest.raises(ValueError, match="dinout and inp overlap"):
        layers.gelu_forward_backward(y, x, x, N)
    with pytest.raises(ValueError, match="out and dinout overlap"):
        layers.gelu_forward_backward(d, d, x, N)
    buf = np.ones(2 * N, np.float32)
    with pytest.raises(ValueError, match="out and inp overlap"):
        layers.gelu_forward_backward(buf[N // 2:N // 2 + N], d, buf[:N], N)
    with pytest.raises(ValueError, match="dinout has 99 elements"):
        layers.gelu_forward_backward(y, d[:99], x, N)
    with pytest.raises(ValueError, match="N must be > 0"):
        layers.gelu_forward_backward(y, d, x, 0)
    layers.gelu_forward_backward(y, d, x, N)   # the same buffers, separate: fine


def test_gelu_backward_finite_differences():
    x = np.linspace(-5, 5, 101).astype(np.float32)
    N = x.size
    d = np.zeros(N, np.float32)
    layers.gelu_backward(d, x, np.ones(N, np.float32), N)
    h = np.float32(1e-2)
    fp, fm = np.empty(N, np.float32), np.empty(N, np.float32)
    layers.gelu_forward(fp, x + h, N)
    layers.gelu_forward(fm, x - h, N)
    fd = (fp.astype(np.float64) - fm) / (2 * 1e-2)
    # truncation h^2/6*|gelu'''| <= 2e-5 on this range, float32 noise ~ 6e-8*5/1e-2 = 3e-5
    np.testing.assert_allclose(d, fd, atol=2e-4)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 16385, 300_001])
def test_zero_fill_clears_exactly_its_view(n, n_threads):
    old = layers.set_parallel_grain(0)   # split even the small sizes over the threads
    try:
        buf = np.full(n + 10, -1.5, np.float32)
        buf[3:3 + n] = np.random.default_rng(n).standard_normal(n)
        buf[3] = -0.0 if n else buf[3]
        layers.zero_fill(buf[3:3 + n], n_threads)
    finally:
        layers.set_parallel_grain(old)
    want = np.full(n + 10, -1.5, np.float32)
    want[3:3 + n] = 0.0
    assert buf.tobytes() == want.tobytes()   # +0.0 bits, as ndarray.fill(0.0); nothing outside


@pytest.mark.parametrize("n_threads", THREADS)
def test_residual_forward_backward(n_threads):
    rng = np.random.default_rng(4)
    N = 40000 + 3
    a, b, dout = _f32(rng, N), _f32(rng, N), _f32(rng, N)
    out = np.empty(N, np.float32)
    layers.residual_forward(out, a, b, N, n_threads)
    np.testing.assert_array_equal(out, a + b)  # a single correctly rounded float32 add
    aa = a.copy()
    layers.residual_forward(aa, aa, b, N, n_threads)  # out may alias inp1
    np.testing.assert_array_equal(aa, a + b)
    d1, d2 = a.copy(), b.copy()
    layers.residual_backward(d1, d2, dout, N, n_threads)
    np.testing.assert_array_equal(d1, a + dout)
    np.testing.assert_array_equal(d2, b + dout)


def test_elementwise_reject_bad_sizes():
    z = np.zeros(4, np.float32)
    with raises_error(ValueError, names=["inp", "4", "5"], hint=None):
        layers.gelu_forward(np.zeros(5, np.float32), z, 5)
    with raises_error(ValueError, names="dout", hint=None):
        layers.residual_backward(z, z, np.zeros(3, np.float32), 4)
    with raises_error(ValueError, names="rstd", hint=None):
        layers.layernorm_forward(np.zeros(8, np.float32), np.zeros(2, np.float32), np.zeros(1, np.float32),
                                 np.zeros(8, np.float32), z, z, 2, 4)


# ---------------------------------------------------------------------------------------------
# fused softmax + cross-entropy

SM_SHAPES = [(1, 1, 1), (3, 37, 48), (5, 1000, 1024), (2, 50257, 50304)]


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("BT,V,Vp", SM_SHAPES)
def test_softmax_crossentropy_matches_reference(n_threads, BT, V, Vp):
    rng = np.random.default_rng(V)
    logits = _f32(rng, BT, Vp, scale=4.0)
    logits[:, V:] = 1e4  # padded logits must never enter the softmax
    targets = rng.integers(0, V, size=BT).astype(np.int32)
    losses, probs = np.empty(BT, np.float32), np.empty(BT * Vp, np.float32)
    layers.softmax_crossentropy_forward(losses, probs, logits.ravel(), targets, BT, V, Vp, n_threads)
    rl, rp = ref.softmax_crossentropy_forward(logits.astype(np.float64), targets, V)
    # probs: x - max is rounded in float32 (absolute error u*|x - max|, which exp turns into that
    # much relative error), exp is within 2 ulp, the sum is in double, one multiply: so
    # |rel err| <= (8 + |x - max|) * u per element.
    z = np.abs(logits[:, :V].astype(np.float64) - logits[:, :V].max(1, keepdims=True))
    p = probs.reshape(BT, Vp)
    assert np.all(np.abs(p[:, :V] - rp[:, :V]) <= (8 + z) * U32 * rp[:, :V] + 1e-38)
    assert np.all(p[:, V:] == 0)
    # loss = log(sum) - (x_t - max): the sum's relative error (bounded as above) becomes absolute
    np.testing.assert_allclose(losses, rl, rtol=8 * U32, atol=(8 + z.max()) * U32)
    # in place (probs is logits) gives the same bits
    inplace = logits.ravel().copy()
    l2 = np.empty(BT, np.float32)
    layers.softmax_crossentropy_forward(l2, inplace, inplace, targets, BT, V, Vp, n_threads)
    assert np.array_equal(inplace, probs) and np.array_equal(l2, losses)
    # backward: overwrite (garbage before), padded columns exactly 0, alias allowed
    dl = _f32(rng, BT)
    dlogits = np.full(BT * Vp, np.nan, np.float32)
    layers.softmax_crossentropy_backward(dlogits, probs, targets, dl, BT, V, Vp, n_threads)
    want = ref.softmax_crossentropy_backward(probs.reshape(BT, Vp).astype(np.float64), targets, dl, V)
    np.testing.assert_allclose(dlogits.reshape(BT, Vp), want, rtol=2 * U32, atol=1e-38)
    assert np.all(dlogits.reshape(BT, Vp)[:, V:] == 0)
    alias = probs.copy()
    layers.softmax_crossentropy_backward(alias, alias, targets, dl, BT, V, Vp, n_threads)
    assert np.array_equal(alias, dlogits)
    # the training forward's one pass: the same losses and dlogits as the two calls, in place
    # (the logits become the dlogits) or into another buffer (the logits only read)
    fused, l3 = logits.ravel().copy(), np.full(BT, np.nan, np.float32)
    layers.softmax_crossentropy_forward_backward(l3, fused, fused, targets, dl, BT, V, Vp, n_threads)
    assert np.array_equal(fused, dlogits) and np.array_equal(l3, losses)
    src, out, l4 = logits.ravel().copy(), np.full(BT * Vp, np.nan, np.float32), np.empty(BT, np.float32)
    layers.softmax_crossentropy_forward_backward(l4, out, src, targets, dl, BT, V, Vp, n_threads)
    assert np.array_equal(out, dlogits) and np.array_equal(l4, losses)
    assert np.array_equal(src, logits.ravel())
    with raises_error(ValueError, names=["dlosses", "elements"], hint=None):
        layers.softmax_crossentropy_forward_backward(l4, out, src, targets, dl[:0], BT, V, Vp, n_threads)


def test_softmax_crossentropy_extreme_logits_stay_finite():
    BT, V, Vp = 2, 40, 48
    logits = np.zeros((BT, Vp), np.float32)
    logits[0, 3] = 1e30  # one huge logit: p=1 there, exp underflows to 0 elsewhere
    logits[1] = -1e30
    logits[1, 5] = 0.0
    targets = np.array([7, 5], np.int32)
    losses, probs = np.empty(BT, np.float32), np.empty(BT * Vp, np.float32)
    layers.softmax_crossentropy_forward(losses, probs, logits.ravel(), targets, BT, V, Vp)
    p = probs.reshape(BT, Vp)
    assert p[0, 3] == 1.0 and p[1, 5] == 1.0 and np.isfinite(p).all()
    assert losses[0] == np.float32(1e30) and losses[1] == 0.0  # -log p without log(0) = inf


def test_softmax_crossentropy_row_max_of_signed_zeros_infinities_and_nan():
    # the row max compares the floats' bits as integers: check the orders that could go wrong
    BT, V, Vp = 4, 37, 48
    logits = np.full((BT, Vp), -np.inf, np.float32)
    logits[:, V:] = 5.0                                   # padding: never part of the max
    logits[0, :] = -3.0 - np.arange(Vp, dtype=np.float32)  # all negative: the max is -3, not 0 or -FLT_MAX
    logits[1, [4, 9]] = [-0.0, 0.0]                       # -0 beside +0, the rest -inf
    logits[2, :V] = np.linspace(-2, 2, V, dtype=np.float32)
    logits[2, 6] = np.nan                                 # NaN poisons its row only
    logits[3, :V] = -np.inf                               # no finite logit at all
    targets = np.array([0, 9, 1, 2], np.int32)
    losses, probs = np.empty(BT, np.float32), np.empty(BT * Vp, np.float32)
    layers.softmax_crossentropy_forward(losses, probs, logits.ravel(), targets, BT, V, Vp)
    p = probs.reshape(BT, Vp)
    rl, rp = ref.softmax_crossentropy_forward(logits[:2].astype(np.float64), targets[:2], V)
    np.testing.assert_allclose(p[:2, :V], rp[:, :V], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(losses[:2], rl, rtol=1e-6)
    assert p[1, 4] == p[1, 9] == 0.5 and losses[1] == np.float32(np.log(2.0))
    assert np.isnan(p[2, :V]).all() and np.isnan(losses[2])
    assert not np.isfinite(losses[3])                     # as before: -inf over -inf has no value
    assert np.all(p[:, V:] == 0)


def test_softmax_crossentropy_backward_finite_differences():
    # d/dlogits of sum_bt dloss_bt * loss_bt, from the kernel's own float32 forward
    BT, V, Vp = 2, 7, 16
    rng = np.random.default_rng(9)
    logits = _f32(rng, BT, Vp)
    targets = np.array([3, 0], np.int32)
    dl = np.array([0.7, -1.3], np.float32)

    def f(lg):
        losses, probs = np.empty(BT, np.float32), np.empty(BT * Vp, np.float32)
        layers.softmax_crossentropy_forward(losses, probs, lg.ravel(), targets, BT, V, Vp)
        return float(np.dot(losses.astype(np.float64), dl)), probs

    _, probs = f(logits)
    d = np.empty(BT * Vp, np.float32)
    layers.softmax_crossentropy_backward(d, probs, targets, dl, BT, V, Vp)
    h = 1e-2
    flat = logits.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h; fp = f(logits)[0]
        flat[i] = old - h; fm = f(logits)[0]
        flat[i] = old
        # h^2 truncation (|f'''| <= 1) ~ 2e-5 plus float32 noise ~ 1e-7*3/h = 3e-5
        assert abs((fp - fm) / (2 * h) - d[i]) <= 2e-4, i


def test_softmax_crossentropy_rejects_bad_targets():
    z = np.zeros(8, np.float32)
    with raises_error(ValueError, names=["targets[0] = 6", "[0, 6)"], hint=None):
        layers.softmax_crossentropy_forward(np.zeros(1, np.float32), z, z, np.array([6], np.int32), 1, 6, 8)
    with raises_error(ValueError, names=["Vp=4", "V=6"], hint=None):
        layers.softmax_crossentropy_backward(z, z, np.array([0], np.int32), np.zeros(1, np.float32), 1, 6, 4)


# ---------------------------------------------------------------------------------------------
# determinism of the row/column-parallel layer kernels across thread counts

def test_layer_kernels_same_bits_for_1_and_2_threads_and_when_repeated():
    rng = np.random.default_rng(21)
    N, C, V, Vp = 33, 100, 300, 320
    x, w, b, dout = _f32(rng, N * C), _f32(rng, C), _f32(rng, C), _f32(rng, N * C)
    logits, targets = _f32(rng, N * Vp), rng.integers(0, V, N).astype(np.int32)
    res = []
    for n in (1, 2, 2):
        r = {}
        r["ln"] = [np.empty(N * C, np.float32), np.empty(N, np.float32), np.empty(N, np.float32)]
        layers.layernorm_forward(*r["ln"], x, w, b, N, C, n)
        r["lnb"] = [np.zeros(N * C, np.float32), np.zeros(C, np.float32), np.zeros(C, np.float32)]
        layers.layernorm_backward(*r["lnb"], dout, x, w, r["ln"][1], r["ln"][2], N, C, n)
        r["gelu"] = [np.empty(N * C, np.float32), np.zeros(N * C, np.float32)]
        layers.gelu_forward(r["gelu"][0], x, N * C, n)
        layers.gelu_backward(r["gelu"][1], x, dout, N * C, n)
        r["sm"] = [np.empty(N, np.float32), np.empty(N * Vp, np.float32)]
        layers.softmax_crossentropy_forward(*r["sm"], logits, targets, N, V, Vp, n)
        r["smb"] = [np.empty(N * Vp, np.float32)]
        layers.softmax_crossentropy_backward(r["smb"][0], r["sm"][1], targets, x[:N], N, V, Vp, n)
        r["res"] = [np.empty(N * C, np.float32), x.copy(), w.repeat(N)[:N * C].copy()]
        layers.residual_forward(r["res"][0], x, dout, N * C, n)
        layers.residual_backward(r["res"][1], r["res"][2], dout, N * C, n)
        res.append(r)
    for other in res[1:]:
        for k in res[0]:
            for a, b2 in zip(res[0][k], other[k]):
                assert np.array_equal(a, b2), k


# ---------------------------------------------------------------------------------------------
# AdamW and the global norm

@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("N", [1, 17, 100003])  # < lane, ragged, > 3 chunks of 32768
def test_adamw_matches_reference_over_steps(n_threads, N):
    # Each step is compared from the same (float32) state, so the bound is one step's rounding.
    rng = np.random.default_rng(N)
    p = _f32(rng, N)
    m, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
    f = lambda a: float(np.float32(a))  # the float32-rounded hyper-parameters the kernel receives
    lr, b1, b2, eps = f(1e-3), f(0.9), f(0.95), f(1e-8)
    for t, (wd, gs) in enumerate([(0.0, 1.0), (0.1, 0.5), (0.01, 1.0), (0.0, 2.0)], start=1):
        wd, gs = f(wd), f(gs)
        g = _f32(rng, N, scale=0.1)
        p64, m64, v64 = p.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
        rp, rm, rv = ref.adamw_step(p64, g.astype(np.float64), m64, v64, lr, b1, b2, eps, wd, t,
                                    grad_scale=gs)
        adamw.adamw_update(p, g, m, v, lr, b1, b2, eps, wd, gs, t, n_threads)
        g1 = np.abs(gs * g.astype(np.float64))
        # m = b1 m + (1-b1) g' and v likewise: 4 roundings on terms of these magnitudes (m can
        # cancel, so the bound is on the terms, not on |m|)
        dm = 6 * U32 * (b1 * np.abs(m64) + (1 - b1) * g1) + 1e-38
        dv = 6 * U32 * (b2 * v64 + (1 - b2) * g1 * g1) + 1e-38
        assert np.all(np.abs(m - rm) <= dm) and np.all(np.abs(v - rv) <= dv)
        # p -= lr*(mhat/(sqrt(vhat)+eps) + wd p): m's absolute error through the ratio, ~10
        # roundings relative to |ratio|, and the final subtraction's rounding of p
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        den = np.sqrt(rv / bc2) + eps
        ratio = (rm / bc1) / den
        dp = (2 * U32 * np.abs(rp)
              + lr * (dm / bc1 / den + 12 * U32 * np.abs(ratio) + 4 * U32 * wd * np.abs(p64)))
        assert np.all(np.abs(p - rp) <= dp), f"step {t}: p off by {np.max(np.abs(p - rp) / dp):.2f}x the bound"


def test_adamw_bit_identical_and_thread_independent():
    rng = np.random.default_rng(8)
    N = 70001
    p0, g = _f32(rng, N), _f32(rng, N)
    out = []
    for n in (1, 2, 2):
        p, m, v = p0.copy(), np.zeros(N, np.float32), np.zeros(N, np.float32)
        adamw.adamw_update(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1, n)
        out.append(p)
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[1], out[2])


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("N", [1, 17, 32768, 32769, 100003])  # < lane, ragged, 1 chunk, chunk + 1, > 3 chunks
@pytest.mark.parametrize("bf16", [False, True])
def test_adamw_zero_grads_same_bits_and_clears_grads(n_threads, N, bf16):
    """zero_grads=True (the trainer's fused zeroing) gives the same params/m/v/bf16 copy as
    zero_grads=False, over steps that each get fresh gradients, and leaves exactly the gradients
    passed (a slice of a larger buffer, as the model passes them) all zero."""
    rng = np.random.default_rng(N + 7)
    p0 = _f32(rng, N)
    state = {}
    for zero in (False, True):
        p, m, v = p0.copy(), np.zeros(N, np.float32), np.zeros(N, np.float32)
        pb = np.zeros(N, np.uint16) if bf16 else None
        gbuf = np.empty(N + 5, np.float32)
        rs = np.random.default_rng(N)   # the same gradients for both runs
        for t, (wd, gs) in enumerate([(0.0, 1.0), (0.1, 0.5), (0.01, 1.3)], start=1):
            gbuf[:] = _f32(rs, N + 5, scale=0.1)
            around = np.concatenate([gbuf[:3], gbuf[3 + N:]])
            g = gbuf[3:3 + N]
            adamw.adamw_update(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, wd, gs, t, n_threads,
                               params_bf16=pb, zero_grads=zero)
            if zero:
                assert not g.any(), f"step {t}: {np.count_nonzero(g)} of {N} gradients left"
            else:
                assert g.any()
            assert np.array_equal(np.concatenate([gbuf[:3], gbuf[3 + N:]]), around)
        state[zero] = (p, m, v, pb)
    for a, b in zip(state[False], state[True]):
        assert (a is None and b is None) or a.tobytes() == b.tobytes()


def test_adamw_zero_grads_refuses_read_only_grads():
    z = np.zeros(4, np.float32)
    g = np.ones(4, np.float32)
    g.flags.writeable = False
    adamw.adamw_update(z.copy(), g, z.copy(), z.copy(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1)
    with raises_error(ValueError, names="read-only", hint=None):
        adamw.adamw_update(z.copy(), g, z.copy(), z.copy(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1,
                           zero_grads=True)


def test_adamw_rejects_bad_arguments():
    z = np.zeros(4, np.float32)
    with raises_error(ValueError, names=["t ", "1-based step"], hint=None):
        adamw.adamw_update(z.copy(), z, z.copy(), z.copy(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 0)
    with raises_error(ValueError, names=["grads", "3"], hint=None):
        adamw.adamw_update(z.copy(), z[:3], z.copy(), z.copy(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1)


def test_global_norm_sq_exact_and_thread_independent():
    rng = np.random.default_rng(6)
    g = _f32(rng, 3 * 32768 + 5)
    want = float(np.sum(g.astype(np.float64) ** 2))
    got1 = adamw.global_norm_sq(g, 1)
    got2 = adamw.global_norm_sq(g, 2)
    assert got1 == got2  # same bits at any thread count (fixed chunking, ordered combine)
    # float32 squares are exact in float64; summing 1e5 of them costs <= 1e5 * 2^-53 relative
    assert abs(got1 - want) <= 1e-10 * want
    assert adamw.global_norm_sq(np.zeros(0, np.float32)) == 0.0


def _cpu_has_avx(flag="avx"):
    """Whether the kernels run AVX (or `flag`, e.g. avx2) here: this CPU has it (x86-64 Linux:
    /proc/cpuinfo's flags) and this build has such copies (the portable test build has none, the
    SIMDe test build runs the AVX-512 ones on AVX2); None when unknown."""
    from llmctl._ext import buildinfo

    if platform.machine().lower() not in ("x86_64", "amd64") or buildinfo.portable():
        return False
    if buildinfo.simde_avx512() and flag.startswith("avx512"):
        flag = "avx2"
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and f" {flag} " in line.rstrip() + " " for line in f)
    except OSError:
        return None


def test_adamw_avx_and_portable_paths_give_identical_bits():
    # the AVX path (runtime-dispatched) repeats the portable loop's operations in the same order
    # without FMA, so the two must agree exactly, including the ragged tail
    has = _cpu_has_avx()
    if not has:
        pytest.skip("no AVX copy runs here (this CPU or this build): the portable path is the only one, "
                    "there is nothing to compare it with" if has is False else
                    "cannot tell whether this CPU has AVX (no /proc/cpuinfo)")
    rng = np.random.default_rng(12)
    N = 4099
    base = [_f32(rng, N), _f32(rng, N), np.zeros(N, np.float32), np.zeros(N, np.float32)]
    res = []
    try:
        for simd in (True, False):
            adamw.set_simd(simd)
            assert adamw.simd() == ("avx" if simd else "baseline")  # what `llmctl info` reports
            p, g, m, v = (a.copy() for a in base)
            pb = np.empty(N, np.uint16)   # the bf16 copy, cast in the same pass
            for t in (1, 2, 3):
                adamw.adamw_update(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.7, t, 2, pb)
            res.append((p, m, v, pb))
    finally:
        adamw.set_simd(True)
    assert all(np.array_equal(a, b) for a, b in zip(*res))


def _isa_levels():
    """The copies of the row loops (gelu.h, rows.h) this CPU and build run, by /proc/cpuinfo."""
    want = {"avx2": ["avx2"], "avx512": ["avx512f", "avx512bw", "avx512dq", "avx512vl"]}
    return ["baseline"] + [isa for isa, flags in want.items() if all(_cpu_has_avx(f) for f in flags)]


def _row_kernel_outputs(n_threads, rng):
    """Every row-loop kernel of layers/convert on awkward data: odd C and V (ragged lane tails),
    several chunks, NaN, inf, signed zeros, tiny and huge values."""
    out = []
    N = 3 * 16384 + 37
    x = (rng.standard_normal(N) * 4).astype(np.float32)
    x[:12] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 9.5, 3e38, -3e38]
    dy, dx = _f32(rng, N), _f32(rng, N)
    o, o16 = np.empty(N, np.float32), np.empty(N, np.uint16)
    layers.gelu_forward(o, x, N, n_threads)
    layers.gelu_forward_bf16(o16, x, N, n_threads)
    layers.gelu_backward(dx, x, dy, N, n_threads)
    out += [o.tobytes(), o16.tobytes(), dx.tobytes()]
    d = dy.copy()
    layers.gelu_forward_backward(o, d, x, N, n_threads)
    out += [o.tobytes(), d.tobytes()]
    gb = _f32(rng, 131)                    # 131 columns: two full chunks of 64 and a tail of 3
    layers.gelu_backward_bf16(o16[:N - N % 131], gb, x[:N - N % 131], dy[:N - N % 131], N // 131, 131, n_threads)
    out += [o16.tobytes(), gb.tobytes()]
    xb = np.empty(N, np.uint16)              # bf16 input (the bf16 model's fch)
    convert.cast_to_bf16(xb, x, n_threads)
    layers.gelu_forward_bf16(o16, xb, N, n_threads)
    out.append(o16.tobytes())
    layers.gelu_backward_bf16(o16[:N - N % 131], gb, xb[:N - N % 131], dy[:N - N % 131], N // 131, 131, n_threads)
    out += [o16.tobytes(), gb.tobytes()]
    convert.cast_to_bf16(o16, x, n_threads)
    out.append(o16.tobytes())
    R, C = 9, 77
    xs = (rng.standard_normal(R * C) * 3 + 1).astype(np.float32)
    xs[5] = np.nan                       # one poisoned row, the rest ordinary
    w, b = _f32(rng, C), _f32(rng, C)
    y, y16 = np.empty(R * C, np.float32), np.empty(R * C, np.uint16)
    mean, rstd = np.empty(R, np.float32), np.empty(R, np.float32)
    layers.layernorm_forward_bf16(y16, mean, rstd, xs, w, b, R, C, n_threads)
    layers.layernorm_forward(y, mean, rstd, xs, w, b, R, C, n_threads)
    din, dw, db = _f32(rng, R * C), np.zeros(C, np.float32), np.zeros(C, np.float32)
    layers.layernorm_backward(din, dw, db, _f32(rng, R * C), xs, w, mean, rstd, R, C, n_threads)
    out += [y.tobytes(), y16.tobytes(), mean.tobytes(), rstd.tobytes(), din.tobytes(), dw.tobytes(), db.tobytes()]
    BT, V, Vp = 7, 1000 + 13, 1040
    logits = (rng.standard_normal(BT * Vp) * 5).astype(np.float32)
    logits[3] = np.inf
    logits[Vp + 7] = -np.inf
    logits[5 * Vp + 11] = np.nan                          # the row max reads the bits as integers:
    logits[6 * Vp:7 * Vp] = -np.inf                       # NaN, a row of -inf, -0 beside +0
    logits[6 * Vp + 2], logits[6 * Vp + 900] = -0.0, 0.0
    tg = rng.integers(0, V, BT).astype(np.int32)
    losses, probs = np.empty(BT, np.float32), np.empty(BT * Vp, np.float32)
    layers.softmax_crossentropy_forward(losses, probs, logits, tg, BT, V, Vp, n_threads)
    dl = _f32(rng, BT)
    d32, d16 = np.empty(BT * Vp, np.float32), np.empty(BT * Vp, np.uint16)
    layers.softmax_crossentropy_backward(d32, probs, tg, dl, BT, V, Vp, n_threads)
    layers.softmax_crossentropy_backward_bf16(d16, probs, tg, dl, BT, V, Vp, n_threads)
    out += [losses.tobytes(), probs.tobytes(), d32.tobytes(), d16.tobytes()]
    layers.softmax_crossentropy_forward_backward_bf16(losses, d16, logits, tg, dl, BT, V, Vp, n_threads)
    out += [losses.tobytes(), d16.tobytes()]
    lg16 = np.empty(BT * Vp, np.uint16)       # the bf16 lm head's logits
    convert.cast_to_bf16(lg16, logits, n_threads)
    layers.softmax_crossentropy_forward_backward_bf16(losses, d16, lg16, tg, dl, BT, V, Vp, n_threads)
    out += [losses.tobytes(), d16.tobytes()]
    layers.softmax_crossentropy_forward_backward_bf16(losses, None, lg16, tg, None, BT, V, Vp, n_threads)
    out.append(losses.tobytes())
    layers.softmax_crossentropy_forward_backward(losses, d32, logits, tg, dl, BT, V, Vp, n_threads)
    out += [losses.tobytes(), d32.tobytes()]
    Rb, Cb, OCb = 37, 16, 131               # a bias gradient with the bf16 copy of dout (rows.h)
    dout = _f32(rng, Rb * OCb)
    dout[5] = np.nan
    i16, w16 = np.empty(Rb * Cb, np.uint16), np.empty(OCb * Cb, np.uint16)
    convert.cast_to_bf16(i16, _f32(rng, Rb * Cb), n_threads)
    convert.cast_to_bf16(w16, _f32(rng, OCb * Cb), n_threads)
    d16b, dbb, dWb = np.empty(Rb * OCb, np.uint16), _f32(rng, OCb), np.zeros(OCb * Cb, np.float32)
    matmul.matmul_backward_bf16(None, dWb, dbb, dout, d16b, i16, w16, Rb, Cb, OCb, n_threads, "blas")
    out += [d16b.tobytes(), dbb.tobytes()]
    g = x[12:].copy()                      # finite: the grad norm and AdamW's bf16 copy
    out.append(float(adamw.global_norm_sq(g, n_threads)).hex())
    p, m, v, pb = _f32(rng, g.size), np.zeros(g.size, np.float32), np.zeros(g.size, np.float32), np.empty(g.size, np.uint16)
    adamw.adamw_update(p, g, m, v, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.7, 1, n_threads, pb)
    out += [p.tobytes(), pb.tobytes()]
    return out


@pytest.mark.parametrize("n_threads", [1, 3])
def test_row_loops_give_identical_bits_in_every_instruction_set(n_threads):
    # gelu.h and rows.h compile each loop for baseline x86-64, AVX2 and AVX-512 and pick one at
    # run time; the same float operations in the same order (no FMA, fixed lane partials) in
    # all, so the same bits, specials and tails included
    levels = _isa_levels()
    if len(levels) == 1:
        pytest.skip("this CPU has no AVX2: the baseline loops are the only copy, nothing to compare")
    res = {}
    try:
        for isa in levels:
            assert layers.set_simd(isa) == isa     # what `llmctl info` reports
            assert convert.set_isa(levels.index(isa)) == levels.index(isa)
            assert adamw.set_isa(levels.index(isa)) == levels.index(isa)
            assert matmul.set_isa(levels.index(isa)) == levels.index(isa)
            res[isa] = _row_kernel_outputs(n_threads, np.random.default_rng(14))
        assert layers.set_simd(False) == "baseline"
    finally:
        layers.set_simd(True)
        convert.set_isa(-1)
        adamw.set_isa(-1)
        matmul.set_isa(-1)
    assert layers.simd() == levels[-1]
    for isa in levels[1:]:
        diff = [i for i, (a, b) in enumerate(zip(res["baseline"], res[isa])) if a != b]
        assert not diff, f"{isa}: outputs {diff} differ from the baseline loops"


def test_bf16_logits_softmax_gives_the_baseline_bits_at_gpt2_size():
    # the bf16 lm head's softmax + cross-entropy, beside the small awkward rows above: a block of
    # GPT-2's shape (50257 keys a row max, the vector loops' 3141 steps and their tail, many bf16
    # roundings of dlogits)
    levels = _isa_levels()
    if "avx512" not in levels:
        pytest.skip("this CPU runs no AVX-512 copy of the row loops")
    rng = np.random.default_rng(15)
    BT, V, Vp = 64, 50257, 50304
    lg16 = np.empty(BT * Vp, np.uint16)
    convert.cast_to_bf16(lg16, (rng.standard_normal(BT * Vp) * 4).astype(np.float32), 2)
    tg = rng.integers(0, V, BT).astype(np.int32)
    dl = np.full(BT, 1.0 / BT, np.float32)
    res = {}
    try:
        for isa in ("baseline", "avx512"):
            layers.set_simd(isa)
            losses, d16 = np.empty(BT, np.float32), np.empty(BT * Vp, np.uint16)
            layers.softmax_crossentropy_forward_backward_bf16(losses, d16, lg16, tg, dl, BT, V, Vp, 2)
            res[isa] = (losses, d16)
    finally:
        layers.set_simd(True)
    np.testing.assert_array_equal(res["avx512"][0], res["baseline"][0])
    np.testing.assert_array_equal(res["avx512"][1], res["baseline"][1])


def test_default_grain_changes_thread_use_not_bits():
    # with the default grain, small calls run serially; the results must be the same bits
    rng = np.random.default_rng(13)
    N, C = 40, 96
    x, w, b = _f32(rng, N * C), _f32(rng, C), _f32(rng, C)
    outs = []
    for grain in (0, None):
        old = layers.set_parallel_grain(grain if grain is not None else 131072)
        try:
            out, mean, rstd = np.empty(N * C, np.float32), np.empty(N, np.float32), np.empty(N, np.float32)
            layers.layernorm_forward(out, mean, rstd, x, w, b, N, C, 2)
            g = np.empty(N * C, np.float32)
            layers.gelu_forward(g, x, N * C, 2)
            outs.append((out, mean, rstd, g))
        finally:
            layers.set_parallel_grain(old)
    assert all(np.array_equal(a, b2) for a, b2 in zip(*outs))


# ---------------------------------------------------------------------------------------------
# llmctl.threads

def test_resolve_threads(monkeypatch):
    from llmctl import threads
    from llmctl.errors import ConfigError

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.resolve_threads(None) == 3 and threads.resolve_threads(0) == 3
    assert threads.resolve_threads(5) == 5
    cores = threads.usable_cores()
    assert threads.resolve_threads(-1) == cores
    with raises_error(ConfigError, names=[str(-cores - 1), str(cores)]):  # the request, the cores there are
        threads.resolve_threads(-cores - 1)
    with raises_error(ConfigError, names="'two'"):
        threads.resolve_threads("two")


def test_configure_threads_sets_every_blas_pool():
    from llmctl import threads

    try:
        assert threads.configure_threads(1) == 1
        assert all(n == 1 for _, n in threads.blas_thread_info())
        with threads.blas_threads(2):
            assert all(n == 2 for _, n in threads.blas_thread_info())
        assert all(n == 1 for _, n in threads.blas_thread_info())
    finally:
        threads.configure_threads(2)


def test_overlapping_outputs_are_rejected():
    buf = np.zeros(64, np.float32)
    z = lambda n: np.zeros(n, np.float32)
    with raises_error(ValueError, names=["out", "inp", "overlap"], hint=None):
        matmul.matmul_forward(buf[:6], buf[4:10], z(9), None, 2, 3, 3)
    with raises_error(ValueError, names=["dinp", "dout", "overlap"], hint=None):
        matmul.matmul_backward(buf[:6], z(9), None, buf[:6], z(6), z(9), 2, 3, 3)
    with raises_error(ValueError, names=["dweight", "dbias", "overlap"], hint=None):
        matmul.matmul_backward(None, buf[:9], buf[8:11], z(6), z(6), z(9), 2, 3, 3)
    with raises_error(ValueError, names=["dinp", "dout", "overlap"], hint=None):
        layers.gelu_backward(buf[:8], z(8), buf[:8], 8)
    with raises_error(ValueError, names=["dinp", "dout", "overlap"], hint=None):
        layers.layernorm_backward(buf[:8], z(4), z(4), buf[4:12], z(8), z(4), z(2), z(2), 2, 4)
    # adjacent but disjoint views are fine
    matmul.matmul_forward(buf[:6], buf[6:12], buf[12:21], buf[21:24], 2, 3, 3)


@pytest.mark.parametrize("engine", ENGINES)
def test_matmul_backward_finite_differences(engine):
    # loss = sum(out * R) is linear in each operand, so central differences have no truncation
    # error; float32 rounding of the loss (~1e-7 * sum|terms| / h) stays below 1e-3 with h = 0.5
    BT, C, OC = 3, 5, 4
    rng = np.random.default_rng(17)
    x, w, b, R = _f32(rng, BT * C), _f32(rng, OC * C), _f32(rng, OC), _f32(rng, BT * OC)

    def loss():
        out = np.empty(BT * OC, np.float32)
        matmul.matmul_forward(out, x, w, b, BT, C, OC, engine=engine)
        return float(np.dot(out.astype(np.float64), R))

    dx, dw, db = np.zeros(BT * C, np.float32), np.zeros(OC * C, np.float32), np.zeros(OC, np.float32)
    matmul.matmul_backward(dx, dw, db, R, x, w, BT, C, OC, engine=engine)
    h = 0.5
    for arr, grad in ((x, dx), (w, dw), (b, db)):
        for i in range(arr.size):
            old = arr[i]
            arr[i] = old + h; fp = loss()
            arr[i] = old - h; fm = loss()
            arr[i] = old
            assert abs((fp - fm) / (2 * h) - grad[i]) <= 1e-3, (i, grad[i])


def test_encoder_backward_finite_differences():
    B, T, C, Vp = 2, 3, 4, 5
    rng = np.random.default_rng(18)
    ids = np.array([1, 3, 1, 0, 1, 4], np.int32)  # token 1 repeats
    wte, wpe, R = _f32(rng, Vp * C), _f32(rng, T * C), _f32(rng, B * T * C)

    def loss():
        out = np.empty(B * T * C, np.float32)
        layers.encoder_forward(out, ids, wte, wpe, B, T, C)
        return float(np.dot(out.astype(np.float64), R))

    dwte, dwpe = np.zeros(Vp * C, np.float32), np.zeros(T * C, np.float32)
    layers.encoder_backward(dwte, dwpe, R, ids, B, T, C)
    h = 0.5  # linear: exact up to float32 rounding of the loss
    for arr, grad in ((wte, dwte), (wpe, dwpe)):
        for i in range(arr.size):
            old = arr[i]
            arr[i] = old + h; fp = loss()
            arr[i] = old - h; fm = loss()
            arr[i] = old
            assert abs((fp - fm) / (2 * h) - grad[i]) <= 1e-4, (i, grad[i])
