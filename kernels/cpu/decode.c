/* A model's layers in one call and one parallel region, for a model whose projections are all in block
 * formats (quant.c), on steps whose attention runs all through the C kernel (attention.c).
 *
 * Called layer by layer from Python, a decode step of a small model is mostly not arithmetic: each of a
 * layer's six C calls pays the interpreter, ctypes and an OpenMP team's start and join, some 10-15 us, about
 * as long as the work of a 576-wide projection. Here the team starts once per step and the stages of every
 * layer are worksharing loops inside it, separated by their barriers:
 *   1. RMSNorm of x and its quantization, per row        2. the q/k/v product, per unit of panels (+ bias)
 *   3. Qwen3's per-head q/k norms, then RoPE, per head    4. the step's K and V into the pool, per token (int8
 *                                                            rows quantized per KV head, where the pool is int8)
 *   5. attention, per (tokens, KV head)                   6. quantization of the attention's output, per row
 *   7. x += the o product, per unit                       8. RMSNorm of x and its quantization, per row
 *   9. the gate/up product, per unit                     10. act(gate) * up and its quantization, per row
 *  11. x += the down product, per unit
 * Gemma normalises each half's output before it joins x: stages 7 and 11 then write the product apart, and a
 * per-row stage adds its RMSNorm to x; its layers rotate by their own RoPE tables (local and global bases).
 * Every stage is the function the per-call path runs (RMSNorm and RoPE of elementwise.c, attention.c's
 * item, quant.c's input preparation and panels), so both paths compute the same numbers, bit for bit.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "quant.h"

void rms_norm_row_f32(float *out, const float *x, const float *weight, int64_t dim, float eps);
void rope_token_f32(float *x, int64_t heads, int64_t position, const float *cos, const float *signed_sin,
                    int64_t head_dim);

typedef struct { /* one product: its segments and its bias (NULL: none) */
    const segment *segs;
    int64_t nseg;
    const float *bias;
} product;

typedef struct { /* one layer's weights, its share of the KV pool and its attention window (0: none) */
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: NULL but for Qwen3 and Gemma 3 */
    const float *attn_out_norm, *mlp_out_norm;            /* Gemma's norms of each half's output; NULL elsewhere */
    const float *cos, *signed_sin;                        /* this layer's RoPE tables [positions, head_dim] */
    product qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* float32, or int8 rows (kv_q8: attention.h) */
    int64_t window;
} layer_plan;

typedef struct { /* the model's shape and what every layer shares */
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;   /* scale: of q . k */
    int32_t activation; /* INPUT_SILU_MUL or INPUT_GELU_MUL */
    int32_t kv_q8;      /* 1: the pools hold int8 rows (attention.h) */
    const layer_plan *layers;
} model_plan;

/* Gemma's end of a half (after stage 7 or 11): x += RMSNorm(part) per row, part the half's product. */
static void add_normed(float *x, float *part, int64_t tokens, int64_t hidden, const float *weight, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < tokens; r++) {
        float *row = part + r * hidden, *stream = x + r * hidden;
        rms_norm_row_f32(row, row, weight, hidden, eps);
        for (int64_t i = 0; i < hidden; i++) stream[i] = stream[i] + row[i];
    }
}

/* One product over the prepared input (stages 2, 7, 9, 11): its units shared out, output written once each. */
static void run_product(const product *w, const act_block *scratch, const float *xs, int64_t xs_stride, int64_t m,
                        int64_t k, float *out, int64_t out_stride, const float *add) {
    const int64_t units = q_units(w->segs, w->nseg);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++)
        q_unit(w->segs, u, scratch, xs, xs_stride, m, k, out, out_stride, w->bias, add, add ? out_stride : 0);
}

/* x ([tokens, hidden], the residual stream) through every layer. Token t is at `positions[t]` and writes its
 * K/V to KV location out_locs[t]; it attends to the first kv_lens[t] KV locations of request-table row rows[t].
 * Returns 0, or -1 where memory ran out. */
