/* Every layer of a decode step in one call: the lean layer of slimkv/model/lean.py and the
 * lean decode attention of slimkv/attention.py (`_lean_decode`), op for op, without a
 * return to Python in between.
 *
 * The kernels are the package's own, reached through function pointers that Python takes
 * from their libraries (qgemm.c: qgemm, rope_inplace, qdequant; kv_stage.c: stage_decode,
 * round_rows; paged_decode.c: paged_decode), so this file computes nothing itself and a
 * change inside one of them flows in. The residual x [T, hidden] float32 starts as the
 * tokens' rows of a quantized embedding table (dequantized a 16-row tile at a time), or as
 * the caller's x; then per layer:
 *   qkv  = qgemm(RMSNorm(x)) (+ bias); RoPE on the q and k heads of each row
 *   stage K/V into the staging slots, Q rounded to the model dtype; paged decode attention;
 *   its output rounded to the model dtype (the attention returns that dtype)
 *   x   += qgemm(out) (+ bias)
 *   gu   = qgemm(RMSNorm(x)) (+ bias);  x += qgemm(SiLU(gate) * up) (+ bias)
 * With a staged cache, blocks that a token fills go into the pool afterwards, in Python
 * (the kernel reads each sequence's own block from its staging slot, never from the pool);
 * an unstaged pool in the model dtype takes the new K/V from the stage kernel directly.
 *
 * kv_cache.int4's rotations (issue 46; slimkv/attention/layer.py's PagedAttention.rotate)
 * are the one computation of this file, hadamard_rows, which the per-op path calls too
 * (slimkv/backends/cpu.py), so the two stay bit-identical: with rotate_k the q and k heads
 * after RoPE; with rotate_v the v heads before staging and the attention's output after
 * its rounding (rounded again: the per-op path returns the model dtype).
 */
#include <stdint.h>
#include <string.h>

typedef void (*qgemm_fn)(const float *x, int M, int K, int x_stride, int mode,
                         const float *norm_w, float eps, const void *w, int bits, int N,
                         float *y, int accumulate);
typedef void (*rope_fn)(float *x, int T, int stride, int heads, int D, const float *cos,
                        const float *sin);
typedef void (*stage_fn)(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                         const float *v, int64_t v_stride, int T, int Hq, int H, int D,
                         int q_kind, float *q_out, void *stage_k, void *stage_v,
                         int stage_kind, int bs, const int64_t *slots, const int64_t *offsets);
typedef void (*decode_fn)(const float *q, float *out, int B, int Hq, int H, int D, int bs,
                          const int64_t *block_tables, int max_blocks, const int64_t *seq_lens,
                          const void *k, const void *v, const void *own_k, const void *own_v,
                          int own_kind, const int64_t *own_slots, float sm_scale);
typedef void (*round_fn)(float *x, int64_t n, int kind);
typedef void (*dequant_fn)(const void *w, int bits, int N, int K, void *out, int out_bf16);

/* One quantized projection: packed weight, bits, output rows, kernel mode, optional bias. */
typedef struct {
    const void *w;
    const float *bias;
    int32_t bits, n, mode;
} linear;

typedef struct {
    linear qkv, o, gate_up, down;
    const float *attn_norm, *ffn_norm;
    float attn_eps, ffn_eps;
    void *stage_k, *stage_v;     /* where the new K, V go: the layer's staging [slots, bs,
                                  * H, D] (own_slots: the attention reads its own block from
                                  * there), or the pool itself (slots: block ids) */
    const void *k_side, *v_side; /* paged_decode's kv_side of the layer's pool */
    int32_t rotate;              /* ROTATE_K | ROTATE_V (kv_cache.int4) */
    float rotate_scale;          /* 1 / sqrt(head_dim) */
} layer;

enum { ROTATE_K = 1, ROTATE_V = 2 };

/* Rows t < T of x (row stride `stride` floats), heads h < heads of D floats each (D a power
 * of two): each head vector times the orthonormal Sylvester Hadamard matrix, in place. The
 * butterflies of the fast Walsh-Hadamard transform (pairs j, j + len for len = 1, 2, ...),
 * then the scale: the same sums, in the same order, wherever it is called. */
void hadamard_rows(float *x, int T, int64_t stride, int heads, int D, float scale) {
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            float *v = x + t * stride + (int64_t)h * D;
            for (int len = 1; len < D; len <<= 1)
                for (int i = 0; i < D; i += len << 1)
                    for (int j = i; j < i + len; j++) {
                        float a = v[j], b = v[j + len];
                        v[j] = a + b;
                        v[j + len] = a - b;
                    }
            for (int d = 0; d < D; d++) v[d] *= scale;
        }
}

