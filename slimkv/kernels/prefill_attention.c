/* Prefill attention on the CPU for a bf16 model: one sequence's chunk of n queries over L
 * keys, grouped query heads, causal or under an additive mask, with AVX-512 BF16.
 *
 * torch's CPU flash kernel spends most of a 512-token chunk in per-block float32 GEMM calls
 * (MKL's sgemm for P.V on AMD, ~5 ms per layer on two Zen 4 cores). Here each task takes 16
 * query rows of one head: Q.K in vdpbf16ps (bf16 pairs multiplied exactly, float32 sums)
 * against keys packed once per call as channel pairs x 16 keys, an online softmax in
 * float32 over blocks of 64 keys (exp512), P.V in float32 FMAs against values converted to
 * float32 once per call, and the output rounded to bf16 (round to nearest even) at the end.
 * Causal (mask NULL): query i sees keys 0 .. i + L - n. Built by slimkv/kernels/build.py;
 * without AVX512-BF16 nothing is compiled in (prefill_attention_native() == 0) and callers
 * keep torch's SDPA.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#include "exp_avx512.h"

enum { ROWS = 16, KEYS = 64, MAX_D = 256 };

/* Keys of every head as [H][tiles][D / 2][16]: 32-bit pairs of channels 2p, 2p + 1 of 16
 * consecutive keys (zero past L), the layout vdpbf16ps multiplies against a broadcast
 * query pair. */
static void pack_keys(const uint16_t *k, int64_t ks, int L, int H, int D, uint32_t *kp) {
    int tiles = (L + 15) / 16;
#pragma omp parallel for collapse(2) schedule(static)
    for (int h = 0; h < H; h++)
        for (int t = 0; t < tiles; t++) {
            uint32_t *dst = kp + ((size_t)h * tiles + t) * (D / 2) * 16;
            for (int key = 0; key < 16; key++) {
                int j = t * 16 + key;
                const uint32_t *row = (const uint32_t *)(k + (size_t)j * ks + (size_t)h * D);
                for (int p = 0; p < D / 2; p++) dst[p * 16 + key] = j < L ? row[p] : 0;
            }
        }
}

/* 16 bf16 values as float32 (bf16 is the top half of a float32). */
static inline __attribute__((always_inline)) __m512 widen16(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* Values of every head as float32 [H][L][D]. */
static void widen_values(const uint16_t *v, int64_t vs, int L, int H, int D, float *vf) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int h = 0; h < H; h++)
        for (int j = 0; j < L; j++) {
            const uint16_t *row = v + (size_t)j * vs + (size_t)h * D;
            float *dst = vf + ((size_t)h * L + j) * D;
            for (int d = 0; d < D; d += 16)
                _mm512_storeu_ps(dst + d, widen16(_mm256_loadu_si256((const __m256i *)(row + d))));
        }
}

/* s[r][0 .. 16) = scale * (q row r . keys of tile kt) for all ROWS rows (rows past the
 * chunk have zero queries). */
static inline __attribute__((always_inline)) void
tile_scores(const uint32_t (*qp)[MAX_D / 2], const uint32_t *kt, const int D, float scale,
            float (*s)[KEYS], int col) {
    __m512 a[ROWS];
    for (int r = 0; r < ROWS; r++) a[r] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        __m512bh kv = (__m512bh)_mm512_load_si512(kt + p * 16);
        for (int r = 0; r < ROWS; r++)
            a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32((int)qp[r][p]), kv);
    }
    for (int r = 0; r < ROWS; r++)
        _mm512_store_ps(s[r] + col, _mm512_mul_ps(a[r], _mm512_set1_ps(scale)));
}

/* The online softmax of a row over one block of keys (scores in s, visible below `limit`,
 * plus the additive bf16 mask row when given): s becomes the weights, acc is rescaled. */