int32_t q_decode_layers(float *x, int64_t tokens, const model_plan *plan, const int64_t *positions,
                        const int64_t *table, int64_t table_stride, const int64_t *rows, const int64_t *kv_lens,
                        const int64_t *out_locs) {
    const int64_t hidden = plan->hidden, head_dim = plan->head_dim, q_size = plan->heads * head_dim;
    const int64_t kv_size = plan->kv_heads * head_dim, qkv_width = q_size + 2 * kv_size, inter = plan->inter;
    const int64_t widest = inter > hidden ? (inter > q_size ? inter : q_size) : (hidden > q_size ? hidden : q_size);
    float *qkv = malloc((size_t)(tokens * qkv_width) * sizeof(float));
    float *attn = malloc((size_t)(tokens * q_size) * sizeof(float));
    float *gate_up = malloc((size_t)(tokens * 2 * inter) * sizeof(float));
    float *prepared = malloc((size_t)(tokens * widest) * sizeof(float));
    act_block *scratch = malloc((size_t)(tokens * (widest / 32)) * sizeof(act_block));
    float *part = malloc((size_t)(tokens * hidden) * sizeof(float)); /* a half's output, where it is normalised */
    int32_t status = 0;
    if (!qkv || !attn || !gate_up || !prepared || !scratch || !part) {
        status = -1;
        goto done;
    }
#pragma omp parallel
    for (int64_t l = 0; l < plan->num_layers; l++) {
        const layer_plan *L = plan->layers + l;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < tokens; r++)
            q_prepare_rows(INPUT_RMS_NORM, x, hidden, r, r + 1, hidden, L->input_norm, plan->eps, prepared, scratch);
        run_product(&L->qkv, scratch, prepared, hidden, tokens, hidden, qkv, qkv_width, NULL);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < tokens * (plan->heads + plan->kv_heads); item++) {
            const int64_t t = item / (plan->heads + plan->kv_heads), h = item % (plan->heads + plan->kv_heads);
            float *row = qkv + t * qkv_width + h * head_dim;
            const float *norm = h < plan->heads ? L->q_norm : L->k_norm;
            if (norm) rms_norm_row_f32(row, row, norm, head_dim, plan->eps);
            rope_token_f32(row, 1, positions[t], L->cos, L->signed_sin, head_dim);
        }
        if (plan->kv_q8) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < tokens * plan->kv_heads; i++) {
                const int64_t t = i / plan->kv_heads, h = i % plan->kv_heads;
                const float *k = qkv + t * qkv_width + q_size + h * head_dim;
                kv_store_q8_head(L->k_cache, L->v_cache, out_locs[t], h, plan->kv_heads, k, k + kv_size, head_dim);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tokens; t++) {
                memcpy((float *)L->k_cache + out_locs[t] * kv_size, qkv + t * qkv_width + q_size,
                       (size_t)kv_size * sizeof(float));
                memcpy((float *)L->v_cache + out_locs[t] * kv_size, qkv + t * qkv_width + q_size + kv_size,
                       (size_t)kv_size * sizeof(float));
            }
        }
        const attention_call call = {.out = attn, .q = qkv, .q_stride = qkv_width, .k_pool = L->k_cache,
                                     .v_pool = L->v_cache, .table = table, .table_stride = table_stride,
                                     .rows = rows, .kv_lens = kv_lens, .batch = tokens, .num_heads = plan->heads,
                                     .num_kv_heads = plan->kv_heads, .head_dim = head_dim, .scale = plan->scale,
                                     .window = L->window, .kv_q8 = plan->kv_q8};
        const int64_t tile = attention_tile_tokens(&call, omp_get_num_threads());
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < attention_items(&call, tile); item++) attention_item_f32(&call, item, tile);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < tokens; r++)
            q_prepare_rows(INPUT_AS_IS, attn, q_size, r, r + 1, q_size, NULL, 0.0f, NULL, scratch);
        if (L->attn_out_norm) {
            run_product(&L->o, scratch, attn, q_size, tokens, q_size, part, hidden, NULL);
            add_normed(x, part, tokens, hidden, L->attn_out_norm, plan->eps);
        } else {
            run_product(&L->o, scratch, attn, q_size, tokens, q_size, x, hidden, x);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < tokens; r++)
            q_prepare_rows(INPUT_RMS_NORM, x, hidden, r, r + 1, hidden, L->post_norm, plan->eps, prepared, scratch);
        run_product(&L->gate_up, scratch, prepared, hidden, tokens, hidden, gate_up, 2 * inter, NULL);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < tokens; r++)
            q_prepare_rows(plan->activation, gate_up, 2 * inter, r, r + 1, inter, NULL, 0.0f, prepared, scratch);
        if (L->mlp_out_norm) {
            run_product(&L->down, scratch, prepared, inter, tokens, inter, part, hidden, NULL);
            add_normed(x, part, tokens, hidden, L->mlp_out_norm, plan->eps);
        } else {
            run_product(&L->down, scratch, prepared, inter, tokens, inter, x, hidden, x);
        }
    }
done:
    free(qkv);
    free(attn);
    free(gate_up);
    free(prepared);
    free(scratch);
    free(part);
    return status;
}

/* The size of each struct the ctypes side mirrors (kernels/cpu/__init__.py and decode.py check theirs against it at
 * load: a field added on one side only fails there, not as a wrong pointer in a step); -1 for an unknown name. */
int64_t struct_bytes(const char *name) {
    if (strcmp(name, "attention_call") == 0) return (int64_t)sizeof(attention_call);
    if (strcmp(name, "segment") == 0) return (int64_t)sizeof(segment);
    if (strcmp(name, "linear_call") == 0) return (int64_t)sizeof(linear_call);
    if (strcmp(name, "act_block") == 0) return (int64_t)sizeof(act_block);
    if (strcmp(name, "product") == 0) return (int64_t)sizeof(product);
    if (strcmp(name, "layer_plan") == 0) return (int64_t)sizeof(layer_plan);
    if (strcmp(name, "model_plan") == 0) return (int64_t)sizeof(model_plan);
    return -1;
}