typedef struct {
    qgemm_fn qgemm;
    rope_fn rope;
    stage_fn stage;
    decode_fn decode;
    round_fn round_to;
    dequant_fn dequant;
    const uint8_t *embed;        /* packed embedding table, or NULL: x is given */
    int64_t embed_tile_bytes;
    int32_t embed_bits, T, hidden, hq, hkv, head_dim, dtype_kind, stage_kind, block_size,
        max_blocks;
    float scale;
    const float *cos, *sin;      /* RoPE tables [positions, head_dim] */
    const int64_t *positions, *slots, *offsets, *own_slots, *block_tables, *seq_lens;
    const int64_t *ids;          /* the tokens (with embed) */
    float *qkv, *q, *attn, *gate_up; /* buffers [T, qkv n], [T, hq * D] x 2, [T, gate_up n] */
    float *tile;                 /* [16, hidden] (with embed) */
} step;

static void add_bias(float *y, int T, const linear *l) {
    if (l->bias)
        for (int r = 0; r < T; r++)
            for (int n = 0; n < l->n; n++) y[(int64_t)r * l->n + n] += l->bias[n];
}

static void run_layer(const step *s, const layer *l, float *x) {
    int T = s->T, D = s->head_dim, H = s->hidden, width = s->hq * D, qkv_n = l->qkv.n;
    s->qgemm(x, T, H, H, l->qkv.mode, l->attn_norm, l->attn_eps, l->qkv.w, l->qkv.bits, qkv_n,
             s->qkv, 0);
    add_bias(s->qkv, T, &l->qkv);
    for (int t = 0; t < T; t++) {
        const int64_t at = s->positions[t] * D;
        s->rope(s->qkv + (int64_t)t * qkv_n, 1, qkv_n, s->hq + s->hkv, D, s->cos + at,
                s->sin + at);
    }
    float *k = s->qkv + width, *v = k + s->hkv * D;
    if (l->rotate & ROTATE_K) hadamard_rows(s->qkv, T, qkv_n, s->hq + s->hkv, D, l->rotate_scale);
    if (l->rotate & ROTATE_V) hadamard_rows(v, T, qkv_n, s->hkv, D, l->rotate_scale);
    s->stage(s->qkv, qkv_n, k, qkv_n, v, qkv_n, T, s->hq, s->hkv, D, s->dtype_kind, s->q,
             l->stage_k, l->stage_v, s->stage_kind, s->block_size, s->slots, s->offsets);
    int own = s->own_slots != 0;
    s->decode(s->q, s->attn, T, s->hq, s->hkv, D, s->block_size, s->block_tables, s->max_blocks,
              s->seq_lens, l->k_side, l->v_side, own ? l->stage_k : 0, own ? l->stage_v : 0,
              s->stage_kind, s->own_slots, s->scale);
    s->round_to(s->attn, (int64_t)T * width, s->dtype_kind);
    if (l->rotate & ROTATE_V) {
        hadamard_rows(s->attn, T, width, s->hq, D, l->rotate_scale);
        s->round_to(s->attn, (int64_t)T * width, s->dtype_kind);
    }
    s->qgemm(s->attn, T, width, width, l->o.mode, 0, 0.0f, l->o.w, l->o.bits, H, x, 1);
    add_bias(x, T, &l->o);
    s->qgemm(x, T, H, H, l->gate_up.mode, l->ffn_norm, l->ffn_eps, l->gate_up.w,
             l->gate_up.bits, l->gate_up.n, s->gate_up, 0);
    add_bias(s->gate_up, T, &l->gate_up);
    s->qgemm(s->gate_up, T, l->gate_up.n / 2, l->gate_up.n, l->down.mode, 0, 0.0f, l->down.w,
             l->down.bits, H, x, 1);
    add_bias(x, T, &l->down);
}

/* x [T, hidden] float32: the tokens' embeddings (with s->embed) or given, then updated in
 * place by layers[0 .. num_layers). */
void decode_step(const step *s, const layer *layers, int num_layers, float *x) {
    for (int t = 0; s->embed && t < s->T; t++) {
        s->dequant(s->embed + s->ids[t] / 16 * s->embed_tile_bytes, s->embed_bits, 16,
                   s->hidden, s->tile, 0);
        memcpy(x + (int64_t)t * s->hidden, s->tile + s->ids[t] % 16 * s->hidden,
               sizeof(float) * s->hidden);
    }
    for (int i = 0; i < num_layers; i++) run_layer(s, layers + i, x);
}
