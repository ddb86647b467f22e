/* Fused paged decode attention on the CPU: gather, dequantize and attend in one pass.
 *
 * One query token per sequence attends over its KV blocks read straight from the quantized
 * pool: each 16-token block is decoded one token-head row at a time into a 64-float buffer
 * that stays in L1, so no float copy of a sequence's cache is ever materialised and the
 * memory traffic is the stored bytes (1 byte per value for int8/fp8, half for int4).
 * Softmax and accumulation are float32. Built by slimkv/kernels/build.py (glue: slimkv/backends/cpu_decode.py) with the
 * system C compiler and called through ctypes (which releases the GIL).
 *
 * With AVX-512 (F/BW/DQ/VL) and a head dim that is a multiple of 16 up to 256, paged_decode
 * takes the tiled path of paged_decode_avx512.h (16-token tiles converted once for the G
 * query heads, transpose-reduced scores, prefetched blocks, long sequences of small batches
 * split across threads and merged by log-sum-exp); with AVX2 + FMA + F16C only (e.g. AMD
 * Zen 2/3) and a multiple of 8, the same design on 8 lanes in paged_decode_avx2.h. Both run
 * under paged_decode_native below (task building, parts, merge_parts: plain C, shared).
 * Elsewhere the portable per-row loop below (`attend`, also exported as
 * paged_decode_portable) computes the same.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* PD_NATIVE: 1 AVX-512 (head dims that are multiples of 16), 2 AVX2 + FMA + F16C (multiples
 * of 8), 0 neither: the portable loop only. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define PD_NATIVE 1
#define PD_LANES 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_NATIVE 2
#define PD_LANES 8
#else
#define PD_NATIVE 0
#define PD_LANES 16
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2, KIND_I8 = 3, KIND_E4M3 = 4, KIND_E5M2 = 5,
       KIND_U4 = 6 };
enum { SCALE_NONE = 0, SCALE_TOKEN = 1, SCALE_BLOCK = 2 };

/* One side (K or V) of one layer of the pool. */
typedef struct {
    const void *data;      /* [num_blocks, block_size, H, width] */
    const _Float16 *scale; /* per token [nb, bs, H, groups] or per block [nb, H, D]; or NULL */
    const _Float16 *zero;  /* same layout as scale; NULL when symmetric */
    int32_t kind;
    int32_t scale_mode;
    int32_t groups;        /* per-token scale groups along D (1 for 8-bit, D/32 for int4) */
    int32_t width;         /* stored elements per token-head */
    int64_t sink_from;     /* first id of the float sink region (INT64_MAX: none), staged_row */
    int64_t sink_shift;    /* staging row of sink id b: b + sink_shift */
} kv_side;

typedef union {
    uint32_t u;
    float f;
} bits32;

/* An fp8 byte (M mantissa bits, exponent bias BIAS) as float32, in integer steps that
 * vectorise: the significand (implicit bit included for normal numbers) shifted by the
 * exponent is an exact integer, scaled by 2^(1 - BIAS - M); subnormals fall out of the same
 * formula. Inf/NaN codes never occur (values are clamped to the finite range when stored). */
static inline __attribute__((always_inline)) float fp8_to_f32(uint8_t x, const int M, const int BIAS) {
    uint32_t e = (x & 0x7f) >> M, nz = e != 0;
    uint32_t magnitude = ((x & ((1u << M) - 1)) | (nz << M)) << (e - nz);
    float sign = 1.0f - 2.0f * (float)(x >> 7);
    return sign * (float)magnitude * (1.0f / (float)(1u << (BIAS + M - 1)));
}

/* Stored values of one token-head row as floats, scales not applied. int4 rows come out
 * de-interleaved, low nibbles then high nibbles (element order 0, 2, 4, ..., 1, 3, ...):
 * see `permuted`. */
