/* A vectorisable float32 exp for SiLU (activation.c, quant.c): see activation.c for why not libmvec's. */
#pragma once
#include <math.h>
#include <stdint.h>

/* exp(x) = 2^n * exp(r), r = x - n*ln2 with ln2 in two parts (Cody-Waite), |r| <= ln2/2, exp(r) by its
 * degree-7 Taylor polynomial (truncation under 0.1 ulp). Branch-free selects, so the loop vectorises.
 * Below -87 it returns 0 (a denormal at most: SiLU's 1 + exp(-g) does not see it). */
static inline float exp_f32(float x) {
    const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(clamped * 1.44269504088896341f);
    float r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.98412698e-4f;
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    const float y = p * scale.f;
    return x < -87.0f ? 0.0f : (x > 88.72283935546875f ? INFINITY : y);
}
