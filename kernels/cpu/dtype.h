/* float32 and bfloat16 element access for the CPU kernels: bf16 is the high half of a float32, and
 * is rounded to nearest-even on store, as torch rounds (NaN is kept a NaN). */
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
#define BF16_LOAD(x) bf16_to_f32(x)
#define BF16_STORE(x) f32_to_bf16(x)
