"""bf16 mixed-precision kernels: the fp32 -> bf16 cast, bf16 matmul with fp32 accumulation, the
producers that write bf16 themselves (layernorm, GELU, the loss backward, AdamW's weight copy).

References. `to_bf16` below rounds to nearest even by comparing the two neighbouring bf16 values
in float64 (not the bit trick the kernels use); NumPy products of inputs rounded that way, in
float64, are the matmul reference, with the float32 dot bound of test_kernels.py (bf16 x bf16
products are exact in float32, so only the fp32 accumulation rounds). Kernels that compute an
fp32 value and write it as bf16 must give exactly to_bf16(their fp32 kernel's output).

The "dnnl" bf16 engine runs only on CPUs with AVX512_BF16 or AMX; "blas" (fp32 sgemm on the
widened operands) everywhere, so both are tested where they exist.
"""
import contextlib
import json

import numpy as np
import pytest
from errcheck import assert_cli_error, raises_error

import reference as ref
from test_kernels import _assert_dot_close, _f32  # the float32 dot-product error bound
from llmctl._ext import adamw, buildinfo, convert, layers, matmul

U32 = 2.0 ** -24
BF16_ENGINES = list(matmul.get_bf16_engines())


@pytest.fixture(autouse=True)
def _all_threads():
    old = [mod.set_parallel_grain(0) for mod in (layers, matmul, adamw, convert)]
    yield
    for mod, g in zip((layers, matmul, adamw, convert), old):
        mod.set_parallel_grain(g)


@pytest.fixture(params=[2048, 7], ids=["wblock2048", "wblock7"])
def widen_block(request):
    """The "blas" bf16 engine widens weights in blocks of rows: one block, and several + a remainder."""
    old = matmul.set_widen_block(request.param)
    yield request.param
    matmul.set_widen_block(old)