static inline __attribute__((always_inline)) void load_raw(const void *row, int kind, const int D, float *out) {
    switch (kind) {
    case KIND_F32: {
        const float *r = row;
        for (int d = 0; d < D; d++) out[d] = r[d];
        break;
    }
    case KIND_BF16: { /* bf16 is the top half of a float32 */
        const uint16_t *r = row;
        bits32 *o = (bits32 *)out;
        for (int d = 0; d < D; d++) o[d].u = (uint32_t)r[d] << 16;
        break;
    }
    case KIND_F16: {
        const _Float16 *r = row;
        for (int d = 0; d < D; d++) out[d] = (float)r[d];
        break;
    }
    case KIND_I8: {
        const int8_t *r = row;
        for (int d = 0; d < D; d++) out[d] = (float)r[d];
        break;
    }
    case KIND_E4M3: {
        const uint8_t *r = row;
        for (int d = 0; d < D; d++) out[d] = fp8_to_f32(r[d], 3, 7);
        break;
    }
    case KIND_E5M2: {
        const uint8_t *r = row;
        for (int d = 0; d < D; d++) out[d] = fp8_to_f32(r[d], 2, 15);
        break;
    }
    case KIND_U4: {
        const uint8_t *r = row;
        for (int i = 0; i < D / 2; i++) {
            out[i] = (float)(r[i] & 15);
            out[D / 2 + i] = (float)(r[i] >> 4);
        }
        break;
    }
    }
}

/* Channel d's place in a row as load_raw delivers it (int4 rows are de-interleaved). */
static inline __attribute__((always_inline)) int permuted(int d, int is_u4, const int D) {
    return is_u4 ? (d & 1) * (D / 2) + d / 2 : d;
}

static inline __attribute__((always_inline)) size_t elem_size(int kind) {
    return kind == KIND_F32 ? 4 : (kind == KIND_BF16 || kind == KIND_F16) ? 2 : 1;
}

/* Row (block, token t, head h) of a side into out[D], in load_raw's order, returning the
 * scale the caller still has to apply. Per-token 8-bit scales are left to the caller (one
 * multiply of a dot product or a softmax weight instead of D); per-block channel scales
 * are left to it when `block_folded` (keys: folded into q once per block), else applied
 * from bsc/bz; int4 group scales are applied here. */
static inline __attribute__((always_inline)) float
load_row(const kv_side *s, int64_t blk, int t, int h, int H, int bs, const int D,
         int block_folded, const float *bsc, const float *bz, float *out) {
    size_t token = ((size_t)blk * bs + t) * H + h;
    load_raw((const char *)s->data + token * s->width * elem_size(s->kind), s->kind, D, out);
    if (s->scale_mode == SCALE_BLOCK && !block_folded) {
        if (s->zero)
            for (int d = 0; d < D; d++) out[d] = out[d] * bsc[d] + bz[d];
        else
            for (int d = 0; d < D; d++) out[d] *= bsc[d];
    } else if (s->scale_mode == SCALE_TOKEN && !s->zero) { /* 8-bit: one scale per row */
        return (float)s->scale[token];
    } else if (s->scale_mode == SCALE_TOKEN) { /* int4 groups: the same span of each half */
        int half = D / 2, gs = half / s->groups;
        for (int g = 0; g < s->groups; g++) {
            float sc = (float)s->scale[token * s->groups + g];
            float z = (float)s->zero[token * s->groups + g];
            for (int d = g * gs; d < (g + 1) * gs; d++) {
                out[d] = out[d] * sc + z;
                out[half + d] = out[half + d] * sc + z;
            }
        }
    }
    return 1.0f;
}

/* The block's per-channel scale/zero of head h as floats in load_raw's order (zero stays
 * untouched when the side is symmetric: callers then ignore it). */
static inline __attribute__((always_inline)) void
load_block_scale(const kv_side *s, int64_t blk, int h, int H, const int D, float *bsc,
                 float *bz) {
    if (s->scale_mode != SCALE_BLOCK) return;
    size_t base = ((size_t)blk * H + h) * D;
    if (s->kind != KIND_U4) {
        for (int d = 0; d < D; d++) bsc[d] = (float)s->scale[base + d];
        return;
    }
    for (int d = 0; d < D; d++) {
        bsc[permuted(d, 1, D)] = (float)s->scale[base + d];
        bz[permuted(d, 1, D)] = (float)s->zero[base + d];
    }
}

