/* The AVX-512 path of paged_decode.c (included there after the row decoders): one task
 * attends all heads of one sequence over a run of its blocks (a whole sequence, or a part of
 * a long one that merge_parts joins with the others: flash-decoding).
 *
 * Per block and KV head, 16 token rows are decoded once into a float tile that stays in L1
 * and serves the G query heads of the group: Q.K keeps 16 vector accumulators per head and
 * sums them with one transpose-reduce (16 scores in one vector, no horizontal sum per dot);
 * P.V accumulates D/16 vectors per head in registers with the row scale folded into p. A
 * sequence's blocks lie anywhere in the pool, so the next blocks are prefetched in software
 * (prefetch_block, in paged_decode.c: shared with the AVX2 path of paged_decode_avx2.h).
 * int8 and int4 pool rows skip the tile where G is a literal small enough for every
 * accumulator to stay in a register (the direct passes, below tile_values_grouped).
 */
enum { TILE = 16, MAX_D = 256, PREFETCH = 2 }; /* head dims: multiples of 16 up to MAX_D */

/* a[i] summed across its lanes into lane i (15 adds for 16 sums). The shuffle tree leaves
 * lane i holding the sum of its input P(i), P swapping 1<->2, 4<->8, 5<->10, 6<->9, 7<->11,
 * 13<->14 (an involution), so a[P(i)] is fed in as input i. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *a) {
    static const int P[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    __m512 w[8], u[4], s[2];
    /* Where a level pairs lanes that stay in place with ones that move, a blend (either
     * vector port) takes one shuffle's (shuffle port) place: the same sums, fewer shuffles. */
    for (int i = 0; i < 8; i++) /* 256-bit halves: input i | input i + 8 */
        w[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xff00, a[P[i]], a[P[i + 8]]),
                             _mm512_shuffle_f32x4(a[P[i]], a[P[i + 8]], 0x4E));
    for (int i = 0; i < 4; i++) /* 128-bit blocks */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88),
                             _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
    for (int i = 0; i < 2; i++) /* lane pairs */
        s[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xcccc, u[i], u[i + 2]),
                             _mm512_shuffle_ps(u[i], u[i + 2], 0x4E));
    return _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
}

#include "exp_avx512.h"

/* sc[0 .. n) = exp(sc - max), returning the max and (in *sum) their sum. */
static inline __attribute__((always_inline)) float softmax_numerators(float *sc, int64_t n,
                                                                      float *sum) {
    __m512 mx = _mm512_set1_ps(-INFINITY), s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 keep = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        mx = _mm512_mask_max_ps(mx, keep, mx, _mm512_maskz_loadu_ps(keep, sc + i));
    }
    float m = _mm512_reduce_max_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 keep = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, sc + i), _mm512_set1_ps(m)));
        s = _mm512_mask_add_ps(s, keep, s, e);
        _mm512_mask_storeu_ps(sc + i, keep, e);
    }
    *sum = _mm512_reduce_add_ps(s);
    return m;
}

/* load_block_scale with vector conversions (int4 sides keep the scalar permuting loop). */
static inline __attribute__((always_inline)) void
block_scale(const kv_side *s, int64_t blk, int h, int H, const int D, float *bsc, float *bz,
            int zeros) {
    if (s->scale_mode != SCALE_BLOCK || (s->kind == KIND_U4 && D % 32)) {
        load_block_scale(s, blk, h, H, D, bsc, bz);
        return;
    }
    const _Float16 *sc = s->scale + ((size_t)blk * H + h) * D;
    if (s->kind != KIND_U4) {
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(bsc + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + d))));
        return;
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int side = 0; side < 1 + zeros; side++) { /* int4: channel d to permuted(d): evens, then odds */
        const _Float16 *src = side ? s->zero + ((size_t)blk * H + h) * D : sc;
        float *dst = side ? bz : bsc;
        for (int d = 0; d < D; d += 32) {
            __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d)));
            __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d + 16)));
            _mm512_storeu_ps(dst + d / 2, _mm512_permutex2var_ps(a, even, b));
            _mm512_storeu_ps(dst + D / 2 + d / 2, _mm512_permutex2var_ps(a, odd, b));
        }
    }
}

/* 16 stored values at p (kind `kind`) as floats, scales not applied. fp8 codes become fp16
 * ones: e5m2 is the top byte of an fp16; e4m3's bits shifted into fp16's fields read 2^-8 of
 * the value (subnormals included), so a multiply by 256 restores it exactly. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, const int kind) {
    switch (kind) {
    case KIND_F32: return _mm512_loadu_ps(p);
    case KIND_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    case KIND_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    case KIND_I8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    case KIND_E5M2:
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
    default: { /* KIND_E4M3 */
        __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
        __m256i h16 = _mm256_or_si256(
            _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
            _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7));
        return _mm512_mul_ps(_mm512_cvtph_ps(h16), _mm512_set1_ps(256.0f));
    }
    }
}

