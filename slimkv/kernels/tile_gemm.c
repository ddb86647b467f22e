/* Many-row matmul over qgemm.c's repacked group-32 weights with Intel AMX bf16 tiles:
 * y [M, N] = a [M, K] . W^T, a bfloat16, W dequantized on the fly, the products summed in
 * float32 and the sum rounded once to bfloat16 (to nearest even), as a bf16 GEMM over the
 * dequantized weights does, but without writing W out in bf16 first.
 *
 * For each pair of 16-row weight tiles (32 outputs), a thread dequantizes the pair's whole
 * K panel (d * q + m, two roundings, to bfloat16: qdequant's values bit for bit) straight
 * into AMX's B-tile layout (16 rows of K pairs: lane n holds elements 2p, 2p+1 of output
 * n), then sweeps all activation rows 32 at a time with 2 x 2 float32 accumulator tiles.
 * A group of 32 along K is one tile step. The result is stored as bfloat16, or rounded to
 * bfloat16 and added to a float32 y (the residual). tile_gemm_ready() says at run time
 * whether the CPU (and the kernel: arch_prctl permission) runs AMX; everything here is
 * compiled only where the compiler targets AVX512-BF16, with AMX enabled per function, so
 * the file builds and the library loads on any CPU (callers then take their torch path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 11
#define TG_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TG_AMX 0
#endif

static inline int code_bytes(int bits) { return 16 * 32 * bits / 8; }
static inline int group_bytes(int bits) { return code_bytes(bits) + 64; }

#if TG_AMX
#define AMX __attribute__((target("amx-tile,amx-bf16")))
enum { RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };

int tile_gemm_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned a, b, c, d;
        /* CPUID.(7,0).EDX: bit 22 AMX-BF16, bit 24 AMX-TILE; then the kernel's permission
         * for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
        ready = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1) &&
                syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return ready;
}

/* A pair row of a B tile: lane n = (v0[n], v1[n]) in bfloat16. */
static inline __m512i pair_row(__m512 v0, __m512 v1) {
    const __m512i idx = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004,
                                          0x150005, 0x160006, 0x170007, 0x180008, 0x190009,
                                          0x1A000A, 0x1B000B, 0x1C000C, 0x1D000D, 0x1E000E,
                                          0x1F000F);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
}

static inline __m512 code_value(__m512i x, int byte, __m512 d, __m512 m) {
    __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(x, 8 * byte),
                                                   _mm512_set1_epi32(0xFF)));
    return _mm512_add_round_ps(_mm512_mul_round_ps(q, d, RN), m, RN);
}

/* 4 code bytes per lane (elements e..e+3 of output lane) -> pair rows p, p + 1 of B. */
static inline void quad_rows(__m512i x, __m512 d, __m512 m, uint16_t *b, int p) {
    _mm512_store_si512(b + p * 32, pair_row(code_value(x, 0, d, m), code_value(x, 1, d, m)));
    _mm512_store_si512(b + (p + 1) * 32,
                       pair_row(code_value(x, 2, d, m), code_value(x, 3, d, m)));
}

/* Tile t's group g as a B tile (16 pair rows x 16 outputs x 2, 1 KB) at b. */
static void dequant_tile(const uint8_t *w, int bits, int nb, int t, int g, uint16_t *b) {
    const uint8_t *s = w + ((size_t)t * nb + g) * group_bytes(bits);
    const int CB = code_bytes(bits);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + CB)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + CB + 32)));
    const __m512i low = _mm512_set1_epi8(15);
    for (int c = 0; c < CB / 64; c++) {
        __m512i raw = _mm512_loadu_si512(s + 64 * c);
        if (bits == 8) {
            quad_rows(raw, d, m, b, 2 * c); /* elements 4c..4c+3 */
        } else { /* low nibbles: elements 4c.., high nibbles: 16 + 4c.. */
            quad_rows(_mm512_and_si512(raw, low), d, m, b, 2 * c);
            quad_rows(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), d, m, b, 8 + 2 * c);
        }
    }
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Rows [r, r + 16) x outputs [n, n + 16) of the float32 sums c (row stride 32) into y. */
static inline void store_block(const float *c, float *y32, uint16_t *y16, int rows, int N,
                               int n) {
    if (n >= N) return;
    __mmask16 k = N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n)) - 1);
    for (int i = 0; i < rows; i++) {
        __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + 32 * i));
        if (y32) { /* y += the bfloat16-rounded sum, widened exactly */
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            float *o = y32 + (size_t)i * N + n;
            _mm512_mask_storeu_ps(o, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, o), v));
        } else {
            _mm256_mask_storeu_epi16(y16 + (size_t)i * N + n, k, h);
        }
    }
}