static inline __attribute__((always_inline)) void
softmax_block(float *s, int limit, const uint16_t *mask, float *m, float *l,
              float *acc, const int D) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < KEYS; i += 16) {
        int left = limit - i;
        __mmask16 keep = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        __m512 x = _mm512_load_ps(s + i);
        if (mask)
            x = _mm512_add_ps(x, widen16(_mm256_maskz_loadu_epi16(keep, mask + i)));
        x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, x);
        _mm512_store_ps(s + i, x);
        mx = _mm512_max_ps(mx, x);
    }
    float m_new = fmaxf(*m, _mm512_reduce_max_ps(mx));
    if (m_new == -INFINITY) { /* nothing visible yet: weights 0 */
        memset(s, 0, sizeof(float) * KEYS);
        return;
    }
    float alpha = *m == -INFINITY ? 0.0f : expf(*m - m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < KEYS; i += 16) {
        __m512 x = _mm512_load_ps(s + i);
        __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        __m512 p = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(x, _mm512_set1_ps(m_new))));
        sum = _mm512_add_ps(sum, p);
        _mm512_store_ps(s + i, p);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    if (alpha != 1.0f)
        for (int d = 0; d < D; d += 16)
            _mm512_store_ps(acc + d, _mm512_mul_ps(_mm512_load_ps(acc + d), _mm512_set1_ps(alpha)));
}

/* acc[r] += sum over the block's keys lo .. hi of s[r][key] * v[key], RG rows at a time
 * (their D / 16 accumulators and one value row in registers). */
static inline __attribute__((always_inline)) void
values_block(float (*s)[KEYS], const float *vb, int lo, int hi, const int D,
             float (*acc)[MAX_D]) {
    enum { RG_MAX = 8 };
    const int RG = 256 / D < RG_MAX ? 256 / D : RG_MAX;
    for (int r0 = 0; r0 < ROWS; r0 += RG) {
        __m512 o[RG_MAX][MAX_D / 16];
        for (int g = 0; g < RG; g++)
            for (int d = 0; d < D / 16; d++) o[g][d] = _mm512_load_ps(acc[r0 + g] + 16 * d);
        for (int key = lo; key < hi; key++)
            for (int d = 0; d < D / 16; d++) {
                __m512 x = _mm512_loadu_ps(vb + (size_t)key * D + 16 * d);
                for (int g = 0; g < RG; g++)
                    o[g][d] = _mm512_fmadd_ps(_mm512_set1_ps(s[r0 + g][key]), x, o[g][d]);
            }
        for (int g = 0; g < RG; g++)
            for (int d = 0; d < D / 16; d++) _mm512_store_ps(acc[r0 + g] + 16 * d, o[g][d]);
    }
}

/* Bit c: some row r0 .. r0 + nr sees one of the keys kb + 16c .. kb + 16c + 16 (nk keys in
 * all) under the additive bf16 mask, i.e. has an entry other than -inf (0xff80) there.
 * Pieces' masks hide whole tiles (the pool past a row's block, the staged keys before it):
 * those are skipped. */
static inline __attribute__((always_inline)) unsigned
visible_tiles(const uint16_t *mask, int64_t ms, int r0, int nr, int kb, int nk) {
    unsigned tiles = 0;
    for (int c = 0; 16 * c < nk; c++) {
        int left = nk - 16 * c;
        __mmask16 keep = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < nr; r++) {
            __m256i x = _mm256_maskz_loadu_epi16(keep, mask + (size_t)(r0 + r) * ms + kb + 16 * c);
            if (_mm256_mask_cmpneq_epi16_mask(keep, x, _mm256_set1_epi16((short)0xff80))) {
                tiles |= 1u << c;
                break;
            }
        }
    }
    return tiles;
}