/* One row (at `row`) of `kind` into v[D / 16] registers in load_raw's order, scales not
 * applied; int4 `centered` rows hold 16 * (x - 8) instead of x, exactly and in as many
 * operations: the nibble is or-ed into the mantissa of a float whose last place is 16 (low
 * nibble, 2^27) or that holds it 16 times already (high nibble, 2^23), then 2^e + 128
 * subtracted (group_scales gives such rows their scale / 16 and zero + 8 * scale). */
static inline __attribute__((always_inline)) void
decode_row(const char *row, const int kind, const int D, const int centered, __m512 *v) {
    if (kind != KIND_U4) {
        for (int d = 0; d < D / 16; d++) v[d] = load16(row + d * 16 * elem_size(kind), kind);
        return;
    }
    const __m512i low = _mm512_set1_epi32(15), high = _mm512_set1_epi32(0xf0);
    for (int i = 0; i < D / 32; i++) { /* 16 bytes widened to 32-bit lanes from memory */
        __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * i)));
        if (centered) { /* (x & mask) | exponent: ternary-logic 0xea */
            v[i] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(
                                     x, low, _mm512_set1_epi32(0x4d000000), 0xea)),
                                 _mm512_set1_ps(134217856.0f));
            v[D / 32 + i] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(
                                              x, high, _mm512_set1_epi32(0x4b000000), 0xea)),
                                          _mm512_set1_ps(8388736.0f));
        } else {
            v[i] = _mm512_cvtepi32_ps(_mm512_and_si512(x, low));
            v[D / 32 + i] = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
        }
    }
}

/* nt rows of `kind` (row r at base + r * stride bytes) into tile rows, in vectors. */
static inline __attribute__((always_inline)) void
rows16(const char *base, size_t stride, int nt, const int kind, const int D, float *tile) {
    for (int t = 0; t < nt; t++) {
        __m512 v[MAX_D / 16];
        decode_row(base + t * stride, kind, D, 0, v);
        for (int d = 0; d < D / 16; d++) _mm512_store_ps(tile + t * D + 16 * d, v[d]);
    }
}

/* nt int4 rows (row r at base + r * stride) into tile rows (see decode_row), per-token group
 * scales applied when `scale` is given (gs: elements per group within each half; a multiple
 * of 16). */
static inline __attribute__((always_inline)) void
rows16_u4(const uint8_t *base, size_t stride, int nt, const int D, const _Float16 *scale,
          const _Float16 *zero, size_t scale_stride, int gs, const int centered, float *tile) {
    for (int t = 0; t < nt; t++) {
        __m512 v[MAX_D / 16];
        decode_row((const char *)base + t * stride, KIND_U4, D, centered, v);
        for (int i = 0; scale && i < D / 32; i++) {
            size_t g = t * scale_stride + 16 * i / gs;
            __m512 sc = _mm512_set1_ps((float)scale[g]), z = _mm512_set1_ps((float)zero[g]);
            v[i] = _mm512_fmadd_ps(v[i], sc, z);
            v[D / 32 + i] = _mm512_fmadd_ps(v[D / 32 + i], sc, z);
        }
        for (int d = 0; d < D / 16; d++) _mm512_store_ps(tile + t * D + 16 * d, v[d]);
    }
}

/* The per-token group scales and zeros of nt int4 rows of every head (row r of head h at
 * (tok0 + r * H + h) * groups, tok0 a row of head 0) as 16-token vectors for centered rows
 * (see rows16_u4): gsc[(h * groups + g) * TILE + r] = scale / 16, gz = zero + 8 * scale, rows
 * past nt zero. Even group counts read both halves of a group pair as one 32-bit lane: up to
 * 64 pairs (all heads of 16 rows) with masked loads (nothing past row nt) and each head's
 * picked out by permutes, else gathered. */
