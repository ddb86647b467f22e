/* Weight-only quantized matmul on the CPU: y[M, N] (+)= x[M, K] . W[N, K]^T.
 *
 * W is stored in groups of 32 along K, as llama.cpp stores Q4_1 / Q8_0: w = d * q + m with
 * an unsigned code q (4 bits, two per byte in ggml's order: byte i of a group holds
 * elements i and i + 16; or 8 bits) and float16 d, m per group. The activations are
 * quantized on entry to int8 per group of 32 as well (one float scale a_d per group, and
 * a_s = a_d * sum(qa) for the min term, llama.cpp's Q8_1), so a group contributes
 *     d * a_d * (q . qa) + m * a_s
 * and q . qa is computed with VNNI (vpdpbusd: unsigned weight bytes x signed activation
 * bytes) over W repacked at load time in tiles of 16 output rows (layout below), 16
 * outputs per instruction. The input can be normalised (RMSNorm) or be [gate | up] to
 * SiLU-multiply on the way in, and the result can be added to y (the residual): that is
 * what a decoder layer needs around each matmul, without a torch op in between.
 * Built by slimkv/kernels/build.py; without AVX512-VNNI a portable loop computes the same.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__) && defined(__AVX512VL__)
#define QG_NATIVE 1
#else
#define QG_NATIVE 0
#endif
#if !QG_NATIVE && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1 /* qgemm_avx2.h: the same sums with vpmaddubsw / vpmaddwd */
#else
#define QG_AVX2 0
#endif

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__GLIBC__)
/* expf 16 lanes at a time from glibc's libmvec (which -lm links as needed), as
 * -ffast-math would declare it, without fast-math's finite-math assumptions */
#pragma omp declare simd notinbranch simdlen(16)
float expf(float);
#elif defined(__x86_64__) && defined(__AVX2__) && defined(__GLIBC__)
#pragma omp declare simd notinbranch simdlen(8) /* libmvec's AVX2 expf, 8 lanes */
float expf(float);
#endif

enum { IN_PLAIN = 0, IN_RMSNORM = 1, IN_SILU_MUL = 2, IN_PRECISE = 4 }; /* 4: OR'ed */
#ifndef QG_MT
#define QG_MT 4 /* activation rows per weight pass */
#endif
#ifndef QG_WIDE
#define QG_WIDE 2 /* tiles per pass where rows are blocked by 3 or more */
#endif
enum { MT = QG_MT };
#ifndef QG_AMX_ROWS
#define QG_AMX_ROWS 16 /* quantized rows from which the AMX int8 tiles take the dot products */
#endif
static int amx_rows = QG_AMX_ROWS;

/* Set the row count from which AMX takes the dot products (bitwise the same outputs; tests
 * and benchmarks compare both paths); returns the previous one. */
int qgemm_amx_rows(int rows) {
    int previous = amx_rows;
    amx_rows = rows;
    return previous;
}

/* 2: the AVX512-VNNI loops; 1: the AVX2 ones; 0: the portable loop. */
int qgemm_native(void) { return QG_NATIVE ? 2 : QG_AVX2; }

/* Row m of the input as the matmul sees it (input_row), then int8 per
 * group of 32: qa [K], ad [K/32], as [K/32]. IN_PRECISE: the rounding residual is quantized
 * too, as a second row (qa + K, ad + K/32, as + K/32), and the two rows' outputs are summed:
 * ~15-bit activations at the cost of a second dot product per weight load. */
/* Row x [K] (x [2K] = [gate | up] for IN_SILU_MUL) as the matmul sees it: normalised,
 * SiLU-multiplied or as it is, into tmp [K]. */
static void input_row(const float *x, int K, int mode, const float *norm_w, float eps,
                      float *tmp) {
    if (mode == IN_RMSNORM) {
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int k = 0; k < K; k++) ss += x[k] * x[k];
        float r = 1.0f / sqrtf(ss / (float)K + eps);
#pragma omp simd
        for (int k = 0; k < K; k++) tmp[k] = x[k] * r * norm_w[k];
    } else if (mode == IN_SILU_MUL) {
#pragma omp simd
        for (int k = 0; k < K; k++) tmp[k] = x[k] / (1.0f + expf(-x[k])) * x[K + k];
    } else {
        memmove(tmp, x, sizeof(float) * K);
    }
}