/* Row t of a staged (full-precision) own block, staging [slots, bs, H, D] in f32 or bf16,
 * in the order `s` delivers its rows. */
static inline __attribute__((always_inline)) void load_staged(const kv_side *s, const void *own, int own_kind, int64_t slot,
                               int t, int h, int H, int bs, const int D, float *out) {
    size_t row = (((size_t)slot * bs + t) * H + h) * D;
    if (s->kind != KIND_U4) {
        load_raw((const char *)own + row * elem_size(own_kind), own_kind, D, out);
        return;
    }
    float natural[D];
    load_raw((const char *)own + row * elem_size(own_kind), own_kind, D, natural);
    for (int i = 0; i < D / 2; i++) { /* permuted(): even channels, then odd ones */
        out[i] = natural[2 * i];
        out[D / 2 + i] = natural[2 * i + 1];
    }
}

/* The staging row block j is read from at full precision, or -1 for the pool: the own
 * block's slot, or the float row of an id in the sink region (a sequence's block 0, kept at
 * the model dtype: docs/kv-formats.md). One branch per block, no copy. */
static inline __attribute__((always_inline)) int64_t
staged_row(const kv_side *s, const int64_t *table, int j, int own, int64_t slot) {
    if (j == own) return slot;
    return table[j] >= s->sink_from ? table[j] + s->sink_shift : -1;
}

/* exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp), written to vectorise. */
static inline __attribute__((always_inline)) float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_roundevenf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    bits32 scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return (p * r * r + r + 1.0f) * scale.f;
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b,
                                                        const int D) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < D; d++) sum += a[d] * b[d];
    return sum;
}

static inline __attribute__((always_inline)) float dot_i8(const float *a, const int8_t *b,
                                                           const int D) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < D; d++) sum += a[d] * (float)b[d];
    return sum;
}

/* Sequence b, KV head h: the G query heads of the group over the sequence's L positions.
 * Always inlined with a literal D so that the row loops are fully unrolled and vectorised. */
