/* bfloat16 <-> float32 for llmctl's mixed-precision kernels.
 *
 * bf16 is the top half of an IEEE float32 (1 sign, 8 exponent, 7 mantissa bits), stored as
 * uint16_t. Widening is exact (shift left 16). Narrowing rounds to nearest, ties to even, as
 * PyTorch's `.to(torch.bfloat16)` (c10::round_to_nearest_even) does: add 0x7FFF plus the
 * lowest kept bit, keep the top half; a NaN becomes the quiet NaN 0x7FC0. Written in integer
 * operations only, so gcc vectorises loops that call it and every vector width gives the same bits.
 */
#ifndef LLMCTL_BF16_H
#define LLMCTL_BF16_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t llmctl_f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    /* a select, not and/or masks: gcc then blends once in 32-bit lanes and narrows once, where
       the masks were narrowed one by one (1.5x the time of a loop that rounds) */
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

static inline float llmctl_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* dst[i] = bf16(src[i]) for n elements */
static inline void llmctl_cast_bf16(uint16_t* dst, const float* src, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) dst[i] = llmctl_f32_to_bf16(src[i]);
}

/* dst[i] = float(src[i]) for n elements (exact) */
static inline void llmctl_widen_bf16(float* dst, const uint16_t* src, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) dst[i] = llmctl_bf16_to_f32(src[i]);
}
#endif