def to_bf16(x):
    """float32 array -> uint16 bf16 bits, round to nearest, ties to even (NaN -> 0x7FC0)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    lo = (u >> 16).astype(np.uint64)                # truncated toward zero (sign-magnitude)
    hi = lo + 1                                     # next bf16 away from zero
    mag = lambda h: np.where((h & 0x7FFF) == 0x7F80, 2.0 ** 128,   # round to inf as if unbounded
                             np.abs((((h & 0x7FFF) << 16).astype(np.uint32)).view(np.float32).astype(np.float64)))
    with np.errstate(invalid="ignore"):   # NaN inputs (signalling ones warn as they widen): replaced below
        ax = np.abs(x.astype(np.float64))
        d_lo, d_hi = ax - mag(lo), mag(hi) - ax
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    out = np.where(pick_hi, hi, lo).astype(np.uint16)
    out[np.isinf(x)] = (u[np.isinf(x)] >> 16).astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def from_bf16(h):
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)




# ---------------------------------------------------------------------------------------------
# the cast

def test_cast_rounds_to_nearest_even_like_torch():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        _f32(rng, 50000, scale=3.0),
        rng.standard_normal(20000).astype(np.float32) * np.float32(1e-39),   # subnormals
        np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38,
                  1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20], np.float32),
    ])
    # exact ties: bf16 values plus half an ulp (0x8000 in the dropped bits), both parities
    base = rng.integers(0, 0x7F00, 2000).astype(np.uint32) << 16
    x = np.concatenate([x, (base | 0x8000).view(np.float32), (base | 0x18000).view(np.float32)])
    # NaNs of every sign and payload (quiet and signalling) all become the one quiet NaN
    nans = np.array([0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC12345], np.uint32)
    x = np.concatenate([x, nans.view(np.float32)])
    got = np.empty(x.size, np.uint16)
    t = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, np.nan, 3.4028235e38], np.float32)
    try:
        for level in range(convert.set_isa(-1) + 1):   # every copy this CPU runs (rows.h's)
            assert convert.set_isa(level) == level
            for n in (1, 2):
                got[:] = 0
                convert.cast_to_bf16(got, x, n)
                np.testing.assert_array_equal(got, to_bf16(x), err_msg=f"copy {level}, {n} thread(s)")
            assert set(got[-nans.size:].tolist()) == {0x7FC0}
            # the cases torch documents: ties to even, NaN to the quiet NaN, overflow of the max to inf
            convert.cast_to_bf16(got[:4], t)
            assert list(got[:4]) == [0x3F80, 0x3F82, 0x7FC0, 0x7F80]
    finally:
        convert.set_isa(-1)


def test_widen_is_exact_and_inverts_the_cast():
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, np.float32)
    convert.widen_bf16(out, bits, 2)
    np.testing.assert_array_equal(out.view(np.uint32), bits.astype(np.uint32) << 16)
    back = np.empty(bits.size, np.uint16)
    convert.cast_to_bf16(back, out, 2)
    finite = ~np.isnan(out)
    np.testing.assert_array_equal(back[finite], bits[finite])


def test_cast_rejects_bad_lengths():
    with pytest.raises(ValueError, match="out has 3 elements, expected 4"):
        convert.cast_to_bf16(np.zeros(3, np.uint16), np.zeros(4, np.float32))


# ---------------------------------------------------------------------------------------------
# matmul

MM_SHAPES = [(1, 1, 1), (7, 13, 33), (9, 300, 17), (24, 40, 270), (261, 24, 20)]


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("shape", MM_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_forward_bf16_matches_rounded_reference(engine, shape, with_bias, widen_block):
    BT, C, OC = shape
    rng = np.random.default_rng(BT * 1000 + C + OC)
    inp, w, b = _f32(rng, BT, C), _f32(rng, OC, C), _f32(rng, OC)
    ib, wb = to_bf16(inp), to_bf16(w)
    out = np.full(BT * OC, np.nan, np.float32)
    matmul.matmul_forward_bf16(out, ib.ravel(), wb.ravel(), b if with_bias else None, BT, C, OC,
                               n_threads=2, engine=engine)
    x64, w64 = from_bf16(ib).astype(np.float64), from_bf16(wb).astype(np.float64)
    want = ref.matmul_forward(x64, w64, b.astype(np.float64) if with_bias else None)
    terms = np.abs(x64) @ np.abs(w64).T + (np.abs(b) if with_bias else 0.0)
    _assert_dot_close(out.reshape(BT, OC), want, terms, C, f"matmul_forward_bf16[{engine}]")
    # and it really is the bf16 product: the fp32 product differs by far more than the bound
    if BT * C > 100:
        full = ref.matmul_forward(inp.astype(np.float64), w.astype(np.float64))
        assert np.abs(full - (want - (b if with_bias else 0))).max() > 1e-3


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("shape", MM_SHAPES)
def test_matmul_backward_bf16_casts_dout_and_accumulates(engine, shape, widen_block):
    BT, C, OC = shape
    rng = np.random.default_rng(BT + 7 * C + 13 * OC)
    inp, w, dout = _f32(rng, BT, C), _f32(rng, OC, C), _f32(rng, BT, OC)
    dinp0, dw0, db0 = _f32(rng, BT, C), _f32(rng, OC, C), _f32(rng, OC)
    dinp, dw, db = dinp0.ravel().copy(), dw0.ravel().copy(), db0.copy()
    dout_bf16 = np.zeros(BT * OC, np.uint16)
    ib, wb = to_bf16(inp), to_bf16(w)
    matmul.matmul_backward_bf16(dinp, dw, db, dout.ravel(), dout_bf16, ib.ravel(), wb.ravel(),
                                BT, C, OC, n_threads=2, engine=engine)
    np.testing.assert_array_equal(dout_bf16, to_bf16(dout).ravel())
    d64 = from_bf16(to_bf16(dout)).astype(np.float64)
    x64, w64 = from_bf16(ib).astype(np.float64), from_bf16(wb).astype(np.float64)
    rdx, rdw, _ = ref.matmul_backward(d64, x64, w64)
    _assert_dot_close(dinp.reshape(BT, C), dinp0 + rdx, np.abs(dinp0) + np.abs(d64) @ np.abs(w64), OC, "dinp")
    _assert_dot_close(dw.reshape(OC, C), dw0 + rdw, np.abs(dw0) + np.abs(d64).T @ np.abs(x64), BT, "dweight")
    # dbias is summed from the fp32 dout, exactly as the fp32 kernel sums it
    db32 = db0.copy()
    matmul.matmul_backward(None, np.zeros(OC * C, np.float32), db32, dout.ravel(), inp.ravel(), w.ravel(),
                           BT, C, OC, engine="blas")
    np.testing.assert_array_equal(db, db32)


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("shape", MM_SHAPES + [(600, 24, 40), (600, 24, 1100)])
def test_matmul_backward_bf16_overwrites_dinp_when_asked(engine, shape, widen_block):
    # accumulate=False: dinp = dout @ W whatever it held (NaN here: a beta-0 GEMM never reads
    # it), the same as accumulating into zeros; dweight still accumulates. On "dnnl" above 512
    # rows a written dX with K <= 1024 runs on the primitive, an accumulated one on the gemm
    # call (600 x 40): the same products in another order, so there only the bound holds
    BT, C, OC = shape
    rng = np.random.default_rng(BT + 3 * C + 5 * OC)
    ib, wb, d16 = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C)), to_bf16(_f32(rng, BT, OC))
    dw0 = _f32(rng, OC, C).ravel()
    runs = []
    for accumulate, start in ((True, 0.0), (False, np.nan)):
        dinp, dw = np.full(BT * C, start, np.float32), dw0.copy()
        matmul.matmul_backward_bf16(dinp, dw, None, None, d16.ravel(), ib.ravel(), wb.ravel(), BT, C, OC,
                                    n_threads=2, engine=engine, accumulate=accumulate)
        runs.append((dinp, dw))
    if not (engine == "dnnl" and BT > 512 and OC <= 1024):
        np.testing.assert_array_equal(runs[1][0], runs[0][0])
    np.testing.assert_array_equal(runs[1][1], runs[0][1])
    assert not np.array_equal(runs[1][1], dw0)
    x64, w64, d64 = (from_bf16(a).astype(np.float64) for a in (ib, wb, d16))
    _assert_dot_close(runs[1][0].reshape(BT, C), d64 @ w64, np.abs(d64) @ np.abs(w64), OC, "dinp")


@pytest.mark.parametrize("engine", BF16_ENGINES)
def test_matmul_backward_bf16_reads_a_precast_dout(engine):
    BT, C, OC = 12, 20, 30
    rng = np.random.default_rng(4)
    ib, wb = to_bf16(_f32(rng, BT * C)), to_bf16(_f32(rng, OC * C))
    db16 = to_bf16(_f32(rng, BT * OC))
    dw = np.zeros(OC * C, np.float32)
    matmul.matmul_backward_bf16(None, dw, None, None, db16, ib, wb, BT, C, OC, engine=engine)
    want = from_bf16(db16).reshape(BT, OC).astype(np.float64).T @ from_bf16(ib).reshape(BT, C)
    np.testing.assert_allclose(dw.reshape(OC, C), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dbias needs the fp32 dout"):
        matmul.matmul_backward_bf16(None, dw, np.zeros(OC, np.float32), None, db16, ib, wb, BT, C, OC,
                                    engine=engine)


DNNL_ENGINES = [b for b in BF16_ENGINES if b != "blas"]
needs_native = pytest.mark.skipif(not DNNL_ENGINES, reason="no native bf16 here: the oneDNN engines "
                                  "are refused (test_bf16_engines_follow_the_cpu); blas tested above")


def _forward_backward(engine, BT, C, OC, n_threads, seed, with_bias=True):
    """One forward and one accumulating backward on `engine`, each checked against float64
    products of the bf16-rounded inputs with the float32 dot bound."""
    rng = np.random.default_rng(seed)
    ib, wb = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C))
    b, d16 = _f32(rng, OC), to_bf16(_f32(rng, BT, OC))
    x64, w64, d64 = (from_bf16(a).astype(np.float64) for a in (ib, wb, d16))
    out = np.full(BT * OC, np.nan, np.float32)
    matmul.matmul_forward_bf16(out, ib.ravel(), wb.ravel(), b if with_bias else None, BT, C, OC,
                               n_threads=n_threads, engine=engine)
    want = ref.matmul_forward(x64, w64, b.astype(np.float64) if with_bias else None)
    terms = np.abs(x64) @ np.abs(w64).T + (np.abs(b) if with_bias else 0.0)
    _assert_dot_close(out.reshape(BT, OC), want, terms, C, f"forward[{engine}]")
    dinp0, dw0 = _f32(rng, BT, C), _f32(rng, OC, C)    # accumulate into non-zero gradients
    dinp, dw = dinp0.ravel().copy(), dw0.ravel().copy()
    matmul.matmul_backward_bf16(dinp, dw, None, None, d16.ravel(), ib.ravel(), wb.ravel(), BT, C, OC,
                                n_threads=n_threads, engine=engine)
    rdx, rdw, _ = ref.matmul_backward(d64, x64, w64)
    _assert_dot_close(dinp.reshape(BT, C), dinp0 + rdx, np.abs(dinp0) + np.abs(d64) @ np.abs(w64), OC, "dinp")
    _assert_dot_close(dw.reshape(OC, C), dw0 + rdw, np.abs(dw0) + np.abs(d64).T @ np.abs(x64), BT, "dweight")
    return out, dinp, dw


@needs_native
@pytest.mark.parametrize("engine", DNNL_ENGINES)
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("shape", [(5, 7, 3), (17, 96, 50257), (64, 130, 257), (300, 33, 40)])
def test_matmul_bf16_dnnl_engines_match_rounded_reference(engine, n_threads, shape):
    # odd shapes, an lm-head-sized N (the GPT-2 vocabulary), 1 and 2 threads, both oneDNN paths
    BT, C, OC = shape
    _forward_backward(engine, BT, C, OC, n_threads, seed=BT + C + OC)


@pytest.fixture
def dw_on_primitive():
    """dW on the matmul primitive at these tests' few rows, whatever this CPU's default (AMX: yes,
    else no): the cache tests count three primitives per forward + backward."""
    old = matmul.set_bf16_primitive_dw_rows(512)
    yield
    matmul.set_bf16_primitive_dw_rows(old)


@needs_native
def test_matmul_bf16_primitive_cache_reuses_and_keys_each_call(dw_on_primitive):
    # "dnnl" builds one oneDNN matmul primitive per (shape, transposes, bias, accumulation,
    # threads) and passes the operands at each call: a second call with new data reuses the
    # primitive and must not see the first call's buffers; a new bias/thread/shape key builds one
    BT, C, OC = 40, 72, 56
    _forward_backward("dnnl", BT, C, OC, 2, seed=1)
    built = matmul.dnnl_matmul_builds()
    for seed in (2, 3):
        _forward_backward("dnnl", BT, C, OC, 2, seed=seed)
    assert matmul.dnnl_matmul_builds() == built          # fwd+bias, dX, dW: all reused
    _forward_backward("dnnl", BT, C, OC, 2, seed=4, with_bias=False)
    assert matmul.dnnl_matmul_builds() == built + 1      # only the forward without bias is new
    _forward_backward("dnnl", BT, C, OC, 1, seed=5)
    assert matmul.dnnl_matmul_builds() == built + 4      # one thread: three more


@needs_native
def test_matmul_bf16_primitive_cache_evicts_and_rebuilds(dw_on_primitive):
    # more shapes than the cache holds (64): the least recently used are rebuilt, results stay right
    first = _forward_backward("dnnl", 5, 5, 7, 1, seed=0)   # BT > 4: no GEMV
    for k in range(30):     # 3 primitives each
        _forward_backward("dnnl", 6 + k, 5, 7, 1, seed=k)
    built = matmul.dnnl_matmul_builds()
    again = _forward_backward("dnnl", 5, 5, 7, 1, seed=0)
    assert matmul.dnnl_matmul_builds() == built + 3
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


@needs_native
def test_matmul_bf16_backward_runs_each_product_on_the_faster_path():
    # the backward's dX runs on the matmul primitive up to set_bf16_primitive_rows() rows (not
    # for an lm-head-sized K), its dW up to set_bf16_primitive_dw_rows() rows (by default 512
    # with AMX, 0 without: measured per CPU), on the gemm call otherwise: both right, counted builds
    old_dw = matmul.set_bf16_primitive_dw_rows(512)
    try:
        assert old_dw == (512 if "amx_bf16" in matmul.cpu_bf16_features() else 0)
        built = matmul.dnnl_matmul_builds()
        _forward_backward("dnnl", 23, 40, 9000, 2, seed=6)     # K = 9000 for dX: the gemm call
        assert matmul.dnnl_matmul_builds() == built + 2        # forward and dW only
        old = matmul.set_bf16_primitive_rows(22)
        try:
            built = matmul.dnnl_matmul_builds()
            _forward_backward("dnnl", 23, 41, 19, 2, seed=7)   # 23 rows > 22: dX on the gemm call
            assert matmul.dnnl_matmul_builds() == built + 2    # the forward and dW
        finally:
            matmul.set_bf16_primitive_rows(old)
        matmul.set_bf16_primitive_dw_rows(22)                  # 23 rows > 22: dW on the gemm call
        built = matmul.dnnl_matmul_builds()
        _forward_backward("dnnl", 23, 42, 19, 2, seed=8)
        assert matmul.dnnl_matmul_builds() == built + 2        # the forward and dX
    finally:
        matmul.set_bf16_primitive_dw_rows(old_dw)
    built = matmul.dnnl_matmul_builds()
    _forward_backward("dnnl", 23, 43, 19, 2, seed=9)
    assert matmul.dnnl_matmul_builds() == built + (3 if old_dw >= 23 else 2)   # dW as the default has it


GEMV_SHAPES = [(1, 1, 1), (1, 768, 67), (1, 130, 5), (1, 33, 130), (2, 31, 9), (3, 128, 70),
               (4, 300, 66), (1, 300, 7), (5, 64, 8)]   # C: tails of 32/128 lanes; OC: ragged 4-row and 64-row blocks
GEMV_ISAS = ["avx2", "avx512_bf16"]
GEMV_BLOCK = 64   # output channels per call of the kernel (matmul.pyx), each call its own 4-row tail


def _gemv_isa_or_skip(isa):
    if isa not in matmul.gemv_bf16_isas():
        pytest.skip(f"this CPU does not run the bf16 GEMV's {isa} copy (it runs: "
                    f"{', '.join(matmul.gemv_bf16_isas()) or 'none'})")
    return matmul.set_gemv_isa(isa)


def vdpbf16ps_gemv(x16, w16, bias, R, C, OC):
    """gemv_bf16.h's result as the Intel SDM defines vdpbf16ps, in NumPy: 16 fp32 lanes per
    32-element chunk, lane j adding the products of elements 2j+1 then 2j, each exact and rounded
    once (an FMA), chunks in order; R = 1 channels past a 64-channel block's last multiple of 4
    spread the chunks over four such accumulators (chunk k of each 128 into accumulator k) and
    add them as (a0 + a1) + (a2 + a3); the 16 lanes are summed as GCC's _mm512_reduce_add_ps
    does, then the bias added."""
    Cp = -(-C // 32) * 32
    X = np.zeros((R, Cp), np.float64)
    W = np.zeros((OC, Cp), np.float64)
    X[:, :C] = from_bf16(x16).reshape(R, C)
    W[:, :C] = from_bf16(w16).reshape(OC, C)

    def chunk(acc, r, o, k):   # acc (16,) float32 += chunk k of row r . channel o
        xs, ws = X[r, 32 * k:32 * k + 32], W[o, 32 * k:32 * k + 32]
        acc = (acc + xs[1::2] * ws[1::2]).astype(np.float32)   # float64 sum of a float32 and an exact
        return (acc + xs[0::2] * ws[0::2]).astype(np.float32)  # 16-bit product: one rounding to float32

    def lanes(a):
        t = (a[8:] + a[:8]).astype(np.float32)
        u = (t[4:] + t[:4]).astype(np.float32)
        return np.float32(np.float32(u[0] + u[2]) + np.float32(u[1] + u[3]))

    out = np.zeros((R, OC), np.float32)
    for o in range(OC):
        b0 = o - o % GEMV_BLOCK
        in_tail = o - b0 >= (min(GEMV_BLOCK, OC - b0) // 4) * 4
        for r in range(R):
            if R == 1 and in_tail:
                acc = [np.zeros(16, np.float32) for _ in range(4)]
                k = 0
                while 32 * k + 128 <= C:
                    for q in range(4):
                        acc[q] = chunk(acc[q], r, o, k + q)
                    k += 4
                while 32 * k < C:
                    acc[0] = chunk(acc[0], r, o, k)
                    k += 1
                a = ((acc[0] + acc[1]).astype(np.float32) + (acc[2] + acc[3]).astype(np.float32)).astype(np.float32)
            else:
                a = np.zeros(16, np.float32)
                for k in range(Cp // 32):
                    a = chunk(a, r, o, k)
            out[r, o] = lanes(a) + (bias[o] if bias is not None else np.float32(0.0))
    return out


@pytest.mark.parametrize("isa", GEMV_ISAS)
@pytest.mark.parametrize("shape", GEMV_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_gemv_copies_give_vdpbf16ps_bits(isa, shape, with_bias, n_threads):
    # decode-sized products (BT <= 4) run on gemv_bf16.h on every bf16 engine: the AVX-512 copy
    # on vdpbf16ps, the AVX2 copy widening bf16 in registers and adding in the order the Intel
    # SDM defines for vdpbf16ps (so AVX2 CPUs decode as AVX512_BF16 ones do where the hardware
    # follows that definition: checked on CPUs that have the instruction)
    BT, C, OC = shape
    rng = np.random.default_rng(BT * 7919 + C * 31 + OC)
    ib, wb, b = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C)), _f32(rng, OC)
    old = _gemv_isa_or_skip(isa)
    try:
        out = np.full(BT * OC, np.nan, np.float32)
        matmul.matmul_forward_bf16(out, ib.ravel(), wb.ravel(), b if with_bias else None, BT, C, OC,
                                   n_threads=n_threads, engine=matmul.get_bf16_engines()[0])
    finally:
        matmul.set_gemv_isa(old)
    want = vdpbf16ps_gemv(ib, wb, b if with_bias else None, BT, C, OC)
    x64, w64 = from_bf16(ib).astype(np.float64), from_bf16(wb).astype(np.float64)
    terms = np.abs(x64) @ np.abs(w64).T + (np.abs(b) if with_bias else 0.0)
    # every path: within the float32 dot bound of the float64 product (past set_gemv_rows(): the
    # engine's GEMM, another summation order)
    _assert_dot_close(out.reshape(BT, OC), ref.matmul_forward(x64, w64, b.astype(np.float64) if with_bias
                                                               else None), terms, C, f"bf16 {isa}")
    if BT <= 4 and (isa == "avx2" or buildinfo.simde_avx512()):
        # llmctl's own arithmetic, or the SIMDe test build's vdpbf16ps (the SDM's): exactly the model
        np.testing.assert_array_equal(out.reshape(BT, OC), want)
    elif BT <= 4 and not np.array_equal(out.reshape(BT, OC), want):
        # the instruction itself: the SDM's definition says these bits; a CPU whose vdpbf16ps
        # rounds otherwise decodes within the bound above, and the AVX2 copy's bits are not its
        pytest.xfail(f"this CPU's vdpbf16ps does not give the SDM model's bits ({C=}, {OC=})")


def test_gemv_model_is_not_the_plain_dot():
    # the order model above must be able to fail: a plain float32 dot of the same operands
    # (one accumulator, elements in order) differs from it somewhere on a decode-sized product
    rng = np.random.default_rng(5)
    C, OC = 768, 64
    ib, wb = to_bf16(_f32(rng, 1, C)), to_bf16(_f32(rng, OC, C))
    want = vdpbf16ps_gemv(ib, wb, None, 1, C, OC)
    x, w = from_bf16(ib).reshape(C), from_bf16(wb).reshape(OC, C)
    plain = np.zeros(OC, np.float32)
    for c in range(C):
        plain = (plain + x[c].astype(np.float64) * w[:, c]).astype(np.float32)
    assert not np.array_equal(plain, want[0])
    np.testing.assert_allclose(plain, want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif("avx512_bf16" not in matmul.gemv_bf16_isas() or "dnnl" not in matmul.get_bf16_engines(),
                    reason="no AVX512_BF16 with oneDNN's bf16 GEMM here: few-row bf16 products run on the "
                    "GEMV's AVX2 copy, tested above against the same order")
@pytest.mark.parametrize("shape", GEMV_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_matmul_forward_bf16_few_rows_gemv_matches_rounded_reference(shape, with_bias, n_threads):
    # decode-sized products (BT <= 4) run on gemv_bf16.h, not oneDNN: the same bound, and the
    # same result as oneDNN's bf16 GEMM up to summation order
    BT, C, OC = shape
    rng = np.random.default_rng(BT * 7919 + C * 31 + OC)
    ib, wb, b = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C)), _f32(rng, OC)
    x64, w64 = from_bf16(ib).astype(np.float64), from_bf16(wb).astype(np.float64)
    want = ref.matmul_forward(x64, w64, b.astype(np.float64) if with_bias else None)
    terms = np.abs(x64) @ np.abs(w64).T + (np.abs(b) if with_bias else 0.0)
    outs = {}
    for rows in (4, 0):   # 0: every shape on oneDNN
        old = matmul.set_gemv_rows(rows)
        try:
            out = np.full(BT * OC, np.nan, np.float32)
            matmul.matmul_forward_bf16(out, ib.ravel(), wb.ravel(), b if with_bias else None, BT, C, OC,
                                       n_threads=n_threads, engine="dnnl")
        finally:
            matmul.set_gemv_rows(old)
        _assert_dot_close(out.reshape(BT, OC), want, terms, C, f"bf16 rows={rows}")
        outs[rows] = out
    if BT > 4:   # past the threshold both runs are oneDNN's
        np.testing.assert_array_equal(outs[4], outs[0])
    elif not np.array_equal(outs[4], vdpbf16ps_gemv(ib, wb, b if with_bias else None, BT, C, OC).ravel()):
        # the GEMV ran (oneDNN may give the same bits on a small product: Zen 4 does at 130 x 5);
        # a vdpbf16ps that rounds otherwise than the SDM is test_gemv_copies_give_vdpbf16ps_bits' xfail
        pytest.xfail(f"this CPU's vdpbf16ps does not give the SDM model's bits ({C=}, {OC=})")


@pytest.mark.skipif("avx512_bf16" not in matmul.gemv_bf16_isas() or "dnnl" not in matmul.get_bf16_engines(),
                    reason="no AVX512_BF16 with oneDNN's bf16 GEMM here")
def test_gemv_threshold_really_switches_engines():
    # set_gemv_rows(0) sends decode-sized products to oneDNN: another summation order, so on
    # decode's own shape (C = 768) the two differ; were both runs one engine they could not
    BT, C, OC = 1, 768, 67
    rng = np.random.default_rng(11)
    ib, wb = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C))
    outs = {}
    for rows in (4, 0):
        old = matmul.set_gemv_rows(rows)
        try:
            out = np.full(BT * OC, np.nan, np.float32)
            matmul.matmul_forward_bf16(out, ib.ravel(), wb.ravel(), None, BT, C, OC, n_threads=1, engine="dnnl")
        finally:
            matmul.set_gemv_rows(old)
        outs[rows] = out
    assert not np.array_equal(outs[4], outs[0])


def test_gemv_off_without_native_bf16_is_the_emulation():
    # set_gemv_isa("off"): few-row products go back to the engine (here the first bf16 engine):
    # within the bound of the float64 product, and other bits than the GEMV's
    if not matmul.gemv_bf16_isas():
        pytest.skip("no copy of the bf16 GEMV runs here (no AVX2 and FMA)")
    rng = np.random.default_rng(11)
    C, OC = 768, 130
    ib, wb = to_bf16(_f32(rng, 1, C)), to_bf16(_f32(rng, OC, C))
    outs = {}
    for isa in ("off", None):
        old = matmul.set_gemv_isa(isa)
        try:
            assert matmul.gemv_bf16_isa() == (isa or matmul.gemv_bf16_isas()[-1])
            outs[isa] = np.full(OC, np.nan, np.float32)
            matmul.matmul_forward_bf16(outs[isa], ib.ravel(), wb.ravel(), None, 1, C, OC, n_threads=2,
                                       engine=matmul.get_bf16_engines()[0])
        finally:
            matmul.set_gemv_isa(old)
    x64, w64 = from_bf16(ib).astype(np.float64), from_bf16(wb).astype(np.float64)
    for out in outs.values():
        _assert_dot_close(out.reshape(1, OC), ref.matmul_forward(x64, w64, None), np.abs(x64) @ np.abs(w64).T,
                          C, "bf16 one row")
    assert not np.array_equal(outs["off"], outs[None])
    with pytest.raises(ValueError, match="does not run here"):
        matmul.set_gemv_isa("avx512_bf16" if "avx512_bf16" not in matmul.gemv_bf16_isas() else "sse")


@pytest.mark.parametrize("isa", GEMV_ISAS)
@pytest.mark.parametrize("shape", [(1, 768, 2304), (3, 130, 517)])
def test_matmul_forward_bf16_gemv_bits_do_not_depend_on_its_thread_split(isa, shape):
    # set_gemv_grain(0) splits the output channels over both threads (each channel on one
    # thread): the same bits as the default, which keeps these shapes on one thread
    BT, C, OC = shape
    rng = np.random.default_rng(OC)
    ib, wb, b = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C)), _f32(rng, OC)
    outs = []
    old_isa = _gemv_isa_or_skip(isa)
    try:
        for grain in (None, 0, 64):
            old = matmul.set_gemv_grain(grain) if grain is not None else None
            try:
                out = np.full(BT * OC, np.nan, np.float32)
                matmul.matmul_forward_bf16(out, ib.ravel(), wb.ravel(), b, BT, C, OC, n_threads=2,
                                           engine=matmul.get_bf16_engines()[0])
            finally:
                if old is not None:
                    matmul.set_gemv_grain(old)
            outs.append(out)
    finally:
        matmul.set_gemv_isa(old_isa)
    assert not np.isnan(outs[0]).any()
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("isa", GEMV_ISAS)
def test_matmul_forward_bf16_gemv_keeps_nan_and_inf(isa):
    # a non-finite input must come out non-finite, not be lost in a masked tail
    C, OC = 45, 6
    x = np.ones(C, np.float32)
    w = np.ones((OC, C), np.float32)
    w[1, 44] = np.inf     # in the tail of the last 32-lane load
    w[3, 3] = np.nan
    x16, w16 = to_bf16(x), to_bf16(w).ravel()
    out = np.zeros(OC, np.float32)
    old = _gemv_isa_or_skip(isa)
    try:
        matmul.matmul_forward_bf16(out, x16, w16, None, 1, C, OC, engine=matmul.get_bf16_engines()[0])
    finally:
        matmul.set_gemv_isa(old)
    assert np.isposinf(out[1]) and np.isnan(out[3])
    np.testing.assert_array_equal(out[[0, 2, 4, 5]], np.float32(C))


def test_bf16_engines_follow_the_cpu():
    feats = matmul.cpu_bf16_features()
    assert set(feats) <= {"avx512_bf16", "amx_bf16"}
    assert "blas" in matmul.get_bf16_engines()
    if not matmul.bf16_native():
        assert matmul.get_bf16_engines() == ("blas",)
        z16, z32 = np.zeros(9, np.uint16), np.zeros(9, np.float32)
        with pytest.raises(ValueError, match="'dnnl' is not available"):
            matmul.matmul_forward_bf16(z32, z16, z16, None, 3, 3, 3, engine="dnnl")
    else:
        assert feats and matmul.get_bf16_engines() == ("dnnl", "dnnl_gemm", "blas")
    with pytest.raises(ValueError, match="unknown bf16 matmul engine"):
        matmul.matmul_forward_bf16(np.zeros(9, np.float32), np.zeros(9, np.uint16), np.zeros(9, np.uint16),
                                   None, 3, 3, 3, engine="tiled")


# ---------------------------------------------------------------------------------------------
# producers writing bf16: exactly the cast of their fp32 output

@pytest.mark.parametrize("N,C", [(5, 7), (9, 130)])
def test_layernorm_forward_bf16_is_the_cast_fp32_output(N, C):
    rng = np.random.default_rng(C)
    x, w, b = _f32(rng, N * C, scale=2.0), _f32(rng, C), _f32(rng, C)
    out, mean, rstd = np.empty(N * C, np.float32), np.empty(N, np.float32), np.empty(N, np.float32)
    layers.layernorm_forward(out, mean, rstd, x, w, b, N, C, 2)
    o16, m2, r2 = np.empty(N * C, np.uint16), np.empty(N, np.float32), np.empty(N, np.float32)
    layers.layernorm_forward_bf16(o16, m2, r2, x, w, b, N, C, 2)
    np.testing.assert_array_equal(o16, to_bf16(out))
    np.testing.assert_array_equal(m2, mean)
    np.testing.assert_array_equal(r2, rstd)
    want, _, _ = ref.layernorm_forward(x.reshape(N, C).astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(from_bf16(o16).reshape(N, C), want, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("N, C", [(1, 7), (37, 131)])
def test_layernorm_forward_adds_a_residual_in_the_same_pass(N, C):
    # x2 = x + attproj(...) and ln2 of it in one pass: the input gets residual_forward's sum and
    # the output (fp32 or bf16), mean and rstd layernorm_forward's bits on that sum
    rng = np.random.default_rng(N * C)
    y, x, w, b = _f32(rng, N * C), _f32(rng, N * C), _f32(rng, C), _f32(rng, C)
    want_x = np.empty(N * C, np.float32)
    layers.residual_forward(want_x, y, x, N * C, 2)
    for fn, dt in ((layers.layernorm_forward, np.float32), (layers.layernorm_forward_bf16, np.uint16)):
        want, wm, wr = np.empty(N * C, dt), np.empty(N, np.float32), np.empty(N, np.float32)
        fn(want, wm, wr, want_x, w, b, N, C, 2)
        got, gm, gr, inp = np.empty(N * C, dt), np.empty(N, np.float32), np.empty(N, np.float32), y.copy()
        fn(got, gm, gr, inp, w, b, N, C, 2, residual=x)
        for a, c in ((inp, want_x), (got, want), (gm, wm), (gr, wr)):
            np.testing.assert_array_equal(a, c)
    with pytest.raises(ValueError, match="overlap"):
        layers.layernorm_forward(np.empty(N * C, np.float32), gm, gr, inp, w, b, N, C, 2, residual=inp)


def test_gelu_forward_bf16_is_the_cast_fp32_output():
    rng = np.random.default_rng(1)
    x = _f32(rng, 40000, scale=3.0)
    out, o16 = np.empty_like(x), np.empty(x.size, np.uint16)
    layers.gelu_forward(out, x, x.size, 2)
    layers.gelu_forward_bf16(o16, x, x.size, 2)
    np.testing.assert_array_equal(o16, to_bf16(out))
    np.testing.assert_allclose(from_bf16(o16), ref.gelu_forward(x.astype(np.float64)), rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("BT, OC", [(1, 1), (5, 64), (300, 131), (77, 3072)])
def test_gelu_backward_bf16_is_the_zeroed_accumulate_cast_and_bias_sum(BT, OC):
    # the fc layer's bf16 backward pass in one kernel: the same bits as zero fill + gelu_backward
    # (+=) + matmul_backward_bf16's cast and dbias sum, which it replaces
    rng = np.random.default_rng(BT + OC)
    x, dy = _f32(rng, BT * OC, scale=3.0), _f32(rng, BT * OC)
    x[:4] = [0.0, -0.0, -50.0, 1e-30][:x.size] if x.size >= 4 else x[:4]
    dy[1::7] = -0.0                          # g * dy = -0.0: the zeroed += makes it +0.0
    db0 = _f32(rng, OC)
    d32 = np.zeros(BT * OC, np.float32)
    layers.gelu_backward(d32, x, dy, BT * OC, 2)
    want16, want_db = np.empty(BT * OC, np.uint16), db0.copy()
    matmul.matmul_backward_bf16(None, np.zeros(OC, np.float32), want_db, d32, want16,
                                np.zeros(BT, np.uint16), np.zeros(OC, np.uint16), BT, 1, OC, n_threads=2)
    for nt in (1, 3):
        got16, got_db = np.full(BT * OC, 0xFFFF, np.uint16), db0.copy()
        layers.gelu_backward_bf16(got16, got_db, x, dy, BT, OC, nt)
        np.testing.assert_array_equal(got16, want16)
        np.testing.assert_array_equal(got_db, want_db)
    got16 = np.empty(BT * OC, np.uint16)
    layers.gelu_backward_bf16(got16, None, x, dy, BT, OC, 2)   # no bias: the same dinp
    np.testing.assert_array_equal(got16, want16)
    want = ref.gelu_backward(dy.astype(np.float64), x.astype(np.float64))
    np.testing.assert_allclose(from_bf16(got16), want, rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(got_db, db0 + want.reshape(BT, OC).sum(0), rtol=1e-5, atol=1e-5 * BT)
    with pytest.raises(ValueError, match="dbias has 2 elements"):
        layers.gelu_backward_bf16(got16, np.zeros(2, np.float32), x, dy, BT, OC, 2)


@pytest.mark.parametrize("BT, OC", [(37, 131), (512, 128)])
def test_gelu_bf16_kernels_read_bf16_input_as_its_exact_widening(BT, OC):
    # the bf16 model keeps fch in bf16: GELU forward and backward read it through tables of
    # every bf16 value, which must give the bits of the fp32 loops on the same values (37 x 131:
    # ragged rows and chunks; 512 x 128: all 65536 bf16 values, NaNs and infinities included)
    rng = np.random.default_rng(3)
    if BT * OC == 65536:
        xb = rng.permutation(np.arange(65536, dtype=np.uint32)).astype(np.uint16)
    else:
        xb = to_bf16(_f32(rng, BT * OC, scale=3.0))
    x32, dy = from_bf16(xb), _f32(rng, BT * OC)
    outs = []
    for x in (x32, xb):
        o, d16, db = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16), np.zeros(OC, np.float32)
        layers.gelu_forward_bf16(o, x, x.size, 2)
        layers.gelu_backward_bf16(d16, db, x, dy, BT, OC, 2)
        outs.append((o, d16, db))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


@contextlib.contextmanager
def _row_isas():
    """The copies of layers.pyx's row loops this CPU runs (layers.ISAS up to the active one), for
    the caller to set in turn with layers.set_simd; the active one is set again on leaving."""
    old = layers.simd()
    try:
        yield layers.ISAS[:layers.ISAS.index(old) + 1]
    finally:
        layers.set_simd(old)


@pytest.mark.parametrize("BT, OC", [(37, 131), (3, 2048 + 40), (64, 3072)])   # ragged; two column chunks
def test_gelu_forward_backward_bf16_is_the_two_kernels_in_one_pass(BT, OC):
    # a backward that recomputes the GELU: GELU(fch) and d(fch) (over d(gelu), in place) with
    # fc's bias gradient, the bits of gelu_forward_bf16 and gelu_backward_bf16, in every copy
    rng = np.random.default_rng(BT + OC)
    xb, dyb = to_bf16(_f32(rng, BT * OC, scale=3.0)), to_bf16(_f32(rng, BT * OC))
    xb[:3] = [0x7FC0, 0xFF80, 0x0001][:xb.size]      # NaN, -inf, a subnormal
    dyb[1::7] = 0x8000                               # -0.0
    want_y, want_d, want_db = np.empty_like(xb), np.empty_like(xb), _f32(rng, OC)
    db0 = want_db.copy()
    layers.gelu_forward_bf16(want_y, xb, xb.size, 2)
    layers.gelu_backward_bf16(want_d, want_db, xb, dyb, BT, OC, 2)
    with _row_isas() as isas:
        for isa in isas:
            layers.set_simd(isa)
            for nt in (1, 2):
                y, d, db = np.full_like(xb, 0x1234), dyb.copy(), db0.copy()
                layers.gelu_forward_backward_bf16(y, d, db, xb, BT, OC, nt)
                np.testing.assert_array_equal(y, want_y, err_msg=isa)
                np.testing.assert_array_equal(d, want_d, err_msg=isa)
                np.testing.assert_array_equal(db, want_db, err_msg=isa)
    d = dyb.copy()
    layers.gelu_forward_backward_bf16(y, d, None, xb, BT, OC, 2)   # no bias: the same d(fch)
    np.testing.assert_array_equal(d, want_d)
    buf = np.zeros(3 * BT * OC, np.uint16)
    with pytest.raises(ValueError, match="overlap|share"):
        layers.gelu_forward_backward_bf16(buf[:BT * OC], buf[BT * OC - 1:2 * BT * OC - 1], None,
                                          buf[2 * BT * OC:], BT, OC, 2)
    with pytest.raises(ValueError, match="overlap|share"):
        layers.gelu_forward_backward_bf16(y, d, None, d, BT, OC, 2)
    with pytest.raises(ValueError, match="dbias has 2 elements"):
        layers.gelu_forward_backward_bf16(y, d, np.zeros(2, np.float32), xb, BT, OC, 2)


def _gelu_backward_bf16_every_copy(want16, want_db, x, dy, BT, OC, n_threads):
    """gelu_backward_bf16 in each copy of its loop this CPU runs gives want16 and want_db,
    whatever dinp held before (it is written, not accumulated)."""
    with _row_isas() as isas:
        for isa in isas:
            layers.set_simd(isa)
            got16, got_db = np.full(BT * OC, 0x1234, np.uint16), np.zeros(OC, np.float32)
            layers.gelu_backward_bf16(got16, got_db, x, dy, BT, OC, n_threads)
            np.testing.assert_array_equal(got16, want16, err_msg=isa)
            np.testing.assert_array_equal(got_db, want_db, err_msg=isa)


@pytest.mark.parametrize("kernel", ["gelu_backward_bf16", "gelu_forward_backward_bf16"])
def test_gelu_bf16_kernels_check_their_shapes_and_dbias(kernel):
    BT, OC = 2, 3
    z = lambda n=BT * OC: np.zeros(n, np.uint16)   # noqa: E731
    call = {"gelu_backward_bf16": lambda db, bt: layers.gelu_backward_bf16(z(), db, z(), z(), bt, OC, 1),
            "gelu_forward_backward_bf16": lambda db, bt: layers.gelu_forward_backward_bf16(z(), z(), db, z(), bt, OC, 1)}[kernel]
    call(None, BT)
    call(np.zeros(OC, np.float32), BT)
    with pytest.raises(ValueError, match="dbias has 4 elements, expected 3"):
        call(np.zeros(OC + 1, np.float32), BT)
    with pytest.raises(ValueError, match="BT"):
        call(None, 0)


def test_gelu_backward_bf16_rounds_ties_to_even_in_every_copy():
    # gelu'(0) = 0.5 exactly, so with x = 0 each gradient is dy / 2 with dy's mantissa: every
    # rounding case of the bf16 store (the ties of both parities, one ulp either side of them,
    # NaN, infinities, signed zeros) lands in the 16-lane loops and in their tails
    lows = np.array([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], np.uint32)
    mant = np.array([0x3F800000, 0x3F810000, 0xBF820000, 0x40FF0000, 0xC07F0000], np.uint32)
    bits = (mant[:, None] | lows[None, :]).reshape(-1)
    special = np.concatenate([np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38], np.float32).view(np.uint32),
                              np.array([0x7FFFFFFF, 0xFFC0FFFF, 0x7F80FFFF], np.uint32)])   # NaN payloads
    BT, OC = 3, 16 * 4 + 5
    dy = np.resize(np.concatenate([bits, special]), BT * OC).astype(np.uint32).view(np.float32)
    dy = np.roll(dy, 7).copy()
    x = np.zeros(BT * OC, np.uint16)
    with np.errstate(invalid="ignore"):   # the signalling NaN, and inf - inf in a column's sum
        g = (dy * np.float32(0.5)) + np.float32(0.0)
        want_db = g.reshape(BT, OC).astype(np.float64).sum(0).astype(np.float32)
    _gelu_backward_bf16_every_copy(to_bf16(g), want_db, x, dy, BT, OC, 1)


@pytest.mark.parametrize("BT, OC", [(37, 131), (3, 2048 + 40)])   # ragged; two column chunks
def test_gelu_backward_bf16_reads_bf16_dout_as_its_exact_widening(BT, OC):
    # the bf16 model's fcproj backward GEMM writes d(gelu) in bf16: every copy of the loop (each
    # ISA this CPU runs) must give the bits the fp32 loop gives the widened values
    rng = np.random.default_rng(BT * OC)
    xb, dyb = to_bf16(_f32(rng, BT * OC, scale=3.0)), to_bf16(_f32(rng, BT * OC))
    dyb[1::7] = 0x8000                                   # -0.0
    want16, want_db = np.empty(BT * OC, np.uint16), np.zeros(OC, np.float32)
    layers.gelu_backward_bf16(want16, want_db, xb, from_bf16(dyb), BT, OC, 2)
    _gelu_backward_bf16_every_copy(want16, want_db, xb, dyb, BT, OC, 2)
    assert np.any(want_db != 0)
    with pytest.raises(TypeError, match="bf16 inp"):
        layers.gelu_backward_bf16(want16.copy(), None, from_bf16(xb), dyb, BT, OC, 2)


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("shape", [(70, 96, 40), (600, 96, 40), (600, 40, 1100)])
def test_matmul_backward_bf16_writes_a_bf16_dinp_as_the_rounded_fp32_one(engine, shape):
    # a uint16 dinp (accumulate=False): the bf16 rounding of the fp32 dinp that engine writes
    # where both run on the same GEMM (oneDNN's primitive for the model's written dX with
    # K <= 1024; 600 x 40 x 1100 runs fp32 on the gemm call, another order: the bound there),
    # and dweight, dbias and the cast dout exactly as with an fp32 dinp
    BT, C, OC = shape
    rng = np.random.default_rng(BT + C + OC)
    ib, wb, dout = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C)), _f32(rng, BT, OC).ravel()
    runs = []
    for dinp in (np.full(BT * C, np.nan, np.float32), np.full(BT * C, 0xFFFF, np.uint16)):
        dw, db, d16 = np.zeros(OC * C, np.float32), np.zeros(OC, np.float32), np.empty(BT * OC, np.uint16)
        matmul.matmul_backward_bf16(dinp, dw, db, dout, d16, ib.ravel(), wb.ravel(), BT, C, OC,
                                    n_threads=2, engine=engine, accumulate=False)
        runs.append((dinp, dw, db, d16))
    for a, b in zip(runs[0][1:], runs[1][1:]):
        np.testing.assert_array_equal(a, b)
    if not (engine == "dnnl" and BT > 512 and OC > 1024):
        np.testing.assert_array_equal(runs[1][0], to_bf16(runs[0][0]))
    x64, w64, d64 = (from_bf16(a).astype(np.float64).reshape(r, c)
                     for a, r, c in ((ib, BT, C), (wb, OC, C), (runs[0][3], BT, OC)))
    got = from_bf16(runs[1][0]).reshape(BT, C).astype(np.float64)
    want = d64 @ w64
    assert np.all(np.abs(got - want) <= 2 ** -8 * np.abs(want) + 1e-5 * (np.abs(d64) @ np.abs(w64)))
    with pytest.raises(ValueError, match="accumulate=False"):
        matmul.matmul_backward_bf16(runs[1][0], runs[1][1], None, None, runs[1][3], ib.ravel(), wb.ravel(),
                                    BT, C, OC, n_threads=2, engine=engine, accumulate=True)


@pytest.mark.parametrize("engine", BF16_ENGINES)
@pytest.mark.parametrize("BT", [1, 3, 70])      # 1, 3: the GEMV rows of a decode step
def test_matmul_forward_bf16_writes_bf16_as_the_rounded_fp32_result(engine, BT):
    C, OC = 96, 200
    rng = np.random.default_rng(BT)
    ib, wb, b = to_bf16(_f32(rng, BT, C)), to_bf16(_f32(rng, OC, C)), _f32(rng, OC)
    o32, o16 = np.empty(BT * OC, np.float32), np.full(BT * OC, 0xFFFF, np.uint16)
    for out in (o32, o16):
        matmul.matmul_forward_bf16(out, ib.ravel(), wb.ravel(), b, BT, C, OC, n_threads=2, engine=engine)
    np.testing.assert_array_equal(o16, to_bf16(o32))
    with pytest.raises(ValueError, match="out has 3 elements"):
        matmul.matmul_forward_bf16(np.empty(3, np.uint16), ib.ravel(), wb.ravel(), b, BT, C, OC, engine=engine)


def test_softmax_crossentropy_backward_bf16_is_the_cast_fp32_output():
    BT, V, Vp = 6, 50, 64
    rng = np.random.default_rng(2)
    logits = _f32(rng, BT * Vp, scale=3.0)
    targets = rng.integers(0, V, BT).astype(np.int32)
    losses, probs = np.empty(BT, np.float32), np.empty(BT * Vp, np.float32)
    layers.softmax_crossentropy_forward(losses, probs, logits, targets, BT, V, Vp, 2)
    dl = np.full(BT, 1.0 / BT, np.float32)
    d32, d16 = np.empty(BT * Vp, np.float32), np.full(BT * Vp, 0xFFFF, np.uint16)
    layers.softmax_crossentropy_backward(d32, probs, targets, dl, BT, V, Vp, 2)
    layers.softmax_crossentropy_backward_bf16(d16, probs, targets, dl, BT, V, Vp, 2)
    np.testing.assert_array_equal(d16, to_bf16(d32))
    want = ref.softmax_crossentropy_backward(probs.reshape(BT, Vp).astype(np.float64), targets, dl, V)
    np.testing.assert_allclose(from_bf16(d16).reshape(BT, Vp), want, rtol=2 ** -8, atol=1e-7)


@pytest.mark.parametrize("n_threads", [1, 3])
@pytest.mark.parametrize("BT,V,Vp", [(7, 1000, 1040), (40, 50257, 50304)])
def test_softmax_crossentropy_forward_backward_bf16_is_the_two_calls(n_threads, BT, V, Vp):
    # 2M dlogits at GPT-2's vocabulary: a product rounded in another order (one fp32 ulp) then
    # changes some of their bf16 roundings; 7000 seldom show it
    rng = np.random.default_rng(5)
    logits = _f32(rng, BT * Vp, scale=4.0)
    targets = rng.integers(0, V, BT).astype(np.int32)
    dl = _f32(rng, BT)
    want_l, want_p, want_d = np.empty(BT, np.float32), logits.copy(), np.empty(BT * Vp, np.uint16)
    layers.softmax_crossentropy_forward(want_l, want_p, want_p, targets, BT, V, Vp, n_threads)
    layers.softmax_crossentropy_backward_bf16(want_d, want_p, targets, dl, BT, V, Vp, n_threads)
    got_l, got_p, got_d = np.full(BT, np.nan, np.float32), logits.copy(), np.full(BT * Vp, 0xFFFF, np.uint16)
    layers.softmax_crossentropy_forward_backward_bf16(got_l, got_d, got_p, targets, dl, BT, V, Vp, n_threads)
    np.testing.assert_array_equal(got_l, want_l)
    np.testing.assert_array_equal(got_p, logits)     # the logits are only read
    np.testing.assert_array_equal(got_d, want_d)
    with pytest.raises(ValueError, match="dlosses has 3 elements"):
        layers.softmax_crossentropy_forward_backward_bf16(got_l, got_d, got_p, targets, dl[:3], BT, V, Vp)


@pytest.mark.parametrize("BT,V,Vp", [(7, 1000, 1040), (9, 50257, 50304)])
def test_softmax_crossentropy_reads_bf16_logits_as_their_exact_widening(BT, V, Vp):
    # the bf16 lm head's logits are bf16: the fused loss kernel on them gives the bits of the
    # float32 call on their widening, in every copy of the loop (each ISA this CPU runs); and
    # without dlogits, the losses alone; and with the dlogits written over the logits
    rng = np.random.default_rng(BT)
    lg16 = to_bf16(_f32(rng, BT * Vp, scale=4.0))
    lg16[3] = lg16.max()                      # ties for the row max
    targets = rng.integers(0, V, BT).astype(np.int32)
    dl = _f32(rng, BT)
    want_l, want_d = np.empty(BT, np.float32), np.empty(BT * Vp, np.uint16)
    layers.softmax_crossentropy_forward_backward_bf16(want_l, want_d, from_bf16(lg16), targets, dl, BT, V, Vp, 2)
    with _row_isas() as isas:
        for isa in isas:
            layers.set_simd(isa)
            got_l, got_d = np.full(BT, np.nan, np.float32), np.full(BT * Vp, 0xFFFF, np.uint16)
            layers.softmax_crossentropy_forward_backward_bf16(got_l, got_d, lg16, targets, dl, BT, V, Vp, 2)
            np.testing.assert_array_equal(got_l, want_l, err_msg=isa)
            np.testing.assert_array_equal(got_d, want_d, err_msg=isa)
            only = np.full(BT, np.nan, np.float32)
            layers.softmax_crossentropy_forward_backward_bf16(only, None, lg16, targets, None, BT, V, Vp, 2)
            np.testing.assert_array_equal(only, want_l, err_msg=isa)
            # in place, as the bf16 training lm head calls it: the dlogits over the logits they
            # come from (each row is read whole before it is written)
            inplace, got_l = lg16.copy(), np.full(BT, np.nan, np.float32)
            layers.softmax_crossentropy_forward_backward_bf16(got_l, inplace, inplace, targets, dl, BT, V, Vp, 2)
            np.testing.assert_array_equal(got_l, want_l, err_msg=isa)
            np.testing.assert_array_equal(inplace, want_d, err_msg=isa)
    x = from_bf16(lg16).reshape(BT, Vp)[:, :V].astype(np.float64)
    ref = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1) - x[np.arange(BT), targets]
    np.testing.assert_allclose(want_l, ref, rtol=1e-5)
    with pytest.raises(ValueError, match="dlogits and dlosses"):
        layers.softmax_crossentropy_forward_backward_bf16(got_l, got_d, lg16, targets, None, BT, V, Vp, 2)


@pytest.mark.parametrize("N, C", [(300, 96), (70, 37)])   # several 64-row tasks, ragged; C odd
def test_layernorm_backward_bf16_is_one_pass_of_the_fp32_kernels(N, C):
    # bf16's layernorm backward in one pass: dinp gets the bits of layernorm_backward's; dweight
    # and dbias its sums in another order (64-row blocks, then the blocks in order); and, with
    # dinp16, the final dinp rounded (cast_to_bf16's bits) and its column sums added to
    # dbias_next: matmul_backward_bf16's cast pass and bias gradient, which it replaces. Every
    # ISA copy and thread count gives the same bits.
    rng = np.random.default_rng(N + C)
    x, dy, d0 = _f32(rng, N * C), _f32(rng, N * C), _f32(rng, N * C)
    w, mean, rstd = _f32(rng, C), _f32(rng, N, scale=0.1), (1.0 + rng.random(N)).astype(np.float32)
    dw0, db0, dn0 = _f32(rng, C), _f32(rng, C), _f32(rng, C)
    want, want_w, want_b = d0.copy(), dw0.copy(), db0.copy()
    layers.layernorm_backward(want, want_w, want_b, dy, x, w, mean, rstd, N, C, 2)
    want16 = np.empty(N * C, np.uint16)
    convert.cast_to_bf16(want16, want, 1)
    runs = []
    with _row_isas() as isas:
        for isa in isas:
            layers.set_simd(isa)
            for nt in (1, 2, 3):
                d, dw, db, dn = d0.copy(), dw0.copy(), db0.copy(), dn0.copy()
                d16 = np.full(N * C, 0xFFFF, np.uint16)
                layers.layernorm_backward_bf16(d, dw, db, dy, x, w, mean, rstd, N, C, nt, dinp16=d16, dbias_next=dn)
                runs.append((d, dw, db, dn, d16))
    for r in runs:
        for a, b in zip(r, runs[0]):
            np.testing.assert_array_equal(a, b)
    d, dw, db, dn, d16 = runs[0]
    np.testing.assert_array_equal(d, want)
    np.testing.assert_array_equal(d16, want16)
    np.testing.assert_allclose(dw, want_w, rtol=1e-6, atol=1e-6 * np.abs(want_w).max())
    np.testing.assert_allclose(db, want_b, rtol=1e-6, atol=1e-6 * np.abs(want_b).max())
    np.testing.assert_allclose(dn, dn0 + d.reshape(N, C).astype(np.float64).sum(0), rtol=1e-6, atol=1e-6 * N)
    d2, dw2, db2 = d0.copy(), dw0.copy(), db0.copy()
    layers.layernorm_backward_bf16(d2, dw2, db2, dy, x, w, mean, rstd, N, C, 2)   # no cast
    for a, b in ((d2, d), (dw2, dw), (db2, db)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="dinp16"):
        layers.layernorm_backward_bf16(d2, dw2, db2, dy, x, w, mean, rstd, N, C, 2, dbias_next=dn)
    with pytest.raises(ValueError, match=f"dbias_next has {C + 1} elements, expected {C}"):
        layers.layernorm_backward_bf16(d2, dw2, db2, dy, x, w, mean, rstd, N, C, 2,
                                       dinp16=np.empty(N * C, np.uint16), dbias_next=np.zeros(C + 1, np.float32))


@pytest.mark.parametrize("N", [1, 1000, 70001])   # 70001: three AdamW chunks, ragged
def test_adamw_writes_the_bf16_copy_without_changing_fp32(N):
    rng = np.random.default_rng(N)
    p, g, m, v = _f32(rng, N), _f32(rng, N), _f32(rng, N, scale=0.1), np.abs(_f32(rng, N, scale=0.1))
    args = (3e-4, 0.9, 0.95, 1e-8, 0.1, 0.5, 3, 2)
    p1, m1, v1 = p.copy(), m.copy(), v.copy()
    adamw.adamw_update(p1, g, m1, v1, *args)
    p2, m2, v2, pb = p.copy(), m.copy(), v.copy(), np.zeros(N, np.uint16)
    adamw.adamw_update(p2, g, m2, v2, *args, params_bf16=pb)
    for a, b in ((p1, p2), (m1, m2), (v1, v2)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(pb, to_bf16(p1))
    with pytest.raises(ValueError, match="params_bf16"):
        adamw.adamw_update(p2, g, m2, v2, *args, params_bf16=np.zeros(N + 1, np.uint16))


# ---------------------------------------------------------------------------------------------
# the model in bf16 (on CPUs without native bf16: the same numerics on fp32 GEMMs)

from llmctl.errors import ConfigError  # noqa: E402
from llmctl.model import GPT2, GPT2Config, init_llmc_  # noqa: E402

MCFG = GPT2Config(max_seq_len=64, vocab_size=500, padded_vocab_size=512, num_layers=2, num_heads=4, channels=64)


@pytest.fixture
def bf16_ok(monkeypatch):
    if not matmul.bf16_native():
        monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")


def _init(precision, cfg=MCFG, n_threads=2):
    m = GPT2(cfg, n_threads=n_threads, precision=precision)
    init_llmc_(m.p, cfg, n_threads=n_threads)
    m.params_changed()
    return m


def _data(B=4, T=64, seed=0, V=MCFG.vocab_size):
    x = np.random.default_rng(seed).integers(0, V, (B, T + 1))
    return x[:, :-1], x[:, 1:]


def _step(m, x, y, t):
    m.zero_grad()
    loss = m.forward(x, y)
    m.backward()
    norm = m.grad_norm()
    m.update(1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0 / norm if norm > 1 else 1.0, t)
    return loss


def test_bf16_step0_loss_and_grads_close_to_fp32(bf16_ok, tmp_path):
    # the same checkpoint and batch in both precisions
    ck = tmp_path / "m.bin"
    src = _init("fp32")
    for t in range(1, 4):          # a few steps, so the weights are not just the init
        _step(src, *_data(seed=t), t)
    src.save_checkpoint(ck)
    m32 = GPT2.from_checkpoint(ck, n_threads=2)
    m16 = GPT2.from_checkpoint(ck, n_threads=2, precision="bf16")
    x, y = _data(seed=9)
    l32, l16 = m32.forward(x, y), m16.forward(x, y)
    assert abs(l16 - l32) <= 1e-2, (l16, l32)
    assert abs(l16 - l32) > 1e-7, "bf16 gave the fp32 loss: are the matmuls really bf16?"
    for m in (m32, m16):
        m.zero_grad()
        m.forward(x, y)
        m.backward()
    rel = np.linalg.norm(m16.grads - m32.grads) / np.linalg.norm(m32.grads)
    assert rel < 2e-2, rel
    for name in m32.g:     # each tensor, the small ones (biases, layernorms) too
        g32, g16 = m32.g[name], m16.g[name]
        assert np.linalg.norm(g16 - g32) <= 5e-2 * np.linalg.norm(g32), name
    # master weights stay fp32 and the bf16 copy is their cast
    assert m16.params.dtype == np.float32 and m16.grads.dtype == np.float32
    np.testing.assert_array_equal(m16.params, m32.params)
    np.testing.assert_array_equal(m16.params_bf16, to_bf16(m16.params))


def test_bf16_backward_hands_bf16_gradients_to_the_gelu_and_the_attention(bf16_ok):
    # as autocast's bf16 matmul outputs get bf16 gradients: the fcproj and attproj backward GEMMs
    # write d(gelu) and d(atty) rounded to bf16 (half the bytes), which the GELU's and the
    # attention's backward read as they are; fp32 keeps llm.c's fp32 gradients
    class Spy:
        def __init__(self, mod, arg):
            self.mod, self.arg = mod, arg

        def __getattr__(self, name):
            f = getattr(self.mod, name)
            if name not in self.arg:
                return f

            def call(*a, **kw):
                seen.append((name, a[self.arg[name]].dtype))
                return f(*a, **kw)
            return call

    x, y = _data(B=2, T=32)
    for precision, dt in (("bf16", np.uint16), ("fp32", np.float32)):
        m, seen = _init(precision), []
        k = m.kernels
        k.layers = Spy(k.layers, {"gelu_backward_bf16": 3, "gelu_backward": 2, "gelu_forward_backward": 1})
        k.attention = Spy(k.attention, {"attention_backward_bf16": 1, "attention_backward": 1})
        m.zero_grad()
        m.forward(x, y)
        m.backward()
        assert len(seen) == 2 * MCFG.num_layers, seen
        assert all(d == dt for _, d in seen), (precision, seen)


def test_bf16_training_is_bit_exact_on_resume(bf16_ok, tmp_path):
    # 4 steps straight == 2 steps, checkpoint (fp32 v3) + AdamW state, a new model, 2 more steps
    batches = [_data(seed=s) for s in range(4)]
    a = _init("bf16")
    la = [_step(a, x, y, t + 1) for t, (x, y) in enumerate(batches)]
    b = _init("bf16")
    lb = [_step(b, x, y, t + 1) for t, (x, y) in enumerate(batches[:2])]
    b.save_checkpoint(tmp_path / "b.bin")
    c = GPT2.from_checkpoint(tmp_path / "b.bin", n_threads=2, precision="bf16")
    c.m, c.v = b.m.copy(), b.v.copy()
    lb += [_step(c, x, y, t + 3) for t, (x, y) in enumerate(batches[2:])]
    assert la == lb
    np.testing.assert_array_equal(a.params, c.params)
    np.testing.assert_array_equal(a.params_bf16, c.params_bf16)
    # the AdamW kernel kept the bf16 copy current in its pass
    np.testing.assert_array_equal(a.params_bf16, to_bf16(a.params))


def test_bf16_eval_forward_without_activations_matches(bf16_ok):
    m = _init("bf16")
    x, y = _data(B=2, T=33, seed=5)
    ref_loss = m.forward(x, y)
    lean = _init("bf16")
    assert lean.forward(x, y, keep_activations=False) == ref_loss
    lean.forward(x)
    full = _init("bf16")
    full.forward(x)
    np.testing.assert_array_equal(lean.logits(), full.logits())


def test_bf16_needs_native_bf16_or_the_emulation_switch(monkeypatch):
    monkeypatch.delenv("LLMCTL_BF16_EMULATE", raising=False)
    if matmul.bf16_native():
        assert GPT2(MCFG, precision="bf16").precision == "bf16"
    else:
        with raises_error(ConfigError, names=["--precision bf16", "--precision fp32"]):
            GPT2(MCFG, precision="bf16")
    with raises_error(ConfigError, names="'fp16'"):
        GPT2(MCFG, precision="fp16")


@pytest.mark.parametrize("grad_rows", [1024, 128, 100])
def test_bf16_lmhead_in_blocks_matches_the_full_lmhead(bf16_ok, monkeypatch, grad_rows):
    # large B*T in bf16: the forward keeps no logits, backward recomputes them per row block; the
    # backward GEMMs run on grad_rows staged rows of dlogits at a time (128, 100: several times,
    # and 100 rows take one 64-row block only), both with and without the logits held
    import llmctl.model.gpt2 as gpt2

    x, y = _data(B=3, T=64, seed=7)          # 192 rows: blocks of LMHEAD_ROWS = 64 below

    def grads(m):
        m.zero_grad()
        loss = m.forward(x, y)
        m.backward()
        return loss, m.grads.copy()

    l_ref, g_ref = grads(_init("bf16"))       # the logits held, one GEMM over all 192 rows
    # emulated bf16 multiplies on fp32 sgemm, whose sums over K may take another order for another
    # number of rows (64 or 100 rows here, not 96 or 128): a last-bit change in d(lnf) then flips
    # some later bf16 roundings of the gradients (2^-9 each). A wrong or missing block is O(1).
    tol = (1e-6 if matmul.bf16_native() else 1e-3) * np.abs(g_ref).max()
    monkeypatch.setattr(gpt2, "LMHEAD_GRAD_ROWS", grad_rows)
    l_full, g_full = grads(_init("bf16"))     # held, the GEMMs grad_rows at a time
    assert l_full == l_ref
    np.testing.assert_allclose(g_full, g_ref, rtol=0, atol=tol)
    monkeypatch.setattr(gpt2, "LOGITS_KEEP_BYTES", 1024)
    monkeypatch.setattr(gpt2, "LMHEAD_ROWS", 64)
    runs = []
    for _ in range(2):
        m = _init("bf16")
        runs.append(grads(m))
        assert m.plan.logits_rows == 64   # the lm head and the loss run in blocks of LMHEAD_ROWS
    (l1, g1), (l2, g2) = runs
    assert l1 == l2 and np.array_equal(g1, g2)   # bit-exact when repeated
    assert abs(l1 - l_ref) <= 1e-6 * l_ref
    np.testing.assert_allclose(g1, g_ref, rtol=0, atol=tol)


@pytest.mark.parametrize("loss_scale", [None, 0.5])
@pytest.mark.parametrize("grad_rows", [1024, 100])
def test_bf16_backward_overwrites_spent_gradients(bf16_ok, monkeypatch, loss_scale, grad_rows):
    # zero_grad(lazy=True) on junk gradients (NaN here) fills nothing in bf16: the next gradient
    # write overwrites each tensor (beta-0 GEMMs for the lm head's first staged rows and each
    # layer's matrices, a fill of the rest), a second micro-step adds, and the gradients are the
    # bits of zero_grad()'s fill; update() and grad_norm() fill spent ones first
    import llmctl.model.gpt2 as gpt2

    monkeypatch.setattr(gpt2, "LMHEAD_GRAD_ROWS", grad_rows)   # 100: several staged GEMMs
    batches = [_data(B=3, T=64, seed=s) for s in (3, 4)]
    runs = []
    for lazy in (False, True):
        m = _init("bf16")
        m.grads[:] = np.nan
        m.zero_grad(lazy=lazy)
        assert m.grads_spent == lazy and (lazy or not m.grads.any())
        for x, y in batches:
            m.forward(x, y, loss_scale=loss_scale)
            m.backward(loss_scale=1.0 if loss_scale is None else loss_scale)
            assert not m.grads_spent
        runs.append(m.grads.copy())
    assert np.isfinite(runs[1]).all()
    np.testing.assert_array_equal(runs[1], runs[0])
    m = _init("bf16")
    m.grads[:] = np.nan
    m.zero_grad(lazy=True)
    assert m.grad_norm() == 0.0 and not m.grads_spent
    m.zero_grad(lazy=True)
    assert not m.grads_spent      # known zero: nothing to mark
    m.update(1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0, 1, zero_grads=True)
    assert m.grads_spent and not m.grads_known_zero
    m.zero_grad()                 # the eager form fills spent gradients
    assert not m.grads_spent and not m.grads.any()


@pytest.mark.parametrize("precision,blocks,grad_rows", [("bf16", True, 1024), ("bf16", True, 100),
                                                        ("bf16", False, 100), ("fp32", False, None)])
def test_lmhead_gradient_made_in_the_forward_is_the_backwards(bf16_ok, monkeypatch, precision, blocks, grad_rows):
    # forward(loss_scale=s) makes the lm head's gradient while the logits are at hand, each row's
    # loss and dlogits in one pass: the blocked bf16 lm head computes no block's logits twice, the
    # held one (fp32; bf16 at small B*T) reads and writes its logits once. The same bits as a
    # backward from the probs (or, blocked, from recomputed logits), and zero_grad() in between
    # makes backward remake it from recomputed logits
    import llmctl.model.gpt2 as gpt2

    if blocks:
        monkeypatch.setattr(gpt2, "LOGITS_KEEP_BYTES", 1024)
        monkeypatch.setattr(gpt2, "LMHEAD_ROWS", 64)
    if grad_rows is not None:
        monkeypatch.setattr(gpt2, "LMHEAD_GRAD_ROWS", grad_rows)
    x, y = _data(B=3, T=64, seed=11)

    def run(fwd_scale, zero_between):
        m = _init(precision)
        m.zero_grad()
        loss = m.forward(x, y, loss_scale=fwd_scale)
        assert m.plan.logits_rows == (64 if blocks else 3 * 64)
        assert np.any(m.g["wte"] != 0) == (fwd_scale is not None)   # the forward wrote d(wte)
        if zero_between:
            m.zero_grad()
            assert not np.any(m.grads)
        m.backward(loss_scale=0.5)
        return loss, m.grads.copy()

    l0, g0 = run(None, False)
    assert np.any(g0[:MCFG.vocab_size * MCFG.channels])
    for fwd_scale, zero_between in ((0.5, False), (0.5, True)):
        loss, g = run(fwd_scale, zero_between)
        assert loss == l0
        np.testing.assert_array_equal(g, g0)

    m = _init("bf16")
    m.zero_grad()
    m.forward(x, y, loss_scale=0.5)
    with raises_error(ValueError, names=["loss_scale=0.25", "loss_scale=0.5"], hint=False):
        m.backward(loss_scale=0.25)
    with raises_error(ValueError, names=["loss_scale", "targets"], hint=False):
        m.forward(x, loss_scale=1.0)
    with raises_error(ValueError, names=["loss_scale", "keep_activations=True"], hint=False):
        m.forward(x, y, keep_activations=False, loss_scale=1.0)


@pytest.mark.parametrize("fwd_scale", [None, 0.5])
def test_bf16_training_lmhead_makes_its_logits_in_the_staging_rows(bf16_ok, monkeypatch, fwd_scale):
    # a bf16 training plan's blocked lm head multiplies LMHEAD_GRAD_ROWS rows at a time into its
    # dlogits staging (where the dlogits then overwrite them), not LMHEAD_ROWS at a time into the
    # logits buffer: one pass over wte's bf16 copy per staged block (d12 B=4 T=1024: 4, not 32).
    # A forward, the backward that remakes its logits and a forward with loss_scale make the same
    # blocks, so the same bits (test_lmhead_gradient_made_in_the_forward_is_the_backwards)
    import llmctl.model.gpt2 as gpt2

    monkeypatch.setattr(gpt2, "LOGITS_KEEP_BYTES", 1024)
    monkeypatch.setattr(gpt2, "LMHEAD_ROWS", 64)
    monkeypatch.setattr(gpt2, "LMHEAD_GRAD_ROWS", 100)
    x, y = _data(B=3, T=64, seed=5)          # 192 rows: staged blocks of 100 and 92
    m = _init("bf16")
    calls, matmul_ = [], m.ops.matmul

    def spy(out, inp, name, l, bias, BT, C, OC, nt, **kw):
        if name == "wte":
            calls.append((BT, np.shares_memory(out, m._staging())))
        return matmul_(out, inp, name, l, bias, BT, C, OC, nt, **kw)

    m.ops.matmul = spy
    m.zero_grad()
    loss = m.forward(x, y, loss_scale=fwd_scale)
    assert m.plan.logits_rows == 64 and np.isfinite(loss)
    assert calls == [(100, True), (92, True)]
    m.backward(loss_scale=0.5)
    assert calls == [(100, True), (92, True)] * (1 if fwd_scale else 2)
    assert np.isfinite(m.grads).all() and np.any(m.g["wte"])


def test_bf16_cached_forward_matches_the_training_forward(bf16_ok):
    # sampling / HellaSwag run the KV-cached forward: in bf16 it rounds the same matmul inputs
    from llmctl.model.gpt2 import KVCache
    from llmctl.model.ops import Bf16Ops

    from llmctl._ext import attention

    m = _init("bf16")
    x, _ = _data(B=2, T=20, seed=3)
    # the cached forward's attention is fp32 (kvcache.pyx) on fp32 q, k, v; the bf16 training
    # forward keeps q, k, v and the attention output in bf16 and rounds P too
    # (attention_forward_bf16, ~2e-3 on these logits): compare the rest of the model with the
    # training forward's attention run in fp32 on the q, k, v it keeps, and the cached forward's
    # fed those same rounded values (its output is rounded for attproj in both)
    def fp32_attention(out, lse, qkv, B, T, C, NH, nt):   # q, k, v and its output in bf16
        o32 = np.empty(out.size, np.float32)
        attention.attention_forward(o32, lse, from_bf16(qkv), B, T, C, NH, nt)
        out[:] = to_bf16(o32)

    def rounding_matmul(out, inp, name, l, bias, N, C, OC, nt):
        Bf16Ops.matmul(m.ops, out, inp, name, l, bias, N, C, OC, nt)
        if name == "qkvw" and out.dtype == np.float32:
            out[:] = from_bf16(to_bf16(out))

    m.ops.attention_forward, m.ops.matmul = fp32_attention, rounding_matmul
    # the decode step's layers in one call read no patched op: run its layer loop (the same bits,
    # test_sample.py's test_decode_step_in_one_call_gives_the_bits_of_the_layer_loop)
    m._decode_layers = lambda x, cache: False
    m.forward(x)
    want = m.logits()[..., :MCFG.vocab_size].astype(np.float64)
    cache = KVCache(MCFG, 2, 20)
    h = np.concatenate([m.forward_cached(cache, x[:, :12]), m.forward_cached(cache, x[:, 12:13]),
                        m.forward_cached(cache, x[:, 13:])], axis=1)
    got = m.logits_from_hidden(h)
    # the training forward's logits are the lm head's rounded to bf16 (the cached forward's stay
    # fp32): each may differ by that rounding, at most half a bf16 ulp (2^-8 relative), beyond it
    # only by what the rest of the model does differently
    assert np.all(from_bf16(to_bf16(want)) == want)

    def err(g):
        return (np.maximum(np.abs(g - want) - 2.0 ** -8 * np.abs(g), 0)).max() / np.abs(want).max()
    assert err(got) < 1e-4, err(got)
    # ... and it is the bf16 model: the fp32 cached forward of the same weights differs more
    m32 = GPT2(MCFG, n_threads=2)
    m32.params[:] = m.params
    c32 = KVCache(MCFG, 2, 20)
    g32 = m32.logits_from_hidden(m32.forward_cached(c32, x))
    assert err(g32) > 1e-3, err(g32)


def test_bf16_eval_hellaswag_and_loss_agree_with_fp32(bf16_ok, tmp_path):
    from llmctl import formats
    from llmctl.evaluate import eval_hellaswag, eval_loss

    m32 = _init("fp32")
    ck = tmp_path / "m.bin"
    m32.save_checkpoint(ck)
    m16 = GPT2.from_checkpoint(ck, n_threads=2, precision="bf16")
    rng = np.random.default_rng(0)
    ex = [dict(label=int(rng.integers(4)), ctx_tokens=rng.integers(0, 500, 9).tolist(),
               ending_tokens=[rng.integers(0, 500, int(rng.integers(1, 6))).tolist() for _ in range(4)])
          for _ in range(6)]
    formats.write_evalfile(str(tmp_path / "hs.bin"), ex)
    r32 = eval_hellaswag(m32, str(tmp_path / "hs.bin"), per_example=True)
    r16 = eval_hellaswag(m16, str(tmp_path / "hs.bin"), per_example=True)
    assert (r32["precision"], r16["precision"]) == ("fp32", "bf16")   # the --json results say which
    a = np.array([e["losses_sum"] for e in r32["examples"]])
    b = np.array([e["losses_sum"] for e in r16["examples"]])
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max() and not np.array_equal(a, b)
    formats.write_datafile(str(tmp_path / "val.bin"), rng.integers(0, 500, 2000).astype(np.uint16))
    e32 = eval_loss(m32, str(tmp_path / "val.bin"), B=2, T=64)
    e16 = eval_loss(m16, str(tmp_path / "val.bin"), B=2, T=64)
    assert abs(e16["loss"] - e32["loss"]) <= 1e-2
    assert (e32["precision"], e16["precision"]) == ("fp32", "bf16")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hellaswag_scores_the_logits_the_training_forward_holds(precision, bf16_ok):
    # bf16 scores from bf16 logits, as `eval loss` (the training forward) and llm.c's bf16 model
    # hold them; fp32 from fp32 ones. Reference: the lm head's fp32 result, rounded to bf16 in
    # bf16, then log-softmax in float64
    from llmctl.evaluate import _token_losses

    m = _init(precision)
    rng = np.random.default_rng(5)
    h = (rng.normal(size=(37, MCFG.channels)) * 3).astype(np.float32)
    tg = rng.integers(0, MCFG.vocab_size, size=(37, 2))
    lg32 = m.logits_from_hidden(h).astype(np.float64)
    lg = from_bf16(to_bf16(lg32.astype(np.float32))).astype(np.float64) if precision == "bf16" else lg32
    if precision == "bf16":
        assert m.logits_from_hidden(h, as_trained=True).dtype == np.uint16
    lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
    want = lse[:, None] - np.take_along_axis(lg, tg, axis=1)
    got = _token_losses(m, h, tg, chunk=16)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    if precision == "bf16":   # and not the fp32 logits' losses
        lse32 = np.log(np.exp(lg32 - lg32.max(1, keepdims=True)).sum(1)) + lg32.max(1)
        assert np.abs(got - (lse32[:, None] - np.take_along_axis(lg32, tg, axis=1))).max() > 1e-4


@pytest.mark.skipif(matmul.bf16_native(), reason="this CPU runs bf16 natively")
@pytest.mark.parametrize("cmd", [["sample", "-n", "1"], ["eval", "loss"], ["eval", "hellaswag"]])
def test_cli_precision_bf16_without_native_bf16_is_one_clear_error(cmd, monkeypatch, capsys):
    from llmctl.cli import main
    from llmctl.info import bf16_sampling

    if cmd[0] == "sample" and bf16_sampling():
        pytest.skip("sample runs bf16 here on a copy of the bf16 GEMV (the test below)")
    monkeypatch.delenv("LLMCTL_BF16_EMULATE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(cmd + ["-e", "d6", "--precision", "bf16"])
    err = capsys.readouterr().err
    assert_cli_error(err, 2, e.value.code, names=["--precision bf16", "--precision fp32"])  # a usage error
    if bf16_sampling():   # and it says where bf16 does run
        name = {"avx2": "AVX2", "avx512_bf16": "AVX512_BF16"}[bf16_sampling()]
        assert f"`llmctl sample --precision bf16` runs on the bf16 GEMV's {name} copy" in err


@pytest.mark.parametrize("native,gemv", [(False, None), (False, "avx2"), (False, "avx512_bf16"), (True, "native")])
def test_check_precision_for_sampling_follows_the_gemv(native, gemv, monkeypatch):
    # the precision check's three cases on any CPU (the CPU's answers replaced): no native bf16
    # and no AVX2 GEMV refuses bf16 everywhere; the AVX2 GEMV allows it for sampling only; native
    # bf16 allows it everywhere. fp32 and emulate=True always pass; an unknown precision never.
    from llmctl import info

    monkeypatch.delenv("LLMCTL_BF16_EMULATE", raising=False)
    monkeypatch.setattr(info, "bf16_sampling", lambda: gemv)
    monkeypatch.setattr(info, "bf16_unavailable", lambda: None if native else "this CPU has no native bf16")
    assert info.check_precision("fp32") == info.check_precision("fp32", sampling=True) == "fp32"
    assert info.check_precision("bf16", emulate=True) == "bf16"
    for sampling in (False, True):
        if native or (sampling and gemv):
            assert info.check_precision("bf16", sampling=sampling) == "bf16"
        else:
            with pytest.raises(ConfigError, match="bf16 is not available: this CPU has no native bf16") as e:
                info.check_precision("bf16", sampling=sampling)
            assert ("`llmctl sample --precision bf16` runs" in str(e.value)) == (gemv is not None and not sampling)
    monkeypatch.setenv("LLMCTL_BF16_EMULATE", "1")
    assert info.check_precision("bf16") == "bf16"
    with pytest.raises(ConfigError, match="unknown precision"):
        info.check_precision("fp16", sampling=True)


@pytest.mark.skipif(matmul.bf16_native() or "avx2" not in matmul.gemv_bf16_isas(),
                    reason="bf16 sampling without native bf16 needs a CPU with AVX2 and FMA and no "
                           "AVX512_BF16/AMX (natively it is the bf16 sampling tested above)")
def test_cli_sample_bf16_on_avx2_decodes_on_the_gemv(monkeypatch, capsys):
    # no LLMCTL_BF16_EMULATE: `sample --precision bf16` runs, its decode steps on the GEMV's AVX2
    # copy (as AVX512_BF16 would give them), and its greedy text is the emulated model's
    import llmctl.sample as sample_mod
    from llmctl.cli import main

    monkeypatch.delenv("LLMCTL_BF16_EMULATE", raising=False)
    with pytest.raises(ConfigError, match="--precision bf16 is not available"):   # the library: still refused
        GPT2(GPT2Config.from_descriptor("d6"), precision="bf16")
    from llmctl._ext import decode

    rows, steps, real, real_step = [], [], matmul.matmul_forward_bf16, decode.decode_layers_bf16

    def counting(out, inp, weight, bias, BT, *a, **kw):
        rows.append(BT)
        return real(out, inp, weight, bias, BT, *a, **kw)

    def counting_step(*a):
        steps.append(a[8])    # B: the step's layers in one call, their products on the GEMV
        return real_step(*a)

    monkeypatch.setattr(matmul, "matmul_forward_bf16", counting)
    monkeypatch.setattr(decode, "decode_layers_bf16", counting_step)
    with pytest.raises(SystemExit) as e:
        main(["sample", "-e", "d6", "--precision", "bf16", "-n", "6", "--seed", "7", "--json"])
    assert e.value.code == 0
    got = json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"]
    # the one-token prompt and 5 decode steps: their layers in one call each, the lm head's row apart
    assert len(got) == 6 and steps == [1] * 6 and rows == [1] * 6
    monkeypatch.setattr(matmul, "matmul_forward_bf16", real)
    monkeypatch.setattr(decode, "decode_layers_bf16", real_step)
    m = GPT2.from_descriptor("d6", precision="bf16", bf16_emulate=True)
    assert m.ops.gemv_on_openmp
    for isa in ("off", None):   # the same samples with the GEMV and with the emulated GEMM
        old = matmul.set_gemv_isa(isa)
        try:
            want = sample_mod.sample(m, [sample_mod.EOT], max_new_tokens=6, seed=7)[0]["tokens"]
        finally:
            matmul.set_gemv_isa(old)
        assert want == got, isa


def test_bf16_model_reads_v5_bf16_checkpoints_bit_exactly(bf16_ok, tmp_path):
    # -e with llm.c's bf16 (v5) file: the fp32 master weights are its exact widening, and the
    # matmul copy is the file's own bits
    from llmctl import formats

    src = _init("fp32")
    src.save_checkpoint(tmp_path / "m5.bin", dtype="bfloat16")
    m = GPT2.from_checkpoint(tmp_path / "m5.bin", n_threads=2, precision="bf16")
    m.forward(*_data(B=1, T=8))
    _, bits = formats.read_checkpoint(str(tmp_path / "m5.bin"))
    np.testing.assert_array_equal(m.params_bf16, np.asarray(bits))
    np.testing.assert_array_equal(m.params, from_bf16(np.asarray(bits)))
