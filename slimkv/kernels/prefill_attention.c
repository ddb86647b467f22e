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
 *
 * prefill_attention_staged: all the pieces of a staged chunk (each over the pool keys before
 * its last block, then its staged keys) in one call, keys packed and values widened once for
 * all of them, what each query sees taken from positions, bit for bit what prefill_attention
 * gives each piece over its concatenation under its mask.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#include "exp_avx512.h"
#include "kv_int8.h"

enum { ROWS = 16, KEYS = 64, MAX_D = 256 };

/* Tile t of head h's keys as [D / 2][16]: 32-bit pairs of channels 2p, 2p + 1 of 16
 * consecutive keys (zero past L), the layout vdpbf16ps multiplies against a broadcast
 * query pair. */
static inline void pack_tile(const uint16_t *k, int64_t ks, int L, int D, int h, int t,
                             uint32_t *dst) {
    for (int key = 0; key < 16; key++) {
        int j = t * 16 + key;
        const uint32_t *row = (const uint32_t *)(k + (size_t)j * ks + (size_t)h * D);
        for (int p = 0; p < D / 2; p++) dst[p * 16 + key] = j < L ? row[p] : 0;
    }
}

/* Keys of every head as [H][tiles][D / 2][16] (pack_tile). */
static void pack_keys(const uint16_t *k, int64_t ks, int L, int H, int D, uint32_t *kp) {
    int tiles = (L + 15) / 16;
#pragma omp parallel for collapse(2) schedule(static)
    for (int h = 0; h < H; h++)
        for (int t = 0; t < tiles; t++)
            pack_tile(k, ks, L, D, h, t, kp + ((size_t)h * tiles + t) * (D / 2) * 16);
}

/* 16 bf16 values as float32 (bf16 is the top half of a float32). */
static inline __attribute__((always_inline)) __m512 widen16(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* Value j of head h as float32 [D]. */
static inline void widen_row(const uint16_t *v, int64_t vs, int D, int h, int j, float *dst) {
    const uint16_t *row = v + (size_t)j * vs + (size_t)h * D;
    for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(dst + d, widen16(_mm256_loadu_si256((const __m256i *)(row + d))));
}

/* Values of every head as float32 [H][L][D]. */
static void widen_values(const uint16_t *v, int64_t vs, int L, int H, int D, float *vf) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int h = 0; h < H; h++)
        for (int j = 0; j < L; j++) widen_row(v, vs, D, h, j, vf + ((size_t)h * L + j) * D);
}

/* pack_tile and widen_row for a sequence's keys and values in an int8 pool: each decoded
 * and rounded to bf16 as kv_blocks.c's dequantize_blocks does (kv_int8.h), so the tiles
 * hold the bits a dequantized bf16 copy would, without the copy. */
static inline void pack_tile_int8(const Int8Pool *k, int L, int H, int D, int h, int t,
                                  uint32_t *dst) {
    uint16_t y[MAX_D] __attribute__((aligned(64)));
    for (int key = 0; key < 16; key++) {
        int j = t * 16 + key;
        if (j < L) int8_key_bf16(k, j, H, D, h, y);
        const uint32_t *row = (const uint32_t *)y;
        for (int p = 0; p < D / 2; p++) dst[p * 16 + key] = j < L ? row[p] : 0;
    }
}

static inline void widen_row_int8(const Int8Pool *v, int H, int D, int h, int j, float *dst) {
    uint16_t y[MAX_D] __attribute__((aligned(64)));
    int8_key_bf16(v, j, H, D, h, y);
    for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(dst + d, widen16(_mm256_load_si256((const __m256i *)(y + d))));
}

/* Where the keys of one task lie: tiles t < split (keys < 16 split) at kp[0] + t and vf[0] +
 * key, the later ones at kp[1] + t - split and vf[1] + key - 16 split (a piece's staged keys
 * after its pool keys; one run of keys: split past the last tile). */
typedef struct {
    const uint32_t *kp[2];
    const float *vf[2];
    int split;
} Keys;

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

/* Lanes lo .. hi of 16 (clamped to 0 .. 16). */
static inline __mmask16 lanes(int lo, int hi) {
    lo = lo < 0 ? 0 : lo > 16 ? 16 : lo;
    hi = hi < 0 ? 0 : hi > 16 ? 16 : hi;
    return hi > lo ? (__mmask16)((1u << hi) - (1u << lo)) : 0;
}

/* Which keys of a block one row sees: 0 .. a and b .. c (block-relative), and where its
 * additive bf16 mask row (when given) is not -inf. */
typedef struct {
    int a, b, c;
} Seen;

/* The online softmax of a row over the 16-key tiles of one block of keys that some row of
 * its task sees (bits of `tiles`; the others' scores are neither read nor written), visible
 * to this row as `seen` says: s becomes the weights, acc is rescaled. */
