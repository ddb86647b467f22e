/* qgemm.c's dot products on AMX int8 tiles, for 16 or more quantized activation rows: the
 * same exact int32 group sums (tdpbsud: signed activation bytes x unsigned weight codes) as
 * the vpdpbusd loop, then the same float32 scaling in the same order, so the outputs are
 * bitwise those of tiles_native. A group of 32 along K is one product: A = 16 activation
 * rows x 32 bytes, B = 8 rows of the repacked group's 4-byte lanes (8 bits: the chunks as
 * stored; 4 bits: the low nibbles of the 4 chunks, then the high ones), C = 16 x 16 int32,
 * stored and scaled per group. qg_amx_ready() checks CPUID and asks the kernel for the tile
 * state once; without AMX (or without GCC 11+) qgemm.c keeps its vpdpbusd loop. */
#if QG_NATIVE && defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && \
    !defined(__clang__) && __GNUC__ >= 11
#define QG_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

static int qg_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned a, b, c, d; /* CPUID.(7,0).EDX bit 24 AMX-TILE, bit 25 AMX-INT8 */
        ready = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
                syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    }
    return ready;
}

struct qg_tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* A B tile of one repacked group: 8 bits as stored; 4 bits unpacked into buf (the low
 * nibbles of the 4 chunks, then the high ones). */
static inline const uint8_t *b_tile(const uint8_t *g, int bits, uint8_t *buf) {
    if (bits == 8)
        return g;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        __m512i raw = _mm512_loadu_si512(g + 64 * c);
        _mm512_store_si512(buf + 64 * c, _mm512_and_si512(raw, lo4));
        _mm512_store_si512(buf + 256 + 64 * c, _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4));
    }
    return buf;
}

/* Tiles [t0, t1) x rows [0, R) (qa padded with zero rows to a multiple of 16). */
__attribute__((target("amx-tile,amx-int8"))) static void
tiles_amx(const uint8_t *w, int bits, int K, int t0, int t1, const int8_t *qa, const float *ad,
          const float *as, int R, float *y, int N, int acc) {
    struct qg_tile_config cfg = {0};
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16; /* C0, C1 int32; A: 16 rows x 32 bytes */
    cfg.colsb[0] = cfg.colsb[1] = 64;
    cfg.colsb[2] = 32;
    cfg.rows[3] = cfg.rows[4] = 8; /* B0, B1: 8 rows x 16 lanes x 4 bytes */
    cfg.colsb[3] = cfg.colsb[4] = 64;
    _tile_loadconfig(&cfg);
    const int nb = K / 32, CB = code_bytes(bits), GB = group_bytes(bits);
    const size_t tstride = (size_t)nb * GB;
    uint8_t bbuf[2][512] __attribute__((aligned(64)));
    int32_t ibuf[2][256] __attribute__((aligned(64)));
    __m512 fbuf[16][2];
    for (int t = t0; t < t1; t += 2) {
        const int nt = t1 - t >= 2 ? 2 : 1;
        for (int r = 0; r < R; r += 16) {
            const int mr = R - r < 16 ? R - r : 16;
            for (int i = 0; i < mr; i++) fbuf[i][0] = fbuf[i][1] = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const uint8_t *g = w + (size_t)t * tstride + (size_t)b * GB;
                _tile_loadd(2, qa + (size_t)r * K + b * 32, K);
                _tile_zero(0);
                _tile_loadd(3, b_tile(g, bits, bbuf[0]), 64);
                _tile_dpbsud(0, 2, 3);
                _tile_stored(0, ibuf[0], 64);
                if (nt == 2) { /* tile numbers are immediates: the second pair spelled out */
                    _tile_zero(1);
                    _tile_loadd(4, b_tile(g + tstride, bits, bbuf[1]), 64);
                    _tile_dpbsud(1, 2, 4);
                    _tile_stored(1, ibuf[1], 64);
                }
                for (int j = 0; j < nt; j++) { /* as micro() scales a group, op for op */
                    const uint8_t *s = g + j * tstride + CB;
                    __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
                    __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32)));
                    for (int i = 0; i < mr; i++) {
                        size_t at = (size_t)(r + i) * nb + b;
                        __m512 sc = _mm512_mul_ps(dv, _mm512_set1_ps(ad[at]));
                        __m512i dot = _mm512_load_si512(ibuf[j] + 16 * i);
                        __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, fbuf[i][j]);
                        fbuf[i][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(as[at]), f);
                    }
                }
            }
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nt; j++)
                    store_tile(y, r + i, N, (t + j) * 16, fbuf[i][j], acc);
        }
    }
    _tile_release();
}
#else
#define QG_AMX 0
#endif
