"""llmctl.rand vs llm.c's llmc/rand.h: its documented test vectors and a gcc-compiled C restatement.

normal_'s math paths: the default (llmctl._ext.randinit, libm through Cython), libm=False (NumPy,
correctly rounded), the ctypes libm path (libm="ctypes", what libm=True falls back to) and the
fallback when the extension is missing (in a subprocess where importing it fails).
"""
import inspect
import shutil
import struct
import subprocess

import numpy as np
import pytest
from conftest import without_module
from errcheck import raises_error

import llmctl.rand as rand_mod
from llmctl._ext import randinit  # part of the build: a missing extension must fail, not skip
from llmctl.errors import FormatError
from llmctl.rand import STATE_STRUCT_BYTES, Mt19937, random_permutation


def test_randint32_vectors():
    r = Mt19937(137)
    assert [r.randint32() for _ in range(5)] == [4053805790, 2173880614, 380293709, 1237255315, 2986595568]
    r = Mt19937(137)
    assert r.randint32_array(5).tolist() == [4053805790, 2173880614, 380293709, 1237255315, 2986595568]


@pytest.mark.parametrize("libm", [None, False, True, "ctypes"])
def test_normal_vectors(libm):
    # llm.c / PyTorch vectors (rand.h header comment); printed with 5-7 digits there, and
    # PyTorch's own float math may differ in the last ulp, hence 1e-6 absolute.
    r = Mt19937(137)
    r.randint32_array(5)
    n8 = r.normal_(8, libm=libm)
    np.testing.assert_allclose(n8[:4], [0.7947664260864258, 1.4369317293167114, -0.2292192131280899,
                                        0.47556325793266296], atol=1e-6)
    assert r.randint32() == 2186503452
    n16 = r.normal_(16, libm=libm)
    np.testing.assert_allclose(n16[[0, 1, 15]], [-1.2813878059387207, -2.646395683288574,
                                                0.3961987793445587], atol=1e-6)
    assert r.randint32() == 2756748748


def test_permutation_vectors():
    # llmc/dataloader.h: tinyshakespeare train, B=4, T=64: 1192 samples; seed 42 (rank 0) and 43 (rank 1 of 2, 596)
    a = np.arange(1192, dtype=np.int32)
    r = Mt19937(42)
    random_permutation(a, r)
    assert a[:6].tolist() == [408, 791, 914, 1057, 81, 450]
    assert sorted(a.tolist()) == list(range(1192))
    b = np.arange(596, dtype=np.int32)
    random_permutation(b, Mt19937(43))
    assert b[:3].tolist() == [251, 260, 93]
    # consumes exactly n-1 words
    r1, r2 = Mt19937(7), Mt19937(7)
    random_permutation(np.arange(10), r1)
    r2.randint32_array(9)
    assert r1.randint32() == r2.randint32()


def test_state_bytes_round_trip():
    r = Mt19937(42)
    b0 = r.get_state_bytes()
    assert len(b0) == STATE_STRUCT_BYTES
    seed_, left, nxt = struct.unpack_from("<QiI", b0)
    assert (left, nxt) == (1, 0)  # as manual_seed leaves it
    assert struct.unpack_from("<2I", b0, 2512) == (0, 0x9908B0DF)
    for k in (1, 623, 1):  # mid-block, end of block (left 1, next 624), start of next block
        r.randint32_array(k)
        b = r.get_state_bytes()
        r2 = Mt19937(1)
        r2.set_state_bytes(b)
        assert r2.get_state_bytes() == b
        assert r2.randint32_array(700).tolist() == r.randint32_array(700).tolist()
    _, left, nxt = struct.unpack_from("<QiI", r.get_state_bytes())
    assert left + nxt == 625


def test_state_bytes_rejects_garbage():
    r = Mt19937(1)
    with raises_error(FormatError, names=["2520", "100"], hint=None):
        r.set_state_bytes(b"\0" * 100)
    with raises_error(FormatError, names="MATRIX_A", hint=None):
        r.set_state_bytes(b"\0" * STATE_STRUCT_BYTES)
    good = bytearray(Mt19937(5).get_state_bytes())
    struct.pack_into("<iI", good, 8, 300, 5)
    with raises_error(FormatError, names=["left_", "300"], hint=None):
        r.set_state_bytes(bytes(good))


