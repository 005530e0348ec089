/* The block products' inner loop at one vector width, included by quant.c once per width; its macros say which.
 *
 * At 256 bits (W_PAIRED 0) a vector is one panel's tile: four values of each of 8 rows. At 512 bits (W_PAIRED 1,
 * AVX-512 with VNNI) it is two panels' tiles side by side, `pair` bytes apart in the segment: 16 rows, so each
 * broadcast of x and each dot-product instruction serve twice the rows (a product over several rows of x runs
 * ~1.35x faster so; one row of x does not gain: there the two streams cost more than the instructions save).
 * W_NAME(f) names this width's functions; W_LOAD_I / W_F16 / W_U8 / W_I8 read a tile vector, 8 f16 values, or 8
 * bytes as floats per panel, the second panel's at +pair when paired; I_* and F_* are the width's integer and
 * float operations, W_DOT its u8 x s8 dot product. W_Q8_SIGNED: Q8_0's biased bytes must be turned back to
 * signed ones first (AVX2's maddubs without VNNI). The file undefines them all at its end. */

/* The tile's eight vectors: w[g] holds values 4g..4g+3 of each row. */
static inline __attribute__((always_inline)) void W_NAME(tile_vectors)(int type, const uint8_t *tile, int64_t pair,
                                                                       VI w[8]) {
    (void)pair;
    if (type == T_Q8_0) {
        for (int g = 0; g < 8; g++) w[g] = W_LOAD_I(tile + 32 * g);
        return;
    }
    const VI low4 = I_SET1_8(0xF);
    for (int p = 0; p < 4; p++) {
        const VI v = W_LOAD_I(tile + 32 * p);
        w[p] = I_AND(v, low4);
        w[p + 4] = I_AND(I_SRLI16(v, 4), low4);
    }
    const uint8_t *plane = tile + 128;
    if (type == T_Q6_K) { /* bits 2(g%4), 2(g%4)+1 of plane g/4 move to bits 4-5 */
        const VI top2 = I_SET1_8(0x30);
        for (int half = 0; half < 2; half++) {
            const VI h = W_LOAD_I(plane + 32 * half);
            w[4 * half + 0] = I_OR(w[4 * half + 0], I_AND(I_SLLI16(h, 4), top2));
            w[4 * half + 1] = I_OR(w[4 * half + 1], I_AND(I_SLLI16(h, 2), top2));
            w[4 * half + 2] = I_OR(w[4 * half + 2], I_AND(h, top2));
            w[4 * half + 3] = I_OR(w[4 * half + 3], I_AND(I_SRLI16(h, 2), top2));
        }
    } else if (tile_plane_bytes(type)) { /* bit g moves to bit 4 */
        const VI bit4 = I_SET1_8(0x10), h = W_LOAD_I(plane);
        w[0] = I_OR(w[0], I_AND(I_SLLI16(h, 4), bit4));
        w[1] = I_OR(w[1], I_AND(I_SLLI16(h, 3), bit4));
        w[2] = I_OR(w[2], I_AND(I_SLLI16(h, 2), bit4));
        w[3] = I_OR(w[3], I_AND(I_SLLI16(h, 1), bit4));
        w[4] = I_OR(w[4], I_AND(h, bit4));
        w[5] = I_OR(w[5], I_AND(I_SRLI16(h, 1), bit4));
        w[6] = I_OR(w[6], I_AND(I_SRLI16(h, 2), bit4));
        w[7] = I_OR(w[7], I_AND(I_SRLI16(h, 3), bit4));
    }
}

static inline VI W_NAME(bcast4)(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return I_SET1_32(v);
}

/* The tile's dot products with x's q and with its residual r as one: iq + ir / RESIDUAL. */
static inline VF W_NAME(combine)(VI iq, VI ir) {
    return F_FMA(F_CVT(ir), F_SET1(1.0f / RESIDUAL), F_CVT(iq));
}

