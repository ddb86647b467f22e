/* The AVX2 path of paged_decode.c (AVX2 + FMA + F16C without AVX-512, e.g. AMD Zen 2/3;
 * included there after the row decoders): the design of paged_decode_avx512.h on 8 lanes.
 * One task attends all heads of one sequence over a run of its blocks (a whole sequence, or
 * a part of a long one that merge_parts joins with the others: flash-decoding; the task
 * building and the merge are paged_decode.c's, shared with the AVX-512 path).
 *
 * Per block and KV head, TILE token rows are decoded once into a float tile that stays in L1
 * and serves the G query heads of the group. Q.K runs over 8-token halves of the tile with 8
 * vector accumulators per head (the q vector loaded once per 8 channels, 9 live registers of
 * 16) and one transpose-reduce per half (reduce8: 8 scores in one vector, no horizontal sum
 * per dot); P.V accumulates up to 64 channels per head in 8 registers with the row scale
 * folded into p. Rows are converted with vector loads per format (int4 with its per-token
 * group scales applied while converting); the staged own block and per-block value scales
 * take the shared row decoders. The next blocks are prefetched in software, spread over the
 * heads' tiles (prefetch_block, shared with the AVX-512 path).
 */
enum { TILE = 16, MAX_D = 256, PREFETCH = 2 }; /* head dims: multiples of 8 up to MAX_D */

/* a[i] summed across its lanes into lane i: 128-bit halves folded by blend + lane swap, then
 * two levels of hadd (lane order comes out natural). */
static inline __attribute__((always_inline)) __m256 reduce8(const __m256 *a) {
    __m256 w[4];
    for (int i = 0; i < 4; i++) /* lanes 0-3: input i's partial sums, 4-7: input i + 4's */
        w[i] = _mm256_add_ps(_mm256_blend_ps(a[i], a[i + 4], 0xf0),
                             _mm256_permute2f128_ps(a[i], a[i + 4], 0x21));
    return _mm256_hadd_ps(_mm256_hadd_ps(w[0], w[1]), _mm256_hadd_ps(w[2], w[3]));
}

/* Lanes below n (0 <= n <= 8) set: a maskload/maskstore mask. */
static inline __attribute__((always_inline)) __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* exp_nonpos on 8 lanes. */
static inline __attribute__((always_inline)) __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e)); /* n >= -126: 2^n is a normal float */
}

static inline __attribute__((always_inline)) float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* sc[0 .. n) = exp(sc - max), returning the max and (in *sum) their sum. */
static inline __attribute__((always_inline)) float softmax_numerators(float *sc, int64_t n,
                                                                      float *sum) {
    __m256 mx = _mm256_set1_ps(-INFINITY), s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))), tail = 0.0f;
    for (int64_t t = i; t < n; t++) m = sc[t] > m ? sc[t] : m;
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i), _mm256_set1_ps(m)));
        s = _mm256_add_ps(s, e);
        _mm256_storeu_ps(sc + i, e);
    }
    for (; i < n; i++) {
        sc[i] = exp_nonpos(sc[i] - m);
        tail += sc[i];
    }
    *sum = hsum8(s) + tail;
    return m;
}

/* n fp16 values at src as floats in out (n a multiple of 8), or, for int4 rows (u4),
 * de-interleaved into load_raw's order: even channels, then odd ones (n a multiple of 16). */
static inline __attribute__((always_inline)) void
floats8(const _Float16 *src, int u4, const int n, float *out) {
    for (int d = 0; d < n; d += u4 ? 16 : 8) {
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d)));
        if (!u4) {
            _mm256_storeu_ps(out + d, a);
            continue;
        }
        __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d + 8)));
        __m256d even = _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
        __m256d odd = _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm256_storeu_ps(out + d / 2, _mm256_castpd_ps(_mm256_permute4x64_pd(even, 0xd8)));
        _mm256_storeu_ps(out + n / 2 + d / 2, _mm256_castpd_ps(_mm256_permute4x64_pd(odd, 0xd8)));
    }
}

/* load_block_scale with vector conversions (int4 sides de-interleaved by floats8 where D is
 * a multiple of 16; the scalar permuting loop cost int4 keys ~12% of the attention at
 * 32 x 2K). */
