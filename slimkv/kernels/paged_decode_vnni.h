/* Integer dot products for int8 and int4 KV in the AVX-512 path (paged_decode_avx512.h),
 * on CPUs with AVX512-VNNI: vpdpwssd multiplies 32 int16 pairs and adds them into 16 int32
 * lanes, twice the products of a float FMA, and the stored integers need no float tile.
 *
 * Q.K (pool blocks of int8 keys, and of block-scaled int4 keys): per block and KV head the
 * (scale-folded) query of each of the G query heads is quantized to int16 (step a = max|q| /
 * 32767, round to nearest even); the key rows are widened to int16 once for the G heads and
 * each score is a * (exact int32 dot) * row scale (+ q.zero for int4).
 * P.V (pool blocks of per-token-scaled int8 values): per 16-token tile and query head the
 * weights p * row scale are quantized to int16 the same way (step b = max w / 32767) and
 * meet pairs of value rows interleaved as int16 pairs; b * (int32 sums) joins a float sum.
 * Rounding q moves a score by at most a / 2 * sum|k|, rounding w a tile's sum by at most
 * b / 2 * sum|v|: far below int8's own step; tests/integer_reference.py is this math in
 * torch, with those bounds.
 */
#if defined(__AVX512VNNI__)
#define PD_VNNI 1

/* x[D] as int16 round(x / a) with a = max|x| / 32767 into q16[D]; returns a (0 for x = 0). */
static inline __attribute__((always_inline)) float quantize_i16(const float *x, const int D,
                                                                int16_t *q16) {
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
    float amax = _mm512_reduce_max_ps(mx);
    __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    for (int d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i *)(q16 + d), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                                      _mm512_mul_ps(_mm512_loadu_ps(x + d), inv))));
    return amax / 32767.0f;
}

/* nt stored rows (row r at base + r * stride bytes) widened to int16 tile rows in load_raw's
 * order: int8 sign-extended, int4 nibbles zero-extended (low nibbles, then high ones). */
static inline __attribute__((always_inline)) void
rows16_i16(const char *base, size_t stride, int nt, const int u4, const int D, int16_t *tile) {
    const __m128i low = _mm_set1_epi8(15);
    for (int t = 0; t < nt; t++) {
        const char *row = base + t * stride;
        int16_t *out = tile + t * D;
        if (!u4) {
            for (int d = 0; d < D; d += 32)
                _mm512_store_si512(out + d, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + d))));
            continue;
        }
        for (int i = 0; i < D / 2; i += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(row + i));
            _mm256_store_si256((__m256i *)(out + i), _mm256_cvtepu8_epi16(_mm_and_si128(x, low)));
            _mm256_store_si256((__m256i *)(out + D / 2 + i),
                               _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(x, 4), low)));
        }
    }
}

/* tile_scores on an int16 tile: q16[G * D] with steps qa[G]; 16 exact int32 dots per query
 * head, transpose-reduced in int32, converted once. */
static inline __attribute__((always_inline)) void
tile_scores_i16(const int16_t *q16, const float *qa, const float *bias, int G, const int D,
                const int16_t *tile, __m512 tsc, int nt, float *scores, int64_t stride) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    for (int g = 0; g < G; g++) {
        __m512 a[TILE];
        for (int t = 0; t < TILE; t++) {
            __m512i s = _mm512_setzero_si512();
            for (int d = 0; d < D; d += 32)
                s = _mm512_dpwssd_epi32(s, _mm512_load_si512(tile + t * D + d),
                                        _mm512_loadu_si512(q16 + g * D + d));
            a[t] = _mm512_castsi512_ps(s);
        }
        __m512 dots = _mm512_cvtepi32_ps(_mm512_castps_si512(reduce16(a, 1)));
        __m512 sc = _mm512_fmadd_ps(dots, _mm512_mul_ps(_mm512_set1_ps(qa[g]), tsc),
                                    _mm512_set1_ps(bias[g]));
        _mm512_mask_storeu_ps(scores + g * stride, keep, sc);
    }
}

/* P.V on int16 pairs: rows 2i and 2i + 1 of a value tile interleaved as int16 pairs, so that
 * one vpdpwssd with the broadcast weight pair (w[2i], w[2i + 1]) adds both rows' products
 * into 16 int32 lanes. unpacklo/hi_epi16 interleave within 128-bit lanes: int32 lane l of
 * output vector c = 2k + hi holds position pair_pos(16 c + l) of the row (below). */