static inline __attribute__((always_inline)) void
softmax_block(float *s, unsigned tiles, Seen seen, const uint16_t *mask, float *m, float *l,
              float *acc, const int D) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < KEYS; i += 16) {
        if (!(tiles >> (i / 16) & 1)) continue;
        __mmask16 keep = lanes(-i, seen.a - i) | lanes(seen.b - i, seen.c - i);
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
        if (!(tiles >> (i / 16) & 1)) continue;
        __m512 x = _mm512_load_ps(s + i);
        __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        if (!seen) { /* 16 keys hidden from this row (past a causal row): weights 0 */
            _mm512_store_ps(s + i, _mm512_setzero_ps());
            continue;
        }
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

/* acc[r] += sum over the keys of block kb in `tiles` (nk keys in all) of s[r][key] *
 * v[kb + key], RG rows at a time (their D / 16 accumulators and one value row in registers).
 * The tiles no row sees would add weights 0: skipping them leaves every sum's bits. */
static inline __attribute__((always_inline)) void
values_block(float (*s)[KEYS], const Keys *keys, int kb, unsigned tiles, int nk, const int D,
             float (*acc)[MAX_D]) {
    enum { RG_MAX = 8 };
    const int RG = 256 / D < RG_MAX ? 256 / D : RG_MAX;
    for (int r0 = 0; r0 < ROWS; r0 += RG) {
        __m512 o[RG_MAX][MAX_D / 16];
        for (int g = 0; g < RG; g++)
            for (int d = 0; d < D / 16; d++) o[g][d] = _mm512_load_ps(acc[r0 + g] + 16 * d);
        for (int c = 0; 16 * c < nk; c++) {
            if (!(tiles >> c & 1)) continue;
            int hi = 16 * c + 16 < nk ? 16 * c + 16 : nk;
            for (int key = 16 * c; key < hi; key++) {
                int j = kb + key, second = j >= 16 * keys->split;
                const float *vr = keys->vf[second] + (size_t)(j - 16 * keys->split * second) * D;
                for (int d = 0; d < D / 16; d++) {
                    __m512 x = _mm512_loadu_ps(vr + 16 * d);
                    for (int g = 0; g < RG; g++)
                        o[g][d] = _mm512_fmadd_ps(_mm512_set1_ps(s[r0 + g][key]), x, o[g][d]);
                }
            }
        }
        for (int g = 0; g < RG; g++)
            for (int d = 0; d < D / 16; d++) _mm512_store_ps(acc[r0 + g] + 16 * d, o[g][d]);
    }
}

/* Bit c: some row r0 .. r0 + nr sees one of the keys kb + 16c .. kb + 16c + 16 (nk keys in
 * all) under the additive bf16 mask, i.e. has an entry other than -inf (0xff80) there.
 * Masks that hide whole tiles (a piece's pool past its rows' blocks, walked piece by piece
 * through prefill_attention) have them skipped. */
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

/* A staged piece's rule, from positions: the query at position p (row r: p = first + r) sees
 * the pool keys before its block (0 .. p - p % bs) and its block's staged keys up to itself;
 * the staged keys, from position first - first % bs on, follow num_pool pool keys. */
typedef struct {
    int first, bs, num_pool;
} Staged;

/* What row r sees of the block at kb (nk keys): causal (query i sees keys 0 .. i + off),
 * the piece's `staged` rule, or every key (under a mask). */
static inline Seen row_seen(const Staged *staged, int masked, int r, int off, int kb, int nk) {
    if (staged) {
        int p = staged->first + r, own = staged->first - staged->first % staged->bs;
        int block = p - p % staged->bs, at = staged->num_pool - own - kb;
        return (Seen){block - kb, at + block, at + p + 1};
    }
    int a = masked ? nk : r + off + 1 - kb;
    return (Seen){a < nk ? a : nk, 0, 0};
}

/* Bit c: a key kb + 16c .. kb + 16c + 16 is in 0 .. a or b .. c. */
static inline unsigned seen_tiles(Seen seen, int kb, int nk) {
    unsigned tiles = 0;
    for (int c = 0; 16 * c < nk; c++) {
        int lo = kb + 16 * c, hi = lo + 16;
        tiles |= (unsigned)(lo < seen.a || (lo < seen.c && hi > seen.b && seen.c > seen.b)) << c;
    }
    return tiles;
}

/* Rows r0 .. r0 + nr of query head hq (kv head h = hq / G) into out: causal, under the
 * additive mask, or (staged given) under a staged piece's rule. */
static inline __attribute__((always_inline)) void
attend_rows(const uint16_t *q, int64_t qs, const uint16_t *mask, int64_t ms,
            const Staged *staged, uint16_t *out, int64_t os, const Keys *keys, int hq, int r0,
            int nr, int L, int off, float scale, const int D) {
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
    /* what the rows see together (staged rule): the pool keys the last row sees, the
     * staged keys from the first row's block to the last row */
    Seen all = {0, 0, 0};
    if (staged) {
        Seen top = row_seen(staged, 0, r0, off, 0, L);
        Seen end = row_seen(staged, 0, r0 + nr - 1, off, 0, L);
        all = (Seen){end.a, top.b, end.c};
    }
    int kmax = mask ? L : staged ? all.c : r0 + nr + off; /* causal: the last row's keys */
    kmax = kmax < L ? kmax : L;
    for (int kb = 0; kb < kmax; kb += KEYS) {
        int nk = kmax - kb < KEYS ? kmax - kb : KEYS;
        unsigned tiles = mask ? visible_tiles(mask, ms, r0, nr, kb, nk)
                         : staged ? seen_tiles(all, kb, nk) : (1u << KEYS / 16) - 1;
        if (!tiles) continue; /* nothing visible: m, l and acc stay */
        for (int c = 0; c < nk; c += 16) {
            int t = (kb + c) / 16, second = t >= keys->split;
            if (tiles >> (c / 16) & 1)
                tile_scores((const uint32_t (*)[MAX_D / 2])qp,
                            keys->kp[second] + (size_t)(t - keys->split * second) * (D / 2) * 16,
                            D, scale, s, c);
        }
        for (int r = 0; r < ROWS; r++) {
            Seen seen = r >= nr ? (Seen){0, 0, 0}
                                : row_seen(staged, mask != NULL, r0 + r, off, kb, nk);
            softmax_block(s[r], tiles, seen, mask ? mask + (size_t)(r0 + r) * ms + kb : NULL,
                          m + r, l + r, acc[r], D);
        }
        values_block(s, keys, kb, tiles, nk, D, acc);
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
        Keys keys = {{kh, kh}, {vh, vh}, tiles};
        if (D == 64)
            attend_rows(q, qs, mask, ms, NULL, out, os, &keys, hq, r0, nr, L, L - n, scale, 64);
        else if (D == 128)
            attend_rows(q, qs, mask, ms, NULL, out, os, &keys, hq, r0, nr, L, L - n, scale, 128);
        else
            attend_rows(q, qs, mask, ms, NULL, out, os, &keys, hq, r0, nr, L, L - n, scale, D);
    }
    free(kp);
    free(vf);
}

/* A chunk's pieces in one call: q [n, Hq, D] (qs), out [n, Hq, D] (os); pool keys, values
 * pk, pv [P, H, D] (pks, pvs), staged ones sk, sv [S, H, D] (sks, svs), all bf16 with each
 * token's heads contiguous, P and S the most any piece reads. pieces [num_pieces][7]: rows
 * row0 .. row1 of the chunk, at positions first .. first + row1 - row0, attend pool keys
 * 0 .. num_pool then staged keys staged0 .. staged1 (from position first - first % bs on)
 * under the staged rule (Staged), in the order row0, row1, num_pool, staged0, staged1,
 * first, bs. num_pool and staged0 are multiples of 16, so each 16-key tile of a piece's keys
 * is one pool tile or one staged tile: attend_rows walks them as prefill_attention walks
 * the concatenation under the rule's additive mask (slimkv.kv.staging.staged_mask), the
 * same blocks of 64 keys in the same order, so the same bits, without reading a mask (keys
 * past it are hidden before the softmax, so the staged tiles' tails need not be zero). */
static void staged_call(const uint16_t *q, int64_t qs, const uint16_t *pk, int64_t pks,
                        const uint16_t *pv, int64_t pvs, const Int8Pool *k8,
                        const Int8Pool *v8, const uint16_t *sk, int64_t sks,
                        const uint16_t *sv, int64_t svs, const int64_t (*pieces)[7],
                        int num_pieces, uint16_t *out, int64_t os, int Hq, int H, int D,
                        float scale) {
    int P = 0, S = 0, G = Hq / H, num_tasks = 0;
    for (int i = 0; i < num_pieces; i++) {
        P = pieces[i][2] > P ? (int)pieces[i][2] : P;
        S = pieces[i][4] > S ? (int)pieces[i][4] : S;
        num_tasks += (pieces[i][1] - pieces[i][0] + ROWS - 1) / ROWS;
    }
    int pt = P / 16, st = (S + 15) / 16;
    uint32_t *kp = aligned_alloc(64, (size_t)H * (pt + st) * 16 * D * 2 + 64);
    float *vf = aligned_alloc(64, ((size_t)H * (P + S) * D * 4 + 127) / 64 * 64);
    uint32_t *kps = kp + (size_t)H * pt * 16 * (D / 2);
    float *vfs = vf + (size_t)H * P * D;
    int (*tasks)[2] = malloc(sizeof(int[2]) * (num_tasks + 1));
    num_tasks = 0;
    for (int i = num_pieces - 1; i >= 0; i--) /* the last (longest) pieces and rows first */
        for (int r0 = (pieces[i][1] - pieces[i][0] - 1) / ROWS * ROWS; r0 >= 0; r0 -= ROWS)
            tasks[num_tasks][0] = i, tasks[num_tasks++][1] = r0;
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static) nowait
        for (int h = 0; h < H; h++)
            for (int t = 0; t < pt; t++) {
                uint32_t *dst = kp + ((size_t)h * pt + t) * (D / 2) * 16;
                if (k8)
                    pack_tile_int8(k8, P, H, D, h, t, dst);
                else
                    pack_tile(pk, pks, P, D, h, t, dst);
            }
#pragma omp for collapse(2) schedule(static) nowait
        for (int h = 0; h < H; h++)
            for (int t = 0; t < st; t++)
                pack_tile(sk, sks, S, D, h, t, kps + ((size_t)h * st + t) * (D / 2) * 16);
#pragma omp for collapse(2) schedule(static) nowait
        for (int h = 0; h < H; h++)
            for (int j = 0; j < P; j++) {
                float *dst = vf + ((size_t)h * P + j) * D;
                if (v8)
                    widen_row_int8(v8, H, D, h, j, dst);
                else
                    widen_row(pv, pvs, D, h, j, dst);
            }
#pragma omp for collapse(2) schedule(static)
        for (int h = 0; h < H; h++)
            for (int j = 0; j < S; j++) widen_row(sv, svs, D, h, j, vfs + ((size_t)h * S + j) * D);
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_tasks * Hq; i++) {
            const int64_t *p = pieces[tasks[i / Hq][0]];
            int hq = i % Hq, h = hq / G, r0 = tasks[i / Hq][1], n = (int)(p[1] - p[0]);
            int num_pool = (int)p[2], s0 = (int)p[3], L = num_pool + (int)(p[4] - p[3]);
            int nr = n - r0 < ROWS ? n - r0 : ROWS;
            Keys keys = {{kp + (size_t)h * pt * 16 * (D / 2),
                          kps + ((size_t)h * st + s0 / 16) * 16 * (D / 2)},
                         {vf + (size_t)h * P * D, vfs + ((size_t)h * S + s0) * D}, num_pool / 16};
            Staged staged = {(int)p[5], (int)p[6], num_pool};
            const uint16_t *qp = q + p[0] * qs;
            uint16_t *op = out + p[0] * os;
            if (D == 64)
                attend_rows(qp, qs, NULL, 0, &staged, op, os, &keys, hq, r0, nr, L, L - n, scale,
                            64);
            else if (D == 128)
                attend_rows(qp, qs, NULL, 0, &staged, op, os, &keys, hq, r0, nr, L, L - n, scale,
                            128);
            else
                attend_rows(qp, qs, NULL, 0, &staged, op, os, &keys, hq, r0, nr, L, L - n, scale,
                            D);
        }
    }
    free(tasks);
    free(kp);
    free(vf);
}

