/* The decoder-layer stack of a decode step, shared by the bf16 (AMX) and float32 (AVX2)
 * variants: cpu_llama_decode.c and cpu_llama_decode_f32.c, which say why and how.
 * Each variant defines its element type and linear layer, then includes this file. */
/* One layer: its weights and its KV cache (built once, kept by the caller). */
typedef struct {
    const ELEM *input_norm, *post_norm;            /* [H] */
    const ELEM *w_qkv, *w_o, *w_gate_up, *w_down;  /* in the variant's layout (see its file) */
    const ELEM *qkv_bias;                          /* [(Hq + 2 Hk) D], or NULL */
    const ELEM *q_norm, *k_norm;                   /* [D] per-head norm weights, or NULL */
    void *k_cache, *v_cache;                       /* [blocks, block_size, Hk, D] halves (Dims' strides) */
} LayerWeights;

/* Sizes shared by every layer; widths are the linear outputs' row lengths (for AMX,
 * multiples of 32). */
typedef struct {
    int64_t hidden, Hq, Hk, D, inter;
    int64_t qkv_width, o_width, gate_up_width, down_width;
    int64_t block_size, kv_stride_block, kv_stride_token, kv_stride_head;
    int64_t kv_bf16; /* the cache's dtype: bf16 (1) or float32 (0) */
    float eps, scale;
    float qk_eps; /* the per-head norms' */
} Dims;

/* One step's inputs and scratch (ELEM, rows `B`, row-contiguous). */
typedef struct {
    const ELEM *x_in;      /* [B, hidden]: the embeddings */
    ELEM *x;               /* [B, down_width]: each layer's output, the result */
    ELEM *residual;        /* [B, hidden]: the running residual, the result */
    ELEM *h;               /* [B, hidden] */
    ELEM *qkv;             /* [B, qkv_width] */
    ELEM *attn;            /* [B, Hq * D] */
    ELEM *o;               /* [B, o_width] */
    ELEM *gate_up;         /* [B, gate_up_width] */
    ELEM *act;             /* [B, inter] */
    const ELEM *cos, *sin; /* [B, D / 2] */
    const int64_t *block_table; /* [B, max_blocks] */
    const int64_t *seq_lens;    /* [B], the new token included */
    int64_t B, max_blocks;
    int64_t prefix_blocks; /* leading blocks of block_table shared by every row (decode attention's prefix) */
    /* Per layer (or NULL): where decode attention keeps the prefix's layouts between
       steps, and their states (cpu_decode_attention.c's Args.prefix_layout). */
    void *const *prefix_layouts;
    int32_t *const *prefix_states;
    int num_threads;
} Step;

/* The product a linear layer's caller runs right after it (nothing but a norm or the
 * gated activation between them), so the variant's kernel can fetch that product's first
 * weights while it finishes this one (or ignore it): its weights, output width n (for the
 * gated form, inter) and summed width k, and whether it is the gated form (linear_silu). */
typedef struct {
    const ELEM *w;
    int64_t n, k;
    int silu;
} NextProduct;

/* The variant's file defines ELEM and IS_BF16 (the element type, and the kernels' dtype
 * flag) before including this one, and these two after it, each returning 0 or -1 (`then`,
 * the product after this one, may be NULL):
 *   linear:      y = x W^T, [rows, n] with rows ldy apart;
 *   linear_bias: the same plus a bias on the first n_bias outputs, rounded as the
 *                layer-by-layer path rounds it. */
static int linear(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, ELEM *y, int64_t ldy, int64_t rows,
                  int64_t n, int64_t k, int nt, const NextProduct *then);
static int linear_bias(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, const ELEM *b, int64_t n_bias,
                       ELEM *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int nt, const NextProduct *then);
/* A variant whose kernel has the gated product in one call (the bits of `linear` followed
 * by aserve_silu_mul) defines HAS_LINEAR_SILU before including this file, and after it
 *   linear_silu: act[rows, inter] (rows `inter` apart) = silu(x Wg^T) * (x Wu^T), W the
 *                [gate; up] weight with inter a multiple of 32. */
#ifdef HAS_LINEAR_SILU
static int linear_silu(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, ELEM *act, int64_t rows,
                       int64_t inter, int64_t k, int nt, const NextProduct *then);
#endif

/* Whether mlp_half runs the gated product in one call (linear_silu). */
static int mlp_fused(const Dims *d) {
#ifdef HAS_LINEAR_SILU
    return d->inter % 32 == 0 && d->gate_up_width == 2 * d->inter; /* each half whole pairs, unpadded */
#else
    (void)d;
    return 0;
#endif
}

/* Layer i's first product of its MLP half (what its o_proj is followed by). */
static NextProduct mlp_first(const LayerWeights *w, const Dims *d) {
    const int fused = mlp_fused(d);
    const NextProduct p = {w->w_gate_up, fused ? d->inter : d->gate_up_width, d->hidden, fused};
    return p;
}

/* The attention half of layer i: x (or, for layer 0, x_in) and the residual -> o, the
 * o_proj output (this rank's partial sum when the layer is split between ranks). */
