/* The quantized products' types and the pieces the fused decode step (decode.c) runs inside its own parallel
 * region (quant.c explains the formats and the arithmetic). */
#pragma once
#include <stdint.h>

#define PANEL 8 /* rows interleaved in a panel */

/* 32 values of a row of x, to about 15 bits: x = d * (q + r / RESIDUAL) with d = max|x| / 127, q = round(x / d)
 * and r the rounding residual, itself rounded to 8 bits; s = d * sum(q + r / RESIDUAL), and per half of 16. */
typedef struct {
    float d, s, s_lo, s_hi;
    int8_t q[32], r[32];
} act_block;

typedef struct {
    int32_t type;
    const uint8_t *data;  /* panels (T_F32, T_BF16: plain float32 or bfloat16 rows) */
    int64_t rows;         /* real rows (the last panel may be part padding) */
    int64_t col;          /* its first output column */
} segment;

/* What the product does to each row of x first: nothing; RMSNorm with a weight (the norm before q/k/v or
 * gate/up, not written out); or act(gate) * up of a [gate | up] row of 2k values (the MLP's activation: SiLU, or
 * GELU's tanh form for Gemma). */
enum { INPUT_AS_IS = 0, INPUT_RMS_NORM = 1, INPUT_SILU_MUL = 2, INPUT_GELU_MUL = 3 };

/* One product of q_linear, its arguments by name (kernels/cpu/__init__.py mirrors it, checked by size):
 * out[m, n] = f(x)[m, k] W^T (+ bias) (+ add), f as `input` says, W the row-wise concatenation of `nseg` segments.
 * `add` may be `out` (a residual added in place). */
typedef struct {
    float *out;
    int64_t out_stride;
    const float *x;
    int64_t x_stride;
    int64_t m, k;
    int32_t input;
    const float *norm_weight; /* INPUT_RMS_NORM's weight, with eps */
    float eps;
    const segment *segs;
    int64_t nseg;
    const float *bias;        /* or NULL */
    const float *add;         /* or NULL; its row stride add_stride */
    int64_t add_stride;
} linear_call;

/* Rows [r0, r1) of the product's input: transformed as `input` says (into `rows`, [m, k], unless AS_IS) and
 * quantized into `scratch` ([m, k / 32] blocks). */
void q_prepare_rows(int32_t input, const float *x, int64_t x_stride, int64_t r0, int64_t r1, int64_t k,
                    const float *norm_weight, float eps, float *rows, act_block *scratch);

/* The units of work of the segments (a panel, or a pair of panels where the 512-bit products are built), and
 * global unit u's output columns for all m rows of the prepared input. */
int64_t q_units(const segment *segs, int64_t nseg);
void q_unit(const segment *segs, int64_t u, const act_block *scratch, const float *xs, int64_t xs_stride, int64_t m,
            int64_t k, float *out, int64_t out_stride, const float *bias, const float *add, int64_t add_stride);
