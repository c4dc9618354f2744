"""Tests for the bf16 attention kernels (_ext/attention_bf16.h via attention_forward_bf16 /
attention_backward_bf16), on every path this CPU runs: "emulated" (everywhere), "avx512_bf16",
"amx".

Reference: tests/reference.py in float64 (its backward is pinned by float64 finite differences in
test_attention.py), fed q, k, v and dout rounded to bf16 here by independent NumPy code, so the
only differences left are the kernel's own roundings. Tolerances are not fitted: each is a bound
derived per element from bf16's unit roundoff u = 2^-8 for the intermediates the kernel rounds
(P before P V and P^T dout, dS before dS K and dS^T Q), plus an fp32 accumulation term
g = (T + hs + 32) * 2^-24, each times the sum of the magnitudes of the terms involved:
  out:  |err| <= (u + 2 eP + g) (P |v|)                   eP: P's relative error from the fp32
  dV:   |err| <= (u + eP + g) (P^T |dout|)                    scores, max and sum (O(g))
  dS:   |err| <= u |dS| + s P (eP |dP - D| + g |dout||v|^T + errD),  s = 1/sqrt(hs)
  dQ, dK: |err| <= err_dS |k| (resp. err_dS^T |q|) + g |dS| |k| (|dS|^T |q|)
A wrong rounding point (say P kept in fp32 in one place and rounded twice in another) moves
errors by ~u relative and is caught only statistically; a wrong mask, scale, block boundary or
missing term is off by O(1) and fails every bound.
"""
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import reference as R

from llmctl._ext import attention as A
from llmctl._ext import convert

SHAPES = [
    (1, 1, 12, 2),     # a single query; hs=6 padded to 32
    (2, 7, 12, 2),     # T below a block
    (2, 33, 24, 2),    # one past a 32-row block; hs=12
    (1, 64, 64, 1),    # two whole blocks; hs=64
    (1, 65, 128, 2),   # one past; hs=64, two heads
    (1, 100, 96, 2),   # hs=48: padded to 64
    (1, 130, 64, 1),   # five blocks, the last partial
    (1, 40, 30, 2),    # hs=15: odd, padded to 32
]
PATHS = A.bf16_available_paths()
U = 2.0 ** -8


@pytest.fixture(params=PATHS)
def path(request):
    """Force one bf16 path for the test, then check that it (and no other) ran."""
    prev = A.set_bf16_path(request.param)
    A._bf16_ran(reset=True)
    try:
        yield request.param
        assert A._bf16_ran() == [request.param]
    finally:
        A.set_bf16_path(prev)