static inline __attribute__((always_inline)) void
group_scales(const kv_side *s, size_t tok0, int nt, int H, float *gsc, float *gz) {
    int groups = s->groups, P = H * groups / 2;
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    const __m512 sixteenth = _mm512_set1_ps(0.0625f), eight = _mm512_set1_ps(8.0f);
    if (groups % 2) {
        for (int h = 0; h < H; h++)
            for (int g = 0; g < groups; g++) {
                float *sc = gsc + (h * groups + g) * TILE, *z = gz + (h * groups + g) * TILE;
                for (int r = 0; r < TILE; r++) {
                    size_t i = (tok0 + (size_t)r * H + h) * groups + g;
                    sc[r] = r < nt ? (float)s->scale[i] : 0.0f;
                    z[r] = r < nt ? (float)s->zero[i] : 0.0f;
                }
                __m512 v = _mm512_load_ps(sc);
                _mm512_store_ps(z, _mm512_fmadd_ps(v, eight, _mm512_load_ps(z)));
                _mm512_store_ps(sc, _mm512_mul_ps(v, sixteenth));
            }
        return;
    }
    const int *sp = (const int *)(s->scale + tok0 * groups), *zp = (const int *)(s->zero + tok0 * groups);
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(P));
    __m512i s4[4], z4[4];
    unsigned n = (unsigned)(nt * P);
    for (int r = 0; P <= 4 && r < 4; r++) { /* no load past row nt: a masked-off load */
        unsigned left = n > 16u * r ? n - 16u * r : 0; /* still waits on its line */
        __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        s4[r] = left ? _mm512_maskz_loadu_epi32(m, sp + 16 * r) : _mm512_setzero_si512();
        z4[r] = left ? _mm512_maskz_loadu_epi32(m, zp + 16 * r) : _mm512_setzero_si512();
    }
    for (int h = 0; h < H; h++)
        for (int g = 0; g < groups; g += 2) {
            __m512i idx = _mm512_add_epi32(rows, _mm512_set1_epi32((h * groups + g) / 2)), x[2];
            for (int side = 0; side < 2; side++) {
                const __m512i *v = side ? z4 : s4;
                if (P <= 4)
                    x[side] = _mm512_mask_blend_epi32(_mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32)),
                                                      _mm512_permutex2var_epi32(v[0], idx, v[1]),
                                                      _mm512_permutex2var_epi32(v[2], idx, v[3]));
                else
                    x[side] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep, idx,
                                                          side ? zp : sp, 4);
            }
            for (int half = 0; half < 2; half++) { /* group g in the low 16 bits, g + 1 high */
                __m512 sc = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x[0], 16 * half)));
                __m512 z = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x[1], 16 * half)));
                int at = (h * groups + g + half) * TILE;
                _mm512_store_ps(gsc + at, _mm512_mul_ps(sc, sixteenth));
                _mm512_store_ps(gz + at, _mm512_fmadd_ps(sc, eight, z));
            }
        }
}

/* The per-token scales of nt 8-bit rows (row r's at tok0 + r * H, tok0 a row of head h) as a
 * 16-token vector in rsc. Up to 4 heads, the block's rows of all heads are read with masked
 * loads (nothing past row nt) and this head's picked out with one permute. */
static inline __attribute__((always_inline)) void
token_scales16(const _Float16 *scale, size_t tok0, int h, int nt, int H, float *rsc) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    if (H > 4) {
        for (int r = 0; r < nt; r++) rsc[r] = (float)scale[tok0 + (size_t)r * H];
        return;
    }
    static const int16_t iota[32] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const _Float16 *src = scale + tok0 - h;
    unsigned n = (unsigned)(nt * H);
    __mmask32 m0 = n >= 32 ? 0xffffffffu : (1u << n) - 1;
    __mmask32 m1 = n <= 32 ? 0 : n >= 64 ? 0xffffffffu : (1u << (n - 32)) - 1;
    __m512i idx = _mm512_add_epi16(_mm512_mullo_epi16(_mm512_loadu_si512(iota), _mm512_set1_epi16((short)H)),
                                   _mm512_set1_epi16((short)h));
    __m512i x = _mm512_permutex2var_epi16(_mm512_maskz_loadu_epi16(m0, src), idx,
                                          _mm512_maskz_loadu_epi16(m1, src + 32));
    _mm512_store_ps(rsc, _mm512_maskz_mov_ps(keep, _mm512_cvtph_ps(_mm512_castsi512_si256(x))));
}

/* nt bf16 rows of an int4 side's staged own block (row r at base + r * stride elements)
 * into tile rows in load_raw's order (even channels, then odd ones): a 32-bit lane holds
 * channels 2i (low half) and 2i + 1 (high half), so a shift gives the evens, a mask the odds. */
static inline __attribute__((always_inline)) void
rows16_staged_u4(const uint16_t *base, size_t stride, int nt, const int D, float *tile) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < D / 2; i += 16) {
            __m512i x = _mm512_loadu_si512(base + t * stride + 2 * i);
            _mm512_store_ps(tile + t * D + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
            _mm512_store_ps(tile + t * D + D / 2 + i, _mm512_castsi512_ps(_mm512_and_si512(x, top)));
        }
}

/* Rows t0 .. t0 + nt of head h of block j (the staged own block when j == own) into
 * tile[TILE][D] in load_raw's order, rows past nt zero; each row's remaining scale in rsc
 * (per-token 8-bit scales; 1 otherwise). Pool rows of every format are converted in vectors
 * with the format switch outside the row loop; the staged block and block scales that are not
 * folded (per-block value scales) take load_row/load_staged. */