AMX static void tile_sweep(const uint16_t *a, const uint16_t *tail, int M, int K,
                           const uint16_t *panel, int N, int n0, float *y32, uint16_t *y16) {
    int nb = K / 32;
    float c[32 * 32] __attribute__((aligned(64)));
    for (int r = 0; r < M; r += 32) {
        const uint16_t *ar = r + 32 <= M ? a + (size_t)r * K : tail;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        /* Tiles are not renamed: each next load is issued as soon as the products that
         * read the tile are issued, so loads overlap the remaining products. */
        const uint16_t *a1 = ar + (size_t)16 * K;
        _tile_loadd(4, ar, 2 * K);
        _tile_loadd(6, panel, 64);
        _tile_loadd(5, a1, 2 * K);
        _tile_loadd(7, panel + 512, 64);
        for (int g = 0; g < nb; g++) {
            const uint16_t *b = panel + (size_t)(g + 1) * 1024;
            int more = g + 1 < nb;
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (more) _tile_loadd(6, b, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (more) _tile_loadd(4, ar + (g + 1) * 32, 2 * K);
            _tile_dpbf16ps(3, 5, 7);
            if (more) {
                _tile_loadd(5, a1 + (g + 1) * 32, 2 * K);
                _tile_loadd(7, b + 512, 64);
            }
        }
        _tile_stored(0, c, 128);
        _tile_stored(1, c + 16, 128);
        _tile_stored(2, c + 512, 128);
        _tile_stored(3, c + 528, 128);
        int rows = M - r < 32 ? M - r : 32;
        size_t at = (size_t)r * N;
        for (int h = 0; h < 2 && h * 16 < rows; h++) {
            int hr = rows - h * 16 < 16 ? rows - h * 16 : 16;
            size_t o = at + (size_t)h * 16 * N;
            for (int j = 0; j < 2; j++)
                store_block(c + h * 512 + j * 16, y32 ? y32 + o : NULL, y16 ? y16 + o : NULL,
                            hr, N, n0 + 16 * j);
        }
    }
}

AMX static void tile_worker(const uint16_t *a, const uint16_t *tail, int M, int K,
                            const uint8_t *w, int bits, int N, int p0, int p1, float *y32,
                            uint16_t *y16) {
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
    int nb = K / 32, ntiles = (N + 15) / 16;
    uint16_t *panel = aligned_alloc(64, (size_t)nb * 2048);
    for (int p = p0; p < p1; p++) {
        for (int g = 0; g < nb; g++)
            for (int j = 0; j < 2; j++) {
                uint16_t *b = panel + (size_t)g * 1024 + j * 512;
                if (2 * p + j < ntiles)
                    dequant_tile(w, bits, nb, 2 * p + j, g, b);
                else
                    memset(b, 0, 1024);
            }
        tile_sweep(a, tail, M, K, panel, N, 32 * p, y32, y16);
    }
    free(panel);
    _tile_release();
}

/* y = a [M, K] bfloat16 . W^T, W [N, K] in qgemm.c's repacked layout (bits 4 or 8): into
 * y16 [M, N] bfloat16, or (y16 NULL) added, rounded to bfloat16, to y32 [M, N] float32.
 * Needs tile_gemm_ready(); K a multiple of 32. */
void tile_gemm(const uint16_t *a, int M, int K, const uint8_t *w, int bits, int N,
               uint16_t *y16, float *y32) {
    uint16_t *tail = NULL;
    if (M % 32) { /* the last rows, zero-padded to a block of 32 */
        tail = aligned_alloc(64, (size_t)32 * K * 2);
        memset(tail, 0, (size_t)32 * K * 2);
        memcpy(tail, a + (size_t)(M / 32 * 32) * K, (size_t)(M % 32) * K * 2);
    }
    int pairs = (N + 31) / 32;
#pragma omp parallel
    {
#ifdef _OPENMP
        int nth = omp_get_num_threads(), me = omp_get_thread_num();
#else
        int nth = 1, me = 0;
#endif
        int p0 = pairs * me / nth, p1 = pairs * (me + 1) / nth;
        if (p0 < p1) tile_worker(a, tail, M, K, w, bits, N, p0, p1, y16 ? NULL : y32, y16);
    }
    free(tail);
}
#else
int tile_gemm_ready(void) { return 0; }

void tile_gemm(const uint16_t *a, int M, int K, const uint8_t *w, int bits, int N,
               uint16_t *y16, float *y32) {
    (void)a, (void)M, (void)K, (void)w, (void)bits, (void)N, (void)y16, (void)y32;
    abort(); /* callers check tile_gemm_ready() first */
}
#endif
