/* AVX-512 block routines of paged_decode.c (included there when the build targets AVX-512
 * with VNNI): one 16-token block of one KV head at a time, D a multiple of 64. Each computes
 * exactly what the portable row loops of paged_decode.c compute, in another order. */

/* r[t] (16 dwords each) -> r[c] with lane t = old r[t] dword c. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int c = 0; c < 4; c++) {
            t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
            t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    }
}

/* Channels 64 * part .. + 63 (load_raw's order) of a stored int8 / int4 row as unsigned
 * bytes: int8 levels + 128 (the caller takes 128 * sum(qi) off), int4 levels as they are. */
static inline __attribute__((always_inline)) __m512i
int_row(const void *data, int kind, size_t token, const int D, int part) {
    if (kind == KIND_I8)
        return _mm512_xor_si512(_mm512_loadu_si512((const int8_t *)data + token * D + 64 * part),
                                _mm512_set1_epi8((char)0x80));
    const uint8_t *r = (const uint8_t *)data + token * (D / 2);
    const __m512i low = _mm512_set1_epi8(15);
    if (D == 64) {
        __m256i y = _mm256_loadu_si256((const __m256i *)r);
        __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1);
        return _mm512_and_si512(x, low);
    }
    /* D = 128 * m: part p < D / 128 is low nibbles of bytes 64p.., then high nibbles */
    int half = D / 128, byte = 64 * (part % half);
    __m512i x = _mm512_loadu_si512(r + byte);
    return _mm512_and_si512(part < half ? x : _mm512_srli_epi16(x, 4), low);
}

/* int_dots for a whole block: the 16 rows transposed to 16 lanes of 4 channels, then one
 * vpdpbusd per 4 channels and head gives the 16 dot products at once. */
static inline __attribute__((always_inline)) void
int_dots_avx512(const void *data, int kind, size_t token0, int H, const int D,
                const int8_t *qi, const int32_t *qsum, int G, int32_t *isum) {
    __m512i acc[G];
    for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_si512();
    for (int part = 0; part < D / 64; part++) {
        __m512i r[16];
        for (int t = 0; t < 16; t++) r[t] = int_row(data, kind, token0 + (size_t)t * H, D, part);
        transpose16(r);
        for (int g = 0; g < G; g++) {
            const int8_t *q4 = qi + g * D + 64 * part;
            for (int c = 0; c < 16; c++) {
                int32_t word;
                memcpy(&word, q4 + 4 * c, 4);
                acc[g] = _mm512_dpbusd_epi32(acc[g], r[c], _mm512_set1_epi32(word));
            }
        }
    }
    for (int g = 0; g < G; g++) {
        if (kind == KIND_I8) acc[g] = _mm512_sub_epi32(acc[g], _mm512_set1_epi32(128 * qsum[g]));
        _mm512_storeu_si512(isum + g * 16, acc[g]);
    }
}

/* q.k of the 16 bf16 rows of a block for G heads (out[g * 16 + t]), float32 products and
 * sums: rows transposed to lanes of channel pairs, then two FMAs per pair and head. */
static inline __attribute__((always_inline)) void
bf16_dots_avx512(const void *data, size_t token0, int H, const int D, const float *qk, int G,
                 float *out) {
    __m512 acc[G];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
    for (int part = 0; part < D / 32; part++) {
        __m512i r[16];
        for (int t = 0; t < 16; t++)
            r[t] = _mm512_loadu_si512((const uint16_t *)data + (token0 + (size_t)t * H) * D + 32 * part);
        transpose16(r);
        for (int c = 0; c < 16; c++) {
            __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(r[c], 16));
            __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(r[c], high));
            for (int g = 0; g < G; g++) {
                const float *q2 = qk + g * D + 32 * part + 2 * c;
                acc[g] = _mm512_fmadd_ps(even, _mm512_set1_ps(q2[0]), acc[g]);
                acc[g] = _mm512_fmadd_ps(odd, _mm512_set1_ps(q2[1]), acc[g]);
            }
        }
    }
    for (int g = 0; g < G; g++) _mm512_storeu_ps(out + g * 16, acc[g]);
}

/* acc[g * D ..] += sum over the block's n rows of p[g * L + t] * value row t (load_raw's
 * order): int8 and bf16 rows, int4 rows with per-token groups of 32 (scale and zero; the
 * zeros' share is summed per group and added once). */
static inline __attribute__((always_inline)) void
values_avx512(const kv_side *v, int64_t blk, int h, int H, int n, const int D, int G,
              const float *p, int64_t L, float *acc) {
    const int C = D / 16, half = D / 32; /* 16-float chunks; int4: chunk c and c + half share group c */
    __m512 a[G][C];
    float zs[G][half];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < C; c++) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
        for (int c = 0; c < half; c++) zs[g][c] = 0.0f;
    }
    for (int t = 0; t < n; t++) {
        size_t token = ((size_t)blk * 16 + t) * H + h;
        __m512 x[C];
        if (v->kind == KIND_I8) {
            const int8_t *r = (const int8_t *)v->data + token * D;
            float sc = (float)v->scale[token];
            for (int c = 0; c < C; c++)
                x[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + 16 * c))));
            for (int g = 0; g < G; g++) {
                __m512 pg = _mm512_set1_ps(p[g * L + t] * sc);
                for (int c = 0; c < C; c++) a[g][c] = _mm512_fmadd_ps(x[c], pg, a[g][c]);
            }
        } else if (v->kind == KIND_BF16) {
            const uint16_t *r = (const uint16_t *)v->data + token * D;
            for (int c = 0; c < C; c++)
                x[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + 16 * c))), 16));
            for (int g = 0; g < G; g++) {
                __m512 pg = _mm512_set1_ps(p[g * L + t]);
                for (int c = 0; c < C; c++) a[g][c] = _mm512_fmadd_ps(x[c], pg, a[g][c]);
            }
        } else { /* int4, groups of 32: chunk c (< half) holds low nibbles of group c */
            const uint8_t *r = (const uint8_t *)v->data + token * (D / 2);
            const _Float16 *sc = v->scale + token * half, *z = v->zero + token * half;
            for (int c = 0; c < half; c++) {
                __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r + 16 * c)));
                x[c] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
                x[half + c] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
            }
            for (int g = 0; g < G; g++) {
                float pg = p[g * L + t];
                for (int c = 0; c < half; c++) {
                    __m512 ps = _mm512_set1_ps(pg * (float)sc[c]);
                    a[g][c] = _mm512_fmadd_ps(x[c], ps, a[g][c]);
                    a[g][half + c] = _mm512_fmadd_ps(x[half + c], ps, a[g][half + c]);
                    zs[g][c] += pg * (float)z[c];
                }
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(acc + g * D + 16 * c,
                             _mm512_add_ps(a[g][c], _mm512_set1_ps(v->kind == KIND_U4 ? zs[g][c % half] : 0.0f)));
}
