# bf16 for the Cython kernels: bf16.h's conversions, and the fused output type of the kernels
# that write either fp32 or bf16 (layernorm, GELU, the loss backward).
#
# A kernel written once over `out_t` is compiled twice, and `store` is resolved per copy at
# compile time (`if out_t is float`): the fp32 copy writes the value, the bf16 copy rounds it
# with llmctl_f32_to_bf16 as it is written. Both compute the same float values in the same
# order, so the bf16 output is always bf16(the fp32 output).
from libc.stdint cimport uint16_t

cdef extern from "bf16.h" nogil:
    uint16_t llmctl_f32_to_bf16(float x)
    float llmctl_bf16_to_f32(uint16_t h)
    void llmctl_cast_bf16(uint16_t* dst, const float* src, Py_ssize_t n)
    void llmctl_widen_bf16(float* dst, const uint16_t* src, Py_ssize_t n)

ctypedef fused out_t:
    float
    uint16_t


cdef inline void store(out_t* dst, Py_ssize_t i, float x) noexcept nogil:
    # dst[i] = x, rounded to nearest even when dst is bf16
    if out_t is float:
        dst[i] = x
    else:
        dst[i] = llmctl_f32_to_bf16(x)