static inline __attribute__((always_inline)) void
load_tile(const kv_side *s, const int64_t *table, int j, int own, const void *own_data,
          int own_kind, int64_t slot, int t0, int nt, int h, int H, int bs, const int D,
          int folded, const float *bsc, const float *bz, float *tile, float *rsc, int centered) {
    int u4 = s->kind == KIND_U4, gs = u4 ? D / 2 / s->groups : 16;
    size_t tok0 = j == own ? 0 : ((size_t)table[j] * bs + t0) * H + h;
    size_t row_bytes = (size_t)s->width * elem_size(s->kind);
    const char *base = (const char *)s->data + tok0 * row_bytes;
    int token_scale = s->scale_mode == SCALE_TOKEN;
    _mm512_store_ps(rsc, _mm512_maskz_mov_ps((__mmask16)((1u << nt) - 1), _mm512_set1_ps(1.0f)));
    if (j == own && own_kind == KIND_BF16 && (!u4 || D % 32 == 0)) { /* a bf16 model's */
        const uint16_t *rows = (const uint16_t *)own_data + (((size_t)slot * bs + t0) * H + h) * D;
        if (u4) rows16_staged_u4(rows, (size_t)H * D, nt, D, tile);
        else rows16((const char *)rows, (size_t)H * D * 2, nt, KIND_BF16, D, tile);
    } else if (j == own || (s->scale_mode == SCALE_BLOCK && !folded) || (u4 && (D % 32 || gs % 16))) {
        for (int t = 0; t < nt; t++) {
            if (j == own) load_staged(s, own_data, own_kind, slot, t0 + t, h, H, bs, D, tile + t * D);
            else rsc[t] = load_row(s, table[j], t0 + t, h, H, bs, D, folded, bsc, bz, tile + t * D);
        }
    } else if (u4) {
        const uint8_t *rows = (const uint8_t *)base;
        size_t sst = (size_t)H * s->groups;
        if (token_scale && centered) { /* scales left to the caller (group_scales) */
            rows16_u4(rows, H * row_bytes, nt, D, NULL, NULL, 0, gs, 1, tile);
        } else if (token_scale) {
            rows16_u4(rows, H * row_bytes, nt, D, s->scale + tok0 * s->groups,
                      s->zero + tok0 * s->groups, sst, gs, 0, tile);
        } else {
            rows16_u4(rows, H * row_bytes, nt, D, NULL, NULL, 0, gs, 0, tile);
        }
    } else {
        switch (s->kind) { /* literal kinds: one unrolled row loop each */
        case KIND_F32: rows16(base, H * row_bytes, nt, KIND_F32, D, tile); break;
        case KIND_BF16: rows16(base, H * row_bytes, nt, KIND_BF16, D, tile); break;
        case KIND_F16: rows16(base, H * row_bytes, nt, KIND_F16, D, tile); break;
        case KIND_I8: rows16(base, H * row_bytes, nt, KIND_I8, D, tile); break;
        case KIND_E4M3: rows16(base, H * row_bytes, nt, KIND_E4M3, D, tile); break;
        case KIND_E5M2: rows16(base, H * row_bytes, nt, KIND_E5M2, D, tile); break;
        }
        if (token_scale) token_scales16(s->scale, tok0, h, nt, H, rsc);
    }
    for (int t = nt; t < TILE; t++) memset(tile + t * D, 0, sizeof(float) * D);
}

/* Scores of the G query heads qk[G * D] against a key tile, stored at scores[g * stride] for
 * the first nt tokens. qz (or NULL): per head a vector whose lanes sum to a bias of every
 * score, added to each token's accumulator before the reduction (for free: its first
 * multiply becomes a multiply-add). */
static inline __attribute__((always_inline)) void
tile_scores(const float *qk, const float *qz, int G, const int D, const float *tile,
            const float *rsc, int nt, float *scores, int64_t stride) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    __m512 tsc = _mm512_load_ps(rsc);
    for (int g = 0; g < G; g++) {
        __m512 a[TILE], z = qz ? _mm512_loadu_ps(qz + 16 * g) : _mm512_setzero_ps();
        for (int t = 0; t < TILE; t++) {
            a[t] = _mm512_fmadd_ps(_mm512_loadu_ps(qk + g * D), _mm512_load_ps(tile + t * D), z);
            for (int d = 16; d < D; d += 16)
                a[t] = _mm512_fmadd_ps(_mm512_loadu_ps(qk + g * D + d),
                                       _mm512_load_ps(tile + t * D + d), a[t]);
        }
        _mm512_mask_storeu_ps(scores + g * stride, keep, _mm512_mul_ps(reduce16(a), tsc));
    }
}

