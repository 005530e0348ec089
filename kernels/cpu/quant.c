/* Weight-only quantized products over GGML's block formats (the tensor types of GGUF files), on the CPU.
 *
 * Every format comes down to the same thing per 32 values of a row: 32 small integers q and, for each
 * half of 16, a scale S and an offset M, so that a weight is S * q + M (Q4_0's d * (q - 8): S = d,
 * M = -8d; Q4_K's sub-block scale d * sc and -dmin * m; Q6_K has a scale per 16 values, hence halves).
 *
 * At load the rows are repacked, losslessly, into panels of 8 rows (`q_repack`). A panel holds, per 32
 * values, one tile: the 8 rows' integers interleaved four at a time (for the 4-bit part: byte
 * [p][row][i] holds value 4p+i in its low nibble and 16+4p+i in its high one; a 5th or 5th-6th bit in a
 * plane of its own; Q8_0 bytes q + 128 [g][row][i]), then the 8 rows' scale fields as the file has them
 * (f16 d and m; the K formats' 6-bit sc and m unpacked to bytes, their f16 d and dmin once per 256
 * values). So one 32-byte vector of a tile is four consecutive values of each of the 8 rows, and one
 * dot-product instruction (AVX2's maddubs + madd, or VNNI's dpbusd) against four values of x broadcast
 * adds into each row's own lane: eight of them give a block's 8 row sums, with no horizontal reduction.
 * That is the layout trick of ggml's repacked CPU GEMMs and of oneDNN; per-row blocks spend most of
 * their instructions reducing and rescaling. With AVX-512 VNNI a product over several rows of x loads two
 * panels' tiles into one 512-bit vector, 16 rows a dot product (tile_dots.h holds the loop for both widths).
 *
 * The product y = x W^T quantizes each row of x to 8 bits per 32 values first (one float scale per
 * block, as ggml's q8_1), so inner products are integer: y += da * (S * dot + M * sum(a)), with the sum
 * of a kept per half in the block. Unsigned integers stay below 64, so maddubs' 16-bit pair sums never
 * saturate (63 * 127 * 2 < 32767). Q8_0's signed bytes are stored as q + 128, a zero point like Q4_0's 8:
 * VNNI's dpbusd (32-bit sums: nothing to saturate) multiplies them as they are, two instructions per four
 * values where taking |q| against a with q's sign took four; AVX2's maddubs, whose pair sums they would
 * overflow, flips them back to q and takes that way. Rows of x are taken four at a time per unpacked tile.
 * Without AVX2 the same arithmetic runs as plain C.
 *
 * `q_dequantize` reads the repacked rows back and rounds where gguf's dequantization rounds (S * q is
 * exact in float32), so the two agree bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define QUANT_VNNI 1 /* dpbusd: four u8 x s8 products into an int32, no 16-bit pair sum that could saturate */
#endif
#if defined(__AVX512F__)
#define QUANT_AVX512 1 /* float rows 16 values a register */
#if defined(QUANT_VNNI) && defined(__AVX512BW__)
#define QUANT_WIDE 1 /* block products over several rows of x: two panels a 512-bit vector (tile_dots.h) */
#endif
#endif
#endif

#include <omp.h>

#include "dtype.h"
#include "exp.h"
#include "quant.h"

enum { T_F32 = 0, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13,
       T_Q6_K = 14, T_BF16 = 30 };

/* Float rows (float32 or bfloat16 values as they are, x unquantized) are panels too: per FLOAT_CHUNK values, the 8
 * rows' values side by side ([chunk][row][FLOAT_CHUNK]; the last chunk zero-padded). One sequential stream per
 * panel: eight rows read in step as eight streams of their own kept the CPU's prefetcher behind (a bfloat16 head
 * of 49,152 x 576 read at 8 GB/s on one core, where a stream reads 20). */
static inline int is_float(int type) { return type == T_F32 || type == T_BF16; }

#define FLOAT_CHUNK 16

static inline int64_t float_bytes(int type) { return type == T_BF16 ? 2 : 4; }

static inline int64_t float_chunks(int64_t k) { return (k + FLOAT_CHUNK - 1) / FLOAT_CHUNK; }

/* Where value j of panel row `lane` lies, in values from the panel's start. */
static inline int64_t float_offset(int64_t j, int lane) {
    return (j / FLOAT_CHUNK * PANEL + lane) * FLOAT_CHUNK + j % FLOAT_CHUNK;
}

#define ROWS_PER_PASS 4          /* rows of x that share one unpacked tile */
#ifdef QUANT_WIDE
#define UNIT_PANELS 2 /* the panels a thread takes at a time: a pair, for the 512-bit products */
#else
#define UNIT_PANELS 1
#endif
#define UNIT_LANES (2 * PANEL) /* the output columns of a unit's pass, at most */
#define PARALLEL_MIN_WORK 32768 /* below this many multiply-adds one thread does the whole product */
#define SERIAL_INPUT_VALUES 8192 /* up to this many input values are prepared before the team starts */
#define PREFETCH_TILES 8         /* how far ahead of the product a panel's tiles are fetched */

#define RESIDUAL 254.0f /* |x / d - q| <= 1/2, so r = round(254 (x / d - q)) fits in [-127, 127] */

/* -- the file's layouts ------------------------------------------------------------------------------- */

static inline int is_k(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

static inline int64_t block_values(int type) { return is_k(type) ? 256 : 32; }

static inline int64_t block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    default: return 210; /* T_Q6_K */
    }
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes (ggml's get_scale_min_k4). */
static inline void k_scale_min(const uint8_t *sc, int j, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = sc[j] & 63;
        *min = sc[j + 4] & 63;
    } else {
        *scale = (uint8_t)((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4));
        *min = (uint8_t)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
    }
}

