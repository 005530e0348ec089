/* The MLP's activation between float32 GEMMs: silu(gate) * up from the gate/up GEMM's float32 output
 * [rows, 2 * inter], written as float32 [rows, inter] for the down projection, in one pass.
 *
 * A float32 model gets the plain product. A bfloat16 model whose GEMMs run in float32 (a CPU without
 * native bf16) gets it rounded where transformers' bf16 ops round (the GEMM output, SiLU's result, the
 * product); eager torch spends four passes on that (round, SiLU, multiply, widen for the next GEMM).
 * On this project's AVX2 CPU the float32 pass also beat oneDNN's SiLU and multiply post-ops on two
 * GEMMs for the gate and the up half (see docs/architecture.md).
 *
 * expf is our own (exp_f32, exp.h) rather than libmvec's: -ffast-math's vector expf is up to 4 ulp off on
 * AVX2, which moved ~0.1% of bf16 SiLU results by a bf16 ulp; exp_f32 stays within 2 ulp of torch's
 * float32 SiLU (no bf16 result moved over 400k draws) and still vectorises (no -ffast-math needed).
 */
#include <math.h>
#include <stdint.h>

#include "dtype.h"
#include "exp.h"

#define PARALLEL_MIN_ELEMENTS 65536

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
static inline float keep_f32(float x) { return x; }

#define DEFINE_SILU_MUL(suffix, ROUND)                                                             \
    void silu_mul_##suffix(float *out, const float *gate_up, int64_t rows, int64_t inter) {          \
        _Pragma("omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)")     \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            const float *gate = gate_up + r * 2 * inter, *up = gate + inter;                         \
            float *o = out + r * inter;                                                              \
            for (int64_t i = 0; i < inter; i++) {                                                    \
                const float g = ROUND(gate[i]);                                                      \
                const float silu = ROUND(g / (1.0f + exp_f32(-g)));                                     \
                o[i] = ROUND(silu * ROUND(up[i]));                                                   \
            }                                                                                        \
        }                                                                                            \
    }

DEFINE_SILU_MUL(f32, keep_f32)
DEFINE_SILU_MUL(bf16, round_bf16)