/* acc[g * D] += p[g * stride + t] * rsc[t] * tile[t] over the tile's nt tokens. */
static inline __attribute__((always_inline)) void
tile_values(const float *p, int64_t stride, int G, const int D, const float *tile,
            const float *rsc, int nt, float *acc) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    for (int g = 0; g < G; g++) {
        float w[TILE] __attribute__((aligned(64)));
        __m512 pv = _mm512_maskz_loadu_ps(keep, p + g * stride);
        _mm512_store_ps(w, _mm512_mul_ps(pv, _mm512_load_ps(rsc)));
        __m512 o[MAX_D / 16]; /* registers when D is a literal */
        for (int d = 0; d < D / 16; d++) o[d] = _mm512_loadu_ps(acc + g * D + 16 * d);
        for (int t = 0; t < nt; t++) {
            __m512 wt = _mm512_set1_ps(w[t]);
            for (int d = 0; d < D / 16; d++)
                o[d] = _mm512_fmadd_ps(wt, _mm512_load_ps(tile + t * D + 16 * d), o[d]);
        }
        for (int d = 0; d < D / 16; d++) _mm512_storeu_ps(acc + g * D + 16 * d, o[d]);
    }
}

/* tile_values for int4 rows left unscaled by load_tile: the group scale folds into the weight
 * (p * scale[t, group] per group) and the zero into zacc[(g * groups + group) * TILE], a
 * 16-token vector of p * zero that the caller adds to the group's channels once at the end. */
static inline __attribute__((always_inline)) void
tile_values_grouped(const float *p, int64_t stride, int G, const int D, const float *tile,
                    const float *gsc, const float *gz, const int groups, int nt, float *acc,
                    float *zacc) {
    const int gs = D / 2 / groups; /* a literal where groups is: no division per head */
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    for (int g = 0; g < G; g++) {
        float w[MAX_D / 32][TILE] __attribute__((aligned(64)));
        __m512 pv = _mm512_maskz_loadu_ps(keep, p + g * stride);
        for (int c = 0; c < groups; c++) {
            float *z = zacc + (g * groups + c) * TILE;
            _mm512_store_ps(w[c], _mm512_mul_ps(pv, _mm512_load_ps(gsc + c * TILE)));
            _mm512_storeu_ps(z, _mm512_fmadd_ps(pv, _mm512_load_ps(gz + c * TILE), _mm512_loadu_ps(z)));
        }
        __m512 o[MAX_D / 16];
        for (int d = 0; d < D / 16; d++) o[d] = _mm512_loadu_ps(acc + g * D + 16 * d);
        for (int t = 0; t < nt; t++)
            for (int d = 0; d < D / 16; d++) {
                __m512 wt = _mm512_set1_ps(w[(d % (D / 32)) * 16 / gs][t]);
                o[d] = _mm512_fmadd_ps(wt, _mm512_load_ps(tile + t * D + 16 * d), o[d]);
            }
        for (int d = 0; d < D / 16; d++) _mm512_storeu_ps(acc + g * D + 16 * d, o[d]);
    }
}

/* ---- pool rows straight into registers (no float tile) -------------------------------
 * For a literal G with every accumulator in a register (G * D <= 256), a block's int8 or
 * int4 rows are decoded once per row into registers and used by all G query heads there: no
 * tile written and read back (the tile's stores and loads cost more than its decode). */

/* Whether G query heads of dim D take the direct passes: only where D is a literal (the
 * accumulators need it to stay in registers; other head dims keep the tiles). */
#define direct_heads(G, D) \
    (__builtin_constant_p(D) && (D) % 32 == 0 && (G) >= 1 && (G) <= 4 && (G) * (D) <= 256)

/* rsc for nt rows: an 8-bit side's per-token scales, else ones. */
static inline __attribute__((always_inline)) void
row_scales(const kv_side *s, size_t tok0, int h, int nt, int H, float *rsc) {
    if (s->scale_mode == SCALE_TOKEN && s->kind != KIND_U4)
        token_scales16(s->scale, tok0, h, nt, H, rsc);
    else
        _mm512_store_ps(rsc, _mm512_maskz_mov_ps((__mmask16)((1u << nt) - 1), _mm512_set1_ps(1.0f)));
}

/* tile_scores on nt pool rows (row r at base + r * row_stride bytes): q (and the block's
 * channel scales bsc, zeros bz where given: q.(raw * s + z) = (q * s).raw + q.z, q.z in 16
 * lanes) held in registers, each row dotted with all G heads, the G partial vectors per row
 * kept for the transpose-reduce; rsc: per-row scales. */
