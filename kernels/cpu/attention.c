/* Attention straight from the paged KV pool, one query token per item: no gather into a padded tensor,
 * no mask. A decode step has one token per request; a prompt chunk's tokens are items of their own,
 * each with its causal key count (kernels/attention/cpu.py).
 *
 * For item b and KV head h the keys are pool rows table[rows[b], 0 .. kv_lens[b]-1] (under a sliding window of
 * `window` positions only the last `window` of them), taken in blocks of KEY_BLOCK rows: float32 rows are read where
 * they lie, bfloat16 rows are widened and int8 rows (kv_q8; their keys rotated, so the queries are turned alike)
 * scaled into a small buffer first; each block serves every query head of h's group. Scores are a vector of keys
 * (8 or 16) at a time, softmax runs online across blocks in float32 (each score first capped as
 * softcap * tanh(s / softcap) where softcap > 0, Gemma 2), and the output is rounded to the activation dtype at the
 * end.
 *
 * Compiled with -ffast-math so that expf vectorises through glibc's libmvec; the running maximum
 * starts at the first block's instead of -inf, so no infinity is ever computed (fast math assumes none).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"
#include "dtype.h"

#define KEY_BLOCK 128
#ifdef __AVX512F__
#define LANES 16 /* one 512-bit register of floats */
#else
#define LANES 8
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load_vec(const float *p) {
    vec v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vec(float *p, vec v) { __builtin_memcpy(p, &v, sizeof v); }

/* The lane sums of LANES vectors, as one vector: {sum(v[0]), ..., sum(v[LANES - 1])}: a transpose-and-add tree
 * (each level adds neighbouring lanes of two vectors into one), LANES - 1 adds for LANES dot products instead of
 * LANES horizontal sums. */
static inline vec lane_sums(const vec v[LANES]) {
#if LANES == 16
    vec pair[8], quad[4], oct[2];
    for (int i = 0; i < 8; i++)
        pair[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
                + __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (int i = 0; i < 4; i++)
        quad[i] = __builtin_shufflevector(pair[2 * i], pair[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
                + __builtin_shufflevector(pair[2 * i], pair[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int i = 0; i < 2; i++)
        oct[i] = __builtin_shufflevector(quad[2 * i], quad[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
               + __builtin_shufflevector(quad[2 * i], quad[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return __builtin_shufflevector(oct[0], oct[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(oct[0], oct[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#else
    vec pair[4], quad[2];
    for (int i = 0; i < 4; i++)
        pair[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
                + __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        quad[i] = __builtin_shufflevector(pair[2 * i], pair[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
                + __builtin_shufflevector(pair[2 * i], pair[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(quad[0], quad[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(quad[0], quad[1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
}

/* s[j] = q . k[j] for j < n_pad (a multiple of LANES; rows past the block point at zeros): LANES keys
 * at a time, each a vector of partial sums over head_dim, reduced together. Their sums advance side by side
 * (independent multiply-add chains, not one chain per key waiting on its own latency). */
static inline __attribute__((always_inline)) void block_scores(float *restrict s, const float *restrict q, const float *const *k, int64_t n_pad,
                         int64_t head_dim) {
    const int64_t full = head_dim / LANES * LANES;
    for (int64_t j = 0; j < n_pad; j += LANES) {
        vec partial[LANES] = {{0}};
        float tail[LANES] = {0};
        const float *const *rows = k + j;
        for (int64_t d = 0; d < full; d += LANES) {
            const vec qv = load_vec(q + d);
            for (int i = 0; i < LANES; i++) partial[i] += qv * load_vec(rows[i] + d);
        }
        for (int i = 0; i < LANES; i++)
            for (int64_t d = full; d < head_dim; d++) tail[i] += q[d] * rows[i][d];
        store_vec(s + j, lane_sums(partial) + load_vec(tail));
    }
}

/* acc = acc * correction + sum_j p[j] v[j], LANES dimensions per vector, up to four vectors at a time. */
static inline __attribute__((always_inline)) void block_values(float *restrict acc, const float *restrict p, const float *const *v, int64_t n,
                         int64_t head_dim, float correction) {
    int64_t d = 0;
    for (; d + 4 * LANES <= head_dim; d += 4 * LANES) { /* even and odd keys apart: eight chains of adds */
        vec a[2][4] = {{correction * load_vec(acc + d), correction * load_vec(acc + d + LANES),
                        correction * load_vec(acc + d + 2 * LANES), correction * load_vec(acc + d + 3 * LANES)}};
        int64_t j = 0;
        for (; j + 1 < n; j += 2)
            for (int o = 0; o < 2; o++)
                for (int i = 0; i < 4; i++) a[o][i] += p[j + o] * load_vec(v[j + o] + d + i * LANES);
        if (j < n)
            for (int i = 0; i < 4; i++) a[0][i] += p[j] * load_vec(v[j] + d + i * LANES);
        for (int i = 0; i < 4; i++) store_vec(acc + d + i * LANES, a[0][i] + a[1][i]);
    }
    for (; d + LANES <= head_dim; d += LANES) {
        vec a = correction * load_vec(acc + d);
        for (int64_t j = 0; j < n; j++) a += p[j] * load_vec(v[j] + d);
        store_vec(acc + d, a);
    }
    for (; d < head_dim; d++) {
        float a = correction * acc[d];
        for (int64_t j = 0; j < n; j++) a += p[j] * v[j][d];
        acc[d] = a;
    }
}

/* One online-softmax step over a block's scores s[0..n): rescale by the new maximum, exponentiate in
 * place; returns the factor the running sum and accumulator must be scaled by. */
static float block_softmax(float *s, int64_t n, float *max, float *sum, int first) {
    float block_max = first ? s[0] : *max;
    for (int64_t j = 0; j < n; j++) block_max = s[j] > block_max ? s[j] : block_max;
    const float correction = first ? 0.0f : expf(*max - block_max);
    float block_sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - block_max);
        block_sum += s[j];
    }
    *sum = *sum * correction + block_sum;
    *max = block_max;
    return correction;
}

/* A block's scores for one query row, capped where softcap > 0; then its online softmax and values. head_dim
 * is a compile-time constant for the common sizes, so that the per-key loops over it unroll. */
#define BY_HEAD_DIM(CALL)                                                                                 \
    switch (head_dim) {                                                                                   \
    case 64: { const int64_t dim = 64; CALL; } break;                                                     \
    case 128: { const int64_t dim = 128; CALL; } break;                                                   \
    case 256: { const int64_t dim = 256; CALL; } break;                                                   \
    case 32: { const int64_t dim = 32; CALL; } break;                                                     \
    default: { const int64_t dim = head_dim; CALL; }                                                      \
    }

static void attend_scores(float *s, const float *q, const float *const *k, int64_t n, int64_t n_pad, int64_t head_dim,
                          float softcap) {
    BY_HEAD_DIM(block_scores(s, q, k, n_pad, dim))
    if (softcap > 0.0f)
        for (int64_t j = 0; j < n; j++) s[j] = softcap * tanhf(s[j] / softcap);
}

static void attend_values(float *s, float *acc, const float *const *v, int64_t n, int64_t head_dim, float *max,
                          float *sum, int first) {
    const float correction = block_softmax(s, n, max, sum, first);
    BY_HEAD_DIM(block_values(acc, s, v, n, dim, correction))
}

/* A pool row as float32: itself, or widened into `buf`. */
static inline const float *row_f32(const float *src, float *buf, int64_t head_dim) {
    (void)buf;
    (void)head_dim;
    return src;
}

static inline const float *row_bf16(const uint16_t *src, float *buf, int64_t head_dim) {
    for (int64_t d = 0; d < head_dim; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* Scales per int8 row: one per 32 values, or one for a head_dim that is not a multiple of 32. */
static inline int64_t q8_blocks(int64_t head_dim) { return head_dim % 32 == 0 ? head_dim / 32 : 1; }

static inline int64_t kv_row_bytes_q8(int64_t head_dim) { return head_dim + 4 * q8_blocks(head_dim); }

/* An int8 row (kernels/attention/int8_kv.py): q * s per block, the float32 scales after the head_dim values. */
static inline const float *row_q8(const int8_t *src, float *buf, int64_t head_dim) {
    const int64_t nb = q8_blocks(head_dim), per = head_dim / nb;
    for (int64_t b = 0; b < nb; b++) {
        float s;
        memcpy(&s, src + head_dim + 4 * b, sizeof s);
        for (int64_t d = b * per; d < (b + 1) * per; d++) buf[d] = (float)src[d] * s;
    }
    return buf;
}

/* One row of head_dim values as an int8 row: round(x / s) per block, s = max|x| / 127 over the block. */
static void kv_store_q8(int8_t *dst, const float *x, int64_t head_dim) {
    const int64_t nb = q8_blocks(head_dim), per = head_dim / nb;
    for (int64_t b = 0; b < nb; b++) {
        float amax = 0.0f;
        for (int64_t d = b * per; d < (b + 1) * per; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
        const float s = amax * (1.0f / 127.0f), inv = s > 0.0f ? 1.0f / s : 0.0f; /* as int8_kv.py's INV_127 */
        for (int64_t d = b * per; d < (b + 1) * per; d++) dst[d] = (int8_t)nearbyintf(x[d] * inv);
        memcpy(dst + head_dim + 4 * b, &s, sizeof s);
    }
}

void kv_store_q8_head(void *k_pool, void *v_pool, int64_t loc, int64_t head, int64_t kv_heads, const float *k,
                      const float *v, int64_t head_dim) {
    const int64_t at = (loc * kv_heads + head) * kv_row_bytes_q8(head_dim);
    float rotated[head_dim];
    memcpy(rotated, k, (size_t)head_dim * sizeof(float));
    hadamard_groups_f32(rotated, head_dim, 0);
    kv_store_q8((int8_t *)k_pool + at, rotated, head_dim);
    kv_store_q8((int8_t *)v_pool + at, v, head_dim);
}

/* Keys per block: up to KEY_BLOCK, fewer for wide heads, so that a block's float32 keys (then its values) stay in
 * a 32 KiB share of L1 while every query row of a run reads them. A decode token and a prompt token see the same
 * blocks, so their numbers do not depend on how tokens were grouped. */
static inline int64_t key_block(int64_t head_dim) {
    const int64_t fit = 8192 / head_dim / LANES * LANES;
    return fit < LANES ? LANES : (fit > KEY_BLOCK ? KEY_BLOCK : fit);
}

/* A run: query tokens b .. b + nt - 1 of one request at consecutive positions (token b + t sees kv_lens[b] + t
 * keys), KV head h's group of query heads each, so nt * group query rows. Each block of keys is read from the pool
 * once and serves every row: first all rows' scores (the keys in L1), then their softmax and values (the values in
 * L1). A run of more than one token has no sliding window in effect (an item ends a run where one starts);
 * a single token keeps only its last `window` keys. Rows past a token's own key count skip the rest of the block. */
#define DEFINE_ATTEND_RUN(NAME, T, LOAD, STORE, ROW)                                                      \
static void NAME(const attention_call *a, int64_t b, int64_t nt, int64_t h) {                            \
    const int64_t num_heads = a->num_heads, num_kv_heads = a->num_kv_heads, head_dim = a->head_dim;      \
    const int64_t group = num_heads / num_kv_heads, nq = nt * group, kb = key_block(head_dim);           \
    const T *q = a->q;                                                                                   \
    const char *k_pool = a->k_pool, *v_pool = a->v_pool;                                                 \
    const int64_t row_bytes = a->kv_q8 ? kv_row_bytes_q8(head_dim) : head_dim * (int64_t)sizeof(T);      \
    const int64_t *locs = a->table + a->rows[b] * a->table_stride;                                      \
    const int64_t len = a->kv_lens[b], last = len + nt - 1, window = a->window;                          \
    const int64_t begin = nt == 1 && window > 0 && len > window ? len - window : 0;                      \
    float qf[nq * head_dim], acc[nq * head_dim], max[nq], sum[nq], s[nq * kb];                           \
    float kbuf[kb * head_dim], vbuf[kb * head_dim], zeros[head_dim];                                     \
    const float *k[kb], *v[kb];                                                                          \
    for (int64_t d = 0; d < head_dim; d++) zeros[d] = 0.0f;                                              \
    for (int64_t r = 0; r < nq; r++) { /* row r: token b + r / group, query head h * group + r % group */ \
        const T *qrow = q + (b + r / group) * a->q_stride + (h * group + r % group) * head_dim;          \
        for (int64_t d = 0; d < head_dim; d++) {                                                         \
            qf[r * head_dim + d] = LOAD(qrow[d]) * a->scale;                                             \
            acc[r * head_dim + d] = 0.0f;                                                                \
        }                                                                                                \
        if (a->kv_q8) /* int8 pages hold keys rotated (kv_store_q8_head): the query turns alike */        \
            hadamard_groups_f32(qf + r * head_dim, head_dim, 1);                                         \
        max[r] = sum[r] = 0.0f;                                                                          \
    }                                                                                                    \
    for (int64_t j0 = begin; j0 < last; j0 += kb) {                                                      \
        const int64_t n = last - j0 < kb ? last - j0 : kb;                                               \
        const int64_t n_pad = (n + LANES - 1) / LANES * LANES;                                           \
        for (int64_t j = 0; j < n; j++) {                                                                \
            const int64_t row = (locs[j0 + j] * num_kv_heads + h) * row_bytes;                          \
            if (a->kv_q8) {                                                                              \
                k[j] = row_q8((const int8_t *)(k_pool + row), kbuf + j * head_dim, head_dim);            \
                v[j] = row_q8((const int8_t *)(v_pool + row), vbuf + j * head_dim, head_dim);            \
            } else {                                                                                     \
                k[j] = ROW((const T *)(k_pool + row), kbuf + j * head_dim, head_dim);                    \
                v[j] = ROW((const T *)(v_pool + row), vbuf + j * head_dim, head_dim);                    \
            }                                                                                            \
        }                                                                                                \
        for (int64_t j = n; j < n_pad; j++) k[j] = zeros;                                                \
        for (int64_t r = 0; r < nq; r++) {                                                               \
            const int64_t seen = len + r / group - j0; /* this row's keys from j0 on */                  \
            if (seen > 0) attend_scores(s + r * kb, qf + r * head_dim, k, seen < n ? seen : n, n_pad,   \
                                        head_dim, a->softcap);                                           \
        }                                                                                                \
        for (int64_t r = 0; r < nq; r++) {                                                               \
            const int64_t seen = len + r / group - j0;                                                   \
            if (seen > 0) attend_values(s + r * kb, acc + r * head_dim, v, seen < n ? seen : n, head_dim, \
                                        &max[r], &sum[r], j0 == begin);                                  \
        }                                                                                                \
    }                                                                                                    \
    T *out = a->out;                                                                                     \
    for (int64_t r = 0; r < nq; r++) {                                                                   \
        T *orow = out + ((b + r / group) * num_heads + h * group + r % group) * head_dim;                \
        const float inv = 1.0f / sum[r];                                                                 \
        for (int64_t d = 0; d < head_dim; d++) orow[d] = STORE(acc[r * head_dim + d] * inv);             \
    }                                                                                                    \
}

/* Query rows a run may hold at most (its stack buffers grow with them), and tokens an item takes at most. */
#define RUN_ROWS 32
#define TILE_TOKENS 8

/* Whether a sliding window cuts token b's keys (it then sees only its last `window`). */
static inline int window_cuts(const attention_call *a, int64_t b) { return a->window > 0 && a->kv_lens[b] > a->window; }

/* Item `item` of attention_items(a, tile): tokens [b0, b0 + tile) (fewer at the end) for KV head h, as runs:
 * consecutive tokens of one request at consecutive positions join a run while no sliding window cuts their keys
 * and the run's rows fit RUN_ROWS; any other token is a run of its own. The result is each token's alone, bit for
 * bit (key_block). */
#define DEFINE_ATTEND_ITEM(NAME, RUN)                                                                     \
void NAME(const attention_call *a, int64_t item, int64_t tile) {                                         \
    const int64_t group = a->num_heads / a->num_kv_heads, h = item % a->num_kv_heads;                    \
    const int64_t most = RUN_ROWS / group > 1 ? RUN_ROWS / group : 1;                                    \
    const int64_t b0 = item / a->num_kv_heads * tile, end = b0 + tile < a->batch ? b0 + tile : a->batch; \
    for (int64_t b = b0; b < end;) {                                                                     \
        int64_t run = 1;                                                                                 \
        while (!window_cuts(a, b) && run < most && b + run < end && a->rows[b + run] == a->rows[b] &&   \
               a->kv_lens[b + run] == a->kv_lens[b] + run && !window_cuts(a, b + run))                   \
            run++;                                                                                       \
        RUN(a, b, run, h);                                                                               \
        b += run;                                                                                        \
    }                                                                                                    \
}

int64_t attention_tile_tokens(const attention_call *a, int threads) {
    return a->batch * a->num_kv_heads >= 4 * TILE_TOKENS * threads ? TILE_TOKENS : 1;
}

int64_t attention_items(const attention_call *a, int64_t tile) { return (a->batch + tile - 1) / tile * a->num_kv_heads; }

/* Items are dealt to threads round robin: a prompt's items grow longer token by token, so contiguous
 * ranges would give one thread the short half; the two KV heads of a decode request split evenly.
 * With `k_new` the step's own keys and values (token t's at k_new + t * k_stride and v_new + t * v_stride, heads
 * contiguous) are first written to pool slots out_locs[t], in the same parallel region (no torch scatter per
 * layer). */
#define DEFINE_PAGED_ATTENTION(NAME, ITEM, T, LOAD)                                                        \
void NAME(const attention_call *a) {                                                                      \
    const int64_t width = a->num_kv_heads * a->head_dim;                                                  \
    const T *k_new = a->k_new, *v_new = a->v_new;                                                         \
    _Pragma("omp parallel")                                                                               \
    {                                                                                                     \
        if (k_new && !a->kv_q8) {                                                                         \
            T *k_pool = a->k_pool, *v_pool = a->v_pool;                                                   \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t t = 0; t < a->batch; t++) {                                                      \
                memcpy(k_pool + a->out_locs[t] * width, k_new + t * a->k_stride, (size_t)width * sizeof(T)); \
                memcpy(v_pool + a->out_locs[t] * width, v_new + t * a->v_stride, (size_t)width * sizeof(T)); \
            }                                                                                             \
        } else if (k_new) { /* one int8 row per token and KV head, quantized from its values */           \
            const int64_t dim = a->head_dim;                                                              \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t i = 0; i < a->batch * a->num_kv_heads; i++) {                                    \
                const int64_t t = i / a->num_kv_heads, h = i % a->num_kv_heads;                           \
                float k[dim], v[dim];                                                                     \
                for (int64_t d = 0; d < dim; d++) {                                                       \
                    k[d] = LOAD(k_new[t * a->k_stride + h * dim + d]);                                    \
                    v[d] = LOAD(v_new[t * a->v_stride + h * dim + d]);                                    \
                }                                                                                         \
                kv_store_q8_head(a->k_pool, a->v_pool, a->out_locs[t], h, a->num_kv_heads, k, v, dim);    \
            }                                                                                             \
        }                                                                                                 \
        const int64_t tile = attention_tile_tokens(a, omp_get_num_threads());                             \
        _Pragma("omp for schedule(static, 1)")                                                            \
        for (int64_t item = 0; item < attention_items(a, tile); item++) ITEM(a, item, tile);              \
    }                                                                                                     \
}

DEFINE_ATTEND_RUN(attend_run_f32, float, F32_LOAD, F32_STORE, row_f32)
DEFINE_ATTEND_RUN(attend_run_bf16, uint16_t, BF16_LOAD, BF16_STORE, row_bf16)
DEFINE_ATTEND_ITEM(attention_item_f32, attend_run_f32)
DEFINE_ATTEND_ITEM(attention_item_bf16, attend_run_bf16)
DEFINE_PAGED_ATTENTION(paged_attention_f32, attention_item_f32, float, F32_LOAD)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, attention_item_bf16, uint16_t, BF16_LOAD)
