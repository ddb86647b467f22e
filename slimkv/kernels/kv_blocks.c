/* int8 KV blocks in and out of the paged pool on the CPU, bit for bit the codecs'.
 *
 * quantize_blocks: whole blocks x [n, bs, H, D] (float32 / bf16 / float16, token t of block i
 * at x + i * x_stride + t * t_stride elements, its heads contiguous) quantized as Int8Codec
 * (one float16 scale per token-head, SCALE_TOKEN) or ChannelBlockCodec (one per
 * block-head-channel over the block's bs tokens, SCALE_BLOCK) of slimkv/kv/quant.py,
 * block_scales.py, and stored into pool block block_ids[i]: codes data [nb, bs, H, D] int8,
 * scales [nb, bs, H, 1] or [nb, H, D].
 * The codec's arithmetic, in the same order: absmax in float32, / 127 (a correctly rounded
 * float32 division), clamped to float16's smallest normal, rounded to the stored float16;
 * codes x / (float)scale rounded half to even (rintf: the default rounding mode), clamped to
 * +-127. Finite inputs (a NaN's code is unspecified).
 *
 * dequantize_blocks: the blocks block_ids[0 .. n) of such a pool decoded as the codec's
 * dequantize, (float)code * (float)scale in float32, then rounded to out_kind (float32 /
 * bf16 round-to-nearest-even / float16), into out [n * bs, H, D] (a prefix's keys or values
 * in the model dtype, as PagedKVCache.read_prefix gives them).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_int8.h"

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2 };
#define TINY 6.103515625e-05f /* float16's smallest normal, 2**-14 */

/* n values of x from element i on, as float32, into y (one loop per kind: vectorised). */
static inline void load(const void *x, int64_t i, int kind, int n, float *restrict y) {
    if (kind == KIND_BF16) {
        const uint16_t *b = (const uint16_t *)x + i;
        for (int d = 0; d < n; d++) {
            uint32_t u = (uint32_t)b[d] << 16;
            memcpy(y + d, &u, 4);
        }
    } else if (kind == KIND_F16) {
        const _Float16 *h = (const _Float16 *)x + i;
        for (int d = 0; d < n; d++) y[d] = (float)h[d];
    } else {
        memcpy(y, (const float *)x + i, (size_t)n * sizeof(float));
    }
}

/* max(m, |v|) for finite values (a compare that vectorises, unlike fmaxf's NaN rules). */
static inline float absmax(float m, float v) {
    v = fabsf(v);
    return v > m ? v : m;
}

/* The stored float16 scale of absmax a (clamp, then round to float16). */
static inline _Float16 stored_scale(float a) {
    float s = a / 127.0f;
    return (_Float16)(s < TINY ? TINY : s);
}

static inline int8_t code(float x, float s) {
    float y = rintf(x / s);
    return (int8_t)(y > 127.0f ? 127.0f : y < -127.0f ? -127.0f : y);
}

void quantize_blocks(const void *x, int64_t x_stride, int64_t t_stride, int in_kind, int n,
                     int bs, int H, int D,
                     const int64_t *block_ids, int8_t *data, _Float16 *scale, int mode) {
    int64_t row = (int64_t)H * D, block = bs * row;
#pragma omp parallel for collapse(2) schedule(static)
    for (int i = 0; i < n; i++)
        for (int h = 0; h < H; h++) {
            const int64_t src = i * x_stride + h * D, dst = block_ids[i] * block + h * D;
            float xs[bs * D]; /* this head's bs x D values, as float32 */
            for (int t = 0; t < bs; t++) load(x, src + t * t_stride, in_kind, D, xs + t * D);
            if (mode == SCALE_BLOCK) {
                float amax[D], s[D];
                for (int d = 0; d < D; d++) amax[d] = 0.0f;
                for (int t = 0; t < bs; t++)
                    for (int d = 0; d < D; d++) amax[d] = absmax(amax[d], xs[t * D + d]);
                _Float16 *sc = scale + (block_ids[i] * H + h) * D;
                for (int d = 0; d < D; d++) s[d] = (float)(sc[d] = stored_scale(amax[d]));
                for (int t = 0; t < bs; t++) {
                    int8_t *restrict o = data + dst + t * row;
                    for (int d = 0; d < D; d++) o[d] = code(xs[t * D + d], s[d]);
                }
            } else {
                for (int t = 0; t < bs; t++) {
                    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
                    for (int d = 0; d < D; d++) amax = absmax(amax, xs[t * D + d]);
                    _Float16 stored = stored_scale(amax);
                    scale[(block_ids[i] * bs + t) * H + h] = stored;
                    float s = (float)stored;
                    for (int d = 0; d < D; d++) data[dst + t * row + d] = code(xs[t * D + d], s);
                }
            }
        }
}

void dequantize_blocks(const int8_t *data, const _Float16 *scale, int mode,
                       const int64_t *block_ids, int n, int bs, int H, int D, void *out,
                       int out_kind) {
    int64_t row = (int64_t)H * D, block = bs * row;
#pragma omp parallel for collapse(2) schedule(static)
    for (int i = 0; i < n; i++)
        for (int h = 0; h < H; h++) {
            const Int8Pool pool = {data, scale, block_ids, mode, bs};
            float y[D]; /* one row decoded */
            for (int t = 0; t < bs; t++) {
                const int64_t o = i * block + t * row + h * D;
                int8_decode(&pool, block_ids[i], t, H, D, h, y);
                if (out_kind == KIND_BF16) {
                    uint16_t *restrict dst = (uint16_t *)out + o;
                    for (int d = 0; d < D; d++) dst[d] = to_bf16(y[d]);
                } else if (out_kind == KIND_F16) {
                    _Float16 *restrict dst = (_Float16 *)out + o;
                    for (int d = 0; d < D; d++) dst[d] = (_Float16)y[d];
                } else {
                    memcpy((float *)out + o, y, (size_t)D * sizeof(float));
                }
            }
        }
}