static inline __attribute__((always_inline)) void
tile_scores_direct(const float *qk, const float *bsc, const float *bz, const int G, const int D,
                   const char *base, size_t row_stride, const int kind, const float *rsc, int nt,
                   float *scores, int64_t stride) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    __m512 part[G][TILE], qv[G][MAX_D / 16], z[G];
    for (int g = 0; g < G; g++) {
        z[g] = _mm512_setzero_ps();
        for (int d = 0; d < D / 16; d++) {
            __m512 x = _mm512_loadu_ps(qk + g * D + 16 * d);
            if (bz) z[g] = _mm512_fmadd_ps(x, _mm512_loadu_ps(bz + 16 * d), z[g]);
            qv[g][d] = bsc ? _mm512_mul_ps(x, _mm512_loadu_ps(bsc + 16 * d)) : x;
        }
    }
    for (int t = 0; t < TILE; t++) {
        __m512 v[MAX_D / 16];
        if (t < nt) decode_row(base + t * row_stride, kind, D, 0, v);
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_setzero_ps();
            if (t < nt) { /* rows past nt: zero sums, masked off below */
                a = _mm512_fmadd_ps(qv[g][0], v[0], z[g]);
                for (int d = 1; d < D / 16; d++) a = _mm512_fmadd_ps(qv[g][d], v[d], a);
            }
            part[g][t] = a;
        }
    }
    __m512 tsc = _mm512_load_ps(rsc);
    for (int g = 0; g < G; g++)
        _mm512_mask_storeu_ps(scores + g * stride, keep, _mm512_mul_ps(reduce16(part[g]), tsc));
}

/* tile_values (groups 1, per-row scales rsc in the weights) or tile_values_grouped
 * (centered int4 rows, `groups` groups of 16 channels per half) on nt pool rows: all G heads'
 * accumulators in registers, each row decoded once, the weights broadcast from memory. */
static inline __attribute__((always_inline)) void
tile_values_direct(const float *p, int64_t stride, const int G, const int D, const char *base,
                   size_t row_stride, const int kind, const float *rsc, const float *gsc,
                   const float *gz, const int groups, int nt, float *acc, float *zacc) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    float w[G][groups][TILE] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {
        __m512 pv = _mm512_maskz_loadu_ps(keep, p + g * stride);
        if (groups == 1) _mm512_store_ps(w[g][0], _mm512_mul_ps(pv, _mm512_load_ps(rsc)));
        for (int c = 0; groups > 1 && c < groups; c++) {
            float *z = zacc + (g * groups + c) * TILE;
            _mm512_store_ps(w[g][c], _mm512_mul_ps(pv, _mm512_load_ps(gsc + c * TILE)));
            _mm512_storeu_ps(z, _mm512_fmadd_ps(pv, _mm512_load_ps(gz + c * TILE), _mm512_loadu_ps(z)));
        }
    }
    __m512 o[G][MAX_D / 16];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D / 16; d++) o[g][d] = _mm512_loadu_ps(acc + g * D + 16 * d);
    for (int t = 0; t < nt; t++) {
        __m512 v[MAX_D / 16];
        decode_row(base + t * row_stride, kind, D, groups > 1, v);
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D / 16; d++) /* vector d's group: d % groups (see rows16_u4) */
                o[g][d] = _mm512_fmadd_ps(_mm512_set1_ps(w[g][d % groups][t]), v[d], o[g][d]);
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D / 16; d++) _mm512_storeu_ps(acc + g * D + 16 * d, o[g][d]);
}

/* CALL(g) for G = g, a literal; only the g that direct_heads allows with this D are built. */
#define LITERAL_G(G, CALL)                                  \
    switch (G) {                                            \
    case 1: CALL(1); break;                                 \
    case 2: if (2 * D <= 256) CALL(2); break;               \
    case 3: if (3 * D <= 256) CALL(3); break;               \
    default: if (4 * D <= 256) CALL(4); break;              \
    }

/* The direct Q.K of nt rows of head h from tok0 (a row of the pool), literal G and kind. */
static inline __attribute__((always_inline)) void
scores_from_pool(const kv_side *k, const float *qk, const float *bsc, const float *bz, int G,
                 const int D, size_t tok0, int h, int nt, int H, float *rsc, float *out,
                 int64_t stride) {
    size_t row = (size_t)k->width * elem_size(k->kind);
    const char *rows = (const char *)k->data + tok0 * row;
    row_scales(k, tok0, h, nt, H, rsc);
#define SCORES(g) tile_scores_direct(qk, bsc, bz, g, D, rows, H * row, KIND, rsc, nt, out, stride)
    if (k->kind == KIND_U4) {
        enum { KIND = KIND_U4 };
        LITERAL_G(G, SCORES)
    } else {
        enum { KIND = KIND_I8 };
        LITERAL_G(G, SCORES)
    }
#undef SCORES
}

