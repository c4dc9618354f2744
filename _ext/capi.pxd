# C entry points one kernel module lends another, so that a caller can run several kernels in one
# call into Cython (decode.pyx: every layer of a decode step) without a Python call per kernel.
#
# What it is: the C signatures of the lent kernels, and the two helpers that pass a function
# through a PyCapsule (each module's `c_api()` returns a dict name -> capsule; the borrower takes
# the pointers once, at import). A lent kernel is the very function its module's `def` wrapper
# calls, with that module's run-time choices (its ISA copy, set by its set_isa/set_simd) in
# force, so the borrower gets the same bits. What it is not: argument checking (the borrower
# checks its own arguments) or a stable ABI (the modules are always built together).
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_New
from libc.stdint cimport uint16_t

# matmul.pyx: out (R,OC) fp32 = x (R,C) bf16 @ W (OC,C)^T bf16 + bias (or NULL), gemv_bf16.h
ctypedef void (*gemv_bf16_fn)(float* out, const uint16_t* x, const uint16_t* W, const float* bias,
                              int R, int C, int OC, int n_threads) noexcept nogil
# layers.pyx: layernorm_forward_bf16 (residual NULL, or inp += residual first)
ctypedef void (*layernorm_bf16_fn)(uint16_t* out, float* mean, float* rstd, float* inp,
                                   const float* weight, const float* bias, int N, int C,
                                   const float* residual, int n_threads) noexcept nogil
# layers.pyx: gelu_forward_bf16 on bf16 input
ctypedef void (*gelu_bf16_fn)(uint16_t* out, const uint16_t* inp, Py_ssize_t N, int n_threads) noexcept nogil
# layers.pyx: residual_forward
ctypedef void (*residual_fn)(float* out, const float* inp1, const float* inp2, Py_ssize_t N,
                             int n_threads) noexcept nogil
# kvcache.pyx: kvcache_append_forward
ctypedef void (*kv_append_fn)(float* kcache, float* vcache, const float* qkv, const int* pos,
                              int B, int Tq, int C, int NH, int Tcap, int n_threads) noexcept nogil
# kvcache.pyx: attention_cached (prefix pointers NULL and Tp 0 without one); -1: out of memory
ctypedef int (*kv_attend_fn)(float* out, const float* qkv, const float* kcache, const float* vcache,
                             const int* pos, int B, int Tq, int C, int NH, int Tcap,
                             const float* kpre, const float* vpre, const int* pre_row,
                             const int* pre_len, int Tp, int n_threads) noexcept nogil

cdef inline object fn_capsule(void* fn):
    return PyCapsule_New(fn, b"llmctl.capi", NULL)

cdef inline void* fn_pointer(object api, str name) except NULL:
    return PyCapsule_GetPointer(api[name], b"llmctl.capi")