static void quantize_row(const float *x, int K, int mode, const float *norm_w, float eps,
                         float *tmp, int8_t *qa, float *ad, float *as, int32_t *qs) {
    int precise = mode & IN_PRECISE;
    input_row(x, K, mode & ~IN_PRECISE, norm_w, eps, tmp);
    for (int b = 0; b < K / 32; b++) {
        const float *v = tmp + b * 32;
        float amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < 32; i++) {
            int q = (int)__builtin_roundevenf(v[i] * inv);
            qa[b * 32 + i] = (int8_t)q;
            sum += q;
        }
        ad[b] = d;
        as[b] = d * (float)sum;
        qs[b] = sum;
    }
    if (!precise) return;
#pragma omp simd
    for (int k = 0; k < K; k++) tmp[k] -= ad[k / 32] * (float)qa[k];
    quantize_row(tmp, K, IN_PLAIN, NULL, 0.0f, tmp, qa + K, ad + K / 32, as + K / 32,
                 qs + K / 32);
}

/* The repacked layout (made once at load time, slimkv.kernels.qgemm.pack): output rows in
 * tiles of 16, N padded with zero rows to a multiple of 16. Tile t's group b is GB bytes at
 * ((size_t)t * nb + b) * GB: its codes as CB / 64 chunks of 64 bytes, chunk c holding for
 * each of the 16 rows 4 consecutive code bytes (row r at bytes 4r..4r+3), then d[16] and
 * m[16] float16. 8 bits: chunk c holds elements 4c..4c+3 (CB = 512); 4 bits: a row's group
 * bytes as they come (byte i: elements i and i + 16), so chunk c's low nibbles are elements
 * 4c..4c+3 and its high nibbles 16 + 4c..16 + 4c + 3 (CB = 256). One vpdpbusd of a chunk
 * against 4 activation bytes broadcast then gives 16 outputs' partial sums, no horizontal
 * sums. */
static inline int code_bytes(int bits) { return 16 * 32 * bits / 8; }
static inline int group_bytes(int bits) { return code_bytes(bits) + 64; }

#if QG_NATIVE
static inline __m512i bcast4(const int8_t *a) {
    int32_t v;
    memcpy(&v, a, 4);
    return _mm512_set1_epi32(v);
}

/* Tile (row r, outputs n..n+15) of y: stored, or added to what is there; masked past N. */
static inline __attribute__((always_inline)) void
store_tile(float *y, size_t r, int N, int n, __m512 v, int accumulate) {
    __mmask16 k = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
    float *out = y + r * N + n;
    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, out));
    _mm512_mask_storeu_ps(out, k, v);
}

/* Activation rows [r0, r0 + MR) x tiles [t0, t0 + NT): MR * NT accumulators of 16 outputs,
 * each chunk of weights loaded (and its nibbles split) once for all MR rows. */
static inline __attribute__((always_inline)) void
micro(const uint8_t *w, const int bits, int nb, int t0, const int NT, const int8_t *qa,
      const float *ad, const float *as, int K, size_t r0, const int MR, float *y, int N,
      int accumulate) {
    const int CB = code_bytes(bits), GB = group_bytes(bits);
    const size_t tstride = (size_t)nb * GB;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512 facc[MR][NT];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NT; j++) facc[i][j] = _mm512_setzero_ps();
    const uint8_t *g0 = w + (size_t)t0 * tstride;
    for (int b = 0; b < nb; b++) {
        __m512i iacc[MR][NT];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NT; j++) iacc[i][j] = _mm512_setzero_si512();
        const uint8_t *g = g0 + (size_t)b * GB;
        if (bits == 4) {
            for (int c = 0; c < 4; c++) {
                __m512i wl[NT], wh[NT];
                for (int j = 0; j < NT; j++) {
                    __m512i raw = _mm512_loadu_si512(g + j * tstride + 64 * c);
                    wl[j] = _mm512_and_si512(raw, lo4);
                    wh[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
                }
                for (int i = 0; i < MR; i++) {
                    const int8_t *a = qa + (r0 + i) * K + b * 32 + 4 * c;
                    __m512i al = bcast4(a), ah = bcast4(a + 16);
                    for (int j = 0; j < NT; j++) {
                        iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wl[j], al);
                        iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wh[j], ah);
                    }
                }
            }
        } else {
            for (int c = 0; c < 8; c++) {
                __m512i wv[NT];
                for (int j = 0; j < NT; j++) wv[j] = _mm512_loadu_si512(g + j * tstride + 64 * c);
                for (int i = 0; i < MR; i++) {
                    __m512i a = bcast4(qa + (r0 + i) * K + b * 32 + 4 * c);
                    for (int j = 0; j < NT; j++)
                        iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wv[j], a);
                }
            }
        }
        for (int j = 0; j < NT; j++) {
            const uint8_t *s = g + j * tstride + CB;
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
            __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32)));
            for (int i = 0; i < MR; i++) {
                size_t at = (r0 + i) * nb + b;
                __m512 sc = _mm512_mul_ps(dv, _mm512_set1_ps(ad[at]));
                facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][j]), sc, facc[i][j]);
                facc[i][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(as[at]), facc[i][j]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NT; j++) store_tile(y, r0 + i, N, (t0 + j) * 16, facc[i][j], accumulate);
}

