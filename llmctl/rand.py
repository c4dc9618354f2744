"""llm.c's random numbers (`llmc/rand.h`, PyTorch's CPU mt19937), reproduced in Python + NumPy.

What it is: `Mt19937` with the same seeding, output stream, float conversions, Box-Muller `normal_`
(16-block path with the n % 16 tail redo, and the n < 16 float64 path), `random_permutation`, and
the raw 2520-byte `mt19937_state` struct that llm.c's state files embed (`train_gpt2.cu` `save_state`).
The integer stream is exact: seeding is MT19937's classic init_genrand, so NumPy's
`MT19937()._legacy_seeding(seed)` + `random_raw()` produces the same words, vectorised.

Float math (normal_): every C step is reproduced with the same float32/float64 roundings
(`1e-12` is a double in rand.h, `2.0 * M_PI * u2` is computed in double, the rest in float).
`logf`/`cosf`/`sinf` come from the C library in llm.c, and by default here too: the Box-Muller
transform runs in llmctl._ext.randinit (Cython calling libm, no FMA contraction), fed with the
uniforms drawn here, so normal_ is bit-identical to rand.h compiled without -ffast-math against
the same libm (d12 init ~2 s). `libm=` picks the math explicitly:
  None  (default) the extension; if it is not built, the NumPy path below with a RuntimeWarning
  True  exact always: the extension, else the process's libm through ctypes (slow: one call per
        distinct input, memoised over the 2^24 possible uniforms; `release_libm_memo()`)
  False correctly rounded NumPy math (float64 rounded to float32), which agrees with glibc's
        float functions on ~99% of inputs and is otherwise a few float32 ulps away
  "ctypes" the process's libm through ctypes even where the extension is built (True's fallback,
        chosen on purpose: to check one exact path against the other)

What it is not: a general RNG library. It mirrors rand.h only.
"""
import ctypes
import ctypes.util
import struct
import warnings

import numpy as np

from llmctl.errors import FormatError

try:
    from llmctl._ext import randinit as _randinit
except ImportError:  # not built: normal_ falls back to NumPy math (see _math_for)
    _randinit = None

N_STATE = 624
MATRIX_A = 0x9908B0DF
STATE_STRUCT_BYTES = 2520  # uint64 seed_, int32 left_, uint32 next_, uint32 state_[624], uint32 MATRIX_A[2]
_STATE_FMT = "<QiI624I2I"
assert struct.calcsize(_STATE_FMT) == STATE_STRUCT_BYTES

_TWO_PI = 6.283185307179586  # (2.0 * M_PI) as C folds it, in double
_CHUNK = 1 << 20  # uniforms per Box-Muller chunk (a multiple of 16)