/* Rows r0 .. r0 + nr of query head hq (kv head h = hq / G) into out. */
static inline __attribute__((always_inline)) void
attend_rows(const uint16_t *q, int64_t qs, const uint16_t *mask, int64_t ms, uint16_t *out,
            int64_t os, const uint32_t *kp, const float *vf, int hq, int r0, int nr, int L,
            int off, float scale, const int D) {
    uint32_t qp[ROWS][MAX_D / 2] __attribute__((aligned(64)));
    float s[ROWS][KEYS] __attribute__((aligned(64)));
    float acc[ROWS][MAX_D] __attribute__((aligned(64)));
    float m[ROWS], l[ROWS];
    for (int r = 0; r < ROWS; r++) {
        const uint32_t *row = (const uint32_t *)(q + (size_t)(r0 + r) * qs + (size_t)hq * D);
        for (int p = 0; p < D / 2; p++) qp[r][p] = r < nr ? row[p] : 0;
        memset(acc[r], 0, sizeof(float) * D);
        m[r] = -INFINITY, l[r] = 0.0f;
    }
    int kmax = mask ? L : r0 + nr + off; /* causal: the last row's keys */
    kmax = kmax < L ? kmax : L;
    for (int kb = 0; kb < kmax; kb += KEYS) {
        int nk = kmax - kb < KEYS ? kmax - kb : KEYS;
        unsigned tiles = mask ? visible_tiles(mask, ms, r0, nr, kb, nk) : (1u << KEYS / 16) - 1;
        if (!tiles) continue; /* nothing visible: m, l and acc stay */
        for (int c = 0; c < nk; c += 16) {
            if (tiles >> (c / 16) & 1)
                tile_scores((const uint32_t (*)[MAX_D / 2])qp,
                            kp + (size_t)((kb + c) / 16) * (D / 2) * 16, D, scale, s, c);
            else
                for (int r = 0; r < ROWS; r++) _mm512_store_ps(s[r] + c, _mm512_set1_ps(-INFINITY));
        }
        for (int r = 0; r < ROWS; r++) {
            int limit = r >= nr ? 0 : mask ? nk : r0 + r + off + 1 - kb;
            limit = limit < nk ? limit : nk;
            softmax_block(s[r], limit, mask ? mask + (size_t)(r0 + r) * ms + kb : NULL,
                          m + r, l + r, acc[r], D);
        }
        int hi = 16 * (32 - __builtin_clz(tiles));
        values_block(s, vf + (size_t)kb * D, 16 * __builtin_ctz(tiles), hi < nk ? hi : nk, D, acc);
    }
    for (int r = 0; r < nr; r++) {
        uint16_t *dst = out + (size_t)(r0 + r) * os + (size_t)hq * D;
        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_load_ps(acc[r] + d), inv)));
    }
}

/* q [n, Hq, D] (token stride qs), k, v [L, H, D] (ks, vs), all bf16 with each token's heads
 * contiguous; mask [n, L] additive bf16 (row stride ms), or NULL for causal; out [n, Hq, D]
 * (os). D: a multiple of 32 up to 256. */
void prefill_attention(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks,
                       const uint16_t *v, int64_t vs, const uint16_t *mask, int64_t ms,
                       uint16_t *out, int64_t os, int n, int L, int Hq, int H, int D,
                       float scale) {
    int tiles = (L + 15) / 16, blocks = (n + ROWS - 1) / ROWS, G = Hq / H;
    uint32_t *kp = aligned_alloc(64, (size_t)H * tiles * 16 * D * 2);
    float *vf = aligned_alloc(64, ((size_t)H * L * D * 4 + 63) / 64 * 64);
    pack_keys(k, ks, L, H, D, kp);
    widen_values(v, vs, L, H, D, vf);
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < blocks * Hq; i++) { /* the last (longest) row blocks first */
        int hq = i % Hq, r0 = (blocks - 1 - i / Hq) * ROWS, nr = n - r0 < ROWS ? n - r0 : ROWS;
        const uint32_t *kh = kp + (size_t)(hq / G) * tiles * 16 * (D / 2);
        const float *vh = vf + (size_t)(hq / G) * L * D;
        if (D == 64)
            attend_rows(q, qs, mask, ms, out, os, kh, vh, hq, r0, nr, L, L - n, scale, 64);
        else if (D == 128)
            attend_rows(q, qs, mask, ms, out, os, kh, vh, hq, r0, nr, L, L - n, scale, 128);
        else
            attend_rows(q, qs, mask, ms, out, os, kh, vh, hq, r0, nr, L, L - n, scale, D);
    }
    free(kp);
    free(vf);
}

int prefill_attention_native(void) { return 1; }
#else
int prefill_attention_native(void) { return 0; }
#endif