/* The 32 integers of sub-block j of file block `b` (signed only for Q8_0). */
static void file_ints(int type, const uint8_t *b, int j, int32_t q[32]) {
    switch (type) {
    case T_Q4_0:
    case T_Q4_1: {
        const uint8_t *qs = b + (type == T_Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) {
            q[i] = qs[i] & 0xF;
            q[i + 16] = qs[i] >> 4;
        }
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const uint8_t *qh = b + (type == T_Q5_0 ? 2 : 4), *qs = qh + 4;
        uint32_t bits;
        memcpy(&bits, qh, 4);
        for (int i = 0; i < 16; i++) {
            q[i] = (qs[i] & 0xF) | (((bits >> i) & 1) << 4);
            q[i + 16] = (qs[i] >> 4) | (((bits >> (i + 16)) & 1) << 4);
        }
        break;
    }
    case T_Q8_0:
        for (int i = 0; i < 32; i++) q[i] = ((const int8_t *)(b + 2))[i];
        break;
    case T_Q4_K:
    case T_Q5_K: {
        const int shift = (j & 1) * 4;
        const uint8_t *qs = b + (type == T_Q4_K ? 16 : 48) + (j >> 1) * 32, *qh = b + 16;
        for (int i = 0; i < 32; i++) {
            q[i] = (qs[i] >> shift) & 0xF;
            if (type == T_Q5_K) q[i] |= ((qh[i] >> j) & 1) << 4;
        }
        break;
    }
    default: { /* T_Q6_K: 128 values per half; low nibbles of 64 bytes, then their high nibbles; 2 bits more */
        const int half = j >> 2, t = j & 3;
        const uint8_t *ql = b + half * 64 + (t & 1) * 32, *qh = b + 128 + half * 32;
        for (int i = 0; i < 32; i++) q[i] = ((ql[i] >> ((t >> 1) * 4)) & 0xF) | (((qh[i] >> (2 * t)) & 3) << 4);
        break;
    }
    }
}

/* Scale and offset of each half of sub-block j of file block `b`, as floats: w = S q + M (Q4_0's M = -8 S). */
static void file_scales(int type, const uint8_t *b, int j, float S[2], float M[2]) {
    float s, m = 0.0f;
    switch (type) {
    case T_Q4_0: s = f16_to_f32(load_u16(b)); m = -8.0f * s; break;
    case T_Q5_0: s = f16_to_f32(load_u16(b)); m = -16.0f * s; break;
    case T_Q4_1:
    case T_Q5_1: s = f16_to_f32(load_u16(b)); m = f16_to_f32(load_u16(b + 2)); break;
    case T_Q8_0: s = f16_to_f32(load_u16(b)); break;
    case T_Q4_K:
    case T_Q5_K: {
        uint8_t sc, mn;
        k_scale_min(b + 4, j, &sc, &mn);
        s = f16_to_f32(load_u16(b)) * (float)sc;
        m = -(f16_to_f32(load_u16(b + 2)) * (float)mn);
        break;
    }
    default: /* T_Q6_K */
        for (int h = 0; h < 2; h++) {
            S[h] = f16_to_f32(load_u16(b + 208)) * (float)((const int8_t *)(b + 192))[2 * j + h];
            M[h] = -32.0f * S[h];
        }
        return;
    }
    S[0] = S[1] = s;
    M[0] = M[1] = m;
}

/* File rows as the GPU kernels read them (kernels/triton/quant.py): every value's integer (int8) and, per
 * 16 values, its scale and offset as float32, so that w = scale * q + offset for every format, exactly. */
void q_expand(int8_t *q, float *scale, float *offset, const uint8_t *w, int64_t row_bytes, int64_t rows,
              int64_t k, int32_t type) {
#pragma omp parallel for schedule(static) if (rows * k >= 8 * PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < k / 32; c++) {
            const int64_t per = block_values(type) / 32;
            const uint8_t *b = w + r * row_bytes + (c / per) * block_bytes(type);
            int32_t ints[32];
            float S[2], M[2];
            file_ints(type, b, (int)(c % per), ints);
            file_scales(type, b, (int)(c % per), S, M);
            for (int i = 0; i < 32; i++) q[r * k + c * 32 + i] = (int8_t)ints[i];
            for (int h = 0; h < 2; h++) {
                scale[r * (k / 16) + 2 * c + h] = S[h];
                offset[r * (k / 16) + 2 * c + h] = M[h];
            }
        }
    }
}

/* -- the repacked layout ------------------------------------------------------------------------------- */

static inline int64_t tile_q_bytes(int type) { return type == T_Q8_0 ? 256 : 128; }

static inline int64_t tile_plane_bytes(int type) { /* the 5th bit, or Q6_K's 5th and 6th */
    return type == T_Q6_K ? 64 : ((type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K) ? 32 : 0);
}

static inline int64_t tile_scale_bytes(int type) { return (type == T_Q4_1 || type == T_Q5_1) ? 32 : 16; }

static inline int64_t tile_bytes(int type) { return tile_q_bytes(type) + tile_plane_bytes(type) + tile_scale_bytes(type); }

static inline int64_t header_bytes(int type) { /* per 256 values: f16 d[8] (and dmin[8]) */
    return type == T_Q6_K ? 16 : (is_k(type) ? 32 : 0);
}

static inline int64_t group_bytes(int type) { return header_bytes(type) + block_values(type) / 32 * tile_bytes(type); }

/* Bytes of one panel of rows `k` values long. */
int64_t q_panel_bytes(int32_t type, int64_t k) {
    if (is_float(type)) return float_chunks(k) * PANEL * FLOAT_CHUNK * float_bytes(type);
    return k / block_values(type) * group_bytes(type);
}

/* The tile of the 32 values starting at c * 32, and the header of its group. */
static inline const uint8_t *tile_at(int type, const uint8_t *panel, int64_t c, const uint8_t **header) {
    const int64_t subs = block_values(type) / 32;
    *header = panel + (c / subs) * group_bytes(type);
    return *header + header_bytes(type) + (c % subs) * tile_bytes(type);
}

/* Formats whose offset is a float (a min), and the integer offset z of the others (M = -z * S). */
static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K; }

