/* A decode step's new tokens into the staging slots, in one pass per layer.
 *
 * For each of the step's T single-token queries: K and V (float32 rows of H heads) are
 * rounded to the staging buffer's dtype and stored at their slot and in-block offset
 * (staging [slots, block_size, H, D], see slimkv/kv/staging.py), and Q (Hq heads) is
 * rounded to the model dtype and written, back in float32, into a contiguous [T, Hq, D]
 * buffer for the attention kernel. Rounding is round-to-nearest-even, as torch's .to().
 * This replaces ~10 ATen ops (gathers, dtype copies, index_put) per layer.
 */
#include <stdint.h>
#include <string.h>

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2 };

static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float rounded(float x, int kind) {
    if (kind == KIND_BF16) {
        uint32_t u = (uint32_t)to_bf16(x) << 16;
        memcpy(&x, &u, 4);
    } else if (kind == KIND_F16) {
        x = (float)(_Float16)x;
    }
    return x;
}

static inline void store(void *dst, int64_t i, const float *src, int n, int kind) {
    if (kind == KIND_BF16) {
        uint16_t *o = (uint16_t *)dst + i;
        for (int d = 0; d < n; d++) o[d] = to_bf16(src[d]);
    } else if (kind == KIND_F16) {
        _Float16 *o = (_Float16 *)dst + i;
        for (int d = 0; d < n; d++) o[d] = (_Float16)src[d];
    } else {
        memcpy((float *)dst + i, src, (size_t)n * sizeof(float));
    }
}

/* q, k, v: row t at q + t * q_stride (heads contiguous, D floats each); q_out [T, Hq, D];
 * stage_k, stage_v: one layer's staging [slots, bs, H, D] of stage_kind; token t goes to
 * slot slots[t], offset offsets[t]. */
void stage_decode(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                  const float *v, int64_t v_stride, int T, int Hq, int H, int D, int q_kind,
                  float *q_out, void *stage_k, void *stage_v, int stage_kind, int bs,
                  const int64_t *slots, const int64_t *offsets) {
    for (int t = 0; t < T; t++) {
        const float *qt = q + t * q_stride;
        float *qo = q_out + (int64_t)t * Hq * D;
        for (int i = 0; i < Hq * D; i++) qo[i] = rounded(qt[i], q_kind);
        int64_t row = (slots[t] * bs + offsets[t]) * H * D;
        store(stage_k, row, k + t * k_stride, H * D, stage_kind);
        store(stage_v, row, v + t * v_stride, H * D, stage_kind);
    }
}

/* x[0 .. n) rounded in place to the model dtype (q_kind above), as float32: what
 * `.to(dtype)` then `.float()` does to the attention's output. */
void round_rows(float *x, int64_t n, int kind) {
    if (kind != KIND_F32)
        for (int64_t i = 0; i < n; i++) x[i] = rounded(x[i], kind);
}
