/* The MLP's activation for bfloat16 activations whose GEMMs run in float32 (a CPU without native bf16):
 * silu(gate) * up, taking the gate/up GEMM's float32 output and rounding where transformers' bf16 ops
 * round (the GEMM output, SiLU's result, the product), written as float32 for the float32 down
 * projection. Eager torch spends four passes on it (round, SiLU, multiply, widen for the next GEMM).
 *
 * Compiled with -ffast-math so that expf vectorises (libmvec); SiLU's float32 value may then differ from
 * torch's by an ulp, which the bf16 rounding right after hides except at an exact tie.
 */
#include <math.h>
#include <stdint.h>

#include "dtype.h"

#define PARALLEL_MIN_ELEMENTS 65536

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

void silu_mul_bf16(float *out, const float *gate_up, int64_t rows, int64_t inter) {
    #pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float g = round_bf16(gate[i]);
            const float silu = round_bf16(g / (1.0f + expf(-g)));
            o[i] = round_bf16(silu * round_bf16(up[i]));
        }
    }
}