static inline int32_t zero_point(int type) {
    return type == T_Q4_0 ? 8 : (type == T_Q5_0 ? 16 : (type == T_Q6_K ? 32 : (type == T_Q8_0 ? 128 : 0)));
}

/* Scale and offset of each half of the tile's values in row `lane`. */
static inline void tile_scales(int type, const uint8_t *header, const uint8_t *tile, int lane, float S[2],
                               float M[2]) {
    const uint8_t *sc = tile + tile_q_bytes(type) + tile_plane_bytes(type);
    float s, m = 0.0f;
    if (type == T_Q6_K) {
        const float d = f16_to_f32(load_u16(header + 2 * lane));
        for (int h = 0; h < 2; h++) S[h] = d * (float)((const int8_t *)sc)[h * PANEL + lane];
        M[0] = M[1] = 0.0f; /* unused: Q6_K is an offset-z format */
        return;
    }
    if (is_k(type)) {
        s = f16_to_f32(load_u16(header + 2 * lane)) * (float)sc[lane];
        m = -(f16_to_f32(load_u16(header + 16 + 2 * lane)) * (float)sc[PANEL + lane]);
    } else {
        s = f16_to_f32(load_u16(sc + 2 * lane));
        if (has_min(type)) m = f16_to_f32(load_u16(sc + 16 + 2 * lane));
    }
    S[0] = S[1] = s;
    M[0] = M[1] = m;
}

/* Where value v (0..31) of row `lane` lies in a tile's 4-bit (or 8-bit) part and its planes. */
static inline int64_t q_offset(int v, int lane) { return (v & 15) / 4 * 32 + lane * 4 + (v & 3); }

static void tile_ints(int type, const uint8_t *tile, int lane, int32_t q[32]) {
    const uint8_t *plane = tile + tile_q_bytes(type);
    for (int v = 0; v < 32; v++) {
        const int g = v / 4, i = v & 3;
        if (type == T_Q8_0) { /* q + 128, as stored */
            q[v] = tile[g * 32 + lane * 4 + i];
            continue;
        }
        q[v] = (tile[q_offset(v, lane)] >> (v < 16 ? 0 : 4)) & 0xF;
        if (type == T_Q6_K) q[v] |= ((plane[(g / 4) * 32 + lane * 4 + i] >> (2 * (g % 4))) & 3) << 4;
        else if (tile_plane_bytes(type)) q[v] |= ((plane[lane * 4 + i] >> g) & 1) << 4;
    }
}

/* A panel of float rows: each row's chunks of FLOAT_CHUNK values to their places (the padding stays zero). */
static void float_repack(uint8_t *panel, const uint8_t *row, int lane, int64_t k, int type) {
    const int64_t width = float_bytes(type);
    for (int64_t j = 0; j < k; j += FLOAT_CHUNK) {
        const int64_t n = k - j < FLOAT_CHUNK ? k - j : FLOAT_CHUNK;
        memcpy(panel + float_offset(j, lane) * width, row + j * width, (size_t)(n * width));
    }
}

/* Rows [0, rows) of `w` (file blocks, or float rows, `row_bytes` apart) into ceil(rows / 8) panels at `out`; rows
 * past the end of the last panel are zeros. */
void q_repack(uint8_t *out, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k, int32_t type) {
    const int64_t panels = (rows + PANEL - 1) / PANEL, pbytes = q_panel_bytes(type, k);
    const int64_t subs = is_float(type) ? 0 : block_values(type) / 32;
#pragma omp parallel for schedule(static) if (rows * k >= 8 * PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++) {
        uint8_t *panel = out + p * pbytes;
        memset(panel, 0, (size_t)pbytes);
        for (int lane = 0; lane < PANEL && p * PANEL + lane < rows; lane++) {
            const uint8_t *row = w + (p * PANEL + lane) * row_bytes;
            if (is_float(type)) {
                float_repack(panel, row, lane, k, type);
                continue;
            }
            for (int64_t blk = 0; blk < k / block_values(type); blk++) {
                const uint8_t *b = row + blk * block_bytes(type);
                uint8_t *header = panel + blk * group_bytes(type);
                if (type == T_Q6_K) memcpy(header + 2 * lane, b + 208, 2);
                else if (is_k(type)) {
                    memcpy(header + 2 * lane, b, 2);
                    memcpy(header + 16 + 2 * lane, b + 2, 2);
                }
                for (int j = 0; j < subs; j++) {
                    uint8_t *tile = header + header_bytes(type) + j * tile_bytes(type);
                    uint8_t *plane = tile + tile_q_bytes(type), *sc = plane + tile_plane_bytes(type);
                    int32_t q[32];
                    file_ints(type, b, j, q);
                    for (int v = 0; v < 32; v++) {
                        const int g = v / 4, i = v & 3;
                        if (type == T_Q8_0) {
                            tile[g * 32 + lane * 4 + i] = (uint8_t)(q[v] + zero_point(T_Q8_0));
                            continue;
                        }
                        tile[q_offset(v, lane)] |= (uint8_t)((q[v] & 0xF) << (v < 16 ? 0 : 4));
                        if (type == T_Q6_K) plane[(g / 4) * 32 + lane * 4 + i] |= (uint8_t)(((q[v] >> 4) & 3) << (2 * (g % 4)));
                        else if (tile_plane_bytes(type)) plane[lane * 4 + i] |= (uint8_t)(((q[v] >> 4) & 1) << g);
                    }
                    if (type == T_Q6_K) {
                        for (int h = 0; h < 2; h++) sc[h * PANEL + lane] = b[192 + 2 * j + h];
                    } else if (is_k(type)) {
                        k_scale_min(b + 4, j, &sc[lane], &sc[PANEL + lane]);
                    } else {
                        memcpy(sc + 2 * lane, b, 2);
                        if (has_min(type)) memcpy(sc + 16 + 2 * lane, b + 2, 2);
                    }
                }
            }
        }
    }
}