static inline __attribute__((always_inline)) void
block_scale(const kv_side *s, int64_t blk, int h, int H, const int D, float *bsc, float *bz) {
    int u4 = s->kind == KIND_U4;
    if (s->scale_mode != SCALE_BLOCK || (u4 && D % 16)) {
        load_block_scale(s, blk, h, H, D, bsc, bz);
        return;
    }
    size_t at = ((size_t)blk * H + h) * D;
    floats8(s->scale + at, u4, D, bsc);
    if (s->zero) floats8(s->zero + at, u4, D, bz);
}

/* 8 stored values at p (kind `kind`) as floats, scales not applied. fp8 codes become fp16
 * ones as in load16 of the AVX-512 path: e5m2 is the top byte of an fp16; e4m3's bits
 * shifted into fp16's fields read exactly 2^-8 of the value, the factor 256 left to the
 * row scale (load_tile: one multiply per row instead of one per 8 values). */
static inline __attribute__((always_inline)) __m256 load8(const void *p, const int kind) {
    switch (kind) {
    case KIND_F32: return _mm256_loadu_ps(p);
    case KIND_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    case KIND_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case KIND_I8: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    case KIND_E5M2:
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    default: { /* KIND_E4M3 */
        __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
        __m128i h16 = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7));
        return _mm256_cvtph_ps(h16);
    }
    }
}

/* nt rows of `kind` (row r at base + r * stride bytes) into tile rows, in vectors. */
static inline __attribute__((always_inline)) void
rows8(const char *base, size_t stride, int nt, const int kind, const int D, float *tile) {
    size_t size = elem_size(kind);
    for (int t = 0; t < nt; t++)
        for (int d = 0; d < D; d += 8)
            _mm256_store_ps(tile + t * D + d, load8(base + t * stride + d * size, kind));
}

/* nt int4 rows (row r at base + r * stride) into tile rows in load_raw's order (low nibbles,
 * then high ones), per-token group scales (row r's groups at scale + r * scale_stride)
 * applied when `scale` is given (gs: elements per group within each half; a multiple of 8). */
static inline __attribute__((always_inline)) void
rows8_u4(const uint8_t *base, size_t stride, int nt, const int D, const _Float16 *scale,
         const _Float16 *zero, size_t scale_stride, int gs, float *tile) {
    const __m256i low = _mm256_set1_epi32(15);
    __m256 sc = _mm256_setzero_ps(), z = sc;
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < D / 2; i += 8) {
            __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(base + t * stride + i)));
            __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(x, low));
            __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
            if (scale) {
                if (i % gs == 0) { /* a group's first 8: its scale and zero, once */
                    size_t g = t * scale_stride + i / gs;
                    sc = _mm256_set1_ps((float)scale[g]), z = _mm256_set1_ps((float)zero[g]);
                }
                lo = _mm256_fmadd_ps(lo, sc, z);
                hi = _mm256_fmadd_ps(hi, sc, z);
            }
            _mm256_store_ps(tile + t * D + i, lo);
            _mm256_store_ps(tile + t * D + D / 2 + i, hi);
        }
}

/* Rows t0 .. t0 + nt of head h of block j (the staged own block when j == own) into
 * tile[TILE][D] in load_raw's order, rows past nt zero; each row's remaining scale in rsc
 * (per-token 8-bit scales, times 256 for e4m3 rows: see load8; 1 otherwise). Pool rows are converted in vectors with the format
 * switch outside the row loop; the staged block, block scales that are not folded (per-block
 * value scales) and int4 rows of odd shapes take load_row/load_staged. */