# A C restatement of rand.h's arithmetic (seeding, twist, tempering, randfloat32/64, Box-Muller
# with the n%16 tail redo and the n<16 path), compiled with gcc -O2, printing raw float bits.
# C_CORE is also used by test_model.py for the llm.c init check.
C_CORE = r"""
#include <math.h>
#include <stdio.h>
#include <stdint.h>
static uint32_t st[624]; static int left_ = 1; static uint32_t next_ = 0;
static void seed(uint32_t s) { st[0] = s; for (uint32_t j = 1; j < 624; j++) st[j] = 1812433253u * (st[j-1] ^ (st[j-1] >> 30)) + j; left_ = 1; next_ = 0; }
static void twist(void) {
  left_ = 624; next_ = 0;
  for (int j = 0; j < 624; j++) {
    uint32_t y = (st[j] & 0x80000000u) | (st[(j + 1) % 624] & 0x7fffffffu);
    st[j] = st[(j + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
  }
}
static uint32_t u32(void) {
  if (--left_ <= 0) twist();
  uint32_t y = st[next_++];
  y ^= y >> 11; y ^= (y << 7) & 0x9d2c5680u; y ^= (y << 15) & 0xefc60000u; y ^= y >> 18; return y;
}
static float f32(void) { return (u32() & 0xffffffu) * (1.0f / 16777216.0f); }
static double f64(void) { uint64_t a = u32(); uint64_t b = u32(); return ((a << 32 | b) & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0); }
static void bm16(float *d, float mean, float std) {
  for (int t = 0; t < 8; t++) {
    float a = 1 - d[t]; float b = d[t + 8];
    float r = sqrtf(-2 * logf(a + 1e-12)); float th = 2.0 * M_PI * b;
    d[t] = r * cosf(th) * std + mean; d[t + 8] = r * sinf(th) * std + mean;
  }
}
static void normal(float *d, unsigned n, float mean, float std) {
  if (n >= 16) {
    for (unsigned i = 0; i < n; i++) d[i] = f32();
    for (unsigned i = 0; i + 16 <= n; i += 16) bm16(d + i, mean, std);
    if (n % 16) { float *e = d + n - 16; for (int i = 0; i < 16; i++) e[i] = f32(); bm16(e, mean, std); }
  } else {
    double nx = 0; int has = 0;
    for (unsigned t = 0; t < n; t++) {
      if (has) { d[t] = (float)(nx * std + mean); has = 0; continue; }
      float a = f64(); float b = f64();
      float r = sqrtf(-2 * logf(1 - b + 1e-12)); float th = 2.0 * M_PI * a;
      nx = r * sinf(th); has = 1; d[t] = r * cosf(th) * std + mean;
    }
  }
}
"""

C_PROG = C_CORE + r"""
static float buf[5000];
static void dump(unsigned n) { for (unsigned i = 0; i < n; i++) { uint32_t b; __builtin_memcpy(&b, &buf[i], 4); printf("%u ", b); } printf("\n"); }
int main(void) {
  seed(137);
  for (int i = 0; i < 5; i++) printf("%u ", u32()); printf("\n");
  unsigned sizes[] = {8, 16, 37, 7, 1, 4099};
  for (int k = 0; k < 6; k++) { normal(buf, sizes[k], k == 5 ? 0.0f : 0.5f, k == 5 ? 0.02f : 1.5f); dump(sizes[k]); printf("%u\n", u32()); }
  return 0;
}
"""


@pytest.fixture(scope="module")
def c_output(tmp_path_factory):
    from conftest import require

    require(shutil.which("gcc") is not None, "gcc is not installed (looked for it on PATH)")
    d = tmp_path_factory.mktemp("randc")
    (d / "r.c").write_text(C_PROG)
    subprocess.run(["gcc", "-O2", "-o", str(d / "r"), str(d / "r.c"), "-lm"], check=True)
    return subprocess.run([str(d / "r")], check=True, capture_output=True, text=True).stdout.split("\n")


def _python_sequence(libm):
    r = Mt19937(137)
    lines = [r.randint32_array(5).tolist()]
    for k, n in enumerate([8, 16, 37, 7, 1, 4099]):
        mean, std = (0.0, 0.02) if k == 5 else (0.5, 1.5)
        lines.append(r.normal_(n, mean, std, libm=libm))
        lines.append(r.randint32())
    return lines


def _c_normals(c_output, i):
    return np.array([int(x) for x in c_output[1 + 2 * i].split()], dtype=np.uint32)