/* -- dequantization ----------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void dequantize_row(int type, const uint8_t *panel, int lane,
                                                                 int64_t k, float *out) {
    for (int64_t c = 0; c < k / 32; c++) {
        const uint8_t *header, *tile = tile_at(type, panel, c, &header);
        int32_t q[32];
        float S[2], M[2];
        tile_ints(type, tile, lane, q);
        tile_scales(type, header, tile, lane, S, M);
        float *o = out + c * 32;
        if (has_min(type)) {
            for (int i = 0; i < 32; i++) o[i] = S[i >> 4] * (float)q[i] + M[i >> 4];
        } else { /* S * (q - z) as gguf computes it: M = -z S would turn its -0.0s into +0.0s */
            const int32_t z = zero_point(type);
            for (int i = 0; i < 32; i++) o[i] = S[i >> 4] * (float)(q[i] - z);
        }
    }
}

static inline float float_value(const uint8_t *panel, int64_t j, int lane, int bf16) {
    const int64_t at = float_offset(j, lane);
    return bf16 ? bf16_to_f32(((const uint16_t *)panel)[at]) : ((const float *)panel)[at];
}

/* One lane of a panel as float32, through the row loop specialised for its format (a constant type each). */
static void dequantize_lane(int type, const uint8_t *panel, int lane, int64_t k, float *out) {
    if (is_float(type)) {
        for (int64_t j = 0; j < k; j++) out[j] = float_value(panel, j, lane, type == T_BF16);
        return;
    }
    switch (type) {
    case T_Q4_0: dequantize_row(T_Q4_0, panel, lane, k, out); break;
    case T_Q4_1: dequantize_row(T_Q4_1, panel, lane, k, out); break;
    case T_Q5_0: dequantize_row(T_Q5_0, panel, lane, k, out); break;
    case T_Q5_1: dequantize_row(T_Q5_1, panel, lane, k, out); break;
    case T_Q8_0: dequantize_row(T_Q8_0, panel, lane, k, out); break;
    case T_Q4_K: dequantize_row(T_Q4_K, panel, lane, k, out); break;
    case T_Q5_K: dequantize_row(T_Q5_K, panel, lane, k, out); break;
    default: dequantize_row(T_Q6_K, panel, lane, k, out); break;
    }
}

/* out[r] = row ids[r] (ids NULL: row r) of repacked `w`, `rows` of them, as float32. */
void q_dequantize(float *out, const uint8_t *w, int64_t k, const int64_t *ids, int64_t rows, int32_t type) {
    const int64_t pbytes = q_panel_bytes(type, k);
#pragma omp parallel for schedule(static) if (rows * k >= 8 * PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = ids ? ids[r] : r;
        const uint8_t *panel = w + row / PANEL * pbytes;
        dequantize_lane(type, panel, (int)(row % PANEL), k, out + r * k);
    }
}

/* -- activations ---------------------------------------------------------------------------------------- */

static void quantize_act_block(const float *x, act_block *a) {
    int32_t sums[2] = {0, 0}; /* RESIDUAL * q + r per half */
    float d;
#ifdef QUANT_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4], r[4];
    for (int i = 0; i < 4; i++) {
        const __m256 scaled = _mm256_mul_ps(v[i], id);
        q[i] = _mm256_cvtps_epi32(scaled);
        r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, _mm256_cvtepi32_ps(q[i])),
                                                _mm256_set1_ps(RESIDUAL)));
    }
    /* int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i pq = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i pr = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i *)a->q, _mm256_permutevar8x32_epi32(pq, order));
    _mm256_storeu_si256((__m256i *)a->r, _mm256_permutevar8x32_epi32(pr, order));
    const __m256i weight = _mm256_set1_epi32((int32_t)RESIDUAL);
    int32_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi32(_mm256_mullo_epi32(_mm256_add_epi32(q[0], q[1]), weight),
                                                           _mm256_add_epi32(r[0], r[1])));
    _mm256_storeu_si256((__m256i *)(lanes + 8), _mm256_add_epi32(_mm256_mullo_epi32(_mm256_add_epi32(q[2], q[3]), weight),
                                                                 _mm256_add_epi32(r[2], r[3])));
    for (int i = 0; i < 16; i++) sums[i / 8] += lanes[i];
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; i++) {
        const float scaled = x[i] * id;
        const int32_t q = (int32_t)nearbyintf(scaled), r = (int32_t)nearbyintf((scaled - (float)q) * RESIDUAL);
        a->q[i] = (int8_t)q;
        a->r[i] = (int8_t)r;
        sums[i / 16] += (int32_t)RESIDUAL * q + r;
    }
#endif
    a->d = d;
    a->s_lo = d / RESIDUAL * (float)sums[0];
    a->s_hi = d / RESIDUAL * (float)sums[1];
    a->s = d / RESIDUAL * (float)(sums[0] + sums[1]);
}

/* -- the product ------------------------------------------------------------------------------------ */

#ifdef QUANT_AVX2
/* Whether Q8_0's stored q + 128 go into the dot products as they are (VNNI), the zero point taken off after. */
#ifdef QUANT_VNNI
#define Q8_BIASED_DOT 1
#else
#define Q8_BIASED_DOT 0
#endif

/* Eight int32 sums, each += four adjacent products u[i] * s[i] (u unsigned, s signed). */
static inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(QUANT_VNNI)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 u8x8(const uint8_t *p) { /* eight bytes as floats, unsigned or (Q6_K) signed */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 i8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 256-bit instance of tile_dots.h: one panel's tile a vector. */
#define W_NAME(f) f##_256
#define W_PAIRED 0
#define W_Q8_SIGNED (!Q8_BIASED_DOT)
#define VI __m256i
#define VF __m256
#define W_LOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define W_F16(p) f16x8(p)
#define W_U8(p) u8x8(p)
#define W_I8(p) i8x8(p)
#define W_DOT dot_acc
#define I_AND _mm256_and_si256
#define I_OR _mm256_or_si256
#define I_SRLI16 _mm256_srli_epi16
#define I_SLLI16 _mm256_slli_epi16
#define I_SET1_8 _mm256_set1_epi8
#define I_SET1_32 _mm256_set1_epi32
#define I_ZERO _mm256_setzero_si256
#define F_ZERO _mm256_setzero_ps
#define F_SET1 _mm256_set1_ps
#define F_MUL _mm256_mul_ps
#define F_SUB _mm256_sub_ps
#define F_FMA _mm256_fmadd_ps
#define F_CVT _mm256_cvtepi32_ps
#include "tile_dots.h"

#ifdef QUANT_WIDE
/* The 512-bit instance: two panels' tiles, `pair` bytes apart, a vector (the second panel's in the high half). */
static inline __m512i load_pair(const uint8_t *p, int64_t pair) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + pair)), 1);
}