def bf16_round(x):
    """float32 -> nearest bf16 (ties to even), returned as float64; bf16 subnormals -> 0."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    r = np.where((r & 0x7F80) == 0, r & 0x8000, r)
    return (r << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def _inputs(B, T, C, seed, shift=0.0):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, 3 * C))
    qkv[..., :2 * C] += shift
    return qkv.astype(np.float32), rng.standard_normal((B, T, C)).astype(np.float32)


def _forward(qkv, NH, n_threads):
    B, T, C3 = qkv.shape
    C = C3 // 3
    out = np.full(B * T * C, np.nan, np.float32)     # NaN-filled: every entry must be written
    lse = np.full(B * NH * T, np.nan, np.float32)
    A.attention_forward_bf16(out, lse, qkv.ravel(), B, T, C, NH, n_threads)
    return out, lse


def _backward(dout, qkv, out, lse, NH, n_threads, dqkv=None):
    B, T, C3 = qkv.shape
    if dqkv is None:
        dqkv = np.zeros(qkv.size, np.float32)
    A.attention_backward_bf16(dqkv, dout.ravel(), qkv.ravel(), out, lse, B, T, C3 // 3, NH, n_threads)
    return dqkv


def _heads(x, NH):          # (B,T,NH*hs) -> (B,NH,T,hs)
    B, T, C = x.shape
    return x.reshape(B, T, NH, C // NH).transpose(0, 2, 1, 3)


def _unheads(x):            # (B,NH,T,hs) -> (B,T,NH*hs)
    B, NH, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, NH * hs)


def reference_and_bounds(qkv, dout, NH):
    """float64 reference on bf16-rounded q, k, v, dout, and the per-element error bounds above."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    s = 1.0 / np.sqrt(hs)
    g = (T + hs + 32) * 2.0 ** -24
    x = bf16_round(qkv).reshape(B, T, C3)
    do = bf16_round(dout).reshape(B, T, C)
    out = R.attention_forward(x, NH)
    lse = R.attention_lse(x, NH)
    dqkv = R.attention_backward(do, x, NH)
    q, k, v = (_heads(x[..., i * C:(i + 1) * C], NH) for i in range(3))
    dy, o = _heads(do, NH), _heads(out, NH)
    mask = np.tril(np.ones((T, T)))
    P = np.exp(np.where(mask > 0, (q @ k.transpose(0, 1, 3, 2)) * s - lse[..., None], -np.inf))
    e_s = g * s * ((np.abs(q) @ np.abs(k).transpose(0, 1, 3, 2)) * mask).max(axis=-1, keepdims=True)
    eP = 2 * e_s + 2 * g                                    # (B,NH,T,1): per query row
    t_out = (U + 2 * eP + g) * (P @ np.abs(v))
    dP = dy @ v.transpose(0, 1, 3, 2)
    D = (dy * o).sum(-1, keepdims=True)
    t_D = (np.abs(dy) * t_out).sum(-1, keepdims=True) + g * (np.abs(dy) * np.abs(o)).sum(-1, keepdims=True)
    dS = P * (dP - D) * s
    e_dS = (1 + U) * (U * np.abs(dS) + s * P * (eP * np.abs(dP - D)
                                                + g * (np.abs(dy) @ np.abs(v).transpose(0, 1, 3, 2)) + t_D))
    t_dq = e_dS @ np.abs(k) + g * (np.abs(dS) @ np.abs(k))
    t_dk = e_dS.transpose(0, 1, 3, 2) @ np.abs(q) + g * (np.abs(dS).transpose(0, 1, 3, 2) @ np.abs(q))
    t_dv = (U + eP.transpose(0, 1, 3, 2).max() + g) * (P.transpose(0, 1, 3, 2) @ np.abs(dy))
    bounds = {"out": _unheads(t_out), "lse": (e_s + 2 * g)[..., 0],
              "dqkv": np.concatenate([_unheads(t_dq), _unheads(t_dk), _unheads(t_dv)], axis=-1)}
    return {"out": out, "lse": lse, "dqkv": dqkv}, bounds


def _within(name, got, want, bound):
    err = np.abs(got.astype(np.float64).reshape(want.shape) - want)
    ratio = err / (bound + 1e-30)
    assert np.all(np.isfinite(got)), name
    assert ratio.max() <= 1.0, f"{name}: error {err.ravel()[ratio.argmax()]:.3g} exceeds its bound by {ratio.max():.3g}x"
    return ratio.max()


@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_matches_bf16_rounded_reference(B, T, C, NH, path):
    qkv, dout = _inputs(B, T, C, seed=T)
    ref, bound = reference_and_bounds(qkv, dout, NH)
    out, lse = _forward(qkv, NH, 2)
    dqkv = _backward(dout, qkv, out, lse, NH, 2)
    _within("out", out, ref["out"], bound["out"])
    _within("lse", lse, ref["lse"], bound["lse"])
    _within("dqkv", dqkv, ref["dqkv"], bound["dqkv"])


def test_bounds_are_not_vacuous():
    # the bounds are worst cases, but not loose by orders of magnitude: the observed error
    # reaches a visible fraction of them, while fp32 attention (no bf16 rounding of q, k, v, P)
    # on the same rounded inputs stays far inside, so bf16's own rounding is what is measured
    B, T, C, NH = 1, 130, 64, 1
    qkv, dout = _inputs(B, T, C, seed=5)
    ref, bound = reference_and_bounds(qkv, dout, NH)
    out, lse = _forward(qkv, NH, 1)
    dqkv = _backward(dout, qkv, out, lse, NH, 1)
    assert _within("out", out, ref["out"], bound["out"]) > 0.05
    assert _within("dqkv", dqkv, ref["dqkv"], bound["dqkv"]) > 0.02
    x = bf16_round(qkv).astype(np.float32)
    o32 = np.zeros(B * T * C, np.float32)
    A.attention_forward(o32, np.zeros(B * NH * T, np.float32), x.ravel(), B, T, C, NH, 1)
    assert _within("out fp32", o32, ref["out"], bound["out"]) < 0.05