class Mt19937:
    """mt19937_state + manual_seed/randint32 of llmc/rand.h.

    Internally the words come from NumPy's MT19937 bit generator; `_fresh` remembers whether the
    state is exactly as manual_seed left it (C: left_=1, next_=0) as opposed to a used-up block
    (left_=1, next_=624), which NumPy cannot tell apart but the 2520-byte struct can.
    """

    def __init__(self, seed=None):
        self._bg = np.random.MT19937()
        self._seed_field = 0  # rand.h never writes seed_; we keep whatever a state file had
        self._fresh = False
        self.manual_seed(5489 if seed is None else seed)

    def manual_seed(self, seed):
        self._bg._legacy_seeding(int(seed) & 0xFFFFFFFF)
        self._fresh = True

    # -- integers ---------------------------------------------------------------------------
    def randint32(self):
        """One uint32 as a Python int."""
        self._fresh = False
        return int(self._bg.random_raw())

    def randint32_array(self, n):
        """n consecutive randint32() outputs as a uint32 array."""
        n = int(n)
        if n <= 0:
            return np.zeros(0, dtype=np.uint32)
        self._fresh = False
        return self._bg.random_raw(n).astype(np.uint32)

    def randint64(self):
        hi = self.randint32()
        return (hi << 32) | self.randint32()

    # -- floats -----------------------------------------------------------------------------
    def randfloat32(self):
        return float(np.float32((self.randint32() & 0xFFFFFF) * (1.0 / (1 << 24))))

    def randfloat32_array(self, n):
        # (u & 0xFFFFFF) * 2^-24 is exact in float32
        return (self.randint32_array(n) & np.uint32(0xFFFFFF)).astype(np.float32) * np.float32(2.0 ** -24)

    def randfloat64(self):
        return (self.randint64() & ((1 << 53) - 1)) * (1.0 / (1 << 53))

    def randfloat64_array(self, n):
        w = self.randint32_array(2 * n).astype(np.uint64)
        u = ((w[0::2] << np.uint64(32)) | w[1::2]) & np.uint64((1 << 53) - 1)
        return u.astype(np.float64) * (1.0 / (1 << 53))  # exact: < 2^53

    def normal_(self, x, mean=0.0, std=1.0, libm=None, n_threads=1):
        """rand.h normal_: fill `x` (a float32 array, in place; returned) or, if `x` is an int,
        a new float32 array of that length, with N(mean, std) draws. `libm`: see the module
        docstring (None = exact via llmctl._ext.randinit). n_threads only splits the extension's
        16-blocks, which are independent: the bits do not depend on it."""
        if isinstance(x, (int, np.integer)):
            out = np.zeros(int(x), dtype=np.float32)
        else:
            out = x
            if out.dtype != np.float32:
                raise TypeError("normal_ fills float32 arrays")
        flat = out.reshape(-1)  # a view for contiguous arrays; checked below
        if not np.shares_memory(flat, out) and out.size:
            raise ValueError("normal_ needs a contiguous array")
        n = flat.size
        mean32, std32 = np.float32(mean), np.float32(std)
        fn = _math_for(libm)
        if n >= 16:
            nfull = n // 16 * 16
            for i in range(0, nfull, _CHUNK):  # blocks are independent: chunk to bound temporaries
                k = min(_CHUNK, nfull - i)
                d = self.randfloat32_array(k).reshape(k // 16, 16)
                flat[i:i + k] = _box_muller16(d, mean32, std32, fn, n_threads).reshape(-1)
            if n % 16:
                self.randfloat32_array(n - nfull)  # rand.h draws all n uniforms before the tail redo
                tail = self.randfloat32_array(16).reshape(1, 16)
                flat[n - 16:] = _box_muller16(tail, mean32, std32, fn, 1).reshape(-1)
        elif fn is _EXT:
            u = self.randfloat64_array(2 * ((n + 1) // 2))  # (angle, radius) per pair, draw order
            small = np.empty(n, dtype=np.float32)
            _randinit.normal_small(u, small, mean32, std32)
            flat[:] = small
        else:
            # small path: pairs from two randfloat64 (u1 -> angle, u2 -> radius); the sin value
            # is kept (as a double) for the next slot
            has_next, nxt = False, 0.0
            for t in range(n):
                if has_next:
                    flat[t] = np.float32(nxt * float(std32) + float(mean32))
                    has_next = False
                    continue
                u1 = np.float32(self.randfloat64())
                u2 = np.float32(self.randfloat64())
                a = np.float32(float(np.float32(1) - u2) + 1e-12)
                radius = np.sqrt(np.float32(-2) * fn.log(np.array([a]))[0])
                theta = np.array([np.float32(_TWO_PI * float(u1))])
                nxt = float(np.float32(radius * fn.sin(theta)[0]))
                has_next = True
                flat[t] = np.float32(np.float32(radius * fn.cos(theta)[0]) * std32) + mean32
        return out

    # -- the C struct -----------------------------------------------------------------------
    def get_state_bytes(self):
        """The 2520-byte `mt19937_state` exactly as llm.c writes it into a state file."""
        st = self._bg.state["state"]
        key, pos = st["key"], int(st["pos"])
        if pos >= N_STATE:
            left, nxt = 1, (0 if self._fresh else N_STATE)
        else:
            left, nxt = N_STATE + 1 - pos, pos
        return struct.pack(_STATE_FMT, self._seed_field, left, nxt, *[int(k) for k in key], 0, MATRIX_A)

    def set_state_bytes(self, b, what="mt19937 state"):
        """Restore from the 2520-byte struct; FormatError if it is not a state rand.h can produce."""
        b = bytes(b)
        if len(b) != STATE_STRUCT_BYTES:
            raise FormatError(f"{what}: expected {STATE_STRUCT_BYTES} bytes, got {len(b)}")
        vals = struct.unpack(_STATE_FMT, b)
        seed_field, left, nxt = vals[0], vals[1], vals[2]
        key = np.array(vals[3:3 + N_STATE], dtype=np.uint32)
        ma = vals[3 + N_STATE:]
        if ma != (0, MATRIX_A):
            raise FormatError(f"{what}: MATRIX_A is {ma[0]:#x},{ma[1]:#x}, not 0,0x9908b0df (not a seeded mt19937)")
        fresh = (left == 1 and nxt == 0)
        if not (fresh or (1 <= left <= N_STATE and 1 <= nxt <= N_STATE and left + nxt == N_STATE + 1)):
            raise FormatError(f"{what}: inconsistent left_={left} next_={nxt}")
        pos = N_STATE if left == 1 else nxt
        self._bg.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}
        self._seed_field = seed_field
        self._fresh = fresh


def random_permutation(arr, rng):
    """rand.h random_permutation, in place on a 1-D integer array: for i = n-1..1,
    j = randint32() % (i+1), swap. Consumes exactly n-1 words. Returns arr."""
    n = len(arr)
    if n <= 1:
        return arr
    i = np.arange(n - 1, 0, -1, dtype=np.uint64)
    js = (rng.randint32_array(n - 1).astype(np.uint64) % (i + np.uint64(1))).tolist()
    a = arr.tolist()
    for i_, j in zip(range(n - 1, 0, -1), js):
        a[i_], a[j] = a[j], a[i_]
    arr[:] = a
    return arr


# ----------------------------------------------------------------------------------------------
# Box-Muller over (k, 16) blocks, float32 exactly as normal_fill_16 does it

class _NumpyMath:
    @staticmethod
    def log(x):
        return np.log(x.astype(np.float64)).astype(np.float32)

    @staticmethod
    def cos(x):
        return np.cos(x.astype(np.float64)).astype(np.float32)

    @staticmethod
    def sin(x):
        return np.sin(x.astype(np.float64)).astype(np.float32)


class _LibmMath:
    """The C library's logf/cosf/sinf, one ctypes call per element (exact, slow)."""

    def __init__(self):
        self._lib = None

    def _f(self, name):
        if self._lib is None:
            self._lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
            for fn in ("logf", "cosf", "sinf"):
                getattr(self._lib, fn).restype = ctypes.c_float
                getattr(self._lib, fn).argtypes = [ctypes.c_float]
        return getattr(self._lib, name)

    def _apply(self, name, x):
        f = self._f(name)
        return np.fromiter(map(f, x.reshape(-1).tolist()), dtype=np.float32, count=x.size).reshape(x.shape)

    def log(self, x):
        return self._apply("logf", x)

    def cos(self, x):
        return self._apply("cosf", x)

    def sin(self, x):
        return self._apply("sinf", x)


_NUMPY = _NumpyMath()
_LIBM = _LibmMath()
_EXT = object()  # marker: the transform runs in llmctl._ext.randinit
_warned_fallback = False


def _math_for(libm):
    """None -> extension (else NumPy + one RuntimeWarning); True -> extension, else ctypes libm;
    "ctypes" -> ctypes libm; False -> NumPy."""
    global _warned_fallback
    if isinstance(libm, str):
        if libm != "ctypes":
            raise ValueError(f"libm={libm!r}: use None, True, False or 'ctypes'")
        return _LIBM
    if libm is not None and not libm:  # False (or 0)
        return _NUMPY
    if _randinit is not None:
        return _EXT
    if libm:
        return _LIBM
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn("llmctl._ext.randinit is not built: normal_ falls back to correctly rounded "
                      "NumPy math (a few float32 ulps from llm.c on ~1% of draws); run "
                      "python setup.py build_ext --inplace", RuntimeWarning, stacklevel=3)
    return _NUMPY


def _radius(u, fn):
    """sqrtf(-2 * logf((1 - u) + 1e-12)) for uniforms u = k * 2^-24, as normal_fill_16 computes it."""
    u1 = np.float32(1) - u                                                # float, exact
    a = (u1.astype(np.float64) + 1e-12).astype(np.float32)                # u1 + EPSILONE in double
    return np.sqrt(np.float32(-2) * fn.log(a))                            # float


def _theta(u):
    return (_TWO_PI * u.astype(np.float64)).astype(np.float32)            # double, then float


class _LibmMemo:
    """libm results memoised over the 2^24 possible uniforms of the 16-block path.

    randfloat32 keeps 24 bits, so radius and cos/sin(theta) only ever see 2^24 distinct inputs
    each; a large normal_ (d12's wte: 19M pairs) repeats most of them. Each missing value costs one
    ctypes call; the tables (3 x 64 MiB, allocated lazily, pages touched as they fill) cap the
    total at 3 x 2^24 calls per process however many parameters are drawn.
    """

    def __init__(self):
        self.tab = None

    def _tables(self):
        if self.tab is None:
            n = 1 << 24
            self.tab = {k: np.zeros(n, dtype=np.float32) for k in ("radius", "cos", "sin")}
            self.tab.update(known_r=np.zeros(n, dtype=bool), known_t=np.zeros(n, dtype=bool))
        return self.tab

    def box_muller16(self, d, mean, std):
        t = self._tables()
        k = (d * np.float32(1 << 24)).astype(np.int64)  # exact: d = k * 2^-24
        kr, kt = k[:, :8], k[:, 8:]
        need = np.unique(kr[~t["known_r"][kr]])
        if need.size:
            t["radius"][need] = _radius(need.astype(np.float32) * np.float32(2.0 ** -24), _LIBM)
            t["known_r"][need] = True
        need = np.unique(kt[~t["known_t"][kt]])
        if need.size:
            th = _theta(need.astype(np.float32) * np.float32(2.0 ** -24))
            t["cos"][need] = _LIBM.cos(th)
            t["sin"][need] = _LIBM.sin(th)
            t["known_t"][need] = True
        radius = t["radius"][kr]
        out = np.empty_like(d)
        out[:, :8] = (radius * t["cos"][kt]) * std + mean
        out[:, 8:] = (radius * t["sin"][kt]) * std + mean
        return out


_MEMO = _LibmMemo()


def release_libm_memo():
    """Free the libm memo tables (up to 224 MiB after a large libm=True draw)."""
    _MEMO.tab = None


def _box_muller16(d, mean, std, fn, n_threads=1):
    if fn is _EXT:
        _randinit.box_muller16(d, mean, std, n_threads)  # in place
        return d
    if fn is _LIBM:
        return _MEMO.box_muller16(d, mean, std)
    radius = _radius(d[:, :8], fn)
    theta = _theta(d[:, 8:])
    out = np.empty_like(d)
    out[:, :8] = (radius * fn.cos(theta)) * std + mean
    out[:, 8:] = (radius * fn.sin(theta)) * std + mean
    return out
