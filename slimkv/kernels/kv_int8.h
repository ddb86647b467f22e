/* An int8 pool block's keys or values decoded as the codecs decode them (Int8Codec: one
 * float16 scale per token-head; ChannelBlockCodec: one per block-head-channel) and rounded
 * to bf16: the one rule kv_blocks.c's dequantize_blocks and prefill_attention.c's staged
 * call (which packs the pool keys straight from the codes) share, so both give the same
 * bits. Pool layout: codes [blocks, bs, H, D] int8, scales [blocks, bs, H, 1] (SCALE_TOKEN)
 * or [blocks, H, D] (SCALE_BLOCK). */
#ifndef SLIMKV_KV_INT8_H
#define SLIMKV_KV_INT8_H
#include <stdint.h>
#include <string.h>

enum { SCALE_TOKEN = 1, SCALE_BLOCK = 2 };

static inline uint16_t to_bf16(float x) { /* round to nearest even, NaN as torch's */
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)r;
}

/* One layer's side of an int8 pool and the blocks a sequence reads in order. */
typedef struct {
    const int8_t *data;
    const _Float16 *scale;
    const int64_t *block_ids;
    int mode, bs;
} Int8Pool;

/* Token t of pool block b, head h (of H) as float32: code * scale, the codec's product. */
static inline void int8_decode(const Int8Pool *p, int64_t b, int t, int H, int D, int h,
                               float *restrict y) {
    const int8_t *c = p->data + ((b * p->bs + t) * H + h) * D;
    if (p->mode == SCALE_BLOCK) {
        const _Float16 *s = p->scale + (b * H + h) * D;
        for (int d = 0; d < D; d++) y[d] = (float)c[d] * (float)s[d];
    } else {
        float s = (float)p->scale[(b * p->bs + t) * H + h];
        for (int d = 0; d < D; d++) y[d] = (float)c[d] * s;
    }
}

/* The sequence's key j (block_ids[j / bs], token j % bs), head h, rounded to bf16 [D]. */
static inline void int8_key_bf16(const Int8Pool *p, int j, int H, int D, int h,
                                 uint16_t *restrict y) {
    float x[D];
    int i = j / p->bs;
    int8_decode(p, p->block_ids[i], j - i * p->bs, H, D, h, x);
    for (int d = 0; d < D; d++) y[d] = to_bf16(x[d]);
}
#endif