def test_rounding_helper_is_round_to_nearest_even():
    # ties go to the even neighbour (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), past a tie rounds
    # up, bf16 subnormals flush to zero
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.5, 1e-39], np.float32)
    np.testing.assert_array_equal(bf16_round(x), [1.0, 1.0, 1 + 2 ** -6, 1 + 2 ** -7, -2.5, 0.0])


@pytest.mark.parametrize("shift", [50.0])
def test_large_scores_do_not_overflow(shift, path):
    # scores ~2e4 (q, k shifted by 50): exp overflows unless the running max is subtracted
    B, T, C, NH = 1, 70, 64, 1
    qkv, dout = _inputs(B, T, C, seed=9, shift=shift)
    ref, bound = reference_and_bounds(qkv, dout, NH)
    out, lse = _forward(qkv, NH, 1)
    _within("out", out, ref["out"], bound["out"])
    dqkv = _backward(dout, qkv, out, lse, NH, 1)
    assert np.all(np.isfinite(dqkv))


def test_bit_identical_across_thread_counts_and_repeats(path):
    B, T, C, NH = 2, 97, 128, 2
    qkv, dout = _inputs(B, T, C, seed=3)
    out1, lse1 = _forward(qkv, NH, 1)
    d1 = _backward(dout, qkv, out1, lse1, NH, 1)
    for nt in (2, 3, 8):
        out, lse = _forward(qkv, NH, nt)
        np.testing.assert_array_equal(out, out1)
        np.testing.assert_array_equal(lse, lse1)
        np.testing.assert_array_equal(_backward(dout, qkv, out, lse, NH, nt), d1)


def test_backward_accumulates(path):
    B, T, C, NH = 1, 40, 64, 2
    qkv, dout = _inputs(B, T, C, seed=4)
    out, lse = _forward(qkv, NH, 1)
    d = _backward(dout, qkv, out, lse, NH, 1)
    base = np.random.default_rng(1).standard_normal(qkv.size).astype(np.float32)
    np.testing.assert_array_equal(_backward(dout, qkv, out, lse, NH, 1, dqkv=base.copy()), base + d)


def test_backward_overwrites_when_asked(path):
    # accumulate=False: dqkv written whatever it held (NaN: never read), the bits of zero + d
    B, T, C, NH = 2, 70, 64, 2      # 70 rows: a ragged last block of 32
    qkv, dout = _inputs(B, T, C, seed=5)
    out, lse = _forward(qkv, NH, 2)
    d = _backward(dout, qkv, out, lse, NH, 2)
    got = np.full(qkv.size, np.nan, np.float32)
    A.attention_backward_bf16(got, dout.ravel(), qkv.ravel(), out, lse, B, T, C, NH, 2, accumulate=False)
    np.testing.assert_array_equal(got, d)


def test_bf16_qkv_gives_the_bits_of_its_fp32_values(path):
    # the bf16 model keeps qkv as the qkv matmul's bf16 output: packing it must equal packing
    # the fp32 values it rounds (subnormals flushed alike), forward and backward
    B, T, C, NH = 2, 45, 64, 2
    qkv, dout = _inputs(B, T, C, seed=6)
    qkv.ravel()[:6] = [1e-39, -1e-39, 3e-41, 0.0, -0.0, 1e-45]    # bf16 subnormals and zeros
    q16 = np.empty(qkv.size, np.uint16)
    convert.cast_to_bf16(q16, qkv.ravel(), 2)
    out, lse = _forward(qkv, NH, 2)
    out16, lse16 = np.full_like(out, np.nan), np.full_like(lse, np.nan)
    A.attention_forward_bf16(out16, lse16, q16, B, T, C, NH, 2)
    np.testing.assert_array_equal(out16, out)
    np.testing.assert_array_equal(lse16, lse)
    d = _backward(dout, qkv, out, lse, NH, 2)
    d16 = np.full(qkv.size, np.nan, np.float32)
    A.attention_backward_bf16(d16, dout.ravel(), q16, out, lse, B, T, C, NH, 2, accumulate=False)
    np.testing.assert_array_equal(d16, d)