static inline __attribute__((always_inline)) void
attend(const float *qh, float *o, int64_t L, const int64_t *table, int own, int64_t slot,
       int h, int G, int H, const int D, int bs, const kv_side *k, const kv_side *v,
       const void *own_k, const void *own_v, int own_kind, float sm_scale, float *scores) {
    float row[D], bsc[D], bz[D], qp[G * D], qs[G * D], bias[G], acc[G * D], sum[G];
    int nblocks = (int)((L + bs - 1) / bs);
    int k_u4 = k->kind == KIND_U4, v_u4 = v->kind == KIND_U4;
    int fold = k->scale_mode == SCALE_BLOCK;
    for (int g = 0; g < G; g++) /* q in the order K rows arrive in */
        for (int d = 0; d < D; d++) qp[g * D + permuted(d, k_u4, D)] = qh[g * D + d] * sm_scale;
    for (int j = 0; j < nblocks; j++) {
        int n = (int)(L - (int64_t)j * bs < bs ? L - (int64_t)j * bs : bs);
        int64_t js = staged_row(k, table, j, own, slot);
        int oj = js >= 0 ? j : -1; /* j itself where staged */
        const float *qk = qp;
        for (int g = 0; g < G; g++) bias[g] = 0.0f;
        if (j != oj && fold) { /* q.(raw * s + z) = (q * s).raw + q.z */
            load_block_scale(k, table[j], h, H, D, bsc, bz);
            for (int g = 0; g < G; g++) {
                for (int d = 0; d < D; d++) qs[g * D + d] = qp[g * D + d] * bsc[d];
                if (k->zero) bias[g] = dot(qp + g * D, bz, D);
            }
            qk = qs;
        }
        for (int t = 0; t < n; t++) {
            float sc = 1.0f, *out = scores + j * bs + t;
            if (j != oj && k->kind == KIND_I8 && (fold || k->scale_mode == SCALE_TOKEN)) {
                /* int8 keys straight from the pool, no row buffer */
                size_t token = ((size_t)table[j] * bs + t) * H + h;
                const int8_t *r = (const int8_t *)k->data + token * D;
                sc = fold ? 1.0f : (float)k->scale[token];
                for (int g = 0; g < G; g++) out[g * L] = dot_i8(qk + g * D, r, D) * sc + bias[g];
                continue;
            }
            if (j == oj) load_staged(k, own_k, own_kind, js, t, h, H, bs, D, row);
            else sc = load_row(k, table[j], t, h, H, bs, D, fold, bsc, bz, row);
            for (int g = 0; g < G; g++) out[g * L] = dot(qk + g * D, row, D) * sc + bias[g];
        }
    }
    for (int g = 0; g < G; g++) {
        float m = -INFINITY, s = 0.0f;
        float *sc = scores + g * L;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < L; i++) m = sc[i] > m ? sc[i] : m;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < L; i++) {
            sc[i] = exp_nonpos(sc[i] - m);
            s += sc[i];
        }
        sum[g] = s;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int j = 0; j < nblocks; j++) {
        int n = (int)(L - (int64_t)j * bs < bs ? L - (int64_t)j * bs : bs);
        int64_t js = staged_row(v, table, j, own, slot);
        int oj = js >= 0 ? j : -1;
        if (j != oj) load_block_scale(v, table[j], h, H, D, bsc, bz);
        for (int t = 0; t < n; t++) {
            float sc = 1.0f;
            if (j != oj && v->kind == KIND_I8 && v->scale_mode == SCALE_TOKEN) {
                size_t token = ((size_t)table[j] * bs + t) * H + h;
                const int8_t *r = (const int8_t *)v->data + token * D;
                sc = (float)v->scale[token];
                for (int g = 0; g < G; g++) {
                    float p = scores[g * L + j * bs + t] * sc;
#pragma omp simd
                    for (int d = 0; d < D; d++) acc[g * D + d] += p * (float)r[d];
                }
                continue;
            }
            if (j == oj) load_staged(v, own_v, own_kind, js, t, h, H, bs, D, row);
            else sc = load_row(v, table[j], t, h, H, bs, D, 0, bsc, bz, row);
            for (int g = 0; g < G; g++) {
                float p = scores[g * L + j * bs + t] * sc;
#pragma omp simd
                for (int d = 0; d < D; d++) acc[g * D + d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < G; g++) /* acc is in the order V rows arrive in */
        for (int d = 0; d < D; d++) o[g * D + d] = acc[g * D + permuted(d, v_u4, D)] / sum[g];
}


#if PD_NATIVE
/* Part `part` of `parts` of a block of side s (all heads' rows and their scales): which of
 * its cache lines, worked out once per call (the divisions cost as much as a tile's
 * conversions when done per block). */
typedef struct { size_t bytes, n, l0, l1, s0, s1; } pf_span;

static inline pf_span prefetch_span(const kv_side *s, int H, int bs, const int D, int part,
                                    int parts) {
    pf_span p;
    p.bytes = (size_t)bs * H * s->width * elem_size(s->kind);
    size_t lines = (p.bytes + 63) / 64;
    p.l0 = lines * part / parts, p.l1 = lines * (part + 1) / parts;
    p.n = s->scale_mode == SCALE_BLOCK ? (size_t)H * D : (size_t)bs * H * s->groups;
    lines = s->scale_mode == SCALE_NONE ? 0 : (2 * p.n + 63) / 64;
    p.s0 = lines * part / parts, p.s1 = lines * (part + 1) / parts;
    return p;
}

/* The span p of block blk on its way to L1: callers spread a block over its heads' tiles, as
 * a burst of a whole block's lines stalls on the core's few outstanding misses (attn_ab
 * 16 x 2K: int8 -11%, int4 -15%). */
static inline __attribute__((always_inline)) void
prefetch_block(const kv_side *s, int64_t blk, const pf_span *p) {
    const char *base = (const char *)s->data + (size_t)blk * p->bytes;
    for (size_t l = p->l0; l < p->l1; l++) _mm_prefetch(base + 64 * l, _MM_HINT_T0);
    for (size_t l = p->s0; l < p->s1; l++) {
        _mm_prefetch((const char *)(s->scale + blk * p->n) + 64 * l, _MM_HINT_T0);
        if (s->zero) _mm_prefetch((const char *)(s->zero + blk * p->n) + 64 * l, _MM_HINT_T0);
    }
}

#if PD_NATIVE == 1
#include "paged_decode_avx512.h"
#else
#include "paged_decode_avx2.h"
#endif
#endif

/* ---- entry point --------------------------------------------------------------------- */

/* One task: sequence b over its blocks [j0, j1), all heads; `part` indexes its result. */
typedef struct {
    int b, j0, j1, part;
} task;

/* Parts p0 .. p0 + np of one sequence ([Hq * D] acc, [Hq] max, [Hq] sum each) merged by
 * their maxima (log-sum-exp) into out[Hq * D]. One part is exactly acc / sum. */
static void merge_parts(const float *parts, int p0, int np, int Hq, int D, float *out) {
    size_t stride = (size_t)Hq * (D + 2);
    for (int i = 0; i < Hq; i++) {
        float mx = -INFINITY, s = 0.0f, w[np];
        for (int p = 0; p < np; p++) {
            float m = parts[(p0 + p) * stride + (size_t)Hq * D + i];
            mx = m > mx ? m : mx;
        }
        for (int p = 0; p < np; p++) {
            const float *part = parts + (p0 + p) * stride + (size_t)Hq * D;
            w[p] = np == 1 ? 1.0f : exp_nonpos(part[i] - mx);
            s += w[p] * part[Hq + i];
        }
        for (int d = 0; d < D; d++) {
            float a = 0.0f;
            for (int p = 0; p < np; p++) a += w[p] * parts[(p0 + p) * stride + (size_t)i * D + d];
            out[i * D + d] = a / s;
        }
    }
}

/* Parts of a sequence of nblocks: one while the batch alone keeps every thread busy; a
 * small batch's long sequences are split so that there are ~8 tasks per thread
 * (flash-decoding), in parts of at least ~256 tokens (shorter ones cost more than they save). */
static int num_parts_of(int64_t nblocks, int64_t all_blocks, int bs) {
    int64_t tasks = 8 * (int64_t)omp_get_max_threads();
    int64_t per = (all_blocks + tasks - 1) / tasks, min_blocks = (256 + bs - 1) / bs;
    per = per < min_blocks ? min_blocks : per;
    return (int)((nblocks + per - 1) / per);
}

#if PD_NATIVE
static void paged_decode_native(const float *q, float *out, int B, int Hq, int H, int D, int bs,
                                const int64_t *block_tables, int max_blocks,
                                const int64_t *seq_lens, const kv_side *k, const kv_side *v,
                                const void *own_k, const void *own_v, int own_kind,
                                const int64_t *own_slots, float sm_scale) {
    int G = Hq / H, num_tasks = 0;
    int64_t all_blocks = 0;
    for (int b = 0; b < B; b++) all_blocks += (seq_lens[b] + bs - 1) / bs;
    for (int b = 0; b < B; b++) num_tasks += num_parts_of((seq_lens[b] + bs - 1) / bs, all_blocks, bs);
    task *tasks = malloc(sizeof(task) * num_tasks);
    int *first = malloc(sizeof(int) * (B + 1)); /* sequence b's parts: first[b] .. first[b+1] */
    for (int b = 0, i = 0; b < B; b++) {
        int nblocks = (int)((seq_lens[b] + bs - 1) / bs);
        int np = num_parts_of(nblocks, all_blocks, bs), per = (nblocks + np - 1) / np;
        first[b] = i;
        for (int j0 = 0; j0 < nblocks; j0 += per, i++)
            tasks[i] = (task){b, j0, j0 + per < nblocks ? j0 + per : nblocks, i};
    }
    first[B] = num_tasks;
    size_t stride = (size_t)Hq * (D + 2);
    float *parts = malloc(sizeof(float) * stride * num_tasks);
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < num_tasks; i++) {
        task t = tasks[i];
        int64_t L = seq_lens[t.b];
        int own = own_slots ? (int)((L - 1) / bs) : -1;
        int64_t slot = own_slots ? own_slots[t.b] : 0;
        const int64_t *table = block_tables + (size_t)t.b * max_blocks;
        const float *qb = q + (size_t)t.b * Hq * D;
        float *acc = parts + stride * t.part, *m = acc + (size_t)Hq * D, *sum = m + Hq;
        float *scores = malloc(sizeof(float) * Hq * (size_t)(t.j1 - t.j0) * bs);
        if (D == 64) /* literal head dims get unrolled code */
            attend_part(qb, L, table, own, slot, H, G, 64, bs, k, v, own_k, own_v, own_kind,
                        sm_scale, t.j0, t.j1, scores, m, sum, acc);
        else if (D == 128)
            attend_part(qb, L, table, own, slot, H, G, 128, bs, k, v, own_k, own_v, own_kind,
                        sm_scale, t.j0, t.j1, scores, m, sum, acc);
        else
            attend_part(qb, L, table, own, slot, H, G, D, bs, k, v, own_k, own_v, own_kind,
                        sm_scale, t.j0, t.j1, scores, m, sum, acc);
        free(scores);
    }
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++)
        merge_parts(parts, first[b], first[b + 1] - first[b], Hq, D, out + (size_t)b * Hq * D);
    free(parts);
    free(first);
    free(tasks);
}
#endif