static inline __m512 f16x16(const uint8_t *p, int64_t pair) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                   _mm_loadu_si128((const __m128i *)(p + pair)), 1));
}

static inline __m128i bytes16(const uint8_t *p, int64_t pair) { /* eight bytes of each panel */
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)p), _mm_loadl_epi64((const __m128i *)(p + pair)));
}

#define W_NAME(f) f##_512
#define W_PAIRED 1
#define W_Q8_SIGNED 0
#define VI __m512i
#define VF __m512
#define W_LOAD_I(p) load_pair(p, pair)
#define W_F16(p) f16x16(p, pair)
#define W_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(p, pair)))
#define W_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(p, pair)))
#define W_DOT _mm512_dpbusd_epi32
#define I_AND _mm512_and_si512
#define I_OR _mm512_or_si512
#define I_SRLI16 _mm512_srli_epi16
#define I_SLLI16 _mm512_slli_epi16
#define I_SET1_8 _mm512_set1_epi8
#define I_SET1_32 _mm512_set1_epi32
#define I_ZERO _mm512_setzero_si512
#define F_ZERO _mm512_setzero_ps
#define F_SET1 _mm512_set1_ps
#define F_MUL _mm512_mul_ps
#define F_SUB _mm512_sub_ps
#define F_FMA _mm512_fmadd_ps
#define F_CVT _mm512_cvtepi32_ps
#include "tile_dots.h"
#endif

/* One panel's `width` rows as float32 rows of `out` (k values each), tile by tile: the integers widened, times
 * their row's scale, plus its offset. The dense form a product over many rows takes (q_dequantize_dense). */
static inline __attribute__((always_inline)) void panel_dense(int type, const uint8_t *panel, int64_t k, int width,
                                                              float *out) {
    __m256 d8 = _mm256_setzero_ps(), dmin8 = _mm256_setzero_ps();
    const __m256i pairs[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                              _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    for (int64_t c = 0; c < k / 32; c++) {
        const uint8_t *header, *tile = tile_at(type, panel, c, &header);
        if (is_k(type) && c % 8 == 0) {
            d8 = f16x8(header);
            if (type != T_Q6_K) dmin8 = f16x8(header + 16);
        }
        const uint8_t *sc = tile + tile_q_bytes(type) + tile_plane_bytes(type);
        __m256 S[2], M[2];
        if (type == T_Q6_K) {
            S[0] = _mm256_mul_ps(d8, i8x8(sc));
            S[1] = _mm256_mul_ps(d8, i8x8(sc + PANEL));
        } else if (is_k(type)) {
            S[0] = S[1] = _mm256_mul_ps(d8, u8x8(sc));
            M[0] = M[1] = _mm256_mul_ps(dmin8, _mm256_sub_ps(_mm256_setzero_ps(), u8x8(sc + PANEL)));
        } else {
            S[0] = S[1] = f16x8(sc);
            M[0] = M[1] = has_min(type) ? f16x8(sc + 16) : _mm256_setzero_ps();
        }
        if (!has_min(type))
            for (int h = 0; h < 2; h++) M[h] = _mm256_mul_ps(S[h], _mm256_set1_ps(-(float)zero_point(type)));
        __m256i w[8];
        tile_vectors_256(type, tile, 0, w);
        for (int g = 0; g < 8; g++) {
            uint8_t bytes[32];
            _mm256_storeu_si256((__m256i *)bytes, w[g]);
            for (int p = 0; 2 * p < width; p++) { /* rows 2p and 2p + 1: four values each */
                const __m128i raw = _mm_loadl_epi64((const __m128i *)(bytes + 8 * p));
                const __m256i ints = _mm256_cvtepu8_epi32(raw);
                const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_permutevar8x32_ps(S[g / 4], pairs[p]),
                                                 _mm256_permutevar8x32_ps(M[g / 4], pairs[p]));
                _mm_storeu_ps(out + (2 * p) * k + c * 32 + 4 * g, _mm256_castps256_ps128(v));
                if (2 * p + 1 < width) _mm_storeu_ps(out + (2 * p + 1) * k + c * 32 + 4 * g, _mm256_extractf128_ps(v, 1));
            }
        }
    }
}

/* Rows [r0, r0 + nr) of the output for one panel, or (pair: the second's offset) two; nr a compile-time constant
 * after inlining. */