static int attention_half(const LayerWeights *layers, int64_t i, const Dims *d, const Step *s) {
    const LayerWeights *w = &layers[i];
    const int64_t B = s->B, H = d->hidden, nt = s->num_threads, q_size = d->Hq * d->D;
    int rc;
    if (i == 0) {
        memcpy(s->residual, s->x_in, (size_t)(B * H) * sizeof(ELEM));
        rc = aserve_rms_norm(s->x_in, H, NULL, 0, NULL, w->input_norm, s->h, B, H, d->eps, IS_BF16, nt);
    } else {
        rc = aserve_rms_norm(s->x, d->down_width, s->residual, H, s->residual, w->input_norm, s->h, B, H, d->eps,
                             IS_BF16, nt);
    }
    if (rc) return rc;
    /* Decode attention comes next, and its reads of the cache would push a prefetched
       o_proj out of the caches before it ran: no `then`. */
    rc = w->qkv_bias ? linear_bias(d, s->h, H, w->w_qkv, w->qkv_bias, q_size + 2 * d->Hk * d->D, s->qkv,
                                   d->qkv_width, B, d->qkv_width, H, nt, NULL)
                     : linear(d, s->h, H, w->w_qkv, s->qkv, d->qkv_width, B, d->qkv_width, H, nt, NULL);
    if (rc) return rc;
    if (w->q_norm) { /* in place, a token's heads as rows D apart: the kernel's per-row arithmetic */
        for (int64_t t = 0; t < B; t++) {
            ELEM *row = s->qkv + t * d->qkv_width;
            if ((rc = aserve_rms_norm(row, d->D, NULL, 0, NULL, w->q_norm, row, d->Hq, d->D, d->qk_eps, IS_BF16, 1)))
                return rc;
            if ((rc = aserve_rms_norm(row + q_size, d->D, NULL, 0, NULL, w->k_norm, row + q_size, d->Hk, d->D,
                                      d->qk_eps, IS_BF16, 1)))
                return rc;
        }
    }
    aserve_rotary(s->qkv, d->qkv_width, d->D, B, d->Hq + d->Hk, d->D, s->cos, s->sin, IS_BF16, nt);
    const ELEM *k_new = s->qkv + q_size, *v_new = s->qkv + q_size + d->Hk * d->D;
    rc = aserve_decode_attention(s->qkv, w->k_cache, w->v_cache, k_new, v_new, d->qkv_width, d->D, d->qkv_width, d->D,
                                 s->attn, s->block_table, s->seq_lens, B, d->Hq, d->Hk, d->D, d->block_size,
                                 s->max_blocks, s->prefix_blocks, s->prefix_layouts ? s->prefix_layouts[i] : NULL,
                                 s->prefix_states ? s->prefix_states[i] : NULL, d->qkv_width, d->D, q_size, d->D,
                                 d->kv_stride_block,
                                 d->kv_stride_token, d->kv_stride_head, d->scale, IS_BF16, (int)d->kv_bf16, nt);
    if (rc) return rc;
    const NextProduct mlp = mlp_first(w, d);
    return linear(d, s->attn, q_size, w->w_o, s->o, d->o_width, B, d->o_width, q_size, nt, &mlp);
}

/* The MLP half of layer i: o and the residual -> x, the down_proj output (a partial sum
 * when split between ranks). `after`: the layer whose qkv_proj runs next (or NULL), whose
 * first weights down_proj prefetches as it finishes. */
static int mlp_half(const LayerWeights *layers, int64_t i, const Dims *d, const Step *s, const LayerWeights *after) {
    const LayerWeights *w = &layers[i];
    const int64_t B = s->B, H = d->hidden, nt = s->num_threads;
    int rc = aserve_rms_norm(s->o, d->o_width, s->residual, H, s->residual, w->post_norm, s->h, B, H, d->eps, IS_BF16,
                             nt);
    if (rc) return rc;
    const NextProduct down = {w->w_down, d->down_width, d->inter, 0};
    const int fused = mlp_fused(d);
#ifdef HAS_LINEAR_SILU
    if (fused) rc = linear_silu(d, s->h, H, w->w_gate_up, s->act, B, d->inter, H, nt, &down);
#endif
    if (!fused) {
        rc = linear(d, s->h, H, w->w_gate_up, s->gate_up, d->gate_up_width, B, d->gate_up_width, H, nt, &down);
        if (rc == 0) aserve_silu_mul(s->gate_up, d->gate_up_width, s->act, B, d->inter, IS_BF16, nt);
    }
    if (rc) return rc;
    const NextProduct qkv = {after ? after->w_qkv : NULL, d->qkv_width, H, 0};
    return linear(d, s->act, d->inter, w->w_down, s->x, d->down_width, B, d->down_width, d->inter, nt,
                  after ? &qkv : NULL);
}

/* Runs layers [0, n_layers) on one rank. Returns 0, or the failing kernel's -1 (a shape
 * it does not take: the caller checked them, so this does not happen in use). */
int aserve_llama_decode(const LayerWeights *layers, int64_t n_layers, const Dims *d, const Step *s) {
    for (int64_t i = 0; i < n_layers; i++) {
        int rc = attention_half(layers, i, d, s);
        if (rc || (rc = mlp_half(layers, i, d, s, i + 1 < n_layers ? &layers[i + 1] : NULL))) return rc;
    }
    return 0;
}

/* One half of layer i of n_layers (half 0: attention, 1: MLP), for a layer split between
 * tensor-parallel ranks: the caller sums o (after half 0) and x (after half 1) over the
 * ranks in between, where the layer-by-layer path all-reduces o_proj's and down_proj's
 * outputs. */
int aserve_llama_decode_half(const LayerWeights *layers, int64_t n_layers, int64_t i, int half, const Dims *d,
                             const Step *s) {
    if (half == 0) return attention_half(layers, i, d, s);
    /* The ranks' sum of x comes between down_proj and the next layer's qkv_proj, but it
       moves only rows x hidden values through shared memory: the next weights that
       down_proj prefetches into L2 are still there after it. */
    return mlp_half(layers, i, d, s, i + 1 < n_layers ? &layers[i + 1] : NULL);
}
