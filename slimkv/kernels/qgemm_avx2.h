/* qgemm.c's tiles on AVX2 (with FMA and F16C), for CPUs without AVX512-VNNI (an AMD EPYC
 * Zen 3, say): the same repacked layout read as half tiles of 8 output rows (32 bytes of a
 * 64-byte chunk), and the same exact int32 group sums, so after the same float32 scaling in
 * the same order the outputs are bitwise those of the vpdpbusd loop.
 * Without vpdpbusd the byte products go through vpmaddubsw (unsigned x signed bytes, pairs
 * summed into int16, saturating) and vpmaddwd against ones (int16 pairs into int32):
 * - 4 bits: codes 0..15 times activations |a| <= 127 give pairs of at most 3,810, so a
 *   group's 8 products (32 elements) add up in int16 (at most 30,480) before one vpmaddwd;
 * - 8 bits: codes 0..255 would saturate, so each code q is taken as q - 128 (a sign flip of
 *   the top bit), multiplied as |q - 128| x sign-adjusted a (at most 2 x 128 x 127 =
 *   32,512 per pair), and the group's sum gets 128 * sum(a) back: the same integer. */

static inline __m256i bcast4_256(const int8_t *a) {
    int32_t v;
    memcpy(&v, a, 4);
    return _mm256_set1_epi32(v);
}

/* Half tile j of a block: tile t0 + j / 2's rows 8 (j % 2) .. 8 (j % 2) + 7. */
static inline const uint8_t *half_at(const uint8_t *g0, size_t tstride, int j) {
    return g0 + (size_t)(j / 2) * tstride + 32 * (j % 2);
}

/* Outputs n .. n + 7 of row r: stored or added, masked past N. */
static inline __attribute__((always_inline)) void
store_half(float *y, size_t r, int N, int n, __m256 v, int accumulate) {
    float *out = y + r * N + n;
    if (N - n >= 8) {
        if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(out));
        _mm256_storeu_ps(out, v);
        return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < N - n; i++) out[i] = accumulate ? out[i] + lanes[i] : lanes[i];
}

/* The float32 scaling of one group, as micro does it: acc += (float)isum * (d * ad) + m * as. */
static inline __attribute__((always_inline)) __m256
scale_group(__m256 acc, __m256i isum, const uint8_t *s, int j, float ad, float as) {
    __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16 * (j % 2))));
    __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32 + 16 * (j % 2))));
    __m256 sc = _mm256_mul_ps(dv, _mm256_set1_ps(ad));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc);
    return _mm256_fmadd_ps(mv, _mm256_set1_ps(as), acc);
}