@pytest.mark.parametrize("C,NH", [(64, 2), (30, 2), (15, 1)])   # hs even; odd, C even; both odd
def test_bf16_output_is_the_rounded_fp32_output(path, C, NH):
    # the bf16 model keeps the attention output in bf16 (attproj reads it rounded): the kernel
    # writes it rounded to nearest even, and the backward's D = dout . out reads it widened
    B, T = 2, 45
    qkv, dout = _inputs(B, T, C, seed=7)
    out, lse = _forward(qkv, NH, 2)
    o16, lse16 = np.full(out.size, 0xFFFF, np.uint16), np.full_like(lse, np.nan)
    A.attention_forward_bf16(o16, lse16, qkv.ravel(), B, T, C, NH, 2)
    want16 = np.empty(out.size, np.uint16)
    convert.cast_to_bf16(want16, out, 2)
    np.testing.assert_array_equal(o16, want16)
    np.testing.assert_array_equal(lse16, lse)
    widened = np.empty(out.size, np.float32)
    convert.widen_bf16(widened, o16, 2)
    d16 = np.full(qkv.size, np.nan, np.float32)
    A.attention_backward_bf16(d16, dout.ravel(), qkv.ravel(), o16, lse, B, T, C, NH, 2, accumulate=False)
    np.testing.assert_array_equal(d16, _backward(dout, qkv, widened, lse, NH, 2))
    with pytest.raises(ValueError, match="overlap"):
        A.attention_forward_bf16(qkv.ravel()[:B * T * C].view(np.uint16)[:B * T * C], lse16, qkv.ravel(),
                                 B, T, C, NH, 2)


@pytest.mark.parametrize("B,T,C,NH", [(2, 45, 64, 2), (3, 70, 30, 2)])
def test_backward_writes_bf16_dqkv_and_sums_the_bias_gradient(B, T, C, NH, path):
    # the bf16 model's qkv layer reads d(qkv) in bf16 and wants its bias gradient: the kernel
    # writes the rounding of the fp32 gradient it would write (convert.cast_to_bf16's bits) and
    # adds its column sums into dbias, the same bits for any thread count
    qkv, dout = _inputs(B, T, C, seed=10)
    out, lse = _forward(qkv, NH, 2)
    d32 = np.full(qkv.size, np.nan, np.float32)
    A.attention_backward_bf16(d32, dout.ravel(), qkv.ravel(), out, lse, B, T, C, NH, 2, accumulate=False)
    want16 = np.empty(qkv.size, np.uint16)
    convert.cast_to_bf16(want16, d32, 2)
    db0 = np.random.default_rng(1).standard_normal(3 * C).astype(np.float32)
    got = []
    for nt in (1, 3):
        d16, db = np.full(qkv.size, 0xFFFF, np.uint16), db0.copy()
        A.attention_backward_bf16(d16, dout.ravel(), qkv.ravel(), out, lse, B, T, C, NH, nt,
                                  accumulate=False, dbias=db)
        np.testing.assert_array_equal(d16, want16)
        got.append(db)
    np.testing.assert_array_equal(got[0], got[1])
    # exactly: each batch row's T rows summed in order in double, the batch rows' sums added in
    # order, then rounded to fp32 and added to dbias
    rows = np.add.accumulate(d32.reshape(B, T, 3 * C).astype(np.float64), axis=1)[:, -1]
    sums = np.add.accumulate(rows, axis=0)[-1]
    np.testing.assert_array_equal(got[0], db0 + sums.astype(np.float32))
    db = db0.copy()    # the fp32 output sums the same
    A.attention_backward_bf16(np.empty_like(d32), dout.ravel(), qkv.ravel(), out, lse, B, T, C, NH, 2,
                              accumulate=False, dbias=db)
    np.testing.assert_array_equal(db, got[0])
    with pytest.raises(ValueError, match="accumulate=False"):
        A.attention_backward_bf16(d16, dout.ravel(), qkv.ravel(), out, lse, B, T, C, NH, 2)
    with pytest.raises(ValueError, match="dbias has"):
        A.attention_backward_bf16(d16, dout.ravel(), qkv.ravel(), out, lse, B, T, C, NH, 2,
                                  accumulate=False, dbias=db[:-1])
    with pytest.raises(ValueError, match="overlap"):
        A.attention_backward_bf16(d32, dout.ravel(), qkv.ravel(), out, lse, B, T, C, NH, 2,
                                  accumulate=False, dbias=d32[:3 * C])


