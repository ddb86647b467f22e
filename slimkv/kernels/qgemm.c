/* Weight-only quantized matmul on the CPU: y[M, N] (+)= x[M, K] . W[N, K]^T.
 *
 * W is stored in groups of 32 along K, as llama.cpp stores Q4_1 / Q8_0: w = d * q + m with
 * an unsigned code q (4 bits, two per byte in ggml's order: byte i of a group holds
 * elements i and i + 16; or 8 bits) and float16 d, m per group. The activations are
 * quantized on entry to int8 per group of 32 as well (one float scale a_d per group, and
 * a_s = a_d * sum(qa) for the min term, llama.cpp's Q8_1), so a group contributes
 *     d * a_d * (q . qa) + m * a_s
 * and q . qa is one VNNI instruction (vpdpbusd: unsigned weight bytes x signed activation
 * bytes) per 64 values. The input can be normalised (RMSNorm) or be [gate | up] to
 * SiLU-multiply on the way in, and the result can be added to y (the residual): that is
 * what a decoder layer needs around each matmul, without a torch op in between.
 * Built by slimkv/kernels/build.py; without AVX512-VNNI a portable loop computes the same.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__) && defined(__AVX512VL__)
#define QG_NATIVE 1
#else
#define QG_NATIVE 0
#endif

enum { IN_PLAIN = 0, IN_RMSNORM = 1, IN_SILU_MUL = 2, IN_PRECISE = 4 }; /* 4: OR'ed flag */
enum { MT = 4 }; /* activation rows per weight pass */

int qgemm_native(void) { return QG_NATIVE; }

/* Row m of the input as the matmul sees it (normalised / SiLU-multiplied), then int8 per
 * group of 32: qa [K], ad [K/32], as [K/32]. IN_PRECISE: the rounding residual is quantized
 * too, as a second row (qa + K, ad + K/32, as + K/32), and the two rows' outputs are summed:
 * ~15-bit activations at the cost of a second dot product per weight load. */
static void quantize_row(const float *x, int K, int mode, const float *norm_w, float eps,
                         float *tmp, int8_t *qa, float *ad, float *as) {
    int precise = mode & IN_PRECISE;
    mode &= ~IN_PRECISE;
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
    }
    if (!precise) return;
#pragma omp simd
    for (int k = 0; k < K; k++) tmp[k] -= ad[k / 32] * (float)qa[k];
    quantize_row(tmp, K, IN_PLAIN, NULL, 0.0f, tmp, qa + K, ad + K / 32, as + K / 32);
}

#if QG_NATIVE
/* Two 4-bit groups (16 bytes each, contiguous) as 64 code bytes in element order. */
static inline __m512i unpack_q4x2(const uint8_t *p) {
    __m512i raw = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    __m512i dup = _mm512_shuffle_i64x2(raw, raw, _MM_SHUFFLE(1, 1, 0, 0));
    __m512i v = _mm512_mask_blend_epi64(0xCC, dup, _mm512_srli_epi16(dup, 4));
    return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

static inline __m256i unpack_q4(const uint8_t *p) {
    __m256i raw = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p));
    raw = _mm256_inserti128_si256(raw, _mm_srli_epi16(_mm_loadu_si128((const __m128i *)p), 4), 1);
    return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
}
#endif

/* The min term and the store of one output. */
static inline __attribute__((always_inline)) void
finish(float t, const _Float16 *wm, const float *as, int nb, float *out, int accumulate) {
#pragma omp simd reduction(+ : t)
    for (int b = 0; b < nb; b++) t += (float)wm[b] * as[b];
    *out = accumulate ? *out + t : t;
}

#if QG_NATIVE
/* Weight rows [n, n + NR) x activation rows [r0, r0 + MR): NR * MR independent float
 * accumulators (ILP), each pair of groups unpacked once for all MR rows. `adv` holds each
 * row's activation scales as 16-lane vectors, one per pair of groups (8 lanes each). */
