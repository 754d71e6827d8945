/* A decode step of a Llama-family model's decoder layers in one call (CPU, bf16, AMX).
 *
 * Why: on a small model a decode step's kernels are short (7M model, 32 rows: ~40
 * kernel calls of 10-60 us each), and calling each from Python (module dispatch, views,
 * output allocation, ctypes argument conversion) cost about a third of the step. Here
 * the whole stack of layers runs from C, calling the same kernels in the same order with
 * the same thread count, so the result is bit-identical to the layer-by-layer path:
 *
 *   per layer:  h, residual = RMSNorm(x + residual)          (first layer: residual = x)
 *               qkv = h . Wqkv^T (+ bias, Qwen2);  RMSNorm of each q and k head (Qwen3);
 *               rotary(q, k)
 *               attn = decode attention over the paged cache (writes k, v into it)
 *               h, residual = RMSNorm(attn . Wo^T + residual)
 *               x = silu(h . Wgate^T) * (h . Wup^T) . Wdown^T
 *
 * and the caller applies the final norm to (x, residual). With tensor parallelism each
 * layer is two calls (aserve_llama_decode_half), the caller all-reducing o_proj's and
 * down_proj's outputs between them. Only for what the layer-by-layer path would run on
 * the same kernels: bf16 weights packed for AMX, no biases but on q/k/v, decode rows
 * only (aserve/kernels/llama_decode.py and LlamaModel.attach_decode_stack check).
 *
 * The kernels are compiled into this library from their own files (built by
 * aserve/kernels/cbuild.py, whose cache key covers them).
 */
#include "cpu_amx_linear.c"
#include "cpu_fused_ops.c"
#include "cpu_decode_attention.c"

/* One layer: its weights and its KV cache (built once, kept by the caller). */
typedef struct {
    const uint16_t *input_norm, *post_norm;            /* [H] */
    const uint16_t *w_qkv, *w_o, *w_gate_up, *w_down;  /* AMX-packed */
    const uint16_t *qkv_bias;                          /* [(Hq + 2 Hk) D], or NULL */
    const uint16_t *q_norm, *k_norm;                   /* [D] per-head norm weights, or NULL */
    void *k_cache, *v_cache;                           /* [blocks, block_size, Hk, D] halves */
} LayerWeights;

/* Sizes shared by every layer; widths are the AMX outputs' (multiples of 32). */
typedef struct {
    int64_t hidden, Hq, Hk, D, inter;
    int64_t qkv_width, o_width, gate_up_width, down_width;
    int64_t block_size, kv_stride_block, kv_stride_token, kv_stride_head;
    float eps, scale;
    float qk_eps; /* the per-head norms' */
} Dims;

/* One step's inputs and scratch (bf16, rows `B`, row-contiguous). */
typedef struct {
    const uint16_t *x_in;      /* [B, hidden]: the embeddings */
    uint16_t *x;               /* [B, down_width]: each layer's output, the result */
    uint16_t *residual;        /* [B, hidden]: the running residual, the result */
    uint16_t *h;               /* [B, hidden] */
    uint16_t *qkv;             /* [B, qkv_width] */
    uint16_t *attn;            /* [B, Hq * D] */
    uint16_t *o;               /* [B, o_width] */
    uint16_t *gate_up;         /* [B, gate_up_width] */
    uint16_t *act;             /* [B, inter] */
    const uint16_t *cos, *sin; /* [B, D / 2] */
    const int64_t *block_table; /* [B, max_blocks] */
    const int64_t *seq_lens;    /* [B], the new token included */
    int64_t B, max_blocks;
    int num_threads;
} Step;

/* y[r][i] += b[i] for r < rows, i < n, rounded to bf16 as torch's bf16 add_ is (in float,
 * to nearest even). */
static void add_bias_bf16(uint16_t *y, int64_t y_stride, const uint16_t *b, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *row = y + r * y_stride;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(row + i),
                                to_bf16x16(_mm512_add_ps(load16(row + i, 1), load16(b + i, 1))));
#endif
        for (; i < n; i++) row[i] = float_to_bf16(bf16_to_float(row[i]) + bf16_to_float(b[i]));
    }
}

/* The attention half of layer i: x (or, for layer 0, x_in) and the residual -> o, the
 * o_proj output (this rank's partial sum when the layer is split between ranks). */