#include "qgemm_amx.h"

#define MICRO(NT)                                                                           \
    switch (mr) {                                                                           \
    case 1: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 1, y, N, acc); break;               \
    case 2: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 2, y, N, acc); break;               \
    case 3: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 3, y, N, acc); break;               \
    case 4: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 4, y, N, acc); break;               \
    case 5: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 5 <= MT ? 5 : 1, y, N, acc); break; \
    case 6: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 6 <= MT ? 6 : 1, y, N, acc); break; \
    case 7: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 7 <= MT ? 7 : 1, y, N, acc); break; \
    default: micro(w, bits, nb, t, NT, qa, ad, as, K, r, 8 <= MT ? 8 : 1, y, N, acc); break; \
    }

/* Tiles [t0, t1) for all R rows: blocks of up to 4 tiles (2 where rows are blocked by 3-4)
 * stay in L1 across the row blocks. */
static void tiles_native(const uint8_t *w, int bits, int K, int t0, int t1, const int8_t *qa,
                         const float *ad, const float *as, int R, float *y, int N, int acc) {
    int nb = K / 32, wide = R <= 2 ? 4 : QG_WIDE;
    for (int t = t0; t < t1;) {
        int nt = t1 - t >= wide ? wide : 1;
        for (int r = 0; r < R; r += MT) {
            int mr = R - r < MT ? R - r : MT;
            if (nt == 4) {
                MICRO(4)
            } else if (nt == 3) {
                MICRO(3)
            } else if (nt == 2) {
                MICRO(2)
            } else {
                MICRO(1)
            }
        }
        t += nt;
    }
}
#endif

#if QG_AVX2
#include "qgemm_avx2.h"
#endif

/* Code k (0..31) of row r in a group's code bytes, in the layout above. */
static inline int code_at(const uint8_t *g, int bits, int r, int k) {
    if (bits == 8) return g[(k / 4) * 64 + r * 4 + k % 4];
    int kk = k % 16, byte = g[(kk / 4) * 64 + r * 4 + kk % 4];
    return k < 16 ? byte & 15 : byte >> 4;
}

static inline float scale_at(const uint8_t *g, int bits, int which, int r) {
    _Float16 v;
    memcpy(&v, g + code_bytes(bits) + 32 * which + 2 * r, 2);
    return (float)v;
}

#if !QG_NATIVE && !QG_AVX2
/* Tiles [t0, t1) for all R rows, one output at a time: the same values, any CPU. */
static void tiles_portable(const uint8_t *w, int bits, int K, int t0, int t1, const int8_t *qa,
                           const float *ad, const float *as, int R, float *y, int N, int acc) {
    int nb = K / 32, GB = group_bytes(bits);
    for (int n = t0 * 16; n < t1 * 16 && n < N; n++)
        for (int r = 0; r < R; r++) {
            float t = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *g = w + ((size_t)(n / 16) * nb + b) * GB;
                const int8_t *a = qa + (size_t)r * K + b * 32;
                int dot = 0;
                for (int k = 0; k < 32; k++) dot += code_at(g, bits, n % 16, k) * a[k];
                t += (float)dot * (scale_at(g, bits, 0, n % 16) * ad[(size_t)r * nb + b]);
                t += scale_at(g, bits, 1, n % 16) * as[(size_t)r * nb + b];
            }
            float *out = y + (size_t)r * N + n;
            *out = acc ? *out + t : t;
        }
}
#endif