/* The direct P.V of nt rows of head h from tok0; int4 rows with their group scales split
 * off (gsc, gz: group_scales' vectors of this head). */
static inline __attribute__((always_inline)) void
values_from_pool(const kv_side *v, const float *p, int64_t stride, int G, const int D,
                 size_t tok0, int h, int nt, int H, float *rsc, const float *gsc,
                 const float *gz, float *acc, float *zacc) {
    size_t row = (size_t)v->width * elem_size(v->kind);
    const char *rows = (const char *)v->data + tok0 * row;
#define VALUES(g) \
    tile_values_direct(p, stride, g, D, rows, H * row, KIND, rsc, gsc, gz, GROUPS, nt, acc, zacc)
    if (v->kind == KIND_U4) {
        enum { KIND = KIND_U4 };
        const int GROUPS = D / 32;
        LITERAL_G(G, VALUES)
    } else {
        enum { KIND = KIND_I8, GROUPS = 1 };
        row_scales(v, tok0, h, nt, H, rsc);
        LITERAL_G(G, VALUES)
    }
#undef VALUES
}
#undef LITERAL_G

/* The Hq = H * G query heads q[Hq * D] of one sequence over its blocks [j0, j1) (positions
 * below L): per query head the max m, the sum of exp(score - m) and acc[D] = the sum of
 * exp(score - m) * v, not yet normalised. scores: [Hq, (j1 - j0) * bs] scratch. */