static inline __attribute__((always_inline)) void panel_pass(int type, const uint8_t *panel, int64_t pair,
                                                             const act_block *a, int64_t blocks, int nr,
                                                             float out[ROWS_PER_PASS][UNIT_LANES]) {
#ifdef QUANT_WIDE
    if (pair) {
        __m512 acc[ROWS_PER_PASS];
        for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
        panel_dots_512(type, panel, pair, a, blocks, nr, acc);
        for (int r = 0; r < nr; r++) _mm512_storeu_ps(out[r], acc[r]);
        return;
    }
#endif
    __m256 acc[ROWS_PER_PASS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    panel_dots_256(type, panel, 0, a, blocks, nr, acc);
    for (int r = 0; r < nr; r++) _mm256_storeu_ps(out[r], acc[r]);
}
#else
static inline __attribute__((always_inline)) void panel_pass(int type, const uint8_t *panel, int64_t pair,
                                                             const act_block *a, int64_t blocks, int nr,
                                                             float out[ROWS_PER_PASS][UNIT_LANES]) {
    (void)pair; /* never paired without the 512-bit products */
    for (int r = 0; r < nr; r++)
        for (int lane = 0; lane < PANEL; lane++) out[r][lane] = 0.0f;
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *header, *tile = tile_at(type, panel, c, &header);
        for (int lane = 0; lane < PANEL; lane++) {
            int32_t q[32];
            float S[2], M[2];
            tile_ints(type, tile, lane, q);
            tile_scales(type, header, tile, lane, S, M);
            if (!has_min(type)) {
                M[0] = -(float)zero_point(type) * S[0];
                M[1] = -(float)zero_point(type) * S[1];
            }
            for (int r = 0; r < nr; r++) {
                const act_block *ab = a + r * blocks + c;
                int32_t dq[2] = {0, 0}, dr[2] = {0, 0};
                for (int i = 0; i < 32; i++) {
                    dq[i >> 4] += q[i] * ab->q[i];
                    dr[i >> 4] += q[i] * ab->r[i];
                }
                for (int h = 0; h < 2; h++)
                    out[r][lane] += ab->d * S[h] * ((float)dq[h] + (float)dr[h] / RESIDUAL) + M[h] * (h ? ab->s_hi : ab->s_lo);
            }
        }
    }
}
#endif

/* One panel (or a pair) against rows [r0, r0 + nr) of x, for each format and row count (specialised by inlining). */
static void panel_rows(int type, const uint8_t *panel, int64_t pair, const act_block *a, int64_t blocks, int nr,
                       float out[ROWS_PER_PASS][UNIT_LANES]) {
#define BY_ROWS(T)                                                        \
    switch (nr) {                                                         \
    case 1: panel_pass(T, panel, pair, a, blocks, 1, out); break;         \
    case 2: panel_pass(T, panel, pair, a, blocks, 2, out); break;         \
    case 3: panel_pass(T, panel, pair, a, blocks, 3, out); break;         \
    default: panel_pass(T, panel, pair, a, blocks, ROWS_PER_PASS, out);   \
    }                                                                     \
    break;
    switch (type) {
    case T_Q4_0: BY_ROWS(T_Q4_0)
    case T_Q4_1: BY_ROWS(T_Q4_1)
    case T_Q5_0: BY_ROWS(T_Q5_0)
    case T_Q5_1: BY_ROWS(T_Q5_1)
    case T_Q8_0: BY_ROWS(T_Q8_0)
    case T_Q4_K: BY_ROWS(T_Q4_K)
    case T_Q5_K: BY_ROWS(T_Q5_K)
    default: BY_ROWS(T_Q6_K)
    }
#undef BY_ROWS
}

#if defined(QUANT_AVX512)
typedef __m512 fvec;
#define FVEC_LANES 16
#define fvec_zero _mm512_setzero_ps
#define fvec_fma _mm512_fmadd_ps
#define fvec_load _mm512_loadu_ps
#define fvec_sum _mm512_reduce_add_ps
/* Sixteen weights at `w` (float32, or bfloat16 widened: exact, a bf16 is a float32's high half). */
static inline __attribute__((always_inline)) fvec fvec_weights(const uint8_t *w, int bf16) {
    if (!bf16) return _mm512_loadu_ps(w);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
}
#elif defined(QUANT_AVX2)
typedef __m256 fvec;
#define FVEC_LANES 8
#define fvec_zero _mm256_setzero_ps
#define fvec_fma _mm256_fmadd_ps
#define fvec_load _mm256_loadu_ps
static inline float fvec_sum(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
static inline __attribute__((always_inline)) fvec fvec_weights(const uint8_t *w, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)w);
    const __m128i half = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif

/* part[r][lane0 + l] = float panel row lane0 + l . x row r, for the R rows of x and L rows of the panel from lane0
 * (R, L constants, so the accumulators stay in registers): each (row, lane) sums a vector of products at a time in
 * a register of its own, reduced once at the end. The panel streams through once per R rows of x. Values of a last
 * part-chunk (k not a multiple of FLOAT_CHUNK) are added one by one. The rows are float32 or (`bf16`) bfloat16,
 * widened as they are read: the same products as float32 rows of the same values, at half the bytes. */