def _assert_bit_identical(c_output, py):
    assert [int(x) for x in c_output[0].split()] == py[0]
    for i in range(6):
        assert py[1 + 2 * i].view(np.uint32).tolist() == _c_normals(c_output, i).tolist(), f"normal_ call {i}"
        assert int(c_output[2 + 2 * i]) == py[2 + 2 * i]


def test_against_c_default_exact(c_output):
    # the default path (llmctl._ext.randinit) calls the same logf/cosf/sinf/sqrtf that gcc links
    # against, with rand.h's types and operation order: every bit must agree, for both the
    # 16-block path (incl. the n % 16 tail redo, mean 0.5 so an FMA contraction would show) and
    # the n < 16 float64 path
    _assert_bit_identical(c_output, _python_sequence(libm=None))


def test_against_c_ctypes_libm_exact(c_output):
    # the ctypes libm path (libm=True's fallback), also bit-identical (slow, memoised)
    _assert_bit_identical(c_output, _python_sequence(libm="ctypes"))
    rand_mod.release_libm_memo()


def _assert_within_ulps(c_output, py):
    # correctly rounded log/cos/sin vs glibc's float versions, which round differently on ~1% of
    # inputs; that moves a normal draw by a few float32 ulps at most (one ulp in each of log,
    # sqrt, cos/sin and the products). Most draws must be identical.
    total = same = 0
    for i in range(6):
        c = _c_normals(c_output, i).view(np.float32)
        p = py[1 + 2 * i]
        np.testing.assert_allclose(p, c, rtol=4 * 2.0 ** -23, atol=1e-30)
        total += c.size
        same += int((p.view(np.uint32) == c.view(np.uint32)).sum())
        assert int(c_output[2 + 2 * i]) == py[2 + 2 * i]  # same number of words consumed
    assert same / total > 0.9


def test_against_c_numpy_within_ulps(c_output):
    _assert_within_ulps(c_output, _python_sequence(libm=False))


def test_fallback_without_extension(c_output):
    # default math with the extension missing: NumPy math, one RuntimeWarning, same words drawn
    (py, want), warned = without_module("llmctl._ext.randinit", "from llmctl.rand import Mt19937\n"
                                        + inspect.getsource(_python_sequence)
                                        + "result = (_python_sequence(None), _python_sequence(False))")
    assert len(warned) == 1 and "randinit is not built" in warned[0], warned
    _assert_within_ulps(c_output, py)
    for a, b in zip(py[1::2], want[1::2]):
        assert a.tobytes() == b.tobytes()


def test_unknown_libm_choice_is_refused():
    with raises_error(ValueError, names="'glibc'", hint=None):
        Mt19937(1).normal_(4, libm="glibc")


def test_extension_threads_and_validation():
    # 16-blocks are independent: the bits do not depend on n_threads (8192 blocks > the
    # 4096-block threshold, so the prange path runs)
    a = Mt19937(3).normal_(8192 * 16 + 5, 0.0, 0.02, n_threads=1)
    b = Mt19937(3).normal_(8192 * 16 + 5, 0.0, 0.02, n_threads=2)
    assert a.tobytes() == b.tobytes()
    with raises_error(ValueError, names="16", hint=None):
        randinit.box_muller16(np.zeros((2, 8), dtype=np.float32), 0.0, 1.0)
    with raises_error(ValueError, names=["n_threads", "0"], hint=None):
        randinit.box_muller16(np.zeros((2, 16), dtype=np.float32), 0.0, 1.0, 0)
    with raises_error(ValueError, names=["8", "7"], hint=None):
        randinit.normal_small(np.zeros(6), np.zeros(7, dtype=np.float32), 0.0, 1.0)
    d = np.zeros((1, 16), dtype=np.float32)  # u1 = 1 - 0 = 1 -> radius sqrtf(-2 logf(1)) = 0
    randinit.box_muller16(d, 0.5, 2.0)
    assert (d == 0.5).all()


def test_normal_in_place_and_errors():
    a = np.zeros((3, 16), dtype=np.float32)
    out = Mt19937(1).normal_(a, 0.0, 0.02)
    assert out is a and a.std() > 0
    np.testing.assert_array_equal(a.reshape(-1), Mt19937(1).normal_(48, 0.0, 0.02))
    with pytest.raises(TypeError):
        Mt19937(1).normal_(np.zeros(16))