static inline __attribute__((always_inline)) void
block(const uint8_t *wq, const _Float16 *wd, const _Float16 *wm, const int bits, int K, int n,
      const int NR, const int8_t *qa, const float *ad, const float *adv, const float *as,
      size_t r0, const int MR, float *y, int N, int accumulate) {
    int nb = K / 32, row_bytes = K * bits / 8;
    __m512 acc[NR][MR];
    float total[NR][MR];
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < MR; i++) acc[j][i] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        __m512i wv[NR];
        __m512 wsc[NR];
        for (int j = 0; j < NR; j++) {
            const uint8_t *w = wq + (size_t)(n + j) * row_bytes;
            const _Float16 *d = wd + (size_t)(n + j) * nb + b;
            wv[j] = bits == 4 ? unpack_q4x2(w + b * 16) : _mm512_loadu_si512(w + b * 32);
            wsc[j] = _mm512_insertf32x8(_mm512_set1_ps((float)d[0]), _mm256_set1_ps((float)d[1]), 1);
        }
        for (int i = 0; i < MR; i++) {
            __m512i a = _mm512_loadu_si512(qa + (r0 + i) * K + b * 32);
            __m512 asc = _mm512_loadu_ps(adv + ((r0 + i) * (nb / 2) + b / 2) * 16);
            for (int j = 0; j < NR; j++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], a);
                acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wsc[j], asc),
                                            acc[j][i]);
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < MR; i++) total[j][i] = _mm512_reduce_add_ps(acc[j][i]);
    if (b < nb) { /* an odd last group */
        for (int j = 0; j < NR; j++) {
            const uint8_t *w = wq + (size_t)(n + j) * row_bytes;
            __m256i wv = bits == 4 ? unpack_q4(w + b * 16)
                                   : _mm256_loadu_si256((const __m256i *)(w + b * 32));
            for (int i = 0; i < MR; i++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(qa + (r0 + i) * K + b * 32));
                __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, a);
                __m128i s = _mm_add_epi32(_mm256_castsi256_si128(dot),
                                          _mm256_extracti128_si256(dot, 1));
                s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
                s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
                total[j][i] += (float)_mm_cvtsi128_si32(s) * (float)wd[(size_t)(n + j) * nb + b] *
                               ad[(r0 + i) * nb + b];
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < MR; i++)
            finish(total[j][i], wm + (size_t)(n + j) * nb, as + (r0 + i) * nb, nb,
                   y + (r0 + i) * N + n + j, accumulate);
}

#define BLOCKS(BITS)                                                                       \
    for (; n + 4 <= n1; n += 4) switch (mt) {                                              \
        case 1: block(wq, wd, wm, BITS, K, n, 4, qa, ad, adv, as, r0, 1, y, N, acc); break;   \
        case 2: block(wq, wd, wm, BITS, K, n, 4, qa, ad, adv, as, r0, 2, y, N, acc); break;   \
        case 3: block(wq, wd, wm, BITS, K, n, 4, qa, ad, adv, as, r0, 3, y, N, acc); break;   \
        default: block(wq, wd, wm, BITS, K, n, 4, qa, ad, adv, as, r0, 4, y, N, acc); break;  \
        }                                                                                  \
    for (; n < n1; n++)                                                                    \
        for (int i = 0; i < mt; i++)                                                       \
            block(wq, wd, wm, BITS, K, n, 1, qa, ad, adv, as, r0 + i, 1, y, N, acc);
#endif

/* Output columns [n0, n1) for activation rows [r0, r0 + mt). */
static void tile(const uint8_t *wq, const _Float16 *wd, const _Float16 *wm, int bits, int K,
                 int n0, int n1, const int8_t *qa, const float *ad, const float *adv,
                 const float *as, size_t r0, int mt, float *y, int N, int acc) {
    int n = n0;
#if QG_NATIVE
    if (bits == 4) {
        BLOCKS(4)
    } else {
        BLOCKS(8)
    }
#else
    (void)adv;
    int nb = K / 32, gbytes = 32 * bits / 8;
    for (; n < n1; n++)
        for (size_t r = r0; r < r0 + mt; r++) {
            const uint8_t *w = wq + (size_t)n * nb * gbytes;
            float t = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *g = w + b * gbytes;
                const int8_t *a = qa + r * K + b * 32;
                int dot = 0;
                for (int j = 0; j < 32; j++) {
                    int q = bits == 8 ? g[j] : j < 16 ? g[j] & 15 : g[j - 16] >> 4;
                    dot += q * a[j];
                }
                t += (float)dot * (float)wd[(size_t)n * nb + b] * ad[r * nb + b];
            }
            finish(t, wm + (size_t)n * nb, as + r * nb, nb, y + r * N + n, acc);
        }