static inline __attribute__((always_inline)) void
attend_part(const float *q, int64_t L, const int64_t *table, int own, int64_t slot, int H,
            int G, const int D, int bs, const kv_side *k, const kv_side *v, const void *own_k,
            const void *own_v, int own_kind, float sm_scale, int j0, int j1, float *scores,
            float *m, float *sum, float *acc) {
    float tile[TILE * D] __attribute__((aligned(64))), rsc[TILE] __attribute__((aligned(64)));
    float bsc[D], bz[D], qp[H * G * D], qs[G * D], qz[G * 16];
    int k_u4 = k->kind == KIND_U4, fold = k->scale_mode == SCALE_BLOCK;
    int v_gs = v->kind == KIND_U4 ? D / 2 / v->groups : 0; /* int4 values: group scales folded */
    int grouped = v_gs && v->scale_mode == SCALE_TOKEN && D % 32 == 0 && v_gs % 16 == 0;
    int ng = grouped ? v->groups : 1, direct = direct_heads(G, D);
    int direct_k = direct && ((k_u4 && fold) || (k->kind == KIND_I8 && !k->zero));
    int direct_v = direct && ((grouped && ng == D / 32) ||
                              (v->kind == KIND_I8 && v->scale_mode != SCALE_BLOCK));
    float gsc[H * ng * TILE] __attribute__((aligned(64))), gz[H * ng * TILE] __attribute__((aligned(64)));
    float zacc[H * G * ng * TILE];
    int64_t base = (int64_t)j0 * bs, n = (L < (int64_t)j1 * bs ? L : (int64_t)j1 * bs) - base;
    pf_span kspan[H], vspan[H];
    for (int h = 0; h < H; h++)
        kspan[h] = prefetch_span(k, H, bs, D, h, H), vspan[h] = prefetch_span(v, H, bs, D, h, H);
    for (int i = 0; i < H * G; i++) /* q in the order K rows arrive in */
        for (int d = 0; d < D; d++) qp[i * D + permuted(d, k_u4, D)] = q[i * D + d] * sm_scale;
    for (int j = j0; j < j1; j++) { /* scores */
        int nj = (int)(L - (int64_t)j * bs < bs ? L - (int64_t)j * bs : bs), jv = j - j1 + PREFETCH + j0;
        int64_t js = staged_row(k, table, j, own, slot); /* staged: own block or sink */
        int oj = js >= 0 ? j : -1;
        for (int h = 0; h < H; h++) {
            if (j + PREFETCH < j1 && j + PREFETCH != own)
                prefetch_block(k, table[j + PREFETCH], kspan + h);
            else if (jv >= j0 && jv != own) /* P.V's first */
                prefetch_block(v, table[jv], vspan + h);
            const float *qk = qp + h * G * D;
            int zeroed = j != oj && fold && k->zero;
            if (j != oj && direct_k) {
                if (fold) block_scale(k, table[j], h, H, D, bsc, bz, zeroed);
                for (int t0 = 0; t0 < nj; t0 += TILE)
                    scores_from_pool(k, qk, fold ? bsc : NULL, zeroed ? bz : NULL, G, D,
                                     ((size_t)table[j] * bs + t0) * H + h, h,
                                     nj - t0 < TILE ? nj - t0 : TILE, H, rsc,
                                     scores + h * G * n + (int64_t)j * bs - base + t0, n);
                continue;
            }
            if (j != oj && fold) { /* q.(raw * s + z) = (q * s).raw + q.z */
                block_scale(k, table[j], h, H, D, bsc, bz, 0);
                for (int g = 0; g < G; g++)
                    for (int d = 0; d < D; d++) qs[g * D + d] = qk[g * D + d] * bsc[d];
                qk = qs;
            }
            if (zeroed) { /* q.z in channel order: 16 lanes per head (see tile_scores) */
                const _Float16 *z = k->zero + ((size_t)table[j] * H + h) * D;
                for (int g = 0; g < G; g++) {
                    const float *qg = q + (size_t)(h * G + g) * D;
                    __m512 sum = _mm512_setzero_ps();
                    for (int d = 0; d < D; d += 16)
                        sum = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(qg + d), _mm512_set1_ps(sm_scale)),
                                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(z + d))), sum);
                    _mm512_storeu_ps(qz + 16 * g, sum);
                }
            }
            for (int t0 = 0; t0 < nj; t0 += TILE) {
                int nt = nj - t0 < TILE ? nj - t0 : TILE;
                load_tile(k, table, j, oj, own_k, own_kind, js, t0, nt, h, H, bs, D, fold,
                          bsc, bz, tile, rsc, 0);
                tile_scores(qk, zeroed ? qz : NULL, G, D, tile, rsc, nt,
                            scores + h * G * n + (int64_t)j * bs - base + t0, n);
            }
        }
    }
    for (int i = 0; i < H * G; i++) m[i] = softmax_numerators(scores + i * n, n, sum + i);
    memset(acc, 0, sizeof(float) * H * G * D);
    memset(zacc, 0, sizeof(zacc));
    for (int j = j0; j < j1; j++) { /* P.V */
        int64_t js = staged_row(v, table, j, own, slot);
        int oj = js >= 0 ? j : -1;
        int nj = (int)(L - (int64_t)j * bs < bs ? L - (int64_t)j * bs : bs), split = grouped && j != oj;
        for (int t0 = 0; t0 < nj; t0 += TILE) {
            int nt = nj - t0 < TILE ? nj - t0 : TILE;
            if (split) group_scales(v, ((size_t)table[j] * bs + t0) * H, nt, H, gsc, gz);
            for (int h = 0; h < H; h++) { /* prefetches spread between the heads' tiles */
                if (t0 == 0 && j + PREFETCH < j1 && j + PREFETCH != own)
                    prefetch_block(v, table[j + PREFETCH], vspan + h);
                const float *p = scores + h * G * n + (int64_t)j * bs - base + t0;
                if (j != oj && direct_v) {
                    values_from_pool(v, p, n, G, D, ((size_t)table[j] * bs + t0) * H + h, h, nt,
                                     H, rsc, gsc + h * ng * TILE, gz + h * ng * TILE,
                                     acc + h * G * D, zacc + h * G * ng * TILE);
                    continue;
                }
                if (j != oj) block_scale(v, table[j], h, H, D, bsc, bz, 1);
                load_tile(v, table, j, oj, own_v, own_kind, js, t0, nt, h, H, bs, D, 0, bsc,
                          bz, tile, rsc, split);
                const float *hs = gsc + h * ng * TILE, *hz = gz + h * ng * TILE;
                float *za = zacc + h * G * ng * TILE;
                if (split && ng == 2) /* a literal group count: no division per head */
                    tile_values_grouped(p, n, G, D, tile, hs, hz, 2, nt, acc + h * G * D, za);
                else if (split)
                    tile_values_grouped(p, n, G, D, tile, hs, hz, ng, nt, acc + h * G * D, za);
                else
                    tile_values(p, n, G, D, tile, rsc, nt, acc + h * G * D);
            }
        }
    }
    for (int i = 0; grouped && i < H * G; i++) /* the folded zeros: each group's channels */
        for (int c = 0; c < ng; c++) {
            float z = _mm512_reduce_add_ps(_mm512_loadu_ps(zacc + (i * ng + c) * TILE));
            for (int d = c * v_gs; d < (c + 1) * v_gs; d++) {
                acc[i * D + d] += z;
                acc[i * D + D / 2 + d] += z;
            }
        }
    if (v->kind == KIND_U4) /* acc back to channel order */
        for (int i = 0; i < H * G; i++) {
            float natural[D];
            for (int d = 0; d < D / 2; d++) { /* see permuted() */
                natural[2 * d] = acc[i * D + d];
                natural[2 * d + 1] = acc[i * D + D / 2 + d];
            }
            memcpy(acc + i * D, natural, sizeof(float) * D);
        }
}