def test_nan_in_a_query_stays_in_its_row(path):
    # a NaN is not masked away as a -inf is: the row it is in comes out NaN, earlier rows and
    # the other head do not; backward carries it into the gradient
    B, T, C, NH = 1, 70, 64, 2
    qkv, dout = _inputs(B, T, C, seed=9)
    qkv[0, 40, 3] = np.nan                        # q of row 40, head 0
    out, lse = _forward(qkv, NH, 2)
    o = out.reshape(T, NH, C // NH)
    assert np.isnan(o[40, 0]).all() and np.isnan(lse.reshape(NH, T)[0, 40])
    assert np.isfinite(o[:40]).all() and np.isfinite(o[:, 1]).all()
    assert np.isnan(_backward(dout, qkv, out, lse, NH, 2)).any()


def test_paths_agree_far_closer_than_with_fp32_attention():
    # same rounding points on every path; only the order of fp32 additions differs (which can
    # move a P or dS across a bf16 rounding boundary, rarely), so the paths agree far more
    # closely than any of them agrees with fp32 attention
    B, T, C, NH = 1, 130, 128, 2
    qkv, dout = _inputs(B, T, C, seed=8)
    prev = A.bf16_path()
    res = {}
    try:
        for p in PATHS:
            A.set_bf16_path(p)
            out, lse = _forward(qkv, NH, 2)
            res[p] = (out, _backward(dout, qkv, out, lse, NH, 2))
    finally:
        A.set_bf16_path(prev)
    o32 = np.zeros(B * T * C, np.float32)
    A.attention_forward(o32, np.zeros(B * NH * T, np.float32), qkv.ravel(), B, T, C, NH, 1)
    gap32 = np.abs(res["emulated"][0] - o32).max()
    assert gap32 > 1e-3
    for p in PATHS:
        assert np.abs(res[p][0] - res["emulated"][0]).max() < gap32 / 20, p
        assert np.abs(res[p][1] - res["emulated"][1]).max() < 1e-3 * np.abs(res["emulated"][1]).max(), p


def test_no_t_by_t_allocation():
    T, C, NH = 4096, 64, 1
    assert A.bf16_backward_scratch_bytes(1, T, C, NH) < 18 * T * C * 2  # O(T*hs), not T*T
    assert A.bf16_forward_scratch_bytes(1, T, C, NH) < 8 * T * C * 2
    for f in (A.bf16_backward_scratch_bytes, A.bf16_forward_scratch_bytes):   # linear in T
        assert f(1, 2 * T, C, NH) <= 2 * f(1, T, C, NH)
        assert f(8, T, C, NH) == f(1, T, C, NH)     # per thread only: each head packs its own rows
    # the run: half the rows and hs=32, an eighth of the work (the emulated AMX copy is slow);
    # its O(T*hs) scratch (traced: PyMem_RawMalloc) is still under a fifth of a T x T fp32 buffer
    T, C = T // 2, 32
    assert max(A.bf16_backward_scratch_bytes(1, T, C, NH), A.bf16_forward_scratch_bytes(1, T, C, NH)) < 4 * T * T // 5
    qkv, dout = _inputs(1, T, C, seed=2)
    out = np.zeros(T * C, np.float32)
    lse = np.zeros(T * NH, np.float32)
    dqkv = np.zeros(qkv.size, np.float32)
    tracemalloc.start()
    try:
        A.attention_forward_bf16(out, lse, qkv.ravel(), 1, T, C, NH, 1)
        A.attention_backward_bf16(dqkv, dout.ravel(), qkv.ravel(), out, lse, 1, T, C, NH, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < T * T                # a T x T fp32 buffer would be 4 T^2 bytes


def test_bad_arguments_raise_value_error():
    out = np.zeros(12, np.float32)
    lse = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="not divisible"):
        A.attention_forward_bf16(out, lse, np.zeros(36, np.float32), 1, 1, 12, 5, 1)
    with pytest.raises(ValueError, match="qkv"):
        A.attention_forward_bf16(out, lse, np.zeros(35, np.float32), 1, 1, 12, 2, 1)
    with pytest.raises(ValueError, match="dout"):
        A.attention_backward_bf16(np.zeros(36, np.float32), np.zeros(11, np.float32),
                                  np.zeros(36, np.float32), out, lse, 1, 1, 12, 2, 1)
    A.attention_forward_bf16(np.zeros(0, np.float32), np.zeros(0, np.float32),
                             np.zeros(0, np.float32), 0, 4, 12, 2, 1)   # empty batch: a no-op


def test_path_selection_api():
    assert PATHS[0] == "emulated"
    prev = A.set_bf16_path("emulated")
    try:
        assert A.bf16_path() == "emulated"
        assert A.set_bf16_path(None) == "emulated"
        assert A.bf16_path() == A.bf16_best_path() == PATHS[-1]
        with pytest.raises(ValueError, match="unknown bf16 path"):
            A.set_bf16_path("avx9000")
        for name in A.BF16_PATHS:
            if name not in PATHS:
                with pytest.raises(ValueError, match="not available"):
                    A.set_bf16_path(name)
    finally:
        A.set_bf16_path(prev)


@pytest.mark.parametrize("value", ["emulated", "bogus"])
def test_env_var_read_at_import(value):
    code = "from llmctl._ext import attention as A; print(A.bf16_path())"
    env = {**os.environ, "LLMCTL_ATT_BF16": value}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if value == "bogus":
        assert r.stdout.strip() == PATHS[-1] and "unknown bf16 path" in r.stderr
    else:
        assert r.stdout.strip() == value


def test_bf16_dout_gives_the_bits_of_its_fp32_values(path):
    # the bf16 model's attproj backward GEMM writes d(atty) in bf16: the backward must give the
    # bits it gives the fp32 dout that rounds to it (subnormals flushed as the packing flushes)
    B, T, C, NH = 2, 45, 64, 2
    qkv, dout = _inputs(B, T, C, seed=7)
    dout.ravel()[:6] = [1e-39, -1e-39, 3e-41, 0.0, -0.0, 1e-45]
    out, lse = _forward(qkv, NH, 2)
    d16 = np.empty(dout.size, np.uint16)
    convert.cast_to_bf16(d16, dout.ravel(), 2)
    runs = []
    for d in (dout.ravel(), d16):
        dq, db = np.full(qkv.size, 0xFFFF, np.uint16), np.zeros(3 * C, np.float32)
        A.attention_backward_bf16(dq, d, qkv.ravel(), out, lse, B, T, C, NH, 2, accumulate=False, dbias=db)
        runs.append((dq, db))
    np.testing.assert_array_equal(runs[1][0], runs[0][0])
    np.testing.assert_array_equal(runs[1][1], runs[0][1])
    assert np.any(runs[0][1] != 0)
    with pytest.raises(ValueError, match="dout"):
        A.attention_backward_bf16(runs[0][0], d16[:-1], qkv.ravel(), out, lse, B, T, C, NH, 2, accumulate=False)


def test_bf16_model_runs_the_bf16_attention_and_fp32_does_not(monkeypatch):
    from llmctl._ext import matmul
    from llmctl.model import GPT2, GPT2Config, init_llmc_

    if not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    cfg = GPT2Config(max_seq_len=40, vocab_size=100, padded_vocab_size=128, num_layers=1, num_heads=2, channels=64)
    x = np.random.default_rng(0).integers(0, 100, (2, 41))
    for precision, want in (("fp32", []), ("bf16", [A.bf16_path()])):
        m = GPT2(cfg, n_threads=1, precision=precision)
        init_llmc_(m.p, cfg, n_threads=1)
        m.params_changed()
        A._bf16_ran(reset=True)
        m.zero_grad()
        m.forward(x[:, :-1], x[:, 1:])
        m.backward()
        assert A._bf16_ran() == want, precision


def test_bf16_results_do_not_depend_on_the_fp32_kernel_set(path):
    # the bf16 kernels' exp is their own loop (the "default" set's polynomial), not the active
    # fp32 set's: forcing another set (LLMCTL_ATT_ISA) leaves their bits unchanged
    B, T, C, NH = 1, 70, 64, 1
    qkv, dout = _inputs(B, T, C, seed=6)
    prev = A.isa()
    got = []
    try:
        for isa in A.available_isas():
            A.set_isa(isa)
            out, lse = _forward(qkv, NH, 1)
            got.append((out, lse, _backward(dout, qkv, out, lse, NH, 1)))
    finally:
        A.set_isa(prev)
    for g in got[1:]:
        for x, y in zip(g, got[0]):
            np.testing.assert_array_equal(x, y)
