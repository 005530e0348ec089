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

/* One row of RMSNorm and one token's heads of RoPE; the entry points below run them over a batch, and the
 * fused decode step (decode.c) calls them row by row inside its own parallel region. */
#define DEFINE_ROWS(SUFFIX, T, LOAD, STORE)                                                              \
void rms_norm_row_##SUFFIX(T *outr, const T *xr, const T *weight, int64_t dim, float eps) {               \
    vec lanes = {0};                                                                                    \
    int64_t d = 0;                                                                                      \
    for (; d + LANES <= dim; d += LANES) {                                                              \
        vec v;                                                                                          \
        for (int i = 0; i < LANES; i++) v[i] = LOAD(xr[d + i]);                                         \
        lanes += v * v;                                                                                 \
    }                                                                                                   \
    float sum = 0.0f;                                                                                   \
    for (int i = 0; i < LANES; i++) sum += lanes[i];                                                    \
    for (; d < dim; d++) sum += LOAD(xr[d]) * LOAD(xr[d]);                                              \
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);                                             \
    for (d = 0; d < dim; d++) outr[d] = STORE(LOAD(weight[d]) * LOAD(STORE(LOAD(xr[d]) * inv)));        \
}                                                                                                       \
                                                                                                        \
void rope_token_##SUFFIX(T *x, int64_t heads, int64_t position, const T *cos, const T *signed_sin,       \
                         int64_t head_dim) {                                                             \
    const int64_t half = head_dim / 2;                                                                  \
    const T *c = cos + position * head_dim, *s = signed_sin + position * head_dim;                      \
    for (int64_t h = 0; h < heads; h++) {                                                               \
        T *row = x + h * head_dim;                                                                      \
        for (int64_t d = 0; d < half; d++) {                                                            \
            const float a = LOAD(row[d]), b = LOAD(row[d + half]);                                      \
            const float lo = LOAD(STORE(a * LOAD(c[d]))) + LOAD(STORE(b * LOAD(s[d])));                 \
            const float hi = LOAD(STORE(b * LOAD(c[d + half]))) + LOAD(STORE(a * LOAD(s[d + half])));   \
            row[d] = STORE(lo);                                                                         \
            row[d + half] = STORE(hi);                                                                  \
        }                                                                                               \
    }                                                                                                   \
}                                                                                                       \
                                                                                                        \
void rms_norm_##SUFFIX(T *out, const T *x, int64_t x_stride, const T *weight, int64_t rows, int64_t dim,  \
                       float eps) {                                                                      \
    _Pragma("omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)")               \
    for (int64_t r = 0; r < rows; r++) rms_norm_row_##SUFFIX(out + r * dim, x + r * x_stride, weight, dim, eps); \
}                                                                                                       \
                                                                                                        \
void rope_##SUFFIX(T *x, int64_t tokens, int64_t heads, int64_t token_stride, const int64_t *positions,  \
                   const T *cos, const T *signed_sin, int64_t head_dim) {                                \
    _Pragma("omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t t = 0; t < tokens; t++)                                                                \
        rope_token_##SUFFIX(x + t * token_stride, heads, positions[t], cos, signed_sin, head_dim);      \
}

DEFINE_ROWS(f32, float, F32_LOAD, F32_STORE)
DEFINE_ROWS(bf16, uint16_t, BF16_LOAD, BF16_STORE)

/* x (n values) times the Walsh-Hadamard matrix of order g = n & -n (the largest power of two dividing n) in each
 * group of g, unnormalised (entries +-1; Sylvester's order): int8 KV pages store keys so rotated, which spreads a
 * key's few large channels over its group, and their queries rotated alike and then times 1/g (`query`: H H = g I,
 * so q . k holds). Each butterfly is one addition or subtraction, compiled without fast math:
 * kernels/attention/int8_kv.py's `rotate` and `rotate_queries` give the same float32 values bit for bit. */
void hadamard_groups_f32(float *x, int64_t n, int query) {
    const int64_t g = n & -n;
    for (int64_t h = 1; h < g; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    if (query)
        for (int64_t d = 0; d < n; d++) x[d] *= 1.0f / (float)g;
}