/* Activation rows [r0, r0 + MR) x half tiles [0, NH) of tiles from t0. */
static inline __attribute__((always_inline)) void
micro2(const uint8_t *w, const int bits, int nb, int t0, const int NH, const int8_t *qa,
       const float *ad, const float *as, const int32_t *qsum, int K, size_t r0, const int MR,
       float *y, int N, int accumulate) {
    const int CB = code_bytes(bits), GB = group_bytes(bits);
    const size_t tstride = (size_t)nb * GB;
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i top = _mm256_set1_epi8((char)0x80);
    __m256 facc[4][4]; /* fixed sizes (MR, NH <= 4): a VLA stays on the stack */
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NH; j++) facc[i][j] = _mm256_setzero_ps();
    const uint8_t *g0 = w + (size_t)t0 * tstride;
    for (int b = 0; b < nb; b++) {
        __m256i iacc[4][4];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NH; j++) iacc[i][j] = _mm256_setzero_si256();
        const uint8_t *g = g0 + (size_t)b * GB;
        if (bits == 4) {
#pragma GCC unroll 1 /* unrolled, GCC hoisted every product ahead and spilled them */
            for (int c = 0; c < 4; c++) {
                __m256i wl[4], wh[4];
                for (int j = 0; j < NH; j++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(half_at(g, tstride, j) + 64 * c));
                    wl[j] = _mm256_and_si256(raw, lo4);
                    wh[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
                }
                for (int i = 0; i < MR; i++) {
                    const int8_t *a = qa + (r0 + i) * K + b * 32 + 4 * c;
                    __m256i al = bcast4_256(a), ah = bcast4_256(a + 16);
                    for (int j = 0; j < NH; j++) /* int16 sums: at most 30,480 */
                        iacc[i][j] = _mm256_add_epi16(iacc[i][j], _mm256_add_epi16(
                            _mm256_maddubs_epi16(wl[j], al), _mm256_maddubs_epi16(wh[j], ah)));
                }
            }
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < NH; j++) iacc[i][j] = _mm256_madd_epi16(iacc[i][j], ones);
        } else {
#pragma GCC unroll 1
            for (int c = 0; c < 8; c++) {
                __m256i ws[4], wa[4];
                for (int j = 0; j < NH; j++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(half_at(g, tstride, j) + 64 * c));
                    ws[j] = _mm256_xor_si256(raw, top); /* q - 128 as a signed byte */
                    wa[j] = _mm256_abs_epi8(ws[j]);    /* |q - 128| <= 128, read unsigned */
                }
                for (int i = 0; i < MR; i++) {
                    __m256i a = bcast4_256(qa + (r0 + i) * K + b * 32 + 4 * c);
                    for (int j = 0; j < NH; j++)
                        iacc[i][j] = _mm256_add_epi32(iacc[i][j], _mm256_madd_epi16(
                            _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(a, ws[j])), ones));
                }
            }
            for (int i = 0; i < MR; i++) { /* sum (q - 128) a + 128 sum a = sum q a */
                __m256i back = _mm256_set1_epi32(128 * qsum[(r0 + i) * nb + b]);
                for (int j = 0; j < NH; j++) iacc[i][j] = _mm256_add_epi32(iacc[i][j], back);
            }
        }
        for (int j = 0; j < NH; j++) {
            const uint8_t *s = g + (size_t)(j / 2) * tstride + CB;
            for (int i = 0; i < MR; i++) {
                size_t at = (r0 + i) * nb + b;
                facc[i][j] = scale_group(facc[i][j], iacc[i][j], s, j, ad[at], as[at]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NH; j++)
            store_half(y, r0 + i, N, t0 * 16 + 8 * j, facc[i][j], accumulate);
}

#define MICRO2(F, NH, ...)                                  \
    switch (mr) {                                           \
    case 1: F(__VA_ARGS__, r, 1, y, N, acc); break;         \
    case 2: F(__VA_ARGS__, r, 2, y, N, acc); break;         \
    case 3: F(__VA_ARGS__, r, 3, y, N, acc); break;         \
    default: F(__VA_ARGS__, r, 4, y, N, acc); break;        \
    }

/* Tiles [t0, t1) for all R rows: blocks of 2 tiles (4 half tiles) for one or two rows, 1
 * tile for more (16 ymm registers), rows 4 at a time. */
#ifndef QG2_WIDE
#define QG2_WIDE 1 /* tiles per block where rows are blocked by 3 or more */
#endif
#ifndef QG2_MR
#define QG2_MR 4 /* rows per block (at most 4) */
#endif
static void tiles_avx2(const uint8_t *w, int bits, int K, int t0, int t1, const int8_t *qa,
                       const float *ad, const float *as, const int32_t *qsum, int R, float *y,
                       int N, int acc) {
    int nb = K / 32, wide = R <= 2 ? 2 : QG2_WIDE;
    for (int t = t0; t < t1;) {
        int nt = t1 - t >= wide ? wide : 1;
        for (int r = 0; r < R; r += QG2_MR) {
            int mr = R - r < QG2_MR ? R - r : QG2_MR;
            if (nt == 2) {
                MICRO2(micro2, 4, w, bits, nb, t, 4, qa, ad, as, qsum, K)
            } else {
                MICRO2(micro2, 2, w, bits, nb, t, 2, qa, ad, as, qsum, K)
            }
        }
        t += nt;
    }
}
