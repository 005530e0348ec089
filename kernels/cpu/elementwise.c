/* RMSNorm and RoPE in one pass each, rounding where transformers' eager ops round.
 *
 * transformers computes RMSNorm as weight * (x * rsqrt(mean(x^2) + eps)) in float32, rounding the
 * normalised row to the activation dtype before the weight multiply; and RoPE as
 * x * cos + rotate_half(x) * sin, each product and the sum rounded to the activation dtype. In eager
 * torch that is five and six passes over the tensor; here it is one, with the same roundings (this file
 * is compiled without FMA contraction). Only the sum of squares is in a different order.
 */
#include <math.h>
#include <stdint.h>

#include "dtype.h"

#define LANES 8
#define PARALLEL_MIN_ELEMENTS 65536

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                            \
void NAME(T *out, const T *x, int64_t x_stride, const T *weight, int64_t rows, int64_t dim, float eps) {  \
    _Pragma("omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)")               \
    for (int64_t r = 0; r < rows; r++) {                                                                \
        const T *xr = x + r * x_stride;                                                                 \
        T *outr = out + r * dim;                                                                        \
        vec lanes = {0};                                                                                \
        int64_t d = 0;                                                                                  \
        for (; d + LANES <= dim; d += LANES) {                                                          \
            vec v;                                                                                      \
            for (int i = 0; i < LANES; i++) v[i] = LOAD(xr[d + i]);                                     \
            lanes += v * v;                                                                             \
        }                                                                                               \
        float sum = 0.0f;                                                                               \
        for (int i = 0; i < LANES; i++) sum += lanes[i];                                                \
        for (; d < dim; d++) sum += LOAD(xr[d]) * LOAD(xr[d]);                                          \
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);                                         \
        for (d = 0; d < dim; d++) outr[d] = STORE(LOAD(weight[d]) * LOAD(STORE(LOAD(xr[d]) * inv)));    \
    }                                                                                                   \
}

#define DEFINE_ROPE(NAME, T, LOAD, STORE)                                                                \
void NAME(T *x, int64_t tokens, int64_t heads, int64_t token_stride, const int64_t *positions,          \
          const T *cos, const T *signed_sin, int64_t head_dim) {                                          \
    const int64_t half = head_dim / 2;                                                                  \
    _Pragma("omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t t = 0; t < tokens; t++) {                                                              \
        const T *c = cos + positions[t] * head_dim, *s = signed_sin + positions[t] * head_dim;          \
        for (int64_t h = 0; h < heads; h++) {                                                           \
            T *row = x + t * token_stride + h * head_dim;                                               \
            for (int64_t d = 0; d < half; d++) {                                                        \
                const float a = LOAD(row[d]), b = LOAD(row[d + half]);                                  \
                const float lo = LOAD(STORE(a * LOAD(c[d]))) + LOAD(STORE(b * LOAD(s[d])));             \
                const float hi = LOAD(STORE(b * LOAD(c[d + half]))) + LOAD(STORE(a * LOAD(s[d + half]))); \
                row[d] = STORE(lo);                                                                     \
                row[d + half] = STORE(hi);                                                              \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
}

DEFINE_RMS_NORM(rms_norm_f32, float, F32_LOAD, F32_STORE)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, BF16_LOAD, BF16_STORE)
DEFINE_ROPE(rope_f32, float, F32_LOAD, F32_STORE)
DEFINE_ROPE(rope_bf16, uint16_t, BF16_LOAD, BF16_STORE)