static inline __attribute__((always_inline)) void float_block(const uint8_t *panel, int bf16, int lane0,
                                                              const float *x, int64_t x_stride, int64_t k,
                                                              const int R, const int L,
                                                              float part[ROWS_PER_PASS][UNIT_LANES]) {
    const int64_t width = bf16 ? 2 : 4, full = k / FLOAT_CHUNK * FLOAT_CHUNK;
    float sums[ROWS_PER_PASS][UNIT_LANES] = {{0}};
#ifdef QUANT_AVX2
    fvec acc[ROWS_PER_PASS][UNIT_LANES];
    for (int r = 0; r < R; r++)
        for (int l = 0; l < L; l++) acc[r][l] = fvec_zero();
    for (int64_t j = 0; j < full; j += FLOAT_CHUNK) {
        const uint8_t *chunk = panel + float_offset(j, lane0) * width;
        for (int h = 0; h < FLOAT_CHUNK; h += FVEC_LANES) {
            fvec v[PANEL];
            for (int l = 0; l < L; l++) v[l] = fvec_weights(chunk + (l * FLOAT_CHUNK + h) * width, bf16);
            for (int r = 0; r < R; r++) {
                const fvec xv = fvec_load(x + r * x_stride + j + h);
                for (int l = 0; l < L; l++) acc[r][l] = fvec_fma(xv, v[l], acc[r][l]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int l = 0; l < L; l++) sums[r][l] = fvec_sum(acc[r][l]);
#else
    for (int64_t j = 0; j < full; j++)
        for (int r = 0; r < R; r++)
            for (int l = 0; l < L; l++) sums[r][l] += float_value(panel, j, lane0 + l, bf16) * x[r * x_stride + j];
#endif
    for (int r = 0; r < R; r++)
        for (int l = 0; l < L; l++) {
            float sum = sums[r][l];
            for (int64_t j = full; j < k; j++) sum += float_value(panel, j, lane0 + l, bf16) * x[r * x_stride + j];
            part[r][lane0 + l] = sum;
        }
}

/* part[r][lane] = float panel row `lane` . x row r, for nr rows of x (the panel's zero rows past a segment's end
 * too): a row of x against all 8 rows (8 independent sums keep the multiply-adds flowing; a single one would wait
 * on its own latency), more rows of x against fewer at a time, as many accumulators as the registers hold (AVX2's
 * 16, AVX-512's 32). */
static inline __attribute__((always_inline)) void float_columns_of(const uint8_t *panel, int bf16, const float *x,
                                                                   int64_t x_stride, int nr, int64_t k,
                                                                   float part[ROWS_PER_PASS][UNIT_LANES]) {
#ifdef QUANT_AVX512
    const int lanes = nr <= 2 ? 8 : 4;
#else
    const int lanes = nr == 1 ? 8 : nr == 2 ? 4 : 2;
#endif
    for (int lane = 0; lane < PANEL; lane += lanes) {
#define FLOAT_CASE(R_, L_) \
    if (nr == (R_) && lanes == (L_)) { float_block(panel, bf16, lane, x, x_stride, k, R_, L_, part); continue; }
        FLOAT_CASE(1, 8) FLOAT_CASE(2, 8) FLOAT_CASE(2, 4) FLOAT_CASE(3, 4) FLOAT_CASE(3, 2) FLOAT_CASE(4, 4)
        FLOAT_CASE(4, 2)
#undef FLOAT_CASE
    }
}

/* float_columns_of inlined twice, each with `bf16` a constant: no per-value branch on the format in the loops. */
static void float_columns(const uint8_t *panel, int bf16, const float *x, int64_t x_stride, int nr, int64_t k,
                          float part[ROWS_PER_PASS][UNIT_LANES]) {
    if (bf16)
        float_columns_of(panel, 1, x, x_stride, nr, k, part);
    else
        float_columns_of(panel, 0, x, x_stride, nr, k, part);
}

/* Output columns of one unit: `count` panels (1, or 2 where UNIT_PANELS is) of one segment from `panel` on, each of
 * block rows or (T_F32, T_BF16) up to 8 float rows. A pair of block panels goes through the 512-bit products
 * together where x has several rows; one row of x reads them one after the other (tile_dots.h says why). */
static void panel_columns(const segment *s, int64_t panel, int count, const act_block *a, const float *x,
                          int64_t x_stride, int64_t m, int64_t k, float *out, int64_t out_stride, const float *bias,
                          const float *add, int64_t add_stride) {
    const int64_t blocks = k / 32, col = s->col + panel * PANEL, pbytes = q_panel_bytes(s->type, k);
    const int64_t left = s->rows - panel * PANEL;
    const int width = (int)(left < count * PANEL ? left : count * PANEL);
    const uint8_t *data = s->data + panel * pbytes;
    float part[ROWS_PER_PASS][UNIT_LANES];
    for (int64_t r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
        const int nr = (int)(m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS);
        if (count == 2 && nr > 1 && !is_float(s->type)) {
            panel_rows(s->type, data, pbytes, a + r0 * blocks, blocks, nr, part);
        } else {
            for (int i = 0; i < count; i++) {
                float(*lanes)[UNIT_LANES] = (float(*)[UNIT_LANES]) & part[0][i * PANEL];
                if (is_float(s->type))
                    float_columns(data + i * pbytes, s->type == T_BF16, x + r0 * x_stride, x_stride, nr, k, lanes);
                else
                    panel_rows(s->type, data + i * pbytes, 0, a + r0 * blocks, blocks, nr, lanes);
            }
        }
        for (int r = 0; r < nr; r++) {
            float *o = out + (r0 + r) * out_stride + col;
            for (int lane = 0; lane < width; lane++) {
                float v = part[r][lane];
                if (bias) v += bias[col + lane];
                if (add) v += add[(r0 + r) * add_stride + col + lane];
                o[lane] = v;
            }
        }
    }
}

/* Row r of the product's input, `k` values, into `dst`, as `input` says. RMSNorm rounds as transformers'
 * float32 one does (the mean of squares, + eps, rsqrt, times x, times the weight). */
static void input_row(int32_t input, const float *x, int64_t k, const float *norm_weight, float eps, float *dst) {
    if (input == INPUT_RMS_NORM) {
        float sum = 0.0f;
        for (int64_t i = 0; i < k; i++) sum += x[i] * x[i];
        const float inv = 1.0f / sqrtf(sum / (float)k + eps);
        for (int64_t i = 0; i < k; i++) dst[i] = norm_weight[i] * (x[i] * inv);
    } else if (input == INPUT_SILU_MUL) {
        for (int64_t i = 0; i < k; i++) dst[i] = x[i] / (1.0f + exp_f32(-x[i])) * x[k + i];
    } else if (input == INPUT_GELU_MUL) { /* 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh by exp_f32 */
        for (int64_t i = 0; i < k; i++) {
            const float g = x[i], y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            const float t = 1.0f - 2.0f / (exp_f32(2.0f * y) + 1.0f);
            dst[i] = 0.5f * g * (1.0f + t) * x[k + i];
        }
    } else {
        memcpy(dst, x, (size_t)k * sizeof(float));
    }
}

void q_prepare_rows(int32_t input, const float *x, int64_t x_stride, int64_t r0, int64_t r1, int64_t k,
                    const float *norm_weight, float eps, float *rows, act_block *scratch) {
    for (int64_t r = r0; r < r1; r++) {
        const float *xs = x + r * x_stride;
        if (rows) {
            input_row(input, xs, k, norm_weight, eps, rows + r * k);
            xs = rows + r * k;
        }
        for (int64_t b = 0; b < k / 32; b++) quantize_act_block(xs + b * 32, scratch + r * (k / 32) + b);
    }
}

/* Panels of a segment, and units (a thread's share at a time: UNIT_PANELS panels, the last perhaps fewer). */
static inline int64_t seg_panels(const segment *s) { return (s->rows + PANEL - 1) / PANEL; }

static inline int64_t seg_units(const segment *s) { return (seg_panels(s) + UNIT_PANELS - 1) / UNIT_PANELS; }

int64_t q_units(const segment *segs, int64_t nseg) {
    int64_t units = 0;
    for (int64_t s = 0; s < nseg; s++) units += seg_units(&segs[s]);
    return units;
}

void q_unit(const segment *segs, int64_t u, const act_block *scratch, const float *xs, int64_t xs_stride, int64_t m,
            int64_t k, float *out, int64_t out_stride, const float *bias, const float *add, int64_t add_stride) {
    int64_t s = 0, first = 0; /* the segment of global unit u, and that segment's first unit */
    while (u >= first + seg_units(&segs[s])) first += seg_units(&segs[s++]);
    const int64_t panel = (u - first) * UNIT_PANELS, rest = seg_panels(&segs[s]) - panel;
    panel_columns(&segs[s], panel, (int)(rest < UNIT_PANELS ? rest : UNIT_PANELS), scratch, xs, xs_stride, m, k, out,
                  out_stride, bias, add, add_stride);
}

/* The product a linear_call describes (quant.h). Returns 0, or -1 where memory ran out. */
int32_t q_linear(const linear_call *c) {
    float *out = c->out;
    const float *x = c->x, *norm_weight = c->norm_weight, *bias = c->bias, *add = c->add;
    const int64_t out_stride = c->out_stride, x_stride = c->x_stride, m = c->m, k = c->k, nseg = c->nseg;
    const int64_t add_stride = c->add_stride;
    const int32_t input = c->input;
    const float eps = c->eps;
    const segment *segs = c->segs;
    int64_t n_total = 0;
    for (int64_t s = 0; s < nseg; s++) n_total += segs[s].rows;
    const int64_t units = q_units(segs, nseg);
    act_block *scratch = malloc((size_t)(m * (k / 32)) * sizeof(act_block));
    float *rows = input == INPUT_AS_IS ? NULL : malloc((size_t)(m * k) * sizeof(float));
    if (scratch == NULL || (input != INPUT_AS_IS && rows == NULL)) {
        free(scratch);
        free(rows);
        return -1;
    }
    const float *xs = rows ? rows : x; /* the product's input, and its row stride */
    const int64_t xs_stride = rows ? k : x_stride;
    /* A few rows (a decode step) are prepared here, before the team starts: a barrier fewer. Each thread then
     * streams one contiguous range of panels (the prefetcher's best case). */
    const int serial_input = m * k <= SERIAL_INPUT_VALUES;
    if (serial_input) q_prepare_rows(input, x, x_stride, 0, m, k, norm_weight, eps, rows, scratch);
    const int threads = m * n_total * k >= PARALLEL_MIN_WORK ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
    {
        if (!serial_input) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) q_prepare_rows(input, x, x_stride, r, r + 1, k, norm_weight, eps, rows, scratch);
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++)
            q_unit(segs, u, scratch, xs, xs_stride, m, k, out, out_stride, bias, add, add_stride);
    }
    free(scratch);
    free(rows);
    return 0;
}

/* Rows [r0, r1) of the segments (r0 and r1 on panel boundaries, or r1 the end) as float32 [r1 - r0, k]: a product
 * over many rows runs on this through torch's GEMM, which beats the integer kernel there. Values equal gguf's
 * dequantization (its -0.0s may come out +0.0). */
void q_dequantize_dense(float *out, const segment *segs, int64_t nseg, int64_t k, int64_t r0, int64_t r1) {
    int64_t panels = 0;
    for (int64_t s = 0; s < nseg; s++) panels += seg_panels(&segs[s]);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int64_t s = 0, first = 0;
        while (p >= first + seg_panels(&segs[s])) first += seg_panels(&segs[s++]);
        const segment *seg = &segs[s];
        const int64_t row = (p - first) * PANEL;
        if (seg->col + row < r0 || seg->col + row >= r1) continue;
        const int width = (int)(seg->rows - row < PANEL ? seg->rows - row : PANEL);
        float *o = out + (seg->col + row - r0) * k;
        const uint8_t *panel = seg->data + (p - first) * q_panel_bytes(seg->type, k);
        if (is_float(seg->type)) {
            for (int lane = 0; lane < width; lane++) dequantize_lane(seg->type, panel, lane, k, o + lane * k);
            continue;
        }
#ifdef QUANT_AVX2
        switch (seg->type) {
        case T_Q4_0: panel_dense(T_Q4_0, panel, k, width, o); break;
        case T_Q4_1: panel_dense(T_Q4_1, panel, k, width, o); break;
        case T_Q5_0: panel_dense(T_Q5_0, panel, k, width, o); break;
        case T_Q5_1: panel_dense(T_Q5_1, panel, k, width, o); break;
        case T_Q8_0: panel_dense(T_Q8_0, panel, k, width, o); break;
        case T_Q4_K: panel_dense(T_Q4_K, panel, k, width, o); break;
        case T_Q5_K: panel_dense(T_Q5_K, panel, k, width, o); break;
        default: panel_dense(T_Q6_K, panel, k, width, o); break;
        }
#else
        for (int lane = 0; lane < width; lane++) dequantize_lane(seg->type, panel, lane, k, o + lane * k);
#endif
    }
}

/* For the tests: x quantized as the product sees it (`rows` rows of k values). */
void q_quantize_act(act_block *out, const float *x, int64_t rows, int64_t k) {
    for (int64_t i = 0; i < rows * (k / 32); i++) quantize_act_block(x + i * 32, out + i);
}


int32_t q_isa(void) { /* 0 plain C, 1 AVX2, 2 AVX2 with VNNI dot products, 3 that and AVX-512's float rows */
#if defined(QUANT_AVX512) && defined(QUANT_VNNI)
    return 3;
#elif defined(QUANT_VNNI)
    return 2;
#elif defined(QUANT_AVX2)
    return 1;
#else
    return 0;
#endif
}