/* acc[r] (lane = row) += the rows . x row r, for nr rows of x (quantized, `blocks` per row). */
static inline __attribute__((always_inline)) void W_NAME(panel_dots)(int type, const uint8_t *panel, int64_t pair,
                                                                     const act_block *a, int64_t blocks, int nr,
                                                                     VF acc[ROWS_PER_PASS]) {
    VF d8 = F_ZERO(), dmin8 = F_ZERO();
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *header, *tile = tile_at(type, panel, c, &header);
        for (int64_t ahead = 0; ahead < tile_bytes(type); ahead += 64) { /* the stream a few tiles on, into L1 */
            _mm_prefetch((const char *)tile + PREFETCH_TILES * tile_bytes(type) + ahead, _MM_HINT_T0);
            if (W_PAIRED) _mm_prefetch((const char *)tile + pair + PREFETCH_TILES * tile_bytes(type) + ahead, _MM_HINT_T0);
        }
        if (is_k(type) && c % 8 == 0) {
            d8 = W_F16(header);
            if (type != T_Q6_K) dmin8 = W_F16(header + 16);
        }
        const uint8_t *sc = tile + tile_q_bytes(type) + tile_plane_bytes(type);
        VF S, M = F_ZERO(), S_hi = F_ZERO();
        if (type == T_Q6_K) {
            S = F_MUL(d8, W_I8(sc));
            S_hi = F_MUL(d8, W_I8(sc + PANEL));
        } else if (is_k(type)) {
            S = F_MUL(d8, W_U8(sc));
            M = F_MUL(dmin8, F_SUB(F_ZERO(), W_U8(sc + PANEL)));
        } else {
            S = W_F16(sc);
            if (has_min(type)) M = W_F16(sc + 16);
            else if (zero_point(type)) M = F_MUL(S, F_SET1(-(float)zero_point(type)));
        }
        VI w[8];
        W_NAME(tile_vectors)(type, tile, pair, w);
        for (int r = 0; r < nr; r++) {
            const act_block *ab = a + r * blocks + c;
            const VF d = F_SET1(ab->d);
            if (type == T_Q6_K) { /* a scale per half; M = -32 S */
                for (int h = 0; h < 2; h++) {
                    VI iq = I_ZERO(), ir = I_ZERO();
                    for (int g = 4 * h; g < 4 * h + 4; g++) {
                        iq = W_DOT(iq, w[g], W_NAME(bcast4)(ab->q + 4 * g));
                        ir = W_DOT(ir, w[g], W_NAME(bcast4)(ab->r + 4 * g));
                    }
                    const VF Sh = h ? S_hi : S;
                    acc[r] = F_FMA(W_NAME(combine)(iq, ir), F_MUL(Sh, d), acc[r]);
                    acc[r] = F_FMA(Sh, F_SET1(-32.0f * (h ? ab->s_hi : ab->s_lo)), acc[r]);
                }
                continue;
            }
            VI iq = I_ZERO(), ir = I_ZERO();
            for (int g = 0; g < 8; g++) {
                const VI xq = W_NAME(bcast4)(ab->q + 4 * g), xr = W_NAME(bcast4)(ab->r + 4 * g);
#if W_Q8_SIGNED
                if (type == T_Q8_0) { /* q back from q + 128: |q| against x with q's sign */
                    const VI q = _mm256_xor_si256(w[g], _mm256_set1_epi8((char)0x80));
                    const VI u = _mm256_sign_epi8(q, q);
                    iq = W_DOT(iq, u, _mm256_sign_epi8(xq, q));
                    ir = W_DOT(ir, u, _mm256_sign_epi8(xr, q));
                    continue;
                }
#endif
                iq = W_DOT(iq, w[g], xq);
                ir = W_DOT(ir, w[g], xr);
            }
            acc[r] = F_FMA(W_NAME(combine)(iq, ir), F_MUL(S, d), acc[r]);
            if (type != T_Q8_0 || !W_Q8_SIGNED) acc[r] = F_FMA(M, F_SET1(ab->s), acc[r]);
        }
    }
}

/* The next width defines them again. */
#undef W_NAME
#undef W_PAIRED
#undef W_Q8_SIGNED
#undef VI
#undef VF
#undef W_LOAD_I
#undef W_F16
#undef W_U8
#undef W_I8
#undef W_DOT
#undef I_AND
#undef I_OR
#undef I_SRLI16
#undef I_SLLI16
#undef I_SET1_8
#undef I_SET1_32
#undef I_ZERO
#undef F_ZERO
#undef F_SET1
#undef F_MUL
#undef F_SUB
#undef F_FMA
#undef F_CVT