/* y [M, N] float32 (+)= f(x) . W^T; x [M, x_stride] float32 (x_stride = 2K for
 * IN_SILU_MUL, whose input is [gate | up]); W [N, K] in the repacked layout above. K must
 * be a multiple of 32. */
void qgemm(const float *x, int M, int K, int x_stride, int mode, const float *norm_w, float eps,
           const uint8_t *w, int bits, int N, float *y, int accumulate) {
    int nb = K / 32, rep = mode & IN_PRECISE ? 2 : 1;
    int R = M * rep; /* R quantized rows */
    /* rows padded with zeros to a multiple of 16 (whole AMX tiles; never stored) */
    size_t pad_rows = (size_t)(R + 15) / 16 * 16;
    int8_t *qa = aligned_alloc(64, (pad_rows * K + 63) / 64 * 64);
    memset(qa + (size_t)R * K, 0, (pad_rows - R) * K);
    float *ad = malloc(sizeof(float) * (size_t)R * nb * 2), *as = ad + (size_t)R * nb;
    int32_t *qs = malloc(sizeof(int32_t) * (size_t)R * nb); /* each group's sum of codes */
    float *yt = rep == 1 ? y : malloc(sizeof(float) * (size_t)R * N);
    int ntiles = (N + 15) / 16, add = rep == 1 && accumulate;
#pragma omp parallel if (ntiles > 1)
    {
        float *tmp = malloc(sizeof(float) * K);
#pragma omp for schedule(static)
        for (int r = 0; r < M; r++)
            quantize_row(x + (size_t)r * x_stride, K, mode, norm_w, eps, tmp, qa + (size_t)r * rep * K, ad + (size_t)r * rep * nb,
                         as + (size_t)r * rep * nb, qs + (size_t)r * rep * nb);
        free(tmp);
        /* An even split of the tiles in pairs (4-tile blocks then fall on both sides). */
#ifdef _OPENMP
        int nth = omp_get_num_threads(), me = omp_get_thread_num();
#else
        int nth = 1, me = 0;
#endif
        int pairs = (ntiles + 1) / 2, t0 = pairs * me / nth * 2, t1 = pairs * (me + 1) / nth * 2;
        t1 = t1 < ntiles ? t1 : ntiles;
        if (t0 < t1) {
#if QG_NATIVE
#if QG_AMX
            if (R >= amx_rows && qg_amx_ready())
                tiles_amx(w, bits, K, t0, t1, qa, ad, as, R, yt, N, add);
            else
#endif
                tiles_native(w, bits, K, t0, t1, qa, ad, as, R, yt, N, add);
#elif QG_AVX2
            tiles_avx2(w, bits, K, t0, t1, qa, ad, as, qs, R, yt, N, add);
#else
            tiles_portable(w, bits, K, t0, t1, qa, ad, as, R, yt, N, add);
#endif
        }
    }
    if (rep == 2) /* a row plus its residual row */
        for (int r = 0; r < M; r++) {
            float *o = y + (size_t)r * N;
            const float *a = yt + (size_t)r * 2 * N, *b = a + N;
#pragma omp simd
            for (int n = 0; n < N; n++) o[n] = (accumulate ? o[n] : 0.0f) + a[n] + b[n];
        }
    if (yt != y) free(yt);
    free(qa);
    free(ad);
    free(qs);
}

static inline float bf16_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline void store_row(const float *v, void *out, size_t at, int out_bf16) {
    if (!out_bf16) {
        memcpy((float *)out + at, v, sizeof(float) * 32);
        return;
    }
    uint16_t *o = (uint16_t *)out + at;
#if defined(__AVX512BF16__)
    /* the same round to nearest even in one instruction, except that it flushes float32
     * denormals (|v| < 1.2e-38) to zero: none occur in weights (d * q + m of float16 d, m);
     * in prep_rows' activation rows one would only drop a term below 1.2e-38 from a GEMM sum */
    _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16),
                                                         _mm512_loadu_ps(v)));
    return;
#endif
#pragma omp simd
    for (int j = 0; j < 32; j++) o[j] = float_bf16(v[j]);
}

/* W [N, K] (repacked layout) as float32 (out_bf16 = 0) or bfloat16 (1, round to nearest
 * even): for matmuls with many activation rows, where a float GEMM beats the dot products.
 * A tile's group at a time: its 16 rows' code bytes gathered back into the original order. */
#if QG_NATIVE && defined(__AVX512BF16__)
enum { RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };

/* 16 codes x (4 codes of rows r0..r0+3: row r0 + l / 4 in lane l, its elements e..e+3)
 * as d * q + m (two roundings, never fused) in bfloat16, stored at out + row * K + e. */
static inline __attribute__((always_inline)) void
dequant_quad(__m128i x, __m512 d, __m512 m, int r0, uint16_t *out, size_t K, int e, int nrows) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(r0), _mm512_srli_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2));
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
    __m512 v = _mm512_add_round_ps(_mm512_mul_round_ps(q, _mm512_permutexvar_ps(idx, d), RN),
                                   _mm512_permutexvar_ps(idx, m), RN);
    uint64_t rows[4];
    _mm256_storeu_si256((__m256i *)rows, (__m256i)_mm512_cvtneps_pbh(v));
    for (int i = 0; i < 4 && r0 + i < nrows; i++) memcpy(out + (r0 + i) * K + e, &rows[i], 8);
}

/* qdequant to bfloat16, a tile's group at a time straight from the repacked chunks: each
 * 16-byte quarter of a chunk is 4 rows x 4 codes, written as 4 pieces of 8 bytes. */
static void qdequant_bf16(const uint8_t *w, int bits, int N, int K, uint16_t *out) {
    int nb = K / 32, GB = group_bytes(bits), CB = code_bytes(bits);
    const __m128i low = _mm_set1_epi8(15);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < (N + 15) / 16; t++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = w + ((size_t)t * nb + b) * GB;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + CB)));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + CB + 32)));
            uint16_t *o = out + (size_t)t * 16 * K + b * 32;
            int nrows = N - t * 16 < 16 ? N - t * 16 : 16;
            for (int c = 0; c < CB / 64; c++)
                for (int r0 = 0; r0 < 16; r0 += 4) {
                    __m128i x = _mm_loadu_si128((const __m128i *)(g + c * 64 + 4 * r0));
                    if (bits == 8) {
                        dequant_quad(x, d, m, r0, o, K, 4 * c, nrows);
                    } else { /* low nibbles: elements 4c.., high nibbles: 16 + 4c.. */
                        dequant_quad(_mm_and_si128(x, low), d, m, r0, o, K, 4 * c, nrows);
                        dequant_quad(_mm_and_si128(_mm_srli_epi16(x, 4), low), d, m, r0, o, K,
                                     16 + 4 * c, nrows);
                    }
                }
        }
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* qdequant to float32, a tile's group at a time: the 16 rows' code bytes gathered back into
 * the original order, each row's 32 codes widened 8 at a time. d * q is exact in float32
 * (11-bit d times an 8-bit code), so + m rounds once, as the reference's two steps do. */
static void qdequant_f32(const uint8_t *w, int bits, int N, int K, float *out) {
    int nb = K / 32, GB = group_bytes(bits), CB = code_bytes(bits), chunks = CB / 64;
    const __m128i low = _mm_set1_epi8(15);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < (N + 15) / 16; t++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = w + ((size_t)t * nb + b) * GB;
            uint32_t rows[16][8];
            float d[16], m[16];
            for (int c = 0; c < chunks; c++)
                for (int r = 0; r < 16; r++) memcpy(&rows[r][c], g + c * 64 + 4 * r, 4);
            for (int h = 0; h < 2; h++) {
                _mm256_storeu_ps(d + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + CB + 16 * h))));
                _mm256_storeu_ps(m + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + CB + 32 + 16 * h))));
            }
            for (int r = 0; r < 16 && t * 16 + r < N; r++) {
                __m128i x = _mm_loadu_si128((const __m128i *)rows[r]), codes[2];
                codes[0] = bits == 8 ? x : _mm_and_si128(x, low);
                codes[1] = bits == 8 ? _mm_loadu_si128((const __m128i *)rows[r] + 1)
                                     : _mm_and_si128(_mm_srli_epi16(x, 4), low);
                __m256 dv = _mm256_set1_ps(d[r]), mv = _mm256_set1_ps(m[r]);
                float *o = out + (size_t)(t * 16 + r) * K + b * 32;
                for (int j = 0; j < 4; j++) {
                    __m128i c8 = j % 2 ? _mm_srli_si128(codes[j / 2], 8) : codes[j / 2];
                    __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c8));
                    _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_mul_ps(dv, q), mv));
                }
            }
        }
}
#endif