static inline __attribute__((always_inline)) int pair_pos(int a) {
    int c = a / 16, l = a % 16;
    return 32 * (c / 2) + 8 * (l / 4) + 4 * (c % 2) + l % 4;
}

/* nt stored rows (as rows16_i16 reads them) into pair rows ptile[(nt + 1) / 2][2 * D]; an
 * odd last row is paired with itself (its partner's weight is 0). */
static inline __attribute__((always_inline)) void
pairs16_i16(const char *base, size_t stride, int nt, const int u4, const int D, int16_t *ptile) {
    int16_t rows[2 * D] __attribute__((aligned(64)));
    for (int i = 0; i < (nt + 1) / 2; i++) {
        rows16_i16(base + 2 * i * stride, 2 * i + 1 < nt ? stride : 0, 2, u4, D, rows);
        for (int d = 0; d < D; d += 32) {
            __m512i a = _mm512_load_si512(rows + d), b = _mm512_load_si512(rows + D + d);
            _mm512_store_si512(ptile + 2 * i * D + 2 * d, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(ptile + 2 * i * D + 2 * d + 32, _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* The scales of nt rows of a per-token-scaled side (row t at token tok0 + t * step) as
 * floats, 1 past nt and for other sides. One gather of the aligned 32-bit words holding
 * them (never outside the tensor's pages), each half shifted down: no scalar stores that
 * a vector load would wait for. */
static inline __attribute__((always_inline)) __m512 row_scales(const kv_side *s, size_t tok0,
                                                               size_t step, int nt) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    if (s->scale_mode != SCALE_TOKEN) return _mm512_set1_ps(1.0f);
    uintptr_t at = (uintptr_t)(s->scale + tok0);
    __m512i off = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32((int)(2 * step))),
        _mm512_set1_epi32((int)(at & 3)));
    __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keep,
                                                _mm512_andnot_si512(_mm512_set1_epi32(3), off),
                                                (const void *)(at & ~(uintptr_t)3), 1);
    __m512i halves = _mm512_srlv_epi32(words, _mm512_slli_epi32(_mm512_and_si512(off, _mm512_set1_epi32(2)), 3));
    return _mm512_mask_blend_ps(keep, _mm512_set1_ps(1.0f), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves)));
}

/* Rows t0 .. t0 + nt of head h of pool block j as an int16 tile (rows past nt left as they
 * are: their scores are never stored), or as pair rows when `pairs` (pairs16_i16); returns
 * the rows' remaining scales (row_scales). */
static inline __attribute__((always_inline)) __m512
load_tile_i16(const kv_side *s, const int64_t *table, int j, int t0, int nt, int h, int H,
              int bs, const int D, const int pairs, int16_t *tile) {
    size_t tok0 = ((size_t)table[j] * bs + t0) * H + h, row_bytes = (size_t)s->width;
    const char *base = (const char *)s->data + tok0 * row_bytes;
    if (pairs) pairs16_i16(base, H * row_bytes, nt, s->kind == KIND_U4, D, tile);
    else rows16_i16(base, H * row_bytes, nt, s->kind == KIND_U4, D, tile);
    return row_scales(s, tok0, H, nt);
}

/* accq[g * D] (pair_pos order) += sum over the tile's nt tokens of p[g * stride + t] *
 * rsc[t] * row t, the weights quantized to int16 per query head and tile (step b = max w /
 * 32767) and the rows summed in int32. */
static inline __attribute__((always_inline)) void
tile_values_i16(const float *p, int64_t stride, int G, const int D, const int16_t *ptile,
                __m512 rsc, int nt, float *accq) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    for (int g = 0; g < G; g++) {
        int16_t w16[TILE] __attribute__((aligned(64)));
        __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, p + g * stride), rsc);
        float b = quantize_i16((const float *)&w, 16, w16);
        if (b == 0.0f) continue;
        __m512i ia[MAX_D / 16];
        for (int c = 0; c < D / 16; c++) ia[c] = _mm512_setzero_si512();
        for (int i = 0; i < (nt + 1) / 2; i++) {
            __m512i wp = _mm512_set1_epi32(((const int32_t *)w16)[i]);
            for (int c = 0; c < D / 16; c++)
                ia[c] = _mm512_dpwssd_epi32(ia[c], _mm512_load_si512(ptile + 2 * i * D + 32 * c), wp);
        }
        for (int c = 0; c < D / 16; c++)
            _mm512_storeu_ps(accq + g * D + 16 * c,
                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[c]), _mm512_set1_ps(b),
                                             _mm512_loadu_ps(accq + g * D + 16 * c)));
    }
}
#else
#define PD_VNNI 0
#endif
