/* The paged attention kernel's call (attention.c): one struct of named fields, so that the ctypes side
 * (kernels/cpu/__init__.py, `_Attention`) and the fused layers (decode.c) name what they pass. */
#pragma once
#include <stdint.h>

typedef struct {
    void *out;                      /* [batch, num_heads, head_dim], the activation dtype */
    const void *q;                  /* [batch, num_heads, head_dim], heads contiguous, tokens q_stride apart */
    int64_t q_stride;
    void *k_pool, *v_pool;          /* [locations, num_kv_heads, head_dim], or with kv_q8 int8 rows (kv_store_q8_head) */
    const int64_t *table;           /* request table: row rows[b] holds item b's KV locations, in order */
    int64_t table_stride;
    const int64_t *rows, *kv_lens;  /* per item: its table row and its key count */
    int64_t batch, num_heads, num_kv_heads, head_dim;
    float scale;                    /* applied to q . k */
    int64_t window;                 /* > 0: only the last `window` keys */
    float softcap;                  /* > 0: each score capped as softcap * tanh(s / softcap) */
    const void *k_new, *v_new;      /* NULL, or this step's keys and values, written to out_locs first */
    int64_t k_stride, v_stride;     /* token strides of k_new and v_new (heads contiguous) */
    const int64_t *out_locs;
    int32_t kv_q8;                  /* 1: the pools hold int8 rows, each head_dim values and its float32 scale */
} attention_call;

/* One token's keys `k` and values `v` for KV head `head` into int8 pools at KV location `loc`: per row round(x / s)
 * per block of 32 (or the whole row where head_dim is not a multiple of 32), s = max|x| / 127 over the block, the
 * float32 scales after the values; the keys first rotated (hadamard_groups_f32; kernels/attention/int8_kv.py). */
void hadamard_groups_f32(float *x, int64_t n, int query); /* elementwise.c */
void kv_store_q8_head(void *k_pool, void *v_pool, int64_t loc, int64_t head, int64_t kv_heads, const float *k,
                      const float *v, int64_t head_dim);

/* Attention's items: a run of up to `tile` query tokens for one KV head's group of heads each (float32 activations;
 * the fused layers' stage 5); consecutive tokens of one prompt share each read of a block of keys. */
void attention_item_f32(const attention_call *a, int64_t item, int64_t tile);

/* Tokens an item takes: TILE_TOKENS where there are enough items for `threads` threads even so, else 1; and the
 * number of items at that size. */
int64_t attention_tile_tokens(const attention_call *a, int threads);
int64_t attention_items(const attention_call *a, int64_t tile);