static inline __attribute__((always_inline)) void
load_tile(const kv_side *s, const int64_t *table, int j, int own, const void *own_data,
          int own_kind, int64_t slot, int t0, int nt, int h, int H, int bs, const int D,
          int folded, const float *bsc, const float *bz, float *tile, float *rsc) {
    int u4 = s->kind == KIND_U4, gs = u4 ? D / 2 / s->groups : 8;
    size_t tok0 = j == own ? 0 : ((size_t)table[j] * bs + t0) * H + h;
    size_t row_bytes = (size_t)s->width * elem_size(s->kind);
    const char *base = (const char *)s->data + tok0 * row_bytes;
    for (int t = 0; t < TILE; t++) rsc[t] = t < nt ? 1.0f : 0.0f;
    if (j == own || (s->scale_mode == SCALE_BLOCK && !folded) || (u4 && (D % 16 || gs % 8))) {
        for (int t = 0; t < nt; t++) {
            if (j == own) load_staged(s, own_data, own_kind, slot, t0 + t, h, H, bs, D, tile + t * D);
            else rsc[t] = load_row(s, table[j], t0 + t, h, H, bs, D, folded, bsc, bz, tile + t * D);
        }
    } else if (u4) {
        const uint8_t *rows = (const uint8_t *)base;
        const _Float16 *sc = s->scale + tok0 * s->groups, *z = s->zero + tok0 * s->groups;
        size_t sstride = (size_t)H * s->groups;
        if (s->scale_mode == SCALE_TOKEN && gs == 16) /* groups of 32: i % gs folds away */
            rows8_u4(rows, H * row_bytes, nt, D, sc, z, sstride, 16, tile);
        else if (s->scale_mode == SCALE_TOKEN)
            rows8_u4(rows, H * row_bytes, nt, D, sc, z, sstride, gs, tile);
        else
            rows8_u4(rows, H * row_bytes, nt, D, NULL, NULL, 0, gs, tile);
    } else {
        switch (s->kind) { /* literal kinds: one unrolled row loop each */
        case KIND_F32: rows8(base, H * row_bytes, nt, KIND_F32, D, tile); break;
        case KIND_BF16: rows8(base, H * row_bytes, nt, KIND_BF16, D, tile); break;
        case KIND_F16: rows8(base, H * row_bytes, nt, KIND_F16, D, tile); break;
        case KIND_I8: rows8(base, H * row_bytes, nt, KIND_I8, D, tile); break;
        case KIND_E4M3: rows8(base, H * row_bytes, nt, KIND_E4M3, D, tile); break;
        case KIND_E5M2: rows8(base, H * row_bytes, nt, KIND_E5M2, D, tile); break;
        }
        float unit = s->kind == KIND_E4M3 ? 256.0f : 1.0f; /* see load8 */
        int token_scale = s->scale_mode == SCALE_TOKEN;
        for (int t = 0; t < nt; t++)
            rsc[t] = token_scale ? unit * (float)s->scale[tok0 + (size_t)t * H] : unit;
    }
    for (int t = nt; t < TILE; t++) memset(tile + t * D, 0, sizeof(float) * D);
}

/* Scores of the G query heads qk[G * D] against a key tile, stored at scores[g * stride] for
 * the first nt tokens. qz (or NULL): per head 8 lanes that sum to a bias of every score,
 * the accumulators' starting value. */
static inline __attribute__((always_inline)) void
tile_scores(const float *qk, const float *qz, int G, const int D, const float *tile,
            const float *rsc, int nt, float *scores, int64_t stride) {
    for (int g = 0; g < G; g++) {
        __m256 z = qz ? _mm256_loadu_ps(qz + 8 * g) : _mm256_setzero_ps();
        for (int t0 = 0; t0 < nt; t0 += 8) {
            __m256 a[8];
            for (int t = 0; t < 8; t++) a[t] = z;
            for (int d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(qk + g * D + d);
                for (int t = 0; t < 8; t++)
                    a[t] = _mm256_fmadd_ps(qv, _mm256_load_ps(tile + (t0 + t) * D + d), a[t]);
            }
            __m256 r = _mm256_mul_ps(reduce8(a), _mm256_load_ps(rsc + t0));
            if (nt - t0 >= 8) _mm256_storeu_ps(scores + g * stride + t0, r);
            else _mm256_maskstore_ps(scores + g * stride + t0, lanes_below(nt - t0), r);
        }
    }
}

/* acc[g * D] += p[g * stride + t] * rsc[t] * tile[t] over the tile's nt tokens, 64 channels
 * (8 registers) at a time. */
static inline __attribute__((always_inline)) void
tile_values(const float *p, int64_t stride, int G, const int D, const float *tile,
            const float *rsc, int nt, float *acc) {
    for (int g = 0; g < G; g++) {
        float w[TILE] __attribute__((aligned(32)));
        for (int t0 = 0; t0 < TILE; t0 += 8) {
            __m256 pv = _mm256_maskload_ps(p + g * stride + t0, lanes_below(nt - t0 < 8 ? nt - t0 : 8));
            _mm256_store_ps(w + t0, _mm256_mul_ps(pv, _mm256_load_ps(rsc + t0)));
        }
        for (int c = 0; c < D; c += 64) {
            enum { NV = 8 };
            __m256 o[NV]; /* registers when D is a literal */
            int nv = (D - c) / 8 < NV ? (D - c) / 8 : NV;
            for (int d = 0; d < nv; d++) o[d] = _mm256_loadu_ps(acc + g * D + c + 8 * d);
            for (int t = 0; t < nt; t++) {
                __m256 wt = _mm256_broadcast_ss(w + t);
                for (int d = 0; d < nv; d++)
                    o[d] = _mm256_fmadd_ps(wt, _mm256_load_ps(tile + t * D + c + 8 * d), o[d]);
            }
            for (int d = 0; d < nv; d++) _mm256_storeu_ps(acc + g * D + c + 8 * d, o[d]);
        }
    }
}

