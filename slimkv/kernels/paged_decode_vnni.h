/* Integer dot products for int8 and int4 KV in the AVX-512 path (paged_decode_avx512.h),
 * on CPUs with AVX512-VNNI: vpdpwssd multiplies 32 int16 pairs and adds them into 16 int32
 * lanes, twice the products of a float FMA, and the stored integers need no float tile.
 *
 * Q.K: per block and KV head the (scale-folded) query of each of the G query heads is
 * quantized to int16 (step a = max|q| / 32767, round to nearest even); the key rows are
 * widened to int16 once for the G heads and each score is a * (exact int32 dot) * row scale.
 * The rounding of q moves a score by at most a / 2 * sum|k| (see tests/test_kernels.py).
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

/* Rows t0 .. t0 + nt of head h of pool block j as an int16 tile (rows past nt left as they
 * are: their scores are never stored), each row's scale in rsc (per-token int8; else 1). */
static inline __attribute__((always_inline)) void
load_tile_i16(const kv_side *s, const int64_t *table, int j, int t0, int nt, int h, int H,
              int bs, const int D, int16_t *tile, float *rsc) {
    size_t tok0 = ((size_t)table[j] * bs + t0) * H + h, row_bytes = (size_t)s->width;
    rows16_i16((const char *)s->data + tok0 * row_bytes, H * row_bytes, nt, s->kind == KIND_U4, D, tile);
    for (int t = 0; t < TILE; t++)
        rsc[t] = t < nt && s->scale_mode == SCALE_TOKEN ? (float)s->scale[tok0 + (size_t)t * H] : 1.0f;
}

/* tile_scores on an int16 tile: q16[G * D] with steps qa[G]; 16 exact int32 dots per query
 * head, transpose-reduced in int32, converted once. */
static inline __attribute__((always_inline)) void
tile_scores_i16(const int16_t *q16, const float *qa, const float *bias, int G, const int D,
                const int16_t *tile, const float *rsc, int nt, float *scores, int64_t stride) {
    __mmask16 keep = (__mmask16)((1u << nt) - 1);
    __m512 tsc = _mm512_load_ps(rsc);
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
#else
#define PD_VNNI 0
#endif