void qdequant(const uint8_t *w, int bits, int N, int K, void *out, int out_bf16) {
    int nb = K / 32, GB = group_bytes(bits), chunks = code_bytes(bits) / 64;
#if QG_NATIVE && defined(__AVX512BF16__)
    if (out_bf16) {
        qdequant_bf16(w, bits, N, K, out);
        return;
    }
#endif
#if defined(__AVX2__) && defined(__F16C__)
    if (!out_bf16) {
        qdequant_f32(w, bits, N, K, out);
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int t = 0; t < (N + 15) / 16; t++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = w + ((size_t)t * nb + b) * GB;
            uint32_t rows[16][8]; /* each row's group bytes in the original order */
            for (int c = 0; c < chunks; c++)
                for (int r = 0; r < 16; r++) memcpy(&rows[r][c], g + c * 64 + 4 * r, 4);
            for (int r = 0; r < 16 && t * 16 + r < N; r++) {
                const uint8_t *raw = (const uint8_t *)rows[r];
                float d = scale_at(g, bits, 0, r), m = scale_at(g, bits, 1, r), v[32];
#pragma omp simd
                for (int j = 0; j < 32; j++) {
                    int q = bits == 8 ? raw[j] : j < 16 ? raw[j] & 15 : raw[j - 16] >> 4;
                    float dq = d * (float)q; /* two roundings, as the reference has */
                    v[j] = dq + m;
                }
                store_row(v, out, (size_t)(t * 16 + r) * K + b * 32, out_bf16);
            }
        }
}

/* The GEMM path's input (many rows, slimkv.model.quant): rows of x [M, x_stride] (float32,
 * or bfloat16 with x_bf16) through input_row, stored to out [M, K] as float32 or bfloat16
 * (out_bf16, round to nearest even): one pass instead of a torch op per step. K must be a
 * multiple of 32. */
void prep_rows(const void *x, int x_bf16, int M, int K, int x_stride, int mode,
               const float *norm_w, float eps, void *out, int out_bf16) {
#pragma omp parallel if (M > 1)
    {
        float *wide = malloc(sizeof(float) * ((size_t)x_stride + K)), *tmp = wide + x_stride;
#pragma omp for schedule(static)
        for (int r = 0; r < M; r++) {
            const float *row = (const float *)x + (size_t)r * x_stride;
            if (x_bf16) {
                const uint16_t *h = (const uint16_t *)x + (size_t)r * x_stride;
#pragma omp simd
                for (int k = 0; k < x_stride; k++) wide[k] = bf16_float(h[k]);
                row = wide;
            }
            input_row(row, K, mode, norm_w, eps, tmp);
            for (int b = 0; b < K; b += 32) store_row(tmp + b, out, (size_t)r * K + b, out_bf16);
        }
        free(wide);
    }
}

/* out [n] float32 += y [n] bfloat16 (exact widening, one float32 add each): the GEMM
 * path's residual add, without torch's mixed-dtype iterator. */
void add_bf16(float *out, const uint16_t *y, size_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) out[i] += bf16_float(y[i]);
}

/* RoPE (rotate-half layout) in place on the first `heads` heads of each row of x
 * [T, stride] float32, with cos/sin [T, D] float32 of each row's position. */
void rope_inplace(float *x, int T, int stride, int heads, int D, const float *cos,
                  const float *sin) {
    int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
        for (int h = 0; h < heads; h++) {
            float *v = x + (size_t)t * stride + (size_t)h * D;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                float a = v[d], b = v[d + half];
                v[d] = a * c[d] - b * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}

/* rope_inplace on x [T, stride] bfloat16: each row's heads widened to float32, rotated,
 * rounded back to nearest even (what rope_inplace then a torch cast give). */
void rope_bf16(uint16_t *x, int T, int stride, int heads, int D, const float *cos,
               const float *sin) {
    int n = heads * D;
#pragma omp parallel if (T > 1)
    {
        float *row = malloc(sizeof(float) * n);
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            uint16_t *h = x + (size_t)t * stride;
#pragma omp simd
            for (int k = 0; k < n; k++) row[k] = bf16_float(h[k]);
            rope_inplace(row, 1, n, heads, D, cos + (size_t)t * D, sin + (size_t)t * D);
#pragma omp simd
            for (int k = 0; k < n; k++) h[k] = float_bf16(row[k]);
        }
        free(row);
    }
}