#endif
}

/* y [M, N] float32 (+)= f(x) . W^T; x [M, x_stride] float32 (x_stride = 2K for
 * IN_SILU_MUL, whose input is [gate | up]); W: wq [N, K * bits / 8], wd, wm [N, K / 32]
 * float16. K must be a multiple of 32. */
void qgemm(const float *x, int M, int K, int x_stride, int mode, const float *norm_w, float eps,
           const uint8_t *wq, const _Float16 *wd, const _Float16 *wm, int bits, int N, float *y,
           int accumulate) {
    int nb = K / 32, rep = mode & IN_PRECISE ? 2 : 1, R = M * rep; /* R quantized rows */
    int8_t *qa = aligned_alloc(64, ((size_t)R * K + 63) / 64 * 64);
    float *ad = malloc(sizeof(float) * (size_t)R * nb * 10), *as = ad + (size_t)R * nb;
    float *adv = as + (size_t)R * nb; /* [R, nb / 2, 16] */
    float *yt = rep == 1 ? y : malloc(sizeof(float) * (size_t)R * N);
#pragma omp parallel if (M > 1)
    {
        float *tmp = malloc(sizeof(float) * K);
#pragma omp for
        for (int r = 0; r < M; r++)
            quantize_row(x + (size_t)r * x_stride, K, mode, norm_w, eps, tmp,
                         qa + (size_t)r * rep * K, ad + (size_t)r * rep * nb,
                         as + (size_t)r * rep * nb);
#pragma omp for
        for (int r = 0; r < R; r++)
            for (int p = 0; p < nb / 2; p++)
                for (int l = 0; l < 16; l++)
                    adv[((size_t)r * (nb / 2) + p) * 16 + l] = ad[(size_t)r * nb + 2 * p + l / 8];
        free(tmp);
    }
    /* Column chunks small enough that both threads get work and a chunk's weights stay in
     * L2 across the row tiles. */
    int chunk = 16, nchunks = (N + chunk - 1) / chunk, add = rep == 1 && accumulate;
#pragma omp parallel for schedule(static)
    for (int c = 0; c < nchunks; c++) {
        int n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int m0 = 0; m0 < R; m0 += MT)
            tile(wq, wd, wm, bits, K, n0, n1, qa, ad, adv, as, m0, R - m0 < MT ? R - m0 : MT, yt,
                 N, add);
    }
    if (rep == 2) /* a row plus its residual row */
        for (size_t i = 0; i < (size_t)M * N; i++)
            y[i] = (accumulate ? y[i] : 0.0f) + yt[i / N * 2 * N + i % N] +
                   yt[(i / N * 2 + 1) * N + i % N];
    if (yt != y) free(yt);
    free(qa);
    free(ad);
}

/* W [N, K] as float32 (out_bf16 = 0) or bfloat16 (1, round to nearest even): for matmuls
 * with many activation rows, where a float GEMM beats the per-row dot products. */
void qdequant(const uint8_t *wq, const _Float16 *wd, const _Float16 *wm, int bits, int N, int K,
              void *out, int out_bf16) {
    int nb = K / 32, row_bytes = K * bits / 8, gbytes = 32 * bits / 8;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        for (int b = 0; b < nb; b++) {
            const uint8_t *g = wq + (size_t)n * row_bytes + b * gbytes;
            float d = (float)wd[(size_t)n * nb + b], m = (float)wm[(size_t)n * nb + b];
            float v[32];
#pragma omp simd
            for (int j = 0; j < 32; j++) {
                int q = bits == 8 ? g[j] : j < 16 ? g[j] & 15 : g[j - 16] >> 4;
                v[j] = d * (float)q + m;
            }
            size_t at = (size_t)n * K + b * 32;
            if (!out_bf16) {
                memcpy((float *)out + at, v, sizeof v);
                continue;
            }
            uint16_t *o = (uint16_t *)out + at;
#pragma omp simd
            for (int j = 0; j < 32; j++) {
                uint32_t u;
                memcpy(&u, &v[j], 4);
                o[j] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
            }
        }
    }
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