static int attention_half(const LayerWeights *layers, int64_t i, const Dims *d, const Step *s) {
    const LayerWeights *w = &layers[i];
    const int64_t B = s->B, H = d->hidden, nt = s->num_threads, q_size = d->Hq * d->D;
    int rc;
    if (i == 0) {
        memcpy(s->residual, s->x_in, (size_t)(B * H) * 2);
        rc = aserve_rms_norm(s->x_in, H, NULL, 0, NULL, w->input_norm, s->h, B, H, d->eps, 1, nt);
    } else {
        rc = aserve_rms_norm(s->x, d->down_width, s->residual, H, s->residual, w->input_norm, s->h, B, H, d->eps, 1,
                             nt);
    }
    if (rc) return rc;
    if ((rc = aserve_amx_linear(s->h, H, w->w_qkv, s->qkv, d->qkv_width, B, d->qkv_width, H, nt))) return rc;
    if (w->qkv_bias) add_bias_bf16(s->qkv, d->qkv_width, w->qkv_bias, B, q_size + 2 * d->Hk * d->D);
    if (w->q_norm) { /* in place, a token's heads as rows D apart: the kernel's per-row arithmetic */
        for (int64_t t = 0; t < B; t++) {
            uint16_t *row = s->qkv + t * d->qkv_width;
            if ((rc = aserve_rms_norm(row, d->D, NULL, 0, NULL, w->q_norm, row, d->Hq, d->D, d->qk_eps, 1, 1)))
                return rc;
            if ((rc = aserve_rms_norm(row + q_size, d->D, NULL, 0, NULL, w->k_norm, row + q_size, d->Hk, d->D,
                                      d->qk_eps, 1, 1)))
                return rc;
        }
    }
    aserve_rotary(s->qkv, d->qkv_width, d->D, B, d->Hq + d->Hk, d->D, s->cos, s->sin, 1, nt);
    const uint16_t *k_new = s->qkv + q_size, *v_new = s->qkv + q_size + d->Hk * d->D;
    rc = aserve_decode_attention(s->qkv, w->k_cache, w->v_cache, k_new, v_new, d->qkv_width, d->D, d->qkv_width, d->D,
                                 s->attn, s->block_table, s->seq_lens, B, d->Hq, d->Hk, d->D, d->block_size,
                                 s->max_blocks, d->qkv_width, d->D, q_size, d->D, d->kv_stride_block,
                                 d->kv_stride_token, d->kv_stride_head, d->scale, 1, 1, nt);
    if (rc) return rc;
    return aserve_amx_linear(s->attn, q_size, w->w_o, s->o, d->o_width, B, d->o_width, q_size, nt);
}

/* The MLP half of layer i: o and the residual -> x, the down_proj output (a partial sum
 * when split between ranks). */
static int mlp_half(const LayerWeights *layers, int64_t i, const Dims *d, const Step *s) {
    const LayerWeights *w = &layers[i];
    const int64_t B = s->B, H = d->hidden, nt = s->num_threads;
    int rc = aserve_rms_norm(s->o, d->o_width, s->residual, H, s->residual, w->post_norm, s->h, B, H, d->eps, 1, nt);
    if (rc) return rc;
    rc = aserve_amx_linear(s->h, H, w->w_gate_up, s->gate_up, d->gate_up_width, B, d->gate_up_width, H, nt);
    if (rc) return rc;
    aserve_silu_mul(s->gate_up, d->gate_up_width, s->act, B, d->inter, 1, nt);
    return aserve_amx_linear(s->act, d->inter, w->w_down, s->x, d->down_width, B, d->down_width, d->inter, nt);
}

/* Runs layers [0, n_layers) on one rank. Returns 0, or the failing kernel's -1 (a shape
 * it does not take: the caller checked them, so this does not happen in use). */
int aserve_llama_decode(const LayerWeights *layers, int64_t n_layers, const Dims *d, const Step *s) {
    for (int64_t i = 0; i < n_layers; i++) {
        int rc = attention_half(layers, i, d, s);
        if (rc || (rc = mlp_half(layers, i, d, s))) return rc;
    }
    return 0;
}

/* One half of layer i (half 0: attention, 1: MLP), for a layer split between
 * tensor-parallel ranks: the caller sums o (after half 0) and x (after half 1) over the
 * ranks in between, where the layer-by-layer path all-reduces o_proj's and down_proj's
 * outputs. */
int aserve_llama_decode_half(const LayerWeights *layers, int64_t i, int half, const Dims *d, const Step *s) {
    return half == 0 ? attention_half(layers, i, d, s) : mlp_half(layers, i, d, s);
}