/* The Hq = H * G query heads q[Hq * D] of one sequence over its blocks [j0, j1) (positions
 * below L): per query head the max m, the sum of exp(score - m) and acc[D] = the sum of
 * exp(score - m) * v, not yet normalised. scores: [Hq, (j1 - j0) * bs] scratch. */
static inline __attribute__((always_inline)) void
attend_part(const float *q, int64_t L, const int64_t *table, int own, int64_t slot, int H,
            int G, const int D, int bs, const kv_side *k, const kv_side *v, const void *own_k,
            const void *own_v, int own_kind, float sm_scale, int j0, int j1, float *scores,
            float *m, float *sum, float *acc) {
    float tile[TILE * D] __attribute__((aligned(32))), rsc[TILE] __attribute__((aligned(32)));
    float bsc[D], bz[D], qp[H * G * D], qs[G * D], qz[G * 8];
    int k_u4 = k->kind == KIND_U4, fold = k->scale_mode == SCALE_BLOCK;
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
            if (j != oj && fold) { /* q.(raw * s + z) = (q * s).raw + q.z, in one pass */
                block_scale(k, table[j], h, H, D, bsc, bz);
                for (int g = 0; g < G; g++) {
                    __m256 z = _mm256_setzero_ps();
                    for (int d = 0; d < D; d += 8) {
                        __m256 qv = _mm256_loadu_ps(qk + g * D + d);
                        _mm256_storeu_ps(qs + g * D + d, _mm256_mul_ps(qv, _mm256_loadu_ps(bsc + d)));
                        if (zeroed) z = _mm256_fmadd_ps(qv, _mm256_loadu_ps(bz + d), z);
                    }
                    _mm256_storeu_ps(qz + 8 * g, z); /* 8 lanes per head (see tile_scores) */
                }
                qk = qs;
            }
            for (int t0 = 0; t0 < nj; t0 += TILE) {
                int nt = nj - t0 < TILE ? nj - t0 : TILE;
                load_tile(k, table, j, oj, own_k, own_kind, js, t0, nt, h, H, bs, D, fold,
                          bsc, bz, tile, rsc);
                tile_scores(qk, zeroed ? qz : NULL, G, D, tile, rsc, nt,
                            scores + h * G * n + (int64_t)j * bs - base + t0, n);
            }
        }
    }
    for (int i = 0; i < H * G; i++) m[i] = softmax_numerators(scores + i * n, n, sum + i);
    memset(acc, 0, sizeof(float) * H * G * D);
    for (int j = j0; j < j1; j++) { /* P.V */
        int64_t js = staged_row(v, table, j, own, slot);
        int oj = js >= 0 ? j : -1;
        int nj = (int)(L - (int64_t)j * bs < bs ? L - (int64_t)j * bs : bs);
        for (int h = 0; h < H; h++) {
            if (j + PREFETCH < j1 && j + PREFETCH != own)
                prefetch_block(v, table[j + PREFETCH], vspan + h);
            if (j != oj) block_scale(v, table[j], h, H, D, bsc, bz);
            for (int t0 = 0; t0 < nj; t0 += TILE) {
                int nt = nj - t0 < TILE ? nj - t0 : TILE;
                load_tile(v, table, j, oj, own_v, own_kind, js, t0, nt, h, H, bs, D, 0, bsc,
                          bz, tile, rsc);
                tile_values(scores + h * G * n + (int64_t)j * bs - base + t0, n, G, D, tile,
                            rsc, nt, acc + h * G * D);
            }
        }
    }
    if (v->kind == KIND_U4) /* acc back to channel order */
        for (int i = 0; i < H * G; i++) {
            float natural[D];
            for (int d = 0; d < D; d++) natural[d] = acc[i * D + permuted(d, 1, D)];
            memcpy(acc + i * D, natural, sizeof(float) * D);
        }
}