void prefill_attention_staged(const uint16_t *q, int64_t qs, const uint16_t *pk, int64_t pks,
                              const uint16_t *pv, int64_t pvs, const uint16_t *sk,
                              int64_t sks, const uint16_t *sv, int64_t svs,
                              const int64_t (*pieces)[7], int num_pieces, uint16_t *out,
                              int64_t os, int Hq, int H, int D, float scale) {
    staged_call(q, qs, pk, pks, pv, pvs, NULL, NULL, sk, sks, sv, svs, pieces, num_pieces, out,
                os, Hq, H, D, scale);
}

/* prefill_attention_staged with the pool keys and values read from an int8 pool (codes
 * kd, vd, float16 scales ks, vs, scale modes km, vm, the sequence's blocks block_ids of bs
 * tokens) rather than a dequantized copy: the same bits (kv_int8.h). */
void prefill_attention_staged_int8(const uint16_t *q, int64_t qs, const int8_t *kd,
                                   const _Float16 *ks, int km, const int8_t *vd,
                                   const _Float16 *vs, int vm, const int64_t *block_ids,
                                   int bs, const uint16_t *sk, int64_t sks, const uint16_t *sv,
                                   int64_t svs, const int64_t (*pieces)[7], int num_pieces,
                                   uint16_t *out, int64_t os, int Hq, int H, int D,
                                   float scale) {
    const Int8Pool k8 = {kd, ks, block_ids, km, bs}, v8 = {vd, vs, block_ids, vm, bs};
    staged_call(q, qs, NULL, 0, NULL, 0, &k8, &v8, sk, sks, sv, svs, pieces, num_pieces, out,
                os, Hq, H, D, scale);
}

int prefill_attention_native(void) { return 1; }
#else
int prefill_attention_native(void) { return 0; }
#endif