/* paged_decode on the portable loop, whatever the CPU (tests compare the two). */
void paged_decode_portable(const float *q, float *out, int B, int Hq, int H, int D, int bs,
                           const int64_t *block_tables, int max_blocks, const int64_t *seq_lens,
                           const kv_side *k, const kv_side *v, const void *own_k,
                           const void *own_v, int own_kind, const int64_t *own_slots,
                           float sm_scale) {
    int G = Hq / H;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            int64_t L = seq_lens[b];
            int own = own_slots ? (int)((L - 1) / bs) : -1;
            int64_t slot = own_slots ? own_slots[b] : 0;
            const int64_t *table = block_tables + (size_t)b * max_blocks;
            size_t head = ((size_t)b * Hq + (size_t)h * G) * D;
            float *scores = malloc(sizeof(float) * G * L);
            if (D == 64) /* literal head dims get unrolled code; any other works too */
                attend(q + head, out + head, L, table, own, slot, h, G, H, 64, bs, k, v, own_k,
                       own_v, own_kind, sm_scale, scores);
            else if (D == 128)
                attend(q + head, out + head, L, table, own, slot, h, G, H, 128, bs, k, v, own_k,
                       own_v, own_kind, sm_scale, scores);
            else
                attend(q + head, out + head, L, table, own, slot, h, G, H, D, bs, k, v, own_k,
                       own_v, own_kind, sm_scale, scores);
            free(scores);
        }
    }
}

/* q, out: [B, Hq, D] float32. block_tables [B, max_blocks], seq_lens [B], own_slots [B]
 * (staging slot per sequence; NULL when the cache is not staged). */
void paged_decode(const float *q, float *out, int B, int Hq, int H, int D, int bs,
                  const int64_t *block_tables, int max_blocks, const int64_t *seq_lens,
                  const kv_side *k, const kv_side *v, const void *own_k, const void *own_v,
                  int own_kind, const int64_t *own_slots, float sm_scale) {
#if PD_NATIVE
    if (D % PD_LANES == 0 && D <= MAX_D) {
        paged_decode_native(q, out, B, Hq, H, D, bs, block_tables, max_blocks, seq_lens, k, v,
                            own_k, own_v, own_kind, own_slots, sm_scale);
        return;
    }
#endif
    paged_decode_portable(q, out, B, Hq, H, D, bs, block_tables, max_blocks, seq_lens, k, v,
                          own_k, own_v, own_kind, own_slots, sm_scale);
}

/* Whether paged_decode takes a tiled SIMD path (AVX-512 or AVX2) for head dim D. */
int paged_decode_native_for(int D) { return PD_NATIVE && D % PD_LANES == 0 && D <= 256; }
